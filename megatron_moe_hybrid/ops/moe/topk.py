"""Fused top-k routing: scores, expert choice and routing weights in one Triton kernel each way.

`router_topk(logits, topk, ...)` in reference.py is the definition: scores = softmax or
sigmoid of the logits, the top-k of scores + expert_bias with equal values to the lower
expert index (its stable sort), weights = the chosen scores, renormalised and scaled. Eager
PyTorch runs that as about a dozen kernels each way (softmax, a full segmented sort of [T, E],
gather, sum, div, mul and their backward: zeros, scatter, softmax backward, ...). Here one
program takes a block of tokens with all E scores in registers and picks the k experts by k
rounds of max + lowest matching index, which is the stable sort's order; the backward
recomputes the weights' chain from the saved scores and writes the logits' gradient once.

`fused_router_topk` covers routing without expert groups (num_groups 1, or every group kept)
and, with stats=True, gives the balance and z losses' inputs too; `routing(..., backend)` picks
it or the reference.

Shape legend: T tokens, E experts, K experts per token.
"""

import torch

from .reference import router_topk as router_topk_reference
from .._intmath import cdiv, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU
    triton = None

BACKENDS = ("auto", "torch", "triton")
ROUTER_ELEMS = 4096  # scores held per program: tokens per program = ROUTER_ELEMS // next_pow2(E)
MAX_EXPERTS = 4096  # one row of scores must fit in a program's registers
MAX_PROGRAMS = 1024  # the forward's programs (each loops over token blocks): rows of its per-program sums


