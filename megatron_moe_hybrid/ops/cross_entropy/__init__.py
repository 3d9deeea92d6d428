"""Linear + cross-entropy that never materialises [N, V] logits: the public entry point.

Backends: "torch" (reference.py, chunked over tokens and vocabulary) and "triton"
(triton.py: cuBLAS logits per token chunk, fused Triton LSE + gradient; imported on first
use). "auto" picks "triton" for CUDA tensors when Triton imports, else "torch".

Shape legend:
  N  tokens    D  hidden size    V  vocabulary rows held by this rank
"""

import importlib.util
import logging
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

logger = logging.getLogger(__name__)


class LinearCrossEntropyBackend(Protocol):
    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        ignore_index: int,
        z_loss_weight: float,
        label_smoothing: float,
        reduction: str,
        tp_group: dist.ProcessGroup | None,
        vocab_start: int,
        chunk_size: int | None,  # None: the backend picks
        vocab_chunk_size: int,
    ) -> torch.Tensor: ...


def _triton_backend(hidden, weight, labels, **kwargs):
    if importlib.util.find_spec("triton") is None:
        raise ValueError('backend "triton" needs the triton package: pip install triton, or pass backend="torch"')
    from .triton import triton_linear_cross_entropy  # imports triton only when asked for

    kwargs.pop("vocab_chunk_size")  # the fused kernel streams the vocabulary itself
    return triton_linear_cross_entropy(hidden, weight, labels, **kwargs)


_BACKENDS: dict[str, LinearCrossEntropyBackend] = {"torch": chunked_linear_cross_entropy, "triton": _triton_backend}
_fallback_logged = False


def register_backend(name: str, fn: LinearCrossEntropyBackend) -> None:
    """Adds a backend computing the same function as the "torch" reference."""
    if name == "auto":
        raise ValueError('backend name "auto" is reserved; pick another name')
    _BACKENDS[name] = fn


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def _auto_backend(hidden: torch.Tensor) -> str:
    global _fallback_logged
    if not hidden.is_cuda:
        return "torch"
    if importlib.util.find_spec("triton") is not None:
        return "triton"
    if not _fallback_logged:
        _fallback_logged = True
        logger.warning("linear_cross_entropy: triton is not installed, CUDA tensors use the slower torch reference")
    return "torch"


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    vocab_chunk_size: int = 8192,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, labels, label_smoothing) + z_loss_weight * lse^2, in chunks.

    hidden [N, D], weight [V, D] (with tp_group: this rank's vocab rows, starting at
    global id vocab_start), labels [N] int64 global ids or ignore_index. reduction is
    "mean" (over non-ignored tokens; 0 when there are none), "sum" or "none" ([N]).
    The loss is fp32 (fp64 for fp64 inputs); gradients come back in the input dtypes,
    grad of hidden complete (all-reduced over tp_group). chunk_size tokens are processed
    at a time (None: each backend's default, 1024 for "torch", triton.auto_chunk_size for
    "triton": a [chunk, V] buffer of about 9% of inputs + gradients); vocab_chunk_size
    bounds the logits tile of the "torch" backend.
    backend: "auto" or one of available_backends().
    """
    name = _auto_backend(hidden) if backend == "auto" else backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {available_backends()}, got {backend!r}")
    return _BACKENDS[name](
        hidden,
        weight,
        labels,
        ignore_index=ignore_index,
        z_loss_weight=z_loss_weight,
        label_smoothing=label_smoothing,
        reduction=reduction,
        tp_group=tp_group,
        vocab_start=vocab_start,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
    )
