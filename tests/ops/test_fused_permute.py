"""fused_permute / fused_unpermute (the compiled torch.ops.mmh ops) against the PyTorch reference.

Shape legend:
  T   tokens                      K   experts chosen per token (top-k)
  E   experts                     h   hidden size
  TK  = T * K permuted rows

Forward outputs must equal the same-dtype reference bit for bit on CPU (a copy, and sums
in the same order and precision). Gradients are compared with the reference run in
float64 on the same inputs, at torch.testing's default tolerance for the gradient's dtype.
"""

import pytest
import torch

from megatron_moe_hybrid import _ext
from megatron_moe_hybrid.ops.moe import fused_permute as fp

needs_cpu_ops = pytest.mark.skipif(
    not _ext.has_cpu_ops(),
    reason="megatron_moe_hybrid._C is not built: run `pip install --no-build-isolation -e .` with a C++ compiler",
)
needs_cuda_ops = pytest.mark.skipif(
    not _ext.has_cuda_ops(), reason="megatron_moe_hybrid._C was built without its CUDA kernels"
)

# (T, K, E, h, repeats): odd sizes, K = 1, T = 0, more experts than copies; repeats lets one
# token pick the same expert twice, which the ops allow though routers do not.
SHAPES = [
    (1, 1, 1, 1, False),
    (7, 1, 4, 5, False),
    (33, 2, 8, 16, True),
    (63, 4, 16, 33, False),
    (17, 3, 40, 7, True),
    (0, 2, 4, 8, False),
    (128, 8, 64, 64, False),
]
SHAPE_IDS = [f"T{T}-K{K}-E{E}-h{h}" + ("-rep" if rep else "") for T, K, E, h, rep in SHAPES]
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _routing(T, K, E, repeats, seed):
    """[T, K] expert ids drawn only from experts e % 3 != 1, so that those receive zero tokens."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(E)[torch.arange(E) % 3 != 1]  # [<= E]
    if repeats:
        return pool[torch.randint(len(pool), (T, K), generator=g)]
    return pool[torch.rand(T, len(pool), generator=g).argsort(dim=1)[:, :K]]


def _fp64_leaf(t):
    return t.detach().cpu().double().requires_grad_()


def _check_permute(T, K, E, h, repeats, dtype, device):
    x = _randn(T, h, dtype=dtype, seed=1).to(device).requires_grad_()  # [T, h]
    topk_idx = _routing(T, K, E, repeats, seed=2).to(device)  # [T, K]
    permuted, row_id_map, tokens_per_expert = fp.fused_permute(x, topk_idx, E)
    x_ref = x.detach().cpu().requires_grad_()
    ref_permuted, ref_map, ref_counts = fp.permute_reference(x_ref, topk_idx.cpu(), E)
    torch.testing.assert_close(permuted.cpu(), ref_permuted, rtol=0, atol=0)
    torch.testing.assert_close(row_id_map.cpu(), ref_map, rtol=0, atol=0)
    torch.testing.assert_close(tokens_per_expert.cpu(), ref_counts, rtol=0, atol=0)
    if E > 1:
        assert (tokens_per_expert[1::3] == 0).all()

    grad = _randn(T * K, h, dtype=dtype, seed=3)  # [TK, h]
    (grad_x,) = torch.autograd.grad(permuted, x, grad.to(device))
    x64 = _fp64_leaf(x)
    (ref_grad_x,) = torch.autograd.grad(fp.permute_reference(x64, topk_idx.cpu(), E)[0], x64, grad.double())
    torch.testing.assert_close(grad_x.cpu(), ref_grad_x.to(dtype))
    return permuted, grad_x


def _check_unpermute(T, K, E, h, repeats, dtype, probs_dtype, device, exact):
    topk_idx = _routing(T, K, E, repeats, seed=4)  # [T, K]
    _, row_id_map, _ = fp.permute_reference(torch.zeros(T, 1), topk_idx, E)  # [TK]
    y = _randn(T * K, h, dtype=dtype, seed=5).requires_grad_()  # [TK, h]
    probs = torch.rand(T, K, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    probs = probs.to(probs_dtype or dtype).requires_grad_()  # [T, K]
    y_dev, probs_dev = (y.detach().to(device).requires_grad_(), probs.detach().to(device).requires_grad_())
    out = fp.fused_unpermute(y_dev, row_id_map.to(device), probs_dev)  # [T, h]
    ref = fp.unpermute_reference(y, row_id_map, probs)
    if exact:
        torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)
    else:
        torch.testing.assert_close(out.cpu(), ref)

    grad_out = _randn(T, h, dtype=dtype, seed=7)  # [T, h]
    grad_y, grad_probs = torch.autograd.grad(out, (y_dev, probs_dev), grad_out.to(device))
    y64, probs64 = _fp64_leaf(y), _fp64_leaf(probs)
    ref_out = fp.unpermute_reference(y64, row_id_map, probs64)
    ref_grad_y, ref_grad_probs = torch.autograd.grad(ref_out, (y64, probs64), grad_out.double())
    assert grad_y.dtype == y.dtype and grad_probs.dtype == probs.dtype
    torch.testing.assert_close(grad_y.cpu(), ref_grad_y.to(grad_y.dtype))
    torch.testing.assert_close(grad_probs.cpu(), ref_grad_probs.to(grad_probs.dtype))
    return out, grad_y, grad_probs


@needs_cpu_ops
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("T,K,E,h,repeats", SHAPES, ids=SHAPE_IDS)
def test_permute_matches_reference(T, K, E, h, repeats, dtype):
    _check_permute(T, K, E, h, repeats, dtype, "cpu")


@needs_cpu_ops
@pytest.mark.parametrize("probs_dtype", [None, torch.float32], ids=["probs-same", "probs-fp32"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("T,K,E,h,repeats", SHAPES, ids=SHAPE_IDS)
def test_unpermute_matches_reference(T, K, E, h, repeats, dtype, probs_dtype):
    _check_unpermute(T, K, E, h, repeats, dtype, probs_dtype, "cpu", exact=True)


@needs_cpu_ops
def test_threads_give_identical_bits():
    T, K, E, h = 257, 4, 16, 64  # several at::parallel_for chunks
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = _check_unpermute(T, K, E, h, False, torch.float32, None, "cpu", exact=True)
        serial += _check_permute(T, K, E, h, False, torch.float32, "cpu")
        torch.set_num_threads(3)
        parallel = _check_unpermute(T, K, E, h, False, torch.float32, None, "cpu", exact=True)
        parallel += _check_permute(T, K, E, h, False, torch.float32, "cpu")
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(serial, parallel):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reference_follows_definition():
    T, K, E, h = 9, 3, 5, 4
    x = _randn(T, h, dtype=torch.float64, seed=8)
    topk_idx = _routing(T, K, E, repeats=True, seed=9)
    probs = torch.rand(T, K, dtype=torch.float64)
    permuted, row_id_map, tokens_per_expert = fp.permute_reference(x, topk_idx, E)
    flat = topk_idx.flatten().tolist()
    for row, i in enumerate(sorted(range(T * K), key=lambda i: (flat[i], i))):
        assert row_id_map[i] == row
        assert torch.equal(permuted[row], x[i // K])
    assert tokens_per_expert.tolist() == [flat.count(e) for e in range(E)]
    out = fp.unpermute_reference(permuted, row_id_map, probs)
    expected = torch.stack([sum(probs[t, k] * x[t] for k in range(K)) for t in range(T)])
    torch.testing.assert_close(out, expected)


def test_missing_extension_falls_back_to_reference(monkeypatch):
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_warned", set())
    x = _randn(5, 3, dtype=torch.float32, seed=10)
    topk_idx = _routing(5, 2, 4, repeats=False, seed=11)
    with pytest.warns(_ext.MissingExtensionWarning, match="fused_permute on cpu"):
        out = fp.fused_permute(x, topk_idx, 4)
    for a, b in zip(out, fp.permute_reference(x, topk_idx, 4)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _bad_calls():
    x, idx = torch.randn(4, 3), torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    probs, row_id_map = torch.rand(4, 2), torch.arange(8)
    return [
        ("x-3d", lambda: fp.fused_permute(x[None], idx, 3), "x must be a 2-D"),
        ("idx-int32", lambda: fp.fused_permute(x, idx.int(), 3), r"topk_idx .*int64"),
        ("idx-rows", lambda: fp.fused_permute(x[:3], idx, 3), "topk_idx must be"),
        ("expert-range", lambda: fp.fused_permute(x, idx, 2), "topk_idx holds expert id"),
        ("map-length", lambda: fp.fused_unpermute(torch.randn(8, 3), row_id_map[:7], probs), "row_id_map"),
        ("y-rows", lambda: fp.fused_unpermute(torch.randn(6, 3), row_id_map, probs), "y has 6 rows"),
    ]


@pytest.mark.parametrize("name,call,match", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_value_error(name, call, match):
    with pytest.raises(ValueError, match=match):
        call()


@needs_cpu_ops
def test_ops_check_their_inputs():
    x, idx = torch.randn(4, 3), torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    with pytest.raises(ValueError, match="topk_idx must be int64"):
        torch.ops.mmh.permute_fwd(x, idx.int(), 3)
    with pytest.raises(ValueError, match="expert id 2 at flat index 3"):
        torch.ops.mmh.permute_fwd(x, idx, 2)
    with pytest.raises(ValueError, match="row_id_map holds row 8"):
        torch.ops.mmh.unpermute_fwd(torch.randn(8, 3), torch.arange(1, 9), torch.rand(4, 2))
    with pytest.raises(ValueError, match="grad_out must be"):
        torch.ops.mmh.unpermute_bwd(torch.randn(3, 3), torch.randn(8, 3), torch.arange(8), torch.rand(4, 2))


@needs_cpu_ops
def test_ops_schema_and_fake_tensor():
    x, topk_idx = _randn(7, 5, dtype=torch.float32, seed=12), _routing(7, 2, 4, repeats=False, seed=13)
    permuted, row_id_map, _ = torch.ops.mmh.permute_fwd(x, topk_idx, 4)
    probs, grad_out = torch.rand(7, 2), torch.randn(7, 5)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.mmh.permute_fwd.default, (x, topk_idx, 4), test_utils=checks)
    torch.library.opcheck(torch.ops.mmh.permute_bwd.default, (permuted, row_id_map, 7, 2), test_utils=checks)
    torch.library.opcheck(torch.ops.mmh.unpermute_fwd.default, (permuted, row_id_map, probs), test_utils=checks)
    torch.library.opcheck(
        torch.ops.mmh.unpermute_bwd.default, (grad_out, permuted, row_id_map, probs), test_utils=checks
    )


@pytest.mark.gpu
@needs_cuda_ops
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    "T,K,E,h,repeats", SHAPES + [(1031, 8, 256, 515, False)], ids=SHAPE_IDS + ["T1031-K8-E256-h515"]
)
def test_cuda_matches_reference(T, K, E, h, repeats, dtype):
    first = _check_permute(T, K, E, h, repeats, dtype, "cuda")
    first += _check_unpermute(T, K, E, h, repeats, dtype, torch.float32, "cuda", exact=False)
    again = _check_permute(T, K, E, h, repeats, dtype, "cuda")
    again += _check_unpermute(T, K, E, h, repeats, dtype, torch.float32, "cuda", exact=False)
    for a, b in zip(first, again):  # deterministic: the same bits on every run
        torch.testing.assert_close(a, b, rtol=0, atol=0)