if triton is not None:
    from .._launch import fast_launch

    @fast_launch
    @triton.jit
    def _router_fwd_kernel(logits, bias, scores, probs, idx, valid, lse, score_sums, counts, T, E, scale, BLOCKS,
                           K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                           SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                           HAS_VALID: tl.constexpr, STATS: tl.constexpr):
        # program p takes BLOCKS blocks of BT tokens and writes row p of score_sums and counts
        cols = tl.arange(0, BE)  # [BE]
        kcols = tl.arange(0, BK)  # [BK]
        cmask = cols < E
        if HAS_BIAS:
            bias_row = tl.load(bias + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        sums_acc = tl.zeros([BE], dtype=tl.float32)
        count = tl.zeros([BE], dtype=tl.int32)
        for blk in range(0, BLOCKS):
            rows = (tl.program_id(0).to(tl.int64) * BLOCKS + blk) * BT + tl.arange(0, BT)  # [BT]
            rmask = rows < T
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(logits + rows[:, None] * E + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            m = tl.where(rmask, tl.max(x, axis=1), 0.0)  # rows past T: -inf, kept finite
            ex = tl.where(mask, tl.exp(x - m[:, None]), 0.0)
            sum_ex = tl.where(rmask, tl.sum(ex, axis=1), 1.0)
            if SOFTMAX:
                s = ex / sum_ex[:, None]
            else:
                s = tl.where(mask, tl.sigmoid(x), 0.0)
            if HAS_VALID:
                rvalid = rmask & (tl.load(valid + rows, mask=rmask, other=0) != 0)
            else:
                rvalid = rmask
            if STATS:  # the z-loss input, and the balance loss's sums over this program's tokens
                tl.store(lse + rows, tl.where(rvalid, m + tl.log(sum_ex), 0.0), mask=rmask)
                normed = s / tl.where(rvalid, tl.sum(s, axis=1), 1.0)[:, None]
                sums_acc += tl.sum(tl.where(rvalid[:, None], normed, 0.0), axis=0)
            tl.store(scores + rows[:, None] * E + cols[None, :], s, mask=mask)
            sel = s
            if HAS_BIAS:
                sel = sel + bias_row
            sel = tl.where(sel != sel, float("inf"), sel)  # NaN sorts first, as in torch.sort
            avail = mask
            top_i = tl.zeros([BT, BK], dtype=tl.int64)
            top_p = tl.zeros([BT, BK], dtype=tl.float32)
            for k in tl.static_range(K):
                best = tl.max(tl.where(avail, sel, float("-inf")), axis=1)  # [BT]
                hit = avail & (sel == best[:, None])
                j = tl.min(tl.where(hit, cols[None, :], BE), axis=1)  # the lowest expert index of the best
                pick = cols[None, :] == j[:, None]  # [BT, BE]
                avail = avail & ~pick
                # the chosen score from its logit (the same operations as s: the same bits), not
                # a third reduction over the E lanes
                xj = tl.load(logits + rows * E + j, mask=rmask, other=0.0).to(tl.float32)  # [BT]
                if SOFTMAX:
                    p = tl.exp(xj - m) / sum_ex
                else:
                    p = tl.sigmoid(xj)
                top_i = tl.where(kcols[None, :] == k, j.to(tl.int64)[:, None], top_i)
                top_p = tl.where(kcols[None, :] == k, p[:, None], top_p)
                if STATS:
                    count += tl.sum((pick & rvalid[:, None]).to(tl.int32), axis=0)
            if NORM:
                top_p = top_p / tl.where(rmask, tl.sum(top_p, axis=1), 1.0)[:, None]
            top_p = top_p * scale
            kmask = rmask[:, None] & (kcols[None, :] < K)
            tl.store(probs + rows[:, None] * K + kcols[None, :], top_p, mask=kmask)
            tl.store(idx + rows[:, None] * K + kcols[None, :], top_i, mask=kmask)
        if STATS:
            tl.store(score_sums + tl.program_id(0) * E + cols, sums_acc, mask=cmask)
            tl.store(counts + tl.program_id(0) * E + cols, count, mask=cmask)

    @fast_launch
    @triton.jit
    def _router_bwd_kernel(scores, idx, grad_probs, grad_scores, valid, grad_lse, grad_sums, grad_logits, T, E, scale,
                           BLOCKS,
                           K: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                           SOFTMAX: tl.constexpr, NORM: tl.constexpr, HAS_GS: tl.constexpr,
                           HAS_VALID: tl.constexpr, HAS_GLSE: tl.constexpr, HAS_GSUMS: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)  # [BT]
        cols = tl.arange(0, BE)  # [BE]
        rmask = rows < T
        cmask = cols < E
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        offs = rows64[:, None] * E + cols[None, :]
        s = tl.load(scores + offs, mask=mask, other=0.0)
        if HAS_GS:
            g = tl.load(grad_scores + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            g = tl.zeros([BT, BE], dtype=tl.float32)
        if NORM:  # probs_k = c * raw_k / S with raw_k the chosen scores and S their sum
            total = tl.zeros([BT], dtype=tl.float32)
            gdot = tl.zeros([BT], dtype=tl.float32)
            for k in tl.static_range(K):
                j = tl.load(idx + rows64 * K + k, mask=rmask, other=0)
                gp = tl.load(grad_probs + rows64 * K + k, mask=rmask, other=0.0).to(tl.float32)
                raw = tl.sum(tl.where(cols[None, :] == j[:, None], s, 0.0), axis=1)
                total += raw
                gdot += gp * raw
            total = tl.where(rmask, total, 1.0)
        for k in tl.static_range(K):
            j = tl.load(idx + rows64 * K + k, mask=rmask, other=0)
            gp = tl.load(grad_probs + rows64 * K + k, mask=rmask, other=0.0).to(tl.float32) * scale
            if NORM:
                gp = gp / total - scale * gdot / (total * total)
            g += tl.where(cols[None, :] == j[:, None], gp[:, None], 0.0)
        if HAS_VALID:
            rvalid = rmask & (tl.load(valid + rows, mask=rmask, other=0) != 0)
        else:
            rvalid = rmask
        if HAS_GSUMS:  # score_sums[e] = sum over valid tokens of s[t, e] / sum_e' s[t, e']
            gn = tl.load(grad_sums + (tl.program_id(0) // BLOCKS) * E + cols, mask=cmask, other=0.0)[None, :]
            total_s = tl.where(rvalid, tl.sum(s, axis=1), 1.0)
            chain = gn / total_s[:, None] - (tl.sum(gn * s, axis=1) / (total_s * total_s))[:, None]
            g += tl.where(rvalid[:, None], chain, 0.0)
        if SOFTMAX:
            dx = s * (g - tl.sum(s * g, axis=1)[:, None])
        else:
            dx = g * s * (1.0 - s)
        if HAS_GLSE:  # lse = logsumexp(x) on valid tokens (softmax scores only: d lse / dx = s)
            gl = tl.load(grad_lse + rows, mask=rvalid, other=0.0)
            dx += gl[:, None] * s
        tl.store(grad_logits + offs, dx.to(grad_logits.dtype.element_ty), mask=mask)


    @fast_launch
    @triton.jit
    def _split_hi_lo_kernel(a, out, total, n_cols, out_row_stride, off_hi0, off_hi1, off_lo, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        v = tl.load(a + offs, mask=mask, other=0.0)
        hi = v.to(out.dtype.element_ty)
        lo = (v - hi.to(tl.float32)).to(out.dtype.element_ty)
        base = out + (offs // n_cols) * out_row_stride + offs % n_cols
        tl.store(base + off_hi0, hi, mask=mask)
        tl.store(base + off_hi1, hi, mask=mask)
        tl.store(base + off_lo, lo, mask=mask)


SPLIT_BLOCK = 1024


def split_hi_lo_reference(a: torch.Tensor, dtype: torch.dtype, along_rows: bool) -> torch.Tensor:
    """split_hi_lo in torch ops."""
    hi = a.to(dtype)
    lo = (a - hi.to(a.dtype)).to(dtype)
    return torch.cat([hi, lo, hi]) if along_rows else torch.cat([hi, hi, lo], dim=1)


def split_hi_lo(a: torch.Tensor, dtype: torch.dtype, along_rows: bool) -> torch.Tensor:
    """a [R, C] fp32 -> its two-term split a = hi + lo (each in dtype, hi the rounding of a, lo
    the rounding of the rest) laid out for the router's split-precision GEMMs, in one pass:
    along_rows: [3R, C] = [hi; lo; hi] (the gate weight: the forward's [hi; lo] is its head);
    else [R, 3C] = [hi | hi | lo] (an upstream gradient: columns C.. are [hi | lo]).
    With these, x @ [hi; lo].T = x @ a.T to ~16 mantissa bits, and [g_hi | g_hi | g_lo] @
    [w_hi; w_lo; w_hi] = g_hi w_hi + g_hi w_lo + g_lo w_hi."""
    if a.dim() != 2 or a.dtype != torch.float32:
        raise ValueError(f"a must be a 2-D float32 tensor, got {a.dtype} {tuple(a.shape)}")
    if triton is None:
        return split_hi_lo_reference(a, dtype, along_rows)
    a = a.contiguous()
    rows, cols = a.shape
    if along_rows:
        out = torch.empty(3 * rows, cols, dtype=dtype, device=a.device)
        layout = (cols, 0, 2 * rows * cols, rows * cols)
    else:
        out = torch.empty(rows, 3 * cols, dtype=dtype, device=a.device)
        layout = (3 * cols, 0, cols, 2 * cols)
    if a.numel():
        _split_hi_lo_kernel[(cdiv(a.numel(), SPLIT_BLOCK),)](a, out, a.numel(), cols, *layout, BLOCK=SPLIT_BLOCK)
    return out


def _blocks(num_experts: int) -> dict:
    be = next_power_of_2(max(num_experts, 16))
    return dict(BT=max(1, ROUTER_ELEMS // be), BE=be, num_warps=4 if be <= 256 else 8)


class _FusedRouterTopK(torch.autograd.Function):
    """logits [T, E] -> probs [T, K], idx [T, K], scores [T, E], and with stats: lse [T] (0 on
    invalid tokens), score_sums [P, E] and counts [P, E] int32, one row per program (at most
    MAX_PROGRAMS: a program takes several blocks of tokens when there are more)."""

    @staticmethod
    def forward(ctx, logits, bias, valid, topk, softmax, norm, scale, stats):
        ctx.set_materialize_grads(False)
        logits = logits.contiguous()
        num_tokens, num_experts = logits.shape
        f32, dev = torch.float32, logits.device
        blocks = _blocks(num_experts)
        per_program = max(1, cdiv(cdiv(num_tokens, blocks["BT"]), MAX_PROGRAMS))  # token blocks
        programs = cdiv(num_tokens, blocks["BT"] * per_program)
        scores = torch.empty(num_tokens, num_experts, dtype=f32, device=dev)  # [T, E]
        probs = torch.empty(num_tokens, topk, dtype=f32, device=dev)  # [T, K]
        idx = torch.empty(num_tokens, topk, dtype=torch.int64, device=dev)  # [T, K]
        if stats:
            lse = torch.empty(num_tokens, dtype=f32, device=dev)  # [T]
            score_sums = torch.empty(programs, num_experts, dtype=f32, device=dev)  # [P, E]
            counts = torch.empty(programs, num_experts, dtype=torch.int32, device=dev)  # [P, E]
        else:
            lse = score_sums = counts = scores  # unused pointers
        if num_tokens:
            _router_fwd_kernel[(programs,)](
                logits, scores if bias is None else bias, scores, probs, idx, scores if valid is None else valid,
                lse, score_sums, counts, num_tokens, num_experts, float(scale), per_program,
                K=topk, BK=next_power_of_2(topk), SOFTMAX=softmax, HAS_BIAS=bias is not None,
                NORM=norm, HAS_VALID=valid is not None, STATS=stats, **blocks)
        ctx.save_for_backward(scores, idx, valid)
        ctx.mark_non_differentiable(idx)
        ctx.cfg = (topk, softmax, norm, float(scale), logits.dtype, per_program)
        if not stats:
            return probs, idx, scores
        ctx.mark_non_differentiable(counts)
        if not softmax:  # d lse / d logits needs the softmax of the logits, which sigmoid scores do not keep
            ctx.mark_non_differentiable(lse)
        return probs, idx, scores, lse, score_sums, counts

    @staticmethod
    def backward(ctx, grad_probs, _grad_idx, grad_scores, grad_lse=None, grad_sums=None, _grad_counts=None):
        scores, idx, valid = ctx.saved_tensors
        topk, softmax, norm, scale, dtype, per_program = ctx.cfg
        num_tokens, num_experts = scores.shape
        grad_logits = torch.empty(num_tokens, num_experts, dtype=dtype, device=scores.device)
        blocks = _blocks(num_experts)
        if num_tokens:
            grads = [None if g is None else g.contiguous() for g in (grad_probs, grad_scores, grad_lse, grad_sums)]
            gp, gs, glse, gsums = (scores if g is None else g for g in grads)
            _router_bwd_kernel[(cdiv(num_tokens, blocks["BT"]),)](
                scores, idx, gp, gs, scores if valid is None else valid, glse, gsums, grad_logits,
                num_tokens, num_experts, scale, per_program, K=topk if grads[0] is not None else 0, SOFTMAX=softmax, NORM=norm,
                HAS_GS=grads[1] is not None, HAS_VALID=valid is not None, HAS_GLSE=grads[2] is not None,
                HAS_GSUMS=grads[3] is not None, **blocks)
        return grad_logits, None, None, None, None, None, None, None


def _fits(logits: torch.Tensor, num_groups: int, topk_groups: int) -> bool:
    """What the kernels cover: 2-D fp32/fp16/bf16 logits, at most MAX_EXPERTS experts, no group limit."""
    return (logits.dim() == 2 and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and logits.shape[1] <= MAX_EXPERTS and topk_groups == num_groups)


def fused_router_topk(
    logits: torch.Tensor,
    topk: int,
    score_func: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    norm_topk_prob: bool | None = None,
    routed_scaling_factor: float = 1.0,
    valid: torch.Tensor | None = None,
    stats: bool = False,
) -> tuple[torch.Tensor, ...]:
    """router_topk (reference.py) without expert groups, in the Triton kernels:
    logits [T, E] -> probs [T, K] fp32, topk_idx [T, K] int64, scores [T, E] fp32; probs and
    scores carry gradients to the logits.

    stats=True adds, from the same kernel, what the balance losses need: lse [T] (logsumexp of
    each valid token's logits, 0 for the others: the z-loss input), score_sums [E] (sum over
    valid tokens of scores / their sum over E: load_balancing_loss's P_e times the token
    count), counts [E] int64 (the valid tokens' routed copies per expert). valid [T] bool
    (False = padding) or None. score_sums and, for softmax scores, lse carry gradients; sums
    run in a fixed order (per block of tokens, then over the blocks): results repeat bitwise."""
    softmax, norm = _checked(logits, topk, score_func, expert_bias, norm_topk_prob, valid)
    out = _FusedRouterTopK.apply(logits, _f32(expert_bias), None if valid is None else valid.contiguous(), topk,
                                 softmax, norm, routed_scaling_factor, stats)  # fmt: skip
    if not stats:
        return out
    probs, idx, scores, lse, sums, counts = out
    return probs, idx, scores, lse, sums.sum(0), counts.sum(0, dtype=torch.int64)


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).contiguous()


def _checked(logits, topk, score_func, expert_bias, norm_topk_prob, valid) -> tuple[bool, bool]:
    """Validates the fused router's inputs -> (softmax, norm)."""
    if triton is None:
        raise ValueError("the fused router needs Triton; use backend='torch'")
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be a [T, E] float32/float16/bfloat16 tensor, got {logits.dtype} {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"logits: at most {MAX_EXPERTS} experts fit the fused router, got E={num_experts}; use backend='torch'")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    if expert_bias is not None and (expert_bias.shape != (num_experts,) or expert_bias.device != logits.device):
        raise ValueError(f"expert_bias must be [E={num_experts}] on {logits.device}, "
                         f"got {tuple(expert_bias.shape)} on {expert_bias.device}")
    if valid is not None and (valid.shape != (num_tokens,) or valid.dtype != torch.bool or valid.device != logits.device):
        raise ValueError(f"valid must be bool [T={num_tokens}] on {logits.device}, got {valid.dtype} {tuple(valid.shape)}")
    if norm_topk_prob is None:
        norm_topk_prob = score_func == "sigmoid"
    return score_func == "softmax", bool(norm_topk_prob)


def uses_fused_router(logits: torch.Tensor, num_groups: int, topk_groups: int, backend: str) -> bool:
    """Whether routing() takes the fused kernels for these logits on this backend (see routing)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and topk_groups != num_groups:
        raise ValueError(
            f"backend='triton' routes without expert groups; got num_groups={num_groups}, "
            f"topk_groups={topk_groups} (use backend='torch' or 'auto')"
        )
    return backend == "triton" or (
        backend == "auto" and triton is not None and logits.is_cuda and _fits(logits, num_groups, topk_groups)
    )


def routing(
    logits: torch.Tensor,
    topk: int,
    score_func: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    norm_topk_prob: bool | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling_factor: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """router_topk's arguments and results on a backend: "torch" (the reference), "triton" (the
    fused kernels; group-limited routing raises) or "auto" (the kernels for CUDA logits they
    cover, the reference for the rest: group-limited routing, fp64, more than MAX_EXPERTS)."""
    if uses_fused_router(logits, num_groups, topk_groups, backend):
        return fused_router_topk(logits, topk, score_func, expert_bias, norm_topk_prob, routed_scaling_factor)
    return router_topk_reference(logits, topk, score_func, expert_bias, norm_topk_prob, num_groups, topk_groups,
                                 routed_scaling_factor)
