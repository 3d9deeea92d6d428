"""Linear + cross-entropy over a large vocabulary, in plain PyTorch.

loss_n = logsumexp_v(h_n . w_v) - h_n . w_{y_n}, for tokens whose label is not ignore_index.

naive_linear_cross_entropy is the oracle: it materialises the logits. The chunked
version never holds more than [chunk_size, V] logits: the forward keeps only the
per-token logsumexp, and the backward recomputes each chunk's logits, turns them
into softmax - onehot and accumulates the input and weight gradients in fp32.

Vocab-parallel (tp_group given): weight is this rank's shard of rows
[vocab_start, vocab_start + V); max, sum-exp and target logit are all-reduced as in
Megatron's vocab_parallel_cross_entropy, so the loss is the full-vocab loss on every
rank. grad_weight is this rank's shard; grad_hidden is all-reduced, i.e. complete, so
hidden must not also pass through copy_to_tensor_model_parallel_region.

Logits are computed in fp32 (fp64 inputs stay fp64); the loss is returned in that dtype.

Shape legend:
  N  tokens            D  hidden size
  V  vocabulary rows held by this rank (all of them without tp_group)
  C  tokens in one chunk (chunk_size, the last one shorter)
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum", "none")


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.promote_types(hidden.dtype, torch.float32)


def _check_inputs(hidden, weight, labels, reduction, chunk_size=1, vocab_start=0) -> None:
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float tensor [N, D], got {tuple(hidden.shape)} {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[1] or not weight.is_floating_point():
        raise ValueError(
            f"weight must be a float tensor [V, D] with V >= 1 and D = hidden.shape[1] = {hidden.shape[1]}, "
            f"got {tuple(weight.shape)} {weight.dtype}"
        )
    if labels.shape != hidden.shape[:1] or labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64 [N] with N = {hidden.shape[0]}, got {tuple(labels.shape)} {labels.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")


def _check_labels_in_vocab(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    valid = labels[labels != ignore_index]
    if valid.numel() and (valid.min() < 0 or valid.max() >= vocab_size):
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}, "
            f"got values in [{int(valid.min())}, {int(valid.max())}]"
        )


def _reduce(loss: torch.Tensor, num_valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / num_valid.clamp(min=1)  # no valid tokens -> 0, not NaN


def naive_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, labels); "mean" over 0 valid tokens gives 0."""
    _check_inputs(hidden, weight, labels, reduction)
    _check_labels_in_vocab(labels, weight.shape[0], ignore_index)
    dtype = _compute_dtype(hidden)
    logits = hidden.to(dtype) @ weight.to(dtype).T  # [N, V]
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")  # [N], 0 where ignored
    return _reduce(loss, (labels != ignore_index).sum(), reduction)


def _all_reduce(tensor: torch.Tensor, op, tp_group) -> torch.Tensor:
    if tp_group is not None:
        dist.all_reduce(tensor, op=op, group=tp_group)
    return tensor


def _local_targets(labels, vocab_start, vocab_size, ignore_index):
    """(target row in this shard [N] clamped to be a valid index, whether it is in this shard [N])."""
    local = labels - vocab_start
    in_shard = (labels != ignore_index) & (local >= 0) & (local < vocab_size)
    return torch.where(in_shard, local, 0), in_shard


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, chunk_size, tp_group, vocab_start):
        dtype = _compute_dtype(hidden)
        num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
        weight_c = weight.to(dtype)  # [V, D]
        local, in_shard = _local_targets(labels, vocab_start, vocab_size, ignore_index)  # [N], [N]
        lse = torch.empty(num_tokens, dtype=dtype, device=hidden.device)  # [N]
        target = torch.empty(num_tokens, dtype=dtype, device=hidden.device)  # [N]
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = hidden[rows].to(dtype) @ weight_c.T  # [C, V]
            row_max = _all_reduce(logits.amax(dim=-1), dist.ReduceOp.MAX, tp_group)  # [C]
            sum_exp = torch.exp(logits - row_max[:, None]).sum(dim=-1)  # [C]
            picked = logits.gather(1, local[rows, None]).squeeze(1)  # [C]
            target_logit = torch.where(in_shard[rows], picked, 0.0)  # [C]: only the owning rank adds it
            sums = _all_reduce(torch.stack([sum_exp, target_logit]), dist.ReduceOp.SUM, tp_group)  # [2, C]
            lse[rows] = row_max + torch.log(sums[0])
            target[rows] = sums[1]
        valid = labels != ignore_index  # [N]
        loss = torch.where(valid, lse - target, 0.0)  # [N]
        num_valid = valid.sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.options = (ignore_index, reduction, chunk_size, tp_group, vocab_start)
        ctx.mark_non_differentiable(labels)
        return _reduce(loss, num_valid, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        ignore_index, reduction, chunk_size, tp_group, vocab_start = ctx.options
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        dtype = lse.dtype
        num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
        valid = labels != ignore_index  # [N]
        # d loss / d loss_n per token [N]: zero for ignored tokens
        if reduction == "mean":
            grad_token = valid * (grad_loss.to(dtype) / valid.sum().clamp(min=1))
        else:
            grad_token = valid * grad_loss.to(dtype).expand(num_tokens)
        weight_c = weight.to(dtype)  # [V, D]
        local, in_shard = _local_targets(labels, vocab_start, vocab_size, ignore_index)  # [N], [N]
        grad_hidden = torch.zeros_like(hidden, dtype=dtype) if need_hidden else None  # [N, D]
        grad_weight = torch.zeros_like(weight, dtype=dtype) if need_weight else None  # [V, D]
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, start + chunk_size)
            hidden_c = hidden[rows].to(dtype)  # [C, D]
            # lse is the full-vocab logsumexp, so this is already this shard's part of the softmax
            grad_logits = torch.exp(hidden_c @ weight_c.T - lse[rows, None])  # [C, V]
            num_rows = grad_logits.shape[0]
            grad_logits[torch.arange(num_rows), local[rows]] -= in_shard[rows].to(dtype)
            grad_logits *= grad_token[rows, None]
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight_c
            if need_weight:
                grad_weight += grad_logits.T @ hidden_c
        if need_hidden:
            grad_hidden = _all_reduce(grad_hidden, dist.ReduceOp.SUM, tp_group).to(hidden.dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int = 1024,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> torch.Tensor:
    """Same loss as naive_linear_cross_entropy, holding at most [chunk_size, V] logits.

    hidden [N, D], weight [V, D] (this rank's vocab rows from vocab_start when tp_group
    is given), labels [N] int64 (global vocab ids or ignore_index). Returns a scalar, or
    [N] for reduction="none", in fp32 (fp64 for fp64 inputs).
    """
    _check_inputs(hidden, weight, labels, reduction, chunk_size, vocab_start)
    if tp_group is None:
        if vocab_start != 0:
            raise ValueError(f"vocab_start={vocab_start} needs tp_group (a vocab shard); pass tp_group or vocab_start=0")
        _check_labels_in_vocab(labels, weight.shape[0], ignore_index)
    return ChunkedLinearCrossEntropy.apply(
        hidden, weight, labels, ignore_index, reduction, chunk_size, tp_group, vocab_start
    )
