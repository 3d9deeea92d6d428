"""Linear attention ops: gated delta rule and simple GLA, with a backend registry.

Shape legend: B batch, T time, H heads, K query/key head dim, V value head dim,
N sequences (B, or the number of cu_seqlens segments). Layout [B, T, H, D] as in
flash-linear-attention; see reference.py for the math and README.md for the chunked form.

Backends register themselves per op with register_backend; "auto" picks the registered
backend of highest priority whose `supports(q)` is true. Today "torch" (the chunked
reference, which "auto" picks) and "torch_recurrent" (token by token, for checking) exist.
"""

import logging
from dataclasses import dataclass
from typing import Callable, Optional

from torch import Tensor

from .reference import (
    chunk_gated_delta_rule,
    chunk_simple_gla,
    recurrent_gated_delta_rule,
    recurrent_simple_gla,
)

__all__ = [
    "Backend",
    "chunk_gated_delta_rule",
    "chunk_simple_gla",
    "gated_delta_rule",
    "recurrent_gated_delta_rule",
    "recurrent_simple_gla",
    "register_backend",
    "registered_backends",
    "simple_gla",
]

logger = logging.getLogger(__name__)

OPS = ("gated_delta_rule", "simple_gla")


def _any_input(q: Tensor) -> bool:
    return True


@dataclass(frozen=True)
class Backend:
    """One implementation of one op.

    fn takes the op's tensors positionally and scale, initial_state, output_final_state,
    cu_seqlens, chunk_size as keywords, and returns (o, final_state or None).
    """

    fn: Callable[..., tuple[Tensor, Optional[Tensor]]]
    priority: int = 0
    supports: Callable[[Tensor], bool] = _any_input


_BACKENDS: dict[str, dict[str, Backend]] = {op: {} for op in OPS}
_fallback_logged: set[str] = set()


def register_backend(
    op: str,
    name: str,
    fn: Callable[..., tuple[Tensor, Optional[Tensor]]],
    *,
    priority: int = 0,
    supports: Optional[Callable[[Tensor], bool]] = None,
) -> None:
    """Makes fn selectable as backend=name for op; a fused backend uses priority > 0."""
    if op not in _BACKENDS:
        raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")
    _BACKENDS[op][name] = Backend(fn, priority, supports or _any_input)


def registered_backends(op: str) -> list[str]:
    if op not in _BACKENDS:
        raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")
    return sorted(_BACKENDS[op])


def _pick(op: str, backend: str, q: Tensor) -> Backend:
    backends = _BACKENDS[op]
    if backend != "auto":
        if backend not in backends:
            raise ValueError(
                f"backend: {backend!r} is not registered for {op}; registered: "
                f"{['auto'] + sorted(backends)} (a fused backend registers itself when its "
                f"package imports, e.g. install triton for 'triton')"
            )
        return backends[backend]
    name, chosen = max(
        ((n, b) for n, b in backends.items() if b.supports(q)), key=lambda nb: nb[1].priority
    )
    if q.is_cuda and name == "torch" and op not in _fallback_logged:
        _fallback_logged.add(op)
        logger.warning("%s: no fused backend supports these inputs; using the torch reference", op)
    return chosen


def _recurrent(fn):
    """Adapts a recurrent reference to the backend signature: it has no chunks to size."""

    def run(*args, chunk_size=None, **kwargs):
        return fn(*args, **kwargs)

    return run


register_backend("gated_delta_rule", "torch", chunk_gated_delta_rule)
register_backend("simple_gla", "torch", chunk_simple_gla)
register_backend(
    "gated_delta_rule", "torch_recurrent", _recurrent(recurrent_gated_delta_rule), priority=-1
)
register_backend("simple_gla", "torch_recurrent", _recurrent(recurrent_simple_gla), priority=-1)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated delta rule: S = exp(g) S; S += k ((v - S^T k) beta)^T; o = S^T (scale q).

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] log decay (<= 0); beta [B, T, H] in (0, 1);
    scale defaults to K ** -0.5; initial_state [N, H, K, V]; cu_seqlens [N + 1] integer offsets
    of packed sequences in a B == 1 batch (the state restarts at each boundary).
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] (fp32, fp64 for fp64
    inputs) if output_final_state, else None.
    """
    return _pick("gated_delta_rule", backend, q).fn(
        q, k, v, g, beta,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size,
    )


def simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Optional[Tensor]]:
    """Scalar-decay gated linear attention: S = exp(g) S + k v^T; o = S^T (scale q).

    Arguments and results as gated_delta_rule, without beta.
    """
    return _pick("simple_gla", backend, q).fn(
        q, k, v, g,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size,
    )
