"""Activation checkpointing of whole transformer layers (memory.recompute_layers).

A recomputed layer keeps only its inputs; the backward runs its forward again. Here, not in
Megatron's TransformerBlock: Megatron's recompute needs CUDA's RNG tracker, and its reentrant
form gives no gradient to a layer whose input needs none (a frozen embedding under LoRA).
"""

import collections
import contextlib

import torch
import torch.utils.checkpoint

_recompute_depth = 0  # > 0 while autograd recomputes a checkpointed layer's forward
_first_forward_depth = 0  # > 0 in the first forward of a layer that the backward recomputes
STASH_DEPTH = 2  # entries a module keeps per name for its recomputes (see reuse_in_recompute)


def is_recomputing() -> bool:
    """True inside the backward's second forward of a recomputed layer (side effects such as
    routing statistics must not count twice)."""
    return _recompute_depth > 0


def will_recompute() -> bool:
    """True in the first forward of a recomputed layer (with gradients on), whose backward
    runs the forward again."""
    return _first_forward_depth > 0 and not is_recomputing()


@contextlib.contextmanager
def _recomputing():
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


@contextlib.contextmanager
def _first_forward():
    global _first_forward_depth
    _first_forward_depth += 1
    try:
        yield
    finally:
        _first_forward_depth -= 1


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def reuse_in_recompute(module: torch.nn.Module, name: str, fingerprint: tuple, compute):
    """compute(), or, in the recompute of a checkpointed layer, what its first forward computed.

    For results without gradient that cost real time (the sparse attention's top-k selection):
    the first forward of a recomputed layer keeps its result on `module` (at most STASH_DEPTH
    per name, oldest dropped), and the recompute takes it instead of computing it again.
    fingerprint: tensors (or None) the result is a function of, small beside it (the indexer's
    head weights, cu_seqlens), kept with it; the recompute, deterministic, produces them again.
    An entry whose fingerprint differs, a first forward whose backward never ran, is dropped,
    never used: the recompute then computes the result itself. Comparing costs one host sync.
    The result must not require grad (it would hold the first forward's graph)."""
    if not (is_recomputing() or will_recompute()):
        return compute()
    stash = module.__dict__.setdefault("_recompute_stash", {}).setdefault(name, collections.deque())
    fingerprint = tuple(None if t is None else t.detach() for t in fingerprint)
    if is_recomputing():
        while stash:
            kept, value = stash.popleft()
            if len(kept) == len(fingerprint) and all(_same(a, b) for a, b in zip(kept, fingerprint)):
                return value
        return compute()
    value = compute()
    if torch.is_tensor(value) and value.requires_grad:
        raise ValueError(f"reuse_in_recompute({name!r}): the result requires grad; keep only results without a graph")
    while len(stash) >= STASH_DEPTH:
        stash.popleft()
    stash.append((fingerprint, value))
    return value


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
                context_fn=lambda: (_first_forward(), _recomputing()), **kwargs,
            )

        layer.forward = run
        layer._recomputed = True
