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

// The master element p, or the copy's value where the copy is no longer p's rounding: [Note: the
// master follows the copy] in adam_math.h.
template <typename C>
C10_ALWAYS_INLINE float followed(float p, C copy) {
  C rounded;
  store(&rounded, p);
  const float written = to_float(copy);
  return to_float(rounded) == written ? p : written;
}

template <typename G, typename C, bool Follow>
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
    if constexpr (Follow) p = followed(p, copy[i]);
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
      return adam_typed<G, NoCopy, false>(ptr, s, begin, end);
    case Storage::kFloat:
      return s.follow_copy ? adam_typed<G, float, true>(ptr, s, begin, end)
                           : adam_typed<G, float, false>(ptr, s, begin, end);
    case Storage::kBFloat16:
      return s.follow_copy ? adam_typed<G, Bf16, true>(ptr, s, begin, end)
                           : adam_typed<G, Bf16, false>(ptr, s, begin, end);
    case Storage::kHalf:
      return s.follow_copy ? adam_typed<G, F16, true>(ptr, s, begin, end)
                           : adam_typed<G, F16, false>(ptr, s, begin, end);
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

// [Note: one pass per block]
// The 8-bit step reads and writes each element's memory once. A chunk of whole blocks (2048
// elements of blocks up to 2048, else one block) is stepped with its moments in a scratch of 16
// bytes per element (32 KiB, in L1 or L2), in loops over the chunk: dequantize each moment into the
// scratch; the fp32 Adam math in place (param, grad and the copy streamed, the parameter written);
// each block's two new scales (largest magnitudes, written over the old ones, which the first loop
// has read); the table's bucket and key of each normalized moment; the table lookups and the final
// index. Each loop is simple enough for the compiler to vectorize on its own, the table lookups as
// gathers (one per moment: the table packs the count and the cut, [Note: quantizing by table] in
// adam_math.h). The exception is the 256-entry code that dequantizing reads: the AVX-512 loop keeps
// it in 16 registers and looks up 16 elements with eight two-register permutes and a three-level
// blend, which measured faster than gathers (AMD EPYC, docs/8bit-state.md). Every value is the one
// the element functions of adam_math.h compute, in the same order, so every instruction set gives
// the same bits, and so does the CUDA kernel's two passes.

// Elements stepped together: whole blocks, at least one, and kChunk elements when blocks are smaller
// ([Note: one pass per block]).
constexpr int64_t kChunk = 2048;

// A chunk's fp32 moments, and the table's bucket and key of each (reused for both moments).
struct Scratch8 {
  std::unique_ptr<float[]> exp_avg;
  std::unique_ptr<float[]> exp_avg_sq;
  std::unique_ptr<uint32_t[]> bucket;
  std::unique_ptr<uint32_t[]> key;

  explicit Scratch8(int64_t elements)
      : exp_avg(new float[elements]),
        exp_avg_sq(new float[elements]),
        bucket(new uint32_t[elements]),
        key(new uint32_t[elements]) {}
};

