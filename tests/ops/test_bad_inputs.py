"""Bad input to the public ops gets a ValueError naming the argument, never a silent wrong
result, an out-of-bounds read or an obscure error from deep inside (an audit's findings,
2026-12-05). CPU: the Triton paths run in the interpreter (conftest sets TRITON_INTERPRET=1
without a GPU), whose bf16 loads are wrong, which is itself one of the refusals tested."""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from megatron_moe_hybrid.ops import cross_entropy as ce
from megatron_moe_hybrid.ops import linear_attention as la
from megatron_moe_hybrid.ops import moe
from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.linear_attention import triton_chunk
from megatron_moe_hybrid.ops.sparse_attention import reference as sa_ref
from megatron_moe_hybrid.ops.sparse_attention import triton_sparse

interpreter = pytest.mark.skipif(not triton_chunk._INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")


def linear_args(B=1, T=10, H=2, HV=2, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, D, generator=gen)
    g = -torch.rand(B, T, HV, generator=gen) * 0.5
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


# --- linear attention ---


@interpreter
@pytest.mark.parametrize("op", ["chunk_simple_gla", "chunk_gated_delta_rule"])
def test_linear_attention_triton_refuses_bf16_in_the_interpreter(op):
    """The interpreter's bf16 loads are wrong: its outputs were off by 1e9. Refused by name;
    fp16 still runs and matches the reference."""
    q, k, v, g, beta = linear_args()
    args = (q, k, v, g) if op == "chunk_simple_gla" else (q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"^q: .*bf16"):
        getattr(la, op)(*(x.bfloat16() if x.dim() == 4 else x for x in args), backend="triton")
    ref, _ = getattr(la, op)(*args, backend="torch")
    o, _ = getattr(la, op)(*(x.half() if x.dim() == 4 else x for x in args), backend="triton")
    assert (o.float() - ref).abs().max() < 1e-2


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreter), "torch_recurrent"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0, "0.5", True])
def test_linear_attention_scale_must_be_finite_and_positive(backend, scale):
    q, k, v, g, beta = linear_args()
    with pytest.raises(ValueError, match="^scale: "):
        la.gated_delta_rule(q, k, v, g, beta, scale=scale, backend=backend)
    with pytest.raises(ValueError, match="^scale: "):
        la.fused_recurrent_simple_gla(q, k, v, g, scale=scale)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreter)])
def test_linear_attention_options_named(backend):
    q, k, v, g, beta = linear_args()
    with pytest.raises(ValueError, match="^cu_seqlens: .*list"):
        la.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=[0, 10], backend=backend)
    for chunk_size in (0, -1, "64", True):
        with pytest.raises(ValueError, match="^chunk_size: "):
            la.gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, backend=backend)
    with pytest.raises(ValueError, match="^q: .*key dim"):
        la.gated_delta_rule(q[..., :0], k[..., :0], v, g, beta, backend=backend)


@interpreter
@pytest.mark.parametrize("op", ["simple_gla", "gated_delta_rule"])
def test_linear_attention_triton_empty_batch_equals_torch(op):
    """B = 0 gave a ZeroDivisionError (delta rule) and max() of nothing (GLA) on Triton."""
    q, k, v, g, beta = (x.requires_grad_() for x in linear_args(B=0))
    args = (q, k, v, g) if op == "simple_gla" else (q, k, v, g, beta)
    o, s = getattr(la, op)(*args, output_final_state=True, backend="triton")
    o_ref, s_ref = getattr(la, op)(*args, output_final_state=True, backend="torch")
    assert o.shape == o_ref.shape == v.shape and s.shape == s_ref.shape == (0, 2, 8, 8)
    grads = torch.autograd.grad(o.sum() + s.sum(), args, allow_unused=True)
    assert all(gr is None or gr.numel() == 0 for gr in grads)


# --- sparse attention and its indexer ---


def sparse_args(B=1, T=12, S=12, H=4, G=2, D=16, K=4, HI=2, DI=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, h, D, generator=gen) for n, h in ((T, H), (S, G), (S, G)))
    qi, ki, w = torch.randn(B, T, HI, DI, generator=gen), torch.randn(B, S, DI, generator=gen), torch.rand(B, T, HI, generator=gen)
    idx = sa_ref.lightning_indexer_topk(qi, ki, w, K)
    return q, k, v, qi, ki, w, idx


@interpreter
def test_indexer_sparse_triton_checks_the_index_range():
    """It read key rows past S (index scores of 3e10) where the torch backend raises."""
    q, k, v, qi, ki, w, idx = sparse_args()
    for bad in (12 + 3, -5):
        b = idx.clone()
        b[0, 5, 0] = bad
        for backend in ("torch", "triton"):
            with pytest.raises(ValueError, match=r"indices must lie in \[-1, S=12\)"):
                sa.lightning_indexer_sparse(qi, ki, w, b, backend=backend)


