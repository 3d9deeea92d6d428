"""Linear-attention ops in plain PyTorch: the ground truth that fused kernels are tested against.

Shape legend (flash-linear-attention's layout):
  B batch, T time, H heads, K query/key head dim, V value head dim,
  N independent sequences (B, or the number of cu_seqlens segments when packed),
  C chunk size, NC number of chunks.
  q, k [B, T, H, K]; v, o [B, T, H, V]; g, beta [B, T, H]; state [N, H, K, V].

Two recurrences over a state S [K, V] per head (g is the log decay, <= 0):
  simple GLA:         S_t = exp(g_t) S_{t-1} + k_t v_t^T
  gated delta rule:   S' = exp(g_t) S_{t-1};  S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T
and in both o_t = S_t^T (scale q_t). The chunked forms compute the same outputs block by
block; README.md derives them. Math runs in fp32 (fp64 when q is fp64) whatever the input
dtype; the final state is returned in that dtype and o in v's dtype.
"""

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import positive_finite

_NO_BETA = "beta: the gated delta rule needs beta [B, T, H]; use simple GLA for no beta"

# (q, k, v, g, beta or None, state) -> (o, state), all in the accumulation dtype, q pre-scaled.
Core = Callable[[Tensor, Tensor, Tensor, Tensor, Optional[Tensor], Tensor], tuple[Tensor, Tensor]]


def check_options(scale, cu_seqlens, chunk_size=None) -> None:
    """Raises ValueError naming a bad scalar option, whatever the backend: scale None or a finite
    positive number, cu_seqlens None or a tensor, chunk_size None or a positive int."""
    if scale is not None and not positive_finite(scale):
        raise ValueError(f"scale: expected None (K ** -0.5) or a finite positive number, got {scale!r}")
    if cu_seqlens is not None and not isinstance(cu_seqlens, Tensor):
        raise ValueError(
            f"cu_seqlens: expected an integer tensor of offsets, got a {type(cu_seqlens).__name__}; "
            "pass torch.tensor(offsets, dtype=torch.int32, device=q.device)"
        )
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size=None) -> int:
    """Raises ValueError naming the bad argument; returns N, the number of sequences."""
    if q.dim() != 4 or not q.is_floating_point():
        raise ValueError(
            f"q: expected a floating [B, T, H, K] tensor, got {q.dtype} {list(q.shape)}"
        )
    B, T, H, K = q.shape
    if k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(
            f"k: expected [B, T, H, K] matching q {list(q.shape)} {q.dtype}, "
            f"got {list(k.shape)} {k.dtype}"
        )
    if v.dim() != 4 or v.shape[:3] != q.shape[:3] or v.dtype != q.dtype:
        raise ValueError(
            f"v: expected [B, T, H, V] with B, T, H = {B}, {T}, {H} and dtype {q.dtype} like q, "
            f"got {list(v.shape)} {v.dtype}"
        )
    for name, x in (("g", g), ("beta", beta)):
        if x is not None and (x.shape != q.shape[:3] or not x.is_floating_point()):
            raise ValueError(
                f"{name}: expected a floating [B, T, H] = {[B, T, H]} tensor (one value per "
                f"token and head), got {x.dtype} {list(x.shape)}"
            )
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"cu_seqlens: expected an integer [N + 1] tensor of sequence offsets (N >= 1), "
                f"got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
            )
        if B != 1:
            raise ValueError(
                f"cu_seqlens: packed sequences need B == 1, got B={B}; flatten the batch"
            )
        offsets = cu_seqlens.tolist()
        if offsets[0] != 0 or offsets[-1] != T or any(a > b for a, b in zip(offsets, offsets[1:])):
            raise ValueError(
                f"cu_seqlens: expected non-decreasing offsets from 0 to T={T}, got {offsets}"
            )
        N = len(offsets) - 1
    V = v.shape[-1]
    if initial_state is not None and (
        initial_state.shape != (N, H, K, V) or not initial_state.is_floating_point()
    ):
        raise ValueError(
            f"initial_state: expected a floating [N, H, K, V] = {[N, H, K, V]} tensor "
            f"(N = {'number of cu_seqlens segments' if cu_seqlens is not None else 'B'}), "
            f"got {initial_state.dtype} {list(initial_state.shape)}"
        )
    if H == 0 or K == 0:
        raise ValueError(f"q: expected at least one head and a key dim of at least 1, got {list(q.shape)}")
    check_options(None, cu_seqlens, chunk_size)
    return N


def _run(
    core: Core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
    chunk_size=None,
):
    """Checks inputs, casts to the accumulation dtype, runs core per batch row or packed segment."""
    N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    B, T, H, K = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = v.dtype
    scale = K**-0.5 if scale is None else scale
    q, k, v, g = (x.to(acc) for x in (q, k, v, g))
    q = q * scale
    beta = None if beta is None else beta.to(acc)
    if initial_state is None:
        state = q.new_zeros(N, H, K, v.shape[-1])  # [N, H, K, V]
    else:
        state = initial_state.to(acc)
    if cu_seqlens is None:
        o, state = core(q, k, v, g, beta, state)
    else:
        # The state restarts at every boundary: each segment is its own B = 1 sequence.
        offsets = cu_seqlens.tolist()
        outs, states = [], []
        for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
            seg = slice(bos, eos)
            o_n, s_n = core(
                q[:, seg], k[:, seg], v[:, seg], g[:, seg],
                None if beta is None else beta[:, seg], state[n : n + 1],
            )
            outs.append(o_n)
            states.append(s_n)
        o, state = torch.cat(outs, dim=1), torch.cat(states, dim=0)
    return o.to(out_dtype), (state if output_final_state else None)


