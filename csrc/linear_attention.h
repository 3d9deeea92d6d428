// Argument checks and index helpers shared by the CPU and CUDA kernels of the mmh
// linear-attention recurrence ops (recurrent_fwd / recurrent_bwd).
//
// Shape legend:
//   B batch, T time, Hqk query/key heads, Hv value heads (a multiple of Hqk: grouped value
//   heads), K query/key head dim, V value head dim, N sequences (B, or the number of
//   cu_seqlens segments when B == 1 holds packed sequences), C checkpoint interval (steps).
//   q, k [B, T, Hqk, K]; v, o [B, T, Hv, V]; g, beta [B, T, Hv]; states [N, Hv, K, V].
//
// The recurrence, per sequence and value head, with a state S [K, V] in fp32 (fp64 for
// fp64 inputs) and value head hv reading query/key head hv / (Hv / Hqk):
//   S' = exp(g_t) S;  u_t = beta_t (v_t - S'^T k_t)  (u_t = v_t without beta);
//   S = S' + k_t u_t^T;  o_t = S^T (scale q_t).
//
// Checkpoints: the forward can store the state entering steps 0, C, 2C, ... of every
// sequence; the backward recomputes each C-step chunk from its checkpoint. Sequence n,
// starting at flat token bos_n (= n T without cu_seqlens), stores chunk j in slot
// bos_n / C + n + j of a [B T / C + N, Hv, K, V] tensor: the slots of consecutive sequences
// never overlap (sum over m < n of ceil(len_m / C) <= bos_n / C + n), and no pass over
// cu_seqlens is needed to find them.
#pragma once

#include <ATen/ATen.h>

namespace mmh {

struct RecurrentDims {
  int64_t B, T, Hqk, Hv, K, V, N;
  bool varlen;
  at::ScalarType acc;  // kFloat, or kDouble for fp64 inputs
};

inline int64_t checkpoint_slots(const RecurrentDims& d, int64_t every) {
  return every > 0 ? d.B * d.T / every + d.N : 0;
}

inline void check_la_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(
      t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but q is on ", ref.device(),
      "; move it with .to(", ref.device(), ")");
}

inline void check_la_shape(
    const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected, const char* layout) {
  TORCH_CHECK_VALUE(
      t.sizes() == expected, op, ": ", name, " must be ", layout, " = ", expected, ", got ", t.sizes());
}

inline void check_la_float(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK_VALUE(
      s == at::kFloat || s == at::kHalf || s == at::kBFloat16 || s == at::kDouble, op, ": ", name,
      " must be float32, float16, bfloat16 or float64, got ", s);
}

