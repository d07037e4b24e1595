// CUDA driver of fused_adam_: a vectorized grid-stride kernel on the current stream. The math is
// adam_math.h's; this file only decides how threads walk the flat tensors.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include "adam_checks.h"
#include "adam_math.h"

namespace zerofast {
namespace cuda {
namespace {

// Elements per vector access: 4 floats are one 16-byte load, the widest a thread issues.
constexpr int kVec = 4;
constexpr int kThreads = 256;

C10_DEVICE C10_ALWAYS_INLINE float to_float(float x) { return x; }
C10_DEVICE C10_ALWAYS_INLINE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
C10_DEVICE C10_ALWAYS_INLINE float to_float(__half x) { return __half2float(x); }
C10_DEVICE C10_ALWAYS_INLINE void store(float* out, float x) { *out = x; }
C10_DEVICE C10_ALWAYS_INLINE void store(__nv_bfloat16* out, float x) { *out = __float2bfloat16_rn(x); }
C10_DEVICE C10_ALWAYS_INLINE void store(__half* out, float x) { *out = __float2half_rn(x); }

struct NoCopy {};

// [Note: the master follows the copy] in adam_math.h.
template <typename C>
C10_DEVICE C10_ALWAYS_INLINE float followed(float p, C copy) {
  C rounded;
  store(&rounded, p);
  const float written = to_float(copy);
  return to_float(rounded) == written ? p : written;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T val[N];
};

// One kVec-wide (or, in the tail, 1-wide) group of elements starting at i.
template <int N, typename G, typename C>
C10_DEVICE C10_ALWAYS_INLINE void update_group(float* param, const G* grad, float* exp_avg, float* exp_avg_sq, C* copy,
                                               int64_t i, const AdamScalars& s) {
  Pack<float, N> p = *reinterpret_cast<const Pack<float, N>*>(param + i);
  Pack<float, N> m = *reinterpret_cast<const Pack<float, N>*>(exp_avg + i);
  Pack<float, N> v = *reinterpret_cast<const Pack<float, N>*>(exp_avg_sq + i);
  Pack<G, N> g = *reinterpret_cast<const Pack<G, N>*>(grad + i);
  if constexpr (!std::is_same_v<C, NoCopy>) {
    if (s.follow_copy) {
      const Pack<C, N> c = *reinterpret_cast<const Pack<C, N>*>(copy + i);
#pragma unroll
      for (int k = 0; k < N; ++k) p.val[k] = followed(p.val[k], c.val[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) adam_update(p.val[k], to_float(g.val[k]), m.val[k], v.val[k], s);
  *reinterpret_cast<Pack<float, N>*>(param + i) = p;
  *reinterpret_cast<Pack<float, N>*>(exp_avg + i) = m;
  *reinterpret_cast<Pack<float, N>*>(exp_avg_sq + i) = v;
  if constexpr (!std::is_same_v<C, NoCopy>) {
    Pack<C, N> c;
#pragma unroll
    for (int k = 0; k < N; ++k) store(&c.val[k], p.val[k]);
    *reinterpret_cast<Pack<C, N>*>(copy + i) = c;
  }
}

// `vectorized` is decided on the host: every pointer aligned for kVec-wide access.
template <typename G, typename C>
__global__ void adam_kernel(float* param, const G* grad, float* exp_avg, float* exp_avg_sq, C* copy, int64_t n,
                            AdamScalars s, const float* grad_scale_tensor, const float* found_inf, bool vectorized) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // all or nothing: see check_kernel
  if (grad_scale_tensor != nullptr) s.grad_scale *= *grad_scale_tensor;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (vectorized) {
    const int64_t groups = n / kVec;
    for (int64_t gi = tid; gi < groups; gi += stride) {
      update_group<kVec>(param, grad, exp_avg, exp_avg_sq, copy, gi * kVec, s);
    }
    done = groups * kVec;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    update_group<1>(param, grad, exp_avg, exp_avg_sq, copy, i, s);
  }
}

// Sets *found_inf = 1 when any scaled gradient value is inf or nan. Several threads may store the
// same 1.0f at once; that race is benign. Runs before adam_kernel on the same stream.
template <typename G>
__global__ void check_kernel(const G* grad, int64_t n, float grad_scale, const float* grad_scale_tensor,
                             float* found_inf) {
  const float scale = grad_scale * (grad_scale_tensor != nullptr ? *grad_scale_tensor : 1.0f);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  bool found = false;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    found = found || is_nonfinite(to_float(grad[i]) * scale);
  }
  if (found) *found_inf = 1.0f;
}

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

int blocks_for(int64_t work) {
  // Enough resident blocks to keep every multiprocessor's memory pipeline full; the grid-stride
  // loop covers the rest.
  const int64_t max_blocks = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 8;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, max_blocks)));
}

template <typename G, typename C>
void launch(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
            C* copy, const AdamScalars& s, const float* grad_scale_tensor, float* found_inf) {
  const int64_t n = param.numel();
  auto stream = at::cuda::getCurrentCUDAStream();
  const G* g = reinterpret_cast<const G*>(grad.data_ptr());
  if (found_inf != nullptr) {
    check_kernel<G><<<blocks_for(n), kThreads, 0, stream>>>(g, n, s.grad_scale, grad_scale_tensor, found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const bool vectorized = aligned(param.data_ptr(), 16) && aligned(exp_avg.data_ptr(), 16) &&
                          aligned(exp_avg_sq.data_ptr(), 16) && aligned(g, sizeof(G) * kVec) &&
                          (copy == nullptr || aligned(copy, sizeof(C) * kVec));
  adam_kernel<G, C><<<blocks_for(vectorized ? n / kVec : n), kThreads, 0, stream>>>(
      param.data_ptr<float>(), g, exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), copy, n, s,
      grad_scale_tensor, found_inf, vectorized);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename G>
void launch_for_grad(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_copy, const AdamScalars& s,
                     const float* grad_scale_tensor, float* found_inf) {
  if (!param_copy.has_value()) {
    return launch<G, NoCopy>(param, grad, exp_avg, exp_avg_sq, nullptr, s, grad_scale_tensor, found_inf);
  }
  void* copy = param_copy->data_ptr();
  switch (param_copy->scalar_type()) {
    case at::kFloat:
      return launch<G, float>(param, grad, exp_avg, exp_avg_sq, static_cast<float*>(copy), s, grad_scale_tensor,
                              found_inf);
    case at::kBFloat16:
      return launch<G, __nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, static_cast<__nv_bfloat16*>(copy), s,
                                      grad_scale_tensor, found_inf);
    case at::kHalf:
      return launch<G, __half>(param, grad, exp_avg, exp_avg_sq, static_cast<__half*>(copy), s, grad_scale_tensor,
                               found_inf);
    default:
      TORCH_CHECK(false, "fused_adam_: unsupported param_copy dtype ", param_copy->scalar_type());
  }
}

void fused_adam_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps,
                     double weight_decay, int64_t step, bool adamw, double grad_scale,
                     const std::optional<at::Tensor>& grad_scale_tensor, const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& param_copy, bool follow_copy) {
  check_fused_adam_args(param, grad, exp_avg, exp_avg_sq, step, grad_scale_tensor, found_inf, param_copy, follow_copy);
  if (param.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  AdamScalars s = make_adam_scalars(lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale);
  s.follow_copy = follow_copy;
  const float* scale_ptr = grad_scale_tensor ? grad_scale_tensor->data_ptr<float>() : nullptr;
  float* found_ptr = found_inf ? found_inf->data_ptr<float>() : nullptr;
  switch (grad.scalar_type()) {
    case at::kFloat:
      return launch_for_grad<float>(param, grad, exp_avg, exp_avg_sq, param_copy, s, scale_ptr, found_ptr);
    case at::kBFloat16:
      return launch_for_grad<__nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, param_copy, s, scale_ptr, found_ptr);
    case at::kHalf:
      return launch_for_grad<__half>(param, grad, exp_avg, exp_avg_sq, param_copy, s, scale_ptr, found_ptr);
    default:
      TORCH_CHECK(false, "fused_adam_: unsupported grad dtype ", grad.scalar_type());
  }
}

// --- 8-bit state: one warp per quantization block ([Note: quantized state] in zerofast/quant.py) ---
// Lane l handles elements l, l + 32, ... of its block (each warp access is 32 consecutive elements);
// the block's new scales are warp-shuffle maxima, exact and order-free as the CPU's reduction.
constexpr int kWarp = 32;

struct Adam8Args {
  float* param;
  uint8_t* exp_avg;
  uint8_t* exp_avg_sq;
  float* exp_avg_scale;
  float* exp_avg_sq_scale;
  const float* exp_avg_code;
  const float* exp_avg_sq_code;
  int64_t numel;
  int64_t block;
  int64_t blocks;
};

C10_DEVICE C10_ALWAYS_INLINE float warp_max(float x) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// The master element the 8-bit step starts from (both of its passes read it alike): [Note: the
// master follows the copy].
template <typename C>
C10_DEVICE C10_ALWAYS_INLINE float master_of(float p, const C* copy, int64_t i, const AdamScalars& s) {
  if constexpr (std::is_same_v<C, NoCopy>) {
    return p;
  } else {
    return s.follow_copy ? followed(p, copy[i]) : p;
  }
}

template <typename G, typename C>
__global__ void adam8_kernel(Adam8Args a, const G* grad, C* copy, AdamScalars s, const float* grad_scale_tensor,
                             const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // all or nothing: see check_kernel
  if (grad_scale_tensor != nullptr) s.grad_scale *= *grad_scale_tensor;
  __shared__ float code_avg[kCodeSize], code_avg_sq[kCodeSize];
  __shared__ float thr_avg[kCodeSize - 1], thr_avg_sq[kCodeSize - 1];
  for (int k = threadIdx.x; k < kCodeSize; k += blockDim.x) {
    code_avg[k] = a.exp_avg_code[k];
    code_avg_sq[k] = a.exp_avg_sq_code[k];
  }
  __syncthreads();
  for (int k = threadIdx.x; k < kCodeSize - 1; k += blockDim.x) {
    thr_avg[k] = code_threshold(code_avg, k);
    thr_avg_sq[k] = code_threshold(code_avg_sq, k);
  }
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t blk = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp; blk < a.blocks;
       blk += warps) {
    const int64_t lo = blk * a.block;
    const int64_t hi = lo + a.block < a.numel ? lo + a.block : a.numel;
    const float old_avg = a.exp_avg_scale[blk], old_avg_sq = a.exp_avg_sq_scale[blk];
    float max_avg = 0.0f, max_avg_sq = 0.0f;
    for (int64_t i = lo + lane; i < hi; i += kWarp) {
      const AdamElement e = adam_moments(master_of(a.param[i], copy, i, s), to_float(grad[i]),
                                         dequantize(a.exp_avg[i], old_avg, code_avg),
                                         dequantize(a.exp_avg_sq[i], old_avg_sq, code_avg_sq), s);
      max_avg = fmaxf(max_avg, scale_magnitude(e.exp_avg));
      max_avg_sq = fmaxf(max_avg_sq, scale_magnitude(e.exp_avg_sq));
    }
    max_avg = warp_max(max_avg);
    max_avg_sq = warp_max(max_avg_sq);
    for (int64_t i = lo + lane; i < hi; i += kWarp) {
      const AdamElement e = adam_moments(master_of(a.param[i], copy, i, s), to_float(grad[i]),
                                         dequantize(a.exp_avg[i], old_avg, code_avg),
                                         dequantize(a.exp_avg_sq[i], old_avg_sq, code_avg_sq), s);
      const float p = adam_param(e, s);
      a.param[i] = p;
      a.exp_avg[i] = quantize(e.exp_avg, max_avg, thr_avg);
      a.exp_avg_sq[i] = quantize(e.exp_avg_sq, max_avg_sq, thr_avg_sq);
      if constexpr (!std::is_same_v<C, NoCopy>) store(&copy[i], p);
    }
    if (lane == 0) {
      a.exp_avg_scale[blk] = max_avg;
      a.exp_avg_sq_scale[blk] = max_avg_sq;
    }
  }
}

