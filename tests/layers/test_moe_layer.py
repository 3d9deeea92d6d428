"""MoELayer against a dense einsum oracle (dropless and with a capacity), routing edge cases,
and expert parallelism (EP=2 and EP=4 over gloo, one 4-process spawn) against EP=1.

Shape legend: s sequence, b micro-batch, T = s * b tokens, h hidden size, E experts,
E_local experts per EP rank, K experts per token, F expert FFN size.
"""

import types

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_moe_hybrid.layers.moe import AllToAllDispatcher, GroupedExperts, MoELayer, TopKRouter
from megatron_moe_hybrid.ops.moe import load_balancing_loss, router_topk
from megatron_moe_hybrid.ops.moe.reference import (
    capacity_keep_mask,
    expert_capacity,
    router_z_loss,
    sequence_load_balancing_loss,
)
from megatron_moe_hybrid.testing import init_megatron, spawn

F64 = torch.float64


DISPATCHERS = {
    # name: the moe fields that pick it; every test of this file runs once per entry
    "exact": dict(dispatcher="alltoall"),
    # a receive capacity of ep x the balanced share cannot overflow at EP <= 4 (nor can None)
    "static": dict(dispatcher="static", dispatch_capacity_factor=4.0),
    "static-chunks3": dict(dispatcher="static", dispatch_chunks=3, dispatch_capacity_factor=None),
}
_dispatcher = dict(DISPATCHERS["exact"])


@pytest.fixture(autouse=True, params=list(DISPATCHERS))
def dispatcher(request):
    _dispatcher.clear()
    _dispatcher.update(DISPATCHERS[request.param])
    yield request.param
    _dispatcher.clear()
    _dispatcher.update(DISPATCHERS["exact"])


