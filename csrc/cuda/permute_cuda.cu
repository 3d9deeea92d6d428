// CUDA kernels for the torch.ops.mmh permute ops (same semantics as csrc/permute.cpp).
//
// Shape legend:
//   T   tokens                      K   experts chosen per token (top-k)
//   E   experts                     h   hidden size
//   TK  = T * K permuted rows, one per (token, choice) copy, flat index i = t * K + k
//
// One thread block per token; its threads stride over h. Sums run over k in order and
// the grad_probs dot product uses a fixed reduction tree, so every run gives the same bits.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../permute.h"

namespace mmh {
namespace {

constexpr int kThreads = 256;

// The stable sort gives order[r] = the flat index that lands in row r; row_id_map inverts it.
__global__ void invert_order_kernel(
    const int64_t* __restrict__ sorted_expert, const int64_t* __restrict__ order, int64_t num_rows,
    int64_t num_experts, int64_t* __restrict__ row_id_map) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= num_rows) return;
  CUDA_KERNEL_ASSERT(sorted_expert[r] >= 0 && sorted_expert[r] < num_experts);
  row_id_map[order[r]] = r;
}

template <typename scalar_t>
__global__ void permute_fwd_kernel(
    const scalar_t* __restrict__ x, const int64_t* __restrict__ row_id_map, int64_t K, int64_t h,
    scalar_t* __restrict__ permuted) {
  const int64_t t = blockIdx.x;
  const scalar_t* x_row = x + t * h;
  for (int64_t k = 0; k < K; ++k) {
    scalar_t* dst = permuted + row_id_map[t * K + k] * h;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) dst[j] = x_row[j];
  }
}

template <typename scalar_t, typename acc_t>
__global__ void permute_bwd_kernel(
    const scalar_t* __restrict__ grad_permuted, const int64_t* __restrict__ row_id_map, int64_t K,
    int64_t h, scalar_t* __restrict__ grad_x) {
  const int64_t t = blockIdx.x;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    acc_t acc = 0;
    for (int64_t k = 0; k < K; ++k) acc += static_cast<acc_t>(grad_permuted[row_id_map[t * K + k] * h + j]);
    grad_x[t * h + j] = static_cast<scalar_t>(acc);
  }
}

template <typename scalar_t, typename acc_t>
__global__ void unpermute_fwd_kernel(
    const scalar_t* __restrict__ y, const int64_t* __restrict__ row_id_map, const acc_t* __restrict__ probs,
    int64_t K, int64_t h, scalar_t* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    acc_t acc = 0;
    for (int64_t k = 0; k < K; ++k) {
      acc += probs[t * K + k] * static_cast<acc_t>(y[row_id_map[t * K + k] * h + j]);
    }
    out[t * h + j] = static_cast<scalar_t>(acc);
  }
}

