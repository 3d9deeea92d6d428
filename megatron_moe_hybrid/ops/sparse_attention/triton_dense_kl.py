"""The dense warm-up's indexer KL loss fused in Triton: no [T, S] target, scores or logits.

Shape legend: B batch, T queries, S keys, H query heads, G kv groups, R = H // G (head h reads
group h // R), D main q/k head dim, HI / DI indexer heads / head dim, BM queries and BN keys
per tile (the lse, forward and score-gradient kernels' query tiles: TILE_QUERIES, a multiple of
BM), Tc queries per backward chunk.

DeepSeek-V3.2's warm-up trains the indexer alone on KL(p[t] || softmax(I[t])) over every key
query t may read, where p[t] is the main attention's probabilities summed over heads,
L1-normalised, and I[t, s] = sum_j w[t, j] relu(q_idx[t, j] . k_idx[s]). With the main
attention's log-sum-exps lse_h[t] (one per head), p[t, s] = sum_h exp(scale q_h . k_s - lse_h)
/ P[t] with P[t] = sum_s of the numerator (= H up to rounding), so one pass over the keys
that keeps, per query, the online log-sum-exp lse_I of I and the sums

    P = sum_s p~,   A = sum_s p~ log p~,   C = sum_s p~ I        (p~ the unnormalised target)

gives KL[t] = A / P - log P - C / P + lse_I. The gradient of KL[t] with respect to I[t, s] is
softmax(I)[t, s] - p~[t, s] / P, recomputed tile by tile in the backward.

Kernels (every one loops only over each tile's readable keys lo[t] <= s <= hi[t]):
    _lse_kernel       [BM queries, one head]: the main attention's lse_h, online (forward).
    _kl_fwd_kernel    [BM queries, one block of KB keys]: p~ (a loop over the H heads) and I (a
                      loop over the HI indexer heads) per [BM, BN] tile; writes the block's
                      partial (max, sum-exp) of I and P, A, C per query.
    _kl_merge_kernel  [BM queries]: merges the key blocks' partials into lse_I, P and KL.
    _kl_dscores_kernel  the same recomputation per (query tile, key block) for a chunk of Tc
                      queries, writing dI = g (softmax(I) - p~ / P) into a [B, Tc, S] buffer
                      (bf16 for bf16 inputs, else fp32; bounded by budget_bytes: memory is linear
                      in T) in whole key tiles, 0 where the query cannot read.
    _kl_dq_kernel     [BM queries, two indexer heads stacked into one product]: d q_idx and
                      d weights from dI.
    _kl_dk_kernel     [BN keys, one block of the chunk's queries]: d k_idx summed over the
                      block's queries and every head (two heads a step), into an fp32 partial
                      per query block (summed in block order) or, with one block, added to the accumulator
                      chunk after chunk: no atomics, bitwise repeatable.
Splitting a row's keys into blocks (and the key gradient's queries) gives a causal sequence
many programs of at most KB keys each: one program per query tile (or key tile) left the
GPU to the last, longest ones (T / BN tiles) while the short ones had finished. The per-head
rows that the head loops read (lse_h, the weights) are laid out [B, heads, T] in fp32: a head's
values for a query tile are one contiguous run (the key-gradient kernel's loop prefetches them
with the tiles; bf16 weights it read one 2-byte load at a time).

The main-attention products are made three times (lse, forward, backward), the indexer's six
(forward, dI, twice in dq and twice in dk); the reference (chunked_indexer_kl_loss's dense branch)
instead writes and reads [Tc, H, S] and [Tc, HI, S] fp32 intermediates several times per chunk.
Dots take the input dtype (bf16/fp16 on the GPU; fp32 only in the CPU interpreter) and
accumulate in fp32. Tensor parallelism (the target summed over ranks' heads) is not fused:
chunked_indexer_kl_loss keeps its chunked form there.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import _check, _compute_dtype, check_kl_args
from .triton_indexer import read_ranges
from .._launch import fast_launch
from .._intmath import cdiv, next_power_of_2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Bytes of the backward's fp32 [B, Tc, S] score-gradient buffer per chunk of queries.
DSCORES_BUDGET_BYTES = 1 << 30
# Tiles on a GPU; the interpreter takes 16 x 16 so that small tests cross tile edges.
BM, BN = (16, 16) if _INTERPRET else (64, 64)
# (num_warps, num_stages) per kernel on a GPU. 3 stages prefetch the next head's tile one loop
# iteration earlier than 2 (Triton 3.6 issues it after the current product's wait); A/B on an H100
# (results/h100/dense_indexer_kl_split.json): 29.0 against 32.3 ms at GQA 8k, 17.4 against 20.8 at
# MLA 4k, the same outputs; 180-243 registers, no spill (MLA's forward 192 KB of shared memory).
LAUNCH = {name: (1, 1) for name in ("lse", "fwd", "merge", "dscores", "dq", "dk")} if _INTERPRET else {
    "lse": (4, 2), "fwd": (8, 3), "merge": (4, 1), "dscores": (8, 3), "dq": (8, 3), "dk": (8, 3)}
# The forward and score-gradient kernels take a query tile's keys in blocks of at least
# MIN_BLOCK_TILES key tiles, at most MAX_KEY_BLOCKS blocks a row (the forward's partial sums are
# 20 B per query and block), so that a causal sequence makes many programs of even length
# instead of one per query tile, the last ones T / BN tiles long.
MIN_BLOCK_TILES, MAX_KEY_BLOCKS = (2, 64) if _INTERPRET else (16, 32)
# The key-gradient kernel splits a backward chunk's queries into blocks, each summed into its
# own fp32 [B, S, DI] partial (at most DK_PARTIAL_BYTES in all), to make about DK_PROGRAMS
# programs.
DK_PROGRAMS = 8 if _INTERPRET else 1024
DK_PARTIAL_BYTES = 256 << 20
# The backward, A/B on an H100 in one process (results/h100/dense_indexer_kl_dq.json): at GQA 8k
# 29.1 -> 13.0 ms (the dq kernel 15.9 -> 2.2), at MLA 4k 17.6 -> 14.0. The score-gradient kernel
# writes dI in whole key tiles from multiples of BN (0 where a query cannot read), so that the
# query- and key-gradient kernels load it without a per-entry mask from aligned addresses (16-byte
# copies instead of one per element): that alone 29.1 -> 18.3 ms (dq 15.9 -> 6.3), MLA 17.6 -> 14.4.
# (dq's query tiles longest first moved it by 1% either way and is gone.)
# Indexer heads per program of the query-gradient kernel (stacked into one [DQ_HEADS BM, BN]
# product: each dI and key tile loaded once for them), when it divides the head count.
DQ_HEADS = 2
# Indexer heads per step of the key-gradient kernel's head loop (stacked into one [BN, DK_HEADS BM]
# product), when it divides the head count: dk 4.53 -> 3.81 ms at GQA 8k (255 registers, 72 B
# spilled under Triton 3.6).
DK_HEADS = 2
# Whether bf16 inputs keep the score-gradient buffer dI in bf16 (half the bytes that the query-
# and key-gradient kernels read; the products take dI times the weight in bf16 all the same). The
# weights' gradient, a sum whose terms cancel (dI sums to 0 over a row's keys), then comes 0.25%
# from the fp32 reference's (relative RMS; 5e-5 with fp32 dI), the other two as before.
DS_BF16 = True
# The kernels whose main-attention products take a head dim that is not a power of two in two
# parts (192 = 128 + 64: two products) instead of one padded to the next power of two (256):
# "lse" (_lse_kernel), "fwd" (_kl_fwd_kernel), "dscores" (_kl_dscores_kernel). At MLA 4k with
# 64-query tiles (H100, results/h100/dense_indexer_kl_tiles.json) the split forward took 5.51 ms
# against 4.25 whole, the split score gradients 5.02 against 5.25; at 128-query tiles (which at
# 256 wide would not fit 3 stages) the score gradients 4.52 split. So the forward takes it whole.
SPLIT_HEAD_DIM = frozenset({"lse", "dscores"})
# Queries per tile of the kernels that make the main-attention products, a pair: (where every
# head has a key of its own, R = 1: MLA's 128 heads; where heads share keys, GQA), each a power of
# two multiple of BM (the query- and key-gradient kernels keep BM). Where the head dim's (first)
# part is wider than TALL_TILE_HEAD_DIM a tile is BM tall whatever the pair says (taller ones
# would not fit the shared memory at 3 stages). Each head's [BM, D] query and [BN, D] key tiles
# are loaded per product, so a taller tile loads each key tile for more queries (32 -> 43 FLOPs
# per byte at 128 x 64) but holds more registers. Per kernel on an H100 (the same file; 64 / 128
# queries): MLA 4k lse 1.58 / 1.43 ms, forward 4.25 (whole) / 4.47 (split), score gradients
# 5.25 / 4.52 (split); GQA 8k lse 0.656 / 0.648, forward 3.34 / 2.68, score gradients 2.23 / 2.67.
TILE_QUERIES = {"lse": (2 * BM, 2 * BM), "fwd": (BM, 2 * BM), "dscores": (2 * BM, BM)}
TALL_TILE_HEAD_DIM = 128
# The largest head dims the kernels hold in one tile (padded to a power of two).
MAX_HEAD_DIM = 256


@triton.jit
def _tile_range(lo, hi, o_t, m_t):
    """[BM] readable ranges of the tile's queries and the union's first and last key."""
    b_lo = tl.load(lo + o_t, mask=m_t, other=1 << 30)
    b_hi = tl.load(hi + o_t, mask=m_t, other=-1)
    return b_lo, b_hi, tl.min(b_lo, 0), tl.max(b_hi, 0)


@triton.jit
def _probs_tile(q, k, lse, i_b, o_t, m_t, o_s, m_s, sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sl_b, sl_t, sl_h, scale,
                G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DP2: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN] fp32 sum over heads of exp(scale q_h . k_s - lse_h) (unmasked). The head dim in
    one part of DP (padded) or, DP2 > 0, two: [0, DP) and [DP, DP + DP2) (192 = 128 + 64)."""
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    p_q = q + i_b * sq_b + o_t[:, None].to(tl.int64) * sq_t + o_d[None, :]
    p_k = k + i_b * sk_b + o_s[:, None].to(tl.int64) * sk_s + o_d[None, :]
    if DP2 > 0:
        o_d2 = DP + tl.arange(0, DP2)
        m_d2 = o_d2 < D
        p_q2 = q + i_b * sq_b + o_t[:, None].to(tl.int64) * sq_t + o_d2[None, :]
        p_k2 = k + i_b * sk_b + o_s[:, None].to(tl.int64) * sk_s + o_d2[None, :]
    p_l = lse + i_b * sl_b + o_t.to(tl.int64) * sl_t
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for g in range(G):
        b_k = tl.load(p_k + g * sk_g, mask=m_s[:, None] & m_d[None, :], other=0.0)
        if DP2 > 0:
            b_k2 = tl.load(p_k2 + g * sk_g, mask=m_s[:, None] & m_d2[None, :], other=0.0)
        for r in range(R):
            h = g * R + r
            b_q = tl.load(p_q + h * sq_h, mask=m_t[:, None] & m_d[None, :], other=0.0)
            b_lse = tl.load(p_l + h * sl_h, mask=m_t, other=0.0)
            b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse)
            b_s = tl.dot(b_q, tl.trans(b_k))
            if DP2 > 0:
                b_q2 = tl.load(p_q2 + h * sq_h, mask=m_t[:, None] & m_d2[None, :], other=0.0)
                b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
            b_s = b_s * scale
            acc += tl.exp(b_s - b_lse[:, None])
    return acc


