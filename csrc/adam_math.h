// The per-element Adam/AdamW update: the only copy of the math.
//
// Both drivers (adam_cpu_loop.h, compiled once per instruction set, and adam_cuda.cu) call these
// functions and differ only in how they loop. Everything here computes in float ("opmath"), whatever
// the storage type of the gradient or of the low-precision parameter copy.
//
// [Note: matching torch.optim.AdamW]
// The operations and their order follow torch's single-tensor (for-loop) Adam/AdamW:
//   AdamW:  p *= 1 - lr*wd                      (param.mul_(1 - lr * weight_decay))
//   Adam:   g = fma(p, wd, g)                   (grad.add(param, alpha=weight_decay))
//   m = lerp(m, g, 1 - beta1)                   (exp_avg.lerp_(grad, 1 - beta1), ATen's two-branch fused lerp)
//   v = fma((1 - beta2)*g, g, v*beta2)          (exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2))
//   denom = sqrt(v)/bias_correction2_sqrt + eps
//   p = p + (-step_size*m)/denom                (param.addcdiv_(exp_avg, denom, value=-step_size))
// ATen's vectorized CPU kernels fuse three of these into one rounding (fused multiply-add): lerp,
// addcmul and add-with-alpha; we use fmaf in the same places, so on an FMA machine the results are
// bitwise those of torch.optim.AdamW(foreach=False). (Where the CPU has no FMA, fmaf is a library
// call: right, but slow; that is only the portable fallback.)
// Host scalars (bias corrections, step size, decay factor) are computed in double and then rounded
// once to float, exactly as torch turns its Python-float scalars into the tensor's opmath type.
//
// [Note: one math, many ISAs]
// The CPU driver compiles this header into several translation units, each under its own
// `#pragma GCC target`. The functions therefore have internal linkage (anonymous namespace): with
// external linkage the linker could keep the AVX-512 copy of an inline function and hand it to the
// portable path, which would then fault on a machine without AVX-512.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace zerofast {

// Host-computed, per-call constants of one Adam step, already rounded to float.
struct AdamScalars {
  float decay_factor;           // AdamW: 1 - lr*wd (1 when wd == 0 or Adam)
  float l2_weight_decay;        // Adam: wd added to the gradient as wd*p (0 for AdamW)
  float lerp_weight;            // 1 - beta1
  float beta2;                  // second-moment decay
  float one_minus_beta2;        // 1 - beta2
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;                    // added to the corrected sqrt(v)
  float neg_step_size;          // -lr / (1 - beta1^step)
  float grad_scale;             // every gradient value is multiplied by this first
  bool follow_copy;             // [Note: the master follows the copy]: param_copy is read first
};

// [Note: the master follows the copy]
// The low-precision parameters the model holds (param_copy) are the fp32 master's rounding after
// every step; a user may write them between steps (nn.init, load_state_dict, p.copy_(...)), and the
// master, which the next step starts from, would undo that. With follow_copy the copy is read first:
// an element whose copy differs from the master's rounding takes the copy's value (its fp32) as its
// master before the update, so the step starts from what the model holds. One more read of the copy,
// in the same pass (ZeroAdam's stages 1 and 2: zerofast/optim/state.py). Each driver writes the test
// with its own conversions (the copy type's rounding, then back to float), which round as store() does.

// Build the scalars on the host, in double, as torch does (see [Note: matching torch.optim.AdamW]).
inline AdamScalars make_adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                     int64_t step, bool adamw, double grad_scale) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamScalars s;
  s.decay_factor = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.l2_weight_decay = adamw ? 0.0f : static_cast<float>(weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  s.grad_scale = static_cast<float>(grad_scale);
  s.follow_copy = false;
  return s;
}