// Launched with exactly kThreads threads: the reduction tree below assumes it.
template <typename scalar_t, typename acc_t>
__global__ void unpermute_bwd_kernel(
    const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ y,
    const int64_t* __restrict__ row_id_map, const acc_t* __restrict__ probs, int64_t K, int64_t h,
    scalar_t* __restrict__ grad_y, acc_t* __restrict__ grad_probs) {
  __shared__ acc_t partial[kThreads];  // [kThreads] per-thread parts of one dot product
  const int64_t t = blockIdx.x;
  const scalar_t* g_row = grad_out + t * h;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t row = row_id_map[t * K + k];
    const acc_t w = probs[t * K + k];
    acc_t dot = 0;
    for (int64_t j = threadIdx.x; j < h; j += kThreads) {
      const acc_t g = static_cast<acc_t>(g_row[j]);
      grad_y[row * h + j] = static_cast<scalar_t>(w * g);
      dot += g * static_cast<acc_t>(y[row * h + j]);
    }
    partial[threadIdx.x] = dot;
    __syncthreads();
    for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
      if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
      __syncthreads();
    }
    if (threadIdx.x == 0) grad_probs[t * K + k] = partial[0];
    __syncthreads();  // partial[0] is read before the next k overwrites it
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_fwd_cuda(
    const at::Tensor& x, const at::Tensor& topk_idx, int64_t num_experts) {
  check_permute_fwd(x, topk_idx, num_experts);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t T = x.size(0), h = x.size(1), K = topk_idx.size(1), TK = T * K;
  const auto flat = topk_idx.reshape({-1}).contiguous();                        // [TK]
  auto row_id_map = at::empty({TK}, flat.options());                            // [TK]
  auto tokens_per_expert = at::zeros({num_experts}, flat.options());           // [E]
  auto permuted = at::empty({TK, h}, x.options());                              // [TK, h]
  if (TK == 0) return {permuted, row_id_map, tokens_per_expert};

  const auto [sorted_expert, order] = at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  // Counts from the sorted ids by binary search: no atomics, so deterministic.
  const auto bounds = at::searchsorted(sorted_expert, at::arange(num_experts + 1, flat.options()));  // [E + 1]
  tokens_per_expert.copy_(bounds.slice(0, 1) - bounds.slice(0, 0, num_experts));

  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = (TK + kThreads - 1) / kThreads;
  invert_order_kernel<<<blocks, kThreads, 0, stream>>>(
      sorted_expert.const_data_ptr<int64_t>(), order.const_data_ptr<int64_t>(), TK, num_experts,
      row_id_map.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto x_c = x.contiguous();  // [T, h]
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_c.scalar_type(), "permute_fwd_cuda", [&] {
    permute_fwd_kernel<scalar_t><<<T, kThreads, 0, stream>>>(
        x_c.const_data_ptr<scalar_t>(), row_id_map.const_data_ptr<int64_t>(), K, h,
        permuted.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {permuted, row_id_map, tokens_per_expert};
}

at::Tensor permute_bwd_cuda(
    const at::Tensor& grad_permuted, const at::Tensor& row_id_map, int64_t num_tokens, int64_t topk) {
  check_permute_bwd(grad_permuted, row_id_map, num_tokens, topk);
  const c10::cuda::CUDAGuard guard(grad_permuted.device());
  const int64_t T = num_tokens, K = topk, h = grad_permuted.size(1);
  const auto g_c = grad_permuted.contiguous();  // [TK, h]
  const auto map = row_id_map.contiguous();     // [TK]
  auto grad_x = at::empty({T, h}, grad_permuted.options());  // [T, h]
  if (T == 0) return grad_x;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g_c.scalar_type(), "permute_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    permute_bwd_kernel<scalar_t, acc_t><<<T, kThreads, 0, stream>>>(
        g_c.const_data_ptr<scalar_t>(), map.const_data_ptr<int64_t>(), K, h, grad_x.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_x;
}

at::Tensor unpermute_fwd_cuda(const at::Tensor& y, const at::Tensor& row_id_map, const at::Tensor& probs) {
  check_unpermute_fwd(y, row_id_map, probs);
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t T = probs.size(0), K = probs.size(1), h = y.size(1);
  const auto y_c = y.contiguous();           // [TK, h]
  const auto map = row_id_map.contiguous();  // [TK]
  auto out = at::empty({T, h}, y.options());  // [T, h]
  if (T == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y_c.scalar_type(), "unpermute_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto w = probs.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();  // [T, K]
    unpermute_fwd_kernel<scalar_t, acc_t><<<T, kThreads, 0, stream>>>(
        y_c.const_data_ptr<scalar_t>(), map.const_data_ptr<int64_t>(), w.const_data_ptr<acc_t>(), K, h,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> unpermute_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& row_id_map, const at::Tensor& probs) {
  check_unpermute_bwd(grad_out, y, row_id_map, probs);
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t T = probs.size(0), K = probs.size(1), h = y.size(1);
  const auto g_c = grad_out.contiguous();    // [T, h]
  const auto y_c = y.contiguous();           // [TK, h]
  const auto map = row_id_map.contiguous();  // [TK]
  auto grad_y = at::empty({T * K, h}, y.options());  // [TK, h]
  at::Tensor grad_w;                                 // [T, K] in the accumulation type
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y_c.scalar_type(), "unpermute_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto w = probs.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();  // [T, K]
    grad_w = at::empty({T, K}, w.options());
    if (T == 0) return;
    unpermute_bwd_kernel<scalar_t, acc_t><<<T, kThreads, 0, stream>>>(
        g_c.const_data_ptr<scalar_t>(), y_c.const_data_ptr<scalar_t>(), map.const_data_ptr<int64_t>(),
        w.const_data_ptr<acc_t>(), K, h, grad_y.data_ptr<scalar_t>(), grad_w.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {grad_y, grad_w.to(probs.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(mmh, CUDA, m) {
  m.impl("permute_fwd", &permute_fwd_cuda);
  m.impl("permute_bwd", &permute_bwd_cuda);
  m.impl("unpermute_fwd", &unpermute_fwd_cuda);
  m.impl("unpermute_bwd", &unpermute_bwd_cuda);
}

}  // namespace mmh