@pytest.fixture(autouse=True)
def unit_aux_loss_scale():
    """The aux-loss gradient scale is class state that a trainer run in this process may change."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def make_config(dtype=F64, **moe):
    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, params_dtype=dtype
    )
    fields = dict(
        num_experts=8,
        topk=2,
        ffn_hidden_size=48,
        shared_expert_ffn_hidden_size=0,
        score_func="softmax",
        aux_loss_coeff=0.01,
        expert_bias=False,
        bias_update_rate=1e-3,
        capacity_factor=None,
        **_dispatcher,
    )
    fields.update(moe)
    cfg.moe = types.SimpleNamespace(**fields)
    return cfg


def _swiglu(x, w_in, w_out):
    gate, up = (x @ w_in).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w_out


def dense_oracle(layer, x, padding_mask=None, batch_size=None):
    """(out [T, h] computing every expert on every token, unscaled aux loss, topk_idx [T, K]
    with -1 for the copies dropped by the capacity), z-loss kept in layer.oracle_z_loss."""
    moe = layer.config.moe
    logits = x @ layer.router.weight.t()  # [T, E]
    probs, idx, scores = router_topk(
        logits,
        moe.topk,
        moe.score_func,
        layer.router.expert_bias,
        getattr(moe, "norm_topk_prob", None),
        getattr(moe, "num_groups", 1),
        getattr(moe, "topk_groups", 1),
        getattr(moe, "routed_scaling_factor", 1.0),
    )
    keep = torch.ones_like(idx, dtype=torch.bool)  # [T, K]
    if moe.capacity_factor is not None:
        capacity = expert_capacity(x.shape[0], moe.topk, moe.num_experts, moe.capacity_factor)
        keep = capacity_keep_mask(idx, probs, moe.num_experts, capacity, getattr(moe, "drop_policy", "probs"))
    w1, w2 = layer.experts.weight1, layer.experts.weight2  # [E, h, 2F], [E, F, h]
    gate, up = torch.einsum("th,ehf->tef", x, w1).chunk(2, dim=-1)  # [T, E, F] each
    y_all = torch.einsum("tef,efh->teh", torch.nn.functional.silu(gate) * up, w2)  # [T, E, h]
    onehot = torch.nn.functional.one_hot(idx, moe.num_experts).to(x.dtype) * keep[..., None]  # [T, K, E]
    out = torch.einsum("tk,tke,teh->th", probs, onehot, y_all)
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        out = out + _swiglu(x, shared.linear_fc1.weight.t(), shared.linear_fc2.weight.t())
    valid = torch.ones(x.shape[0], dtype=torch.bool) if padding_mask is None else ~padding_mask  # [T]
    if getattr(moe, "aux_loss_type", "micro_batch") == "seq":
        shape = (x.shape[0] // batch_size, batch_size)
        aux = sequence_load_balancing_loss(
            scores.view(*shape, moe.num_experts),  # explicit sizes: s may be 0
            idx.view(*shape, moe.topk),
            moe.num_experts,
            moe.topk,
            valid.view(shape),
        )
    else:
        aux = load_balancing_loss(scores[valid], idx[valid], moe.num_experts, moe.topk)
    layer.oracle_z_loss = router_z_loss(logits[valid])
    return out, aux, idx.masked_fill(~keep, -1)


def _objective(layer, want_out, want_aux, g):
    """What backward differentiates: <out, g> + the scaled router losses."""
    moe = layer.config.moe
    z = getattr(moe, "z_loss_coeff", 0.0) * layer.oracle_z_loss
    return (want_out * g).sum() + moe.aux_loss_coeff * want_aux + z


def _kept_counts(idx, num_experts):
    return torch.bincount(idx[idx >= 0], minlength=num_experts)


def _check_layer_against_oracle(layer, hidden, g, padding_mask=None):
    """Forward, losses, counts and every gradient of layer(hidden) against dense_oracle."""
    s, b, h = hidden.shape
    hidden = hidden.clone().requires_grad_(True)
    layer.reset_stats()
    out, bias = layer(hidden, padding_mask=padding_mask)
    token_mask = None if padding_mask is None else padding_mask.t().reshape(-1)  # [T]
    want_out, want_aux, idx = dense_oracle(layer, hidden.view(s * b, h), token_mask, b)

    assert bias is None
    torch.testing.assert_close(out.view(s * b, h), want_out)
    torch.testing.assert_close(layer.last_aux_loss, want_aux.detach().float())
    torch.testing.assert_close(layer.last_z_loss, layer.oracle_z_loss.detach().float())
    kept = idx if token_mask is None else idx[~token_mask]
    assert torch.equal(layer.tokens_per_expert, _kept_counts(kept, layer.config.moe.num_experts))
    assert int(layer.last_dropped) == int((idx < 0).sum())

    inputs = [hidden] + _params(layer)
    got = torch.autograd.grad(out, inputs, g, materialize_grads=True)
    objective = _objective(layer, want_out, want_aux, g.view(s * b, h))
    want = torch.autograd.grad(objective, inputs, materialize_grads=True)
    for (name, _), a, w in zip([("hidden", None)] + sorted(layer.named_parameters()), got, want):
        torch.testing.assert_close(a, w, msg=lambda m: f"grad of {name}: {m}")
    return idx, dict(zip(["hidden"] + [n for n, _ in sorted(layer.named_parameters())], got))


def _params(layer):
    return [p for _, p in sorted(layer.named_parameters())]


SHAPES = [(5, 3), (1, 1), (16, 2)]
SHAPE_IDS = [f"S{s}-B{b}" for s, b in SHAPES]


@pytest.mark.parametrize("s,b", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize(
    "moe",
    [
        dict(),
        dict(score_func="sigmoid", expert_bias=True, shared_expert_ffn_hidden_size=16),
        dict(topk=3, num_experts=5, aux_loss_coeff=0.0),
    ],
    ids=["softmax-E8-K2", "sigmoid-bias-shared", "E5-K3-noaux"],
)
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
def test_layer_matches_dense_oracle(s, b, moe, dtype):
    torch.manual_seed(s * 10 + b)
    layer = MoELayer(make_config(dtype=dtype, **moe))
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.randn(layer.config.moe.num_experts) * 0.3)
    hidden = torch.randn(s, b, 32, dtype=dtype)
    idx, _ = _check_layer_against_oracle(layer, hidden, torch.randn(s, b, 32, dtype=dtype))
    assert not (idx < 0).any()


ROUTING_VARIANTS = {
    "groups-sigmoid-seqaux-z": dict(
        score_func="sigmoid", expert_bias=True, num_groups=4, topk_groups=2, topk=3,
        routed_scaling_factor=2.5, aux_loss_type="seq", z_loss_coeff=0.03,
    ),
    "groups-softmax-norm-z": dict(num_groups=2, topk_groups=1, norm_topk_prob=True, z_loss_coeff=0.1),
    "cap1.0-probs": dict(capacity_factor=1.0, drop_policy="probs", shared_expert_ffn_hidden_size=16),
    # the reference permute here; "auto" elsewhere runs the compiled one where _C is built
    "cap0.5-position-sigmoid-torchpermute": dict(
        capacity_factor=0.5, drop_policy="position", score_func="sigmoid", topk=3, permute_backend="torch"
    ),
    "cap1.25-probs-groups-seqaux": dict(
        capacity_factor=1.25, num_groups=4, topk_groups=2, aux_loss_type="seq", expert_bias=True,
    ),
}


@pytest.mark.parametrize("name", list(ROUTING_VARIANTS))
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_routing_variants_match_dense_oracle(name, padded):
    """Group-limited routing, scaling, seq aux loss, z-loss and capacity drops, in the layer."""
    torch.manual_seed(len(name) + padded)
    layer = MoELayer(make_config(**ROUTING_VARIANTS[name]))
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.randn(8) * 0.2)
    s, b = 9, 3
    padding_mask = None
    if padded:
        padding_mask = torch.zeros(b, s, dtype=torch.bool)
        padding_mask[1, 5:] = True
    hidden = torch.randn(s, b, 32, dtype=F64)
    idx, _ = _check_layer_against_oracle(layer, hidden, torch.randn(s, b, 32, dtype=F64), padding_mask)
    if layer.config.moe.capacity_factor is not None:
        capacity = expert_capacity(s * b, layer.config.moe.topk, 8, layer.config.moe.capacity_factor)
        assert int((idx < 0).sum()) > 0, "the skew of random routing should overflow some expert"
        assert int(_kept_counts(idx, 8).max()) <= capacity


EDGE_CASES = {
    # name: (moe overrides, expert bias forcing the routing or None, (s, b))
    "all-to-expert3-dropless": (
        dict(topk=1, score_func="sigmoid", expert_bias=True), [0.0] * 3 + [9.0] + [0.0] * 4, (7, 3)
    ),
    "all-to-expert3-cap1.0": (
        dict(topk=1, score_func="sigmoid", expert_bias=True, capacity_factor=1.0, drop_policy="position"),
        [0.0] * 3 + [9.0] + [0.0] * 4,
        (7, 3),
    ),
    "topk-eq-E-dropless": (dict(topk=8, num_groups=2, topk_groups=2), None, (5, 3)),
    "topk-eq-E-cap1.0": (dict(topk=4, num_experts=4, capacity_factor=1.0, score_func="sigmoid"), None, (5, 3)),
    "no-tokens": (dict(shared_expert_ffn_hidden_size=16, aux_loss_type="seq"), None, (0, 2)),
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases_match_dense_oracle(name):
    moe, bias, (s, b) = EDGE_CASES[name]
    torch.manual_seed(7)
    layer = MoELayer(make_config(**moe))
    if bias is not None:
        layer.router.expert_bias.copy_(torch.tensor(bias))
    hidden = torch.randn(s, b, 32, dtype=F64)
    idx, grads = _check_layer_against_oracle(layer, hidden, torch.randn(s, b, 32, dtype=F64))
    counts = layer.tokens_per_expert
    num_experts, topk = layer.config.moe.num_experts, layer.config.moe.topk
    if bias is not None:  # one expert takes every kept copy; the others get none and no gradient
        cf = layer.config.moe.capacity_factor
        assert counts.tolist() == [0] * 3 + [s * b if cf is None else expert_capacity(s * b, 1, 8, cf)] + [0] * 4
        idle = torch.arange(num_experts) != 3
        assert not grads["experts.weight1"][idle].any() and not grads["experts.weight2"][idle].any()
    if topk == num_experts:  # every token reaches every expert; a capacity of T drops nothing
        assert counts.tolist() == [s * b] * num_experts and int(layer.last_dropped) == 0
    if s * b == 0:
        assert counts.sum() == 0 and not grads["experts.weight1"].any()


def test_two_runs_are_bitwise_equal():
    moe = dict(
        capacity_factor=0.75, num_groups=4, topk_groups=2, score_func="sigmoid", expert_bias=True,
        shared_expert_ffn_hidden_size=16, aux_loss_type="seq", z_loss_coeff=0.01,
    )
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        layer = MoELayer(make_config(dtype=torch.float32, **moe))
        layer.router.expert_bias.copy_(torch.randn(8) * 0.1)
        hidden, g = torch.randn(13, 3, 32), torch.randn(13, 3, 32)
        runs.append(_run_layer(layer, hidden, g) + (layer.tokens_per_expert.clone(),))
    (out_a, grads_a, counts_a), (out_b, grads_b, counts_b) = runs
    assert torch.equal(out_a, out_b) and torch.equal(counts_a, counts_b)
    for key in grads_a:
        assert torch.equal(grads_a[key], grads_b[key]), key


def test_aux_loss_changes_gradients_not_output_and_is_off_in_eval():
    torch.manual_seed(0)
    layer = MoELayer(make_config(aux_loss_coeff=0.5))
    hidden = torch.randn(7, 3, 32, dtype=F64)
    out_train = layer(hidden)[0]
    layer.config.moe.aux_loss_coeff = 0.0
    no_aux = MoELayer(layer.config)
    no_aux.load_state_dict(layer.state_dict())
    out_plain = no_aux(hidden)[0]
    torch.testing.assert_close(out_train, out_plain, rtol=0, atol=0)
    g_aux = torch.autograd.grad(out_train.sum(), layer.router.weight)[0]
    g_plain = torch.autograd.grad(out_plain.sum(), no_aux.router.weight)[0]
    assert (g_aux - g_plain).abs().max() > 1e-6

    layer.eval()
    g_eval = torch.autograd.grad(layer(hidden)[0].sum(), layer.router.weight)[0]
    torch.testing.assert_close(g_eval, g_plain)


def test_padding_mask_excludes_padding_from_aux_loss_and_counts():
    torch.manual_seed(1)
    layer = MoELayer(make_config())
    s, b = 9, 2
    hidden = torch.randn(s, b, 32, dtype=F64)
    padding_mask = torch.zeros(b, s, dtype=torch.bool)
    padding_mask[0, 6:] = True
    padding_mask[1, 2:] = True

    out_masked = layer(hidden, padding_mask=padding_mask)[0]
    aux_masked, counts_masked = layer.last_aux_loss, layer.tokens_per_expert.clone()
    layer.reset_stats()
    out_full = layer(hidden)[0]

    token_mask = padding_mask.t().reshape(-1)  # [T] in [s, b] token order
    _, want_aux, idx = dense_oracle(layer, hidden.view(s * b, 32), token_mask, b)
    torch.testing.assert_close(aux_masked, want_aux.float())
    assert torch.equal(counts_masked, torch.bincount(idx[~token_mask].flatten(), minlength=8))
    torch.testing.assert_close(out_masked, out_full, rtol=0, atol=0)
    with pytest.raises(ValueError, match="padding_mask"):
        layer(hidden, padding_mask=padding_mask.t())


def test_tokens_per_expert_accumulates_until_reset_and_skips_no_grad():
    torch.manual_seed(2)
    layer = MoELayer(make_config())
    xs = [torch.randn(4, 3, 32, dtype=F64) for _ in range(3)]
    total = torch.zeros(8, dtype=torch.int64)
    for x in xs[:2]:
        layer(x)
        total += torch.bincount(dense_oracle(layer, x.view(-1, 32))[2].flatten(), minlength=8)
    with torch.no_grad():
        layer(xs[2])
    assert torch.equal(layer.tokens_per_expert, total)
    assert int(total.sum()) == 2 * 12 * 2
    layer.reset_stats()
    assert not layer.tokens_per_expert.any()


def test_update_expert_bias_follows_sign_rule():
    torch.manual_seed(3)
    layer = MoELayer(make_config(expert_bias=True, bias_update_rate=0.25))
    router = layer.router
    start = torch.randn(8)
    router.expert_bias.copy_(start)
    counts = torch.tensor([5, 3, 4, 4, 0, 9, 4, 3])  # mean 4
    router.update_expert_bias(counts)
    want = start + 0.25 * torch.tensor([-1.0, 1, 0, 0, 1, -1, 0, 1])
    torch.testing.assert_close(router.expert_bias, want)
    with pytest.raises(ValueError, match="tokens_per_expert_global"):
        router.update_expert_bias(counts[:4])
    with pytest.raises(ValueError, match="expert_bias"):
        MoELayer(make_config()).router.update_expert_bias(counts)


def test_expert_params_are_marked_and_initialised_per_global_expert():
    cfg = make_config(dtype=torch.float32)
    torch.manual_seed(4)
    full = GroupedExperts(cfg, 8)
    torch.manual_seed(4)
    upper = GroupedExperts(cfg, 4, expert_offset=4)
    torch.testing.assert_close(upper.weight1, full.weight1[4:], rtol=0, atol=0)
    torch.testing.assert_close(upper.weight2, full.weight2[4:], rtol=0, atol=0)
    assert not torch.equal(full.weight1[0], full.weight1[1])
    std2 = cfg.init_method_std / (2.0 * cfg.num_layers) ** 0.5
    assert abs(full.weight1.std().item() / cfg.init_method_std - 1) < 0.05
    assert abs(full.weight2.std().item() / std2 - 1) < 0.05
    for p in (full.weight1, full.weight2):
        assert p.allreduce is False and p.num_local_experts == 8
    layer = MoELayer(make_config(shared_expert_ffn_hidden_size=8))
    for name, p in layer.named_parameters():
        assert getattr(p, "allreduce", True) is (not name.startswith("experts.")), name


def test_routing_stays_fp32_after_the_model_is_cast_to_bf16():
    torch.manual_seed(5)
    layer = MoELayer(make_config(dtype=torch.bfloat16, expert_bias=True)).to(torch.bfloat16)
    hidden = torch.randn(6, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    probs, _ = layer.router(hidden.view(-1, 32))
    assert probs.dtype == torch.float32 and layer.router.expert_bias.dtype == torch.float32
    layer.router.update_expert_bias(torch.arange(8))
    assert layer.router.expert_bias.dtype == torch.float32
    out = layer(hidden)[0]
    assert out.dtype == torch.bfloat16
    assert torch.autograd.grad(out.float().sum(), hidden)[0].isfinite().all()


def test_config_errors():
    with pytest.raises(ValueError, match="aux_loss_type"):
        MoELayer(make_config(aux_loss_type="batch"))
    with pytest.raises(ValueError, match="num_local_experts"):
        GroupedExperts(make_config(), 0)
    seq_router = MoELayer(make_config(aux_loss_type="seq")).router
    with pytest.raises(ValueError, match="batch_size"):
        seq_router(torch.randn(6, 32, dtype=F64))
    with pytest.raises(ValueError, match="batch_size"):
        seq_router(torch.randn(6, 32, dtype=F64), batch_size=4)


def _run_layer(layer, hidden, g):
    hidden = hidden.clone().requires_grad_(True)
    out = layer(hidden)[0]
    names = [n for n, _ in sorted(layer.named_parameters())]
    grads = torch.autograd.grad(out, [hidden] + _params(layer), g, materialize_grads=True)
    return out.detach(), dict(zip(["hidden"] + names, grads))


def _inputs(rank, s, b):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(s, b, 32, dtype=F64, generator=gen), torch.randn(s, b, 32, dtype=F64, generator=gen)


EP_SCENARIOS = {
    # name: (moe overrides, [(s, b)] per rank of the world, expert bias that forces the routing or None)
    "random-shared": (dict(shared_expert_ffn_hidden_size=16), [(5, 3), (7, 2), (3, 1), (4, 2)], None),
    # experts 0-3 only: with EP=2 rank 1's experts, with EP=4 ranks 2 and 3's, receive nothing
    "all-to-experts0-3": (
        dict(score_func="sigmoid", expert_bias=True), [(4, 3), (3, 3), (2, 2), (5, 1)], [10.0] * 4 + [0.0] * 4
    ),
    "capacity-groups": (
        dict(capacity_factor=0.75, drop_policy="position", num_groups=4, topk_groups=2, topk=3, z_loss_coeff=0.01),
        [(6, 2), (5, 3), (3, 3), (4, 2)],
        None,
    ),
    "empty-rank": (dict(aux_loss_type="seq", capacity_factor=1.0), [(5, 2), (3, 3), (4, 1), (0, 2)], None),
}


def _shapes(name, dispatcher=None):
    """[(s, b)] per rank. The static dispatcher sizes its buffers from the local token count,
    so every EP rank passes the same [s, b] (as a trainer does): rank 0's shape for all."""
    shapes = EP_SCENARIOS[name][1]
    static = (_dispatcher if dispatcher is None else DISPATCHERS[dispatcher])["dispatcher"] == "static"
    return [shapes[0]] * len(shapes) if static else shapes


