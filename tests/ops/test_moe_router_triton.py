"""The fused top-k router (Triton; the interpreter on CPU) against router_topk's reference:
the same experts in the same order (ties to the lower index), the same weights and scores,
and the same logits gradient through the weights and through the scores (the balance
losses' path), on fresh random inputs.

Shape legend: T tokens, E experts, K experts per token.
"""

import pytest
import torch

import megatron_moe_hybrid.ops.moe.topk as topk_module
from megatron_moe_hybrid.ops.moe.reference import count_experts, router_topk
from megatron_moe_hybrid.ops.moe.topk import (
    fused_router_topk,
    routing,
    split_hi_lo,
    split_hi_lo_reference,
    uses_fused_router,
)

CASES = [  # T, E, K, score_func, bias, norm, scale
    (1, 4, 1, "softmax", False, None, 1.0),
    (37, 64, 8, "softmax", False, None, 1.0),
    (50, 100, 6, "sigmoid", True, None, 2.5),  # E not a power of 2; DeepSeek-V3's sigmoid + bias + norm
    (33, 512, 10, "softmax", False, True, 1.0),  # Qwen3-Next: softmax renormalised
    (9, 24, 24, "sigmoid", False, False, 1.0),  # every expert chosen
]


def _inputs(t, e, bias, dtype=torch.float32):
    logits = (torch.randn(t, e, dtype=torch.float64) * 2).to(dtype)
    b = (torch.randn(e, dtype=torch.float64) * 0.1).float() if bias else None
    return logits, b


@pytest.mark.parametrize("t,e,k,score_func,bias,norm,scale", CASES, ids=[f"T{c[0]}-E{c[1]}-K{c[2]}-{c[3]}" for c in CASES])
def test_matches_reference_forward_and_gradients(t, e, k, score_func, bias, norm, scale):
    logits, b = _inputs(t, e, bias)
    x = logits.clone().requires_grad_(True)
    probs, idx, scores = fused_router_topk(x, k, score_func, b, norm, scale)
    gp, gs = torch.randn(t, k, dtype=torch.float64), torch.randn(t, e, dtype=torch.float64)
    (grad,) = torch.autograd.grad([probs, scores], x, [gp.float(), gs.float()])

    x64 = logits.double().requires_grad_(True)
    want_probs, want_idx, want_scores = router_topk(x64, k, score_func, None if b is None else b.double(), norm,
                                                    routed_scaling_factor=scale)
    (want_grad,) = torch.autograd.grad([want_probs, want_scores], x64, [gp, gs])
    assert torch.equal(idx, want_idx)
    assert idx.dtype == torch.int64 and probs.dtype == scores.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.double(), want_probs, **tol)
    torch.testing.assert_close(scores.double(), want_scores, **tol)
    torch.testing.assert_close(grad.double(), want_grad, **tol)


def _reference_stats(logits64, k, score_func, bias, norm, valid):
    probs, idx, scores = router_topk(logits64, k, score_func, bias, norm)
    v = torch.ones(logits64.shape[0], dtype=torch.bool) if valid is None else valid
    lse = torch.where(v, torch.logsumexp(logits64, -1), 0.0)
    sums = ((scores / scores.sum(-1, keepdim=True)) * v[:, None]).sum(0)
    counts = count_experts(idx.masked_fill(~v[:, None], logits64.shape[1]), logits64.shape[1])
    return probs, idx, scores, lse, sums, counts


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("padded", [False, True], ids=["all-valid", "padded"])
@pytest.mark.parametrize("max_programs", [1024, 2], ids=["block-per-program", "blocks-looped"])
def test_stats_match_reference_forward_and_gradients(score_func, padded, max_programs, monkeypatch):
    monkeypatch.setattr(topk_module, "MAX_PROGRAMS", max_programs)  # 2: a program loops over 2 blocks
    t, e, k = 150, 40, 6  # three blocks of 64 tokens, the last one partial
    logits, bias = _inputs(t, e, True)
    valid = torch.rand(t) > 0.3 if padded else None
    x = logits.clone().requires_grad_(True)
    got = fused_router_topk(x, k, score_func, bias, None, 1.0, valid, stats=True)
    x64 = logits.double().requires_grad_(True)
    want = _reference_stats(x64, k, score_func, bias.double(), None, valid)
    assert torch.equal(got[1], want[1]) and torch.equal(got[5], want[5]) and got[5].dtype == torch.int64
    for a, b in zip(got[:5], want[:5]):
        if a.is_floating_point():
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    # every differentiable output at once: probs, scores, score_sums, and lse for softmax scores
    outs = [0, 2, 4] + ([3] if score_func == "softmax" else [])
    grads_out = [torch.randn(got[i].shape, dtype=torch.float64) for i in outs]
    (grad,) = torch.autograd.grad([got[i] for i in outs], x, [g.float() for g in grads_out])
    (want_grad,) = torch.autograd.grad([want[i] for i in outs], x64, grads_out)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-5)
    if score_func == "sigmoid":
        assert not got[3].requires_grad  # its gradient would need the logits' softmax