@interpreter
def test_indexer_triton_refuses_bf16_and_integer_inputs_in_the_interpreter():
    """bf16 picked wrong keys silently; an integer q_idx failed inside the interpreter."""
    q, k, v, qi, ki, w, idx = sparse_args()
    bf = [x.bfloat16() for x in (qi, ki, w)]
    with pytest.raises(ValueError, match="^q_idx: .*bf16"):
        sa.lightning_indexer_topk(*bf, 4, backend="triton")
    with pytest.raises(ValueError, match="^q_idx: .*bf16"):
        sa.lightning_indexer_sparse(*bf, idx, backend="triton")
    with pytest.raises(ValueError, match="^q_idx must be a floating-point tensor"):
        sa.lightning_indexer_topk(qi.long(), ki.long(), w, 4, backend="triton")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreter)])
def test_sparse_attention_refuses_a_repeated_key_without_a_backward(backend):
    """The Triton forward weighted a repeated key twice where no backward (whose per-key lists
    find it) followed; the torch backend raised."""
    q, k, v, qi, ki, w, idx = sparse_args()
    bad = idx.clone()
    bad[0, 5, 1] = bad[0, 5, 0]
    with pytest.raises(ValueError, match="must not repeat a key"):
        sa.sparse_attention(q, k, v, bad, backend=backend)
    with torch.no_grad(), pytest.raises(ValueError, match="must not repeat a key"):
        sa.sparse_attention(q.requires_grad_(), k, v, bad, backend=backend)
    o, lse = sa.sparse_attention(q, k, v, idx, backend=backend)  # the valid selection still runs
    o_ref, lse_ref = sa_ref.sparse_attention(q, k, v, idx)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)


@interpreter
def test_repeated_key_check_covers_every_chunk_of_rows(monkeypatch):
    """The forward-only check sorts rows in chunks: a repeat in the last chunk is found too."""
    monkeypatch.setattr(triton_sparse, "REPEAT_CHECK_ELEMENTS", 8)  # two rows of 4 slots per sort
    q, k, v, qi, ki, w, idx = sparse_args()
    triton_sparse._check_no_repeats(idx)
    bad = idx.clone()
    bad[0, 11, 3] = bad[0, 11, 2]
    with pytest.raises(ValueError, match="must not repeat a key"):
        triton_sparse._check_no_repeats(bad)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreter)])
def test_sparse_attention_dtypes_and_scale(backend):
    q, k, v, qi, ki, w, idx = sparse_args()
    with pytest.raises(ValueError, match="^q must be a floating-point tensor"):
        sa.sparse_attention((q * 10).long(), k, v, idx, backend=backend)  # torch returned int zeros
    for scale in (float("nan"), float("inf"), 0.0, -0.5, "0.25"):
        with pytest.raises(ValueError, match="^scale must be"):
            sa.sparse_attention(q, k, v, idx, scale=scale, backend=backend)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreter)])
def test_sparse_attention_without_queries_or_keys(backend):
    """T = 0 and S = 0 (every slot -1) failed in the torch reference's reshape and gather."""
    q, k, v, qi, ki, w, idx = sparse_args()
    o, lse = sa.sparse_attention(q[:, :0], k, v, idx[:, :0], backend=backend)
    assert o.shape == (1, 0, 4, 16) and lse.shape == (1, 0, 4)
    o, lse = sa.sparse_attention(q, k[:, :0], v[:, :0], torch.full_like(idx, -1), backend=backend)
    assert o.shape == (1, 12, 4, 16) and bool((o == 0).all()) and bool((lse == -math.inf).all())


def test_indexer_kl_loss_lets_a_nan_target_through():
    """A NaN target made every query invalid and the loss 0: it must show as NaN."""
    q, k, v, qi, ki, w, idx = sparse_args()
    scores = sa_ref.lightning_indexer_sparse(qi, ki, w, idx)
    target = torch.rand(idx.shape)
    assert torch.isfinite(sa.indexer_kl_loss(scores, target, idx))
    target[0, 3] = float("nan")
    assert torch.isnan(sa.indexer_kl_loss(scores, target, idx))


