// CUDA kernels for torch.ops.mmh.recurrent_fwd / recurrent_bwd (same semantics as the CPU
// twin in csrc/linear_attention.cpp; shapes, math and checkpoint slots in linear_attention.h).
//
// One block per (sequence, value head, V-slice of BV columns). The columns of the state are
// independent in the recurrence (every dot product runs over K), so a block owns a [K, BV]
// slice of S in registers, in fp32, for the whole sequence. Lane layout (Layout below): a
// warp is 32 / LPC groups of LPC lanes; a group owns CPL adjacent columns and its lane j
// holds rows j, j + LPC, ..., so dots over K are a per-lane partial sum plus a shuffle
// reduction over the group's lanes. A forward step needs one reduction: with
// pk = S^T k, pq = S^T (scale q) and kq = k . (scale q) of the state before the step,
//   u = beta (v - e^g pk),  o = e^g pq + u kq,  S = e^g S + k u^T.
//
// Backward: per C-step chunk, last first (see linear_attention.cpp for the equations), the
// block reloads the chunk's checkpoint, recomputes the chunk keeping the decayed states S'_t
// in shared memory ([C, K, BV] fp32) and taking dq, then walks it backwards. dq, dk, dg and
// dbeta sum over all V columns (and over grouped value heads for dq, dk): each block reduces
// its warps' partials in shared memory and adds them to fp32 buffers with atomicAdd, so
// those four gradients may differ between runs in the last bits (the order of the V-slice
// additions); dv and dh0 are written once and are deterministic.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <type_traits>

#include "../linear_attention.h"

namespace mmh {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr unsigned kFullMask = 0xffffffffu;

template <int LPC_, int CPL_, int KPAD_>
struct Layout {
  static constexpr int LPC = LPC_;            // lanes sharing a set of columns (split K)
  static constexpr int CPL = CPL_;            // columns per lane
  static constexpr int KPAD = KPAD_;          // K rounded up to 32, 64 or 128
  static constexpr int KL = KPAD / LPC;       // rows per lane
  static constexpr int G = 32 / LPC;          // column groups per warp
  static constexpr int BV = kWarps * G * CPL;  // columns per block
  static constexpr int TILE_LD = BV + 1;      // padded row stride of the staging tile
  static_assert(KL >= 1 && 32 % LPC == 0, "bad layout");
};

struct Params {
  const void *q, *k, *v;       // [B, T, Hqk, K], [B, T, Hqk, K], [B, T, Hv, V] in scalar_t
  const float *g, *beta;       // [B, T, Hv] fp32, nullable
  const int64_t* cu;           // [N + 1], nullable
  int64_t T, Hqk, Hv, K, V, NV, group, C;
  float scale;
};

struct FwdOut {
  const float* h0;  // [N, Hv, K, V], nullable
  void* o;          // [B, T, Hv, V] scalar_t
  float* ht;        // [N, Hv, K, V], nullable
  float* ck;        // [slots, Hv, K, V], nullable (C == 0)
};

struct BwdIO {
  const float* ck;   // [slots, Hv, K, V]
  const void* grad_o;  // [B, T, Hv, V] scalar_t
  const float* dht;  // [N, Hv, K, V], nullable
  float *dq, *dk;    // [B, T, Hqk, K] fp32, zeroed (atomics)
  void* dv;          // [B, T, Hv, V] scalar_t
  float *dg, *dbeta;  // [B, T, Hv] fp32, zeroed (atomics), nullable
  float* dh0;        // [N, Hv, K, V]
};

// Where this thread sits: which (sequence, head, slice) and which rows / columns it holds.
template <class L>
struct Place {
  int tid, lane, warp, jl, grp, col_blk;
  int64_t n, hv, hqk, nh, col0, bos, len;

