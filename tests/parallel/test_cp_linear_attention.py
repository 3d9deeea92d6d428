"""Linear attention under context parallelism (CP=2 and CP=4 over gloo, both layouts) against
the single-process ops and layer: forward, every gradient, communication volume.

Shape legend: B batch, T global tokens, Tl = T / P local tokens, H heads, K key dim, V value
dim, N sequences, P CP ranks, NP pieces, L tokens per piece; layer: s sequence, b micro-batch,
h hidden size ([s, b, h], s local under CP).

Loss convention: rank r's loss is <o_r, do_r> over its own tokens plus <final_state, dF_r>
(a different dF_r per rank); the global loss is their sum, so the single-process gradient is
that of <o, do> + <final_state, sum_r dF_r>. Local input gradients are compared at their
global positions, replicated ones (initial_state, layer parameters) summed over ranks.
"""

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

import megatron_moe_hybrid.parallel.cp_linear_attention as cpla
from megatron_moe_hybrid.layers.linear_attention import LinearAttention, LinearAttentionSubmodules
from megatron_moe_hybrid.ops.linear_attention import gated_delta_rule, simple_gla
from megatron_moe_hybrid.parallel.context_parallel import CPLayout
from megatron_moe_hybrid.parallel.cp_linear_attention import cp_gated_delta_rule, cp_simple_gla
from megatron_moe_hybrid.testing import assert_close_to_scale, init_megatron, spawn, teardown

H, K, V = 2, 8, 6
CHUNK = 16
WORLD = 4
KINDS = ["contiguous", "zigzag"]
OPS = {"gated_delta_rule": (gated_delta_rule, cp_gated_delta_rule), "simple_gla": (simple_gla, cp_simple_gla)}
# (id, piece length L, packing, initial and final state): L 5, 16, 23 against chunk_size 16 so
# pieces end before, at and after a chunk end; packing None is unpacked with B = 2.
OP_CASES = [
    ("L5-B2-state", 5, None, True),
    ("L16-packedA-state", 16, "A", True),
    ("L23-packedB-state", 23, "B", True),
    ("L5-packedA", 5, "A", False),
    ("L23-B2", 23, None, False),
]


