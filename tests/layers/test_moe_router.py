"""TopKRouter: its losses against hand computations, the expert-bias update against a skewed
load, and capacity drops. The "global" aux loss over a process group is checked in the
4-process spawn of test_moe_layer.py (one spawn for all distributed MoE checks).

Shape legend: s sequence, b micro-batch, T = s * b tokens in [s, b] order, h hidden size,
E experts, K experts per token.
"""

import types

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_moe_hybrid.layers.moe import TopKRouter
from megatron_moe_hybrid.ops.moe import router_topk

F64 = torch.float64
H, E = 16, 6


@pytest.fixture(autouse=True)
def unit_aux_loss_scale():
    """The aux-loss gradient scale is class state that a trainer run in this process may change."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def make_router(**moe):
    cfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True, params_dtype=F64
    )
    fields = dict(
        num_experts=E, topk=2, score_func="softmax", aux_loss_coeff=0.1, expert_bias=False,
        bias_update_rate=1e-3, capacity_factor=None,
    )
    fields.update(moe)
    cfg.moe = types.SimpleNamespace(**fields)
    return TopKRouter(cfg)


def _hand_losses(router, x, s, b, valid, aux_loss_type):
    """Aux loss and z-loss written out token by token from the definitions."""
    logits = x @ router.weight.t()  # [T, E]
    scores = logits.softmax(-1) if router.score_func == "softmax" else logits.sigmoid()
    _, idx, _ = router_topk(logits.detach(), router.topk, router.score_func, router.expert_bias)
    tokens = [t for t in range(s * b) if valid[t]]
    z = sum(torch.log(torch.exp(logits[t]).sum()) ** 2 for t in tokens) / max(len(tokens), 1)
    # a sequence is the tokens j, j + b, j + 2b, ... of the [s, b] layout
    groups = [[t for t in tokens if t % b == j] for j in range(b)] if aux_loss_type == "seq" else [tokens]
    losses = []
    for group in groups:
        if not group:
            continue
        loss = 0.0
        for e in range(E):
            f_e = sum(int(e in idx[t].tolist()) for t in group) / (router.topk * len(group))
            p_e = sum(scores[t, e] / scores[t].sum() for t in group) / len(group)
            loss = loss + E * f_e * p_e
        losses.append(loss)
    return sum(losses) / len(losses), z


@pytest.mark.parametrize("aux_loss_type", ["micro_batch", "seq"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize(
    "s,b,padded", [(7, 3, False), (5, 2, True), (1, 1, False)], ids=["S7-B3", "S5-B2-padded", "S1-B1"]
)
def test_router_losses_match_hand_computation(aux_loss_type, score_func, s, b, padded):
    torch.manual_seed(s * 7 + b)
    router = make_router(score_func=score_func, aux_loss_type=aux_loss_type, aux_loss_coeff=0.2, z_loss_coeff=0.05)
    x = torch.randn(s * b, H, dtype=F64, requires_grad=True)
    padding_mask = torch.zeros(s * b, dtype=torch.bool)
    if padded:
        padding_mask[-3:] = True  # the last 3 positions of the [s, b] layout: both sequences' tails
    probs, idx = router(x, padding_mask if padded else None, batch_size=b)

    aux, z = _hand_losses(router, x, s, b, ~padding_mask, aux_loss_type)
    torch.testing.assert_close(router.last_aux_loss, aux.detach().float())
    torch.testing.assert_close(router.last_z_loss, z.detach().float())
    want_probs, want_idx, _ = router_topk(x @ router.weight.t(), 2, score_func)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(probs, want_probs)

    g = torch.randn_like(probs)
    got = torch.autograd.grad(probs, [x, router.weight], g)
    objective = (want_probs * g).sum() + 0.2 * aux + 0.05 * z
    for a, w in zip(got, torch.autograd.grad(objective, [x, router.weight])):
        torch.testing.assert_close(a, w)


def test_global_aux_loss_without_a_group_is_the_micro_batch_loss():
    torch.manual_seed(3)
    x = torch.randn(11, H, dtype=F64)
    local, micro = make_router(aux_loss_type="global"), make_router(aux_loss_type="micro_batch")
    micro.load_state_dict(local.state_dict())
    local(x), micro(x)
    torch.testing.assert_close(local.last_aux_loss, micro.last_aux_loss, rtol=0, atol=0)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_expert_bias_moves_a_skewed_load_towards_balance(score_func):
    """Fixed logits that favour the low experts; aux-loss-free bias updates even the load."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, topk = 240, 2
    skew = torch.linspace(2.0, 0.0, E, dtype=F64)  # [E]: expert 0 favoured
    logits = torch.randn(num_tokens, E, dtype=F64, generator=gen) + skew  # [T, E]
    router = make_router(score_func=score_func, expert_bias=True, bias_update_rate=0.02, topk=topk)

    def load_ratio():
        _, idx, _ = router_topk(logits, topk, score_func, router.expert_bias)
        counts = torch.bincount(idx.flatten(), minlength=E).double()
        return counts, float(counts.max() / counts.mean())

    counts, start = load_ratio()
    ratios = [start]
    for _ in range(60):
        router.update_expert_bias(counts)
        counts, ratio = load_ratio()
        ratios.append(ratio)
    assert start > 1.5, "the logits should start clearly skewed"
    assert max(ratios[-10:]) < 1 + (start - 1) / 3, ratios
    assert router.expert_bias[0] < 0 < router.expert_bias[-1]


