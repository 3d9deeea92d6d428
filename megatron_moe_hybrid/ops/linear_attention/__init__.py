"""Linear attention ops: gated delta rule and simple GLA, with a backend registry.

Shape legend: B batch, T time, H heads, K query/key head dim, V value head dim,
N sequences (B, or the number of cu_seqlens segments). Layout [B, T, H, D] as in
flash-linear-attention; see reference.py for the math and README.md for the chunked form.

Backends register themselves per op with register_backend; "auto" picks the registered
backend of highest priority whose `supports(q)` is true: "triton" (triton_chunk.py, fused
chunk kernels) for CUDA tensors it handles, else "torch" (the chunked reference in
reference.py); "torch_recurrent" (token by token) is there for checking. Every backend takes
grouped value heads (v, g, beta with HV heads, a multiple of q/k's H; value head h reads q/k
head h // (HV // H)); the torch ones repeat q and k.

chunk_gated_delta_rule and chunk_simple_gla have flash-linear-attention's signatures, so that
its users switch by changing the import; reference.chunk_gated_delta_rule /
reference.chunk_simple_gla are the plain PyTorch forms.
"""

import functools
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import reference
from .recurrent import (
    fused_recurrent_gated_delta_rule,
    fused_recurrent_simple_gla,
    register_recurrent_backends,
)
from .reference import l2norm, recurrent_gated_delta_rule, recurrent_simple_gla

__all__ = [
    "Backend",
    "chunk_gated_delta_rule",
    "chunk_simple_gla",
    "gated_delta_rule",
    "l2norm",
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

    fn: Callable[..., tuple[Tensor, Tensor | None]]
    priority: int = 0
    supports: Callable[[Tensor], bool] = _any_input


_BACKENDS: dict[str, dict[str, Backend]] = {op: {} for op in OPS}
_fallback_logged: set[str] = set()


def register_backend(
    op: str,
    name: str,
    fn: Callable[..., tuple[Tensor, Tensor | None]],
    *,
    priority: int = 0,
    supports: Callable[[Tensor], bool] | None = None,
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


def _grouped_heads(fn):
    """Lets a reference take grouped value heads: q and k repeated to v's heads (autograd sums
    the repeats' gradients back)."""

    @functools.wraps(fn)
    def run(q, k, v, *args, **kwargs):
        if q.dim() == 4 and v.dim() == 4 and v.shape[2] != q.shape[2] and v.shape[2] % q.shape[2] == 0:
            group = v.shape[2] // q.shape[2]
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        return fn(q, k, v, *args, **kwargs)

    return run


_HAVE_TRITON = importlib.util.find_spec("triton") is not None


# The key head dims the Triton kernels take, per op (triton_chunk checks them too).
_TRITON_MAX_HEAD_DIM_K = {"gdn": 128, "gla": 256}


def _triton_supports(max_head_dim_k: int):
    """What "auto" sends to Triton: CUDA bf16/fp16 tensors with a key head dim the kernels take
    (_TRITON_MAX_HEAD_DIM_K: 128 for the delta rule, 256 for simple GLA). fp32 inputs stay
    on the reference, whose products are fp32: the kernels multiply in tf32 (about 1e-3
    relative), which the fp32 callers (context parallelism's state fold) do not expect;
    backend="triton" takes them on request, and CPU tensors too (Triton's interpreter)."""

    def supports(q: Tensor) -> bool:
        return (
            q.is_cuda and q.dim() == 4 and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] <= max_head_dim_k
        )

    return supports


def _triton(name: str):
    """triton_chunk.<name>, imported on first use so that importing this package stays light."""

    def run(*args, **kwargs):
        from . import triton_chunk

        return getattr(triton_chunk, name)(*args, **kwargs)

    return run


register_backend("gated_delta_rule", "torch", _grouped_heads(reference.chunk_gated_delta_rule))
register_backend("simple_gla", "torch", _grouped_heads(reference.chunk_simple_gla))
register_backend(
    "gated_delta_rule", "torch_recurrent",
    _recurrent(_grouped_heads(recurrent_gated_delta_rule)), priority=-1,
)
register_backend(
    "simple_gla", "torch_recurrent", _recurrent(_grouped_heads(recurrent_simple_gla)), priority=-1
)
if _HAVE_TRITON:
    register_backend(
        "gated_delta_rule", "triton", _triton("chunk_gated_delta_rule_triton"), priority=1,
        supports=_triton_supports(_TRITON_MAX_HEAD_DIM_K["gdn"]),
    )
    register_backend(
        "simple_gla", "triton", _triton("chunk_simple_gla_triton"), priority=1,
        supports=_triton_supports(_TRITON_MAX_HEAD_DIM_K["gla"]),
    )


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule: S = exp(g) S; S += k ((v - S^T k) beta)^T; o = S^T (scale q).

    q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (grouped value heads);
    g [B, T, HV] log decay (<= 0); beta [B, T, HV] in (0, 1); scale defaults to K ** -0.5;
    initial_state [N, HV, K, V]; cu_seqlens [N + 1] integer offsets of packed sequences in a
    B == 1 batch (the state restarts at each boundary).
    Returns o [B, T, HV, V] in v's dtype and the final state [N, HV, K, V] (fp32, fp64 for fp64
    inputs) if output_final_state, else None.
    """
    reference.check_options(scale, cu_seqlens, chunk_size)
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
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Scalar-decay gated linear attention: S = exp(g) S + k v^T; o = S^T (scale q).

    Arguments and results as gated_delta_rule, without beta.
    """
    reference.check_options(scale, cu_seqlens, chunk_size)
    return _pick("simple_gla", backend, q).fn(
        q, k, v, g,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size,
    )


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule's signature over gated_delta_rule.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [N, HV, K, V].
    use_qk_l2norm_in_kernel L2-normalises q and k first (l2norm). Returns (o, final state or None).
    """
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend,
    )


def chunk_simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    g_gamma: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """fla.ops.simple_gla.chunk_simple_gla's signature over simple_gla.

    g [B, T, HV] per-token log decay, or g_gamma [HV] one constant log decay per head (not
    both; neither means no decay). Other arguments as chunk_gated_delta_rule.
    """
    g = reference.decay_from_g_gamma(g, g_gamma, v)
    if g is None:  # no decay
        if v.dim() != 4:
            raise ValueError(f"v: expected [B, T, HV, V], got {list(v.shape)}")
        g = v.new_zeros(*v.shape[:3], dtype=torch.float32)
    return simple_gla(
        q, k, v, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend,
    )


# --- fused_recurrent_*: the compiled token-by-token recurrence (recurrent.py, csrc/linear_attention*) ---

register_recurrent_backends(register_backend)
__all__ += ["fused_recurrent_gated_delta_rule", "fused_recurrent_simple_gla"]
