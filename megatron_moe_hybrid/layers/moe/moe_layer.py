"""The MoE MLP block: router -> dispatch -> grouped experts -> combine (+ shared expert).

Model code is single-device; expert parallelism lives only in the dispatcher, whose process
group is passed in (or taken from Megatron's parallel_state when that is initialised), as is
the data-parallel group over which the "global" aux loss counts the expert load.

Shape legend:
    s sequence, b micro-batch, T = s * b tokens, h hidden size
    E experts, E_local experts of this EP rank, K experts per token, N rows grouped by expert
"""

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.module import MegatronModule

from megatron_moe_hybrid.ops.moe.reference import count_experts
from megatron_moe_hybrid.parallel.recompute import is_recomputing
from megatron_moe_hybrid.registry import MOE_DISPATCHERS

from .experts import GroupedExperts
from .router import TopKRouter


class SharedExpertMLP(MegatronModule):
    """A SwiGLU MLP applied to every token, next to the routed experts.

    With moe.shared_expert_gate (Qwen3-Next) its output is scaled per token by
    sigmoid(x @ gate_weight^T), gate_weight [1, h]. The gate is a bare parameter, not a Linear,
    so that LoRA's shared_expert target adapts the MLP and leaves the one-output gate alone.
    """

    def __init__(self, config, ffn_hidden_size: int):
        super().__init__(config)
        h = config.hidden_size
        self.linear_fc1 = torch.nn.Linear(h, 2 * ffn_hidden_size, bias=False, dtype=config.params_dtype)
        self.linear_fc2 = torch.nn.Linear(ffn_hidden_size, h, bias=False, dtype=config.params_dtype)
        config.init_method(self.linear_fc1.weight)
        config.output_layer_init_method(self.linear_fc2.weight)
        self.gate_weight = None
        if getattr(config.moe, "shared_expert_gate", False):
            self.gate_weight = torch.nn.Parameter(torch.empty(1, h, dtype=config.params_dtype))
            config.init_method(self.gate_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)  # [T, F_shared] each
        y = self.linear_fc2(torch.nn.functional.silu(gate) * up)  # [T, h]
        if self.gate_weight is not None:
            y = torch.sigmoid(torch.nn.functional.linear(x, self.gate_weight)) * y  # [T, 1] * [T, h]
        return y


