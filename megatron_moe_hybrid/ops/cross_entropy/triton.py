"""Linear + cross-entropy on the GPU: cuBLAS logits per token chunk, fused Triton LSE and gradient.

Per chunk of C tokens the logits [C, V] are one cuBLAS product (bf16 in, fp32
accumulation). Triton then reads each row twice: a first pass splits the row into S
column ranges, one program each, for (max, sum-exp, target logit, logit sum); a tiny
kernel merges the S partials into lse and the loss (on one rank; vocab-parallel merges
them across ranks in torch); a second pass turns the chunk in place into d loss / d logits.
Two more cuBLAS products give grad_hidden[chunk] and add into grad_weight. That is
6 N V D FLOPs, the least any exact method does; a kernel that never stores the logits
must recompute them for the gradient (8 N V D). README.md says why this design was chosen.

On CUDA the grad_weight product (its [V, D] read-modify-write makes it partly
memory-bound) goes through ops/_cublaslt.py: cuBLASLt's candidates for the shape are timed
on the first chunk (which overwrites grad_weight, so the timing runs leave nothing behind)
and the fastest is kept; at V 151936, D 4096 and 768 tokens it ran at 696 TFLOP/s against
the 553 of torch's addmm_, the same bits (loss_grad_weight.json, tests/ops/test_cublaslt.py).
The logits and grad_hidden products stay torch's (cuBLAS runs them near the ceiling; for
grad_hidden's long K cuBLASLt offers only split-K algorithms, which ops/_cublaslt.py refuses).
The grad_weight product runs on a side stream, concurrently with grad_hidden's product, which
is compute-bound; the next chunk's logits wait for it (they overwrite the buffer it reads).
The side stream adds into grad_weight in chunk order, so results are bitwise reproducible.
(Two half-size buffers, letting the next logits overlap it too, were slower in an H200
probe: halving the chunk costs more in the grad_weight product, 315 TFLOP/s at 256 tokens
against 465 at 512, than the overlap wins: loss_parts.json. Cutting each chunk's logits product in two
row halves, the first half's row passes on a second stream beside the second half's product, was
slower too on an H100: 99.7 against 95.8 ms trainable, 79.0 against 68.8 frozen at N 16384, D 4096,
V 151936: results/h100/loss_row_overlap.json.)

With reduction "mean" or "sum" and gradients wanted, the gradients are computed in the
forward (the upstream gradient is a scalar, applied in the backward in place by _scale_kernel,
which reads it on the device and leaves the gradients alone where it is 1: no pass over the
[V, D] grad_weight for loss.backward()'s 1.0, and no host sync; so a second backward through the
same loss, retain_graph=True, raises rather than scaling them twice). With "none" the
upstream gradient is one number per token; row n of grad_hidden is linear in it (only loss_n
depends on hidden_n), so with a frozen weight (LoRA: the model's per-token loss path) the
forward computes d loss_n / d hidden_n and the backward scales the rows: 4 N V D instead of
6. A trainable weight's gradient mixes the rows, so there the forward keeps lse [N] and the
backward recomputes each chunk. The [C, V] chunk is the only working buffer, so peak memory
is the gradients plus C * V elements.

Vocab-parallel as reference.py: only the per-token statistics are all-reduced.

Shape legend:
  N  tokens    D  hidden size    V  vocabulary rows held by this rank
  C  tokens in one chunk         S  column ranges (programs) per row
  BV columns one program streams at a time
"""

import contextlib
import math
import warnings

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .reference import (
    all_reduce,
    check_inputs,
    check_labels_in_vocab,
    combine_stats,
    global_vocab_size,
    grad_per_token,
    local_targets,
    reduce_loss,
    token_loss,
)
from .. import _cublaslt
from .._launch import fast_launch
from .._intmath import cdiv, next_power_of_2

__all__ = ["auto_chunk_size", "triton_linear_cross_entropy"]

