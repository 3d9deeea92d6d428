"""Causal depthwise short convolution + SiLU, the token mixer in front of linear attention's
q/k/v (GatedDeltaNet, Mamba): y[b, t, c] = silu(sum_j weight[c, j] * x[b, t - (W-1) + j, c]),
taps before the sequence start read zero. One Triton kernel each way; x is read through its
strides, so the usual input, a channel slice of the input projection [T, B, D] seen as
[B, T, C], is never copied.

Shape legend: B batch, T time, C channels, W kernel size (taps, <= 8 in the kernels),
S packed sequences (cu_seqlens [S + 1], B == 1); pos [T] a token's position in its sequence.
"""

import logging
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from .._intmath import cdiv

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional on CPU
    triton = None

logger = logging.getLogger(__name__)

MAX_KERNEL_SIZE = 8
# (BLOCK_T, BLOCK_C, num_warps). The forward's from an sm_90 compile's register counts (~4 a
# element: 64 at W=4 for 16 elements a thread); the backward's the fastest of five tried on the
# H200 at B4-T4096-C8192 (benchmarks/results/h200/short_conv.json: 2.14 ms forward and backward,
# against 3.18 with the forward's shape).
FWD_CONFIG = (32, 128, 8)
BWD_CONFIG = (64, 64, 4)
_fallback_logged = False


def _conv_segment(x_BTC: Tensor, w_CW: Tensor, activation: bool) -> Tensor:
    """One sequence (or a batch of unpacked ones) by F.conv1d; x, w already in compute dtype."""
    T, C = x_BTC.shape[1:]
    if T == 0:
        return x_BTC.clone()
    W = w_CW.shape[1]
    pre = F.conv1d(F.pad(x_BTC.transpose(1, 2), (W - 1, 0)), w_CW[:, None, :], groups=C)
    out = F.silu(pre) if activation else pre
    return out.transpose(1, 2)  # [B, T, C]


def causal_conv1d_reference(
    x: Tensor, weight: Tensor, cu_seqlens: Tensor | None = None, activation: bool = True
) -> Tensor:
    """x [B, T, C], weight [C, W] (or [C, 1, W]) -> y [B, T, C] in x's dtype, computed in fp32
    (fp64 for fp64 inputs). With cu_seqlens [S + 1] (B == 1) the conv restarts at every
    sequence start. Plain PyTorch; syncs on cu_seqlens."""
    weight = _check(x, weight, cu_seqlens)
    ct = torch.promote_types(x.dtype, torch.float32)
    xc, wc = x.to(ct), weight.to(ct)
    if cu_seqlens is None:
        return _conv_segment(xc, wc, activation).to(x.dtype)
    offsets = cu_seqlens.tolist()
    T = x.shape[1]
    if offsets[0] != 0 or offsets[-1] != T or any(a > b for a, b in pairwise(offsets)):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={T}, got {offsets}")
    segments = [_conv_segment(xc[:, s:e], wc, activation) for s, e in pairwise(offsets)]
    return torch.cat(segments, dim=1).to(x.dtype)


