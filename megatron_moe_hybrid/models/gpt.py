"""HybridMoEModel: Megatron's GPTModel with the hybrid layer stack and a chunked loss.

Shapes: s sequence, b micro-batch, h hidden, V vocabulary.
The decoder runs in Megatron's [s, b, h] layout. With labels, the output projection and the
cross-entropy run fused over token chunks (ops.cross_entropy), so [s*b, V] logits are never
materialised; the per-token loss [b, s] is returned as GPTModel does.
"""

import torch
from megatron.core.models.gpt import GPTModel

from megatron_moe_hybrid.config import HybridMoEConfig
from megatron_moe_hybrid.models.specs import hybrid_layer_specs
from megatron_moe_hybrid.parallel.recompute import recompute_layers


class HybridMoEModel(GPTModel):
    def __init__(self, config: HybridMoEConfig, **kwargs):
        kwargs.setdefault("pre_process", True)
        kwargs.setdefault("post_process", True)
        super().__init__(
            config=config,
            transformer_layer_spec=hybrid_layer_specs(config),
            vocab_size=config.vocab_size,
            max_sequence_length=config.training.seq_length,
            # Positions are handled inside the layers: linear attention needs none, sparse
            # attention applies its own RoPE.
            position_embedding_type="none",
            share_embeddings_and_output_weights=False,
            **kwargs,
        )

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        if labels is None or not self.post_process:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        from megatron_moe_hybrid.ops.cross_entropy import linear_cross_entropy

        s, b, h = hidden_states.shape
        hidden_bsh = hidden_states.transpose(0, 1).reshape(b * s, h)  # [b*s, h]
        loss = linear_cross_entropy(
            hidden_bsh,
            self.output_layer.weight,
            labels.reshape(b * s),
            reduction="none",
            chunk_size=self.config.memory.ce_chunk_size,
        )
        return loss.view(b, s)  # [b, s] fp32

    def moe_layers(self):
        from megatron_moe_hybrid.layers.moe import MoELayer

        return [m for m in self.modules() if isinstance(m, MoELayer)]


def build_model(config: HybridMoEConfig, device=None) -> HybridMoEModel:
    """Builds the model on CPU in config.params_dtype; call after parallel_state is initialised.
    memory.recompute_layers turns on activation checkpointing (recompute_layers).

    device "meta": no storage and no initialisation (nothing allocated, any model size);
    materialize() then gives the tensors storage on a device, for a checkpoint to fill."""
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            model = HybridMoEModel(config)
    else:
        model = HybridMoEModel(config)
    if config.params_dtype != torch.float32:
        model = model.to(config.params_dtype)
    n = config.memory.recompute_layers
    if n:
        recompute_layers(model, len(model.decoder.layers) if n < 0 else n)
    return model


def materialize(model: torch.nn.Module, device) -> torch.nn.Module:
    """A model built on the meta device, given storage on `device`: parameters and persistent
    buffers uninitialised (load a checkpoint into them: load_model_weights) with their
    attributes kept; sharded by FSDP2 first, each rank allocates its shards only. The runtime
    state is made anew there: non-persistent buffers (routing counters) and tensor attributes
    (the last losses and counts) zero, and what a module draws at construction by its
    _materialize(device) (LoRA's adapters). Raises if a meta tensor is left."""
    device = torch.device(device)
    # to_empty makes new Parameter objects: the attributes Megatron and we tag them with
    # (tensor_model_parallel, allreduce, num_local_experts, ...) are carried over
    tags = {name: {k: v for k, v in vars(t).items() if not k.startswith("_")}
            for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    model.to_empty(device=device)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        t.__dict__.update(tags.get(name, {}))
    persistent = set(model.state_dict())
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name not in persistent:
                buf.zero_()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    for name, module in model.named_modules():
        if hasattr(module, "_materialize"):
            module._materialize(device)
        for key, value in list(vars(module).items()):
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            new = _off_meta(value, device, 0)
            if new is not value:
                setattr(module, key, new)
            if _has_meta(new, 0):
                left.append(f"{name}.{key}")
    if left:
        raise RuntimeError(f"materialize: tensors still on the meta device: {left[:5]}")
    return model


def _walkable(value) -> bool:
    """Plain objects of ours that modules keep (the MoE dispatcher and its chunk states)."""
    return (hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module))
            and type(value).__module__.startswith("megatron_moe_hybrid"))


def _off_meta(value, device, depth):
    """value with its meta tensors replaced by zeros on device; containers and objects are
    changed in place (their type kept: a module's hook OrderedDicts are walked too)."""
    if not _has_meta(value, depth):
        return value
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, list):
        value[:] = [_off_meta(v, device, depth + 1) for v in value]
    elif isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_off_meta(v, device, depth + 1) for v in value)
    elif isinstance(value, dict):
        for k in list(value):
            value[k] = _off_meta(value[k], device, depth + 1)
    elif _walkable(value):
        for k, v in list(vars(value).items()):
            setattr(value, k, _off_meta(v, device, depth + 1))
    return value


def _has_meta(value, depth) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_meta
    if depth > 4:
        return False
    if isinstance(value, (list, tuple)):
        return any(_has_meta(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_has_meta(k, depth + 1) or _has_meta(v, depth + 1) for k, v in value.items())
    if _walkable(value):
        return any(_has_meta(v, depth + 1) for v in vars(value).values())
    return False
