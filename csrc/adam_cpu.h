// The CPU driver's view of its per-instruction-set loops (adam_cpu_loop.h, compiled once per ISA).
#pragma once

#include <cstdint>

#include "adam_math.h"

namespace zerofast {
namespace cpu {

// Storage type of the gradient or of the parameter copy, as the loops see it.
enum class Storage : int8_t { kNone, kFloat, kBFloat16, kHalf };

// One call's flat tensors as raw pointers. `param`, `exp_avg`, `exp_avg_sq` are fp32.
struct AdamPointers {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* param_copy;  // nullptr when there is no copy
  Storage grad_type;
  Storage copy_type;  // kNone when there is no copy
};

// One call's flat tensors of the 8-bit step ([Note: quantized state] in zerofast/quant.py).
struct Adam8Pointers {
  float* param;
  const void* grad;
  uint8_t* exp_avg;  // code indices, one per element
  uint8_t* exp_avg_sq;
  float* exp_avg_scale;  // one per block
  float* exp_avg_sq_scale;
  const float* exp_avg_code;  // 256 values each, increasing
  const float* exp_avg_sq_code;
  const float* exp_avg_thresholds;  // 256 each: the codes' 255 midpoints, then +inf
  const float* exp_avg_sq_thresholds;
  const int32_t* exp_avg_table;  // kTableSize each, or nullptr: [Note: quantizing by table]
  const int32_t* exp_avg_sq_table;
  void* param_copy;  // nullptr when there is no copy
  Storage grad_type;
  Storage copy_type;  // kNone when there is no copy
  int64_t numel;      // elements; the last block may be shorter than `block`
  int64_t block;      // elements per scale
};

// The instruction sets a loop is compiled for; the driver picks one at load time.
enum class Isa : int8_t { kPortable, kAvx2, kAvx512 };

// Update elements [begin, end).
using AdamRangeFn = void (*)(const AdamPointers&, const AdamScalars&, int64_t begin, int64_t end);
// True when any of grad[begin, end) * grad_scale is inf or nan.
using NonfiniteRangeFn = bool (*)(const void* grad, Storage grad_type, float grad_scale, int64_t begin, int64_t end);

// Update blocks [block_begin, block_end) of the 8-bit state.
using Adam8RangeFn = void (*)(const Adam8Pointers&, const AdamScalars&, int64_t block_begin, int64_t block_end);

struct IsaKernels {
  AdamRangeFn adam_range;
  NonfiniteRangeFn nonfinite_range;
  Adam8RangeFn adam8_range;
};

// Defined in adam_cpu_portable.cpp, adam_cpu_avx2.cpp and adam_cpu_avx512.cpp (x86-64 only).
IsaKernels portable_kernels();
IsaKernels avx2_kernels();
IsaKernels avx512_kernels();

}  // namespace cpu
}  // namespace zerofast
