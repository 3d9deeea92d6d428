"""SwiGLU of the experts' first matmul: act = silu(gate) * up, with h1 = [gate | up] along
the last dimension. One Triton kernel each way instead of eager PyTorch's chunk, silu, mul
and their backward (several passes and a cat over [N, 2F]).

Shape legend: N rows, F expert FFN size; h1 [N, 2F], act [N, F].
"""

import torch
import torch.nn.functional as F

from .._intmath import cdiv, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU
    triton = None


def swiglu_reference(h1: torch.Tensor) -> torch.Tensor:
    gate, up = h1.chunk(2, dim=-1)  # [N, F] each
    return F.silu(gate) * up


if triton is not None:
    from .._launch import fast_launch

    @fast_launch
    @triton.jit
    def _swiglu_fwd_kernel(h1, act, ffn, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < ffn
        gate = tl.load(h1 + row * 2 * ffn + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h1 + row * 2 * ffn + ffn + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(act + row * ffn + cols, out.to(act.dtype.element_ty), mask=mask)

    @fast_launch
    @triton.jit
    def _swiglu_bwd_kernel(h1, grad_act, grad_h1, ffn, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < ffn
        gate = tl.load(h1 + row * 2 * ffn + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h1 + row * 2 * ffn + ffn + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_act + row * ffn + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(grad_h1 + row * 2 * ffn + cols, d_gate.to(grad_h1.dtype.element_ty), mask=mask)
        tl.store(grad_h1 + row * 2 * ffn + ffn + cols, (g * silu).to(grad_h1.dtype.element_ty), mask=mask)


def _launch(kernel, h1, *tensors):
    ffn = h1.shape[1] // 2
    block = min(1024, next_power_of_2(max(ffn, 16)))
    if h1.shape[0]:
        kernel[(h1.shape[0], cdiv(ffn, block))](h1, *tensors, ffn, BLOCK=block)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h1):
        h1 = h1.contiguous()
        act = h1.new_empty(h1.shape[0], h1.shape[1] // 2)
        _launch(_swiglu_fwd_kernel, h1, act)
        ctx.save_for_backward(h1)
        return act

    @staticmethod
    def backward(ctx, grad_act):
        (h1,) = ctx.saved_tensors
        grad_h1 = torch.empty_like(h1)
        _launch(_swiglu_bwd_kernel, h1, grad_act.contiguous(), grad_h1)
        return grad_h1


def swiglu(h1: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """h1 [N, 2F] -> silu(h1[:, :F]) * h1[:, F:] [N, F]; computed in fp32, stored in h1's dtype.

    backend "auto": the Triton kernels on CUDA (float32/16, bfloat16), the reference elsewhere.
    """
    if h1.dim() != 2 or h1.shape[1] % 2:
        raise ValueError(f"h1 must be [N, 2F] (gate | up), got shape {tuple(h1.shape)}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    use_triton = backend == "triton" or (
        backend == "auto" and triton is not None and h1.is_cuda and h1.dtype != torch.float64
    )
    if use_triton:
        if triton is None or h1.dtype == torch.float64:
            raise ValueError("backend='triton' needs Triton and a float32/float16/bfloat16 h1")
        return _SwiGLU.apply(h1)
    return swiglu_reference(h1)