template <typename G, typename C>
void launch8(const Adam8Args& a, const G* grad, C* copy, const AdamScalars& s, const float* grad_scale_tensor,
             float* found_inf) {
  auto stream = at::cuda::getCurrentCUDAStream();
  if (found_inf != nullptr) {
    check_kernel<G>
        <<<blocks_for(a.numel), kThreads, 0, stream>>>(grad, a.numel, s.grad_scale, grad_scale_tensor, found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  adam8_kernel<G, C>
      <<<blocks_for(a.blocks * kWarp), kThreads, 0, stream>>>(a, grad, copy, s, grad_scale_tensor, found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename G>
void launch8_for_grad(const Adam8Args& a, const at::Tensor& grad, const std::optional<at::Tensor>& param_copy,
                      const AdamScalars& s, const float* grad_scale_tensor, float* found_inf) {
  const G* g = reinterpret_cast<const G*>(grad.data_ptr());
  if (!param_copy.has_value()) return launch8<G, NoCopy>(a, g, nullptr, s, grad_scale_tensor, found_inf);
  void* copy = param_copy->data_ptr();
  switch (param_copy->scalar_type()) {
    case at::kFloat:
      return launch8<G, float>(a, g, static_cast<float*>(copy), s, grad_scale_tensor, found_inf);
    case at::kBFloat16:
      return launch8<G, __nv_bfloat16>(a, g, static_cast<__nv_bfloat16*>(copy), s, grad_scale_tensor, found_inf);
    case at::kHalf:
      return launch8<G, __half>(a, g, static_cast<__half*>(copy), s, grad_scale_tensor, found_inf);
    default:
      TORCH_CHECK(false, "fused_adam_8bit_: unsupported param_copy dtype ", param_copy->scalar_type());
  }
}

void fused_adam_8bit_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const at::Tensor& exp_avg_scale,
                          const at::Tensor& exp_avg_sq_scale, const at::Tensor& exp_avg_code,
                          const at::Tensor& exp_avg_sq_code, int64_t block, double lr, double beta1, double beta2,
                          double eps, double weight_decay, int64_t step, bool adamw, double grad_scale,
                          const std::optional<at::Tensor>& grad_scale_tensor,
                          const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& param_copy,
                          bool follow_copy) {
  check_fused_adam8_args(param, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, exp_avg_code,
                         exp_avg_sq_code, block, step, grad_scale_tensor, found_inf, param_copy, follow_copy);
  if (param.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  AdamScalars s = make_adam_scalars(lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale);
  s.follow_copy = follow_copy;
  const Adam8Args a{param.data_ptr<float>(),
                    exp_avg.data_ptr<uint8_t>(),
                    exp_avg_sq.data_ptr<uint8_t>(),
                    exp_avg_scale.data_ptr<float>(),
                    exp_avg_sq_scale.data_ptr<float>(),
                    exp_avg_code.data_ptr<float>(),
                    exp_avg_sq_code.data_ptr<float>(),
                    param.numel(),
                    block,
                    exp_avg_scale.numel()};
  const float* scale_ptr = grad_scale_tensor ? grad_scale_tensor->data_ptr<float>() : nullptr;
  float* found_ptr = found_inf ? found_inf->data_ptr<float>() : nullptr;
  switch (grad.scalar_type()) {
    case at::kFloat:
      return launch8_for_grad<float>(a, grad, param_copy, s, scale_ptr, found_ptr);
    case at::kBFloat16:
      return launch8_for_grad<__nv_bfloat16>(a, grad, param_copy, s, scale_ptr, found_ptr);
    case at::kHalf:
      return launch8_for_grad<__half>(a, grad, param_copy, s, scale_ptr, found_ptr);
    default:
      TORCH_CHECK(false, "fused_adam_8bit_: unsupported grad dtype ", grad.scalar_type());
  }
}

template <typename G>
void launch_check(const at::Tensor& grad, float* found_inf) {
  const int64_t n = grad.numel();
  check_kernel<G><<<blocks_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const G*>(grad.data_ptr()), n, 1.0f, nullptr, found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void nonfinite_check_cuda(const at::Tensor& grad, const at::Tensor& found_inf) {
  check_nonfinite_args(grad, found_inf);
  if (grad.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  float* found = found_inf.data_ptr<float>();
  switch (grad.scalar_type()) {
    case at::kFloat:
      return launch_check<float>(grad, found);
    case at::kBFloat16:
      return launch_check<__nv_bfloat16>(grad, found);
    case at::kHalf:
      return launch_check<__half>(grad, found);
    default:
      TORCH_CHECK(false, "nonfinite_check_: unsupported grad dtype ", grad.scalar_type());
  }
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(zerofast, CUDA, m) {
  m.impl("fused_adam_", &cuda::fused_adam_cuda);
  m.impl("fused_adam_8bit_", &cuda::fused_adam_8bit_cuda);
  m.impl("nonfinite_check_", &cuda::nonfinite_check_cuda);
}

}  // namespace zerofast
