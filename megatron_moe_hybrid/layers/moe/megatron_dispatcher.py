"""StaticAllToAllDispatcher behind Megatron-Core's own MoE layer (MoETokenDispatcher's six steps).

Select it through the spec: `megatron_moe_spec()` returns a ModuleSpec of
MegatronMoELayerWithStaticDispatcher, Megatron's MoELayer with its dispatcher replaced; router,
experts, shared expert, aux losses and forward stay Megatron's.

    spec = megatron_moe_spec(experts="sequential")  # or "grouped", or your own experts spec
    layer = build_module(spec, config=config)      # config.num_moe_experts, moe_router_topk, ...

Megatron's experts (SequentialMLP, TEGroupedMLP) apply the routing probs themselves, so the
dispatcher carries them with the tokens (permuted_probs) and its combine is the plain sum.
Those experts split their rows with tokens_per_expert.tolist(): the padding tail of the static
buffers must go, which reads the counts on the host once per forward (as Megatron's alltoall
dispatcher does). Experts that declare `accepts_padded_rows = True` (MegatronGroupedExperts)
take the padded buffer and device counts: no host sync in the dispatcher.

Every EP rank must pass the same [s, b]: the buffer sizes derive from the local token count.

Shape legend:
    s, b  sequence, micro-batch     T = s * b local tokens      h hidden size
    E     experts (global)          E_local = E / ep            K experts per token
    C     rows per (source, destination) rank pair              N = sum(tokens_per_expert)
"""

import copy
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_moe_hybrid.layers.moe.dispatcher import StaticAllToAllDispatcher
from megatron_moe_hybrid.layers.moe.experts import GroupedExperts


