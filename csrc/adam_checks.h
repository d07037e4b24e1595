// Argument checks of fused_adam_, shared by the CPU and CUDA drivers, so that both reject bad input
// with the same messages (each names the argument and what it got).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>

namespace zerofast {

inline void check_flat(const at::Tensor& t, const char* name, const at::Tensor& param, const char* op = "fused_adam_",
                       int64_t numel = -1) {
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be a flat 1-D tensor (use .view(-1)); got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous; got stride ", t.strides());
  if (numel < 0) {
    TORCH_CHECK(t.numel() == param.numel(), op, ": ", name, " has ", t.numel(), " elements but param has ",
                param.numel());
  } else {
    TORCH_CHECK(t.numel() == numel, op, ": ", name, " has ", t.numel(), " elements but needs ", numel);
  }
  TORCH_CHECK(t.device() == param.device(), op, ": ", name, " is on ", t.device(), " but param is on ", param.device());
}

inline bool is_low_or_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

inline void check_scalar_tensor(const at::Tensor& t, const char* name, const at::Tensor& param,
                                const char* op = "fused_adam_") {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, op, ": ", name,
              " must be a 1-element float32 tensor; got dtype ", t.scalar_type(), " with ", t.numel(), " elements");
  TORCH_CHECK(t.device() == param.device(), op, ": ", name, " is on ", t.device(), " but param is on ", param.device());
}

inline void check_fused_adam_args(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                  const at::Tensor& exp_avg_sq, int64_t step,
                                  const std::optional<at::Tensor>& grad_scale_tensor,
                                  const std::optional<at::Tensor>& found_inf,
                                  const std::optional<at::Tensor>& param_copy, bool follow_copy) {
  TORCH_CHECK(param.dim() == 1, "fused_adam_: param must be a flat 1-D tensor (use .view(-1)); got shape ",
              param.sizes());
  TORCH_CHECK(param.is_contiguous(), "fused_adam_: param must be contiguous; got stride ", param.strides());
  TORCH_CHECK(param.scalar_type() == at::kFloat, "fused_adam_: param must be float32 (the fp32 master copy); got ",
              param.scalar_type());
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat, "fused_adam_: exp_avg must be float32; got ", exp_avg.scalar_type());
  TORCH_CHECK(exp_avg_sq.scalar_type() == at::kFloat, "fused_adam_: exp_avg_sq must be float32; got ",
              exp_avg_sq.scalar_type());
  TORCH_CHECK(is_low_or_float(grad.scalar_type()), "fused_adam_: grad must be float32, bfloat16 or float16; got ",
              grad.scalar_type());
  check_flat(grad, "grad", param);
  check_flat(exp_avg, "exp_avg", param);
  check_flat(exp_avg_sq, "exp_avg_sq", param);
  TORCH_CHECK(step >= 1, "fused_adam_: step counts from 1 (the bias corrections divide by 1 - beta^step); got ", step);
  if (grad_scale_tensor.has_value()) check_scalar_tensor(*grad_scale_tensor, "grad_scale", param);
  if (found_inf.has_value()) check_scalar_tensor(*found_inf, "found_inf", param);
  if (param_copy.has_value()) {
    TORCH_CHECK(is_low_or_float(param_copy->scalar_type()),
                "fused_adam_: param_copy must be float32, bfloat16 or float16; got ", param_copy->scalar_type());
    check_flat(*param_copy, "param_copy", param);
  }
  TORCH_CHECK(!follow_copy || param_copy.has_value(), "fused_adam_: follow_copy=True reads param_copy, which is None");
}

// fused_adam_8bit_: the same parameter, gradient and optional arguments as fused_adam_, and the
// 8-bit state ([Note: quantized state] in zerofast/quant.py).
inline void check_fused_adam8_args(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                   const at::Tensor& exp_avg_sq, const at::Tensor& exp_avg_scale,
                                   const at::Tensor& exp_avg_sq_scale, const at::Tensor& exp_avg_code,
                                   const at::Tensor& exp_avg_sq_code, int64_t block, int64_t step,
                                   const std::optional<at::Tensor>& grad_scale_tensor,
                                   const std::optional<at::Tensor>& found_inf,
                                   const std::optional<at::Tensor>& param_copy, bool follow_copy) {
  constexpr const char* op = "fused_adam_8bit_";
  TORCH_CHECK(param.dim() == 1 && param.is_contiguous() && param.scalar_type() == at::kFloat, op,
              ": param must be a flat contiguous float32 tensor (the fp32 master copy); got dtype ",
              param.scalar_type(), " shape ", param.sizes());
  TORCH_CHECK(is_low_or_float(grad.scalar_type()), op, ": grad must be float32, bfloat16 or float16; got ",
              grad.scalar_type());
  check_flat(grad, "grad", param, op);
  TORCH_CHECK(block >= 1, op, ": block must be positive; got ", block);
  const int64_t blocks = (param.numel() + block - 1) / block;
  for (const auto& [t, name] : {std::pair{exp_avg, "exp_avg"}, std::pair{exp_avg_sq, "exp_avg_sq"}}) {
    TORCH_CHECK(t.scalar_type() == at::kByte, op, ": ", name, " must be uint8 (code indices); got ", t.scalar_type());
    check_flat(t, name, param, op);
  }
  for (const auto& [t, name] :
       {std::pair{exp_avg_scale, "exp_avg_scale"}, std::pair{exp_avg_sq_scale, "exp_avg_sq_scale"}}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32; got ", t.scalar_type());
    check_flat(t, name, param, op, blocks);
  }
  for (const auto& [t, name] :
       {std::pair{exp_avg_code, "exp_avg_code"}, std::pair{exp_avg_sq_code, "exp_avg_sq_code"}}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32; got ", t.scalar_type());
    check_flat(t, name, param, op, 256);
  }
  TORCH_CHECK(step >= 1, op, ": step counts from 1 (the bias corrections divide by 1 - beta^step); got ", step);
  if (grad_scale_tensor.has_value()) check_scalar_tensor(*grad_scale_tensor, "grad_scale", param, op);
  if (found_inf.has_value()) check_scalar_tensor(*found_inf, "found_inf", param, op);
  if (param_copy.has_value()) {
    TORCH_CHECK(is_low_or_float(param_copy->scalar_type()), op,
                ": param_copy must be float32, bfloat16 or float16; got ", param_copy->scalar_type());
    check_flat(*param_copy, "param_copy", param, op);
  }
  TORCH_CHECK(!follow_copy || param_copy.has_value(), op, ": follow_copy=True reads param_copy, which is None");
}

inline void check_nonfinite_args(const at::Tensor& grad, const at::Tensor& found_inf) {
  TORCH_CHECK(grad.dim() == 1 && grad.is_contiguous(),
              "nonfinite_check_: grad must be a flat contiguous 1-D tensor; got shape ", grad.sizes());
  TORCH_CHECK(is_low_or_float(grad.scalar_type()), "nonfinite_check_: grad must be float32, bfloat16 or float16; got ",
              grad.scalar_type());
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat && found_inf.numel() == 1,
              "nonfinite_check_: found_inf must be a 1-element float32 tensor; got dtype ", found_inf.scalar_type(),
              " with ", found_inf.numel(), " elements");
  TORCH_CHECK(found_inf.device() == grad.device(), "nonfinite_check_: found_inf is on ", found_inf.device(),
              " but grad is on ", grad.device());
}

}  // namespace zerofast
