"""The fused lightning indexer + top-k (ops/sparse_attention/triton_indexer.py) and the chunked
indexer KL loss, against the PyTorch reference.

CPU: Triton's interpreter in fp32 (tests/conftest.py sets TRITON_INTERPRET=1). Integer-valued
inputs make every score exact in any summation order, so there are many real ties and the
selections must be equal element for element (recall exactly 1.0 under the tie rule: equal
scores go to the lower key index). GPU (-m gpu): bf16 at the issue's indexer shapes.

Shape legend: B batch, T queries, S keys, HI / DI indexer heads / head dim, K top-k;
q_idx [B, T, HI, DI], k_idx [B, S, DI], weights [B, T, HI].
"""

import pytest
import torch

pytest.importorskip("triton")

from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.sparse_attention import reference, triton_indexer

interpreter = pytest.mark.skipif(
    not triton_indexer._INTERPRET,
    reason="CPU tensors need TRITON_INTERPRET=1 (conftest sets it without a GPU)",
)


def indexer_inputs(B, T, HI, DI, S=None, integer=True, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator(device=device).manual_seed(seed)
    S = T if S is None else S

    def make(*shape):
        if integer:  # small integers: exact products and sums, many equal scores
            return torch.randint(-2, 3, shape, generator=gen, device=device).to(dtype)
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return make(B, T, HI, DI), make(B, S, DI), make(B, T, HI)


def full_topk(q_idx, k_idx, w, topk, cu_seqlens=None, causal=True, q_positions=None):
    """The definition: every score, masked, then a stable descending sort."""
    scores = reference.lightning_indexer(q_idx, k_idx, w, causal, cu_seqlens, q_positions=q_positions)
    return reference.topk_indices(scores, topk).to(torch.int32)


def block_topk_brute(q_idx, k_idx, w, topk, bs, cu_seqlens=None, causal=True):
    """Block mode written out per query with Python loops (independent of _block_topk)."""
    scores = reference.lightning_indexer(q_idx, k_idx, w, causal, cu_seqlens)
    B, T, S = scores.shape
    nb = -(-S // bs)
    out = torch.full((B, T, topk), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            row = scores[b, t].tolist()
            best = [max(row[i * bs:(i + 1) * bs]) for i in range(nb)]
            blocks = sorted(range(nb), key=lambda i: (-best[i], i))[: -(-topk // bs)]
            keys = [s for i in sorted(blocks) for s in range(i * bs, min(S, (i + 1) * bs))]
            keys = [s for s in sorted(keys, key=lambda s: (-row[s], s)) if row[s] != float("-inf")]
            out[b, t, : min(topk, len(keys))] = torch.tensor(keys[:topk], dtype=torch.int32)
    return out


PACKED = torch.tensor([0, 5, 5, 40, 70])  # an empty sequence in the middle


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cu", [None, PACKED])
@pytest.mark.parametrize("topk", [9, 80])  # 80 > T: every readable key, then -1
def test_reference_lightning_indexer_topk_is_the_definition(causal, cu, topk):
    q_idx, k_idx, w = indexer_inputs(1, 70, 3, 8)
    got = reference.lightning_indexer_topk(q_idx, k_idx, w, topk, cu, causal=causal)
    assert got.dtype == torch.int32 and got.shape == (1, 70, topk)
    assert torch.equal(got, full_topk(q_idx, k_idx, w, topk, cu, causal))


@pytest.mark.parametrize("bs, topk", [(4, 9), (16, 9), (8, 16), (32, 40)])
@pytest.mark.parametrize("cu", [None, PACKED])
def test_reference_block_mode_matches_brute_force(bs, topk, cu):
    q_idx, k_idx, w = indexer_inputs(1, 70, 2, 4, seed=1)
    got = reference.lightning_indexer_topk(q_idx, k_idx, w, topk, cu, block_size=bs)
    assert torch.equal(got, block_topk_brute(q_idx, k_idx, w, topk, bs, cu))
    # every selected key lies in at most ceil(topk / bs) blocks
    for row in got[0].tolist():
        assert len({s // bs for s in row if s >= 0}) <= -(-topk // bs)


def test_block_mode_with_whole_blocks_is_token_mode_when_one_block_holds_all():
    """bs >= S: one block, every key in it: block mode = token mode."""
    q_idx, k_idx, w = indexer_inputs(1, 33, 2, 4, seed=2)
    token = reference.lightning_indexer_topk(q_idx, k_idx, w, 7)
    assert torch.equal(reference.lightning_indexer_topk(q_idx, k_idx, w, 7, block_size=64), token)


@interpreter
@pytest.mark.parametrize("B, T, HI, DI", [(1, 70, 3, 24), (2, 37, 1, 16), (1, 50, 4, 40)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [None, 8])
def test_triton_equals_reference_with_ties(B, T, HI, DI, causal, block_size):
    q_idx, k_idx, w = indexer_inputs(B, T, HI, DI, seed=T)
    for topk in (5, 16, T + 3):
        want = reference.lightning_indexer_topk(q_idx, k_idx, w, topk, block_size=block_size, causal=causal)
        got = sa.lightning_indexer_topk(q_idx, k_idx, w, topk, block_size=block_size, causal=causal, backend="triton")
        assert got.dtype == torch.int32
        assert torch.equal(got, want), (topk, (got != want).sum())


@interpreter
@pytest.mark.parametrize("block_size", [None, 4, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_packed_sequences(block_size, causal, monkeypatch):
    if block_size is None and causal:  # the radix select's form (the default is torch.topk's)
        monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "radix")
    q_idx, k_idx, w = indexer_inputs(1, 70, 2, 16, seed=3)
    want = reference.lightning_indexer_topk(q_idx, k_idx, w, 12, PACKED, block_size, causal)
    got = sa.lightning_indexer_topk(q_idx, k_idx, w, 12, PACKED, block_size, causal, backend="triton")
    assert torch.equal(got, want)
    # a query never selects a key of another packed sequence or a later one
    seq = torch.searchsorted(PACKED[1:], torch.arange(70), right=True)
    for t, row in enumerate(got[0].tolist()):
        for s in row:
            if s >= 0:
                assert seq[s] == seq[t] and (s <= t or not causal)


@interpreter
def test_triton_queries_among_keys():
    """q_positions (context parallelism): T queries at given global indices among S keys."""
    q_idx, k_idx, w = indexer_inputs(1, 20, 2, 16, S=64, seed=4)
    pos = torch.tensor(sorted(torch.randperm(64, generator=torch.Generator().manual_seed(0))[:20].tolist()))
    want = full_topk(q_idx, k_idx, w, 10, q_positions=pos)
    got = sa.lightning_indexer_topk(q_idx, k_idx, w, 10, q_positions=pos, backend="triton")
    assert torch.equal(got, want)
    # the int64 indexer_topk contract from the same kernel
    got64 = sa.indexer_topk(q_idx, k_idx, w, 10, q_positions=pos, backend="triton")
    assert got64.dtype == torch.int64 and torch.equal(got64, want.long())


@interpreter
def test_triton_real_valued_scores_select_the_top():
    """Random normal inputs: the kernel sums heads in another order than the reference, so
    scores may differ in the last ulp; the selected keys' reference scores must equal the
    reference's top-k scores (within rounding), row by row."""
    q_idx, k_idx, w = indexer_inputs(2, 64, 4, 32, integer=False, seed=5)
    scores = reference.lightning_indexer(q_idx, k_idx, w)
    got = sa.lightning_indexer_topk(q_idx, k_idx, w, 20, backend="triton").long()
    want = reference.topk_indices(scores, 20)
    assert torch.equal(got < 0, want < 0)
    picked = scores.gather(-1, got.clamp(min=0)).masked_fill(got < 0, 0)
    best = scores.gather(-1, want.clamp(min=0)).masked_fill(want < 0, 0)
    torch.testing.assert_close(picked, best, rtol=1e-5, atol=1e-5)
    assert (got == want).float().mean() > 0.99


def order_keys(scores):
    """fp32 scores -> the kernel's int32 order keys (-0.0 taken as +0.0)."""
    bits = (scores + 0.0).view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@interpreter
@pytest.mark.parametrize("block", [16, 1024])  # 16: each row crosses many blocks of the scan
@pytest.mark.parametrize("threshold, order", [("radix", "kernel"), ("radix", "torch"), ("topk", "torch")])
def test_select_rows_keeps_the_lowest_ties(monkeypatch, block, threshold, order):
    """The threshold + compaction + short sort selection equals the stable sort's, row by row,
    with ties at the threshold, a row of one value, signed zeros and unreadable keys; the radix
    form ordering its selection in the kernel or with torch.sort."""
    monkeypatch.setattr(triton_indexer, "COMPACT_BLOCK", block)
    monkeypatch.setattr(triton_indexer, "RADIX_BLOCK", block)
    monkeypatch.setattr(triton_indexer, "RADIX_CBLOCK", block)
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", threshold)
    monkeypatch.setattr(triton_indexer, "SELECT_SORT", order)
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (7, 100), generator=gen).float()
    scores[1] = 2.0
    scores[2, 40:] = float("-inf")  # fewer readable keys than some topk below
    scores[3] = torch.where(scores[3] > 0, 0.0, -0.0)  # only zeros, of both signs
    scores[4, ::3] = float("-inf")
    scores[5] = torch.randn(100, generator=gen)
    for topk in (1, 7, 33, 50, 99):
        want = reference.topk_indices(scores[None], topk)[0].to(torch.int32)
        got = triton_indexer._select_rows(order_keys(scores), topk)
        assert got.dtype == torch.int32
        assert torch.equal(got, want), (topk, (got != want).nonzero()[:5].tolist())


def _thresholds_by_sort(ords, topk):
    """Each row's topk-th largest key and the count above it, from a full sort."""
    kth = ords.sort(-1, descending=True).values[:, topk - 1]
    return kth, (ords > kth[:, None]).sum(-1, dtype=torch.int32)


@interpreter
@pytest.mark.parametrize("bits, block", [(8, 16), (8, 4096), (11, 64), (6, 32), (12, 128)])
def test_radix_thresholds(monkeypatch, bits, block):
    """_radix_kth_kernel's k-th largest key and count above it equal a full sort's, at digit
    widths that divide 32 and ones that do not (the last digit shorter), over rows of ties, one
    value, the int32 extremes (INT32_MIN is block mode's padding), -inf and signed zeros, and
    random scores; blocks of 16 make each row cross many blocks of every pass."""
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "radix")
    monkeypatch.setattr(triton_indexer, "RADIX_BITS", bits)
    monkeypatch.setattr(triton_indexer, "RADIX_BLOCK", block)
    calls, real = [], triton_indexer._radix_kth_kernel
    monkeypatch.setattr(triton_indexer, "_radix_kth_kernel", Spy(real, calls))
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(-3, 4, (8, 301), generator=gen).float()
    scores[1] = 2.0
    scores[2, 40:] = float("-inf")
    scores[3] = torch.where(scores[3] > 0, 0.0, -0.0)
    scores[4] = torch.randn(301, generator=gen) * 1e3
    scores[5] = torch.randn(301, generator=gen) * 1e-30
    ords = order_keys(scores)
    ords[6] = torch.randint(-(1 << 31), (1 << 31) - 1, (301,), generator=gen, dtype=torch.int64).to(torch.int32)
    ords[6, ::7] = triton_indexer.INT32_MIN
    ords[7, ::2] = (1 << 31) - 1
    ords[7, 1::2] = triton_indexer.INT32_MIN
    for topk in (1, 2, 37, 150, 151, 300, 301):
        kth, above = triton_indexer._thresholds(ords, topk)
        want_kth, want_above = _thresholds_by_sort(ords, topk)
        assert torch.equal(kth, want_kth), (bits, topk, (kth != want_kth).nonzero()[:3].tolist())
        assert torch.equal(above, want_above), (bits, topk)
    # a strided view: rows of a wider buffer
    wide = torch.cat([ords, ords.flip(-1)], -1)[:, :301]
    assert torch.equal(triton_indexer._thresholds(wide, 37)[0], _thresholds_by_sort(wide.contiguous(), 37)[0])
    assert len(calls) == 8  # every threshold above came from the radix kernel


class Spy:
    """A launched kernel's stand-in that records each launch's grid and runs the kernel."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def _run_maxima(ords, run):
    """The scoring kernel's bmax: each run of `run` keys' largest order key (past the row: -inf)."""
    N, Sc = ords.shape
    pad = -Sc % run
    padded = torch.cat([ords, ords.new_full((N, pad), triton_indexer.ORD_NEG_INF)], 1)
    return padded.view(N, -1, run).amax(-1).contiguous()


def _long_rows():
    """[8, 203] order keys for the runs-first selections: rows of a few values (ties at the
    threshold spread over many runs), one value throughout, unreadable keys (fewer readable than
    topk, a causal tail), signed zeros, random ones."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(-3, 4, (8, 203), generator=gen).float()
    scores[1] = 2.0
    scores[2, 30:] = float("-inf")
    scores[3] = torch.where(scores[3] > 0, 0.0, -0.0)
    scores[4, ::3] = float("-inf")
    scores[5] = torch.randn(203, generator=gen)
    scores[6, 150:] = float("-inf")
    scores[7] = torch.randn(203, generator=gen)
    return order_keys(scores)


@interpreter
@pytest.mark.parametrize("run, threshold", [(1, "topk"), (3, "radix"), (4, "topk"), (8, "radix")])
def test_select_by_blocks_equals_select_rows(monkeypatch, run, threshold):
    """The runs-first selection of long rows equals the whole-row one, ties included: rows of a
    few values (ties at the threshold spread over many runs), one value throughout, unreadable
    keys (fewer readable than topk, a causal tail), signed zeros; row chunks crossed."""
    monkeypatch.setattr(triton_indexer, "SELECT_BLOCK_ROWS", 3)
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", threshold)
    ords = _long_rows()
    for topk in (1, 5, 17, 40):
        if -(-203 // run) <= topk:
            continue
        want = triton_indexer._select_rows(ords, topk)
        got = triton_indexer._select_by_blocks(ords, _run_maxima(ords, run), topk, run)
        assert got.dtype == torch.int32
        assert torch.equal(got, want), (run, topk, (got != want).nonzero()[:5].tolist())


@interpreter
@pytest.mark.parametrize("run, cap, order", [(1, 2, "kernel"), (3, 2, "torch"), (4, 1, "kernel"), (8, 2, "torch")])
def test_select_by_runs_equals_select_rows(monkeypatch, run, cap, order):
    """The radix form's runs-first selection (_select_by_runs_kernel: only the runs that reach
    the K-th best run's key are read) equals the whole-row one, ties included, on the rows of
    test_select_by_blocks_equals_select_rows; with room for cap * topk candidates, rows of many
    ties overflow it and take the whole row (both branches run: counted below). The qualifying
    runs are listed over several steps of the runs' maxima (SELECT_RUNS_LIST_BLOCK 8)."""
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "radix")
    monkeypatch.setattr(triton_indexer, "SELECT_CANDIDATES", cap)
    monkeypatch.setattr(triton_indexer, "SELECT_RUNS_KEYS", 16)  # many steps a row
    monkeypatch.setattr(triton_indexer, "SELECT_SORT", order)
    monkeypatch.setattr(triton_indexer, "SELECT_RUNS_LIST_BLOCK", 8)
    ords = _long_rows()
    overflowed = set()
    for topk in (1, 5, 17, 40):
        if -(-203 // run) <= topk:
            continue
        want = triton_indexer._select_rows(ords, topk)
        bmax = _run_maxima(ords, run)
        got = triton_indexer._select_by_runs(ords, bmax, topk, run)
        assert got.dtype == torch.int32
        assert torch.equal(got, want), (run, topk, (got != want).nonzero()[:5].tolist())
        # each row's branch: more than cap * topk runs reach the K-th best run's key (the whole
        # row without reading keys), more than cap * topk keys do, or they fit
        run_kth = bmax.sort(-1, descending=True).values[:, topk - 1]
        keys, runs = (ords >= run_kth[:, None]).sum(-1), (bmax >= run_kth[:, None]).sum(-1)
        overflowed |= {"runs" if r > cap * topk else "keys" if k > cap * topk else "fits"
                       for k, r in zip(keys.tolist(), runs.tolist())}
    assert overflowed == ({"runs", "fits"} if run == 1 else {"runs", "keys", "fits"})


@interpreter
@pytest.mark.parametrize("cu, q_positions, fp8", [(None, None, False), (PACKED, None, False),
                                                  (None, torch.arange(30, 70), True)])
def test_triton_selects_long_rows_by_runs(monkeypatch, cu, q_positions, fp8):
    """Rows of at least SELECT_BLOCK_MIN_KEYS keys: the kernel writes the runs' maxima and the
    selection goes through them; equal to the reference element for element (integer inputs,
    many ties), causal and full, packed, queries among keys, fp8 rows (with the radix select's
    form: its runs kernel)."""
    radix = fp8
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "radix" if radix else "topk")
    monkeypatch.setattr(triton_indexer, "SELECT_BLOCK", 4)
    monkeypatch.setattr(triton_indexer, "SELECT_BLOCK_MIN_KEYS", 32)
    monkeypatch.setattr(triton_indexer, "RADIX_RUNS_MIN_KEYS", 32)
    name = "_select_by_runs" if radix else "_select_by_blocks"
    calls, real = [], getattr(triton_indexer, name)
    monkeypatch.setattr(triton_indexer, name, lambda *a: calls.append(a[3]) or real(*a))
    q_idx, k_idx, w = indexer_inputs(1, 70 if q_positions is None else 40, 2, 32, S=70, seed=9)
    ks = None
    if fp8:
        q_idx, k_idx, w, ks = sa.indexer_fp8_inputs(q_idx, k_idx, w, rotate=False)
    for causal in (True, False):
        for topk in (3, 9):
            want = reference.lightning_indexer_topk(q_idx, k_idx, w, topk, cu, None, causal, q_positions, k_scale=ks)
            got = sa.lightning_indexer_topk(q_idx, k_idx, w, topk, cu, None, causal, q_positions, "triton", k_scale=ks)
            assert torch.equal(got, want), (causal, topk, (got != want).sum())
    assert calls and set(calls) == {4}


@interpreter
def test_triton_chunks_bound_memory(monkeypatch):
    """A small budget splits the queries into chunks; each chunk's [Tc, Sc] int32 keys stay
    within it (or one BQ-row tile); the result does not change."""
    q_idx, k_idx, w = indexer_inputs(1, 96, 2, 16, seed=6)
    want = reference.lightning_indexer_topk(q_idx, k_idx, w, 8)
    shapes = []
    select = triton_indexer._select

    def spy(keys, topk, block_size, bmax=None):
        shapes.append(tuple(keys.shape))
        return select(keys, topk, block_size, bmax)

    monkeypatch.setattr(triton_indexer, "_select", spy)
    budget = 16 * 96 * 4 * 2  # two 16-query tiles at the full width
    got = triton_indexer.lightning_indexer_topk_triton(q_idx, k_idx, w, 8, budget_bytes=budget)
    assert torch.equal(got, want)
    assert len(shapes) > 1
    for _, Tc, Sc in shapes:
        assert Tc * Sc * triton_indexer.KEY_BYTES <= budget
    # causal: a chunk reads only the keys up to its last query
    assert shapes[0][2] == shapes[0][1]


def test_bad_arguments_name_the_field():
    q_idx, k_idx, w = indexer_inputs(1, 8, 2, 4)
    for backend in ("torch",) + (("triton",) if triton_indexer._INTERPRET else ()):
        with pytest.raises(ValueError, match="block_size must be None"):
            sa.lightning_indexer_topk(q_idx, k_idx, w, 2, block_size=0, backend=backend)
        with pytest.raises(ValueError, match="topk must"):
            sa.lightning_indexer_topk(q_idx, k_idx, w, 0, backend=backend)
        with pytest.raises(ValueError, match="weights must"):
            sa.lightning_indexer_topk(q_idx, k_idx, w[:, :, :1], 2, backend=backend)


# --- the chunked KL loss ----------------------------------------------------------------------


def kl_inputs(T, H=4, G=2, D=8, HI=3, DI=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=gen, dtype=dtype)
    k = torch.randn(1, T, G, D, generator=gen, dtype=dtype)
    q_idx = torch.randn(1, T, HI, DI, generator=gen, dtype=dtype, requires_grad=True)
    k_idx = torch.randn(1, T, DI, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(1, T, HI, generator=gen, dtype=dtype, requires_grad=True)
    return q, k, q_idx, k_idx, w


@pytest.mark.parametrize("stage", ["dense", "sparse"])
@pytest.mark.parametrize("cu", [None, PACKED[PACKED <= 40].tolist() + [45]])
def test_chunked_kl_loss_equals_the_one_shot_loss(stage, cu):
    T = 45
    cu = None if cu is None else torch.tensor(cu)
    q, k, q_idx, k_idx, w = kl_inputs(T)
    indices = None
    if stage == "sparse":
        indices = reference.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), 6, cu).long()
    # the definition: whole [T, S or K] scores and target
    target = reference.attention_probs_target(q, k, indices, cu_seqlens=cu)
    if indices is None:
        scores = reference.lightning_indexer(q_idx, k_idx, w, cu_seqlens=cu)
    else:
        scores = reference.lightning_indexer_sparse(q_idx, k_idx, w, indices)
    want = reference.indexer_kl_loss(scores, target, indices)
    want_valid = reference.indexer_kl_valid_queries(scores.detach(), target, indices)
    want_grads = torch.autograd.grad(want, (q_idx, k_idx, w))
    for budget in (None, 1):  # one chunk; one query per chunk
        got, valid = sa.chunked_indexer_kl_loss(
            q, k, q_idx, k_idx, w, indices, cu_seqlens=cu, budget_bytes=budget
        )
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(valid, want_valid)
        for g, e in zip(torch.autograd.grad(got, (q_idx, k_idx, w)), want_grads):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_target_from_the_attention_lse_equals_the_softmax_target():
    """sparse_probs_target (attention lse, no softmax of its own) = attention_probs_target x H,
    in chunks too; the loss with lse equals the loss without, value and gradients."""
    T = 45
    q, k, q_idx, k_idx, w = kl_inputs(T, seed=7)
    indices = reference.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), 6).long()
    _, lse = reference.sparse_attention(q, k, k, indices)
    want = reference.attention_probs_target(q, k, indices) * q.shape[2]
    for budget in (None, 1):
        got = sa.sparse_probs_target(q, k, indices, lse, budget_bytes=budget)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    plain, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, indices)
    g_plain = torch.autograd.grad(plain, (q_idx, k_idx, w))
    with_lse, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, indices, lse=lse, budget_bytes=1)
    torch.testing.assert_close(with_lse, plain, rtol=1e-12, atol=1e-12)
    for g, e in zip(torch.autograd.grad(with_lse, (q_idx, k_idx, w)), g_plain):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="lse must be"):
        sa.sparse_probs_target(q, k, indices, lse[:, :, :1])
    # the target made beside the attention (sparse_attention_with_target) gives the same loss
    o, lse2, target = sa.sparse_attention_with_target(q, k, k, indices)
    torch.testing.assert_close(lse2, lse, rtol=0, atol=0)
    given, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, indices, target=target, budget_bytes=1)
    torch.testing.assert_close(given, plain, rtol=1e-12, atol=1e-12)
    for g, e in zip(torch.autograd.grad(given, (q_idx, k_idx, w)), g_plain):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="target must be"):
        sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, indices, target=target[:, :, :1])


