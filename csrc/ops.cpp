// Every op schema of the zerofast library (TORCH_LIBRARY), and what a build without the CUDA
// kernels answers a CUDA tensor. Backend files only add their TORCH_LIBRARY_IMPL; nothing else spells
// a signature. The module's Python bindings (the engines' classes) are bindings.cpp's.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

namespace zerofast {

TORCH_LIBRARY(zerofast, m) {
  // One Adam/AdamW step on flat fp32 master state; see adam_math.h for the math and
  // zerofast/_ops.py for the Python face and the fake kernel. Mutates param, exp_avg, exp_avg_sq,
  // and found_inf / param_copy when given; returns nothing. follow_copy: param_copy is read first
  // ([Note: the master follows the copy] in adam_math.h).
  m.def(
      "fused_adam_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, *, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, int step, bool adamw, "
      "float grad_scale, Tensor? grad_scale_tensor, Tensor(d!)? found_inf, Tensor(e!)? param_copy, "
      "bool follow_copy=False) -> ()");
  // fused_adam_'s step with 8-bit moments ([Note: quantized state] in zerofast/quant.py): exp_avg and
  // exp_avg_sq are uint8 code indices, exp_avg_scale and exp_avg_sq_scale one float32 per `block`
  // elements, exp_avg_code and exp_avg_sq_code the 256 values of each code. Mutates param, the
  // moments, their scales, and found_inf / param_copy when given; returns nothing.
  m.def(
      "fused_adam_8bit_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!) exp_avg_scale, Tensor(e!) exp_avg_sq_scale, Tensor exp_avg_code, Tensor exp_avg_sq_code, *, "
      "int block, float lr, float beta1, float beta2, float eps, float weight_decay, int step, bool adamw, "
      "float grad_scale, Tensor? grad_scale_tensor, Tensor(f!)? found_inf, Tensor(g!)? param_copy, "
      "bool follow_copy=False) -> ()");
  // Sets found_inf (a 1-element float32 tensor) to 1 when any value of grad is inf or nan, with the
  // same check fused_adam_ runs before its update; leaves it alone otherwise. ZeroAdam runs it on
  // each rank's gradient shard so the ranks can agree on skipping a step before any rank updates.
  m.def("nonfinite_check_(Tensor grad, Tensor(a!) found_inf) -> ()");
}

#ifndef ZEROFAST_WITH_CUDA
namespace {
// Without this, a CUDA tensor would meet the dispatcher's generic "could not run ... CUDA backend".
void fused_adam_cuda_missing(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                             double, double, double, int64_t, bool, double, const std::optional<at::Tensor>&,
                             const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false,
              "fused_adam_: got CUDA tensors, but zerofast was built without its CUDA kernels "
              "(zerofast.has_cuda_kernels() is False); rebuild with ZEROFAST_CUDA=1");
}
void fused_adam_8bit_cuda_missing(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                  double, double, double, double, double, int64_t, bool, double,
                                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                  const std::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false,
              "fused_adam_8bit_: got CUDA tensors, but zerofast was built without its CUDA kernels "
              "(zerofast.has_cuda_kernels() is False); rebuild with ZEROFAST_CUDA=1");
}
void nonfinite_check_cuda_missing(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false,
              "nonfinite_check_: got CUDA tensors, but zerofast was built without its CUDA kernels "
              "(zerofast.has_cuda_kernels() is False); rebuild with ZEROFAST_CUDA=1");
}
}  // namespace
TORCH_LIBRARY_IMPL(zerofast, CUDA, m) {
  m.impl("fused_adam_", &fused_adam_cuda_missing);
  m.impl("fused_adam_8bit_", &fused_adam_8bit_cuda_missing);
  m.impl("nonfinite_check_", &nonfinite_check_cuda_missing);
}
#endif

bool has_cuda_kernels() {
#ifdef ZEROFAST_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace zerofast