BLOCK_V = 2048
# (row, column range) programs per chunk, enough to keep every SM streaming. H200, 768 x 151936 and
# 1408 x 262144 bf16 chunks (loss_row_passes.json): stats 0.103 / 0.265 ms at 2048, 0.115 / 0.241 at 8192
# (within the runs' spread); gradient 0.183 / 0.462 ms at 2048, 0.167 / 0.440 at 32768, and 9% / 2% faster
# at 32768 in each earlier run too (more, shorter ranges: a shorter tail)
PROGRAMS_PER_CHUNK = 2048  # the stats pass
GRAD_PROGRAMS_PER_CHUNK = 32768  # the gradient pass
ROW_WARPS = 4  # warps per row-pass program (8 was slower for both passes at BLOCK_V 2048)
# auto chunk: the logits buffer may take this fraction of inputs + gradients. Issue 7 bounds the peak by
# 1.1x inputs + gradients; the loss's other buffers (partials, lse, loss, a cuBLASLt workspace) add about
# 0.05% (1.5 MB at N 16384, D 4096, V 151936), so 9.9% keeps the peak under 1.1x at any shape.
CHUNK_BUDGET = 0.099
MIN_CHUNK = 512  # auto chunk: never fewer tokens while the weight trains (grad_weight's product slows below)
# A frozen weight has no grad_weight product; its floor is set by memory, not by that product's speed
# (first shape, torch's products: 256 / 384 / 512 tokens 72.7 / 70.5 / 67.8 ms, loss_grad_weight.json).
MIN_CHUNK_FROZEN = 256
# grad_weight's product (logits and grad_hidden always take torch.mm): "cublaslt" (ops/_cublaslt.py,
# the shape's algorithm chosen by timing on the first chunk), "torch" (addmm_: cuBLAS's heuristic),
# or "auto": cublaslt for bf16/fp16 CUDA tensors, torch otherwise (CPU, the interpreter, fp32), and
# torch with a warning where cuBLASLt cannot run the shape.
GEMM_BACKEND = "auto"
# grad_weight's product on a side stream, beside grad_hidden's: 0.2-1% faster than one stream on the
# H200 with the tuned product (98.2 vs 99.2 ms at N 16384, D 4096, V 151936, chunk 768:
# benchmarks/results/h200/loss_variants.json), at the same peak (the tuned product's workspace is its own, a few bytes).
SIDE_STREAM = True


@triton.jit
def _exp_minus(x, shift, FAST_EXP: tl.constexpr):
    """e^(x - shift) for a block x and a scalar shift.

    FAST_EXP (compiled for CUDA): ex2.approx.ftz of x log2(e) - shift log2(e), one FFMA and one
    MUFU per element. tl.exp adds a subtract and guards the denormal range with three more
    (a compare, two predicated multiplies); these passes are issue-bound, and a term under
    2^-126 is below any bf16 gradient or fp32 sum-exp it could change. The interpreter takes tl.exp.
    """
    if FAST_EXP:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634 - shift * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x - shift)


@triton.jit
def _online_block(b_x, row_max, row_sum, FAST_EXP: tl.constexpr):
    """Folds one block of logits into the running (max, sum-exp under it): one exp per element, one rescale per block."""
    new_max = tl.maximum(row_max, tl.max(b_x, axis=0))
    # while the max is still -inf the sum stays 0; subtracting -inf from -inf would give NaN
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    row_sum = row_sum * tl.exp(row_max - safe_max) + tl.sum(_exp_minus(b_x, safe_max, FAST_EXP), axis=0)
    return new_max, row_sum