def _ep_case(rank, name, ep_group, members, solo_group):
    """EP layer on this rank's tokens vs an EP=1 layer on the tokens of every member of the EP group."""
    moe, bias = EP_SCENARIOS[name][0], EP_SCENARIOS[name][2]
    shapes = _shapes(name)
    cfg = make_config(**moe)
    ep_size, ep_rank = len(members), members.index(rank)
    torch.manual_seed(0)
    ep_layer = MoELayer(cfg, ep_group=ep_group)  # None: the EP group of parallel_state
    torch.manual_seed(0)
    ref_layer = MoELayer(cfg, ep_group=solo_group)  # a size-1 group: no communication
    num_local = 8 // ep_size
    assert ep_layer.dispatcher.ep_size == ep_size and ref_layer.dispatcher.ep_size == 1
    assert ep_layer.local_expert_indices == list(range(ep_rank * num_local, (ep_rank + 1) * num_local))
    for layer in (ep_layer, ref_layer):
        if bias is not None:
            layer.router.expert_bias.copy_(torch.tensor(bias))
    local = slice(ep_rank * num_local, (ep_rank + 1) * num_local)
    ref_state = ref_layer.state_dict()
    for key, value in ep_layer.state_dict().items():
        want = ref_state[key][local] if key.startswith("experts.") else ref_state[key]
        torch.testing.assert_close(value, want, rtol=0, atol=0, msg=lambda m: f"{name} {key}: {m}")

    hidden, g = _inputs(rank, *shapes[rank])
    out, grads = _run_layer(ep_layer, hidden, g)
    ref = {r: _run_layer(ref_layer, *_inputs(r, *shapes[r])) for r in members}
    torch.testing.assert_close(out, ref[rank][0], rtol=1e-9, atol=1e-10)
    for key, grad in grads.items():
        if key.startswith("experts."):
            want = sum(ref_r[1][key] for ref_r in ref.values())[local]  # the group's tokens reach them
        else:
            want = ref[rank][1][key]  # replicated params: this rank's tokens only
        torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name} grad {key}: {m}")
    ref_layer.reset_stats()
    _run_layer(ref_layer, hidden, g)
    assert torch.equal(ep_layer.tokens_per_expert, ref_layer.tokens_per_expert), name
    assert torch.equal(ep_layer.last_dropped, ref_layer.last_dropped), name
    torch.testing.assert_close(ep_layer.last_aux_loss, ref_layer.last_aux_loss)
    d = ep_layer.dispatcher
    received = int(d.last_received if hasattr(d, "last_received") else d.recv_counts.sum())
    assert int(ep_layer.last_dispatch_overflow) == 0, name  # the default capacity never overflows here
    expert_grads_nonzero = any(bool(grads[k].any()) for k in grads if k.startswith("experts."))
    assert expert_grads_nonzero == (received > 0), name
    return received, int(ep_layer.last_dropped)


