"""LoRA adapters over a frozen base: linears (Megatron's or torch's) and grouped experts.

Shape legend: N rows (tokens), r rank, E experts of this EP rank, h hidden size,
F expert FFN size, tp tensor-parallel size.
  linear:            x [..., in], A [r, in], B [out, r], y = base(x) + s * x A^T B^T
  column-parallel:   A [r, in] replicated, B [out/tp, r] sharded like the base output
  row-parallel:      A [r, in/tp] sharded like the input, B [out, r] replicated
  experts (per_expert): A1 [E, r, h], B1 [E, 2F, r], A2 [E, r, F], B2 [E, h, r]
  experts (shared):     A1 [r, h], B1 [2F, r], A2 [r, F], B2 [h, r]
s = alpha / r, or alpha / sqrt(r) with rsLoRA. B starts at zero, so an adapted model first
computes exactly what its base does.

Tensor parallelism adds no collective to the forward or backward of a layer: the adapter of
a column-parallel linear reads the same copied input and its input gradient joins the base's
single all-reduce; the adapter of a row-parallel linear adds its partial product before the
base's single all-reduce. The price is that the replicated factor's gradient (A of a column,
B of a row) is this rank's partial sum: call allreduce_lora_partial_grads(model) once per
step, after backward and before clipping (it does nothing at tp = 1).
"""

import math
import re
import zlib
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from megatron_moe_hybrid.ops.moe.grouped import grouped_matmul

_LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
EXPERT_ADAPTERS = ("per_expert", "shared")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def lora_scale(rank: int, alpha: float, rslora: bool = False) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _seed(base_seed: int, path: str) -> int:
    # A stable per-module seed: adapters do not depend on module order or on the TP/EP layout.
    return (base_seed + zlib.crc32(path.encode())) % 2**62


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """param <- value (this rank's whole tensor, on the CPU); a DTensor (FSDP2) takes its shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            value = distribute_tensor(value.to(param.to_local().device), param.device_mesh, param.placements,
                                      src_data_rank=None)
        param.copy_(value)


def _init_a_(a: torch.Tensor, fan_in: int, seed: int) -> None:
    """PEFT's kaiming_uniform(a=sqrt(5)) bound, 1 / sqrt(fan_in), drawn from its own seed."""
    bound = 1.0 / math.sqrt(fan_in)
    with torch.random.fork_rng(devices=[]):  # devices=[] keeps fork_rng off CUDA
        torch.manual_seed(seed)
        a.uniform_(-bound, bound)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear over the rows of x [..., in]. A 3-D input whose strides matmul will not fold
    (Megatron's [s, 1, h] made by a transpose) would otherwise run as a batched GEMV that
    reads the weight once per token (about 60 ms a call at 32k tokens in an H200 profile)."""
    return F.linear(x.reshape(-1, x.shape[-1]), w, bias).view(*x.shape[:-1], w.shape[0])


def _compute_dtype(x: torch.Tensor, adapter: torch.Tensor) -> torch.dtype:
    """Adapters compute in the narrower of the activations' and their own dtype: fp32 adapters
    (the optimizer's master copy) over bf16 activations run bf16 GEMMs, as under autocast."""
    return x.dtype if x.element_size() < adapter.element_size() else adapter.dtype


def _tp_info(base: nn.Module) -> tuple[int, int, Optional[dist.ProcessGroup]]:
    """(tp_rank, tp_size, tp_group) of a Megatron linear; (0, 1, None) for torch's."""
    group = getattr(base, "tp_group", None)
    if group is None or not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        return 0, 1, None
    return dist.get_rank(group), dist.get_world_size(group), group


def _all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _my_slice_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()


# Megatron's gather/scatter mappings allocate on the current CUDA device; these two stay on
# the input's device, so tensor parallelism also runs on CPU (gloo).
class _GatherLastDim(torch.autograd.Function):
    """Forward: all-gather along the last dim; backward: this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_slice_last_dim(grad, ctx.group), None


class _ScatterLastDim(torch.autograd.Function):
    """Forward: this rank's slice of the last dim; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_slice_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad, ctx.group), None


class LoRALinear(nn.Module):
    """Wraps a linear; returns what the base returns (a tensor, or Megatron's (out, bias)).

    The Megatron forwards are re-implemented around the base weight so the adapter shares
    the base's communication (see the module docstring). The base computes in its own dtype
    (bf16 when the frozen base is cast down), the adapter in its own (fp32).
    """

    def __init__(
        self,
        base: nn.Module,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        rslora: bool = False,
        seed: int = 0,
        adapter_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if getattr(base, "sequence_parallel", False) or getattr(base, "explicit_expert_comm", False):
            raise ValueError(
                f"base: LoRA does not support sequence-parallel or expert linears ({type(base).__name__}); "
                "turn sequence_parallel off"
            )
        self.base = base
        self.rank, self.alpha, self.rslora = rank, alpha, rslora
        self.scale = lora_scale(rank, alpha, rslora)
        self.merged = False
        dtype = adapter_dtype or base.weight.dtype
        out_local, in_local = base.weight.shape  # [out(/tp), in(/tp)]
        tp_rank, tp, _ = _tp_info(base)
        self.is_row = isinstance(base, RowParallelLinear)
        in_full = in_local * tp if self.is_row else in_local
        device = base.weight.device  # drawn on the CPU (seeded), kept where the base lives
        self._init_args = (seed, in_full, in_local, tp_rank)
        self.lora_A = nn.Parameter(self._initial_a(dtype).to(device, copy=True))
        self.lora_B = nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        if tp > 1:
            sharded, replicated, dim = (
                (self.lora_A, self.lora_B, 1) if self.is_row else (self.lora_B, self.lora_A, 0)
            )
            set_tensor_model_parallel_attributes(sharded, True, dim, 1)
            replicated.lora_tp_partial_grad = True
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def _initial_a(self, dtype) -> torch.Tensor:
        """This rank's A as initialised (CPU): every TP rank draws the same [r, in]; a row-parallel
        linear keeps its columns (A sharded like the input), a column one all of it."""
        seed, in_full, in_local, tp_rank = self._init_args
        a_full = torch.empty(self.rank, in_full, dtype=dtype)
        _init_a_(a_full, in_full, seed)
        return a_full[:, tp_rank * in_local : (tp_rank + 1) * in_local] if self.is_row else a_full

    def _materialize(self, device) -> None:
        """After a meta-device build (models.materialize): the adapter drawn again, B zero."""
        _assign(self.lora_A, self._initial_a(self.lora_A.dtype))
        _assign(self.lora_B, torch.zeros(self.lora_B.shape, dtype=self.lora_B.dtype))

    @property
    def weight(self):
        return self.base.weight

    def delta_weight(self) -> torch.Tensor:
        """[out(/tp), in(/tp)] s * B A: this rank's block of the weight delta (merge only)."""
        return (self.lora_B @ self.lora_A) * self.scale

    def _plus_adapter(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + s * (x A^T) B^T. The scale goes on the rank-r product, and where the adapter
        computes in out's dtype the sum is the second GEMM's epilogue (addmm): no pass over
        the [..., out] tensor besides the GEMM's own."""
        dtype = _compute_dtype(x, self.lora_A)
        u = _linear(self.dropout(x).to(dtype), self.lora_A.to(dtype)) * self.scale  # [..., r]
        b = self.lora_B.to(dtype)
        if dtype != out.dtype:
            return out + _linear(u, b).to(out.dtype)
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), u.reshape(-1, u.shape[-1]), b.t())
        return flat.view(out.shape)  # [..., out(/tp)]

    def _base_linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        w = self.base.weight
        return _linear(x.to(w.dtype), w, None if bias is None else bias.to(w.dtype)).to(x.dtype)

    def forward(self, x, *args, **kwargs):
        base = self.base
        if isinstance(base, ColumnParallelLinear):
            return self._column_forward(x, *args, **kwargs)
        if isinstance(base, RowParallelLinear):
            return self._row_forward(x)
        out = self._base_linear(x, base.bias)
        return out if self.merged else self._plus_adapter(out, x)

    def _column_forward(self, x, weight=None, runtime_gather_output=None):
        base = self.base
        if weight is not None:
            raise ValueError("weight: a LoRA-wrapped ColumnParallelLinear uses its own weight; pass None")
        _, tp, group = _tp_info(base)
        # Identity forward, all-reduce backward: the base's one reduction, now summing the
        # input gradients of both the base and the adapter.
        x_par = copy_to_tensor_model_parallel_region(x, group=group) if tp > 1 else x
        out = self._base_linear(x_par, None if base.skip_bias_add else base.bias)  # [..., out/tp]
        if not self.merged:
            out = self._plus_adapter(out, x_par)
        gather = base.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and tp > 1:
            out = _GatherLastDim.apply(out, group)
        return out, base.bias if base.skip_bias_add else None

    def _row_forward(self, x):
        base = self.base
        _, tp, group = _tp_info(base)
        x_par = x if base.input_is_parallel or tp == 1 else _ScatterLastDim.apply(x, group)
        partial = self._base_linear(x_par, None)  # [..., out], this rank's share of the sum
        if not self.merged:
            partial = self._plus_adapter(partial, x_par)
        out = reduce_from_tensor_model_parallel_region(partial, group=group) if tp > 1 else partial
        if base.skip_bias_add:
            return out, base.bias
        return (out + base.bias if base.bias is not None else out), None

    def merge(self) -> None:
        if not self.merged:
            with torch.no_grad():
                self.base.weight += self.delta_weight().to(self.base.weight.dtype)
            self.merged = True

    def unmerge(self) -> None:
        if self.merged:
            with torch.no_grad():
                self.base.weight -= self.delta_weight().to(self.base.weight.dtype)
            self.merged = False


class LoRAGroupedExperts(nn.Module):
    """Adapters on both SwiGLU expert matmuls, computed as grouped low-rank matmuls.

    The per-expert weight delta is never formed: each expert's rows go through (x A^T) B^T.
    per_expert: stacked adapters, sharded by EP like the experts (allreduce=False,
    num_local_experts). shared: one adapter for every expert, an ordinary dense parameter.
    """

    def __init__(
        self,
        base: nn.Module,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        rslora: bool = False,
        expert_adapter: str = "per_expert",
        seed: int = 0,
        adapter_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if expert_adapter not in EXPERT_ADAPTERS:
            raise ValueError(f"expert_adapter: {expert_adapter!r} is not one of {', '.join(EXPERT_ADAPTERS)}")
        self.base = base
        self.rank, self.alpha, self.rslora = rank, alpha, rslora
        self.expert_adapter = expert_adapter
        self.scale = lora_scale(rank, alpha, rslora)
        self.merged = False
        w1, w2 = base.weight1, base.weight2  # [E, h, 2F], [E, F, h]
        e, h, f2 = w1.shape
        f = w2.shape[1]
        dtype = adapter_dtype or w1.dtype
        self.per_expert = expert_adapter == "per_expert"
        lead = (e,) if self.per_expert else ()
        device = w1.device  # A drawn on the CPU (seeded), kept where the base lives
        self._init_args = (seed, e, h, f)
        a1, a2 = self._initial_a(dtype)
        self.lora_A1 = nn.Parameter(a1.to(device))
        self.lora_B1 = nn.Parameter(torch.zeros(*lead, f2, rank, dtype=dtype, device=device))
        self.lora_A2 = nn.Parameter(a2.to(device))
        self.lora_B2 = nn.Parameter(torch.zeros(*lead, h, rank, dtype=dtype, device=device))
        if self.per_expert:
            for p in (self.lora_A1, self.lora_B1, self.lora_A2, self.lora_B2):
                p.allreduce = False  # Megatron's marker: sharded by EP, skip the dense DP all-reduce
                p.num_local_experts = e
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def _initial_a(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A1 [(E,) r, h] and A2 [(E,) r, F] as initialised (CPU). Per expert, seeded by global
        expert index: any EP layout holds the slice of the same full set."""
        seed, e, h, f = self._init_args
        lead = (e,) if self.per_expert else ()
        a1, a2 = torch.empty(*lead, self.rank, h, dtype=dtype), torch.empty(*lead, self.rank, f, dtype=dtype)
        if self.per_expert:
            offset = getattr(self.base, "expert_offset", 0)
            for i in range(e):
                _init_a_(a1[i], h, seed + 2 * (offset + i))
                _init_a_(a2[i], f, seed + 2 * (offset + i) + 1)
        else:
            _init_a_(a1, h, seed)
            _init_a_(a2, f, seed + 1)
        return a1, a2

    def _materialize(self, device) -> None:
        """After a meta-device build (models.materialize): the adapters drawn again, B zero."""
        a1, a2 = self._initial_a(self.lora_A1.dtype)
        _assign(self.lora_A1, a1)
        _assign(self.lora_A2, a2)
        for b in (self.lora_B1, self.lora_B2):
            _assign(b, torch.zeros(b.shape, dtype=b.dtype))

    @property
    def weight1(self):
        return self.base.weight1

    @property
    def weight2(self):
        return self.base.weight2

    @property
    def num_local_experts(self) -> int:
        return self.base.weight1.shape[0]

    @property
    def expert_offset(self) -> int:
        return getattr(self.base, "expert_offset", 0)

    def _adapter(self, x, a, b, counts) -> torch.Tensor:
        """x [N, in] -> [N, out]: s * (x A_e^T) B_e^T per expert, or with the one shared A, B."""
        dtype = _compute_dtype(x, a)
        x, a, b = self.dropout(x).to(dtype), a.to(dtype), b.to(dtype)
        if not self.per_expert:
            # Rows past the counted ones are the static dispatcher's padding and may hold
            # anything (NaN on the GPU): a dense adapter would carry them into its gradient.
            # Their incoming gradients are as unspecified (the grouped GEMM's backward leaves
            # them): mask the output too, so that no padding row reaches A or B either way.
            total = counts.sum() if torch.is_tensor(counts) else sum(counts)  # no host sync
            valid = (torch.arange(x.shape[0], device=x.device) < total)[:, None]  # [N, 1]
            out = F.linear(F.linear(torch.where(valid, x, x.new_zeros(())), a) * self.scale, b)
            return torch.where(valid, out, out.new_zeros(()))
        u = grouped_matmul(x, a.transpose(1, 2), counts) * self.scale  # [N, r]: scaled where it is narrow
        return grouped_matmul(u, b.transpose(1, 2), counts)  # [N, out]

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        """x_sorted [N, h] grouped by local expert, tokens_per_expert [E] -> [N, h].

        The adapters ride into the base module's forward: under FSDP2 a shared adapter leaves
        the base experts their own sharded unit, gathered by their own forward hooks."""
        if self.merged:  # the unfused path all the same: merged and unmerged agree to rounding
            return self.base(x_sorted, tokens_per_expert, lambda x, c: x.new_zeros(()), None)
        return self.base(
            x_sorted,
            tokens_per_expert,
            lambda x, counts: self._adapter(x, self.lora_A1, self.lora_B1, counts),
            lambda act, counts: self._adapter(act, self.lora_A2, self.lora_B2, counts),
        )

    def delta_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """s * (B A)^T in the base layout: [E, h, 2F] and [E, F, h] (merge only)."""
        d1 = (self.lora_B1 @ self.lora_A1).transpose(-1, -2) * self.scale
        d2 = (self.lora_B2 @ self.lora_A2).transpose(-1, -2) * self.scale
        return d1.expand_as(self.base.weight1), d2.expand_as(self.base.weight2)

    def merge(self) -> None:
        if not self.merged:
            d1, d2 = self.delta_weights()
            with torch.no_grad():
                self.base.weight1 += d1.to(self.base.weight1.dtype)
                self.base.weight2 += d2.to(self.base.weight2.dtype)
            self.merged = True

    def unmerge(self) -> None:
        if self.merged:
            d1, d2 = self.delta_weights()
            with torch.no_grad():
                self.base.weight1 -= d1.to(self.base.weight1.dtype)
                self.base.weight2 -= d2.to(self.base.weight2.dtype)
            self.merged = False


def _target_of(path: str, module: nn.Module, parents: list[nn.Module]) -> str | None:
    """The lora.targets group a module belongs to, or None."""
    from megatron.core.transformer.mlp import MLP

    from megatron_moe_hybrid.layers.gated_attention import GatedAttention
    from megatron_moe_hybrid.layers.linear_attention import LinearAttention
    from megatron_moe_hybrid.layers.mla_attention import MLAttention
    from megatron_moe_hybrid.layers.moe.experts import GroupedExperts
    from megatron_moe_hybrid.layers.moe.moe_layer import MoELayer
    from megatron_moe_hybrid.layers.sparse_attention import SparseAttention

    if isinstance(module, GroupedExperts):
        return "experts"
    if not isinstance(module, _LINEARS):
        return None
    for parent in reversed(parents):
        if isinstance(parent, LinearAttention):
            return "linear_attention"
        if isinstance(parent, GatedAttention):
            return "full_attention"
        if isinstance(parent, (SparseAttention, MLAttention)):  # M is DSA sparse attention in MLA form
            return "indexer" if "index" in path.rsplit(".", 1)[-1].lower() else "sparse_attention"
        if isinstance(parent, MoELayer):
            return "shared_expert" if "shared" in path.lower() else None
        if isinstance(parent, MLP):
            return "dense_mlp"
    return None


def _listing(items: Iterable[str], limit: int = 12) -> str:
    items = list(items)
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def find_lora_targets(
    model: nn.Module, targets: Iterable[str], target_modules: Iterable[str] = ()
) -> list[tuple[nn.Module, str, str]]:
    """(parent, child name, full path) of every module to wrap.

    A module is taken when its group is in `targets` and, if `target_modules` is given, its
    full path matches one of the regexes (re.fullmatch); "attention" stands for every attention
    group (LORA_ATTENTION_TARGETS) the model has. A group or a pattern that selects nothing
    raises ValueError listing what this model has.
    """
    from megatron_moe_hybrid.registry import LORA_ATTENTION_TARGETS, LORA_TARGETS

    targets, patterns = list(targets), list(target_modules)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(f"lora.targets: unknown or empty {unknown or targets}; valid: {', '.join(LORA_TARGETS)}")
    groups: dict[str, list[tuple[nn.Module, str, str]]] = {}

    def walk(module: nn.Module, prefix: str, parents: list[nn.Module]):
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (LoRALinear, LoRAGroupedExperts)):
                raise ValueError(f"model: {path} already has a LoRA adapter; apply_lora once per model")
            group = _target_of(path, child, parents + [module])
            if group is not None:
                groups.setdefault(group, []).append((module, name, path))
                continue
            walk(child, path, parents + [module])

    walk(model, "", [])
    if "attention" in targets:
        kinds = [k for k in LORA_ATTENTION_TARGETS if k in groups]
        if not kinds:
            have = ", ".join(groups) or "none"
            raise ValueError(f"lora.targets: 'attention' matches no attention module of this model; its groups: {have}")
        targets = list(dict.fromkeys(k for t in targets for k in (kinds if t == "attention" else [t])))
    for t in targets:
        if t not in groups:
            have = ", ".join(f"{g} (e.g. {m[0][2]})" for g, m in groups.items())
            raise ValueError(f"lora.targets: {t!r} matches no module of this model; it has: {have}")
    candidates = [m for t in targets for m in groups[t]]
    if not patterns:
        return candidates
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"lora.target_modules: {p!r} is not a valid regular expression ({e})") from None
    for p, rx in zip(patterns, compiled):
        if not any(rx.fullmatch(path) for _, _, path in candidates):
            raise ValueError(
                f"lora.target_modules: {p!r} matches no module path of lora.targets {targets} "
                f"(patterns must match the whole path); paths: {_listing(c[2] for c in candidates)}"
            )
    return [c for c in candidates if any(rx.fullmatch(c[2]) for rx in compiled)]


def apply_lora(
    model: nn.Module,
    targets: Iterable[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    *,
    rslora: bool = False,
    expert_adapter: str = "per_expert",
    target_modules: Iterable[str] = (),
    base_dtype: Optional[str | torch.dtype] = None,
    adapter_dtype: Optional[str | torch.dtype] = None,
) -> list[str]:
    """Freezes the model and wraps the targeted modules in place; returns the wrapped paths.

    base_dtype (e.g. "bfloat16") casts the frozen weights of the wrapped modules; adapters
    are stored in adapter_dtype (default: the model's parameter dtype; "float32" over a bf16
    model gives the optimizer fp32 adapters while their GEMMs run in bf16). Draws one number
    from the global RNG (every adapter's init derives from it and its path), so call it with
    the same RNG state on every rank.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora.rank: must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"lora.alpha: must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora.dropout: must be within [0, 1), got {dropout!r}")
    if expert_adapter not in EXPERT_ADAPTERS:
        raise ValueError(f"lora.expert_adapter: {expert_adapter!r} is not one of {', '.join(EXPERT_ADAPTERS)}")
    if isinstance(base_dtype, str):
        if base_dtype not in _DTYPES:
            raise ValueError(f"lora.base_dtype: {base_dtype!r} is not one of {', '.join(_DTYPES)}")
        base_dtype = _DTYPES[base_dtype]
    if isinstance(adapter_dtype, str):
        if adapter_dtype not in _DTYPES:
            raise ValueError(f"lora.adapter_dtype: {adapter_dtype!r} is not one of {', '.join(_DTYPES)}")
        adapter_dtype = _DTYPES[adapter_dtype]
    found = find_lora_targets(model, targets, target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    base_seed = int(torch.randint(2**62, ()))
    for parent, name, path in found:
        child = getattr(parent, name)
        kw = dict(rslora=rslora, seed=_seed(base_seed, path), adapter_dtype=adapter_dtype or next(child.parameters()).dtype)
        if hasattr(child, "weight1"):
            wrapped = LoRAGroupedExperts(child, rank, alpha, dropout, expert_adapter=expert_adapter, **kw)
        else:
            wrapped = LoRALinear(child, rank, alpha, dropout, **kw)
        if base_dtype is not None:
            child.to(base_dtype)
        setattr(parent, name, wrapped)
    return [path for _, _, path in found]


def lora_modules(model: nn.Module):
    """(path, module) of every LoRA wrapper."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts))]


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """This process's adapters under the trainer's file names: per-expert adapters split as
    `<param>.expert<g>` with g the global expert index (TP is taken as 1)."""
    out = {}
    for path, m in lora_modules(model):
        for pname, p in m.named_parameters(recurse=False):
            name = f"{path}.{pname}"
            if isinstance(m, LoRAGroupedExperts) and m.per_expert:
                for i in range(p.shape[0]):
                    out[f"{name}.expert{m.expert_offset + i}"] = p[i].detach().clone()
            else:
                out[name] = p.detach().clone()
    return out


def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copies adapter_tensors()-named tensors into the model's adapters; every adapter of the
    model must be present with its shape (ValueError names what is missing)."""
    missing, wrong = [], []
    with torch.no_grad():
        for path, m in lora_modules(model):
            for pname, p in m.named_parameters(recurse=False):
                name = f"{path}.{pname}"
                if isinstance(m, LoRAGroupedExperts) and m.per_expert:
                    keys = [f"{name}.expert{m.expert_offset + i}" for i in range(p.shape[0])]
                    if any(k not in tensors for k in keys):
                        missing.append(keys[0])
                        continue
                    src = torch.stack([tensors[k] for k in keys])
                else:
                    if name not in tensors:
                        missing.append(name)
                        continue
                    src = tensors[name]
                if src.shape != p.shape:
                    wrong.append(f"{name} {tuple(src.shape)} vs {tuple(p.shape)}")
                    continue
                p.copy_(src)
    if missing or wrong:
        raise ValueError(
            f"tensors: adapter file does not match the model (same lora.rank, targets and expert_adapter?); "
            f"missing: {_listing(missing)}; wrong shape: {_listing(wrong)}"
        )


def allreduce_lora_partial_grads(model: nn.Module) -> None:
    """Sums the partial gradients of replicated TP factors over their TP group, one flat
    all-reduce per group (nothing at tp = 1). Call once per step after backward."""
    by_group: dict = {}
    for m in model.modules():
        if isinstance(m, LoRALinear):
            _, tp, group = _tp_info(m.base)
            for p in (m.lora_A, m.lora_B):
                if tp > 1 and getattr(p, "lora_tp_partial_grad", False) and p.grad is not None:
                    by_group.setdefault(group, []).append(p.grad)
    for group, grads in by_group.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def merge(model: nn.Module) -> int:
    """Folds every adapter into its base weight (the wrappers stay and skip their adapter);
    returns how many were merged. Exact for the forward in eval mode (dropout off)."""
    mods = [m for _, m in lora_modules(model) if not m.merged]
    for m in mods:
        m.merge()
    return len(mods)


def unmerge(model: nn.Module) -> int:
    """Subtracts what merge() added (to the rounding of the base dtype); returns the count."""
    mods = [m for _, m in lora_modules(model) if m.merged]
    for m in mods:
        m.unmerge()
    return len(mods)


def merge_lora_(model: nn.Module) -> None:
    """Folds every adapter into its base weight in place and unwraps it (no way back)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (LoRALinear, LoRAGroupedExperts)):
                child.merge()
                setattr(module, name, child.base)