  __device__ Place(const Params& p) {
    tid = threadIdx.x;
    lane = tid & 31;
    warp = tid >> 5;
    jl = lane % L::LPC;
    grp = lane / L::LPC;
    col_blk = (warp * L::G + grp) * L::CPL;
    const int64_t i_v = blockIdx.x % p.NV;
    nh = blockIdx.x / p.NV;
    n = nh / p.Hv;
    hv = nh % p.Hv;
    hqk = hv / p.group;
    col0 = i_v * L::BV;
    if (p.cu != nullptr) {
      bos = p.cu[n];
      len = p.cu[n + 1] - bos;
      CUDA_KERNEL_ASSERT(len >= 0);
    } else {
      bos = n * p.T;
      len = p.T;
    }
  }
  __device__ int row(int i) const { return jl + L::LPC * i; }
  __device__ int64_t col(int c) const { return col0 + col_blk + c; }
};

// Block-wide coalesced copies of a [K, BV] slice of a [K, V] fp32 state through the tile.
template <class L>
__device__ void tile_load(float* tile, const float* src, int64_t K, int64_t V, int64_t col0) {
  for (int e = threadIdx.x; e < L::KPAD * L::BV; e += kThreads) {
    const int r = e / L::BV, c = e % L::BV;
    tile[r * L::TILE_LD + c] = (r < K && col0 + c < V) ? src[r * V + col0 + c] : 0.f;
  }
}

template <class L>
__device__ void tile_store(const float* tile, float* dst, int64_t K, int64_t V, int64_t col0) {
  for (int e = threadIdx.x; e < L::KPAD * L::BV; e += kThreads) {
    const int r = e / L::BV, c = e % L::BV;
    if (r < K && col0 + c < V) dst[r * V + col0 + c] = tile[r * L::TILE_LD + c];
  }
}

template <class L>
__device__ void tile_to_regs(const float* tile, const Place<L>& pl, float (&S)[L::KL][L::CPL]) {
#pragma unroll
  for (int i = 0; i < L::KL; ++i) {
#pragma unroll
    for (int c = 0; c < L::CPL; ++c) S[i][c] = tile[pl.row(i) * L::TILE_LD + pl.col_blk + c];
  }
}

template <class L>
__device__ void regs_to_tile(float* tile, const Place<L>& pl, const float (&S)[L::KL][L::CPL]) {
#pragma unroll
  for (int i = 0; i < L::KL; ++i) {
#pragma unroll
    for (int c = 0; c < L::CPL; ++c) tile[pl.row(i) * L::TILE_LD + pl.col_blk + c] = S[i][c];
  }
}

// One token's inputs as this lane needs them (rows of k, q; columns of v, do).
template <class L>
struct Step {
  float k[L::KL], q[L::KL], v[L::CPL], d[L::CPL], g, b;
};

template <typename scalar_t, class L>
__device__ void load_step(
    Step<L>& s, const Params& p, const Place<L>& pl, int64_t tok, bool want_v, const scalar_t* grad_o) {
  const scalar_t* kp = static_cast<const scalar_t*>(p.k) + (tok * p.Hqk + pl.hqk) * p.K;
  const scalar_t* qp = static_cast<const scalar_t*>(p.q) + (tok * p.Hqk + pl.hqk) * p.K;
  const int64_t vo = (tok * p.Hv + pl.hv) * p.V;
#pragma unroll
  for (int i = 0; i < L::KL; ++i) {
    const int r = pl.row(i);
    const bool in = r < p.K;
    s.k[i] = in ? static_cast<float>(kp[r]) : 0.f;
    s.q[i] = in ? static_cast<float>(qp[r]) * p.scale : 0.f;
  }
#pragma unroll
  for (int c = 0; c < L::CPL; ++c) {
    const int64_t col = pl.col(c);
    const bool in = col < p.V;
    s.v[c] = (want_v && in) ? static_cast<float>(static_cast<const scalar_t*>(p.v)[vo + col]) : 0.f;
    s.d[c] = (grad_o != nullptr && in) ? static_cast<float>(grad_o[vo + col]) : 0.f;
  }
  s.g = p.g != nullptr ? p.g[tok * p.Hv + pl.hv] : 0.f;
  s.b = p.beta != nullptr ? p.beta[tok * p.Hv + pl.hv] : 1.f;
}

// Sums each x[m] over the LPC lanes of this lane's group (xor offsets stay inside the group).
template <int LPC, int M>
__device__ __forceinline__ void group_allreduce(float (&x)[M]) {
#pragma unroll
  for (int off = LPC / 2; off > 0; off >>= 1) {
#pragma unroll
    for (int m = 0; m < M; ++m) x[m] += __shfl_xor_sync(kFullMask, x[m], off);
  }
}

template <typename scalar_t, class L>
__global__ void __launch_bounds__(kThreads) recurrent_fwd_kernel(const Params p, const FwdOut out) {
  __shared__ float tile[L::KPAD * L::TILE_LD];
  const Place<L> pl(p);
  constexpr int KL = L::KL, CPL = L::CPL;
  const int64_t KV = p.K * p.V;
  float S[KL][CPL];  // this lane's rows x columns of the state, fp32
  if (out.h0 != nullptr) {
    tile_load<L>(tile, out.h0 + pl.nh * KV, p.K, p.V, pl.col0);
    __syncthreads();
    tile_to_regs<L>(tile, pl, S);
  } else {
#pragma unroll
    for (int i = 0; i < KL; ++i) {
#pragma unroll
      for (int c = 0; c < CPL; ++c) S[i][c] = 0.f;
    }
  }
  scalar_t* o = static_cast<scalar_t*>(out.o);
  const bool delta = p.beta != nullptr;
  Step<L> cur, nxt;
  if (pl.len > 0) load_step<scalar_t, L>(cur, p, pl, pl.bos, true, nullptr);
  for (int64_t t = 0; t < pl.len; ++t) {
    // Issued now, used next step: the loads overlap this step's arithmetic.
    if (t + 1 < pl.len) load_step<scalar_t, L>(nxt, p, pl, pl.bos + t + 1, true, nullptr);
    if (out.ck != nullptr && t % p.C == 0) {
      float* dst = out.ck + ((pl.bos / p.C + pl.n + t / p.C) * p.Hv + pl.hv) * KV;
#pragma unroll
      for (int i = 0; i < KL; ++i) {
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          if (pl.row(i) < p.K && pl.col(c) < p.V) dst[pl.row(i) * p.V + pl.col(c)] = S[i][c];
        }
      }
    }
    float red[2 * CPL + 1];  // pk[c], pq[c], kq
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      float pk = 0.f, pq = 0.f;
#pragma unroll
      for (int i = 0; i < KL; ++i) {
        pk = fmaf(S[i][c], cur.k[i], pk);
        pq = fmaf(S[i][c], cur.q[i], pq);
      }
      red[c] = pk;
      red[CPL + c] = pq;
    }
    float kq = 0.f;
#pragma unroll
    for (int i = 0; i < KL; ++i) kq = fmaf(cur.k[i], cur.q[i], kq);
    red[2 * CPL] = kq;
    group_allreduce<L::LPC>(red);
    const float a = p.g != nullptr ? expf(cur.g) : 1.f;
    const int64_t tok = pl.bos + t;
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const float u = delta ? cur.b * (cur.v[c] - a * red[c]) : cur.v[c];
      const float o_c = fmaf(u, red[2 * CPL], a * red[CPL + c]);
      if (pl.jl == 0 && pl.col(c) < p.V) o[(tok * p.Hv + pl.hv) * p.V + pl.col(c)] = static_cast<scalar_t>(o_c);
#pragma unroll
      for (int i = 0; i < KL; ++i) S[i][c] = fmaf(cur.k[i], u, a * S[i][c]);
    }
    cur = nxt;
  }
  if (out.ht != nullptr) {
    __syncthreads();  // the tile may still be read by the initial-state load
    regs_to_tile<L>(tile, pl, S);
    __syncthreads();
    tile_store<L>(tile, out.ht + pl.nh * KV, p.K, p.V, pl.col0);
  }
}