def test_stats_repeat_bitwise():
    logits, _ = _inputs(300, 64, False)
    a = fused_router_topk(logits, 8, stats=True)
    b = fused_router_topk(logits, 8, stats=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_gradient_through_the_weights_alone():
    logits, _ = _inputs(21, 40, False)
    x = logits.clone().requires_grad_(True)
    probs, _, _ = fused_router_topk(x, 5, "sigmoid", None, True)
    gp = torch.randn(21, 5)
    (grad,) = torch.autograd.grad(probs, x, gp)
    x64 = logits.double().requires_grad_(True)
    (want,) = torch.autograd.grad(router_topk(x64, 5, "sigmoid", None, True)[0], x64, gp.double())
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lower_expert():
    # integer logits with many equal values: the stable sort's order is the only right one
    logits = torch.randint(0, 3, (64, 32)).float()
    bias = torch.zeros(32)
    bias[5] = 1.0  # the bias decides the choice but not the weights
    probs, idx, _ = fused_router_topk(logits, 7, "softmax", bias)
    want_probs, want_idx, _ = router_topk(logits, 7, "softmax", bias)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(probs, want_probs, rtol=1e-6, atol=1e-7)
    assert bool((idx[:, 0] == 5).all())


def test_fp16_logits():
    logits, _ = _inputs(17, 48, False, torch.float16)
    x = logits.clone().requires_grad_(True)
    probs, idx, _ = fused_router_topk(x, 4)
    (grad,) = torch.autograd.grad(probs, x, torch.ones(17, 4))
    x64 = logits.double().requires_grad_(True)
    want_probs, want_idx, _ = router_topk(x64, 4)
    (want_grad,) = torch.autograd.grad(want_probs, x64, torch.ones(17, 4, dtype=torch.float64))
    assert torch.equal(idx, want_idx) and grad.dtype == torch.float16
    torch.testing.assert_close(probs.double(), want_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), want_grad, rtol=2e-3, atol=2e-4)


def test_no_tokens():
    x = torch.zeros(0, 16, requires_grad=True)
    probs, idx, scores = fused_router_topk(x, 2)
    assert probs.shape == (0, 2) and idx.shape == (0, 2) and scores.shape == (0, 16)
    probs.sum().backward()
    assert x.grad.shape == (0, 16)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="topk"):
        fused_router_topk(torch.randn(3, 8), 9)
    with pytest.raises(ValueError, match="logits"):
        fused_router_topk(torch.randn(3, 8, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="expert_bias"):
        fused_router_topk(torch.randn(3, 8), 2, expert_bias=torch.zeros(7))
    with pytest.raises(ValueError, match="score_func"):
        fused_router_topk(torch.randn(3, 8), 2, "relu")
    with pytest.raises(ValueError, match="topk_groups"):
        routing(torch.randn(3, 8), 2, num_groups=4, topk_groups=2, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        routing(torch.randn(3, 8), 2, backend="cuda")
    with pytest.raises(ValueError, match="valid"):
        fused_router_topk(torch.randn(3, 8), 2, valid=torch.ones(4, dtype=torch.bool), stats=True)


def test_auto_takes_the_reference_for_groups_and_cpu():
    logits = torch.randn(12, 16)
    # the dispatch itself: the reference's results alone could not tell the two apart
    assert not uses_fused_router(logits, 1, 1, "auto")  # CPU logits
    assert not uses_fused_router(logits, 4, 2, "auto")  # group-limited
    assert uses_fused_router(logits, 1, 1, "triton") and uses_fused_router(logits, 4, 4, "triton")
    assert not uses_fused_router(logits, 1, 1, "torch")
    for kw in (dict(), dict(num_groups=4, topk_groups=2)):
        got = routing(logits, 3, backend="auto", **kw)
        want = router_topk(logits, 3, **kw)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(16384, 64, 8), (16384, 512, 10), (4096, 896, 16)])
def test_cuda_matches_reference(t, e, k):
    logits = torch.randn(t, e, device="cuda") * 2
    bias = torch.randn(e, device="cuda") * 0.01
    for score_func, norm in (("softmax", True), ("sigmoid", None)):
        x = logits.clone().requires_grad_(True)
        probs, idx, scores = routing(x, k, score_func, bias, norm)
        gp, gs = torch.randn(t, k, device="cuda"), torch.randn(t, e, device="cuda")
        (grad,) = torch.autograd.grad([probs, scores], x, [gp, gs])
        x64 = logits.double().requires_grad_(True)
        want_probs, want_idx, want_scores = router_topk(x64, k, score_func, bias.double(), norm)
        (want_grad,) = torch.autograd.grad([want_probs, want_scores], x64, [gp.double(), gs.double()])
        # fp32 scores against fp64 ones can swap two near-equal experts: count, don't demand none
        assert float((idx != want_idx).any(-1).float().mean()) < 1e-3
        same = (idx == want_idx).all(-1)
        torch.testing.assert_close(probs[same].double(), want_probs[same], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(scores.double(), want_scores, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad[same].double(), want_grad[same], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("along_rows", [True, False], ids=["rows", "cols"])
def test_split_hi_lo_layout_and_values(along_rows):
    a = torch.randn(7, 37) * 3
    out = split_hi_lo(a, torch.float16, along_rows)
    hi = a.half()
    lo = (a - hi.float()).half()
    want = torch.cat([hi, lo, hi]) if along_rows else torch.cat([hi, hi, lo], dim=1)
    assert torch.equal(out, want)
    assert torch.equal(split_hi_lo_reference(a, torch.float16, along_rows), want)
    assert float((hi.double() + lo.double() - a.double()).abs().max()) < 1e-6 * float(a.abs().max())
    with pytest.raises(ValueError, match="float32"):
        split_hi_lo(a.double(), torch.float16, along_rows)
