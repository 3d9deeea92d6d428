"""Grouped matmul over rows grouped by expert, and the SwiGLU expert MLP built from it.

Shape legend: N rows grouped by expert (possibly followed by a tail of padding rows that
belong to no expert), E experts, K input width, M output width.
"""

import torch

from .swiglu import swiglu


def uses_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm runs bf16 on CUDA; it takes the counts as device offsets (no host sync)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == x.dtype and hasattr(torch, "_grouped_mm")


GROUPED_GEMM_BACKENDS = ("auto", "torch", "triton")
# auto takes our Triton kernel where experts hold at most this many rows on average. On the H200
# (benchmarks/results/h200/grouped_gemm.json), its forward and input gradient against
# torch._grouped_mm's: 1.23-1.56x at 128 rows per expert (issue 5's second shape, K 7168),
# 1.02-1.12x at 320 (Qwen3-Next's experts, K 2048), 0.91-0.96x at 512 and 0.88-0.92x at 2048.
TRITON_MAX_ROWS_PER_EXPERT = 384


def uses_triton_grouped_gemm(x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> bool:
    """Whether grouped_matmul runs our Triton kernel for x [N, K] @ w [E, K, M]."""
    if backend not in GROUPED_GEMM_BACKENDS:
        raise ValueError(f"backend: unknown grouped GEMM backend {backend!r}; choose from {', '.join(GROUPED_GEMM_BACKENDS)}")
    if backend == "triton":
        return True
    return (
        backend == "auto"
        and uses_grouped_mm(x, w)
        and x.shape[0] <= TRITON_MAX_ROWS_PER_EXPERT * w.shape[0]
        and min(w.shape[1], w.shape[2]) >= 128  # narrow products (LoRA's rank) leave its tiles empty
    )


def reads_counts_on_host(x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> bool:
    """Whether grouped_matmul runs its loop over experts, which reads the counts on the host
    (callers with several products read them once and pass host ints)."""
    return not (uses_triton_grouped_gemm(x, w, backend) or uses_grouped_mm(x, w))


def grouped_gemm_kind(x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> str:
    """What grouped_matmul runs for x [N, K] @ w [E, K, M], in words (for benchmarks and logs)."""
    if uses_triton_grouped_gemm(x, w, backend):
        return "triton grouped GEMM (weight gradient: " + ("torch._grouped_mm)" if uses_grouped_mm(x, w) else "triton)")
    return "torch._grouped_mm" if uses_grouped_mm(x, w) else "loop over experts"


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, tokens_per_expert, backend: str = "auto") -> torch.Tensor:
    """x [N, K] grouped by expert, w [E, K, M] (any strides), tokens_per_expert [E] -> [N, M].

    Rows past sum(tokens_per_expert) (the static dispatcher's padding tail) belong to no
    expert: their outputs and gradients are unspecified (zeros in the loop, left unwritten by
    the grouped GEMMs) and callers never read them.
    On CUDA: our Triton grouped GEMM (grouped_triton.py; backend "triton", or "auto" where
    experts hold few rows) or torch._grouped_mm (bf16), both taking the counts on the device;
    elsewhere a loop over experts, which reads the counts on the host (backend "triton" runs
    the kernel there too: Triton's interpreter on CPU).
    """
    if uses_triton_grouped_gemm(x, w, backend):
        from .grouped_triton import GroupedMM, row_bounds

        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        return GroupedMM.apply(x, w, row_bounds(counts))
    if uses_grouped_mm(x, w):
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each expert
        return torch._grouped_mm(x, w, offs=offs)
    counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
    if len(counts) != w.shape[0] or min(counts, default=0) < 0 or sum(counts) > x.shape[0]:
        raise ValueError(
            f"tokens_per_expert: expected {w.shape[0]} non-negative counts summing to at most "
            f"N={x.shape[0]}, got {counts}"
        )
    tail = x.shape[0] - sum(counts)
    parts = [x_e @ w[e] for e, x_e in enumerate(torch.split(x, counts + [tail])[: len(counts)])]  # [N_e, M]
    if tail:
        parts.append(x.new_zeros(tail, w.shape[2]))
    return torch.cat(parts)


def swiglu_experts(x_sorted: torch.Tensor, tokens_per_expert, w1: torch.Tensor, w2: torch.Tensor,
                   backend: str = "auto") -> torch.Tensor:
    """SwiGLU of each expert over its rows: x_sorted [N, h], w1 [E, h, 2F] (gate | up),
    w2 [E, F, h] -> [N, h]."""
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0] or w1.shape[2] != 2 * w2.shape[1]:
        raise ValueError(
            f"w1 must be [E_local, h, 2F] and w2 [E_local, F, h], got {tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    if x_sorted.dim() != 2 or x_sorted.shape[1] != w1.shape[1] or w2.shape[2] != w1.shape[1]:
        raise ValueError(f"x_sorted must be [N, h={w1.shape[1]}] matching w1/w2, got {tuple(x_sorted.shape)}")
    act = swiglu(grouped_matmul(x_sorted, w1, tokens_per_expert, backend))  # [N, F]
    return grouped_matmul(act, w2, tokens_per_expert, backend)  # [N, h]
