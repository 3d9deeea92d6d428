"""Top-k sparse attention (DeepSeek-V3.2 DSA): the plain PyTorch reference.

Shape legend (batch first, the layout of every function here):
  B batch, T tokens (queries), S keys, N packed sequences, H query heads, G kv groups
  (H % G == 0; head h reads group h // R), R = H // G, D q/k head dim, DV value head dim,
  HI indexer heads, DI indexer head dim, K top-k.

Queries and keys are usually the same tokens (T == S). Under context parallelism a rank's
T queries are a subset of the S global keys: q_positions [T] gives each query's global key
index, which the causal mask (s <= q_positions[t]) and the packed-sequence mask use.

Scores and softmax run in fp32, or in fp64 when the inputs are fp64 so that tests can
be exact. The math (indexer, selection, attention, KL loss) is in README.md.
"""

import functools
import weakref
from itertools import pairwise

import torch
from torch import Tensor

from .._checks import positive_finite
from .._packed import host_offsets

NEG_INF = float("-inf")
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0  # the largest float8_e4m3fn value


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _compute_dtype(x: Tensor) -> torch.dtype:
    if x.dtype in FP8_DTYPES:  # torch does not promote float8 types
        return torch.float32
    return torch.promote_types(x.dtype, torch.float32)


def _bmm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in fp32 (fp64 stays fp64): 16-bit CUDA operands on tensor cores with an fp32
    output, anything else converted first (the fast paths' batched products share it)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=torch.float32)
    dtype = _compute_dtype(a)
    return torch.bmm(a.to(dtype), b.to(dtype))


def _shape(x: Tensor, name: str, legend: str) -> tuple[int, ...]:
    num_dims = legend.count(",") + 1
    _check(
        isinstance(x, Tensor) and x.dim() == num_dims,
        f"{name} must be a {num_dims}-D tensor {legend}, got "
        f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}",
    )
    return tuple(x.shape)


def _check_topk(topk: int) -> None:
    _check(
        isinstance(topk, int) and not isinstance(topk, bool) and topk > 0,
        f"topk must be a positive int (keys kept per query), got {topk!r}",
    )


def check_cu_seqlens(cu_seqlens: Tensor, B: int, T: int) -> list[int]:
    """The offsets of a packed batch (B == 1) of T tokens, checked, as host ints (read once per
    tensor: do not modify the list)."""
    _check(B == 1, f"cu_seqlens needs the packed layout B == 1, got B={B}; concatenate the batch")
    _check(
        cu_seqlens.dim() == 1
        and cu_seqlens.numel() >= 2
        and not cu_seqlens.is_floating_point()
        and not cu_seqlens.is_complex(),
        f"cu_seqlens must be a 1-D integer tensor [N + 1], got {cu_seqlens.dtype} "
        f"{tuple(cu_seqlens.shape)}",
    )
    offsets = host_offsets(cu_seqlens)  # one host read per tensor, shared by the step's layers
    _check(
        offsets[0] == 0 and offsets[-1] == T and all(a <= b for a, b in pairwise(offsets)),
        f"cu_seqlens must start at 0, end at the token count {T} and never decrease, got {offsets}",
    )
    return offsets


def _segment_ids(cu_seqlens: Tensor | None, B: int, T: int) -> Tensor | None:
    """[T] int64 sequence id of each token, or None when nothing is packed."""
    if cu_seqlens is None:
        return None
    check_cu_seqlens(cu_seqlens, B, T)
    cu = cu_seqlens.to(torch.int64)
    # right=True puts a token that starts a sequence after empty ones into the non-empty one.
    return torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True)


def positions_from_cu_seqlens(cu_seqlens: Tensor, T: int) -> Tensor:
    """[T] int64 position of each token inside its own packed sequence (restarts at 0)."""
    seg = _segment_ids(cu_seqlens, 1, T)
    return torch.arange(T, device=cu_seqlens.device) - cu_seqlens.to(torch.int64)[seg]


def _query_positions(q_positions: Tensor | None, T: int, S: int, device) -> Tensor:
    """[T] int64 global key index of each query; arange(T) when None (then T must equal S)."""
    if q_positions is None:
        _check(
            T == S,
            f"got T={T} queries but S={S} keys: pass q_positions [T] (each query's global key "
            "index) when the queries are a subset of the keys",
        )
        return torch.arange(S, device=device)
    _check(
        isinstance(q_positions, Tensor)
        and tuple(q_positions.shape) == (T,)
        and not q_positions.is_floating_point()
        and not q_positions.is_complex(),
        f"q_positions must be a 1-D integer tensor [T={T}], got "
        f"{q_positions.dtype} {tuple(q_positions.shape)}"
        if isinstance(q_positions, Tensor)
        else f"q_positions must be a Tensor, got {type(q_positions).__name__}",
    )
    q_positions = q_positions.to(device=device, dtype=torch.int64)
    _check(
        bool(((q_positions >= 0) & (q_positions < S)).all()),
        f"q_positions must lie in [0, S={S}) (global key indices)",
    )
    return q_positions


