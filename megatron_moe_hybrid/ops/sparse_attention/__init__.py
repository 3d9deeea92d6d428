"""Top-k sparse attention (DeepSeek-V3.2 DSA): public ops with a backend choice.

Shape legend: B batch, T tokens (queries), S keys (== T unless q_positions [T] places the
queries among the keys, as under context parallelism), H query heads, G kv groups, D head
dim, DV value head dim, HI / DI indexer heads / head dim, K top-k. Layout [B, T, H, D].

Each public function takes backend="auto" | a registered name. Backends live in a small
registry (name -> SparseAttentionBackend); "torch" (reference.py) is the only one today,
and "auto" takes the first registered of _AUTO_ORDER that implements the op.
"""

from dataclasses import dataclass, fields
from typing import Callable, Optional

from torch import Tensor

from . import reference
from .reference import (
    dense_attention,
    dense_masked_attention,
    indexer_kl_valid_queries,
    indices_to_mask,
    positions_from_cu_seqlens,
)


@dataclass(frozen=True)
class SparseAttentionBackend:
    """One backend's implementations; None means the op is not provided (auto falls through)."""

    name: str
    apply_rope: Optional[Callable[..., Tensor]] = None
    lightning_indexer: Optional[Callable[..., Tensor]] = None
    lightning_indexer_sparse: Optional[Callable[..., Tensor]] = None
    topk_indices: Optional[Callable[..., Tensor]] = None
    indexer_topk: Optional[Callable[..., Tensor]] = None
    sparse_attention: Optional[Callable[..., tuple[Tensor, Tensor]]] = None
    attention_probs_target: Optional[Callable[..., Tensor]] = None
    indexer_kl_loss: Optional[Callable[..., Tensor]] = None


OPS = tuple(f.name for f in fields(SparseAttentionBackend) if f.name != "name")
_BACKENDS: dict[str, SparseAttentionBackend] = {}
# Fast backends first; "torch" is always last so that auto can always run.
_AUTO_ORDER = ("cuda", "triton", "torch")


def register_backend(backend: SparseAttentionBackend) -> None:
    _BACKENDS[backend.name] = backend


def registered_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_op(op: str, backend: str = "auto") -> Callable:
    """The implementation of op in backend; ValueError naming what is registered otherwise."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if backend == "auto":
        for name in _AUTO_ORDER:
            fn = getattr(_BACKENDS.get(name), op, None)
            if fn is not None:
                return fn
    elif backend in _BACKENDS and getattr(_BACKENDS[backend], op) is not None:
        return getattr(_BACKENDS[backend], op)
    raise ValueError(
        f"backend={backend!r} does not provide sparse_attention.{op}; registered backends: "
        f"{registered_backends()} (or 'auto')"
    )


register_backend(SparseAttentionBackend(name="torch", **{op: getattr(reference, op) for op in OPS}))


def apply_rope(
    x: Tensor, positions: Tensor, rope_dim: int, base: float = 10000.0, backend: str = "auto"
) -> Tensor:
    return get_op("apply_rope", backend)(x, positions, rope_dim, base)


def lightning_indexer(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    causal: bool = True,
    cu_seqlens: Optional[Tensor] = None,
    backend: str = "auto",
    q_positions: Optional[Tensor] = None,
) -> Tensor:
    return get_op("lightning_indexer", backend)(
        q_idx, k_idx, weights, causal, cu_seqlens, q_positions=q_positions
    )


def lightning_indexer_sparse(
    q_idx: Tensor, k_idx: Tensor, weights: Tensor, indices: Tensor, backend: str = "auto"
) -> Tensor:
    return get_op("lightning_indexer_sparse", backend)(q_idx, k_idx, weights, indices)


def topk_indices(scores: Tensor, topk: int, backend: str = "auto") -> Tensor:
    return get_op("topk_indices", backend)(scores, topk)


def indexer_topk(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    topk: int,
    block_size: int = 256,
    causal: bool = True,
    cu_seqlens: Optional[Tensor] = None,
    backend: str = "auto",
    q_positions: Optional[Tensor] = None,
) -> Tensor:
    return get_op("indexer_topk", backend)(
        q_idx, k_idx, weights, topk, block_size, causal, cu_seqlens, q_positions=q_positions
    )


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    scale: Optional[float] = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    return get_op("sparse_attention", backend)(q, k, v, indices, scale)


def attention_probs_target(
    q: Tensor,
    k: Tensor,
    indices: Optional[Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = True,
    cu_seqlens: Optional[Tensor] = None,
    backend: str = "auto",
    q_positions: Optional[Tensor] = None,
) -> Tensor:
    return get_op("attention_probs_target", backend)(
        q, k, indices, scale, causal, cu_seqlens, q_positions=q_positions
    )


def indexer_kl_loss(
    index_scores: Tensor,
    attn_probs_target: Tensor,
    indices: Optional[Tensor] = None,
    backend: str = "auto",
) -> Tensor:
    return get_op("indexer_kl_loss", backend)(index_scores, attn_probs_target, indices)


for _name in OPS:
    globals()[_name].__doc__ = getattr(reference, _name).__doc__
del _name

__all__ = [
    *OPS,
    "SparseAttentionBackend",
    "dense_attention",
    "dense_masked_attention",
    "get_op",
    "indexer_kl_valid_queries",
    "indices_to_mask",
    "positions_from_cu_seqlens",
    "register_backend",
    "registered_backends",
]
