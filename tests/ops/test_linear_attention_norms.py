"""The fused per-head norms (Triton; the interpreter on CPU) against the eager references,
forward and gradients, on fresh random inputs: the gated RMSNorm with a strided z and the
sequence-first output, the l2norm of strided q/k slices.

Shape legend: B batch, T sequence, H heads, V head dim.
"""

import pytest
import torch

from megatron_moe_hybrid.ops.linear_attention.norms import (
    gated_rms_norm,
    gated_rms_norm_reference,
    l2_normalize,
    l2_normalize_reference,
)

SHAPES = [(1, 1, 1, 8), (2, 5, 3, 16), (3, 7, 2, 24)]  # V 24: a masked tail of the 32-wide block
EPS = 1e-6


def _inputs(B, T, H, V, dtype, strided_z):
    x = (torch.randn(B, T, H, V, dtype=torch.float64) * 2).to(dtype).requires_grad_(True)
    if strided_z:  # z as a slice of a sequence-first projection, as the layer takes it
        proj = torch.randn(T, B, H * V + 5, dtype=torch.float64).to(dtype).requires_grad_(True)
        z = proj.transpose(0, 1)[..., 3 : 3 + H * V].unflatten(-1, (H, V))
        assert B * T * H == 1 or not z.is_contiguous()
        leaf_z = proj
    else:
        z = leaf_z = (torch.randn(B, T, H, V, dtype=torch.float64) * 2).to(dtype).requires_grad_(True)
    w = torch.empty(V, dtype=torch.float64).uniform_(0.5, 1.5).to(dtype).requires_grad_(True)
    return x, z, leaf_z, w


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("strided_z", [False, True], ids=["z", "z-view"])
@pytest.mark.parametrize("seq_first", [False, True], ids=["bthv", "tbhv"])
def test_triton_matches_reference(shape, dtype, strided_z, seq_first):
    x, z, leaf_z, w = _inputs(*shape, dtype, strided_z)
    got = gated_rms_norm(x, z, w, EPS, seq_first=seq_first, backend="triton")
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, (x, leaf_z, w), g)
    # the reference in float64 on the same values
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    z64_leaf = leaf_z.detach().double().requires_grad_(True)
    z64 = z64_leaf.transpose(0, 1)[..., 3 : 3 + z.shape[2] * z.shape[3]].unflatten(-1, z.shape[2:]) if strided_z else z64_leaf
    want = gated_rms_norm_reference(x64, z64, w64, EPS, seq_first=seq_first)
    want_grads = torch.autograd.grad(want, (x64, z64_leaf, w64), g.double())
    assert got.shape == want.shape and got.is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    for a, b, name in zip(grads, want_grads, ("x", "z", "weight")):
        scale = 1.0 if name != "weight" else max(1.0, float(b.abs().max()))
        torch.testing.assert_close(a.double() / scale, b / scale, **tol, msg=lambda m: f"grad {name}: {m}")


def test_frozen_weight_skips_its_gradient():
    x, z, _, w = _inputs(2, 3, 2, 8, torch.float32, False)
    want = torch.autograd.grad(gated_rms_norm(x, z, w, EPS, backend="triton").sum(), (x, z))
    frozen = w.detach()
    got = torch.autograd.grad(gated_rms_norm(x, z, frozen, EPS, backend="triton").sum(), (x, z))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reference_is_qwen3_next_formula():
    """The reference against the HF module's formula, written out: a check that the fused form
    is compared with the right thing."""
    x, z, _, w = _inputs(2, 4, 3, 16, torch.float32, False)
    var = x.pow(2).mean(-1, keepdim=True)
    want = w * (x * torch.rsqrt(var + EPS)) * torch.nn.functional.silu(z)
    torch.testing.assert_close(gated_rms_norm_reference(x, z, w, EPS), want)


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_l2_normalize_matches_reference_on_a_strided_slice(shape, dtype):
    B, T, H, D = shape
    conv_out = (torch.randn(B, T, 2 * H * D + 3, dtype=torch.float64) * 2).to(dtype).requires_grad_(True)
    k = conv_out[..., H * D : 2 * H * D].unflatten(-1, (H, D))  # the layer's k: a slice of the conv output
    got = l2_normalize(k, EPS, backend="triton")
    g = torch.randn_like(got)
    (grad,) = torch.autograd.grad(got, conv_out, g)
    c64 = conv_out.detach().double().requires_grad_(True)
    want = l2_normalize_reference(c64[..., H * D : 2 * H * D].unflatten(-1, (H, D)), EPS)
    (want_grad,) = torch.autograd.grad(want, c64, g.double())
    assert got.is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(grad.double(), want_grad, **tol)
    assert float(grad[..., : H * D].abs().max()) == 0.0  # q's part of the slice gets nothing


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="x:"):
        l2_normalize(torch.randn(3, 8), EPS)
    x = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="x, z"):
        gated_rms_norm(x, torch.randn(2, 3, 4, 7), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm(x, x, torch.ones(7), EPS)
    with pytest.raises(ValueError, match="backend"):
        gated_rms_norm(x, x, torch.ones(8), EPS, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("seq_first", [False, True], ids=["bthv", "tbhv"])
def test_bf16_cuda_matches_fp32_reference(seq_first):
    B, T, H, V = 4, 4096, 32, 128
    x = torch.randn(B, T, H, V, device="cuda").bfloat16().requires_grad_(True)
    proj = torch.randn(T, B, 2 * H * V, device="cuda").bfloat16().requires_grad_(True)
    z = proj.transpose(0, 1)[..., H * V :].unflatten(-1, (H, V))
    w = torch.empty(V, device="cuda").uniform_(0.5, 1.5).bfloat16().requires_grad_(True)
    got = gated_rms_norm(x, z, w, EPS, seq_first=seq_first)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, (x, proj, w), g)
    x32, p32, w32 = (t.detach().float().requires_grad_(True) for t in (x, proj, w))
    z32 = p32.transpose(0, 1)[..., H * V :].unflatten(-1, (H, V))
    want = gated_rms_norm_reference(x32, z32, w32, EPS, seq_first=seq_first)
    want_grads = torch.autograd.grad(want, (x32, p32, w32), g.float())
    for a, b in ((got, want), *zip(grads, want_grads)):
        assert float((a.float() - b).norm() / b.norm()) < 1e-2


@pytest.mark.gpu
def test_l2_normalize_bf16_cuda_matches_fp32_reference():
    B, T, H, D = 4, 4096, 16, 128
    conv_out = torch.randn(B, T, 4 * H * D, device="cuda").bfloat16().requires_grad_(True)
    got = l2_normalize(conv_out[..., : H * D].unflatten(-1, (H, D)), EPS)
    g = torch.randn_like(got)
    (grad,) = torch.autograd.grad(got, conv_out, g)
    c32 = conv_out.detach().float().requires_grad_(True)
    want = l2_normalize_reference(c32[..., : H * D].unflatten(-1, (H, D)), EPS)
    (want_grad,) = torch.autograd.grad(want, c32, g.float())
    for a, b in ((got, want), (grad, want_grad)):
        assert float((a.float() - b).norm() / b.norm()) < 1e-2