def _key_mask(q_pos: Tensor, S: int, causal: bool, seg: Tensor | None) -> Tensor:
    """[len(q_pos), S] bool: True where the query at global index q_pos[t] may read key s."""
    s = torch.arange(S, device=q_pos.device)[None, :]
    ok = s <= q_pos[:, None] if causal else torch.ones_like(s, dtype=torch.bool)
    ok = ok.expand(len(q_pos), S)
    if seg is not None:
        ok = ok & (seg[q_pos][:, None] == seg[None, :])
    return ok


def apply_rope(x: Tensor, positions: Tensor, rope_dim: int, base: float = 10000.0) -> Tensor:
    """Non-interleaved (rotate-half) RoPE on the first rope_dim channels of x.

    x [B, T, ..., D]; positions [B, T] or [T] integer positions. Channel i < rope_dim / 2
    is rotated together with channel i + rope_dim / 2; channels >= rope_dim pass through.
    """
    _check(x.dim() >= 3, f"x must be [B, T, ..., D], got shape {tuple(x.shape)}")
    B, T, D = x.shape[0], x.shape[1], x.shape[-1]
    _check(
        isinstance(rope_dim, int) and rope_dim % 2 == 0 and 0 <= rope_dim <= D,
        f"rope_dim must be an even int in [0, D={D}], got {rope_dim!r}",
    )
    _check(
        tuple(positions.shape) in ((T,), (B, T)),
        f"positions must be [T] or [B, T] = [{B}, {T}], got {tuple(positions.shape)}",
    )
    if rope_dim == 0:
        return x
    dtype = _compute_dtype(x)
    half = rope_dim // 2
    inv_freq = base ** (-2.0 * torch.arange(half, device=x.device, dtype=dtype) / rope_dim)
    angle = positions.to(device=x.device, dtype=dtype)[..., None] * inv_freq  # [B or 1, T, half]
    angle = angle.expand(B, T, half).reshape(B, T, *[1] * (x.dim() - 3), half)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half].to(dtype), x[..., half:rope_dim].to(dtype)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., rope_dim:]], dim=-1)


def _check_indexer_args(q_idx: Tensor, k_idx: Tensor, weights: Tensor) -> tuple[int, int, int]:
    B, T, HI, DI = _shape(q_idx, "q_idx", "[B, T, HI, DI]")
    _check(
        k_idx.dim() == 3 and (k_idx.shape[0], k_idx.shape[2]) == (B, DI),
        f"k_idx must be [B, S, DI] = [{B}, S, {DI}] (one key head shared by all indexer "
        f"heads), got {tuple(k_idx.shape)}",
    )
    _check(
        tuple(weights.shape) == (B, T, HI),
        f"weights must be [B, T, HI] = [{B}, {T}, {HI}], got {tuple(weights.shape)}",
    )
    return B, T, k_idx.shape[1]


def check_kl_args(q: Tensor, k: Tensor, q_idx: Tensor, k_idx: Tensor, weights: Tensor) -> tuple[int, ...]:
    """The indexer KL loss's attention and indexer inputs checked together: (B, T, S, H, G, D)
    of q [B, T, H, D] and k [B, S, G, D], with q_idx [B, T, HI, DI], k_idx [B, S, DI] and
    weights [B, T, HI] covering the same queries and keys."""
    B, T, S, H, G, D = _check_attention_args(q, k, k)
    _, _, S_idx = _check_indexer_args(q_idx, k_idx, weights)
    _check(
        tuple(q_idx.shape[:2]) == (B, T) and S_idx == S,
        f"q_idx [B, T, HI, DI] and k_idx [B, S, DI] must cover q's B={B}, T={T} and k's S={S}, got "
        f"{tuple(q_idx.shape)} and {tuple(k_idx.shape)}",
    )
    return B, T, S, H, G, D