def _cu_seqlens(packing, L, NP):
    """[N + 1] global offsets. "A": a cut inside piece 0, one exactly at its end (with an empty
    sequence there), then one sequence across pieces 1 .. NP - 1 (3+ pieces when NP >= 4) that
    ends inside the last piece. "B": a sequence from token 1 to token T - 1, across every piece
    boundary."""
    T = L * NP
    if packing is None:
        return None
    cu = [0, L // 2, L, L, (NP - 1) * L + L // 2, T] if packing == "A" else [0, 1, T - 1, T]
    return torch.tensor(cu)


def _op_inputs(variant, L, packing, with_state, NP, seed):
    """Global fp64 inputs of one op case, the same in every process for the same arguments."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    T = L * NP
    cu = _cu_seqlens(packing, L, NP)
    B = 2 if cu is None else 1
    N = B if cu is None else cu.numel() - 1
    x = {
        "q": randn(B, T, H, K),
        "k": F.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, H, V),
        "g": -F.softplus(randn(B, T, H)) / 16,  # slow decay: states carry across whole pieces
    }
    if variant == "gated_delta_rule":
        x["beta"] = randn(B, T, H).sigmoid()
    if with_state:
        x["initial_state"] = randn(N, H, K, V)
    do = randn(B, T, H, V)
    dF = [randn(N, H, K, V) for _ in range(WORLD)]  # [rank] final-state cotangents
    return x, do, dF, cu


def _run_op(fn, x, cu, **kwargs):
    """o and final state; the inputs are fresh leaves."""
    x = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    tensors = [x[n] for n in ("q", "k", "v", "g", "beta") if n in x]
    o, final = fn(
        *tensors, initial_state=x.get("initial_state"), output_final_state="initial_state" in x,
        cu_seqlens=cu, chunk_size=CHUNK, **kwargs,
    )
    return x, o, final


def _op_case_on_rank(layout, variant, case, seed):
    """This rank's output, final state and local gradients (rank loss as the module docstring)."""
    _, L, packing, with_state = case
    x, do, dF, cu = _op_inputs(variant, L, packing, with_state, layout.num_pieces, seed)
    local = {n: t if n == "initial_state" else layout.shard(t, dim=1) for n, t in x.items()}
    local, o, final = _run_op(OPS[variant][1], local, cu, layout=layout)
    loss = (o * layout.shard(do, dim=1)).sum()
    if final is not None:
        loss = loss + (final * dF[layout.rank]).sum()
    names = list(local)
    grads = torch.autograd.grad(loss, [local[n] for n in names])
    return {"o": o.detach(), "final": final, **{f"d{n}": g for n, g in zip(names, grads)}}


def _op_worker(rank, world):
    """CP=4 over all ranks (both layouts), CP=2 on pairs {0, 1} (contiguous) and {2, 3}
    (zigzag); and the all-gather shapes for T and 2T."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank makes both
    results = {}
    runs = [(WORLD, kind, dist.group.WORLD, rank) for kind in KINDS]
    runs.append((2, KINDS[rank // 2], pairs[rank // 2], rank % 2))
    for P, kind, group, cp_rank in runs:
        for variant in OPS:
            for i, case in enumerate(OP_CASES):
                T = case[1] * P * (2 if kind == "zigzag" else 1)
                layout = CPLayout(T, P, cp_rank, kind, group)
                results[(P, kind, variant, case[0])] = _op_case_on_rank(layout, variant, case, seed=i)
    results["gathered"] = _record_gathers(lambda: _comm_op_runs(rank, world))
    return results


def _record_gathers(fn):
    """The shapes passed to cp_linear_attention's all_gather while fn runs."""
    shapes, plain = [], cpla.all_gather

    def recording(x, group):
        shapes.append(tuple(x.shape))
        return plain(x, group)

    cpla.all_gather = recording
    try:
        fn()
    finally:
        cpla.all_gather = plain
    return shapes


def _comm_op_runs(rank, world):
    """Both ops without then with the final state, at T and 2T, on one packed and one unpacked case."""
    for T in (64, 128):
        layout = CPLayout(T, world, rank, "zigzag", dist.group.WORLD)
        for variant in OPS:
            for packing, with_state in ((None, False), ("A", True)):
                case = ("comm", T // layout.num_pieces, packing, with_state)
                _op_case_on_rank(layout, variant, case, seed=0)


def _check_op_results(results, P, kind, ranks):
    for variant in OPS:
        for i, (name, L, packing, with_state) in enumerate(OP_CASES):
            label = f"CP{P}-{kind}-{variant}-{name}"
            NP = P * (2 if kind == "zigzag" else 1)
            x, do, dF, cu = _op_inputs(variant, L, packing, with_state, NP, seed=i)
            x, o, final = _run_op(OPS[variant][0], x, cu)
            loss = (o * do).sum()
            if final is not None:
                loss = loss + (final * sum(dF[r] for r in range(P))).sum()
            want = {"o": o.detach()}
            want.update(zip([f"d{n}" for n in x], torch.autograd.grad(loss, list(x.values()))))
            got = [results[r][(P, kind, variant, name)] for r in ranks]
            assert got[0].keys() == want.keys() | {"final"}, label
            for cp_rank, res in enumerate(got):  # the same final state on every rank
                if final is None:
                    assert res["final"] is None, label
                else:
                    torch.testing.assert_close(
                        res["final"], final.detach(), atol=1e-10, rtol=1e-10,
                        msg=lambda m: f"{label} final on CP rank {cp_rank}: {m}",  # noqa: B023
                    )
            for key, ref in want.items():
                if key == "dinitial_state":  # replicated: the rank gradients add up
                    actual = sum(res[key] for res in got)
                else:  # local rows, placed at their global positions
                    actual = torch.full_like(ref, float("nan"))
                    for cp_rank, res in enumerate(got):
                        actual[:, CPLayout(L * NP, P, cp_rank, kind).positions()] = res[key]
                torch.testing.assert_close(
                    actual, ref, atol=1e-10, rtol=1e-10, msg=lambda m: f"{label} {key}: {m}"  # noqa: B023
                )


@pytest.mark.distributed
def test_cp_ops_match_single_process_and_communication_is_independent_of_T():
    results = spawn(_op_worker, WORLD)
    for kind in KINDS:
        _check_op_results(results, WORLD, kind, range(WORLD))
    _check_op_results(results, 2, "contiguous", [0, 1])
    _check_op_results(results, 2, "zigzag", [2, 3])
    # One gather per call, at T and at 2T in the same order: [2 pieces x B + N, H, K, V + K].
    shapes = results[0]["gathered"]
    assert shapes[:4] == [(2 * 2, H, K, V + K), (2 + 5, H, K, V + K)] * 2
    assert shapes[4:] == shapes[:4]


@pytest.mark.parametrize("variant", list(OPS))
def test_cp_size_one_is_the_plain_op_bit_for_bit(variant):
    x, _, _, cu = _op_inputs(variant, 23, "A", True, NP=2, seed=3)  # T = 46
    plain, cp = OPS[variant]
    _, o, final = _run_op(plain, x, cu)
    _, o_cp, final_cp = _run_op(cp, x, cu, layout=CPLayout(46))
    assert torch.equal(o, o_cp) and torch.equal(final, final_cp)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (dict(Tl=5), r"^q: expected this rank's 8 local tokens.*layout\.shard"),
        (dict(B=2, cu=True), r"^cu_seqlens: packed sequences need B == 1"),
        (dict(N=3), r"^initial_state: expected \[N, H, K, V\] = \[1, 2, 8, 6\]"),
    ],
    ids=["q-local-length", "cu_seqlens-batch", "initial_state-shape"],
)
def test_cp_bad_input_raises_value_error_naming_argument(shapes, match):
    layout = CPLayout(16, 2, 0, "contiguous")  # checked before any communication
    B, Tl = shapes.get("B", 1), shapes.get("Tl", 8)
    q = torch.randn(B, Tl, H, K)
    with pytest.raises(ValueError, match=match):
        cp_simple_gla(
            q, q, torch.randn(B, Tl, H, V), torch.zeros(B, Tl, H), layout=layout,
            initial_state=torch.zeros(shapes.get("N", B), H, K, V),
            cu_seqlens=torch.tensor([0, 16]) if shapes.get("cu") else None,
        )