// The element functions have internal linkage: see [Note: one math, many ISAs].
namespace {

// True for inf and nan: x - x is 0 for every finite x and nan otherwise. Written without
// std::isfinite so that it vectorizes and compiles unchanged for host and device.
C10_HOST_DEVICE C10_ALWAYS_INLINE bool is_nonfinite(float x) { return !(x - x == 0.0f); }

// ATen's lerp: two branches keep the result exact at both ends of the weight range.
C10_HOST_DEVICE C10_ALWAYS_INLINE float lerp(float self, float end, float weight) {
  // Both branches are computed and one is selected, so the loop stays free of control flow and
  // vectorizes on targets without masked instructions (AVX2); the extra FMA costs nothing in a
  // memory-bound loop.
  const float low = fmaf(weight, end - self, self);
  const float high = fmaf(-(end - self), 1.0f - weight, end);
  return (weight < 0.5f) ? low : high;
}

// One element's values within a step: the decayed parameter and the new moments.
struct AdamElement {
  float param;       // after AdamW's decay, before the update
  float exp_avg;     // this step's first moment
  float exp_avg_sq;  // this step's second moment
};

// The first half of one element's step: the new moments. `grad` is the raw stored gradient
// converted to float; it is scaled here.
C10_HOST_DEVICE C10_ALWAYS_INLINE AdamElement adam_moments(float param, float grad, float exp_avg, float exp_avg_sq,
                                                           const AdamScalars& s) {
  float g = grad * s.grad_scale;
  const float p = param * s.decay_factor;
  g = fmaf(p, s.l2_weight_decay, g);
  return {p, lerp(exp_avg, g, s.lerp_weight), fmaf(s.one_minus_beta2 * g, g, exp_avg_sq * s.beta2)};
}

// The second half: the updated parameter from the new moments.
C10_HOST_DEVICE C10_ALWAYS_INLINE float adam_param(AdamElement e, const AdamScalars& s) {
  const float denom = std::sqrt(e.exp_avg_sq) / s.bias_correction2_sqrt + s.eps;
  return e.param + (s.neg_step_size * e.exp_avg) / denom;
}

// One element of one step on fp32 state.
C10_HOST_DEVICE C10_ALWAYS_INLINE void adam_update(float& param, float grad, float& exp_avg, float& exp_avg_sq,
                                                   const AdamScalars& s) {
  const AdamElement e = adam_moments(param, grad, exp_avg, exp_avg_sq, s);
  param = adam_param(e, s);
  exp_avg = e.exp_avg;
  exp_avg_sq = e.exp_avg_sq;
}

// --- 8-bit state: [Note: quantized state] in zerofast/quant.py -----------------------------------
// A block's moments are stored as byte indices into a 256-entry code times the block's scale (its
// largest |value|). Both drivers step a block with these functions: dequantize, adam_moments and
// adam_param, the block's new scales (scale_magnitude), then quantize (or quantize_by_table). The
// CUDA kernel runs each block in two passes, the second recomputing the moments in registers; the
// CPU loops run one pass and hold the block's new moments in a small scratch ([Note: one pass per
// block] in adam_cpu_loop.h).

// The 256 code values and the 255 rounding thresholds between neighbours of one code.
constexpr int kCodeSize = 256;

C10_HOST_DEVICE C10_ALWAYS_INLINE float code_midpoint(const float* code, int k) {
  return (code[k] + code[k + 1]) * 0.5f;
}

// [Note: no positive value rounds to zero]
// Threshold k of a code: the midpoint of code values k and k + 1, except for an unsigned code (its
// lowest value 0: exp_avg_sq's), whose first threshold is 0 itself. So an unsigned code stores 0
// only for 0 (and NaN), and a positive value too small for its block's nearest code value rounds
// up to the smallest nonzero one. Rounding it to nearest would store a second moment far below its
// block's largest as 0 while its first moment is not (a value 10^-7 of the block's largest lies
// below the dynamic code's smallest value): its update becomes lr * m / eps, a blow-up of the
// element that a fine-tune measured (docs/8bit-state.md), the zero-point problem of Li et al.,
// "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023. A signed code keeps its
// midpoints: a first moment rounded to 0 only stops its element's update.
C10_HOST_DEVICE C10_ALWAYS_INLINE float code_threshold(const float* code, int k) {
  return (k == 0 && code[0] == 0.0f) ? 0.0f : code_midpoint(code, k);
}

C10_HOST_DEVICE C10_ALWAYS_INLINE float dequantize(uint8_t q, float scale, const float* code) {
  return code[static_cast<int32_t>(q)] * scale;  // a 32-bit index: the loops gather with it
}

// |x| for the block's scale, NaN counted as 0 (a NaN moment does not poison its block's scale).
C10_HOST_DEVICE C10_ALWAYS_INLINE float scale_magnitude(float x) {
  const float a = std::fabs(x);
  return a == a ? a : 0.0f;
}

// The index of the code value nearest to x / scale: how many thresholds are below it (a tie goes
// to the lower value; NaN to index 0). A branch-free binary search over the 255 thresholds: the
// CUDA kernel's search (its thresholds sit in shared memory) and the CPU loops' fallback for a code
// the table below cannot serve.
C10_HOST_DEVICE C10_ALWAYS_INLINE int32_t search_step(int32_t index, int32_t step, float x, const float* thresholds) {
  return index + (thresholds[index + step - 1] < x ? step : 0);
}

C10_HOST_DEVICE C10_ALWAYS_INLINE float normalize(float x, float scale) { return scale > 0.0f ? x / scale : 0.0f; }

C10_HOST_DEVICE C10_ALWAYS_INLINE uint8_t quantize(float x, float scale, const float* thresholds) {
  const float normalized = normalize(x, scale);
  int32_t index = search_step(0, 128, normalized, thresholds);
  index = search_step(index, 64, normalized, thresholds);
  index = search_step(index, 32, normalized, thresholds);
  index = search_step(index, 16, normalized, thresholds);
  index = search_step(index, 8, normalized, thresholds);
  index = search_step(index, 4, normalized, thresholds);
  index = search_step(index, 2, normalized, thresholds);
  index = search_step(index, 1, normalized, thresholds);
  return static_cast<uint8_t>(index);
}

// [Note: quantizing by table]
// The binary search above is eight dependent loads per moment and does not vectorize. The table
// below gives the same index with one load and one integer comparison. A normalized value's float
// bits, read as sign and magnitude, select a bucket: the magnitude clamped to [2^-24, 1], its
// exponent and top kTableMantissaBits mantissa bits (so the bucket is a function of the top 16 bits
// alone), mirrored for negative values, so that buckets are increasing in the value. Each entry
// packs two numbers: in its low byte the count of thresholds in the buckets before it (every one
// of them is below any value of the bucket, and every threshold of a later bucket above it), and
// above that the cut of the threshold inside the bucket, if there is one. Values of one bucket
// share their top 16 bits, so within it a value is ordered by its low 16 bits (its key, mirrored
// for negative values as the buckets are): t < x exactly when key(x) >= key(t) + 1, the cut
// (kNoCut, above every key, when the bucket holds no threshold). The host checks each code (true
// for the dynamic and linear codes of zerofast/quant.py): no two thresholds in one bucket, none
// in the two clamped buckets of each sign (below 2^-24 times 1 + 2^-7, or at least 1; their values
// do not share their top bits) but +0 (whose key, 0, is below every other value's there), none NaN
// or repeated. NaN falls in bucket 0 (cut kNoCut, count 0)
// and a block of zeros normalizes to +0: index 0 and the zero's index, as the search gives. A code
// that fails the check is searched instead.
constexpr int kTableMantissaBits = 7;
constexpr uint32_t kTableLowBits = (127u - 24u) << 23;  // 2^-24
constexpr uint32_t kTableHighBits = 127u << 23;         // 1.0
constexpr int32_t kTableHalf = static_cast<int32_t>((kTableHighBits - kTableLowBits) >> (23 - kTableMantissaBits)) + 1;
constexpr int32_t kTableSize = 2 * kTableHalf;
constexpr uint32_t kKeyMask = (1u << (23 - kTableMantissaBits)) - 1;                     // the bits below a bucket's
constexpr uint32_t kNoCut = kKeyMask + 2;                                                // above every key
constexpr uint32_t kFirstUnclamped = kTableLowBits + (1u << (23 - kTableMantissaBits));  // the lowest
                                                                                         // bucket's end

C10_HOST_DEVICE C10_ALWAYS_INLINE uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

C10_HOST_DEVICE C10_ALWAYS_INLINE int32_t table_bucket(uint32_t bits) {
  const uint32_t magnitude = bits & 0x7fffffffu;
  const uint32_t clamped = magnitude < kTableLowBits    ? kTableLowBits
                           : magnitude > kTableHighBits ? kTableHighBits
                                                        : magnitude;
  const int32_t offset = static_cast<int32_t>((clamped - kTableLowBits) >> (23 - kTableMantissaBits));
  // NaN (a magnitude above inf's) goes with the negative values, to bucket 0, whose count is 0.
  const bool low_side = (bits >> 31) != 0u || magnitude > 0x7f800000u;
  return low_side ? kTableHalf - 1 - offset : kTableHalf + offset;
}

// A value's order within its bucket (see the Note). In the two lowest buckets (magnitudes below
// 2^-24 times 1 + 2^-7, clamped into them), a zero's key is below every other value's, so a
// threshold of +0 (an unsigned code's first: [Note: no positive value rounds to zero]) has its cut
// there.
C10_HOST_DEVICE C10_ALWAYS_INLINE uint32_t table_key(uint32_t bits) {
  const uint32_t magnitude = bits & 0x7fffffffu;
  const uint32_t low = magnitude < kFirstUnclamped ? (magnitude != 0u ? 1u : 0u) : bits & kKeyMask;
  return (bits >> 31) != 0u ? kKeyMask - low : low;
}

// The bits of x / scale as quantize sees them: x / scale computed unconditionally (by 1 in a block
// of zeros) and masked to +0 there, as `normalize` does, with no data-dependent branch.
C10_HOST_DEVICE C10_ALWAYS_INLINE uint32_t normalized_bits(float x, float scale) {
  const uint32_t keep = scale > 0.0f ? 0xffffffffu : 0u;
  return float_bits(x / (scale > 0.0f ? scale : 1.0f)) & keep;
}

// The index from a value's table entry and key.
C10_HOST_DEVICE C10_ALWAYS_INLINE uint8_t table_index(uint32_t entry, uint32_t key) {
  return static_cast<uint8_t>((entry & 0xffu) + (key >= (entry >> 8) ? 1u : 0u));
}

// The same index as quantize(x, scale, thresholds); `table` has kTableSize entries (see the Note).
// The CPU loops run its three steps as three loops: see [Note: one pass per block] in adam_cpu_loop.h.
C10_HOST_DEVICE C10_ALWAYS_INLINE uint8_t quantize_by_table(float x, float scale, const int32_t* table) {
  const uint32_t bits = normalized_bits(x, scale);
  return table_index(static_cast<uint32_t>(table[table_bucket(bits)]), table_key(bits));
}

// Fills `table` (kTableSize entries) for the 255 sorted `thresholds`; false when the code cannot
// use it (see the Note), and the caller searches instead.
inline bool build_quantize_table(const float* thresholds, int32_t* table) {
  for (int k = 0; k < kCodeSize - 1; ++k) {
    const float t = thresholds[k];
    const uint32_t magnitude = float_bits(t) & 0x7fffffffu;
    const bool positive_zero = float_bits(t) == 0u;  // an unsigned code's first threshold
    if (t != t || (magnitude < kFirstUnclamped && !positive_zero) || magnitude >= kTableHighBits) return false;
    if (k > 0 && !(thresholds[k - 1] < t)) return false;
    if (k > 0 && table_bucket(float_bits(thresholds[k - 1])) == table_bucket(float_bits(t))) return false;
  }
  int32_t below = 0;
  for (int32_t b = 0; b < kTableSize; ++b) {
    while (below < kCodeSize - 1 && table_bucket(float_bits(thresholds[below])) < b) ++below;
    const bool inside = below < kCodeSize - 1 && table_bucket(float_bits(thresholds[below])) == b;
    const uint32_t cut = inside ? table_key(float_bits(thresholds[below])) + 1 : kNoCut;
    table[b] = static_cast<int32_t>(static_cast<uint32_t>(below) | (cut << 8));
  }
  return true;
}

}  // namespace
}  // namespace zerofast
