"""Context parallelism: how one sequence is split over the CP ranks, and the collectives across it.

Shape legend: T global tokens of one micro-batch row, P CP ranks (size), NP pieces (P for the
contiguous layout, 2P for zigzag), L = T / NP tokens per piece, Tl = T / P local tokens.

The sequence is cut into NP equal pieces. "contiguous" gives rank r piece r; "zigzag" gives
rank r pieces r and 2P-1-r, so that every rank holds the same amount of causal work (an
early piece is cheap for attention, a late one expensive). A rank's local tokens are its
pieces concatenated in that order. Tokens are independent in the MoE layers and the
norms, so only attention layers need to know the layout: linear attention passes states
from piece to piece, sparse attention gathers keys in global order.

Packed sequences keep their global cu_seqlens (offsets into the T tokens); `local_segments`
cuts them at piece boundaries.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

LAYOUTS = ("contiguous", "zigzag")


def _group_size(group: Optional[ProcessGroup]) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class _AllGather(torch.autograd.Function):
    """[n, ...] per rank -> [P * n, ...] in rank order; backward sums the gradients over ranks."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Optional[ProcessGroup]) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((_group_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        size, rank = _group_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        # gloo has no reduce_scatter: sum everywhere, keep this rank's rows.
        dist.all_reduce(grad, group=group)
        return grad.chunk(size)[rank].contiguous(), None


def all_gather(x: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    """Differentiable all-gather along dim 0: [n, ...] -> [P * n, ...] in rank order.

    The gradient of each rank's x is the sum over ranks of the gradients of its rows, so a
    loss computed on every rank from the gathered tensor trains x as a single process would.
    """
    if _group_size(group) == 1:
        return x
    return _AllGather.apply(x, group)


@dataclass(frozen=True)
class CPLayout:
    """Which global tokens [0, seq_len) this rank holds; see the module docstring."""

    seq_len: int
    size: int = 1
    rank: int = 0
    kind: str = "zigzag"
    group: Optional[ProcessGroup] = None

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise ValueError(f"context parallel layout: expected one of {LAYOUTS}, got {self.kind!r}")
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"context parallel: rank {self.rank} is not in [0, size={self.size})")
        if self.seq_len < 1 or self.seq_len % self.num_pieces:
            raise ValueError(
                f"sequence length {self.seq_len} must be a positive multiple of {self.num_pieces} "
                f"(context_parallel_size={self.size} x {self.num_pieces // self.size} pieces per "
                f"rank for the {self.kind} layout); pad the sequence or change "
                "training.seq_length"
            )

    @classmethod
    def from_parallel_state(cls, seq_len: int, kind: str = "zigzag") -> "CPLayout":
        """The layout of Megatron's context-parallel group (size 1 when CP is off)."""
        from megatron.core import parallel_state as ps

        size = ps.get_context_parallel_world_size()
        if size == 1:
            return cls(seq_len, kind=kind)
        return cls(seq_len, size, ps.get_context_parallel_rank(), kind, ps.get_context_parallel_group())

    @property
    def num_pieces(self) -> int:
        return self.size * (2 if self.kind == "zigzag" else 1)

    @property
    def piece_len(self) -> int:
        return self.seq_len // self.num_pieces

    @property
    def local_len(self) -> int:
        return self.seq_len // self.size

    def rank_pieces(self, rank: Optional[int] = None) -> list[int]:
        """The global piece ids rank holds, in local order."""
        r = self.rank if rank is None else rank
        return [r] if self.kind == "contiguous" else [r, 2 * self.size - 1 - r]

    def piece_range(self, piece: int) -> tuple[int, int]:
        return piece * self.piece_len, (piece + 1) * self.piece_len

    def rank_order_index(self) -> Tensor:
        """[NP] int64: row p is where global piece p sits in a rank-order all-gather of every
        rank's pieces (rank r's slots at rows r * pieces-per-rank + slot)."""
        index = [0] * self.num_pieces
        for r in range(self.size):
            pieces = self.rank_pieces(r)
            for slot, p in enumerate(pieces):
                index[p] = r * len(pieces) + slot
        return torch.tensor(index)

    def rank_ranges(self) -> list[tuple[int, int]]:
        """The global [start, end) of this rank's pieces, in local order (the q_ranges of
        ops.causal_attention: where this rank's queries sit among every rank's keys)."""
        return [self.piece_range(p) for p in self.rank_pieces()]

    def positions(self, device=None) -> Tensor:
        """[Tl] int64 global index of each local token."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.rank_ranges()])

    def shard(self, x: Tensor, dim: int = 0) -> Tensor:
        """This rank's tokens of a global [..., T, ...] tensor (T at dim)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"shard: expected {self.seq_len} tokens at dim {dim}, got shape {list(x.shape)}"
            )
        if self.size == 1:
            return x
        return torch.cat([x.narrow(dim, p * self.piece_len, self.piece_len) for p in self.rank_pieces()], dim)

    def gather(self, x: Tensor, dim: int = 0) -> Tensor:
        """The global [..., T, ...] tensor from every rank's local [..., Tl, ...] (differentiable).

        Every rank gets all T tokens in global order; gradients flow back to the owning rank.
        """
        if x.shape[dim] != self.local_len:
            raise ValueError(
                f"gather: expected {self.local_len} local tokens at dim {dim}, got shape {list(x.shape)}"
            )
        if self.size == 1:
            return x
        xs = all_gather(x.movedim(dim, 0), self.group)  # [P * Tl, ...] in rank order
        pieces = xs.unflatten(0, (self.num_pieces, self.piece_len))  # [NP, L, ...] in rank order
        return pieces[self.rank_order_index().to(xs.device)].flatten(0, 1).movedim(0, dim)

    def local_segments(self, cu_seqlens: Optional[Tensor]) -> "LocalSegments":
        """Cuts the global packed sequences (cu_seqlens [N + 1] over T, or None: one sequence
        per row) at this rank's piece boundaries."""
        if cu_seqlens is None:
            bounds = [0, self.seq_len]
        else:
            bounds = [int(c) for c in cu_seqlens.tolist()]
            if bounds[0] != 0 or bounds[-1] != self.seq_len or any(a > b for a, b in zip(bounds, bounds[1:])):
                raise ValueError(
                    f"cu_seqlens: expected non-decreasing global offsets from 0 to "
                    f"T={self.seq_len}, got {bounds}"
                )
        starts = sorted(set(bounds[:-1]))  # empty sequences have no tokens to place
        cu, seq_start, first_in_piece, last_in_piece, gstart = [0], [], [], [], []
        for p in self.rank_pieces():
            a, b = self.piece_range(p)
            cuts = [a] + [s for s in starts if a < s < b] + [b]
            for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
                cu.append(cu[-1] + e - s)
                gstart.append(s)
                seq_start.append(s in starts)
                first_in_piece.append(i == 0)
                last_in_piece.append(i == len(cuts) - 2)
        return LocalSegments(
            cu_seqlens=torch.tensor(cu, dtype=torch.int64),
            global_start=torch.tensor(gstart, dtype=torch.int64),
            starts_sequence=torch.tensor(seq_start),
            first_in_piece=torch.tensor(first_in_piece),
            last_in_piece=torch.tensor(last_in_piece),
        )

    def sequence_positions(self, cu_seqlens: Optional[Tensor], device=None) -> Tensor:
        """[Tl] int64 position of each local token inside its own packed sequence (RoPE)."""
        pos = self.positions(device)
        if cu_seqlens is None:
            return pos
        cu = cu_seqlens.to(device=pos.device, dtype=torch.int64)
        return pos - cu[torch.searchsorted(cu, pos, right=True) - 1]

    def sequence_ids(self, cu_seqlens: Optional[Tensor], positions: Tensor) -> Optional[Tensor]:
        """Packed-sequence id of each global token index in positions, or None when unpacked."""
        if cu_seqlens is None:
            return None
        cu = cu_seqlens.to(device=positions.device, dtype=torch.int64)
        return torch.searchsorted(cu[1:], positions, right=True)


