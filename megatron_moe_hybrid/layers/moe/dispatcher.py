"""Expert-parallel token dispatchers over all_to_all_single (Megatron's six-step split).

Two dispatchers with the same six steps (dispatch_preprocess, token_dispatch,
dispatch_postprocess, combine_preprocess, token_combine, combine_postprocess):

  StaticAllToAllDispatcher  (moe.dispatcher "static", the default) no host sync: fixed rows
      per rank pair, each token sent once per destination rank, combined on the expert side;
      forward_experts() pipelines chunks. See its docstring.
  AllToAllDispatcher        (moe.dispatcher "alltoall") exact split sizes, read on the host
      once per layer; sends one row per routed copy.

Experts are split contiguously over the EP group: rank r holds experts
[r * E_local, (r + 1) * E_local). Only token_dispatch and token_combine communicate, so a
caller can overlap them with other work. Everything runs on CPU over gloo as well as on GPU.
Copies dropped by the router's capacity (topk_idx -1) are never sent and add nothing.

Shape legend:
    T  local tokens         K  experts per token      h  hidden size
    E  experts (global)     E_local = E / ep          ep EP group size
    N_send rows sent by this rank (T * K less the dropped copies); N_recv rows received
    C  static rows per (source, destination) pair      R  static expert-grouped rows
"""

import torch
import torch.distributed as dist

from megatron_moe_hybrid.ops.moe import layout, permute_tokens, unpermute_tokens
from megatron_moe_hybrid.ops.moe.gather import (
    gather_entries,
    row_gather,
    weighted_combine,
)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, group, x, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = _AllToAll.apply(ctx.group, grad_out, ctx.input_splits, ctx.output_splits)
        return None, grad_in, None, None


def _sort_chunks(x: torch.Tensor, split_sizes: list[int], order: list[int]) -> torch.Tensor:
    """Splits x's rows into blocks of split_sizes and concatenates them in `order`."""
    chunks = torch.split(x, split_sizes)
    return torch.cat([chunks[i] for i in order])


def _ep_layout(num_experts: int, ep_group: dist.ProcessGroup | None) -> tuple[int, int, int]:
    """(ep_size, ep_rank, experts per rank) of an EP group (None: this rank alone)."""
    ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
    ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the EP group size {ep_size}: "
            "change moe.num_experts or the expert-parallel size"
        )
    return ep_size, ep_rank, num_experts // ep_size