def test_chunked_kl_loss_holds_one_chunk_at_a_time():
    """With a budget of a few queries, what autograd keeps is the inputs, not [T, S] scores."""
    T = 64
    q, k, q_idx, k_idx, w = kl_inputs(T, dtype=torch.float32)
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, budget_bytes=8 * 64 * 60)
    assert max(saved) < T * T  # no [T, S] tensor is kept for the backward
    loss.backward()
    assert q_idx.grad is not None and torch.isfinite(q_idx.grad).all()


# --- GPU (bf16) -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("HI, DI, T", [(64, 128, 4096), (16, 64, 8192)])
@pytest.mark.parametrize("runs", [None, "topk", "radix"], ids=["rows", "runs", "radix-runs"])
def test_gpu_bf16_selection(HI, DI, T, runs, monkeypatch):
    """runs: the long rows' selection through the runs' maxima, in the form named (_runs_at)."""
    calls = _runs_at(monkeypatch, T, runs)
    # integer-valued bf16: exact scores, so the selection equals the reference's exactly
    q_idx, k_idx, w = indexer_inputs(1, T, HI, DI, device="cuda", dtype=torch.bfloat16)
    want = reference.lightning_indexer_topk(q_idx, k_idx, w, 2048)
    got = sa.lightning_indexer_topk(q_idx, k_idx, w, 2048)  # auto: the Triton kernel
    assert torch.equal(got, want)
    block = sa.lightning_indexer_topk(q_idx, k_idx, w, 2048, block_size=64)
    assert torch.equal(block, reference.lightning_indexer_topk(q_idx, k_idx, w, 2048, block_size=64))
    # real-valued bf16: the selected keys' fp32 reference scores are the top ones
    q_idx, k_idx, w = (x.float().div(4).bfloat16() for x in indexer_inputs(1, T, HI, DI, integer=False, device="cuda"))
    got = sa.lightning_indexer_topk(q_idx, k_idx, w, 2048).long()
    want = reference.lightning_indexer_topk(q_idx, k_idx, w, 2048).long()
    assert torch.equal(got < 0, want < 0)
    rows = torch.arange(0, T, 97, device="cuda")
    scores = reference.lightning_indexer(q_idx[:, rows], k_idx, w[:, rows], q_positions=rows)
    picked = scores.gather(-1, got[:, rows].clamp(min=0)).masked_fill(got[:, rows] < 0, 0)
    best = scores.gather(-1, want[:, rows].clamp(min=0)).masked_fill(want[:, rows] < 0, 0)
    torch.testing.assert_close(picked, best, rtol=1e-4, atol=1e-3)
    assert bool(calls) == bool(runs)


