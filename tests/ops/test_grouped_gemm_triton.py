"""The Triton grouped GEMM (the interpreter on CPU, bf16 on the GPU) against the loop over
experts (`grouped_matmul`'s reference), forward, input gradient and weight gradient, on fresh
random inputs: empty experts, one expert holding every row, groups that straddle row tiles,
K and M not multiples of the tile, a padding tail left unwritten, and strided weights.

Shape legend: N rows grouped by expert, E experts, K input width, M output width.
"""

import pytest
import torch

from megatron_moe_hybrid.ops.moe.grouped import grouped_matmul
from megatron_moe_hybrid.ops.moe.grouped_triton import GroupedMM, grouped_mm, grouped_mm_wgrad, row_bounds

SMALL_FWD = (16, 16, 16, 4, 1)  # small tiles keep the interpreter quick and make groups straddle tiles
SMALL_WGRAD = (16, 16, 16, 4, 1, 2)  # two column tiles per program: M=24, 33 leave a last short group

CASES = [  # counts, tail, K, M
    ([5, 0, 23, 1, 16], 3, 40, 24),  # empty expert, 1-row expert, groups across tile edges, K % 16 != 0
    ([0, 0, 37], 0, 32, 20),  # every row in the last expert; M % 16 != 0
    ([7], 5, 16, 16),  # one expert
    ([0, 0, 0, 0], 6, 24, 8),  # no rows routed at all: dw is zero
    ([3, 9, 0, 2, 0, 11, 4], 0, 48, 33),  # E not a power of 2
]


def _case(counts, tail, k, m, dtype=torch.float32, device="cpu"):
    counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
    n = sum(counts) + tail
    x = torch.randn(n, k, dtype=torch.float64).to(device=device, dtype=dtype)
    w = (torch.randn(len(counts), k, m, dtype=torch.float64) / k**0.5).to(device=device, dtype=dtype)
    dy = torch.randn(n, m, dtype=torch.float64).to(device=device, dtype=dtype)
    return counts_t, x, w, dy


def _ref_wgrad(x, dy, counts):
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0] + ends[:-1]
    return torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in zip(starts, ends)])


@pytest.mark.parametrize("counts,tail,k,m", CASES, ids=[f"E{len(c[0])}-K{c[2]}-M{c[3]}" for c in CASES])
def test_forward_dx_and_wgrad_equal_the_loop(counts, tail, k, m):
    counts_t, x, w, dy = _case(counts, tail, k, m)
    bounds = row_bounds(counts_t)
    n_real = sum(counts)
    ref = grouped_matmul(x.double(), w.double(), counts)
    out = grouped_mm(x, w, bounds, SMALL_FWD)
    torch.testing.assert_close(out[:n_real].double(), ref[:n_real], rtol=1e-5, atol=1e-5)
    dx = grouped_mm(dy, w.transpose(1, 2), bounds, SMALL_FWD)  # a strided (transposed) weight
    ref_dx = grouped_matmul(dy.double(), w.double().transpose(1, 2), counts)
    torch.testing.assert_close(dx[:n_real].double(), ref_dx[:n_real], rtol=1e-5, atol=1e-5)
    dw = grouped_mm_wgrad(x, dy, bounds, SMALL_WGRAD)
    torch.testing.assert_close(dw.double(), _ref_wgrad(x, dy, counts_t), rtol=1e-5, atol=1e-5)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))  # written, not left as torch.empty


def test_padding_tail_rows_are_not_written():
    counts_t, x, w, _ = _case([4, 6], 7, 16, 16)
    out = torch.full((x.shape[0], 16), float("nan"))  # poisoned: every real row must be overwritten
    grouped_mm(x, w, row_bounds(counts_t), SMALL_FWD, out=out)
    torch.testing.assert_close(out[:10], grouped_matmul(x, w, [4, 6])[:10], rtol=1e-5, atol=1e-5)
    assert torch.isnan(out[10:]).all()


@pytest.fixture
def small_tiles(monkeypatch):
    import megatron_moe_hybrid.ops.moe.grouped_triton as gt

    monkeypatch.setattr(gt, "FWD_CONFIG", SMALL_FWD)
    monkeypatch.setattr(gt, "WGRAD_CONFIG", SMALL_WGRAD)
    return gt


