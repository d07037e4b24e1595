// CPU driver of fused_adam_: argument checks, the parallel loop, and the run-time choice of the
// instruction set whose loop runs (see adam_cpu_loop.h and [Note: one math, many ISAs]).
#include "adam_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "adam_checks.h"

namespace zerofast {
namespace cpu {
namespace {

// Elements per parallel chunk: 64K floats are 256 KiB per state array, so a chunk keeps each
// thread streaming for tens of microseconds, well above the cost of waking a worker; a tensor
// smaller than that runs on the calling thread alone.
constexpr int64_t kGrain = 1 << 16;

Storage storage_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return Storage::kFloat;
    case at::kBFloat16:
      return Storage::kBFloat16;
    case at::kHalf:
      return Storage::kHalf;
    default:
      TORCH_CHECK(false, "zerofast: unsupported storage dtype ", t);
  }
}

bool cpu_has(const char* feature) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (std::strcmp(feature, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma");
  }
  if (std::strcmp(feature, "avx2") == 0) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
#endif
  (void)feature;
  return false;
}

}  // namespace

// ZEROFAST_CPU_ISA=portable|avx2|avx512 forces a loop (asking for one this CPU lacks is an error);
// unset or "auto" takes the widest the CPU supports. Read on every call, so tests can switch it.
Isa selected_isa() {
  const char* env = std::getenv("ZEROFAST_CPU_ISA");
  const std::string want = env ? env : "auto";
  if (want == "portable") return Isa::kPortable;
  if (want == "avx2" || want == "avx512") {
    TORCH_CHECK(cpu_has(want.c_str()), "zerofast: ZEROFAST_CPU_ISA=", want, " but this CPU lacks ", want);
    return want == "avx2" ? Isa::kAvx2 : Isa::kAvx512;
  }
  TORCH_CHECK(want == "auto" || want.empty(),
              "zerofast: ZEROFAST_CPU_ISA must be portable, avx2, avx512 or auto; got '", want, "'");
  if (cpu_has("avx512")) return Isa::kAvx512;
  if (cpu_has("avx2")) return Isa::kAvx2;
  return Isa::kPortable;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kPortable:
      return "portable";
  }
  return "portable";
}

namespace {

IsaKernels kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return avx512_kernels();
    case Isa::kAvx2:
      return avx2_kernels();
    case Isa::kPortable:
      return portable_kernels();
  }
  return portable_kernels();
}

