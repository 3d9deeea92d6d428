"""Gradient synchronisation and clipping for data + expert parallelism (CPU/gloo or NCCL).

Conventions (Megatron's): expert parameters carry `param.allreduce = False`. Dense parameters
are replicated on every data-parallel rank; expert parameters are sharded over the
expert-parallel group and replicated over the expert-data-parallel group.

Each rank's loss is the mean over its own tokens and the global loss is the mean over the
data-parallel ranks, so every gradient is summed over its replicas and divided by the
data-parallel size. Expert gradients already hold the contributions of every EP rank's
tokens (the all-to-all brought them), hence the same 1/dp factor.

Under FSDP2 (parallel.fsdp) parameters are DTensors sharded over their mesh: FSDP itself
reduce-scatters their gradients, so sync_gradients leaves them alone, and the gradient norm
sums the squares of the local shards over the mesh that shards them.
"""

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def is_expert_param(p: torch.nn.Parameter) -> bool:
    return not getattr(p, "allreduce", True)


def is_fsdp_param(p: torch.nn.Parameter) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


@dataclass
class ParallelGroups:
    dp: Optional[ProcessGroup]  # dense replicas (data- and context-parallel ranks)
    expert_dp: Optional[ProcessGroup]  # replicas of this rank's experts
    ep: Optional[ProcessGroup]  # expert shards
    dp_size: int

    @classmethod
    def from_parallel_state(cls) -> "ParallelGroups":
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            return cls(None, None, None, 1)
        # Context-parallel ranks hold other tokens of the same sequences: for the gradients
        # they are data-parallel replicas like the others (Megatron's dp-cp group). The
        # expert-data-parallel group already spans them.
        return cls(
            dp=ps.get_data_parallel_group(with_context_parallel=True),
            expert_dp=ps.get_expert_data_parallel_group(),
            ep=ps.get_expert_model_parallel_group(),
            dp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
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
    params = [p for p in params if p.requires_grad and not is_fsdp_param(p)]
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
    """L2 norm over all gradients of the model, expert shards included (fp32).

    Squared sums by kind: replicated dense (already whole), FSDP-sharded dense (summed over
    dp), replicated expert (summed over ep: experts differ across EP ranks) and FSDP-sharded
    expert (summed over expert-dp, then over ep).
    """
    params = [p for p in params if p.grad is not None]
    # the collectives' device (NCCL takes CUDA tensors only), also for a kind with no gradients
    device = params[0].grad.device if params else torch.device("cpu")

    def sq(kind) -> torch.Tensor:
        grads = [p.grad.to_local() if is_fsdp_param(p) else p.grad for p in params if kind(p)]
        return sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=device)).reshape(1).clone()

    dense_sq = sq(lambda p: not is_expert_param(p) and not is_fsdp_param(p))
    expert_sq = sq(lambda p: is_expert_param(p) and not is_fsdp_param(p))
    if any(is_fsdp_param(p) for p in params):  # the same on every rank: one model structure
        sharded_dense_sq = sq(lambda p: not is_expert_param(p) and is_fsdp_param(p))
        sharded_expert_sq = sq(lambda p: is_expert_param(p) and is_fsdp_param(p))
        if _size(groups.dp) > 1:
            dist.all_reduce(sharded_dense_sq, group=groups.dp)
        if _size(groups.expert_dp) > 1:
            dist.all_reduce(sharded_expert_sq, group=groups.expert_dp)
        dense_sq += sharded_dense_sq
        expert_sq += sharded_expert_sq
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
    value = all_reduce_sum(value, group)
    if _size(group) > 1:
        value /= _size(group)
    return value


def all_reduce_sum(value: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """A detached fp32 copy of value summed over the group."""
    value = value.detach().float().clone()
    if _size(group) > 1:
        dist.all_reduce(value, group=group)
    return value