@fast_launch
@triton.jit
def _partial_stats_kernel(logits_ptr, local_ptr, part_ptr, stride_row, num_rows, num_cols, cols_per_split,
                          BLOCK_V: tl.constexpr, HAS_SMOOTHING: tl.constexpr, FAST_EXP: tl.constexpr):
    """One column range of one row -> (max, sum-exp under it, target logit or 0, logit sum or 0) into part [4, S, C].

    Whole blocks load without a mask and the last, partial one with; the target logit is one
    load, not a compare per element; the logit sum is taken only with label smoothing.
    """
    i_row = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)  # -1: ignored, or the target is not in this shard
    col_start = i_split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, num_cols)
    full_end = col_start + (col_end - col_start) // BLOCK_V * BLOCK_V
    row_max = tl.full([], float("-inf"), tl.float32)
    row_sum = tl.zeros([], tl.float32)
    b_logit_sum = tl.zeros([BLOCK_V], tl.float32)
    for i_col in range(col_start, full_end, BLOCK_V):
        b_x = tl.load(p_row + i_col + tl.arange(0, BLOCK_V)).to(tl.float32)
        row_max, row_sum = _online_block(b_x, row_max, row_sum, FAST_EXP)
        if HAS_SMOOTHING:
            b_logit_sum += b_x
    if full_end < col_end:
        o_col = full_end + tl.arange(0, BLOCK_V)
        m_col = o_col < col_end
        b_x = tl.load(p_row + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
        row_max, row_sum = _online_block(b_x, row_max, row_sum, FAST_EXP)
        if HAS_SMOOTHING:
            b_logit_sum += tl.where(m_col, b_x, 0.0)
    has_target = (target_col >= col_start) & (target_col < col_end)
    target = tl.load(p_row + tl.where(has_target, target_col, 0), mask=has_target, other=0.0).to(tl.float32)
    p_out = part_ptr + i_split * num_rows + i_row
    tl.store(p_out, row_max)
    tl.store(p_out + num_splits * num_rows, row_sum)
    tl.store(p_out + 2 * num_splits * num_rows, target)
    tl.store(p_out + 3 * num_splits * num_rows, tl.sum(b_logit_sum, axis=0))


@fast_launch
@triton.jit
def _finish_kernel(part_ptr, local_ptr, lse_ptr, loss_ptr, num_rows, num_splits, z_loss_weight, label_smoothing,
                   inv_num_classes, BLOCK_S: tl.constexpr):
    """One rank holds the whole vocabulary: S partials of a row -> lse and loss (0 where ignored)."""
    i_row = tl.program_id(0).to(tl.int64)
    o_split = tl.arange(0, BLOCK_S)
    m_split = o_split < num_splits
    p_part = part_ptr + o_split * num_rows + i_row
    b_max = tl.load(p_part, mask=m_split, other=float("-inf"))
    row_max = tl.max(b_max, axis=0)
    b_sum = tl.load(p_part + num_splits * num_rows, mask=m_split, other=0.0)
    lse = row_max + tl.log(tl.sum(b_sum * tl.exp(b_max - row_max), axis=0))
    target = tl.sum(tl.load(p_part + 2 * num_splits * num_rows, mask=m_split, other=0.0), axis=0)
    logit_sum = tl.sum(tl.load(p_part + 3 * num_splits * num_rows, mask=m_split, other=0.0), axis=0)
    loss = lse - (1.0 - label_smoothing) * target - label_smoothing * inv_num_classes * logit_sum
    loss += z_loss_weight * lse * lse
    valid = tl.load(local_ptr + i_row) >= 0  # one rank: -1 only for ignored tokens
    tl.store(lse_ptr + i_row, lse)
    tl.store(loss_ptr + i_row, tl.where(valid, loss, 0.0))


@fast_launch
@triton.jit
def _grad_logits_kernel(logits_ptr, local_ptr, lse_ptr, grad_token_ptr, stride_row, num_cols, cols_per_split,
                        z_loss_weight, label_smoothing, inv_num_classes, BLOCK_V: tl.constexpr,
                        HAS_SMOOTHING: tl.constexpr, FAST_EXP: tl.constexpr):
    """Overwrites one column range of one row of logits with d loss / d logits (reference.py's formula).

    The target's own element is computed from its logit, read before the loop overwrites it,
    and stored after the loop (behind a barrier, so it lands after the block's store); the
    loop itself has no per-element compare.
    """
    i_row = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)
    lse = tl.load(lse_ptr + i_row)
    grad_token = tl.load(grad_token_ptr + i_row)  # 0 for ignored tokens
    scale_softmax = grad_token * (1.0 + 2.0 * z_loss_weight * lse)
    target_weight = grad_token * (1.0 - label_smoothing)
    uniform = grad_token * label_smoothing * inv_num_classes
    col_start = i_split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, num_cols)
    full_end = col_start + (col_end - col_start) // BLOCK_V * BLOCK_V
    has_target = (target_col >= col_start) & (target_col < col_end)
    p_target = p_row + tl.where(has_target, target_col, 0)
    x_target = tl.load(p_target, mask=has_target, other=0.0).to(tl.float32)
    for i_col in range(col_start, full_end, BLOCK_V):
        o_col = i_col + tl.arange(0, BLOCK_V)
        b_grad = _exp_minus(tl.load(p_row + o_col).to(tl.float32), lse, FAST_EXP) * scale_softmax
        if HAS_SMOOTHING:
            b_grad -= uniform
        tl.store(p_row + o_col, b_grad.to(logits_ptr.dtype.element_ty))
    if full_end < col_end:
        o_col = full_end + tl.arange(0, BLOCK_V)
        m_col = o_col < col_end
        b_grad = _exp_minus(tl.load(p_row + o_col, mask=m_col, other=0.0).to(tl.float32), lse, FAST_EXP) * scale_softmax
        if HAS_SMOOTHING:
            b_grad -= uniform
        tl.store(p_row + o_col, b_grad.to(logits_ptr.dtype.element_ty), mask=m_col)
    g_target = tl.exp(x_target - lse) * scale_softmax - uniform - target_weight
    tl.debug_barrier()
    tl.store(p_target, g_target.to(logits_ptr.dtype.element_ty), mask=has_target)