// out[i] = dequantize(q[i], scale of i's block, code) over the chunk's n elements.
#if defined(ZEROFAST_AVX512_LOOKUPS)
// 16 elements at a time from the code held in registers.
C10_NOINLINE void dequantize_blocks(const uint8_t* __restrict q, const float* __restrict code,
                                    const float* __restrict scales, int64_t block, float* __restrict out, int64_t n) {
  __m512 t[16];
  for (int k = 0; k < 16; ++k) t[k] = _mm512_loadu_ps(code + 16 * k);
  const __m512i bit5 = _mm512_set1_epi32(32), bit6 = _mm512_set1_epi32(64), bit7 = _mm512_set1_epi32(128);
  for (int64_t lo = 0; lo < n; lo += block) {
    const int64_t hi = std::min(lo + block, n);
    const float scale = scales[lo / block];
    const __m512 scale16 = _mm512_set1_ps(scale);
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
      const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
      // permutex2var reads the index's low five bits: entries 32k .. 32k + 31 for each k.
      __m512 r[8];
      for (int k = 0; k < 8; ++k) r[k] = _mm512_permutex2var_ps(t[2 * k], index, t[2 * k + 1]);
      const __mmask16 m5 = _mm512_test_epi32_mask(index, bit5);
      const __mmask16 m6 = _mm512_test_epi32_mask(index, bit6);
      const __mmask16 m7 = _mm512_test_epi32_mask(index, bit7);
      const __m512 low =
          _mm512_mask_blend_ps(m6, _mm512_mask_blend_ps(m5, r[0], r[1]), _mm512_mask_blend_ps(m5, r[2], r[3]));
      const __m512 high =
          _mm512_mask_blend_ps(m6, _mm512_mask_blend_ps(m5, r[4], r[5]), _mm512_mask_blend_ps(m5, r[6], r[7]));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mask_blend_ps(m7, low, high), scale16));
    }
    for (; i < hi; ++i) out[i] = dequantize(q[i], scale, code);
  }
}
#else
C10_NOINLINE void dequantize_blocks(const uint8_t* __restrict q, const float* __restrict code,
                                    const float* __restrict scales, int64_t block, float* __restrict out, int64_t n) {
  for (int64_t lo = 0; lo < n; lo += block) {
    const int64_t hi = std::min(lo + block, n);
    const float scale = scales[lo / block];
    for (int64_t i = lo; i < hi; ++i) out[i] = dequantize(q[i], scale, code);
  }
}
#endif

// The Adam math of adam_typed on the chunk, its moments read from and written back to the scratch.
// The arrays are restrict parameters of a function never inlined: GCC proves them free of aliasing
// from those, not from restrict locals copied out of a struct. No `omp simd`: under it GCC keeps
// `e` (a struct returned by value) in a per-lane array in memory; the plain loop vectorizes.
template <typename G, typename C>
C10_NOINLINE void adam8_math(float* __restrict param, const G* __restrict grad, C* __restrict copy,
                             float* __restrict exp_avg, float* __restrict exp_avg_sq, const AdamScalars& scalars,
                             int64_t n) {
  const AdamScalars s = scalars;  // a local copy, as in adam_typed
  for (int64_t i = 0; i < n; ++i) {
    float master = param[i];
    if constexpr (!std::is_same_v<C, NoCopy>) {
      if (s.follow_copy) master = followed(master, copy[i]);
    }
    const AdamElement e = adam_moments(master, to_float(grad[i]), exp_avg[i], exp_avg_sq[i], s);
    const float p = adam_param(e, s);
    param[i] = p;
    exp_avg[i] = e.exp_avg;
    exp_avg_sq[i] = e.exp_avg_sq;
    if constexpr (!std::is_same_v<C, NoCopy>) {
      store(&copy[i], p);
    }
  }
}

// Each block's new scale: its largest magnitude.
C10_NOINLINE void block_scales(const float* __restrict x, int64_t block, float* __restrict scales, int64_t n) {
  for (int64_t lo = 0; lo < n; lo += block) {
    const int64_t hi = std::min(lo + block, n);
    float largest = 0.0f;
#pragma omp simd reduction(max : largest)
    for (int64_t i = lo; i < hi; ++i) largest = std::max(largest, scale_magnitude(x[i]));
    scales[lo / block] = largest;
  }
}

C10_NOINLINE void bucket_blocks(const float* __restrict x, const float* __restrict scales, int64_t block,
                                uint32_t* __restrict bucket, uint32_t* __restrict key, int64_t n) {
  for (int64_t lo = 0; lo < n; lo += block) {
    const int64_t hi = std::min(lo + block, n);
    const float scale = scales[lo / block];
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t bits = normalized_bits(x[i], scale);
      bucket[i] = static_cast<uint32_t>(table_bucket(bits));
      key[i] = table_key(bits);
    }
  }
}

