"""Top-k sparse attention in Triton, forward and backward, deterministic (no atomics).

Shape legend: B batch, T queries, S keys, H query heads, G kv groups, R = H // G heads per
group (head h reads group h // R), D q/k head dim, DV value head dim, K slots per query
(indices [B, T, K] in [-1, S), -1 unused), F = D + DV. BH heads, BK slots, BF features and
BL list entries per register block. D is split into D1 (a power of two) and an optional
masked tail D2 (576 = 512 + 64, 24 = 16 + 8 padded to 16) so that no head dim is padded to
the next power of two; DV is padded to DVP with a mask.

Kernels (README.md has the forward math; the backward is the usual softmax gradient):
    _fwd_kernel     one query, BH heads of one group: streams the K selected keys BK at a
                    time (rows of k and v gathered by index, -1 slots masked), online
                    softmax in fp32 (base 2), writes o and lse.
    _bwd_dq_kernel  same grid: recomputes p = exp(s - lse), dp = do v^T,
                    ds = p (dp - delta), dq = scale ds k.
    _bwd_dkv_kernel one query, BK slots, one group: recomputes p and ds for all R heads
                    (BH at a time) and writes the per-(query, slot) contributions
                    dk_c = scale ds^T q and dv_c = p^T do, summed over the group's heads,
                    to a buffer C [B, Tc, K, G, F] (input dtype for bf16, else fp32).
    _bwd_fused_kernel   (BACKWARD_FORM "fused"; auto's on the GPU for GQA-width rows, at most
                    FUSED_MAX_HEADS heads per group and fewer than the products form's) the dq
                    and dk/dv kernels in one, one query and all R heads of one group over its K
                    slots: each block of slots gathered once, dq accumulated and the block's
                    contributions written to C.
    _bwd_reduce_kernel  one key, BW of its G F columns: sums the contributions of the
                    (query, slot) pairs that selected the key, listed by a CSR built with a
                    stable sort of the chunk's indices, in a fixed order; adds into an fp32
                    accumulator [B, S, G, F] (queries are processed in chunks of Tc so that
                    C stays under CONTRIB_BUDGET_BYTES: memory is linear in T).
So dk and dv are bitwise repeatable. The cost: s and dp are computed twice in the backward
(dq and dk/dv kernels), 2 R K (4 D + 3 DV) FLOPs per query instead of 2 R K (3 D + 2 DV), and
C is written and read once (2 K G F elements per query).

The products form (FORWARD_FORM / BACKWARD_FORM; "auto" takes it on the GPU from
PRODUCTS_MIN_HEADS heads per kv group for the backward: absorbed MLA's 128 on one latent, where
it measured 2.6x the kernels, and MLA's 32 per rank under TP 4, 1.44x; for the forward only where
it is to make the indexer loss's target, at 64 or more: otherwise the forward kernel, at 64 slots
a step, beats it at every head count, 1.57x at 128 heads and 3.6x at 32) runs
each chunk of queries as batched cuBLAS products over the chunk's key rows gathered once
(_gathered): forward s = q k^T (fp32), _softmax_kernel (p, lse and, on request, the sum over
heads of p: the indexer KL loss's sparse target), o = p v; backward s and dp = do v^T again,
_probs_grads_kernel (p, ds), dq = ds k, and the contributions ds^T q and p^T do (for absorbed
MLA one product [ds; p]^T [q; do 0] = dk + dv), summed per key by the same deterministic reduce.
Few heads per group (GQA's 16) make thin products: the kernels win there (5x).

Dots take the input dtype (bf16/fp16; fp32 only in the CPU interpreter) and accumulate in
fp32. When v is the first DV columns of k (absorbed MLA: v = kv[..., :DV] with DV the power
of two D1), the kernels read k once and use it as v (SHARED_KV).

The forward checks shapes, dtypes, scale and the index range; a key repeated within one query's
row is found by the backward's sort (ValueError there), or, where no backward will follow (no
input needs a gradient, or grad mode is off), by a sort of each row in the forward
(_check_no_repeats), as the reference raises. The data checks read the host, so a stream
capturing a CUDA graph skips them (_capturing): the op then captures, forward and backward.
Indices known valid (reference.mark_valid_indices: lightning_indexer_topk's selections, as the
layer passes them) skip both checks, and their host reads.
"""

import functools
import logging
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from .reference import _bmm_f32, _check_attention_args, _check_scale, known_valid_indices
from .._checks import capturing as _capturing
from .._launch import fast_launch
from .._intmath import cdiv

logger = logging.getLogger(__name__)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_HEAD_DIM = 1024
# Bytes of the backward's contribution buffer C; queries are processed in chunks that fit.
CONTRIB_BUDGET_BYTES = 4 << 30
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _alloc(shape, dtype, device) -> Tensor:
    """Every buffer a kernel writes in full comes from here (tests poison it with NaN)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


@triton.jit
def _load_rows(base, o_row, stride_row, o_col, m_row, NUM_COLS):
    """[len(o_row), len(o_col)] block of a row-major tile; masked rows/cols read 0."""
    p = base + o_row[:, None] * stride_row + o_col[None, :]
    return tl.load(p, mask=m_row[:, None] & (o_col < NUM_COLS)[None, :], other=0.0)


@triton.jit
def _head_block(G, R: tl.constexpr, BH: tl.constexpr):
    """The program's (b, t, g) and its BH heads of group g, for grids (T x head blocks, B x G):
    i_b, i_t [int64], i_g, o_h [BH] query heads, m_r [BH] head in the group."""
    NHB: tl.constexpr = (R + BH - 1) // BH
    i_th, i_bg = tl.program_id(0), tl.program_id(1)
    i_t, i_hb = (i_th // NHB).to(tl.int64), i_th % NHB
    i_b, i_g = (i_bg // G).to(tl.int64), i_bg % G
    o_r = i_hb * BH + tl.arange(0, BH)
    return i_b, i_t, i_g, i_g * R + o_r, o_r < R


@triton.jit
def _load_q(p_q, o_h, sq_h, m_r, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, HAS_D2: tl.constexpr,
            BH: tl.constexpr):
    """q rows o_h of one query split at D1: [BH, D1] and the tail [BH, D2] (zeros without one)."""
    b_q1 = _load_rows(p_q, o_h, sq_h, tl.arange(0, D1), m_r, D)
    b_q2 = tl.zeros([BH, D2], dtype=b_q1.dtype)
    if HAS_D2:
        b_q2 = _load_rows(p_q, o_h, sq_h, D1 + tl.arange(0, D2), m_r, D)
    return b_q1, b_q2


@triton.jit
def _load_slots(p_idx, o_k, K, p_k, sk_s, p_v, sv_s, D: tl.constexpr, DV: tl.constexpr, D1: tl.constexpr,
                D2: tl.constexpr, HAS_D2: tl.constexpr, DVP: tl.constexpr, SHARED_KV: tl.constexpr, BK: tl.constexpr):
    """The keys of slots o_k [BK] of one query: m_s [BK] (slot holds a key), k split at D1
    ([BK, D1], [BK, D2]; -1 slots read 0) and v [BK, DVP] (k's first columns when SHARED_KV)."""
    b_i = tl.load(p_idx + o_k, mask=o_k < K, other=-1).to(tl.int64)
    m_s = b_i >= 0
    b_i = tl.where(m_s, b_i, 0)
    b_k1 = _load_rows(p_k, b_i, sk_s, tl.arange(0, D1), m_s, D)
    b_k2 = tl.zeros([BK, D2], dtype=b_k1.dtype)
    if HAS_D2:
        b_k2 = _load_rows(p_k, b_i, sk_s, D1 + tl.arange(0, D2), m_s, D)
    if SHARED_KV:
        b_v = b_k1
    else:
        b_v = _load_rows(p_v, b_i, sv_s, tl.arange(0, DVP), m_s, DV)
    return m_s, b_k1, b_k2, b_v


@triton.jit
def _scores(b_q1, b_q2, b_k1, b_k2, HAS_D2: tl.constexpr):
    """q k^T [BH, BK] over the split head dim, fp32."""
    b_s = tl.dot(b_q1, tl.trans(b_k1))
    if HAS_D2:
        b_s += tl.dot(b_q2, tl.trans(b_k2))
    return b_s


@triton.jit
def _probs_grads(b_s, b_do, b_v, m_rs, b_lse2, b_delta, scale_log2):
    """The backward's recomputed probabilities p = exp2(scale_log2 s - lse2) (0 off m_rs) and
    their gradient p (do v^T - delta) [BH, BK], both fp32."""
    b_p = tl.where(m_rs, tl.exp2(b_s * scale_log2 - b_lse2[:, None]), 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_v))
    return b_p, b_p * (b_dp - b_delta[:, None])


