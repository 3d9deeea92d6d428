"""The dense warm-up's fused indexer KL loss (ops/sparse_attention/triton_dense_kl.py) against the
PyTorch reference: the definition on whole [T, S] tensors (lightning_indexer,
attention_probs_target, indexer_kl_loss).

CPU: Triton's interpreter in fp32 (tests/conftest.py sets TRITON_INTERPRET=1); 16 x 16 tiles, so
the small shapes below cross tile edges, start keys mid-tile (packed sequences, q_positions) and
run the backward in several query chunks. GPU (-m gpu): bf16 at the layer's shapes.

Shape legend: B batch, T queries, S keys, H / G query heads / kv groups, D head dim, HI / DI
indexer heads / head dim.
"""

import pytest
import torch

pytest.importorskip("triton")

from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.sparse_attention import reference, triton_dense_kl

interpreter = pytest.mark.skipif(
    not triton_dense_kl._INTERPRET,
    reason="CPU tensors need TRITON_INTERPRET=1 (conftest sets it without a GPU)",
)


def inputs(B, T, S, H, G, D, HI, DI, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator(device=device).manual_seed(seed)

    def make(*shape, grad=False, div=1.0):
        x = (torch.randn(*shape, generator=gen, device=device) / div).to(dtype)
        return x.requires_grad_() if grad else x

    q, k = make(B, T, H, D), make(B, S, G, D)
    return q, k, make(B, T, HI, DI, grad=True, div=2), make(B, S, DI, grad=True, div=2), make(B, T, HI, grad=True)


def per_query_reference(q, k, q_idx, k_idx, w, cu=None, pos=None, scale=None):
    """(KL [B, T] per query, 0 where left out; valid [B, T]) from the whole [T, S] tensors."""
    scores = reference.lightning_indexer(q_idx, k_idx, w, True, cu, q_positions=pos)
    target = reference.attention_probs_target(q, k, None, scale, True, cu, q_positions=pos)
    p = target / target.sum(-1, keepdim=True).clamp_min(torch.finfo(target.dtype).tiny)
    log_q = torch.log_softmax(scores, -1)
    valid = reference.indexer_kl_valid_queries(scores.detach(), target)
    kl = torch.where(p != 0, p * (p.log() - log_q.masked_fill(~valid[..., None], 0.0)), 0.0).sum(-1)
    return torch.where(valid, kl, 0.0), valid


ZIGZAG = torch.tensor(list(range(10, 20)) + list(range(40, 50)))  # a CP rank's queries of 50 keys
CASES = {
    # name: (B, T, S, H, G, D, HI, DI, cu_seqlens, q_positions)
    "gqa": (1, 45, 45, 4, 2, 16, 3, 16, None, None),
    "mla-heads-own-keys": (2, 37, 37, 3, 3, 24, 2, 12, None, None),
    "mqa": (1, 33, 33, 4, 1, 16, 4, 16, None, None),
    "packed": (1, 45, 45, 4, 2, 16, 3, 16, torch.tensor([0, 5, 5, 33, 45]), None),
    "cp-zigzag": (1, 20, 50, 2, 1, 16, 2, 16, None, ZIGZAG),
    "cp-zigzag-packed": (1, 20, 50, 2, 2, 16, 2, 8, torch.tensor([0, 15, 42, 50]), ZIGZAG),
}


@interpreter
@pytest.mark.parametrize("block_tiles,heads,split,tall", [
    (1, 1, (), 1), (2, 2, ("lse", "fwd", "dscores"), 2), (2, 2, None, None)])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_per_query_kl_and_gradients_equal_the_definition(name, block_tiles, heads, split, tall, monkeypatch):
    """Each query's KL, and the gradients of a sum that weighs every query differently (so that
    per-query errors cannot cancel), in several backward chunks and in one; the keys in blocks
    of one tile (3-4 blocks a row: partial sums merged, tiles that start mid-block cut at its
    end) and of two; the query gradient one indexer head a program and two (stacked; the
    three-head cases fall back to one), the key gradient's head loop one head a step and two;
    the main attention's head dim 24 padded to 32 and in two parts (16 + 8 of 16); the lse,
    forward and score-gradient kernels' query tiles as tall as the gradient kernels' and twice
    as tall (each score-gradient tile then writes for two of the readers' tiles), and the module's
    own choice (tiles and splits per kernel and the heads' layout: the forward's query tile
    shorter or taller than the score gradients'). The score gradients are read unmasked in whole
    aligned tiles: the interpreter's buffer starts NaN, so an entry read but never written fails
    this test."""
    monkeypatch.setattr(triton_dense_kl, "MIN_BLOCK_TILES", block_tiles)
    monkeypatch.setattr(triton_dense_kl, "DQ_HEADS", heads)
    monkeypatch.setattr(triton_dense_kl, "DK_HEADS", heads)
    if split is not None:  # else the module's: some kernels split, tiles by the heads' layout
        monkeypatch.setattr(triton_dense_kl, "SPLIT_HEAD_DIM", frozenset(split))
        bm = tall * triton_dense_kl.BM
        monkeypatch.setattr(triton_dense_kl, "TILE_QUERIES", dict.fromkeys(("lse", "fwd", "dscores"), (bm, bm)))
    B, T, S, H, G, D, HI, DI, cu, pos = CASES[name]
    q, k, q_idx, k_idx, w = inputs(B, T, S, H, G, D, HI, DI, seed=len(name))
    weigh = torch.rand(B, T, generator=torch.Generator().manual_seed(1)) + 0.5
    want, want_valid = per_query_reference(q, k, q_idx, k_idx, w, cu, pos, scale=0.3)
    want_grads = torch.autograd.grad((want * weigh).sum(), (q_idx, k_idx, w))
    for budget in (B * S * 4 * 16, None):  # chunks of one score-gradient tile; one chunk
        got, valid = triton_dense_kl.dense_indexer_kl_triton(q, k, q_idx, k_idx, w, 0.3, cu, pos, budget)
        assert torch.equal(valid, want_valid)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad((got * weigh).sum(), (q_idx, k_idx, w))
        for g, e in zip(grads, want_grads):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_work_splits_stay_in_their_bounds(monkeypatch):
    """The key blocks cover S in whole tiles, at most MAX_KEY_BLOCKS of them; the key gradient's
    query blocks are whole tiles and their fp32 partials stay under DK_PARTIAL_BYTES."""
    BN, BM = triton_dense_kl.BN, triton_dense_kl.BM
    for S in (1, BN - 1, BN, 45, 1000, 100_000, 1 << 20):
        KB, NKB = triton_dense_kl._key_blocks(S)
        assert KB % BN == 0 and KB >= triton_dense_kl.MIN_BLOCK_TILES * BN
        assert (NKB - 1) * KB < S <= NKB * KB and NKB <= max(triton_dense_kl.MAX_KEY_BLOCKS, 1)
    monkeypatch.setattr(triton_dense_kl, "DK_PROGRAMS", 10_000)
    monkeypatch.setattr(triton_dense_kl, "DK_PARTIAL_BYTES", 3 * 45 * 16 * 4)
    for n in (1, BM, 5 * BM + 3, 100 * BM):
        QB = triton_dense_kl._query_blocks(n, 1, 45, 16)
        NQB = -(-n // QB)
        assert QB % BM == 0 and (NQB == 1 or NQB * 45 * 16 * 4 <= 3 * 45 * 16 * 4)


@interpreter
@pytest.mark.parametrize("cu", [None, [0, 7, 7, 30, 45]])
def test_chunked_kl_loss_takes_the_fused_form_and_equals_the_chunked_one(cu):
    """chunked_indexer_kl_loss's dense warm-up, backend "triton" (the fused kernels) against
    backend "torch" (the chunked reference): loss, valid queries, gradients."""
    cu = None if cu is None else torch.tensor(cu)
    q, k, q_idx, k_idx, w = inputs(1, 45, 45, 4, 2, 16, 3, 16, seed=3)
    want, want_valid = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, cu_seqlens=cu, backend="torch")
    want_grads = torch.autograd.grad(want, (q_idx, k_idx, w))
    got, valid = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, cu_seqlens=cu, backend="triton", budget_bytes=1)
    assert torch.equal(valid, want_valid)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, e in zip(torch.autograd.grad(got, (q_idx, k_idx, w)), want_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@interpreter
def test_a_nan_reaches_the_loss_and_gradients():
    """As in the reference, a NaN in the main attention's inputs makes the loss NaN: the query
    does not silently leave the mean."""
    q, k, q_idx, k_idx, w = inputs(1, 20, 20, 2, 1, 8, 2, 8, seed=4)
    q[0, 7, 1, 3] = float("nan")
    want, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, backend="torch")
    got, valid = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, backend="triton")
    assert want.isnan() and got.isnan() and valid.all()
    assert torch.autograd.grad(got, w)[0][0, 7].isnan().all()