// bucket[i] becomes its table entry.
C10_NOINLINE void lookup_entries(uint32_t* __restrict bucket, const int32_t* __restrict table, int64_t n) {
  for (int64_t i = 0; i < n; ++i) bucket[i] = static_cast<uint32_t>(table[bucket[i]]);
}

C10_NOINLINE void index_entries(const uint32_t* __restrict entry, const uint32_t* __restrict key, uint8_t* __restrict q,
                                int64_t n) {
  for (int64_t i = 0; i < n; ++i) q[i] = table_index(entry[i], key[i]);
}

C10_NOINLINE void search_blocks(const float* __restrict x, const float* __restrict scales, int64_t block,
                                const float* __restrict thresholds, uint8_t* __restrict q, int64_t n) {
  for (int64_t lo = 0; lo < n; lo += block) {
    const int64_t hi = std::min(lo + block, n);
    const float scale = scales[lo / block];
    for (int64_t i = lo; i < hi; ++i) q[i] = quantize(x[i], scale, thresholds);
  }
}

// Stores x (the chunk's new values of one moment) quantized with its blocks' `scales`.
void quantize_moment(const float* x, const float* scales, int64_t block, const float* thresholds, const int32_t* table,
                     Scratch8& scratch, uint8_t* q, int64_t n) {
  if (table == nullptr) return search_blocks(x, scales, block, thresholds, q, n);
  bucket_blocks(x, scales, block, scratch.bucket.get(), scratch.key.get(), n);
  lookup_entries(scratch.bucket.get(), table, n);
  index_entries(scratch.bucket.get(), scratch.key.get(), q, n);
}

// Blocks [first, last) of the step.
template <typename G, typename C>
void adam8_chunk(const Adam8Pointers& ptr, const AdamScalars& s, int64_t first, int64_t last, Scratch8& scratch) {
  const int64_t lo = first * ptr.block;
  const int64_t n = std::min(last * ptr.block, ptr.numel) - lo;
  float* exp_avg = scratch.exp_avg.get();
  float* exp_avg_sq = scratch.exp_avg_sq.get();
  float* scale_avg = ptr.exp_avg_scale + first;
  float* scale_avg_sq = ptr.exp_avg_sq_scale + first;
  C* copy = static_cast<C*>(ptr.param_copy);
  dequantize_blocks(ptr.exp_avg + lo, ptr.exp_avg_code, scale_avg, ptr.block, exp_avg, n);
  dequantize_blocks(ptr.exp_avg_sq + lo, ptr.exp_avg_sq_code, scale_avg_sq, ptr.block, exp_avg_sq, n);
  adam8_math<G, C>(ptr.param + lo, static_cast<const G*>(ptr.grad) + lo, copy == nullptr ? nullptr : copy + lo, exp_avg,
                   exp_avg_sq, s, n);
  block_scales(exp_avg, ptr.block, scale_avg, n);  // the old scales were read above
  block_scales(exp_avg_sq, ptr.block, scale_avg_sq, n);
  quantize_moment(exp_avg, scale_avg, ptr.block, ptr.exp_avg_thresholds, ptr.exp_avg_table, scratch, ptr.exp_avg + lo,
                  n);
  quantize_moment(exp_avg_sq, scale_avg_sq, ptr.block, ptr.exp_avg_sq_thresholds, ptr.exp_avg_sq_table, scratch,
                  ptr.exp_avg_sq + lo, n);
}

template <typename G, typename C>
void adam8_typed(const Adam8Pointers& ptr, const AdamScalars& s, int64_t block_begin, int64_t block_end) {
  const int64_t blocks_per_chunk = std::max<int64_t>(1, kChunk / ptr.block);
  Scratch8 scratch(blocks_per_chunk * ptr.block);  // one allocation per range of blocks (a parallel chunk)
  for (int64_t first = block_begin; first < block_end; first += blocks_per_chunk) {
    adam8_chunk<G, C>(ptr, s, first, std::min(first + blocks_per_chunk, block_end), scratch);
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