@triton.jit
def _dq_block(p_idx, o_k, K, p_k, sk_s, p_v, sv_s, b_q1, b_q2, b_do, m_r, b_lse2, b_delta, scale_log2, b_dq1, b_dq2,
              D: tl.constexpr, DV: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, HAS_D2: tl.constexpr,
              DVP: tl.constexpr, SHARED_KV: tl.constexpr, BK: tl.constexpr):
    """One block of slots o_k of a dq pass: their key rows gathered, p and ds formed (ds in the
    input dtype), ds k added to dq (unscaled): (p fp32, ds, dq1, dq2)."""
    m_s, b_k1, b_k2, b_v = _load_slots(p_idx, o_k, K, p_k, sk_s, p_v, sv_s, D, DV, D1, D2, HAS_D2, DVP, SHARED_KV, BK)
    b_s = _scores(b_q1, b_q2, b_k1, b_k2, HAS_D2)
    b_p, b_ds = _probs_grads(b_s, b_do, b_v, m_r[:, None] & m_s[None, :], b_lse2, b_delta, scale_log2)
    b_ds = b_ds.to(b_k1.dtype)
    b_dq1 += tl.dot(b_ds, b_k1)
    if HAS_D2:
        b_dq2 += tl.dot(b_ds, b_k2)
    return b_p, b_ds, b_dq1, b_dq2


