"""Linear attention under context parallelism: each rank runs its own pieces, one all-gather of
per-piece states, a fold in global order, an output correction. No new kernel is needed.

Shape legend: B batch, T global tokens, Tl = T / P local tokens, H heads, K key dim, V value
dim, N sequences (B, or the number of global cu_seqlens segments), NP pieces in all, NPL
pieces on this rank, L tokens per piece, NS local segments (pieces cut at packed-sequence
starts, see CPLayout.local_segments), C channels.

Per head the state recurrence is affine in the state, S_t = A_t S_{t-1} + b_t, with
A_t = exp(g_t) (I - beta_t k_t k_t^T) for the gated delta rule and exp(g_t) I for simple GLA.
With P_t = A_t ... A_1 a segment started from S0 gives S_t = P_t S0 + S_t|0 (S_t|0 from a zero
start), so o_t = o_t|0 + S0^T P_t^T (scale q_t). Every value column evolves with the same A_t,
so the gated delta rule run once with v_aug = [v | 0_K] and initial state [S | I_K] returns
o_aug = [o|0 | P_t^T (scale q_t)] and final state [S_T|0 | P_T]: the correction needs only the
state S_in entering the segment. For simple GLA P_t = exp(cumsum g) I, computed directly.

Each rank runs its segments from a zero state (a segment that begins a sequence starts from
that sequence's initial_state instead), all-gathers (S_out|0, P) of the last segment of each
piece (and of the segment that ends each sequence, for the final state), and folds in global
piece order: S_in(p + 1) = P(p) S_in(p) + S_out|0(p), where P(p) is
zero unless the piece passes the state through (one segment, continuing a sequence). The
transitions P are zero for every segment that starts a sequence, so the same fold and
correction apply to all of them. The backward is autograd through all_gather, whose gradient
returns to the owning rank.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron_moe_hybrid.ops.linear_attention import gated_delta_rule, simple_gla
from megatron_moe_hybrid.ops.linear_attention.reference import _check_inputs
from megatron_moe_hybrid.parallel.context_parallel import CPLayout, LocalSegments, all_gather

__all__ = ["conv_halo", "cp_gated_delta_rule", "cp_simple_gla"]


def cp_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    layout: CPLayout,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Optional[Tensor]]:
    """ops.linear_attention.gated_delta_rule over a sequence split by layout.

    q, k [B, Tl, H, K], v [B, Tl, H, V], g, beta [B, Tl, H]: this rank's local tokens (its
    pieces concatenated, layout.shard of the global tensors). cu_seqlens [N + 1]: GLOBAL
    offsets over the T tokens, the same on every rank (B == 1 then).

    initial_state [N, H, K, V] is the state before each sequence's first global token, passed
    identically on every rank; a rank uses only the rows of sequences that start in its
    pieces, so the other rows get no gradient there: sum its gradient over the CP group, as
    for any replicated parameter. The final state [N, H, K, V] (output_final_state; its N rows
    ride in the same all-gather) comes back on every rank with the same values; the gradient
    that reaches the inputs is the sum over ranks of each rank's final-state gradient (the
    global loss is the sum of rank losses), so put a final-state loss term on one rank to count
    it once. o [B, Tl, H, V] in v's dtype. With layout.size == 1 this is gated_delta_rule itself.

    Every rank of layout.group must call this, and must run the backward: that of the
    all-gather is a collective.

    The math runs in fp32 (fp64 for fp64 inputs): the inputs are cast before the op call so
    that the correction is added before o is rounded to v's dtype once.
    """
    if layout.size == 1:
        return gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            chunk_size=chunk_size, backend=backend,
        )
    if beta is None:
        raise ValueError("beta: the gated delta rule needs beta [B, Tl, H]; use cp_simple_gla for no beta")
    return _cp_run(
        q, k, v, g, beta, layout, scale, initial_state, output_final_state, cu_seqlens,
        chunk_size, backend,
    )


def cp_simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    layout: CPLayout,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Optional[Tensor]]:
    """ops.linear_attention.simple_gla over a sequence split by layout; arguments, results and
    gradient conventions as cp_gated_delta_rule, without beta."""
    if layout.size == 1:
        return simple_gla(
            q, k, v, g, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            chunk_size=chunk_size, backend=backend,
        )
    return _cp_run(
        q, k, v, g, None, layout, scale, initial_state, output_final_state, cu_seqlens,
        chunk_size, backend,
    )


def conv_halo(x: Tensor, layout: CPLayout, width: int, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """The `width` tokens before each of this rank's pieces in global order, for a causal conv.

    x [B, Tl, C] local -> [NPL, B, width, C]. Rows before token 0, or before the start of the
    packed sequence (global cu_seqlens) that holds the piece's first token, are zero. One
    all-gather of every piece's last min(width, L) rows (differentiable: a halo row's gradient
    returns to the rank that owns the token).
    """
    B, _, C = x.shape
    NPL, L = len(layout.rank_pieces()), layout.piece_len
    if width == 0:
        return x.new_zeros(NPL, B, 0, C)
    n = min(width, L)  # a piece shorter than the halo lends all of itself
    tails = x.unflatten(1, (NPL, L))[:, :, L - n :].movedim(1, 0)  # [NPL, B, n, C]
    tails = all_gather(tails.contiguous(), layout.group)[layout.rank_order_index()]  # [NP, B, n, C]
    # [B, width + NP * n, C]: the tails in global order after `width` zero rows for token 0
    history = torch.cat([x.new_zeros(B, width, C), tails.movedim(0, 1).flatten(1, 2)], dim=1)
    starts = torch.tensor([layout.piece_range(p)[0] for p in layout.rank_pieces()])  # [NPL]
    if cu_seqlens is None:
        seq_start = torch.zeros_like(starts)
    else:
        cu = cu_seqlens.long().cpu()
        seq_start = cu[layout.sequence_ids(cu, starts)]  # [NPL]
    halos = []
    for j, p in enumerate(layout.rank_pieces()):
        # The last `width` tails before piece p are exactly the `width` tokens before it.
        pos = starts[j] - width + torch.arange(width)  # [width] global index of each halo row
        keep = (pos >= seq_start[j]).to(x)[:, None]  # [width, 1]
        # A slice of history even where it is all zeros (piece 0): the gather stays in every
        # rank's graph, so every rank runs its backward, a collective.
        halos.append(history[:, p * n : p * n + width] * keep)
    return torch.stack(halos)


def _check(q, k, v, g, beta, layout, initial_state, cu_seqlens) -> None:
    _check_inputs(q, k, v, g, beta, None, None)
    B, Tl, H, K = q.shape
    if Tl != layout.local_len:
        raise ValueError(
            f"q: expected this rank's {layout.local_len} local tokens at dim 1 (T={layout.seq_len} "
            f"over {layout.size} context-parallel ranks), got shape {list(q.shape)}; pass "
            "layout.shard(x, dim=1) of the global tensors"
        )
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"cu_seqlens: expected an integer [N + 1] tensor of GLOBAL offsets (N >= 1), "
                f"got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
            )
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got B={B}; flatten the batch")
        N = cu_seqlens.numel() - 1
    expected = [N, H, K, v.shape[-1]]
    if initial_state is not None and list(initial_state.shape) != expected:
        raise ValueError(
            f"initial_state: expected [N, H, K, V] = {expected} (the state before each "
            f"sequence's first global token), got {list(initial_state.shape)}"
        )


def _cp_run(
    q, k, v, g, beta, layout, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
    backend,
):
    _check(q, k, v, g, beta, layout, initial_state, cu_seqlens)
    B, Tl, H, K = q.shape
    V, L = v.shape[-1], layout.piece_len
    out_dtype = v.dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = K**-0.5 if scale is None else scale
    q, k, v, g = (x.to(acc) for x in (q, k, v, g))
    segs = layout.local_segments(None if cu_seqlens is None else cu_seqlens.cpu())
    offsets = segs.cu_seqlens.tolist()
    NS = len(offsets) - 1
    continues = ~segs.starts_sequence  # [NS]; only a piece's first segment can continue
    s0 = _segment_initial_states(initial_state, segs, layout, cu_seqlens, (B, NS, H, K, V), v)
    run = dict(scale=scale, chunk_size=chunk_size, backend=backend)
    eye = torch.eye(K, dtype=acc, device=q.device)
    if beta is not None:
        ident = torch.where(continues.to(q.device)[:, None, None, None], eye, 0)  # [NS, 1, K, K]
        init = torch.cat([s0, ident.expand(B, NS, H, K, K)], dim=-1)  # [B, NS, H, K, V + K]
        v_aug = torch.cat([v, v.new_zeros(B, Tl, H, K)], dim=-1)  # [B, Tl, H, V + K]
        o_aug, s_aug = _run_segments(gated_delta_rule, (q, k, v_aug, g, beta.to(acc)), init, segs, L, run)
        o0, pq = o_aug.split([V, K], dim=-1)  # [B, Tl, H, V], [B, Tl, H, K] = P_t^T (scale q_t)
        s_loc, M = s_aug.split([V, K], dim=-1)  # [B, NS, H, K, V], [B, NS, H, K, K]
    else:
        o0, s_loc = _run_segments(simple_gla, (q, k, v, g), s0, segs, L, run)
        pqs, Ms = [], []
        for a, b, cont in zip(offsets[:-1], offsets[1:], continues.tolist()):
            if cont:
                gam = g[:, a:b].cumsum(1)  # [B, n, H] log decay from the segment start
                pqs.append(gam.exp()[..., None] * (scale * q[:, a:b]))  # [B, n, H, K]
                Ms.append(gam[:, -1].exp()[..., None, None] * eye)  # [B, H, K, K]
            else:
                pqs.append(q.new_zeros(B, b - a, H, K))
                Ms.append(q.new_zeros(B, H, K, K))
        pq, M = torch.cat(pqs, dim=1), torch.stack(Ms, dim=1)

    # One all-gather whatever T is: every piece's (S_out|0, P) of its last segment and, for the
    # final state, (S|0, P) of the segment that ends each sequence (zero where it ends elsewhere).
    states = torch.cat([s_loc, M], dim=-1)  # [B, NS, H, K, V + K]
    NPL = len(layout.rank_pieces())
    rows = [states[:, segs.last_in_piece].movedim(1, 0).flatten(0, 1)]  # [NPL * B, H, K, V + K]
    if output_final_state:
        rows.append(_sequence_end_rows(states, segs, layout, cu_seqlens))  # [N, H, K, V + K]
    gathered = all_gather(torch.cat(rows), layout.group).unflatten(0, (layout.size, -1))
    by_piece = gathered[:, : NPL * B].unflatten(1, (NPL, B)).flatten(0, 1)  # [P * NPL, B, H, K, V + K]
    by_piece = by_piece[layout.rank_order_index()]  # [NP, B, H, K, V + K] in global order
    s_in = [s_loc.new_zeros(B, H, K, V)]  # the state entering global piece 0, 1, ...
    for p in range(layout.num_pieces - 1):
        s_out0, M_p = by_piece[p].split([V, K], dim=-1)
        s_in.append(M_p @ s_in[-1] + s_out0)
    # Stacked over all pieces, the fold keeps the gather in this rank's graph even where its own
    # pieces need nothing from it (contiguous rank 0): every rank must run its backward, a collective.
    s_in = torch.stack(s_in)  # [NP, B, H, K, V]
    s_in_piece = s_in[layout.rank_pieces()].movedim(0, 1)  # [B, NPL, H, K, V]

    # pq is zero outside continuing segments, so each piece's correction is a plain product.
    o = torch.cat(
        [
            o0[:, j * L : (j + 1) * L]
            + torch.einsum("bthk,bhkv->bthv", pq[:, j * L : (j + 1) * L], s_in_piece[:, j])
            for j in range(NPL)
        ],
        dim=1,
    ).to(out_dtype)  # [B, Tl, H, V]
    if not output_final_state:
        return o, None
    s_end, M_end = gathered[:, NPL * B :].sum(0).split([V, K], dim=-1)  # [N, H, K, V], [N, H, K, K]
    if cu_seqlens is None:
        seq_end, seq_row = torch.full((B,), layout.seq_len), torch.arange(B)
    else:
        seq_end, seq_row = cu_seqlens[1:].long().cpu(), torch.zeros(cu_seqlens.numel() - 1, dtype=torch.long)
    end_piece = (seq_end - 1).clamp(min=0) // L  # [N]; M_end is zero for an empty sequence
    final = s_end + M_end @ s_in[end_piece, seq_row]  # [N, H, K, V]
    if cu_seqlens is not None and initial_state is not None:
        # An empty sequence keeps its initial state, read here on every rank.
        empty = (seq_end == cu_seqlens[:-1].long().cpu()).to(final.device)[:, None, None, None]
        final = final + torch.where(empty, initial_state.to(final.dtype), 0)
    return o, final


def _segment_initial_states(initial_state, segs: LocalSegments, layout, cu_seqlens, shape, v) -> Tensor:
    """[B, NS, H, K, V] = shape: the initial_state of the sequence a segment begins, zero where
    it continues one (or without initial_state); in v's dtype and device."""
    if initial_state is None:
        return v.new_zeros(shape)
    starts = segs.starts_sequence.to(initial_state.device)[:, None, None, None]  # [NS, 1, 1, 1]
    init = initial_state.to(v.dtype)  # [N, H, K, V]
    if cu_seqlens is None:
        return torch.where(starts, init[:, None], 0)  # [B, NS, H, K, V]
    ids = layout.sequence_ids(cu_seqlens.cpu(), segs.global_start).to(init.device)  # [NS]
    return torch.where(starts, init[ids], 0)[None]  # [1, NS, H, K, V]