def test_auto_keeps_cpu_and_fp32_on_the_chunked_form(monkeypatch):
    """auto fuses only 16-bit CUDA inputs: CPU training stays on the reference."""
    def refuse(*args, **kwargs):
        raise AssertionError("the fused dense KL ran under auto on the CPU")

    monkeypatch.setattr(triton_dense_kl, "dense_indexer_kl_triton", refuse)
    q, k, q_idx, k_idx, w = inputs(1, 20, 20, 2, 1, 8, 2, 8, seed=0)
    loss, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w)
    assert torch.isfinite(loss)
    assert not sa._dense_kl_fused("auto", q, k, q_idx, k_idx, w)
    assert sa._dense_kl_fused("triton", q, k, q_idx, k_idx, w)
    assert not sa._dense_kl_fused("torch", q, k, q_idx, k_idx, w)


@interpreter
def test_fused_form_keeps_no_scores_for_the_backward():
    """What autograd keeps is the inputs and per-query statistics, nothing [T, S] or [T, H, S]."""
    T = 64
    q, k, q_idx, k_idx, w = inputs(1, T, T, 2, 1, 8, 2, 8, seed=5)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        loss, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, backend="triton")
    assert saved and max(saved) < T * T / 2  # the largest is q_idx's T HI DI
    loss.backward()
    assert torch.isfinite(k_idx.grad).all()


