"""Top-k router: gate projection, scores, expert choice, load-balancing loss, expert bias.

Shape legend: T tokens, E experts, K experts per token, h hidden size.
"""

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_moe_hybrid.ops.moe import load_balancing_loss, router_topk


class TopKRouter(MegatronModule):
    """Routes each token to config.moe.topk of config.moe.num_experts experts.

    The gate weight [E, h] is created in fp32 (or wider) and the routing math runs in fp32
    even if the model is later cast to bf16, so that rounding does not flip expert choices.
    In training the load-balancing loss, scaled by config.moe.aux_loss_coeff, is attached to
    the returned probs with Megatron's MoEAuxLossAutoScaler: the forward value is unchanged
    and backward adds its gradient.
    `last_aux_loss` keeps the unscaled loss of the latest micro-batch (detached).
    """

    def __init__(self, config):
        super().__init__(config)
        moe = config.moe
        self.num_experts = moe.num_experts
        self.topk = moe.topk
        self.score_func = moe.score_func
        self.norm_topk_prob = getattr(moe, "norm_topk_prob", None)
        self.aux_loss_coeff = moe.aux_loss_coeff
        self.bias_update_rate = moe.bias_update_rate
        dtype = torch.promote_types(config.params_dtype, torch.float32)
        self.weight = torch.nn.Parameter(torch.empty(moe.num_experts, config.hidden_size, dtype=dtype))
        config.init_method(self.weight)
        if moe.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.last_aux_loss = torch.zeros((), dtype=torch.float32)

    def forward(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h], padding_mask [T] bool (True = padding) -> probs [T, K] fp32+, topk_idx [T, K].

        Padding tokens are still routed (their outputs are discarded by the loss mask) but do
        not count in the load-balancing loss.
        """
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        logits = torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype))  # [T, E]
        self._keep_expert_bias_fp32()
        probs, topk_idx, scores = router_topk(
            logits, self.topk, self.score_func, self.expert_bias, self.norm_topk_prob
        )
        if padding_mask is not None:
            scores, kept_idx = scores[~padding_mask], topk_idx[~padding_mask]
        else:
            kept_idx = topk_idx
        aux_loss = load_balancing_loss(scores, kept_idx, self.num_experts, self.topk)
        self.last_aux_loss = aux_loss.detach().float()
        if self.training and torch.is_grad_enabled() and self.aux_loss_coeff:
            probs = MoEAuxLossAutoScaler.apply(probs, self.aux_loss_coeff * aux_loss)
        return probs, topk_idx

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