def _global_aux_case(rank, group, members):
    """The "global" aux loss over `group` against a hand computation from every member's tokens."""
    cfg = make_config(aux_loss_type="global", aux_loss_coeff=0.3)
    torch.manual_seed(0)
    router = TopKRouter(cfg, aux_loss_group=group)
    xs = {r: torch.randn(3 + 2 * r, 32, dtype=F64, generator=torch.Generator().manual_seed(50 + r)) for r in members}
    x = xs[rank].clone().requires_grad_(True)
    probs, _ = router(x)
    g = torch.randn(probs.shape, dtype=F64, generator=torch.Generator().manual_seed(rank))
    got = torch.autograd.grad(probs, [x, router.weight], g)

    counts = [0] * 8  # copies per expert over the tokens of every member
    for r in members:
        for e in router_topk(xs[r] @ router.weight.detach().t(), 2)[1].flatten().tolist():
            counts[e] += 1
    logits = x @ router.weight.t()
    scores = logits.softmax(-1)
    hand = 8 * sum(counts[e] / sum(counts) * scores[:, e].mean() for e in range(8))
    torch.testing.assert_close(router.last_aux_loss, hand.detach().float())
    objective = (router_topk(logits, 2)[0] * g).sum() + 0.3 * hand
    for a, w in zip(got, torch.autograd.grad(objective, [x, router.weight])):
        torch.testing.assert_close(a, w)
    local = load_balancing_loss(scores, router_topk(logits, 2)[1], 8, 2)
    return abs(float(hand) - float(local)) > 1e-6  # the other ranks' load made a difference


