// MoE token permutation ops torch.ops.mmh.*: schemas, CPU kernels and the Python module _C.
//
// Shape legend:
//   T   tokens                      K   experts chosen per token (top-k)
//   E   experts                     h   hidden size
//   TK  = T * K permuted rows, one per (token, choice) copy, flat index i = t * K + k
//
// Permuted rows are grouped by expert ascending and, within an expert, by i ascending
// (a stable sort of topk_idx.flatten()); row_id_map[i] is the permuted row of copy i.
// Every sum runs over k = 0..K-1 in order, in fp32 (fp64 for float64 data), so the
// results are deterministic and round like megatron_moe_hybrid's PyTorch reference.
#include <Python.h>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "permute.h"

namespace mmh {
namespace {

// Enough tokens per task that a task moves at least GRAIN_SIZE elements.
int64_t token_grain(int64_t elems_per_token) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, elems_per_token));
}

inline int64_t checked_row(const char* op, int64_t row, int64_t num_rows) {
  TORCH_CHECK_VALUE(
      row >= 0 && row < num_rows, op, ": row_id_map holds row ", row, " outside [0, T*K=",
      num_rows, "); pass the row_id_map that permute_fwd returned");
  return row;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_fwd_cpu(
    const at::Tensor& x, const at::Tensor& topk_idx, int64_t num_experts) {
  check_permute_fwd(x, topk_idx, num_experts);
  const int64_t T = x.size(0), h = x.size(1), K = topk_idx.size(1), TK = T * K;
  const auto x_c = x.contiguous();           // [T, h]
  const auto idx = topk_idx.contiguous();    // [T, K]
  auto tokens_per_expert = at::zeros({num_experts}, idx.options());  // [E]
  auto row_id_map = at::empty({TK}, idx.options());                  // [TK]
  auto permuted = at::empty({TK, h}, x.options());                   // [TK, h]
  const int64_t* p_idx = idx.const_data_ptr<int64_t>();
  int64_t* p_count = tokens_per_expert.data_ptr<int64_t>();
  int64_t* p_map = row_id_map.data_ptr<int64_t>();

  // A counting sort is stable, which is what orders the copies of one expert by i.
  for (int64_t i = 0; i < TK; ++i) {
    const int64_t e = p_idx[i];
    TORCH_CHECK_VALUE(
        e >= 0 && e < num_experts, "permute_fwd: topk_idx holds expert id ", e, " at flat index ", i,
        ", outside [0, num_experts=", num_experts, "); pass the router's num_experts");
    ++p_count[e];
  }
  std::vector<int64_t> next_row(num_experts, 0);  // [E] first free permuted row of each expert
  for (int64_t e = 1; e < num_experts; ++e) next_row[e] = next_row[e - 1] + p_count[e - 1];
  for (int64_t i = 0; i < TK; ++i) p_map[i] = next_row[p_idx[i]]++;

  if (permuted.numel() > 0) {
    // A pure copy: bytes, so one code path serves every dtype.
    const int64_t row_bytes = h * x.element_size();
    const char* src = static_cast<const char*>(x_c.const_data_ptr());
    char* dst = static_cast<char*>(permuted.data_ptr());
    at::parallel_for(0, T, token_grain(K * h), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t k = 0; k < K; ++k) {
          std::memcpy(dst + p_map[t * K + k] * row_bytes, src + t * row_bytes, row_bytes);
        }
      }
    });
  }
  return {permuted, row_id_map, tokens_per_expert};
}

at::Tensor permute_bwd_cpu(
    const at::Tensor& grad_permuted, const at::Tensor& row_id_map, int64_t num_tokens, int64_t topk) {
  check_permute_bwd(grad_permuted, row_id_map, num_tokens, topk);
  const int64_t T = num_tokens, K = topk, TK = T * K, h = grad_permuted.size(1);
  const auto g_c = grad_permuted.contiguous();  // [TK, h]
  const auto map = row_id_map.contiguous();     // [TK]
  auto grad_x = at::empty({T, h}, grad_permuted.options());  // [T, h]
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g_c.scalar_type(), "permute_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* p_g = g_c.const_data_ptr<scalar_t>();
    const int64_t* p_map = map.const_data_ptr<int64_t>();
    scalar_t* p_out = grad_x.data_ptr<scalar_t>();
    at::parallel_for(0, T, token_grain(K * h), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(h);  // [h] one token's sum over its K copies
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t k = 0; k < K; ++k) {
          const scalar_t* g_row = p_g + checked_row("permute_bwd", p_map[t * K + k], TK) * h;
          for (int64_t j = 0; j < h; ++j) acc[j] += static_cast<acc_t>(g_row[j]);
        }
        for (int64_t j = 0; j < h; ++j) p_out[t * h + j] = static_cast<scalar_t>(acc[j]);
      }
    });
  });
  return grad_x;
}