def test_softmax_bias_selects_but_does_not_weight():
    torch.manual_seed(4)
    router = make_router(expert_bias=True)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 5.0]))  # forces experts 4 and 5
    x = torch.randn(9, H, dtype=F64)
    probs, idx = router(x)
    assert (idx.sort(-1).values == torch.tensor([4, 5])).all()
    torch.testing.assert_close(probs, (x @ router.weight.t()).softmax(-1).gather(1, idx))


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_copies_and_their_gradient(policy):
    torch.manual_seed(5)
    router = make_router(capacity_factor=0.5, drop_policy=policy, aux_loss_coeff=0.0)
    x = torch.randn(13, H, dtype=F64, requires_grad=True)
    probs, idx = router(x)
    free_probs, free_idx, _ = router_topk(x @ router.weight.t(), 2)
    dropped = idx < 0
    capacity = -(-13 * 2 // (2 * E))  # ceil(0.5 * T * K / E)
    assert dropped.any()
    assert torch.equal(idx[~dropped], free_idx[~dropped])
    assert int(torch.bincount(idx[~dropped], minlength=E).max()) <= capacity
    assert not probs[dropped].any()
    torch.testing.assert_close(probs[~dropped], free_probs[~dropped])
    g = torch.randn_like(probs)
    got = torch.autograd.grad(probs, [x, router.weight], g)
    want = torch.autograd.grad(free_probs, [x, router.weight], g.masked_fill(dropped, 0.0))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


@pytest.mark.gpu
@pytest.mark.parametrize("weight_grad", [False, True], ids=["frozen", "trained"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["w-fp32", "w-bf16"])
def test_split_precision_logits_match_fp64_on_cuda(weight_grad, weight_dtype):
    """bf16 tokens with an fp32 gate (split in two) or a bf16 one (a bf16 model): fp32 accuracy
    on tensor cores (a bf16 GEMM with bf16 output would be ~3e-3 off), forward and gradients."""
    from megatron_moe_hybrid.layers.moe.router import router_logits

    x = torch.randn(4096, 2048, device="cuda").bfloat16().requires_grad_(True)
    w = (torch.randn(512, 2048, device="cuda") * 0.02).to(weight_dtype).requires_grad_(weight_grad)
    got = router_logits(x, w)
    assert got.dtype == torch.float32
    g = torch.randn_like(got)
    inputs = (x, w) if weight_grad else (x,)
    grads = torch.autograd.grad(got, inputs, g)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(weight_grad)
    want = x64 @ w64.t()
    want_grads = torch.autograd.grad(want, (x64, w64) if weight_grad else (x64,), g.double())

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert rel(got, want) < 2e-5
    assert rel(grads[0], want_grads[0]) < 8e-3  # rounded to bf16, as x
    if weight_grad:
        assert grads[1].dtype == weight_dtype
        assert rel(grads[1], want_grads[1]) < (2e-5 if weight_dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("aux_loss_type", ["micro_batch", "global", "seq"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("padded", [False, True], ids=["all-valid", "padded"])
def test_fused_router_equals_the_reference_router(aux_loss_type, score_func, padded):
    """router_backend "triton" (the kernel's own lse, score sums and counts feed the losses; the
    interpreter on CPU) against "torch": choice, weights, both losses and every gradient."""
    torch.manual_seed(5)
    s, b = 9, 4
    x = torch.randn(s * b, H, requires_grad=True)
    padding_mask = torch.rand(s * b) < 0.3 if padded else None
    g = torch.randn(s * b, 2)
    results = []
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        router = make_router(score_func=score_func, aux_loss_type=aux_loss_type, aux_loss_coeff=0.2,
                             z_loss_coeff=0.05, expert_bias=True, router_backend=backend)
        router.float()
        router.expert_bias.copy_(torch.linspace(-0.01, 0.01, E))
        probs, idx = router(x, padding_mask, batch_size=b)
        grads = torch.autograd.grad(probs, [x, router.weight], g)
        results.append((probs, idx, router.last_aux_loss, router.last_z_loss, *grads))
        if backend == "triton" and aux_loss_type != "seq":
            kept = idx if padding_mask is None else idx.masked_fill(padding_mask[:, None], E)
            assert torch.equal(router.last_counts, torch.bincount(kept.flatten(), minlength=E + 1)[:E])
    ref, fused = results
    assert torch.equal(ref[1], fused[1])
    for a, w in zip(fused[:1] + fused[2:], ref[:1] + ref[2:]):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)


def _cp_router_run(rank, world, aux_loss_type):
    """One rank's half of the tokens under context parallelism (and, for "global", the group
    summing the loads), through router_backend torch and triton."""
    import torch.distributed as dist

    torch.manual_seed(11)
    x_all = torch.randn(2 * 12, H)
    g_all = torch.randn(2 * 12, 2)
    mask_all = torch.rand(2 * 12) < 0.25
    rows = slice(rank * 12, (rank + 1) * 12)
    out = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True)
        cfg.moe = types.SimpleNamespace(
            num_experts=E, topk=2, score_func="softmax", aux_loss_coeff=0.2, z_loss_coeff=0.05, expert_bias=False,
            bias_update_rate=1e-3, capacity_factor=None, aux_loss_type=aux_loss_type, router_backend=backend,
        )
        group = dist.group.WORLD
        router = TopKRouter(cfg, aux_loss_group=group if aux_loss_type == "global" else None,
                            cp_group=group if aux_loss_type != "global" else None).float()
        x = x_all[rows].clone().requires_grad_(True)
        probs, idx = router(x, mask_all[rows], batch_size=1)
        grads = torch.autograd.grad(probs, [x, router.weight], g_all[rows])
        out[backend] = (probs, idx, router.last_aux_loss, router.last_z_loss, *grads)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("aux_loss_type", ["micro_batch", "global"], ids=["cp2", "global-group2"])
def test_fused_router_equals_the_reference_across_ranks(aux_loss_type):
    """The fused router's losses from its sums and counts under context parallelism (loads and
    token counts summed over the CP group) and over an aux-loss group: equal to the reference."""
    from megatron_moe_hybrid.testing import spawn

    for out in spawn(_cp_router_run, 2, aux_loss_type):
        ref, fused = out["torch"], out["triton"]
        assert torch.equal(ref[1], fused[1])
        for a, w in zip(fused[:1] + fused[2:], ref[:1] + ref[2:]):
            torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)