def test_autograd_function_equals_the_loop_gradients(small_tiles):
    counts_t, x, w, dy = _case([9, 0, 14, 3], 2, 40, 24)
    bounds = row_bounds(counts_t)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = GroupedMM.apply(xa, wa, bounds)
    out[:26].backward(dy[:26])
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = grouped_matmul(xr, wr, [9, 0, 14, 3])
    ref[:26].backward(dy[:26].double())
    torch.testing.assert_close(out[:26].double(), ref[:26].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xa.grad[:26].double(), xr.grad[:26], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wa.grad.double(), wr.grad, rtol=1e-5, atol=1e-5)


@pytest.fixture
def wgrad_calls(monkeypatch):
    """The calls of grouped_triton.grouped_mm_wgrad from here on, in order: True for those that
    add into a given tensor (accumulate_into), False for those that return a new gradient."""
    import megatron_moe_hybrid.ops.moe.grouped_triton as gt

    calls, real = [], gt.grouped_mm_wgrad

    def spy(*args, **kwargs):
        calls.append(kwargs.get("accumulate_into") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(gt, "grouped_mm_wgrad", spy)
    return calls


def test_frozen_weight_skips_the_weight_gradient(wgrad_calls):
    counts_t, x, w, dy = _case([5, 6], 0, 16, 16)
    xa = x.clone().requires_grad_()
    GroupedMM.apply(xa, w, row_bounds(counts_t)).backward(dy)
    assert not wgrad_calls and xa.grad is not None


def _micro_batches(n, counts, k, m, seed):
    """n micro-batches' (x, dy) for one [E, k, m] weight: each a fresh draw of rows."""
    torch.manual_seed(seed)
    return [(c, x, dy) for c, x, _, dy in (_case(counts, 0, k, m) for _ in range(n))]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd-adds"])
def test_gradient_accumulated_over_micro_batches_equals_the_sum(small_tiles, wgrad_calls, monkeypatch, fused):
    """Three .backward() calls into one weight: w.grad is the sum of the three loop gradients.
    Fused, the second and third backward add into w.grad themselves (no gradient returned)."""
    monkeypatch.setattr(small_tiles, "ACCUMULATE_INTO_GRAD", fused)
    counts = [5, 0, 23, 1, 16]  # an expert without rows keeps its accumulated gradient
    w = (torch.randn(5, 40, 24, dtype=torch.float64) / 40**0.5).float().requires_grad_()
    want = torch.zeros(5, 40, 24, dtype=torch.float64)
    bounds = row_bounds(torch.tensor(counts))
    for counts_t, x, dy in _micro_batches(3, counts, 40, 24, seed=3):
        GroupedMM.apply(x, w, bounds).backward(dy)
        want += _ref_wgrad(x, dy, counts_t)
    torch.testing.assert_close(w.grad.double(), want, rtol=1e-5, atol=1e-5)
    assert wgrad_calls == ([False, True, True] if fused else [False, False, False])


def test_accumulation_leaves_autograd_grad_hooks_and_other_inputs_alone(small_tiles, wgrad_calls):
    """w.grad is only added to where autograd would add to it: not under autograd.grad (its
    gradient is returned), not for .backward(inputs=[x]) (w's gradient is not wanted), not
    where a tensor hook would transform the gradient first (it runs on the returned one). A
    post-accumulate hook (the trainer's NonFiniteTracker) keeps the fused add and still runs,
    once, on the sum."""
    counts = [4, 7, 2]
    bounds = row_bounds(torch.tensor(counts))
    (c1, x1, dy1), (c2, x2, dy2) = _micro_batches(2, counts, 16, 16, seed=4)
    dw2 = _ref_wgrad(x2, dy2, c2)
    w = (torch.randn(3, 16, 16, dtype=torch.float64) / 4).float().requires_grad_()
    GroupedMM.apply(x1, w, bounds).backward(dy1)
    first = w.grad.clone()
    (dw,) = torch.autograd.grad(GroupedMM.apply(x2, w, bounds), [w], dy2)
    torch.testing.assert_close(dw.double(), dw2, rtol=1e-5, atol=1e-5)
    xa = x2.clone().requires_grad_()
    GroupedMM.apply(xa, w, bounds).backward(dy2, inputs=[xa])
    assert torch.equal(w.grad, first) and xa.grad is not None
    # the first micro-batch, autograd.grad's, and inputs=[xa]'s (made, as autograd asks, and dropped)
    assert wgrad_calls == [False, False, False]
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    GroupedMM.apply(x2, w, bounds).backward(dy2)
    assert wgrad_calls[-1] and len(seen) == 1
    torch.testing.assert_close(seen[0].double(), first.double() + dw2, rtol=1e-5, atol=1e-5)
    handle = w.register_hook(lambda g: 2 * g)  # transforms the gradient before it is accumulated
    GroupedMM.apply(x2, w, bounds).backward(dy2)
    handle.remove()
    assert not wgrad_calls[-1] and len(seen) == 2
    torch.testing.assert_close(w.grad.double(), first.double() + 3 * dw2, rtol=1e-5, atol=1e-5)


def test_wgrad_accumulate_into_checks_its_target():
    counts_t, x, w, dy = _case([3, 4], 0, 16, 16)
    with pytest.raises(ValueError, match="accumulate_into"):
        grouped_mm_wgrad(x, dy, row_bounds(counts_t), SMALL_WGRAD, accumulate_into=torch.zeros(2, 16, 8))
    target = torch.randn(2, 16, 16)
    out = grouped_mm_wgrad(x, dy, row_bounds(counts_t), SMALL_WGRAD, accumulate_into=target.clone())
    torch.testing.assert_close(out.double(), target.double() + _ref_wgrad(x, dy, counts_t), rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_argument():
    counts_t, x, w, dy = _case([3, 4], 0, 16, 16)
    with pytest.raises(ValueError, match="bounds"):
        grouped_mm(x, w, counts_t, SMALL_FWD)  # counts, not bounds
    with pytest.raises(ValueError, match="w must be"):
        grouped_mm(x, w[:, :8], row_bounds(counts_t), SMALL_FWD)
    with pytest.raises(ValueError, match="dy must be"):
        grouped_mm_wgrad(x, dy[:5], row_bounds(counts_t), SMALL_WGRAD)


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad", ["triton", "torch"])
@pytest.mark.parametrize("counts_kind", ["balanced", "skewed"])
def test_bf16_on_the_gpu_matches_fp32(counts_kind, wgrad):
    torch.manual_seed(0)
    e, k, m = 16, 512, 384
    if counts_kind == "balanced":
        counts = torch.full((e,), 200)
    else:
        counts = torch.zeros(e, dtype=torch.int64)
        counts[3], counts[4], counts[15] = 2500, 1, 700  # 2500 rows: the weight gradient's many-row path
    counts_t, x, w, dy = _case(counts.tolist(), 17, k, m, dtype=torch.bfloat16, device="cuda")
    bounds = row_bounds(counts_t)
    n_real = int(counts.sum())
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = GroupedMM.apply(xa, wa, bounds, wgrad)
    out[:n_real].backward(dy[:n_real])
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    ref = grouped_matmul(xr, wr, counts.tolist())
    ref[:n_real].backward(dy[:n_real].float())

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    assert rel(out[:n_real], ref[:n_real].detach()) < 1e-2
    assert rel(xa.grad[:n_real], xr.grad[:n_real]) < 1e-2
    assert rel(wa.grad, wr.grad) < 1e-2
    if counts_kind == "skewed":
        assert torch.equal(wa.grad[0], torch.zeros_like(wa.grad[0]))  # an expert without rows


@pytest.mark.gpu
def test_bf16_gradient_accumulation_on_the_gpu(wgrad_calls, monkeypatch):
    """Three micro-batches into one bf16 weight on the H200: the fused accumulation (the second
    and third add in the kernel, rounded once each) within bf16 of the fp32 sum, and of the
    path where autograd adds (auto: torch._grouped_mm's gradient, then grad += it)."""
    import megatron_moe_hybrid.ops.moe.grouped_triton as gt

    torch.manual_seed(0)
    k, m = 512, 384
    counts = [200] * 8 + [0] + [150] * 7
    bounds = row_bounds(torch.tensor(counts, device="cuda"))
    batches = [_case(counts, 0, k, m, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    w0 = batches[0][2]
    grads = {}
    for fused in (True, False):
        monkeypatch.setattr(gt, "ACCUMULATE_INTO_GRAD", fused)
        w = w0.clone().requires_grad_()
        hooked = []  # a post-accumulate hook, as the trainer's NonFiniteTracker sets: it runs each time
        w.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad.float().norm()))
        for _, x, _, dy in batches:
            GroupedMM.apply(x, w, bounds).backward(dy)
        grads[fused] = w.grad
        assert len(hooked) == 3 and torch.equal(hooked[-1], w.grad.float().norm())
    # the kernel ran for the fused run's 2nd and 3rd micro-batches only: every other weight
    # gradient was torch._grouped_mm's (auto)
    assert wgrad_calls == [True, True]
    want = sum(_ref_wgrad(x.float(), dy.float(), torch.tensor(counts)) for _, x, _, dy in batches).float()

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(grads[True], want) < 1e-2 and rel(grads[False], want) < 1e-2
    assert rel(grads[True], grads[False]) < 1e-2
    assert rel(grads[True], want) <= rel(grads[False], want) * 1.05  # one rounding per add, not two
    assert torch.equal(grads[True][8], torch.zeros_like(grads[True][8]))  # the expert without rows


def test_swiglu_experts_on_the_triton_backend_equal_the_loop():
    """The experts' fc1 -> SwiGLU -> fc2 through grouped_matmul(backend="triton") (the kernel
    here for the forward, the input gradient and the weight gradient) against the loop."""
    from megatron_moe_hybrid.ops.moe.grouped import swiglu_experts

    counts = [6, 0, 11, 3]
    n, h, f = sum(counts) + 2, 32, 24
    x = torch.randn(n, h, dtype=torch.float64).float()
    w1 = (torch.randn(4, h, 2 * f, dtype=torch.float64) / h**0.5).float()
    w2 = (torch.randn(4, f, h, dtype=torch.float64) / f**0.5).float()
    dy = torch.randn(sum(counts), h)
    grads = []
    for backend in ("triton", "torch"):
        xs, a, b = (t.clone().requires_grad_() for t in (x, w1, w2))
        out = swiglu_experts(xs, torch.tensor(counts), a, b, backend=backend)
        out[: sum(counts)].backward(dy)
        grads.append((out[: sum(counts)].detach(), xs.grad[: sum(counts)], a.grad, b.grad))
    for mine, ref in zip(*grads):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)


def test_auto_backend_picks_by_rows_per_expert(monkeypatch):
    import megatron_moe_hybrid.ops.moe.grouped as grouped
    from megatron_moe_hybrid.ops.moe.grouped import TRITON_MAX_ROWS_PER_EXPERT, grouped_gemm_kind, uses_triton_grouped_gemm

    w = torch.empty(8, 256, 256, dtype=torch.bfloat16)
    x = torch.empty(8 * TRITON_MAX_ROWS_PER_EXPERT, 256, dtype=torch.bfloat16)
    assert not uses_triton_grouped_gemm(x, w, "auto")  # CPU: no torch._grouped_mm, so never auto
    assert uses_triton_grouped_gemm(x, w, "triton") and not uses_triton_grouped_gemm(x, w, "torch")
    assert grouped_gemm_kind(x, w, "auto") == "loop over experts"
    with pytest.raises(ValueError, match="backend"):
        uses_triton_grouped_gemm(x, w, "cutlass")
    # where torch._grouped_mm runs (bf16 on CUDA), auto's rule: rows per expert and product width
    monkeypatch.setattr(grouped, "uses_grouped_mm", lambda x, w: True)
    assert uses_triton_grouped_gemm(x, w, "auto")  # at the threshold
    assert not uses_triton_grouped_gemm(torch.empty(x.shape[0] + 8, 256), w, "auto")  # one row per expert over
    assert not uses_triton_grouped_gemm(x, torch.empty(8, 256, 16), "auto")  # LoRA-narrow product
    assert grouped_gemm_kind(x, w, "auto") == "triton grouped GEMM (weight gradient: torch._grouped_mm)"


@pytest.mark.gpu
def test_row_offsets_past_two_to_the_31_elements():
    """x with more than 2^31 elements (issue 5's int64 edge case, TE #2908): the rows past
    2^31 / K are read and written at their int64 offsets, in the forward and the weight gradient."""
    torch.manual_seed(0)
    e, k, m = 2, 8192, 256
    n = 2**31 // k + 4096  # [n, k] holds more than 2^31 elements
    counts = torch.tensor([n - 1000, 1000], device="cuda")
    x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, k, m, device="cuda", dtype=torch.bfloat16) / k**0.5
    dy = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
    bounds = row_bounds(counts)
    out = grouped_mm(x, w, bounds)
    ref = torch.cat([x[n - 2000 : n - 1000].float() @ w[0].float(), x[n - 1000 :].float() @ w[1].float()])
    got = out[n - 2000 :].float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    dw = grouped_mm_wgrad(x, dy, bounds)
    ref_dw = x[n - 1000 :].float().T @ dy[n - 1000 :].float()
    assert ((dw[1].float() - ref_dw).norm() / ref_dw.norm()).item() < 1e-2