if triton is not None:
    from .._launch import fast_launch

    @fast_launch
    @triton.jit
    def _causal_conv1d_fwd_kernel(
        x, w, y, pos, T, C, stride_xb, stride_xt,
        W: tl.constexpr, HAS_POS: tl.constexpr, ACT: tl.constexpr,
        BT: tl.constexpr, BC: tl.constexpr,
    ):
        i_bt, i_c = tl.program_id(0), tl.program_id(1)
        num_t = tl.cdiv(T, BT)
        i_b, i_t = i_bt // num_t, i_bt % num_t
        o_t = i_t * BT + tl.arange(0, BT)  # [BT] token rows
        o_c = i_c * BC + tl.arange(0, BC)  # [BC] channels
        m_t, m_c = o_t < T, o_c < C
        if HAS_POS:
            b_pos = tl.load(pos + o_t, mask=m_t, other=0)  # [BT] position in its sequence
        else:
            b_pos = o_t
        p_x = x + i_b.to(tl.int64) * stride_xb + o_c[None, :]
        b_acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            # tap j reads row t - (W-1-j); it exists while it stays inside the sequence
            shift = W - 1 - j
            m_tap = m_t & (b_pos >= shift)
            b_w = tl.load(w + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)  # [BC]
            o_src = (o_t - shift).to(tl.int64) * stride_xt
            b_x = tl.load(p_x + o_src[:, None], mask=m_tap[:, None] & m_c[None, :], other=0.0)
            b_acc += b_x.to(tl.float32) * b_w[None, :]
        if ACT:
            b_acc = b_acc * tl.sigmoid(b_acc)
        p_y = y + (i_b.to(tl.int64) * T + o_t.to(tl.int64))[:, None] * C + o_c[None, :]
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])

    @fast_launch
    @triton.jit
    def _causal_conv1d_dpre_kernel(
        x, w, dy, dpre, pos, T, C, stride_xb, stride_xt,
        W: tl.constexpr, HAS_POS: tl.constexpr,
        BT: tl.constexpr, BC: tl.constexpr,
    ):
        """dpre = dy * silu'(pre), pre recomputed from x as the forward does (SiLU only)."""
        i_bt, i_c = tl.program_id(0), tl.program_id(1)
        num_t = tl.cdiv(T, BT)
        i_b, i_t = i_bt // num_t, i_bt % num_t
        o_t = i_t * BT + tl.arange(0, BT)
        o_c = i_c * BC + tl.arange(0, BC)
        m_t, m_c = o_t < T, o_c < C
        if HAS_POS:
            b_pos = tl.load(pos + o_t, mask=m_t, other=0)
        else:
            b_pos = o_t
        p_x = x + i_b.to(tl.int64) * stride_xb + o_c[None, :]
        b_pre = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            shift = W - 1 - j
            m_tap = m_t & (b_pos >= shift)
            b_w = tl.load(w + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
            o_src = (o_t - shift).to(tl.int64) * stride_xt
            b_x = tl.load(p_x + o_src[:, None], mask=m_tap[:, None] & m_c[None, :], other=0.0)
            b_pre += b_x.to(tl.float32) * b_w[None, :]
        o_out = (i_b.to(tl.int64) * T + o_t.to(tl.int64))[:, None] * C + o_c[None, :]
        m = m_t[:, None] & m_c[None, :]
        b_dy = tl.load(dy + o_out, mask=m, other=0.0).to(tl.float32)
        b_sig = tl.sigmoid(b_pre)
        tl.store(dpre + o_out, (b_dy * b_sig * (1.0 + b_pre * (1.0 - b_sig))).to(dpre.dtype.element_ty), mask=m)

    @fast_launch
    @triton.jit
    def _causal_conv1d_bwd_kernel(
        x, w, dpre, dx, dw, pos, T, C, stride_xb, stride_xt,
        W: tl.constexpr, HAS_POS: tl.constexpr,
        BT: tl.constexpr, BC: tl.constexpr,
    ):
        # Rows t of this tile get dx[t] = sum_s w[W-1-s] * dpre[t+s] (W shifted loads of dpre,
        # served by the cache); the same products x[t] * dpre[t+s] summed over the tile's t are
        # its share of dw[:, W-1-s]: every (t, t+s) pair is counted in t's tile only.
        i_bt, i_c = tl.program_id(0), tl.program_id(1)
        num_t = tl.cdiv(T, BT)
        i_b, i_t = i_bt // num_t, i_bt % num_t
        o_t = i_t * BT + tl.arange(0, BT)
        o_c = i_c * BC + tl.arange(0, BC)
        m_t, m_c = o_t < T, o_c < C
        p_x = x + i_b.to(tl.int64) * stride_xb + o_c[None, :]
        p_dpre = dpre + i_b.to(tl.int64) * T * C + o_c[None, :]
        b_x0 = tl.load(
            p_x + o_t.to(tl.int64)[:, None] * stride_xt, mask=m_t[:, None] & m_c[None, :], other=0.0
        ).to(tl.float32)  # [BT, BC] x at the tile's own rows
        b_dx = tl.zeros([BT, BC], dtype=tl.float32)
        for s in tl.static_range(W):
            o_r = o_t + s  # [BT] the output rows t + s that read row t through tap W-1-s
            m_r = o_r < T
            if HAS_POS:
                b_pos = tl.load(pos + o_r, mask=m_r, other=0)
            else:
                b_pos = o_r
            # row t + s read row t iff tap W-1-s (shift s) stayed inside its sequence
            m_read = m_r & (b_pos >= s)
            b_dpre = tl.load(p_dpre + o_r.to(tl.int64)[:, None] * C, mask=m_read[:, None] & m_c[None, :],
                             other=0.0).to(tl.float32)
            b_ws = tl.load(w + o_c * W + (W - 1 - s), mask=m_c, other=0.0).to(tl.float32)
            b_dx += b_dpre * b_ws[None, :]
            b_dws = tl.sum(b_x0 * b_dpre, axis=0)  # [BC]
            tl.store(dw + (i_bt.to(tl.int64) * C + o_c) * W + (W - 1 - s), b_dws, mask=m_c)
        p_dx = dx + (i_b.to(tl.int64) * T + o_t.to(tl.int64))[:, None] * C + o_c[None, :]
        tl.store(p_dx, b_dx.to(dx.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


def _alloc(shape, dtype, device) -> Tensor:
    """Every buffer the kernels write (tests swap in a NaN-filled one to catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _positions(cu_seqlens: Tensor | None, T: int, device) -> Tensor | None:
    """pos [T] int32: each token's position inside its packed sequence, on device (no sync)."""
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    t = torch.arange(T, device=device, dtype=torch.int64)
    seq = torch.searchsorted(cu, t, right=True) - 1  # [T] the sequence of token t
    return (t - cu[seq]).to(torch.int32).contiguous()


def _grid(B: int, T: int, C: int, block_t: int, block_c: int) -> tuple[int, int]:
    return B * cdiv(T, block_t), cdiv(C, block_c)


def causal_conv1d_fwd(x: Tensor, w_CW: Tensor, pos: Tensor | None, activation: bool) -> Tensor:
    """x [B, T, C] with x.stride(2) == 1, w [C, W] contiguous -> y [B, T, C] contiguous."""
    B, T, C = x.shape
    BT, BC, num_warps = FWD_CONFIG
    y = _alloc((B, T, C), x.dtype, x.device)
    if y.numel():
        _causal_conv1d_fwd_kernel[_grid(B, T, C, BT, BC)](
            x, w_CW, y, pos, T, C, x.stride(0), x.stride(1),
            W=w_CW.shape[1], HAS_POS=pos is not None, ACT=activation,
            BT=BT, BC=BC, num_warps=num_warps,
        )
    return y


def causal_conv1d_bwd(
    x: Tensor, w_CW: Tensor, dy: Tensor, pos: Tensor | None, activation: bool, need_dw: bool
) -> tuple[Tensor, Tensor | None]:
    """dy [B, T, C] contiguous -> dx [B, T, C] in x's dtype, dw [C, W] in w's dtype (or None).

    Two passes: dpre = dy * silu'(pre) (pre recomputed; dy itself without the activation),
    then dx and dw's partial sums from W shifted reads of dpre. (One kernel that recomputed
    pre at each of the W shifted rows did W^2 loads a tile and ran 2.2 ms for [4, 4096, 8192]
    on the H200.)"""
    B, T, C = x.shape
    W = w_CW.shape[1]
    BT, BC, num_warps = BWD_CONFIG
    grid = _grid(B, T, C, BT, BC)
    dx = _alloc((B, T, C), x.dtype, x.device)
    # [programs over (B, T-blocks), C, W] fp32 partial sums, added up below: deterministic
    dw_partial = _alloc((grid[0], C, W), torch.float32, x.device)
    if dx.numel():
        dpre = dy
        if activation:
            dpre = _alloc((B, T, C), torch.float32, x.device)  # fp32: dw sums it over every token
            _causal_conv1d_dpre_kernel[grid](
                x, w_CW, dy, dpre, pos, T, C, x.stride(0), x.stride(1),
                W=W, HAS_POS=pos is not None, BT=BT, BC=BC, num_warps=num_warps,
            )
        _causal_conv1d_bwd_kernel[grid](
            x, w_CW, dpre, dx, dw_partial, pos, T, C, x.stride(0), x.stride(1),
            W=W, HAS_POS=pos is not None, BT=BT, BC=BC, num_warps=num_warps,
        )
    if not need_dw:
        return dx, None
    return dx, dw_partial.sum(0).to(w_CW.dtype)  # no programs (B or T is 0): zeros


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, pos, activation):
        if x.stride(2) != 1:
            x = x.contiguous()
        w_CW = weight.contiguous()
        y = causal_conv1d_fwd(x, w_CW, pos, activation)
        ctx.save_for_backward(x, w_CW, pos)  # x as given: a view of the projection, not a copy
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w_CW, pos = ctx.saved_tensors
        need_dw = ctx.needs_input_grad[1]
        dx, dw = causal_conv1d_bwd(x, w_CW, dy.contiguous(), pos, ctx.activation, need_dw)
        return dx, dw, None, None


def _check(x: Tensor, weight: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """Validates the arguments; returns weight as [C, W]."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x: expected a floating [B, T, C] tensor, got {x.dtype} {list(x.shape)}")
    if weight.dim() == 3 and weight.shape[1] == 1:  # nn.Conv1d(C, C, W, groups=C).weight
        weight = weight.squeeze(1)
    C = x.shape[2]
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1 or not weight.is_floating_point():
        raise ValueError(
            f"weight: expected a floating [C, W] (or [C, 1, W]) tensor with C={C} from x, got "
            f"{weight.dtype} {list(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight: expected on x's device {x.device}, got {weight.device}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"cu_seqlens: expected an integer [S + 1] tensor of offsets, got {cu_seqlens.dtype} "
                f"{list(cu_seqlens.shape)}"
            )
        if x.shape[0] != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got B={x.shape[0]}; flatten the batch")
        if cu_seqlens.device != x.device:
            raise ValueError(f"cu_seqlens: expected on x's device {x.device}, got {cu_seqlens.device}")
    return weight


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    cu_seqlens: Tensor | None = None,
    activation: bool = True,
    backend: str = "auto",
) -> Tensor:
    """Causal depthwise conv (+ SiLU if activation): x [B, T, C] (any strides; a channel slice of
    a [T, B, D] projection is read in place), weight [C, W] or [C, 1, W], cu_seqlens [S + 1]
    integer offsets of packed sequences (B == 1) where the conv restarts.
    Returns y [B, T, C] contiguous in x's dtype; differentiable in x and weight.

    backend "auto": the Triton kernels for CUDA float32/16 and bfloat16 x, the reference
    (causal_conv1d_reference) elsewhere; "triton" / "torch" ask for one.
    """
    global _fallback_logged
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    w_CW = _check(x, weight, cu_seqlens)
    use_triton = backend == "triton" or (
        backend == "auto" and triton is not None and x.is_cuda and x.dtype != torch.float64
    )
    if backend == "auto" and x.is_cuda and not use_triton and not _fallback_logged:
        _fallback_logged = True
        logger.warning("causal_conv1d: Triton is missing or x is float64; using the torch reference")
    if not use_triton:
        return causal_conv1d_reference(x, w_CW, cu_seqlens, activation)
    if triton is None:
        raise ValueError("backend: 'triton' needs the triton package (pip install triton)")
    if x.dtype == torch.float64:
        raise ValueError("x: backend='triton' takes float32/float16/bfloat16, got float64; use backend='torch'")
    if w_CW.shape[1] > MAX_KERNEL_SIZE:
        raise ValueError(
            f"weight: the Triton kernels take W <= {MAX_KERNEL_SIZE} taps, got W={w_CW.shape[1]}; "
            f"use backend='torch'"
        )
    pos = _positions(cu_seqlens, x.shape[1], x.device)
    return _CausalConv1d.apply(x, w_CW, pos, bool(activation))
