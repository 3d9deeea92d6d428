"""Linear + cross-entropy over a large vocabulary, in plain PyTorch.

Per non-ignored token n with logits z = W h_n, lse_n = logsumexp_v z_v, target y_n,
smoothing eps over the full vocabulary of size V_total and z-loss weight zw:

    loss_n = lse_n - (1 - eps) z_y - eps / V_total * sum_v z_v + zw * lse_n^2

which is F.cross_entropy(z, y, label_smoothing=eps) plus zw * lse^2; ignored tokens give 0.
d loss_n / d z_v = softmax_v * (1 + 2 zw lse_n) - (1 - eps) [v = y] - eps / V_total.
README.md has the derivation and the vocab-parallel combine.

naive_linear_cross_entropy is the oracle: it materialises the logits.
chunked_linear_cross_entropy never holds more than [chunk_size, vocab_chunk_size] logits:
its forward runs an online logsumexp over vocabulary chunks and keeps only lse [N]; its
backward recomputes each tile, turns it into d loss / d logits and accumulates both
gradients in the compute dtype. No gradient entry is skipped.

Vocab-parallel (tp_group given): weight is this rank's shard of rows
[vocab_start, vocab_start + V). Only per-token max, sum-exp, target logit and logit sum
(for smoothing) are all-reduced, as in Megatron's vocab_parallel_cross_entropy, so the
loss is the full-vocab loss on every rank. grad_weight is this rank's shard; grad_hidden
is all-reduced, i.e. complete, so hidden must not also pass through
copy_to_tensor_model_parallel_region.

Logits are computed in fp32 (fp64 inputs stay fp64); the loss is returned in that dtype.

Shape legend:
  N  tokens            D  hidden size
  V  vocabulary rows held by this rank (all of them without tp_group)
  C  tokens in one chunk (chunk_size, the last one shorter)
  U  vocabulary rows in one chunk (vocab_chunk_size, the last one shorter)
"""

import math
import numbers

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._checks import capturing

REDUCTIONS = ("mean", "sum", "none")


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.promote_types(hidden.dtype, torch.float32)


def check_inputs(
    hidden, weight, labels, reduction, chunk_size=1, vocab_start=0, z_loss_weight=0.0, label_smoothing=0.0, vocab_chunk_size=1
) -> None:
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
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size), ("vocab_start", vocab_start)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an int, got {value!r}")
    for name, value in (("z_loss_weight", z_loss_weight), ("label_smoothing", label_smoothing)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if vocab_chunk_size < 1:
        raise ValueError(f"vocab_chunk_size must be >= 1, got {vocab_chunk_size}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    if not (0.0 <= z_loss_weight < math.inf):  # NaN fails too
        raise ValueError(f"z_loss_weight must be a finite number >= 0, got {z_loss_weight}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")


def check_labels_in_vocab(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """ValueError unless every label is in [0, vocab_size) or ignore_index. It reads the labels'
    range on the host (a device sync), which a stream capturing a CUDA graph does not allow: there
    it is skipped, the eager calls that warm a graph up before its capture having checked them."""
    if capturing(labels):
        return
    valid = labels[labels != ignore_index]
    if valid.numel() and (valid.min() < 0 or valid.max() >= vocab_size):
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}, "
            f"got values in [{int(valid.min())}, {int(valid.max())}]"
        )


def reduce_loss(loss: torch.Tensor, num_valid: torch.Tensor, reduction: str) -> torch.Tensor:
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
    z_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, labels, label_smoothing) + z_loss_weight * lse^2.

    "mean" is over non-ignored tokens (as F.cross_entropy) and gives 0 when there are none.
    """
    check_inputs(hidden, weight, labels, reduction, z_loss_weight=z_loss_weight, label_smoothing=label_smoothing)
    check_labels_in_vocab(labels, weight.shape[0], ignore_index)
    dtype = _compute_dtype(hidden)
    logits = hidden.to(dtype) @ weight.to(dtype).T  # [N, V]
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)  # [N]
    valid = labels != ignore_index  # [N]
    loss = loss + torch.where(valid, z_loss_weight * torch.logsumexp(logits, dim=-1) ** 2, 0.0)
    return reduce_loss(loss, valid.sum(), reduction)


def all_reduce(tensor: torch.Tensor, op, tp_group) -> torch.Tensor:
    if tp_group is not None:
        dist.all_reduce(tensor, op=op, group=tp_group)
    return tensor


def global_vocab_size(vocab_size: int, device, tp_group) -> int:
    """The vocabulary over the TP group's shards: an all-reduce and a host read, so callers ask
    only where label smoothing needs it (its 1 / V)."""
    if tp_group is None:
        return vocab_size  # no device round trip on the single-rank path
    size = torch.tensor([vocab_size], dtype=torch.int64, device=device)
    return int(all_reduce(size, dist.ReduceOp.SUM, tp_group).item())


def local_targets(labels, vocab_start, vocab_size, ignore_index):
    """(target row in this shard [N], or -1 where the target lives elsewhere or is ignored)."""
    local = labels - vocab_start
    in_shard = (labels != ignore_index) & (local >= 0) & (local < vocab_size)
    return torch.where(in_shard, local, -1)


def combine_stats(row_max, sum_exp, target, logit_sum, tp_group):
    """This rank's per-token (max, sum-exp under that max, target logit, logit sum) [C] -> full-vocab lse, target, logit sum."""
    global_max = all_reduce(row_max.clone(), dist.ReduceOp.MAX, tp_group)  # [C]
    sums = torch.stack([sum_exp * torch.exp(row_max - global_max), target, logit_sum])  # [3, C]
    sums = all_reduce(sums, dist.ReduceOp.SUM, tp_group)
    return global_max + torch.log(sums[0]), sums[1], sums[2]


