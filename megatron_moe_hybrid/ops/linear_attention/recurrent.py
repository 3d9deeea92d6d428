"""Token-by-token linear attention served by the compiled recurrence torch.ops.mmh.recurrent_*.

fused_recurrent_gated_delta_rule and fused_recurrent_simple_gla take flash-linear-attention's
arguments. They run one step per token, which suits decode (T = 1 with a carried state) and
short sequences; long sequences belong to the chunked backends.

Shape legend: B batch, T time, Hqk query/key heads, Hv value heads (a multiple of Hqk:
grouped value heads, each group of Hv / Hqk value heads reads one q/k head), K q/k head dim,
V value head dim, N sequences (B, or the number of cu_seqlens segments).
q, k [B, T, Hqk, K]; v, o [B, T, Hv, V]; g, beta [B, T, Hv]; states [N, Hv, K, V] fp32.

Backends: "cuda" (csrc/cuda/linear_attention_cuda.cu, CUDA tensors), "cpp" (its CPU twin,
csrc/linear_attention.cpp), "torch" (reference.recurrent_*), "auto" = the compiled op for
the tensors' device when megatron_moe_hybrid._C has it, else "torch" with a warning (once).
The backward recomputes the states from checkpoints the forward stores every
CHECKPOINT_EVERY steps (fp32 [B T / CHECKPOINT_EVERY + N, Hv, K, V]); csrc/linear_attention.cpp
explains why the states are not recovered by inverting the steps.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_moe_hybrid import _ext

from .reference import (
    decay_from_g_gamma,
    l2norm,
    _NO_BETA,
    _check_inputs,
    check_options,
    recurrent_gated_delta_rule,
    recurrent_simple_gla,
)

__all__ = ["CHECKPOINT_EVERY", "fused_recurrent_gated_delta_rule", "fused_recurrent_simple_gla"]

BACKENDS = ("auto", "cuda", "cpp", "torch")
CHECKPOINT_EVERY = 16  # the CUDA backward keeps this many [K, V-slice] states in shared memory
CUDA_MAX_HEAD_DIM = 128  # K; the CUDA kernel keeps a [K, V-slice] state slice in registers


def _validate(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """The reference's checks (ValueError naming the argument), extended to grouped value heads."""
    if q.dim() == 4 and v.dim() == 4 and v.shape[2] != q.shape[2]:
        if q.shape[2] == 0 or v.shape[2] % q.shape[2]:
            raise ValueError(
                f"v: its heads ({v.shape[2]}) must equal q's ({q.shape[2]}) or be a multiple of them "
                f"(grouped value heads), got v {list(v.shape)} and q {list(q.shape)}"
            )
        # The reference checks q, k against v's heads: meta tensors stand for q, k repeated.
        expanded = (*q.shape[:2], v.shape[2], q.shape[3])
        if k.shape != q.shape or k.dtype != q.dtype:
            raise ValueError(
                f"k: expected [B, T, H, K] matching q {list(q.shape)} {q.dtype}, got {list(k.shape)} {k.dtype}"
            )
        q = torch.empty(expanded, dtype=q.dtype, device="meta")
        k = torch.empty(expanded, dtype=k.dtype, device="meta")
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    device = v.device
    for name, t in (("k", k), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.device.type != "meta" and t.device != device:
            raise ValueError(f"{name}: is on {t.device} but v is on {device}; move it with .to({device})")


class _RecurrentFunction(torch.autograd.Function):
    """Autograd over torch.ops.mmh.recurrent_fwd / recurrent_bwd (CPU or CUDA tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state):
        needs_grad = any(ctx.needs_input_grad[:6])
        # Checkpoints cost B T / C states of memory: only stored when a backward will follow.
        every = CHECKPOINT_EVERY if needs_grad else 0
        o, final_state, checkpoints = torch.ops.mmh.recurrent_fwd(
            q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, every
        )
        if needs_grad:
            ctx.save_for_backward(q, k, v, g, beta, checkpoints, cu_seqlens)
            ctx.scale = scale
            ctx.dtypes = (
                None if g is None else g.dtype,
                None if beta is None else beta.dtype,
                None if initial_state is None else initial_state.dtype,
            )
        return o, (final_state if output_final_state else None)

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        q, k, v, g, beta, checkpoints, cu_seqlens = ctx.saved_tensors
        if grad_o is None:
            grad_o = torch.zeros_like(v)
        dq, dk, dv, dg, dbeta, dh0 = torch.ops.mmh.recurrent_bwd(
            q, k, v, g, beta, checkpoints, cu_seqlens, grad_o, grad_final_state, ctx.scale, CHECKPOINT_EVERY
        )
        g_dtype, beta_dtype, h0_dtype = ctx.dtypes
        return (
            dq,
            dk,
            dv,
            None if g_dtype is None else dg.to(g_dtype),
            None if beta_dtype is None else dbeta.to(beta_dtype),
            None if h0_dtype is None else dh0.to(h0_dtype),
            None,
            None,
            None,
        )


def _resolve_backend(name: str, backend: str, q: Tensor) -> str:
    """The backend that runs: an explicit one is checked; "auto" says once when it falls back."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    cuda_fits = q.shape[-1] <= CUDA_MAX_HEAD_DIM and q.dtype != torch.float64
    if backend == "auto":
        if q.is_cuda and _ext.has_cuda_ops() and cuda_fits:
            return "cuda"
        if q.device.type == "cpu" and _ext.has_cpu_ops():
            return "cpp"
        if q.is_cuda and _ext.has_cuda_ops():
            _ext.warn_missing_once(
                f"{name} with K={q.shape[-1]} {q.dtype} on cuda (the kernel takes K <= "
                f"{CUDA_MAX_HEAD_DIM}, fp32/fp16/bf16)",
                fallback="the token-by-token PyTorch reference",
            )
        else:
            _ext.warn_missing_once(f"{name} on {q.device.type}", fallback="the token-by-token PyTorch reference")
        return "torch"
    if backend == "cuda":
        if not q.is_cuda:
            raise ValueError(f"backend: 'cuda' needs CUDA tensors, q is on {q.device}; use 'cpp' or 'auto'")
        _ext.require("cuda")
    elif backend == "cpp":
        if q.device.type != "cpu":
            raise ValueError(f"backend: 'cpp' needs CPU tensors, q is on {q.device}; use 'cuda' or 'auto'")
        _ext.require("cpu")
    return backend


def _run(name, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend):
    check_options(scale, cu_seqlens)
    _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    chosen = _resolve_backend(name, backend, q)
    if chosen == "torch":
        group = v.shape[2] // q.shape[2]
        if group > 1:
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        if g is None:
            g = v.new_zeros(v.shape[:3])
        if beta is None:
            return recurrent_simple_gla(
                q, k, v, g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            )
        return recurrent_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        )
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    return _RecurrentFunction.apply(
        q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state
    )


