"""Activation checkpointing of whole transformer layers (memory.recompute_layers).

A recomputed layer keeps only its inputs; the backward runs its forward again. Here, not in
Megatron's TransformerBlock: Megatron's recompute needs CUDA's RNG tracker, and its reentrant
form gives no gradient to a layer whose input needs none (a frozen embedding under LoRA).
"""

import contextlib

import torch
import torch.utils.checkpoint

_recompute_depth = 0  # > 0 while autograd recomputes a checkpointed layer's forward


def is_recomputing() -> bool:
    """True inside the backward's second forward of a recomputed layer (side effects such as
    routing statistics must not count twice)."""
    return _recompute_depth > 0


@contextlib.contextmanager
def _recomputing():
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


def recompute_layers(model, n: int) -> None:
    """Activation checkpointing of the first n decoder layers: each keeps only its inputs and
    runs its forward again in the backward (torch.utils.checkpoint, non-reentrant, so that a
    frozen embedding's output, which needs no gradient, still trains the layers' adapters).
    On CPU and CUDA alike: Megatron's own recompute needs CUDA's RNG tracker. checkpoint
    restores the RNG state for the recompute, so dropout draws the same masks."""
    for layer in list(model.decoder.layers)[:n]:
        if getattr(layer, "_recomputed", False):
            continue
        forward = layer.forward

        def run(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(
                _forward, *args, use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), _recomputing()), **kwargs,
            )

        layer.forward = run
        layer._recomputed = True
