"""Megatron-Core's MoELayer with MegatronStaticDispatcher against the same layer with Megatron's
"allgather" dispatcher: forward and every gradient, at EP=1 in-process and EP=2 over gloo.

Megatron's allgather dispatcher calls torch.cuda.current_device() as soon as EP > 1, so the
EP=2 layer is compared with an EP=1 allgather layer run on each rank's tokens (the pattern of
test_moe_layer.py): outputs, input and replicated-parameter gradients per rank, routed-expert
gradients summed over the ranks whose tokens reach them.

Shape legend: s sequence, b micro-batch, T = s * b tokens, h hidden size, E experts,
K experts per token, F expert FFN size; "fc1"/"fc2" name an expert's weights in Megatron's
layout ([2F, h] gate | up, [h, F]) under its global index.
"""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_default_pg_collection
from megatron.core.transformer.spec_utils import build_module

from megatron_moe_hybrid.layers.moe.megatron_dispatcher import (
    MegatronGroupedExperts,
    MegatronMoELayerWithStaticDispatcher,
    MegatronStaticDispatcher,
    megatron_moe_spec,
)
from megatron_moe_hybrid.testing import init_megatron, spawn, teardown

F64 = torch.float64
HIDDEN = 16

ROUTINGS = {
    # name: TransformerConfig MoE fields
    "E4-K2": {"num_moe_experts": 4, "moe_router_topk": 2},
    "E6-K3-shared": {"num_moe_experts": 6, "moe_router_topk": 3, "moe_shared_expert_intermediate_size": 12},
    # Megatron's router drops the copies past each expert's capacity (routing_map False)
    "E4-K2-cap1.0": {
        "num_moe_experts": 4, "moe_router_topk": 2, "moe_expert_capacity_factor": 1.0, "moe_token_drop_policy": "probs"
    },
    "E4-K1-cap0.5-position": {
        "num_moe_experts": 4, "moe_router_topk": 1, "moe_router_pre_softmax": True,
        "moe_expert_capacity_factor": 0.5, "moe_token_drop_policy": "position",
    },
}


def make_config(dtype, routing):
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=20,
        moe_ffn_hidden_size=20,
        use_cpu_initialization=True,
        params_dtype=dtype,
        moe_token_dispatcher_type="allgather",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        **ROUTINGS[routing],
    )


def reference_layer(cfg, pg_collection=None):
    """Megatron's MoELayer with its allgather dispatcher and SequentialMLP experts."""
    spec = megatron_moe_spec("sequential", shared_expert=cfg.moe_shared_expert_intermediate_size is not None)
    return MoELayer(cfg, spec.submodules, pg_collection=pg_collection)


def static_layer(cfg, experts, **params):
    spec = megatron_moe_spec(experts, shared_expert=cfg.moe_shared_expert_intermediate_size is not None, **params)
    return build_module(spec, config=cfg)


def _canonical(name, tensor, offset):
    """(name, parameter or gradient) -> [(canonical name, view)]: routed experts by global index
    in Megatron's layout, everything else under its own name."""
    m = re.fullmatch(r"experts\.local_experts\.(\d+)\.linear_(fc[12])\.weight", name)
    if m:
        return [(f"expert{offset + int(m[1])}.{m[2]}", tensor)]
    if name in ("experts.weight1", "experts.weight2"):
        fc = "fc1" if name.endswith("1") else "fc2"
        return [(f"expert{offset + e}.{fc}", tensor[e].t()) for e in range(tensor.shape[0])]
    return [(name, tensor)]


def canonical(layer, tensors=None):
    """{canonical name: tensor} of layer's parameters, or of `tensors` listed in their order."""
    offset = layer.local_expert_indices[0]
    named = list(layer.named_parameters())
    tensors = [p for _, p in named] if tensors is None else tensors
    return dict(kv for (name, _), t in zip(named, tensors) for kv in _canonical(name, t, offset))


def load_canonical(layer, params):
    with torch.no_grad():
        for key, view in canonical(layer).items():
            view.copy_(params[key])