@triton.jit
def _index_tile(qi, ki, w, i_b, o_t, m_t, o_s, m_s, si_b, si_t, si_h, sk_b, sk_s, sw_b, sw_t, sw_h,
                HI: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN] fp32 index scores sum_j w_j relu(q_idx_j . k_idx) (unmasked)."""
    o_d = tl.arange(0, DIP)
    m_d = o_d < DI
    b_k = tl.load(ki + i_b * sk_b + o_s[:, None].to(tl.int64) * sk_s + o_d[None, :],
                  mask=m_s[:, None] & m_d[None, :], other=0.0)
    p_q = qi + i_b * si_b + o_t[:, None].to(tl.int64) * si_t + o_d[None, :]
    p_w = w + i_b * sw_b + o_t.to(tl.int64) * sw_t
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for j in range(HI):
        b_q = tl.load(p_q + j * si_h, mask=m_t[:, None] & m_d[None, :], other=0.0)
        b_w = tl.load(p_w + j * sw_h, mask=m_t, other=0.0).to(tl.float32)
        acc += tl.maximum(tl.dot(b_q, tl.trans(b_k)), 0.0) * b_w[:, None]
    return acc


@triton.jit
def _tiles(q, k, lse, qi, ki, w, i_b, o_t, m_t, b_lo, b_hi, s0, S,
           sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sl_b, sl_t, sl_h, si_b, si_t, si_h, ski_b, ski_s, sw_b, sw_t, sw_h, scale,
           G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DP2: tl.constexpr,
           HI: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Keys [s0, s0 + BN): their offsets, the [BM, BN] readable mask, the target numerator p~ and
    the index scores I (both unmasked)."""
    o_s = s0 + tl.arange(0, BN)
    m_s = o_s < S
    m_read = (o_s[None, :] >= b_lo[:, None]) & (o_s[None, :] <= b_hi[:, None])
    pt = _probs_tile(q, k, lse, i_b, o_t, m_t, o_s, m_s, sq_b, sq_t, sq_h, sk_b, sk_s, sk_g,
                     sl_b, sl_t, sl_h, scale, G, R, D, DP, DP2, BM, BN)
    it = _index_tile(qi, ki, w, i_b, o_t, m_t, o_s, m_s, si_b, si_t, si_h, ski_b, ski_s, sw_b, sw_t, sw_h,
                     HI, DI, DIP, BM, BN)
    return o_s, m_read, pt, it


