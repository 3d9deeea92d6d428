"""Linear + cross-entropy on the GPU: cuBLAS logits per token chunk, fused Triton LSE and gradient.

Per chunk of C tokens the logits [C, V] are one cuBLAS product (bf16 in, fp32
accumulation); one Triton pass streams each row once for max, sum-exp, target logit and
logit sum (the online LSE), and a second turns the chunk in place into d loss / d logits.
Two more cuBLAS products give grad_hidden[chunk] and add into grad_weight. That is
6 N V D FLOPs, the least any exact method does; a kernel that never stores the logits
must recompute them for the gradient (8 N V D). README.md says why this design was chosen.

With reduction "mean" or "sum" and gradients wanted, the gradients are computed in the
forward (the upstream gradient is a scalar, applied in the backward); with "none" the
forward keeps lse [N] and the backward recomputes each chunk. The [C, V] chunk is the
only working buffer, so peak memory is the gradients plus C * V elements.

Vocab-parallel as reference.py: only the per-token statistics are all-reduced.

Shape legend:
  N  tokens    D  hidden size    V  vocabulary rows held by this rank
  C  tokens in one chunk         BV columns one program streams at a time
"""

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

__all__ = ["triton_linear_cross_entropy"]

BLOCK_V = 4096


@triton.jit
def _row_stats_kernel(
    logits_ptr, local_ptr, max_ptr, sum_exp_ptr, target_ptr, logit_sum_ptr, stride_row, num_cols, BLOCK_V: tl.constexpr
):
    """One row of logits -> (max, sum-exp under it, target logit or 0, sum of logits), all fp32."""
    i_row = tl.program_id(0).to(tl.int64)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)  # -1: the target is not in this shard
    b_max = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per-lane running max, merged at the end
    b_sum = tl.zeros([BLOCK_V], tl.float32)
    b_target = tl.zeros([BLOCK_V], tl.float32)
    b_logit_sum = tl.zeros([BLOCK_V], tl.float32)
    for i_col in range(0, num_cols, BLOCK_V):
        o_col = i_col + tl.arange(0, BLOCK_V)
        m_col = o_col < num_cols
        b_x = tl.load(p_row + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
        b_new_max = tl.maximum(b_max, b_x)
        # lanes still at -inf keep sum 0; subtracting -inf from -inf would give NaN
        b_safe_max = tl.where(b_new_max == float("-inf"), 0.0, b_new_max)
        b_sum = b_sum * tl.exp(b_max - b_safe_max) + tl.exp(b_x - b_safe_max)
        b_max = b_new_max
        b_target += tl.where(o_col == target_col, b_x, 0.0)
        b_logit_sum += tl.where(m_col, b_x, 0.0)
    row_max = tl.max(b_max, axis=0)
    row_sum = tl.sum(b_sum * tl.exp(b_max - row_max), axis=0)
    tl.store(max_ptr + i_row, row_max)
    tl.store(sum_exp_ptr + i_row, row_sum)
    tl.store(target_ptr + i_row, tl.sum(b_target, axis=0))
    tl.store(logit_sum_ptr + i_row, tl.sum(b_logit_sum, axis=0))


@triton.jit
def _grad_logits_kernel(
    logits_ptr, local_ptr, lse_ptr, scale_softmax_ptr, target_weight_ptr, uniform_ptr, stride_row, num_cols,
    BLOCK_V: tl.constexpr,
):
    """Overwrites one row of logits with softmax * scale_softmax - target_weight [v = y] - uniform."""
    i_row = tl.program_id(0).to(tl.int64)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)
    lse = tl.load(lse_ptr + i_row)
    scale_softmax = tl.load(scale_softmax_ptr + i_row)
    target_weight = tl.load(target_weight_ptr + i_row)
    uniform = tl.load(uniform_ptr + i_row)
    for i_col in range(0, num_cols, BLOCK_V):
        o_col = i_col + tl.arange(0, BLOCK_V)
        m_col = o_col < num_cols
        b_x = tl.load(p_row + o_col, mask=m_col, other=0.0).to(tl.float32)
        b_grad = tl.exp(b_x - lse) * scale_softmax - uniform - tl.where(o_col == target_col, target_weight, 0.0)
        tl.store(p_row + o_col, b_grad.to(logits_ptr.dtype.element_ty), mask=m_col)


def _row_stats(logits, local):
    """logits [C, V] -> (max, sum-exp, target logit, logit sum), each [C] fp32."""
    num_rows, num_cols = logits.shape
    stats = torch.empty(4, num_rows, dtype=torch.float32, device=logits.device)  # [4, C]
    _row_stats_kernel[(num_rows,)](
        logits, local, stats[0], stats[1], stats[2], stats[3], logits.stride(0), num_cols,
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(num_cols)), num_warps=8,
    )
    return stats.unbind(0)


def _grad_logits_(logits, local, lse, scale_softmax, target_weight, uniform) -> None:
    num_rows, num_cols = logits.shape
    _grad_logits_kernel[(num_rows,)](
        logits, local, lse, scale_softmax, target_weight, uniform, logits.stride(0), num_cols,
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(num_cols)), num_warps=8,
    )


