"""Top-k router: gate projection, scores, expert choice, balance losses, expert bias, capacity.

Shape legend: T = s * b tokens in the [s, b] layout, E experts, K experts per token,
h hidden size.
"""

import contextlib

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_moe_hybrid.ops.moe.reference import (
    capacity_keep_mask,
    count_experts,
    expert_capacity,
    load_balancing_loss,
    load_balancing_loss_from_sums,
    router_z_loss,
    sequence_load_balancing_loss,
)
from megatron_moe_hybrid.ops.moe.topk import fused_router_topk, routing, split_hi_lo, uses_fused_router

_HALF = (torch.bfloat16, torch.float16)


class _SplitPrecisionLogits(torch.autograd.Function):
    """x [T, h] bf16/fp16 @ w [E, h].T with fp32 output and accuracy, on tensor cores.

    x is exact in its half type. A weight in x's dtype is exact too: one half-precision GEMM
    with fp32 accumulation and output is the fp32 product. An fp32 weight is split, w = w_hi +
    w_lo (each half, ~16 mantissa bits together): one GEMM over the stacked [w_hi; w_lo] gives
    the fp32 product to ~1e-5 relative. The plain fp32 GEMM (no tensor cores) costs several
    times as much: with the bf16 model's bf16 gate it took 1.4 ms of each layer's forward and
    backward on the H200 at 16k tokens. The backward splits the fp32 upstream gradient the same
    way; grad x is rounded to x's dtype, as any activation gradient, grad w is fp32 before the
    cast to w's dtype. Each split is one pass (split_hi_lo) that writes the stacked operand.
    """

    @staticmethod
    def forward(ctx, x, w):
        f32 = torch.float32
        num_experts = w.shape[0]
        ctx.w_dtype = w.dtype
        if w.dtype == x.dtype:
            ctx.save_for_backward(x, w)
            return torch.mm(x, w.t(), out_dtype=f32)
        w3 = split_hi_lo(w.to(f32), x.dtype, along_rows=True)  # [3E, h] = [w_hi; w_lo; w_hi]
        both = torch.mm(x, w3[: 2 * num_experts].t(), out_dtype=f32)  # [T, 2E]
        ctx.save_for_backward(x, w3)
        return both[:, :num_experts] + both[:, num_experts:]

    @staticmethod
    def backward(ctx, g):
        f32 = torch.float32
        x, rhs = ctx.saved_tensors  # w, or [w_hi; w_lo; w_hi]
        num_experts = g.shape[1]
        lhs = split_hi_lo(g.to(f32), x.dtype, along_rows=False)  # [T, 3E] = [g_hi | g_hi | g_lo]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # one GEMM along the stacked inner dim, fp32 accumulation rounded once to x's dtype:
            # g_hi w_hi + g_hi w_lo + g_lo w_hi, or g_hi w + g_lo w for a weight in x's dtype
            if rhs.shape[0] == 3 * num_experts:
                dx = torch.mm(lhs, rhs)
            else:
                dx = torch.mm(lhs[:, num_experts:], torch.cat([rhs, rhs]))
        if ctx.needs_input_grad[1]:
            both = torch.mm(lhs[:, num_experts:].t(), x, out_dtype=f32)  # [2E, h]: [g_hi; g_lo]^T x
            dw = (both[:num_experts] + both[num_experts:]).to(ctx.w_dtype)
        return dx, dw


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, h] @ weight [E, h].T -> [T, E] in fp32 (or wider), with fp32 (or wider) accuracy.

    On CUDA, half-precision x with a weight in x's dtype or fp32 takes _SplitPrecisionLogits
    (tensor cores); otherwise x and the weight are widened and multiplied in that precision.
    """
    dtype = torch.promote_types(weight.dtype, torch.float32)
    if x.is_cuda and x.dtype in _HALF and weight.dtype in (x.dtype, torch.float32):
        return _SplitPrecisionLogits.apply(x, weight)
    return torch.nn.functional.linear(x.to(dtype), weight.to(dtype))


DROPPED = -1  # topk_idx of a copy dropped by the capacity: it goes to no expert
AUX_LOSS_TYPES = ("micro_batch", "seq", "global")


class TopKRouter(MegatronModule):
    """Routes each token to config.moe.topk of config.moe.num_experts experts.

    The gate weight [E, h] is created in fp32 (or wider) and the routing math runs in fp32
    even if the model is later cast to bf16, so that rounding does not flip expert choices.
    In training, aux_loss_coeff * aux loss + z_loss_coeff * z-loss is attached to the
    returned probs with Megatron's MoEAuxLossAutoScaler: the forward value is unchanged and
    backward adds its gradient.
    The aux loss (config.moe.aux_loss_type) is the Switch loss of the micro-batch, the mean of
    per-sequence losses ("seq", DeepSeek-V3), or the micro-batch loss with the load f_e taken
    from counts summed over aux_loss_group ("global"; None: this rank alone). It is computed
    on the routing before any capacity drop: it balances what the router asks for.
    `last_aux_loss` and `last_z_loss` keep the unscaled losses of the latest micro-batch (detached).
    """

    def __init__(
        self,
        config,
        aux_loss_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(config)
        moe = config.moe
        self.num_experts = moe.num_experts
        self.topk = moe.topk
        self.score_func = moe.score_func
        self.norm_topk_prob = getattr(moe, "norm_topk_prob", None)
        self.num_groups = getattr(moe, "num_groups", 1)
        self.topk_groups = getattr(moe, "topk_groups", 1)
        self.routed_scaling_factor = getattr(moe, "routed_scaling_factor", 1.0)
        self.aux_loss_coeff = moe.aux_loss_coeff
        self.aux_loss_type = getattr(moe, "aux_loss_type", "micro_batch")
        if self.aux_loss_type not in AUX_LOSS_TYPES:
            raise ValueError(f"moe.aux_loss_type must be one of {AUX_LOSS_TYPES}, got {self.aux_loss_type!r}")
        self.aux_loss_group = aux_loss_group
        # Context parallelism splits every sequence over cp_group: the balance losses count
        # their loads over it and each rank attaches cp x its share, because the gradients
        # are then averaged over the CP ranks like those of the LM loss.
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        self.z_loss_coeff = getattr(moe, "z_loss_coeff", 0.0)
        self.capacity_factor = getattr(moe, "capacity_factor", None)
        self.drop_policy = getattr(moe, "drop_policy", "probs")
        self.bias_update_rate = moe.bias_update_rate
        self.backend = getattr(moe, "router_backend", "auto")
        dtype = torch.promote_types(config.params_dtype, torch.float32)
        self.weight = torch.nn.Parameter(torch.empty(moe.num_experts, config.hidden_size, dtype=dtype))
        config.init_method(self.weight)
        if moe.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.last_aux_loss = torch.zeros((), dtype=torch.float32)
        self.last_z_loss = torch.zeros((), dtype=torch.float32)
        self.last_counts = None

    def forward(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None = None, batch_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] in [s, b] token order, padding_mask [T] bool (True = padding)
        -> probs [T, K] fp32+, topk_idx [T, K] int64.

        batch_size b splits the tokens into sequences for aux_loss_type "seq" (required there).
        Copies dropped by the capacity have topk_idx DROPPED (-1) and weight 0.
        Padding tokens are still routed (their outputs are discarded by the loss mask) and take
        capacity, but count in neither loss.
        """
        logits = router_logits(x, self.weight)  # [T, E] fp32+
        self._keep_expert_bias_fp32()
        valid = None if padding_mask is None else ~padding_mask  # [T]
        stats = None  # the fused kernel's (lse [T], score_sums [E], counts [E]): the losses' inputs
        if self.aux_loss_type != "seq" and uses_fused_router(logits, self.num_groups, self.topk_groups, self.backend):
            probs, topk_idx, scores, *stats = fused_router_topk(
                logits, self.topk, self.score_func, self.expert_bias, self.norm_topk_prob,
                self.routed_scaling_factor, valid, stats=True,
            )
        else:
            probs, topk_idx, scores = routing(
                logits,
                self.topk,
                self.score_func,
                self.expert_bias,
                self.norm_topk_prob,
                self.num_groups,
                self.topk_groups,
                self.routed_scaling_factor,
                self.backend,
            )
        # [E] int64: the valid tokens' routed copies per expert before any capacity drop, when
        # the fused kernel counted them (the MoE layer's load statistics take them), else None
        self.last_counts = None if stats is None else stats[2]
        # the tokens the losses count: an int, or a device scalar with padding (no host sync)
        n_valid = x.shape[0] if valid is None else valid.sum()
        # Under CP: this rank's counted tokens and, once, their sum over the CP group, shared by
        # the aux loss and the z-loss.
        n_local = n_cp = None
        if self.cp_group is not None:
            n_local = torch.as_tensor(n_valid).to(scores.device, scores.dtype)
        attach = self.training and torch.is_grad_enabled() and bool(self.aux_loss_coeff or self.z_loss_coeff)
        with contextlib.nullcontext() if attach else torch.no_grad():  # else only logged: no autograd record
            aux_loss, n_cp = self._aux_loss(scores, topk_idx, valid, batch_size, n_local, stats, n_valid)
            if stats is not None and (self.score_func == "softmax" or not attach):
                # the kernel's lse is 0 on padding; its gradient reaches the logits for softmax scores
                z_loss = stats[0].square().sum() / (max(n_valid, 1) if valid is None else n_valid.clamp_min(1))
            else:
                z_loss = router_z_loss(logits if valid is None else logits[valid])
            if self.cp_group is not None and self.z_loss_coeff:  # cp x this rank's share, as the aux loss
                if n_cp is None:
                    n_cp = n_local.clone()
                    dist.all_reduce(n_cp, group=self.cp_group)
                z_loss = z_loss * (n_local / n_cp.clamp_min(1)) * dist.get_world_size(self.cp_group)
        self.last_aux_loss = aux_loss.detach().float()
        self.last_z_loss = z_loss.detach().float()

        if self.capacity_factor is not None:
            capacity = expert_capacity(x.shape[0], self.topk, self.num_experts, self.capacity_factor)
            keep = capacity_keep_mask(topk_idx, probs, self.num_experts, capacity, self.drop_policy)  # [T, K]
            topk_idx = topk_idx.masked_fill(~keep, DROPPED)
            probs = probs.masked_fill(~keep, 0.0)
        if attach:
            probs = MoEAuxLossAutoScaler.apply(probs, self.aux_loss_coeff * aux_loss + self.z_loss_coeff * z_loss)
        return probs, topk_idx

    def _aux_loss(
        self,
        scores: torch.Tensor,
        topk_idx: torch.Tensor,
        valid: torch.Tensor | None,
        batch_size: int | None,
        n_local: torch.Tensor | None = None,
        stats: list[torch.Tensor] | None = None,
        n_valid: int | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """scores [T, E], topk_idx [T, K], valid [T] bool or None -> (the unscaled aux loss, the
        counted tokens summed over the CP group when it was needed here, else None).

        Under context parallelism (n_local: this rank's counted tokens): this rank's share of
        the loss of the whole sequences, times the CP size (the mean over the CP ranks is the loss).
        stats: the fused kernel's (lse, score_sums, counts) over the valid tokens, or None;
        n_valid: their number (with stats).
        """
        cp = self.cp_group
        cp_size = 1 if cp is None else dist.get_world_size(cp)

        def sum_over_cp(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            dist.all_reduce(t, group=cp)
            return t

        if self.aux_loss_type == "seq":
            if batch_size is None or batch_size < 1 or scores.shape[0] % batch_size:
                raise ValueError(
                    f"batch_size must divide the {scores.shape[0]} tokens for moe.aux_loss_type='seq', "
                    f"got {batch_size}; pass the micro-batch size b of the [s, b] layout"
                )
            seq_shape = (scores.shape[0] // batch_size, batch_size)
            loss = sequence_load_balancing_loss(
                scores.view(*seq_shape, self.num_experts),  # explicit sizes: s may be 0
                topk_idx.view(*seq_shape, self.topk),
                self.num_experts,
                self.topk,
                None if valid is None else valid.view(seq_shape),
                sum_over_ranks=None if cp is None else sum_over_cp,
            )
            return cp_size * loss, None
        if valid is not None and stats is None:
            scores, topk_idx = scores[valid], topk_idx[valid]

        def local_counts() -> torch.Tensor:  # [E]
            return (count_experts(topk_idx, self.num_experts) if stats is None else stats[2]).to(scores.dtype)

        counts = n_cp = None
        if self.aux_loss_type == "global" and self.aux_loss_group is not None and dist.get_world_size(self.aux_loss_group) > 1:
            counts = local_counts()
            dist.all_reduce(counts, group=self.aux_loss_group)
        if cp is not None:
            if counts is None:  # the micro-batch's load and token count in one collective: [E + 1]
                both = sum_over_cp(torch.cat([local_counts(), n_local[None]]))
                counts, n_cp = both[:-1], both[-1]
            else:
                n_cp = sum_over_cp(n_local)
        if stats is None:
            loss = load_balancing_loss(scores, topk_idx, self.num_experts, self.topk, counts, n_cp)
        else:
            num_tokens = n_cp if n_cp is not None else n_valid
            loss = load_balancing_loss_from_sums(stats[1], stats[2] if counts is None else counts, num_tokens)
        return cp_size * loss, n_cp

    def _keep_expert_bias_fp32(self) -> None:
        """model.to(bf16) casts buffers too; bias steps of ~1e-3 would round away in bf16."""
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.float()

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_global: torch.Tensor) -> None:
        """DeepSeek-V3 aux-loss-free step: bias_e += rate * sign(mean_count - count_e).

        tokens_per_expert_global [E]: routed copies per expert summed over the step and over
        every rank that shares this router (the trainer all-reduces them first).
        """
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs moe.expert_bias=True in the config")
        if tokens_per_expert_global.shape != (self.num_experts,):
            raise ValueError(
                f"tokens_per_expert_global must be [E={self.num_experts}], "
                f"got shape {tuple(tokens_per_expert_global.shape)}"
            )
        self._keep_expert_bias_fp32()
        counts = tokens_per_expert_global.to(self.expert_bias.device, torch.float32)  # [E]
        self.expert_bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
