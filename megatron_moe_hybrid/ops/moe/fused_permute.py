"""MoE token permutation: autograd wrappers over the compiled torch.ops.mmh ops, and the
plain PyTorch reference that defines them (and runs when _C is missing).

Shape legend:
  T   tokens                      K   experts chosen per token (top-k)
  E   experts                     h   hidden size
  TK  = T * K permuted rows, one per (token, choice) copy, flat index i = t * K + k

permute: rows are grouped by expert ascending and, within an expert, by i ascending (a
stable sort of topk_idx.flatten()); row_id_map[i] is the permuted row of copy i, so
permuted[row_id_map[t * K + k]] == x[t].
unpermute: out[t] = sum over k = 0..K-1, in that order, of probs[t, k] * y[row_id_map[t * K + k]],
accumulated in fp32 (fp64 for float64 y) and rounded once to y's dtype.
"""

import torch

from megatron_moe_hybrid import _ext

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> None:
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D [T, h] float tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(
            f"topk_idx must be a 2-D [T, K] int64 tensor (call .long() on it), got {topk_idx.dtype} "
            f"of shape {tuple(topk_idx.shape)}"
        )
    if topk_idx.shape[0] != x.shape[0] or topk_idx.shape[1] < 1:
        raise ValueError(
            f"topk_idx must be [T, K] with T = x.shape[0] = {x.shape[0]} and K >= 1, got {tuple(topk_idx.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if topk_idx.device != x.device:
        raise ValueError(f"topk_idx is on {topk_idx.device} but x is on {x.device}; move it with .to(x.device)")


def _check_unpermute(y: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor) -> None:
    if y.dim() != 2 or y.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"y must be a 2-D [T*K, h] float tensor, got {y.dtype} of shape {tuple(y.shape)}")
    if probs.dim() != 2 or probs.dtype not in _FLOAT_DTYPES or probs.shape[1] < 1:
        raise ValueError(
            f"probs must be a 2-D [T, K] float tensor with K >= 1, got {probs.dtype} of shape {tuple(probs.shape)}"
        )
    if y.shape[0] != probs.numel():
        raise ValueError(
            f"y has {y.shape[0]} rows but probs is {tuple(probs.shape)}; y must hold the T*K permuted rows"
        )
    if row_id_map.shape != (probs.numel(),) or row_id_map.dtype != torch.int64:
        raise ValueError(
            f"row_id_map must be the [T*K] = [{probs.numel()}] int64 map returned by fused_permute, "
            f"got {row_id_map.dtype} of shape {tuple(row_id_map.shape)}"
        )
    if row_id_map.device != y.device or probs.device != y.device:
        raise ValueError(f"row_id_map and probs must be on y's device {y.device}; move them with .to(y.device)")


def permute_reference(
    x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain PyTorch permute: returns (permuted [TK, h], row_id_map [TK] int64, tokens_per_expert [E] int64)."""
    _check_permute(x, topk_idx, num_experts)
    num_tokens, topk = topk_idx.shape
    flat = topk_idx.reshape(-1)  # [TK] expert of copy i
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(
            f"topk_idx holds expert ids outside [0, num_experts={num_experts}); pass the router's num_experts"
        )
    order = torch.argsort(flat, stable=True)  # [TK] flat index of each permuted row
    row_id_map = torch.empty_like(order)  # [TK]
    row_id_map[order] = torch.arange(flat.numel(), device=flat.device)
    permuted = x[order // topk]  # [TK, h]
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)  # [E]
    return permuted, row_id_map, tokens_per_expert


def unpermute_reference(y: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch unpermute: out [T, h] = sum over k in order of probs[t, k] * y[row_id_map[t * K + k]]."""
    _check_unpermute(y, row_id_map, probs)
    num_tokens, topk = probs.shape
    acc = _acc_dtype(y.dtype)
    rows = row_id_map.view(num_tokens, topk)  # [T, K]
    weights = probs.to(acc)  # [T, K]
    out = torch.zeros(num_tokens, y.shape[1], dtype=acc, device=y.device)  # [T, h]
    for k in range(topk):  # k order fixes the rounding, as in the kernels
        out = out + weights[:, k, None] * y[rows[:, k]].to(acc)
    return out.to(y.dtype)


class _FusedPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, num_experts):
        permuted, row_id_map, tokens_per_expert = torch.ops.mmh.permute_fwd(x, topk_idx, num_experts)
        ctx.save_for_backward(row_id_map)
        ctx.num_tokens, ctx.topk = topk_idx.shape
        ctx.mark_non_differentiable(row_id_map, tokens_per_expert)
        return permuted, row_id_map, tokens_per_expert

    @staticmethod
    def backward(ctx, grad_permuted, _grad_row_id_map, _grad_tokens_per_expert):
        (row_id_map,) = ctx.saved_tensors
        grad_x = torch.ops.mmh.permute_bwd(grad_permuted, row_id_map, ctx.num_tokens, ctx.topk)
        return grad_x, None, None


