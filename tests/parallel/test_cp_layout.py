"""CPLayout: sharding, the differentiable gather and packed segments, over real gloo groups.

Shape legend: T global tokens, Tl = T / P local tokens, C channels.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_moe_hybrid.parallel.context_parallel import CPLayout
from megatron_moe_hybrid.testing import spawn


def _gather_worker(rank, world, kind, T):
    torch.manual_seed(0)
    x = torch.randn(T, 3, dtype=torch.float64)  # [T, C], the same on every rank
    w = torch.randn(T, 3, dtype=torch.float64)
    layout = CPLayout(T, world, rank, kind, dist.group.WORLD)
    local = layout.shard(x).clone().requires_grad_()  # [Tl, C]
    full = layout.gather(local)  # [T, C]
    # Each rank weighs the gathered tensor differently; the owner's gradient sums them all.
    (full * w * (rank + 1)).sum().backward()
    return full.detach(), local.grad, layout.positions()


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_gather_inverts_shard_and_sums_gradients(kind, world):
    T = 8 * world
    torch.manual_seed(0)
    x = torch.randn(T, 3, dtype=torch.float64)
    w = torch.randn(T, 3, dtype=torch.float64)
    results = spawn(_gather_worker, world, kind, T)
    seen = torch.cat([pos for _, _, pos in results])
    assert torch.equal(seen.sort().values, torch.arange(T))  # every token on exactly one rank
    total_w = w * sum(r + 1 for r in range(world))
    for full, grad, pos in results:
        torch.testing.assert_close(full, x, rtol=0, atol=0)
        torch.testing.assert_close(grad, total_w[pos])


def test_zigzag_balances_causal_work():
    layout = [CPLayout(64, 4, r, "zigzag") for r in range(4)]
    work = [int((lay.positions() + 1).sum()) for lay in layout]  # keys seen by causal queries
    assert len(set(work)) == 1
    contiguous = [int((CPLayout(64, 4, r, "contiguous").positions() + 1).sum()) for r in range(4)]
    assert len(set(contiguous)) == 4


def test_local_segments_cut_at_pieces_and_sequences():
    cu = torch.tensor([0, 5, 5, 13, 16])
    seg = CPLayout(16, 2, 1, "zigzag").local_segments(cu)  # pieces [4, 8) and [8, 12)
    assert seg.cu_seqlens.tolist() == [0, 1, 4, 8]
    assert seg.global_start.tolist() == [4, 5, 8]
    assert seg.starts_sequence.tolist() == [False, True, False]
    assert seg.first_in_piece.tolist() == [True, False, True]
    assert seg.last_in_piece.tolist() == [False, True, True]
    pos = CPLayout(16, 2, 1, "zigzag").sequence_positions(cu)
    assert pos.tolist() == [4, 0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(seq_len=10, size=4), "multiple of 8"), (dict(seq_len=8, kind="ring"), "layout"),
     (dict(seq_len=8, size=2, rank=2), "rank 2")],
)
def test_bad_layout_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPLayout(**kwargs)