def run(layer, hidden, g):
    """-> (out [s, b, h], {"hidden" or canonical name: gradient})."""
    hidden = hidden.clone().requires_grad_(True)
    out, bias = layer(hidden)
    assert bias is None
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(out, [hidden] + params, g, materialize_grads=True)
    return out.detach(), {"hidden": grads[0], **canonical(layer, grads[1:])}


def _rows_seen(layer):
    seen = []
    layer.experts.register_forward_hook(lambda module, args, out: seen.append((args[0].shape[0], args[1])))
    return seen


@pytest.fixture(scope="module", autouse=True)
def megatron_ep1():
    init_megatron()
    yield
    teardown()


@pytest.fixture(autouse=True)
def unit_aux_loss_scale():
    """The aux-loss gradient scale is class state that another test may have changed."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))


@pytest.mark.parametrize("s,b", [(5, 3), (7, 1), (1, 1)], ids=["S5-B3", "S7-B1", "S1-B1"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("experts", ["sequential", "grouped"])
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
def test_ep1_matches_megatron_allgather(s, b, routing, experts, dtype):
    cfg = make_config(dtype, routing)
    torch.manual_seed(s * 7 + b)
    ref = reference_layer(cfg)
    ours = static_layer(cfg, experts)
    load_canonical(ours, canonical(ref))
    assert isinstance(ours.token_dispatcher, MegatronStaticDispatcher)
    assert ours.token_dispatcher.trim_padding == (experts == "sequential")
    hidden, g = torch.randn(s, b, HIDDEN, dtype=dtype), torch.randn(s, b, HIDDEN, dtype=dtype)
    seen = _rows_seen(ours)

    want_out, want = run(ref, hidden, g)
    got_out, got = run(ours, hidden, g)
    torch.testing.assert_close(got_out, want_out)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m, key=key: f"grad of {key}: {m}")

    _, routing_map = ours.router(hidden.view(-1, HIDDEN))
    [(rows, counts)] = seen
    assert torch.equal(counts.cpu(), routing_map.sum(0))
    # grouped experts take the whole static buffer (C = T * K at EP=1); Megatron's, the kept rows
    assert rows == (int(routing_map.sum()) if experts == "sequential" else s * b * cfg.moe_router_topk)
    assert int(ours.token_dispatcher.last_overflow) == 0


def test_capacity_cases_drop_copies():
    """The capacity routings above are only meaningful if Megatron's router drops copies."""
    for routing in ("E4-K2-cap1.0", "E4-K1-cap0.5-position"):
        cfg = make_config(F64, routing)
        torch.manual_seed(5 * 7 + 3)
        layer = static_layer(cfg, "sequential")
        _, routing_map = layer.router(torch.randn(15, HIDDEN, dtype=F64))
        assert int(routing_map.sum()) < 15 * cfg.moe_router_topk, routing


def test_probs_reach_the_router_through_the_dispatcher():
    """With the aux loss off, the router weight learns only through permuted_probs."""
    cfg = make_config(F64, "E4-K2")
    cfg.moe_aux_loss_coeff = 0.0
    torch.manual_seed(1)
    layer = static_layer(cfg, "grouped")
    hidden = torch.randn(6, 2, HIDDEN, dtype=F64)
    _, grads = run(layer, hidden, torch.randn_like(hidden))
    assert grads["router.weight"].abs().max() > 1e-6