@fast_launch
@triton.jit
def _lse_kernel(
    q, k, lo, hi, lse, sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sl_b, sl_t, sl_h, T, S, scale,
    R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    """lse[b, t, h] = log sum over readable s of exp(scale q_h . k_s), -inf with no key."""
    i_m, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_t = i_m * BM + tl.arange(0, BM)
    m_t = o_t < T
    b_lo, b_hi, s_lo, s_hi = _tile_range(lo, hi, o_t, m_t)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    b_q = tl.load(q + i_b * sq_b + o_t[:, None].to(tl.int64) * sq_t + i_h * sq_h + o_d[None, :],
                  mask=m_t[:, None] & m_d[None, :], other=0.0)
    p_k = k + i_b * sk_b + (i_h // R) * sk_g + o_d[None, :]
    if DP2 > 0:  # the head dim's second part (as _probs_tile)
        o_d2 = DP + tl.arange(0, DP2)
        m_d2 = o_d2 < D
        b_q2 = tl.load(q + i_b * sq_b + o_t[:, None].to(tl.int64) * sq_t + i_h * sq_h + o_d2[None, :],
                       mask=m_t[:, None] & m_d2[None, :], other=0.0)
        p_k2 = k + i_b * sk_b + (i_h // R) * sk_g + o_d2[None, :]
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    for s0 in range(s_lo, s_hi + 1, BN):
        o_s = s0 + tl.arange(0, BN)
        b_k = tl.load(p_k + o_s[:, None].to(tl.int64) * sk_s, mask=(o_s < S)[:, None] & m_d[None, :], other=0.0)
        m_read = (o_s[None, :] >= b_lo[:, None]) & (o_s[None, :] <= b_hi[:, None])
        b_s = tl.dot(b_q, tl.trans(b_k))
        if DP2 > 0:
            b_k2 = tl.load(p_k2 + o_s[:, None].to(tl.int64) * sk_s, mask=(o_s < S)[:, None] & m_d2[None, :], other=0.0)
            b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
        b_s = tl.where(m_read, b_s * scale, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_l = b_l * tl.exp(b_m - m_use) + tl.sum(tl.exp(b_s - m_use[:, None]), 1)
        b_m = m_new
    b_lse = tl.where(b_l > 0, b_m + tl.log(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
    tl.store(lse + i_b * sl_b + o_t.to(tl.int64) * sl_t + i_h * sl_h, b_lse, mask=m_t)


@triton.jit
def _block_range(lo, hi, o_t, m_t, k0, KB):
    """_tile_range of the queries' readable keys inside the key block [k0, k0 + KB)."""
    b_lo, b_hi, _, _ = _tile_range(lo, hi, o_t, m_t)
    b_lo = tl.maximum(b_lo, k0)
    b_hi = tl.minimum(b_hi, k0 + KB - 1)
    return b_lo, b_hi, tl.min(b_lo, 0), tl.max(b_hi, 0)


@fast_launch
@triton.jit
def _kl_fwd_kernel(
    q, k, lse, qi, ki, w, lo, hi, part,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sl_b, sl_t, sl_h, si_b, si_t, si_h, ski_b, ski_s, sw_b, sw_t, sw_h,
    sp, T, S, KB, NKB, scale,
    G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DP2: tl.constexpr,
    HI: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    """Per query, over its readable keys in block i_k ([i_k KB, + KB)): the running max m and
    sum l of exp(I - m), and P, A, C, into part[0..4, b, t, i_k] (-inf, 0, 0, 0, 0 with no key)."""
    i_k, i_m, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_t = i_m * BM + tl.arange(0, BM)
    m_t = o_t < T
    b_lo, b_hi, s_lo, s_hi = _block_range(lo, hi, o_t, m_t, i_k * KB, KB)
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_p = tl.zeros([BM], dtype=tl.float32)
    b_a = tl.zeros([BM], dtype=tl.float32)
    b_c = tl.zeros([BM], dtype=tl.float32)
    for s0 in range(s_lo, s_hi + 1, BN):
        _, m_read, pt, it = _tiles(q, k, lse, qi, ki, w, i_b, o_t, m_t, b_lo, b_hi, s0, S, sq_b, sq_t, sq_h, sk_b, sk_s,
                                   sk_g, sl_b, sl_t, sl_h, si_b, si_t, si_h, ski_b, ski_s, sw_b, sw_t, sw_h, scale,
                                   G, R, D, DP, DP2, HI, DI, DIP, BM, BN)
        pt = tl.where(m_read, pt, 0.0)
        b_c += tl.sum(pt * it, 1)  # pt is 0 at unreadable keys, it finite everywhere
        it = tl.where(m_read, it, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(it, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_l = b_l * tl.exp(b_m - m_use) + tl.sum(tl.exp(it - m_use[:, None]), 1)
        b_m = m_new
        b_p += tl.sum(pt, 1)
        b_a += tl.sum(tl.where(pt > 0, pt * tl.log(tl.where(pt > 0, pt, 1.0)), 0.0), 1)
    p_o = part + (i_b * T + o_t.to(tl.int64)) * NKB + i_k
    tl.store(p_o, b_m, mask=m_t)
    tl.store(p_o + sp, b_l, mask=m_t)
    tl.store(p_o + 2 * sp, b_p, mask=m_t)
    tl.store(p_o + 3 * sp, b_a, mask=m_t)
    tl.store(p_o + 4 * sp, b_c, mask=m_t)


@fast_launch
@triton.jit
def _kl_merge_kernel(part, lo, hi, lse_i, mass, kl, sp, T, NKB, BM: tl.constexpr, NKBP: tl.constexpr):
    """Per query, the key blocks' partial sums merged: lse_i (of I over the readable keys), mass P
    and KL = A / P - log P - C / P + lse_i (0 with no key) into [B, T]."""
    i_m, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_t = i_m * BM + tl.arange(0, BM)
    m_t = o_t < T
    o_k = tl.arange(0, NKBP)
    m_p = m_t[:, None] & (o_k < NKB)[None, :]
    p_p = part + (i_b * T + o_t[:, None].to(tl.int64)) * NKB + o_k[None, :]
    b_m = tl.load(p_p, mask=m_p, other=float("-inf"))
    m_all = tl.max(b_m, 1)
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    b_l = tl.sum(tl.load(p_p + sp, mask=m_p, other=0.0) * tl.exp(b_m - m_use[:, None]), 1)
    b_p = tl.sum(tl.load(p_p + 2 * sp, mask=m_p, other=0.0), 1)
    b_a = tl.sum(tl.load(p_p + 3 * sp, mask=m_p, other=0.0), 1)
    b_c = tl.sum(tl.load(p_p + 4 * sp, mask=m_p, other=0.0), 1)
    b_lo = tl.load(lo + o_t, mask=m_t, other=1 << 30)
    b_hi = tl.load(hi + o_t, mask=m_t, other=-1)
    # (b_p > 0) | NaN, the reference's ~(sum <= 0): a NaN target keeps its query, so the NaN
    # reaches the loss instead of the query silently leaving it
    valid = (b_hi >= b_lo) & ((b_p > 0) | (b_p != b_p))
    b_pp = tl.where(valid, b_p, 1.0)
    b_lse = tl.where(b_l > 0, m_use + tl.log(tl.where(b_l > 0, b_l, 1.0)), 0.0)
    b_kl = tl.where(valid, b_a / b_pp - tl.log(b_pp) - b_c / b_pp + b_lse, 0.0)
    o = i_b * T + o_t
    tl.store(lse_i + o, b_lse, mask=m_t)
    tl.store(mass + o, tl.where(valid, b_p, 0.0), mask=m_t)
    tl.store(kl + o, b_kl, mask=m_t)


@fast_launch
@triton.jit
def _kl_dscores_kernel(
    q, k, lse, qi, ki, w, lo, hi, lse_i, mass, dkl, ds,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sl_b, sl_t, sl_h, si_b, si_t, si_h, ski_b, ski_s, sw_b, sw_t, sw_h,
    sd_b, sd_t, t0, t1, T, S, KB, scale,
    G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DP2: tl.constexpr,
    HI: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    """ds[b, t - t0, s] = dkl[b, t] (softmax(I)[t, s] - p~[t, s] / P[t]) at readable keys s of
    block i_k ([i_k KB, + KB)) of queries t0 <= t < t1, over whole key tiles from a multiple of
    BN, 0 at the tiles' unreadable entries (so that the readers' tiles, aligned the same way, need
    no per-entry mask); entries outside those tiles are left unwritten. Its query tile (BM here,
    TILE_QUERIES["dscores"]) is whole reader tiles (the module's BM) from t0, so a reader tile's
    readable keys lie within the union that its writer covers."""
    i_k, i_m, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_t = t0 + i_m * BM + tl.arange(0, BM)
    m_t = o_t < t1
    b_lo, b_hi, s_lo, s_hi = _block_range(lo, hi, o_t, m_t, i_k * KB, KB)
    o = i_b * T + o_t
    b_mass = tl.load(mass + o, mask=m_t, other=0.0)
    b_g = tl.load(dkl + o, mask=m_t, other=0.0)
    m_mass = (b_mass > 0) | (b_mass != b_mass)
    b_g = tl.where(m_mass, b_g, 0.0)
    b_inv = b_g / tl.where(m_mass, b_mass, 1.0)
    b_lse = tl.load(lse_i + o, mask=m_t, other=0.0)
    p_d = ds + i_b * sd_b + (o_t - t0)[:, None].to(tl.int64) * sd_t
    s_lo = s_lo // BN * BN  # the block starts at a multiple of BN: its tiles stay inside it
    for s0 in range(s_lo, s_hi + 1, BN):
        o_s, m_read, pt, it = _tiles(q, k, lse, qi, ki, w, i_b, o_t, m_t, b_lo, b_hi, s0, S, sq_b, sq_t, sq_h, sk_b,
                                     sk_s, sk_g, sl_b, sl_t, sl_h, si_b, si_t, si_h, ski_b, ski_s, sw_b, sw_t, sw_h, scale,
                                     G, R, D, DP, DP2, HI, DI, DIP, BM, BN)
        b_ds = b_g[:, None] * tl.exp(it - b_lse[:, None]) - b_inv[:, None] * pt
        b_ds = tl.where(m_read, b_ds, 0.0).to(ds.dtype.element_ty)
        tl.store(p_d + o_s[None, :], b_ds, mask=(o_s < S)[None, :] & m_t[:, None])


@fast_launch
@triton.jit
def _kl_dq_kernel(
    qi, ki, w, lo, hi, ds, dqi, dw,
    si_b, si_t, si_h, ski_b, ski_s, sw_b, sw_t, sw_h, sd_b, sd_t, sdw_b, sdw_t, t0, t1, S,
    DI: tl.constexpr, DIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, JH: tl.constexpr,
):
    """d q_idx[b, t, j] and d weights[b, t, j] of queries t0 <= t < t1, for JH indexer heads
    j = i_j JH + r stacked as the rows (r, t) of one [JH BM, BN] product, so that each dI and key
    tile is loaded once for JH heads (the head axis is the fastest grid axis: the heads of a query
    tile run side by side and share its dI tiles in L2). dI holds whole key tiles from a multiple
    of BN (0 where unreadable), read as such."""
    i_j, i_m, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_t = t0 + i_m * BM + tl.arange(0, BM)
    m_t = o_t < t1
    _, _, s_lo, s_hi = _tile_range(lo, hi, o_t, m_t)
    o_d = tl.arange(0, DIP)
    m_d = o_d < DI
    # row r * BM + i of the stacked tile: head i_j * JH + r, query o_t[i]
    o_r = tl.arange(0, JH * BM)
    r_t = t0 + i_m * BM + o_r % BM
    r_h = i_j * JH + o_r // BM
    m_r = r_t < t1
    off_q = i_b * si_b + r_t[:, None].to(tl.int64) * si_t + r_h[:, None] * si_h + o_d[None, :]
    b_q = tl.load(qi + off_q, mask=m_r[:, None] & m_d[None, :], other=0.0)
    b_w = tl.load(w + i_b * sw_b + r_t.to(tl.int64) * sw_t + r_h * sw_h, mask=m_r, other=0.0).to(tl.float32)
    p_d = ds + i_b * sd_b + (o_t - t0)[:, None].to(tl.int64) * sd_t
    b_dq = tl.zeros([JH * BM, DIP], dtype=tl.float32)
    b_dw = tl.zeros([JH * BM], dtype=tl.float32)
    for s0 in range(s_lo // BN * BN, s_hi + 1, BN):
        o_s = s0 + tl.arange(0, BN)
        b_ds = tl.load(p_d + o_s[None, :], mask=m_t[:, None] & (o_s < S)[None, :], other=0.0).to(tl.float32)
        if JH > 1:
            b_ds = tl.reshape(tl.broadcast_to(b_ds[None, :, :], (JH, BM, BN)), (JH * BM, BN))
        b_k = tl.load(ki + i_b * ski_b + o_s[:, None].to(tl.int64) * ski_s + o_d[None, :],
                      mask=(o_s < S)[:, None] & m_d[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k))
        b_dw += tl.sum(tl.maximum(b_s, 0.0) * b_ds, 1)
        b_dl = tl.where(b_s > 0, b_ds * b_w[:, None], 0.0).to(b_k.dtype)
        b_dq += tl.dot(b_dl, b_k)
    tl.store(dqi + off_q, b_dq.to(dqi.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
    tl.store(dw + i_b * sdw_b + r_t.to(tl.int64) * sdw_t + r_h, b_dw.to(dw.dtype.element_ty), mask=m_r)


@fast_launch
@triton.jit
def _kl_dk_kernel(
    qi, ki, w, lo, hi, ds, dk,
    si_b, si_t, si_h, ski_b, ski_s, sw_b, sw_t, sw_h, sd_b, sd_t, t0, t1, QB, B, S,
    HI: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    JH: tl.constexpr, ADD: tl.constexpr,
):
    """The gradient of k_idx[b, s] from the queries of block i_q, [t0 + i_q QB, + QB) within
    [t0, t1): ADD: added into dk[b, s] (fp32 [B, S, DI]); else written to dk[i_q, b, s] (fp32
    [NQB, B, S, DI], summed by the caller in a fixed order). JH indexer heads per step, stacked as
    the columns (r, t) of one [BN, JH BM] product. dI holds whole key tiles (0 where unreadable),
    read without a per-entry mask."""
    i_n, i_q, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    q0 = t0 + i_q * QB
    q1 = tl.minimum(t1, q0 + QB)
    o_s = i_n * BN + tl.arange(0, BN)
    m_s = o_s < S
    o_d = tl.arange(0, DIP)
    m_d = o_d < DI
    b_k = tl.load(ki + i_b * ski_b + o_s[:, None].to(tl.int64) * ski_s + o_d[None, :],
                  mask=m_s[:, None] & m_d[None, :], other=0.0)
    b_dk = tl.zeros([BN, DIP], dtype=tl.float32)
    o_r = tl.arange(0, JH * BM)  # row r * BM + i of the stacked queries: head j + r, query m0 + i
    for m0 in range(q0, q1, BM):
        o_t = m0 + tl.arange(0, BM)
        m_t = o_t < q1
        _, _, s_lo, s_hi = _tile_range(lo, hi, o_t, m_t)
        if (i_n * BN <= s_hi) & (i_n * BN + BN > s_lo):
            p_d = ds + i_b * sd_b + (o_t - t0)[None, :].to(tl.int64) * sd_t + o_s[:, None]
            b_ds = tl.load(p_d, mask=m_s[:, None] & m_t[None, :], other=0.0).to(tl.float32)  # [BN, BM]
            if JH > 1:
                b_ds = tl.reshape(tl.broadcast_to(b_ds[:, None, :], (BN, JH, BM)), (BN, JH * BM))
            r_t = m0 + o_r % BM
            m_r = r_t < q1
            p_q = qi + i_b * si_b + r_t[:, None].to(tl.int64) * si_t + (o_r // BM)[:, None] * si_h + o_d[None, :]
            p_w = w + i_b * sw_b + r_t.to(tl.int64) * sw_t + (o_r // BM) * sw_h
            for j in range(0, HI, JH):
                b_q = tl.load(p_q + j * si_h, mask=m_r[:, None] & m_d[None, :], other=0.0)
                b_w = tl.load(p_w + j * sw_h, mask=m_r, other=0.0).to(tl.float32)
                b_s = tl.dot(b_k, tl.trans(b_q))  # [BN, JH BM]
                b_dl = tl.where(b_s > 0, b_ds * b_w[None, :], 0.0).to(b_q.dtype)
                b_dk += tl.dot(b_dl, b_q)
    m_o = m_s[:, None] & m_d[None, :]
    if ADD:
        p_o = dk + (i_b * S + o_s[:, None].to(tl.int64)) * DI + o_d[None, :]
        tl.store(p_o, tl.load(p_o, mask=m_o, other=0.0) + b_dk, mask=m_o)
    else:
        p_o = dk + ((i_q * B + i_b) * S + o_s[:, None].to(tl.int64)) * DI + o_d[None, :]
        tl.store(p_o, b_dk, mask=m_o)


def _key_blocks(S: int) -> tuple[int, int]:
    """(keys per block KB, blocks NKB) of the forward and score-gradient kernels."""
    tiles = max(MIN_BLOCK_TILES, cdiv(cdiv(max(S, 1), BN), MAX_KEY_BLOCKS))
    return tiles * BN, cdiv(max(S, 1), tiles * BN)


def _query_blocks(n: int, B: int, S: int, DI: int) -> int:
    """Queries per block QB (a multiple of BM) of the key-gradient kernel for a chunk of n queries."""
    tiles = cdiv(n, BM)
    blocks = min(tiles, cdiv(DK_PROGRAMS, B * cdiv(S, BN)), max(1, DK_PARTIAL_BYTES // (B * S * DI * 4)))
    return cdiv(tiles, max(1, blocks)) * BM


def _dscores_dtype(q_idx: Tensor) -> torch.dtype:
    """The score-gradient buffer's dtype: bf16 for bf16 inputs under DS_BF16 (its entries, about
    dkl / S, keep bf16's exponent range; fp16's would flush them to zero), else fp32."""
    return torch.bfloat16 if DS_BF16 and q_idx.dtype == torch.bfloat16 else torch.float32


def _launch(kernel: str) -> dict:
    num_warps, num_stages = LAUNCH[kernel]
    return dict(num_warps=num_warps, num_stages=num_stages)


def _meta(q: Tensor, k: Tensor, q_idx: Tensor, kernel: str) -> dict:
    """The constexprs of the forward / score-gradient kernel (kernel "fwd" / "dscores")."""
    H, D = q.shape[2:]
    G = k.shape[2]
    HI, DI = q_idx.shape[2:]
    DP, DP2 = _head_dim_parts(D, kernel)
    return dict(G=G, R=H // G, D=D, DP=DP, DP2=DP2, HI=HI, DI=DI,
                DIP=max(16, next_power_of_2(DI)), BM=_tile_queries(kernel, H // G, DP), BN=BN)


def _tile_queries(kernel: str, R: int, DP: int) -> int:
    """Queries per tile of kernel ("lse", "fwd", "dscores") for R heads per key and a (first) head-
    dim part DP wide: TILE_QUERIES' (BM above TALL_TILE_HEAD_DIM), a multiple of BM."""
    own, shared = TILE_QUERIES[kernel]
    bm = (own if R == 1 else shared) if DP <= TALL_TILE_HEAD_DIM else BM
    if bm % BM or bm & (bm - 1):
        raise ValueError(f"triton_dense_kl.TILE_QUERIES[{kernel!r}] must hold power of two multiples of {BM}, got {bm}")
    return bm


def _head_dim_parts(D: int, kernel: str) -> tuple[int, int]:
    """(DP, DP2): the head dim D padded to one power of two (DP2 = 0) or, for the kernels named in
    SPLIT_HEAD_DIM, in two (192: 128 + 64 rather than 256)."""
    DP = max(16, next_power_of_2(D))
    if kernel in SPLIT_HEAD_DIM and DP != D and D > 16:
        return DP // 2, max(16, next_power_of_2(D - DP // 2))
    return DP, 0


class DenseIndexerKL(torch.autograd.Function):
    """Per-query KL [B, T] fp32 (0 for queries with no key); gradients to q_idx, k_idx, weights."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, weights, q, k, lo, hi, scale, budget_bytes):
        B, T, H, _ = q.shape
        S = k.shape[1]
        meta = _meta(q, k, q_idx, "fwd")
        dev = q.device
        # per-head rows of T (lse [B, H, T]; the weights as fp32 [B, HI, T]): a head's values for a
        # query tile are one contiguous fp32 run (prefetched in the key-gradient kernel's head loop;
        # the forward's loops load them directly, from L1 after the first key tile)
        lse = torch.empty((B, H, T), dtype=torch.float32, device=dev)
        w32 = weights.detach().float().transpose(1, 2).contiguous()
        lse_i = torch.empty((B, T), dtype=torch.float32, device=dev)
        mass = torch.empty_like(lse_i)
        kl = torch.empty_like(lse_i)
        if T:
            lse_dp = _head_dim_parts(meta["D"], "lse")
            bm = _tile_queries("lse", meta["R"], lse_dp[0])
            _lse_kernel[(cdiv(T, bm), H, B)](
                q, k, lo, hi, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                *_row_strides(lse), T, S, scale,
                R=meta["R"], D=meta["D"], DP=lse_dp[0], DP2=lse_dp[1], BM=bm, BN=BN, **_launch("lse"),
            )
            KB, NKB = _key_blocks(S)
            # m, l, P, A, C per block, kept as the kernel sums them (fp32; fp64 in the interpreter,
            # whose sums take fp64 inputs' dtype)
            part = torch.empty((5, B, T, NKB), dtype=_compute_dtype(q_idx), device=dev)
            _kl_fwd_kernel[(NKB, cdiv(T, meta["BM"]), B)](
                q, k, lse, q_idx, k_idx, w32, lo, hi, part, *_strides(q, k, lse, q_idx, k_idx, w32),
                part.stride(0), T, S, KB, NKB, scale, **meta, **_launch("fwd"),
            )
            _kl_merge_kernel[(cdiv(T, BM), B)](
                part, lo, hi, lse_i, mass, kl, part.stride(0), T, NKB, BM=BM, NKBP=next_power_of_2(NKB),
                **_launch("merge"),
            )
        ctx.save_for_backward(q_idx, k_idx, weights, w32, q, k, lo, hi, lse, lse_i, mass)
        ctx.scale, ctx.budget = scale, budget_bytes
        return kl

    @staticmethod
    def backward(ctx, dkl):
        q_idx, k_idx, weights, w32, q, k, lo, hi, lse, lse_i, mass = ctx.saved_tensors
        B, T = q.shape[:2]
        S, DI = k_idx.shape[1:]
        HI = q_idx.shape[2]
        meta = _meta(q, k, q_idx, "dscores")
        dkl = dkl.float().contiguous()
        dqi = torch.empty_like(q_idx)
        dw = torch.empty_like(weights)
        dk = torch.zeros((B, S, DI), dtype=torch.float32, device=q.device)
        ds_dtype = _dscores_dtype(q_idx)
        bm = meta["BM"]  # a multiple of BM: the chunk's tiles of either size start at t0
        Tc = max(bm, ctx.budget // max(1, B * S * ds_dtype.itemsize) // bm * bm)
        ds = None
        if T:
            ds = torch.empty((B, min(T, Tc), S), dtype=ds_dtype, device=q.device)
            if _INTERPRET:  # an entry left unwritten that a reader takes unmasked turns the tests' gradients NaN
                ds.fill_(float("nan"))
        JH = DQ_HEADS if HI % DQ_HEADS == 0 else 1
        strides = _strides(q, k, lse, q_idx, k_idx, w32)
        istrides = (q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
                    *_row_strides(w32))
        KB, NKB = _key_blocks(S)
        for t0 in range(0, T, Tc):
            t1 = min(T, t0 + Tc)
            _kl_dscores_kernel[(NKB, cdiv(t1 - t0, meta["BM"]), B)](
                q, k, lse, q_idx, k_idx, w32, lo, hi, lse_i, mass, dkl, ds, *strides,
                ds.stride(0), ds.stride(1), t0, t1, T, S, KB, ctx.scale, **meta, **_launch("dscores"),
            )
            _kl_dq_kernel[(HI // JH, cdiv(t1 - t0, BM), B)](
                q_idx, k_idx, w32, lo, hi, ds, dqi, dw, *istrides, ds.stride(0), ds.stride(1), dw.stride(0),
                dw.stride(1), t0, t1, S,
                DI=DI, DIP=meta["DIP"], BM=BM, BN=BN, JH=JH, **_launch("dq"),
            )
            QB = _query_blocks(t1 - t0, B, S, DI)
            NQB = cdiv(t1 - t0, QB)
            # one block adds into dk itself; several write partials, summed here in block order
            out = dk if NQB == 1 else torch.empty((NQB, B, S, DI), dtype=torch.float32, device=q.device)
            _kl_dk_kernel[(cdiv(S, BN), NQB, B)](
                q_idx, k_idx, w32, lo, hi, ds, out, *istrides, ds.stride(0), ds.stride(1), t0, t1, QB, B, S,
                HI=HI, DI=DI, DIP=meta["DIP"], BM=BM, BN=BN, JH=DK_HEADS if HI % DK_HEADS == 0 else 1,
                ADD=NQB == 1, **_launch("dk"),
            )
            if NQB > 1:
                dk += out.sum(0)
        return dqi, dk.to(k_idx.dtype), dw, None, None, None, None, None, None


def _row_strides(x: Tensor) -> tuple:
    """(batch, query, head) strides of a per-head [B, H, T] tensor."""
    return x.stride(0), x.stride(2), x.stride(1)


def _strides(q, k, lse, q_idx, k_idx, w32) -> tuple:
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), *_row_strides(lse),
            q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1), *_row_strides(w32))


def dense_kl_unsupported(q: Tensor, k: Tensor, q_idx: Tensor, k_idx: Tensor, weights: Tensor) -> str | None:
    """Why the fused kernels cannot take these inputs (None: they can)."""
    if q.dtype != k.dtype or q_idx.dtype != k_idx.dtype:
        return f"q/k ({q.dtype}, {k.dtype}) and q_idx/k_idx ({q_idx.dtype}, {k_idx.dtype}) must share a dtype"
    if q.shape[-1] > MAX_HEAD_DIM or q_idx.shape[-1] > MAX_HEAD_DIM:
        return f"head dims D={q.shape[-1]}, DI={q_idx.shape[-1]} above {MAX_HEAD_DIM}"
    for name, x in (("q", q), ("q_idx", q_idx), ("weights", weights)):
        if not x.is_floating_point():
            return f"{name} must be floating point, got {x.dtype}"
        if not x.is_cuda and x.dtype == torch.bfloat16:
            return f"{name}: the CPU interpreter reads bf16 wrongly; use fp32 or fp16 on the CPU"
    return None


def dense_indexer_kl_triton(
    q: Tensor, k: Tensor, q_idx: Tensor, k_idx: Tensor, weights: Tensor, scale: float | None = None,
    cu_seqlens: Tensor | None = None, q_positions: Tensor | None = None, budget_bytes: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The dense warm-up's indexer KL, fused: (KL [B, T] per query, 0 where the query reads no
    key, fp32 (fp64 for fp64 inputs, computed in fp32 all the same); valid [B, T] bool).

    q [B, T, H, D], k [B, S, G, D] (the main attention's, detached: only the indexer trains),
    q_idx [B, T, HI, DI], k_idx [B, S, DI], weights [B, T, HI]; causal, masks as in
    lightning_indexer. Equal to indexer_kl_sum(lightning_indexer(...),
    attention_probs_target(q, k)) per query; no [T, S] tensor (the backward holds an fp32
    [B, Tc, S] chunk of budget_bytes)."""
    B, T, S, H, G, D = check_kl_args(q, k, q_idx, k_idx, weights)
    why = dense_kl_unsupported(q, k, q_idx, k_idx, weights)
    _check(why is None, f"dense_indexer_kl_triton: {why}")
    scale = D**-0.5 if scale is None else float(scale)
    lo, hi = read_ranges(B, T, S, True, cu_seqlens, q_positions, q.device)
    budget = DSCORES_BUDGET_BYTES if budget_bytes is None else budget_bytes
    q, k = q.detach().contiguous(), k.detach().contiguous()
    q_idx, k_idx, weights = (x.contiguous() for x in (q_idx, k_idx, weights))
    kl = DenseIndexerKL.apply(q_idx, k_idx, weights, q, k, lo, hi, scale, budget)
    valid = (hi >= lo)[None, :].expand(B, T)
    return kl.to(_compute_dtype(q_idx)), valid  # the reference's dtype
