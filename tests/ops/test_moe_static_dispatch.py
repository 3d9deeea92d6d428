"""The static MoE dispatch ops (ops/moe/gather.py, ops/moe/layout.py) against plain-Python oracles.

Shape legend:
  gathers:  R source rows       M output rows          K rows gathered per output row   h row width
  layouts:  T tokens            K experts per token    E experts (global)               ep EP group size
            L = E / ep local experts                   C rows per (source, destination) rank pair
            M = ep * C received rows                   R expert-grouped rows kept by a rank
            i = t * K + k, flat copy index

Oracles are Python loops in float64 / plain ints, written from the docstrings and the
dispatch contract, not from the code under test. test_dispatch_simulation runs a whole EP
group in one process (the all_to_alls become block copies) and follows every routed copy.

The Triton kernels run in the Triton interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1), which mis-handles bf16 loads: on CPU Triton is checked in float32 and
float16, and in bf16 only by the `gpu` tests.
"""

import itertools
import math
from fractions import Fraction

import pytest
import torch

from megatron_moe_hybrid.ops.moe import gather as gather_mod
from megatron_moe_hybrid.ops.moe import layout
from megatron_moe_hybrid.ops.moe.gather import (
    gather_sum,
    row_dot,
    row_gather,
    scatter_rows,
    weighted_combine,
)

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
# Triton runs on CUDA where there is a GPU, in its interpreter on CPU tensors elsewhere
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _dev(backend):
    return TRITON_DEVICE if backend == "triton" else "cpu"


# the Triton backend rejects float64 (see test_bad_input)
BACKEND_DTYPES = [
    pytest.param("torch", torch.float64, id="torch-fp64"),
    pytest.param("torch", torch.float32, id="torch-fp32"),
    pytest.param("torch", torch.float16, id="torch-fp16"),
    pytest.param("triton", torch.float32, id="triton-fp32", marks=needs_triton),
    pytest.param("triton", torch.float16, id="triton-fp16", marks=needs_triton),
]
# output vs the float64 oracle: fp32 accumulation of <= 8 terms, then one rounding to the dtype
GATHER_TOL = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.float16: {"rtol": 1e-3, "atol": 1e-5},
}
# row_dot returns fp32 (fp64 for float64) sums of h products: error grows with h, not the dtype
DOT_TOL = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-4},
    torch.float16: {"rtol": 1e-5, "atol": 1e-4},
}


