"""LoRA adapters over a frozen base: linears (Megatron's or torch's) and grouped experts.

Shapes: x [..., in], A [r, in], B [out, r]; experts: A1 [E, h, r], B1 [E, r, 2F],
A2 [E, F, r], B2 [E, r, h]. B starts at zero, so an adapted model first computes exactly
what its base does. Adapter tensors are plain (non-expert or expert-sharded) parameters, so
the data-parallel sync and the checkpoints treat them like any other parameter.

Tensor parallelism is not supported here yet (config validation keeps TP at 1).
"""

import math
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

_LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


class LoRALinear(nn.Module):
    """Wraps a linear; returns what the base returns (a tensor, or Megatron's (out, bias))."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        weight = base.weight  # [out, in]
        out_features, in_features = weight.shape
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, dtype=weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=weight.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x, *args, **kwargs):
        out = self.base(x, *args, **kwargs)
        delta = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scale
        if isinstance(out, tuple):
            return (out[0] + delta.to(out[0].dtype), *out[1:])
        return out + delta.to(out.dtype)


class LoRAGroupedExperts(nn.Module):
    """Per-expert adapters on both expert matmuls, computed as low-rank grouped matmuls.

    The full weight delta is never formed: each expert's tokens go through x A B.
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        w1, w2 = base.weight1, base.weight2  # [E, h, 2F], [E, F, h]
        e, h, f2 = w1.shape
        f = w2.shape[1]
        self.scale = alpha / rank
        self.lora_A1 = nn.Parameter(torch.empty(e, h, rank, dtype=w1.dtype))
        self.lora_B1 = nn.Parameter(torch.zeros(e, rank, f2, dtype=w1.dtype))
        self.lora_A2 = nn.Parameter(torch.empty(e, f, rank, dtype=w2.dtype))
        self.lora_B2 = nn.Parameter(torch.zeros(e, rank, h, dtype=w2.dtype))
        for a, fan_in in ((self.lora_A1, h), (self.lora_A2, f)):
            nn.init.uniform_(a, -1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))
        # Adapters are sharded like the experts they adapt.
        for p in (self.lora_A1, self.lora_B1, self.lora_A2, self.lora_B2):
            p.allreduce = False
            p.num_local_experts = e
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def weight1(self):
        return self.base.weight1

    @property
    def weight2(self):
        return self.base.weight2

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        counts = [int(c) for c in tokens_per_expert]
        outs = []
        for e, x_e in enumerate(torch.split(x_sorted, counts)):  # x_e [n_e, h]
            h1 = x_e @ self.base.weight1[e] + (self.dropout(x_e) @ self.lora_A1[e]) @ self.lora_B1[e] * self.scale
            a, b = h1.chunk(2, dim=-1)
            act = F.silu(a) * b  # [n_e, F]
            out = act @ self.base.weight2[e] + (self.dropout(act) @ self.lora_A2[e]) @ self.lora_B2[e] * self.scale
            outs.append(out)
        if not outs:
            return x_sorted.new_zeros(0, self.base.weight2.shape[-1])
        return torch.cat(outs)


def _target_of(path: str, module: nn.Module, parents: list[nn.Module]) -> str | None:
    """The lora.targets group a module belongs to, or None."""
    from megatron.core.transformer.mlp import MLP

    from megatron_moe_hybrid.layers.linear_attention import LinearAttention
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
        if isinstance(parent, SparseAttention):
            return "indexer" if "index" in path.lower() else "sparse_attention"
        if isinstance(parent, MoELayer):
            return "shared_expert" if "shared" in path.lower() else None
        if isinstance(parent, MLP):
            return "dense_mlp"
    return None


def apply_lora(model: nn.Module, targets: Iterable[str], rank: int, alpha: float, dropout: float = 0.0) -> list[str]:
    """Freezes the model and wraps the targeted modules in place; returns the wrapped paths."""
    targets = set(targets)
    for p in model.parameters():
        p.requires_grad_(False)
    found: list[tuple[nn.Module, str, str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str, parents: list[nn.Module]):
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            target = _target_of(path, child, parents + [module])
            if target is not None:
                if target in targets:
                    found.append((module, name, path, child))
                continue
            walk(child, path, parents + [module])

    walk(model, "", [])
    for parent, name, _, child in found:
        cls = LoRAGroupedExperts if hasattr(child, "weight1") else LoRALinear
        setattr(parent, name, cls(child, rank, alpha, dropout))
    return [path for _, _, path, _ in found]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def merge_lora_(model: nn.Module) -> None:
    """Folds every adapter into its base weight in place and unwraps it."""
    with torch.no_grad():
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, LoRALinear):
                    child.base.weight += (child.lora_B @ child.lora_A) * child.scale
                    setattr(module, name, child.base)
                elif isinstance(child, LoRAGroupedExperts):
                    child.base.weight1 += torch.bmm(child.lora_A1, child.lora_B1) * child.scale
                    child.base.weight2 += torch.bmm(child.lora_A2, child.lora_B2) * child.scale
                    setattr(module, name, child.base)