class _FusedUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_id_map, probs):
        ctx.save_for_backward(y, row_id_map, probs)
        return torch.ops.mmh.unpermute_fwd(y, row_id_map, probs)

    @staticmethod
    def backward(ctx, grad_out):
        y, row_id_map, probs = ctx.saved_tensors
        grad_y, grad_probs = torch.ops.mmh.unpermute_bwd(grad_out, y, row_id_map, probs)
        return grad_y, None, grad_probs


def _compiled_ops_for(device: torch.device, feature: str) -> bool:
    """True when _C has kernels for `device`; otherwise says once that the reference runs."""
    if (device.type == "cpu" and _ext.has_cpu_ops()) or (device.type == "cuda" and _ext.has_cuda_ops()):
        return True
    _ext.warn_missing_once(f"{feature} on {device.type}")
    return False


def fused_permute(
    x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies each token x[t] [T, h] to its K experts' rows, grouped by expert.

    Returns (permuted [TK, h], row_id_map [TK] int64, tokens_per_expert [E] int64);
    only permuted carries a gradient (grad_x sums the K copies in k order).
    """
    _check_permute(x, topk_idx, num_experts)
    if not _compiled_ops_for(x.device, "fused_permute"):
        return permute_reference(x, topk_idx, num_experts)
    return _FusedPermute.apply(x, topk_idx, num_experts)


def fused_unpermute(y: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Sums each token's K expert outputs y [TK, h] weighted by probs [T, K]; returns out [T, h] in y's dtype.

    Gradients flow to y and probs (grad_probs in probs' dtype); row_id_map comes from fused_permute.
    """
    _check_unpermute(y, row_id_map, probs)
    if not _compiled_ops_for(y.device, "fused_unpermute"):
        return unpermute_reference(y, row_id_map, probs)
    return _FusedUnpermute.apply(y, row_id_map, probs)


if _ext.has_cpu_ops():
    # Shapes only, so that torch.compile can trace through the ops without running them.
    @torch.library.register_fake("mmh::permute_fwd")
    def _permute_fwd_fake(x, topk_idx, num_experts):
        num_rows = topk_idx.shape[0] * topk_idx.shape[1]
        row_id_map = topk_idx.new_empty(num_rows)
        return x.new_empty(num_rows, x.shape[1]), row_id_map, topk_idx.new_empty(num_experts)

    @torch.library.register_fake("mmh::permute_bwd")
    def _permute_bwd_fake(grad_permuted, row_id_map, num_tokens, topk):
        return grad_permuted.new_empty(num_tokens, grad_permuted.shape[1])

    @torch.library.register_fake("mmh::unpermute_fwd")
    def _unpermute_fwd_fake(y, row_id_map, probs):
        return y.new_empty(probs.shape[0], y.shape[1])

    @torch.library.register_fake("mmh::unpermute_bwd")
    def _unpermute_bwd_fake(grad_out, y, row_id_map, probs):
        return torch.empty_like(y), torch.empty_like(probs)