@pytest.fixture(autouse=True)
def _nan_filled_empty():
    """In deterministic mode torch.empty fills floats with NaN: an output row that a kernel
    forgets to write then fails the comparison instead of passing on leftover zeros."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was_deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = was_filling


def _to(t, dev):
    return None if t is None else t.to(dev)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(dtype)


def _random_idx(M, K, R, seed):
    """[M, K] int64 in [-1, R): about a quarter -1, and every fifth row all -1."""
    g = _gen(seed)
    if R == 0:
        return torch.full((M, K), -1, dtype=torch.int64)
    idx = torch.randint(R, (M, K), generator=g)  # [M, K]
    idx[torch.rand(M, K, generator=g) < 0.25] = -1
    idx[::5] = -1
    return idx


def _gather_sum_oracle(src, idx, weights):
    """[R, h], [M, K], [M, K] or None -> [M, h] float64, one row and one k at a time."""
    out = torch.zeros(idx.shape[0], src.shape[1], dtype=torch.float64)
    for m in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            row = int(idx[m, k])
            if row >= 0:
                w = 1.0 if weights is None else float(weights[m, k])
                out[m] += w * src[row].double()
    return out


def _row_dot_oracle(a, src, idx):
    """[M, h], [R, h], [M, K] -> [M, K] float64."""
    out = torch.zeros(idx.shape, dtype=torch.float64)
    for m in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            row = int(idx[m, k])
            if row >= 0:
                out[m, k] = (a[m].double() * src[row].double()).sum()
    return out


GATHER_CASES = [(M, R, K, h) for K in (1, 3, 8) for h in (1, 17, 64, 1030) for M, R in ((13, 11),)]
GATHER_CASES += [(0, 5, 3, 17), (9, 0, 3, 17), (0, 0, 1, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("weighted", [False, True], ids=["sum", "weighted"])
@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("M,R,K,h", GATHER_CASES, ids=[f"M{M}-R{R}-K{K}-h{h}" for M, R, K, h in GATHER_CASES])
def test_gather_sum(M, R, K, h, backend, dtype, weighted):
    src = _randn(R, h, dtype=dtype, seed=1)  # [R, h]
    idx = _random_idx(M, K, R, seed=2)  # [M, K]
    weights = _randn(M, K, dtype=torch.float32, seed=3) if weighted else None  # [M, K]
    dev = _dev(backend)
    out = gather_sum(src.to(dev), idx.to(dev), _to(weights, dev), backend=backend).cpu()  # [M, h]
    assert out.dtype == dtype and out.shape == (M, h)
    torch.testing.assert_close(out.double(), _gather_sum_oracle(src, idx, weights), **GATHER_TOL[dtype])
    empty_rows = (idx < 0).all(1)  # [M]
    assert torch.equal(out[empty_rows], torch.zeros_like(out[empty_rows]))


def _inverse_map(S, K, M, seed, drop=0.3):
    """dest [S, K] naming distinct output rows of M (about `drop` of the entries -1) and
    unread [M]: for each output row the flat s * K + k that names it, -1 for none."""
    g = _gen(seed)
    dest = torch.randperm(M, generator=g)[: S * K].view(S, K).clone() if S * K else torch.zeros(S, K, dtype=torch.int64)
    dest[torch.rand(S, K, generator=g) < drop] = -1
    unread = torch.full((M,), -1, dtype=torch.int64)
    ok = dest >= 0
    unread[dest[ok]] = torch.arange(S * K).view(S, K)[ok]
    return dest, unread


# S source rows, K destinations each, M >= S * K output rows (the rest unread); S 300 spans
# several programs' rows at h 17 (GATHER_ELEMS // 32 rows per program)
SCATTER_CASES = [(S, K, M, h) for S, K, M in ((13, 1, 20), (11, 3, 40), (300, 2, 700)) for h in (17, 1030)]
SCATTER_CASES += [(0, 2, 5, 17), (4, 2, 8, 1)]


@pytest.mark.parametrize("weighted", [False, True], ids=["copy", "weighted"])
@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("S,K,M,h", SCATTER_CASES, ids=[f"S{S}-K{K}-M{M}-h{h}" for S, K, M, h in SCATTER_CASES])
def test_scatter_rows(S, K, M, h, backend, dtype, weighted):
    """out[dest[s, k]] = w[s, k] src[s], unread rows 0: the gather of the transposed map."""
    src = _randn(S, h, dtype=dtype, seed=11)  # [S, h]
    dest, unread = _inverse_map(S, K, M, seed=12)  # [S, K], [M]
    weights = _randn(S, K, dtype=torch.float32, seed=13) if weighted else None
    dev = _dev(backend)
    out = scatter_rows(src.to(dev), dest.to(dev), unread.to(dev), _to(weights, dev), backend=backend).cpu()
    assert out.dtype == dtype and out.shape == (M, h)
    # the same rows as a gather through unread: output row m reads src[unread[m] // K]
    idx = torch.where(unread >= 0, unread // max(K, 1), -1)[:, None]  # [M, 1]
    w_rows = None
    if weights is not None:
        padded = torch.cat([weights.reshape(-1), weights.new_zeros(1)])  # a 0 for unread rows
        w_rows = padded[torch.where(unread >= 0, unread, S * K)][:, None]
    torch.testing.assert_close(out.double(), _gather_sum_oracle(src, idx, w_rows), **GATHER_TOL[dtype])
    assert torch.equal(out[unread < 0], torch.zeros_like(out[unread < 0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_rows_zeroes_only_unread_rows_of_a_poisoned_output(backend, monkeypatch):
    """Unread rows sit in a few of many zero-fill tiles (most tiles have none, and skip):
    written into a NaN-poisoned out, every read row holds its source and every unread one 0."""
    monkeypatch.setattr(gather_mod, "SCATTER_ELEMS", 64)  # 2 rows per program at h 17 (block 32)
    monkeypatch.setattr(gather_mod, "SCATTER_ZERO_TILES", 4)  # 8 output rows per zero-fill program
    S, K, M, h = 40, 2, 120, 17
    named = torch.cat([torch.arange(79), torch.tensor([81])])  # rows 79, 80 and 82.. unread
    dest = named[torch.randperm(S * K, generator=_gen(21))].view(S, K)
    unread = torch.full((M,), -1, dtype=torch.int64)
    unread[dest.reshape(-1)] = torch.arange(S * K)
    src = _randn(S, h, dtype=torch.float32, seed=22)
    dev = _dev(backend)
    out = torch.full((M, h), float("nan"), device=dev)
    got = scatter_rows(src.to(dev), dest.to(dev), unread.to(dev), None, backend=backend, out=out)
    assert got is out
    out = out.cpu()
    read = unread >= 0
    assert torch.equal(out[read], src[unread[read] // K])
    assert torch.equal(out[~read], torch.zeros(int((~read).sum()), h))
    with pytest.raises(ValueError, match="out must be"):
        scatter_rows(src.to(dev), dest.to(dev), unread.to(dev), None, backend=backend, out=out[:, :4].to(dev))


ROW_DOT_CASES = [(M, R, K, h) for K in (1, 3, 8) for h in (1, 17, 64, 1030) for M, R in ((9, 7),)]
ROW_DOT_CASES += [(0, 5, 3, 17), (9, 0, 3, 17)]


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize(
    "M,R,K,h",
    ROW_DOT_CASES,
    ids=[f"M{M}-R{R}-K{K}-h{h}" for M, R, K, h in ROW_DOT_CASES],
)
def test_row_dot(M, R, K, h, backend, dtype):
    a = _randn(M, h, dtype=dtype, seed=4)  # [M, h]
    src = _randn(R, h, dtype=dtype, seed=5)  # [R, h]
    idx = _random_idx(M, K, R, seed=6)  # [M, K]
    dev = _dev(backend)
    out = row_dot(a.to(dev), src.to(dev), idx.to(dev), backend=backend).cpu()  # [M, K]
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and out.shape == (M, K)
    ref = _row_dot_oracle(a, src, idx)
    torch.testing.assert_close(out.double(), ref, **DOT_TOL[dtype])
    assert torch.equal(out[idx < 0], torch.zeros_like(out[idx < 0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_skips_dropped_entries(backend):
    """idx -1 is skipped: the row a dropped entry would have read cannot leak in, even when it
    holds NaN (padding rows of a buffer that no expert wrote)."""
    M, R, K, h = 11, 7, 3, 17
    src = _randn(R, h, dtype=torch.float32, seed=7)  # [R, h]
    idx = _random_idx(M, K, R, seed=8)  # [M, K]
    idx[idx == 0] = 1  # nothing valid reads row 0, the row a clamped -1 would read
    src[0] = float("nan")
    weights = _randn(M, K, dtype=torch.float32, seed=9)  # [M, K]
    dev = _dev(backend)
    out = gather_sum(src.to(dev), idx.to(dev), weights.to(dev), backend=backend).cpu()  # [M, h]
    torch.testing.assert_close(out.double(), _gather_sum_oracle(src, idx, weights), **GATHER_TOL[torch.float32])
    a = _randn(M, h, dtype=torch.float32, seed=10)  # [M, h]
    dots = row_dot(a.to(dev), src.to(dev), idx.to(dev), backend=backend).cpu()  # [M, K]
    torch.testing.assert_close(dots.double(), _row_dot_oracle(a, src, idx), **DOT_TOL[torch.float32])


def _random_topk(T, K, E, seed, drop=0.2, experts=None):
    """[T, K] distinct experts per token (from `experts`, default all), about `drop` set to -1."""
    g = _gen(seed)
    pool = torch.arange(E) if experts is None else torch.as_tensor(experts)
    topk = pool[torch.rand(T, len(pool), generator=g).argsort(dim=1)[:, :K]]  # [T, K]
    topk[torch.rand(T, K, generator=g) < drop] = -1
    return topk


def _token_send_oracle(topk_idx, E, ep, C):
    """Per destination rank r: the tokens, in token order, with a kept copy on r; the first C
    take rows r*C + position. ep 1 with C >= T is the identity: token t owns row t."""
    T, K = topk_idx.shape
    L = E // ep
    idx = topk_idx.tolist()
    identity = ep == 1 and C >= T
    pair_slot = [[-1] * ep for _ in range(T)]
    send_token = [-1] * (ep * C)
    send_expert = [[-1] * K for _ in range(ep * C)]
    send_copy = [[-1] * K for _ in range(ep * C)]
    overflow = 0
    for r in range(ep):
        to_r = [[k for k, e in enumerate(idx[t]) if e >= 0 and e // L == r] for t in range(T)]
        tokens = [t for t in range(T) if identity or to_r[t]]
        for pos, t in enumerate(tokens):
            if pos >= C:
                overflow += len(to_r[t])
                continue
            row = r * C + pos
            pair_slot[t][r] = row
            send_token[row] = t
            for k in to_r[t]:
                send_expert[row][k] = idx[t][k] - r * L
                send_copy[row][k] = t * K + k
    return {
        "pair_slot": torch.tensor(pair_slot, dtype=torch.int64).view(T, ep),
        "send_token": torch.tensor(send_token, dtype=torch.int64),
        "send_expert": torch.tensor(send_expert, dtype=torch.int64),
        "send_copy": torch.tensor(send_copy, dtype=torch.int64),
        "overflow": torch.tensor(overflow, dtype=torch.int64),
    }


def _expand_oracle(recv_expert, L, R):
    """Entries (j, k) with an expert, sorted by (local expert, j*K + k); the first R are kept."""
    M, K = recv_expert.shape
    rows = recv_expert.tolist()
    entries = sorted((e, j * K + k) for j in range(M) for k, e in enumerate(rows[j]) if e >= 0)
    kept = entries[:R]
    tail = [-1] * (R - len(kept))
    copy_pos = [[-1] * K for _ in range(M)]
    for p, (_, i) in enumerate(kept):
        copy_pos[i // K][i % K] = p
    return {
        "sorted_row": torch.tensor([i // K for _, i in kept] + tail, dtype=torch.int64),
        "sorted_copy": torch.tensor([i for _, i in kept] + tail, dtype=torch.int64),
        "copy_pos": torch.tensor(copy_pos, dtype=torch.int64).view(M, K),
        "tokens_per_expert": torch.tensor([sum(e == x for e, _ in kept) for x in range(L)], dtype=torch.int64),
        "overflow": torch.tensor(len(entries) - len(kept), dtype=torch.int64),
    }


def _assert_layout(got, want):
    """got: a layout dataclass; want: field name -> int64 tensor; exact, naming the field."""
    for name, w in want.items():
        torch.testing.assert_close(getattr(got, name), w, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


SEND_CASES = [(T, K, E, ep) for T in (0, 1, 7, 33) for K in (1, 2, 4) for E in (4, 8) for ep in (1, 2, 4)]
FACTORS = [None, 0.5, 1.0, 2.0]


@pytest.mark.parametrize("factor", FACTORS, ids=[f"cf{f}" for f in FACTORS])
@pytest.mark.parametrize("T,K,E,ep", SEND_CASES, ids=[f"T{T}-K{K}-E{E}-ep{ep}" for T, K, E, ep in SEND_CASES])
def test_token_send_layout(T, K, E, ep, factor):
    topk_idx = _random_topk(T, K, E, seed=T * 100 + K * 10 + E + ep)  # [T, K]
    C = layout.token_capacity(T, K, ep, factor)
    _assert_layout(layout.token_send_layout(topk_idx, E, ep, C), _token_send_oracle(topk_idx, E, ep, C))


# E = 8 throughout; T = 13 > C3, so ep 1 also runs the general (non-identity) path
EDGE_ROUTINGS = {
    "one-expert": lambda: torch.full((13, 1), 5),
    "one-expert-dropped": lambda: torch.tensor([[5], [-1], [5], [5], [-1], [5]]),
    "topk-eq-E": lambda: _random_topk(9, 8, 8, seed=11, drop=0.0),
    "topk-eq-E-dropped": lambda: _random_topk(9, 8, 8, seed=12),
    "empty-experts": lambda: _random_topk(21, 2, 8, seed=13, experts=[0, 3, 6, 7]),
    "one-rank": lambda: _random_topk(13, 2, 8, seed=14, drop=0.0, experts=[0, 1]),
    "all-dropped": lambda: torch.full((5, 2), -1),
}


@pytest.mark.parametrize("capacity", [1, 3, 1000], ids=["C1", "C3", "C1000"])
@pytest.mark.parametrize("ep", [1, 2, 4], ids=["ep1", "ep2", "ep4"])
@pytest.mark.parametrize("routing", EDGE_ROUTINGS.keys())
def test_token_send_layout_edge_cases(routing, ep, capacity):
    topk_idx = EDGE_ROUTINGS[routing]()  # [T, K]
    _assert_layout(
        layout.token_send_layout(topk_idx, 8, ep, capacity),
        _token_send_oracle(topk_idx, 8, ep, capacity),
    )


def _random_recv_expert(M, K, L, seed, experts=None, drop=0.2):
    """[M, K] int64: distinct local experts (from `experts`, default all) at random positions
    of each row, about `drop` of them and every fourth row -1 (padding rows)."""
    g = _gen(seed)
    pool = torch.arange(L) if experts is None else torch.as_tensor(experts)
    n = min(K, len(pool))
    out = torch.full((M, K), -1, dtype=torch.int64)  # [M, K]
    out[:, :n] = pool[torch.rand(M, len(pool), generator=g).argsort(dim=1)[:, :n]]
    out[torch.rand(M, K, generator=g) < drop] = -1
    out = out.gather(1, torch.rand(M, K, generator=g).argsort(dim=1))  # entries at any k
    out[::4] = -1
    return out


# R relative to the n valid entries: one row, half of them, exactly all, all plus a tail
ROW_MODES = {
    "R1": lambda n: 1,
    "Rhalf": lambda n: max(1, n // 2),
    "Rall": lambda n: max(1, n),
    "Rtail": lambda n: n + 5,
}
EXPAND_CASES = [(M, K, L) for M in (0, 1, 7, 33) for K in (1, 2, 4) for L in (1, 2, 4)]


@pytest.mark.parametrize("rows", ROW_MODES.keys())
@pytest.mark.parametrize("M,K,L", EXPAND_CASES, ids=[f"M{M}-K{K}-L{L}" for M, K, L in EXPAND_CASES])
def test_expand_layout(M, K, L, rows):
    recv_expert = _random_recv_expert(M, K, L, seed=M * 100 + K * 10 + L)  # [M, K]
    R = ROW_MODES[rows](int((recv_expert >= 0).sum()))
    _assert_layout(layout.expand_layout(recv_expert, L, R), _expand_oracle(recv_expert, L, R))


EXPAND_EDGES = {  # L = 4
    "one-expert": lambda: torch.tensor([[-1, 2], [2, -1], [-1, -1], [-1, 2], [2, -1]]),
    "no-entries": lambda: torch.full((6, 3), -1),
    "empty-experts": lambda: _random_recv_expert(17, 2, 4, seed=15, experts=[0, 3]),
    "K-eq-L-full": lambda: _random_recv_expert(9, 4, 4, seed=16, drop=0.0),
}


@pytest.mark.parametrize("R", [1, 3, 1000], ids=["R1", "R3", "R1000"])
@pytest.mark.parametrize("recv", EXPAND_EDGES.keys())
def test_expand_layout_edge_cases(recv, R):
    recv_expert = EXPAND_EDGES[recv]()  # [M, K]
    _assert_layout(layout.expand_layout(recv_expert, 4, R), _expand_oracle(recv_expert, 4, R))


@needs_triton
@pytest.mark.parametrize("rows", ROW_MODES.keys())
@pytest.mark.parametrize("M,K,L", [(0, 2, 3), (1, 1, 1), (7, 4, 2), (33, 2, 4)], ids=lambda v: str(v))
def test_expand_layout_triton(M, K, L, rows):
    """The counting sort (three Triton kernels) gives the oracle's layout, element for element."""
    recv_expert = _random_recv_expert(M, K, L, seed=M * 100 + K * 10 + L).to(TRITON_DEVICE)  # [M, K]
    R = ROW_MODES[rows](int((recv_expert >= 0).sum()))
    got = layout.expand_layout(recv_expert, L, R, backend="triton")
    _assert_layout(got, {k: v.to(TRITON_DEVICE) for k, v in _expand_oracle(recv_expert.cpu(), L, R).items()})