def _allow_router_gemm_without_te() -> None:
    """Megatron's router_gating_linear tests `te_general_gemm is not None`, but moe_utils only
    defines that name when Transformer Engine imports: without TE, a non-fp64 router raises
    NameError. None selects its plain torch.mm path."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class PortableTopKRouter(TopKRouter):
    """Megatron's TopKRouter whose gate runs on the device of its input.

    Megatron's gating() moves CPU-initialised weights to torch.cuda.current_device(), which
    fails on a CPU-only machine; moving them to the input's device is the same on a GPU.
    (Its expert-bias and global-aux-loss buffers are still created on CUDA: off on CPU.)
    """

    def __init__(self, config, pg_collection=None):
        _allow_router_gemm_without_te()
        super().__init__(config=config, pg_collection=pg_collection)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        for param in (self.weight, self.bias):
            if param is not None and param.device != input.device:
                param.data = param.data.to(input.device)
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return moe_utils.router_gating_linear(input, self.weight, self.bias, router_dtype)


class MegatronStaticDispatcher(MoETokenDispatcher):
    """Megatron's six dispatcher steps over a StaticAllToAllDispatcher (see the module docstring).

    trim_padding True: dispatch_postprocess returns exactly N rows and host counts (one host
    sync), for experts that split rows with tokens_per_expert.tolist(); False: R rows, the
    padding tail last, and device counts, for experts that accept padded rows.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config,
        pg_collection=None,
        capacity_factor: float | None = 2.0,
        permute_backend: str = "auto",
        trim_padding: bool = True,
    ):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size > 1:
            raise ValueError(
                f"expert_tensor_parallel_size={self.tp_size}: MegatronStaticDispatcher moves whole "
                "expert rows over the EP group only; set expert_tensor_parallel_size=1"
            )
        self.static = StaticAllToAllDispatcher(
            config.num_moe_experts, self.ep_group, permute_backend, capacity_factor, num_chunks=1
        )
        first = self.static.ep_rank * self.static.num_local_experts
        if list(local_expert_indices) != list(range(first, first + self.static.num_local_experts)):
            raise ValueError(
                f"local_expert_indices={list(local_expert_indices)}: the static dispatcher places experts "
                f"contiguously by EP rank, expected {first}..{first + self.static.num_local_experts - 1}"
            )
        if num_local_experts != self.static.num_local_experts:
            raise ValueError(f"num_local_experts={num_local_experts}, expected {self.static.num_local_experts}")
        self.num_local_experts = num_local_experts
        self.topk = config.moe_router_topk
        self.trim_padding = trim_padding

    @property
    def last_overflow(self) -> torch.Tensor:
        """[] int64 (device): routed copies of the last forward that the receive capacities left uncomputed."""
        return self.static.last_overflow

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """tokens [s, b, h], routing_map [T, E] bool, probs [T, E] -> (send [ep * C, h],
        send_probs [ep * C, K]: the routing weight of each sent entry, 0 where none)."""
        self.hidden_shape = tokens.shape
        x = tokens.reshape(-1, tokens.shape[-1])  # [T, h]
        want = (x.shape[0], self.config.num_moe_experts)
        if routing_map.shape != want or routing_map.dtype != torch.bool:
            raise ValueError(
                f"routing_map must be a [T, E] = {want} bool tensor, got {routing_map.dtype} {tuple(routing_map.shape)}"
            )
        if probs.shape != want:
            raise ValueError(f"probs must be [T, E] = {want} like routing_map, got {tuple(probs.shape)}")
        # The router marks at most K experts per token; a token left with fewer (capacity
        # drops) gets -1 in the spare slots. topk on int8 avoids a host sync to count them.
        kept, topk_idx = torch.topk(routing_map.to(torch.int8), k=self.topk, dim=1)  # [T, K] each
        topk_idx = torch.where(kept > 0, topk_idx, -1)  # [T, K]
        probs_tk = probs.gather(1, topk_idx.clamp(min=0))  # [T, K]; dropped copies are never sent
        send = self.static.dispatch_preprocess(x, topk_idx, probs_tk)  # [ep * C, h]
        return send, self.static.state.send_probs  # the weights travel inside token_dispatch

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """[ep * C, h] -> the same shape as [source][slot] blocks of C rows; the routing weights
        and expert ids travel in the same step (probs is passed through for Megatron's loop)."""
        return self.static.token_dispatch(hidden_states), probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """-> (dispatched_input [N or R, h] grouped by local expert, tokens_per_expert
        [E_local] int64, permuted_probs [N or R]: the routing weight of each row)."""
        x_sorted, counts = self.static.dispatch_postprocess(hidden_states)  # [R, h], [E_local]
        probs_sorted = self.static.permuted_probs()  # [R]
        self.static.release()  # the combine needs no weights: none of the graph stays on the module
        self.padded_rows = x_sorted.shape[0]
        if not self.trim_padding:
            return x_sorted, counts, probs_sorted
        counts = counts.cpu()  # the documented host sync (see the class docstring)
        num_rows = int(counts.sum())
        return x_sorted[:num_rows], counts, probs_sorted[:num_rows]

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N or R, h] expert outputs (weights applied) -> [ep * C, h]: per received token, the
        sum over its local experts."""
        tail = self.padded_rows - hidden_states.shape[0]
        if tail:  # the trimmed padding rows: never read by the combine, any value will do
            hidden_states = torch.cat([hidden_states, hidden_states.new_zeros(tail, hidden_states.shape[1])])
        return self.static.combine_preprocess(hidden_states, weighted=False)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[ep * C, h] -> [ep * C, h], back on the rank that owns the tokens."""
        return self.static.token_combine(hidden_states)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[ep * C, h] -> [s, b, h]: each token's rows from its destination ranks, summed."""
        return self.static.combine_postprocess(hidden_states).view(self.hidden_shape)