def _runs_at(monkeypatch, T, form):
    """Rows of T keys select through the runs' maxima in the given form ("topk", "radix"; None:
    leave the settings): runs of 1 or 2 keys, so that a row holds more than 2048 of them (else
    _select takes the whole row). Returns the list of the runs selections' calls."""
    calls = []
    if form is None:
        return calls
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", form)
    monkeypatch.setattr(triton_indexer, "SELECT_BLOCK", 1 if T <= 4096 else 2)
    monkeypatch.setattr(triton_indexer, "SELECT_BLOCK_MIN_KEYS", 2048)
    monkeypatch.setattr(triton_indexer, "RADIX_RUNS_MIN_KEYS", 2048)
    name = "_select_by_runs" if form == "radix" else "_select_by_blocks"
    real = getattr(triton_indexer, name)
    monkeypatch.setattr(triton_indexer, name, lambda *a: calls.append(a[3]) or real(*a))
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits", [8, 11])
def test_gpu_radix_thresholds(bits, monkeypatch):
    """The radix select's thresholds on the GPU equal torch.topk's over long rows: random fp32
    order keys with a causal -inf tail, many ties, and block mode's INT32_MIN padding."""
    monkeypatch.setattr(triton_indexer, "RADIX_BITS", bits)
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "radix")
    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(512, 40000, generator=gen, device="cuda")
    scores[:, 30000:] = float("-inf")
    scores[1] = torch.randint(-2, 3, (40000,), generator=gen, device="cuda").float()
    scores[2, ::3] = 0.5
    ords = order_keys(scores)
    ords[3, 100:] = triton_indexer.INT32_MIN
    for topk in (2048, 512, 39999):
        got = triton_indexer._thresholds(ords, topk)
        monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "topk")
        want = triton_indexer._thresholds(ords, topk)
        monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "radix")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), topk


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("order", ["kernel", "torch"])
def test_gpu_radix_selection(order, monkeypatch):
    """The radix form's whole-row and runs-first selections on the GPU (8 warps, the barriers
    between one thread's stores and another's loads) equal torch.topk's form over long rows:
    random scores with causal tails, rows of few values (their candidates overflow the runs'
    room and take the whole row) and one value throughout."""
    monkeypatch.setattr(triton_indexer, "SELECT_SORT", order)
    gen = torch.Generator(device="cuda").manual_seed(1)
    S, K, run = 131072, 2048, triton_indexer.SELECT_BLOCK
    scores = torch.randn(384, S, generator=gen, device="cuda")
    scores[::3, S // 2:] = float("-inf")
    scores[1:64:4] = torch.randint(-2, 3, (16, S), generator=gen, device="cuda").float()
    scores[5] = 1.0
    ords = order_keys(scores)
    bmax = _run_maxima(ords, run)
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "topk")
    want = triton_indexer._select_rows(ords, K)
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "radix")
    assert torch.equal(triton_indexer._select_rows(ords, K), want)
    assert torch.equal(triton_indexer._select_by_runs(ords, bmax, K, run), want)
    # the default ("auto") at this length: the radix form, by runs
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "auto")
    assert triton_indexer._form(S) == "radix" and triton_indexer._takes_runs(S)
    assert torch.equal(triton_indexer._select(ords[None], K, None, bmax[None])[0], want)


