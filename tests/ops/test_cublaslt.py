"""ops/_cublaslt.py: cuBLASLt products with a timed choice of algorithm, against torch's products.

The products themselves need CUDA (gpu tests, bf16); on the CPU the argument checks and the
linear + cross-entropy's choice of product backend are tested.
"""

import warnings

import pytest
import torch

from megatron_moe_hybrid.ops import _cublaslt
from megatron_moe_hybrid.ops.cross_entropy import triton as ce_triton

pytest.importorskip("triton")


def test_gemm_refuses_cpu_tensors_and_mismatched_shapes():
    a, b, out = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8, 3, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        _cublaslt.gemm(out, a, b)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        _cublaslt.gemm(out.float(), a.float(), b.float())


def test_alignment_of_an_address():
    assert _cublaslt._alignment(0) == 256
    assert _cublaslt._alignment(512 + 64) == 64
    assert _cublaslt._alignment(2 * 1001) == 2


def test_cross_entropy_gemm_backend_switch(monkeypatch):
    cpu = torch.zeros(2, 2, dtype=torch.bfloat16)
    monkeypatch.setattr(ce_triton, "GEMM_BACKEND", "auto")
    assert ce_triton._use_cublaslt(cpu) is False  # CPU: torch's products
    monkeypatch.setattr(ce_triton, "GEMM_BACKEND", "torch")
    assert ce_triton._use_cublaslt(cpu) is False
    monkeypatch.setattr(ce_triton, "GEMM_BACKEND", "cublaslt")
    with pytest.raises(ValueError, match="bf16/fp16 CUDA"):
        ce_triton._use_cublaslt(cpu)
    monkeypatch.setattr(ce_triton, "GEMM_BACKEND", "cuda")
    with pytest.raises(ValueError, match="GEMM_BACKEND must be"):
        ce_triton._use_cublaslt(cpu)


def test_a_shape_cublaslt_cannot_run_is_asked_once(monkeypatch):
    calls = []

    def refuse(key):
        calls.append(key)
        raise RuntimeError("cuBLASLt offers no algorithm without split-K")

    monkeypatch.setattr(_cublaslt, "_key", lambda *args: ("a shape", "cpu"))
    monkeypatch.setattr(_cublaslt, "_Plan", refuse)
    monkeypatch.setattr(_cublaslt, "_PLANS", {})
    for _ in range(3):
        with pytest.raises(RuntimeError, match="split-K"):
            _cublaslt.plan(None, None, None)
    assert len(calls) == 1  # the heuristic is not asked again on every call


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


SHAPES = [  # (M, N, K): the loss's weight gradient [V, D] over a chunk, odd sizes
    (20000, 1024, 768),
    (1000, 520, 72),
]


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_a", [False, True], ids=["a", "aT"])
@pytest.mark.parametrize("transpose_b", [False, True], ids=["b", "bT"])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_gemm_equals_torch_on_gpu(M, N, K, transpose_a, transpose_b):
    torch.manual_seed(M + N + K)
    a = torch.randn(*((K, M) if transpose_a else (M, K)), device="cuda").bfloat16()
    b = torch.randn(*((N, K) if transpose_b else (K, N)), device="cuda").bfloat16()
    a_, b_ = (a.T if transpose_a else a), (b.T if transpose_b else b)
    ref = a_ @ b_
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)  # poisoned: every element written
    _cublaslt.gemm(out, a, b, transpose_a, transpose_b)
    p = _cublaslt.plan(out, a, b, transpose_a, transpose_b)
    assert p.choice is not None and len(p.times) >= 1  # tuned on the first call
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 4e-3, _rel(out, ref)
    every = {}
    for i in p.candidates:  # each candidate computes the same product
        out.fill_(float("nan"))
        p.run(out, a, b, accumulate=False, candidate=i)
        every[i] = (_rel(out, ref), int((out != ref).sum()))
        assert every[i][0] < 4e-3, (i, p.config(i), every[i])
    print("candidates (relative error, elements differing from torch's):", every)
    # no split-K: one fp32 reduction over K rounded once, as torch's product (so far bit for bit on the H200)
    assert all(differing == 0 for _, differing in every.values()), every
    base = torch.randn(M, N, device="cuda").bfloat16()
    acc = base.clone()
    _cublaslt.gemm(acc, a, b, transpose_a, transpose_b, accumulate=True)
    assert _rel(acc, base.float() + a_.float() @ b_.float()) < 4e-3


@pytest.mark.gpu
def test_tune_with_overwrite_leaves_the_product():
    torch.manual_seed(0)
    g, h = torch.randn(512, 9000, device="cuda").bfloat16(), torch.randn(512, 640, device="cuda").bfloat16()
    out = torch.full((9000, 640), 7.0, device="cuda", dtype=torch.bfloat16)
    _cublaslt.tune_with_overwrite(out, g, h, transpose_a=True)
    p = _cublaslt.plan(out, g, h, transpose_a=True)
    assert p.choice in p.times and set(p.times) <= set(p.candidates)  # timed the candidates, kept one
    ref = g.T @ h
    assert _rel(out, ref) < 4e-3  # the timing runs' sums are gone
    _cublaslt.gemm(out, g, h, transpose_a=True, accumulate=True)
    assert _rel(out, 2 * ref.float()) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("weight_trainable", [True, False], ids=["trainable", "frozen"])
def test_cross_entropy_on_cublaslt_equals_torch_products(weight_trainable, monkeypatch):
    torch.manual_seed(1)
    N, D, V = 3000, 512, 40000
    hidden = (torch.randn(N, D, device="cuda") / 2).bfloat16().requires_grad_()
    weight = (torch.randn(V, D, device="cuda") / D**0.5).bfloat16().requires_grad_(weight_trainable)
    labels = torch.randint(0, V, (N,), device="cuda")
    leaves = [t for t in (hidden, weight) if t.requires_grad]
    results = {}
    for backend in ("torch", "cublaslt"):
        monkeypatch.setattr(ce_triton, "GEMM_BACKEND", backend)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no silent or warned fallback to torch's product
            loss = ce_triton.triton_linear_cross_entropy(hidden, weight, labels, chunk_size=768)
            results[backend] = (loss.detach(), *torch.autograd.grad(loss, leaves))
    if weight_trainable:  # the first chunk tuned grad_weight's accumulating product
        tuned = [p for key, p in _cublaslt._PLANS.items() if key[:3] == (V, D, 768) and not isinstance(p, Exception)]
        assert tuned and tuned[0].choice is not None
    for name, x, y in zip(("loss", "grad_hidden", "grad_weight"), results["cublaslt"], results["torch"]):
        print(name, "elements differing:", int((x != y).sum()), "of", x.numel())
        assert torch.equal(x, y), (name, _rel(x, y))  # the same bits as torch's addmm_