@needs_triton
@pytest.mark.parametrize("R", [1, 3, 1000], ids=["R1", "R3", "R1000"])
@pytest.mark.parametrize("recv", EXPAND_EDGES.keys())
def test_expand_layout_triton_edge_cases(recv, R):
    recv_expert = EXPAND_EDGES[recv]().to(TRITON_DEVICE)  # [M, K]
    got = layout.expand_layout(recv_expert, 4, R, backend="triton")
    _assert_layout(got, {k: v.to(TRITON_DEVICE) for k, v in _expand_oracle(recv_expert.cpu(), 4, R).items()})


# entries over many count blocks (more than one base scan step: BASE_SCAN is lowered); many
# experts; one expert holding most entries (long runs crossing every block boundary)
BIG_EXPANDS = {
    "blocks": (700, 4, 5, None),
    "many-experts": (300, 3, 70, None),
    "one-hot-expert": (600, 4, 6, [2]),
}


@needs_triton
@pytest.mark.parametrize("R_of", ["all", "cut"])
@pytest.mark.parametrize("case", BIG_EXPANDS.keys())
def test_expand_layout_triton_many_blocks(case, R_of, monkeypatch):
    monkeypatch.setattr(layout, "BASE_SCAN", 4)
    M, K, L, experts = BIG_EXPANDS[case]
    recv_expert = _random_recv_expert(M, K, L, seed=len(case), experts=experts, drop=0.1)  # [M, K]
    if experts is not None:  # most entries on one expert, the rest anywhere
        spread = _random_recv_expert(M, K, L, seed=7, drop=0.6)
        recv_expert = torch.where(spread >= 0, spread, recv_expert)
    assert recv_expert.numel() > 4 * layout.COUNT_BLOCK
    n = int((recv_expert >= 0).sum())
    R = n if R_of == "all" else n // 3
    got = layout.expand_layout(recv_expert.to(TRITON_DEVICE), L, R, backend="triton")
    _assert_layout(got, {k: v.to(TRITON_DEVICE) for k, v in _expand_oracle(recv_expert, L, R).items()})


