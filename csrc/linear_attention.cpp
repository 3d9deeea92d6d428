// Linear-attention recurrence ops torch.ops.mmh.recurrent_fwd / recurrent_bwd: schemas and
// the CPU twin of csrc/cuda/linear_attention_cuda.cu (shapes and math in linear_attention.h).
//
// The CPU twin is written for clarity: it casts the inputs to the accumulation dtype (fp32,
// fp64 for fp64 inputs) and runs the recurrence of each (sequence, value head) in the order
// of megatron_moe_hybrid/ops/linear_attention/reference.py, so fp64 results match it to
// rounding. It is the CUDA kernel's reference on the GPU machine and a fast CPU path.
//
// Backward: the state before step t is needed in reverse order, and inverting a step
// (dividing by exp(g_t)) is unstable when exp(g_t) is small, so the forward stores the state
// every C = checkpoint_every steps and the backward, chunk by chunk from the last, recomputes
// the chunk's C decayed states S'_t = exp(g_t) S_{t-1} from its checkpoint, then walks the
// chunk backwards with them:
//   dS_t += (scale q_t) do_t^T;  du = dS_t^T k_t;  dv = beta du;  dbeta = du . (v_t - S'^T k_t)
//   dk = dS_t u_t - beta S' du;  dS' = dS_t - beta k_t du^T;  dg = <dS', S'>;  dS_{t-1} = e^g dS'
// and dq_t = scale S_t do_t is taken during the recompute, where S_t is at hand.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "linear_attention.h"

