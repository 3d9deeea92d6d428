"""Top-k sparse attention (DeepSeek-V3.2 DSA): public ops with a backend choice.

Shape legend: B batch, T tokens (queries), S keys (== T unless q_positions [T] places the
queries among the keys, as under context parallelism), H query heads, G kv groups, D head
dim, DV value head dim, HI / DI indexer heads / head dim, K top-k. Layout [B, T, H, D].

Each public function takes backend="auto" | a registered name. Backends live in a small
registry (name -> SparseAttentionBackend): "torch" (reference.py) implements every op;
"triton" (triton_sparse.py, when triton is installed) implements sparse_attention for bf16/fp16
CUDA tensors. "auto" takes the first registered backend of _AUTO_ORDER that implements the op
and whose supports(op, x) accepts the op's first tensor; a CUDA call that a fused backend
declines is logged once before it runs on the torch reference.
"""

import importlib.util
import logging
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch
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
    # supports(op, x): whether auto may send op with first tensor x here; None: any input
    supports: Callable[[str, Tensor], bool] | None = None


logger = logging.getLogger(__name__)
OPS = tuple(f.name for f in fields(SparseAttentionBackend) if f.name not in ("name", "supports"))
_BACKENDS: dict[str, SparseAttentionBackend] = {}
# Fast backends first; "torch" is always last so that auto can always run.
_AUTO_ORDER = ("cuda", "triton", "torch")


def register_backend(backend: SparseAttentionBackend) -> None:
    _BACKENDS[backend.name] = backend


def registered_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


_fallback_logged: set[str] = set()


def get_op(op: str, backend: str = "auto", x: Tensor | None = None) -> Callable:
    """The implementation of op in backend; ValueError naming what is registered otherwise.

    Under auto, x (the op's first tensor) is offered to each backend's supports(); without x
    only backends with no supports() check are taken.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if backend == "auto":
        declined = []
        for name in _AUTO_ORDER:
            impl = _BACKENDS.get(name)
            fn = getattr(impl, op, None)
            if fn is None:
                continue
            if impl.supports is not None and (x is None or not impl.supports(op, x)):
                declined.append(name)
                continue
            if declined and x is not None and x.is_cuda and op not in _fallback_logged:
                _fallback_logged.add(op)
                logger.warning(
                    "sparse_attention.%s: backend(s) %s do not take %s %s inputs; running %r",
                    op, declined, x.dtype, tuple(x.shape), name,
                )
            return fn
    elif backend in _BACKENDS and getattr(_BACKENDS[backend], op) is not None:
        return getattr(_BACKENDS[backend], op)
    raise ValueError(
        f"backend={backend!r} does not provide sparse_attention.{op}; registered backends: "
        f"{registered_backends()} (or 'auto')"
    )


register_backend(SparseAttentionBackend(name="torch", **{op: getattr(reference, op) for op in OPS}))


def _triton_sparse_attention(q, k, v, indices, scale=None):
    """triton_sparse.sparse_attention_triton, imported on first use (importing stays light)."""
    from .triton_sparse import sparse_attention_triton

    return sparse_attention_triton(q, k, v, indices, scale)


def _triton_supports(op: str, x: Tensor) -> bool:
    """What auto sends to Triton: bf16/fp16 CUDA tensors. CPU tensors stay on the reference
    (backend="triton" runs them in Triton's interpreter, fp32 only, for tests), and so do fp32
    CUDA tensors, which the kernels refuse (their tiles are sized for 16-bit operands)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] <= 1024


if importlib.util.find_spec("triton") is not None:
    register_backend(
        SparseAttentionBackend(
            name="triton", sparse_attention=_triton_sparse_attention, supports=_triton_supports
        )
    )


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
    return get_op("sparse_attention", backend, q)(q, k, v, indices, scale)


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Optional[Tensor] = None,
    scale: Optional[float] = None,
    backend: str = "auto",
) -> Tensor:
    """Full causal GQA attention, q [B, T, H, D], k [B, T, G, D], v [B, T, G, DV] -> [B, T, H, DV].

    backend "sdpa": torch's scaled_dot_product_attention (flash / cuDNN / memory-efficient
    kernels on CUDA, memory linear in T); "torch": reference.dense_attention, which holds the
    [B, T, H, T] scores. "auto" takes sdpa for CUDA tensors without cu_seqlens (packed
    sequences stay on the reference) and the reference otherwise.
    """
    if backend not in ("auto", "sdpa", "torch"):
        raise ValueError(f"backend: {backend!r} is not one of auto, sdpa, torch")
    if backend == "auto":
        backend = "sdpa" if q.is_cuda and cu_seqlens is None else "torch"
    if backend == "torch":
        return dense_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens, scale=scale)[0]
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens: the sdpa backend takes unpacked batches; use backend='torch' for packed ones")
    _, T, S, *_ = reference._check_attention_args(q, k, v)
    if T != S:
        raise ValueError(f"k: causal_attention needs as many keys as queries (T={T}), got S={S}")
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # [B, H, T, DV]
    return o.transpose(1, 2)


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
    "causal_attention",
    "dense_attention",
    "dense_masked_attention",
    "get_op",
    "indexer_kl_valid_queries",
    "indices_to_mask",
    "positions_from_cu_seqlens",
    "register_backend",
    "registered_backends",
]