HIDDEN = 32
# (id, piece length L, packing, micro-batch b): L = 2 is shorter than the conv halo (W - 1 = 3)
LAYER_CASES = [("L7-b2", 7, None, 2), ("L7-packedA", 7, "A", 1), ("L2-packedB", 2, "B", 1)]
LAYER_VARIANTS = [(v, w) for v in OPS for w in (4, 0)]


def _layer_config(variant, conv, kind):
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
        use_cpu_initialization=True, params_dtype=torch.float32,
    )
    cfg.linear_attention = types.SimpleNamespace(
        variant=variant, num_qk_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
        conv_kernel_size=conv, chunk_size=CHUNK, backend="auto",
    )
    cfg.cp_layout = kind
    return cfg


def _make_layer(variant, conv, kind="zigzag", state_dict=None):
    """fp64; every parameter random (seeded) or loaded from state_dict."""
    torch.manual_seed(0)
    layer = LinearAttention(_layer_config(variant, conv, kind), LinearAttentionSubmodules()).double()
    with torch.no_grad():
        if state_dict is not None:
            layer.load_state_dict(state_dict)
        else:
            layer.out_norm.weight.uniform_(0.5, 1.5)
            if variant == "gated_delta_rule":
                layer.dt_bias.normal_()
    return layer


def _layer_inputs(L, packing, b, NP, seed):
    gen = torch.Generator().manual_seed(seed)
    T = L * NP
    x = torch.randn(T, b, HIDDEN, generator=gen, dtype=torch.float64)
    do = torch.randn(T, b, HIDDEN, generator=gen, dtype=torch.float64)
    cu = _cu_seqlens(packing, L, NP)
    params = None
    if cu is not None:
        cu = cu.int()
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    return x, do, params


def _layer_grads(layer, x, do, params):
    x = x.detach().clone().requires_grad_()
    out, _ = layer(x, packed_seq_params=params)
    names, weights = zip(*layer.named_parameters())
    grads = torch.autograd.grad((out * do).sum(), (x,) + weights)
    return {"out": out.detach(), "dx": grads[0], **{f"d{n}": g for n, g in zip(names, grads[1:])}}


def _layer_runs(state_dicts, kinds):
    """Every layer case on parallel_state's CP group; the layout kind comes from the config."""
    P, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    results = {}
    for kind in kinds:
        for variant, conv in LAYER_VARIANTS:
            layer = _make_layer(variant, conv, kind, state_dicts[(variant, conv)])
            for i, (name, L, packing, b) in enumerate(LAYER_CASES):
                layout = CPLayout(L * P * (2 if kind == "zigzag" else 1), P, cp_rank, kind)
                x, do, params = _layer_inputs(L, packing, b, layout.num_pieces, seed=i)
                local = _layer_grads(layer, layout.shard(x), layout.shard(do), params)
                results[(P, kind, variant, conv, name)] = local
    return results


