"""Device-side routing layouts for the static (sync-free) expert-parallel dispatch.

Everything here is a handful of integer kernels over T*K or ep*C*K entries, with every size
known on the host in advance: nothing reads a device value back, so a forward+backward
passes `torch.cuda.set_sync_debug_mode("error")`.

A token travels once to each rank that holds one of its experts (not once per expert): the
send buffer has ep * C rows, rows [r * C, (r + 1) * C) going to rank r in token order, each
with the local expert ids of the token's copies there. The receiver expands its rows into
R rows grouped by local expert. Rows past C, or copies past R, are counted as overflow.

Shape legend:
    T  local tokens          K  experts per token       E  experts (global)
    ep EP group size         E_local = E / ep           C  rows per (source, destination) rank pair
    M  = ep * C received rows                           R  expert-grouped rows kept by a rank
    i  = t * K + k           the flat index of a routed copy
"""

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from megatron_moe_hybrid.ops.moe.gather import _triton_ok
from .._intmath import cdiv, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU
    triton = None


@dataclass
class TokenSendLayout:
    pair_slot: torch.Tensor  # [T, ep] int64: send row of (token, destination); -1 = none or overflowed
    send_token: torch.Tensor  # [ep * C] int64: token of each send row; -1 = padding
    send_expert: torch.Tensor  # [ep * C, K] int64: local expert of copy k of the row's token there; -1 = none
    send_copy: torch.Tensor  # [ep * C, K] int64: flat copy index t * K + k of that entry; -1 = none
    copy_entry: torch.Tensor  # [T, K] int64: flat send entry row * K + k of copy (t, k); -1 = not sent
    overflow: torch.Tensor  # [] int64: routed copies whose (token, destination) row did not fit in C


@dataclass
class ExpandLayout:
    sorted_row: torch.Tensor  # [R] int64: receive row feeding each expert-grouped row; -1 = tail
    sorted_copy: torch.Tensor  # [R] int64: flat (row, k) entry of each expert-grouped row; -1 = tail
    copy_pos: torch.Tensor  # [M, K] int64: expert-grouped row of entry (row, k); -1 = none or overflowed
    tokens_per_expert: torch.Tensor  # [E_local] int64 (device): rows kept per local expert
    overflow: torch.Tensor  # [] int64: received copies past the R rows


def _ceil_times(factor: float, value: int) -> int:
    """ceil(factor * value) in exact arithmetic (a float product can land one row high)."""
    return math.ceil(Fraction(str(factor)) * value)


def token_capacity(num_tokens: int, topk: int, ep_size: int, capacity_factor: float | None) -> int:
    """Rows per (source, destination) pair: factor x the share T * min(K, ep) / ep of a rank
    (a token reaches at most min(K, ep) ranks), at most T; None or ep_size 1 gives T."""
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    if ep_size == 1 or capacity_factor is None:
        return max(1, num_tokens)
    share = Fraction(num_tokens * min(topk, ep_size), ep_size)
    return max(1, min(num_tokens, math.ceil(Fraction(str(capacity_factor)) * share)))


def expert_rows(
    num_recv_rows: int, num_tokens: int, topk: int, num_local: int, capacity_factor: float | None,
    ep_size: int | None = None,
) -> int:
    """Expert-grouped rows a rank keeps: every received (row, local expert) entry, at most
    factor x the balanced T * K (None, or ep_size 1 where a rank only computes its own
    copies: no limit)."""
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    most = num_recv_rows * min(topk, num_local)
    if capacity_factor is None or ep_size == 1:
        return max(1, most)
    return max(1, min(most, _ceil_times(capacity_factor, num_tokens * topk)))