def fused_recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule, one token at a time: S = e^g S; S += k (beta (v - S^T k))^T; o = S^T (scale q).

    q, k [B, T, Hqk, K]; v [B, T, Hv, V] with Hv a multiple of Hqk; g [B, T, Hv] log decay
    (None: no decay); beta [B, T, Hv]; scale defaults to K ** -0.5; initial_state [N, Hv, K, V];
    cu_seqlens [N + 1] offsets of packed sequences (B == 1). use_qk_l2norm_in_kernel normalises
    q and k first (in PyTorch, fla's formula). Returns o [B, T, Hv, V] in v's dtype and the final
    state [N, Hv, K, V] fp32 (fp64 for fp64 inputs) if output_final_state, else None.
    """
    if beta is None:
        raise ValueError(_NO_BETA)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return _run(
        "fused_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state,
        output_final_state, cu_seqlens, backend,
    )


def fused_recurrent_simple_gla(
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
    """Scalar-decay gated linear attention, one token at a time: S = e^g S + k v^T; o = S^T (scale q).

    g [B, T, Hv] is a per-token log decay; g_gamma [Hv] a constant one per head (pass at most
    one; neither means no decay). Other arguments and results as fused_recurrent_gated_delta_rule.
    """
    g = decay_from_g_gamma(g, g_gamma, v)
    return _run(
        "fused_recurrent_simple_gla", q, k, v, g, None, scale, initial_state, output_final_state,
        cu_seqlens, backend,
    )


def _registry_fn(fn: Callable, backend: str) -> Callable:
    """Adapts fn to the registry's backend signature (see __init__.Backend): no chunks to size."""

    def run(*tensors, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=None):
        return fn(
            *tensors, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, backend=backend,
        )

    return run


def register_recurrent_backends(register_backend: Callable) -> None:
    """Registers "cuda" and "cpp" for gated_delta_rule and simple_gla below every chunked backend.

    A token loop suits decode-style steps, not long sequences, so "auto" never picks them over
    a chunked backend; backend="cuda" / "cpp" asks for them.
    """
    supports = {
        "cuda": lambda q: q.is_cuda and _ext.has_cuda_ops() and q.shape[-1] <= CUDA_MAX_HEAD_DIM
        and q.dtype != torch.float64,
        "cpp": lambda q: q.device.type == "cpu" and _ext.has_cpu_ops(),
    }
    for name, ok in supports.items():
        register_backend(
            "gated_delta_rule", name, _registry_fn(fused_recurrent_gated_delta_rule, name), priority=-2, supports=ok
        )
        register_backend("simple_gla", name, _registry_fn(fused_recurrent_simple_gla, name), priority=-2, supports=ok)