// Checks what both ops take; returns the dimensions.
inline RecurrentDims check_recurrent_common(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& g, const c10::optional<at::Tensor>& beta,
    const c10::optional<at::Tensor>& cu_seqlens) {
  TORCH_CHECK_VALUE(q.dim() == 4, op, ": q must be [B, T, Hqk, K], got shape ", q.sizes());
  check_la_float(op, "q", q);
  RecurrentDims d{};
  d.B = q.size(0);
  d.T = q.size(1);
  d.Hqk = q.size(2);
  d.K = q.size(3);
  d.acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  check_la_shape(op, "k", k, q.sizes(), "[B, T, Hqk, K] like q");
  TORCH_CHECK_VALUE(
      k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
      ": k and v must have q's dtype ", q.scalar_type(), ", got ", k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK_VALUE(
      v.dim() == 4 && v.size(0) == d.B && v.size(1) == d.T, op, ": v must be [B, T, Hv, V] with B, T = ",
      d.B, ", ", d.T, ", got shape ", v.sizes());
  d.Hv = v.size(2);
  d.V = v.size(3);
  TORCH_CHECK_VALUE(
      d.Hqk >= 1 && d.Hv % d.Hqk == 0, op, ": v's heads Hv=", d.Hv,
      " must be a positive multiple of q's heads Hqk=", d.Hqk, " (grouped value heads)");
  TORCH_CHECK_VALUE(d.K >= 1 && d.V >= 1, op, ": head dims K and V must be >= 1, got ", d.K, " and ", d.V);
  check_la_device(op, "k", k, q);
  check_la_device(op, "v", v, q);
  for (const auto& [name, t] : {std::pair{"g", &g}, std::pair{"beta", &beta}}) {
    if (!t->has_value()) continue;
    check_la_shape(op, name, **t, {d.B, d.T, d.Hv}, "[B, T, Hv]");
    check_la_float(op, name, **t);
    check_la_device(op, name, **t, q);
  }
  d.varlen = cu_seqlens.has_value();
  d.N = d.B;
  if (d.varlen) {
    const auto& cu = *cu_seqlens;
    TORCH_CHECK_VALUE(
        cu.dim() == 1 && cu.numel() >= 2 && (cu.scalar_type() == at::kLong || cu.scalar_type() == at::kInt),
        op, ": cu_seqlens must be a 1-D int64 or int32 [N + 1] tensor with N >= 1, got ", cu.scalar_type(),
        " of shape ", cu.sizes());
    TORCH_CHECK_VALUE(d.B == 1, op, ": cu_seqlens needs B == 1 (packed sequences), got B=", d.B);
    check_la_device(op, "cu_seqlens", cu, q);
    d.N = cu.numel() - 1;
  }
  return d;
}

inline void check_state(
    const char* op, const char* name, const at::Tensor& s, const RecurrentDims& d, const at::Tensor& q) {
  check_la_shape(op, name, s, {d.N, d.Hv, d.K, d.V}, "[N, Hv, K, V]");
  check_la_float(op, name, s);
  check_la_device(op, name, s, q);
}

inline RecurrentDims check_recurrent_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& g,
    const c10::optional<at::Tensor>& beta, const c10::optional<at::Tensor>& initial_state,
    const c10::optional<at::Tensor>& cu_seqlens, int64_t checkpoint_every) {
  constexpr const char* op = "recurrent_fwd";
  const auto d = check_recurrent_common(op, q, k, v, g, beta, cu_seqlens);
  if (initial_state.has_value()) check_state(op, "initial_state", *initial_state, d, q);
  TORCH_CHECK_VALUE(checkpoint_every >= 0, op, ": checkpoint_every must be >= 0, got ", checkpoint_every);
  return d;
}

inline RecurrentDims check_recurrent_bwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& g,
    const c10::optional<at::Tensor>& beta, const at::Tensor& checkpoints,
    const c10::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,
    const c10::optional<at::Tensor>& grad_final_state, int64_t checkpoint_every) {
  constexpr const char* op = "recurrent_bwd";
  const auto d = check_recurrent_common(op, q, k, v, g, beta, cu_seqlens);
  TORCH_CHECK_VALUE(
      checkpoint_every >= 1, op, ": checkpoint_every must be the forward's (>= 1), got ", checkpoint_every);
  check_la_shape(
      op, "checkpoints", checkpoints, {checkpoint_slots(d, checkpoint_every), d.Hv, d.K, d.V},
      "[B T / checkpoint_every + N, Hv, K, V] as recurrent_fwd returned it");
  TORCH_CHECK_VALUE(
      checkpoints.scalar_type() == d.acc, op, ": checkpoints must be ", d.acc,
      " as recurrent_fwd returned them, got ", checkpoints.scalar_type());
  check_la_device(op, "checkpoints", checkpoints, q);
  check_la_shape(op, "grad_o", grad_o, v.sizes(), "[B, T, Hv, V] like v");
  check_la_float(op, "grad_o", grad_o);
  check_la_device(op, "grad_o", grad_o, q);
  if (grad_final_state.has_value()) check_state(op, "grad_final_state", *grad_final_state, d, q);
  return d;
}

// cu_seqlens values (host copy): 0 = c_0 <= c_1 <= ... <= c_N = T.
inline void check_cu_seqlens_values(const char* op, const int64_t* cu, int64_t N, int64_t T) {
  TORCH_CHECK_VALUE(cu[0] == 0 && cu[N] == T, op, ": cu_seqlens must run from 0 to T=", T, ", got ", cu[0], " .. ", cu[N]);
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK_VALUE(cu[n] <= cu[n + 1], op, ": cu_seqlens must be non-decreasing, got ", cu[n], " > ", cu[n + 1]);
  }
}

}  // namespace mmh