def test_auto_form_by_row_length(monkeypatch):
    """SELECT_THRESHOLD "auto": the radix form for rows of at least RADIX_AUTO_MIN_KEYS keys on
    the GPU (by runs from RADIX_RUNS_MIN_KEYS, 1M-key rows included), torch.topk's below and in
    the interpreter."""
    lo = triton_indexer.RADIX_AUTO_MIN_KEYS
    monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", "auto")
    monkeypatch.setattr(triton_indexer, "_INTERPRET", False)
    assert [triton_indexer._form(n) for n in (lo - 1, lo, 1 << 20)] == ["topk", "radix", "radix"]
    runs_at = triton_indexer.RADIX_RUNS_MIN_KEYS
    assert triton_indexer._takes_runs(max(lo, runs_at)) and not triton_indexer._takes_runs(lo - 1)
    assert triton_indexer._takes_runs(triton_indexer.SELECT_BLOCK_MIN_KEYS)
    monkeypatch.setattr(triton_indexer, "_INTERPRET", True)
    assert triton_indexer._form(lo) == triton_indexer._form(1 << 20) == "topk"
    for form in ("topk", "radix"):
        monkeypatch.setattr(triton_indexer, "SELECT_THRESHOLD", form)
        assert triton_indexer._form(lo - 1) == triton_indexer._form(1 << 20) == form


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("H, G, D, DV", [(16, 1, 576, 512), (16, 4, 128, 128)])
def test_gpu_bf16_chunked_kl_loss(H, G, D, DV, monkeypatch):
    """The bf16 fast paths (target from the Triton attention's lse with bf16 products, index
    scores at the selection on tensor cores) against the fp32 reference loss and gradients."""
    T, K = 1024, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, H, D, generator=gen, device="cuda").bfloat16()
    k = torch.randn(1, T, G, D, generator=gen, device="cuda").bfloat16()
    q_idx, k_idx, w = (x.float().div(4).bfloat16().requires_grad_() for x in indexer_inputs(1, T, 8, 64, integer=False, device="cuda"))
    idx = sa.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), K)
    _, lse = sa.sparse_attention(q, k, k[..., :DV], idx)  # Triton
    got, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, idx, lse=lse, budget_bytes=64 << 20)
    # the target summed from the products forward's own fp32 probabilities gives the same loss
    from megatron_moe_hybrid.ops.sparse_attention import triton_sparse

    monkeypatch.setattr(triton_sparse, "FORWARD_FORM", "products")
    _, _, made = triton_sparse.sparse_attention_triton(q, k, k[..., :DV], idx, with_target=True)
    fused, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, idx, target=made, budget_bytes=64 << 20)
    torch.testing.assert_close(fused, got, rtol=1e-3, atol=1e-5)
    grads = torch.autograd.grad(got, (q_idx, k_idx, w))
    # the key gradient is summed per key in a fixed order (no atomics): two runs agree bitwise
    again, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, idx, lse=lse, budget_bytes=64 << 20)
    assert torch.equal(torch.autograd.grad(again, k_idx)[0], grads[1])
    f32 = [x.detach().float().requires_grad_() for x in (q_idx, k_idx, w)]
    target = reference.attention_probs_target(q.float(), k.float(), idx.long())
    want = reference.indexer_kl_loss(reference.lightning_indexer_sparse(*f32, idx.long()), target, idx.long())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-3)
    for g, e in zip(grads, torch.autograd.grad(want, f32)):
        err = ((g.float() - e).norm() / e.norm()).item()
        assert err < 2e-2, err