def _layer_worker(rank, world, state_dicts):
    """CP=2 (parallel_state's groups {0, 1} contiguous and {2, 3} zigzag), then CP=4 with both
    layouts; the gathers of one layer at T and 2T; a sequence the layout cannot split."""
    init_megatron(rank, world, cp=2)
    assert ps.get_context_parallel_global_ranks() == [2 * (rank // 2), 2 * (rank // 2) + 1]
    results = _layer_runs(state_dicts, [KINDS[rank // 2]])
    init_megatron(rank, world, cp=WORLD)
    results.update(_layer_runs(state_dicts, KINDS))
    layer = _make_layer("gated_delta_rule", 4, "zigzag", state_dicts[("gated_delta_rule", 4)])

    def two_lengths():
        for s in (8, 16):  # local tokens: T = 32 and 64
            layer(torch.randn(s, 1, HIDDEN, dtype=torch.float64))

    results["gathered"] = _record_gathers(two_lengths)
    with pytest.raises(ValueError, match="must be a positive multiple of 8.*pad the sequence"):
        layer(torch.randn(3, 1, HIDDEN, dtype=torch.float64))  # T = 12 in 8 zigzag pieces
    return results


@pytest.fixture
def single_process_megatron():
    init_megatron()
    yield
    teardown()


@pytest.mark.distributed
def test_cp_layer_matches_single_process(single_process_megatron):
    layers = {vc: _make_layer(*vc) for vc in LAYER_VARIANTS}
    results = spawn(_layer_worker, WORLD, {vc: layer.state_dict() for vc, layer in layers.items()})
    runs = [(2, "contiguous", [0, 1]), (2, "zigzag", [2, 3])]
    runs += [(WORLD, kind, list(range(WORLD))) for kind in KINDS]
    for P, kind, ranks in runs:
        NP = P * (2 if kind == "zigzag" else 1)
        for (variant, conv), layer in layers.items():
            for i, (name, L, packing, b) in enumerate(LAYER_CASES):
                label = f"CP{P}-{kind}-{variant}-W{conv}-{name}"
                want = _layer_grads(layer, *_layer_inputs(L, packing, b, NP, seed=i))
                got = [results[r][(P, kind, variant, conv, name)] for r in ranks]
                for key, ref in want.items():
                    if key in ("out", "dx"):
                        actual = torch.full_like(ref, float("nan"))
                        for cp_rank, res in enumerate(got):
                            actual[CPLayout(L * NP, P, cp_rank, kind).positions()] = res[key]
                        torch.testing.assert_close(
                            actual, ref, atol=1e-10, rtol=1e-10,
                            msg=lambda m: f"{label} {key}: {m}",  # noqa: B023
                        )
                    else:  # replicated parameters: the rank gradients add up
                        assert_close_to_scale(sum(res[key] for res in got), ref, 1e-10, f"{label} {key}")
    # The conv halo and the state fold, each one gather whose size does not grow with T.
    shapes = results[0]["gathered"]
    assert len(shapes) == 4 and shapes[:2] == shapes[2:]


def _one_gather_worker(rank, world):
    layout = CPLayout(23 * 2 * world, world, rank, "zigzag", dist.group.WORLD)
    return _record_gathers(lambda: _op_case_on_rank(layout, "gated_delta_rule", ("plan", 23, None, False), seed=0))


@pytest.mark.distributed
def test_planner_counts_the_gather_this_op_makes():
    """tools/plan.py's context-parallel buffer for a linear layer (cp_linear_gather_bytes) is
    the all-gather this op makes: here CP=2, B=2, each rank's [2 pieces x B, H, K, V + K]."""
    import importlib.util
    import os

    from megatron_moe_hybrid.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("plan", os.path.join(root, "tools", "plan.py"))
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    shapes = spawn(_one_gather_worker, 2)[0]
    assert shapes == [(2 * 2, H, K, V + K)]
    config = load_config(os.path.join(root, "examples", "configs", "tiny.yaml"),
                         {"parallel.world_size": 2, "parallel.context_parallel_size": 2,
                          "linear_attention.num_qk_heads": H, "linear_attention.num_v_heads": H,
                          "linear_attention.head_k_dim": K, "linear_attention.head_v_dim": V})  # fmt: skip
    cluster = plan.Cluster(accelerators=2, devices_per_node=2, expert_model_parallel_size=1, context_parallel_size=2,
                           micro_batch_size=2, seq_length=23 * 4)  # fmt: skip
    gathered = 2 * 2 * 2 * H * K * (V + K)  # both ranks' rows; fp32 where the op runs in bf16
    assert plan.cp_linear_gather_bytes(config, cluster) == gathered * 4