@fast_launch
@triton.jit
def _scale_kernel(x_ptr, s_ptr, n, BLOCK: tl.constexpr):
    """x *= s in place, s a one-element device tensor: s rounded to x's dtype, the product in fp32,
    rounded once (torch's x.mul_(s.to(x.dtype)), bitwise). Each program reads s first and does
    nothing when it is 1 (x times 1 is x), so an upstream gradient of 1.0 costs a launch, not a
    pass over x, with no host sync. A few programs per SM stride over x."""
    s = tl.load(s_ptr).to(x_ptr.dtype.element_ty).to(tl.float32)
    if s != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
            o_x = start + tl.arange(0, BLOCK)
            m_x = o_x < n
            b_x = tl.load(x_ptr + o_x, mask=m_x, other=0.0).to(tl.float32)
            tl.store(x_ptr + o_x, (b_x * s).to(x_ptr.dtype.element_ty), mask=m_x)


# The backward's scaling of the forward's gradients by the upstream gradient: _scale_kernel (True),
# which skips it on the device where that is 1, or torch's mul_ (False: a pass over grad_weight
# whatever the gradient; the A/B of benchmarks/loss.py). Bitwise the same results.
SCALE_ON_DEVICE = True
# _scale_kernel's launch: BLOCK elements per program and step, PROGRAMS_PER_SM programs per SM (16
# of 4 warps: 64 warps an SM, enough loads in flight to stream x where s is not 1; where it is, the
# 2112 programs on an H200 only read s). Untimed on the H200 so far.
SCALE_BLOCK = 4096
SCALE_PROGRAMS_PER_SM = 16