def token_send_layout(topk_idx: torch.Tensor, num_experts: int, ep_size: int, capacity: int) -> TokenSendLayout:
    """topk_idx [T, K] int64 (-1 = dropped) -> rows [r * C, (r + 1) * C) carry, in token order,
    the tokens with an expert on rank r, each once, with the local experts of its copies."""
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(f"topk_idx must be a [T, K] int64 tensor, got {topk_idx.dtype} {tuple(topk_idx.shape)}")
    if num_experts % ep_size or capacity < 1:
        raise ValueError(f"need num_experts % ep_size == 0 and capacity >= 1, got {num_experts}, {ep_size}, {capacity}")
    dev = topk_idx.device
    num_tokens, topk = topk_idx.shape
    num_local = num_experts // ep_size
    valid = topk_idx >= 0  # [T, K]
    if ep_size == 1 and capacity >= num_tokens:  # every token keeps its own row: an identity layout
        token = torch.arange(num_tokens, device=dev)
        copy = torch.where(valid, torch.arange(num_tokens * topk, device=dev).view(num_tokens, topk), -1)  # [T, K]
        send_token, send_expert, send_copy = token, topk_idx, copy
        if capacity > num_tokens:  # padding rows after the tokens (the dispatcher's EP=1 has none)
            pad_rows = torch.full((capacity - num_tokens, topk), -1, dtype=torch.int64, device=dev)
            send_token = torch.cat([token, pad_rows[:, 0]])
            send_expert, send_copy = torch.cat([topk_idx, pad_rows]), torch.cat([copy, pad_rows])
        # no copies of the [T, K] maps where there is no padding: nothing writes into a layout
        return TokenSendLayout(token[:, None], send_token, send_expert, send_copy, copy,
                               torch.zeros((), dtype=torch.int64, device=dev))
    dest = torch.where(valid, topk_idx // num_local, ep_size)  # [T, K]; ep_size = no destination
    present = torch.zeros(num_tokens, ep_size + 1, dtype=torch.bool, device=dev)
    present.scatter_(1, dest, True)
    present = present[:, :ep_size]  # [T, ep]
    # [T, ep] row within the destination's block; scanned along a contiguous last dim (a scan
    # over the outer dim of a [T, 2] tensor runs on a handful of threads)
    pos = (present.t().long().contiguous().cumsum(1) - 1).t()
    ok = present & (pos < capacity)
    pair_slot = torch.where(ok, torch.arange(ep_size, device=dev) * capacity + pos, -1)  # [T, ep]

    dump = ep_size * capacity  # rows that do not exist land on an extra row that is cut off
    send_token = torch.full((dump + 1,), -1, dtype=torch.int64, device=dev)
    token = torch.arange(num_tokens, device=dev)[:, None].expand(num_tokens, ep_size)
    send_token[torch.where(ok, pair_slot, dump)] = torch.where(ok, token, -1)
    copy_slot = torch.where(valid, pair_slot.gather(1, dest.clamp(max=ep_size - 1)), -1)  # [T, K]
    rows = torch.where(copy_slot >= 0, copy_slot, dump)  # [T, K]
    cols = torch.arange(topk, device=dev).expand(num_tokens, topk)
    send_expert = torch.full((dump + 1, topk), -1, dtype=torch.int64, device=dev)
    send_expert[rows, cols] = torch.where(copy_slot >= 0, topk_idx - dest * num_local, -1)
    send_copy = torch.full((dump + 1, topk), -1, dtype=torch.int64, device=dev)
    flat = torch.arange(num_tokens * topk, device=dev).view(num_tokens, topk)
    send_copy[rows, cols] = torch.where(copy_slot >= 0, flat, -1)
    overflow = (valid & (copy_slot < 0)).sum()
    copy_entry = torch.where(copy_slot >= 0, copy_slot * topk + cols, -1)  # [T, K]
    return TokenSendLayout(pair_slot, send_token[:dump], send_expert[:dump], send_copy[:dump], copy_entry, overflow)


def expand_layout(recv_expert: torch.Tensor, num_local: int, num_rows: int, backend: str = "auto") -> ExpandLayout:
    """recv_expert [M, K] (local expert of each received row's entries, -1 = none) -> the
    expansion of received rows into num_rows rows grouped by local expert (entries in
    (row, k) order within an expert; a tail of padding; entries past num_rows overflow).

    backend "torch": a stable sort and index ops (~20 launches); "triton": a counting sort in
    three kernels (_expert_count_kernel, _expert_base_kernel, _expert_place_kernel) and two
    fills; "auto": Triton on CUDA. Both give the same layout, element for element."""
    if recv_expert.dim() != 2:
        raise ValueError(f"recv_expert must be [M, K], got {tuple(recv_expert.shape)}")
    if num_local < 1 or num_rows < 1:
        raise ValueError(f"expand_layout needs num_local >= 1 and num_rows >= 1, got {num_local}, {num_rows}")
    if _triton_ok(recv_expert, backend):  # the gathers' backend rule (int64 keys pass its dtype check)
        return _expand_layout_triton(recv_expert, num_local, num_rows)
    dev = recv_expert.device
    num_recv, topk = recv_expert.shape
    flat = recv_expert.reshape(-1)  # [M*K]
    key = torch.where(flat < 0, num_local, flat)
    sorted_key, order = torch.sort(key, stable=True)  # [M*K]
    starts = torch.searchsorted(sorted_key, torch.arange(num_local + 1, device=dev))  # [E_local + 1]
    counts = starts[1:] - starts[:-1]  # [E_local] entries per local expert
    if order.numel() < num_rows:  # fewer entries than rows: the rest is tail
        pad = num_rows - order.numel()
        order = torch.cat([order, order.new_full((pad,), -1)])
        sorted_key = torch.cat([sorted_key, sorted_key.new_full((pad,), num_local)])
    keep = sorted_key[:num_rows] < num_local  # [R]
    sorted_copy = torch.where(keep, order[:num_rows], -1)  # [R]
    sorted_row = torch.where(keep, sorted_copy // topk, -1)  # [R]
    copy_pos = torch.full((num_recv * topk + 1,), -1, dtype=torch.int64, device=dev)
    copy_pos[torch.where(keep, sorted_copy, num_recv * topk)] = torch.where(
        keep, torch.arange(num_rows, device=dev), -1
    )
    kept = torch.minimum(counts, torch.clamp(num_rows - starts[:-1], min=0))  # [E_local]
    return ExpandLayout(
        sorted_row, sorted_copy, copy_pos[:-1].view(num_recv, topk), kept, (counts - kept).sum()
    )


# The counting sort: entries i = j * K + k in blocks of COUNT_BLOCK; per block and expert a
# count (integer atomics: the counts do not depend on their order); each (block, expert)
# starts at the expert's start plus the counts of earlier blocks (expert-major [E_local,
# blocks], so that scan runs along contiguous memory); within a block an entry
# comes after the earlier entries of its expert (a [COUNT_BLOCK, COUNT_BLOCK] comparison).
COUNT_BLOCK = 128  # entries per block (one program of the count and the place kernels)
BASE_SCAN = 1024  # blocks scanned at once by the base kernel (one program per expert)

if triton is not None:
    from .._launch import fast_launch

    @fast_launch
    @triton.jit
    def _expert_count_kernel(keys, counts, totals, n, nblk, L, BLOCK: tl.constexpr, LB: tl.constexpr):
        """counts[e, b] += entries of block b with key e (zeroed before; keys outside [0, L)
        count nowhere); then totals[e] += counts[e, b]."""
        b = tl.program_id(0).to(tl.int64)
        i = b * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(keys + i, mask=i < n, other=-1).to(tl.int32)
        valid = (i < n) & (key >= 0) & (key < L)
        slot = tl.where(valid, key, 0).to(tl.int64) * nblk + b
        tl.atomic_add(counts + slot, tl.full((BLOCK,), 1, tl.int32), mask=valid)
        tl.debug_barrier()  # the block's counts complete before they are read back
        e = tl.arange(0, LB)
        c = tl.load(counts + e.to(tl.int64) * nblk + b, mask=e < L, other=0, volatile=True)
        tl.atomic_add(totals + e, c, mask=(e < L) & (c > 0))

    @fast_launch
    @triton.jit
    def _expert_base_kernel(counts, totals, base, kept, overflow, nblk, L, R, LB: tl.constexpr, BB: tl.constexpr):
        """Expert e = program: base[e, b] = start of e (the totals of the experts before it) +
        its entries in blocks before b (a scan along the contiguous block axis); kept[e] = its
        entries within the first R rows; program 0 writes overflow = the entries past them."""
        e = tl.program_id(0)
        all_e = tl.arange(0, LB)
        total = tl.load(totals + all_e, mask=all_e < L, other=0).to(tl.int64)  # [LB]
        run = tl.sum(tl.where(all_e < e, total, 0), axis=0)
        mine = tl.sum(tl.where(all_e == e, total, 0), axis=0)
        tl.store(kept + e, tl.minimum(mine, tl.maximum(R - run, 0)))
        if e == 0:
            start_all = tl.cumsum(total, axis=0) - total
            tl.store(overflow, tl.sum(total - tl.minimum(total, tl.maximum(R - start_all, 0)), axis=0))
        row = e.to(tl.int64) * nblk
        for b0 in range(0, nblk, BB):
            blk = b0 + tl.arange(0, BB)
            c = tl.load(counts + row + blk, mask=blk < nblk, other=0)  # [BB] int32
            tl.store(base + row + blk, run + (tl.cumsum(c, axis=0) - c).to(tl.int64), mask=blk < nblk)
            run += tl.sum(c, axis=0).to(tl.int64)

    @fast_launch
    @triton.jit
    def _expert_place_kernel(keys, base, sorted_copy, sorted_row, copy_pos, n, nblk, L, R, K, BLOCK: tl.constexpr):
        """Entries of block b: row = base[key, b] + the earlier entries of the key in the block
        (kept when below R)."""
        b = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK)
        i = b * BLOCK + r
        inb = i < n
        key = tl.load(keys + i, mask=inb, other=-1).to(tl.int32)
        valid = inb & (key >= 0) & (key < L)
        earlier = tl.sum(((key[:, None] == key[None, :]) & (r[None, :] < r[:, None])).to(tl.int32), axis=1)
        pos = tl.load(base + tl.where(valid, key, 0).to(tl.int64) * nblk + b, mask=valid, other=0) + earlier
        keep = valid & (pos < R)
        tl.store(sorted_copy + pos, i, mask=keep)
        tl.store(sorted_row + pos, i // K, mask=keep)
        tl.store(copy_pos + i, tl.where(keep, pos, -1), mask=inb)


def _expand_layout_triton(recv_expert: torch.Tensor, num_local: int, num_rows: int) -> ExpandLayout:
    dev = recv_expert.device
    num_recv, topk = recv_expert.shape
    keys = recv_expert.contiguous().view(-1)  # [n] int64
    n = keys.numel()
    nblk = max(1, cdiv(n, COUNT_BLOCK))
    zeroed = torch.zeros((nblk + 1) * num_local, dtype=torch.int32, device=dev)  # one memset
    counts, totals = zeroed[: nblk * num_local], zeroed[nblk * num_local :]  # [E_local * blocks], [E_local]
    base = torch.empty(num_local, nblk, dtype=torch.int64, device=dev)
    kept = torch.empty(num_local, dtype=torch.int64, device=dev)
    overflow = torch.empty((), dtype=torch.int64, device=dev)
    rows = torch.full((2, num_rows), -1, dtype=torch.int64, device=dev)  # sorted_copy, sorted_row
    copy_pos = torch.empty(num_recv, topk, dtype=torch.int64, device=dev)
    lb = next_power_of_2(num_local)
    _expert_count_kernel[(nblk,)](keys, counts, totals, n, nblk, num_local, BLOCK=COUNT_BLOCK, LB=lb)
    _expert_base_kernel[(num_local,)](counts, totals, base, kept, overflow, nblk, num_local, num_rows,
                                      LB=lb, BB=min(next_power_of_2(nblk), BASE_SCAN))
    if n:
        _expert_place_kernel[(nblk,)](keys, base, rows[0], rows[1], copy_pos, n, nblk, num_local, num_rows, topk,
                                      BLOCK=COUNT_BLOCK)
    return ExpandLayout(rows[1], rows[0], copy_pos, kept, overflow)
