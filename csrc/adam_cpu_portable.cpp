// The portable CPU loop: the build's baseline instruction set (SSE2 on x86-64). It is what a
// machine gets when it lacks AVX2, and what ZEROFAST_CPU_ISA=portable forces.
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#include "adam_cpu.h"

#define ZEROFAST_ISA_NAMESPACE portable
#include "adam_cpu_loop.h"

namespace zerofast {
namespace cpu {
IsaKernels portable_kernels() { return {portable::adam_range, portable::nonfinite_range, portable::adam8_range}; }
}  // namespace cpu
}  // namespace zerofast
