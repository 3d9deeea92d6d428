"""FSDP2 (`fully_shard`) combined with expert parallelism.

Meshes come from Megatron's parallel_state: dense modules are sharded over the
data-parallel group (dp ranks), the experts of this EP rank over the expert-data-parallel
group (world / (EP x TP x PP) ranks holding the same experts). Shapes: an expert parameter
[E_local, ...] is sharded along E_local over expert-dp; a dense parameter along dim 0 over dp.

Frozen (requires_grad=False) parameters may sit in the same fully_shard group as trainable
ones (FSDP2 reduce-scatters only the gradients that exist), so a LoRA wrapper and its frozen
base share one group; base weights may also be stored in another dtype (bf16) than the
adapters, the mixed-precision policy casts them for compute.

Parameter attributes (`allreduce`, `num_local_experts`) are copied onto the sharded
parameters that FSDP2 creates, so that checkpoints and clipping still see expert params.
"""

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ATTRS = ("allreduce", "num_local_experts")


def _dtype(name: str, field: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"{field}: {name!r} is not one of {sorted(_DTYPES)}; pick one of them")
    return _DTYPES[name]


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost modules that directly own expert params (GroupedExperts or its LoRA wrapper)."""
    owners = [
        m for m in model.modules()
        if any(hasattr(p, "num_local_experts") for p in m.parameters(recurse=False))
    ]
    owned = {id(m) for m in owners}
    inner = {id(sub) for m in owners for sub in m.modules() if sub is not m and id(sub) in owned}
    return [m for m in owners if id(m) not in inner]


def apply_fsdp(model: nn.Module, config, device_type: str | None = None) -> nn.Module:
    """Shards the model in place: experts over expert-dp, each TransformerLayer and the root over dp.
    device_type: where the meshes live (default: where the parameters are; give it for a model on
    the meta device, which models.materialize then gives this rank's shards only)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    p = config.parallel
    policy = MixedPrecisionPolicy(
        param_dtype=_dtype(p.fsdp_param_dtype, "parallel.fsdp_param_dtype"),
        reduce_dtype=_dtype(p.fsdp_reduce_dtype, "parallel.fsdp_reduce_dtype"),
    )
    device = device_type or next(model.parameters()).device.type  # training.device: the meshes live where the model does
    # Context-parallel ranks are data-parallel replicas of the weights (they hold other tokens
    # of the same sequences): dense modules shard over dp x cp; expert-dp already spans them.
    dp_mesh = DeviceMesh.from_group(ps.get_data_parallel_group(with_context_parallel=True), device)
    expert_mesh = DeviceMesh.from_group(ps.get_expert_data_parallel_group(), device)
    dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)

    attrs = {
        name: {a: getattr(param, a) for a in _ATTRS if hasattr(param, a)}
        for name, param in model.named_parameters()
    }
    for module in expert_modules(model):
        fully_shard(module, mesh=expert_mesh, mp_policy=policy)
        # FSDP divides by its mesh size (expert-dp) by default. Each rank's loss is its local
        # mean and the global loss the mean over all dp ranks, and an expert's gradient
        # already holds every EP rank's tokens (the all-to-all brought them), so summing
        # over expert-dp must be followed by the same 1/dp as the dense gradients.
        module.set_gradient_divide_factor(float(dp_size))
        # gloo has no PREMUL_SUM: reduce with SUM, then divide the shard. Not on a 1-rank mesh:
        # there torch 2.13 would divide twice (its no-communication branch divides as well).
        if device == "cpu" and expert_mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)
    if config.sparse_attention.stage == "dense_warmup":
        # The warm-up's trainer backwards the indexer KL losses alone (no gradient reaches a
        # layer's output, whose hook would unshard the layer's group for its backward): each
        # indexer is a group of its own, unsharded again by the hooks on its outputs.
        for layer in model.indexer_layers():
            fully_shard(list(layer.indexer_modules()), mesh=dp_mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            fully_shard(module, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    for name, param in model.named_parameters():
        for a, value in attrs[name].items():
            setattr(param, a, value)
    return model


def is_sharded(t: Any) -> bool:
    return isinstance(t, DTensor)


def optimizer_state_from_local(optimizer: torch.optim.Optimizer) -> None:
    """After load_state_dict of local shards (a checkpoint of an earlier version, whose state files
    hold each rank's moments): wraps the state of sharded params back as DTensors."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not is_sharded(param):
                continue
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and not is_sharded(value) and value.dim() > 0:
                    optimizer.state[param][name] = DTensor.from_local(
                        value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                    )
