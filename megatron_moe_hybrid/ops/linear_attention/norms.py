"""Per-head norms of the linear-attention layer, one fused Triton kernel each way.

l2_normalize: q and k after the short conv, x / sqrt(sum x^2 + eps) per head (fla's l2norm).
The kernel reads x through its strides (a slice of the conv output: no copy).

gated_rms_norm: the recurrence's output, y = weight * rmsnorm(x) * silu(z), per head.

Qwen3-Next (and fla's FusedRMSNormGated) normalise each head's V values of the recurrence's
output with one weight of size V shared by every head, then gate them with silu(z), z a
slice of the fused input projection. Eager PyTorch spends about ten fp32 passes forward and
twenty backward over [B, T, H, V] on it; here it is one Triton kernel each way, which reads
x and z through their strides (z is a strided view of the projection: no copy) and can write
y sequence-first ([T, B, H, V], Megatron's [s, b, h] once flattened), so that out_proj needs
no transpose copy either.

Shape legend: B batch, T sequence, H heads, V head dim; N = B * T * H rows of V.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .._intmath import cdiv, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU
    triton = None

__all__ = ["gated_rms_norm", "gated_rms_norm_reference", "l2_normalize", "l2_normalize_reference"]

ROWS_PER_PROGRAM = 16


def gated_rms_norm_reference(x: Tensor, z: Tensor, weight: Tensor, eps: float, seq_first: bool = False) -> Tensor:
    """x, z [B, T, H, V], weight [V] -> y [B, T, H, V] ([T, B, H, V] with seq_first), x.dtype.

    As Qwen3-Next's RMSNormGated: the norm in fp32 (fp64 for fp64 inputs), rounded to x's dtype
    before the weight, the gate in fp32.
    """
    wide = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(wide)
    n = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = (weight * n.to(x.dtype)) * F.silu(z.to(wide))
    y = y.to(x.dtype)
    return y.transpose(0, 1).contiguous() if seq_first else y


def l2_normalize_reference(x: Tensor, eps: float) -> Tensor:
    """fla's l2norm: x * rsqrt(sum x^2 + eps) over the last dim, in x's dtype."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