def _static_overflow_case(rank, world_size, solo_group):
    """Receive capacities too small for the routing: every routed copy is either computed by an
    expert or counted as overflow, over the group; with no limit (factor None) the same routing
    computes every copy and equals EP=1. Returns this rank's overflow."""
    results = {}
    for factor in (1.0, None):
        cfg = make_config(
            score_func="sigmoid", expert_bias=True, dispatcher="static", dispatch_capacity_factor=factor,
            dispatch_chunks=1,
        )
        layers = []
        for group in (None, solo_group):
            torch.manual_seed(0)
            layers.append(MoELayer(cfg, ep_group=group))
            layers[-1].router.expert_bias.copy_(torch.tensor([10.0] * 4 + [0.0] * 4))  # every copy to experts 0-3
        ep_layer, ref_layer = layers
        hidden = _inputs(0, 4, 3)[0] + rank  # the same shape on every rank, different tokens
        out = ep_layer(hidden)[0]
        routed = torch.tensor([12 * 2, int(ep_layer.dispatcher.last_received), int(ep_layer.last_dispatch_overflow)])
        dist.all_reduce(routed)
        assert int(routed[0]) == int(routed[1]) + int(routed[2]), (factor, routed.tolist())
        results[factor] = int(ep_layer.last_dispatch_overflow)
        if factor is None:
            assert int(routed[2]) == 0
            torch.testing.assert_close(out, ref_layer(hidden)[0], rtol=1e-9, atol=1e-10)
        else:
            total = torch.tensor(results[factor])
            dist.all_reduce(total)
            assert int(total) > 0
    return results[1.0]