@fast_launch
@triton.jit(do_not_specialize=["T", "K"])
def _fwd_kernel(
    q, k, v, idx, o, lse,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sv_b, sv_s, sv_g, si_b, si_t,
    scale_log2, T, K, G,
    R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, HAS_D2: tl.constexpr, DVP: tl.constexpr,
    SHARED_KV: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """One query t, heads [i_hb BH, i_hb BH + BH) of group g: o [BH, DV], lse [BH]."""
    i_b, i_t, i_g, o_h, m_r = _head_block(G, R, BH)
    o_dv = tl.arange(0, DVP)
    b_q1, b_q2 = _load_q(q + i_b * sq_b + i_t * sq_t, o_h, sq_h, m_r, D, D1, D2, HAS_D2, BH)
    p_k = k + i_b * sk_b + i_g * sk_g
    p_v = v + i_b * sv_b + i_g * sv_g
    p_idx = idx + i_b * si_b + i_t * si_t

    b_m = tl.full([BH], float("-inf"), tl.float32)  # running max, base-2 logits
    b_l = tl.zeros([BH], tl.float32)
    b_acc = tl.zeros([BH, DVP], tl.float32)
    for i_k in range(0, K, BK):
        m_s, b_k1, b_k2, b_v = _load_slots(
            p_idx, i_k + tl.arange(0, BK), K, p_k, sk_s, p_v, sv_s, D, DV, D1, D2, HAS_D2, DVP, SHARED_KV, BK
        )
        b_s = tl.where(m_s[None, :], _scores(b_q1, b_q2, b_k1, b_k2, HAS_D2) * scale_log2, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        # a row that has seen no key yet stays at -inf; -inf - -inf would give NaN
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.exp2(b_s - b_m_use[:, None])
        b_alpha = tl.exp2(b_m - b_m_use)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        b_m = b_m_new

    m_l = b_l > 0
    b_o = b_acc / tl.where(m_l, b_l, 1.0)[:, None]
    r_th = (i_b * T + i_t) * (G * R) + o_h  # [BH] rows of o [B, T, H, DV] and lse [B, T, H]
    p_o = o + r_th[:, None] * DV + o_dv[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_r[:, None] & (o_dv < DV)[None, :])
    b_lse = tl.where(m_l, (b_m + tl.log2(tl.where(m_l, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse + r_th, b_lse, mask=m_r)


@fast_launch
@triton.jit(do_not_specialize=["T", "K"])
def _bwd_dq_kernel(
    q, k, v, idx, do, lse2, delta, dq,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sv_b, sv_s, sv_g, si_b, si_t,
    scale, scale_log2, T, K, G,
    R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, HAS_D2: tl.constexpr, DVP: tl.constexpr,
    SHARED_KV: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """dq [BH, D] of one query t and BH heads of group g. lse2 = lse log2(e) with -inf -> 0;
    delta = rowsum(o do) - dlse; do [B, T, H, DV] and dq contiguous."""
    i_b, i_t, i_g, o_h, m_r = _head_block(G, R, BH)
    o_d1 = tl.arange(0, D1)
    o_d2 = D1 + tl.arange(0, D2)
    r_th = (i_b * T + i_t) * (G * R) + o_h  # [BH] rows of do, dq, lse, delta

    b_q1, b_q2 = _load_q(q + i_b * sq_b + i_t * sq_t, o_h, sq_h, m_r, D, D1, D2, HAS_D2, BH)
    b_do = _load_rows(do, r_th, DV, tl.arange(0, DVP), m_r, DV)
    b_lse2 = tl.load(lse2 + r_th, mask=m_r, other=0.0)
    b_delta = tl.load(delta + r_th, mask=m_r, other=0.0)
    p_k = k + i_b * sk_b + i_g * sk_g
    p_v = v + i_b * sv_b + i_g * sv_g
    p_idx = idx + i_b * si_b + i_t * si_t

    b_dq1 = tl.zeros([BH, D1], tl.float32)
    b_dq2 = tl.zeros([BH, D2], tl.float32)
    for i_k in range(0, K, BK):
        _, _, b_dq1, b_dq2 = _dq_block(p_idx, i_k + tl.arange(0, BK), K, p_k, sk_s, p_v, sv_s, b_q1, b_q2, b_do, m_r,
                                       b_lse2, b_delta, scale_log2, b_dq1, b_dq2, D, DV, D1, D2, HAS_D2, DVP,
                                       SHARED_KV, BK)

    p_dq = dq + r_th[:, None] * D
    tl.store(p_dq + o_d1[None, :], (b_dq1 * scale).to(dq.dtype.element_ty), mask=m_r[:, None] & (o_d1 < D)[None, :])
    if HAS_D2:
        tl.store(p_dq + o_d2[None, :], (b_dq2 * scale).to(dq.dtype.element_ty), mask=m_r[:, None] & (o_d2 < D)[None, :])


@fast_launch
@triton.jit(do_not_specialize=["T", "K", "t0", "Tc"])
def _bwd_dkv_kernel(
    q, k, v, idx, do, lse2, delta, C,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sv_b, sv_s, sv_g, si_b, si_t,
    scale, scale_log2, T, K, G, t0, Tc,
    R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, HAS_D2: tl.constexpr, DVP: tl.constexpr,
    SHARED_KV: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """Contributions of query t0 + i_tc, slots [i_kb BK, i_kb BK + BK), group g, summed over
    the group's R heads: C[b, i_tc, slot, g, :D] = scale ds^T q, C[..., D:] = p^T do."""
    NKB = tl.cdiv(K, BK)
    i_tk, i_bg = tl.program_id(0), tl.program_id(1)
    i_tc, i_kb = (i_tk // NKB).to(tl.int64), i_tk % NKB
    i_t = t0 + i_tc
    i_b, i_g = (i_bg // G).to(tl.int64), i_bg % G
    o_d1 = tl.arange(0, D1)
    o_d2 = D1 + tl.arange(0, D2)
    o_dv = tl.arange(0, DVP)
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_s, b_k1, b_k2, b_v = _load_slots(
        idx + i_b * si_b + i_t * si_t, o_k, K, k + i_b * sk_b + i_g * sk_g, sk_s, v + i_b * sv_b + i_g * sv_g, sv_s,
        D, DV, D1, D2, HAS_D2, DVP, SHARED_KV, BK,
    )

    p_q = q + i_b * sq_b + i_t * sq_t
    b_dk1 = tl.zeros([BK, D1], tl.float32)
    b_dk2 = tl.zeros([BK, D2], tl.float32)
    b_dv = tl.zeros([BK, DVP], tl.float32)
    for i_r in range(0, R, BH):
        o_r = i_r + tl.arange(0, BH)
        m_r = o_r < R
        o_h = i_g * R + o_r
        r_th = (i_b * T + i_t) * (G * R) + o_h
        b_q1, b_q2 = _load_q(p_q, o_h, sq_h, m_r, D, D1, D2, HAS_D2, BH)
        b_s = _scores(b_q1, b_q2, b_k1, b_k2, HAS_D2)
        b_do = _load_rows(do, r_th, DV, o_dv, m_r, DV)
        b_lse2 = tl.load(lse2 + r_th, mask=m_r, other=0.0)
        b_delta = tl.load(delta + r_th, mask=m_r, other=0.0)
        b_p, b_ds = _probs_grads(b_s, b_do, b_v, m_r[:, None] & m_s[None, :], b_lse2, b_delta, scale_log2)
        b_ds = b_ds.to(b_q1.dtype)
        b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
        b_dk1 += tl.dot(tl.trans(b_ds), b_q1)
        if HAS_D2:
            b_dk2 += tl.dot(tl.trans(b_ds), b_q2)

    F: tl.constexpr = D + DV
    # [BK] rows of C [B, Tc, K, G, F]
    r_c = ((i_b * Tc + i_tc) * K + o_k) * G + i_g
    p_c = C + r_c[:, None] * F
    dt = C.dtype.element_ty
    tl.store(p_c + o_d1[None, :], (b_dk1 * scale).to(dt), mask=m_k[:, None] & (o_d1 < D)[None, :])
    if HAS_D2:
        tl.store(p_c + o_d2[None, :], (b_dk2 * scale).to(dt), mask=m_k[:, None] & (o_d2 < D)[None, :])
    tl.store(p_c + D + o_dv[None, :], b_dv.to(dt), mask=m_k[:, None] & (o_dv < DV)[None, :])


@fast_launch
@triton.jit(do_not_specialize=["T", "K", "t0", "Tc"])
def _bwd_fused_kernel(
    q, k, v, idx, do, lse2, delta, dq, C,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sv_b, sv_s, sv_g, si_b, si_t,
    scale, scale_log2, T, K, G, t0, Tc,
    R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, HAS_D2: tl.constexpr, DVP: tl.constexpr,
    SHARED_KV: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
):
    """_bwd_dq_kernel and _bwd_dkv_kernel in one (BACKWARD_FORM "fused"; R <= BH): query t0 +
    i_tc and all R heads of group g, its K slots BK at a time. Each block of slots is gathered
    and s, p, dp, ds formed once: dq [R, D] accumulates over the blocks, and the block's
    contributions go to C as _bwd_dkv_kernel writes them. The same products in the same order as
    the two kernels at equal BK (the same dq and C in the CPU interpreter); half the key rows
    gathered, and 5 products per block instead of 7."""
    i_tc, i_bg = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_t = t0 + i_tc
    i_b, i_g = (i_bg // G).to(tl.int64), i_bg % G
    o_r = tl.arange(0, BH)
    m_r = o_r < R
    o_h = i_g * R + o_r
    r_th = (i_b * T + i_t) * (G * R) + o_h  # [BH] rows of do, dq, lse, delta
    o_d1 = tl.arange(0, D1)
    o_d2 = D1 + tl.arange(0, D2)
    o_dv = tl.arange(0, DVP)

    b_q1, b_q2 = _load_q(q + i_b * sq_b + i_t * sq_t, o_h, sq_h, m_r, D, D1, D2, HAS_D2, BH)
    b_do = _load_rows(do, r_th, DV, o_dv, m_r, DV)
    b_lse2 = tl.load(lse2 + r_th, mask=m_r, other=0.0)
    b_delta = tl.load(delta + r_th, mask=m_r, other=0.0)
    p_k = k + i_b * sk_b + i_g * sk_g
    p_v = v + i_b * sv_b + i_g * sv_g
    p_idx = idx + i_b * si_b + i_t * si_t
    F: tl.constexpr = D + DV
    dt = C.dtype.element_ty

    b_dq1 = tl.zeros([BH, D1], tl.float32)
    b_dq2 = tl.zeros([BH, D2], tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        b_p, b_ds, b_dq1, b_dq2 = _dq_block(p_idx, o_k, K, p_k, sk_s, p_v, sv_s, b_q1, b_q2, b_do, m_r, b_lse2,
                                            b_delta, scale_log2, b_dq1, b_dq2, D, DV, D1, D2, HAS_D2, DVP,
                                            SHARED_KV, BK)
        # [BK] rows of C [B, Tc, K, G, F], as _bwd_dkv_kernel's
        p_c = C + (((i_b * Tc + i_tc) * K + o_k) * G + i_g)[:, None] * F
        b_dv = tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
        tl.store(p_c + D + o_dv[None, :], b_dv.to(dt), mask=m_k[:, None] & (o_dv < DV)[None, :])
        b_dk1 = tl.dot(tl.trans(b_ds), b_q1)
        tl.store(p_c + o_d1[None, :], (b_dk1 * scale).to(dt), mask=m_k[:, None] & (o_d1 < D)[None, :])
        if HAS_D2:
            b_dk2 = tl.dot(tl.trans(b_ds), b_q2)
            tl.store(p_c + o_d2[None, :], (b_dk2 * scale).to(dt), mask=m_k[:, None] & (o_d2 < D)[None, :])

    p_dq = dq + r_th[:, None] * D
    tl.store(p_dq + o_d1[None, :], (b_dq1 * scale).to(dq.dtype.element_ty), mask=m_r[:, None] & (o_d1 < D)[None, :])
    if HAS_D2:
        tl.store(p_dq + o_d2[None, :], (b_dq2 * scale).to(dq.dtype.element_ty), mask=m_r[:, None] & (o_d2 < D)[None, :])


@fast_launch
@triton.jit
def _bwd_reduce_kernel(C, order, offsets, acc, W, SLOTS, st_t, st_k, st_acc, FIRST, BW: tl.constexpr,
                       BL: tl.constexpr):
    """acc[key, BW columns] (+)= the sum of the C rows order[offsets[key]:offsets[key + 1]]
    (a row: the W contributions of one flat position p = t SLOTS + slot, at C + t st_t +
    slot st_k), in list order, BL rows at a time (a fixed tree inside each block):
    deterministic. BL x BW elements per step keep enough loads in flight; one program per key
    and BW columns; acc rows st_acc apart."""
    i_key, i_w = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_w = i_w * BW + tl.arange(0, BW)
    m_w = o_w < W
    start = tl.load(offsets + i_key)
    end = tl.load(offsets + i_key + 1)
    b_acc = tl.zeros([BW], tl.float32)
    for i_l in range(start, end, BL):
        o_l = i_l + tl.arange(0, BL)
        m_l = o_l < end
        b_p = tl.load(order + o_l, mask=m_l, other=0).to(tl.int64)  # flat (b, t, slot)
        p_c = C + ((b_p // SLOTS) * st_t + (b_p % SLOTS) * st_k)[:, None] + o_w[None, :]
        b_c = tl.load(p_c, mask=m_l[:, None] & m_w[None, :], other=0.0).to(tl.float32)
        b_acc += tl.sum(b_c, axis=0)
    p_acc = acc + i_key * st_acc + o_w
    if FIRST == 0:
        b_acc += tl.load(p_acc, mask=m_w, other=0.0)
    tl.store(p_acc, b_acc, mask=m_w)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _split_dim(D: int) -> tuple[int, int, bool]:
    """(D1, D2, has_tail): D1 the largest power of two <= D (at least 16), D2 the tail's
    power-of-two block (at least 16, the smallest dot)."""
    D1 = max(16, 1 << (D.bit_length() - 1))
    tail = D - D1
    if tail <= 0:
        return D1, 16, False
    return D1, max(16, _next_pow2(tail)), True


@functools.cache
def _candidates(kernel: str, R: int, width: int, interpret: bool) -> tuple[dict, ...]:
    """Launch configs, preferred first; the first that fits the GPU is kept per shape.

    width = D1 + D2 + DVP (the columns of a gathered key row). From Triton 3.6's sm_90
    resource report (compiled without a GPU: registers, shared memory, spills) and one H200
    sweep of a few configs, not autotuned.
    """
    bh = min(64, max(16, _next_pow2(R)))
    if kernel == "fused":  # one block holds the group's heads (R <= FUSED_MAX_HEADS)
        bh = max(16, _next_pow2(R))
        if interpret:
            return ({"BH": bh, "BK": 16, "num_warps": 4, "num_stages": 1},)
        if width <= 512:  # GQA. H100, 16 heads per group (results/h100/sparse_fused_bwd_gqa.json):
            # 32 slots on 4 warps 31.6 / 133.8 ms fwd+bwd at 8k / 32k, 64 slots 33.9 / 144.6
            first = {"BH": bh, "BK": 32, "num_warps": 4, "num_stages": 2}
            big = {**first, "BK": 64}
            return (first, big, {**big, "num_stages": 1}, {**first, "num_stages": 1})
        first = {"BH": bh, "BK": 32, "num_warps": 8, "num_stages": 2}
        return (first, {**first, "num_stages": 1}, {**first, "BK": 16, "num_stages": 1})
    if kernel == "reduce":  # width: the G F columns of a contribution row
        if interpret:  # small blocks cross block edges in the CPU tests
            return ({"BW": 16, "BL": 4, "num_warps": 4, "num_stages": 1},)
        # One program per key reads ~K Tc / S rows of a chunk (16 at T = S = 128k, K = 2048,
        # Tc = 1024): wide rows and short steps. At G F = 1024 on the H200 (benchmarks/device/
        # tune_sparse_reduce.py): BW 1024, BL 8, 4 warps 1.10 ms (3.9 TB/s of C read) per chunk,
        # against 5.00 ms for BW 512, BL 32, 8 warps (the earlier default).
        return ({"BW": min(1024, max(16, _next_pow2(width))), "BL": 8, "num_warps": 4, "num_stages": 1},)
    if interpret:
        return ({"BH": 16, "BK": 16, "num_warps": 4, "num_stages": 1},)
    if width <= 512:  # GQA, D = DV = 128: 112-163 registers
        big = {"BH": bh, "BK": 64, "num_warps": 4, "num_stages": 2}
        return (big, {**big, "num_stages": 1}, {**big, "BK": 32, "num_stages": 1})
    # MLA, D = 576 (512 + 64), DV = 512. 64 heads spill in the backward kernels (dq's [64, 576]
    # fp32 accumulator). Measured on the H200 (benchmarks/sparse_attention.py --sweep): backward
    # dq and dk/dv 16 heads x 32 slots about 20 ms faster each than 32 x 16. A second sweep timed
    # dq at 16 heads x 64 slots another 19 ms faster (fwd+bwd 108 vs 127 ms); with it the bf16
    # GPU tests pass and sparse_attention.json has 108.3 ms. The forward
    # (benchmarks/device/probe_sparse_fwd_configs.py, H200, 4096 queries, 2048 slots,
    # results/h200/sparse_fwd_configs.json): 64 slots a step, the most shared memory allows
    # (221 KB at 2 stages), 64 heads 8 warps 8.52 ms at 128 heads against 18.94 at 16 slots and
    # 13.41 for the products form; at 32 heads 32 x 64 on 4 warps 2.87 ms (8 warps 4.02, 16 slots
    # 9.69, products 10.32). The KL target's kernel keeps the 16-slot config it was timed at.
    if kernel == "fwd" and R > 32:
        first = {"BH": 64, "BK": 64, "num_warps": 8, "num_stages": 2}
        return (first, {**first, "BK": 32}, {**first, "BK": 16}, {"BH": 16, "BK": 16, "num_warps": 4, "num_stages": 1})
    if kernel == "fwd":
        first = {"BH": bh, "BK": 64, "num_warps": 4, "num_stages": 2}
        return (first, {**first, "BK": 32, "num_warps": 8}, {"BH": bh, "BK": 16, "num_warps": 8, "num_stages": 2},
                {"BH": 16, "BK": 16, "num_warps": 4, "num_stages": 1})
    if kernel == "target":
        first = {"BH": min(bh, 64), "BK": 16, "num_warps": 8, "num_stages": 2}
    elif kernel == "dq":
        first = {"BH": 16, "BK": 64, "num_warps": 8, "num_stages": 2}
    else:
        first = {"BH": 16, "BK": 32, "num_warps": 8, "num_stages": 2}
    return (first, {**first, "num_stages": 1}, {"BH": 16, "BK": 16, "num_warps": 4, "num_stages": 1})


_chosen: dict = {}
# kernel ("fwd", "dq", "dkv", "reduce") -> config used instead of _candidates (benchmarks
# compare configs with this; the tests run the defaults).
CONFIG_OVERRIDE: dict[str, dict] = {}


def _launch(kernel, name: str, key: tuple, grid_of, args: tuple, consts: dict, candidates) -> None:
    """Runs kernel with the first of candidates that fits the device (cached per key); a
    config that does not fit is logged and the next smaller one tried."""
    if key[0] in CONFIG_OVERRIDE:
        candidates = (CONFIG_OVERRIDE[key[0]],)
    elif key in _chosen:
        candidates = (_chosen[key],)
    for i, cfg in enumerate(candidates):
        grid = grid_of(cfg)
        if 0 in grid:
            return
        launch = {n: cfg[n] for n in ("num_warps", "num_stages")}
        blocks = {n: c for n, c in cfg.items() if n not in launch}
        try:
            kernel[grid](*args, **consts, **blocks, **launch)
        except OutOfResources as err:
            if i + 1 == len(candidates):
                raise
            logger.warning("sparse attention %s: config %s does not fit (%s); trying %s",
                           name, cfg, err, candidates[i + 1])
            continue
        if key[0] not in CONFIG_OVERRIDE:
            _chosen[key] = cfg
        return


def _shared_kv(k: Tensor, v: Tensor, D1: int) -> bool:
    """v is k's first DV == D1 columns (absorbed MLA): the kernels read k once."""
    return (
        v.shape[-1] == D1
        and v.data_ptr() == k.data_ptr()
        and v.stride() == k.stride()
        and v.dtype == k.dtype
    )


def _row_strides(x: Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


class _Shape:
    def __init__(self, q, k, v, indices):
        self.B, self.T, self.H, self.D = q.shape
        self.S, self.G = k.shape[1], k.shape[2]
        self.DV, self.K = v.shape[3], indices.shape[2]
        self.R = self.H // self.G
        self.D1, self.D2, self.has_d2 = _split_dim(self.D)
        self.DVP = max(16, _next_pow2(self.DV))
        self.shared_kv = _shared_kv(k, v, self.D1)

    def consts(self) -> dict:
        return {
            "R": self.R, "D": self.D, "DV": self.DV, "D1": self.D1, "D2": self.D2,
            "HAS_D2": self.has_d2, "DVP": self.DVP, "SHARED_KV": self.shared_kv,
        }

    def key(self, q: Tensor) -> tuple:
        return (q.dtype, q.device, self.R, self.D, self.DV, self.shared_kv)

    @property
    def width(self) -> int:
        return self.D1 + (self.D2 if self.has_d2 else 0) + self.DVP


def _strides(q, k, v, indices) -> tuple[int, ...]:
    return (*_row_strides(q), *_row_strides(k), *_row_strides(v), indices.stride(0), indices.stride(1))


def _fwd(q, k, v, indices, scale: float, with_target: bool = False, backward: bool = False):
    """(o, lse, target): target the sum over heads of p when with_target and the products form
    makes it, else None. backward: a backward will follow, whose form (BACKWARD_FORM) is checked
    here, before the forward's buffers."""
    sh = _Shape(q, k, v, indices)
    if backward:
        _form(sh, q, BACKWARD_FORM, "backward")
    if _form(sh, q, FORWARD_FORM, with_target=with_target) == "products":
        return _fwd_products(sh, q, k, v, indices, scale, with_target)
    o = _alloc((sh.B, sh.T, sh.H, sh.DV), q.dtype, q.device)
    lse = _alloc((sh.B, sh.T, sh.H), torch.float32, q.device)
    _launch(
        _fwd_kernel, "forward", ("fwd", *sh.key(q)),
        lambda c: (sh.T * cdiv(sh.R, c["BH"]), sh.B * sh.G),
        (q, k, v, indices, o, lse, *_strides(q, k, v, indices), scale * LOG2E, sh.T, sh.K, sh.G),
        sh.consts(), _candidates("fwd", sh.R, sh.width, _INTERPRET),
    )
    return o, lse, None


# Forward / backward form: "kernels" (the Triton kernels above), "products" (batched cuBLAS
# products over each query chunk's gathered key rows: _fwd_products, _bwd_products) or "auto"
# (_form: products for many heads per kv group on the GPU, absorbed MLA's 128, where they won:
# benchmarks/results/h200/sparse_attention.json, backward_forms).
FORWARD_FORM = "auto"
BACKWARD_FORM = "auto"
# BACKWARD_FORM "fused": the kernels form's backward with _bwd_dq_kernel folded into the
# contributions kernel (_bwd_fused_kernel), for at most FUSED_MAX_HEADS heads per kv group. "auto"
# takes it on the GPU where the kernels form would run and a gathered row is at most
# FUSED_AUTO_MAX_WIDTH columns (GQA's d 128): on an H100 (benchmarks/sparse_attention.py --forms,
# results/h100/sparse_fused_bwd_gqa.json) GQA's 16 heads per group ran fwd+bwd 1.27x / 1.32x the
# kernels form at 8k / 32k queries, bitwise equal to it; MLA's 576-wide rows at fewer than
# PRODUCTS_MIN_HEADS heads (TP 8) are untimed and keep the kernels form. Not yet timed on an H200.
FUSED_MAX_HEADS = 64
FUSED_AUTO_MAX_WIDTH = 512


# heads per kv group from which "auto" takes the products form, per pass (sparse_attention.json,
# one H200, MLA 4096 queries over 8k keys: backward at 128 heads 30.7 vs 78.8 ms, at 32 heads
# (mla-h32) 22.6 vs 32.6; GQA's 16 heads: the products 5x slower). The forward takes them only
# where the indexer loss's target is asked for (with_target), which they make from their own
# probabilities: at 128 heads 13.43 ms, against the kernel's 8.52 plus 18.7 for the target
# after it; without the target the kernel wins at every head count (8.52 vs 13.41 ms at 128
# heads, 2.87 vs 10.32 at 32; sparse_fwd_configs.json).
PRODUCTS_MIN_HEADS = {"forward": 64, "backward": 32}


FORMS = {"forward": ("auto", "kernels", "products"), "backward": ("auto", "kernels", "products", "fused")}


def _form(sh: "_Shape", q: Tensor, which: str, pass_: str = "forward", with_target: bool = False) -> str:
    """The form a pass runs in: the switch's value (FORWARD_FORM / BACKWARD_FORM), "auto" taken
    by shape (and for the forward, whether it is to make the indexer loss's target). ValueError
    for a value the pass does not take, or "fused" over FUSED_MAX_HEADS heads per kv group."""
    if which not in FORMS[pass_]:
        raise ValueError(f"triton_sparse.{pass_.upper()}_FORM must be one of {FORMS[pass_]}, got {which!r}")
    if which == "fused" and sh.R > FUSED_MAX_HEADS:
        raise ValueError(
            f"BACKWARD_FORM 'fused' takes at most {FUSED_MAX_HEADS} query heads per kv group (its dq "
            f"accumulator holds them all), got {sh.R}; set triton_sparse.BACKWARD_FORM to 'auto', "
            "'kernels' or 'products'"
        )
    if which != "auto":
        return which
    many = q.is_cuda and sh.R >= PRODUCTS_MIN_HEADS[pass_]
    if many and (pass_ == "backward" or with_target):
        return "products"
    fused = q.is_cuda and pass_ == "backward" and sh.R <= FUSED_MAX_HEADS and sh.width <= FUSED_AUTO_MAX_WIDTH
    return "fused" if fused else "kernels"


def _chunk_rows(sh: "_Shape", per_query: int, extra_elems: int) -> int:
    """Queries per chunk of the products forms: per_query bytes within CONTRIB_BUDGET_BYTES,
    and extra_elems elements per query within int32 offsets."""
    return max(1, min(sh.T, CONTRIB_BUDGET_BYTES // max(per_query, 1), (2**31 - 1) // max(extra_elems, 1)))


def _gathered(sh: "_Shape", kf: Tensor, vf, indices: Tensor, t0: int, n: int):
    """The key rows of queries [t0, t0 + n): (kg [N, K, D], vg [N, K, DV] (kg's first DV
    columns when shared), idx_c [B, n, K]) with N = B n G rows (batch, query, group); -1 slots
    read key 0 (the kernels mask them)."""
    B, S, G, K, D, DV = sh.B, sh.S, sh.G, sh.K, sh.D, sh.DV
    N = B * n * G
    idx_c = indices[:, t0:t0 + n]
    rows = (idx_c.clamp_min(0) + (torch.arange(B, device=idx_c.device) * S).view(B, 1, 1)).reshape(-1)

    def gather(x, cols):  # [B n K, G, cols] -> [N, K, cols]
        sel = x.index_select(0, rows).view(B * n, K, G, cols)
        return sel.view(N, K, cols) if G == 1 else sel.transpose(1, 2).reshape(N, K, cols)

    kg = gather(kf, D)
    vg = kg[..., :DV] if vf is None else gather(vf, DV)
    return kg, vg, idx_c


def _flat_kv(sh: "_Shape", k: Tensor, v: Tensor):
    """k [B S, G, D] and v [B S, G, DV] (None when v is k's first columns) for _gathered."""
    return k.reshape(sh.B * sh.S, sh.G, sh.D), None if sh.shared_kv else v.reshape(sh.B * sh.S, sh.G, sh.DV)


@triton.jit
def _lse_of(b_m, b_l):
    """Natural-log lse from a base-2 running max and sum; -inf for a row without keys."""
    return tl.where(b_l > 0, (b_m + tl.log2(tl.where(b_l > 0, b_l, 1.0))) * 0.6931471805599453, float("-inf"))


@fast_launch
@triton.jit  # K specialised (unlike the gathering kernels): K % 16 == 0 known makes the [BK] rows 16-byte vectors
def _softmax_kernel(s, idx, p, lse, psum, K, H, scale_log2, BK: tl.constexpr, ONE_PASS: tl.constexpr,
                    PSUM: tl.constexpr):
    """One query (b, t): its H rows i_q H + h of s [B n H, K] fp32 (heads in group order): p =
    softmax(scale s) over the row's slots (0 at -1 slots of idx [B n, K]) in p's dtype, lse
    (natural log, -inf for a row without keys) and, with PSUM, psum [B n, K] fp32 = the sum of
    the fp32 p over the H heads (the indexer KL loss's sparse target). ONE_PASS: the row fits
    one block (K <= BK), s read once; else the max and sum first, then p block by block."""
    i_q = tl.program_id(0).to(tl.int64)
    p_idx = idx + i_q * K
    if ONE_PASS:
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        m_s = m_k & (tl.load(p_idx + o_k, mask=m_k, other=-1) >= 0)
        b_sum = tl.zeros([BK], tl.float32)
        for h in range(H):
            row = i_q * H + h
            b_s = tl.where(m_s, tl.load(s + row * K + o_k, mask=m_k, other=0.0) * scale_log2, float("-inf"))
            b_m = tl.max(b_s, 0)
            b_e = tl.exp2(b_s - tl.where(b_m == float("-inf"), 0.0, b_m))  # no key: 0, not NaN
            b_l = tl.sum(b_e, 0)
            b_p = b_e * tl.where(b_l > 0, 1.0 / tl.where(b_l > 0, b_l, 1.0), 0.0)
            tl.store(p + row * K + o_k, b_p.to(p.dtype.element_ty), mask=m_k)
            b_sum += b_p
            tl.store(lse + row, _lse_of(b_m, b_l))
        if PSUM:
            tl.store(psum + i_q * K + o_k, b_sum, mask=m_k)
    else:
        for h in range(H):  # each row's lse: online max and sum over the blocks
            row = i_q * H + h
            b_m = tl.max(tl.full([BK], float("-inf"), tl.float32), 0)
            b_l = tl.sum(tl.zeros([BK], tl.float32), 0)
            for k0 in range(0, K, BK):
                o_k = k0 + tl.arange(0, BK)
                m_k = o_k < K
                m_s = m_k & (tl.load(p_idx + o_k, mask=m_k, other=-1) >= 0)
                b_s = tl.where(m_s, tl.load(s + row * K + o_k, mask=m_k, other=0.0) * scale_log2, float("-inf"))
                b_m_new = tl.maximum(b_m, tl.max(b_s, 0))
                b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
                b_l = b_l * tl.exp2(b_m - b_m_use) + tl.sum(tl.exp2(b_s - b_m_use), 0)
                b_m = b_m_new
            tl.store(lse + row, _lse_of(b_m, b_l))
        for k0 in range(0, K, BK):  # p = exp2(scale_log2 s - lse2), block by block over the heads
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            m_s = m_k & (tl.load(p_idx + o_k, mask=m_k, other=-1) >= 0)
            b_sum = tl.zeros([BK], tl.float32)
            for h in range(H):
                row = i_q * H + h
                b_lse2 = tl.load(lse + row) * 1.4426950408889634
                b_lse2 = tl.where(b_lse2 == float("-inf"), float("inf"), b_lse2)  # no key: p = 0
                b_s = tl.load(s + row * K + o_k, mask=m_k, other=0.0) * scale_log2
                b_p = tl.where(m_s, tl.exp2(b_s - b_lse2), 0.0)
                tl.store(p + row * K + o_k, b_p.to(p.dtype.element_ty), mask=m_k)
                b_sum += b_p
            if PSUM:
                tl.store(psum + i_q * K + o_k, b_sum, mask=m_k)


# The products forward's softmax holds a row of up to this many slots in one block.
SOFTMAX_ONE_PASS_MAX = 4096


def _fwd_products(sh: "_Shape", q, k, v, indices, scale: float, with_target: bool = False):
    """The forward as batched products per chunk of queries (cuBLAS on the GPU): s = q k^T
    (fp32) over the gathered key rows, p and lse (_softmax_kernel), o = p v. with_target: also
    the sum over heads of the fp32 p, [B, T, K] (sparse_probs_target's value), else None."""
    B, T, G, R, K, D, DV = sh.B, sh.T, sh.G, sh.R, sh.K, sh.D, sh.DV
    H, dev, dt, es = G * R, q.device, q.dtype, q.element_size()
    o = _alloc((B, T, H, DV), dt, dev)
    lse = _alloc((B, T, H), torch.float32, dev)
    target = _alloc((B, T, K), torch.float32, dev) if with_target else None
    kv_cols = D if sh.shared_kv else D + DV
    Tc = _chunk_rows(sh, B * (K * G * kv_cols * es + H * K * (4 + es)), B * H * K)
    kf, vf = _flat_kv(sh, k, v)
    one_pass = K <= SOFTMAX_ONE_PASS_MAX
    bk = _next_pow2(K) if one_pass else (16 if _INTERPRET else 2048)
    for t0 in range(0, T, Tc):
        n = min(Tc, T - t0)
        N = B * n * G
        kg, vg, idx_c = _gathered(sh, kf, vf, indices, t0, n)
        s = _bmm_f32(q[:, t0:t0 + n].reshape(N, R, D), kg.transpose(1, 2))
        p = _alloc((N, R, K), dt, dev)
        lse_c = lse[:, t0:t0 + n] if B == 1 else _alloc((B, n, H), torch.float32, dev)
        t_c = target[:, t0:t0 + n] if with_target and B == 1 else (
            _alloc((B, n, K), torch.float32, dev) if with_target else lse_c)  # (unread without PSUM)
        _softmax_kernel[(B * n,)](s, idx_c.reshape(B * n, K).contiguous(), p, lse_c, t_c, K, H, scale * LOG2E,
                                  BK=bk, ONE_PASS=one_pass, PSUM=with_target, num_warps=8 if bk >= 1024 else 4)
        del s
        _bmm_into(p, vg, o[:, t0:t0 + n])
        if B > 1:
            lse[:, t0:t0 + n] = lse_c
            if with_target:
                target[:, t0:t0 + n] = t_c
    return o, lse, target


@fast_launch
@triton.jit
def _row_dot_kernel(a, b, out, N, W, BR: tl.constexpr, BW: tl.constexpr):
    """out[r] = sum over the W columns of a[r] b[r] in fp32, BR rows of a, b [N, W] per program."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < N
    b_acc = tl.zeros([BR], tl.float32)
    for w0 in range(0, W, BW):
        o_w = w0 + tl.arange(0, BW)
        m = m_r[:, None] & (o_w < W)[None, :]
        p = o_r[:, None] * W + o_w[None, :]
        b_acc += tl.sum(tl.load(a + p, mask=m, other=0.0).to(tl.float32) * tl.load(b + p, mask=m, other=0.0).to(tl.float32), 1)
    tl.store(out + o_r, b_acc, mask=m_r)


def _row_dots(a: Tensor, b: Tensor) -> Tensor:
    """(a.float() * b.float()).sum(-1) without the fp32 copies: a, b [..., W] -> [...] fp32."""
    a, b = a.contiguous(), b.contiguous()
    W = a.shape[-1]
    N = a.numel() // max(W, 1)
    out = _alloc(a.shape[:-1], torch.float32, a.device)
    if N and W:
        br, bw = (16, 16) if _INTERPRET else (16, min(512, _next_pow2(W)))
        _row_dot_kernel[(cdiv(N, br),)](a, b, out, N, W, BR=br, BW=bw, num_warps=4)
    elif N:
        out.zero_()
    return out


def _bwd(q, k, v, indices, o, lse, do, dlse, scale: float, combine_kv: bool = False, valid: bool = False):
    """dq, dk, dv; combine_kv (v is a differentiable view of k's first DV columns): dk holds
    dv too and dv is None (the products form only; the kernels form returns both). valid: the
    indices are known valid (mark_valid_indices), so no repeated key is looked for."""
    sh = _Shape(q, k, v, indices)
    # [B, T, H] fp32: rowsum(o do), minus dlse (d lse / d s = p, so it shifts ds = p (dp - delta))
    delta = _row_dots(o, do)
    finite = torch.isfinite(lse)
    if dlse is not None:
        delta = delta - torch.where(finite, dlse.float(), 0.0)
    lse2 = torch.where(finite, lse * LOG2E, 0.0).contiguous()
    delta = delta.contiguous()
    form = _form(sh, q, BACKWARD_FORM, "backward")
    if form == "products":
        return _bwd_products(sh, q, k, v, indices, lse2, delta, do, scale, combine_kv and sh.shared_kv, valid)
    return _bwd_kernels(sh, q, k, v, indices, lse2, delta, do, scale, fused=form == "fused", valid=valid)


def _raise_if_repeated(repeated: Tensor | None) -> None:
    """repeated None: indices known valid, nothing was checked."""
    if repeated is not None and not _capturing(repeated) and bool(repeated):
        raise ValueError("indices must not repeat a key within one query's row")


def _chunk_lists(idx_c: Tensor, S: int, repeated: Tensor | None) -> tuple[Tensor, Tensor]:
    """per_key_lists of one chunk's indices [B, n, K]; ORs into repeated whether a row holds a
    key twice (not with repeated None: indices known valid)."""
    K = idx_c.shape[-1]
    sorted_keys, order, offsets = per_key_lists(idx_c, S)
    same_row = torch.div(order[1:], K, rounding_mode="floor") == torch.div(order[:-1], K, rounding_mode="floor")
    if repeated is not None:
        repeated |= ((sorted_keys[1:] == sorted_keys[:-1]) & (sorted_keys[1:] < idx_c.shape[0] * S) & same_row).any()
    return order, offsets


def _bwd_kernels(sh: _Shape, q, k, v, indices, lse2, delta, do, scale: float, fused: bool = False, valid: bool = False):
    """The kernels form's backward: _bwd_dq_kernel, then per chunk of queries _bwd_dkv_kernel's
    contributions and their per-key sums; fused: _bwd_fused_kernel writes dq and the
    contributions per chunk (R <= FUSED_MAX_HEADS heads per group)."""
    B, T, S, G, K, D, DV = sh.B, sh.T, sh.S, sh.G, sh.K, sh.D, sh.DV
    dev = q.device
    strides = _strides(q, k, v, indices)
    consts = sh.consts()

    dq = _alloc(q.shape, q.dtype, dev)
    if not fused:
        _launch(
            _bwd_dq_kernel, "backward dq", ("dq", *sh.key(q)),
            lambda c: (T * cdiv(sh.R, c["BH"]), B * G),
            (q, k, v, indices, do, lse2, delta, dq, *strides, scale, scale * LOG2E, T, K, G),
            consts, _candidates("dq", sh.R, sh.width, _INTERPRET),
        )

    F = D + DV
    c_dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    row_bytes = B * K * G * F * torch.finfo(c_dtype).bits // 8
    Tc = max(1, min(T, CONTRIB_BUDGET_BYTES // max(row_bytes, 1), (2**31 - 1) // max(B * K, 1)))
    C = _alloc((B, Tc, K, G, F), c_dtype, dev)
    acc = _alloc((B, S, G, F), torch.float32, dev)
    repeated = None if valid else torch.zeros((), dtype=torch.bool, device=dev)
    for t0 in range(0, T, Tc):
        tc = min(Tc, T - t0)
        if fused:
            _launch(
                _bwd_fused_kernel, "backward dq, dk/dv (fused)", ("fused", *sh.key(q)),
                lambda c, tc=tc: (tc, B * G),
                (q, k, v, indices, do, lse2, delta, dq, C, *strides, scale, scale * LOG2E, T, K, G, t0, Tc),
                consts, _candidates("fused", sh.R, sh.width, _INTERPRET),
            )
        else:
            _launch(
                _bwd_dkv_kernel, "backward dk/dv", ("dkv", *sh.key(q)),
                lambda c, tc=tc: (tc * cdiv(K, c["BK"]), B * G),
                (q, k, v, indices, do, lse2, delta, C, *strides, scale, scale * LOG2E, T, K, G, t0, Tc),
                consts, _candidates("dkv", sh.R, sh.width, _INTERPRET),
            )
        idx_c = indices[:, t0:t0 + tc]
        if tc < Tc:  # positions index C [B, Tc, K]: pad the short last chunk with -1
            idx_c = torch.cat([idx_c, idx_c.new_full((B, Tc - tc, K), -1)], dim=1)
        order, offsets = _chunk_lists(idx_c, S, repeated)
        sum_rows_per_key(C.view(-1, G * F), order, offsets, acc.view(B * S, G * F), first=t0 == 0)
    del C
    _raise_if_repeated(repeated)
    if T == 0:
        acc.zero_()
    dk = acc[..., :D].to(k.dtype)
    dv = acc[..., D:].to(v.dtype)
    return dq, dk, dv


@fast_launch
@triton.jit  # K specialised, as _softmax_kernel: 16-byte loads and stores (4-byte without)
def _probs_grads_kernel(s, dp, lse2, delta, idx, ps, K, R, G, scale, scale_log2, BK: tl.constexpr):
    """Row i_row = i R + r of s, dp [n G R, K] fp32 (i: a (query, group), r: its head), BK
    slots: p = exp2(scale_log2 s - lse2) (0 at -1 slots of idx [n, K]), ds = scale p (dp - delta);
    ps [n G, 2 R, K]: ds in rows i 2R + r, p in rows i 2R + R + r."""
    i_row, i_kb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i, r = i_row // R, i_row % R
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_i = tl.load(idx + (i // G) * K + o_k, mask=m_k, other=-1)
    b_s = tl.load(s + i_row * K + o_k, mask=m_k, other=0.0)
    b_dp = tl.load(dp + i_row * K + o_k, mask=m_k, other=0.0)
    b_p = tl.where(m_k & (b_i >= 0), tl.exp2(b_s * scale_log2 - tl.load(lse2 + i_row)), 0.0)
    b_ds = b_p * (b_dp - tl.load(delta + i_row)) * scale
    dt = ps.dtype.element_ty
    tl.store(ps + (i * 2 * R + r) * K + o_k, b_ds.to(dt), mask=m_k)
    tl.store(ps + (i * 2 * R + R + r) * K + o_k, b_p.to(dt), mask=m_k)


def _bmm_into(a: Tensor, b: Tensor, out: Tensor) -> None:
    """out (a slice [B, n, H, cols]) = a @ b [B n G, R, cols]: written in place when the slice
    is contiguous (B = 1), else through a copy."""
    if out.is_contiguous():
        torch.bmm(a, b, out=out.view(a.shape[0], a.shape[1], b.shape[2]))
    else:
        out.copy_(torch.bmm(a, b).view(out.shape))


def _bwd_products(sh: _Shape, q, k, v, indices, lse2, delta, do, scale: float, combine_kv: bool, valid: bool = False):
    """The backward as batched products over each chunk of queries (cuBLAS on the GPU): the
    chunk's key rows gathered once into [n G, K, D] (v: k's first DV columns when shared), then
    s = q k^T and dp = do v^T (fp32), p and ds (_probs_grads_kernel, input dtype), dq = ds k, and
    the per-(query, slot) contributions ds^T q and p^T do, which sum_rows_per_key adds per key
    (no atomics: bitwise repeatable). combine_kv: one product [ds; p]^T [q; do 0] gives
    dk + dv in k's D columns (half the contribution bytes of two)."""
    B, T, S, G, R, K, D, DV = sh.B, sh.T, sh.S, sh.G, sh.R, sh.K, sh.D, sh.DV
    H, dev, dt = G * R, q.device, q.dtype
    es = q.element_size()
    F = D if combine_kv else D + DV
    kv_cols = D if sh.shared_kv else D + DV  # gathered columns per (slot, group)
    per_query = B * (K * G * kv_cols * es + H * K * (8 + 2 * es) + K * G * F * es + 2 * H * D * es)
    Tc = _chunk_rows(sh, per_query, B * max(K * G * F, H * K))
    kf, vf = _flat_kv(sh, k, v)
    dq = _alloc(q.shape, dt, dev)
    acc = _alloc((B, S, G, F), torch.float32, dev)
    acc2 = acc.view(B * S, G * F)
    repeated = None if valid else torch.zeros((), dtype=torch.bool, device=dev)
    for t0 in range(0, T, Tc):
        n = min(Tc, T - t0)
        N = B * n * G  # (batch, query, group) rows of the products
        kg, vg, idx_c = _gathered(sh, kf, vf, indices, t0, n)
        qg = q[:, t0:t0 + n].reshape(N, R, D)
        dog = do[:, t0:t0 + n].reshape(N, R, DV)
        s = _bmm_f32(qg, kg.transpose(1, 2))
        dp = _bmm_f32(dog, vg.transpose(1, 2))
        ps = _alloc((N, 2 * R, K), dt, dev)
        bk = min(1024, _next_pow2(K)) if not _INTERPRET else 16
        _probs_grads_kernel[(N * R, cdiv(K, bk))](
            s, dp, lse2[:, t0:t0 + n].reshape(-1).contiguous(), delta[:, t0:t0 + n].reshape(-1).contiguous(),
            idx_c.reshape(B * n, K).contiguous(), ps, K, R, G, scale, scale * LOG2E, BK=bk, num_warps=4,
        )
        del s, dp
        ds, p = ps[:, :R], ps[:, R:]
        _bmm_into(ds, kg, dq[:, t0:t0 + n])
        order, offsets = _chunk_lists(idx_c, S, repeated)
        first = t0 == 0
        if combine_kv:  # [ds; p]^T [q; do | 0]: dk + dv in one product
            rhs = torch.empty((N, 2 * R, D), dtype=dt, device=dev)
            rhs[:, :R] = qg
            rhs[:, R:, :DV] = dog
            rhs[:, R:, DV:] = 0
            parts = [(torch.bmm(ps.transpose(1, 2), rhs), 0)]
            del rhs
        else:
            parts = [(torch.bmm(ds.transpose(1, 2), qg), 0), (torch.bmm(p.transpose(1, 2), dog), D)]
        del kg, vg, ps
        for c, col in parts:  # c [N, K, W] = [B n, G, K, W]: group g's rows at t G K W + slot W
            W = c.shape[-1]
            c4 = c.view(B * n, G, K, W)
            for g in range(G):
                sum_rows_per_key(c4[:, g], order, offsets, acc2[:, g * F + col:g * F + col + W], first)
        del parts
    _raise_if_repeated(repeated)
    if T == 0:
        acc.zero_()
    if combine_kv:
        return dq, acc.to(k.dtype), None
    return dq, acc[..., :D].to(k.dtype), acc[..., D:].to(v.dtype)


def per_key_lists(indices: Tensor, S: int) -> tuple[Tensor, Tensor, Tensor]:
    """indices [B, n, K] (keys in [0, S), -1 none) -> each key's list of the flat (b, t, slot)
    positions that hold it, in increasing order: (sorted keys [B n K] with key b S + s and -1
    slots on the sentinel B S, order [B n K] int64 positions, offsets [B S + 1] int32)."""
    B = indices.shape[0]
    idx = indices.to(torch.int32)
    key_base = (torch.arange(B, device=idx.device, dtype=torch.int32) * S)[:, None, None]
    sorted_keys, order = torch.sort(torch.where(idx >= 0, idx + key_base, B * S).reshape(-1), stable=True)
    all_keys = torch.arange(B * S + 1, device=idx.device, dtype=torch.int32)
    return sorted_keys, order, torch.searchsorted(sorted_keys, all_keys).to(torch.int32)


def sum_rows_per_key(rows: Tensor, order: Tensor, offsets: Tensor, acc: Tensor, first: bool) -> None:
    """acc[key] (first: =, else +=) the sum of rows[order[offsets[key]:offsets[key + 1]]], in
    list order, fp32 (per_key_lists' lists): deterministic, no atomics. rows [N, W], or [N / n,
    n, W] read at flat position t n + slot (any strides with unit columns); acc [num_keys, W]
    fp32 with unit columns (a column slice of a wider buffer too)."""
    if rows.dim() == 2:
        rows = rows.unsqueeze(1)
    W = rows.shape[2]
    if rows.stride(2) != 1 or acc.stride(1) != 1 or tuple(acc.shape) != (offsets.shape[0] - 1, W):
        raise ValueError(f"sum_rows_per_key: rows {tuple(rows.shape)} / acc {tuple(acc.shape)} need unit "
                         f"column strides and acc [{offsets.shape[0] - 1}, {W}]")
    _launch(
        _bwd_reduce_kernel, "per-key reduce", ("reduce", rows.device, W),
        lambda c: (acc.shape[0], cdiv(W, c["BW"])),
        (rows, order.to(torch.int32), offsets, acc, W, rows.shape[1], rows.stride(0), rows.stride(1),
         acc.stride(0), int(first)),
        {}, _candidates("reduce", 1, W, _INTERPRET),
    )


class SparseAttentionFunction(torch.autograd.Function):
    """o, lse = sparse attention of q over the keys of indices; gradients for q, k, v.
    with_target: a third output, the sum over heads of the probabilities [B, T, K] fp32 when
    the products forward makes them (else a [0] stand-in), not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, indices, scale, combine_kv=False, with_target=False, valid=False):
        o, lse, target = _fwd(q, k, v, indices, scale, with_target, backward=any(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(q, k, v, indices, o, lse)
        ctx.scale, ctx.combine_kv, ctx.valid = scale, combine_kv, valid
        if not with_target:
            return o, lse
        target = q.new_empty((0,), dtype=torch.float32) if target is None else target
        ctx.mark_non_differentiable(target)
        return o, lse, target

    @staticmethod
    def backward(ctx, do, dlse, *_):
        q, k, v, indices, o, lse = ctx.saved_tensors
        combine = ctx.combine_kv and ctx.needs_input_grad[1] and ctx.needs_input_grad[2]
        dq, dk, dv = _bwd(q, k, v, indices, o, lse, do.contiguous(), dlse, ctx.scale, combine, ctx.valid)
        return dq, dk, dv, None, None, None, None, None


def _check(q: Tensor, k: Tensor, v: Tensor, indices: Tensor) -> None:
    """ValueError naming the argument and the fix."""
    B, T, S, _, _, D = _check_attention_args(q, k, v)
    if q.is_cuda:
        ok = q.dtype in (torch.bfloat16, torch.float16)
        want = "bf16 or fp16 CUDA tensors (fp32 runs only in the CPU interpreter)"
    else:
        ok = q.dtype == torch.float32
        want = "fp32 on CPU (Triton's interpreter; its bf16 loads are wrong)"
    if not ok:
        raise ValueError(
            f"q: the triton sparse_attention takes {want}, got {q.dtype} on {q.device.type}; "
            "cast q, k, v, or use backend='torch'"
        )
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name}: expected {q.dtype} on {q.device} like q, got {x.dtype} on {x.device}")
    if D > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"q: the triton sparse_attention takes head dims up to {MAX_HEAD_DIM}, got D={D}, "
            f"DV={v.shape[-1]}; use backend='torch'"
        )
    if not q.is_cuda and not _INTERPRET:
        raise ValueError(
            "q: the triton sparse_attention on CPU tensors runs in Triton's interpreter; set "
            "TRITON_INTERPRET=1 before importing triton, or use backend='torch'"
        )
    if (
        not isinstance(indices, Tensor)
        or indices.dim() != 3
        or tuple(indices.shape[:2]) != (B, T)
        or indices.dtype not in (torch.int32, torch.int64)
        or indices.device != q.device
    ):
        raise ValueError(
            f"indices must be int64/int32 [B, T, K] with B={B}, T={T} on {q.device}, got "
            + (f"{indices.dtype} {tuple(indices.shape)} on {indices.device}" if isinstance(indices, Tensor) else type(indices).__name__)
        )
    check_index_range(indices, S)


def check_index_range(indices: Tensor, S: int) -> None:
    """ValueError unless indices lie in [-1, S): one aminmax and one host read, none for indices
    known valid (reference.mark_valid_indices: lightning_indexer_topk's selections) or while a
    CUDA graph captures. The fused kernels read key rows by index: they trust this range."""
    if indices.numel() and not known_valid_indices(indices, S) and not _capturing(indices):
        lo, hi = torch.aminmax(indices)
        if lo.item() < -1 or hi.item() >= S:
            raise ValueError(f"indices must lie in [-1, S={S}) (-1 marks an unused slot)")


REPEAT_CHECK_ELEMENTS = 1 << 22  # indices per sort of the forward-only repeated-key check (~50 MB of buffers)


def _check_no_repeats(indices: Tensor) -> None:
    """ValueError if a row of indices [B, T, K] holds a key twice, for a forward no backward
    follows (the backward's per-key lists check it otherwise): each row sorted, in chunks of
    rows, one host read at the end (none while a CUDA graph captures)."""
    B, T, K = indices.shape
    if K < 2 or not indices.numel():
        return
    repeated = torch.zeros((), dtype=torch.bool, device=indices.device)
    rows = max(1, REPEAT_CHECK_ELEMENTS // (B * K))
    for t0 in range(0, T, rows):
        ordered = indices[:, t0:t0 + rows].sort(dim=-1).values
        repeated |= ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()
    _raise_if_repeated(repeated)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def sparse_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float | None = None, with_target: bool = False
):
    """Backend "triton" of ops.sparse_attention: arguments and results as reference.sparse_attention
    (o [B, T, H, DV] in q's dtype, lse [B, T, H] fp32), differentiable in q, k, v (and lse).
    with_target: (o, lse, target), target the products forward's sum over heads of the fp32
    probabilities [B, T, K] (sparse_probs_target's value) or None in the kernels form."""
    _check(q, k, v, indices)
    _check_scale(scale)
    valid = known_valid_indices(indices, k.shape[1])
    if not valid and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
        _check_no_repeats(indices)  # no backward will look
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    combine = _view_of(v, k)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out = SparseAttentionFunction.apply(q, k, v, indices.contiguous(), scale, combine, with_target, valid)
    if not with_target:
        return out
    o, lse, target = out
    return o, lse, target if target.dim() == 3 else None  # the kernels form's stand-in is [0]


def _view_of(v: Tensor, k: Tensor) -> bool:
    """v is a differentiable view of k's own storage (absorbed MLA's kv[..., :DV]): a gradient
    for k's first DV columns reaches the same tensor as v's, so the backward may sum them."""
    base = k if k._base is None else k._base
    return v._base is not None and v._base is base and v.grad_fn is not None


# --- the indexer KL loss's sparse-stage target from the attention's lse ----------------------


@fast_launch
@triton.jit(do_not_specialize=["T", "K"])
def _target_kernel(
    q, k, idx, lse, out,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, si_b, si_t, sl_b, sl_t, so_b, so_t,
    scale_log2, T, K, G,
    R: tl.constexpr, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, HAS_D2: tl.constexpr,
    BH: tl.constexpr, BK: tl.constexpr,
):
    """One query t: out[b, t, j] = sum_h exp(scale q_h . k[idx_j, g(h)] - lse_h), 0 at -1 slots.

    The slots' key rows are read once per group straight from k (no gathered copy); the heads
    of the group BH at a time; the sum over heads stays in registers."""
    i_t, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    NHB: tl.constexpr = (R + BH - 1) // BH
    p_idx = idx + i_b * si_b + i_t * si_t
    p_q = q + i_b * sq_b + i_t * sq_t
    p_l = lse + i_b * sl_b + i_t * sl_t
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        b_acc = tl.zeros([BK], dtype=tl.float32)
        m_s = o_k < 0
        for i_g in range(G):
            p_k = k + i_b * sk_b + i_g * sk_g
            m_s, b_k1, b_k2, _ = _load_slots(p_idx, o_k, K, p_k, sk_s, p_k, sk_s, D, D1, D1, D2, HAS_D2,
                                             D1, True, BK)
            for i_hb in tl.static_range(NHB):
                o_r = i_hb * BH + tl.arange(0, BH)
                m_r = o_r < R
                o_h = i_g * R + o_r
                b_q1, b_q2 = _load_q(p_q, o_h, sq_h, m_r, D, D1, D2, HAS_D2, BH)
                b_l = tl.load(p_l + o_h, mask=m_r, other=float("inf")) * 1.4426950408889634
                b_s = _scores(b_q1, b_q2, b_k1, b_k2, HAS_D2) * scale_log2  # [BH, BK]
                b_p = tl.exp2(b_s - b_l[:, None])
                b_acc += tl.sum(tl.where(m_r[:, None] & m_s[None, :], b_p, 0.0), 0)
        tl.store(out + i_b * so_b + i_t * so_t + o_k, b_acc, mask=o_k < K)


def sparse_probs_target_triton(q: Tensor, k: Tensor, indices: Tensor, lse: Tensor, scale: float | None = None) -> Tensor:
    """ops.sparse_probs_target in Triton: q [B, T, H, D], k [B, S, G, D], indices [B, T, K],
    lse [B, T, H] -> [B, T, K] fp32 sum over heads of exp(scale q_h . k_j - lse_h)."""
    _check(q, k, k, indices)
    B, T, H, D = q.shape
    if tuple(lse.shape) != (B, T, H):
        raise ValueError(f"lse must be [B, T, H] = {(B, T, H)} (sparse_attention's second output), got {tuple(lse.shape)}")
    scale = D**-0.5 if scale is None else float(scale)
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    indices, lse = indices.contiguous(), lse.float().contiguous()
    sh = _Shape(q, k, k, indices)
    out = _alloc((B, T, sh.K), torch.float32, q.device)
    consts = {"R": sh.R, "D": D, "D1": sh.D1, "D2": sh.D2, "HAS_D2": sh.has_d2}
    _launch(
        _target_kernel, "KL target", ("target", *sh.key(q)),
        lambda c: (T, B),
        (q, k, indices, lse, out, *_row_strides(q), *_row_strides(k), indices.stride(0), indices.stride(1),
         lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), scale * LOG2E, T, sh.K, sh.G),
        consts, _candidates("target", sh.R, sh.width, _INTERPRET),
    )
    return out
