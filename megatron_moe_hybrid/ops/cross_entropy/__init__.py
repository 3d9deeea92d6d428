"""Linear + cross-entropy that never materialises [N, V] logits: the public entry point.

Shape legend:
  N  tokens    D  hidden size    V  vocabulary rows held by this rank
"""

from typing import Protocol

import torch
import torch.distributed as dist

from .reference import chunked_linear_cross_entropy, naive_linear_cross_entropy

__all__ = [
    "available_backends",
    "chunked_linear_cross_entropy",
    "linear_cross_entropy",
    "naive_linear_cross_entropy",
    "register_backend",
]


class LinearCrossEntropyBackend(Protocol):
    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        reduction: str,
        chunk_size: int,
        tp_group: dist.ProcessGroup | None,
        vocab_start: int,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, LinearCrossEntropyBackend] = {"torch": chunked_linear_cross_entropy}


def register_backend(name: str, fn: LinearCrossEntropyBackend) -> None:
    """Adds a backend (e.g. "triton") computing the same function as the "torch" reference."""
    if name == "auto":
        raise ValueError('backend name "auto" is reserved; pick another name')
    _BACKENDS[name] = fn


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int = 1024,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, labels) in chunks of tokens.

    hidden [N, D], weight [V, D] (with tp_group: this rank's vocab rows, starting at
    global id vocab_start), labels [N] int64 global ids or ignore_index. reduction is
    "mean" (over non-ignored tokens; 0 when there are none), "sum" or "none" ([N]).
    The loss is fp32 (fp64 for fp64 inputs); gradients come back in the input dtypes,
    grad of hidden complete (all-reduced over tp_group). backend: "auto" or one of
    available_backends(); "auto" is the "torch" reference until a fused one is registered.
    """
    name = "torch" if backend == "auto" else backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {available_backends()}, got {backend!r}")
    return _BACKENDS[name](
        hidden,
        weight,
        labels,
        ignore_index=ignore_index,
        reduction=reduction,
        chunk_size=chunk_size,
        tp_group=tp_group,
        vocab_start=vocab_start,
    )