// Shared memory of the backward, in floats, for checkpoint interval C.
template <class L>
struct BwdSmem {
  int64_t C;
  __host__ __device__ int64_t sp() const { return 0; }                                         // [C][KL*CPL][kThreads] S'_t
  __host__ __device__ int64_t part() const { return sp() + C * L::KL * L::CPL * kThreads; }  // [C][KL][kThreads] dq / dk partials
  __host__ __device__ int64_t rr() const { return part() + C * L::KL * kThreads; }           // [C][BV] v - S'^T k
  __host__ __device__ int64_t gw() const { return rr() + C * L::BV; }                         // [C][kWarps] dg partials
  __host__ __device__ int64_t bw() const { return gw() + C * kWarps; }                        // [C][kWarps*G] dbeta partials
  __host__ __device__ int64_t tile() const { return bw() + C * kWarps * L::G; }               // [KPAD][BV+1]
  __host__ __device__ int64_t total() const { return tile() + L::KPAD * L::TILE_LD; }
};

// Adds the block's row partials part[s][i][thread] of steps [0, num_steps) to dst rows (fp32 atomics;
// on Hopper 16-byte ones, four rows each, when K allows).
template <class L>
__device__ void flush_rows(
    const float* part, int64_t num_steps, const Params& p, const Place<L>& pl, int64_t tok0, float factor,
    float* dst) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(L::LPC % 4 == 0, "four adjacent rows must sit in one lane group");
  if (p.K % 4 == 0) {
    const int64_t K4 = p.K / 4;
    for (int64_t e = threadIdx.x; e < num_steps * K4; e += kThreads) {
      const int64_t s = e / K4;
      const int r = static_cast<int>(e % K4) * 4;
      const int i = r / L::LPC, j = r % L::LPC;
      const float* src = part + (s * L::KL + i) * kThreads + j;
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < kWarps * L::G; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(src + w * L::LPC);
        sum.x += x.x;
        sum.y += x.y;
        sum.z += x.z;
        sum.w += x.w;
      }
      sum = make_float4(factor * sum.x, factor * sum.y, factor * sum.z, factor * sum.w);
      atomicAdd(reinterpret_cast<float4*>(dst + ((tok0 + s) * p.Hqk + pl.hqk) * p.K + r), sum);
    }
    return;
  }