class MoELayer(MegatronModule):
    """Sparse MoE MLP, a drop-in for Megatron's MLP in a TransformerLayer spec.

    Kept for the trainer:
      last_aux_loss      detached load-balancing loss of the latest micro-batch, before
                         moe.aux_loss_coeff (1.0 = balanced);
      last_z_loss        detached router z-loss of the latest micro-batch, before moe.z_loss_coeff;
      last_dropped       int64 scalar tensor: copies of the latest forward dropped by the
                         capacity (moe.capacity_factor; always 0 when dropless);
      tokens_per_expert  [E] int64 kept routed copies per expert (this rank's non-padding
                         tokens) summed over the grad-enabled forwards since reset_stats(); the
                         trainer all-reduces it for router.update_expert_bias.
      dispatch_overflow  int64 scalar: copies the static dispatcher could not send, summed
                         like tokens_per_expert; the trainer stops if it is ever non-zero.
    """

    def __init__(self, config, submodules=None, layer_number=None, ep_group=None, dp_group=None, **kwargs):
        super().__init__(config)
        moe = config.moe
        if ep_group is None and ps.model_parallel_is_initialized():
            ep_group = ps.get_expert_model_parallel_group()
        global_aux = getattr(moe, "aux_loss_type", "micro_batch") == "global"
        if dp_group is None and global_aux and ps.model_parallel_is_initialized():
            # every rank that holds other tokens of the global batch (CP ranks hold other positions)
            dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.layer_number = layer_number
        cp_group = None
        if ps.model_parallel_is_initialized() and ps.get_context_parallel_world_size() > 1:
            cp_group = ps.get_context_parallel_group()
        self.router = TopKRouter(config, aux_loss_group=dp_group, cp_group=cp_group)
        # Configs without a dispatcher field get the all-to-all one (the only one so far).
        name = getattr(moe, "dispatcher", "alltoall")
        dispatcher_cls = MOE_DISPATCHERS.get(name)
        extra = {}
        if name == "static":
            extra = dict(
                capacity_factor=getattr(moe, "dispatch_capacity_factor", 2.0),
                num_chunks=getattr(moe, "dispatch_chunks", 1),
            )
        self.dispatcher = dispatcher_cls(moe.num_experts, ep_group, getattr(moe, "permute_backend", "auto"), **extra)
        num_local = self.dispatcher.num_local_experts
        self.local_expert_indices = list(
            range(self.dispatcher.ep_rank * num_local, (self.dispatcher.ep_rank + 1) * num_local)
        )
        self.experts = GroupedExperts(config, num_local, expert_offset=self.local_expert_indices[0])
        self.shared_experts = (
            SharedExpertMLP(config, moe.shared_expert_ffn_hidden_size)
            if moe.shared_expert_ffn_hidden_size
            else None
        )
        self.register_buffer(
            "tokens_per_expert", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False
        )
        self.register_buffer("dispatch_overflow", torch.zeros((), dtype=torch.int64), persistent=False)
        self.last_dropped = torch.zeros((), dtype=torch.int64)

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    @property
    def last_aux_loss(self) -> torch.Tensor:
        return self.router.last_aux_loss

    @property
    def last_dispatch_overflow(self) -> torch.Tensor:
        """int64 device scalar: routed copies of the latest forward that the static dispatcher's
        receive capacity could not take (always 0 for the exact all-to-all and at EP=1)."""
        return getattr(self.dispatcher, "last_overflow", self.last_dropped.new_zeros(()))

    @property
    def last_z_loss(self) -> torch.Tensor:
        return self.router.last_z_loss

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.dispatch_overflow.zero_()

    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None, **kwargs):
        """hidden_states [s, b, h], padding_mask [b, s] bool (True = padding) -> ([s, b, h], None)."""
        s, b, h = hidden_states.shape
        x = hidden_states.reshape(s * b, h)  # [T, h]
        if padding_mask is not None:
            if padding_mask.shape != (b, s):
                raise ValueError(
                    f"padding_mask must be [b={b}, s={s}] (True = padding), "
                    f"got shape {tuple(padding_mask.shape)}"
                )
            padding_mask = padding_mask.t().reshape(-1).bool()  # [T] in the token order of x
        probs, topk_idx = self.router(x, padding_mask, batch_size=b)  # [T, K] each; -1 = dropped

        d = self.dispatcher
        if hasattr(d, "forward_experts"):  # pipelined: all-to-alls overlap experts and the shared expert
            out = d.forward_experts(x, topk_idx, probs, self.experts, self.shared_experts)  # [T, h]
        else:
            permuted = d.dispatch_preprocess(x, topk_idx)  # [N_send, h]
            received = d.token_dispatch(permuted)  # [N_recv, h]
            x_sorted, tokens_per_local_expert = d.dispatch_postprocess(received)  # [N_recv, h], [E_local]
            y_sorted = self.experts(x_sorted, tokens_per_local_expert)  # [N_recv, h]
            y = d.token_combine(d.combine_preprocess(y_sorted))  # [N_send, h]
            out = d.combine_postprocess(y, probs)  # [T, h]
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)

        dropless = self.router.capacity_factor is None  # the router drops nothing: no -1 in topk_idx
        if dropless:
            if self.last_dropped.device != topk_idx.device:
                self.last_dropped = torch.zeros((), dtype=torch.int64, device=topk_idx.device)
        else:
            self.last_dropped = (topk_idx < 0).sum()
        # Counted only with grad enabled so that eval and reentrant-checkpoint recompute
        # forwards do not count twice (Megatron's rule for its expert-bias counts), and not in
        # our recompute (parallel.recompute), whose second forward has grad enabled.
        if torch.is_grad_enabled() and not is_recomputing():
            with torch.no_grad():
                counts = self.router.last_counts if dropless else None  # [E]: the fused router counted them
                if counts is None:
                    # a discard bin E collects dropped copies and padding tokens (no boolean
                    # indexing: that would read a size back from the device)
                    num_experts = self.tokens_per_expert.numel()
                    kept_idx = topk_idx.masked_fill(topk_idx < 0, num_experts)  # [T, K]
                    if padding_mask is not None:
                        kept_idx = kept_idx.masked_fill(padding_mask[:, None], num_experts)
                    counts = count_experts(kept_idx, num_experts)
                self.tokens_per_expert += counts.to(self.tokens_per_expert.device)
                self.dispatch_overflow += self.last_dispatch_overflow.to(self.dispatch_overflow.device)
        return out.view(s, b, h), None


