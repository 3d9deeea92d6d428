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

from .._intmath import cdiv, next_power_of_2

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


def _check_scatter(src, dest, unread, weights) -> None:
    _check(src, dest, weights)
    if unread.dim() != 1 or unread.device != src.device:
        raise ValueError(f"unread must be a 1-D tensor on {src.device}, got {tuple(unread.shape)} on {unread.device}")


def scatter_rows_reference(src: torch.Tensor, dest: torch.Tensor, unread: torch.Tensor,
                           weights: torch.Tensor | None = None) -> torch.Tensor:
    """src [S, h], dest [S, K] (-1 none), unread [M] -> [M, h]: out[dest[s, k]] = weights[s, k]
    * src[s] (1 without weights); rows with unread < 0 are 0. Every other row must be named by
    exactly one dest entry (an inverse map), so nothing is summed and nothing races."""
    _check_scatter(src, dest, unread, weights)
    acc = _acc(src.dtype)
    out = torch.zeros(unread.shape[0], src.shape[1], dtype=acc, device=src.device)  # [M, h]
    ok = dest >= 0  # [S, K]
    rows = src.to(acc)[:, None, :].expand(-1, dest.shape[1], -1)  # [S, K, h]
    if weights is not None:
        rows = weights.to(acc)[:, :, None] * rows
    out[dest[ok]] = rows[ok]
    return out.to(src.dtype)