def token_loss(lse, target, logit_sum, valid, z_loss_weight, label_smoothing, num_classes):
    """loss_n from the full-vocab per-token statistics [N]; 0 where ignored."""
    loss = lse - (1.0 - label_smoothing) * target - (label_smoothing / num_classes) * logit_sum + z_loss_weight * lse**2
    return torch.where(valid, loss, 0.0)


def grad_per_token(grad_loss, valid, reduction, dtype):
    """d (reduced loss) / d loss_n [N]: zero for ignored tokens."""
    if reduction == "mean":
        return valid * (grad_loss.to(dtype) / valid.sum().clamp(min=1))
    return valid * grad_loss.to(dtype).expand(valid.shape[0])


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, options):
        ignore_index, z_loss_weight, label_smoothing, reduction, chunk_size, vocab_chunk_size, tp_group, vocab_start = options
        dtype = _compute_dtype(hidden)
        num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
        # only label smoothing's 1 / V needs the whole vocabulary
        num_classes = global_vocab_size(vocab_size, hidden.device, tp_group) if label_smoothing else vocab_size
        local = local_targets(labels, vocab_start, vocab_size, ignore_index)  # [N]
        lse = torch.empty(num_tokens, dtype=dtype, device=hidden.device)  # [N]
        target = torch.empty_like(lse)  # [N]
        logit_sum = torch.empty_like(lse)  # [N]
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, start + chunk_size)
            hidden_c = hidden[rows].to(dtype)  # [C, D]
            local_c = local[rows]  # [C]
            row_max = torch.full_like(local_c, float("-inf"), dtype=dtype)  # [C]
            sum_exp, target_c, logit_sum_c = (torch.zeros_like(row_max) for _ in range(3))  # [C] each
            for col in range(0, vocab_size, vocab_chunk_size):
                weight_u = weight[col : col + vocab_chunk_size].to(dtype)  # [U, D]
                logits = hidden_c @ weight_u.T  # [C, U]
                new_max = torch.maximum(row_max, logits.amax(dim=-1))
                sum_exp = sum_exp * torch.exp(row_max - new_max) + torch.exp(logits - new_max[:, None]).sum(dim=-1)
                row_max = new_max
                hit = (local_c >= col) & (local_c < col + weight_u.shape[0])  # [C]: target in this tile
                picked = logits.gather(1, torch.where(hit, local_c - col, 0)[:, None]).squeeze(1)
                target_c = target_c + torch.where(hit, picked, 0.0)
                logit_sum_c = logit_sum_c + logits.sum(dim=-1)
            lse[rows], target[rows], logit_sum[rows] = combine_stats(row_max, sum_exp, target_c, logit_sum_c, tp_group)
        valid = labels != ignore_index  # [N]
        loss = token_loss(lse, target, logit_sum, valid, z_loss_weight, label_smoothing, num_classes)  # [N]
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.options = options
        ctx.num_classes = num_classes
        return reduce_loss(loss, valid.sum(), reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        ignore_index, z_loss_weight, label_smoothing, reduction, chunk_size, vocab_chunk_size, tp_group, vocab_start = ctx.options
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        dtype = lse.dtype
        num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
        grad_token = grad_per_token(grad_loss, labels != ignore_index, reduction, dtype)  # [N]
        # d loss / d z_v = softmax_v * scale_softmax - target_weight [v = y] - uniform, per token [N]
        scale_softmax = grad_token * (1.0 + 2.0 * z_loss_weight * lse)
        target_weight = grad_token * (1.0 - label_smoothing)
        uniform = grad_token * (label_smoothing / ctx.num_classes)
        local = local_targets(labels, vocab_start, vocab_size, ignore_index)  # [N]
        grad_hidden = torch.zeros_like(hidden, dtype=dtype) if need_hidden else None  # [N, D]
        grad_weight = torch.zeros_like(weight, dtype=dtype) if need_weight else None  # [V, D]
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, start + chunk_size)
            hidden_c = hidden[rows].to(dtype)  # [C, D]
            local_c = local[rows]  # [C]
            for col in range(0, vocab_size, vocab_chunk_size):
                cols = slice(col, col + vocab_chunk_size)
                weight_u = weight[cols].to(dtype)  # [U, D]
                # lse is the full-vocab logsumexp, so this is already this shard's part of the softmax
                grad_logits = torch.exp(hidden_c @ weight_u.T - lse[rows, None]) * scale_softmax[rows, None]  # [C, U]
                grad_logits -= uniform[rows, None]
                hit = (local_c >= col) & (local_c < col + weight_u.shape[0])  # [C]
                grad_logits[hit, (local_c - col)[hit]] -= target_weight[rows][hit]
                if need_hidden:
                    grad_hidden[rows] += grad_logits @ weight_u
                if need_weight:
                    grad_weight[cols] += grad_logits.T @ hidden_c
        if need_hidden:
            grad_hidden = all_reduce(grad_hidden, dist.ReduceOp.SUM, tp_group).to(hidden.dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def chunked_linear_cross_entropy(
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
    vocab_chunk_size: int = 8192,
) -> torch.Tensor:
    """Same loss as naive_linear_cross_entropy, holding at most [chunk_size, vocab_chunk_size] logits
    (chunk_size None: 1024 tokens).

    hidden [N, D], weight [V, D] (this rank's vocab rows from vocab_start when tp_group
    is given), labels [N] int64 (global vocab ids or ignore_index). Returns a scalar, or
    [N] for reduction="none", in fp32 (fp64 for fp64 inputs). A weight with
    requires_grad=False (frozen, e.g. under LoRA) costs no weight-gradient work.
    """
    chunk_size = 1024 if chunk_size is None else chunk_size
    check_inputs(hidden, weight, labels, reduction, chunk_size, vocab_start, z_loss_weight, label_smoothing, vocab_chunk_size)
    if tp_group is None:
        if vocab_start != 0:
            raise ValueError(f"vocab_start={vocab_start} needs tp_group (a vocab shard); pass tp_group or vocab_start=0")
        check_labels_in_vocab(labels, weight.shape[0], ignore_index)
    options = (ignore_index, z_loss_weight, label_smoothing, reduction, chunk_size, vocab_chunk_size, tp_group, vocab_start)
    return ChunkedLinearCrossEntropy.apply(hidden, weight, labels, options)
