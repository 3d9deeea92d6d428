"""Reference sparse-attention ops against independent plain formulations.

Shape legend: B batch, T tokens, S keys (== T), H query heads, G kv groups, D head dim,
DV value head dim, HI / DI indexer heads / head dim, K top-k, N packed sequences.
Everything runs in float64 so forward and gradients can be compared tightly.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.sparse_attention import reference

F64 = dict(dtype=torch.float64)
TOL = dict(rtol=1e-9, atol=1e-10)


def _grads(out, inputs):
    """Gradients of a random projection of out (finite entries only) w.r.t. inputs."""
    finite = out.isfinite()
    probe = torch.randn(out.shape, dtype=out.dtype)
    loss = (torch.where(finite, out, 0.0) * probe).sum()
    return torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)


def _assert_grads_close(out_a, in_a, out_b, in_b):
    seed = torch.randint(0, 2**31, ()).item()
    torch.manual_seed(seed)
    ga = _grads(out_a, in_a)
    torch.manual_seed(seed)
    gb = _grads(out_b, in_b)
    for a, b in zip(ga, gb):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, **TOL)


def _leaf(*shape):
    return torch.randn(*shape, **F64).requires_grad_()


def _segments(cu, T):
    """Python oracle of the packed-sequence id of each token."""
    ids = [0] * T
    for n in range(len(cu) - 1):
        for t in range(cu[n], cu[n + 1]):
            ids[t] = n
    return torch.tensor(ids)


def _oracle_mask(T, causal, cu):
    t = torch.arange(T)
    mask = t[:, None] >= t[None, :] if causal else torch.ones(T, T, dtype=torch.bool)
    if cu is not None:
        seg = _segments(cu, T)
        mask = mask & (seg[:, None] == seg[None, :])
    return mask


# RoPE


@pytest.mark.parametrize(
    "shape, rope_dim, per_batch",
    [
        ((2, 63, 4, 32), 32, False),
        ((2, 17, 3, 16), 8, True),
        ((1, 9, 12), 6, False),
        ((3, 5, 2, 2, 10), 4, True),
    ],
    ids=["B2-T63-H4-D32-R32", "B2-T17-H3-D16-R8", "B1-T9-D12-R6", "B3-T5-2x2-D10-R4"],
)
def test_apply_rope_matches_complex_rotation(shape, rope_dim, per_batch):
    torch.manual_seed(0)
    x = _leaf(*shape)
    B, T, half = shape[0], shape[1], rope_dim // 2
    positions = torch.randint(0, 1000, (B, T) if per_batch else (T,))
    out = sa.apply_rope(x, positions, rope_dim, base=500.0)

    # Oracle: channels (i, i + half) form the complex x_i + i x_{i+half}, turned by pos * theta_i.
    theta = 500.0 ** (-torch.arange(half, **F64) / half)
    angle = positions.to(torch.float64)[..., None] * theta
    angle = angle.expand(B, T, half).reshape(B, T, *[1] * (x.dim() - 3), half)
    z = torch.complex(x[..., :half], x[..., half:rope_dim]) * torch.polar(
        torch.ones_like(angle), angle
    )
    expected = torch.cat([z.real, z.imag, x[..., rope_dim:]], dim=-1)

    torch.testing.assert_close(out, expected, **TOL)
    _assert_grads_close(out, (x,), expected, (x,))


def test_apply_rope_depends_only_on_relative_position():
    torch.manual_seed(1)
    q, k = torch.randn(1, 7, 2, 16, **F64), torch.randn(1, 7, 2, 16, **F64)
    pos = torch.randint(0, 100, (7,))
    shift = int(torch.randint(1, 1000, ()))
    dots = [
        torch.einsum("bthd,bshd->bhts", sa.apply_rope(q, p, 12), sa.apply_rope(k, p, 12))
        for p in (pos, pos + shift)
    ]
    torch.testing.assert_close(dots[0], dots[1], rtol=1e-9, atol=1e-9)


# Lightning indexer


def _oracle_index_scores(q_idx, k_idx, weights, causal, cu):
    B, T, HI, DI = q_idx.shape
    scores = torch.zeros(B, T, T, **F64)
    for j in range(HI):
        logits = torch.relu(q_idx[:, :, j] @ k_idx.transpose(1, 2))  # [B, T, S]
        scores = scores + weights[:, :, j, None] * logits
    return scores.masked_fill(~_oracle_mask(T, causal, cu), float("-inf"))


INDEXER_CASES = [
    pytest.param(2, 63, 4, 32, True, None, id="B2-T63-HI4-DI32-causal"),
    pytest.param(1, 1, 2, 8, True, None, id="B1-T1-HI2-DI8-causal"),
    pytest.param(3, 20, 3, 16, False, None, id="B3-T20-HI3-DI16-full"),
    pytest.param(1, 30, 4, 16, True, [0, 5, 5, 17, 30], id="B1-T30-packed-5-0-12-13"),
    pytest.param(1, 11, 2, 8, False, [0, 4, 11], id="B1-T11-packed-4-7-full"),
]


@pytest.mark.parametrize("B, T, HI, DI, causal, cu", INDEXER_CASES)
def test_lightning_indexer_matches_per_head_loop(B, T, HI, DI, causal, cu):
    torch.manual_seed(2)
    q_idx, k_idx, w = _leaf(B, T, HI, DI), _leaf(B, T, DI), _leaf(B, T, HI)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    out = sa.lightning_indexer(q_idx, k_idx, w, causal=causal, cu_seqlens=cu_seqlens)
    expected = _oracle_index_scores(q_idx, k_idx, w, causal, cu)

    assert out.dtype == torch.float64
    assert torch.equal(out.isinf(), expected.isinf())
    torch.testing.assert_close(out, expected, **TOL)
    _assert_grads_close(out, (q_idx, k_idx, w), expected, (q_idx, k_idx, w))


def test_lightning_indexer_is_fp32_for_low_precision_inputs():
    q_idx, k_idx, w = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 2)
    out = sa.lightning_indexer(q_idx.bfloat16(), k_idx.bfloat16(), w.bfloat16())
    assert out.dtype == torch.float32


def _random_indices(B, T, K, causal=True, empty_row=None):
    """Random distinct readable keys per query, -1 padded at random slots."""
    indices = torch.full((B, T, K), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            num_keys = t + 1 if causal else T
            chosen = torch.randperm(num_keys)[: int(torch.randint(1, K + 1, ()))]
            slots = torch.randperm(K)[: chosen.numel()]
            indices[b, t, slots] = chosen
    if empty_row is not None:
        indices[0, empty_row] = -1
    return indices


@pytest.mark.parametrize(
    "B, T, HI, DI, K",
    [(2, 31, 4, 16, 8), (1, 7, 2, 8, 12), (3, 5, 1, 4, 1)],
    ids=["B2-T31-HI4-DI16-K8", "B1-T7-HI2-DI8-K12", "B3-T5-HI1-DI4-K1"],
)
def test_lightning_indexer_sparse_matches_gathered_dense(B, T, HI, DI, K):
    torch.manual_seed(3)
    q_idx, k_idx, w = _leaf(B, T, HI, DI), _leaf(B, T, DI), _leaf(B, T, HI)
    indices = _random_indices(B, T, K)
    out = sa.lightning_indexer_sparse(q_idx, k_idx, w, indices)
    dense = sa.lightning_indexer(q_idx, k_idx, w)
    expected = dense.gather(-1, indices.clamp(min=0)).masked_fill(indices < 0, float("-inf"))

    torch.testing.assert_close(out, expected, **TOL)
    _assert_grads_close(out, (q_idx, k_idx, w), expected, (q_idx, k_idx, w))


# Top-k selection


def _oracle_topk(scores, topk):
    B, T, S = scores.shape
    out = torch.full((B, T, topk), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            finite = [
                (-scores[b, t, s].item(), s) for s in range(S) if scores[b, t, s] > float("-inf")
            ]
            kept = [s for _, s in sorted(finite)[:topk]]
            out[b, t, : len(kept)] = torch.tensor(kept, dtype=torch.int64)
    return out


@pytest.mark.parametrize(
    "B, T, topk, ties",
    [(2, 33, 8, False), (1, 9, 16, False), (2, 17, 5, True), (1, 1, 3, True)],
    ids=["B2-T33-K8", "B1-T9-K16-more-than-keys", "B2-T17-K5-ties", "B1-T1-K3-ties"],
)
def test_topk_indices_matches_sorted_oracle(B, T, topk, ties):
    torch.manual_seed(4)
    # Integer scores make ties certain; the oracle breaks them towards the lower key.
    scores = torch.randint(-3, 4, (B, T, T)).double() if ties else torch.randn(B, T, T, **F64)
    scores = scores.masked_fill(~_oracle_mask(T, True, None), float("-inf"))
    assert torch.equal(sa.topk_indices(scores, topk), _oracle_topk(scores, topk))


@pytest.mark.parametrize(
    "B, T, topk, block_size, causal, cu, integer",
    [
        (2, 63, 8, 16, True, None, False),
        (1, 50, 7, 7, True, [0, 9, 9, 31, 50], False),
        (2, 29, 6, 4, False, None, True),
        (1, 40, 12, 13, True, [0, 40], True),
        (2, 10, 4, 256, True, None, False),
    ],
    ids=[
        "B2-T63-K8-blk16",
        "B1-T50-K7-blk7-packed",
        "B2-T29-K6-blk4-full-ties",
        "B1-T40-K12-blk13-ties",
        "B2-T10-K4-blk256",
    ],
)
def test_indexer_topk_blocks_equal_full(B, T, topk, block_size, causal, cu, integer):
    torch.manual_seed(5)
    if integer:
        # Small integers keep every score exact in both paths, so ties really happen.
        q_idx = torch.randint(-2, 3, (B, T, 3, 4)).double()
        k_idx = torch.randint(-2, 3, (B, T, 4)).double()
        w = torch.randint(0, 3, (B, T, 3)).double()
    else:
        q_idx, k_idx, w = (
            torch.randn(B, T, 3, 8, **F64),
            torch.randn(B, T, 8, **F64),
            torch.randn(B, T, 3, **F64),
        )
    cu_seqlens = None if cu is None else torch.tensor(cu)
    full = sa.topk_indices(sa.lightning_indexer(q_idx, k_idx, w, causal, cu_seqlens), topk)
    blocked = sa.indexer_topk(
        q_idx, k_idx, w, topk, block_size=block_size, causal=causal, cu_seqlens=cu_seqlens
    )
    assert torch.equal(blocked, full)
    assert torch.equal(full, _oracle_topk(_oracle_index_scores(q_idx, k_idx, w, causal, cu), topk))


def test_packed_cu_seqlens_is_read_to_the_host_once_per_tensor(monkeypatch):
    """The sparse and attention layers of one step share cu_seqlens: its check reads it to the
    host (a sync on the GPU) once, not in every call; a write in place is seen."""
    cu = torch.tensor([0, 5, 12])
    reads = []
    for name in ("tolist", "item"):
        real = getattr(torch.Tensor, name)

        def spy(self, real=real):
            reads.append(self is cu or self._base is cu)
            return real(self)

        monkeypatch.setattr(torch.Tensor, name, spy)
    torch.manual_seed(3)
    q_idx, k_idx, w = torch.randn(1, 12, 2, 8, **F64), torch.randn(1, 12, 8, **F64), torch.randn(1, 12, 2, **F64)
    first = sa.lightning_indexer_topk(q_idx, k_idx, w, 4, cu_seqlens=cu, backend="torch")
    pos = sa.positions_from_cu_seqlens(cu, 12)
    again = sa.lightning_indexer_topk(q_idx, k_idx, w, 4, cu_seqlens=cu, backend="torch")
    assert sum(reads) == 1
    assert torch.equal(first, again)
    assert pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    cu[1] = 7  # in place: the host copy is stale
    assert sa.positions_from_cu_seqlens(cu, 12).tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]
    assert sum(reads) == 2
    cu[2] = 11
    with pytest.raises(ValueError, match="end at the token count 12"):
        sa.positions_from_cu_seqlens(cu, 12)


# Sparse attention


ATTN_CASES = [
    pytest.param(2, 63, 4, 2, 32, 16, 8, id="B2-T63-H4-G2-D32-DV16-K8"),
    pytest.param(1, 17, 3, 1, 16, 16, 5, id="B1-T17-H3-G1-D16-DV16-K5"),
    pytest.param(2, 9, 4, 4, 8, 12, 16, id="B2-T9-H4-G4-D8-DV12-K16"),
    pytest.param(1, 1, 2, 1, 8, 8, 1, id="B1-T1-H2-G1-D8-DV8-K1"),
]


@pytest.mark.parametrize("B, T, H, G, D, DV, K", ATTN_CASES)
def test_sparse_attention_matches_dense_masked(B, T, H, G, D, DV, K):
    torch.manual_seed(6)
    q, k, v = _leaf(B, T, H, D), _leaf(B, T, G, D), _leaf(B, T, G, DV)
    indices = _random_indices(B, T, K, empty_row=T // 2)
    o, lse = sa.sparse_attention(q, k, v, indices, scale=0.3)
    o_ref, lse_ref = sa.dense_masked_attention(q, k, v, indices, scale=0.3)

    assert o.shape == (B, T, H, DV) and lse.shape == (B, T, H)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    # A query with no key reads nothing: zero output, -inf lse, finite gradients.
    assert torch.equal(o[0, T // 2], torch.zeros_like(o[0, T // 2]))
    assert bool((lse[0, T // 2] == float("-inf")).all())
    _assert_grads_close(o, (q, k, v), o_ref, (q, k, v))
    _assert_grads_close(lse, (q, k, v), lse_ref, (q, k, v))


def _sdpa_causal(q, k, v, cu=None, scale=None):
    """torch SDPA with heads repeated per group: an oracle independent of our softmax code."""
    B, T, H, _ = q.shape
    R = H // k.shape[2]
    mask = _oracle_mask(T, True, cu)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(R, dim=2).transpose(1, 2),
        v.repeat_interleave(R, dim=2).transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return o.transpose(1, 2)


@pytest.mark.parametrize(
    "B, T, H, G, D, cu",
    [(2, 33, 4, 2, 16, None), (1, 21, 6, 3, 8, [0, 6, 6, 15, 21]), (1, 5, 2, 2, 4, None)],
    ids=["B2-T33-H4-G2-D16", "B1-T21-H6-G3-D8-packed", "B1-T5-H2-G2-D4"],
)
def test_dense_and_full_topk_attention_match_sdpa(B, T, H, G, D, cu):
    torch.manual_seed(7)
    q, k, v = _leaf(B, T, H, D), _leaf(B, T, G, D), _leaf(B, T, G, D)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    expected = _sdpa_causal(q, k, v, cu)

    dense, _ = sa.dense_attention(q, k, v, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(dense, expected, **TOL)
    _assert_grads_close(dense, (q, k, v), expected, (q, k, v))

    # With topk >= T the indexer keeps every readable key, so sparse equals dense causal.
    indices = sa.indexer_topk(
        torch.randn(B, T, 2, 4, **F64),
        torch.randn(B, T, 4, **F64),
        torch.randn(B, T, 2, **F64),
        T + 3,
        cu_seqlens=cu_seqlens,
    )
    sparse, _ = sa.sparse_attention(q, k, v, indices)
    torch.testing.assert_close(sparse, expected, **TOL)
    _assert_grads_close(sparse, (q, k, v), expected, (q, k, v))


# Indexer KL loss and its target


def _oracle_probs(q, k, mask, scale):
    """[B, H, T, S] per-head softmax probabilities with heads repeated per group."""
    R = q.shape[2] // k.shape[2]
    logits = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(R, dim=2)) * scale
    return torch.softmax(logits.masked_fill(~mask[:, None], float("-inf")), dim=-1)


@pytest.mark.parametrize(
    "B, T, H, G, D, K, cu",
    [(2, 25, 4, 2, 8, 6, None), (1, 19, 3, 3, 8, 4, [0, 7, 19]), (1, 6, 2, 1, 4, 9, None)],
    ids=["B2-T25-H4-G2-K6", "B1-T19-H3-G3-K4-packed", "B1-T6-H2-G1-K9"],
)
def test_attention_probs_target(B, T, H, G, D, K, cu):
    torch.manual_seed(8)
    q, k = torch.randn(B, T, H, D, **F64), torch.randn(B, T, G, D, **F64)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    causal = _oracle_mask(T, True, cu).expand(B, T, T)
    dense_expected = _oracle_probs(q, k, causal, 0.5).sum(1) / H
    torch.testing.assert_close(
        sa.attention_probs_target(q, k, scale=0.5, cu_seqlens=cu_seqlens), dense_expected, **TOL
    )

    indices = _random_indices(B, T, K)
    selected = sa.indices_to_mask(indices, T)
    sparse_full = _oracle_probs(q, k, selected, 0.5).sum(1) / H  # [B, T, S]
    sparse_expected = sparse_full.gather(-1, indices.clamp(min=0)).masked_fill(indices < 0, 0.0)
    torch.testing.assert_close(
        sa.attention_probs_target(q, k, indices, scale=0.5), sparse_expected, **TOL
    )


def _oracle_kl(index_scores, target):
    """Mean over queries of KL(p || softmax(scores)), one row at a time over its finite keys."""
    rows = []
    B, T, _ = index_scores.shape
    for b in range(B):
        for t in range(T):
            keep = index_scores[b, t] > float("-inf")
            p = target[b, t, keep] / target[b, t, keep].sum()
            log_q = torch.log_softmax(index_scores[b, t, keep], dim=-1)
            rows.append(F.kl_div(log_q, p, reduction="sum"))
    return torch.stack(rows).mean()


@pytest.mark.parametrize(
    "B, T, cu",
    [(2, 23, None), (1, 16, [0, 3, 3, 16]), (1, 1, None)],
    ids=["B2-T23", "B1-T16-packed", "B1-T1"],
)
def test_indexer_kl_loss_dense_matches_rowwise_kl_div(B, T, cu):
    torch.manual_seed(9)
    mask = _oracle_mask(T, True, cu).expand(B, T, T)
    scores = torch.randn(B, T, T, **F64).masked_fill(~mask, float("-inf")).requires_grad_()
    # Unnormalised, with some zero entries: the loss must normalise it and skip 0 log 0.
    target = (torch.rand(B, T, T, **F64) * (torch.rand(B, T, T) > 0.3)).masked_fill(~mask, 0.0)
    target[:, torch.arange(T), torch.arange(T)] += 0.1  # every query keeps some mass on itself
    loss = sa.indexer_kl_loss(scores, target)
    expected = _oracle_kl(scores, target)
    torch.testing.assert_close(loss, expected, **TOL)
    _assert_grads_close(loss, (scores,), expected, (scores,))


@pytest.mark.parametrize("B, T, K", [(2, 21, 5), (1, 8, 11)], ids=["B2-T21-K5", "B1-T8-K11"])
def test_indexer_kl_loss_sparse_equals_dense_on_the_selection(B, T, K):
    torch.manual_seed(10)
    q_idx, k_idx, w = _leaf(B, T, 2, 8), _leaf(B, T, 8), _leaf(B, T, 2)
    q, k = torch.randn(B, T, 4, 8, **F64), torch.randn(B, T, 2, 8, **F64)
    indices = sa.indexer_topk(q_idx, k_idx, w, K)

    sparse = sa.indexer_kl_loss(
        sa.lightning_indexer_sparse(q_idx, k_idx, w, indices),
        sa.attention_probs_target(q, k, indices),
        indices,
    )
    # Oracle: the dense loss over full scores and target with everything unselected masked out.
    selected = sa.indices_to_mask(indices, T)
    full_scores = sa.lightning_indexer(q_idx, k_idx, w).masked_fill(~selected, float("-inf"))
    full_target = _oracle_probs(q, k, selected, 8**-0.5).sum(1)
    dense = _oracle_kl(full_scores, full_target)
    torch.testing.assert_close(sparse, dense, **TOL)
    _assert_grads_close(sparse, (q_idx, k_idx, w), dense, (q_idx, k_idx, w))


def test_indexer_kl_loss_skips_queries_without_keys():
    torch.manual_seed(11)
    scores = torch.randn(1, 4, 3, **F64, requires_grad=True)
    target = torch.rand(1, 4, 3, **F64)
    indices = torch.tensor([[[0, 1, 2], [-1, -1, -1], [2, 0, -1], [1, -1, -1]]])
    loss = sa.indexer_kl_loss(scores, target, indices)
    kept = [0, 2, 3]
    expected = _oracle_kl(
        scores[:, kept].masked_fill(indices[:, kept] < 0, float("-inf")),
        target[:, kept].masked_fill(indices[:, kept] < 0, 0),
    )
    torch.testing.assert_close(loss, expected, **TOL)
    (grad,) = torch.autograd.grad(loss, scores)
    assert bool(grad.isfinite().all()) and bool((grad[0, 1] == 0).all())


# Validation and backends


def _bad_calls():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    good = torch.zeros(1, 4, 2, dtype=torch.int64)
    q_idx, k_idx, w = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 2)
    scores = torch.randn(1, 4, 4)
    return [
        ("q must", lambda: sa.sparse_attention(q[0], k, v, good)),
        ("k must", lambda: sa.sparse_attention(q, torch.randn(1, 4, 3, 8), v, good)),
        ("v must", lambda: sa.sparse_attention(q, k, torch.randn(1, 4, 2, 8), good)),
        ("indices must", lambda: sa.sparse_attention(q, k, v, good + 4)),
        ("indices must", lambda: sa.sparse_attention(q, k, v, good.float())),
        ("indices must not repeat", lambda: sa.sparse_attention(q, k, v, good)),
        ("k_idx must", lambda: sa.lightning_indexer(q_idx, k_idx[..., :4], w)),
        ("weights must", lambda: sa.lightning_indexer(q_idx, k_idx, w[..., :1])),
        (
            "cu_seqlens must",
            lambda: sa.lightning_indexer(q_idx, k_idx, w, cu_seqlens=torch.tensor([0, 3])),
        ),
        (
            "cu_seqlens needs",
            lambda: sa.lightning_indexer(
                q_idx.expand(2, -1, -1, -1),
                k_idx.expand(2, -1, -1),
                w.expand(2, -1, -1),
                cu_seqlens=torch.tensor([0, 4]),
            ),
        ),
        ("topk must", lambda: sa.topk_indices(scores, 0)),
        ("topk must", lambda: sa.indexer_topk(q_idx, k_idx, w, -2)),
        ("block_size must", lambda: sa.indexer_topk(q_idx, k_idx, w, 2, block_size=0)),
        ("scores must", lambda: sa.topk_indices(scores[0], 2)),
        ("rope_dim must", lambda: sa.apply_rope(q, torch.arange(4), 3)),
        ("rope_dim must", lambda: sa.apply_rope(q, torch.arange(4), 10)),
        ("positions must", lambda: sa.apply_rope(q, torch.arange(5), 4)),
        ("attn_probs_target must", lambda: sa.indexer_kl_loss(scores, scores[..., :2])),
        ("indices must", lambda: sa.indexer_kl_loss(scores, scores, good)),
    ]


@pytest.mark.parametrize(
    "case",
    range(len(_bad_calls())),
    ids=[c[0].replace(" ", "-") + f"-{i}" for i, c in enumerate(_bad_calls())],
)
def test_bad_input_raises_value_error_naming_the_argument(case):
    match, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=match):
        call()


def test_backend_registry(monkeypatch):
    assert "torch" in sa.registered_backends()
    scores = torch.randn(1, 5, 5)
    assert torch.equal(
        sa.topk_indices(scores, 2, backend="torch"), reference.topk_indices(scores, 2)
    )
    with pytest.raises(ValueError, match="registered backends: .*torch"):
        sa.topk_indices(scores, 2, backend="no-such-backend")

    # A backend that implements one op: auto prefers it there and falls back to torch elsewhere.
    calls = []

    def fake_topk(s, topk):
        calls.append(topk)
        return reference.topk_indices(s, topk)

    monkeypatch.setitem(
        sa._BACKENDS, "triton", sa.SparseAttentionBackend("triton", topk_indices=fake_topk)
    )
    sa.topk_indices(scores, 3)
    assert calls == [3]
    assert sa.get_op("sparse_attention") is reference.sparse_attention
    with pytest.raises(ValueError, match="triton"):
        sa.sparse_attention(
            torch.randn(1, 5, 1, 4),
            torch.randn(1, 5, 1, 4),
            torch.randn(1, 5, 1, 4),
            torch.zeros(1, 5, 1, dtype=torch.int64),
            backend="triton",
        )


@pytest.mark.parametrize("H,G", [(4, 4), (4, 2), (6, 1)])
def test_causal_attention_sdpa_equals_reference(H, G):
    """The SDPA path of causal_attention (what GatedAttention runs on CUDA) computes the
    reference's dense causal attention, forward and every gradient, GQA included."""
    from megatron_moe_hybrid.ops.sparse_attention import causal_attention

    gen = torch.Generator().manual_seed(H * 10 + G)
    B, T, D = 2, 37, 16
    q, k, v = (torch.randn(B, T, n, D, generator=gen, dtype=torch.float64, requires_grad=True) for n in (H, G, G))
    go = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    outs = []
    for backend in ("torch", "sdpa"):
        o = causal_attention(q, k, v, backend=backend)
        outs.append((o, *torch.autograd.grad(o, (q, k, v), go)))
    for ref, got in zip(*outs):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("H,G,lengths", [(4, 4, [5, 0, 17, 1, 14]), (4, 2, [37]), (6, 1, [0, 9, 28, 0])])