@interpreter
@pytest.mark.parametrize("HI, DI", [(3, 24), (1, 16), (20, 40)])
def test_triton_sparse_index_scores_forward_and_gradients(HI, DI):
    """lightning_indexer_sparse_triton (forward and every gradient) against the reference, with
    -1 slots, a key chosen by many queries, and B = 2; the backward's key contributions are
    summed in chunks (a small CONTRIB_BUDGET_BYTES) and must not change the result."""
    B, T, K = 2, 29, 11
    gen = torch.Generator().manual_seed(HI)
    q_idx = torch.randn(B, T, HI, DI, generator=gen, requires_grad=True)
    k_idx = torch.randn(B, T, DI, generator=gen, requires_grad=True)
    w = torch.randn(B, T, HI, generator=gen, requires_grad=True)
    idx = reference.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), K).long()
    idx[:, 5, 3] = -1  # a hole inside a row
    want = reference.lightning_indexer_sparse(q_idx, k_idx, w, idx)
    d = torch.randn(want.shape, generator=gen).masked_fill(idx < 0, 0.0)
    want_g = torch.autograd.grad(want, (q_idx, k_idx, w), d)
    for budget in (triton_indexer.CONTRIB_BUDGET_BYTES, K * DI * 4 * 2 * 3):
        triton_indexer.CONTRIB_BUDGET_BYTES, saved = budget, triton_indexer.CONTRIB_BUDGET_BYTES
        try:
            got = triton_indexer.lightning_indexer_sparse_triton(q_idx, k_idx, w, idx.int())
            got_g = torch.autograd.grad(got, (q_idx, k_idx, w), d)
        finally:
            triton_indexer.CONTRIB_BUDGET_BYTES = saved
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, e in zip(got_g, want_g):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@interpreter
def test_chunked_kl_loss_on_the_triton_index_scores():
    """The loss with backend="triton" (the Triton index scores) equals the reference loss."""
    q, k, q_idx, k_idx, w = kl_inputs(40, dtype=torch.float32, seed=9)
    idx = reference.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), 6).long()
    _, lse = reference.sparse_attention(q, k, k, idx)
    want, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, idx, backend="torch")
    want_g = torch.autograd.grad(want, (q_idx, k_idx, w))
    got, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, idx, lse=lse, budget_bytes=1, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, e in zip(torch.autograd.grad(got, (q_idx, k_idx, w)), want_g):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@interpreter