#endif
  for (int64_t e = threadIdx.x; e < num_steps * p.K; e += kThreads) {
    const int64_t s = e / p.K;
    const int r = static_cast<int>(e % p.K);
    const int i = r / L::LPC, j = r % L::LPC;
    const float* src = part + (s * L::KL + i) * kThreads + j;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps * L::G; ++w) sum += src[w * L::LPC];
    atomicAdd(dst + ((tok0 + s) * p.Hqk + pl.hqk) * p.K + r, factor * sum);
  }
}

template <typename scalar_t, class L>
__global__ void __launch_bounds__(kThreads) recurrent_bwd_kernel(const Params p, const BwdIO io) {
  extern __shared__ float smem[];
  constexpr int KL = L::KL, CPL = L::CPL, NG = kWarps * L::G;
  const BwdSmem<L> lay{p.C};
  float* Sp = smem + lay.sp();
  float* part = smem + lay.part();
  float* rr = smem + lay.rr();
  float* gw = smem + lay.gw();
  float* bw = smem + lay.bw();
  float* tile = smem + lay.tile();
  const Place<L> pl(p);
  const int64_t KV = p.K * p.V, C = p.C;
  const bool delta = p.beta != nullptr, gated = p.g != nullptr;
  const scalar_t* grad_o = static_cast<const scalar_t*>(io.grad_o);
  scalar_t* dv = static_cast<scalar_t*>(io.dv);

  float dS[KL][CPL];  // gradient of the state after the step being walked
  if (io.dht != nullptr) {
    tile_load<L>(tile, io.dht + pl.nh * KV, p.K, p.V, pl.col0);
    __syncthreads();
    tile_to_regs<L>(tile, pl, dS);
  } else {
#pragma unroll
    for (int i = 0; i < KL; ++i) {
#pragma unroll
      for (int c = 0; c < CPL; ++c) dS[i][c] = 0.f;
    }
  }
  float S[KL][CPL];
  for (int64_t j = (pl.len + C - 1) / C - 1; j >= 0; --j) {
    const int64_t t0 = j * C, num_steps = min(C, pl.len - t0), tok0 = pl.bos + t0;
    __syncthreads();  // the previous chunk's flush and tile reads are done
    tile_load<L>(tile, io.ck + ((pl.bos / C + pl.n + j) * p.Hv + pl.hv) * KV, p.K, p.V, pl.col0);
    __syncthreads();
    tile_to_regs<L>(tile, pl, S);

    // Recompute the chunk: S'_t to shared memory, r_t = v_t - S'^T k_t, dq_t partials.
    Step<L> cur, nxt;
    load_step<scalar_t, L>(cur, p, pl, tok0, true, grad_o);
    for (int64_t s = 0; s < num_steps; ++s) {
      if (s + 1 < num_steps) load_step<scalar_t, L>(nxt, p, pl, tok0 + s + 1, true, grad_o);
      const float a = gated ? expf(cur.g) : 1.f;
      float pk[CPL];
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        pk[c] = 0.f;
#pragma unroll
        for (int i = 0; i < KL; ++i) pk[c] = fmaf(S[i][c], cur.k[i], pk[c]);
      }
      if (delta) group_allreduce<L::LPC>(pk);
      float* sp_s = Sp + s * KL * CPL * kThreads + pl.tid;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const float r = cur.v[c] - a * pk[c];
        const float u = delta ? cur.b * r : cur.v[c];
        if (delta && pl.jl == 0) rr[s * L::BV + pl.col_blk + c] = r;
#pragma unroll
        for (int i = 0; i < KL; ++i) {
          const float sp = a * S[i][c];
          sp_s[(i * CPL + c) * kThreads] = sp;
          S[i][c] = fmaf(cur.k[i], u, sp);
        }
      }
#pragma unroll
      for (int i = 0; i < KL; ++i) {
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < CPL; ++c) acc = fmaf(S[i][c], cur.d[c], acc);
        part[(s * KL + i) * kThreads + pl.tid] = acc;
      }
      cur = nxt;
    }
    __syncthreads();
    flush_rows<L>(part, num_steps, p, pl, tok0, p.scale, io.dq);
    __syncthreads();

    // Walk the chunk backwards.
    load_step<scalar_t, L>(cur, p, pl, tok0 + num_steps - 1, !delta, grad_o);
    for (int64_t s = num_steps - 1; s >= 0; --s) {
      if (s > 0) load_step<scalar_t, L>(nxt, p, pl, tok0 + s - 1, !delta, grad_o);
      const float* sp_s = Sp + s * KL * CPL * kThreads + pl.tid;
      float du[CPL];
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        du[c] = 0.f;
#pragma unroll
        for (int i = 0; i < KL; ++i) {
          dS[i][c] = fmaf(cur.q[i], cur.d[c], dS[i][c]);
          du[c] = fmaf(dS[i][c], cur.k[i], du[c]);
        }
      }
      group_allreduce<L::LPC>(du);
      const int64_t tok = tok0 + s;
      float u[CPL], dp[CPL], db = 0.f;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const float r = delta ? rr[s * L::BV + pl.col_blk + c] : 0.f;
        u[c] = delta ? cur.b * r : cur.v[c];
        if (pl.jl == 0 && pl.col(c) < p.V) dv[(tok * p.Hv + pl.hv) * p.V + pl.col(c)] = static_cast<scalar_t>(cur.b * du[c]);
        db = fmaf(du[c], r, db);
        dp[c] = -cur.b * du[c];
      }
      if (delta && pl.jl == 0) bw[s * NG + pl.warp * L::G + pl.grp] = db;
      float dgp = 0.f;