class _Chunks:
    """The shared per-chunk steps of the forward and the backward."""

    def __init__(self, hidden, weight, labels, options):
        (self.ignore_index, self.z_loss_weight, self.label_smoothing, self.reduction,
         self.chunk_size, self.tp_group, vocab_start) = options
        self.hidden, self.weight = hidden, weight
        self.local = local_targets(labels, vocab_start, weight.shape[0], ignore_index=self.ignore_index).contiguous()  # [N]
        self.valid = labels != self.ignore_index  # [N]
        self.num_classes = global_vocab_size(weight.shape[0], hidden.device, self.tp_group)
        rows = min(self.chunk_size, hidden.shape[0])
        self.buffer = torch.empty(rows, weight.shape[0], dtype=hidden.dtype, device=hidden.device)  # [C, V]

    def ranges(self):
        for start in range(0, self.hidden.shape[0], self.chunk_size):
            yield slice(start, min(start + self.chunk_size, self.hidden.shape[0]))

    def logits(self, rows):
        out = self.buffer[: rows.stop - rows.start]  # [C, V]
        return torch.mm(self.hidden[rows], self.weight.T, out=out)

    def grads_(self, logits, rows, lse, grad_token, grad_hidden, grad_weight):
        """Turns logits into d loss / d logits and adds their products into the gradients."""
        lse_c, grad_c = lse[rows], grad_token[rows]  # [C] fp32
        scale_softmax = grad_c * (1.0 + 2.0 * self.z_loss_weight * lse_c)
        target_weight = grad_c * (1.0 - self.label_smoothing)
        uniform = grad_c * (self.label_smoothing / self.num_classes)
        _grad_logits_(logits, self.local[rows], lse_c, scale_softmax, target_weight, uniform)
        if grad_hidden is not None:
            torch.mm(logits, self.weight, out=grad_hidden[rows])
        if grad_weight is not None:
            grad_weight.addmm_(logits.T, self.hidden[rows])  # one rounding per chunk, fp32 inside the product


class TritonLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, options):
        hidden, weight = hidden.contiguous(), weight.contiguous()
        chunks = _Chunks(hidden, weight, labels, options)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grads_now = chunks.reduction != "none" and (need_hidden or need_weight)
        grad_hidden = torch.empty_like(hidden) if grads_now and need_hidden else None  # [N, D]
        grad_weight = torch.zeros_like(weight) if grads_now and need_weight else None  # [V, D]
        grad_token = grad_per_token(torch.ones((), device=hidden.device), chunks.valid, chunks.reduction, torch.float32)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
        loss = torch.empty_like(lse)  # [N]
        for rows in chunks.ranges():
            logits = chunks.logits(rows)  # [C, V]
            lse[rows], target, logit_sum = combine_stats(*_row_stats(logits, chunks.local[rows]), chunks.tp_group)
            loss[rows] = token_loss(
                lse[rows], target, logit_sum, chunks.valid[rows], chunks.z_loss_weight, chunks.label_smoothing, chunks.num_classes
            )
            if grads_now:
                chunks.grads_(logits, rows, lse, grad_token, grad_hidden, grad_weight)
        if grad_hidden is not None:
            grad_hidden = all_reduce(grad_hidden, dist.ReduceOp.SUM, chunks.tp_group)
        ctx.grads_now = grads_now
        if grads_now:
            ctx.save_for_backward(grad_hidden, grad_weight)
        else:
            ctx.save_for_backward(hidden, weight, labels, lse)
            ctx.options = options
        return reduce_loss(loss, chunks.valid.sum(), chunks.reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if ctx.grads_now:
            grad_hidden, grad_weight = ctx.saved_tensors
            # in place: these buffers are ours, and a copy of grad_weight would add [V, D] to the peak
            if grad_hidden is not None:
                grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
            if grad_weight is not None:
                grad_weight.mul_(grad_loss.to(grad_weight.dtype))
            return grad_hidden, grad_weight, None, None
        hidden, weight, labels, lse = ctx.saved_tensors
        chunks = _Chunks(hidden, weight, labels, ctx.options)
        grad_token = grad_per_token(grad_loss, chunks.valid, chunks.reduction, torch.float32)  # [N]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [N, D]
        grad_weight = torch.zeros_like(weight) if need_weight else None  # [V, D]
        for rows in chunks.ranges():
            chunks.grads_(chunks.logits(rows), rows, lse, grad_token, grad_hidden, grad_weight)
        if grad_hidden is not None:
            grad_hidden = all_reduce(grad_hidden, dist.ReduceOp.SUM, chunks.tp_group)
        return grad_hidden, grad_weight, None, None


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
    chunk_size: int = 1024,
) -> torch.Tensor:
    """The function of reference.chunked_linear_cross_entropy with fused Triton kernels.

    hidden [N, D] and weight [V, D] of one float dtype (bf16 on the GPU; fp32/fp16 in the
    interpreter), labels [N] int64. Statistics and the loss are fp32; gradients come back
    in the input dtype. Holds one [chunk_size, V] logits buffer.
    """
    check_inputs(hidden, weight, labels, reduction, chunk_size, vocab_start, z_loss_weight, label_smoothing)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}; cast one of them")
    if tp_group is None:
        if vocab_start != 0:
            raise ValueError(f"vocab_start={vocab_start} needs tp_group (a vocab shard); pass tp_group or vocab_start=0")
        check_labels_in_vocab(labels, weight.shape[0], ignore_index)
    options = (ignore_index, z_loss_weight, label_smoothing, reduction, chunk_size, tp_group, vocab_start)
    return TritonLinearCrossEntropy.apply(hidden, weight, labels, options)
