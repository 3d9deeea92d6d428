"""Row gathers with an optional weighted sum: the data movement of the static MoE dispatch.

One primitive, `gather_sum(src, idx, weights)`: out[m] = sum over k = 0..K-1, in that order,
of weights[m, k] * src[idx[m, k]], skipping idx -1, accumulated in fp32 (fp64 for float64)
and rounded once. Permute, regroup, combine and all their gradients are gathers of this
form with a precomputed inverse map, so nothing scatters and nothing uses atomics: results
are deterministic. `row_dot` gives the gradient of the combine weights.

Backends: "torch" (the reference, any device) and "triton" (one program per output row and
block of columns); "auto" picks Triton on CUDA.

Shape legend: R source rows, M output rows, K gathered rows per output row, h row width.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU
    triton = None

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(src: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None) -> None:
    if src.dim() != 2 or src.dtype not in _FLOATS:
        raise ValueError(f"src must be a 2-D [R, h] float tensor, got {src.dtype} {tuple(src.shape)}")
    if idx.dim() != 2 or idx.dtype != torch.int64 or idx.device != src.device:
        raise ValueError(f"idx must be a [M, K] int64 tensor on {src.device}, got {idx.dtype} {tuple(idx.shape)} on {idx.device}")
    if weights is not None and (weights.shape != idx.shape or weights.device != src.device):
        raise ValueError(f"weights must be [M, K] = {tuple(idx.shape)} on {src.device}, got {tuple(weights.shape)}")


def _check_a(a: torch.Tensor, src: torch.Tensor, idx: torch.Tensor) -> None:
    if a.shape != (idx.shape[0], src.shape[1]) or a.device != src.device:
        raise ValueError(f"a must be [M, h] = {(idx.shape[0], src.shape[1])} on {src.device}, got {tuple(a.shape)}")


def gather_sum_reference(src: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[R, h], [M, K], [M, K] or None -> [M, h] in src's dtype."""
    _check(src, idx, weights)
    acc = _acc(src.dtype)
    out = torch.zeros(idx.shape[0], src.shape[1], dtype=acc, device=src.device)  # [M, h]
    if src.shape[0] == 0:  # nothing to read: every idx is -1
        return out.to(src.dtype)
    safe = idx.clamp(min=0)  # -1 rows read row 0 and are zeroed below
    for k in range(idx.shape[1]):  # k order fixes the rounding, as in the kernel
        rows = src.index_select(0, safe[:, k]).to(acc)  # [M, h]
        if weights is not None:
            rows = weights[:, k].to(acc)[:, None] * rows
        # where, not a 0 weight: a skipped entry must not bring a NaN of row 0 along
        out = out + torch.where((idx[:, k] >= 0)[:, None], rows, 0.0)
    return out.to(src.dtype)