#pragma unroll
      for (int i = 0; i < KL; ++i) {
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          acc = fmaf(dS[i][c], u[c], acc);
          if (delta) {
            const float sp = sp_s[(i * CPL + c) * kThreads];
            acc = fmaf(sp, dp[c], acc);
            dS[i][c] = fmaf(cur.k[i], dp[c], dS[i][c]);  // now dS'
          }
          if (gated) dgp = fmaf(dS[i][c], sp_s[(i * CPL + c) * kThreads], dgp);
        }
        part[(s * KL + i) * kThreads + pl.tid] = acc;
      }
      if (gated) {
        float x[1] = {dgp};
        group_allreduce<32>(x);
        if (pl.lane == 0) gw[s * kWarps + pl.warp] = x[0];
        const float a = expf(cur.g);
#pragma unroll
        for (int i = 0; i < KL; ++i) {
#pragma unroll
          for (int c = 0; c < CPL; ++c) dS[i][c] *= a;
        }
      }
      cur = nxt;
    }
    __syncthreads();
    flush_rows<L>(part, num_steps, p, pl, tok0, 1.f, io.dk);
    for (int64_t s = threadIdx.x; s < num_steps; s += kThreads) {
      if (gated) {
        float sum = 0.f;
        for (int w = 0; w < kWarps; ++w) sum += gw[s * kWarps + w];
        atomicAdd(io.dg + (tok0 + s) * p.Hv + pl.hv, sum);
      }
      if (delta) {
        float sum = 0.f;
        for (int w = 0; w < NG; ++w) sum += bw[s * NG + w];
        atomicAdd(io.dbeta + (tok0 + s) * p.Hv + pl.hv, sum);
      }
    }
  }
  __syncthreads();
  regs_to_tile<L>(tile, pl, dS);
  __syncthreads();
  tile_store<L>(tile, io.dh0 + pl.nh * KV, p.K, p.V, pl.col0);
}

