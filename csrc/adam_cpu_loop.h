// The CPU loops, compiled once per instruction set: see [Note: one math, many ISAs] in adam_math.h.
//
// Include this after every library header and after the translation unit's `#pragma GCC target`,
// with ZEROFAST_ISA_NAMESPACE naming a namespace of its own, so that each copy has its own symbols.
// The loops are plain element loops over contiguous memory; `omp simd` (with -fopenmp-simd and
// -fno-math-errno) lets the compiler turn sqrt and division into vector instructions of the target.

#ifndef ZEROFAST_ISA_NAMESPACE
#error "define ZEROFAST_ISA_NAMESPACE before including adam_cpu_loop.h"
#endif

namespace zerofast {
namespace cpu {
namespace ZEROFAST_ISA_NAMESPACE {
namespace {

// Storage types as the loop reads and writes them. bf16 is converted with bit operations (exactly
// c10::BFloat16's round-to-nearest-even, nan kept nan) so that the conversion vectorizes; fp16 uses
// the compiler's _Float16, IEEE round-to-nearest-even like c10::Half (F16C instructions where the
// target has them).
struct Bf16 {
  uint16_t bits;
};
using F16 = _Float16;

C10_ALWAYS_INLINE float to_float(float x) { return x; }
C10_ALWAYS_INLINE float to_float(F16 x) { return static_cast<float>(x); }
C10_ALWAYS_INLINE float to_float(Bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

C10_ALWAYS_INLINE void store(float* out, float x) { *out = x; }
C10_ALWAYS_INLINE void store(F16* out, float x) { *out = static_cast<F16>(x); }
C10_ALWAYS_INLINE void store(Bf16* out, float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  out->bits = static_cast<uint16_t>(x != x ? 0x7fc0u : rounded);
}

struct NoCopy {};

template <typename G, typename C>
void adam_typed(const AdamPointers& ptr, const AdamScalars& scalars, int64_t begin, int64_t end) {
  // A local copy: stores through the float pointers below cannot alias it, so its fields stay in
  // registers instead of being reloaded every iteration.
  const AdamScalars s = scalars;
  float* __restrict param = ptr.param;
  const G* __restrict grad = static_cast<const G*>(ptr.grad);
  float* __restrict exp_avg = ptr.exp_avg;
  float* __restrict exp_avg_sq = ptr.exp_avg_sq;
  C* __restrict copy = static_cast<C*>(ptr.param_copy);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float p = param[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    adam_update(p, to_float(grad[i]), m, v, s);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (!std::is_same_v<C, NoCopy>) {
      store(&copy[i], p);
    }
  }
}

template <typename G>
void adam_for_grad(const AdamPointers& ptr, const AdamScalars& s, int64_t begin, int64_t end) {
  switch (ptr.copy_type) {
    case Storage::kNone:
      return adam_typed<G, NoCopy>(ptr, s, begin, end);
    case Storage::kFloat:
      return adam_typed<G, float>(ptr, s, begin, end);
    case Storage::kBFloat16:
      return adam_typed<G, Bf16>(ptr, s, begin, end);
    case Storage::kHalf:
      return adam_typed<G, F16>(ptr, s, begin, end);
  }
}

void adam_range(const AdamPointers& ptr, const AdamScalars& s, int64_t begin, int64_t end) {
  switch (ptr.grad_type) {
    case Storage::kFloat:
      return adam_for_grad<float>(ptr, s, begin, end);
    case Storage::kBFloat16:
      return adam_for_grad<Bf16>(ptr, s, begin, end);
    case Storage::kHalf:
      return adam_for_grad<F16>(ptr, s, begin, end);
    case Storage::kNone:
      return;
  }
}

// One block of the 8-bit step, in the two passes of [Note: quantized state] (adam_math.h), on the
// block's elements [0, n) of the pointers. With kTable the second pass quantizes by table
// ([Note: quantizing by table]) and vectorizes; without, it searches, element by element. The arrays
// written are restrict parameters of this function, never inlined: GCC proves from those (not from
// restrict locals copied out of a struct, nor once inlined) that the gathers from the codes and
// tables do not alias them.
template <typename G, typename C, bool kTable>
C10_NOINLINE void adam8_elements(float* __restrict param, const G* __restrict grad, uint8_t* __restrict q_avg,
                                 uint8_t* __restrict q_avg_sq, C* __restrict copy, float* __restrict scale_avg,
                                 float* __restrict scale_avg_sq, const Adam8Pointers& ptr, const AdamScalars& scalars,
                                 int64_t n) {
  const AdamScalars s = scalars;  // a local copy, as in adam_typed
  const float* __restrict code_avg = ptr.exp_avg_code;
  const float* __restrict code_avg_sq = ptr.exp_avg_sq_code;
  const float* __restrict thr_avg = ptr.exp_avg_thresholds;
  const float* __restrict thr_avg_sq = ptr.exp_avg_sq_thresholds;
  const int32_t* __restrict table_avg = ptr.exp_avg_table;
  const int32_t* __restrict table_avg_sq = ptr.exp_avg_sq_table;
  const float old_scale_avg = *scale_avg;
  const float old_scale_avg_sq = *scale_avg_sq;
  float max_avg = 0.0f;
  float max_avg_sq = 0.0f;
#pragma omp simd reduction(max : max_avg, max_avg_sq)
  for (int64_t i = 0; i < n; ++i) {
    const AdamElement e = adam_moments(param[i], to_float(grad[i]), dequantize(q_avg[i], old_scale_avg, code_avg),
                                       dequantize(q_avg_sq[i], old_scale_avg_sq, code_avg_sq), s);
    max_avg = std::max(max_avg, scale_magnitude(e.exp_avg));
    max_avg_sq = std::max(max_avg_sq, scale_magnitude(e.exp_avg_sq));
  }
  // No `omp simd` here: under it GCC keeps `e` (a struct returned by value) in a per-lane array in
  // memory, whose loads it does not vectorize; the plain loop vectorizes.
  for (int64_t i = 0; i < n; ++i) {
    const AdamElement e = adam_moments(param[i], to_float(grad[i]), dequantize(q_avg[i], old_scale_avg, code_avg),
                                       dequantize(q_avg_sq[i], old_scale_avg_sq, code_avg_sq), s);
    const float p = adam_param(e, s);
    param[i] = p;
    if constexpr (kTable) {
      q_avg[i] = quantize_by_table(e.exp_avg, max_avg, thr_avg, table_avg);
      q_avg_sq[i] = quantize_by_table(e.exp_avg_sq, max_avg_sq, thr_avg_sq, table_avg_sq);
    } else {
      q_avg[i] = quantize(e.exp_avg, max_avg, thr_avg);
      q_avg_sq[i] = quantize(e.exp_avg_sq, max_avg_sq, thr_avg_sq);
    }
    if constexpr (!std::is_same_v<C, NoCopy>) {
      store(&copy[i], p);
    }
  }
  *scale_avg = max_avg;
  *scale_avg_sq = max_avg_sq;
}

template <typename G, typename C, bool kTable>
void adam8_block(const Adam8Pointers& ptr, const AdamScalars& s, int64_t lo, int64_t hi, int64_t blk) {
  C* copy = static_cast<C*>(ptr.param_copy);
  adam8_elements<G, C, kTable>(ptr.param + lo, static_cast<const G*>(ptr.grad) + lo, ptr.exp_avg + lo,
                               ptr.exp_avg_sq + lo, copy == nullptr ? nullptr : copy + lo, ptr.exp_avg_scale + blk,
                               ptr.exp_avg_sq_scale + blk, ptr, s, hi - lo);
}

template <typename G, typename C>
void adam8_typed(const Adam8Pointers& ptr, const AdamScalars& s, int64_t block_begin, int64_t block_end) {
  const bool by_table = ptr.exp_avg_table != nullptr && ptr.exp_avg_sq_table != nullptr;
  for (int64_t blk = block_begin; blk < block_end; ++blk) {
    const int64_t lo = blk * ptr.block;
    const int64_t hi = std::min(lo + ptr.block, ptr.numel);
    if (by_table) {
      adam8_block<G, C, true>(ptr, s, lo, hi, blk);
    } else {
      adam8_block<G, C, false>(ptr, s, lo, hi, blk);
    }
  }
}

template <typename G>
void adam8_for_grad(const Adam8Pointers& ptr, const AdamScalars& s, int64_t begin, int64_t end) {
  switch (ptr.copy_type) {
    case Storage::kNone:
      return adam8_typed<G, NoCopy>(ptr, s, begin, end);
    case Storage::kFloat:
      return adam8_typed<G, float>(ptr, s, begin, end);
    case Storage::kBFloat16:
      return adam8_typed<G, Bf16>(ptr, s, begin, end);
    case Storage::kHalf:
      return adam8_typed<G, F16>(ptr, s, begin, end);
  }
}

void adam8_range(const Adam8Pointers& ptr, const AdamScalars& s, int64_t block_begin, int64_t block_end) {
  switch (ptr.grad_type) {
    case Storage::kFloat:
      return adam8_for_grad<float>(ptr, s, block_begin, block_end);
    case Storage::kBFloat16:
      return adam8_for_grad<Bf16>(ptr, s, block_begin, block_end);
    case Storage::kHalf:
      return adam8_for_grad<F16>(ptr, s, block_begin, block_end);
    case Storage::kNone:
      return;
  }
}

template <typename G>
bool nonfinite_typed(const G* __restrict grad, float grad_scale, int64_t begin, int64_t end) {
  bool found = false;
#pragma omp simd reduction(|| : found)
  for (int64_t i = begin; i < end; ++i) {
    found = found || is_nonfinite(to_float(grad[i]) * grad_scale);
  }
  return found;
}

bool nonfinite_range(const void* grad, Storage type, float grad_scale, int64_t begin, int64_t end) {
  switch (type) {
    case Storage::kFloat:
      return nonfinite_typed(static_cast<const float*>(grad), grad_scale, begin, end);
    case Storage::kBFloat16:
      return nonfinite_typed(static_cast<const Bf16*>(grad), grad_scale, begin, end);
    case Storage::kHalf:
      return nonfinite_typed(static_cast<const F16*>(grad), grad_scale, begin, end);
    case Storage::kNone:
      return false;
  }
  return false;
}

}  // namespace
}  // namespace ZEROFAST_ISA_NAMESPACE
}  // namespace cpu
}  // namespace zerofast