// All or nothing: look at every gradient value before anything is written.
bool any_nonfinite(const IsaKernels& k, const at::Tensor& grad, float grad_scale) {
  std::atomic<bool> found{false};
  const void* data = grad.data_ptr();
  const Storage type = storage_of(grad.scalar_type());
  at::parallel_for(0, grad.numel(), kGrain, [&](int64_t begin, int64_t end) {
    if (!found.load(std::memory_order_relaxed) && k.nonfinite_range(data, type, grad_scale, begin, end)) {
      found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

void fused_adam_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps,
                    double weight_decay, int64_t step, bool adamw, double grad_scale,
                    const std::optional<at::Tensor>& grad_scale_tensor, const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& param_copy, bool follow_copy) {
  check_fused_adam_args(param, grad, exp_avg, exp_avg_sq, step, grad_scale_tensor, found_inf, param_copy, follow_copy);
  AdamScalars s = make_adam_scalars(lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale);
  s.follow_copy = follow_copy;
  // In float, as the CUDA kernel multiplies the device value in: the same bits on both devices.
  if (grad_scale_tensor) s.grad_scale *= grad_scale_tensor->item<float>();
  const IsaKernels k = kernels_for(selected_isa());
  if (found_inf.has_value()) {
    if (any_nonfinite(k, grad, s.grad_scale)) found_inf->fill_(1.0);
    // A value set by an earlier call (another bucket of the same step) skips this one too.
    if (found_inf->item<float>() != 0.0f) return;
  }
  const AdamPointers ptr{param.data_ptr<float>(),
                         grad.data_ptr(),
                         exp_avg.data_ptr<float>(),
                         exp_avg_sq.data_ptr<float>(),
                         param_copy ? param_copy->data_ptr() : nullptr,
                         storage_of(grad.scalar_type()),
                         param_copy ? storage_of(param_copy->scalar_type()) : Storage::kNone};
  at::parallel_for(0, param.numel(), kGrain, [&](int64_t begin, int64_t end) { k.adam_range(ptr, s, begin, end); });
}

// A code's rounding thresholds as the loops read them: the 255 of adam_math.h's code_threshold,
// then +inf, and the table that replaces their search where the code allows it.
struct QuantizeTables {
  std::array<float, kCodeSize> code;  // what they were built from
  std::array<float, kCodeSize> thresholds;
  std::array<int32_t, kTableSize> table;
  bool has_table;

  explicit QuantizeTables(const float* c) {
    std::copy(c, c + kCodeSize, code.begin());
    for (int k = 0; k < kCodeSize - 1; ++k) thresholds[k] = code_threshold(c, k);
    thresholds[kCodeSize - 1] = std::numeric_limits<float>::infinity();
    has_table = build_quantize_table(thresholds.data(), table.data());
  }
  const int32_t* table_or_null() const { return has_table ? table.data() : nullptr; }
};

// The tables of `code`, built once per thread and code: building one costs about 20 us, three times
// the whole step of a small tensor, and a step calls the kernel once per run of parameters with
// the same two codes. The cache is keyed by the code's values, not its tensor, so a code changed
// in place is never served stale tables; it keeps the last few codes (8-bit state has two).
std::shared_ptr<const QuantizeTables> tables_for(const at::Tensor& code) {
  constexpr size_t kCodesKept = 4;
  thread_local std::vector<std::shared_ptr<const QuantizeTables>> cache;
  const float* c = code.data_ptr<float>();
  for (const auto& t : cache) {
    if (std::memcmp(t->code.data(), c, sizeof(float) * kCodeSize) == 0) return t;
  }
  if (cache.size() == kCodesKept) cache.erase(cache.begin());
  cache.push_back(std::make_shared<const QuantizeTables>(c));
  return cache.back();
}

void fused_adam_8bit_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const at::Tensor& exp_avg_scale,
                         const at::Tensor& exp_avg_sq_scale, const at::Tensor& exp_avg_code,
                         const at::Tensor& exp_avg_sq_code, int64_t block, double lr, double beta1, double beta2,
                         double eps, double weight_decay, int64_t step, bool adamw, double grad_scale,
                         const std::optional<at::Tensor>& grad_scale_tensor, const std::optional<at::Tensor>& found_inf,
                         const std::optional<at::Tensor>& param_copy, bool follow_copy) {
  check_fused_adam8_args(param, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, exp_avg_code,
                         exp_avg_sq_code, block, step, grad_scale_tensor, found_inf, param_copy, follow_copy);
  AdamScalars s = make_adam_scalars(lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale);
  s.follow_copy = follow_copy;
  if (grad_scale_tensor) s.grad_scale *= grad_scale_tensor->item<float>();  // as fused_adam_cpu
  const IsaKernels k = kernels_for(selected_isa());
  if (found_inf.has_value()) {
    if (any_nonfinite(k, grad, s.grad_scale)) found_inf->fill_(1.0);
    if (found_inf->item<float>() != 0.0f) return;
  }
  const auto avg = tables_for(exp_avg_code);
  const auto avg_sq = tables_for(exp_avg_sq_code);
  const Adam8Pointers ptr{param.data_ptr<float>(),
                          grad.data_ptr(),
                          exp_avg.data_ptr<uint8_t>(),
                          exp_avg_sq.data_ptr<uint8_t>(),
                          exp_avg_scale.data_ptr<float>(),
                          exp_avg_sq_scale.data_ptr<float>(),
                          exp_avg_code.data_ptr<float>(),
                          exp_avg_sq_code.data_ptr<float>(),
                          avg->thresholds.data(),
                          avg_sq->thresholds.data(),
                          avg->table_or_null(),
                          avg_sq->table_or_null(),
                          param_copy ? param_copy->data_ptr() : nullptr,
                          storage_of(grad.scalar_type()),
                          param_copy ? storage_of(param_copy->scalar_type()) : Storage::kNone,
                          param.numel(),
                          block};
  const int64_t blocks = exp_avg_scale.numel();
  at::parallel_for(0, blocks, std::max<int64_t>(1, kGrain / block),
                   [&](int64_t begin, int64_t end) { k.adam8_range(ptr, s, begin, end); });
}

void nonfinite_check_cpu(const at::Tensor& grad, const at::Tensor& found_inf) {
  check_nonfinite_args(grad, found_inf);
  if (any_nonfinite(kernels_for(selected_isa()), grad, 1.0f)) found_inf.fill_(1.0);
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(zerofast, CPU, m) {
  m.impl("fused_adam_", &cpu::fused_adam_cpu);
  m.impl("fused_adam_8bit_", &cpu::fused_adam_8bit_cpu);
  m.impl("nonfinite_check_", &cpu::nonfinite_check_cpu);
}

}  // namespace zerofast
