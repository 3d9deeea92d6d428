"""MoE reference ops in plain PyTorch: routing, load-balancing loss, permute/unpermute, grouped SwiGLU.

These define the semantics that the fused kernels (ops/moe/fused_permute.py, later grouped
GEMMs) are tested against, so every ordering rule below is part of the contract.

Shape legend:
    T  tokens (flattened s * b)           E  experts (E_local: experts of this EP rank)
    K  experts per token (topk)           N  routed rows (T * K on the sending side)
    h  hidden size                        F  expert FFN hidden size
"""

import torch
from torch.nn.functional import silu

SCORE_FUNCS = ("softmax", "sigmoid")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, else the dtype itself: fp64 tests stay exact."""
    return torch.promote_types(dtype, torch.float32)


def router_topk(
    logits: torch.Tensor,
    topk: int,
    score_func: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    norm_topk_prob: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing, DeepSeek-V3 convention.

    logits [T, E] -> probs [T, K], topk_idx [T, K] int64, scores [T, E].
    expert_bias [E] (aux-loss-free balancing) is added only to choose the experts; the weights
    come from the unbiased scores. norm_topk_prob None means the usual default per score
    function: renormalise the top-k weights to sum to 1 for sigmoid (DeepSeek-V3), leave
    softmax weights as they are (DeepSeek-V2); pass True/False to force it.
    Ties go to the lower expert index (stable sort), so the choice is deterministic.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if expert_bias is not None and expert_bias.shape != (num_experts,):
        raise ValueError(
            f"expert_bias must be [E={num_experts}], got shape {tuple(expert_bias.shape)}"
        )
    if norm_topk_prob is None:
        norm_topk_prob = score_func == "sigmoid"

    logits = logits.to(_acc_dtype(logits.dtype))  # [T, E]
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()  # [T, E]
    selection = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
    # A stable descending sort keeps equal scores in expert order; torch.topk does not promise it.
    topk_idx = torch.sort(selection.detach(), dim=-1, descending=True, stable=True)[1][:, :topk]
    probs = scores.gather(1, topk_idx)  # [T, K]
    if norm_topk_prob:
        probs = probs / probs.sum(-1, keepdim=True)
    return probs, topk_idx, scores


def load_balancing_loss(
    scores: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, topk: int
) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e (1.0 when perfectly balanced).

    f_e: fraction of the T*K routed copies that go to expert e (no gradient).
    P_e: mean over tokens of the score of e, with scores normalised per token so that sigmoid
    scores count like probabilities; for softmax scores this normalisation is the identity,
    in value and in the gradient reaching the logits. T = 0 gives 0.
    """
    if scores.dim() != 2 or scores.shape[1] != num_experts:
        raise ValueError(
            f"scores must be [T, E={num_experts}], got shape {tuple(scores.shape)}"
        )
    if topk_idx.shape != (scores.shape[0], topk):
        raise ValueError(
            f"topk_idx must be [T={scores.shape[0]}, K={topk}], got shape {tuple(topk_idx.shape)}"
        )
    num_tokens = scores.shape[0]
    scores = scores.to(_acc_dtype(scores.dtype))
    counts = torch.bincount(topk_idx.flatten(), minlength=num_experts).to(scores.dtype)  # [E]
    f = counts / max(num_tokens * topk, 1)  # [E]
    p = (scores / scores.sum(-1, keepdim=True)).sum(0) / max(num_tokens, 1)  # [E]
    return num_experts * (f * p).sum()


def permute(
    x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies each token once per chosen expert and groups the copies by expert.

    x [T, h], topk_idx [T, K] -> permuted [T*K, h], row_id_map [T*K] int64, tokens_per_expert [E].
    Copy i = t*K + k. Rows are sorted by expert ascending and, within an expert, by i
    ascending; row_id_map[i] is the row that holds copy i.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [T, h], got shape {tuple(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx must be [T={x.shape[0]}, K], got shape {tuple(topk_idx.shape)}"
        )
    if topk_idx.numel() and not 0 <= int(topk_idx.min()) <= int(topk_idx.max()) < num_experts:
        raise ValueError(f"topk_idx values must lie in [0, num_experts={num_experts})")
    topk = topk_idx.shape[1]
    flat_idx = topk_idx.flatten()  # [T*K]
    sorted_copies = torch.argsort(flat_idx, stable=True)  # [T*K]: copy held by each row
    row_id_map = torch.empty_like(sorted_copies)
    row_id_map[sorted_copies] = torch.arange(flat_idx.numel(), device=flat_idx.device)
    permuted = x.index_select(0, sorted_copies // topk)  # [T*K, h]
    tokens_per_expert = torch.bincount(flat_idx, minlength=num_experts)  # [E]
    return permuted, row_id_map, tokens_per_expert


def unpermute(y: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Inverse of permute with the routing weights: out[t] = sum_k probs[t, k] * y[row of t*K+k].

    y [T*K, h], row_id_map [T*K], probs [T, K] -> [T, h] in y's dtype. The sum runs over
    k = 0..K-1 in order, accumulated in fp32 (fp64 for fp64 inputs).
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [T, K], got shape {tuple(probs.shape)}")
    num_tokens, topk = probs.shape
    if y.dim() != 2 or y.shape[0] != num_tokens * topk:
        raise ValueError(
            f"y must be [T*K={num_tokens * topk}, h], got shape {tuple(y.shape)}"
        )
    if row_id_map.shape != (num_tokens * topk,):
        raise ValueError(
            f"row_id_map must be [T*K={num_tokens * topk}], got shape {tuple(row_id_map.shape)}"
        )
    acc = _acc_dtype(y.dtype)
    y_tk = y.index_select(0, row_id_map).view(num_tokens, topk, -1).to(acc)  # [T, K, h]
    probs = probs.to(acc)
    out = y_tk.new_zeros(num_tokens, y.shape[1])  # [T, h]
    for k in range(topk):
        out = out + probs[:, k, None] * y_tk[:, k]
    return out.to(y.dtype)


def grouped_mlp(
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor | list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU of each expert over its contiguous block of rows.

    x_sorted [N, h] grouped by expert, tokens_per_expert [E_local] (host ints),
    w1 [E_local, h, 2F] (gate | up), w2 [E_local, F, h] -> [N, h].
    """
    counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0] or w1.shape[2] != 2 * w2.shape[1]:
        raise ValueError(
            f"w1 must be [E_local, h, 2F] and w2 [E_local, F, h], got {tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    if len(counts) != w1.shape[0] or sum(counts) != x_sorted.shape[0] or min(counts, default=0) < 0:
        raise ValueError(
            f"tokens_per_expert must have E_local={w1.shape[0]} non-negative counts summing to "
            f"N={x_sorted.shape[0]}, got {counts}"
        )
    if x_sorted.dim() != 2 or x_sorted.shape[1] != w1.shape[1] or w2.shape[2] != w1.shape[1]:
        raise ValueError(
            f"x_sorted must be [N, h={w1.shape[1]}] matching w1/w2, got {tuple(x_sorted.shape)}"
        )
    outs = []
    for e, x_e in enumerate(torch.split(x_sorted, counts)):  # x_e [N_e, h]
        gate, up = (x_e @ w1[e]).chunk(2, dim=-1)  # [N_e, F] each
        outs.append((silu(gate) * up) @ w2[e])  # [N_e, h]
    return torch.cat(outs)
