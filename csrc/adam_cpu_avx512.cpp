// The AVX-512 CPU loop (x86-64 only). Every library header is included before the target pragma,
// so only this file's own loop is compiled for AVX-512: see [Note: one math, many ISAs].
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#include "adam_cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define ZEROFAST_ISA_NAMESPACE avx512
#define ZEROFAST_AVX512_LOOKUPS  // dequantize_block's permutes: [Note: one pass per block]
#include "adam_cpu_loop.h"
#pragma GCC pop_options  // the getter below must run on any x86-64

namespace zerofast {
namespace cpu {
IsaKernels avx512_kernels() { return {avx512::adam_range, avx512::nonfinite_range, avx512::adam8_range}; }
}  // namespace cpu
}  // namespace zerofast
#else
namespace zerofast {
namespace cpu {
IsaKernels avx512_kernels() { return portable_kernels(); }
}  // namespace cpu
}  // namespace zerofast
#endif
