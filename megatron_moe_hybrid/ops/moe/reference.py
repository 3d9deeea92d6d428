"""MoE reference ops in plain PyTorch: routing, load-balancing loss, permute/unpermute, grouped SwiGLU.

These define the semantics that the fused kernels (ops/moe/fused_permute.py, later grouped
GEMMs) are tested against, so every ordering rule below is part of the contract.

Shape legend:
    T  tokens (flattened s * b)           E  experts (E_local: experts of this EP rank)
    K  experts per token (topk)           N  routed rows (T * K on the sending side)
    h  hidden size                        F  expert FFN hidden size
    G  expert groups (group-limited routing), E / G experts per group
    s, b  sequence length and micro-batch size of the [s, b] token layout (T = s * b)
"""

import math

import torch
from torch.nn.functional import silu

SCORE_FUNCS = ("softmax", "sigmoid")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, else the dtype itself: fp64 tests stay exact."""
    return torch.promote_types(dtype, torch.float32)


def count_experts(idx: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[num_bins] int64 histogram of idx (any shape, values in [0, num_bins]; num_bins itself
    is a discard bin). Unlike torch.bincount on CUDA, it never reads a device value back."""
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise ValueError(f"idx must be an integer tensor of expert ids, got {idx.dtype}")
    flat = idx.reshape(-1).long()
    counts = torch.zeros(num_bins + 1, dtype=torch.int64, device=idx.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts[:num_bins]


def _best_groups_mask(
    selection: torch.Tensor, num_groups: int, topk_groups: int, score_func: str
) -> torch.Tensor:
    """[T, E] selection scores -> [T, E] bool, True for the experts of each token's best groups.

    Group score as in DeepSeek-V3 (sigmoid): the sum of the group's two best scores; as in
    DeepSeek-V2 (softmax): the group's best score. Ties go to the lower group index.
    """
    num_tokens, num_experts = selection.shape
    grouped = selection.view(num_tokens, num_groups, num_experts // num_groups)  # [T, G, E/G]
    if score_func == "sigmoid":
        top2 = min(2, grouped.shape[-1])
        group_scores = grouped.topk(top2, dim=-1).values.sum(-1)  # [T, G]
    else:
        group_scores = grouped.amax(-1)  # [T, G]
    best = torch.sort(group_scores, dim=-1, descending=True, stable=True)[1][:, :topk_groups]  # [T, G_keep]
    in_best = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    return in_best.repeat_interleave(num_experts // num_groups, dim=1)  # [T, E]


def router_topk(
    logits: torch.Tensor,
    topk: int,
    score_func: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    norm_topk_prob: bool | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing, DeepSeek-V3 convention.

    logits [T, E] -> probs [T, K], topk_idx [T, K] int64, scores [T, E].
    expert_bias [E] (aux-loss-free balancing) is added only to choose the experts (and their
    groups); the weights come from the unbiased scores, for softmax and sigmoid alike.
    Group-limited routing (num_groups > 1): the experts form num_groups contiguous groups,
    each token keeps its best topk_groups groups and picks its top-k among their experts.
    norm_topk_prob None means the usual default per score function: renormalise the top-k
    weights to sum to 1 for sigmoid (DeepSeek-V3), leave softmax weights as they are
    (DeepSeek-V2); pass True/False to force it. The weights are then multiplied by
    routed_scaling_factor. Ties go to the lower expert index (stable sort), so the choice is
    deterministic.
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
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups must divide num_experts={num_experts}, got {num_groups}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups must be in [1, num_groups={num_groups}], got {topk_groups}")
    if topk > topk_groups * (num_experts // num_groups):
        raise ValueError(
            f"topk={topk} experts cannot come from topk_groups={topk_groups} groups of "
            f"{num_experts // num_groups}; raise topk_groups or lower topk"
        )
    if norm_topk_prob is None:
        norm_topk_prob = score_func == "sigmoid"

    logits = logits.to(_acc_dtype(logits.dtype))  # [T, E]
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()  # [T, E]
    selection = scores.detach()  # [T, E]: the choice carries no gradient
    if expert_bias is not None:
        selection = selection + expert_bias.to(scores.dtype)
    if topk_groups < num_groups:
        in_best = _best_groups_mask(selection, num_groups, topk_groups, score_func)
        selection = selection.masked_fill(~in_best, float("-inf"))
    # A stable descending sort keeps equal scores in expert order; torch.topk does not promise it.
    topk_idx = torch.sort(selection, dim=-1, descending=True, stable=True)[1][:, :topk]
    probs = scores.gather(1, topk_idx)  # [T, K]
    if norm_topk_prob:
        probs = probs / probs.sum(-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        probs = probs * routed_scaling_factor
    return probs, topk_idx, scores


def _check_scores_idx(scores: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, topk: int) -> None:
    if scores.dim() < 2 or scores.shape[-1] != num_experts:
        raise ValueError(
            f"scores must be [..., E={num_experts}], got shape {tuple(scores.shape)}"
        )
    if topk_idx.shape != scores.shape[:-1] + (topk,):
        raise ValueError(
            f"topk_idx must be {tuple(scores.shape[:-1]) + (topk,)} ([..., K={topk}] like scores), "
            f"got shape {tuple(topk_idx.shape)}"
        )
    if topk_idx.is_floating_point() or topk_idx.dtype == torch.bool:
        raise ValueError(f"topk_idx must be an integer tensor of expert ids, got {topk_idx.dtype}")
    # the range: a host read, so on CPU tensors only (the GPU path stays free of syncs; the router
    # makes these ids itself)
    if not topk_idx.is_cuda and topk_idx.numel() and not (0 <= int(topk_idx.min()) and int(topk_idx.max()) < num_experts):
        raise ValueError(f"topk_idx must lie in [0, {num_experts}), got values in "
                         f"[{int(topk_idx.min())}, {int(topk_idx.max())}]")


def load_balancing_loss(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    topk: int,
    expert_counts: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e (1.0 when perfectly balanced).

    f_e: fraction of the routed copies that go to expert e (no gradient): counted from
    topk_idx [T, K], or taken from expert_counts [E] when given (e.g. counts all-reduced over
    the data-parallel group for a loss over the global batch).
    P_e: the scores of e summed over the T tokens, divided by num_tokens (default T: the mean;
    context parallelism passes the count over all CP ranks, so that the ranks' shares add up),
    with scores [T, E] normalised per token so that sigmoid scores count like probabilities;
    for softmax scores this normalisation is the identity, in value and in the gradient
    reaching the logits. No copies gives 0.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [T, E={num_experts}], got shape {tuple(scores.shape)}")
    _check_scores_idx(scores, topk_idx, num_experts, topk)
    if expert_counts is not None and expert_counts.shape != (num_experts,):
        raise ValueError(
            f"expert_counts must be [E={num_experts}], got shape {tuple(expert_counts.shape)}"
        )
    if num_tokens is None:
        num_tokens = scores.shape[0]
    scores = scores.to(_acc_dtype(scores.dtype))
    if expert_counts is None:
        expert_counts = count_experts(topk_idx, num_experts)
    return load_balancing_loss_from_sums((scores / scores.sum(-1, keepdim=True)).sum(0), expert_counts, num_tokens)


def load_balancing_loss_from_sums(
    score_sums: torch.Tensor, expert_counts: torch.Tensor, num_tokens: float | torch.Tensor
) -> torch.Tensor:
    """load_balancing_loss from its two per-expert sums: score_sums [E] (over the tokens, of each
    token's scores divided by their sum; carries the gradient) and expert_counts [E] (routed
    copies; no gradient), over num_tokens tokens (an int or a device scalar)."""
    counts = expert_counts.detach().to(score_sums.dtype)  # [E]
    f = counts / counts.sum().clamp_min(1)  # [E]
    if isinstance(num_tokens, torch.Tensor):
        num_tokens = num_tokens.to(score_sums.dtype).clamp_min(1)
    else:
        num_tokens = max(num_tokens, 1)
    p = score_sums / num_tokens  # [E]
    return score_sums.shape[0] * (f * p).sum()


def sequence_load_balancing_loss(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    topk: int,
    valid: torch.Tensor | None = None,
    sum_over_ranks=None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: load_balancing_loss of each sequence alone,
    averaged over the sequences that hold at least one valid token.

    scores [s, b, E], topk_idx [s, b, K], valid [s, b] bool (False = padding, left out).
    sum_over_ranks: a callable that sums a tensor over the ranks holding the other tokens of the
    same sequences (context parallelism); the loss is then this rank's share, and the
    shares add up to the loss of the whole sequences.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be [s, b, E={num_experts}], got shape {tuple(scores.shape)}")
    _check_scores_idx(scores, topk_idx, num_experts, topk)
    seq_len, batch = scores.shape[:2]
    if valid is None:
        valid = torch.ones(seq_len, batch, dtype=torch.bool, device=scores.device)
    if valid.shape != (seq_len, batch):
        raise ValueError(f"valid must be [s={seq_len}, b={batch}] bool, got shape {tuple(valid.shape)}")
    scores = scores.to(_acc_dtype(scores.dtype))
    weight = valid.to(scores.dtype)  # [s, b]
    num_valid = weight.sum(0)  # [b]
    seq_of_copy = torch.arange(batch, device=topk_idx.device).view(1, batch, 1)  # [1, b, 1]
    bins = seq_of_copy * num_experts + topk_idx  # [s, b, K]: (sequence, expert) bins
    bins = bins.masked_fill(~valid[..., None], batch * num_experts)  # padding to the discard bin
    counts = count_experts(bins, batch * num_experts).view(batch, num_experts).to(scores.dtype)
    if sum_over_ranks is not None:  # [b, E + 1]: one collective for both
        both = sum_over_ranks(torch.cat([counts, num_valid[:, None]], dim=1))
        counts, num_valid = both[:, :-1], both[:, -1]
    f = counts / (num_valid * topk).clamp_min(1)[:, None]  # [b, E]
    normed = scores / scores.sum(-1, keepdim=True) * weight[..., None]  # [s, b, E]
    p = normed.sum(0) / num_valid.clamp_min(1)[:, None]  # [b, E]
    per_seq = num_experts * (f * p).sum(-1)  # [b]; 0 for a sequence of padding only
    return per_seq.sum() / (num_valid > 0).sum().clamp_min(1)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss mean_t logsumexp(logits[t])^2 over logits [T, E]; T = 0 gives 0."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    lse = torch.logsumexp(logits.to(_acc_dtype(logits.dtype)), dim=-1)  # [T]
    return lse.square().sum() / max(logits.shape[0], 1)


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Copies each expert may take: ceil(capacity_factor * T * K / E)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (None in the config for dropless), got {capacity_factor}")
    return math.ceil(capacity_factor * num_tokens * topk / num_experts)


def capacity_keep_mask(
    topk_idx: torch.Tensor,
    probs: torch.Tensor,
    num_experts: int,
    capacity: int,
    drop_policy: str = "probs",
) -> torch.Tensor:
    """[T, K] bool: True for the copies that fit in their expert's capacity.

    Each expert keeps at most `capacity` of its copies: the highest-probability ones
    (drop_policy "probs", ties to the earlier copy t*K+k) or those of the earliest tokens
    ("position", copy order t*K+k).
    """
    if topk_idx.dim() != 2 or probs.shape != topk_idx.shape:
        raise ValueError(
            f"topk_idx and probs must both be [T, K], got {tuple(topk_idx.shape)} and {tuple(probs.shape)}"
        )
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    flat = topk_idx.flatten()  # [N]
    num_copies = flat.numel()
    if drop_policy == "probs":
        order = torch.sort(probs.detach().flatten(), descending=True, stable=True)[1]  # [N] by priority
    else:
        order = torch.arange(num_copies, device=flat.device)
    order = order[torch.sort(flat[order], stable=True)[1]]  # [N] by expert, then priority
    counts = count_experts(flat, num_experts)  # [E]
    starts = counts.cumsum(0) - counts  # [E]
    rank_in_expert = torch.arange(num_copies, device=flat.device) - starts[flat[order]]  # [N]
    keep = torch.empty(num_copies, dtype=torch.bool, device=flat.device)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(topk_idx)


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