def _token_capacity_oracle(T, K, ep, factor):
    """factor x T * min(K, ep) / ep rounded up, at most T, at least 1; T for None or ep 1."""
    if ep == 1 or factor is None:
        return max(1, T)
    return max(1, min(T, math.ceil(Fraction(factor) * T * min(K, ep) / ep)))


def _expert_rows_oracle(M, T, K, L, factor):
    """A row carries at most min(K, L) entries (distinct local experts): M * min(K, L), at most
    factor x T * K rounded up, at least 1."""
    most = M * min(K, L)
    if factor is None:
        return max(1, most)
    return max(1, min(most, math.ceil(Fraction(factor) * T * K)))


# dyadic factors: the float is the number written, so exact arithmetic has one answer
CAP_FACTORS = [None, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0]


@pytest.mark.parametrize("factor", CAP_FACTORS, ids=[f"cf{f}" for f in CAP_FACTORS])
@pytest.mark.parametrize("ep", [1, 2, 3, 4, 8], ids=lambda e: f"ep{e}")
def test_token_capacity(ep, factor):
    for T, K in itertools.product(range(70), (1, 2, 3, 4, 8)):
        got = layout.token_capacity(T, K, ep, factor)
        assert got == _token_capacity_oracle(T, K, ep, factor), f"T={T} K={K}: got {got}"


