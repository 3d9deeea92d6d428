"""Grouped GEMM over rows grouped by expert, in Triton: the experts' matmuls and their gradients.

    out[rows of e] = x[rows of e] @ w[e]                       (grouped_mm: forward, and dx with w[e]^T)
    dw[e]          = x[rows of e]^T @ dy[rows of e]           (grouped_mm_wgrad: the weight gradient)

Rows of expert e are [bounds[e], bounds[e + 1]); rows past bounds[E] (a padding tail) belong to
no expert and their outputs are left unwritten. The counts stay on the device: the number of
row tiles is bounded by ceil(N / BM) + E, programs past the real number return at once, and
each program finds its expert by a binary search over the cumulative row-tile counts. No
host sync.

Program order keeps HBM traffic at one read of each weight: one expert's programs run back to
back, its column tiles outer and its row tiles inner, so the expert's rows (a few MB) and each
weight column tile stay in L2 while they are reused.

Offsets are int64 (tokens x hidden past 2^31). Accumulation is fp32, outputs in x's dtype.

Gradient accumulation over micro-batches: where autograd would add the weight gradient into an
existing w.grad (AccumulateGrad: a new [E, K, M] gradient, then grad += it, three passes over
it), GroupedMM's backward adds it there itself with the weight-gradient kernel (ACCUMULATE:
each tile read, added in fp32, rounded once) and returns None for w; autograd.grad, tensor
hooks on w and double backward keep the plain path (_grad_to_accumulate_into).

Tried in H200 probe runs and dropped for want of a gain (no results file keeps them): TMA
descriptors for the operands, a persistent weight gradient storing by TMA, a weight-gradient
path holding an expert's rows in one tile. Measured: benchmarks/results/h200/grouped_gemm.json.
Also tried (grouped_gemm_overlap.json): the weight gradient on a second stream beside the input
gradient, either launch order or stream priority; the pair took as long as in turn (at 128 rows
per expert fc1 12.66 ms in turn, 12.67-13.30 side by side), so GroupedMM runs them in turn.
And (fused_backward.json, benchmarks/device/probe_fused_backward.py): the input gradient and the
weight gradient in one kernel sharing each dy tile, one program per (expert, k tile) holding the
expert's rows in one register tile: at exactly 128 rows per expert 0.99-1.01x our dx kernel plus
torch's weight gradient, and 0.61-0.74x where an expert holds more than 128 rows (a 256-row tile
doubles the tensor-core work), so it stayed a probe.
On an H100 (2026-12-05, issue 5's second shape, ~128 rows per expert; results/h100/
grouped_wgrad_store.json, grouped_gemm_tail.json): the weight gradient's stores alone reach the
fill_ ceiling (3.2 TB/s) but with the products 1.9-2.1 TB/s, and neither the store (.cs,
evict_first, TMA from shared memory) nor two or three programs per SM changed that; a half-height
product for an expert's last row tile of <= BM / 2 rows and evict_first weight loads left the
forward and input gradient where they were (probe_wgrad_store.py, probe_grouped_tail.py).
The torch reference is `grouped_matmul`'s loop over experts (grouped.py).
"""

import torch
from torch.autograd.graph import get_gradient_edge

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU
    triton = None

from .grouped import uses_grouped_mm
from .._intmath import cdiv