// Calls f(Layout<...>{}) for K's padded size and the chosen lane layout.
template <int LPC, int CPL, typename F>
void with_kpad(int64_t K, F&& f) {
  if (K <= 32) {
    f(Layout<LPC, CPL, 32>{});
  } else if (K <= 64) {
    f(Layout<LPC, CPL, 64>{});
  } else {
    f(Layout<LPC, CPL, 128>{});
  }
}

// block_layout (a tuning knob for benchmarks): 0 = default, 1 = groups of 32 lanes x 2 columns,
// 2 = 16 lanes x 1 column, 3 = 8 lanes x 1 column. 2 and 3 are built for K > 64 only (fewer
// kernels to compile); smaller K runs layout 1.
template <typename F>
void with_fwd_layout(int64_t block_layout, int64_t K, F&& f) {
  TORCH_CHECK_VALUE(
      block_layout >= 0 && block_layout <= 3, "recurrent_fwd: block_layout must be 0 (default), 1, 2 or 3, got ",
      block_layout);
  if (K > 64 && block_layout == 2) {
    f(Layout<16, 1, 128>{});
  } else if (K > 64 && block_layout == 3) {
    f(Layout<8, 1, 128>{});
  } else {
    with_kpad<32, 2>(K, f);
  }
}

Params make_params(
    const RecurrentDims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& cu, double scale, int64_t C, int64_t BV) {
  Params p{};
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.g = g.defined() ? g.const_data_ptr<float>() : nullptr;
  p.beta = beta.defined() ? beta.const_data_ptr<float>() : nullptr;
  p.cu = cu.defined() ? cu.const_data_ptr<int64_t>() : nullptr;
  p.T = d.T;
  p.Hqk = d.Hqk;
  p.Hv = d.Hv;
  p.K = d.K;
  p.V = d.V;
  p.NV = (d.V + BV - 1) / BV;
  p.group = d.Hv / d.Hqk;
  p.C = C;
  p.scale = static_cast<float>(scale);
  return p;
}

void check_cuda_dims(const char* op, const RecurrentDims& d) {
  TORCH_CHECK_VALUE(
      d.acc == at::kFloat, op, ": the CUDA kernel takes float32, float16 or bfloat16 inputs; run float64 on the CPU op");
  TORCH_CHECK_VALUE(d.K <= 128, op, ": the CUDA kernel supports K <= 128, got K=", d.K, "; use the CPU op or the torch backend");
}

at::Tensor float_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->to(at::kFloat).contiguous() : at::Tensor();
}