def _ep_worker(rank, world_size, dispatcher):
    """EP=4 (parallel_state's group) and EP=2 (groups {0, 1} and {2, 3}) against EP=1; the global
    aux loss over 2 and 4 ranks against a hand computation."""
    torch.set_num_threads(1)
    _dispatcher.clear()
    _dispatcher.update(DISPATCHERS[dispatcher])
    # new_group is collective: every rank creates every group, in the same order
    solo_groups = [dist.new_group([r]) for r in range(world_size)]
    pairs = [[0, 1], [2, 3]]
    pair_groups = [dist.new_group(p) for p in pairs]
    init_megatron(rank, world_size, ep=world_size)
    with pytest.raises(ValueError, match="num_experts"):
        AllToAllDispatcher(6, ps.get_expert_model_parallel_group())
    pair = rank // 2
    results = {}
    default_group = MoELayer(make_config(aux_loss_type="global")).router.aux_loss_group
    assert dist.get_world_size(default_group) == world_size  # parallel_state's data-parallel group
    results["global-aux-2"] = _global_aux_case(rank, pair_groups[pair], pairs[pair])
    results["global-aux-4"] = _global_aux_case(rank, default_group, list(range(world_size)))
    if _dispatcher["dispatcher"] == "static":
        results["overflow"] = _static_overflow_case(rank, world_size, solo_groups[rank])
    for name in EP_SCENARIOS:
        results[(4, name)] = _ep_case(rank, name, None, list(range(world_size)), solo_groups[rank])
        results[(2, name)] = _ep_case(rank, name, pair_groups[pair], pairs[pair], solo_groups[rank])
    return results