def _index_scores(q_idx: Tensor, k_idx: Tensor, weights: Tensor, k_scale: Tensor | None = None) -> Tensor:
    """[B, Tq, S] = k_scale[s] * sum_j w[t, j] * relu(q_idx[t, j] . k_idx[s]), no mask
    (k_scale None: 1)."""
    # fp8 rows compute in the (scaled) weights' dtype: fp32, or fp64 for exact tests
    dtype = _compute_dtype(weights if q_idx.dtype in FP8_DTYPES else q_idx)
    # [B, Tq, HI, S]: one relu'd logit per indexer head
    logits = torch.einsum("bthd,bsd->bths", q_idx.to(dtype), k_idx.to(dtype)).relu()
    scores = (logits * weights.to(dtype)[..., None]).sum(2)
    return scores if k_scale is None else scores * k_scale.to(dtype)[:, None, :]


def _check_k_scale(q_idx: Tensor, k_idx: Tensor, k_scale: Tensor | None) -> None:
    """fp8 index inputs come with k_scale [B, S] (positive, fp32), 16/32-bit ones without."""
    fp8 = k_idx.dtype in FP8_DTYPES
    _check(
        (q_idx.dtype in FP8_DTYPES) == fp8,
        f"q_idx and k_idx must both be float8_e4m3fn or neither, got {q_idx.dtype} and {k_idx.dtype}",
    )
    if not fp8:
        _check(k_scale is None, "k_scale: only for float8_e4m3fn q_idx / k_idx (see indexer_fp8_inputs)")
        return
    _check(
        k_scale is not None,
        "k_scale: float8_e4m3fn k_idx needs its per-key scales [B, S] (indexer_fp8_inputs makes both)",
    )
    _check(
        tuple(k_scale.shape) == tuple(k_idx.shape[:2]) and k_scale.dtype == torch.float32,
        f"k_scale must be fp32 [B, S] = {list(k_idx.shape[:2])}, got {k_scale.dtype} {list(k_scale.shape)}",
    )
    _check(k_scale.device == k_idx.device, f"k_scale must be on k_idx's device {k_idx.device}, got {k_scale.device}")


def hadamard_rotate(x: Tensor) -> Tensor:
    """x [..., D] times the orthonormal Walsh-Hadamard matrix H_D / sqrt(D) (D a power of 2):
    dot products are kept (H orthogonal), while a few large channels spread over all D, so a
    row quantizes to fp8 with less error (DeepSeek-V3.2's rotate_activation before fp8_index).
    The product runs in x's dtype (16-bit rows on tensor cores, accumulated in fp32): every
    entry of H has one magnitude, so rounding it to 16 bits only scales H by a number within
    2^-9 of 1."""
    D = x.shape[-1]
    _check(D > 0 and D & (D - 1) == 0, f"hadamard_rotate: the last dim must be a power of 2, got {D}")
    return x @ _hadamard(D, x.device, x.dtype)


