"""MoELayer against a dense einsum oracle, and expert parallelism (EP=2 over gloo) against EP=1.

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

from megatron_moe_hybrid.layers.moe import AllToAllDispatcher, GroupedExperts, MoELayer
from megatron_moe_hybrid.ops.moe import load_balancing_loss, router_topk
from megatron_moe_hybrid.testing import init_megatron, spawn

F64 = torch.float64


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
    )
    fields.update(moe)
    cfg.moe = types.SimpleNamespace(**fields)
    return cfg


def _swiglu(x, w_in, w_out):
    gate, up = (x @ w_in).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w_out


def dense_oracle(layer, x, padding_mask=None):
    """out [T, h] computing every expert on every token, and coeff * load-balancing loss."""
    moe = layer.config.moe
    logits = x @ layer.router.weight.t()  # [T, E]
    probs, idx, scores = router_topk(logits, moe.topk, moe.score_func, layer.router.expert_bias)
    w1, w2 = layer.experts.weight1, layer.experts.weight2  # [E, h, 2F], [E, F, h]
    gate, up = torch.einsum("th,ehf->tef", x, w1).chunk(2, dim=-1)  # [T, E, F] each
    y_all = torch.einsum("tef,efh->teh", torch.nn.functional.silu(gate) * up, w2)  # [T, E, h]
    onehot = torch.nn.functional.one_hot(idx, moe.num_experts).to(x.dtype)  # [T, K, E]
    out = torch.einsum("tk,tke,teh->th", probs, onehot, y_all)
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        out = out + _swiglu(x, shared.linear_fc1.weight.t(), shared.linear_fc2.weight.t())
    keep = slice(None) if padding_mask is None else ~padding_mask
    aux = load_balancing_loss(scores[keep], idx[keep], moe.num_experts, moe.topk)
    return out, aux, idx


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
    hidden = torch.randn(s, b, 32, dtype=dtype, requires_grad=True)
    g = torch.randn(s, b, 32, dtype=dtype)

    out, bias = layer(hidden)
    want_out, want_aux, idx = dense_oracle(layer, hidden.view(s * b, 32))

    assert bias is None
    torch.testing.assert_close(out.view(s * b, 32), want_out)
    torch.testing.assert_close(layer.last_aux_loss, want_aux.detach().float())
    counts = torch.bincount(idx.flatten(), minlength=layer.config.moe.num_experts)
    assert torch.equal(layer.tokens_per_expert, counts)

    inputs = [hidden] + _params(layer)
    got = torch.autograd.grad(out, inputs, g, materialize_grads=True)
    objective = (want_out * g.view(s * b, 32)).sum() + layer.config.moe.aux_loss_coeff * want_aux
    want = torch.autograd.grad(objective, inputs, materialize_grads=True)
    for (name, _), a, w in zip([("hidden", None)] + sorted(layer.named_parameters()), got, want):
        torch.testing.assert_close(a, w, msg=lambda m: f"grad of {name}: {m}")


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
    _, want_aux, idx = dense_oracle(layer, hidden.view(s * b, 32), token_mask)
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
    with pytest.raises(NotImplementedError, match="moe.capacity_factor"):
        MoELayer(make_config(capacity_factor=1.25))
    with pytest.raises(ValueError, match="num_local_experts"):
        GroupedExperts(make_config(), 0)


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
    # name: (moe overrides, [(s, b)] per rank, expert bias that forces the routing or None)
    "random-shared": (dict(shared_expert_ffn_hidden_size=16), [(5, 3), (7, 2)], None),
    "all-to-rank0": (dict(score_func="sigmoid", expert_bias=True), [(4, 3), (3, 3)], [10.0] * 4 + [0.0] * 4),
}


def _ep_worker(rank, world_size):
    """Runs on each rank: EP=2 layer on this rank's tokens vs EP=1 layers on every rank's tokens."""
    torch.set_num_threads(1)
    solo_groups = [dist.new_group([r]) for r in range(world_size)]  # collective: every rank creates all
    init_megatron(rank, world_size, ep=world_size)
    with pytest.raises(ValueError, match="num_experts"):
        AllToAllDispatcher(3, ps.get_expert_model_parallel_group())
    received = {}
    for name, (moe, shapes, bias) in EP_SCENARIOS.items():
        cfg = make_config(**moe)
        torch.manual_seed(0)
        ep_layer = MoELayer(cfg)  # EP group from parallel_state
        torch.manual_seed(0)
        ref_layer = MoELayer(cfg, ep_group=solo_groups[rank])  # a size-1 group: no communication
        assert ep_layer.dispatcher.ep_size == world_size and ref_layer.dispatcher.ep_size == 1
        assert ep_layer.local_expert_indices == list(range(rank * 4, rank * 4 + 4))
        for layer in (ep_layer, ref_layer):
            if bias is not None:
                layer.router.expert_bias.copy_(torch.tensor(bias))
        local = slice(rank * 4, rank * 4 + 4)
        ref_state = ref_layer.state_dict()
        for key, value in ep_layer.state_dict().items():
            want = ref_state[key][local] if key.startswith("experts.") else ref_state[key]
            torch.testing.assert_close(value, want, rtol=0, atol=0, msg=lambda m: f"{name} {key}: {m}")

        hidden, g = _inputs(rank, *shapes[rank])
        out, grads = _run_layer(ep_layer, hidden, g)
        ref = [_run_layer(ref_layer, *_inputs(r, *shapes[r])) for r in range(world_size)]
        torch.testing.assert_close(out, ref[rank][0], rtol=1e-9, atol=1e-10)
        for key, grad in grads.items():
            if key.startswith("experts."):
                want = sum(ref_r[1][key] for ref_r in ref)[local]  # every rank's tokens reach them
            else:
                want = ref[rank][1][key]  # replicated params: this rank's tokens only
            torch.testing.assert_close(
                grad, want, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name} grad {key}: {m}"
            )
        ref_layer.reset_stats()
        _run_layer(ref_layer, hidden, g)
        assert torch.equal(ep_layer.tokens_per_expert, ref_layer.tokens_per_expert), name
        torch.testing.assert_close(ep_layer.last_aux_loss, ref_layer.last_aux_loss)
        received[name] = int(ep_layer.dispatcher.recv_counts.sum())
        expert_grads_nonzero = any(bool(grads[k].any()) for k in grads if k.startswith("experts."))
        assert expert_grads_nonzero == (received[name] > 0), name
    return received


@pytest.mark.distributed
def test_expert_parallel_matches_single_process():
    received = spawn(_ep_worker, 2)  # [rank] -> {scenario: rows received by the rank's experts}
    for name, (moe, shapes, _) in EP_SCENARIOS.items():
        num_copies = sum(s * b * make_config(**moe).moe.topk for s, b in shapes)
        assert received[0][name] + received[1][name] == num_copies, name
    assert received[0]["random-shared"] > 0 and received[1]["random-shared"] > 0
    # the expert bias sends every copy to rank 0's experts: rank 1's experts get none
    assert received[1]["all-to-rank0"] == 0