def test_causal_attention_packed_sdpa_equals_reference(H, G, lengths):
    """Packed sequences through SDPA, one sequence at a time (what CUDA runs where the varlen
    kernel cannot), equal the reference's masked dense attention, forward and every gradient:
    each sequence attends within itself, empty sequences included."""
    from megatron_moe_hybrid.ops.sparse_attention import causal_attention

    gen = torch.Generator().manual_seed(H * 10 + G + len(lengths))
    T, D = sum(lengths), 16
    cu = torch.tensor([0, *lengths]).cumsum(0)
    q, k, v = (torch.randn(1, T, n, D, generator=gen, dtype=torch.float64, requires_grad=True) for n in (H, G, G))
    go = torch.randn(1, T, H, D, generator=gen, dtype=torch.float64)
    outs = []
    for backend in ("torch", "sdpa"):
        o = causal_attention(q, k, v, cu_seqlens=cu, backend=backend)
        outs.append((o, *torch.autograd.grad(o, (q, k, v), go)))
    for ref, got in zip(*outs):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    if len(lengths) == 1:  # one whole sequence is the unpacked causal attention
        torch.testing.assert_close(outs[1][0], causal_attention(q, k, v, backend="sdpa"), rtol=0, atol=0)


def test_causal_attention_refuses_what_its_backends_cannot_run():
    from megatron_moe_hybrid.ops.sparse_attention import causal_attention, varlen_unsupported

    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="backend"):
        causal_attention(q, q, q, backend="flash")
    with pytest.raises(ValueError, match="S=6"):
        causal_attention(q, q[:, :6], q[:, :6], backend="sdpa")
    q2 = q.expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match="B == 1"):
        causal_attention(q2, q2, q2, cu_seqlens=torch.tensor([0, 3, 8]), backend="sdpa")
    with pytest.raises(ValueError, match="end at the token count 8"):
        causal_attention(q, q, q, cu_seqlens=torch.tensor([0, 3, 7]), backend="sdpa")
    # varlen (torch's flash kernel) takes 16-bit CUDA tensors of one head dim: a refusal says why
    with pytest.raises(ValueError, match="varlen.*(CUDA|varlen_attn)"):
        causal_attention(q, q, q, cu_seqlens=torch.tensor([0, 3, 8]), backend="varlen")
    assert "CUDA" in varlen_unsupported(q, q, q) or "varlen_attn" in varlen_unsupported(q, q, q)
    # auto keeps CPU tensors, packed or not, on the reference
    torch.testing.assert_close(
        causal_attention(q, q, q, cu_seqlens=torch.tensor([0, 3, 8])),
        sa.dense_attention(q, q, q, cu_seqlens=torch.tensor([0, 3, 8]))[0],
    )


