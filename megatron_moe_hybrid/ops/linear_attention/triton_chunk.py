"""Chunked gated delta rule and simple GLA in Triton, forward and backward (chunks of 64).

Shape legend: B batch, T time, H query/key heads, HV value heads (a multiple of H: value head
h reads q/k head h // (HV // H)), K key dim, V value dim, N sequences (B, or the cu_seqlens
segments), C = 64 the chunk, NT chunks in all (over every sequence), BK/BV register blocks.
q, k [B, T, H, K]; v, o [B, T, HV, V]; g, beta [B, T, HV]; states fp32 [N, HV, K, V].

README.md derives the chunk form. Per chunk, gam = cumsum(g) inside the chunk,
D_ij = exp(gam_i - gam_j) (j <= i), P = scale * tril(q k^T . D) and, for the delta rule,
M = strictly_lower(diag(beta) (k k^T . D)), A = (I + M)^-1, w = A (beta e^gam k),
u = A (beta v). With S the state entering the chunk and gC the chunk's last gam:
    U = u - w S  (U = v for simple GLA),  o = (scale e^gam q) S + P U,
    S' = e^gC S + (k . e^(gC - gam))^T U.

Kernels (each program one chunk of one value head, or one V block of one sequence-head):
    forward:  _prep_kernel (gam, P, A, w, u; parallel over chunks)
              _recurrence_fwd_kernel (state kept on chip, sequential over chunks, writes o and,
              for the backward, the chunk states h and U: KEEP_STATES)
    backward: _prep_kernel again (reading the forward's A: gam, P, w only; not at all for simple
              GLA, GLA_KEEP_P), the chunk states h and U (bf16 for bf16 inputs, freed at the end of
              the backward) as the forward's last sweep wrote them beside o (KEEP_STATES; else
              _recurrence_fwd_kernel runs again to write them), _recurrence_bwd_kernel
              (state gradient on chip, reverse over chunks, writes dh and, for the delta rule,
              dU), _bwd_chunk_kernel (every input gradient of one chunk, including the WY
              backward, the reverse cumsum of dg inside the chunk and simple GLA's
              dv = P^T do + k' dS', formed there from P and dh rather than in the sweep); for the
              delta rule, by default, _bwd_chunk_kernel in simple GLA's form over U and then
              _bwd_chunk_gdn_w_kernel for the terms through w and u (GDN_SPLIT_CHUNK_BWD).
    sequence split (_Segments; simple GLA with few sequence-heads, README.md): the recurrences
              run per segment, first from a zero state, then, after _segment_scan_kernel joins
              the segments, from each segment's true entering state.
Dots take the input dtype (bf16/fp16; fp32 inputs use Triton's default tf32 on the GPU) and
accumulate in fp32; the state, gam and every exponent are fp32.
"""

import functools
import heapq
import itertools
import logging
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # Triton without host-side TMA descriptors: plain stores
    _TensorDescriptor = None

from . import _TRITON_MAX_HEAD_DIM_K
from .._intmath import cdiv, next_power_of_2
from .._launch import fast_launch
from .._packed import derived, host_offsets

logger = logging.getLogger(__name__)

CHUNK = 64
MAX_HEAD_DIM_K = _TRITON_MAX_HEAD_DIM_K  # key head dims the kernels take, per op (one table with auto's)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# Launch configs, fixed rather than autotuned (each autotuned config is another compile per
# shape), picked from benchmarks/linear_attention.py --breakdown on the H200 at
# B1-T32768-HQK16-HV32-D128: kernel -> (BV, num_warps); BV None: the kernel takes none.
# "seq" is both recurrences, whose BV also sets how many programs run side by side.
# "seq_wide": the recurrences where "seq" would make more programs than SMs (_seq_config).
# "seq_wide_varlen": the delta rule's there over packed sequences (cu_seqlens), whose recurrences
# at 4 warps spill 40 B (forward) and 112 B (backward) a thread, none at 8 (tools/compile_kernels.py
# with Triton 3.6): H200 fwd+bwd 7.754 -> 6.898 ms at varlen-28672-4096-HQK16-HV32, where at
# B4-T8192-H16 and B1-T8192-H96 (no spill) 8 warps ran 0.966x and 0.957x (linear_attention.json,
# "CONFIGS['seq_wide'] = (64, 8) (A/B)", 2026-12-05).
# "seq_wide_gla": simple GLA's there, whole [K, V] states as its split takes them (BV 128, 8 warps).
# "prep": (None, num_warps[, maxnreg]): the forward prep kernel (the delta rule's at 217 registers a
# thread uncapped, two programs per SM) capped at 168 for three: fwd+bwd 1.022x at
# B1-T32768-HQK16-HV32, 1.026x at B4-T8192-H16; at 128 (four, 264 B spilled) 0.993x at both
# (linear_attention.json, "the prep kernel at 4 warps, at most ... registers (A/B)", 2026-12-05).
CONFIGS = {"prep": (None, 4, 168), "seq": (32, 4), "seq_wide": (64, 4), "seq_wide_varlen": (64, 8),
           "seq_wide_gla": (128, 8), "chunk_bwd": (64, 8),
           "split": (128, 8), "split_gdn": (32, 4), "light": (64, 4, 64)}
# "light": (BV, num_warps, BK[, num_stages]) of simple GLA's light sweeps; at B4-T8192-H16 fwd+bwd
# (linear_attention_light.json) against (32, 4, 64) 0.96x, (64, 2, 64) and (64, 8, 64) 0.99x,
# (32, 4, 32) 0.83x, (64, 4, 128) 0.96x; 1, 2 or 4 stages 0.88x, 0.95x, 1.00x of the default 3.
MIN_SEQ_PROGRAMS = 64  # about half the H200's 132 SMs
# The sequence split (_plan_segments): where B x heads leave the recurrences short of programs,
# each sequence is cut into segments of at least MIN_SEGMENT_CHUNKS chunks, their length the one
# whose sweep ends first with SPLIT_PROGRAMS_PER_SM programs per SM (_segment_length; each
# program takes a whole [K, V] state, BV 128, so q, k and P are read once per chunk, not once
# per V block). Chosen from
# benchmarks/results/h200/linear_attention_split.json (device/probe_split.py): simple GLA fwd+bwd 3.43 -> 1.61 ms at
# B1-T32768-H16-D128 and 2.00 -> 1.66 ms at B4-T8192-H16 (1 program per SM; 2 per SM: 1.66
# and 1.63, 3 per SM: 1.71 and 1.69). The delta rule's split (two first passes, one of them
# over the [K, K] transition; BV 32, "split_gdn": at BV 128 its kernels need 238 KB of shared
# memory, over the H200's 227 KB) was 0.82x at B1-T32768-HQK16-HV32 and 0.77x at B4-T8192-H16
# (128 and 256 unsplit programs), but 2.13x on the device at B1-T8192-HQK2-HV4 (16 programs:
# 0.863 -> 0.405 ms, one CUDA graph replayed, linear_attention_segments.json; do_bench had
# timed the host's launches there and read 0.8-0.9x), so it splits only under 32 programs.
# SPLIT_MAX_PROGRAMS: split only where the unsplit recurrences would run at most this many
# programs (at BV 32). MIN_SEGMENT_CHUNKS 4 rather than 16 (before 2026-12-03): at that shape
# simple GLA's plan then takes 4-chunk segments, 128 programs, 0.300 -> 0.199 ms on the device;
# elsewhere enough programs fill the SMs at the plan's longer lengths, which are unchanged.
SPLIT_MAX_PROGRAMS = {"gla": 256, "gdn": 32, "gla_light": 64}
SPLIT_PROGRAMS_PER_SM = 1
# The light sweeps (GLA_LIGHT_SWEEPS) split under 64 unsplit programs ([BK, BV] blocks), planned
# for 2 of their 4-warp programs per SM: at TP=8 (16 programs unsplit) 16 segments of 8 chunks,
# 256 programs (0.160 ms as one CUDA graph against 0.186 for the whole states' split).
SPLIT_LIGHT_PROGRAMS_PER_SM = 2
MIN_SEGMENT_CHUNKS = 4
SEGMENT_CHUNKS: int | None = None
SPLIT_PROGRAM_OVERHEAD_CHUNKS = 2  # a program's start and end (state load, store), in chunk steps
# Simple GLA's dv: formed by _bwd_chunk_kernel from P and dh (DV_FROM_DH), its reverse sweep then
# forming only the state gradient, where the sweep runs unsplit ("unsplit"); True / False: always /
# never (probes). H200, fwd+bwd, both forms in one process (linear_attention.json, the rows "gla
# fwd+bwd, dv from the chunk kernel (A/B)"): 2.73 -> 2.57 ms at B1-T8192-H96 (unsplit: BV 64 blocks,
# each formed its own slice of dU), but 0.3-1.7% slower at the split shapes, whose sweeps hold
# whole states (BV 128, 8 warps) and lost less than the chunk kernel gained.
GLA_DV_FROM_DH: bool | str = "unsplit"
# Simple GLA: keep the forward's gam and P ([B, T, HV] fp32, [B, T, HV, C] in the input dtype, half
# of v's bytes) for the backward, whose prep kernel then does not run (as the delta rule keeps A).
# Bitwise the same results either way. H200, fwd+bwd, both forms in one process (linear_attention.json,
# the rows "gla fwd+bwd, the backward from the forward's gam and P (A/B)"): 5.5-7.0% faster at the
# listed shapes (B4-T8192-H16 1.646 -> 1.550 ms, B1-T8192-H96 2.574 -> 2.416; 3.3% at TP=8 as one
# CUDA graph), peak above the inputs 6% higher at the split shapes (1.09 -> 1.15 GB at B4-T8192-H16,
# fla's 1.61), the same at H96.
# P held from forward to backward is activation memory fla does not hold: False gives it back.
GLA_KEEP_P = True
# Keep the chunk states h ([NT, HV, K, V] in the input dtype, twice v's bytes at K 128) and, for the
# delta rule, U (v's bytes) from the forward, whose last sweep writes them beside o, so that the
# backward does not run the forward sweep again to write them. The backward holds them anyway, so
# one call's peak does not grow; what grows is the memory held from forward to backward (activation
# memory, per layer). False: recompute in the backward, as fla does.
KEEP_STATES = {"gla": True, "gdn": True}
# The delta rule's GLA_KEEP_P, where it keeps its states: the forward's gam, P and w ([B, T, HV] fp32,
# [B, T, HV, C] and [B, T, HV, K] in the input dtype: 1.5x v's bytes at K 128) for the backward,
# whose prep kernel then does not run (it would read A, k, q and g to write them again). H200, both
# forms in one process: fwd+bwd 6.732 -> 6.377 ms at B1-T32768-HQK16-HV32, 2.728 -> 2.563 at
# B4-T8192-H16 (linear_attention.json); with the two-kernel chunk backward 1.049-1.065x at five
# shapes (2026-12-04). On by default since then: it raises one call's peak (the backward freed its
# own w and P before its last kernel; 2.83 -> 3.23 GB at that shape, under fla's 3.77; 5.3 -> 6.0
# GiB at the 2.8T flagship's linear layer, HQK32-HV64, 32k tokens; with FUSE_GROUP_SUM on for the
# delta rule since 2026-12-05, 2.56 -> 2.97 GB and 4.8 -> 5.5 GiB), and a memory-bound run can set
# it False.
GDN_KEEP_PREP = True
# The sweeps write the chunk states h (forward) and their gradients dh (backward) through TMA
# descriptors (Hopper's bulk tensor stores from shared memory) rather than per-thread stores
# through a layout conversion (_states_desc). True: every sweep writing h or dh; "whole": only the
# forward sweeps that hold whole [K, V] states (simple GLA's split, BV 128 with 8 warps, whose o
# sweep writing h spilled 12 registers a thread and took 0.785 ms against 0.530 without h at
# B1-T32768-H32); False: none. Bitwise the same results in every form. H200, fwd+bwd, True against
# False in one process (linear_attention.json, "... written by TMA (A/B; every sweep)"): 0.998x and
# 1.003x at B1-T32768-H32 and -HQK16-HV32, whose backward alone ran 3.2% and 2.7% slower (the dh
# sweep), so that the forward writing h ran about 0.056 ms faster at both (the fwd+bwd difference
# less the backward's; inferred, the forward with states is not timed alone); 0.92x at
# B4-T8192-H16 (the 4-warp [64, 64] light sweeps) and 0.91-0.93x for the delta rule ([128, 32]
# blocks). "whole" against False (probe_gla_switch.py --switch states_tma, 2026-12-05): 1.016-1.021x
# fwd+bwd at simple GLA's four split shapes, but O_TMA alone gains more (below), and both together
# must run that sweep at 2 pipeline stages (at 3 it needs 238600 B of shared memory, over the
# H200's 227 KB; _sweep_fwd caps it), 1.021-1.030x: off. A sweep given a descriptor launches
# through Triton's own path (fast_launch keys no descriptors): about 20 us more host time a launch.
STATES_TMA: bool | str = False
# The forward sweeps that form o write it through a TMA descriptor too ([B * T, HV, V] in [C, 1, BV]
# blocks: _out_desc), where every sequence's length is a multiple of the chunk (a block store
# cannot mask a short last chunk's rows, which belong to the next sequence). Forms as STATES_TMA's
# (True, "whole", False). "whole" (simple GLA's split, whose o sweep spilled 48 B a thread at 255
# registers; none through the descriptor) against False, fwd+bwd on the H200 in one process
# (linear_attention.json, "o written by TMA, form whole (A/B)", 2026-12-05): 1.082x at
# B1-T32768-H32, 1.075x at B1-T32768-HQK16-HV32, 1.078x at B1-T32768-H16-D128, 1.076x packed
# [28672, 4096]; bitwise the same results. True (every forward sweep forming o, the delta rule's
# [128, 32] blocks too) against False for the delta rule: 1.014x at B1-T32768-HQK16-HV32, 0.999x at
# B4-T8192-H16, 1.000x packed ("gdn fwd+bwd, o written by TMA, form true (A/B; kept off)"): kept at
# "whole".
O_TMA: bool | str = "whole"
# Grouped value heads (HV > H): the chunk kernel takes a q/k head's value heads in turn and sums
# their dq and dk in fp32 on chip (GROUP), no _group_sum pass over per-value-head copies, where
# that still leaves FUSE_GROUP_MIN_PROGRAMS programs (chunks x q/k heads). H200, fwd+bwd, both forms
# in one process (linear_attention.json, "... summed in the chunk kernel (A/B)"): simple GLA at
# B1-T32768-HQK16-HV32 3.158 -> 2.843 ms, packed [28672, 4096] 3.200 -> 2.895 (8192 programs;
# peak 2.30 -> 2.03 GB); but at TP=8 (256 programs) 0.158 -> 0.167 ms as one CUDA graph, and the
# delta rule's fused kernel, which already spilled, 6.749 -> 7.981 at the Qwen shape: off for it.
# The gain is the pass and the halved dq, dk writes, not fewer programs: 2 value heads per program
# without a group (45c3415, reverted) ran 1.000x at B1-T32768-H32 and 0.871x at B4-T8192-H16. The
# delta rule's two-kernel backward (GDN_SPLIT_CHUNK_BWD) sums groups too since da791da (its
# first half as simple GLA's, its second over a q/k head's value heads, dk read and written
# once): H200 fwd+bwd against unfused in one process (probe_gla_switch.py --switch group_sum --op
# gdn, 2026-12-05) 1.002x at B1-T32768-HQK16-HV32, 1.005x packed [28672, 4096], 1.016x at TP=8 as
# one CUDA graph; one call's peak 3.23 -> 2.97 GB (no per-value-head dq, dk copies): on.
FUSE_GROUP_SUM = {"gla": True, "gdn": True}
# The delta rule's per-chunk backward as two kernels (with FUSE_GROUP_SUM, both sum groups): the output and
# state paths as simple GLA's kernel with U for v (dq; dk and dg's terms from do S^T, do U^T, U dS'^T),
# then _bwd_chunk_gdn_w_kernel (Y = A^T dU: dv, dbeta, and dk and dg's terms through w and u, added
# in place). The fused kernel holds both halves' accumulators and spilled 82 registers a thread at
# Triton's 255 (kernel_asm.py, B1-T32768-HQK16-HV32); the halves compile to 196 and 224, none
# spilled, and read h, U and k twice. dk's first half is rounded to dk's dtype between the two
# (3.2e-3 relative RMS from the fused kernel's dk in bf16). H200, fwd+bwd, both forms in one
# process (linear_attention.json, "the per-chunk backward as two kernels (A/B)"): 6.860 -> 6.751 ms
# at B1-T32768-HQK16-HV32, 2.765 -> 2.695 at B4-T8192-H16, 4.612 -> 4.492 at B1-T8192-H96, 1.015x
# at TP=8 by do_bench (0.994x as one CUDA graph), 0.990x packed [28672, 4096]: the spills were not
# what holds the kernel at 35% of its byte floor. False: the fused kernel.
GDN_SPLIT_CHUNK_BWD = True
FUSE_GROUP_MIN_PROGRAMS = 1024
# Simple GLA's light sweeps (_fwd_gla_light): the recurrences form only the chunk states, forward
# (h) and backward (dh), each program a [BK, BV] block (CONFIGS["light"]: 64 x 64, a quarter of a
# K 128 state), so 4x the programs of whole states with a quarter of the work per chunk step; the
# prep kernel then forms o from h, every chunk in parallel (fla's order), and the chunk kernel dv
# from dh (DV_FROM_DH). False: the recurrences form o (and dv where split) over whole key dims.
# H200, fwd+bwd, both forms in one process (linear_attention_light.json), bitwise the same results:
# faster at the 128-chunk shapes (B4-T8192-H16 1.543 -> 1.376 ms, B1-T8192-H96 2.097 -> 2.027, TP=8
# as one CUDA graph 0.186 -> 0.160), slower at the long ones (B1-T32768-HQK16-HV32 3.173 -> 3.271,
# -H32 3.050 -> 3.105, -H16 1.558 -> 1.646, varlen [28672, 4096] 3.234 -> 3.248), where the whole
# states' split already fills the GPU and 512 light chunk steps in a row cost more than the o and dv
# they move out (splitting the light sweeps there, into 32- to 128-chunk segments: 0.94-0.98x).
# "short": the light sweeps where the longest sequence has at most LIGHT_MAX_CHUNKS chunks (between
# the 128 measured faster and the 448 measured slower; untried in between).
GLA_LIGHT_SWEEPS: bool | str = "short"
LIGHT_MAX_CHUNKS = 256
# Where simple GLA keeps its whole-key-dim recurrences, its split's first passes form states only
# and could take the light blocks too: 0.974-0.979x fwd+bwd at the four long shapes (tried, dropped;
# linear_attention_light.json, "the split's first passes as light sweeps").