def test_chunked_indexer_kl_loss_checks_before_computing(monkeypatch):
    """Its shapes were checked only after the whole sparse-stage target (and then per chunk,
    naming the chunk's T); wrong ranks failed with unpacking / index errors."""
    q, k, v, qi, ki, w, idx = sparse_args()
    calls = []
    real = sa.attention_probs_target
    monkeypatch.setattr(sa, "attention_probs_target", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with pytest.raises(ValueError, match=r"weights must be \[B, T, HI\] = \[1, 12, 2\]"):
        sa.chunked_indexer_kl_loss(q, k, qi, ki, w[..., :1], idx, budget_bytes=1, backend="torch")
    with pytest.raises(ValueError, match="^q_idx must be a 4-D tensor"):
        sa.chunked_indexer_kl_loss(q, k, qi[:, :, 0], ki, w, idx, backend="torch")
    with pytest.raises(ValueError, match="^k must be a 4-D tensor"):
        sa.chunked_indexer_kl_loss(q, k[:, :, 0], qi, ki, w, None, backend="torch")
    with pytest.raises(ValueError, match="^q_idx .* must cover"):
        sa.chunked_indexer_kl_loss(q, k, qi[:, :6], ki, w[:, :6], idx, backend="torch")
    with pytest.raises(ValueError, match="^indices must be an integer"):
        sa.chunked_indexer_kl_loss(q, k, qi, ki, w, idx.float(), backend="torch")
    assert calls == []
    loss, valid = sa.chunked_indexer_kl_loss(q, k, qi, ki, w, idx, budget_bytes=1, backend="torch")
    assert torch.isfinite(loss) and calls


# --- loss ---


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreter)])
def test_linear_cross_entropy_scalar_options_named(backend):
    h, w, y = torch.randn(16, 8), torch.randn(20, 8), torch.randint(0, 20, (16,))
    for kwargs, name in (({"chunk_size": 2.5}, "chunk_size"), ({"chunk_size": "8"}, "chunk_size"),
                         ({"z_loss_weight": "0.1"}, "z_loss_weight"), ({"z_loss_weight": float("nan")}, "z_loss_weight"),
                         ({"z_loss_weight": float("inf")}, "z_loss_weight")):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            ce.linear_cross_entropy(h, w, y, backend=backend, **kwargs)
    with pytest.raises(ValueError, match=r"^hidden must be a float tensor \[N, D\]"):
        ce.linear_cross_entropy(h[0], w, y, backend=backend)  # Triton's auto chunk ran first: IndexError
    loss = ce.linear_cross_entropy(h, w, y, z_loss_weight=0.0, backend=backend)
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.T, y), rtol=1e-5, atol=1e-5)


# --- MoE ---


def test_load_balancing_loss_checks_expert_ids():
    """An id equal to num_experts fell into count_experts' discard bin: a wrong loss, no error;
    int32 ids failed inside scatter_add."""
    probs, idx, scores = moe.router_topk(torch.randn(6, 8, generator=torch.Generator().manual_seed(0)), 2)
    good = moe.load_balancing_loss(scores, idx, 8, 2)
    torch.testing.assert_close(moe.load_balancing_loss(scores, idx.int(), 8, 2), good)
    for bad_id in (8, -1):
        bad = idx.clone()
        bad[0, 0] = bad_id
        with pytest.raises(ValueError, match=r"^topk_idx must lie in \[0, 8\)"):
            moe.load_balancing_loss(scores, bad, 8, 2)
    with pytest.raises(ValueError, match="^topk_idx must be an integer tensor"):
        moe.load_balancing_loss(scores, idx.float(), 8, 2)


@interpreter
def test_the_indexers_selections_skip_the_checks(monkeypatch):
    """lightning_indexer_topk's output is marked valid (in range, no key twice in a row), so the
    fused ops skip their checks of it: no row sort in a forward-only call, no range read, no
    repeated-key read in the backward, none per chunk of the KL loss. A write in place, a copy,
    or more keys than it was made for void the mark, and the checks run again."""
    q, k, v, qi, ki, w, idx = sparse_args()
    sorted_rows, range_reads = [], []
    real_sort = triton_sparse._check_no_repeats
    monkeypatch.setattr(triton_sparse, "_check_no_repeats", lambda i: sorted_rows.append(i) or real_sort(i))
    real_aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: range_reads.append(t) or real_aminmax(t))
    repeat_reads = []
    real_raise = triton_sparse._raise_if_repeated

    def raise_if_repeated(repeated):
        if repeated is not None:  # a flag was formed: the host will read it
            repeat_reads.append(repeated)
        real_raise(repeated)

    monkeypatch.setattr(triton_sparse, "_raise_if_repeated", raise_if_repeated)
    sel = sa.lightning_indexer_topk(qi, ki, w, 4, backend="triton")
    assert sa_ref.known_valid_indices(sel, 12) and not sa_ref.known_valid_indices(sel.clone(), 12)
    assert not sa_ref.known_valid_indices(sel, 11)  # made over 12 keys: not known valid over fewer
    sa.sparse_attention(q, k, v, sel, backend="triton")
    qg = q.clone().requires_grad_()
    o, lse = sa.sparse_attention(qg, k, v, sel, backend="triton")
    o.sum().backward()
    sa.chunked_indexer_kl_loss(q, k, qi.requires_grad_(), ki, w, sel, budget_bytes=1, backend="triton")[0].backward()
    assert sorted_rows == [] and range_reads == [] and repeat_reads == []
    sa.sparse_attention(q, k, v, sel.clone(), backend="triton")
    assert len(sorted_rows) == 1 and len(range_reads) == 1
    o, lse = sa.sparse_attention(q.clone().requires_grad_(), k, v, sel.clone(), backend="triton")
    o.sum().backward()
    # unmarked copies: the forward-only call's row sort, then this backward, each read a flag
    assert len(repeat_reads) == 2
    sel[0, 5, 1] = sel[0, 5, 0]  # in place: the mark no longer holds
    assert not sa_ref.known_valid_indices(sel, 12)
    with pytest.raises(ValueError, match="must not repeat a key"):
        sa.sparse_attention(q, k, v, sel, backend="triton")
