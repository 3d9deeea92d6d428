"""Gradient synchronisation and clipping for data + expert parallelism (CPU/gloo or NCCL).

Conventions (Megatron's): expert parameters carry `param.allreduce = False`. Dense parameters
are replicated on every data-parallel rank; expert parameters are sharded over the
expert-parallel group and replicated over the expert-data-parallel group.

Each rank's loss is the mean over its own tokens and the global loss is the mean over the
data-parallel ranks, so every gradient is summed over its replicas and divided by the
data-parallel size. Expert gradients already hold the contributions of every EP rank's
tokens (the all-to-all brought them), hence the same 1/dp factor.
"""

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def is_expert_param(p: torch.nn.Parameter) -> bool:
    return not getattr(p, "allreduce", True)


@dataclass
class ParallelGroups:
    dp: Optional[ProcessGroup]  # dense replicas
    expert_dp: Optional[ProcessGroup]  # replicas of this rank's experts
    ep: Optional[ProcessGroup]  # expert shards
    dp_size: int

    @classmethod
    def from_parallel_state(cls) -> "ParallelGroups":
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            return cls(None, None, None, 1)
        return cls(
            dp=ps.get_data_parallel_group(),
            expert_dp=ps.get_expert_data_parallel_group(),
            ep=ps.get_expert_model_parallel_group(),
            dp_size=ps.get_data_parallel_world_size(),
        )


def _size(group: Optional[ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _flat_all_reduce(tensors: list[torch.Tensor], group: Optional[ProcessGroup]) -> None:
    """One all-reduce (sum) over a flat copy of the tensors, then scattered back."""
    if not tensors or _size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def sync_gradients(params: Iterable[torch.nn.Parameter], groups: ParallelGroups) -> None:
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:  # keep every rank's flat buffer the same length
            p.grad = torch.zeros_like(p)
    dense = [p.grad for p in params if not is_expert_param(p)]
    expert = [p.grad for p in params if is_expert_param(p)]
    _flat_all_reduce(dense, groups.dp)
    _flat_all_reduce(expert, groups.expert_dp)
    if groups.dp_size > 1:
        for g in dense + expert:
            g.div_(groups.dp_size)


def global_grad_norm(params: Iterable[torch.nn.Parameter], groups: ParallelGroups) -> float:
    """L2 norm over all gradients of the model, expert shards included (fp32)."""
    params = [p for p in params if p.grad is not None]
    dense_sq = sum((p.grad.float().pow(2).sum() for p in params if not is_expert_param(p)), torch.zeros(()))
    expert_sq = sum((p.grad.float().pow(2).sum() for p in params if is_expert_param(p)), torch.zeros(()))
    expert_sq = expert_sq.reshape(1).clone()
    if _size(groups.ep) > 1:
        dist.all_reduce(expert_sq, group=groups.ep)
    return math.sqrt(float(dense_sq) + float(expert_sq))


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float) -> None:
    if max_norm <= 0 or not math.isfinite(total_norm) or total_norm <= max_norm:
        return
    scale = max_norm / (total_norm + 1e-6)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)


def all_reduce_mean(value: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    value = value.detach().float().clone()
    if _size(group) > 1:
        dist.all_reduce(value, group=group)
        value /= _size(group)
    return value