def _scale_(x: torch.Tensor, s: torch.Tensor) -> None:
    """x.mul_(s.to(x.dtype)) for a contiguous x and a one-element s, skipped on the device where s
    is 1 (_scale_kernel): the backward's scaling of the gradients formed in the forward. Liger
    skips it for 1.0 too, after reading the gradient on the host (a sync)."""
    if not x.is_contiguous() or s.numel() != 1:
        raise ValueError(f"_scale_ takes a contiguous tensor and a one-element scale, got strides {x.stride()} "
                         f"and {s.numel()} elements")
    n = x.numel()
    if n == 0:
        return
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    grid = (max(1, min(cdiv(n, SCALE_BLOCK), SCALE_PROGRAMS_PER_SM * sms)),)
    _scale_kernel[grid](x, s.reshape(1).contiguous(), n, BLOCK=SCALE_BLOCK, num_warps=4)


def _splits(num_rows: int, num_cols: int, programs: int | None = None) -> tuple[int, int]:
    """(S column ranges per row, columns per range, a multiple of BLOCK_V) for about programs (row, range) programs."""
    block = min(BLOCK_V, next_power_of_2(num_cols))
    programs = PROGRAMS_PER_CHUNK if programs is None else programs
    num_splits = max(1, min(cdiv(num_cols, block), cdiv(programs, num_rows)))
    cols_per_split = cdiv(cdiv(num_cols, num_splits), block) * block
    return cdiv(num_cols, cols_per_split), cols_per_split


def _partial_stats(logits, local, label_smoothing=0.0):
    """logits [C, V] -> per column range (max, sum-exp, target logit, logit sum) [4, S, C] fp32."""
    num_rows, num_cols = logits.shape
    num_splits, cols_per_split = _splits(num_rows, num_cols)
    part = torch.empty(4, num_splits, num_rows, dtype=torch.float32, device=logits.device)  # [4, S, C]
    _partial_stats_kernel[(num_rows, num_splits)](
        logits, local, part, logits.stride(0), num_rows, num_cols, cols_per_split,
        BLOCK_V=min(BLOCK_V, next_power_of_2(num_cols)), HAS_SMOOTHING=label_smoothing != 0.0, FAST_EXP=logits.is_cuda,
        num_warps=ROW_WARPS,
    )
    return part


def _merge_splits(part):
    """[4, S, C] partials -> this rank's (max, sum-exp, target logit, logit sum), each [C]."""
    row_max = part[0].amax(0)  # [C]
    sum_exp = (part[1] * torch.exp(part[0] - row_max)).sum(0)  # empty ranges: exp(-inf) = 0
    return row_max, sum_exp, part[2].sum(0), part[3].sum(0)


