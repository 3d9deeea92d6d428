"""The fused SwiGLU (Triton; the interpreter on CPU) against the eager reference, forward and
gradient, on fresh random inputs.

Shape legend: N rows, F expert FFN size; h1 [N, 2F] = [gate | up].
"""

import pytest
import torch

from megatron_moe_hybrid.ops.moe.swiglu import swiglu, swiglu_reference

SHAPES = [(1, 1), (7, 5), (33, 48), (4, 1100)]  # the last spans two 1024-column blocks


@pytest.mark.parametrize("n,f", SHAPES, ids=[f"N{n}-F{f}" for n, f in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_reference(n, f, dtype):
    h1 = (torch.randn(n, 2 * f, dtype=torch.float64) * 3).to(dtype).requires_grad_(True)
    g = torch.randn(n, f, dtype=dtype)
    got = swiglu(h1, backend="triton")
    (grad,) = torch.autograd.grad(got, h1, g)
    h64 = h1.detach().double().requires_grad_(True)
    want = swiglu_reference(h64)
    (want_grad,) = torch.autograd.grad(want, h64, g.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(grad.double(), want_grad, **tol)


def test_bad_shape_names_h1():
    with pytest.raises(ValueError, match="h1"):
        swiglu(torch.randn(3, 5))


@pytest.mark.gpu
def test_bf16_cuda_matches_fp32_reference():
    h1 = torch.randn(4096, 2 * 1408, device="cuda").bfloat16().requires_grad_(True)
    g = torch.randn(4096, 1408, device="cuda").bfloat16()
    got = swiglu(h1)
    (grad,) = torch.autograd.grad(got, h1, g)
    h32 = h1.detach().float().requires_grad_(True)
    want = swiglu_reference(h32)
    (want_grad,) = torch.autograd.grad(want, h32, g.float())
    for a, b in ((got, want), (grad, want_grad)):
        assert float((a.float() - b).norm() / b.norm()) < 8e-3