def _recurrent_core(q, k, v, g, beta, S):
    """Token-by-token recurrence; beta None is simple GLA, else the gated delta rule."""
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t, :, None, None].exp()  # [N, H, K, V]
        v_t = v[:, t]  # [N, H, V]
        if beta is not None:
            v_t = (v_t - torch.einsum("nhk,nhkv->nhv", k[:, t], S)) * beta[:, t, :, None]
        S = S + torch.einsum("nhk,nhv->nhkv", k[:, t], v_t)
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S))
    return (torch.stack(outs, dim=1) if outs else torch.zeros_like(v)), S


def _chunk_core(q, k, v, g, beta, S, chunk_size):
    """Block-parallel form (README.md): dense work inside chunks, the state passed between them."""
    B, T, H, K = q.shape
    if T == 0:
        return torch.zeros_like(v), S
    C = chunk_size
    NC = -(-T // C)
    pad = NC * C - T

    # Zero padding is inert: k = 0 and beta = 0 add nothing to the state and g = 0 keeps it.
    def blocks(x):  # [B, T, H, *] -> [B, H, NC, C, *]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.unflatten(1, (NC, C)).movedim(3, 1)

    q, k, v, g = blocks(q), blocks(k), blocks(v), blocks(g)
    gam = g.cumsum(-1)  # [B, H, NC, C] log decay from the chunk start through position i
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: above the diagonal gam_i - gam_j > 0 may overflow, and inf * 0 = nan.
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, -float("inf")).exp()
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, NC, C, C] inclusive causal
    u, w = v, None  # simple GLA writes v itself
    if beta is not None:
        beta = blocks(beta)[..., None]  # [B, H, NC, C, 1]
        # WY form: (I + diag(beta) L) U = beta V - beta exp(gam) K S0, L strictly lower.
        lhs = torch.eye(C, dtype=q.dtype, device=q.device) + beta * (
            (k @ k.transpose(-1, -2)) * decay.tril(-1)
        )
        u = torch.linalg.solve_triangular(lhs, beta * v, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(
            lhs, beta * gam[..., None].exp() * k, upper=False, unitriangular=True
        )
    outs = []
    for n in range(NC):
        gam_n = gam[:, :, n]  # [B, H, C]
        u_n = u[:, :, n] if w is None else u[:, :, n] - w[:, :, n] @ S  # [B, H, C, V]
        outs.append((q[:, :, n] * gam_n[..., None].exp()) @ S + attn[:, :, n] @ u_n)
        k_to_end = k[:, :, n] * (gam_n[..., -1:] - gam_n).exp()[..., None]  # [B, H, C, K]
        S = S * gam_n[..., -1, None, None].exp() + k_to_end.transpose(-1, -2) @ u_n
    o = torch.stack(outs, dim=2)  # [B, H, NC, C, V]
    return o.movedim(1, 3).flatten(1, 2)[:, :T], S


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated delta rule, one token at a time (fla's naive convention).

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] log decay (<= 0); beta [B, T, H] in (0, 1);
    scale defaults to K ** -0.5; initial_state [N, H, K, V]; cu_seqlens [N + 1] integer offsets
    of packed sequences (B must be 1; the state restarts at each boundary).
    Returns o [B, T, H, V] in v's dtype and, if output_final_state, the state [N, H, K, V] in
    fp32 (fp64 for fp64 inputs), else None.
    """
    if beta is None:
        raise ValueError(_NO_BETA)
    return _run(
        _recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens
    )


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated delta rule in chunked (WY) form; same arguments and results as the recurrent form.

    T need not be a multiple of chunk_size: the last chunk is zero-padded internally.
    """
    if beta is None:
        raise ValueError(_NO_BETA)
    core = functools.partial(_chunk_core, chunk_size=chunk_size)
    return _run(
        core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size
    )


def recurrent_simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Scalar-decay gated linear attention, one token at a time: S = exp(g) S + k v^T, o = S^T q.

    Arguments and results as recurrent_gated_delta_rule, without beta.
    """
    return _run(
        _recurrent_core, q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens
    )


def chunk_simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Optional[Tensor]]:
    """Simple GLA in chunked form; same arguments and results as recurrent_simple_gla."""
    core = functools.partial(_chunk_core, chunk_size=chunk_size)
    return _run(
        core, q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens, chunk_size
    )


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32, returned in x's dtype (fla's
    use_qk_l2norm_in_kernel); autograd gives its backward."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def decay_from_g_gamma(g: Optional[Tensor], g_gamma: Optional[Tensor], v: Tensor) -> Optional[Tensor]:
    """fla's simple-GLA decay arguments -> g [B, T, HV] (or None: no decay): g_gamma [HV] is one
    constant log decay per value head, expanded (autograd sums dg over B and T into it)."""
    if g is not None and g_gamma is not None:
        raise ValueError("g_gamma: pass either g [B, T, HV] or g_gamma [HV], not both")
    if g_gamma is None:
        return g
    if v.dim() != 4 or g_gamma.shape != (v.shape[2],) or not g_gamma.is_floating_point():
        raise ValueError(
            f"g_gamma: expected a floating [HV] tensor, one log decay per value head of v "
            f"{list(v.shape)}, got {g_gamma.dtype} {list(g_gamma.shape)}"
        )
    return g_gamma.expand(*v.shape[:3])