def _run_segments(op, tensors, init: Tensor, segs: LocalSegments, L: int, run: dict):
    """Runs op on every local segment from init [B, NS, H, K, D]: o [B, Tl, H, D] and the final
    states [B, NS, H, K, D]."""
    B, NS = init.shape[:2]
    if B == 1:
        o, s = op(*tensors, initial_state=init[0], output_final_state=True,
                  cu_seqlens=segs.cu_seqlens, **run)  # fmt: skip
        return o, s[None]
    # B > 1 is unpacked: the segments are the NS pieces, all L long, so they become batch rows.
    rows = [x.unflatten(1, (NS, L)).flatten(0, 1) for x in tensors]
    o, s = op(*rows, initial_state=init.flatten(0, 1), output_final_state=True, **run)
    return o.unflatten(0, (B, NS)).flatten(1, 2), s.unflatten(0, (B, NS))


def _sequence_end_rows(states, segs: LocalSegments, layout, cu_seqlens) -> Tensor:
    """[N, H, K, V + K]: states [B, NS, H, K, V + K] of this rank's segments that end a
    sequence, at that sequence's row; zero for sequences that end on another rank."""
    seg_end = segs.global_start + segs.cu_seqlens.diff()  # [NS] global end of each segment
    if cu_seqlens is None:
        return states[:, seg_end == layout.seq_len].sum(1)  # [B, ...]: only the last piece ends one
    cu = cu_seqlens.long().cpu()
    ids = layout.sequence_ids(cu, segs.global_start)  # [NS]
    ends = seg_end == cu[ids + 1]
    rows = states.new_zeros(cu.numel() - 1, *states.shape[2:])
    return rows.index_add(0, ids[ends].to(states.device), states[0, ends.to(states.device)])