def _load_hf_moe(layer, hf_state_dict, prefix: str, shared_name: str, extra) -> None:
    """Copies a transformers MoE block (router `gate`, experts fused as gate_up_proj [E, 2F, h]
    (gate rows, then up) and down_proj [E, h, F], a SwiGLU shared MLP `shared_name`) into our
    MoELayer: router.weight [E, h], this EP rank's experts.weight1 [E_local, h, 2F] (gate | up)
    and weight2 [E_local, F, h], shared_experts.linear_fc1 [2Fs, h] (gate | up) and linear_fc2.
    extra: {HF key: (HF shape, our tensor)} copied as they are. Every key is checked first:
    unexpected, missing and wrongly shaped ones raise ValueError naming them."""
    router, experts, shared = layer.router, layer.experts, layer.shared_experts
    E, h = router.weight.shape
    F, Fs = experts.weight2.shape[1], shared.linear_fc2.weight.shape[1]
    local = slice(layer.local_expert_indices[0], layer.local_expert_indices[-1] + 1)

    def to_ours(t):  # [E, out, in] -> this rank's [E_local, in, out]
        return t[local].transpose(1, 2)

    fc1 = shared.linear_fc1.weight
    targets = {  # HF key: (HF shape, our tensor (a view where HF splits it), HF -> our layout)
        "gate.weight": ((E, h), router.weight, None),
        "experts.gate_up_proj": ((E, 2 * F, h), experts.weight1, to_ours),
        "experts.down_proj": ((E, h, F), experts.weight2, to_ours),
        f"{shared_name}.gate_proj.weight": ((Fs, h), fc1[:Fs], None),
        f"{shared_name}.up_proj.weight": ((Fs, h), fc1[Fs:], None),
        f"{shared_name}.down_proj.weight": ((h, Fs), shared.linear_fc2.weight, None),
        **{k: (shape, dest, None) for k, (shape, dest) in extra.items()},
    }
    sd = {k[len(prefix):]: v for k, v in hf_state_dict.items() if k.startswith(prefix)}
    unexpected = sorted(prefix + k for k in sd if k not in targets)
    if unexpected:
        raise ValueError(
            f"hf_state_dict: unexpected keys {unexpected}; this MoE block takes only "
            f"{sorted(prefix + k for k in targets)} (per-expert keys: stack them into gate_up_proj / down_proj)"
        )
    missing = sorted(prefix + k for k in targets if k not in sd)
    if missing:
        raise ValueError(f"hf_state_dict: missing {missing}")
    for k, (shape, _, _) in targets.items():
        if tuple(sd[k].shape) != shape:
            raise ValueError(
                f"hf_state_dict[{prefix + k!r}]: shape {tuple(sd[k].shape)}, expected {shape} from this layer "
                f"(E={E}, h={h}, F={F}, Fs={Fs}); check the expert count and the expert and shared-expert sizes"
            )
    with torch.no_grad():
        for k, (_, dest, convert) in targets.items():
            dest.copy_((sd[k] if convert is None else convert(sd[k])).to(dest.dtype))


def load_hf_qwen3_next_moe(layer, hf_state_dict, prefix: str = "") -> None:
    """Copies a transformers Qwen3NextSparseMoeBlock state dict into our MoELayer (this EP
    rank's experts): see _load_hf_moe, plus shared_expert_gate.weight [1, h] -> the shared
    expert's gate_weight."""
    shared = layer.shared_experts
    if shared is None or shared.gate_weight is None:
        raise ValueError(
            "layer: Qwen3-Next's MoE has a gated shared expert; build the layer with "
            "moe.shared_expert_ffn_hidden_size > 0 and moe.shared_expert_gate=True"
        )
    h = layer.router.weight.shape[1]
    _load_hf_moe(layer, hf_state_dict, prefix, "shared_expert", {"shared_expert_gate.weight": ((1, h), shared.gate_weight)})


def load_hf_deepseek_v32_moe(layer, hf_state_dict, prefix: str = "") -> None:
    """Copies a transformers DeepseekV32MoE state dict into our MoELayer (this EP rank's experts):
    see _load_hf_moe (on disk transformers stores experts.<e>.{gate,up,down}_proj and fuses them
    on load), plus gate.e_score_correction_bias [E] -> router.expert_bias, the bias added only
    to choose the experts. The shared MLP is n_shared_experts * moe_intermediate_size wide."""
    router, shared = layer.router, layer.shared_experts
    if router.expert_bias is None or shared is None:
        raise ValueError(
            "layer: DeepSeek-V3.2's MoE has an expert bias (gate.e_score_correction_bias) and shared experts; "
            "build the layer with moe.expert_bias=True and moe.shared_expert_ffn_hidden_size = "
            "n_shared_experts * moe_intermediate_size"
        )
    if shared.gate_weight is not None:
        raise ValueError("layer: DeepSeek-V3.2's shared experts have no output gate; set moe.shared_expert_gate=False")
    extra = {"gate.e_score_correction_bias": ((router.weight.shape[0],), router.expert_bias)}
    _load_hf_moe(layer, hf_state_dict, prefix, "shared_experts", extra)