def test_auto_loops_over_packed_sequences_only_where_few_and_long():
    """auto's choice between SDPA per packed sequence and the varlen kernel (same attention,
    different speed), at the shapes of benchmarks/packed_attention.py: a few long records of
    Qwen3-Next's heads loop, 65 short chat records and small heads take varlen."""
    from megatron_moe_hybrid.ops.sparse_attention import _pieces, _sequence_loop_pays

    def offsets(lengths):  # the pieces of packed sequences of these lengths, every query over its own
        cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
        return _pieces([(0, cu[-1])], cu, cu[-1])

    long_records = offsets([4096, 8192, 4096, 6000, 2000, 8192, 192])  # 32k tokens, 7 records
    assert _sequence_loop_pays(long_records, 16 * 256)
    assert not _sequence_loop_pays(long_records, 2 * 64)  # too little work per launch
    assert not _sequence_loop_pays(offsets([252] * 65), 16 * 128)
    assert not _sequence_loop_pays(offsets([1] * 10), 16 * 256)
    # a CP=8 rank's two pieces over 128k keys: the second reads every key before it
    assert _sequence_loop_pays(_pieces([(0, 8192), (122880, 131072)], None, 131072), 16 * 128)
    # empty sequences cost the loop nothing
    assert _sequence_loop_pays(offsets([0, 8192, 0, 0, 8192]), 16 * 256) == _sequence_loop_pays(offsets([8192] * 2), 16 * 256)


