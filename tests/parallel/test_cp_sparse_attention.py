"""Sparse attention under context parallelism: the ops with query positions against their full
rows, and the SparseAttention layer at CP=2 and CP=4 over gloo against the single process.

Shape legend: B batch, T global tokens (keys), Tq queries placed at global indices pos [Tq],
P CP ranks, Tl = T / P local tokens, H / G query heads / kv groups, D head dim, DV value head
dim, HI / DI indexer heads / head dim, K top-k, s tokens, b batch, h hidden (layer boundary).
Everything is float64 so that the CP path can be compared within fp64 rounding. The layer
test follows the trainer: each CP rank's loss is P x its share of the global loss and the
parameter gradients are averaged over the CP ranks.
"""

import math
import types

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_moe_hybrid.layers.sparse_attention import SparseAttention, SparseAttentionSubmodules
from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.sparse_attention import reference
from megatron_moe_hybrid.parallel.context_parallel import CPLayout, local_layout
from megatron_moe_hybrid.parallel.cp_sparse_attention import cp_sparse_attention_core
from megatron_moe_hybrid.testing import (
    assert_close_to_scale,
    causal_attention_backend,
    init_megatron,
    spawn,
    teardown,
)

F64 = dict(dtype=torch.float64)
TOL = dict(rtol=1e-9, atol=1e-10)
H, G, D, HIDDEN = 4, 2, 16, 64


def _assert_close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _leaf(*shape):
    return torch.randn(*shape, **F64).requires_grad_()


def _masked_probe_grads(out, probe, leaves):
    """Gradients of sum(out * probe) over out's finite entries (-inf marks unreadable keys)."""
    loss = (torch.where(out.isfinite(), out, 0.0) * probe).sum()
    return torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True)


def _assert_rows(full, sub, pos, leaves):
    """sub (queries at pos only) equals full's rows pos: forward and every gradient."""
    rows = full[:, pos]
    assert torch.equal(sub.isinf(), rows.isinf())
    torch.testing.assert_close(sub, rows, **TOL)
    probe = torch.randn(rows.shape, **F64)
    for a, b in zip(
        _masked_probe_grads(sub, probe, leaves), _masked_probe_grads(rows, probe, leaves)
    ):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, **TOL)