@pytest.mark.parametrize("factor", CAP_FACTORS, ids=[f"cf{f}" for f in CAP_FACTORS])
@pytest.mark.parametrize("L", [1, 2, 3, 8], ids=lambda n: f"L{n}")
def test_expert_rows(L, factor):
    for M, T, K in itertools.product((0, 1, 5, 12, 40), (0, 1, 7, 33), (1, 2, 4, 8)):
        got = layout.expert_rows(M, T, K, L, factor)
        assert got == _expert_rows_oracle(M, T, K, L, factor), f"M={M} T={T} K={K}: got {got}"


@pytest.mark.parametrize("factor", [0.3, 1.1, 1.2], ids=lambda f: f"cf{f}")
def test_capacity_decimal_factor_rounds_exactly(factor):
    """A factor written as a decimal (1.1 in a YAML config) means that decimal: 1.1 x 50 rows is
    55, not the 56 that ceil() of a float product rounding up past 55 gives."""
    want = Fraction(str(factor))
    wrong = []
    for T, K, ep in itertools.product(range(160), (1, 2, 3, 4), (2, 3, 4)):
        exact = max(1, min(T, math.ceil(want * T * min(K, ep) / ep)))
        got = layout.token_capacity(T, K, ep, factor)
        if got != exact:
            wrong.append(f"token_capacity({T}, {K}, {ep}, {factor}) = {got}, not {exact}")
    for T, K in itertools.product(range(160), (1, 2, 3, 4)):
        exact = max(1, min(2 * T * K, math.ceil(want * T * K)))
        got = layout.expert_rows(2 * T, T, K, 8, factor)  # 2 T rows: the factor, not M, binds
        if got != exact:
            wrong.append(f"expert_rows({T}, {T}, {K}, 8, {factor}) = {got}, not {exact}")
    assert not wrong, f"{len(wrong)} sizes off: {wrong[:4]}"


def _exchange(buffers, C, r):
    """What rank r receives from all_to_all_single with equal splits: block r (rows
    [r*C, (r+1)*C)) of every rank's buffer, in source order."""
    return torch.cat([b[r * C : (r + 1) * C] for b in buffers])


def _flat_take(values, flat_idx):
    """values [T, K], flat_idx [...] of t*K + k or -1 -> values there, 0 at -1 (plain indexing)."""
    padded = torch.cat([values.reshape(-1), values.new_zeros(1)])
    return padded[torch.where(flat_idx >= 0, flat_idx, values.numel())]


E2E_ROUTINGS = {  # E = 8, T = 19, K = 3, rank s of the group routes with seed 80 + s
    "random": lambda s: _random_topk(19, 3, 8, seed=80 + s),
    "one-expert": lambda s: torch.tensor([[6, -1, -1]] * 19),
    "hot-rank": lambda s: _random_topk(19, 3, 8, seed=90 + s, drop=0.0, experts=[0, 1, 2, 7]),
}