class MegatronGroupedExperts(GroupedExperts):
    """Our GroupedExperts (SwiGLU, grouped GEMM) with Megatron's experts interface:
    forward(rows, tokens_per_expert, permuted_probs) -> (out, None), probs applied to the
    output. Takes the static dispatcher's padded rows and device counts (no host sync)."""

    accepts_padded_rows = True

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):
        if not config.gated_linear_unit or config.activation_func is not F.silu or config.add_bias_linear:
            raise ValueError(
                "MegatronGroupedExperts computes a bias-free SwiGLU: set gated_linear_unit=True, "
                "activation_func=torch.nn.functional.silu and add_bias_linear=False, or use experts='sequential'"
            )
        if pg_collection is None:
            pg_collection = moe_utils.get_default_pg_collection()
        ep_rank = dist.get_rank(pg_collection.ep)
        # GroupedExperts reads the expert FFN size from config.moe, Megatron's from moe_ffn_hidden_size
        own_config = copy.copy(config)
        own_config.moe = types.SimpleNamespace(ffn_hidden_size=config.moe_ffn_hidden_size)
        super().__init__(own_config, num_local_experts, expert_offset=ep_rank * num_local_experts)

    def forward(self, x_sorted, tokens_per_expert, permuted_probs):
        out = super().forward(x_sorted, tokens_per_expert)  # [N, h]
        return out * permuted_probs[:, None].to(out.dtype), None


class MegatronMoELayerWithStaticDispatcher(MoELayer):
    """Megatron's MoELayer whose token_dispatcher is a MegatronStaticDispatcher.

    dispatch_capacity_factor and permute_backend are StaticAllToAllDispatcher's capacity_factor
    and permute_backend (a factor >= ep, or None, never overflows).
    """

    def __init__(
        self,
        config,
        submodules: MoESubmodules | None = None,
        layer_number: int | None = None,
        pg_collection=None,
        dispatch_capacity_factor: float | None = 2.0,
        permute_backend: str = "auto",
    ):
        if config.moe_shared_expert_overlap:
            raise ValueError(
                "moe_shared_expert_overlap=True is not supported with MegatronStaticDispatcher: "
                "set it False (the shared expert then runs before the dispatch)"
            )
        _allow_router_gemm_without_te()
        if pg_collection is None:
            pg_collection = moe_utils.get_default_pg_collection()
        # MoELayer.__init__ builds the dispatcher named in the config before we replace it:
        # "alltoall" creates CUDA streams and "flex" needs DeepEP, "allgather" only stores fields.
        requested = config.moe_token_dispatcher_type
        config.moe_token_dispatcher_type = "allgather"
        try:
            super().__init__(config, submodules, layer_number, pg_collection)
        finally:
            config.moe_token_dispatcher_type = requested
        self.token_dispatcher = MegatronStaticDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config,
            pg_collection,
            capacity_factor=dispatch_capacity_factor,
            permute_backend=permute_backend,
            trim_padding=not getattr(self.experts, "accepts_padded_rows", False),
        )


_MLP = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
EXPERT_SPECS = {
    # name: routed experts; "sequential" is Megatron's per-expert loop (one host sync a forward)
    "sequential": ModuleSpec(module=SequentialMLP, submodules=_MLP),
    "grouped": ModuleSpec(module=MegatronGroupedExperts),
}


def megatron_moe_spec(
    experts: str | ModuleSpec | type = "sequential",
    shared_expert: bool = False,
    dispatch_capacity_factor: float | None = 2.0,
    permute_backend: str = "auto",
) -> ModuleSpec:
    """The ModuleSpec of a Megatron MoE layer with the static dispatcher: experts is a name
    from EXPERT_SPECS or any Megatron experts spec (e.g. TEGroupedMLP's); shared_expert adds
    Megatron's SharedExpertMLP (sized by config.moe_shared_expert_intermediate_size)."""
    if isinstance(experts, str):
        if experts not in EXPERT_SPECS:
            raise ValueError(f"experts={experts!r} is unknown: use one of {sorted(EXPERT_SPECS)} or a ModuleSpec")
        experts = EXPERT_SPECS[experts]
    return ModuleSpec(
        module=MegatronMoELayerWithStaticDispatcher,
        submodules=MoESubmodules(
            experts=experts,
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=_MLP) if shared_expert else None,
            router=PortableTopKRouter,
        ),
        params={"dispatch_capacity_factor": dispatch_capacity_factor, "permute_backend": permute_backend},
    )
