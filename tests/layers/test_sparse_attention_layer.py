"""SparseAttention layer: the Megatron module against plain formulations of the same math.

Shape legend: s tokens, b batch, h hidden (Megatron's [s, b, h]); H query heads, G kv
groups, D head dim. Layers are built in fp32 (as Megatron does) and cast to fp64 so that
outputs and every gradient can be compared tightly.
"""

import types

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_moe_hybrid.layers.sparse_attention import SparseAttention, SparseAttentionSubmodules
from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.testing import init_megatron, teardown

TOL = dict(rtol=1e-9, atol=1e-10)
H, G, D, HIDDEN = 4, 2, 16, 64


@pytest.fixture(scope="module", autouse=True)
def megatron():
    init_megatron()
    # The schedule sets this scale during training; a unit scale makes grads directly comparable.
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    yield
    teardown()


def make_config(**sparse):
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
        indexer_loss_coeff=0.01,
        stage="sparse",
        backend="auto",
        indexer_fp8=False,
    )
    fields.update(sparse)
    cfg.sparse_attention = types.SimpleNamespace(**fields)
    return cfg


def make_layer(seed=0, **sparse):
    torch.manual_seed(seed)
    return SparseAttention(make_config(**sparse), SparseAttentionSubmodules()).double()


def clone_with(layer, **sparse):
    """Same weights, different sparse_attention settings."""
    other = make_layer(**sparse)
    other.load_state_dict(layer.state_dict())
    return other


def run(layer, x, grad_out, packed_seq_params=None):
    """Output and gradients (input first, then every parameter by name) for a given output grad."""
    x = x.detach().clone().requires_grad_()
    out, bias = layer(x, packed_seq_params=packed_seq_params)
    assert bias is None
    names, params = zip(*layer.named_parameters())
    grads = torch.autograd.grad(out, (x, *params), grad_out, allow_unused=True)
    return out.detach(), dict(zip(("input", *names), grads))


def assert_grads_close(ga, gb, names=None):
    for name in names or ga:
        a, b = ga[name], gb[name]
        if a is None or b is None:
            assert a is None and b is None, name
        else:
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


def plain_dense_forward(layer, x):
    """The dense causal layer written out with torch SDPA, independent of the ops package."""
    s, b, _ = x.shape
    R = H // G
    w_qkv = layer.linear_qkv.weight  # [G * (R + 2) * D, h]: per group R query heads, then k, v
    mixed = (x @ w_qkv.T).view(s, b, G, (R + 2) * D)
    q, k, v = mixed.split([R * D, D, D], dim=-1)
    q = q.reshape(s, b, H, D)
    pos = torch.arange(s)
    q, k = (sa.apply_rope(t.transpose(0, 1), pos, D) for t in (q, k))  # [B, T, *, D]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(R, dim=2).transpose(1, 2),
        v.transpose(0, 1).repeat_interleave(R, dim=2).transpose(1, 2),
        is_causal=True,
    )  # [B, H, T, D]
    o = o.permute(2, 0, 1, 3).reshape(s, b, H * D)
    return o @ layer.linear_proj.weight.T


@pytest.mark.parametrize("s, b", [(17, 2), (8, 1), (1, 3)], ids=["T17-B2", "T8-B1", "T1-B3"])
def test_dense_warmup_matches_plain_sdpa(s, b):
    layer = make_layer(stage="dense_warmup")
    x = torch.randn(s, b, HIDDEN, dtype=torch.float64, requires_grad=True)
    out, _ = layer(x)
    expected = plain_dense_forward(layer, x)
    torch.testing.assert_close(out, expected, **TOL)

    grad_out = torch.randn_like(out)
    params = [layer.linear_qkv.weight, layer.linear_proj.weight]
    got = torch.autograd.grad(out, [x, *params], grad_out, retain_graph=True)
    want = torch.autograd.grad(expected, [x, *params], grad_out)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, **TOL)


@pytest.mark.parametrize(
    "s, b, topk", [(17, 2, 17), (9, 1, 64), (5, 2, 5)], ids=["T17-B2-K17", "T9-B1-K64", "T5-B2-K5"]
)
def test_sparse_with_topk_at_least_T_equals_dense(s, b, topk):
    sparse = make_layer(topk=topk)
    dense = clone_with(sparse, stage="dense_warmup", topk=topk)
    x = torch.randn(s, b, HIDDEN, dtype=torch.float64)
    grad_out = torch.randn(s, b, HIDDEN, dtype=torch.float64)
    out_s, grads_s = run(sparse, x, grad_out)
    out_d, grads_d = run(dense, x, grad_out)
    torch.testing.assert_close(out_s, out_d, **TOL)
    # Every readable key is selected, so the sparse KL equals the dense one: all grads agree.
    assert_grads_close(grads_s, grads_d)
    torch.testing.assert_close(sparse.last_indexer_loss, dense.last_indexer_loss, **TOL)


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_forward_backward_shapes_and_every_parameter_learns(stage):
    layer = make_layer(stage=stage, topk=4)
    x = torch.randn(23, 2, HIDDEN, dtype=torch.float64)
    out, grads = run(layer, x, torch.randn(23, 2, HIDDEN, dtype=torch.float64))
    assert out.shape == (23, 2, HIDDEN) and bool(out.isfinite().all())
    for name, grad in grads.items():
        assert grad is not None and bool(grad.isfinite().all()) and bool(grad.abs().sum() > 0), name
    assert layer.last_indexer_loss is not None and layer.last_indexer_loss.requires_grad is False
    assert float(layer.last_indexer_loss) > 0