@triton.jit
def _unit_lower_inverse(b_M, BT: tl.constexpr):
    """(I + M)^-1 for M [BT, BT] fp32 strictly lower, BT = 64.

    The four 16x16 diagonal blocks are inverted by forward substitution (all four at once, as
    a [4, 16, 16] tensor), D^-1; then (I + M) = D (I + N) with N = D^-1 M_offdiag strictly
    block-lower, so N^4 = 0 and (I + M)^-1 = (I - N + N^2 - N^3) D^-1.
    """
    BC: tl.constexpr = 16
    NB: tl.constexpr = BT // BC
    o_c = tl.arange(0, BT)
    m_same = (o_c[:, None] // BC) == (o_c[None, :] // BC)
    b_off = tl.where(m_same, 0.0, b_M)
    o_b = tl.arange(0, NB)
    m_bb = o_b[:, None, None, None] == o_b[None, None, :, None]  # [NB, 1, NB, 1]
    b_M3 = tl.sum(tl.where(m_bb, tl.reshape(b_M, [NB, BC, NB, BC]), 0.0), axis=2)  # [NB, BC, BC]
    o_i = tl.arange(0, BC)
    # Y = (I + M_blk)^-1 - I, row by row: y_i = -m_i + sum_j (-m_ij) y_j (rows 0 and 1 are -m)
    b_Y3 = -b_M3
    for i in range(2, BC):
        m_row = (o_i == i)[None, :, None]
        b_a = tl.sum(tl.where(m_row, -b_M3, 0.0), axis=1)  # [NB, BC]
        b_a = b_a + tl.sum(b_a[:, :, None] * b_Y3, axis=1)
        b_Y3 = tl.where(m_row, b_a[:, None, :], b_Y3)
    b_Y3 += tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)[None, :, :]
    b_Dinv = tl.reshape(tl.where(m_bb, b_Y3[:, :, None, :], 0.0), [BT, BT])
    b_eye = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    b_N = tl.dot(b_Dinv, b_off)
    b_T = b_eye - tl.dot(b_N, b_eye - tl.dot(b_N, b_eye - b_N))
    return tl.dot(b_T, b_Dinv)