def row_bounds(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """[E] counts -> int32 [E + 1] row bounds (0, c0, c0 + c1, ...), on the counts' device."""
    bounds = torch.zeros(tokens_per_expert.numel() + 1, dtype=torch.int32, device=tokens_per_expert.device)
    torch.cumsum(tokens_per_expert, 0, out=bounds[1:])
    return bounds


def row_tile_bounds(bounds: torch.Tensor, bm: int) -> torch.Tensor:
    """int32 [E + 1] row bounds -> int32 [E + 1] cumulative counts of bm-row tiles per expert."""
    tiles = torch.zeros_like(bounds)
    torch.cumsum((bounds[1:] - bounds[:-1] + bm - 1) // bm, 0, out=tiles[1:])
    return tiles


# (BM, BN, BK, warps, stages) for x @ w; (BK, BN, BR over rows, warps, stages, column tiles per
# program) for the weight gradient.
# Chosen on the H200 (benchmarks/device/probe_grouped_gemm.py), not autotuned at run time.
FWD_CONFIG = (128, 256, 64, 8, 3)
WGRAD_CONFIG = (128, 256, 64, 8, 3, 4)


if triton is not None:
    from .._launch import fast_launch

    @triton.jit
    def _find_expert(tile_bounds, t, E, LOG_E: tl.constexpr):
        # the largest e < E with tile_bounds[e] <= t: the expert owning row tile t (empty
        # experts before it have the same bound, and the search keeps the last of them)
        lo = t * 0
        hi = lo + E - 1
        for _ in tl.static_range(LOG_E):
            mid = (lo + hi + 1) // 2
            go = tl.load(tile_bounds + mid) <= t
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid - 1)
        return lo

    @fast_launch
    @triton.jit
    def _grouped_mm_kernel(x, w, out, bounds, tile_bounds, E, M, K,
                           sxm, sxk, swe, swk, swm, som, som_col,
                           LOG_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        num_n = tl.cdiv(M, BN)
        t = pid // num_n  # the row tile's rank among all row tiles; the program's expert is t's
        if t >= tl.load(tile_bounds + E):
            return
        e = _find_expert(tile_bounds, t, E, LOG_E)
        tile0 = tl.load(tile_bounds + e)
        tiles_e = tl.load(tile_bounds + e + 1) - tile0
        local = pid - tile0 * num_n  # within the expert: column tile outer, row tile inner
        n = local // tiles_e
        j = local % tiles_e
        row0 = tl.load(bounds + e)
        row_end = tl.load(bounds + e + 1)
        rm = (row0 + j * BM + tl.arange(0, BM)).to(tl.int64)  # [BM]
        rn = (n * BN + tl.arange(0, BN)).to(tl.int64)  # [BN]
        rk = tl.arange(0, BK).to(tl.int64)  # [BK]
        row_ok = rm < row_end
        a_ptr = x + rm[:, None] * sxm + rk[None, :] * sxk  # [BM, BK]
        b_ptr = w + e.to(tl.int64) * swe + rk[:, None] * swk + rn[None, :] * swm  # [BK, BN]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptr, mask=rn[None, :] < M, other=0.0)
            else:
                k_ok = rk < K - k * BK
                a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptr, mask=k_ok[:, None] & (rn[None, :] < M), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptr += BK * sxk
            b_ptr += BK * swk
        o_ptr = out + rm[:, None] * som + rn[None, :] * som_col
        tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & (rn[None, :] < M))

    @fast_launch
    @triton.jit
    def _grouped_wgrad_kernel(x, dy, dw, bounds, K, M,
                              sxm, sxk, sdm, sdn, swe, swk, swm,
                              BK: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, NT: tl.constexpr,
                              ACCUMULATE: tl.constexpr):
        # one program: expert e, row tile kt of dw[e], NT column tiles in turn (the x^T tile it
        # reads is the same for each: L2 hits), each a reduction over the expert's rows in
        # chunks of BR. Column tiles and row chunks run as one loop (step i: chunk i % chunks of
        # column tile n0 + i // chunks), which Triton pipelines as one: the next tile's loads are
        # in flight while a tile finishes and stores. Nested loops started each tile's pipeline
        # afresh (H200, 128 rows per expert: fc1 8.52 -> 7.64 ms, fc2 4.30 -> 3.86).
        # ACCUMULATE: dw += the product (read in fp32, added, rounded once) instead of dw =.
        pid = tl.program_id(0)
        num_k = tl.cdiv(K, BK)
        num_n = tl.cdiv(M, BN)
        n_groups = tl.cdiv(num_n, NT)
        e = pid // (num_k * n_groups)  # one expert's tiles back to back: its rows stay in L2
        local = pid % (num_k * n_groups)
        kt = local // n_groups
        n0 = (local % n_groups) * NT
        row0 = tl.load(bounds + e)
        row_end = tl.load(bounds + e + 1)
        chunks = tl.maximum(tl.cdiv(row_end - row0, BR), 1)  # an expert without rows writes zeros
        steps = (tl.minimum(n0 + NT, num_n) - n0) * chunks
        rk = (kt * BK + tl.arange(0, BK)).to(tl.int64)  # [BK]
        acc = tl.zeros((BK, BN), dtype=tl.float32)
        for i in range(0, steps):
            n = n0 + i // chunks
            c = i % chunks
            rn = (n * BN + tl.arange(0, BN)).to(tl.int64)  # [BN]
            rr = (row0 + c * BR + tl.arange(0, BR)).to(tl.int64)  # [BR]
            r_ok = rr < row_end
            a = tl.load(x + rr[None, :] * sxm + rk[:, None] * sxk, mask=r_ok[None, :] & (rk[:, None] < K), other=0.0)
            b = tl.load(dy + rr[:, None] * sdm + rn[None, :] * sdn, mask=r_ok[:, None] & (rn[None, :] < M), other=0.0)
            acc = tl.dot(a, b, acc)  # [BK, BR] @ [BR, BN]
            if c == chunks - 1:
                o_ptr = dw + e.to(tl.int64) * swe + rk[:, None] * swk + rn[None, :] * swm
                o_ok = (rk[:, None] < K) & (rn[None, :] < M)
                if ACCUMULATE:
                    acc += tl.load(o_ptr, mask=o_ok, other=0.0).to(tl.float32)
                tl.store(o_ptr, acc.to(dw.dtype.element_ty), mask=o_ok)
                acc = tl.zeros((BK, BN), dtype=tl.float32)


def _check(x: torch.Tensor, bounds: torch.Tensor, n_experts: int) -> None:
    if triton is None:
        raise RuntimeError("grouped GEMM backend 'triton' needs the triton package; use backend='torch'")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [N, K], got {tuple(x.shape)}")
    if bounds.dtype != torch.int32 or bounds.shape != (n_experts + 1,) or bounds.device != x.device:
        raise ValueError(
            f"bounds must be int32 [E + 1] = [{n_experts + 1}] on {x.device} (row_bounds(tokens_per_expert)), "
            f"got {bounds.dtype} {tuple(bounds.shape)} on {bounds.device}"
        )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, bounds: torch.Tensor, config=None,
               out: torch.Tensor | None = None, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] grouped by expert, w [E, K, M] (any strides), bounds int32 [E + 1] -> [N, M] in x's dtype.

    Rows past bounds[E] are left unwritten (torch.empty, or what `out` held). tiles:
    row_tile_bounds(bounds, the config's BM) when the caller has it (GroupedMM reuses the
    forward's in the backward)."""
    E = w.shape[0]
    _check(x, bounds, E)
    if w.dim() != 3 or w.shape[1] != x.shape[1] or w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w must be [E, K={x.shape[1]}, M] in {x.dtype} on {x.device}, got {w.dtype} {tuple(w.shape)}")
    BM, BN, BK, warps, stages = config or FWD_CONFIG
    N, K = x.shape
    M = w.shape[2]
    if out is None:
        out = torch.empty(N, M, dtype=x.dtype, device=x.device)
    elif out.shape != (N, M) or out.device != x.device:
        raise ValueError(f"out must be [N, M] = {(N, M)} on {x.device}, got {tuple(out.shape)} on {out.device}")
    if N == 0 or M == 0:
        return out
    if tiles is None:
        tiles = row_tile_bounds(bounds, BM)
    max_tiles = cdiv(N, BM) + E  # a bound on tiles[E] that needs no host read
    grid = (max_tiles * cdiv(M, BN),)
    _grouped_mm_kernel[grid](
        x, w, out, bounds, tiles, E, M, K,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        LOG_E=max(1, (E - 1).bit_length()), BM=BM, BN=BN, BK=BK, EVEN_K=K % BK == 0,
        num_warps=warps, num_stages=stages,
    )
    return out


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, bounds: torch.Tensor, config=None,
                     accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K], dy [N, M] grouped by expert, bounds int32 [E + 1] -> dw [E, K, M] in x's dtype
    (zero for an expert without rows). accumulate_into: an [E, K, M] tensor (any strides, a
    float dtype) that gets dw added in place (each element read, added in fp32, rounded once)
    and is returned: a gradient accumulated over micro-batches without a second [E, K, M]
    buffer or a separate add."""
    E = bounds.shape[0] - 1
    _check(x, bounds, E)
    if dy.dim() != 2 or dy.shape[0] != x.shape[0] or dy.dtype != x.dtype or dy.device != x.device:
        raise ValueError(f"dy must be [N={x.shape[0]}, M] in {x.dtype} on {x.device}, got {dy.dtype} {tuple(dy.shape)}")
    BK, BN, BR, warps, stages, nt = config or WGRAD_CONFIG
    K, M = x.shape[1], dy.shape[1]
    if accumulate_into is None:
        dw = torch.empty(E, K, M, dtype=x.dtype, device=x.device)
    else:
        dw = accumulate_into
        if tuple(dw.shape) != (E, K, M) or dw.device != x.device or not dw.is_floating_point():
            raise ValueError(f"accumulate_into must be a float [E={E}, K={K}, M={M}] tensor on {x.device}, "
                             f"got {dw.dtype} {tuple(dw.shape)} on {dw.device}")
    if dw.numel() == 0:
        return dw
    grid = (E * cdiv(K, BK) * cdiv(cdiv(M, BN), nt),)
    _grouped_wgrad_kernel[grid](
        x, dy, dw, bounds, K, M,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        BK=BK, BN=BN, BR=BR, NT=nt, ACCUMULATE=accumulate_into is not None, num_warps=warps, num_stages=stages,
    )
    return dw


# GroupedMM's backward adds the weight gradient into weight.grad itself where autograd would only
# add it there (AccumulateGrad: grad += dw), as Megatron's gradient_accumulation_fusion does for
# its GEMMs: from the second micro-batch of a step on, no [E, K, M] gradient is made and none is
# read back three times for the add (at 128 rows per expert, hidden 7168, 256 experts: 15 GB
# for fc1). False: always return the gradient.
ACCUMULATE_INTO_GRAD = True


def _grad_to_accumulate_into(w: torch.Tensor) -> torch.Tensor | None:
    """w.grad where GroupedMM's backward may add w's gradient into it in place and return None
    for w: w is a leaf, the engine will run its AccumulateGrad (a .backward() whose inputs
    include w, not autograd.grad), w.grad exists (not the first micro-batch), no tensor hook
    would transform the gradient first, no double backward; a plain tensor (not a DTensor or
    other subclass). Otherwise None. Post-accumulate hooks (the trainer's NonFiniteTracker) still run: the
    engine runs w's AccumulateGrad with no gradient to add, and its hooks see the sum."""
    if not ACCUMULATE_INTO_GRAD or not (w.is_leaf and w.requires_grad) or torch.is_grad_enabled():
        return None
    grad = w.grad
    if (type(grad) is not torch.Tensor or grad.requires_grad or grad.layout != torch.strided or grad.shape != w.shape
            or grad.device != w.device or w._backward_hooks):
        return None
    try:  # the graph holds w's AccumulateGrad, and w's (weak) reference to it gives that node back
        if not torch._C._will_engine_execute_node(get_gradient_edge(w).node):
            return None
    except RuntimeError:  # autograd.grad() over a leaf: its gradient is returned, not accumulated
        return None
    return grad


class GroupedMM(torch.autograd.Function):
    """x [N, K] @ w[e] [K, M] per expert; the input gradient by the same kernel, the weight
    gradient by `grouped_mm_wgrad` (wgrad="triton") or torch._grouped_mm (wgrad="torch"; "auto":
    torch's where it runs, bf16 on CUDA, faster there at every shape measured). No host sync.
    Where w is a leaf whose .grad already holds a gradient that autograd would add this one to,
    the backward adds it there itself (ACCUMULATE_INTO_GRAD, _grad_to_accumulate_into) with the
    weight-gradient kernel, unless wgrad="torch"."""

    @staticmethod
    def forward(ctx, x, w, bounds, wgrad="auto"):
        if wgrad not in ("auto", "torch", "triton"):
            raise ValueError(f"wgrad must be auto, torch or triton, got {wgrad!r}")
        tiles = row_tile_bounds(bounds, FWD_CONFIG[0])  # the input gradient's kernel tiles rows alike
        ctx.save_for_backward(x, w, bounds, tiles)  # a saved leaf unpacks as w itself, .grad and all
        ctx.wgrad = wgrad
        return grouped_mm(x, w, bounds, tiles=tiles)

    @staticmethod
    def backward(ctx, dy):
        x, w, bounds, tiles = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_mm(dy, w.transpose(1, 2), bounds, tiles=tiles) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            grad = None if ctx.wgrad == "torch" else _grad_to_accumulate_into(w)
            if grad is not None:
                grouped_mm_wgrad(x, dy, bounds, accumulate_into=grad)  # added in place: none returned
            elif ctx.wgrad == "torch" or (ctx.wgrad == "auto" and uses_grouped_mm(x, dy)):
                dw = torch._grouped_mm(x.t(), dy, offs=bounds[1:])
            else:
                dw = grouped_mm_wgrad(x, dy, bounds)
        return dx, dw, None, None