def test_fused_kl_loss_sizes_its_chunks_by_the_fused_rows(monkeypatch):
    """With the fused index scores a chunk holds KL_FUSED_ROWS fp32 [K] rows per query (no
    [Tc, HI, K] logits): a budget of 7 queries' rows makes ceil(40 / 7) chunks; the
    reference scores keep their own per-query size."""
    T, K = 40, 6
    q, k, q_idx, k_idx, w = kl_inputs(T, dtype=torch.float32, seed=9)
    idx = reference.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), K).long()
    calls = []
    kl_sum = reference.indexer_kl_sum
    monkeypatch.setattr(reference, "indexer_kl_sum", lambda *a: calls.append(a[0].shape[1]) or kl_sum(*a))
    budget = 7 * K * 4 * sa.KL_FUSED_ROWS
    with torch.no_grad():
        fused, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, idx, budget_bytes=budget, backend="triton")
    assert calls == [7] * 5 + [5]
    calls.clear()
    with torch.no_grad():
        plain, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, idx, budget_bytes=budget, backend="torch")
    HI, DI = q_idx.shape[2:]
    tc = budget // (K * (4 * (2 * HI + 4) + 2 * DI))  # the reference's [Tc, HI, K] logits per query
    assert tc != 7 and calls == [min(tc, T - t0) for t0 in range(0, T, tc)]
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


@interpreter
@pytest.mark.parametrize("H, G, D", [(4, 2, 8), (20, 1, 24), (3, 3, 40)])
def test_triton_kl_target_equals_the_gathered_one(H, G, D):
    """sparse_probs_target's Triton kernel (one program per query, key rows read in place,
    heads in blocks of 16, D split as the attention kernels split it) = the torch path."""
    B, T, K = 2, 23, 9
    gen = torch.Generator().manual_seed(H + D)
    q = torch.randn(B, T, H, D, generator=gen)
    k = torch.randn(B, T, G, D, generator=gen)
    idx = torch.stack([reference.lightning_indexer_topk(*indexer_inputs(1, T, 2, 8, seed=b), K)[0] for b in range(B)])
    idx[1, 7, 2] = -1
    _, lse = reference.sparse_attention(q, k, k, idx.long())
    want = sa.sparse_probs_target(q, k, idx.long(), lse, backend="torch")
    got = sa.sparse_probs_target(q, k, idx, lse, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got[idx < 0] == 0).all()


