"""The lightning indexer's scoring fused with top-k key selection, in Triton.

Shape legend: B batch, T queries, S keys, HI indexer heads, DI indexer head dim, K top-k,
Tc queries per chunk, Sc keys a chunk can read (its last readable key + 1).

    I[b, t, s] = sum_j w[b, t, j] * relu(q_idx[b, t, j] . k_idx[b, s])

_score_keys_kernel computes a [BQ, BS] tile of I for all HI heads in registers (the key tile
is loaded once and reused by every head; the [T, HI, S] per-head logits of the reference
never exist) and writes it as one int32 order key per (query, key):

    ord(I)    fp32 bits mapped to int32 with the float order (-0.0 taken as +0.0)

Keys a query may not read (after it, or in another packed sequence) get I = -inf and decode
to -1. Selection (_select_rows) then takes the reference's tie rule (a stable descending
sort: among equal scores the lowest key index) without sorting a whole row: find the K-th
largest value v of each row, stream the row once keeping, in key order, every key above v and
the first K - #(above v) keys equal to v, then a stable descending sort of those K keys orders
them. Two forms (SELECT_THRESHOLD):
- "topk": torch.topk (unsorted) gives v, _compact_kernel keeps the keys, torch.sort orders
  them. int32 keys halve the bytes against int64 sort keys (benchmarks/device/topk_probe.py:
  8.1 against 12.2 ms at 128k keys).
- "radix": one program per row finds v by a radix select (_radix_kth: RADIX_BITS bits a pass,
  each a histogram of the next digit among the keys that match the digits fixed so far) and
  keeps the keys, in _radix_kth_kernel; torch.sort orders them (SELECT_SORT "torch"), or a
  bitonic sort in the same program (_write_in_order, "kernel").
- "auto" (the default): "radix" for rows of at least RADIX_AUTO_MIN_KEYS keys on the GPU (by
  the runs below), "topk" for shorter rows and in the interpreter.
Queries are processed Tc at a time so that the [Tc, Sc] key buffer stays under
SCORE_BUDGET_BYTES: memory is linear in T for a fixed budget, and no [T, S] tensor is ever held.
Each chunk reads only the keys up to its last readable one (Sc), so a causal chunk early in the
sequence costs little.

Long rows (Sc >= SELECT_BLOCK_MIN_KEYS, token mode): the scoring kernel also writes the largest
order key of each run of SELECT_BLOCK keys.
- "topk": _select_by_blocks keeps the K best runs (the same selection over the runs' maxima:
  ties to the lower run) and selects among their K * SELECT_BLOCK keys, in key order, instead of
  the whole row. The keys above the K-th value lie in fewer than K runs, all kept, and the tie
  rule's lowest keys equal to it lie in the lowest runs whose best equals it, which the runs'
  own tie rule keeps: the result is the whole row's.
- "radix": the K-th best run's key r bounds v from below (K keys, the K best runs' best, are
  >= r), so the top K lie among the keys >= r, in the runs whose best is >= r:
  _select_by_runs_kernel lists those runs, reads only them, lists their
  keys >= r in key order (about 1.01-1.4 K on random rows) and selects among them; rows of more
  than SELECT_CANDIDATES K such keys (ties) select from the whole row. The radix form takes the
  runs from RADIX_RUNS_MIN_KEYS keys.

Block mode (block_size=bs): the keys are cut into blocks [i bs, (i + 1) bs); a block scores
its best key (ties to the lower block), the ceil(K / bs) best blocks are kept, and the top-K
readable keys inside them are returned in order (an int64 sort key ord << 32 | (2^32 - 1 - s)
over those few keys carries the tie rule): the selection is a few contiguous runs of keys, so
neighbouring queries share their loads.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import (
    _check,
    _check_indexer_args,
    _check_k_scale,
    _check_selection_args,
    _query_positions,
    _segment_ids,
)
from .triton_sparse import check_index_range, per_key_lists, sum_rows_per_key
from .._launch import fast_launch
from .._intmath import cdiv, next_power_of_2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Bytes of one chunk's [B, Tc, Sc] int32 order keys and, on long rows, its runs' maxima
# (the selection's working set comes on top).
SCORE_BUDGET_BYTES = 2 << 30
KEY_BYTES = 4
LOW_MASK = (1 << 32) - 1
# ord(-inf): the order key of every unreadable key (the high word of its int64 sort key).
ORD_NEG_INF = -2139095041
INT32_MIN = -(1 << 31)  # block mode's padding keys: below every real one, -inf included
COMPACT_BLOCK, COMPACT_WARPS = 2048, 4  # _compact_kernel's columns per step and warps
# Launch config on a GPU (benchmarks/sparse_layer.py --sweep times others); the interpreter
# takes 16 x 16 tiles so that small tests cross tile edges. On an H100 at 128k keys the 128-key
# tiles on 4 warps score in 13.97 ms bf16 / 8.75 fp8 against 18.95 / 11.03 for 64 x 64
# (results/h100/indexer_config.json); fp8 rows take the same (3 stages: within 1%).
CONFIG = {"BQ": 64, "BS": 128, "num_warps": 4, "num_stages": 2}
CONFIG_FP8 = dict(CONFIG)  # fp8 rows
# Token mode over long rows selects through the runs' maxima (the module's docstring): the
# scoring kernel also writes each run of SELECT_BLOCK keys' best order key. Rows of at least
# SELECT_BLOCK_MIN_KEYS keys take it.
SELECT_BLOCK = 16
# torch.topk's form by runs, on an H100: 0.92x at 128k keys, 5.1x at 1M (results/h100/indexer_select_runs.json)
SELECT_BLOCK_MIN_KEYS = 196608
# Rows of _select_by_blocks' candidate step at a time (its [rows, topk * SELECT_BLOCK] int64 columns).
SELECT_BLOCK_ROWS = 1024
# The selection's form (the module's docstring): "topk", torch.topk's threshold, "radix", the
# radix select's kernels (RADIX_BITS bits a pass, ceil(32 / RADIX_BITS) reads of the row), or
# "auto": the radix form for rows of at least RADIX_AUTO_MIN_KEYS keys on the GPU (by runs), where
# it was the faster; torch.topk's below and in the interpreter (where the radix kernels cost about
# 30 ms a row). On an H100 in one run (results/h100/indexer_radix_listed.json, every form equal),
# the indexer with top-k at 64k / 128k / 1M keys: 9.28 / 16.73 / 127.8 ms radix (runs listed,
# ordered by torch.sort) against 12.04 / 23.00 / 131.4 for torch.topk's form, the selection alone
# 1.88 / 2.21 / 6.26 against 4.69 / 8.61 / 12.80. Over whole rows the radix kernel is slower than
# torch.topk's form at every length (its 8-bit histograms: 10.9 against 8.5 ms at 128k keys,
# results/h100/indexer_radix.json; 6.88 against 6.51 at 32k keys, too few keys for the runs).
SELECT_THRESHOLD = "auto"
RADIX_AUTO_MIN_KEYS = 65536
RADIX_RUNS_MIN_KEYS = 65536  # the radix form selects by runs from here (SELECT_BLOCK_MIN_KEYS: torch.topk's)
RADIX_BITS = 8
# Columns per step of the passes and of the compaction that follows in the same kernel, and
# warps (Triton 3.6, sm_90, tools/compile_kernels.py): at 8 bits, 4096 / 1024 on 8 warps take 64
# registers without the ordering (four programs per SM), 78 with it (three), the runs kernel 80
# either way (with the ordering in the kernel, 8 bytes of local memory); 2048-column compaction
# steps 99, 11-bit digits 255 and a spill.
RADIX_BLOCK, RADIX_CBLOCK, RADIX_WARPS = 4096, 1024, 8
# The radix form orders its selection with torch.sort after its kernel ("torch") or in the kernel
# ("kernel": _write_in_order's bitonic sort of the row's topk keys). torch.sort was the faster in
# every H100 run: by listed runs 1.88 / 2.21 / 6.26 ms against 2.26 / 2.62 / 6.65 at 64k / 128k /
# 1M keys (the selection alone, results/h100/indexer_radix_listed.json), over whole rows 10.16
# against 11.04 at 128k (results/h100/indexer_radix.json's radix_sweep).
SELECT_SORT = "torch"
SELECT_RUNS_KEYS = 1024  # _select_by_runs_kernel's keys per step (SELECT_RUNS_KEYS / SELECT_BLOCK runs)
# _select_by_runs_kernel lists the qualifying runs first (SELECT_RUNS_LIST_BLOCK runs' maxima a
# step), then steps over those alone. Stepping over every run instead (a 1M-key row's 65536 runs
# in 1024 steps, the form of 6664667, removed since) took 2.92 / 4.62 / 26.97 ms against 2.26 /
# 2.62 / 6.65 listed at 64k / 128k / 1M keys on an H100 (the selection alone, both ordered in the
# kernel: results/h100/indexer_radix_listed.json).
SELECT_RUNS_LIST_BLOCK = 1024
_INT32_MIN = tl.constexpr(INT32_MIN)  # also the sign bit
_INT64_MIN = tl.constexpr(-(1 << 63))
_ORD_NEG_INF = tl.constexpr(ORD_NEG_INF)
# The runs' candidates (_select_by_runs_kernel): room for SELECT_CANDIDATES * topk keys a row
# (random rows hold about 1.36 / 1.14 / 1.01 topk at 64k / 128k / 1M keys, 2048 of them).
SELECT_CANDIDATES = 2
_RUNS_SCRATCH_ROWS = 3  # _select_by_runs' scratch a row: candidates' columns, their keys, the listed runs


@fast_launch
@triton.jit
def _score_keys_kernel(
    q, k, w, ks, lo, hi, out, bmax,
    sq_b, sq_t, sq_h, sk_b, sk_s, sw_b, sw_t, sks_b, so_b, so_t, sm_b, sm_t,
    t0, t1, S_out,
    HI: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BQ: tl.constexpr, BS: tl.constexpr,
    HAS_KS: tl.constexpr, SB: tl.constexpr,
):
    """int32 order keys of queries [t0 + i_q BQ, + BQ) x keys [i_s BS, + BS) into out[b, t - t0, s].

    lo[t] <= s <= hi[t] is what query t may read (hi < lo: nothing). HAS_KS: fp8 q and k, the
    scores times the keys' scales ks[b, s] (the queries' are in w). SB > 0: also the largest
    key of each run [i SB, (i + 1) SB) into bmax[b, t - t0, i] (keys past S_out count as -inf)."""
    i_s, i_q, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_t = t0 + i_q * BQ + tl.arange(0, BQ)
    o_s = i_s * BS + tl.arange(0, BS)
    o_d = tl.arange(0, DIP)
    m_t = o_t < t1
    b_lo = tl.load(lo + o_t, mask=m_t, other=1 << 30)
    b_hi = tl.load(hi + o_t, mask=m_t, other=-1)
    b_acc = tl.zeros([BQ, BS], dtype=tl.float32)
    # Skip the products where no query of the tile reads any key of it (causal upper half).
    if (i_s * BS <= tl.max(b_hi, 0)) & (i_s * BS + BS > tl.min(b_lo, 0)):
        p_k = k + i_b * sk_b + o_s[:, None].to(tl.int64) * sk_s + o_d[None, :]
        b_k = tl.load(p_k, mask=(o_s < S_out)[:, None] & (o_d < DI)[None, :], other=0.0)
        p_q = q + i_b * sq_b + o_t[:, None].to(tl.int64) * sq_t + o_d[None, :]
        m_q = m_t[:, None] & (o_d < DI)[None, :]
        p_w = w + i_b * sw_b + o_t.to(tl.int64) * sw_t
        for j in range(HI):
            b_q = tl.load(p_q + j * sq_h, mask=m_q, other=0.0)
            b_w = tl.load(p_w + j, mask=m_t, other=0.0).to(tl.float32)
            b_s = tl.dot(b_q, tl.trans(b_k))
            b_acc += tl.maximum(b_s, 0.0) * b_w[:, None]
        if HAS_KS:
            b_ks = tl.load(ks + i_b * sks_b + o_s, mask=o_s < S_out, other=0.0)
            b_acc *= b_ks[None, :]
    m_read = (o_s[None, :] >= b_lo[:, None]) & (o_s[None, :] <= b_hi[:, None])
    # + 0.0 turns -0.0 into +0.0, which the reference's sort takes as equal.
    b_i = tl.where(m_read, b_acc + 0.0, float("-inf"))
    b_bits = b_i.to(tl.int32, bitcast=True)
    b_ord = b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)
    p_o = out + i_b * so_b + (o_t - t0)[:, None].to(tl.int64) * so_t + o_s[None, :]
    tl.store(p_o, b_ord, mask=m_t[:, None] & (o_s < S_out)[None, :])
    if SB > 0:
        b_max = tl.max(tl.reshape(b_ord, (BQ, BS // SB, SB)), axis=2)  # [BQ, BS // SB]
        o_r = i_s * (BS // SB) + tl.arange(0, BS // SB)
        p_m = bmax + i_b * sm_b + (o_t - t0)[:, None].to(tl.int64) * sm_t + o_r[None, :]
        tl.store(p_m, b_max, mask=m_t[:, None] & (o_r * SB < S_out)[None, :])


@triton.jit
def _compact_row(p_row, p_src, p_out, p_val, num_cols, b_kth, need, BLOCK: tl.constexpr,
                 WRITE_VALS: tl.constexpr, INDIRECT: tl.constexpr):
    """Writes p_out[:K] = the columns, in increasing order, of every key of the row above b_kth
    and of the first `need` keys equal to it (K in all: the row's top K under the lowest-index
    tie rule when b_kth is its K-th largest key and need = K - #above); WRITE_VALS: their keys
    into p_val[:K] too. INDIRECT: the row is a list of candidates in increasing column order,
    their columns at p_src (written instead of the positions in the list)."""
    n_out = tl.zeros([], dtype=tl.int32)
    n_tie = tl.zeros([], dtype=tl.int32)
    for i_col in range(0, num_cols, BLOCK):
        o_col = i_col + tl.arange(0, BLOCK)
        m_col = o_col < num_cols
        b_x = tl.load(p_row + o_col, mask=m_col, other=0)
        b_tie = (m_col & (b_x == b_kth)).to(tl.int32)
        tie_rank = n_tie + tl.cumsum(b_tie, 0) - b_tie  # equal keys before this one
        b_take = ((m_col & (b_x > b_kth)) | ((b_tie > 0) & (tie_rank < need))).to(tl.int32)
        o_out = n_out + tl.cumsum(b_take, 0) - b_take
        if INDIRECT:
            b_c = tl.load(p_src + o_col, mask=b_take > 0, other=0)
        else:
            b_c = o_col
        tl.store(p_out + o_out, b_c, mask=b_take > 0)
        if WRITE_VALS:
            tl.store(p_val + o_out, b_x, mask=b_take > 0)
        n_out += tl.sum(b_take, 0)
        n_tie += tl.sum(b_tie, 0)


@fast_launch
@triton.jit
def _compact_kernel(keys, kth, num_above, out, num_cols, K, BLOCK: tl.constexpr):
    """One row of int32 order keys [num_cols]: out[row, :K] = the columns, in increasing order,
    of every key above kth[row] and of the first K - num_above[row] keys equal to it (the
    row's top K under the lowest-index tie rule; exactly K columns, kth being the K-th
    largest key)."""
    i_row = tl.program_id(0).to(tl.int64)
    need = K - tl.load(num_above + i_row)  # keys equal to kth to keep, the lowest first
    _compact_row(keys + i_row * num_cols, out, out + i_row * K, out, num_cols, tl.load(kth + i_row), need,
                 BLOCK, False, False)


@triton.jit
def _radix_kth(p_row, num_cols, K, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """(the K-th largest of the int32 keys p_row[:num_cols], counted with repeats; how many of
    the K lie at it, the rest above it), by a radix select: BITS bits of the key at a time from
    the top (the last digit takes what is left), each digit a pass over the row that counts its
    values among the keys whose higher bits equal the ones fixed so far."""
    NB: tl.constexpr = 1 << BITS
    o_bin = tl.arange(0, NB)
    prefix = tl.zeros([], dtype=tl.uint32)  # the top bits fixed so far
    need = K + tl.zeros([], dtype=tl.int32)  # the rank still sought among the keys that match them
    for i_pass in tl.static_range((32 + BITS - 1) // BITS):
        TOP = i_pass * BITS  # bits fixed before this pass (constexpr, as the two below)
        SHIFT = (32 - TOP - BITS) * (TOP + BITS < 32)  # the digit's lowest bit
        WIDTH = 32 - TOP - SHIFT
        hist = tl.zeros([NB], dtype=tl.int32)
        for i_col in range(0, num_cols, BLOCK):
            o_col = i_col + tl.arange(0, BLOCK)
            m_col = o_col < num_cols
            # the sign bit flipped: the unsigned order is the keys' signed order
            b_u = (tl.load(p_row + o_col, mask=m_col, other=0) ^ _INT32_MIN).to(tl.uint32, bitcast=True)
            if TOP > 0:
                m_col = m_col & ((b_u >> (32 - TOP)) == prefix)
            b_d = ((b_u >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32)
            hist += tl.histogram(b_d, NB, mask=m_col)
        at_least = tl.cumsum(hist, 0, reverse=True)  # matching keys whose digit is >= the bin's
        b_bin = tl.sum((at_least >= need).to(tl.int32), 0) - 1  # the sought key's digit
        need -= tl.sum(tl.where(o_bin == b_bin, at_least - hist, 0), 0)
        prefix = (prefix << WIDTH) | b_bin.to(tl.uint32)
    return prefix.to(tl.int32, bitcast=True) ^ _INT32_MIN, need


@triton.jit
def _write_in_order(p_cols, p_vals, p_out, K, KP: tl.constexpr):
    """p_out[:K] = the columns p_cols[:K] (this program's compaction: increasing) by descending
    key p_vals[:K], equal keys in column order (the stable sort's), -1 for unreadable keys: one
    bitonic sort of the int64 sort keys key << 32 | (2^32 - 1 - column) over KP >= K lanes."""
    tl.debug_barrier()  # the compaction's stores, by every thread of the program, are visible
    o_k = tl.arange(0, KP)
    m_k = o_k < K
    b_c = tl.load(p_cols + o_k, mask=m_k, other=0).to(tl.int64)
    b_v = tl.load(p_vals + o_k, mask=m_k, other=0).to(tl.int64)
    b_key = tl.sort(tl.where(m_k, (b_v << 32) + (4294967295 - b_c), _INT64_MIN), descending=True)
    b_col = (4294967295 - (b_key & 4294967295)).to(tl.int32)
    tl.store(p_out + o_k, tl.where((b_key >> 32) > _ORD_NEG_INF, b_col, -1), mask=m_k)


@fast_launch
@triton.jit
def _radix_kth_kernel(keys, kth, num_above, cols, vals, out, num_cols, stride_row, K,
                      BITS: tl.constexpr, BLOCK: tl.constexpr, COMPACT: tl.constexpr, CBLOCK: tl.constexpr,
                      SORT: tl.constexpr, KP: tl.constexpr):
    """One row of int32 order keys [num_cols]: its K-th largest key (counted with repeats) and
    how many keys lie above it (_radix_kth). COMPACT: then the row's top K (_compact_row) into
    cols[row, :K] in key order and their keys into vals[row, :K], and with SORT the selection in
    its final order into out[row, :K] (_write_in_order); otherwise the two numbers into
    kth[row], num_above[row]."""
    i_row = tl.program_id(0).to(tl.int64)
    p_row = keys + i_row * stride_row
    b_kth, need = _radix_kth(p_row, num_cols, K, BITS, BLOCK)
    if COMPACT:
        _compact_row(p_row, p_row, cols + i_row * K, vals + i_row * K, num_cols, b_kth, need, CBLOCK, True, False)
        if SORT:
            _write_in_order(cols + i_row * K, vals + i_row * K, out + i_row * K, K, KP)
    else:
        tl.store(kth + i_row, b_kth)
        tl.store(num_above + i_row, K - need)


@triton.jit
def _list_candidates(p_row, o_col, m_key, b_lo, p_cc, p_cv, n, CAP):
    """Appends the row's keys p_row[o_col] (where m_key) that are >= b_lo, in o_col's order, to
    the candidates' columns p_cc and keys p_cv after the n listed so far (those past CAP are
    counted, not stored); returns the new count."""
    b_x = tl.load(p_row + o_col, mask=m_key, other=_INT32_MIN)
    b_in = (m_key & (b_x >= b_lo)).to(tl.int32)
    o_out = n + tl.cumsum(b_in, 0) - b_in
    m_out = (b_in > 0) & (o_out < CAP)
    tl.store(p_cc + o_out, o_col, mask=m_out)
    tl.store(p_cv + o_out, b_x, mask=m_out)
    return n + tl.sum(b_in, 0)


@fast_launch
@triton.jit
def _select_by_runs_kernel(keys, bmax, run_kth, cols, vals, out, cand_c, cand_v, cand_r, num_cols, num_runs, K,
                           CAP, RUN: tl.constexpr, RUNP: tl.constexpr, BR: tl.constexpr,
                           RBLOCK: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr,
                           SORT: tl.constexpr, KP: tl.constexpr):
    """One row of int32 order keys [num_cols] whose runs of RUN keys have their largest keys in
    bmax[row, :num_runs], run_kth[row] the K-th largest of those: the row's top K into
    cols[row, :K] (key order) and their keys into vals[row, :K], as _radix_kth_kernel's COMPACT.

    At least K keys (the K best runs' largest) are >= run_kth, so the row's K-th largest key is
    too: its top K lie among the keys >= run_kth, which lie in the runs whose largest key is >=
    run_kth. Those runs are read (a fraction of the row), their keys >= run_kth listed in key
    order into cand_c / cand_v[row, :CAP], and the top K taken among them; where more than CAP
    keys qualify (many ties), from the whole row instead. SORT: as _radix_kth_kernel's.

    The qualifying runs are first listed (in increasing order) into cand_r[row, :CAP] by a pass
    over bmax RBLOCK runs at a time, and only they are stepped over, BR at a time; more than CAP
    of them hold more than CAP candidates (the whole row)."""
    i_row = tl.program_id(0).to(tl.int64)
    p_row = keys + i_row * num_cols
    p_bmax = bmax + i_row * num_runs
    p_cc, p_cv = cand_c + i_row * CAP, cand_v + i_row * CAP
    b_lo = tl.load(run_kth + i_row)
    o_key = tl.arange(0, BR * RUNP)  # RUNP: RUN rounded up to a power of two
    n = tl.zeros([], dtype=tl.int32)  # candidates so far
    p_cr = cand_r + i_row * CAP
    n_run = tl.zeros([], dtype=tl.int32)  # qualifying runs so far
    for i_run in range(0, num_runs, RBLOCK):
        o_run = i_run + tl.arange(0, RBLOCK)
        b_q = ((o_run < num_runs)
               & (tl.load(p_bmax + o_run, mask=o_run < num_runs, other=_INT32_MIN) >= b_lo)).to(tl.int32)
        o_out = n_run + tl.cumsum(b_q, 0) - b_q
        tl.store(p_cr + o_out, o_run, mask=(b_q > 0) & (o_out < CAP))
        n_run += tl.sum(b_q, 0)
    if n_run <= CAP:
        tl.debug_barrier()  # the listed runs, each stored by one thread, are read by others below
        for i_run in range(0, n_run, BR):
            o_list = i_run + o_key // RUNP  # [BR RUNP] the list entry of each key of the step
            m_run = o_list < n_run
            o_col = tl.load(p_cr + o_list, mask=m_run, other=0) * RUN + o_key % RUNP
            m_key = m_run & (o_key % RUNP < RUN) & (o_col < num_cols)
            n = _list_candidates(p_row, o_col, m_key, b_lo, p_cc, p_cv, n, CAP)
    else:
        n = CAP + 1  # more than CAP qualifying runs hold more than CAP candidates
    if n <= CAP:
        tl.debug_barrier()  # the candidates, each stored by one thread, are read by others below
        b_kth, need = _radix_kth(p_cv, n, K, BITS, BLOCK)
        _compact_row(p_cv, p_cc, cols + i_row * K, vals + i_row * K, n, b_kth, need, CBLOCK, True, True)
    else:
        b_kth, need = _radix_kth(p_row, num_cols, K, BITS, BLOCK)
        _compact_row(p_row, p_row, cols + i_row * K, vals + i_row * K, num_cols, b_kth, need, CBLOCK, True, False)
    if SORT:
        _write_in_order(cols + i_row * K, vals + i_row * K, out + i_row * K, K, KP)


def decode_keys(keys: Tensor) -> Tensor:
    """int64 sort keys ord << 32 | (2^32 - 1 - s) -> int32 key indices, -1 where the key was
    unreadable."""
    index = (LOW_MASK - (keys & LOW_MASK)).to(torch.int32)
    # <=: block mode's padding keys (INT32_MIN) and negative NaN scores also decode to -1
    return index.masked_fill((keys >> 32) <= ORD_NEG_INF, -1)


def sort_keys(ords: Tensor, cols: Tensor) -> Tensor:
    """int32 order keys and their key indices -> int64 sort keys, descending = the tie rule."""
    return (ords.long() << 32) + (LOW_MASK - cols.long())


def read_ranges(
    B: int, T: int, S: int, causal: bool, cu_seqlens: Tensor | None, q_positions: Tensor | None,
    device,
) -> tuple[Tensor, Tensor]:
    """int32 [T] lo, hi: query t reads keys lo[t] <= s <= hi[t] (the reference's mask as a range)."""
    pos = _query_positions(q_positions, T, S, device)
    seg = _segment_ids(cu_seqlens, B, S)
    if seg is None:
        lo = torch.zeros_like(pos)
        end = torch.full_like(pos, S)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        lo, end = cu[seg[pos]], cu[seg[pos] + 1]
    hi = pos if causal else end - 1
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


def last_keys_on_host(hi: Tensor, T: int, S: int, causal: bool, cu_seqlens: Tensor | None,
                      q_positions: Tensor | None) -> Tensor:
    """[T] the last key each query reads (read_ranges' hi) on the host, without reading hi back
    where it follows from the arguments: query t itself when causal without q_positions (then
    T == S), the last key when neither causal nor packed; otherwise hi.cpu(), a host sync."""
    if q_positions is None and causal:
        return torch.arange(T, dtype=hi.dtype)
    if q_positions is None and cu_seqlens is None:
        return torch.full((T,), S - 1, dtype=hi.dtype)
    return hi.cpu()


def _form(Sc: int) -> str:
    """The selection's form ("topk" or "radix") for rows of Sc keys (SELECT_THRESHOLD)."""
    if SELECT_THRESHOLD == "auto":
        return "radix" if Sc >= RADIX_AUTO_MIN_KEYS and not _INTERPRET else "topk"
    return SELECT_THRESHOLD


def _takes_runs(Sc: int) -> bool:
    """Rows of Sc keys select through their runs' maxima (token mode)."""
    return Sc >= (RADIX_RUNS_MIN_KEYS if _form(Sc) == "radix" else SELECT_BLOCK_MIN_KEYS)


def _thresholds(ords: Tensor, topk: int, form: str | None = None) -> tuple[Tensor, Tensor]:
    """[N, Sc] int32 order keys (rows contiguous) -> [N] the topk-th largest key of each row and
    [N] int32 how many keys lie above it; by torch.topk or the radix kernel (form, else _form's)."""
    N, Sc = ords.shape
    if (form or _form(Sc)) == "topk":
        best = ords.topk(topk, dim=-1, sorted=False).values  # [N, topk]: the top values, any order
        kth = best.amin(-1)
        return kth, (best > kth[:, None]).sum(-1, dtype=torch.int32)
    kth = torch.empty(N, dtype=torch.int32, device=ords.device)
    num_above = torch.empty(N, dtype=torch.int32, device=ords.device)
    if N:
        _radix_kth_kernel[(N,)](ords, kth, num_above, kth, kth, kth, Sc, ords.stride(0), topk, **_radix_meta(Sc),
                                COMPACT=False, SORT=False, KP=1)
    return kth, num_above


def _sort_meta(topk: int) -> dict:
    return dict(SORT=SELECT_SORT == "kernel", KP=next_power_of_2(topk))


def _radix_meta(Sc: int) -> dict:
    return dict(BITS=RADIX_BITS, BLOCK=min(RADIX_BLOCK, next_power_of_2(Sc)),
                CBLOCK=min(RADIX_CBLOCK, next_power_of_2(Sc)), num_warps=RADIX_WARPS)


def _select_rows(ords: Tensor, topk: int) -> Tensor:
    """[N, Sc] int32 order keys (rows contiguous), topk < Sc -> [N, topk] int32 key indices, by
    descending key with ties to the lower index (the stable sort's order), -1 for unreadable keys."""
    N, Sc = ords.shape
    cols = torch.empty((N, topk), dtype=torch.int32, device=ords.device)  # the selection, in key order
    if _form(Sc) == "radix":  # the threshold and the compaction (and the order) in one kernel
        vals = torch.empty((N, topk), dtype=torch.int32, device=ords.device)  # their keys
        out = torch.empty((N, topk), dtype=torch.int32, device=ords.device) if SELECT_SORT == "kernel" else cols
        if N:
            _radix_kth_kernel[(N,)](ords, cols, cols, cols, vals, out, Sc, ords.stride(0), topk, **_radix_meta(Sc),
                                    COMPACT=True, **_sort_meta(topk))
        if SELECT_SORT == "kernel":
            return out
    else:
        kth, num_above = _thresholds(ords, topk)
        if N:
            _compact_kernel[(N,)](ords, kth, num_above, cols, Sc, topk,
                                  BLOCK=min(COMPACT_BLOCK, next_power_of_2(Sc)), num_warps=COMPACT_WARPS)
        vals = ords.gather(1, cols.long())
    return _in_order(cols, vals)


def _in_order(cols: Tensor, vals: Tensor) -> Tensor:
    """[N, topk] columns in increasing order and their keys -> the columns by descending key,
    ties in column order (a stable sort), -1 for unreadable keys."""
    picked, order = torch.sort(vals, dim=-1, descending=True, stable=True)
    return cols.gather(1, order).masked_fill(picked <= ORD_NEG_INF, -1)


def _select_by_runs(ords: Tensor, bmax: Tensor, topk: int, run: int) -> Tensor:
    """_select_rows(ords, topk) from the runs' best keys bmax [N, ceil(Sc / run)] (run keys
    each, more than topk runs): the K-th best run's key bounds the row's K-th key from below,
    and only the runs that reach it are read (_select_by_runs_kernel)."""
    N, Sc = ords.shape
    cap = SELECT_CANDIDATES * topk
    run_kth, _ = _thresholds(bmax, topk, "radix")
    cols = torch.empty((N, topk), dtype=torch.int32, device=ords.device)
    vals = torch.empty((N, topk), dtype=torch.int32, device=ords.device)
    cand = torch.empty((_RUNS_SCRATCH_ROWS, N, cap), dtype=torch.int32, device=ords.device)
    out = torch.empty((N, topk), dtype=torch.int32, device=ords.device) if SELECT_SORT == "kernel" else cols
    if N:
        _select_by_runs_kernel[(N,)](ords, bmax, run_kth, cols, vals, out, cand[0], cand[1], cand[2], Sc,
                                     bmax.shape[1], topk, cap, RUN=run, RUNP=next_power_of_2(run),
                                     BR=max(1, SELECT_RUNS_KEYS // next_power_of_2(run)),
                                     RBLOCK=min(SELECT_RUNS_LIST_BLOCK, next_power_of_2(bmax.shape[1])),
                                     **_radix_meta(Sc), **_sort_meta(topk))
    return out if SELECT_SORT == "kernel" else _in_order(cols, vals)


def _select_by_blocks(ords: Tensor, bmax: Tensor, topk: int, run: int) -> Tensor:
    """_select_rows(ords, topk) from the runs' best keys bmax [N, ceil(Sc / run)] (run keys
    each): the topk best runs (ties to the lower run) hold the row's top-k. Every key above
    the k-th value v lies in a run whose best is above v, and there are fewer than topk such
    runs; the keys equal to v that the tie rule keeps (the lowest ones) lie in the lowest runs
    whose best is v, which the runs' own tie rule keeps. So the top-k among the kept runs'
    keys, taken in key order, is the row's."""
    N, Sc = ords.shape
    out = torch.empty((N, topk), dtype=torch.int32, device=ords.device)
    offsets = torch.arange(run, device=ords.device)
    for r0 in range(0, N, SELECT_BLOCK_ROWS):
        r1 = min(N, r0 + SELECT_BLOCK_ROWS)
        runs = _select_rows(bmax[r0:r1], topk).sort(-1).values  # [n, topk] ascending, -1 (all -inf) first
        cols = (runs.clamp(min=0).long()[:, :, None] * run + offsets).flatten(1)  # [n, topk * run], key order
        void = ((runs < 0)[:, :, None] | (cols.view(r1 - r0, topk, run) >= Sc)).flatten(1)
        cand = ords[r0:r1].gather(1, cols.clamp(max=Sc - 1)).masked_fill_(void, INT32_MIN)
        picked = _select_rows(cand, topk)  # positions in cand; -1 where unreadable
        out[r0:r1] = cols.gather(1, picked.clamp(min=0).long()).masked_fill_(picked < 0, -1)
    return out


def _select(ords: Tensor, topk: int, block_size: int | None, bmax: Tensor | None = None) -> Tensor:
    """[B, Tc, Sc] int32 order keys -> [B, Tc, topk] int32 indices (descending, -1 padded).
    bmax [B, Tc, ceil(Sc / SELECT_BLOCK)]: the runs' best keys (token mode: _select_by_blocks)."""
    B, Tc, Sc = ords.shape
    if block_size is not None:
        nb = -(-Sc // block_size)
        pad = nb * block_size - Sc
        if pad:  # padding keys rank below every real one (also below -inf keys)
            ords = torch.cat([ords, ords.new_full((B, Tc, pad), INT32_MIN)], -1)
        blocks = ords.view(B, Tc, nb, block_size)
        block_ids = torch.arange(nb, device=ords.device)
        best = sort_keys(blocks.amax(-1), block_ids).topk(min(-(-topk // block_size), nb), dim=-1).indices
        cols = (best[..., None] * block_size + torch.arange(block_size, device=ords.device)).flatten(2)
        keys = sort_keys(blocks.gather(2, best[..., None].expand(-1, -1, -1, block_size)).flatten(2), cols)
    elif bmax is not None and bmax.shape[-1] > topk:
        select = _select_by_runs if _form(Sc) == "radix" else _select_by_blocks
        return select(ords.view(B * Tc, Sc), bmax.view(B * Tc, -1), topk, SELECT_BLOCK).view(B, Tc, topk)
    elif Sc > topk:
        return _select_rows(ords.view(B * Tc, Sc), topk).view(B, Tc, topk)
    else:  # every key is kept: one short sort
        keys = sort_keys(ords, torch.arange(Sc, device=ords.device))
    kept = min(topk, keys.shape[-1])
    index = decode_keys(keys.topk(kept, dim=-1).values)
    if kept < topk:
        index = torch.cat([index, index.new_full((B, Tc, topk - kept), -1)], -1)
    return index


@torch.no_grad()
def lightning_indexer_topk_triton(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    topk: int,
    cu_seqlens: Tensor | None = None,
    block_size: int | None = None,
    causal: bool = True,
    q_positions: Tensor | None = None,
    budget_bytes: int | None = None,
    k_scale: Tensor | None = None,
) -> Tensor:
    """q_idx [B, T, HI, DI], k_idx [B, S, DI], weights [B, T, HI] -> int32 [B, T, topk].
    float8_e4m3fn q_idx / k_idx with k_scale [B, S] (reference.indexer_fp8_inputs): the
    products on fp8 tensor cores, the scores scaled by k_scale."""
    B, T, S = _check_selection_args(q_idx, k_idx, weights, topk, block_size)
    _check_triton_dtypes(q_idx, k_idx, weights)
    _check_k_scale(q_idx, k_idx, k_scale)
    DI = q_idx.shape[-1]
    _check(DI <= 256, f"q_idx: indexer head dim {DI} > 256 is not supported by the Triton indexer")
    _check(
        q_idx.dtype == k_idx.dtype,
        f"k_idx must have q_idx's dtype {q_idx.dtype}, got {k_idx.dtype}",
    )
    out = torch.empty((B, T, topk), dtype=torch.int32, device=q_idx.device)
    if T == 0:
        return out
    q_idx = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()
    k_idx = k_idx if k_idx.stride(-1) == 1 else k_idx.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    lo, hi = read_ranges(B, T, S, causal, cu_seqlens, q_positions, q_idx.device)
    cfg = dict(CONFIG_FP8 if k_scale is not None else CONFIG)
    if _INTERPRET:
        cfg.update(BQ=16, BS=16)
    BQ, BS = cfg["BQ"], cfg["BS"]
    fp8 = k_scale is not None
    DIP = max(32 if fp8 else 16, next_power_of_2(DI))  # an fp8 product's depth is at least 32
    ks = k_scale.contiguous() if fp8 else weights  # (a placeholder pointer without scales)
    budget = SCORE_BUDGET_BYTES if budget_bytes is None else budget_bytes
    # The last key each query can read decides how many keys its chunk scores: known on the
    # host for the causal, unshifted queries of training (and the whole-sequence case), else
    # read back once (context parallelism's q_positions, packed non-causal).
    hi_host = last_keys_on_host(hi, T, S, causal, cu_seqlens, q_positions)
    reach = hi_host.flip(0).cummax(0).values.flip(0)  # [T] the widest range from query t on
    t0 = 0
    while t0 < T:
        # As many queries as fit the budget at the widest key range they could reach.
        Sc_max = int(reach[t0]) + 1
        row_bytes = KEY_BYTES * B * max(Sc_max, 1)
        if Sc_max >= min(SELECT_BLOCK_MIN_KEYS, RADIX_RUNS_MIN_KEYS):  # the runs' maxima too, and their candidates' room
            room = _RUNS_SCRATCH_ROWS * SELECT_CANDIDATES * topk  # _select_by_runs' scratch
            row_bytes += KEY_BYTES * B * (cdiv(Sc_max, SELECT_BLOCK) + room)
        Tc = max(BQ, (budget // row_bytes) // BQ * BQ)
        t1 = min(T, t0 + Tc)
        Sc = max(int(hi_host[t0:t1].max()) + 1, 1)
        keys = torch.empty((B, t1 - t0, Sc), dtype=torch.int32, device=q_idx.device)
        runs = block_size is None and _takes_runs(Sc) and BS % SELECT_BLOCK == 0
        bmax = torch.empty((B, t1 - t0, cdiv(Sc, SELECT_BLOCK) if runs else 0), dtype=torch.int32, device=q_idx.device)
        grid = (cdiv(Sc, BS), cdiv(t1 - t0, BQ), B)
        _score_keys_kernel[grid](
            q_idx, k_idx, weights, ks, lo, hi, keys, bmax,
            q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
            weights.stride(0), weights.stride(1), ks.stride(0), keys.stride(0), keys.stride(1),
            bmax.stride(0), bmax.stride(1),
            t0, t1, Sc,
            HI=q_idx.shape[2], DI=DI, DIP=DIP, BQ=BQ, BS=BS, HAS_KS=fp8, SB=SELECT_BLOCK if runs else 0,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        out[:, t0:t1] = _select(keys, topk, block_size, bmax if runs else None)
        del keys, bmax
        t0 = t1
    return out


# --- index scores at the selected keys (the sparse-stage KL loss), forward and backward -----
#
# I[b, t, j] = sum_h w[b, t, h] relu(q_idx[b, t, h] . k_idx[b, idx[b, t, j]]), -inf at -1 slots.
# One program per query streams its K slots BK at a time (rows of k_idx gathered by index);
# the [HI, BK] logits live in registers only. The backward recomputes them and writes dq_idx,
# dw and, per (query, slot), the key gradient contribution [K, DI] (fp32) into a chunk buffer,
# which the sparse attention's per-key reduce (a stable sort of the chunk's indices, then each
# key's rows summed in order) adds into dk_idx: no atomics, no [T, HI, K] tensor either way.
SCORES_BK = 64
# Bytes of the backward's [Tc, K, DI] fp32 key-gradient contributions per chunk.
CONTRIB_BUDGET_BYTES = 1 << 30


@triton.jit
def _load_query(q, w, i_b, i_t, sq_b, sq_t, sq_h, sw_b, sw_t,
                HI: tl.constexpr, HIP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr):
    """q_idx[b, t] [HIP, DIP] (padded heads and dims read 0) and w[b, t] [HIP] fp32."""
    o_h, o_d = tl.arange(0, HIP), tl.arange(0, DIP)
    p_q = q + i_b * sq_b + i_t * sq_t + o_h[:, None] * sq_h + o_d[None, :]
    b_q = tl.load(p_q, mask=(o_h < HI)[:, None] & (o_d < DI)[None, :], other=0.0)
    b_w = tl.load(w + i_b * sw_b + i_t * sw_t + o_h, mask=o_h < HI, other=0.0).to(tl.float32)
    return b_q, b_w


@triton.jit
def _load_selected(k, idx, i_b, i_t, k0, K, sk_b, sk_s, si_b, si_t,
                   DI: tl.constexpr, DIP: tl.constexpr, BK: tl.constexpr):
    """Slots [k0, k0 + BK) of query t: o_k, m_k (slot holds a key), key rows [BK, DIP]."""
    o_k, o_d = k0 + tl.arange(0, BK), tl.arange(0, DIP)
    b_i = tl.load(idx + i_b * si_b + i_t * si_t + o_k, mask=o_k < K, other=-1).to(tl.int64)
    m_k = b_i >= 0
    p_k = k + i_b * sk_b + tl.where(m_k, b_i, 0)[:, None] * sk_s + o_d[None, :]
    b_k = tl.load(p_k, mask=m_k[:, None] & (o_d < DI)[None, :], other=0.0)
    return o_k, m_k, b_k


@fast_launch
@triton.jit
def _sparse_scores_fwd_kernel(
    q, k, w, idx, out,
    sq_b, sq_t, sq_h, sk_b, sk_s, sw_b, sw_t, si_b, si_t, so_b, so_t, K,
    HI: tl.constexpr, HIP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BK: tl.constexpr,
):
    i_t, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    b_q, b_w = _load_query(q, w, i_b, i_t, sq_b, sq_t, sq_h, sw_b, sw_t, HI, HIP, DI, DIP)
    for k0 in range(0, K, BK):
        o_k, m_k, b_k = _load_selected(k, idx, i_b, i_t, k0, K, sk_b, sk_s, si_b, si_t, DI, DIP, BK)
        b_s = tl.dot(b_q, tl.trans(b_k))  # [HIP, BK]
        b_i = tl.sum(tl.maximum(b_s, 0.0) * b_w[:, None], 0)
        tl.store(out + i_b * so_b + i_t * so_t + o_k, tl.where(m_k, b_i, float("-inf")), mask=o_k < K)


@fast_launch
@triton.jit
def _sparse_scores_bwd_kernel(
    q, k, w, idx, ds, dq, dw, dkc,
    sq_b, sq_t, sq_h, sk_b, sk_s, sw_b, sw_t, si_b, si_t, sd_b, sd_t, sc_b, sc_t, t0, K,
    HI: tl.constexpr, HIP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BK: tl.constexpr,
):
    """dq_idx[b, t], dw[b, t] (like q_idx / w) and dkc[b, t - t0, j] = the gradient of the key
    in slot j (zeros for -1 slots), for queries t0 + program_id(0)."""
    i_t = t0 + tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    o_h, o_d = tl.arange(0, HIP), tl.arange(0, DIP)
    b_q, b_w = _load_query(q, w, i_b, i_t, sq_b, sq_t, sq_h, sw_b, sw_t, HI, HIP, DI, DIP)
    b_dq = tl.zeros([HIP, DIP], dtype=tl.float32)
    b_dw = tl.zeros([HIP], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k, m_k, b_k = _load_selected(k, idx, i_b, i_t, k0, K, sk_b, sk_s, si_b, si_t, DI, DIP, BK)
        b_ds = tl.load(ds + i_b * sd_b + i_t * sd_t + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_s = tl.dot(b_q, tl.trans(b_k))  # [HIP, BK]
        b_dw += tl.sum(tl.maximum(b_s, 0.0) * b_ds[None, :], 1)
        b_dl = tl.where(b_s > 0, b_w[:, None] * b_ds[None, :], 0.0).to(b_k.dtype)
        b_dq += tl.dot(b_dl, b_k)
        b_dk = tl.dot(tl.trans(b_dl), b_q)  # [BK, DIP]
        p_c = dkc + i_b * sc_b + (i_t - t0) * sc_t + o_k[:, None] * DI + o_d[None, :]
        tl.store(p_c, b_dk, mask=(o_k < K)[:, None] & (o_d < DI)[None, :])
    p_dq = dq + i_b * sq_b + i_t * sq_t + o_h[:, None] * sq_h + o_d[None, :]
    tl.store(p_dq, b_dq.to(dq.dtype.element_ty), mask=(o_h < HI)[:, None] & (o_d < DI)[None, :])
    tl.store(dw + i_b * sw_b + i_t * sw_t + o_h, b_dw.to(dw.dtype.element_ty), mask=o_h < HI)


def _scores_meta(q_idx: Tensor) -> dict:
    HI, DI = q_idx.shape[2:]
    return dict(HI=HI, HIP=max(16, next_power_of_2(HI)), DI=DI,
                DIP=max(16, next_power_of_2(DI)), BK=16 if _INTERPRET else SCORES_BK)


class SparseIndexScores(torch.autograd.Function):
    """lightning_indexer_sparse in Triton: [B, T, K] fp32 scores, gradients to q_idx, k_idx, w."""

    @staticmethod
    def forward(ctx, q_idx: Tensor, k_idx: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        B, T, K = indices.shape
        q_idx, k_idx, weights, indices = (x.contiguous() for x in (q_idx, k_idx, weights, indices))
        out = torch.empty((B, T, K), dtype=torch.float32, device=q_idx.device)
        if T and K:
            _sparse_scores_fwd_kernel[(T, B)](
                q_idx, k_idx, weights, indices, out,
                q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
                weights.stride(0), weights.stride(1), indices.stride(0), indices.stride(1),
                out.stride(0), out.stride(1), K, **_scores_meta(q_idx), num_warps=4,
            )
        ctx.save_for_backward(q_idx, k_idx, weights, indices)
        return out

    @staticmethod
    def backward(ctx, d_scores: Tensor):
        q_idx, k_idx, weights, indices = ctx.saved_tensors
        B, T, K = indices.shape
        S, DI = k_idx.shape[1:]
        d_scores = d_scores.float().contiguous()
        dq = torch.empty_like(q_idx)
        dw = torch.empty_like(weights)
        dk = torch.empty((B * S, DI), dtype=torch.float32, device=k_idx.device)  # the first chunk writes it all
        Tc = max(1, min(T, CONTRIB_BUDGET_BYTES // max(1, B * K * DI * 4)))
        for t0 in range(0, T, Tc):
            n = min(Tc, T - t0)
            dkc = torch.empty((B, n, K, DI), dtype=torch.float32, device=q_idx.device)
            _sparse_scores_bwd_kernel[(n, B)](
                q_idx, k_idx, weights, indices, d_scores, dq, dw, dkc,
                q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
                weights.stride(0), weights.stride(1), indices.stride(0), indices.stride(1),
                d_scores.stride(0), d_scores.stride(1), dkc.stride(0), dkc.stride(1), t0, K,
                **_scores_meta(q_idx), num_warps=4,
            )
            # each key's rows of dkc in (b, t, slot) order, summed in that order (no atomics:
            # bitwise repeatable); -1 slots go to the sentinel key B S, which nothing reads
            _, order, offsets = per_key_lists(indices[:, t0:t0 + n], S)
            sum_rows_per_key(dkc.view(-1, DI), order, offsets, dk, first=t0 == 0)
        if T == 0:
            dk.zero_()
        return dq, dk.view(B, S, DI).to(k_idx.dtype), dw, None


def _check_triton_dtypes(q_idx: Tensor, k_idx: Tensor, weights: Tensor) -> None:
    """ValueError naming the argument: floating inputs, and no bf16 in the CPU interpreter
    (Triton's interpreter reads bf16 wrongly)."""
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx), ("weights", weights)):
        _check(x.is_floating_point(), f"{name} must be a floating-point tensor, got {x.dtype}")
        _check(x.is_cuda or x.dtype != torch.bfloat16,
               f"{name}: the triton indexer's CPU interpreter reads bf16 wrongly; use fp32 or fp16 on CPU, "
               "or backend='torch'")


def lightning_indexer_sparse_triton(q_idx: Tensor, k_idx: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
    """q_idx [B, T, HI, DI], k_idx [B, S, DI], weights [B, T, HI], indices [B, T, K] -> [B, T, K]
    fp32 index scores at the selected keys (-inf at -1 slots), differentiable."""
    _, _, S = _check_indexer_args(q_idx, k_idx, weights)
    _check_triton_dtypes(q_idx, k_idx, weights)
    B, T = q_idx.shape[:2]
    _check(
        indices.dim() == 3 and tuple(indices.shape[:2]) == (B, T) and not indices.is_floating_point(),
        f"indices must be an integer [B, T, K] = [{B}, {T}, K] tensor, got {indices.dtype} {tuple(indices.shape)}",
    )
    check_index_range(indices, S)  # the kernels read key rows by index
    _check(q_idx.shape[-1] <= 256 and q_idx.shape[2] <= 128,
           f"q_idx: {tuple(q_idx.shape[2:])} indexer heads x dim; the Triton kernel takes HI <= 128, DI <= 256")
    return SparseIndexScores.apply(q_idx, k_idx, weights, indices)
