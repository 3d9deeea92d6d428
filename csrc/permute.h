// Argument checks shared by the CPU and CUDA kernels of the mmh permute ops.
//
// Shape legend:
//   T   tokens                      K   experts chosen per token (top-k)
//   E   experts                     h   hidden size
//   TK  = T * K permuted rows, one per (token, choice) copy
//
// Shape and dtype errors raise ValueError (TORCH_CHECK_VALUE); the values inside
// topk_idx / row_id_map are checked by each kernel where it reads them.
#pragma once

#include <ATen/ATen.h>

namespace mmh {

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK_VALUE(
      s == at::kFloat || s == at::kHalf || s == at::kBFloat16 || s == at::kDouble,
      op, ": ", name, " must be float32, float16, bfloat16 or float64, got ", s);
}

inline void check_2d(const char* op, const char* name, const at::Tensor& t, const char* layout) {
  TORCH_CHECK_VALUE(
      t.dim() == 2, op, ": ", name, " must be a 2-D ", layout, " tensor, got shape ", t.sizes());
}

inline void check_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(
      t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but the data is on ",
      ref.device(), "; move it with .to(", ref.device(), ")");
}

inline void check_row_id_map(const char* op, const at::Tensor& row_id_map, int64_t num_rows) {
  TORCH_CHECK_VALUE(
      row_id_map.scalar_type() == at::kLong && row_id_map.dim() == 1 &&
          row_id_map.numel() == num_rows,
      op, ": row_id_map must be the 1-D int64 [T*K] = [", num_rows,
      "] map returned by permute_fwd, got ", row_id_map.scalar_type(), " of shape ",
      row_id_map.sizes());
}

inline void check_permute_fwd(const at::Tensor& x, const at::Tensor& topk_idx, int64_t num_experts) {
  constexpr const char* op = "permute_fwd";
  check_2d(op, "x", x, "[T, h]");
  check_float(op, "x", x);
  check_2d(op, "topk_idx", topk_idx, "[T, K]");
  TORCH_CHECK_VALUE(
      topk_idx.scalar_type() == at::kLong, op, ": topk_idx must be int64 (call .long() on it), got ",
      topk_idx.scalar_type());
  TORCH_CHECK_VALUE(
      topk_idx.size(0) == x.size(0), op, ": topk_idx has ", topk_idx.size(0),
      " rows but x has ", x.size(0), " tokens; pass one row of expert ids per token");
  TORCH_CHECK_VALUE(topk_idx.size(1) >= 1, op, ": topk_idx needs at least one column (K >= 1)");
  TORCH_CHECK_VALUE(num_experts >= 1, op, ": num_experts must be >= 1, got ", num_experts);
  check_device(op, "topk_idx", topk_idx, x);
}

inline void check_permute_bwd(
    const at::Tensor& grad_permuted, const at::Tensor& row_id_map, int64_t num_tokens, int64_t topk) {
  constexpr const char* op = "permute_bwd";
  TORCH_CHECK_VALUE(
      num_tokens >= 0 && topk >= 1, op, ": num_tokens must be >= 0 and topk >= 1, got ",
      num_tokens, " and ", topk);
  check_2d(op, "grad_permuted", grad_permuted, "[T*K, h]");
  check_float(op, "grad_permuted", grad_permuted);
  TORCH_CHECK_VALUE(
      grad_permuted.size(0) == num_tokens * topk, op, ": grad_permuted has ", grad_permuted.size(0),
      " rows, expected num_tokens * topk = ", num_tokens * topk);
  check_row_id_map(op, row_id_map, num_tokens * topk);
  check_device(op, "row_id_map", row_id_map, grad_permuted);
}

inline void check_unpermute_fwd(const at::Tensor& y, const at::Tensor& row_id_map, const at::Tensor& probs) {
  constexpr const char* op = "unpermute_fwd";
  check_2d(op, "y", y, "[T*K, h]");
  check_float(op, "y", y);
  check_2d(op, "probs", probs, "[T, K]");
  check_float(op, "probs", probs);
  TORCH_CHECK_VALUE(probs.size(1) >= 1, op, ": probs needs at least one column (K >= 1)");
  TORCH_CHECK_VALUE(
      y.size(0) == probs.numel(), op, ": y has ", y.size(0), " rows but probs is ", probs.sizes(),
      "; y must hold the T*K rows that permute_fwd produced");
  check_row_id_map(op, row_id_map, probs.numel());
  check_device(op, "row_id_map", row_id_map, y);
  check_device(op, "probs", probs, y);
}

inline void check_unpermute_bwd(
    const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& row_id_map, const at::Tensor& probs) {
  check_unpermute_fwd(y, row_id_map, probs);
  constexpr const char* op = "unpermute_bwd";
  TORCH_CHECK_VALUE(
      grad_out.dim() == 2 && grad_out.size(0) == probs.size(0) && grad_out.size(1) == y.size(1),
      op, ": grad_out must be [T, h] = [", probs.size(0), ", ", y.size(1), "], got ", grad_out.sizes());
  TORCH_CHECK_VALUE(
      grad_out.scalar_type() == y.scalar_type(), op, ": grad_out must have y's dtype ",
      y.scalar_type(), ", got ", grad_out.scalar_type());
  check_device(op, "grad_out", grad_out, y);
}

}  // namespace mmh