@interpreter
def test_triton_kl_kernels_name_bad_arguments():
    q_idx, k_idx, w = indexer_inputs(1, 8, 2, 16)
    with pytest.raises(ValueError, match="indices must be an integer"):
        triton_indexer.lightning_indexer_sparse_triton(q_idx, k_idx, w, torch.zeros(1, 8, 4))
    with pytest.raises(ValueError, match="HI <= 128"):
        triton_indexer.lightning_indexer_sparse_triton(
            torch.zeros(1, 8, 129, 16), k_idx, torch.zeros(1, 8, 129), torch.zeros(1, 8, 4, dtype=torch.int32)
        )
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
    idx = torch.zeros(1, 8, 4, dtype=torch.int64)
    from megatron_moe_hybrid.ops.sparse_attention.triton_sparse import sparse_probs_target_triton

    with pytest.raises(ValueError, match="lse must be"):
        sparse_probs_target_triton(q, k, idx, torch.zeros(1, 8, 3))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("packed", [False, True], ids=["one", "packed"])
@pytest.mark.parametrize("shifted", [False, True], ids=["q=k", "q_positions"])
def test_last_keys_on_host_equal_the_device_ranges(causal, packed, shifted):
    """The indexer's chunk plan takes each query's last readable key on the host: where it follows
    from the arguments (causal without q_positions, or neither causal nor packed) it is built
    there without touching the device tensor (a meta tensor stands in for it), and in every
    case it equals read_ranges' hi."""
    S = 50
    cu = torch.tensor([0, 7, 7, 30, 50]) if packed else None
    q_positions = torch.tensor([3, 9, 10, 29, 30, 31, 49]) if shifted else None
    T = S if q_positions is None else q_positions.numel()
    _, hi = triton_indexer.read_ranges(1, T, S, causal, cu, q_positions, torch.device("cpu"))
    got = triton_indexer.last_keys_on_host(hi, T, S, causal, cu, q_positions)
    assert got.dtype == hi.dtype and torch.equal(got, hi)
    if q_positions is None and (causal or cu is None):
        on_meta = triton_indexer.last_keys_on_host(hi.to("meta"), T, S, causal, cu, q_positions)
        assert on_meta.device.type == "cpu" and torch.equal(on_meta, hi)


# --- fp8 scoring (DeepSeek-V3.2's fp8_index) ----------------------------------------------------


def _recall(got, want):
    """Share of want's selected keys (>= 0) that got selects, row by row."""
    hits = total = 0
    for g, w_ in zip(got.reshape(-1, got.shape[-1]).tolist(), want.reshape(-1, want.shape[-1]).tolist()):
        keys = {s for s in w_ if s >= 0}
        hits += len(keys & set(g))
        total += len(keys)
    return hits / max(total, 1)


def test_quantize_fp8_rows_scales_by_powers_of_two():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, 64, generator=gen, dtype=torch.float64) * torch.logspace(-6, 6, 40, dtype=torch.float64)[:, None]
    x[2, 3] = 0  # an all-zero row
    x8, scale = reference.quantize_fp8_rows(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
    assert scale[2, 3] == 1 and not x8[2, 3].float().any()
    top = x8.float().abs().amax(-1)
    live = x.abs().amax(-1) > 0
    assert (top[live] >= 224).all() and (top <= reference.FP8_MAX).all()  # each row fills fp8's top binade
    back = x8.double() * scale.double()[..., None]
    # e4m3: 3 mantissa bits, so at most 2^-4 relative error; below 2^-6 (subnormal) 2^-10 absolute
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale.double()[..., None] * 2**-10).all()