@triton.jit
def _chunk_rows(i_tg, i_b, T, cu_seqlens, chunk_indices, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Where a chunk-parallel program's chunk is: (its index within its sequence, the sequence's
    first token row, the sequence's length, the chunk's global index over every sequence), from
    program_id(0) i_tg (the chunk within row i_b, or when packed the global chunk) and batch row i_b."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_tg * 2)
        i_t = tl.load(chunk_indices + i_tg * 2 + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        i_c = i_tg.to(tl.int64)
    else:
        i_t = i_tg
        bos = i_b.to(tl.int64) * T
        i_c = i_b.to(tl.int64) * tl.cdiv(T, BT) + i_t
    return i_t, bos, T, i_c


@triton.jit
def _chunk_block(i_t, bos, T, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """A chunk program's rows and key columns: (its token offsets within the sequence, their
    mask, its token rows, the in-chunk offsets, the key offsets, their mask, the [BT, BK] mask)."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    return o_t, m_t, bos + o_t, tl.arange(0, BT), o_k, m_k, m_t[:, None] & m_k[None, :]


@triton.jit
def _gdn_y_init(beta, A, r_t, m_t, o_c, HV, i_h, BT: tl.constexpr, BK: tl.constexpr, dt: tl.constexpr):
    """What _gdn_y_terms sums into for one chunk of value head i_h: (beta, A^T in dt, and the
    zero sums dbeta, Y U^T (dM = -Y U^T) and Y S^T (d(beta e^gam k) = -Y S^T))."""
    b_beta = tl.load(beta + r_t * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_A = tl.load(A + (r_t * HV + i_h)[:, None] * BT + o_c[None, :], mask=m_t[:, None], other=0.0).to(dt)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dMn = tl.zeros([BT, BT], dtype=tl.float32)
    b_acc_kw = tl.zeros([BT, BK], dtype=tl.float32)
    return b_beta, tl.trans(b_A), b_db, b_dMn, b_acc_kw


@triton.jit
def _gdn_y_terms(b_AT, b_dU, b_U, b_ST, b_beta, v, dv, p_tv, m_tv, b_db, b_dMn, b_acc_kw):
    """One V block of the delta rule's terms through Y = A^T dU: dv = beta Y written, and the
    sums dbeta += rowsum(Y . v), Y U^T (dM = -Y U^T) and Y S^T (d(beta e^gam k) = -Y S^T)."""
    dt = b_U.dtype
    b_Y = tl.dot(b_AT, b_dU)  # [BT, BV] = A^T dU
    b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32)
    tl.store(dv + p_tv, (b_Y * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
    b_db += tl.sum(b_Y * b_v, axis=1)
    b_Yd = b_Y.to(dt)
    b_dMn = tl.dot(b_Yd, tl.trans(b_U), b_dMn)
    b_acc_kw = tl.dot(b_Yd, b_ST.to(dt), b_acc_kw)
    return b_db, b_dMn, b_acc_kw


@triton.jit
def _gdn_w_terms(b_k, b_beta, b_eg, b_D, m_strict, b_acc_kw, b_dMn, b_dk, b_dgam, b_db):
    """The delta rule's dk, dgam and dbeta terms through w = A (beta e^gam k) and M, from the
    sums _gdn_y_terms formed (b_D: the decay matrix, m_strict: its strictly lower part to take),
    added to b_dk, b_dgam and b_db."""
    dt = b_k.dtype
    b_kf = b_k.to(tl.float32)
    b_r = tl.sum(b_kf * b_acc_kw, axis=1)
    b_kbs = b_beta * b_eg
    b_dk -= b_acc_kw * b_kbs[:, None]
    b_dgam -= b_kbs * b_r
    b_db -= b_eg * b_r
    b_dMD = tl.where(m_strict, -b_dMn * b_D, 0.0)  # dM . D
    b_T1 = tl.dot(b_dMD.to(dt), b_k)
    b_T2 = tl.dot(tl.trans(b_dMD).to(dt), (b_kf * b_beta[:, None]).to(dt))
    b_dk += b_T1 * b_beta[:, None] + b_T2
    b_rk = tl.sum(b_kf * b_T1, axis=1)
    b_db += b_rk
    b_dgam += b_beta * b_rk - tl.sum(b_kf * b_T2, axis=1)
    return b_dk, b_dgam, b_db


@fast_launch
@triton.jit(do_not_specialize=["T", "H", "HV"])
def _prep_kernel(
    q, k, v, g, beta, gam, P, A, w, u, h, o, cu_seqlens, chunk_indices, scale, T,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_GDN: tl.constexpr, STORE_A: tl.constexpr, LOAD_A: tl.constexpr, IS_VARLEN: tl.constexpr,
    STORE_U: tl.constexpr = True, STORE_O: tl.constexpr = False,
):
    """One chunk of one value head: gam = cumsum(g), P; and for the delta rule A, w, u (LOAD_A:
    A as the forward stored it, in the input dtype, instead of k k^T and the inverse; STORE_U
    False: no u, for a backward given the forward's chunk states and U). STORE_O (simple GLA
    after its light sweeps): also o = q^ S + P v from the state S entering the chunk (h)."""
    i_tg, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    i_t, bos, T, i_tg = _chunk_rows(i_tg, i_b, T, cu_seqlens, chunk_indices, BT, IS_VARLEN)
    i_hk = i_h // (HV // H)
    o_t, m_t, r_t, o_c, o_k, m_k, m_tk = _chunk_block(i_t, bos, T, K, BT, BK)  # r_t: [BT] int64 token rows

    b_gam = tl.cumsum(tl.load(g + r_t * HV + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
    tl.store(gam + r_t * HV + i_h, b_gam, mask=m_t)
    b_q = tl.load(q + (r_t * H + i_hk)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + (r_t * H + i_hk)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    # Mask before exp: above the diagonal gam_i - gam_j may be large and positive.
    m_incl = (o_c[:, None] >= o_c[None, :]) & m_t[:, None]
    b_D = tl.where(m_incl, tl.exp(tl.where(m_incl, b_gam[:, None] - b_gam[None, :], 0.0)), 0.0)
    b_P = tl.dot(b_q, tl.trans(b_k)) * b_D * scale
    p_P = P + (r_t * HV + i_h)[:, None] * BT + o_c[None, :]
    tl.store(p_P, b_P.to(P.dtype.element_ty), mask=m_t[:, None])
    if STORE_O:  # as _recurrence_fwd_kernel's STORE_O, from the same operands in the input dtype
        dt = k.dtype.element_ty
        b_qh = (b_q * (scale * tl.exp(b_gam))[:, None]).to(dt)
        b_Pd = b_P.to(dt)
        p_h = h + (i_tg * HV + i_h) * K * V
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            p_tv = (r_t * HV + i_h)[:, None] * V + o_v[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            b_S = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
            b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(dt)
            b_o = tl.dot(b_qh, b_S.to(dt)) + tl.dot(b_Pd, b_v)
            tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
    if IS_GDN:
        b_beta = tl.load(beta + r_t * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        if LOAD_A:
            p_A = A + (r_t * HV + i_h)[:, None] * BT + o_c[None, :]
            b_Ad = tl.load(p_A, mask=m_t[:, None], other=0.0).to(k.dtype.element_ty)
        else:
            m_strict = o_c[:, None] > o_c[None, :]
            b_M = tl.where(m_strict, tl.dot(b_k, tl.trans(b_k)) * b_D, 0.0) * b_beta[:, None]
            b_A = _unit_lower_inverse(b_M, BT)
            if STORE_A:
                p_A = A + (r_t * HV + i_h)[:, None] * BT + o_c[None, :]
                tl.store(p_A, b_A.to(A.dtype.element_ty), mask=m_t[:, None])
            b_Ad = b_A.to(k.dtype.element_ty)
        b_kb = (b_k * (b_beta * tl.exp(b_gam))[:, None]).to(k.dtype.element_ty)
        b_w = tl.dot(b_Ad, b_kb)
        tl.store(w + (r_t * HV + i_h)[:, None] * K + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_tk)
        if STORE_U:
            for i_v in range(tl.cdiv(V, BV)):
                o_v = i_v * BV + tl.arange(0, BV)
                m_tv = m_t[:, None] & (o_v < V)[None, :]
                p_v = (r_t * HV + i_h)[:, None] * V + o_v[None, :]
                b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
                b_u = tl.dot(b_Ad, (b_v * b_beta[:, None]).to(v.dtype.element_ty))
                tl.store(u + p_v, b_u.to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def _sweep_program(cu_seqlens, chunk_offsets, T, HV, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                   IS_VARLEN: tl.constexpr):
    """What a recurrence program sweeps, the grid being (K blocks x V blocks, sequences x value
    heads): (program_id(0) i_kv, program_id(1) i_nh, its K block, its V block, its value head,
    the sequence's first token row, its first chunk over every sequence, its length). A helper
    that keeps the kernels' machine code: tools/compile_kernels.py --against found the same SASS
    at every benchmark shape; one that also formed the block offsets and masks did not."""
    i_kv, i_nh = tl.program_id(0), tl.program_id(1)
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    i_n, i_h = i_nh // HV, i_nh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        boh = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return i_kv, i_nh, i_k, i_v, i_h, bos, boh, T


@fast_launch
@triton.jit(do_not_specialize=["T", "H", "HV"])
def _recurrence_fwd_kernel(
    q, k, w, u, gam, P, o, h0, ht, h, U, gt, cu_seqlens, chunk_offsets, scale, T,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_GDN: tl.constexpr, STORE_O: tl.constexpr, STORE_H: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
    ZERO_U: tl.constexpr = False, H0_EYE: tl.constexpr = False, STORE_GT: tl.constexpr = False,
    GAM_FROM_G: tl.constexpr = False, H_TMA: tl.constexpr = False, O_TMA: tl.constexpr = False,
):
    """One [BK, BV] block of one sequence-head's state, chunk after chunk: U = u - w S,
    o = q^ S + P U, S'.

    u is v for simple GLA. STORE_H (the backward's recompute) writes the state entering each
    chunk to h [NT, HV, K, V] and U to U [B, T, HV, V].
    The sequence split's first pass (_Segments) uses three more switches: STORE_GT writes the
    sequence's total log decay (the sum of its chunks' gC) to gt [N, HV]; ZERO_U with H0_EYE
    (the delta rule, V = K) starts from the identity with u = 0, so that ht is the product of
    the chunks' state transitions S -> e^gC S - k'^T w S.
    Simple GLA's state rows are independent, so its light sweeps (GLA_LIGHT_SWEEPS: no o, BK < K,
    program_id(0) running over K blocks x V blocks) take a block of K too; with GAM_FROM_G gam is
    g, whose chunk cumsum the sweep forms itself (it runs ahead of the prep kernel).
    """
    i_kv, i_nh, i_k, i_v, i_h, bos, boh, T = _sweep_program(cu_seqlens, chunk_offsets, T, HV, V, BT, BV, IS_VARLEN)
    NT = tl.cdiv(T, BT)
    i_hk = i_h // (HV // H)
    dt = k.dtype.element_ty
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_c = tl.arange(0, BT)
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)
    if H0_EYE:
        b_S += tl.where((o_k[:, None] == o_v[None, :]) & m_kv, 1.0, 0.0)
    b_G = tl.sum(tl.zeros([1], dtype=tl.float32), axis=0)  # the total log decay (STORE_GT)
    for i_t in range(NT):
        o_t = i_t * BT + o_c
        m_t = o_t < T
        r_t = bos + o_t
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = (r_t * HV + i_h)[:, None] * V + o_v[None, :]
        if STORE_H:
            if H_TMA:  # h: a descriptor of [NT * HV * K, V] in blocks [BK, BV] (_states_desc)
                h.store([(((boh + i_t) * HV + i_h) * K + i_k * BK).to(tl.int32), i_v * BV], b_S.to(dt))
            else:
                tl.store(h + ((boh + i_t) * HV + i_h) * K * V + o_kv, b_S.to(h.dtype.element_ty), mask=m_kv)
        if GAM_FROM_G:  # as _prep_kernel forms gam
            b_gam = tl.cumsum(tl.load(gam + r_t * HV + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
            b_glast = tl.sum(tl.where(o_c == tl.minimum(BT, T - i_t * BT) - 1, b_gam, 0.0), axis=0)
        else:
            b_gam = tl.load(gam + r_t * HV + i_h, mask=m_t, other=0.0)
            b_glast = tl.load(gam + (bos + tl.minimum(i_t * BT + BT, T) - 1) * HV + i_h)
        if STORE_GT:
            b_G += b_glast
        if ZERO_U:
            b_u = tl.zeros([BT, BV], dtype=tl.float32)
        else:
            b_u = tl.load(u + p_tv, mask=m_tv, other=0.0)
        if IS_GDN:
            b_w = tl.load(w + (r_t * HV + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_U = b_u.to(tl.float32) - tl.dot(b_w, b_S.to(dt))
            if STORE_H:
                tl.store(U + p_tv, b_U.to(U.dtype.element_ty), mask=m_tv)
            b_Ud = b_U.to(dt)
        else:
            b_Ud = b_u.to(dt)
        if STORE_O:
            b_q = tl.load(q + (r_t * H + i_hk)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_qh = (b_q * (scale * tl.exp(b_gam))[:, None]).to(dt)
            b_P = tl.load(P + (r_t * HV + i_h)[:, None] * BT + o_c[None, :], mask=m_t[:, None], other=0.0)
            b_o = tl.dot(b_qh, b_S.to(dt)) + tl.dot(b_P.to(dt), b_Ud)
            if O_TMA:  # o: a descriptor of [rows, HV, V] in blocks [BT, 1, BV], every chunk whole (_out_desc)
                o.store([(bos + i_t * BT).to(tl.int32), i_h, i_v * BV], tl.expand_dims(b_o.to(dt), 1))
            else:
                tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        # k^T loaded transposed [BK, BT]; padded tokens load k = 0
        b_kT = tl.load(k + (r_t * H + i_hk)[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_kT = (b_kT * tl.exp(b_glast - b_gam)[None, :]).to(dt)
        b_S = b_S * tl.exp(b_glast) + tl.dot(b_kT, b_Ud)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + o_kv, b_S.to(ht.dtype.element_ty), mask=m_kv)
    if STORE_GT:
        if i_kv == 0:
            tl.store(gt + i_nh, b_G)


@fast_launch
@triton.jit(do_not_specialize=["T", "H", "HV"])
def _recurrence_bwd_kernel(
    q, k, w, gam, P, do, dU, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_GDN: tl.constexpr, USE_DHT: tl.constexpr, USE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    STORE: tl.constexpr = True, STORE_DU: tl.constexpr = True, H_TMA: tl.constexpr = False,
):
    """One V block of one sequence-head, chunks in reverse: dU = P^T do + k' dS',
    dS = e^gC dS' + q^T do - w^T dU. Writes dh (the gradient of the state leaving each chunk)
    and, with STORE_DU, dU; with STORE False only dh0 (the sequence split's first pass: each
    segment's own contribution to the gradient of the state entering it). Simple GLA's dS does
    not involve dU, so without STORE_DU its sweep forms none (_bwd_chunk_kernel's DV_FROM_DH
    forms dv = dU from dh instead: one product per step, not three). Without dU (simple GLA) a
    block of K too, as the forward's light sweeps."""
    i_kv, i_nh, i_k, i_v, i_h, bos, boh, T = _sweep_program(cu_seqlens, chunk_offsets, T, HV, V, BT, BV, IS_VARLEN)
    NT = tl.cdiv(T, BT)
    i_hk = i_h // (HV // H)
    dt = k.dtype.element_ty
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_c = tl.arange(0, BT)
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]

    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dht + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in range(NT - 1, -1, -1):
        o_t = i_t * BT + o_c
        m_t = o_t < T
        r_t = bos + o_t
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = (r_t * HV + i_h)[:, None] * V + o_v[None, :]
        if STORE:
            if H_TMA:  # as _recurrence_fwd_kernel's h
                dh.store([(((boh + i_t) * HV + i_h) * K + i_k * BK).to(tl.int32), i_v * BV], b_dS.to(dt))
            else:
                tl.store(dh + ((boh + i_t) * HV + i_h) * K * V + o_kv, b_dS.to(dh.dtype.element_ty), mask=m_kv)
        b_gam = tl.load(gam + r_t * HV + i_h, mask=m_t, other=0.0)
        b_glast = tl.load(gam + (bos + tl.minimum(i_t * BT + BT, T) - 1) * HV + i_h)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0).to(dt)
        if IS_GDN or STORE_DU:
            b_P = tl.load(P + (r_t * HV + i_h)[:, None] * BT + o_c[None, :], mask=m_t[:, None], other=0.0).to(dt)
            b_k = tl.load(k + (r_t * H + i_hk)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0)
            b_kp = (b_k * tl.exp(b_glast - b_gam)[:, None]).to(dt)
            b_dU = tl.dot(tl.trans(b_P), b_do) + tl.dot(b_kp, b_dS.to(dt))
            if STORE_DU:
                tl.store(dU + p_tv, b_dU.to(dU.dtype.element_ty), mask=m_tv)
        b_qT = tl.load(q + (r_t * H + i_hk)[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_qT = (b_qT * (scale * tl.exp(b_gam))[None, :]).to(dt)
        b_dS = b_dS * tl.exp(b_glast) + tl.dot(b_qT, b_do)
        if IS_GDN:
            b_wT = tl.load(w + (r_t * HV + i_h)[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
            b_dS -= tl.dot(b_wT, b_dU.to(dt))
    if USE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_kv, b_dS.to(dh0.dtype.element_ty), mask=m_kv)


@fast_launch
@triton.jit(do_not_specialize=["rows"])
def _group_sum_kernel(x, out, rows, R: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """out[r] = sum_j x[r, j] over rows r of [rows, R, K] -> [rows, K], fp32 sums rounded once."""
    o_r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    o_k = tl.arange(0, BK)
    m = (o_r < rows)[:, None] & (o_k < K)[None, :]
    acc = tl.zeros((BR, BK), dtype=tl.float32)
    for j in tl.static_range(R):
        acc += tl.load(x + (o_r * R + j)[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out + o_r[:, None] * K + o_k[None, :], acc.to(out.dtype.element_ty), mask=m)


@fast_launch
@triton.jit(do_not_specialize=["HV"])
def _segment_scan_kernel(
    L, G, M, s0, S_in, st, seq_first, HV, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    IS_GDN: tl.constexpr, REVERSE: tl.constexpr, USE_S0: tl.constexpr, STORE_ST: tl.constexpr,
):
    """The sequence split's middle pass: one V block of one sequence-head, over its segments.

    Segment s maps the state entering it to T_s S + L_s, with T_s = e^{G_s} (simple GLA) or
    the [K, K] matrix M_s (the delta rule). Forward: S_in[s] is the state entering segment s
    and st the one leaving the sequence. REVERSE (the backward) runs the segments last to
    first with T_s^T: S_in[s] is then the gradient of the state leaving segment s, st that of
    the state entering the sequence. s0 [N, HV, K, V] starts the scan.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    first = tl.load(seq_first + i_n)
    count = tl.load(seq_first + i_n + 1) - first
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_S0:
        b_S += tl.load(s0 + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)
    for j in range(count):
        if REVERSE:
            i_s = (first + count - 1 - j).to(tl.int64)
        else:
            i_s = (first + j).to(tl.int64)
        p_s = (i_s * HV + i_h) * K * V
        tl.store(S_in + p_s + o_kv, b_S, mask=m_kv)
        if IS_GDN:
            p_m = M + (i_s * HV + i_h) * K * K
            m_kk = m_k[:, None] & m_k[None, :]
            if REVERSE:  # M^T [a, b] = M[b, a]
                b_M = tl.load(p_m + o_k[None, :] * K + o_k[:, None], mask=m_kk, other=0.0)
            else:
                b_M = tl.load(p_m + o_k[:, None] * K + o_k[None, :], mask=m_kk, other=0.0)
            b_S = tl.dot(b_M, b_S, input_precision="tf32x3")  # ~fp32; "ieee" ran 10x slower
        else:
            b_S = b_S * tl.exp(tl.load(G + i_s * HV + i_h))
        b_S += tl.load(L + p_s + o_kv, mask=m_kv, other=0.0)
    if STORE_ST:
        tl.store(st + i_nh.to(tl.int64) * K * V + o_kv, b_S, mask=m_kv)


@fast_launch
@triton.jit(do_not_specialize=["T", "H", "HV"])
def _bwd_chunk_kernel(
    q, k, v, gam, beta, A, P, h, dh, U, dU, do, dq, dk, dv, dg, dbeta, cu_seqlens, chunk_indices,
    scale, T,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_GDN: tl.constexpr, IS_VARLEN: tl.constexpr, DV_FROM_DH: tl.constexpr = False,
    GROUP: tl.constexpr = 1,
):
    """Every input gradient of one chunk of one value head, given the state S entering it (h),
    the gradient dS' of the state leaving it (dh), U and dU. README.md lists the terms.
    DV_FROM_DH (simple GLA): dv = P^T do + k' dS' here, from P and dh, rather than the reverse
    sweep's dU (the sweep then forms only the state gradient). Each program takes GROUP value
    heads in turn: GROUP 1, dq and dk per value head; GROUP = HV // H, a q/k head's value heads,
    their dq and dk summed in fp32 and stored once ([B, T, H, K])."""
    i_tg, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_p = i_bh // (HV // GROUP), i_bh % (HV // GROUP)  # i_p: the program's first value head / GROUP
    i_t, bos, T, i_tg = _chunk_rows(i_tg, i_b, T, cu_seqlens, chunk_indices, BT, IS_VARLEN)
    dt = k.dtype.element_ty
    o_t, m_t, r_t, o_c, o_k, m_k, m_tk = _chunk_block(i_t, bos, T, K, BT, BK)  # r_t: [BT] int64 token rows
    last = tl.minimum(i_t * BT + BT, T) - 1

    if GROUP > 1:
        b_dq_sum = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk_sum = tl.zeros([BT, BK], dtype=tl.float32)
    for i_r in tl.static_range(GROUP):
        i_h = i_p * GROUP + i_r
        i_hk = i_h // (HV // H)
        b_gam = tl.load(gam + r_t * HV + i_h, mask=m_t, other=0.0)
        b_glast = tl.load(gam + (bos + last) * HV + i_h)
        if IS_GDN:
            b_beta, b_AT, b_db, b_dMn, b_acc_kw = _gdn_y_init(beta, A, r_t, m_t, o_c, HV, i_h, BT, BK, dt)

        b_acc_q = tl.zeros([BT, BK], dtype=tl.float32)  # do S^T
        b_acc_ks = tl.zeros([BT, BK], dtype=tl.float32)  # U dS'^T
        b_dP = tl.zeros([BT, BT], dtype=tl.float32)  # do U^T
        b_sds = tl.zeros([BK], dtype=tl.float32)  # sum(S . dS') by rows of S
        p_h = h + (i_tg * HV + i_h) * K * V
        p_dh = dh + (i_tg * HV + i_h) * K * V
        if DV_FROM_DH:  # as _recurrence_bwd_kernel forms dU, dS' rounded to the input dtype as dh is
            b_P = tl.load(P + (r_t * HV + i_h)[:, None] * BT + o_c[None, :], mask=m_t[:, None], other=0.0).to(dt)
            b_kc = tl.load(k + (r_t * H + i_hk)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_kp = (b_kc * tl.exp(b_glast - b_gam)[:, None]).to(dt)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            p_tv = (r_t * HV + i_h)[:, None] * V + o_v[None, :]
            m_vk = m_v[:, None] & m_k[None, :]
            # states loaded transposed: [BV, BK]
            b_ST = tl.load(p_h + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.0)
            b_dST = tl.load(p_dh + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.0)
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.0).to(dt)
            if IS_GDN:
                b_dU = tl.load(dU + p_tv, mask=m_tv, other=0.0).to(dt)
                b_U = tl.load(U + p_tv, mask=m_tv, other=0.0).to(dt)
            else:
                b_U = tl.load(v + p_tv, mask=m_tv, other=0.0).to(dt)
            if DV_FROM_DH:
                b_dv = tl.dot(tl.trans(b_P), b_do) + tl.dot(b_kp, tl.trans(b_dST.to(dt)))
                tl.store(dv + p_tv, b_dv.to(dv.dtype.element_ty), mask=m_tv)
            b_acc_q = tl.dot(b_do, b_ST.to(dt), b_acc_q)
            b_dP = tl.dot(b_do, tl.trans(b_U), b_dP)
            b_acc_ks = tl.dot(b_U, b_dST.to(dt), b_acc_ks)
            b_sds += tl.sum(b_ST.to(tl.float32) * b_dST.to(tl.float32), axis=0)
            if IS_GDN:
                b_db, b_dMn, b_acc_kw = _gdn_y_terms(b_AT, b_dU, b_U, b_ST, b_beta, v, dv, p_tv, m_tv,
                                                     b_db, b_dMn, b_acc_kw)

        # q and k are loaded only now: loaded before the V loop (whose dv stores keep the compiler from
        # sinking the loads) they held two [BT, BK] tiles live through it, where the kernel spills
        b_q = tl.load(q + (r_t * H + i_hk)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(k + (r_t * H + i_hk)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_qf = b_q.to(tl.float32)
        b_kf = b_k.to(tl.float32)
        b_eg = tl.exp(b_gam)
        m_incl = (o_c[:, None] >= o_c[None, :]) & m_t[:, None]
        b_D = tl.where(m_incl, tl.exp(tl.where(m_incl, b_gam[:, None] - b_gam[None, :], 0.0)), 0.0)
        b_dA = b_dP * b_D * scale  # d(q k^T) of the intra-chunk term
        b_dq = b_acc_q * (scale * b_eg)[:, None] + tl.dot(b_dA.to(dt), b_k)
        b_dk_s = b_acc_ks * tl.where(m_t, tl.exp(b_glast - b_gam), 0.0)[:, None]
        b_dk = tl.dot(tl.trans(b_dA).to(dt), b_q) + b_dk_s
        # gam enters as e^gam with q and as e^-gam with k (output and state paths), hence this form.
        b_dgam = tl.sum(b_qf * b_dq, axis=1) - tl.sum(b_kf * b_dk, axis=1)
        b_dglast = tl.exp(b_glast) * tl.sum(b_sds, axis=0) + tl.sum(tl.sum(b_kf * b_dk_s, axis=1), axis=0)
        if IS_GDN:  # b_D is masked to the chunk's rows (m_incl), so the strict triangle suffices
            b_dk, b_dgam, b_db = _gdn_w_terms(b_k, b_beta, b_eg, b_D, o_c[:, None] > o_c[None, :], b_acc_kw, b_dMn,
                                              b_dk, b_dgam, b_db)
            tl.store(dbeta + r_t * HV + i_h, b_db.to(dbeta.dtype.element_ty), mask=m_t)
        b_dgam = tl.where(o_t == last, b_dgam + b_dglast, b_dgam)
        b_dgam = tl.where(m_t, b_dgam, 0.0)
        b_dg = tl.cumsum(b_dgam, axis=0, reverse=True)
        tl.store(dg + r_t * HV + i_h, b_dg.to(dg.dtype.element_ty), mask=m_t)
        if GROUP > 1:
            b_dq_sum += b_dq
            b_dk_sum += b_dk
        else:
            p_dqk = (r_t * HV + i_h)[:, None] * K + o_k[None, :]
            tl.store(dq + p_dqk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
            tl.store(dk + p_dqk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    if GROUP > 1:
        p_dqk = (r_t * H + i_p)[:, None] * K + o_k[None, :]
        tl.store(dq + p_dqk, b_dq_sum.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + p_dqk, b_dk_sum.to(dk.dtype.element_ty), mask=m_tk)


@fast_launch
@triton.jit(do_not_specialize=["T", "H", "HV"])
def _bwd_chunk_gdn_w_kernel(
    k, v, gam, beta, A, h, U, dU, dk, dv, dg, dbeta, cu_seqlens, chunk_indices, T,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
    GROUP: tl.constexpr = 1,
):
    """The delta rule's chunk-kernel terms through w and u (GDN_SPLIT_CHUNK_BWD), after
    _bwd_chunk_kernel has run as for simple GLA with U for v: that wrote dq, the dk and dg terms
    of the output and state paths. This one, per chunk and value head: Y = A^T dU, dv = beta Y,
    dbeta, and the dk and dg terms through w = A (beta e^gam k) and u = A (beta v) (README.md),
    added to dk and dg in place. Its accumulators (Y U^T, Y S^T) are the fused kernel's other
    half, so neither kernel spills where the fused one did. GROUP as _bwd_chunk_kernel's: GROUP
    = HV // H takes a q/k head's value heads in turn, dk [B, T, H, K] (the first half's group
    sums) read once, their terms added in fp32 and stored once."""
    i_tg, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_p = i_bh // (HV // GROUP), i_bh % (HV // GROUP)  # i_p: the program's first value head / GROUP
    i_t, bos, T, i_tg = _chunk_rows(i_tg, i_b, T, cu_seqlens, chunk_indices, BT, IS_VARLEN)
    dt = k.dtype.element_ty
    o_t, m_t, r_t, o_c, o_k, m_k, m_tk = _chunk_block(i_t, bos, T, K, BT, BK)  # r_t: [BT] int64 token rows

    # GROUP 1 (the default) keeps the order of the kernel before GROUP: nothing [BT, BT] or
    # [BT, BK] beyond the accumulators is live through the V loop
    for i_r in tl.static_range(GROUP):
        i_h = i_p * GROUP + i_r
        i_hk = i_h // (HV // H)
        b_beta, b_AT, b_db, b_dMn, b_acc_kw = _gdn_y_init(beta, A, r_t, m_t, o_c, HV, i_h, BT, BK, dt)
        p_h = h + (i_tg * HV + i_h) * K * V
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            p_tv = (r_t * HV + i_h)[:, None] * V + o_v[None, :]
            b_ST = tl.load(p_h + o_k[None, :] * V + o_v[:, None], mask=m_v[:, None] & m_k[None, :], other=0.0)
            b_dU = tl.load(dU + p_tv, mask=m_tv, other=0.0).to(dt)
            b_U = tl.load(U + p_tv, mask=m_tv, other=0.0).to(dt)
            b_db, b_dMn, b_acc_kw = _gdn_y_terms(b_AT, b_dU, b_U, b_ST, b_beta, v, dv, p_tv, m_tv, b_db, b_dMn,
                                                 b_acc_kw)

        b_k = tl.load(k + (r_t * H + i_hk)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_gam = tl.load(gam + r_t * HV + i_h, mask=m_t, other=0.0)
        # mask before exp, padded rows too: there gam_i reads 0 and e^(0 - gam_j) can overflow
        m_strict = (o_c[:, None] > o_c[None, :]) & m_t[:, None]
        b_D = tl.where(m_strict, tl.exp(tl.where(m_strict, b_gam[:, None] - b_gam[None, :], 0.0)), 0.0)
        if i_r == 0:  # the first half's dk (its group sum where GROUP > 1), loaded only now
            b_dk = tl.load(dk + (r_t * (HV // GROUP) + i_p)[:, None] * K + o_k[None, :], mask=m_tk,
                           other=0.0).to(tl.float32)
        b_dk, b_dgam, b_db = _gdn_w_terms(b_k, b_beta, tl.exp(b_gam), b_D, m_strict, b_acc_kw, b_dMn,
                                          b_dk, tl.zeros([BT], dtype=tl.float32), b_db)
        tl.store(dbeta + r_t * HV + i_h, b_db.to(dbeta.dtype.element_ty), mask=m_t)
        b_dgam = tl.where(m_t, b_dgam, 0.0)
        b_dg = tl.load(dg + r_t * HV + i_h, mask=m_t, other=0.0) + tl.cumsum(b_dgam, axis=0, reverse=True)
        tl.store(dg + r_t * HV + i_h, b_dg.to(dg.dtype.element_ty), mask=m_t)
    tl.store(dk + (r_t * (HV // GROUP) + i_p)[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)


def _chunks_of(B: int, T: int, cu_seqlens: Tensor | None) -> "_Chunks":
    """_Chunks(B, T, cu_seqlens), built once per packed cu_seqlens tensor (ops/_packed.py):
    the linear-attention layers of one step share their batch's cu_seqlens."""
    if cu_seqlens is None:
        return _Chunks(B, T, None)
    return derived(cu_seqlens, ("linear_attention_chunks", B, T), lambda: _Chunks(B, T, cu_seqlens))


class _Chunks:
    """Where the chunks are: N sequences, NT chunks in all, and for packed sequences the
    (sequence, chunk) of every chunk [NT, 2] and each sequence's first chunk [N + 1].
    starts / lengths: each sequence's first token and token count (host ints, from
    host_offsets: cu_seqlens is read to the host once per tensor); whole: every length a
    multiple of the chunk (O_TMA's block stores)."""

    def __init__(self, B: int, T: int, cu_seqlens):
        self.cu_seqlens = cu_seqlens
        if cu_seqlens is None:
            self.N, self.NT = B, B * cdiv(T, CHUNK)
            self.indices = self.offsets = None
            self.starts, self.lengths = [b * T for b in range(B)], [T] * B
            self.whole = T % CHUNK == 0
            return
        cu = cu_seqlens.to(torch.int64)
        bounds = host_offsets(cu_seqlens)
        self.starts, self.lengths = list(bounds[:-1]), [b - a for a, b in itertools.pairwise(bounds)]
        counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK  # [N]
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        self.N = counts.numel()
        self.NT = sum(cdiv(n, CHUNK) for n in self.lengths)
        self.whole = all(n % CHUNK == 0 for n in self.lengths)
        seq = torch.repeat_interleave(torch.arange(self.N, device=cu.device), counts, output_size=self.NT)
        within = torch.arange(self.NT, device=cu.device) - offsets[seq]
        self.indices = torch.stack([seq, within], 1).to(torch.int32).contiguous()
        self.offsets = offsets.to(torch.int32)
        self.cu_seqlens = cu.to(torch.int32).contiguous()


class _Layout(NamedTuple):
    """What a recurrence kernel walks: N sequences, packed (cu [N + 1] tokens, offsets [N] chunks)
    or not (B rows of T tokens)."""

    N: int
    cu: Tensor | None
    offsets: Tensor | None
    varlen: bool


def _layout(chunks: _Chunks) -> _Layout:
    return _Layout(chunks.N, chunks.cu_seqlens, chunks.offsets, chunks.indices is not None)


class _Segments(NamedTuple):
    """The sequence split: every sequence cut into segments of a fixed number of chunks (its
    last one shorter), run side by side by the recurrence kernels as packed sequences.

    Chunks keep their global numbers, so h / dh and the chunk-parallel kernels are unchanged.
    Three passes replace one sequential sweep (README.md, "The sequence split"): each segment
    from a zero state (its L_s, and its transition: e^{G_s}, or the [K, K] M_s of the delta
    rule), a scan over each sequence's few segments (_segment_scan_kernel), then each segment
    again from its true entering state, writing o (forward) or dh, dU (backward).
    """

    layout: _Layout  # N = NS segments
    first: Tensor  # [N + 1] int32, the first segment of each sequence
    N: int  # sequences


@functools.lru_cache(maxsize=64)
def _segments(starts: tuple, lengths: tuple, length: int, device: torch.device) -> _Segments:
    """Cached per shape: the split's index tensors are built once (one host-to-device copy)
    and reused by later steps."""
    cu, offsets, first, chunk = [], [], [0], 0
    for start, n in zip(starts, lengths):
        m = max(1, cdiv(n, length * CHUNK))
        cu += [start + j * length * CHUNK for j in range(m)]
        offsets += [chunk + j * length for j in range(m)]
        first.append(first[-1] + m)
        chunk += cdiv(n, CHUNK)
    cu.append(starts[-1] + lengths[-1])
    flat = torch.tensor(cu + offsets + first, dtype=torch.int32).to(device)
    NS = len(offsets)
    layout = _Layout(NS, flat[: NS + 1], flat[NS + 1 : 2 * NS + 1], True)
    return _Segments(layout, flat[2 * NS + 1 :], len(lengths))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: the H200's count, so CPU runs plan as the GPU would
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan_segments(chunks: _Chunks, K: int, HV: int, V: int, device, gdn: bool) -> _Segments | None:
    """The split, or None where the sequences alone give the recurrences enough programs.

    Segments take the length with the shortest sweep (_segment_length) and hold at least
    MIN_SEGMENT_CHUNKS chunks (each segment adds a program's start and end and a scan step).
    SEGMENT_CHUNKS, when set, forces the segment length (tests, probes).
    """
    counts = [cdiv(n, CHUNK) for n in chunks.lengths]
    longest = max(counts)
    if SEGMENT_CHUNKS is not None:
        length = SEGMENT_CHUNKS
    else:
        # programs per sequence-head: unsplit (the gate's count) and under the split (the plan's)
        if not gdn and _gla_light(chunks):  # the light sweeps' [BK, BV] blocks, split or not
            BV, _, BK, _ = _sweep_launch(_light_config(K, V), K, V)
            unsplit = per_segment = cdiv(K, BK) * cdiv(V, BV)
            key, per_sm = "gla_light", SPLIT_LIGHT_PROGRAMS_PER_SM
        else:
            unsplit, per_segment = cdiv(V, CONFIGS["seq"][0]), cdiv(V, _split_config(K, V, gdn)[0])
            key, per_sm = "gdn" if gdn else "gla", SPLIT_PROGRAMS_PER_SM
        if chunks.N * HV * unsplit > SPLIT_MAX_PROGRAMS[key]:
            return None
        slots = _num_sms(torch.device(device)) * per_sm
        length = _segment_length(tuple(counts), HV * per_segment, slots)
        if length is None:
            return None
    if length >= longest:
        return None
    return _segments(tuple(chunks.starts), tuple(chunks.lengths), length, torch.device(device))


@functools.lru_cache(maxsize=256)
def _segment_length(counts: tuple, programs_per_segment: int, slots: int) -> int | None:
    """Chunks per segment for sequences of counts chunks: the length whose sweep ends first
    when its programs (programs_per_segment per segment, in launch order) take the first free
    of slots program slots, each for its chunk count plus SPLIT_PROGRAM_OVERHEAD_CHUNKS; ties
    go to the longer length (fewer segments to scan). None where no length of at least
    MIN_SEGMENT_CHUNKS cuts the longest sequence.

    Lengths tried are those where the longest sequence's segment count changes, longest first,
    until the programs would take more than two waves, so each length tried places at most
    2 x slots programs. Taking total chunks / slots rounded up instead (before 2026-12-03) cut
    B4-T8192-H16 into 63 + 63 + 2 chunks per sequence: 192 programs on 132 SMs, whose long
    second-wave segments start late (a modelled 73 steps against 66 for 2 x 64 chunks).
    """
    longest = max(counts)
    lengths = {max(MIN_SEGMENT_CHUNKS, cdiv(longest, s)) for s in range(2, 2 * slots + 2)}
    best = None
    for length in sorted((n for n in lengths if n < longest), reverse=True):
        if programs_per_segment * sum(cdiv(n, length) for n in counts) > 2 * slots:
            break  # shorter lengths make only more programs
        free = [0] * slots  # when each slot is next free (a heap)
        for n in counts:
            for j in range(cdiv(n, length)):
                steps = min(length, n - j * length) + SPLIT_PROGRAM_OVERHEAD_CHUNKS
                for _ in range(programs_per_segment):
                    heapq.heappush(free, heapq.heappop(free) + steps)
        if best is None or max(free) < best[0]:
            best = (max(free), length)
    return None if best is None else best[1]


def _alloc(shape, dtype, device) -> Tensor:
    """Every buffer the kernels write (tests swap in a NaN-filled one to catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _blocks(K: int, V: int) -> tuple[int, int]:
    return max(16, next_power_of_2(K)), min(64, max(16, next_power_of_2(V)))


def _seq_config(K: int, V: int, sequence_heads: int, device, *, gdn: bool,
                varlen: bool = False) -> tuple[int, int]:
    """(BV, num_warps) of the recurrences. With few sequence-heads (tensor-parallel shards,
    B1 with 4 heads) a smaller BV puts more programs side by side: a chunk step's latency
    hardly depends on BV, so that is nearly free. With more programs than SMs (one fits per
    SM at BV 32 and 64), CONFIGS["seq_wide"]'s BV runs the same sequential steps in fewer
    waves: Gated DeltaNet fwd+bwd 3.49 -> 3.07 ms at B4-T8192-H16 (256 -> 128 programs),
    5.50 -> 5.24 at B1-T8192-H96, simple GLA 3.07 -> 2.73 at B1-T8192-H96, bitwise the same
    results (benchmarks/results/h200/linear_attention_seq_bv.json); at 128 programs
    (B1-T32768-HQK16-HV32) BV 64 would leave half the SMs idle (7.46 -> 8.49 ms), so BV 32
    stays there. Simple GLA goes wider still (CONFIGS["seq_wide_gla"], whole states at K 128):
    at B1-T8192-H96 BV 128 with 8 warps (96 programs, one wave, against 192 at BV 64) took
    fwd+bwd 2.437 -> 2.261 ms, 4 warps 2.843 (linear_attention_seq_configs.json, bitwise the
    same); the delta rule's recurrences need more shared memory than the H200 has at BV 128.
    Over packed sequences (varlen) the delta rule's wide recurrences take
    CONFIGS["seq_wide_varlen"] (8 warps: no spill)."""
    BV, num_warps = CONFIGS["seq"]
    BV = min(BV, _blocks(1, V)[1])
    while BV > 16 and sequence_heads * cdiv(V, BV) < MIN_SEQ_PROGRAMS:
        BV //= 2
    wide, wide_warps = CONFIGS[("seq_wide_varlen" if varlen else "seq_wide") if gdn else "seq_wide_gla"]
    wide = min(wide, _blocks(1, V)[1] if gdn else max(16, next_power_of_2(V)))
    if wide > BV and _wide_v_fits(K) and sequence_heads * cdiv(V, BV) > _num_sms(torch.device(device)):
        return wide, wide_warps
    return BV, num_warps


def _gla_light(chunks: _Chunks) -> bool:
    """Whether simple GLA runs its light sweeps (GLA_LIGHT_SWEEPS; "short": sequences of at most
    LIGHT_MAX_CHUNKS chunks)."""
    if GLA_LIGHT_SWEEPS == "short":
        return max(cdiv(n, CHUNK) for n in chunks.lengths) <= LIGHT_MAX_CHUNKS
    return bool(GLA_LIGHT_SWEEPS)


def _fuse_group_sum(chunks: _Chunks, H: int, HV: int, gdn: bool) -> bool:
    """Whether the chunk kernel sums each group of value heads' dq and dk (FUSE_GROUP_SUM, from
    FUSE_GROUP_MIN_PROGRAMS chunk x q/k head programs)."""
    return HV != H and FUSE_GROUP_SUM["gdn" if gdn else "gla"] and chunks.NT * H >= FUSE_GROUP_MIN_PROGRAMS


def _light_config(K: int, V: int) -> tuple[int, int, int]:
    """(BV, num_warps, BK[, num_stages]) of simple GLA's light sweeps (GLA_LIGHT_SWEEPS):
    CONFIGS["light"]'s blocks, cut to the head dims."""
    BV, num_warps, BK, *stages = CONFIGS["light"]
    return (min(BV, _blocks(1, V)[1]), num_warps, min(BK, _blocks(K, 1)[0]), *stages)


def _wide_v_fits(K: int) -> bool:
    """Whether the recurrences take V blocks wider than 32 at key head dim K: not at K 256
    (simple GLA), where BV 64 needs 241 KB of shared memory on the H200 (227 KB)."""
    return _blocks(K, 1)[0] <= 128


def _split_config(K: int, V: int, gdn: bool) -> tuple:
    """(BV, num_warps[, BK[, num_stages]]) of the recurrences under the sequence split (which
    supplies the programs); a BK given is taken as the whole key head dim (_sweep_launch), the
    split's sweeps forming o."""
    BV, num_warps, *rest = CONFIGS["split_gdn" if gdn else "split"]
    rest = (_blocks(K, V)[0], *rest[1:]) if rest else ()
    return (min(BV, max(16, next_power_of_2(V)), 128 if _wide_v_fits(K) else 32), num_warps, *rest)


def _chunk_bwd_config(K: int, V: int) -> tuple:
    """(BV, num_warps[, num_stages[, maxnreg]]) of _bwd_chunk_kernel (and of the delta rule's
    second chunk-backward kernel): CONFIGS["chunk_bwd"], BV at most the value block. K 256
    (simple GLA) takes (32, 4): at the default (64, 8) it needs 240 KB of shared memory, and
    (32, 8) gave dq 2.8e-2 off the fp32 reference in bf16 on the H200 (Triton 3.6), where
    (32, 4) and (16, 4) passed; at this config
    test_simple_gla_head_dim_256_bf16_matches_fp32_reference_gpu passes there. (32, 8) is
    wrong for the delta rule at K 128 too: 7% faster there (2.67 against 2.86 ms at
    B1-T32768-HQK16-HV32), it failed 2 of the 14 bf16 GPU tests (among them the forced split's
    packed case), 2026-12-02."""
    BV, num_warps, *options = CONFIGS["chunk_bwd"]
    BV = min(BV, _blocks(K, V)[1])
    if _blocks(K, V)[0] > 128:
        return min(BV, 32), 4
    return (BV, num_warps, *options)


def _prep(q, k, v, g, beta, scale, chunks: _Chunks, store_A: bool, A: Tensor | None = None, want_u: bool = True,
          h: Tensor | None = None, o: Tensor | None = None):
    """gam, P and for the delta rule A, w, u; A given (what an earlier call stored): read, not
    computed again (bitwise the same w and u, as both round A to the input dtype first); want_u
    False: u None (a backward given the forward's chunk states and U needs none); h and o given
    (simple GLA's light sweeps): o written from the chunk states h."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BK, BV = _blocks(K, V)
    gdn = beta is not None
    load_A = gdn and A is not None
    store_A = gdn and store_A and not load_A
    gam = _alloc((B, T, HV), torch.float32, q.device)
    P = _alloc((B, T, HV, CHUNK), q.dtype, q.device)
    if store_A:
        A = _alloc((B, T, HV, CHUNK), q.dtype, q.device)
    w = _alloc((B, T, HV, K), q.dtype, q.device) if gdn else None
    u = _alloc(v.shape, v.dtype, v.device) if gdn and want_u else None
    grid = (chunks.NT // (1 if chunks.indices is not None else B), B * HV)
    _prep_kernel[grid](
        q, k, v, g, beta, gam, P, A, w, u, h, o, chunks.cu_seqlens, chunks.indices, scale, T,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=BV,
        IS_GDN=gdn, STORE_A=store_A, LOAD_A=load_A, IS_VARLEN=chunks.indices is not None,
        STORE_U=u is not None, STORE_O=o is not None, num_warps=CONFIGS["prep"][1],
        **({"maxnreg": CONFIGS["prep"][2]} if len(CONFIGS["prep"]) > 2 else {}),
    )
    return gam, P, A if gdn else None, w, u


def _sweep_launch(config, K: int, V: int) -> tuple[int, int, int, dict]:
    """(BV, num_warps, BK, launch options) of a sweep's config (BV, num_warps[, BK[, num_stages]]):
    BK the whole key head dim unless given, num_stages Triton's default unless given."""
    BV, num_warps, *rest = config
    BK = rest[0] if rest else _blocks(K, V)[0]
    return BV, num_warps, BK, {"num_stages": rest[1]} if len(rest) > 1 else {}


@functools.cache
def _device_has_tma(device: torch.device) -> bool:
    """Hopper's TMA (sm_90 and later); the interpreter takes descriptors too."""
    return _INTERPRET or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


def _tma_ok(form, t, q, whole: bool, backward: bool = False) -> bool:
    """Whether a sweep writes t through a TMA descriptor under the switch's form (STATES_TMA,
    O_TMA: True every sweep, "whole" only a forward sweep over whole [K, V] states, False none):
    Triton has host descriptors, t is in q's dtype, 16-byte aligned with 16-byte rows, and the
    device has TMA. Else plain stores."""
    if not form or _TensorDescriptor is None or (form == "whole" and (backward or not whole)):
        return False
    if t.dtype != q.dtype or t.data_ptr() % 16 or (t.shape[-1] * t.element_size()) % 16:
        return False
    return _device_has_tma(t.device)


def _states_desc(h, BK: int, BV: int, q, backward: bool = False):
    """A TMA descriptor over the chunk states h [NT, HV, K, V] (or their gradients, backward) as
    [NT * HV * K, V] in [BK, BV] blocks, for the sweeps to write them under STATES_TMA; None
    (plain stores) without h, where _tma_ok says no, or where the blocks do not tile K and V
    exactly or the rows pass int32 offsets."""
    if h is None:
        return None
    NT, HV, K, V = h.shape
    if K % BK or V % BV or NT * HV * K >= 2**31 or not _tma_ok(STATES_TMA, h, q, BK == K and BV == V, backward):
        return None
    return _TensorDescriptor(h, [NT * HV * K, V], [V, 1], [BK, BV])


def _out_desc(o, BK: int, BV: int, q, whole_chunks: bool):
    """A TMA descriptor over o [B, T, HV, V] as [B * T, HV, V] in [CHUNK, 1, BV] blocks, for the
    forward sweeps to write o under O_TMA; None: plain stores. A block store writes whole chunks,
    so only where every sequence's length is a multiple of the chunk (whole_chunks); else as
    _states_desc."""
    if o is None or not whole_chunks:
        return None
    B, T, HV, V = o.shape
    if V % BV or B * T >= 2**31 or not _tma_ok(O_TMA, o, q, BK == q.shape[3] and BV == V):
        return None
    return _TensorDescriptor(o, [B * T, HV, V], [HV * V, V, 1], [CHUNK, 1, BV])


def _sweep_fwd(layout: _Layout, config, q, k, w, u, gam, P, scale, *, V=None, o=None, h0=None, ht=None,
               h=None, U=None, gt=None, zero_u=False, h0_eye=False, gam_from_g=False, whole_chunks=False):
    """_recurrence_fwd_kernel over layout's sequences; each output given is written. config:
    _sweep_launch's (a BK below the key head dim: simple GLA's light sweeps); gam_from_g: gam is
    g (the sweep forms its chunk cumsum); whole_chunks: every sequence's length is a multiple of
    the chunk (o may then be written through a descriptor, O_TMA)."""
    T, H, K = q.shape[1:]
    HV = gam.shape[2]
    V = u.shape[3] if V is None else V
    BV, num_warps, BK, options = _sweep_launch(config, K, V)
    assert BK >= K or (w is None and o is None), "only simple GLA's sweeps without o take a block of K"
    h_desc = _states_desc(h, BK, BV, q)
    o_desc = _out_desc(o, BK, BV, q, whole_chunks)
    if h_desc is not None and o_desc is not None:
        # Both stores' staging tiles and three pipeline stages need 238600 B of shared memory in
        # simple GLA's whole-state sweep (K = V = BV = 128, 8 warps), over the 232448 a block may
        # take; two stages need 180740 (tools/compile_kernels.py, Triton 3.6 and 3.9 alike).
        options = {**options, "num_stages": min(options.get("num_stages", 3), 2)}
    _recurrence_fwd_kernel[(cdiv(K, BK) * cdiv(V, BV), layout.N * HV)](
        q, k, w, u, gam, P, o if o_desc is None else o_desc, h0, ht, h if h_desc is None else h_desc, U, gt,
        layout.cu, layout.offsets, scale, T,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=BV,
        IS_GDN=w is not None, STORE_O=o is not None, STORE_H=h is not None, USE_H0=h0 is not None,
        STORE_HT=ht is not None, IS_VARLEN=layout.varlen, ZERO_U=zero_u, H0_EYE=h0_eye,
        STORE_GT=gt is not None, GAM_FROM_G=gam_from_g, H_TMA=h_desc is not None, O_TMA=o_desc is not None,
        num_warps=num_warps, **options,
    )


def _sweep_bwd(layout: _Layout, config, q, k, w, gam, P, do, scale, *, dU=None, dh=None, dht=None, dh0=None):
    """_recurrence_bwd_kernel over layout's sequences; without dh (and dU) it writes only dh0.
    config as _sweep_fwd's."""
    T, H, K = q.shape[1:]
    HV, V = do.shape[2], do.shape[3]
    BV, num_warps, BK, options = _sweep_launch(config, K, V)
    assert BK >= K or (w is None and dU is None), "only simple GLA's sweeps without dU take a block of K"
    dh_desc = _states_desc(dh, BK, BV, q, backward=True)
    _recurrence_bwd_kernel[(cdiv(K, BK) * cdiv(V, BV), layout.N * HV)](
        q, k, w, gam, P, do, dU, dh if dh_desc is None else dh_desc, dht, dh0, layout.cu, layout.offsets, scale, T,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=BV,
        IS_GDN=w is not None, USE_DHT=dht is not None, USE_DH0=dh0 is not None, IS_VARLEN=layout.varlen,
        STORE=dh is not None, STORE_DU=dU is not None, H_TMA=dh_desc is not None, num_warps=num_warps, **options,
    )


def _scan(seg: _Segments, L, trans, s0, *, reverse: bool, want_end: bool):
    """_segment_scan_kernel: (per segment the state entering it, or in reverse the gradient of
    the state leaving it; and the sequence's end of the scan, or None)."""
    NS, HV, K, V = L.shape
    gdn = trans.dim() == 4
    S_in = _alloc(L.shape, torch.float32, L.device)
    st = _alloc((seg.N, HV, K, V), torch.float32, L.device) if want_end else None
    BV = min(32, _blocks(1, V)[1])
    _segment_scan_kernel[(cdiv(V, BV), seg.N * HV)](
        L, None if gdn else trans, trans if gdn else None, s0, S_in, st, seg.first, HV, K=K, V=V,
        BK=_blocks(K, V)[0], BV=BV, IS_GDN=gdn, REVERSE=reverse, USE_S0=s0 is not None, STORE_ST=want_end,
        num_warps=8 if gdn else 4,
    )
    return S_in, st


def _fwd(q, k, v, g, beta, scale, h0, output_final_state, chunks: _Chunks, keep_A: bool = False,
         keep_prep: bool = False, keep_states: bool = False):
    """(o, final state or None, the split's states or None, with keep_A the delta rule's A
    [B, T, HV, C] in the input dtype for the backward, as fla keeps it, else None, with
    keep_prep the prep's (gam, P, w) (w None for simple GLA: GLA_KEEP_P; the delta rule's GDN_KEEP_PREP
    only with keep_states, as its backward then needs no u), else None, and with keep_states
    (KEEP_STATES) the chunk states h [NT, HV, K, V] and for the delta rule U, written by the
    sweep that writes o, else None)."""
    if beta is None and _gla_light(chunks):
        return _fwd_gla_light(q, k, v, g, scale, h0, output_final_state, chunks, keep_prep, keep_states)
    K = q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    gam, P, A, w, u = _prep(q, k, v, g, beta, scale, chunks, store_A=keep_A)
    gdn = beta is not None
    u = u if gdn else v
    kept_prep = (gam, P, w) if keep_prep else None
    o = _alloc(v.shape, v.dtype, v.device)
    h = _alloc((chunks.NT, HV, K, V), q.dtype, q.device) if keep_states else None
    U = _alloc(v.shape, v.dtype, v.device) if keep_states and gdn else None
    states = (h, U) if keep_states else None
    seg = _plan_segments(chunks, K, HV, V, q.device, gdn)
    if seg is None:
        ht = _alloc((chunks.N, HV, K, V), torch.float32, q.device) if output_final_state else None
        config = _seq_config(K, V, chunks.N * HV, q.device, gdn=gdn, varlen=chunks.cu_seqlens is not None)
        _sweep_fwd(_layout(chunks), config, q, k, w, u, gam, P, scale, o=o, h0=h0, ht=ht, h=h, U=U,
                   whole_chunks=chunks.whole)
        return o, ht, None, A, kept_prep, states
    config = _split_config(K, V, gdn)
    # 1. every segment from a zero state: L_s, and its transition (G_s, or M_s from the identity)
    L = _alloc((seg.layout.N, HV, K, V), torch.float32, q.device)
    if gdn:
        trans = _alloc((seg.layout.N, HV, K, K), torch.float32, q.device)
        _sweep_fwd(seg.layout, config, q, k, w, u, gam, P, scale, ht=L)
        _sweep_fwd(seg.layout, config, q, k, w, u, gam, P, scale, V=K, ht=trans, zero_u=True, h0_eye=True)
    else:
        trans = _alloc((seg.layout.N, HV), torch.float32, q.device)
        _sweep_fwd(seg.layout, config, q, k, w, u, gam, P, scale, ht=L, gt=trans)
    # 2. the states entering the segments; 3. each segment from its state, writing o
    S_in, ht = _scan(seg, L, trans, h0, reverse=False, want_end=output_final_state)
    _sweep_fwd(seg.layout, config, q, k, w, u, gam, P, scale, o=o, h0=S_in, h=h, U=U,
               whole_chunks=chunks.whole)
    return o, ht, (seg, S_in, trans), A, kept_prep, states


def _fwd_gla_light(q, k, v, g, scale, h0, output_final_state, chunks: _Chunks, keep_prep: bool, keep_states: bool):
    """_fwd for simple GLA with GLA_LIGHT_SWEEPS: the sweeps (split or not) write only the chunk
    states h, in [BK, BV] blocks of K and V (_light_config), forming gam from g themselves; the
    prep kernel then forms gam, P and o = q^ S + P v, every chunk in parallel."""
    K = q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    h = _alloc((chunks.NT, HV, K, V), q.dtype, q.device)
    config = _light_config(K, V)
    seg = _plan_segments(chunks, K, HV, V, q.device, False)
    split = None
    if seg is None:
        ht = _alloc((chunks.N, HV, K, V), torch.float32, q.device) if output_final_state else None
        _sweep_fwd(_layout(chunks), config, q, k, None, v, g, None, scale, h0=h0, ht=ht, h=h, gam_from_g=True)
    else:
        L = _alloc((seg.layout.N, HV, K, V), torch.float32, q.device)
        trans = _alloc((seg.layout.N, HV), torch.float32, q.device)
        _sweep_fwd(seg.layout, config, q, k, None, v, g, None, scale, ht=L, gt=trans, gam_from_g=True)
        S_in, ht = _scan(seg, L, trans, h0, reverse=False, want_end=output_final_state)
        del L
        _sweep_fwd(seg.layout, config, q, k, None, v, g, None, scale, h0=S_in, h=h, gam_from_g=True)
        split = (seg, S_in, trans)
    o = _alloc(v.shape, v.dtype, v.device)
    gam, P, _, _, _ = _prep(q, k, v, g, None, scale, chunks, store_A=False, h=h, o=o)
    return o, ht, split, None, (gam, P, None) if keep_prep else None, (h, None) if keep_states else None


def _bwd(q, k, v, g, beta, scale, h0, do, dht, chunks: _Chunks, split, A=None, prep=None, states=None):
    """A: the forward's (None: computed again here); prep: the forward's (gam, P, w) (w None for
    simple GLA; GLA_KEEP_P, GDN_KEEP_PREP; None: the prep kernel runs again); states: the forward's
    (h, U) (KEEP_STATES; None: the forward sweep runs again here to write them)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gdn = beta is not None
    if prep is not None:  # the delta rule's only with states (its backward then reads no u)
        assert not gdn or states is not None
        (gam, P, w), u = prep, None
    else:
        gam, P, A, w, u = _prep(q, k, v, g, beta, scale, chunks, store_A=True, A=A, want_u=states is None)
    # The chunk states, the forward's or recomputed; in the input dtype like every other dot operand.
    recompute = states is None
    if recompute:
        h = _alloc((chunks.NT, HV, K, V), q.dtype, q.device)
        U = _alloc(v.shape, v.dtype, v.device) if gdn else None
    else:
        (h, U), u = states, None
    dh = _alloc(h.shape, h.dtype, h.device)
    # simple GLA's dv (dU) is formed by the chunk kernel from dh (DV_FROM_DH), not by the sweep;
    # always under its light sweeps, which take a block of K
    light = not gdn and _gla_light(chunks)
    dv_from_dh = not gdn and (light or GLA_DV_FROM_DH is True or (GLA_DV_FROM_DH == "unsplit" and split is None))
    dU = None if dv_from_dh else _alloc(v.shape, v.dtype, v.device)
    # the recomputed states as the forward's light sweeps formed them, gam from g
    fwd_gam = g if light else gam
    if split is None:
        layout = _layout(chunks)
        config = _light_config(K, V) if light else _seq_config(K, V, chunks.N * HV, q.device, gdn=gdn,
                                                               varlen=chunks.cu_seqlens is not None)
        if recompute:
            _sweep_fwd(layout, config, q, k, w, u if gdn else v, fwd_gam, P, scale, h0=h0, h=h, U=U,
                       gam_from_g=light)
        del u
        dh0 = _alloc((chunks.N, HV, K, V), torch.float32, q.device) if h0 is not None else None
        _sweep_bwd(layout, config, q, k, w, gam, P, do, scale, dU=dU, dh=dh, dht=dht, dh0=dh0)
    else:
        seg, S_in, trans = split
        config = _light_config(K, V) if light else _split_config(K, V, gdn)
        if recompute:
            _sweep_fwd(seg.layout, config, q, k, w, u if gdn else v, fwd_gam, P, scale, h0=S_in, h=h, U=U,
                       gam_from_g=light)
        del u
        L = _alloc((seg.layout.N, HV, K, V), torch.float32, q.device)
        _sweep_bwd(seg.layout, config, q, k, w, gam, P, do, scale, dh0=L)
        dht_in, dh0 = _scan(seg, L, trans, dht, reverse=True, want_end=h0 is not None)
        del L
        _sweep_bwd(seg.layout, config, q, k, w, gam, P, do, scale, dU=dU, dh=dh, dht=dht_in)
        del dht_in
    del w
    if not dv_from_dh:
        P = None  # only simple GLA's chunk kernel reads P (its dv)
    grouped = HV != H
    # with FUSE_GROUP_SUM the chunk kernel sums a group of value heads' dq and dk in fp32 and
    # stores them once; else per value head, in the input dtype, a group of heads summed
    # afterwards in fp32 and rounded once (_group_sum: one pass; torch's sum over the group dim
    # ran at 1.5 TB/s)
    fused = _fuse_group_sum(chunks, H, HV, gdn)
    dq = _alloc((B, T, H if fused else HV, K), q.dtype, q.device)
    dk = _alloc((B, T, H if fused else HV, K), q.dtype, q.device)
    dv = _alloc(v.shape, v.dtype, v.device) if gdn or dv_from_dh else dU
    dg = _alloc((B, T, HV), torch.float32, q.device)
    dbeta = _alloc((B, T, HV), torch.float32, q.device) if gdn else None
    if gdn and GDN_SPLIT_CHUNK_BWD:
        # the output and state paths as simple GLA's (U for v: dq, dk and dg's terms), then w's and u's
        _chunk_bwd(chunks, q, k, U, gam, None, None, h, dh, None, None, do, dq, dk, None, dg, None, scale)
        _chunk_bwd_gdn_w(chunks, k, v, gam, beta, A, h, U, dU, dk, dv, dg, dbeta)
    else:
        _chunk_bwd(chunks, q, k, v, gam, beta, A, h, dh, U, dU, do, dq, dk, dv, dg, dbeta, scale, P=P)
    # freed before the group sums, where the backward's peak memory is (the chunk states alone
    # are [NT, HV, K, V])
    del gam, P, h, dh, U, dU
    if grouped and not fused:
        dq, dk = _group_sum(dq, H), _group_sum(dk, H)
    return dq, dk, dv, dg, dbeta, dh0


def _chunk_bwd_launch(config) -> tuple[int, int, dict]:
    """(BV, num_warps, launch options) of a chunk-backward config (BV, num_warps[, num_stages
    [, maxnreg]]), a None option left to Triton's default; both chunk-backward kernels take it."""
    BV, num_warps, *rest = config
    return BV, num_warps, {name: value for name, value in zip(("num_stages", "maxnreg"), rest) if value is not None}


def _chunk_bwd(chunks: _Chunks, q, k, v, gam, beta, A, h, dh, U, dU, do, dq, dk, dv, dg, dbeta, scale,
               config=None, P=None) -> None:
    """_bwd_chunk_kernel over every chunk and value head (config: (BV, num_warps[, num_stages
    [, maxnreg]]), num_stages None for Triton's default; default _chunk_bwd_config's); beta None:
    simple GLA, whose dv the kernel forms from P and dh (dU None)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = chunks.indices is not None
    BV, num_warps, options = _chunk_bwd_launch(_chunk_bwd_config(K, V) if config is None else config)
    heads = dq.shape[2]  # HV, or H where the kernel sums each group of value heads (FUSE_GROUP_SUM)
    _bwd_chunk_kernel[(chunks.NT // (1 if varlen else B), B * heads)](
        q, k, v, gam, beta, A, P, h, dh, U, dU, do, dq, dk, dv, dg, dbeta,
        chunks.cu_seqlens, chunks.indices, scale, T,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_blocks(K, V)[0], BV=BV,
        IS_GDN=beta is not None, IS_VARLEN=varlen, DV_FROM_DH=P is not None, GROUP=HV // heads,
        num_warps=num_warps, **options,
    )


def _chunk_bwd_gdn_w(chunks: _Chunks, k, v, gam, beta, A, h, U, dU, dk, dv, dg, dbeta) -> None:
    """_bwd_chunk_gdn_w_kernel over every chunk and value head (GDN_SPLIT_CHUNK_BWD), at
    _chunk_bwd_config's config; or, where dk has q/k heads (FUSE_GROUP_SUM), over every chunk
    and q/k head, its value heads in turn."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = chunks.indices is not None
    BV, num_warps, options = _chunk_bwd_launch(_chunk_bwd_config(K, V))
    heads = dk.shape[2]  # HV, or H where the chunk kernels sum each group of value heads
    _bwd_chunk_gdn_w_kernel[(chunks.NT // (1 if varlen else B), B * heads)](
        k, v, gam, beta, A, h, U, dU, dk, dv, dg, dbeta, chunks.cu_seqlens, chunks.indices, T,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_blocks(K, V)[0], BV=BV, IS_VARLEN=varlen, GROUP=HV // heads,
        num_warps=num_warps, **options,
    )


def _group_sum(x: Tensor, H: int) -> Tensor:
    """[B, T, HV, K] per value head -> [B, T, H, K], each group of HV // H heads summed."""
    B, T, HV, K = x.shape
    out = _alloc((B, T, H, K), x.dtype, x.device)
    rows = B * T * H
    BR = 32
    _group_sum_kernel[(cdiv(rows, BR),)](
        x, out, rows, R=HV // H, K=K, BR=BR, BK=next_power_of_2(K), num_warps=4
    )
    return out


def kept_for_backward(gdn: bool) -> tuple[bool, bool]:
    """(keep_states, keep_prep) where a backward follows: the chunk states under KEEP_STATES; the
    prep's gam and P under GLA_KEEP_P (simple GLA), or with w under GDN_KEEP_PREP where the delta
    rule keeps its states."""
    states = KEEP_STATES["gdn" if gdn else "gla"]
    return states, (GDN_KEEP_PREP and states) if gdn else GLA_KEEP_P


def kept_bytes_per_token(gdn: bool, HV: int, K: int, V: int, elem: int) -> float:
    """What the forward keeps for the backward beyond its inputs, per token, as _fwd allocates it
    under kept_for_backward: h [NT, HV, K, V] and the delta rule's U (v's shape), gam [T, HV] fp32,
    P [T, HV, CHUNK] and the delta rule's w [T, HV, K]; elem: the inputs' element size."""
    states, prep = kept_for_backward(gdn)
    n = (HV * K * V * elem / CHUNK + (HV * V * elem if gdn else 0)) if states else 0.0
    return n + ((HV * 4 + HV * CHUNK * elem + (HV * K * elem if gdn else 0)) if prep else 0)


class ChunkLinearAttentionFunction(torch.autograd.Function):
    """Autograd of the chunked gated delta rule (beta given) or simple GLA (beta None)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, grad_enabled):
        chunks = _chunks_of(q.shape[0], q.shape[1], cu_seqlens)
        # needs_input_grad stays True under no_grad: the caller's grad mode decides too
        backward_follows = grad_enabled and any(ctx.needs_input_grad[:5])
        keep_A = beta is not None and backward_follows
        states, prep = kept_for_backward(beta is not None)
        keep_states, keep_prep = backward_follows and states, backward_follows and prep
        o, ht, split, A, prep, states = _fwd(q, k, v, g, beta, scale, initial_state, output_final_state, chunks,
                                             keep_A, keep_prep, keep_states)
        gam, P, w = prep or (None, None, None)
        h, U = states or (None, None)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, A, gam, P, w, h, U)
        ctx.chunks, ctx.scale, ctx.split = chunks, scale, split  # split: the segments' states
        if ht is None:
            return o
        return o, ht

    @staticmethod
    def backward(ctx, do, dht=None):
        q, k, v, g, beta, h0, A, gam, P, w, h, U = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _bwd(
            q, k, v, g, beta, ctx.scale, h0, do.contiguous(),
            None if dht is None else dht.contiguous(), ctx.chunks, ctx.split, A,
            None if gam is None else (gam, P, w), None if h is None else (h, U),
        )
        return (
            dq, dk, dv, dg.to(g.dtype), None if dbeta is None else dbeta.to(beta.dtype),
            None, None if dh0 is None else dh0.to(h0.dtype), None, None, None,
        )


def _check(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """Raises ValueError naming the argument (cu_seqlens's values through host_offsets: one
    host read per packed batch, shared with the forward's _chunks_of)."""
    if q.dim() != 4 or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q: the triton backend needs a [B, T, H, K] tensor in bf16, fp16 or fp32, got "
            f"{q.dtype} {list(q.shape)}; use backend='torch' for other dtypes"
        )
    B, T, H, K = q.shape
    if H == 0 or K == 0:
        raise ValueError(f"q: expected at least one head and a key dim of at least 1, got {list(q.shape)}")
    op = "gla" if beta is None else "gdn"
    if K > MAX_HEAD_DIM_K[op]:
        raise ValueError(
            f"q: the triton backend's {'simple GLA' if beta is None else 'gated delta rule'} handles key head "
            f"dims K <= {MAX_HEAD_DIM_K[op]}, got K={K}; use backend='torch'"
        )
    if k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(f"k: expected {list(q.shape)} {q.dtype} like q, got {list(k.shape)} {k.dtype}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % H or v.dtype != q.dtype:
        raise ValueError(
            f"v: expected [B, T, HV, V] with B, T = {B}, {T}, HV a multiple of q's {H} heads and "
            f"dtype {q.dtype}, got {list(v.shape)} {v.dtype}"
        )
    HV, V = v.shape[2], v.shape[3]
    for name, x in (("g", g), ("beta", beta)):
        if x is not None and (x.shape != (B, T, HV) or not x.is_floating_point()):
            raise ValueError(
                f"{name}: expected a floating [B, T, HV] = {[B, T, HV]} tensor, got {x.dtype} {list(x.shape)}"
            )
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"cu_seqlens: expected an integer [N + 1] tensor of offsets, got {cu_seqlens.dtype} "
                f"{list(cu_seqlens.shape)}"
            )
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got B={B}; flatten the batch")
        offsets = host_offsets(cu_seqlens)
        if offsets[0] != 0 or offsets[-1] != T or any(a > b for a, b in itertools.pairwise(offsets)):
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={T}, got {offsets}")
        N = len(offsets) - 1
    if initial_state is not None and (
        initial_state.shape != (N, HV, K, V) or not initial_state.is_floating_point()
    ):
        raise ValueError(
            f"initial_state: expected a floating [N, HV, K, V] = {[N, HV, K, V]} tensor, got "
            f"{initial_state.dtype} {list(initial_state.shape)}"
        )
    tensors = [("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens)]
    for name, x in tensors:
        if x is not None and x.device != q.device:
            raise ValueError(f"{name}: expected on {q.device} like q, got {x.device}")
    if q.is_cuda and q.dtype == torch.float32:
        # Measured on the H200: fp32 tiles at head dim 128 need 353 KB of shared memory (the
        # limit is 227 KB), and fp32 is tested only in the interpreter.
        raise ValueError(
            "q: the triton backend takes bf16 or fp16 CUDA tensors (fp32 runs only in the CPU "
            "interpreter); cast q, k, v to bf16, or use backend='torch' for fp32 products"
        )
    if q.device.type == "cpu" and not _INTERPRET:
        raise ValueError(
            "q: the triton backend on CPU tensors runs in Triton's interpreter; set "
            "TRITON_INTERPRET=1 before importing triton, or use backend='torch'"
        )
    _check_interpreter_dtype(q)


def _check_interpreter_dtype(q: Tensor) -> None:
    """Triton's CPU interpreter reads bf16 wrongly (its outputs would be garbage): refused there."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise ValueError(
            "q: the triton backend's CPU interpreter reads bf16 wrongly; cast q, k, v to fp32 or fp16, "
            "or use backend='torch'"
        )


@functools.cache
def _log_chunk_size_once(chunk_size: int) -> None:
    logger.warning(
        "triton backend: chunks are always %d tokens; chunk_size=%d only changes rounding, not "
        "the function", CHUNK, chunk_size,
    )


def _run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    if q.shape[0] == 0:  # an empty batch launches nothing: the torch form's empty results and gradients
        from . import gated_delta_rule, simple_gla

        kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state, backend="torch")
        return simple_gla(q, k, v, g, **kwargs) if beta is None else gated_delta_rule(q, k, v, g, beta, **kwargs)
    if chunk_size != CHUNK:
        _log_chunk_size_once(chunk_size)
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    out = ChunkLinearAttentionFunction.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
        None if beta is None else beta.contiguous(), scale,
        None if initial_state is None else initial_state.contiguous(), output_final_state,
        cu_seqlens, torch.is_grad_enabled(),
    )
    if output_final_state:
        return out
    return out, None


def chunk_gated_delta_rule_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale=None, initial_state=None,
    output_final_state: bool = False, cu_seqlens=None, chunk_size: int = CHUNK,
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule (backend "triton"): arguments and results as ops.gated_delta_rule, with
    grouped value heads (v, g, beta, states with HV heads, a multiple of q/k's H)."""
    if beta is None:
        raise ValueError("beta: the gated delta rule needs beta [B, T, HV]; use simple GLA for no beta")
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


def chunk_simple_gla_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, scale=None, initial_state=None,
    output_final_state: bool = False, cu_seqlens=None, chunk_size: int = CHUNK,
) -> tuple[Tensor, Tensor | None]:
    """Simple GLA (backend "triton"): the gated delta rule's kernels without the WY step."""
    return _run(q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