def _positions(spec, T):
    """[Tq] global query indices: one zigzag / contiguous rank's, or a random unsorted subset."""
    kind, rank, size = spec
    if kind == "random":
        return torch.randperm(T)[: T // 2 + 1]
    return CPLayout(T, size, rank, kind).positions()


OP_CASES = [
    pytest.param(1, 20, [0, 3, 10, 10, 15, 20], ("zigzag", 1, 2), id="B1-T20-packed-zigzag-r1of2"),
    pytest.param(2, 24, None, ("zigzag", 0, 4), id="B2-T24-zigzag-r0of4"),
    pytest.param(1, 24, [0, 5, 6, 13, 24], ("contiguous", 2, 4), id="B1-T24-packed-contig-r2of4"),
    pytest.param(1, 23, [0, 7, 7, 16, 23], ("random", None, None), id="B1-T23-packed-random"),
    pytest.param(2, 17, None, ("random", None, None), id="B2-T17-random"),
]


@pytest.mark.parametrize("B, T, cu, spec", OP_CASES)
def test_indexer_ops_with_q_positions_equal_full_rows(B, T, cu, spec):
    torch.manual_seed(20)
    HI, DI, K = 3, 8, 5
    pos = _positions(spec, T)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    q_idx, k_idx, w = _leaf(B, T, HI, DI), _leaf(B, T, DI), _leaf(B, T, HI)
    leaves = (q_idx, k_idx, w)
    for causal in (True, False):
        full = sa.lightning_indexer(q_idx, k_idx, w, causal, cu_seqlens)  # [B, T, T]
        sub = sa.lightning_indexer(
            q_idx[:, pos], k_idx, w[:, pos], causal, cu_seqlens, q_positions=pos
        )  # [B, Tq, T]
        _assert_rows(full, sub, pos, leaves)

        # Blocks of 3 queries, unsorted positions: the selection is the full one's rows.
        indices = sa.indexer_topk(
            q_idx[:, pos], k_idx, w[:, pos], K, 3, causal, cu_seqlens, q_positions=pos
        )  # [B, Tq, K]
        full_indices = sa.topk_indices(full, K)
        assert torch.equal(indices, full_indices[:, pos])
        assert torch.equal(
            indices, sa.indexer_topk(q_idx, k_idx, w, K, 4, causal, cu_seqlens)[:, pos]
        )

        _assert_rows(
            sa.lightning_indexer_sparse(q_idx, k_idx, w, full_indices),
            sa.lightning_indexer_sparse(q_idx[:, pos], k_idx, w[:, pos], indices),
            pos,
            leaves,
        )


@pytest.mark.parametrize("B, T, cu, spec", OP_CASES)
def test_attention_ops_with_q_positions_equal_full_rows(B, T, cu, spec):
    torch.manual_seed(21)
    Hq, Gq, Dq, DV, K = 4, 2, 8, 6, 4
    pos = _positions(spec, T)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    q, k, v = _leaf(B, T, Hq, Dq), _leaf(B, T, Gq, Dq), _leaf(B, T, Gq, DV)
    for full, sub in zip(
        sa.dense_attention(q, k, v, cu_seqlens=cu_seqlens, scale=0.4),
        sa.dense_attention(q[:, pos], k, v, cu_seqlens=cu_seqlens, scale=0.4, q_positions=pos),
    ):  # o [B, Tq, H, DV], lse [B, Tq, H]
        _assert_rows(full, sub, pos, (q, k, v))

    indices = sa.indexer_topk(
        torch.randn(B, T, 2, 4, **F64),
        torch.randn(B, T, 4, **F64),
        torch.randn(B, T, 2, **F64),
        K,
        cu_seqlens=cu_seqlens,
    )  # [B, T, K]
    for full, sub in zip(
        sa.sparse_attention(q, k, v, indices), sa.sparse_attention(q[:, pos], k, v, indices[:, pos])
    ):
        _assert_rows(full, sub, pos, (q, k, v))
    full, sub = (
        sa.dense_masked_attention(q, k, v, indices)[0],
        sa.dense_masked_attention(q[:, pos], k, v, indices[:, pos])[0],
    )
    _assert_rows(full, sub, pos, (q, k, v))

    # The KL target is detached: forward only.
    dense_target = sa.attention_probs_target(q, k, scale=0.4, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(
        sa.attention_probs_target(q[:, pos], k, scale=0.4, cu_seqlens=cu_seqlens, q_positions=pos),
        dense_target[:, pos],
        **TOL,
    )
    torch.testing.assert_close(
        sa.attention_probs_target(q[:, pos], k, indices[:, pos]),
        sa.attention_probs_target(q, k, indices)[:, pos],
        **TOL,
    )


@pytest.mark.parametrize(
    "P, kind",
    [(2, "zigzag"), (4, "contiguous"), (3, "zigzag")],
    ids=["P2-zigzag", "P4-contig", "P3-zigzag"],
)
def test_kl_loss_shares_sum_to_the_full_loss(P, kind):
    """The CP convention: each rank's mean times its share of valid queries sums to the full mean."""
    torch.manual_seed(22)
    T, K = 6 * P, 5
    q_idx, k_idx, w = _leaf(1, T, 2, 8), _leaf(1, T, 8), _leaf(1, T, 2)
    q, k = torch.randn(1, T, 4, 8, **F64), torch.randn(1, T, 2, 8, **F64)
    cu = torch.tensor([0, 5, 5, T - 3, T])
    for sparse in (False, True):
        indices = sa.indexer_topk(q_idx, k_idx, w, K, cu_seqlens=cu) if sparse else None
        if sparse:
            indices[0, 2] = -1  # a query with no key counts in no mean
        full = sa.indexer_kl_loss(
            sa.lightning_indexer_sparse(q_idx, k_idx, w, indices)
            if sparse
            else sa.lightning_indexer(q_idx, k_idx, w, cu_seqlens=cu),
            sa.attention_probs_target(q, k, indices, cu_seqlens=cu),
            indices,
        )
        shares, counts = [], []
        for r in range(P):
            pos = CPLayout(T, P, r, kind).positions()
            sel = None if indices is None else indices[:, pos]
            scores = (
                sa.lightning_indexer_sparse(q_idx[:, pos], k_idx, w[:, pos], sel)
                if sparse
                else sa.lightning_indexer(
                    q_idx[:, pos], k_idx, w[:, pos], cu_seqlens=cu, q_positions=pos
                )
            )
            target = sa.attention_probs_target(q[:, pos], k, sel, cu_seqlens=cu, q_positions=pos)
            shares.append(sa.indexer_kl_loss(scores, target, sel))
            counts.append(int(sa.indexer_kl_valid_queries(scores, target, sel).sum()))
        assert sum(counts) == T - (1 if sparse else 0)
        total = sum(loss * n / sum(counts) for loss, n in zip(shares, counts))
        torch.testing.assert_close(total, full, **TOL)
        for a, b in zip(
            torch.autograd.grad(total, (q_idx, k_idx, w)),
            torch.autograd.grad(full, (q_idx, k_idx, w)),
        ):
            torch.testing.assert_close(a, b, **TOL)


def _bad_calls():
    q_idx, k_idx, w = torch.randn(1, 3, 2, 8), torch.randn(1, 8, 8), torch.randn(1, 3, 2)
    q, k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 8, 1, 4), torch.randn(1, 8, 1, 4)
    layout = CPLayout(8, 2, 0, "contiguous")  # Tl = 4; the checks run before any collective
    ql, kl, vl = torch.randn(1, 4, 2, 4), torch.randn(1, 4, 1, 4), torch.randn(1, 4, 1, 4)
    qil, kil, wl = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 2)

    def core(**changed):
        args = dict(q=ql, k=kl, v=vl, q_idx=qil, k_idx=kil, weights=wl, layout=layout, topk=2)
        return cp_sparse_attention_core(**{**args, **changed})

    return [
        ("pass q_positions", lambda: sa.lightning_indexer(q_idx, k_idx, w)),
        ("pass q_positions", lambda: sa.indexer_topk(q_idx, k_idx, w, 2)),
        ("pass q_positions", lambda: sa.dense_attention(q, k, v)),
        (
            "q_positions must be a 1-D integer",
            lambda: sa.lightning_indexer(q_idx, k_idx, w, q_positions=torch.zeros(3)),
        ),
        (
            "q_positions must be a 1-D integer",
            lambda: sa.indexer_topk(q_idx, k_idx, w, 2, q_positions=torch.arange(4)),
        ),
        (
            "q_positions must lie in",
            lambda: sa.attention_probs_target(q, k, q_positions=torch.tensor([0, 8, 1])),
        ),
        (
            "q_positions must be a Tensor",
            lambda: sa.dense_attention(q, k, v, q_positions=[0, 1, 2]),
        ),
        ("indices must lie in", lambda: sa.sparse_attention(q, k, v, torch.full((1, 3, 2), 8))),
        (
            "k must be",
            lambda: sa.sparse_attention(
                q, k[:, :, :, :3], v, torch.zeros(1, 3, 1, dtype=torch.int64)
            ),
        ),
        ("q must be", lambda: core(q=q)),
        ("k_idx must be", lambda: core(k_idx=k_idx)),
        ("weights must be", lambda: core(weights=wl[0])),
        ("stage must be one of", lambda: core(stage="dense")),
        (
            "cu_seqlens must start at 0, end at the token count 8",
            lambda: core(cu_seqlens=torch.tensor([0, 4])),
        ),
        ("layout must be a CPLayout", lambda: core(layout=None)),
    ]