def row_dot_reference(a: torch.Tensor, src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """a [M, h], src [R, h], idx [M, K] -> [M, K] fp32 (fp64): dot(a[m], src[idx[m, k]]), 0 for -1."""
    _check(src, idx, None)
    _check_a(a, src, idx)
    acc = _acc(src.dtype)
    if src.shape[0] == 0:
        return torch.zeros(idx.shape, dtype=acc, device=src.device)
    rows = src.index_select(0, idx.clamp(min=0).reshape(-1)).view(*idx.shape, src.shape[1]).to(acc)  # [M, K, h]
    return torch.where(idx >= 0, (rows * a.to(acc)[:, None, :]).sum(-1), 0.0)


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(src, idx, weights, out, h, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < h
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(idx + m * K + k)  # int64: row * h cannot overflow
            w = (row >= 0).to(tl.float32)
            if HAS_W:
                w = w * tl.load(weights + m * K + k).to(tl.float32)
            # (cols * 0 + row): a full block, so the mask stays boolean in Triton's interpreter too
            vals = tl.load(src + tl.maximum(row, 0) * h + cols, mask=mask & ((cols * 0 + row) >= 0), other=0.0)
            acc += w * vals.to(tl.float32)
        tl.store(out + m * h + cols, acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _row_dot_kernel(a, src, idx, out, h, K: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        for k in tl.static_range(K):
            row = tl.load(idx + m * K + k)
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for start in range(0, h, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = (cols < h) & ((cols * 0 + row) >= 0)
                x = tl.load(a + m * h + cols, mask=mask, other=0.0).to(tl.float32)
                y = tl.load(src + tl.maximum(row, 0) * h + cols, mask=mask, other=0.0).to(tl.float32)
                acc += x * y
            tl.store(out + m * K + k, tl.sum(acc, 0))


def _triton_ok(src: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if triton is None or src.dtype == torch.float64:
            raise ValueError("backend='triton' needs Triton and a float32/float16/bfloat16 src")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return triton is not None and src.is_cuda and src.dtype != torch.float64


def gather_sum(src: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """out[m] = sum_k weights[m, k] * src[idx[m, k]] (idx -1 skipped); no autograd."""
    if not _triton_ok(src, backend):
        return gather_sum_reference(src, idx, weights)
    _check(src, idx, weights)
    src, idx = src.contiguous(), idx.contiguous()
    weights = None if weights is None else weights.contiguous()
    out = src.new_empty(idx.shape[0], src.shape[1])
    if out.numel():
        block = min(1024, triton.next_power_of_2(max(src.shape[1], 16)))
        grid = (idx.shape[0], triton.cdiv(src.shape[1], block))
        _gather_sum_kernel[grid](src, idx, idx if weights is None else weights, out, src.shape[1],
                                 K=idx.shape[1], HAS_W=weights is not None, BLOCK=block)
    return out


def row_dot(a: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """[M, h], [R, h], [M, K] -> [M, K] fp32 (fp64 for float64): dot(a[m], src[idx[m, k]])."""
    if not _triton_ok(src, backend):
        return row_dot_reference(a, src, idx)
    _check(src, idx, None)
    _check_a(a, src, idx)
    out = torch.empty(idx.shape, dtype=torch.float32, device=src.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(max(src.shape[1], 16)))
        _row_dot_kernel[(idx.shape[0],)](a.contiguous(), src.contiguous(), idx.contiguous(), out, src.shape[1],
                                         K=idx.shape[1], BLOCK=block)
    return out


class _RowGather(torch.autograd.Function):
    """out = gather_sum(x, idx); grad_x = gather_sum(grad_out, inv).

    inv [R, K'] lists, for each row of x, the output rows that read it (-1 padded), so the
    backward is a gather too: exact when idx reads each (x row, output row) pair at most once.
    """

    @staticmethod
    def forward(ctx, x, idx, inv, backend):
        ctx.save_for_backward(inv)
        ctx.backend = backend
        return gather_sum(x, idx, None, backend)

    @staticmethod
    def backward(ctx, grad_out):
        (inv,) = ctx.saved_tensors
        return gather_sum(grad_out, inv, None, ctx.backend), None, None, None


class _WeightedCombine(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * y[idx[t, k]]; each y row is read by at most one (t, k),
    listed in inv [R] (flat t * K + k; -1 = read by none)."""

    @staticmethod
    def forward(ctx, y, idx, w, inv, backend):
        ctx.save_for_backward(y, idx, w, inv)
        ctx.backend = backend
        return gather_sum(y, idx, w, backend)

    @staticmethod
    def backward(ctx, grad_out):
        y, idx, w, inv = ctx.saved_tensors
        topk = idx.shape[1]
        # row j of y came from copy inv[j] = t * K + k: grad_y[j] = w[t, k] * grad_out[t]
        w_pad = torch.cat([w.reshape(-1), w.new_zeros(1)])  # a zero weight for rows read by none
        w_row = w_pad[torch.where(inv >= 0, inv, w.numel())]  # [R]
        token = torch.where(inv >= 0, inv // topk, -1)  # [R]
        grad_y = gather_sum(grad_out, token[:, None], w_row[:, None].to(_acc(y.dtype)), ctx.backend)
        grad_w = None
        if ctx.needs_input_grad[2]:
            grad_w = row_dot(grad_out, y, idx, ctx.backend).to(w.dtype)
        return grad_y, None, grad_w, None, None


def row_gather(x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Differentiable out[m] = sum_k x[idx[m, k]]; inv [R, K'] is its transpose map (see _RowGather)."""
    return _RowGather.apply(x, idx, inv, backend)


def weighted_combine(y: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, inv: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Differentiable out[t] = sum_k w[t, k] * y[idx[t, k]] (in y's dtype), gradients to y and w."""
    return _WeightedCombine.apply(y, idx, w, inv, backend)


class _GatherEntries(torch.autograd.Function):
    """out = src.flatten()[idx] (0 where idx is -1) in idx's shape; grad_src = the same gather
    of grad_out through inv (src's shape; -1 = read by none). idx reads each entry at most once,
    so the backward is a gather too: no index_put, no atomics (an index backward of a -1
    padded gather piles every pad onto one entry)."""

    @staticmethod
    def forward(ctx, src, idx, inv):
        ctx.save_for_backward(inv)
        return _take(src, idx)

    @staticmethod
    def backward(ctx, grad_out):
        (inv,) = ctx.saved_tensors
        return _take(grad_out, inv), None, None


def _take(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    flat = src.reshape(-1)
    return torch.where(idx >= 0, flat[idx.clamp(min=0)], 0) if flat.numel() else src.new_zeros(idx.shape)


def gather_entries(src: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Differentiable src.flatten()[idx] with -1 -> 0; inv (src's shape) maps each entry of src
    to the flat position of idx that reads it (-1: none)."""
    if inv.shape != src.shape:
        raise ValueError(f"inv must have src's shape {tuple(src.shape)}, got {tuple(inv.shape)}")
    return _GatherEntries.apply(src, idx, inv)