unsigned int num_blocks(const char* op, int64_t blocks) {
  TORCH_CHECK_VALUE(blocks < (int64_t{1} << 31), op, ": too many (sequence, head, V-slice) blocks: ", blocks);
  return static_cast<unsigned int>(blocks);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> recurrent_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& g,
    const c10::optional<at::Tensor>& beta, const c10::optional<at::Tensor>& initial_state,
    const c10::optional<at::Tensor>& cu_seqlens, double scale, bool output_final_state,
    int64_t checkpoint_every, int64_t block_layout) {
  constexpr const char* op = "recurrent_fwd";
  const auto d = check_recurrent_fwd(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_every);
  check_cuda_dims(op, d);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const auto gf = float_or_undefined(g), bf = float_or_undefined(beta), h0 = float_or_undefined(initial_state);
  const auto cu = cu_seqlens.has_value() ? cu_seqlens->to(at::kLong).contiguous() : at::Tensor();
  const auto fopts = q.options().dtype(at::kFloat);
  auto o = at::empty({d.B, d.T, d.Hv, d.V}, v.options());
  auto ht = output_final_state ? at::empty({d.N, d.Hv, d.K, d.V}, fopts) : at::empty({0}, fopts);
  auto ck = at::empty({checkpoint_slots(d, checkpoint_every), d.Hv, d.K, d.V}, fopts);
  if (d.N * d.Hv == 0) return {o, ht, ck};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "recurrent_fwd_cuda", [&] {
    with_fwd_layout(block_layout, d.K, [&](auto layout) {
      using L = decltype(layout);
      if constexpr (std::is_same_v<scalar_t, double>) {
        TORCH_CHECK(false, "unreachable: float64 is refused above");
      } else {
        const Params p = make_params(d, qc, kc, vc, gf, bf, cu, scale, checkpoint_every, L::BV);
        const FwdOut out{
            h0.defined() ? h0.const_data_ptr<float>() : nullptr, o.data_ptr(),
            output_final_state ? ht.data_ptr<float>() : nullptr, checkpoint_every > 0 ? ck.data_ptr<float>() : nullptr};
        recurrent_fwd_kernel<scalar_t, L><<<num_blocks(op, p.NV * d.N * d.Hv), kThreads, 0, stream>>>(p, out);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  return {o, ht, ck};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> recurrent_bwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& g,
    const c10::optional<at::Tensor>& beta, const at::Tensor& checkpoints,
    const c10::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,
    const c10::optional<at::Tensor>& grad_final_state, double scale, int64_t checkpoint_every) {
  constexpr const char* op = "recurrent_bwd";
  const auto d = check_recurrent_bwd(q, k, v, g, beta, checkpoints, cu_seqlens, grad_o, grad_final_state, checkpoint_every);
  check_cuda_dims(op, d);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const auto gf = float_or_undefined(g), bf = float_or_undefined(beta), dht = float_or_undefined(grad_final_state);
  const auto cu = cu_seqlens.has_value() ? cu_seqlens->to(at::kLong).contiguous() : at::Tensor();
  const auto ck = checkpoints.contiguous();
  const auto doc = grad_o.to(q.scalar_type()).contiguous();
  const auto fopts = q.options().dtype(at::kFloat);
  auto dq = at::zeros({d.B, d.T, d.Hqk, d.K}, fopts);
  auto dk = at::zeros({d.B, d.T, d.Hqk, d.K}, fopts);
  auto dv = at::empty({d.B, d.T, d.Hv, d.V}, v.options());
  auto dg = g.has_value() ? at::zeros({d.B, d.T, d.Hv}, fopts) : at::empty({0}, fopts);
  auto dbeta = beta.has_value() ? at::zeros({d.B, d.T, d.Hv}, fopts) : at::empty({0}, fopts);
  auto dh0 = at::empty({d.N, d.Hv, d.K, d.V}, fopts);
  if (d.N * d.Hv > 0) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "recurrent_bwd_cuda", [&] {
      with_kpad<32, 2>(d.K, [&](auto layout) {
        using L = decltype(layout);
        if constexpr (std::is_same_v<scalar_t, double>) {
          TORCH_CHECK(false, "unreachable: float64 is refused above");
        } else {
          const Params p = make_params(d, qc, kc, vc, gf, bf, cu, scale, checkpoint_every, L::BV);
          const BwdIO io{
              ck.const_data_ptr<float>(), doc.const_data_ptr(), dht.defined() ? dht.const_data_ptr<float>() : nullptr,
              dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr(),
              g.has_value() ? dg.data_ptr<float>() : nullptr, beta.has_value() ? dbeta.data_ptr<float>() : nullptr,
              dh0.data_ptr<float>()};
          const int64_t smem_bytes = BwdSmem<L>{checkpoint_every}.total() * static_cast<int64_t>(sizeof(float));
          int max_smem = 0;
          C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, q.get_device()));
          TORCH_CHECK_VALUE(
              smem_bytes <= max_smem, op, ": checkpoint_every=", checkpoint_every, " needs ", smem_bytes,
              " bytes of shared memory for K=", d.K, ", the device has ", max_smem, "; use a smaller interval");
          auto kernel = recurrent_bwd_kernel<scalar_t, L>;
          C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
          kernel<<<num_blocks(op, p.NV * d.N * d.Hv), kThreads, smem_bytes, stream>>>(p, io);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
    });
  }
  const auto dtype = q.scalar_type();
  return {dq.to(dtype), dk.to(dtype), dv, dg, dbeta, dh0};
}

}  // namespace

TORCH_LIBRARY_IMPL(mmh, CUDA, m) {
  m.impl("recurrent_fwd", &recurrent_fwd_cuda);
  m.impl("recurrent_bwd", &recurrent_bwd_cuda);
}

}  // namespace mmh
