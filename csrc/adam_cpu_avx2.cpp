// The AVX2 + FMA + F16C CPU loop (x86-64 only). Every library header is included before the
// target pragma, so only this file's own loop is compiled for AVX2: see [Note: one math, many ISAs].
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#include "adam_cpu.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ZEROFAST_ISA_NAMESPACE avx2
#include "adam_cpu_loop.h"
#pragma GCC pop_options  // the getter below must run on any x86-64

namespace zerofast {
namespace cpu {
IsaKernels avx2_kernels() { return {avx2::adam_range, avx2::nonfinite_range, avx2::adam8_range}; }
}  // namespace cpu
}  // namespace zerofast
#else
namespace zerofast {
namespace cpu {
IsaKernels avx2_kernels() { return portable_kernels(); }
}  // namespace cpu
}  // namespace zerofast
#endif