at::Tensor unpermute_fwd_cpu(const at::Tensor& y, const at::Tensor& row_id_map, const at::Tensor& probs) {
  check_unpermute_fwd(y, row_id_map, probs);
  const int64_t T = probs.size(0), K = probs.size(1), TK = T * K, h = y.size(1);
  const auto y_c = y.contiguous();         // [TK, h]
  const auto map = row_id_map.contiguous();  // [TK]
  auto out = at::empty({T, h}, y.options());  // [T, h]
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y_c.scalar_type(), "unpermute_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto w = probs.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();  // [T, K]
    const scalar_t* p_y = y_c.const_data_ptr<scalar_t>();
    const acc_t* p_w = w.const_data_ptr<acc_t>();
    const int64_t* p_map = map.const_data_ptr<int64_t>();
    scalar_t* p_out = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, token_grain(K * h), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(h);  // [h] one token's weighted sum
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t k = 0; k < K; ++k) {
          const acc_t w_tk = p_w[t * K + k];
          const scalar_t* y_row = p_y + checked_row("unpermute_fwd", p_map[t * K + k], TK) * h;
          for (int64_t j = 0; j < h; ++j) acc[j] += w_tk * static_cast<acc_t>(y_row[j]);
        }
        for (int64_t j = 0; j < h; ++j) p_out[t * h + j] = static_cast<scalar_t>(acc[j]);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> unpermute_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& row_id_map, const at::Tensor& probs) {
  check_unpermute_bwd(grad_out, y, row_id_map, probs);
  const int64_t T = probs.size(0), K = probs.size(1), TK = T * K, h = y.size(1);
  const auto g_c = grad_out.contiguous();    // [T, h]
  const auto y_c = y.contiguous();           // [TK, h]
  const auto map = row_id_map.contiguous();  // [TK]
  auto grad_y = at::empty({TK, h}, y.options());  // [TK, h]
  at::Tensor grad_w;                              // [T, K] in the accumulation type
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y_c.scalar_type(), "unpermute_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto w = probs.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();  // [T, K]
    grad_w = at::empty({T, K}, w.options());
    const scalar_t* p_g = g_c.const_data_ptr<scalar_t>();
    const scalar_t* p_y = y_c.const_data_ptr<scalar_t>();
    const acc_t* p_w = w.const_data_ptr<acc_t>();
    const int64_t* p_map = map.const_data_ptr<int64_t>();
    scalar_t* p_gy = grad_y.data_ptr<scalar_t>();
    acc_t* p_gw = grad_w.data_ptr<acc_t>();
    at::parallel_for(0, T, token_grain(K * h), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g_row = p_g + t * h;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t row = checked_row("unpermute_bwd", p_map[t * K + k], TK);
          const acc_t w_tk = p_w[t * K + k];
          acc_t dot = 0;
          for (int64_t j = 0; j < h; ++j) {
            const acc_t g = static_cast<acc_t>(g_row[j]);
            p_gy[row * h + j] = static_cast<scalar_t>(w_tk * g);
            dot += g * static_cast<acc_t>(p_y[row * h + j]);
          }
          p_gw[t * K + k] = dot;
        }
      }
    });
  });
  return {grad_y, grad_w.to(probs.scalar_type())};
}

}  // namespace

TORCH_LIBRARY(mmh, m) {
  m.def(
      "permute_fwd(Tensor x, Tensor topk_idx, int num_experts)"
      " -> (Tensor permuted, Tensor row_id_map, Tensor tokens_per_expert)");
  m.def("permute_bwd(Tensor grad_permuted, Tensor row_id_map, int num_tokens, int topk) -> Tensor");
  m.def("unpermute_fwd(Tensor y, Tensor row_id_map, Tensor probs) -> Tensor");
  m.def(
      "unpermute_bwd(Tensor grad_out, Tensor y, Tensor row_id_map, Tensor probs)"
      " -> (Tensor grad_y, Tensor grad_probs)");
}

TORCH_LIBRARY_IMPL(mmh, CPU, m) {
  m.impl("permute_fwd", &permute_fwd_cpu);
  m.impl("permute_bwd", &permute_bwd_cpu);
  m.impl("unpermute_fwd", &unpermute_fwd_cpu);
  m.impl("unpermute_bwd", &unpermute_bwd_cpu);
}

}  // namespace mmh

#ifdef WITH_CUDA
#define MMH_WITH_CUDA 1
#else
#define MMH_WITH_CUDA 0
#endif

// The module only carries the op registrations above (run when it loads) and says
// whether the CUDA kernels were compiled in.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "megatron_moe_hybrid compiled ops (torch.ops.mmh)", -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && PyModule_AddIntConstant(module, "WITH_CUDA", MMH_WITH_CUDA) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
