"""Expert-parallel token dispatcher over all_to_all_single (Megatron's six-step split).

Experts are split contiguously over the EP group: rank r holds experts
[r * E_local, (r + 1) * E_local). Only token_dispatch and token_combine communicate, so a
caller can overlap them with other work. Everything runs on CPU over gloo as well as on GPU.
Copies dropped by the router's capacity (topk_idx -1) are permuted behind all real experts'
rows and never sent; at the combine their rows come back as zeros.

Shape legend:
    T  local tokens         K  experts per token      h  hidden size
    E  experts (global)     E_local = E / ep          ep EP group size
    N_send rows sent by this rank (T * K less the dropped copies); N_recv rows received
"""

import torch
import torch.distributed as dist

from megatron_moe_hybrid.ops.moe import permute_tokens, unpermute_tokens


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


class AllToAllDispatcher:
    """Moves routed token copies to the EP rank that owns their expert and back.

    One dispatcher serves one forward at a time: the dispatch steps store the layout that the
    combine steps (and their backward) reuse. ep_group None or of size 1: no communication.
    """

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None = None, permute_backend: str = "auto"):
        self.ep_group = ep_group
        self.permute_backend = permute_backend
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the EP group size {self.ep_size}: "
                "change moe.num_experts or the expert-parallel size"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        # block b of the [src][local_expert] layout goes to position order[b] of [local_expert][src]
        blocks = torch.arange(num_experts).view(self.ep_size, self.num_local_experts)
        self._src_major_to_expert_major = blocks.t().flatten().tolist()
        self._expert_major_to_src_major = (
            torch.arange(num_experts).view(self.num_local_experts, self.ep_size).t().flatten().tolist()
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