@interpreter
def test_fused_form_names_bad_inputs():
    q, k, q_idx, k_idx, w = inputs(1, 8, 8, 2, 1, 8, 2, 8, seed=0)
    with pytest.raises(ValueError, match="q_idx/k_idx"):
        triton_dense_kl.dense_indexer_kl_triton(q, k, q_idx.detach().half(), k_idx, w)
    with pytest.raises(ValueError, match="interpreter reads bf16"):
        triton_dense_kl.dense_indexer_kl_triton(q.bfloat16(), k.bfloat16(), q_idx, k_idx, w)
    big = torch.randn(1, 8, 2, 320)
    with pytest.raises(ValueError, match="head dims"):
        triton_dense_kl.dense_indexer_kl_triton(big, big[:, :, :1], q_idx, k_idx, w)
    with pytest.raises(ValueError, match="k_idx"):
        triton_dense_kl.dense_indexer_kl_triton(q, k, q_idx, k_idx[:, :5], w)
    with pytest.raises(ValueError, match="dense_indexer_kl_triton: head dims"):
        sa.chunked_indexer_kl_loss(big, big[:, :, :1], q_idx, k_idx, w, backend="triton")


# --- GPU (bf16) -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "H, G, D, packed",
    [(16, 4, 128, False), (16, 16, 192, True), (16, 1, 128, False)],
    ids=["gqa", "mla-packed", "mqa"],
)
def test_gpu_bf16_fused_dense_kl(H, G, D, packed):
    """bf16 on the GPU, the layer's indexer shape (64 x 128): auto takes the fused form; loss and
    gradients against the fp32 reference; the backward is bitwise repeatable (no atomics)."""
    T = 1536
    q, k, q_idx, k_idx, w = inputs(1, T, T, H, G, D, 64, 128, seed=11, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 301, 1100, T], device="cuda") if packed else None
    assert sa._dense_kl_fused("auto", q, k, q_idx, k_idx, w)
    got, valid = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, cu_seqlens=cu, budget_bytes=T * 4 * 200)
    grads = torch.autograd.grad(got, (q_idx, k_idx, w))
    again, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, cu_seqlens=cu, budget_bytes=T * 4 * 200)
    assert torch.equal(again, got)
    for g, e in zip(torch.autograd.grad(again, (q_idx, k_idx, w)), grads):
        assert torch.equal(g, e)
    f32 = [x.detach().float().requires_grad_() for x in (q_idx, k_idx, w)]
    want, want_valid = sa.chunked_indexer_kl_loss(q.float(), k.float(), *f32, cu_seqlens=cu, backend="torch")
    assert torch.equal(valid, want_valid)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
    for g, e in zip(grads, torch.autograd.grad(want, f32)):
        err = ((g.float() - e).norm() / e.norm()).item()
        assert err < 2e-2, err