@pytest.mark.parametrize("factor", FACTORS, ids=[f"cf{f}" for f in FACTORS])
@pytest.mark.parametrize("ep", [1, 2, 4], ids=lambda e: f"ep{e}")
@pytest.mark.parametrize("routing", E2E_ROUTINGS.keys())
def test_dispatch_simulation(routing, ep, factor):
    """An EP group in one process, sized and laid out as StaticAllToAllDispatcher does, the
    all_to_alls replaced by _exchange: every copy that no layout counts as overflow reaches
    its expert exactly once, grouped under it by tokens_per_expert; then the data path
    (permute, expand, expert, weighted combine, combine) equals the plain weighted sum over
    the copies that arrived."""
    E, h = 8, 5
    L = E // ep
    topks = [E2E_ROUTINGS[routing](s) for s in range(ep)]  # ep x [T, K]
    T, K = topks[0].shape
    C = layout.token_capacity(T, K, ep, factor)
    R = layout.expert_rows(ep * C, T, K, L, factor, ep_size=ep)
    sends = [layout.token_send_layout(topk, E, ep, C) for topk in topks]
    arrived = set()  # (source, t, k)
    overflow = sum(int(send.overflow) for send in sends)
    expands = []
    for r in range(ep):
        recv_expert = _exchange([s.send_expert for s in sends], C, r)  # [ep*C, K]
        recv_copy = _exchange([s.send_copy for s in sends], C, r)  # [ep*C, K] source's t*K + k
        expand = layout.expand_layout(recv_expert, L, R)
        expands.append(expand)
        overflow += int(expand.overflow)
        # the grouped GEMM reads row p as expert e where ends[e-1] <= p < ends[e]
        ends = expand.tokens_per_expert.cumsum(0).tolist()  # [L]
        for p, q in enumerate(expand.sorted_copy.tolist()):
            if q < 0:
                assert p >= ends[-1], f"rank {r}: row {p} inside the experts' rows has no entry"
                continue
            j, k = divmod(q, K)
            src, (t, k_src) = j // C, divmod(int(recv_copy[j, k]), K)
            assert (src, t, k_src) not in arrived, f"copy {(src, t, k_src)} arrived twice"
            arrived.add((src, t, k_src))
            local = next(e for e in range(L) if p < ends[e])
            assert int(topks[src][t, k_src]) == r * L + local, f"copy {(src, t, k_src)} at the wrong expert"
    num_valid = sum(int((topk >= 0).sum()) for topk in topks)
    assert len(arrived) == num_valid - overflow
    if factor is None:
        assert overflow == 0

    # data path: expert e scales its rows by e + 1
    xs = [_randn(T, h, dtype=torch.float64, seed=100 + s) for s in range(ep)]  # ep x [T, h]
    probs = [torch.rand(T, K, generator=_gen(110 + s), dtype=torch.float64) for s in range(ep)]
    send_bufs = [
        row_gather(x, send.send_token[:, None], send.pair_slot, "torch") for x, send in zip(xs, sends)
    ]  # ep x [ep*C, h]
    send_probs = [_flat_take(p, send.send_copy) for p, send in zip(probs, sends)]  # ep x [ep*C, K]
    backs = []
    for r, expand in enumerate(expands):
        recv = _exchange(send_bufs, C, r)  # [ep*C, h]
        x_sorted = row_gather(recv, expand.sorted_row[:, None], expand.copy_pos, "torch")  # [R, h]
        scale = torch.repeat_interleave(
            torch.arange(r * L + 1, (r + 1) * L + 1, dtype=torch.float64), expand.tokens_per_expert
        )  # [kept rows]
        y_sorted = x_sorted.clone()
        y_sorted[: scale.numel()] *= scale[:, None]
        recv_probs = _exchange(send_probs, C, r)  # [ep*C, K]
        backs.append(weighted_combine(y_sorted, expand.copy_pos, recv_probs, expand.sorted_copy, "torch"))
    for s, send in enumerate(sends):
        out = row_gather(_exchange(backs, C, s), send.pair_slot, send.send_token[:, None], "torch")  # [T, h]
        want = torch.zeros(T, h, dtype=torch.float64)
        for src, t, k in arrived:
            if src == s:
                want[t] += probs[s][t, k] * (int(topks[s][t, k]) + 1) * xs[s][t]
        torch.testing.assert_close(out, want, msg=lambda m, s=s: f"rank {s}: {m}")


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0], ids=lambda f: f"cf{f}")
@pytest.mark.parametrize("K", [1, 3, 8], ids=lambda k: f"K{k}")
def test_ep1_never_overflows(K, factor):
    """StaticAllToAllDispatcher's contract: "EP=1, or a factor of None, can never overflow".
    At ep 1 the send side is the identity, so every valid copy must also fit in R."""
    T, E = 19, 8
    topk_idx = _random_topk(T, K, E, seed=120 + K, drop=0.0)  # [T, K]
    C = layout.token_capacity(T, K, 1, factor)
    R = layout.expert_rows(C, T, K, E, factor, ep_size=1)
    send = layout.token_send_layout(topk_idx, E, 1, C)
    expand = layout.expand_layout(send.send_expert, E, R)
    assert int(send.overflow) == 0
    assert int(expand.overflow) == 0, (
        f"expert_rows({C}, {T}, {K}, {E}, {factor}) = {R} < {T * K} routed copies: "
        f"{int(expand.overflow)} copies overflow at EP=1"
    )


def _rank_case(seed, ep, E=8, T=13, K=3, factor=0.5):
    """Rank 0 of a simulated EP group: its own send layout, and the expansion of what it
    receives (block 0 of every rank's send rows). Factor 0.5 makes copies overflow: on the
    send side where ep > 1, on the expert side at ep 1."""
    L = E // ep
    C = layout.token_capacity(T, K, ep, factor)
    R = layout.expert_rows(ep * C, T, K, L, factor, ep_size=ep)
    sends = [layout.token_send_layout(_random_topk(T, K, E, seed=seed + s), E, ep, C) for s in range(ep)]
    expand = layout.expand_layout(_exchange([s.send_expert for s in sends], C, 0), L, R)
    return sends[0], expand


def _gather_rows_ref(x, rows):
    """Differentiable sum_k x[rows[m, k]] over rows >= 0, with plain indexing."""
    out = []
    for m in range(rows.shape[0]):
        picked = [x[int(r)] for r in rows[m] if r >= 0]
        out.append(torch.stack(picked).sum(0) if picked else x.new_zeros(x.shape[1]))
    return torch.stack(out) if out else x.new_zeros(0, x.shape[1])


def _combine_ref(y, pos, probs):
    """Differentiable out[m] = sum_k probs[m, k] * y[pos[m, k]] over pos >= 0."""
    out = []
    for m in range(pos.shape[0]):
        terms = [probs[m, k] * y[int(p)] for k, p in enumerate(pos[m]) if p >= 0]
        out.append(torch.stack(terms).sum(0) if terms else y.new_zeros(y.shape[1]))
    return torch.stack(out) if out else y.new_zeros(0, y.shape[1])


# h 1 is a torch-only case: the interpreter's cost is per row, whatever h
DISPATCH_CASES = [
    pytest.param(backend, dtype, ep, h, id=f"{backend}-{name}-ep{ep}-h{h}", marks=marks)
    for backend, dtype, name, marks in (
        ("torch", torch.float64, "fp64", ()),
        ("torch", torch.float32, "fp32", ()),
        ("triton", torch.float32, "fp32", needs_triton),
    )
    for ep in (1, 2, 4)
    for h in ((1, 33) if backend == "torch" else (33,))
]