def local_layout(local_len: int, kind: str = "zigzag") -> Optional[CPLayout]:
    """The layout of a layer's local_len tokens under Megatron's context-parallel group, or None
    when CP is off or parallel_state is not initialised (the single-device path then runs)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return None
    return CPLayout.from_parallel_state(local_len * ps.get_context_parallel_world_size(), kind)


def token_positions(
    packed_seq_params, s: int, b: int, device, layout: Optional["CPLayout"] = None
) -> tuple[Tensor, Optional[Tensor]]:
    """An attention layer's [s] RoPE positions (restarting per packed sequence) and cu_seqlens
    [N + 1] or None. Under CP (layout) the s local tokens sit at layout.positions() and
    cu_seqlens holds global offsets over layout.seq_len tokens."""
    from megatron_moe_hybrid.ops.sparse_attention import positions_from_cu_seqlens

    if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
        return (torch.arange(s, device=device) if layout is None else layout.positions(device)), None
    cu_seqlens = packed_seq_params.cu_seqlens_q
    cu_kv = packed_seq_params.cu_seqlens_kv
    if cu_kv is not None and not torch.equal(cu_kv, cu_seqlens):
        raise ValueError("packed_seq_params.cu_seqlens_kv must equal cu_seqlens_q (self-attention)")
    if b != 1:
        raise ValueError(f"packed_seq_params: packed sequences need hidden_states [s, 1, h], got batch {b}")
    if layout is not None:
        return layout.sequence_positions(cu_seqlens, device), cu_seqlens
    return positions_from_cu_seqlens(cu_seqlens, s), cu_seqlens


@dataclass(frozen=True)
class LocalSegments:
    """This rank's tokens cut at piece and packed-sequence boundaries (NS local segments).

    cu_seqlens [NS + 1] local offsets; global_start [NS] global index of each segment's first
    token; starts_sequence [NS] whether that token begins a packed sequence (else the segment
    continues one from the piece before it in global order); first_in_piece / last_in_piece
    [NS] where the segment sits in its piece.
    """

    cu_seqlens: Tensor
    global_start: Tensor
    starts_sequence: Tensor
    first_in_piece: Tensor
    last_in_piece: Tensor
