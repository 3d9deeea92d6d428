"""HybridMoEModel: Megatron's GPTModel with the hybrid layer stack and a chunked loss.

Shapes: s sequence, b micro-batch, h hidden, V vocabulary.
The decoder runs in Megatron's [s, b, h] layout. With labels, the output projection and the
cross-entropy run fused over token chunks (ops.cross_entropy), so [s*b, V] logits are never
materialised; the per-token loss [b, s] is returned as GPTModel does.
"""

import re
from typing import Optional

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

    def indexer_layers(self):
        """The attention layers with a lightning indexer (S, M): their indexer_parameters() and
        last_indexer_loss."""
        return [m for m in self.modules() if hasattr(m, "indexer_parameters")]


# -- seeded builds: each piece of the model from its own seed ---------------------------------
# The embedding draws from `seed` itself, decoder layer n (1-based) from piece_seed(seed, n),
# the output layer from piece_seed(seed, num_layers + 1): a piece's initial weights do not
# depend on the pieces built before it, so initialize() can build the model piece by piece
# and get, tensor for tensor, what build_model(config, seed=seed) gives.

_SEEDED_BUILD = None  # the SeededBuild in progress, read by specs.SeededTransformerLayer


def piece_seed(seed: int, piece: int) -> int:
    """The seed of piece `piece` (0 the embedding, n >= 1 decoder layer n, num_layers + 1 the
    output layer) of a model built from `seed`."""
    return (int(seed) + 1_000_003 * int(piece)) % (2**63)


def current_seeded_build():
    return _SEEDED_BUILD


class SeededBuild:
    """How the layers of one HybridMoEModel construction are seeded and where they go.

    sink(layer_number, layer) (optional) takes each layer as soon as it is built (its weights
    on the CPU), after which the layer is moved to the meta device: the construction then holds
    one layer's weights at a time. layers (optional): the layer numbers to draw; the others are
    built on the meta device (nothing drawn: each layer has its own seed, so the rest come out
    the same) and not handed to the sink."""

    def __init__(self, seed: int, sink=None, layers=None):
        self.seed, self.sink, self.layers = int(seed), sink, layers

    def draws(self, layer_number: int) -> bool:
        return self.layers is None or layer_number in self.layers

    def __enter__(self):
        global _SEEDED_BUILD
        if _SEEDED_BUILD is not None:
            raise RuntimeError("a seeded model build is already in progress")
        _SEEDED_BUILD = self
        torch.manual_seed(piece_seed(self.seed, 0))  # the embedding, built first
        return self

    def __exit__(self, *exc):
        global _SEEDED_BUILD
        _SEEDED_BUILD = None

    def before_layer(self, layer_number: int) -> None:
        torch.manual_seed(piece_seed(self.seed, layer_number))

    def after_layer(self, layer_number: int, layer: torch.nn.Module, num_layers: int) -> None:
        if self.sink is not None and self.draws(layer_number):
            self.sink(layer_number, layer)
            layer.to_empty(device="meta")  # its storage freed; the construction goes on
        if layer_number == num_layers:  # next to draw: the output layer
            torch.manual_seed(piece_seed(self.seed, num_layers + 1))


def build_model(
    config: HybridMoEConfig, device=None, seed: int | None = None, recompute: int | None = None
) -> HybridMoEModel:
    """Builds the model on CPU in config.params_dtype; call after parallel_state is initialised.
    memory.recompute_layers (or recompute, where given) turns on activation checkpointing
    (recompute_layers).

    seed: each piece drawn from its own seed (see piece_seed; the same weights as
    initialize(model, config, seed) gives a model built on the meta device); None: one stream
    from the global RNG as it stands.
    device "meta": no storage and no initialisation (nothing allocated, any model size);
    materialize() then gives the tensors storage on a device, for a checkpoint or initialize()
    to fill."""
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            model = HybridMoEModel(config)
    elif seed is not None:
        with SeededBuild(seed):
            model = HybridMoEModel(config)
    else:
        model = HybridMoEModel(config)
    if config.params_dtype != torch.float32:
        model = model.to(config.params_dtype)
    n = config.memory.recompute_layers if recompute is None else recompute
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


_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.")


def initialize(
    model: torch.nn.Module, config: HybridMoEConfig, seed: int, only: Optional[set[str]] = None
) -> list[str]:
    """Fills a materialized model (built on the meta device, possibly LoRA-wrapped and FSDP2-
    sharded, see materialize) with the initial weights build_model(config, seed=seed) would
    draw on this rank, tensor for tensor, holding on the host one decoder layer's weights at a
    time besides the embedding and the output layer (not the whole model): the pieces are
    built on the CPU one after another and each copied into this rank's shards. Returns the
    model tensors that no piece holds (LoRA adapters: drawn by materialize); raises if any
    other parameter or persistent buffer is left unfilled. only: fill just these of the
    model's tensor names (the others keep what they hold); the decoder layers holding none of
    them are built on the meta device, nothing drawn (the embedding and the output layer are
    always drawn)."""
    from megatron_moe_hybrid.training.checkpoint import _unwrapped_name, copy_whole

    targets = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    if only is not None:
        unknown = sorted(set(only) - set(targets))
        if unknown:
            raise ValueError(f"initialize: the model has no tensors {unknown[:5]}")
        targets = {k: v for k, v in targets.items() if k in only}
    unwrapped = _unwrapped_name(model)
    by_source = {unwrapped(name): name for name in targets}  # a freshly built piece's name -> the model's
    filled = set()

    @torch.no_grad()
    def fill(prefix: str, piece: torch.nn.Module) -> None:
        if config.params_dtype != torch.float32:
            piece.to(config.params_dtype)  # as build_model casts the whole model
        for key, value in piece.state_dict().items():
            name = by_source.get(prefix + key)
            if name is None or not isinstance(value, torch.Tensor) or value.is_meta:
                continue
            copy_whole(targets[name], value)  # every rank built the whole piece
            filled.add(name)

    layers = None  # the decoder layers holding a target (1-based); only those are drawn
    if only is not None:
        layers = {int(m.group(1)) + 1 for m in map(_LAYER_NAME.match, targets) if m}
    with SeededBuild(seed, sink=lambda n, layer: fill(f"decoder.layers.{n - 1}.", layer), layers=layers):
        rest = HybridMoEModel(config)  # each layer filled and freed as it is built
    fill("", rest)  # the embedding, the final norm, the output layer
    del rest
    left = [n for n in targets if n not in filled]
    from megatron_moe_hybrid.layers.lora import lora_modules

    wrappers = [f"{path}." for path, _ in lora_modules(model)]  # their tensors but base.* are adapters
    unfilled = [n for n in left if not any(n.startswith(w) and not n.startswith(w + "base.") for w in wrappers)]
    if unfilled:
        raise RuntimeError(f"initialize: no piece holds {unfilled[:5]}{' ...' if len(unfilled) > 5 else ''}")
    return left