def test_hadamard_rotate_keeps_dot_products():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 128, generator=gen, dtype=torch.float64), torch.randn(7, 128, generator=gen, dtype=torch.float64)
    hq, hk = reference.hadamard_rotate(q), reference.hadamard_rotate(k)
    torch.testing.assert_close(hq @ hk.T, q @ k.T, rtol=1e-12, atol=1e-12)
    # it spreads a one-channel row over every channel
    spike = torch.zeros(1, 128, dtype=torch.float64)
    spike[0, 5] = 1
    torch.testing.assert_close(reference.hadamard_rotate(spike).abs(), torch.full((1, 128), 128**-0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="power of 2"):
        reference.hadamard_rotate(torch.zeros(2, 24))


@interpreter
@pytest.mark.parametrize("cu, causal, block_size", [(None, True, None), (None, False, 8), (PACKED, True, None),
                                                    (PACKED, False, 16)])
def test_fp8_triton_equals_reference_with_ties(cu, causal, block_size):
    """Integer inputs and power-of-two scales: the fp8 rows hold the inputs exactly, so the
    kernel's fp8 products, the reference on the fp8 rows and the unquantized selection agree
    element for element, ties included."""
    q_idx, k_idx, w = indexer_inputs(1, 70, 3, 32, seed=7)
    q8, k8, w8, ks = sa.indexer_fp8_inputs(q_idx, k_idx, w, rotate=False)
    q_scale = reference.quantize_fp8_rows(q_idx)[1]
    assert torch.equal(q8.float() * q_scale[..., None], q_idx) and torch.equal(w8, w * q_scale)
    assert torch.equal(k8.float() * ks[..., None], k_idx)
    for topk in (6, 75):
        want = reference.lightning_indexer_topk(q8, k8, w8, topk, cu, block_size, causal, k_scale=ks)
        got = sa.lightning_indexer_topk(q8, k8, w8, topk, cu, block_size, causal, backend="triton", k_scale=ks)
        assert torch.equal(got, want), (topk, (got != want).sum())
        assert torch.equal(want, reference.lightning_indexer_topk(q_idx, k_idx, w, topk, cu, block_size, causal))


@interpreter
def test_fp8_triton_applies_the_key_scales():
    """Keys of very different sizes (scales 2^-8 .. 2^8): the kernel's scores are the scaled ones
    (an unscaled kernel would rank the keys by their fp8 rows alone), also queries among keys."""
    q_idx, k_idx, w = indexer_inputs(1, 24, 2, 16, S=64, seed=8)
    k_idx = k_idx * torch.exp2(torch.randint(-8, 9, (1, 64, 1), generator=torch.Generator().manual_seed(0)).float())
    pos = torch.arange(40, 64)
    q8, k8, w8, ks = sa.indexer_fp8_inputs(q_idx, k_idx, w, rotate=False)
    want = full_topk(q_idx, k_idx, w, 10, q_positions=pos)
    got = sa.lightning_indexer_topk(q8, k8, w8, 10, q_positions=pos, backend="triton", k_scale=ks)
    assert torch.equal(got, want)
    got64 = sa.indexer_topk(q8, k8, w8, 10, q_positions=pos, backend="triton", k_scale=ks)  # the int64 contract
    assert torch.equal(got64, want.long())


def test_fp8_selection_keeps_the_top_scores():
    """Real-valued rows: fp8 keeps about 3 significant bits, so near-equal scores swap at the
    k-th place, but the selected keys hold nearly all the top-k score (measured: recall 0.966,
    0.999 of the score). A channel 30x the others (an outlier) costs the unrotated rows
    precision; the Hadamard rotation spreads it (measured: 0.938 without, 0.991 with)."""
    gen = torch.Generator().manual_seed(0)
    T, S, HI, DI, K = 64, 4096, 8, 128, 256
    pos = torch.arange(S - T, S)
    for outlier, rotate, min_recall in ((1.0, True, 0.95), (30.0, False, 0.9), (30.0, True, 0.98)):
        q, k, w = torch.randn(1, T, HI, DI, generator=gen), torch.randn(1, S, DI, generator=gen), torch.randn(1, T, HI, generator=gen)
        q[..., 3] *= outlier
        k[..., 3] *= outlier
        scores = reference.lightning_indexer(q, k, w, q_positions=pos)
        want = reference.lightning_indexer_topk(q, k, w, K, q_positions=pos)
        q8, k8, w8, ks = sa.indexer_fp8_inputs(q, k, w, rotate=rotate)
        got = reference.lightning_indexer_topk(q8, k8, w8, K, q_positions=pos, k_scale=ks)
        recall = _recall(got, want)
        mass = scores.gather(-1, got.long()).sum() / scores.gather(-1, want.long()).sum()
        assert recall >= min_recall and mass > 0.995, (outlier, rotate, recall, mass)
        if outlier > 1:
            assert (rotate and recall > 0.98) or (not rotate and recall < 0.96), recall
    # fp8=True is the rotation and quantization above, then the same selection
    assert torch.equal(sa.lightning_indexer_topk(q, k, w, K, q_positions=pos, fp8=True),
                       reference.lightning_indexer_topk(q8, k8, w8, K, q_positions=pos, k_scale=ks))


def test_fp8_bad_arguments_name_the_field():
    q_idx, k_idx, w = indexer_inputs(1, 8, 2, 32)
    q8, k8, w8, ks = sa.indexer_fp8_inputs(q_idx, k_idx, w)
    for backend in ("torch",) + (("triton",) if triton_indexer._INTERPRET else ()):
        with pytest.raises(ValueError, match="k_scale: float8_e4m3fn k_idx needs"):
            sa.lightning_indexer_topk(q8, k8, w8, 2, backend=backend)
        with pytest.raises(ValueError, match="both be float8_e4m3fn or neither"):
            sa.lightning_indexer_topk(q8, k_idx, w8, 2, backend=backend, k_scale=ks)
        with pytest.raises(ValueError, match="k_scale: only for float8_e4m3fn"):
            sa.lightning_indexer_topk(q_idx, k_idx, w, 2, backend=backend, k_scale=ks)
        with pytest.raises(ValueError, match=r"k_scale must be fp32 \[B, S\]"):
            sa.lightning_indexer_topk(q8, k8, w8, 2, backend=backend, k_scale=ks[:, :4])
        with pytest.raises(ValueError, match="k_scale must be on k_idx's device"):
            sa.lightning_indexer_topk(q8, k8, w8, 2, backend=backend, k_scale=ks.to("meta"))
        with pytest.raises(ValueError, match="fp8=True quantizes"):
            sa.lightning_indexer_topk(q8, k8, w8, 2, backend=backend, k_scale=ks, fp8=True)
    with pytest.raises(ValueError, match="power of 2"):
        sa.lightning_indexer_topk(*indexer_inputs(1, 8, 2, 24), 2, fp8=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("HI, DI, T", [(64, 128, 4096), (16, 64, 8192)])
@pytest.mark.parametrize("runs", [None, "topk", "radix"], ids=["rows", "runs", "radix-runs"])
def test_gpu_fp8_selection(HI, DI, T, runs, monkeypatch):
    """The kernel's products on fp8 tensor cores: integer rows (exact in fp8 with power-of-two
    scales) select exactly the reference's keys; real-valued rows select keys whose reference
    scores (on the same fp8 rows) are the top ones, and keep most of the bf16 selection. runs:
    as test_gpu_bf16_selection's."""
    calls = _runs_at(monkeypatch, T, runs)
    q_idx, k_idx, w = indexer_inputs(1, T, HI, DI, device="cuda", dtype=torch.bfloat16)
    q8, k8, w8, ks = sa.indexer_fp8_inputs(q_idx, k_idx, w, rotate=False)
    got = sa.lightning_indexer_topk(q8, k8, w8, 2048, k_scale=ks)  # auto: the Triton kernel
    assert torch.equal(got, reference.lightning_indexer_topk(q8, k8, w8, 2048, k_scale=ks))
    assert torch.equal(got, reference.lightning_indexer_topk(q_idx, k_idx, w, 2048))
    q_idx, k_idx, w = (x.float().div(4).bfloat16() for x in indexer_inputs(1, T, HI, DI, integer=False, device="cuda"))
    q8, k8, w8, ks = sa.indexer_fp8_inputs(q_idx, k_idx, w)
    got = sa.lightning_indexer_topk(q_idx, k_idx, w, 2048, fp8=True).long()
    want = reference.lightning_indexer_topk(q8, k8, w8, 2048, k_scale=ks).long()
    assert torch.equal(got < 0, want < 0)
    rows = torch.arange(0, T, 97, device="cuda")
    scores = reference.lightning_indexer(q8[:, rows], k8, w8[:, rows], q_positions=rows, k_scale=ks)
    picked = scores.gather(-1, got[:, rows].clamp(min=0)).masked_fill(got[:, rows] < 0, 0)
    best = scores.gather(-1, want[:, rows].clamp(min=0)).masked_fill(want[:, rows] < 0, 0)
    torch.testing.assert_close(picked, best, rtol=1e-4, atol=1e-3)
    bf16 = sa.lightning_indexer_topk(q_idx, k_idx, w, 2048).long()
    print(f"fp8 recall of the bf16 selection: {_recall(got[:, rows], bf16[:, rows]):.4f}")
    assert _recall(got[:, rows], bf16[:, rows]) > 0.9
    assert bool(calls) == bool(runs)