class AllToAllDispatcher:
    """Moves routed token copies to the EP rank that owns their expert and back.

    One dispatcher serves one forward at a time: the dispatch steps store the layout that the
    combine steps (and their backward) reuse. ep_group None or of size 1: no communication.
    """

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None = None, permute_backend: str = "auto"):
        self.ep_group = ep_group
        self.permute_backend = permute_backend
        self.ep_size, self.ep_rank, self.num_local_experts = _ep_layout(num_experts, ep_group)
        self.num_experts = num_experts
        # block b of the [src][local_expert] layout goes to position order[b] of [local_expert][src]
        # (host lists, computed on the CPU even inside a meta-device build)
        blocks = torch.arange(num_experts, device="cpu").view(self.ep_size, self.num_local_experts)
        self._src_major_to_expert_major = blocks.t().flatten().tolist()
        self._expert_major_to_src_major = (
            torch.arange(num_experts, device="cpu").view(self.num_local_experts, self.ep_size).t().flatten().tolist()
        )

    def dispatch_preprocess(self, x: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """x [T, h], topk_idx [T, K] (-1: dropped) -> rows [N_send, h] ordered by expert, hence
        by destination."""
        # A virtual expert E after the real ones collects the dropped copies at the tail.
        routed_idx = topk_idx.masked_fill(topk_idx < 0, self.num_experts)  # [T, K]
        permuted, self.row_id_map, counts = permute_tokens(
            x, routed_idx, self.num_experts + 1, self.permute_backend
        )  # [T*K, h], [T*K], [E + 1]
        self.tokens_per_expert = counts[: self.num_experts]  # [E] local kept copies per global expert
        self.input_splits = self.tokens_per_expert.view(self.ep_size, -1).sum(1).tolist()  # [ep]
        self.num_copies = topk_idx.numel()
        return permuted[: sum(self.input_splits)]

    def token_dispatch(self, permuted: torch.Tensor) -> torch.Tensor:
        """[N_send, h] -> [N_recv, h] laid out as [src_rank][local_expert] blocks."""
        if self.ep_size == 1:
            self.recv_counts = self.tokens_per_expert.view(1, -1).cpu()  # [1, E_local]
            self.output_splits = self.input_splits
            return permuted
        # recv_counts[src, e]: copies that rank src sends to our local expert e
        recv_counts = torch.empty_like(self.tokens_per_expert)
        dist.all_to_all_single(recv_counts, self.tokens_per_expert.contiguous(), group=self.ep_group)
        self.recv_counts = recv_counts.view(self.ep_size, self.num_local_experts).cpu()
        self.output_splits = self.recv_counts.sum(1).tolist()  # [ep]
        return _AllToAll.apply(self.ep_group, permuted, self.output_splits, self.input_splits)

    def dispatch_postprocess(self, received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N_recv, h] in [src][local_expert] order -> ([N_recv, h] grouped by local expert,
        tokens_per_local_expert [E_local] int64 on the host)."""
        tokens_per_local_expert = self.recv_counts.sum(0)  # [E_local]
        if self.ep_size == 1:
            return received, tokens_per_local_expert
        x_sorted = _sort_chunks(
            received, self.recv_counts.flatten().tolist(), self._src_major_to_expert_major
        )
        return x_sorted, tokens_per_local_expert

    def combine_preprocess(self, y_sorted: torch.Tensor) -> torch.Tensor:
        """[N_recv, h] grouped by local expert -> [src][local_expert] order, ready to send back."""
        if self.ep_size == 1:
            return y_sorted
        return _sort_chunks(
            y_sorted, self.recv_counts.t().flatten().tolist(), self._expert_major_to_src_major
        )

    def token_combine(self, y: torch.Tensor) -> torch.Tensor:
        """[N_recv, h] -> [N_send, h], back on the rank that owns the tokens."""
        if self.ep_size == 1:
            return y
        return _AllToAll.apply(self.ep_group, y, self.input_splits, self.output_splits)

    def combine_postprocess(self, y: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """[N_send, h], probs [T, K] -> [T, h]: the probability-weighted sum over each token's
        kept experts (a dropped copy reads a zero row, so adds nothing, whatever its weight)."""
        if y.shape[0] < self.num_copies:
            y = torch.cat([y, y.new_zeros(self.num_copies - y.shape[0], y.shape[1])])  # [T*K, h]
        return unpermute_tokens(y, self.row_id_map, probs, self.permute_backend)


class _A2AHandle:
    """Shares an in-flight all_to_all between the start and wait halves of one exchange."""

    work = None
    grad_work = None
    grad = None


class _A2AStart(torch.autograd.Function):
    """Launches all_to_all_single with equal splits; the output is valid after _A2AWait.

    Backward waits for the reverse exchange that _A2AWait's backward launched, so other
    backward work runs while the gradient is in flight.
    """

    @staticmethod
    def forward(ctx, group, x, handle):
        ctx.handle = handle
        x = x.contiguous()
        out = torch.empty_like(x)
        handle.work = dist.all_to_all_single(out, x, group=group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, _grad_placeholder):
        ctx.handle.grad_work.wait()
        grad, ctx.handle.grad = ctx.handle.grad, None
        return None, grad, None


class _A2AWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, out, handle):
        ctx.group, ctx.handle = group, handle
        handle.work.wait()
        handle.work = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        grad_in = torch.empty_like(grad_out)
        ctx.handle.grad_work = dist.all_to_all_single(grad_in, grad_out, group=ctx.group, async_op=True)
        ctx.handle.grad = grad_in
        return None, grad_in, None


class _ChunkState:
    """The layout of one dispatched chunk, from dispatch_preprocess to combine_postprocess."""

    send = None  # ops.moe.layout.TokenSendLayout
    expand = None  # ops.moe.layout.ExpandLayout
    capacity = 0  # C: rows per (source, destination) pair
    num_rows = 0  # R: expert-grouped rows kept on this rank
    send_probs = None  # [ep * C, K] routing weight of each sent entry (0 = none); None: unweighted
    recv_probs = None
    recv_expert = None  # [ep * C, K] int64 local expert of each received entry
    works = ()  # in-flight all_to_alls without autograd (the expert ids)
    handles = ()  # _A2AHandle of each in-flight autograd all_to_all


class StaticAllToAllDispatcher:
    """Expert-parallel dispatch with no host sync, each token sent once per destination rank.

    A token whose K experts live on r distinct ranks travels r times (not K): the receiving
    rank expands it into one row per local expert, and sends back one row per token, the
    probability-weighted sum over its local experts (DeepEP's layout). Every size is fixed
    before any data moves: each (source, destination) pair exchanges exactly C rows
    (ops.moe.layout.token_capacity: moe.dispatch_capacity_factor x the balanced share, at most
    T), so all_to_all_single runs with split sizes known on the host; a rank keeps R
    expert-grouped rows (ops.moe.layout.expert_rows: the factor x T*K). Token counts stay on
    the device, into the grouped GEMM's offsets. A copy past either limit is not computed: its
    count is in last_overflow (a device scalar; the trainer checks it once per step) and it
    adds nothing to the output. EP=1, or a factor of None, can never overflow. Every EP rank
    must pass the same number of tokens (the buffer sizes derive from it), as a trainer does.

    The six steps follow Megatron's split; forward_experts() runs them in moe.dispatch_chunks
    chunks whose all-to-alls (forward and backward) proceed while other chunks' experts
    compute, and the shared expert computes while the first chunk is in flight. Every data
    movement is a gather with a precomputed inverse map: deterministic, free of atomics.
    """

    def __init__(
        self,
        num_experts: int,
        ep_group: dist.ProcessGroup | None = None,
        permute_backend: str = "auto",
        capacity_factor: float | None = 2.0,
        num_chunks: int = 1,
    ):
        self.ep_group = ep_group
        self.ep_size, self.ep_rank, self.num_local_experts = _ep_layout(num_experts, ep_group)
        if num_chunks < 1:
            raise ValueError(f"moe.dispatch_chunks must be >= 1, got {num_chunks}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"moe.dispatch_capacity_factor must be > 0 (or None: never overflow), got {capacity_factor}")
        self.num_experts = num_experts
        # "fused" asks for the compiled gathers: Triton (on CUDA; its interpreter elsewhere)
        self.backend = {"auto": "auto", "torch": "torch", "fused": "triton"}[permute_backend]
        self.capacity_factor = capacity_factor
        self.num_chunks = num_chunks
        self.state = _ChunkState()
        self.last_overflow = torch.zeros((), dtype=torch.int64)  # copies not computed (see above)
        self._last_states: list[_ChunkState] = []  # of the latest forward_experts (for last_received)

    @property
    def last_received(self) -> torch.Tensor:
        """[] int64: expert-grouped rows the latest forward_experts computed on this rank
        (summed on demand, not in the hot path)."""
        return sum((st.expand.tokens_per_expert.sum() for st in self._last_states), torch.zeros((), dtype=torch.int64))

    def release(self, states=()) -> None:
        """Drops the routing weights of self.state and states, the states' only tensors in the
        autograd graph, once the forward has used them (the layouts stay, for last_received). A
        module attribute that holds a graph keeps every activation it saved alive until the next
        forward; under activation recompute that is the recomputed layer's (~11 GB per layer of
        job c131072)."""
        for st in (self.state, *states):
            st.send_probs = st.recv_probs = None

    # -- the six steps, on self.state ---------------------------------------------------------

    def dispatch_preprocess(
        self, x: torch.Tensor, topk_idx: torch.Tensor, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, h], topk_idx [T, K] (-1 = dropped), probs [T, K] (None: the experts' outputs
        are summed unweighted) -> send buffer [ep * C, h]."""
        st = self.state = _ChunkState()
        num_tokens, topk = topk_idx.shape
        st.capacity = layout.token_capacity(num_tokens, topk, self.ep_size, self.capacity_factor)
        st.num_rows = layout.expert_rows(
            self.ep_size * st.capacity, num_tokens, topk, self.num_local_experts, self.capacity_factor,
            ep_size=self.ep_size,
        )
        st.send = layout.token_send_layout(topk_idx, self.num_experts, self.ep_size, st.capacity)
        identity = self.ep_size == 1 and st.capacity == num_tokens  # row t is token t: no copy
        if probs is not None and identity:  # [T, K], 0 where dropped
            st.send_probs = torch.where(topk_idx >= 0, probs, 0.0)
        elif probs is not None:  # [ep * C, K], 0 where no entry
            st.send_probs = gather_entries(probs, st.send.send_copy, st.send.copy_entry)
        if identity:
            return x
        return row_gather(x, st.send.send_token[:, None], st.send.pair_slot, self.backend)

    def token_dispatch(self, send: torch.Tensor, async_op: bool = False) -> torch.Tensor:
        """[ep * C, h] -> [ep * C, h] as [source][slot] blocks, with the expert ids and weights
        (with async_op, valid after dispatch_postprocess)."""
        st = self.state
        if self.ep_size == 1:
            st.recv_expert, st.recv_probs = st.send.send_expert, st.send_probs
            return send
        st.recv_expert = torch.empty_like(st.send.send_expert)
        st.works = (dist.all_to_all_single(st.recv_expert, st.send.send_expert, group=self.ep_group, async_op=True),)
        handles = [_A2AHandle()]
        out = _A2AStart.apply(self.ep_group, send, handles[0])
        if st.send_probs is not None:
            handles.append(_A2AHandle())
            st.recv_probs = _A2AStart.apply(self.ep_group, st.send_probs, handles[1])
        st.handles = tuple(handles)
        return out if async_op else self._wait(out)

    def _wait(self, out: torch.Tensor) -> torch.Tensor:
        st = self.state
        for work in st.works:
            work.wait()
        st.works = ()
        if st.handles:
            out = _A2AWait.apply(self.ep_group, out, st.handles[0])
            if len(st.handles) > 1:
                st.recv_probs = _A2AWait.apply(self.ep_group, st.recv_probs, st.handles[1])
        st.handles = ()
        return out

    def dispatch_postprocess(self, recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[ep * C, h] -> (R rows grouped by local expert then a padding tail [R, h],
        tokens_per_local_expert [E_local] int64 on the device)."""
        st = self.state
        recv = self._wait(recv)
        st.expand = layout.expand_layout(st.recv_expert, self.num_local_experts, st.num_rows, self.backend)
        x_sorted = row_gather(recv, st.expand.sorted_row[:, None], st.expand.copy_pos, self.backend)
        return x_sorted, st.expand.tokens_per_expert

    def permuted_probs(self) -> torch.Tensor:
        """[R] the routing weight of each expert-grouped row (0 on the tail), differentiable:
        for experts that apply the weights themselves (Megatron's)."""
        st = self.state
        return gather_entries(st.recv_probs, st.expand.sorted_copy, st.expand.copy_pos)

    def combine_preprocess(self, y_sorted: torch.Tensor, weighted: bool = True) -> torch.Tensor:
        """[R, h] expert outputs -> [ep * C, h]: per received row, the sum over its local experts,
        weighted by the routing probs (weighted=False, or no probs: unweighted)."""
        st = self.state
        if weighted and st.recv_probs is not None:
            return weighted_combine(y_sorted, st.expand.copy_pos, st.recv_probs, st.expand.sorted_copy, self.backend)
        row_of = torch.where(st.expand.sorted_copy >= 0, st.expand.sorted_copy // st.expand.copy_pos.shape[1], -1)
        return row_gather(y_sorted, st.expand.copy_pos, row_of[:, None], self.backend)

    def token_combine(self, y: torch.Tensor, async_op: bool = False) -> torch.Tensor:
        """[ep * C, h] -> [ep * C, h], back on the rank that owns the tokens."""
        st = self.state
        if self.ep_size == 1:
            return y
        st.handles = (_A2AHandle(),)
        out = _A2AStart.apply(self.ep_group, y, st.handles[0])
        return out if async_op else self._wait(out)

    def combine_postprocess(self, y: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """[ep * C, h] -> [T, h]: each token's rows from its destination ranks, summed in rank
        order (the weights were applied on the expert side; probs is not used here)."""
        st = self.state
        y = self._wait(y)
        if self.ep_size == 1 and y.shape[0] == st.send.pair_slot.shape[0]:  # the identity layout
            return y
        return row_gather(y, st.send.pair_slot, st.send.send_token[:, None], self.backend)

    # -- the pipelined whole --------------------------------------------------------------------

    def forward_experts(self, x, topk_idx, probs, experts, shared_expert=None):
        """out [T, h] = combine(experts(dispatch(x))) (+ shared_expert(x)), in num_chunks chunks
        of tokens. Chunk i+1's dispatch and chunk i's combine are in flight (on the
        communication stream) while chunk i's experts compute; the shared expert hides the
        first dispatch."""
        num_tokens = x.shape[0]
        n = max(1, min(self.num_chunks, num_tokens))
        bounds = [num_tokens * i // n for i in range(n + 1)]
        states, sends = [], []
        try:
            for i in range(n):
                part = slice(bounds[i], bounds[i + 1])
                sends.append(self.dispatch_preprocess(x[part], topk_idx[part], None if probs is None else probs[part]))
                states.append(self.state)
            in_flight, outs = [None] * n, [None] * n
            self.state = states[0]
            in_flight[0] = self.token_dispatch(sends[0], async_op=True)
            shared = shared_expert(x) if shared_expert is not None else None
            for i in range(n):
                if i + 1 < n:
                    self.state = states[i + 1]
                    in_flight[i + 1] = self.token_dispatch(sends[i + 1], async_op=True)
                self.state = states[i]
                x_sorted, counts = self.dispatch_postprocess(in_flight[i])
                outs[i] = self.token_combine(self.combine_preprocess(experts(x_sorted, counts)), async_op=True)
            for i in range(n):
                self.state = states[i]
                outs[i] = self.combine_postprocess(outs[i])
            self.last_overflow = sum(st.send.overflow + st.expand.overflow for st in states)
            self._last_states = states
        finally:  # also when a recompute stops early inside the layer (torch.utils.checkpoint)
            self.release(states)
        out = outs[0] if n == 1 else torch.cat(outs)
        return out if shared is None else out + shared
