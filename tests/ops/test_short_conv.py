"""The fused causal short conv + SiLU (Triton; the interpreter on CPU) against the F.conv1d
reference in float64, forward and both gradients; strided input views, packed sequences,
argument checks.

Shape legend: B batch, T time, C channels, W kernel size, D projection width (> C).
"""

from itertools import pairwise

import pytest
import torch

from megatron_moe_hybrid.ops.linear_attention import short_conv
from megatron_moe_hybrid.ops.linear_attention.short_conv import (
    causal_conv1d,
    causal_conv1d_reference,
)

SHAPES = [(2, 37, 24, 4), (1, 1, 5, 4), (3, 130, 200, 3)]  # the last spans several T- and C-blocks
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Every buffer the kernels write starts as NaN, so an element they skip fails the test."""

    def nan_alloc(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(short_conv, "_alloc", nan_alloc)


def _reference64(x, weight, g, cu_seqlens=None, activation=True):
    """y, dx, dw of the reference in float64 on the same (rounded) inputs."""
    x64 = x.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    y = causal_conv1d_reference(x64, w64, cu_seqlens, activation)
    dx, dw = torch.autograd.grad(y, (x64, w64), g.double())
    return y, dx, dw


def _inputs(B, T, C, W, dtype, weight_grad=True):
    x = torch.randn(B, T, C, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(C, W, dtype=torch.float64) / W**0.5).to(dtype).requires_grad_(weight_grad)
    g = torch.randn(B, T, C, dtype=dtype)
    return x, weight, g


@pytest.mark.parametrize("B,T,C,W", SHAPES, ids=[f"B{b}-T{t}-C{c}-W{w}" for b, t, c, w in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("activation", [True, False], ids=["silu", "identity"])
@pytest.mark.parametrize("weight_grad", [True, False], ids=["dw", "no_dw"])
def test_triton_matches_reference(B, T, C, W, dtype, activation, weight_grad):
    x, weight, g = _inputs(B, T, C, W, dtype, weight_grad)
    y = causal_conv1d(x, weight, activation=activation, backend="triton")
    assert y.shape == (B, T, C) and y.dtype == dtype and y.is_contiguous()
    wants = (x, weight) if weight_grad else (x,)
    grads = torch.autograd.grad(y, wants, g)
    want_y, want_dx, want_dw = _reference64(x, weight, g, activation=activation)
    torch.testing.assert_close(y.double(), want_y, **TOL[dtype])
    torch.testing.assert_close(grads[0].double(), want_dx, **TOL[dtype])
    if weight_grad:
        assert grads[1].dtype == dtype
        # dw sums B*T products: compare relative to its size
        torch.testing.assert_close(grads[1].double(), want_dw, **TOL[dtype])


def test_strided_view_of_projection_grads_reach_it():
    T, B, D, C, W = 45, 2, 40, 24, 4
    proj = torch.randn(T, B, D, requires_grad=True)
    x = proj.transpose(0, 1)[..., :C]  # [B, T, C], strides (D, B*D, 1)
    assert x.stride() == (D, B * D, 1)
    weight = torch.randn(C, 1, W, requires_grad=True)  # nn.Conv1d's layout
    g = torch.randn(B, T, C)
    y = causal_conv1d(x, weight, backend="triton")
    dproj, dw = torch.autograd.grad(y, (proj, weight), g)
    want_y, want_dx, want_dw = _reference64(x, weight.squeeze(1), g)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dproj[:, :, :C].transpose(0, 1).double(), want_dx, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(dproj[:, :, C:]) == 0
    assert dw.shape == (C, 1, W)
    torch.testing.assert_close(dw.squeeze(1).double(), want_dw, rtol=1e-5, atol=1e-5)


def test_packed_sequences_restart_at_each_boundary():
    C, W = 12, 4
    cu_seqlens = torch.tensor([0, 5, 5, 40, 41, 64], dtype=torch.int32)  # an empty and a length-1 one
    T = int(cu_seqlens[-1])
    x, weight, g = _inputs(1, T, C, W, torch.float32)
    y = causal_conv1d(x, weight, cu_seqlens, backend="triton")
    dx, dw = torch.autograd.grad(y, (x, weight), g)
    want_y, want_dx, want_dw = _reference64(x, weight, g, cu_seqlens)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), want_dw, rtol=1e-5, atol=1e-5)

    offsets = cu_seqlens.tolist()
    separate = torch.cat(
        [causal_conv1d(x[:, s:e], weight, backend="triton") for s, e in pairwise(offsets) if e > s],
        dim=1,
    )
    torch.testing.assert_close(y, separate, rtol=1e-5, atol=1e-5)
    unpacked = causal_conv1d(x, weight, backend="triton")
    # the first token of each later sequence would see its predecessor's tail without the restart
    for start in (5, 40, 41):
        assert not torch.allclose(y[:, start], unpacked[:, start])
    torch.testing.assert_close(y[:, :5], unpacked[:, :5])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs_name_the_argument(backend):
    x, weight = torch.randn(2, 8, 6), torch.randn(6, 4)
    with pytest.raises(ValueError, match="x"):
        causal_conv1d(torch.randn(8, 6), weight, backend=backend)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(5, 4), backend=backend)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(6, 2, 4), backend=backend)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x, weight, torch.tensor([0, 3, 8]), backend=backend)  # B == 2
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x[:1], weight, torch.tensor([0.0, 8.0]), backend=backend)
    with pytest.raises(ValueError, match="backend"):
        causal_conv1d(x, weight, backend="cuda")


def test_triton_refuses_too_many_taps():
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(torch.randn(1, 8, 6), torch.randn(6, 9), backend="triton")


@pytest.mark.gpu
def test_bf16_cuda_strided_matches_fp32_reference():
    B, T, C, D, W = 4, 4096, 8192, 12352, 4
    proj = torch.randn(T, B, D, device="cuda").bfloat16().requires_grad_(True)
    x = proj.transpose(0, 1)[..., :C]
    weight = (torch.randn(C, W, device="cuda") / W**0.5).bfloat16().requires_grad_(True)
    g = torch.randn(B, T, C, device="cuda").bfloat16()
    y = causal_conv1d(x, weight)
    dproj, dw = torch.autograd.grad(y, (proj, weight), g)
    dx = dproj.transpose(0, 1)[..., :C]
    x32 = x.detach().float().requires_grad_(True)
    w32 = weight.detach().float().requires_grad_(True)
    want_y = causal_conv1d_reference(x32, w32)
    want_dx, want_dw = torch.autograd.grad(want_y, (x32, w32), g.float())
    for name, a, b in (("y", y, want_y), ("dx", dx, want_dx), ("dw", dw, want_dw)):
        a, b = a.detach().float(), b.detach()
        err = float((a - b).norm() / b.norm())
        assert err < 1e-2, f"{name}: relative error {err:.2e}"