if triton is not None:
    from .._launch import fast_launch

    @triton.jit
    def _row_pointers(row, T, H, s_b, s_t, s_h):
        """Row index over [B, T, H] -> element offset of its first value (int64)."""
        h = row % H
        t = (row // H) % T
        b = row // (H * T)
        return b * s_b + t * s_t + h * s_h

    @fast_launch
    @triton.jit
    def _gated_norm_fwd_kernel(x_ptr, z_ptr, w_ptr, y_ptr, N, T, H, V, eps,
                               xs_b, xs_t, xs_h, zs_b, zs_t, zs_h, ys_b, ys_t, ys_h,
                               ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        cols = tl.arange(0, BLOCK_V)
        m_row = rows < N
        m = m_row[:, None] & (cols < V)[None, :]
        px = x_ptr + _row_pointers(rows, T, H, xs_b, xs_t, xs_h)[:, None] + cols[None, :]
        pz = z_ptr + _row_pointers(rows, T, H, zs_b, zs_t, zs_h)[:, None] + cols[None, :]
        x = tl.load(px, mask=m, other=0.0).to(tl.float32)
        z = tl.load(pz, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / V + eps)  # [ROWS]
        y = w[None, :] * (x * rstd[:, None]) * (z * tl.sigmoid(z))
        py = y_ptr + _row_pointers(rows, T, H, ys_b, ys_t, ys_h)[:, None] + cols[None, :]
        tl.store(py, y.to(y_ptr.dtype.element_ty), mask=m)

    @fast_launch
    @triton.jit
    def _gated_norm_bwd_kernel(x_ptr, z_ptr, w_ptr, dy_ptr, dx_ptr, dz_ptr, dw_ptr, N, T, H, V, eps,
                               xs_b, xs_t, xs_h, zs_b, zs_t, zs_h, ys_b, ys_t, ys_h,
                               ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
        """dx, dz [N, V] contiguous; dw partial sums [programs, V] fp32."""
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_V)
        m_row = rows < N
        m = m_row[:, None] & (cols < V)[None, :]
        px = x_ptr + _row_pointers(rows, T, H, xs_b, xs_t, xs_h)[:, None] + cols[None, :]
        pz = z_ptr + _row_pointers(rows, T, H, zs_b, zs_t, zs_h)[:, None] + cols[None, :]
        pdy = dy_ptr + _row_pointers(rows, T, H, ys_b, ys_t, ys_h)[:, None] + cols[None, :]
        x = tl.load(px, mask=m, other=0.0).to(tl.float32)
        z = tl.load(pz, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(pdy, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / V + eps)
        n = x * rstd[:, None]
        sig = tl.sigmoid(z)
        gate = z * sig
        dn = dy * w[None, :] * gate
        dx = rstd[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / V)[:, None])
        dz = dy * w[None, :] * n * sig * (1.0 + z * (1.0 - sig))
        out = rows[:, None] * V + cols[None, :]
        tl.store(dx_ptr + out, dx.to(dx_ptr.dtype.element_ty), mask=m)
        tl.store(dz_ptr + out, dz.to(dz_ptr.dtype.element_ty), mask=m)
        tl.store(dw_ptr + pid * V + cols, tl.sum(dy * n * gate, axis=0), mask=cols < V)


    @fast_launch
    @triton.jit
    def _l2norm_fwd_kernel(x_ptr, y_ptr, N, T, H, D, eps, xs_b, xs_t, xs_h,
                           ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        """x rows through their strides -> y [N, D] contiguous."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        m = (rows < N)[:, None] & (cols < D)[None, :]
        px = x_ptr + _row_pointers(rows, T, H, xs_b, xs_t, xs_h)[:, None] + cols[None, :]
        x = tl.load(px, mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) + eps)
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=m)

    @fast_launch
    @triton.jit
    def _l2norm_bwd_kernel(x_ptr, dy_ptr, dx_ptr, N, T, H, D, eps, xs_b, xs_t, xs_h,
                           ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        """dy, dx [N, D] contiguous: dx = rstd * (dy - n * sum(dy * n)), n = x * rstd."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        m = (rows < N)[:, None] & (cols < D)[None, :]
        px = x_ptr + _row_pointers(rows, T, H, xs_b, xs_t, xs_h)[:, None] + cols[None, :]
        x = tl.load(px, mask=m, other=0.0).to(tl.float32)
        out = rows[:, None] * D + cols[None, :]
        dy = tl.load(dy_ptr + out, mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) + eps)
        n = x * rstd[:, None]
        dx = rstd[:, None] * (dy - n * tl.sum(dy * n, axis=1)[:, None])
        tl.store(dx_ptr + out, dx.to(dx_ptr.dtype.element_ty), mask=m)


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, eps, seq_first):
        B, T, H, V = x.shape
        N = B * T * H
        y = torch.empty((T, B, H, V) if seq_first else (B, T, H, V), device=x.device, dtype=x.dtype)
        y_view = y.transpose(0, 1) if seq_first else y  # [B, T, H, V] over y's storage
        grid = (cdiv(N, ROWS_PER_PROGRAM),)
        _gated_norm_fwd_kernel[grid](x, z, weight, y_view, N, T, H, V, eps,
                                     *_strides(x), *_strides(z), *_strides(y_view),
                                     ROWS=ROWS_PER_PROGRAM, BLOCK_V=next_power_of_2(V))
        ctx.save_for_backward(x, z, weight)
        ctx.eps, ctx.seq_first = eps, seq_first
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, weight = ctx.saved_tensors
        B, T, H, V = x.shape
        N = B * T * H
        dy_view = dy.transpose(0, 1) if ctx.seq_first else dy
        if dy_view.stride(-1) != 1:
            dy_view = dy_view.contiguous()
        dx = torch.empty((B, T, H, V), device=x.device, dtype=x.dtype)
        dz = torch.empty((B, T, H, V), device=z.device, dtype=z.dtype)
        programs = cdiv(N, ROWS_PER_PROGRAM)
        dw = torch.empty((programs, V), device=x.device, dtype=torch.float32)
        _gated_norm_bwd_kernel[(programs,)](x, z, weight, dy_view, dx, dz, dw, N, T, H, V, ctx.eps,
                                            *_strides(x), *_strides(z), *_strides(dy_view),
                                            ROWS=ROWS_PER_PROGRAM, BLOCK_V=next_power_of_2(V))
        dw = dw.sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        return dx, dz, dw, None, None


def _backend(backend: str, x: Tensor) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":  # the kernels compute in fp32: fp64 inputs keep the reference's fp64
        return "triton" if x.is_cuda and triton is not None and x.dtype != torch.float64 else "torch"
    if backend == "triton" and triton is None:
        raise ValueError("backend: 'triton' needs the triton package (pip install triton), or use backend='torch'")
    return backend


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float, seq_first: bool = False,
                   backend: str = "auto") -> Tensor:
    """weight * rmsnorm(x) * silu(z) over the last dim: x, z [B, T, H, V] (any strides with a
    unit last stride), weight [V] -> y [B, T, H, V], or [T, B, H, V] with seq_first, in x.dtype.

    backend "triton" (one fused kernel each way), "torch" (gated_rms_norm_reference) or "auto"
    (triton for CUDA tensors when it is installed). The fused form rounds once, at the end; the
    reference rounds the norm to x's dtype before the weight, as Qwen3-Next does: they agree to
    that rounding.
    """
    if x.dim() != 4 or z.shape != x.shape:
        raise ValueError(
            f"x, z: expected two [B, T, H, V] tensors of one shape, got {tuple(x.shape)} and {tuple(z.shape)}"
        )
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight: expected shape [V={x.shape[-1]}], got {tuple(weight.shape)}")
    if _backend(backend, x) == "torch":
        return gated_rms_norm_reference(x, z, weight, eps, seq_first)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    return _GatedRMSNorm.apply(x, z, weight.contiguous(), float(eps), bool(seq_first))


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        B, T, H, D = x.shape
        N = B * T * H
        y = torch.empty((B, T, H, D), device=x.device, dtype=x.dtype)
        _l2norm_fwd_kernel[(cdiv(N, ROWS_PER_PROGRAM),)](
            x, y, N, T, H, D, eps, *_strides(x), ROWS=ROWS_PER_PROGRAM, BLOCK_D=next_power_of_2(D))
        ctx.save_for_backward(x)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        B, T, H, D = x.shape
        N = B * T * H
        dy = dy.contiguous()
        dx = torch.empty((B, T, H, D), device=x.device, dtype=x.dtype)
        _l2norm_bwd_kernel[(cdiv(N, ROWS_PER_PROGRAM),)](
            x, dy, dx, N, T, H, D, ctx.eps, *_strides(x), ROWS=ROWS_PER_PROGRAM, BLOCK_D=next_power_of_2(D))
        return dx, None


def l2_normalize(x: Tensor, eps: float, backend: str = "auto") -> Tensor:
    """x [B, T, H, D] (any strides with a unit last stride) -> x / sqrt(sum x^2 + eps) per row,
    contiguous, in x's dtype. backend as gated_rms_norm's; the fused form computes in fp32."""
    if x.dim() != 4:
        raise ValueError(f"x: expected [B, T, H, D], got shape {tuple(x.shape)}")
    backend = _backend(backend, x)
    if backend == "torch":
        return l2_normalize_reference(x, eps)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _L2Normalize.apply(x, float(eps))
