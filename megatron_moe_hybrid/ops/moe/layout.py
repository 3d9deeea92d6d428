"""Device-side routing layouts for the static (sync-free) expert-parallel dispatch.

Everything here is a handful of integer kernels over T*K or ep*C entries, with every size
known on the host in advance: nothing reads a device value back, so a forward+backward
passes `torch.cuda.set_sync_debug_mode("error")`.

Shape legend:
    T  local tokens          K  experts per token       E  experts (global)
    ep EP group size         E_local = E / ep           C  rows per (source, destination) rank pair
    i  = t * K + k           the flat index of a routed copy

Send layout: the send buffer has ep * C rows; rows [r * C, (r + 1) * C) go to rank r, ordered
by local expert and, within an expert, by i. Copies past C (overflow) and copies dropped by
the router (topk_idx -1) get no row.
"""

from dataclasses import dataclass

import torch


@dataclass
class SendLayout:
    slot_map: torch.Tensor  # [T, K] int64: send row of copy (t, k); -1 = dropped or overflowed
    send_copy: torch.Tensor  # [ep * C] int64: flat copy index i in each send row; -1 = padding
    send_counts: torch.Tensor  # [ep, E_local] int64: rows sent to each destination's local experts
    overflow: torch.Tensor  # [] int64: routed copies that did not fit in C


@dataclass
class RecvLayout:
    sorted_src: torch.Tensor  # [ep * C] int64: receive row feeding each expert-grouped row; -1 = tail
    recv_dst: torch.Tensor  # [ep * C] int64: expert-grouped row of each receive row; -1 = padding
    tokens_per_expert: torch.Tensor  # [E_local] int64 (device)
    offsets: torch.Tensor  # [E_local] int32: inclusive cumsum, the grouped GEMM's offs


def capacity_rows(num_copies: int, ep_size: int, capacity_factor: float | None) -> int:
    """Rows per (source, destination) pair: factor x the balanced share T*K/ep, at most T*K.

    None, or ep_size 1, gives T*K: no copy can ever overflow. At least 1, so that a rank
    with no tokens still takes part in the exchange with a well-formed (padding) buffer.
    """
    if ep_size == 1 or capacity_factor is None:
        return max(1, num_copies)
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    balanced = -(-num_copies // ep_size)
    return max(1, min(num_copies, int(-(-balanced * capacity_factor // 1))))


def send_layout(topk_idx: torch.Tensor, num_experts: int, ep_size: int, capacity: int) -> SendLayout:
    """topk_idx [T, K] int64 (-1 = dropped) -> the send layout (see the module docstring)."""
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(f"topk_idx must be a [T, K] int64 tensor, got {topk_idx.dtype} {tuple(topk_idx.shape)}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by ep_size={ep_size}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    dev = topk_idx.device
    num_local = num_experts // ep_size
    flat = topk_idx.reshape(-1)  # [TK]
    key = torch.where(flat < 0, num_experts, flat)  # [TK]; dropped copies sort last
    sorted_key, order = torch.sort(key, stable=True)  # [TK] each
    # starts[e]: first sorted row of expert e (e = E: the dropped copies)
    starts = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=dev))  # [E + 1]
    bounds = torch.cat([starts, starts.new_full((1,), flat.numel())])  # [E + 2]
    counts = (bounds[1:] - bounds[:-1])[:num_experts]  # [E] routed copies per expert
    rank_start = starts[:num_experts:num_local]  # [ep] first sorted row per destination rank

    dest = torch.clamp(sorted_key // num_local, max=ep_size - 1)  # [TK]
    pos = torch.arange(flat.numel(), device=dev) - rank_start[dest]  # [TK] row within the destination
    ok = (sorted_key < num_experts) & (pos < capacity)  # [TK]
    slot_sorted = torch.where(ok, dest * capacity + pos, -1)  # [TK]
    slot_map = torch.empty_like(slot_sorted)
    slot_map[order] = slot_sorted  # order is a permutation: a plain, deterministic scatter

    dump = ep_size * capacity  # overflowed copies land on an extra row that is cut off
    send_copy = torch.full((dump + 1,), -1, dtype=torch.int64, device=dev)
    send_copy[torch.where(ok, slot_sorted, dump)] = torch.where(ok, order, -1)
    send_copy = send_copy[:dump]

    # rows each expert keeps: its copies, cut where its destination's C rows run out
    expert_off = starts[:num_experts] - rank_start.repeat_interleave(num_local)  # [E]
    kept = torch.minimum(counts, torch.clamp(capacity - expert_off, min=0))  # [E]
    overflow = (counts - kept).sum()
    return SendLayout(slot_map.view_as(topk_idx), send_copy, kept.view(ep_size, num_local), overflow)


def recv_layout(recv_counts: torch.Tensor, capacity: int) -> RecvLayout:
    """recv_counts [ep, E_local]: rows each source sent to each local expert -> the regrouping
    from the [source][slot] receive buffer (ep * C rows) to rows grouped by local expert
    (ep * C rows: the grouped rows first, then a tail of padding)."""
    if recv_counts.dim() != 2:
        raise ValueError(f"recv_counts must be [ep, E_local], got {tuple(recv_counts.shape)}")
    ep_size, num_local = recv_counts.shape
    dev = recv_counts.device
    recv_counts = recv_counts.to(torch.int64)
    cum = recv_counts.cumsum(1)  # [ep, E_local] inclusive, within each source's block
    q = torch.arange(capacity, device=dev).expand(ep_size, capacity).contiguous()  # [ep, C]
    expert = torch.searchsorted(cum, q, right=True)  # [ep, C] local expert of each receive row
    valid = expert < num_local  # [ep, C]
    e = expert.clamp(max=num_local - 1)
    # expert-major destination of block (e, src): all earlier experts, then earlier sources
    block_start = (recv_counts.t().reshape(-1).cumsum(0) - recv_counts.t().reshape(-1)).view(num_local, ep_size)
    src = torch.arange(ep_size, device=dev)[:, None].expand(ep_size, capacity)  # [ep, C]
    within = q - (torch.gather(cum, 1, e) - torch.gather(recv_counts, 1, e))  # [ep, C]
    recv_dst = torch.where(valid, block_start[e, src] + within, -1).reshape(-1)  # [ep * C]

    rows = ep_size * capacity
    sorted_src = torch.full((rows + 1,), -1, dtype=torch.int64, device=dev)
    sorted_src[torch.where(recv_dst >= 0, recv_dst, rows)] = torch.where(
        recv_dst >= 0, torch.arange(rows, device=dev), -1
    )
    tokens_per_expert = recv_counts.sum(0)  # [E_local]
    return RecvLayout(sorted_src[:rows], recv_dst, tokens_per_expert, tokens_per_expert.cumsum(0).to(torch.int32))