if triton is not None:
    from .._launch import fast_launch

    @fast_launch
    @triton.jit
    def _gather_sum_kernel(src, idx, weights, out, M, h, K: tl.constexpr, HAS_W: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """ROWS output rows x BLOCK columns per program."""
        m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m_ok = m < M
        c_ok = cols < h
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(idx + m * K + k, mask=m_ok, other=-1)  # [ROWS] int64: row * h cannot overflow
            ok = row >= 0
            w = ok.to(tl.float32)
            if HAS_W:
                w = w * tl.load(weights + m * K + k, mask=m_ok, other=0.0).to(tl.float32)
            vals = tl.load(src + tl.maximum(row, 0)[:, None] * h + cols[None, :],
                           mask=ok[:, None] & c_ok[None, :], other=0.0)
            # where: a skipped entry adds 0 even under a NaN weight, as in the reference
            acc += tl.where(ok[:, None], w[:, None] * vals.to(tl.float32), 0.0)
        tl.store(out + m[:, None] * h + cols[None, :], acc.to(out.dtype.element_ty), mask=m_ok[:, None] & c_ok[None, :])

    @fast_launch
    @triton.jit
    def _scatter_rows_kernel(src, dest, weights, unread, out, S, M, h, K: tl.constexpr, HAS_W: tl.constexpr,
                             ROWS: tl.constexpr, BLOCK: tl.constexpr, ZERO_TILES: tl.constexpr, SRC_PROGS):
        """Programs below SRC_PROGS: ROWS source rows x BLOCK columns, each row read once and
        written to its K destinations; the others: ZERO_TILES x ROWS output rows, zeroed where
        unread < 0, and done at once where none is (the usual case: a dense layout has no
        unread row, and one program per ROWS rows took a sixth of the scatter's time at
        131072 rows of 2048)."""
        p = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        c_ok = cols < h
        if p < SRC_PROGS:
            s = p * ROWS + tl.arange(0, ROWS)  # [ROWS]
            s_ok = s < S
            vals = tl.load(src + s[:, None] * h + cols[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
            for k in tl.static_range(K):
                d = tl.load(dest + s * K + k, mask=s_ok, other=-1)  # [ROWS] int64
                v = vals
                if HAS_W:
                    v = (tl.load(weights + s * K + k, mask=s_ok, other=0.0).to(tl.float32)[:, None]
                         * vals.to(tl.float32))
                tl.store(out + tl.maximum(d, 0)[:, None] * h + cols[None, :], v.to(out.dtype.element_ty),
                         mask=(d >= 0)[:, None] & c_ok[None, :])
        else:
            first = (p - SRC_PROGS) * (ZERO_TILES * ROWS)
            span = first + tl.arange(0, ZERO_TILES * ROWS)
            any_unread = tl.max((tl.load(unread + span, mask=span < M, other=0) < 0).to(tl.int32), axis=0)
            if any_unread > 0:
                for z in tl.static_range(ZERO_TILES):
                    m = first + z * ROWS + tl.arange(0, ROWS)
                    zero = tl.load(unread + m, mask=m < M, other=0) < 0
                    tl.store(out + m[:, None] * h + cols[None, :],
                             tl.zeros((ROWS, BLOCK), dtype=out.dtype.element_ty),
                             mask=zero[:, None] & c_ok[None, :])

    @fast_launch
    @triton.jit
    def _row_dot_kernel(a, src, idx, out, h, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        """Row m: its K source rows against a[m], a read once per column block."""
        m = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, KP)
        row = tl.load(idx + m * K + kk, mask=kk < K, other=-1)  # [KP]
        ok = row >= 0
        acc = tl.zeros((KP,), dtype=tl.float32)
        for start in range(0, h, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            c_ok = cols < h
            x = tl.load(a + m * h + cols, mask=c_ok, other=0.0).to(tl.float32)  # [BLOCK]
            y = tl.load(src + tl.maximum(row, 0)[:, None] * h + cols[None, :],
                        mask=ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)  # [KP, BLOCK]
            acc += tl.sum(y * x[None, :], axis=1)
        tl.store(out + m * K + kk, tl.where(ok, acc, 0.0), mask=kk < K)


# the tiles (elements per program, of GATHER_BLOCK_MAX columns at most), from
# benchmarks/device/probe_dispatch.py on the H200 at h 2048 and 7168: a gather of K rows per
# output row is fastest one output row per program, the scatter with 4 source rows
GATHER_BLOCK_MAX = 1024
GATHER_ELEMS = 1024
SCATTER_ELEMS = 4096
GATHER_WARPS = 4
# tiles of ROWS output rows per zero-fill program of the scatter (benchmarks/results/h200/
# permute_probe.json: at 16384 x top-8 rows of 2048 the scatter took 0.195 ms with one program
# per ROWS rows and 0.170 with these; a probe kernel without any zero-fill took 0.164-0.167)
SCATTER_ZERO_TILES = 16


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
        block = min(GATHER_BLOCK_MAX, next_power_of_2(max(src.shape[1], 16)))
        rows = max(1, GATHER_ELEMS // block)
        grid = (cdiv(idx.shape[0], rows), cdiv(src.shape[1], block))
        _gather_sum_kernel[grid](src, idx, idx if weights is None else weights, out, idx.shape[0], src.shape[1],
                                 K=idx.shape[1], HAS_W=weights is not None, ROWS=rows, BLOCK=block,
                                 num_warps=GATHER_WARPS)
    return out


def scatter_rows(src: torch.Tensor, dest: torch.Tensor, unread: torch.Tensor, weights: torch.Tensor | None = None,
                 backend: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """out[dest[s, k]] = weights[s, k] * src[s], rows with unread < 0 zero (see
    scatter_rows_reference); no autograd. The transpose of gather_sum with K = 1: the same
    output, reading each source row once (a K-fold gather of one row re-reads it from HBM
    once the source outgrows the L2). out: a contiguous [M, h] tensor of src's dtype and
    device to write every row of (None: a new one)."""
    if out is not None and (out.shape != (unread.shape[0], src.shape[1]) or out.dtype != src.dtype
                            or out.device != src.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [M, h] = {(unread.shape[0], src.shape[1])} {src.dtype} tensor "
                         f"on {src.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not _triton_ok(src, backend):
        result = scatter_rows_reference(src, dest, unread, weights)
        return result if out is None else out.copy_(result)
    _check_scatter(src, dest, unread, weights)
    src, dest, unread = src.contiguous(), dest.contiguous(), unread.contiguous()
    weights = None if weights is None else weights.contiguous()
    if out is None:
        out = src.new_empty(unread.shape[0], src.shape[1])
    if out.numel():
        block = min(GATHER_BLOCK_MAX, next_power_of_2(max(src.shape[1], 16)))
        rows = max(1, SCATTER_ELEMS // block)
        src_progs = cdiv(src.shape[0], rows)
        grid = (src_progs + cdiv(out.shape[0], rows * SCATTER_ZERO_TILES), cdiv(src.shape[1], block))
        _scatter_rows_kernel[grid](src, dest, dest if weights is None else weights, unread, out, src.shape[0],
                                   out.shape[0], src.shape[1], K=dest.shape[1], HAS_W=weights is not None,
                                   ROWS=rows, BLOCK=block, ZERO_TILES=SCATTER_ZERO_TILES, SRC_PROGS=src_progs,
                                   num_warps=GATHER_WARPS)
    return out


def row_dot(a: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """[M, h], [R, h], [M, K] -> [M, K] fp32 (fp64 for float64): dot(a[m], src[idx[m, k]])."""
    if not _triton_ok(src, backend):
        return row_dot_reference(a, src, idx)
    _check(src, idx, None)
    _check_a(a, src, idx)
    out = torch.empty(idx.shape, dtype=torch.float32, device=src.device)
    if out.numel():
        kp = next_power_of_2(idx.shape[1])
        block = max(16, min(next_power_of_2(max(src.shape[1], 16)), GATHER_ELEMS // kp))
        _row_dot_kernel[(idx.shape[0],)](a.contiguous(), src.contiguous(), idx.contiguous(), out, src.shape[1],
                                         K=idx.shape[1], KP=kp, BLOCK=block)
    return out


class _RowGather(torch.autograd.Function):
    """out = gather_sum(x, idx); grad_x = gather_sum(grad_out, inv).

    inv [R, K'] lists, for each row of x, the output rows that read it (-1 padded), so the
    backward is a gather too: exact when idx reads each (x row, output row) pair at most once.
    With one source per output row (idx [M, 1]) the forward is scatter_rows through inv: the
    same rows, each x row read once.
    """

    @staticmethod
    def forward(ctx, x, idx, inv, backend):
        ctx.save_for_backward(inv)
        ctx.backend = backend
        if idx.shape[1] == 1:  # one source per output: read each once
            return scatter_rows(x, inv, idx[:, 0], None, backend)
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
        # row idx[t, k] of y came from copy (t, k): grad_y[idx[t, k]] = w[t, k] * grad_out[t],
        # written from each grad_out row once; rows read by none (inv -1) are 0
        grad_y = scatter_rows(grad_out, idx, inv, w.to(_acc(y.dtype)), ctx.backend)
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