class _Chunks:
    """The shared per-chunk steps of the forward and the backward."""

    def __init__(self, hidden, weight, labels, options, num_classes=None):
        (self.ignore_index, self.z_loss_weight, self.label_smoothing, self.reduction,
         self.chunk_size, self.tp_group, vocab_start) = options
        self.hidden, self.weight = hidden, weight
        self.local = local_targets(labels, vocab_start, weight.shape[0], ignore_index=self.ignore_index).contiguous()  # [N]
        self.valid = labels != self.ignore_index  # [N]
        # only label smoothing's 1 / V needs the whole vocabulary (an all-reduce and a host read),
        # asked once per call: the backward takes the forward's (num_classes)
        if num_classes is None:
            num_classes = (global_vocab_size(weight.shape[0], hidden.device, self.tp_group) if self.label_smoothing
                           else weight.shape[0])
        self.num_classes = num_classes
        rows = max(1, min(self.chunk_size, hidden.shape[0]))  # an empty batch still gets a (tiny) buffer
        self.buffer = torch.empty(rows, weight.shape[0], dtype=hidden.dtype, device=hidden.device)  # [C, V]
        self.side = _side_stream(hidden.device) if hidden.is_cuda and SIDE_STREAM else None
        self.free = None  # the event after which the side stream no longer reads the buffer
        self.forked = False  # whether the side stream took work (and so must be joined)
        self.lt = _use_cublaslt(hidden)

    def ranges(self):
        for start in range(0, self.hidden.shape[0], self.chunk_size):
            yield slice(start, min(start + self.chunk_size, self.hidden.shape[0]))

    def logits(self, rows):
        if self.free is not None:
            torch.cuda.current_stream().wait_event(self.free)
        out = self.buffer[: rows.stop - rows.start]  # [C, V]
        return torch.mm(self.hidden[rows], self.weight.T, out=out)

    def _lt_grad_weight(self, logits, rows, grad_weight) -> bool:
        """grad_weight (+)= logits^T hidden[rows] through cuBLASLt; False where torch's product runs instead.
        The first chunk overwrites grad_weight, so it hosts the timing of the accumulating product."""
        if not self.lt:
            return False
        try:
            if rows.start == 0:
                _cublaslt.tune_with_overwrite(grad_weight, logits, self.hidden[rows], transpose_a=True)
            else:
                _cublaslt.gemm(grad_weight, logits, self.hidden[rows], transpose_a=True, accumulate=True)
            return True
        except (RuntimeError, ValueError, OSError) as error:
            if GEMM_BACKEND == "cublaslt":
                raise
            _warn_once(f"linear_cross_entropy: cuBLASLt cannot run grad_weight{tuple(grad_weight.shape)} ({error}); "
                       "this run takes torch's product there (set cross_entropy.triton.GEMM_BACKEND = 'torch' "
                       "to silence this)")
            self.lt = False
            return False

    def stats_(self, logits, rows, lse, loss):
        """Fills lse[rows] and loss[rows] from this chunk's logits."""
        local = self.local[rows]
        part = _partial_stats(logits, local, self.label_smoothing)  # [4, S, C]
        if self.tp_group is None:
            _finish_kernel[(logits.shape[0],)](
                part, local, lse[rows], loss[rows], logits.shape[0], part.shape[1], self.z_loss_weight,
                self.label_smoothing, 1.0 / self.num_classes, BLOCK_S=next_power_of_2(part.shape[1]),
            )
            return
        lse[rows], target, logit_sum = combine_stats(*_merge_splits(part), self.tp_group)
        loss[rows] = token_loss(
            lse[rows], target, logit_sum, self.valid[rows], self.z_loss_weight, self.label_smoothing, self.num_classes
        )

    def grads_(self, logits, rows, lse, grad_token, grad_hidden, grad_weight):
        """Turns logits into d loss / d logits and adds their products into the gradients."""
        num_rows, num_cols = logits.shape
        num_splits, cols_per_split = _splits(num_rows, num_cols, GRAD_PROGRAMS_PER_CHUNK)
        _grad_logits_kernel[(num_rows, num_splits)](
            logits, self.local[rows], lse[rows], grad_token[rows], logits.stride(0), num_cols, cols_per_split,
            self.z_loss_weight, self.label_smoothing, 1.0 / self.num_classes,
            BLOCK_V=min(BLOCK_V, next_power_of_2(num_cols)), HAS_SMOOTHING=self.label_smoothing != 0.0,
            FAST_EXP=logits.is_cuda, num_warps=ROW_WARPS,
        )
        if grad_weight is not None:
            if self.side is not None:
                self.side.wait_stream(torch.cuda.current_stream())
                self.forked = True
            with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
                # one rounding per chunk, fp32 inside the product; the first chunk writes grad_weight:
                # no [V, D] zero fill
                if self._lt_grad_weight(logits, rows, grad_weight):
                    pass
                elif rows.start == 0:
                    torch.mm(logits.T, self.hidden[rows], out=grad_weight)
                else:
                    grad_weight.addmm_(logits.T, self.hidden[rows])
            if self.side is not None:
                self.free = self.side.record_event()
        if grad_hidden is not None:  # long K (V): cuBLAS's split-K choice runs near the ceiling
            torch.mm(logits, self.weight, out=grad_hidden[rows])

    def join(self):
        """The caller's stream waits for the side stream: after this every gradient is complete.
        Only where the side stream took work: a stream capturing a CUDA graph cannot wait on one
        that never joined the capture (a frozen weight's loss uses none)."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.side)


def _grad_weight_buffer(weight, num_tokens):
    """[V, D] for grad_weight: the first chunk's product overwrites it, so only an empty batch needs zeros."""
    return torch.empty_like(weight) if num_tokens else torch.zeros_like(weight)