@pytest.mark.parametrize(
    "stage, topk",
    [("sparse", 3), ("sparse", 8), ("dense_warmup", 8)],
    ids=["sparse-K3", "sparse-K8", "dense"],
)
def test_causal_no_output_depends_on_later_tokens(stage, topk):
    layer = make_layer(stage=stage, topk=topk)
    x = torch.randn(21, 2, HIDDEN, dtype=torch.float64)
    changed = x.clone()
    changed[13:] = torch.randn(8, 2, HIDDEN, dtype=torch.float64)
    out, _ = layer(x)
    out_changed, _ = layer(changed)
    torch.testing.assert_close(out[:13], out_changed[:13], **TOL)
    assert not torch.allclose(out[13:], out_changed[13:])


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_indexer_loss_trains_only_the_indexer(stage):
    layer = make_layer(stage=stage, topk=5, indexer_loss_coeff=0.01)
    no_loss = clone_with(layer, stage=stage, topk=5, indexer_loss_coeff=0.0)
    double_loss = clone_with(layer, stage=stage, topk=5, indexer_loss_coeff=0.02)
    x = torch.randn(19, 2, HIDDEN, dtype=torch.float64)
    grad_out = torch.randn(19, 2, HIDDEN, dtype=torch.float64)
    out, grads = run(layer, x, grad_out)
    out_0, grads_0 = run(no_loss, x, grad_out)
    out_2, grads_2 = run(double_loss, x, grad_out)

    # The loss leaves the forward output, the input grad and the main weights' grads untouched...
    torch.testing.assert_close(out, out_0, **TOL)
    indexer_ids = {id(p) for p in layer.indexer_parameters()}
    indexer = [n for n, p in layer.named_parameters() if id(p) in indexer_ids]
    main = ["input"] + [n for n, p in layer.named_parameters() if id(p) not in indexer_ids]
    assert_grads_close(grads, grads_0, main)
    assert_grads_close(grads, grads_2, main)
    # ...and is the indexer's only teacher: no loss, no indexer grad; its grad is linear in coeff.
    assert len(indexer) == 5 and no_loss.last_indexer_loss is None
    for name in indexer:
        assert grads_0[name] is None, name
        assert bool(grads[name].abs().sum() > 0), name
        torch.testing.assert_close(2 * grads[name], grads_2[name], **TOL)

    # With a zero output grad only the KL path is left: main weights get exactly nothing.
    _, grads_kl = run(layer, x, torch.zeros_like(grad_out))
    for name in main:
        assert bool((grads_kl[name] == 0).all()), name
    for name in indexer:
        torch.testing.assert_close(grads_kl[name], grads[name], **TOL)


def test_indexer_loss_value_matches_ops():
    layer = make_layer(topk=6)
    x = torch.randn(15, 2, HIDDEN, dtype=torch.float64)
    layer(x)
    pos = torch.arange(15)
    q, k, _ = layer._qkv(x, pos)
    q_idx, k_idx, w = layer._indexer(x, pos)
    indices = sa.topk_indices(sa.lightning_indexer(q_idx, k_idx, w), 6)
    dense_scores = sa.lightning_indexer(q_idx, k_idx, w)
    selected = sa.indices_to_mask(indices, 15)
    # Oracle: the dense-form loss with everything outside the selection masked out.
    target = sa.attention_probs_target(q, k, indices)
    full_target = torch.zeros(2, 15, 16, dtype=torch.float64).scatter(
        -1, torch.where(indices >= 0, indices, 15), target
    )
    expected = sa.indexer_kl_loss(
        dense_scores.masked_fill(~selected, float("-inf")), full_target[..., :15]
    )
    torch.testing.assert_close(layer.last_indexer_loss, expected.detach(), **TOL)