@pytest.mark.parametrize(
    "B,S,lengths,runs",
    [
        (2, 24, None, [(0, 6), (18, 24)]),  # zigzag CP=2, rank 0: first and last pieces
        (1, 24, None, [(6, 12), (12, 18)]),  # rank 1: two adjacent pieces
        (1, 40, [5, 0, 12, 1, 22], [(3, 9), (16, 19), (30, 36)]),  # packed: runs across sequences
        (1, 40, [40], [(0, 0), (39, 40), (0, 10)]),  # an empty run, one query, runs out of order
    ],
)
def test_causal_attention_placed_queries_sdpa_equals_reference(B, S, lengths, runs):
    """Queries placed among more keys (a context-parallel rank's pieces, q_ranges) through SDPA
    per sequence piece (lower-right causal windows) equal the reference with the same positions,
    forward and every gradient, GQA, packed or not."""
    from megatron_moe_hybrid.ops.sparse_attention import causal_attention

    gen = torch.Generator().manual_seed(S + len(runs))
    T, H, G, D = sum(b - a for a, b in runs), 4, 2, 8
    cu = None if lengths is None else torch.tensor([0, *lengths]).cumsum(0)
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, S, G, D, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    go = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    positions = torch.cat([torch.arange(a, b) for a, b in runs])
    o_ref = sa.dense_attention(q, k, v, cu_seqlens=cu, q_positions=positions)[0]
    ref = (o_ref, *torch.autograd.grad(o_ref, (q, k, v), go))
    for backend in ("sdpa", "torch"):
        o = causal_attention(q, k, v, cu_seqlens=cu, q_ranges=runs, backend=backend)
        for want, got in zip(ref, (o, *torch.autograd.grad(o, (q, k, v), go))):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_causal_attention_q_ranges_are_checked():
    from megatron_moe_hybrid.ops.sparse_attention import causal_attention

    q, k = torch.randn(1, 6, 2, 4), torch.randn(1, 12, 2, 4)
    with pytest.raises(ValueError, match="need q_ranges"):
        causal_attention(q, k, k, backend="sdpa")
    with pytest.raises(ValueError, match=r"q_ranges: .*sum to the 6 queries"):
        causal_attention(q, k, k, q_ranges=[(0, 5)], backend="sdpa")
    with pytest.raises(ValueError, match=r"\[\(10, 16\)\] are not"):
        causal_attention(q, k, k, q_ranges=[(10, 16)], backend="sdpa")