@pytest.mark.parametrize(
    "case",
    range(len(_bad_calls())),
    ids=[f"{i}-" + c[0].replace(" ", "-") for i, c in enumerate(_bad_calls())],
)
def test_bad_input_raises_value_error_naming_the_argument(case):
    match, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=match):
        call()


def make_config(cp_layout, **sparse):
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=H,
        num_query_groups=G,
        kv_channels=D,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    fields = dict(
        topk=8,
        index_n_heads=4,
        index_head_dim=16,
        index_rope_dim=8,
        rope_base=10000.0,
        indexer_loss_coeff=0.05,
        stage="sparse",
        backend="auto",
        indexer_fp8=False,
    )
    fields.update(sparse)
    cfg.sparse_attention = types.SimpleNamespace(**fields)
    cfg.cp_layout = cp_layout  # HybridMoEConfig's property; the layer reads it with getattr
    return cfg


def make_layer(state, cp_layout="zigzag", **sparse):
    layer = SparseAttention(make_config(cp_layout, **sparse), SparseAttentionSubmodules()).double()
    layer.load_state_dict(state)
    return layer


def _packed(cu):
    if cu is None:
        return None
    cu = torch.tensor(cu, dtype=torch.int32)
    longest = int(cu.diff().max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def run_layer(layer, x, grad_out, cu):
    """Output, input grad and every parameter grad (by name) for the loss sum(out * grad_out)."""
    x = x.detach().clone().requires_grad_()
    out, bias = layer(x, packed_seq_params=_packed(cu))
    assert bias is None
    names, params = zip(*layer.named_parameters())
    grads = torch.autograd.grad(out, (x, *params), grad_out, allow_unused=True)
    return out.detach(), grads[0], dict(zip(names, grads[1:])), layer.last_indexer_loss


def _cp_cases(P):
    """Both layouts x (sparse with topk below / above the visible keys, dense) x (packed, not).

    Packed offsets cut pieces inside and on their boundaries (zigzag pieces are T / 2P long,
    contiguous ones T / P), with an empty sequence; unpacked cases use b = 2.
    """
    T, cu = {2: (20, [0, 3, 10, 10, 15, 20]), 4: (24, [0, 5, 6, 6, 13, 24])}[P]
    cases = []
    for kind in ("contiguous", "zigzag"):
        for stage, topk in (("sparse", 3), ("sparse", T + 5), ("dense_warmup", 4)):
            for packed in (True, False):
                name = f"P{P}-{kind}-{stage}-K{topk}-" + ("packed" if packed else "b2")
                cases.append(
                    dict(
                        name=name,
                        kind=kind,
                        stage=stage,
                        topk=topk,
                        T=T,
                        b=1 if packed else 2,
                        cu=cu if packed else None,
                    )
                )
    # the top-k by fp8 index scores (sparse_attention.indexer_fp8): each key row is quantized
    # alone, so the gathered keys' rows are the CP == 1 rows
    cases.append(dict(name=f"P{P}-zigzag-sparse-K3-fp8-b2", kind="zigzag", stage="sparse", topk=3, T=T, b=2,
                      cu=None, fp8=True))
    return cases


def _memory_check(rank, P):
    """The sparse core's indexer scores [B, block, HI, T] blocks of at most block_size queries."""
    layout = CPLayout.from_parallel_state(seq_len=12 * P, kind="zigzag")
    Tl, T, block = layout.local_len, layout.seq_len, 5
    torch.manual_seed(30 + rank)
    q, k, v = (
        torch.randn(1, Tl, 4, 8, **F64),
        torch.randn(1, Tl, 2, 8, **F64),
        torch.randn(1, Tl, 2, 8, **F64),
    )
    q_idx, k_idx, w = (
        torch.randn(1, Tl, 2, 8, **F64),
        torch.randn(1, Tl, 8, **F64),
        torch.randn(1, Tl, 2, **F64),
    )
    blocks = []
    index_scores = reference._index_scores

    def recording(q_blk, k_all, w_blk, k_scale=None):
        scores = index_scores(q_blk, k_all, w_blk, k_scale)
        blocks.append(tuple(scores.shape))
        return scores

    reference._index_scores = recording
    try:
        o_small, loss_small = cp_sparse_attention_core(
            q, k, v, q_idx, k_idx, w, layout=layout, topk=4, indexer_loss=True, block_size=block
        )
    finally:
        reference._index_scores = index_scores
    o_big, loss_big = cp_sparse_attention_core(
        q, k, v, q_idx, k_idx, w, layout=layout, topk=4, indexer_loss=True
    )
    torch.testing.assert_close(o_small, o_big, rtol=0, atol=0)
    torch.testing.assert_close(loss_small, loss_big, rtol=0, atol=0)
    assert len(blocks) == math.ceil(Tl / block)
    assert all(rows <= block and keys == T for _, rows, keys in blocks), blocks


def _cp_worker(rank, world, cases_by_cp, state, inputs_by_cp):
    """One 4-process spawn for both sizes (process start-up dominates): CP=4, then CP=2 as two
    independent CP groups {0, 1} and {2, 3} (data parallel 2)."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    results = {}
    for P, cases in cases_by_cp.items():
        init_megatron(rank, world, cp=P)
        assert ps.get_context_parallel_world_size() == P
        _memory_check(rank, P)
        results[P] = []
        for case, (x, grad_out) in zip(cases, inputs_by_cp[P]):
            layer = make_layer(state, case["kind"], stage=case["stage"], topk=case["topk"],
                               indexer_fp8=case.get("fp8", False))
            layout = CPLayout.from_parallel_state(case["T"], case["kind"])
            assert local_layout(layout.local_len, layer.config.cp_layout) == layout
            # The trainer's convention: each rank's loss is P x its share of the global loss
            # (the mean over its own tokens) and the gradients are averaged over the CP ranks.
            out, x_grad, grads, loss = run_layer(
                layer, layout.shard(x), P * layout.shard(grad_out), case["cu"]
            )
            if case["stage"] == "dense_warmup":  # the form CUDA runs (SDPA per piece) gives the same
                with causal_attention_backend("sdpa"):
                    fused = run_layer(layer, layout.shard(x), P * layout.shard(grad_out), case["cu"])
                for a, b in zip((out, x_grad, *grads.values()), (fused[0], fused[1], *fused[2].values())):
                    if a is not None:
                        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
                # and so does the fused indexer KL loss CUDA runs (triton_dense_kl, here in the
                # interpreter; it accumulates in fp32) over this rank's queries of all the keys
                triton_layer = make_layer(state, case["kind"], stage=case["stage"], topk=case["topk"], backend="triton")
                fused = run_layer(triton_layer, layout.shard(x), P * layout.shard(grad_out), case["cu"])
                # (the loss is about 1e-4 and the indexer's gradients 1e-5 here: absolute floors far below)
                torch.testing.assert_close(fused[3], loss, rtol=1e-5, atol=1e-10)
                for a, b in zip((out, x_grad, *grads.values()), (fused[0], fused[1], *fused[2].values())):
                    if a is not None:
                        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-9)
            for grad in grads.values():
                dist.all_reduce(grad, group=ps.get_context_parallel_group())
                grad /= P
            # x_local's gradient sums every rank's P-scaled loss (through the gathers).
            x_grad /= P
            results[P].append(
                dict(positions=layout.positions(), out=out, x_grad=x_grad, grads=grads, loss=loss)
            )
    return results


@pytest.fixture(scope="module")
def megatron():
    init_megatron()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    yield
    teardown()


@pytest.mark.distributed
def test_cp_layer_equals_single_process(megatron):
    """Output, input grad, every parameter grad (indexer ones through the KL loss) and the
    logged indexer loss of SparseAttention at CP=2 and CP=4 equal the single-process layer's."""
    torch.manual_seed(40)
    state = (
        SparseAttention(make_config("zigzag"), SparseAttentionSubmodules()).double().state_dict()
    )
    cases = {P: _cp_cases(P) for P in (4, 2)}
    inputs = {
        P: [
            (torch.randn(c["T"], c["b"], HIDDEN, **F64), torch.randn(c["T"], c["b"], HIDDEN, **F64))
            for c in cs
        ]
        for P, cs in cases.items()
    }
    expected = {P: [] for P in cases}
    for P in cases:
        for case, (x, grad_out) in zip(cases[P], inputs[P]):
            layer = make_layer(state, case["kind"], stage=case["stage"], topk=case["topk"],
                               indexer_fp8=case.get("fp8", False))
            assert local_layout(case["T"], layer.config.cp_layout) is None  # CP == 1: the old path
            expected[P].append(run_layer(layer, x, grad_out, case["cu"]))
            if case.get("fp8"):  # the case selects other keys than full precision does (it can fail)
                plain = make_layer(state, case["kind"], stage=case["stage"], topk=case["topk"])
                assert not torch.allclose(run_layer(plain, x, grad_out, case["cu"])[0], expected[P][-1][0])

    results = spawn(_cp_worker, 4, cases, state, inputs)
    for P, cases_p in cases.items():
        for i, case in enumerate(cases_p):
            out, x_grad, grads, loss = expected[P][i]
            assert loss is not None and all(g is not None for g in grads.values()), case["name"]
            for rank in range(4):
                got = results[rank][P][i]
                pos, name = got["positions"], f"{case['name']} rank {rank}"
                _assert_close(got["out"], out[pos], f"{name} out")
                _assert_close(got["x_grad"], x_grad[pos], f"{name} x grad")
                _assert_close(got["loss"], loss, f"{name} indexer loss")
                for key, grad in grads.items():
                    assert_close_to_scale(got["grads"][key], grad, 1e-10, f"{name} grad {key}")


def _saved_shapes_worker(rank, world, T, topk, stages):
    """{stage: the shapes autograd keeps from one CP forward (with the indexer loss)} (one group
    for every stage: a spawn costs more than the forwards)."""
    return {stage: _saved_shapes(rank, world, T, topk, stage) for stage in stages}


def _saved_shapes(rank, world, T, topk, stage):
    torch.manual_seed(rank)
    layout = CPLayout(T, world, rank, "zigzag", dist.group.WORLD)
    Tl, H, G, D, HI, DI = layout.local_len, 4, 1, 8, 2, 8
    q, k, v = (torch.randn(1, Tl, n, D, requires_grad=True) for n in (H, G, G))
    q_idx = torch.randn(1, Tl, HI, DI, requires_grad=True)
    k_idx = torch.randn(1, Tl, DI, requires_grad=True)
    weights = torch.randn(1, Tl, HI, requires_grad=True)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, loss = cp_sparse_attention_core(
            q, k, v, q_idx, k_idx, weights, layout=layout, topk=topk, indexer_loss=True, stage=stage
        )
    (o.sum() + loss).backward()  # the backward (and its reduce-scatter) runs on every rank
    return shapes


def test_sparse_stage_saves_only_local_rows():
    """The gathered [B, T, ...] keys are transient: what autograd keeps for the backward is
    O(local tokens x top-k), so memory per rank stays linear in the local length."""
    T, topk = 96, 5
    results = spawn(_saved_shapes_worker, 2, T, topk, ["sparse", "dense_warmup"])
    for shapes in (r["sparse"] for r in results):
        assert shapes
        for shape in shapes:
            assert T not in shape, shape  # B = G = 1: any global-length tensor has a dim of T
    # the check sees a gathered tensor when one is kept: the dense warm-up keeps the keys
    assert all(any(T in shape for shape in r["dense_warmup"]) for r in results)