@functools.lru_cache(maxsize=16)
def _hadamard(D: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """H_D / sqrt(D) by Sylvester's construction (entries +-1 / sqrt(D)), made once per device."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * D**-0.5).to(device=device, dtype=dtype)


def quantize_fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (x8 float8_e4m3fn [..., D], scale fp32 [...]) with x ~ x8 * scale.

    scale is the power of two 2^ceil(log2(amax / 448)) of each row, so x / scale is exact and
    every row lands in fp8's top range (|x8| <= 448, 3 mantissa bits: about 6% relative error
    at worst, half that on average); an all-zero row gets scale 1. The division runs in x's
    dtype where its exponent range holds every scale (bf16, fp32, fp64: exact, no fp32 copy of
    x), else in fp32."""
    x = x.detach()
    amax = x.abs().amax(-1).float()
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    if x.dtype not in (torch.bfloat16, torch.float32, torch.float64):
        x = x.float()
    x8 = (x / scale.to(x.dtype)[..., None]).to(torch.float8_e4m3fn)
    return x8, scale


def indexer_fp8_inputs(
    q_idx: Tensor, k_idx: Tensor, weights: Tensor, rotate: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The indexer's inputs for fp8 scoring (DeepSeek-V3.2's fp8_index), no gradient:
    q_idx [B, T, HI, DI], k_idx [B, S, DI], weights [B, T, HI] ->
    (q8 [B, T, HI, DI], k8 [B, S, DI] float8_e4m3fn, weights * q_scale fp32 [B, T, HI],
    k_scale fp32 [B, S]), each row of q and k rotated (hadamard_rotate, when rotate) and
    quantized with its own power-of-two scale. Since relu(a x) = a relu(x) for a > 0,

        k_scale[s] * sum_j (w q_scale)[t, j] relu(q8[t, j] . k8[s])

    is the index score of the dequantized rows: lightning_indexer_topk(q8, k8, w8, ...,
    k_scale=k_scale) selects by it, its products on fp8 tensor cores on a GPU."""
    _check_indexer_args(q_idx, k_idx, weights)
    if rotate:
        q_idx, k_idx = hadamard_rotate(q_idx.detach()), hadamard_rotate(k_idx.detach())
    q8, q_scale = quantize_fp8_rows(q_idx)
    k8, k_scale = quantize_fp8_rows(k_idx)
    return q8, k8, weights.detach().float() * q_scale, k_scale


def lightning_indexer(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    causal: bool = True,
    cu_seqlens: Tensor | None = None,
    q_positions: Tensor | None = None,
    k_scale: Tensor | None = None,
) -> Tensor:
    """Index scores I[b, t, s] = sum_j weights[b, t, j] * relu(q_idx[b, t, j] . k_idx[b, s]).

    q_idx [B, T, HI, DI], k_idx [B, S, DI], weights [B, T, HI] -> [B, T, S] fp32, -inf where
    query t may not read key s (s > q_positions[t] when causal; another sequence when
    cu_seqlens [N + 1] over the S keys). q_positions [T]: None means arange(T) with T == S.
    float8_e4m3fn q_idx and k_idx (indexer_fp8_inputs) come with k_scale [B, S]: I is then
    k_scale[b, s] times the sum above.
    """
    B, T, S = _check_indexer_args(q_idx, k_idx, weights)
    _check_k_scale(q_idx, k_idx, k_scale)
    q_pos = _query_positions(q_positions, T, S, q_idx.device)
    seg = _segment_ids(cu_seqlens, B, S)
    scores = _index_scores(q_idx, k_idx, weights, k_scale)  # [B, T, S]
    return scores.masked_fill(~_key_mask(q_pos, S, causal, seg), NEG_INF)


def lightning_indexer_sparse(
    q_idx: Tensor, k_idx: Tensor, weights: Tensor, indices: Tensor
) -> Tensor:
    """The index scores at the selected keys only: [B, T, K], -inf where indices == -1.

    Equals lightning_indexer(...).gather(-1, indices) without building [B, T, S]; used for the
    sparse-stage KL loss, where only the selected keys matter. k_idx [B, S, DI], indices
    [B, T, K] in [-1, S).
    """
    B, T, S = _check_indexer_args(q_idx, k_idx, weights)
    _check_indices(indices, B, T, S)
    dtype = _compute_dtype(q_idx)
    k_sel = _select_keys(k_idx, indices)  # [B, T, K, DI]
    # [B, T, HI, K]
    logits = torch.einsum("bthd,btkd->bthk", q_idx.to(dtype), k_sel.to(dtype)).relu()
    scores = (logits * weights.to(dtype)[..., None]).sum(2)  # [B, T, K]
    return scores.masked_fill(indices < 0, NEG_INF)


def topk_indices(scores: Tensor, topk: int) -> Tensor:
    """Keys with the topk highest finite scores per query: [B, T, S] -> [B, T, topk] int64.

    Ordered by descending score; equal scores go to the lower key index (a stable sort, so
    every backend agrees). Where fewer than topk scores are finite the tail is -1.
    """
    B, T, S = _shape(scores, "scores", "[B, T, S]")
    _check_topk(topk)
    num_kept = min(topk, S)
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, indices = values[..., :num_kept], indices[..., :num_kept]
    indices = indices.masked_fill(values == NEG_INF, -1)
    if num_kept < topk:
        pad = indices.new_full((B, T, topk - num_kept), -1)
        indices = torch.cat([indices, pad], dim=-1)
    return indices


@torch.no_grad()
def indexer_topk(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    topk: int,
    block_size: int = 256,
    causal: bool = True,
    cu_seqlens: Tensor | None = None,
    q_positions: Tensor | None = None,
    k_scale: Tensor | None = None,
) -> Tensor:
    """topk_indices(lightning_indexer(...), topk), computed block_size queries at a time.

    Only [B, block_size, HI, S] scores are alive at once instead of [B, T, HI, S]. Returns
    [B, T, topk] int64 key indices in [-1, S) (no gradient: selection is not differentiable).
    q_positions and k_scale (fp8 inputs) as in lightning_indexer.
    """
    B, T, S = _check_indexer_args(q_idx, k_idx, weights)
    _check_k_scale(q_idx, k_idx, k_scale)
    _check_topk(topk)
    check_query_block(block_size)
    return _select(q_idx, k_idx, weights, topk, block_size, None, causal, cu_seqlens, q_positions, k_scale)


def check_query_block(block_size) -> None:
    _check(
        isinstance(block_size, int) and block_size > 0,
        f"block_size must be a positive int (queries per block), got {block_size!r}",
    )


def _select(q_idx, k_idx, weights, topk, query_block, key_block, causal, cu_seqlens, q_positions,
            k_scale=None) -> Tensor:
    """indexer_topk / lightning_indexer_topk: masked scores query_block queries at a time, then
    token mode (key_block None) or block mode -> [B, T, topk] int64."""
    B, T, S = q_idx.shape[0], q_idx.shape[1], k_idx.shape[1]
    q_pos = _query_positions(q_positions, T, S, q_idx.device)
    seg = _segment_ids(cu_seqlens, B, S)
    blocks = []
    for t0 in range(0, T, query_block):
        t1 = min(t0 + query_block, T)
        scores = _index_scores(q_idx[:, t0:t1], k_idx, weights[:, t0:t1], k_scale)  # [B, t1 - t0, S]
        scores = scores.masked_fill(~_key_mask(q_pos[t0:t1], S, causal, seg), NEG_INF)
        if key_block is None:
            blocks.append(topk_indices(scores, topk))
        else:
            blocks.append(_block_topk(scores, topk, key_block))
    return torch.cat(blocks, dim=1) if blocks else q_idx.new_empty((B, 0, topk), dtype=torch.int64)


def _block_topk(scores: Tensor, topk: int, block_size: int) -> Tensor:
    """Block mode of lightning_indexer_topk on [B, Tc, S] masked scores -> [B, Tc, topk] int64."""
    B, Tc, S = scores.shape
    nb = -(-S // block_size)
    padded = torch.nn.functional.pad(scores, (0, nb * block_size - S), value=NEG_INF)
    blocks = padded.view(B, Tc, nb, block_size)
    # A block scores its best key; equal blocks go to the lower one (a stable sort).
    order = torch.sort(blocks.amax(-1), dim=-1, descending=True, stable=True).indices
    chosen = order[..., : min(-(-topk // block_size), nb)].sort(-1).values  # ascending keys
    key = chosen[..., None] * block_size + torch.arange(block_size, device=scores.device)
    key = key.flatten(2)  # [B, Tc, chosen keys], ascending
    in_range = key < S
    picked = padded.view(B, Tc, -1).gather(-1, key).masked_fill(~in_range, NEG_INF)
    values, order = torch.sort(picked, dim=-1, descending=True, stable=True)
    kept = min(topk, key.shape[-1])
    index = key.gather(-1, order[..., :kept]).masked_fill(values[..., :kept] == NEG_INF, -1)
    if kept < topk:
        index = torch.cat([index, index.new_full((B, Tc, topk - kept), -1)], dim=-1)
    return index


def _check_selection_args(q_idx, k_idx, weights, topk, block_size) -> tuple[int, int, int]:
    """lightning_indexer_topk's argument checks (every backend): B, T, S."""
    B, T, S = _check_indexer_args(q_idx, k_idx, weights)
    _check_topk(topk)
    _check(
        block_size is None or (isinstance(block_size, int) and block_size > 0),
        f"block_size must be None (token mode) or a positive int (keys per block), got {block_size!r}",
    )
    return B, T, S


@torch.no_grad()
def lightning_indexer_topk(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    topk: int,
    cu_seqlens: Tensor | None = None,
    block_size: int | None = None,
    causal: bool = True,
    q_positions: Tensor | None = None,
    k_scale: Tensor | None = None,
) -> Tensor:
    """The indexer's key selection: int32 [B, T, topk] key indices in [-1, S), -1 padded.

    q_idx [B, T, HI, DI], k_idx [B, S, DI] (one key head shared by all indexer heads),
    weights [B, T, HI]; masks as in lightning_indexer. Token mode (block_size None): the topk
    highest scores among the keys query t may read, in descending order, equal scores to the
    lower key index (topk_indices' rule). Block mode (block_size = bs): keys form blocks
    [i bs, (i + 1) bs); each block scores its best key, the ceil(topk / bs) best blocks are
    kept (equal blocks: the lower one), and the topk best readable keys inside them are
    returned in the same order. No gradient: selection is not differentiable. This
    reference scores 256 queries at a time; the Triton backend never holds the per-head
    [T, HI, S] logits and works through the queries in memory-bounded chunks. fp8 scoring:
    float8_e4m3fn q_idx and k_idx with k_scale [B, S], from indexer_fp8_inputs (the scores
    as in lightning_indexer).
    """
    _check_selection_args(q_idx, k_idx, weights, topk, block_size)
    _check_k_scale(q_idx, k_idx, k_scale)
    return _select(
        q_idx, k_idx, weights, topk, 256, block_size, causal, cu_seqlens, q_positions, k_scale
    ).to(torch.int32)


def _select_keys(x: Tensor, indices: Tensor) -> Tensor:
    """x [B, S, *] rows picked by indices [B, T, K] (-1 reads row 0; callers mask it) -> [B, T, K, *].

    index_select on the flattened rows: its backward is one index_add, where advanced
    indexing's backward sorts every (query, slot) pair first (seconds on a GPU at 8k x 2048).
    """
    B, S = x.shape[:2]
    if S == 0:  # no keys: every slot is -1 (the range check), and callers mask what this reads
        return x.new_zeros((*indices.shape, *x.shape[2:])) + 0 * x.sum()
    rows = (indices.clamp(min=0) + torch.arange(B, device=x.device)[:, None, None] * S).reshape(-1)
    return x.reshape(B * S, *x.shape[2:]).index_select(0, rows).view(*indices.shape, *x.shape[2:])


# id -> (weak reference, version, S) of index tensors known valid over S keys: in [-1, S), no key
# twice in a row (lightning_indexer_topk's selections)
_VALID: dict[int, tuple] = {}


def mark_valid_indices(indices: Tensor, num_keys: int) -> Tensor:
    """Records that indices [B, T, K] lie in [-1, num_keys) and repeat no key within a row, as
    lightning_indexer_topk's selections do, so that the fused ops skip their checks of them (the
    range's host read, the rows' sort, the backward's repeated-key read). A write in place (the
    version counter) voids the mark; none is kept for inference-mode tensors. Returns indices."""
    try:
        version = indices._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        return indices
    key = id(indices)
    _VALID[key] = (weakref.ref(indices, lambda _, key=key: _VALID.pop(key, None)), version, num_keys)
    return indices


def known_valid_indices(indices: Tensor, num_keys: int) -> bool:
    """mark_valid_indices was called on this tensor for at most num_keys keys, and it has not been
    written since."""
    entry = _VALID.get(id(indices))
    if entry is None or entry[0]() is not indices or entry[2] > num_keys:
        return False
    try:
        return indices._version == entry[1]
    except RuntimeError:
        return False


def _check_indices(indices: Tensor, B: int, T: int, S: int) -> None:
    _B, _T, _K = _shape(indices, "indices", "[B, T, K]")
    _check(
        (_B, _T) == (B, T) and indices.dtype in (torch.int64, torch.int32),
        f"indices must be int64/int32 [B, T, K] with B={B}, T={T}, got {indices.dtype} "
        f"{tuple(indices.shape)}",
    )
    _check(
        bool(((indices >= -1) & (indices < S)).all()),
        f"indices must lie in [-1, S={S}) (-1 marks an unused slot)",
    )
    # A repeated key would be counted twice by the gather but once by a mask.
    ordered = indices.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    _check(not bool(repeated.any()), "indices must not repeat a key within one query's row")


def _check_scale(scale) -> None:
    """scale: None (D ** -0.5) or a finite positive number."""
    _check(
        scale is None or positive_finite(scale),
        f"scale must be None (D ** -0.5) or a finite positive number, got {scale!r}",
    )


def _check_attention_args(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, ...]:
    B, T, H, D = _shape(q, "q", "[B, T, H, D]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(x.is_floating_point(), f"{name} must be a floating-point tensor, got {x.dtype}")
    _, S, G, _ = _shape(k, "k", "[B, S, G, D]")
    _check(
        tuple(k.shape) == (B, S, G, D) and G > 0 and H % G == 0,
        f"k must be [B, S, G, D] = [{B}, S, G, {D}] with H={H} divisible by G, got "
        f"{tuple(k.shape)}",
    )
    _check(
        v.dim() == 4 and tuple(v.shape[:3]) == (B, S, G),
        f"v must be [B, S, G, DV] = [{B}, {S}, {G}, DV], got {tuple(v.shape)}",
    )
    return B, T, S, H, G, D


def _grouped_scores_dense(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """[B, T, G, R, S] fp32 logits of every query head against every key of its group."""
    B, T, S, H, G, D = _check_attention_args(q, k, k)
    dtype = _compute_dtype(q)
    q_g = q.reshape(B, T, G, H // G, D).to(dtype)
    return torch.einsum("btgrd,bsgd->btgrs", q_g, k.to(dtype)) * scale


def _grouped_scores_sparse(q: Tensor, k: Tensor, indices: Tensor, scale: float) -> Tensor:
    """[B, T, G, R, K] fp32 logits against the gathered keys; -inf in the -1 slots."""
    B, T, S, H, G, D = _check_attention_args(q, k, k)
    dtype = _compute_dtype(q)
    q_g = q.reshape(B, T, G, H // G, D).to(dtype)
    k_sel = _select_keys(k, indices)  # [B, T, K, G, D]
    scores = torch.einsum("btgrd,btkgd->btgrk", q_g, k_sel.to(dtype)) * scale
    return scores.masked_fill((indices < 0)[:, :, None, None, :], NEG_INF)


def _softmax_lse(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim that leaves a row with no readable key at p = 0, lse = -inf."""
    lse = torch.logsumexp(scores, dim=-1)  # [..., ]
    probs = torch.exp(scores - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])
    return probs, lse


def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Each query attends only to the keys in its row of indices (gathered, no dense mask).

    q [B, T, H, D], k [B, S, G, D], v [B, S, G, DV], indices [B, T, K] in [-1, S) (-1 = unused
    slot; the op does not add causality, the indexer already did) -> o [B, T, H, DV] in q's
    dtype and lse [B, T, H] fp32. A query with no key gets o = 0, lse = -inf.
    """
    B, T, S, H, G, D = _check_attention_args(q, k, v)
    _check_indices(indices, B, T, S)
    _check_scale(scale)
    scale = D**-0.5 if scale is None else scale
    probs, lse = _softmax_lse(_grouped_scores_sparse(q, k, indices, scale))  # [B, T, G, R, K]
    v_sel = _select_keys(v, indices)  # [B, T, K, G, DV]
    o = torch.einsum("btgrk,btkgd->btgrd", probs, v_sel.to(probs.dtype))
    return o.reshape(B, T, H, v.shape[-1]).to(q.dtype), lse.reshape(B, T, H)


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None):
    B, T, S, H, G, D = _check_attention_args(q, k, v)
    scale = D**-0.5 if scale is None else scale
    scores = _grouped_scores_dense(q, k, scale)  # [B, T, G, R, S]
    probs, lse = _softmax_lse(scores.masked_fill(~mask[:, :, None, None, :], NEG_INF))
    o = torch.einsum("btgrs,bsgd->btgrd", probs, v.to(probs.dtype))
    return o.reshape(B, T, H, v.shape[-1]).to(q.dtype), lse.reshape(B, T, H)


def indices_to_mask(indices: Tensor, S: int) -> Tensor:
    """[B, T, K] indices -> [B, T, S] bool, True at the selected keys."""
    B, T, K = _shape(indices, "indices", "[B, T, K]")
    # Unused slots write into an extra column S that is dropped, so they never clear a key.
    mask = torch.zeros(B, T, S + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(-1, torch.where(indices >= 0, indices, S).to(torch.int64), True)
    return mask[..., :S]


def dense_masked_attention(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """sparse_attention computed densely over [B, T, S], the selection as a mask: the oracle."""
    B, T, S, H, G, D = _check_attention_args(q, k, v)
    _check_indices(indices, B, T, S)
    return _masked_attention(q, k, v, indices_to_mask(indices, S), scale)


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    cu_seqlens: Tensor | None = None,
    scale: float | None = None,
    q_positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Full (causal, optionally packed) GQA attention: the dense warm-up stage's main attention.

    q [B, T, H, D], k [B, S, G, D], v [B, S, G, DV]; masks as in lightning_indexer.
    """
    B, T, S, H, G, D = _check_attention_args(q, k, v)
    q_pos = _query_positions(q_positions, T, S, q.device)
    seg = _segment_ids(cu_seqlens, B, S)
    mask = _key_mask(q_pos, S, causal, seg).expand(B, T, S)
    return _masked_attention(q, k, v, mask, scale)


@torch.no_grad()
def attention_probs_target(
    q: Tensor,
    k: Tensor,
    indices: Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    cu_seqlens: Tensor | None = None,
    q_positions: Tensor | None = None,
) -> Tensor:
    """The indexer's KL target p: main attention probabilities summed over heads, L1-normalised.

    q [B, T, H, D], k [B, S, G, D].
    indices None (dense warm-up): softmax over every readable key -> [B, T, S] (masks as in
    lightning_indexer, with q_positions and cu_seqlens over the S keys).
    indices [B, T, K] (sparse stage): softmax over the selected keys -> [B, T, K], aligned with
    indices, 0 in the -1 slots. Detached: the loss trains the indexer, not the main attention.
    """
    B, T, S, H, G, D = _check_attention_args(q, k, k)
    scale = D**-0.5 if scale is None else scale
    if indices is None:
        q_pos = _query_positions(q_positions, T, S, q.device)
        seg = _segment_ids(cu_seqlens, B, S)
        mask = _key_mask(q_pos, S, causal, seg)  # [T, S]
        scores = _grouped_scores_dense(q, k, scale).masked_fill(~mask[:, None, None, :], NEG_INF)
    else:
        _check_indices(indices, B, T, S)
        scores = _grouped_scores_sparse(q, k, indices, scale)
    probs = _softmax_lse(scores)[0].sum(dim=(2, 3))  # [B, T, S or K]
    return probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)


def _valid_queries(index_scores: Tensor, target: Tensor) -> Tensor:
    """[B, T] bool: the query has a readable key and some target mass (it counts in the mean)."""
    # ~(sum <= 0), not sum > 0: a NaN target keeps its query, so the NaN reaches the loss instead of
    # the query silently leaving the mean
    return ~(target.sum(-1) <= 0) & (index_scores > NEG_INF).any(-1)


@torch.no_grad()
def indexer_kl_valid_queries(
    index_scores: Tensor, attn_probs_target: Tensor, indices: Tensor | None = None
) -> Tensor:
    """[B, T] bool: the queries indexer_kl_loss averages over (same arguments)."""
    if indices is not None:
        index_scores = index_scores.masked_fill(indices < 0, NEG_INF)
        attn_probs_target = attn_probs_target.masked_fill(indices < 0, 0.0)
    return _valid_queries(index_scores, attn_probs_target)


def indexer_kl_loss(
    index_scores: Tensor, attn_probs_target: Tensor, indices: Tensor | None = None
) -> Tensor:
    """Mean over queries of KL(p[t] || softmax(index_scores[t])): the indexer training loss.

    Dense warm-up (indices None): index_scores [B, T, S] with -inf at unreadable keys, target
    [B, T, S]. Sparse stage: index_scores and target both restricted to the selection,
    [B, T, K] aligned with indices [B, T, K] (lightning_indexer_sparse and
    attention_probs_target(..., indices) give exactly these); the -1 slots are ignored. The
    target is detached and L1-normalised here; queries with no key or an all-zero target are
    left out of the mean (indexer_kl_valid_queries says which count). Under context
    parallelism a rank's T queries are a subset of all: scale by its share of the valid queries.
    """
    kl_sum, valid_query = indexer_kl_sum(index_scores, attn_probs_target, indices)
    return kl_sum / valid_query.sum().clamp_min(1)


def indexer_kl_sum(
    index_scores: Tensor, attn_probs_target: Tensor, indices: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """indexer_kl_loss before the mean: (the KL summed over the valid queries, valid [B, T]
    bool, what indexer_kl_valid_queries gives). Chunks of queries add their sums and counts."""
    B, T, X = _shape(index_scores, "index_scores", "[B, T, S or K]")
    _check(
        tuple(attn_probs_target.shape) == (B, T, X),
        f"attn_probs_target must match index_scores {(B, T, X)}, got "
        f"{tuple(attn_probs_target.shape)}",
    )
    if indices is not None:
        _check(
            tuple(indices.shape) == (B, T, X),
            f"indices must be [B, T, K] = {(B, T, X)} like the restricted index_scores (gather "
            f"full [B, T, S] scores with lightning_indexer_sparse first), got "
            f"{tuple(indices.shape)}",
        )
        index_scores = index_scores.masked_fill(indices < 0, NEG_INF)
        attn_probs_target = attn_probs_target.masked_fill(indices < 0, 0.0)
    dtype = _compute_dtype(index_scores)
    p = attn_probs_target.detach().to(dtype)
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    valid_query = _valid_queries(index_scores, p)  # [B, T]
    # Rows left out get finite dummy logits so their log_softmax (and its gradient) is not NaN.
    log_q = torch.log_softmax(index_scores.to(dtype).masked_fill(~valid_query[..., None], 0.0), -1)
    kl = torch.where(p != 0, p * (p.log() - log_q), 0.0).sum(-1)  # [B, T]; p != 0: a NaN p stays NaN
    return torch.where(valid_query, kl, 0.0).sum(), valid_query