def _use_cublaslt(hidden) -> bool:
    if GEMM_BACKEND not in ("auto", "torch", "cublaslt"):
        raise ValueError(f"cross_entropy.triton.GEMM_BACKEND must be 'auto', 'torch' or 'cublaslt', got {GEMM_BACKEND!r}")
    if GEMM_BACKEND == "torch":
        return False
    usable = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
    if GEMM_BACKEND == "cublaslt" and not usable:
        raise ValueError(f"GEMM_BACKEND 'cublaslt' needs bf16/fp16 CUDA tensors, got {hidden.dtype} on {hidden.device}")
    return usable


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device) -> torch.cuda.Stream:
    """One side stream per device, reused: each new stream would get its own cuBLAS workspace."""
    device = torch.device(device)
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


class TritonLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, options):
        hidden, weight = hidden.contiguous(), weight.contiguous()
        chunks = _Chunks(hidden, weight, labels, options)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        per_token = chunks.reduction == "none"  # then only grad_hidden can be formed ahead (module docstring)
        grads_now = (need_hidden or need_weight) and not (per_token and need_weight)
        grad_hidden = torch.empty_like(hidden) if grads_now and need_hidden else None  # [N, D]
        grad_weight = _grad_weight_buffer(weight, hidden.shape[0]) if grads_now and need_weight else None  # [V, D]
        if grads_now:  # d loss / d loss_n for an upstream gradient of 1 (applied in the backward)
            grad_token = grad_per_token(torch.ones((), device=hidden.device), chunks.valid, chunks.reduction, torch.float32)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
        loss = torch.empty_like(lse)  # [N]
        for rows in chunks.ranges():
            logits = chunks.logits(rows)  # [C, V]
            chunks.stats_(logits, rows, lse, loss)
            if grads_now:
                chunks.grads_(logits, rows, lse, grad_token, grad_hidden, grad_weight)
        chunks.join()
        if grad_hidden is not None:
            grad_hidden = all_reduce(grad_hidden, dist.ReduceOp.SUM, chunks.tp_group)
        ctx.grads_now, ctx.per_token, ctx.scaled = grads_now, per_token, False
        if grads_now:
            ctx.save_for_backward(grad_hidden, grad_weight)
        else:
            ctx.save_for_backward(hidden, weight, labels, lse)
            ctx.options, ctx.num_classes = options, chunks.num_classes
        return reduce_loss(loss, chunks.valid.sum(), chunks.reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if ctx.grads_now:
            grad_hidden, grad_weight = ctx.saved_tensors
            if ctx.scaled:
                raise RuntimeError(
                    "linear_cross_entropy: a second backward through the same loss (retain_graph=True) is not "
                    "supported with reduction 'mean' or 'sum': the gradients were formed in the forward and the "
                    "first backward scaled them in place (and returned them); run the loss's forward again for "
                    "another backward"
                )
            if ctx.per_token:  # d loss_n / d hidden_n times the upstream gradient of token n, in fp32
                return (grad_hidden.float() * grad_loss.float()[:, None]).to(grad_hidden.dtype), None, None, None
            # in place: these buffers are ours, and a copy of grad_weight would add [V, D] to the peak;
            # no pass at all for the usual upstream gradient of 1.0 (2.5 GB of grad_weight traffic at
            # V 151936, D 4096 in bf16), decided on the device
            ctx.scaled = True
            for grad in (grad_hidden, grad_weight):
                if grad is not None and SCALE_ON_DEVICE:
                    _scale_(grad, grad_loss)
                elif grad is not None:
                    grad.mul_(grad_loss.to(grad.dtype))
            return grad_hidden, grad_weight, None, None
        hidden, weight, labels, lse = ctx.saved_tensors
        chunks = _Chunks(hidden, weight, labels, ctx.options, ctx.num_classes)
        grad_token = grad_per_token(grad_loss, chunks.valid, chunks.reduction, torch.float32)  # [N]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [N, D]
        grad_weight = _grad_weight_buffer(weight, hidden.shape[0]) if need_weight else None  # [V, D]
        for rows in chunks.ranges():
            chunks.grads_(chunks.logits(rows), rows, lse, grad_token, grad_hidden, grad_weight)
        chunks.join()
        if grad_hidden is not None:
            grad_hidden = all_reduce(grad_hidden, dist.ReduceOp.SUM, chunks.tp_group)
        return grad_hidden, grad_weight, None, None


def auto_chunk_size(num_tokens: int, hidden_size: int, vocab_size: int, weight_trainable: bool) -> int:
    """Tokens per chunk so the logits buffer takes about CHUNK_BUDGET of inputs + gradients.

    A multiple of 256 tokens with a trainable weight, 128 with a frozen one, at least MIN_CHUNK
    (MIN_CHUNK_FROZEN for a frozen weight) and at most num_tokens. Larger chunks make the
    grad_weight product less memory-bound (it reads and writes [V, D] once per chunk); smaller
    ones bound the peak. Below MIN_CHUNK tokens that product loses more time than the memory
    saved is worth (H200, cuBLAS's heuristic: 315 TFLOP/s with 256 tokens, 465 with 512, 596
    with 1024: loss_parts.json). Odd multiples of 128 ran slower than the even ones below them
    (whole loss, H200, loss_chunks.json): at N 16384, D 4096, V 151936 768 / 896 / 1024 tokens
    took 97.1 / 99.3 / 94.2 ms, at N 32768, D 7168, V 262144 1408 / 1536 / 2048 took 579.0 / 543.9
    / 571.5 ms; the budget then gives 768 and 1536 (1024 would take the first to 1.11x inputs +
    gradients). A frozen weight has no grad_weight product: at the first shape the budget's 384
    tokens ran in 68.1 ms against 66.9 with 512, and keep the peak at 1.08x inputs + gradients
    instead of 1.10x (loss_variants.json).
    """
    inputs_and_grads = (2 * num_tokens * hidden_size + (2 if weight_trainable else 1) * vocab_size * hidden_size)
    rows = CHUNK_BUDGET * inputs_and_grads / vocab_size
    least = MIN_CHUNK if weight_trainable else MIN_CHUNK_FROZEN
    tile = 256 if weight_trainable else 128
    return max(1, min(num_tokens, max(least, math.floor(rows / tile) * tile)))


def triton_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    z_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The function of reference.chunked_linear_cross_entropy with fused Triton kernels.

    hidden [N, D] and weight [V, D] of one float dtype (bf16 on the GPU; fp32/fp16 in the
    interpreter), labels [N] int64. Statistics and the loss are fp32; gradients come back
    in the input dtype. Holds one [chunk_size, V] logits buffer; chunk_size None picks
    auto_chunk_size.
    """
    check_inputs(hidden, weight, labels, reduction, 1 if chunk_size is None else chunk_size, vocab_start,
                 z_loss_weight, label_smoothing)
    if chunk_size is None:
        chunk_size = auto_chunk_size(hidden.shape[0], hidden.shape[1], weight.shape[0], weight.requires_grad)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}; cast one of them")
    if tp_group is None:
        if vocab_start != 0:
            raise ValueError(f"vocab_start={vocab_start} needs tp_group (a vocab shard); pass tp_group or vocab_start=0")
        check_labels_in_vocab(labels, weight.shape[0], ignore_index)
    options = (ignore_index, z_loss_weight, label_smoothing, reduction, chunk_size, tp_group, vocab_start)
    return TritonLinearCrossEntropy.apply(hidden, weight, labels, options)