def _assert_close_named(got, want, tol):
    """got and want: dicts name -> tensor; a failure names the output or gradient."""
    for name, g in got.items():
        torch.testing.assert_close(
            g.cpu().double(),
            want[name].double(),
            **tol,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("backend,dtype,ep,h", DISPATCH_CASES)
def test_row_gather_permute(backend, dtype, ep, h):
    """Dispatch: send row j = x[send_token[j]]; its transpose map is pair_slot."""
    send, _ = _rank_case(seed=20 + ep, ep=ep)
    dev = _dev(backend)
    x = _randn(send.pair_slot.shape[0], h, dtype=dtype, seed=21).to(dev).requires_grad_()  # [T, h]
    out = row_gather(x, send.send_token[:, None].to(dev), send.pair_slot.to(dev), backend)  # [ep*C, h]
    grad = _randn(*out.shape, dtype=dtype, seed=22)
    (grad_x,) = torch.autograd.grad(out, x, grad.to(dev))

    x64 = x.detach().cpu().double().requires_grad_()
    ref = _gather_rows_ref(x64, send.send_token[:, None])
    (ref_grad_x,) = torch.autograd.grad(ref, x64, grad.double())
    _assert_close_named({"out": out, "grad_x": grad_x}, {"out": ref, "grad_x": ref_grad_x}, GATHER_TOL[dtype])


@pytest.mark.parametrize("backend,dtype,ep,h", DISPATCH_CASES)
def test_row_gather_expand(backend, dtype, ep, h):
    """Receive side: expert-grouped row p = recv[sorted_row[p]]; its transpose map is copy_pos."""
    _, expand = _rank_case(seed=30 + ep, ep=ep)
    dev = _dev(backend)
    recv = _randn(expand.copy_pos.shape[0], h, dtype=dtype, seed=31).to(dev).requires_grad_()  # [M, h]
    out = row_gather(recv, expand.sorted_row[:, None].to(dev), expand.copy_pos.to(dev), backend)  # [R, h]
    grad = _randn(*out.shape, dtype=dtype, seed=32)
    (grad_recv,) = torch.autograd.grad(out, recv, grad.to(dev))

    recv64 = recv.detach().cpu().double().requires_grad_()
    ref = _gather_rows_ref(recv64, expand.sorted_row[:, None])
    (ref_grad_recv,) = torch.autograd.grad(ref, recv64, grad.double())
    _assert_close_named(
        {"out": out, "grad_recv": grad_recv}, {"out": ref, "grad_recv": ref_grad_recv}, GATHER_TOL[dtype]
    )


@pytest.mark.parametrize("backend,dtype,ep,h", DISPATCH_CASES)
def test_weighted_combine(backend, dtype, ep, h):
    """Receiver combine: back[j] = sum_k recv_probs[j, k] * y_sorted[copy_pos[j, k]];
    gradients to y_sorted and recv_probs (nonzero also where copy_pos is -1: they must not leak)."""
    _, expand = _rank_case(seed=60 + ep, ep=ep)
    dev = _dev(backend)
    y = _randn(expand.sorted_copy.shape[0], h, dtype=dtype, seed=61).to(dev).requires_grad_()  # [R, h]
    probs = torch.rand(*expand.copy_pos.shape, generator=_gen(62), dtype=torch.float64).to(dtype)  # [M, K]
    probs = probs.to(dev).requires_grad_()
    out = weighted_combine(y, expand.copy_pos.to(dev), probs, expand.sorted_copy.to(dev), backend)  # [M, h]
    assert out.dtype == dtype
    grad = _randn(*out.shape, dtype=dtype, seed=63)
    grad_y, grad_probs = torch.autograd.grad(out, (y, probs), grad.to(dev))

    y64 = y.detach().cpu().double().requires_grad_()
    probs64 = probs.detach().cpu().double().requires_grad_()
    ref = _combine_ref(y64, expand.copy_pos, probs64)
    ref_grad_y, ref_grad_probs = torch.autograd.grad(ref, (y64, probs64), grad.double())
    _assert_close_named({"out": out, "grad_y": grad_y}, {"out": ref, "grad_y": ref_grad_y}, GATHER_TOL[dtype])
    _assert_close_named({"grad_probs": grad_probs}, {"grad_probs": ref_grad_probs}, DOT_TOL[dtype])


@pytest.mark.parametrize("backend,dtype,ep,h", DISPATCH_CASES)
def test_row_gather_sender_combine(backend, dtype, ep, h):
    """Sender combine: out[t] = sum_r back[pair_slot[t, r]]; its transpose map is send_token."""
    send, _ = _rank_case(seed=40 + ep, ep=ep)
    dev = _dev(backend)
    back = _randn(send.send_token.shape[0], h, dtype=dtype, seed=41).to(dev).requires_grad_()  # [ep*C, h]
    out = row_gather(back, send.pair_slot.to(dev), send.send_token[:, None].to(dev), backend)  # [T, h]
    grad = _randn(*out.shape, dtype=dtype, seed=42)
    (grad_back,) = torch.autograd.grad(out, back, grad.to(dev))

    back64 = back.detach().cpu().double().requires_grad_()
    ref = _gather_rows_ref(back64, send.pair_slot)
    (ref_grad_back,) = torch.autograd.grad(ref, back64, grad.double())
    _assert_close_named(
        {"out": out, "grad_back": grad_back}, {"out": ref, "grad_back": ref_grad_back}, GATHER_TOL[dtype]
    )


def test_bad_input():
    src = torch.zeros(4, 8)
    idx = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="src"):
        gather_sum(src[0], idx, backend="torch")
    with pytest.raises(ValueError, match="idx"):
        gather_sum(src, idx.int(), backend="torch")
    with pytest.raises(ValueError, match="weights"):
        gather_sum(src, idx, torch.ones(3, 3), backend="torch")
    with pytest.raises(ValueError, match="backend"):
        gather_sum(src, idx, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        row_dot(torch.zeros(3, 8), src, idx, backend="fused")
    with pytest.raises(ValueError, match="backend='triton'"):
        gather_sum(src.double(), idx, backend="triton")
    with pytest.raises(ValueError, match="topk_idx"):
        layout.token_send_layout(idx.int(), 4, 2, 3)
    with pytest.raises(ValueError, match="topk_idx"):
        layout.token_send_layout(idx[0], 4, 2, 3)
    with pytest.raises(ValueError, match="num_experts"):
        layout.token_send_layout(idx, 6, 4, 3)
    with pytest.raises(ValueError, match="capacity"):
        layout.token_send_layout(idx, 4, 2, 0)
    with pytest.raises(ValueError, match="capacity_factor"):
        layout.token_capacity(8, 2, 2, 0.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        layout.token_capacity(8, 2, 2, -1.0)
    with pytest.raises(ValueError, match="recv_expert"):
        layout.expand_layout(torch.zeros(4, dtype=torch.int64), 2, 3)


@pytest.mark.parametrize("factor", [0.0, -1.0], ids=["cf0", "cf-1"])
def test_expert_rows_rejects_bad_factor(factor):
    """token_capacity rejects a factor <= 0; expert_rows, given the same factor, must too
    rather than quietly keep one row."""
    with pytest.raises(ValueError, match="capacity_factor"):
        layout.expert_rows(16, 8, 2, 2, factor)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad_a", ["a-one-row", "a-wrong-h"])
def test_row_dot_checks_a(backend, bad_a):
    """row_dot reads a[m] for every output row m: a [M', h'] != [M, h] must raise, not broadcast
    (torch) or read past the end of a (triton)."""
    dev = _dev(backend)
    src = torch.zeros(4, 8, device=dev)
    idx = torch.zeros(3, 2, dtype=torch.int64, device=dev)
    a = torch.zeros(1, 8, device=dev) if bad_a == "a-one-row" else torch.zeros(3, 5, device=dev)
    with pytest.raises(ValueError, match=r"\ba\b"):
        row_dot(a, src, idx, backend=backend)


@pytest.mark.gpu
def test_gather_int64_offsets_cuda():
    """Offsets past 2**31 elements: src rows * h and out rows * h must be computed in int64.
    [2**24 + 8, 128] bf16 is 2**31 + 1024 elements (4 GiB) per big tensor."""
    h = 128
    rows = 2**31 // h + 8
    big = torch.empty(rows, h, dtype=torch.bfloat16, device="cuda")  # [rows, h]
    tail = torch.randn(64, h, device="cuda").to(torch.bfloat16)  # [64, h]
    big[-64:] = tail
    idx = torch.arange(rows - 64, rows, device="cuda").flip(0)[:, None].repeat(1, 2)  # [64, 2]
    idx[::3, 1] = -1
    weights = torch.rand(64, 2, device="cuda")
    out = gather_sum(big, idx, weights, backend="triton")  # [64, h]
    idx_tail = torch.where(idx >= 0, idx - (rows - 64), -1).cpu()  # [64, 2] rows of `tail`
    want = _gather_sum_oracle(tail.cpu(), idx_tail, weights.cpu())
    torch.testing.assert_close(out.cpu().double(), want, rtol=1.6e-2, atol=1e-5)
    a = torch.randn(64, h, device="cuda").to(torch.bfloat16)
    dots = row_dot(a, big, idx, backend="triton")  # [64, 2]
    torch.testing.assert_close(dots, row_dot(a, big, idx, backend="torch"), rtol=1e-5, atol=1e-4)

    # the output side: row m * h past 2**31, reading a small src
    idx_out = torch.arange(rows, device="cuda")[:, None] % 64  # [rows, 1]
    out_big = gather_sum(tail, idx_out, backend="triton")  # [rows, h]
    assert torch.equal(out_big[-100:], tail[idx_out[-100:, 0]])
    dots_big = row_dot(out_big, tail, idx_out, backend="triton")  # [rows, 1]
    torch.testing.assert_close(dots_big[-100:], row_dot(out_big[-100:], tail, idx_out[-100:], backend="torch"))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [17, 1030], ids=["h17", "h1030"])
def test_triton_matches_torch_bf16_cuda(h):
    """bf16 on the GPU: Triton forward and every gradient against the torch reference."""
    dev, dtype = "cuda", torch.bfloat16
    tol = {"rtol": 1.6e-2, "atol": 1e-5}
    M, R, K = 301, 257, 8
    src = _randn(R, h, dtype=dtype, seed=70).to(dev)
    idx = _random_idx(M, K, R, seed=71).to(dev)
    weights = _randn(M, K, dtype=torch.float32, seed=72).to(dev)
    for w in (None, weights):
        torch.testing.assert_close(gather_sum(src, idx, w, "triton"), gather_sum(src, idx, w, "torch"), **tol)
    a = _randn(M, h, dtype=dtype, seed=73).to(dev)
    torch.testing.assert_close(
        row_dot(a, src, idx, "triton"),
        row_dot(a, src, idx, "torch"),
        rtol=1e-5,
        atol=1e-4,
    )

    send, expand = _rank_case(seed=74, ep=4, E=16, T=200, K=4)
    pair_slot, send_token = send.pair_slot.to(dev), send.send_token.to(dev)
    sorted_row, sorted_copy, copy_pos = (t.to(dev) for t in (expand.sorted_row, expand.sorted_copy, expand.copy_pos))
    x = _randn(pair_slot.shape[0], h, dtype=dtype, seed=75).to(dev).requires_grad_()  # [T, h]
    recv = _randn(copy_pos.shape[0], h, dtype=dtype, seed=76).to(dev).requires_grad_()  # [M, h]
    y = _randn(sorted_row.shape[0], h, dtype=dtype, seed=77).to(dev).requires_grad_()  # [R, h]
    probs = torch.rand(*copy_pos.shape, generator=_gen(78)).to(dev).requires_grad_()  # [M, K]
    ops = {
        "permute": (lambda b: row_gather(x, send_token[:, None], pair_slot, b), (x,)),
        "expand": (lambda b: row_gather(recv, sorted_row[:, None], copy_pos, b), (recv,)),
        "receiver-combine": (lambda b: weighted_combine(y, copy_pos, probs, sorted_copy, b), (y, probs)),
        "sender-combine": (lambda b: row_gather(recv, pair_slot, send_token[:, None], b), (recv,)),
    }
    for name, (op, inputs) in ops.items():
        results = {}
        for backend in ("torch", "triton"):
            out = op(backend)
            grad = _randn(*out.shape, dtype=dtype, seed=79).to(dev)
            results[backend] = (out, *torch.autograd.grad(out, inputs, grad))
        for got, want in zip(results["triton"], results["torch"], strict=True):
            torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"{name}: {m}")