namespace mmh {
namespace {

struct Span {
  int64_t bos, len;  // flat token range [bos, bos + len) of one sequence
};

inline Span span_of(const int64_t* cu, int64_t n, int64_t T) {
  return cu != nullptr ? Span{cu[n], cu[n + 1] - cu[n]} : Span{n * T, T};
}

// Host copy of cu_seqlens as int64, checked; empty when there is none.
std::vector<int64_t> host_offsets(const char* op, const c10::optional<at::Tensor>& cu_seqlens, const RecurrentDims& d) {
  if (!cu_seqlens.has_value()) return {};
  const auto cu = cu_seqlens->to(at::kLong).contiguous();
  std::vector<int64_t> offsets(cu.const_data_ptr<int64_t>(), cu.const_data_ptr<int64_t>() + cu.numel());
  check_cu_seqlens_values(op, offsets.data(), d.N, d.T);
  return offsets;
}

inline at::Tensor acc_contiguous(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

template <typename acc_t>
struct Inputs {
  const acc_t *q, *k, *v, *g, *beta;  // g, beta may be null
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> recurrent_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& g,
    const c10::optional<at::Tensor>& beta, const c10::optional<at::Tensor>& initial_state,
    const c10::optional<at::Tensor>& cu_seqlens, double scale, bool output_final_state,
    int64_t checkpoint_every, int64_t /*block_layout: CUDA only*/) {
  const auto d = check_recurrent_fwd(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_every);
  const auto offsets = host_offsets("recurrent_fwd", cu_seqlens, d);
  const int64_t C = checkpoint_every;
  const auto opts = q.options().dtype(d.acc);
  const auto qa = acc_contiguous(q, d.acc), ka = acc_contiguous(k, d.acc), va = acc_contiguous(v, d.acc);
  const auto ga = g.has_value() ? acc_contiguous(*g, d.acc) : at::Tensor();
  const auto ba = beta.has_value() ? acc_contiguous(*beta, d.acc) : at::Tensor();
  const auto h0 = initial_state.has_value() ? acc_contiguous(*initial_state, d.acc) : at::Tensor();
  auto o = at::empty({d.B, d.T, d.Hv, d.V}, opts);                                      // [B, T, Hv, V]
  auto ht = output_final_state ? at::empty({d.N, d.Hv, d.K, d.V}, opts) : at::empty({0}, opts);  // [N, Hv, K, V]
  auto ck = at::empty({checkpoint_slots(d, C), d.Hv, d.K, d.V}, opts);                 // [slots, Hv, K, V]
  const int64_t K = d.K, V = d.V, Hqk = d.Hqk, Hv = d.Hv, group = d.Hv / d.Hqk;

  AT_DISPATCH_FLOATING_TYPES(d.acc, "recurrent_fwd_cpu", [&] {
    using acc_t = scalar_t;
    const Inputs<acc_t> in{
        qa.const_data_ptr<acc_t>(), ka.const_data_ptr<acc_t>(), va.const_data_ptr<acc_t>(),
        ga.defined() ? ga.const_data_ptr<acc_t>() : nullptr, ba.defined() ? ba.const_data_ptr<acc_t>() : nullptr};
    const acc_t* p_h0 = h0.defined() ? h0.const_data_ptr<acc_t>() : nullptr;
    acc_t* p_o = o.data_ptr<acc_t>();
    acc_t* p_ht = output_final_state ? ht.data_ptr<acc_t>() : nullptr;
    acc_t* p_ck = C > 0 ? ck.data_ptr<acc_t>() : nullptr;
    const acc_t sc = static_cast<acc_t>(scale);
    at::parallel_for(0, d.N * Hv, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> S(K * V), u(V);  // [K, V] state, [V] written value
      for (int64_t nh = begin; nh < end; ++nh) {
        const int64_t n = nh / Hv, hv = nh % Hv, hqk = hv / group;
        const Span sp = span_of(offsets.empty() ? nullptr : offsets.data(), n, d.T);
        if (p_h0 != nullptr) {
          std::copy_n(p_h0 + nh * K * V, K * V, S.begin());
        } else {
          std::fill(S.begin(), S.end(), acc_t(0));
        }
        for (int64_t t = 0; t < sp.len; ++t) {
          if (p_ck != nullptr && t % C == 0) {
            const int64_t slot = sp.bos / C + n + t / C;
            std::copy(S.begin(), S.end(), p_ck + (slot * Hv + hv) * K * V);
          }
          const int64_t tok = sp.bos + t;
          const acc_t* q_t = in.q + (tok * Hqk + hqk) * K;
          const acc_t* k_t = in.k + (tok * Hqk + hqk) * K;
          const acc_t* v_t = in.v + (tok * Hv + hv) * V;
          if (in.g != nullptr) {
            const acc_t a = std::exp(in.g[tok * Hv + hv]);
            for (auto& s : S) s *= a;
          }
          if (in.beta != nullptr) {
            const acc_t b = in.beta[tok * Hv + hv];
            for (int64_t j = 0; j < V; ++j) u[j] = 0;
            for (int64_t i = 0; i < K; ++i) {
              for (int64_t j = 0; j < V; ++j) u[j] += k_t[i] * S[i * V + j];
            }
            for (int64_t j = 0; j < V; ++j) u[j] = (v_t[j] - u[j]) * b;
          } else {
            std::copy_n(v_t, V, u.begin());
          }
          acc_t* o_t = p_o + (tok * Hv + hv) * V;
          for (int64_t j = 0; j < V; ++j) o_t[j] = 0;
          for (int64_t i = 0; i < K; ++i) {
            const acc_t qi = q_t[i] * sc;
            for (int64_t j = 0; j < V; ++j) {
              S[i * V + j] += k_t[i] * u[j];
              o_t[j] += qi * S[i * V + j];
            }
          }
        }
        if (p_ht != nullptr) std::copy(S.begin(), S.end(), p_ht + nh * K * V);
      }
    });
  });
  return {o.to(v.scalar_type()), ht, ck};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> recurrent_bwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& g,
    const c10::optional<at::Tensor>& beta, const at::Tensor& checkpoints,
    const c10::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,
    const c10::optional<at::Tensor>& grad_final_state, double scale, int64_t checkpoint_every) {
  const auto d = check_recurrent_bwd(q, k, v, g, beta, checkpoints, cu_seqlens, grad_o, grad_final_state, checkpoint_every);
  const auto offsets = host_offsets("recurrent_bwd", cu_seqlens, d);
  const int64_t C = checkpoint_every;
  const auto opts = q.options().dtype(d.acc);
  const auto qa = acc_contiguous(q, d.acc), ka = acc_contiguous(k, d.acc), va = acc_contiguous(v, d.acc);
  const auto ga = g.has_value() ? acc_contiguous(*g, d.acc) : at::Tensor();
  const auto ba = beta.has_value() ? acc_contiguous(*beta, d.acc) : at::Tensor();
  const auto ck = checkpoints.contiguous();
  const auto doa = acc_contiguous(grad_o, d.acc);
  const auto dht = grad_final_state.has_value() ? acc_contiguous(*grad_final_state, d.acc) : at::Tensor();
  // dq, dk sum over the value heads of a group: each task owns one (sequence, qk head).
  auto dq = at::zeros({d.B, d.T, d.Hqk, d.K}, opts);
  auto dk = at::zeros({d.B, d.T, d.Hqk, d.K}, opts);
  auto dv = at::empty({d.B, d.T, d.Hv, d.V}, opts);
  auto dg = g.has_value() ? at::empty({d.B, d.T, d.Hv}, opts) : at::empty({0}, opts);
  auto dbeta = beta.has_value() ? at::empty({d.B, d.T, d.Hv}, opts) : at::empty({0}, opts);
  auto dh0 = at::empty({d.N, d.Hv, d.K, d.V}, opts);
  const int64_t K = d.K, V = d.V, Hqk = d.Hqk, Hv = d.Hv, group = d.Hv / d.Hqk;

  AT_DISPATCH_FLOATING_TYPES(d.acc, "recurrent_bwd_cpu", [&] {
    using acc_t = scalar_t;
    const Inputs<acc_t> in{
        qa.const_data_ptr<acc_t>(), ka.const_data_ptr<acc_t>(), va.const_data_ptr<acc_t>(),
        ga.defined() ? ga.const_data_ptr<acc_t>() : nullptr, ba.defined() ? ba.const_data_ptr<acc_t>() : nullptr};
    const acc_t* p_ck = ck.const_data_ptr<acc_t>();
    const acc_t* p_do = doa.const_data_ptr<acc_t>();
    const acc_t* p_dht = dht.defined() ? dht.const_data_ptr<acc_t>() : nullptr;
    acc_t* p_dq = dq.data_ptr<acc_t>();
    acc_t* p_dk = dk.data_ptr<acc_t>();
    acc_t* p_dv = dv.data_ptr<acc_t>();
    acc_t* p_dg = g.has_value() ? dg.data_ptr<acc_t>() : nullptr;
    acc_t* p_db = beta.has_value() ? dbeta.data_ptr<acc_t>() : nullptr;
    acc_t* p_dh0 = dh0.data_ptr<acc_t>();
    const acc_t sc = static_cast<acc_t>(scale);
    at::parallel_for(0, d.N * Hqk, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> S(K * V), dS(K * V);          // [K, V]
      std::vector<acc_t> Sp(C * K * V);                // [C, K, V] decayed states S'_t of one chunk
      std::vector<acc_t> r(C * V), u(C * V), du(V);    // [C, V] v_t - S'^T k_t and u_t; [V]
      for (int64_t nh = begin; nh < end; ++nh) {
        const int64_t n = nh / Hqk, hqk = nh % Hqk;
        const Span sp = span_of(offsets.empty() ? nullptr : offsets.data(), n, d.T);
        for (int64_t hv = hqk * group; hv < (hqk + 1) * group; ++hv) {
          if (p_dht != nullptr) {
            std::copy_n(p_dht + (n * Hv + hv) * K * V, K * V, dS.begin());
          } else {
            std::fill(dS.begin(), dS.end(), acc_t(0));
          }
          for (int64_t j = (sp.len + C - 1) / C - 1; j >= 0; --j) {
            const int64_t t0 = j * C, L = std::min(C, sp.len - t0);
            const int64_t slot = sp.bos / C + n + j;
            std::copy_n(p_ck + (slot * Hv + hv) * K * V, K * V, S.begin());
            // Recompute the chunk: S'_t, u_t, and dq_t = scale S_t do_t.
            for (int64_t s = 0; s < L; ++s) {
              const int64_t tok = sp.bos + t0 + s;
              const acc_t* k_t = in.k + (tok * Hqk + hqk) * K;
              const acc_t* v_t = in.v + (tok * Hv + hv) * V;
              const acc_t* do_t = p_do + (tok * Hv + hv) * V;
              acc_t* Sp_s = Sp.data() + s * K * V;
              acc_t* r_s = r.data() + s * V;
              acc_t* u_s = u.data() + s * V;
              const acc_t a = in.g != nullptr ? std::exp(in.g[tok * Hv + hv]) : acc_t(1);
              for (int64_t e = 0; e < K * V; ++e) Sp_s[e] = S[e] * a;
              if (in.beta != nullptr) {
                const acc_t b = in.beta[tok * Hv + hv];
                for (int64_t jv = 0; jv < V; ++jv) r_s[jv] = 0;
                for (int64_t i = 0; i < K; ++i) {
                  for (int64_t jv = 0; jv < V; ++jv) r_s[jv] += k_t[i] * Sp_s[i * V + jv];
                }
                for (int64_t jv = 0; jv < V; ++jv) {
                  r_s[jv] = v_t[jv] - r_s[jv];
                  u_s[jv] = r_s[jv] * b;
                }
              } else {
                std::copy_n(v_t, V, u_s);
              }
              acc_t* dq_t = p_dq + (tok * Hqk + hqk) * K;
              for (int64_t i = 0; i < K; ++i) {
                acc_t acc = 0;
                for (int64_t jv = 0; jv < V; ++jv) {
                  S[i * V + jv] = Sp_s[i * V + jv] + k_t[i] * u_s[jv];
                  acc += S[i * V + jv] * do_t[jv];
                }
                dq_t[i] += sc * acc;
              }
            }
            // Walk the chunk backwards.
            for (int64_t s = L - 1; s >= 0; --s) {
              const int64_t tok = sp.bos + t0 + s;
              const acc_t* q_t = in.q + (tok * Hqk + hqk) * K;
              const acc_t* k_t = in.k + (tok * Hqk + hqk) * K;
              const acc_t* do_t = p_do + (tok * Hv + hv) * V;
              const acc_t* Sp_s = Sp.data() + s * K * V;
              const acc_t* u_s = u.data() + s * V;
              for (int64_t i = 0; i < K; ++i) {
                const acc_t qi = q_t[i] * sc;
                for (int64_t jv = 0; jv < V; ++jv) dS[i * V + jv] += qi * do_t[jv];
              }
              for (int64_t jv = 0; jv < V; ++jv) du[jv] = 0;
              for (int64_t i = 0; i < K; ++i) {
                for (int64_t jv = 0; jv < V; ++jv) du[jv] += dS[i * V + jv] * k_t[i];
              }
              const acc_t b = in.beta != nullptr ? in.beta[tok * Hv + hv] : acc_t(1);
              acc_t* dv_t = p_dv + (tok * Hv + hv) * V;
              for (int64_t jv = 0; jv < V; ++jv) dv_t[jv] = b * du[jv];
              acc_t* dk_t = p_dk + (tok * Hqk + hqk) * K;
              for (int64_t i = 0; i < K; ++i) {
                acc_t acc = 0;
                for (int64_t jv = 0; jv < V; ++jv) acc += dS[i * V + jv] * u_s[jv];
                dk_t[i] += acc;
              }
              if (in.beta != nullptr) {
                // u = beta (v - S'^T k): dp = -beta du feeds k, S' and beta.
                const acc_t* r_s = r.data() + s * V;
                acc_t db = 0;
                for (int64_t jv = 0; jv < V; ++jv) {
                  db += du[jv] * r_s[jv];
                  du[jv] *= -b;  // now dp
                }
                p_db[tok * Hv + hv] = db;
                for (int64_t i = 0; i < K; ++i) {
                  acc_t acc = 0;
                  for (int64_t jv = 0; jv < V; ++jv) {
                    acc += Sp_s[i * V + jv] * du[jv];
                    dS[i * V + jv] += k_t[i] * du[jv];  // now dS'
                  }
                  dk_t[i] += acc;
                }
              }
              if (in.g != nullptr) {
                acc_t dg_t = 0;
                for (int64_t e = 0; e < K * V; ++e) dg_t += dS[e] * Sp_s[e];
                p_dg[tok * Hv + hv] = dg_t;
                const acc_t a = std::exp(in.g[tok * Hv + hv]);
                for (auto& x : dS) x *= a;
              }
            }
          }
          std::copy(dS.begin(), dS.end(), p_dh0 + (n * Hv + hv) * K * V);
        }
      }
    });
  });
  const auto dtype = q.scalar_type();
  return {dq.to(dtype), dk.to(dtype), dv.to(dtype), dg, dbeta, dh0};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mmh, m) {
  m.def(
      "recurrent_fwd(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? initial_state,"
      " Tensor? cu_seqlens, float scale, bool output_final_state, int checkpoint_every, int block_layout=0)"
      " -> (Tensor o, Tensor final_state, Tensor checkpoints)");
  m.def(
      "recurrent_bwd(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor checkpoints,"
      " Tensor? cu_seqlens, Tensor grad_o, Tensor? grad_final_state, float scale, int checkpoint_every)"
      " -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor dh0)");
}

TORCH_LIBRARY_IMPL(mmh, CPU, m) {
  m.impl("recurrent_fwd", &recurrent_fwd_cpu);
  m.impl("recurrent_bwd", &recurrent_bwd_cpu);
}

}  // namespace mmh