@pytest.mark.distributed
def test_expert_parallel_matches_single_process(dispatcher):
    results = spawn(_ep_worker, 4, dispatcher)  # [rank] -> {(ep, scenario): (rows received, copies dropped)}
    assert all(results[r]["global-aux-2"] and results[r]["global-aux-4"] for r in range(4))
    for name, (moe, _, _) in EP_SCENARIOS.items():
        shapes = _shapes(name, dispatcher)
        topk = make_config(**moe).moe.topk
        for ep, groups in ((4, [[0, 1, 2, 3]]), (2, [[0, 1], [2, 3]])):
            for members in groups:
                sent = sum(shapes[r][0] * shapes[r][1] * topk - results[r][(ep, name)][1] for r in members)
                assert sum(results[r][(ep, name)][0] for r in members) == sent, (ep, name)
    if DISPATCHERS[dispatcher]["dispatcher"] == "static":
        assert sum(results[r]["overflow"] for r in range(4)) > 0  # factor 1.0 overflowed somewhere
    for rank in range(4):
        assert results[rank][(4, "random-shared")][0] > 0
    # the expert bias sends every copy to experts 0-3: the ranks holding experts 4-7 get none
    assert [results[r][(4, "all-to-experts0-3")][0] == 0 for r in range(4)] == [False, False, True, True]
    assert [results[r][(2, "all-to-experts0-3")][0] == 0 for r in range(4)] == [False, True, False, True]
    assert sum(results[r][(4, "capacity-groups")][1] for r in range(4)) > 0