@pytest.mark.parametrize(
    "lengths, stage",
    [([5, 7, 0, 6], "sparse"), ([9, 4], "dense_warmup"), ([1, 11], "sparse")],
    ids=["packed-5-7-0-6-sparse", "packed-9-4-dense", "packed-1-11-sparse"],
)
def test_packed_sequences_equal_separate_runs(lengths, stage):
    layer = make_layer(stage=stage, topk=4)
    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    x = torch.randn(total, 1, HIDDEN, dtype=torch.float64)
    grad_out = torch.randn(total, 1, HIDDEN, dtype=torch.float64)
    out, grads = run(layer, x, grad_out, packed)

    # The packed KL averages over all queries: a sequence's share is its length / total.
    coeff = layer.config.sparse_attention.indexer_loss_coeff
    outs, summed = [], {}
    for start, n in zip(cu[:-1].tolist(), lengths):
        if n == 0:
            continue
        part = clone_with(layer, stage=stage, topk=4, indexer_loss_coeff=coeff * n / total)
        out_n, grads_n = run(part, x[start : start + n], grad_out[start : start + n])
        outs.append(out_n)
        summed["input"] = summed.get("input", []) + [grads_n.pop("input")]
        for name, grad in grads_n.items():
            summed[name] = summed[name] + grad if name in summed else grad
    summed["input"] = torch.cat(summed["input"])
    torch.testing.assert_close(out, torch.cat(outs), **TOL)
    assert_grads_close(grads, summed)


def test_eval_and_no_grad_skip_the_indexer_loss():
    layer = make_layer()
    x = torch.randn(7, 2, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    assert layer.last_indexer_loss is None


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("stage", "warmup", "stage must be one of"),
        ("indexer_loss_coeff", -0.1, "indexer_loss_coeff must be >= 0"),
        ("topk", 0, "topk must be a positive int"),
        ("index_rope_dim", 7, "index_rope_dim must be even"),
        ("indexer_fp8", True, None),  # with index_head_dim 12 below
    ],
    ids=["stage", "coeff", "topk", "rope-dim", "fp8-dim"],
)
def test_bad_config_raises_value_error_naming_the_field(field, value, match):
    if field == "indexer_fp8":
        with pytest.raises(ValueError, match="index_head_dim must be a power of 2 with indexer_fp8"):
            make_layer(indexer_fp8=True, index_head_dim=12)
        return
    with pytest.raises(ValueError, match=match):
        make_layer(**{field: value})


def test_bad_packed_batch_raises():
    layer = make_layer()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed sequences need"):
        layer(
            torch.randn(7, 2, HIDDEN, dtype=torch.float64),
            packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu),
        )


@pytest.mark.parametrize("lengths", [None, [9, 4, 7]], ids=["b2", "packed-9-4-7"])
def test_dense_warmup_fused_indexer_loss_equals_the_reference(lengths):
    """backend "triton" runs the dense warm-up's KL loss fused (what auto runs on CUDA; here in
    Triton's interpreter, fp32 inside): loss and every gradient equal the reference form's."""
    pytest.importorskip("triton")
    from megatron_moe_hybrid.ops.sparse_attention import triton_dense_kl

    if not triton_dense_kl._INTERPRET:
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 (conftest sets it without a GPU)")
    layer = make_layer(stage="dense_warmup", indexer_loss_coeff=0.5)
    with torch.no_grad():  # larger weights: peaked attention and index scores, a KL far from 0
        for p in layer.parameters():
            p.mul_(6.0)
    fused = clone_with(layer, stage="dense_warmup", indexer_loss_coeff=0.5, backend="triton")
    packed = None
    if lengths is not None:
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    b = 2 if lengths is None else 1
    s = 20 if lengths is None else sum(lengths)
    x = torch.randn(s, b, HIDDEN, dtype=torch.float64)
    grad_out = torch.randn(s, b, HIDDEN, dtype=torch.float64)
    out, grads = run(layer, x, grad_out, packed)
    out_f, grads_f = run(fused, x, grad_out, packed)
    torch.testing.assert_close(out_f, out, **TOL)
    loss = layer.last_indexer_loss
    assert loss > 1e-3  # a loss far above the fp32 error the comparison allows
    torch.testing.assert_close(fused.last_indexer_loss, loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        if g is None:
            assert grads_f[name] is None, name
        else:
            torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-6 * g.abs().max().item(),
                                       msg=lambda m: f"{name}: {m}")


def test_indexer_fp8_selects_by_the_fp8_scores(monkeypatch):
    """sparse_attention.indexer_fp8: the layer's top-k is lightning_indexer_topk(fp8=True) of its
    index inputs (rows rotated and quantized, ops tests check the scoring); the selection then
    differs from the full-precision one somewhere, and so does the output, while every
    parameter still gets its gradient (the indexer's through the KL loss)."""
    layer = make_layer(topk=4)
    fp8 = clone_with(layer, topk=4, indexer_fp8=True)
    calls, real = [], sa.lightning_indexer_topk

    def spy(*args, **kwargs):
        calls.append((kwargs["fp8"], real(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(sa, "lightning_indexer_topk", spy)
    x, grad_out = torch.randn(33, 2, HIDDEN, dtype=torch.float64), torch.randn(33, 2, HIDDEN, dtype=torch.float64)
    out, grads = run(layer, x, grad_out)
    out8, grads8 = run(fp8, x, grad_out)
    assert [c[0] for c in calls] == [False, True]
    assert not torch.equal(calls[0][1], calls[1][1]) and not torch.allclose(out, out8)
    assert all(g is not None for g in grads8.values())