def test_bad_inputs_raise():
    cfg = make_config(F64, "E4-K2")
    layer = static_layer(cfg, "sequential")
    d = layer.token_dispatcher
    x = torch.randn(3, 2, HIDDEN, dtype=F64)
    with pytest.raises(ValueError, match="routing_map"):
        d.dispatch_preprocess(x, torch.zeros(6, 5, dtype=torch.bool), torch.zeros(6, 4, dtype=F64))
    with pytest.raises(ValueError, match="routing_map"):
        d.dispatch_preprocess(x, torch.zeros(6, 4), torch.zeros(6, 4, dtype=F64))
    with pytest.raises(ValueError, match="probs"):
        d.dispatch_preprocess(x, torch.zeros(6, 4, dtype=torch.bool), torch.zeros(6, 3, dtype=F64))
    with pytest.raises(ValueError, match="experts="):
        megatron_moe_spec("fused")
    with pytest.raises(ValueError, match="local_expert_indices"):
        MegatronStaticDispatcher(2, [1, 2], cfg, get_default_pg_collection())
    cfg.moe_shared_expert_overlap = True
    with pytest.raises(ValueError, match="moe_shared_expert_overlap"):
        MegatronMoELayerWithStaticDispatcher(cfg, megatron_moe_spec().submodules)
    cfg.moe_shared_expert_overlap = False
    cfg.activation_func = F.gelu
    with pytest.raises(ValueError, match="activation_func"):
        MegatronGroupedExperts(2, cfg)


EP2_CASES = {
    # name: (routing, experts, static dispatcher params); a factor >= ep cannot overflow
    "E4-K2-sequential": ("E4-K2", "sequential", {}),
    "E6-K3-shared-grouped": ("E6-K3-shared", "grouped", {"dispatch_capacity_factor": None}),
    "E4-K2-cap1.0-sequential": ("E4-K2-cap1.0", "sequential", {"dispatch_capacity_factor": 3.0}),
    "E4-K1-cap0.5-grouped": ("E4-K1-cap0.5-position", "grouped", {}),
}
EP2_SHAPES = [(5, 3), (4, 1)]  # [s, b], the same on every rank


def _ep2_worker(rank, world_size):
    """Each EP2 case on this rank's tokens against the EP=1 allgather layer on each rank's."""
    torch.set_num_threads(1)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    solo = [dist.new_group([r]) for r in range(world_size)]  # collective: every rank, same order
    init_megatron(rank, world_size, ep=world_size)
    ref_pg = get_default_pg_collection()
    ref_pg.ep = ref_pg.tp_ep = solo[rank]
    rows = {}
    for name, (routing, experts, params) in EP2_CASES.items():
        for s, b in EP2_SHAPES:
            cfg = make_config(F64, routing)
            torch.manual_seed(3)  # the same reference weights on every rank
            ref = reference_layer(cfg, ref_pg)
            ours = static_layer(cfg, experts, **params)
            assert ours.token_dispatcher.static.ep_size == world_size
            load_canonical(ours, canonical(ref))
            seen = _rows_seen(ours)
            gen = torch.Generator().manual_seed(s * b)
            inputs = [  # (hidden, output gradient) of each rank
                tuple(torch.randn(s, b, HIDDEN, dtype=F64, generator=gen) for _ in range(2)) for _ in range(world_size)
            ]
            out, grads = run(ours, *inputs[rank])
            refs = [run(ref, *inputs[r]) for r in range(world_size)]
            torch.testing.assert_close(out, refs[rank][0], rtol=1e-9, atol=1e-11)
            for key, grad in grads.items():
                if key.startswith("expert"):  # routed experts: every rank's tokens reach them
                    want = sum(ref_grads[key] for _, ref_grads in refs)
                else:
                    want = refs[rank][1][key]
                torch.testing.assert_close(
                    grad, want, rtol=1e-9, atol=1e-11, msg=lambda m, key=key, name=name: f"{name} grad {key}: {m}"
                )
            assert int(ours.token_dispatcher.last_overflow) == 0
            rows[(name, s, b)] = seen[0][0]
    return rows


@pytest.mark.distributed
def test_ep2_matches_megatron_allgather_at_ep1():
    rows = spawn(_ep2_worker, 2)
    for (name, s, b), n in rows[0].items():  # every copy landed on one of the two ranks
        if EP2_CASES[name][1] == "sequential" and "cap" not in name:
            topk = make_config(F64, EP2_CASES[name][0]).moe_router_topk
            assert n + rows[1][(name, s, b)] == 2 * s * b * topk, name
