"""Top-k sparse attention (DeepSeek-V3.2 DSA): public ops with a backend choice.

Shape legend: B batch, T tokens (queries), S keys (== T unless q_positions [T] places the
queries among the keys, as under context parallelism), H query heads, G kv groups, D head
dim, DV value head dim, HI / DI indexer heads / head dim, K top-k. Layout [B, T, H, D].

Each public function takes backend="auto" | a registered name. Backends live in a small
registry (name -> SparseAttentionBackend): "torch" (reference.py) implements every op;
"triton" (when triton is installed) implements sparse_attention (triton_sparse.py) and the
indexer's fused scoring + top-k, lightning_indexer_topk and indexer_topk, and the scores at
the selected keys, lightning_indexer_sparse (triton_indexer.py), for bf16/fp16 CUDA tensors. "auto" takes the first registered backend of _AUTO_ORDER that implements the op
and whose supports(op, x) accepts the op's first tensor; a CUDA call that a fused backend
declines is logged once before it runs on the torch reference.
"""

import bisect
import functools
import importlib.util
import inspect
import logging
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch
import torch.utils.checkpoint
from torch import Tensor

from . import reference
from .reference import (
    dense_attention,
    dense_masked_attention,
    hadamard_rotate,
    indexer_fp8_inputs,
    indexer_kl_valid_queries,
    indices_to_mask,
    mark_valid_indices,
    positions_from_cu_seqlens,
    quantize_fp8_rows,
)


@dataclass(frozen=True)
class SparseAttentionBackend:
    """One backend's implementations; None means the op is not provided (auto falls through)."""

    name: str
    apply_rope: Optional[Callable[..., Tensor]] = None
    lightning_indexer: Optional[Callable[..., Tensor]] = None
    lightning_indexer_sparse: Optional[Callable[..., Tensor]] = None
    topk_indices: Optional[Callable[..., Tensor]] = None
    indexer_topk: Optional[Callable[..., Tensor]] = None
    lightning_indexer_topk: Optional[Callable[..., Tensor]] = None
    sparse_attention: Optional[Callable[..., tuple[Tensor, Tensor]]] = None
    attention_probs_target: Optional[Callable[..., Tensor]] = None
    indexer_kl_loss: Optional[Callable[..., Tensor]] = None
    # supports(op, x): whether auto may send op with first tensor x here; None: any input
    supports: Callable[[str, Tensor], bool] | None = None


logger = logging.getLogger(__name__)
OPS = tuple(f.name for f in fields(SparseAttentionBackend) if f.name not in ("name", "supports"))
_BACKENDS: dict[str, SparseAttentionBackend] = {}
# Fast backends first; "torch" is always last so that auto can always run.
_AUTO_ORDER = ("cuda", "triton", "torch")


def register_backend(backend: SparseAttentionBackend) -> None:
    _BACKENDS[backend.name] = backend


def registered_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


_fallback_logged: set[str] = set()


def get_op(op: str, backend: str = "auto", x: Tensor | None = None) -> Callable:
    """The implementation of op in backend; ValueError naming what is registered otherwise.

    Under auto, x (the op's first tensor) is offered to each backend's supports(); without x
    only backends with no supports() check are taken.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if backend == "auto":
        declined = []
        for name in _AUTO_ORDER:
            impl = _BACKENDS.get(name)
            fn = getattr(impl, op, None)
            if fn is None:
                continue
            if impl.supports is not None and (x is None or not impl.supports(op, x)):
                declined.append(name)
                continue
            if declined and x is not None and x.is_cuda and op not in _fallback_logged:
                _fallback_logged.add(op)
                logger.warning(
                    "sparse_attention.%s: backend(s) %s do not take %s %s inputs; running %r",
                    op, declined, x.dtype, tuple(x.shape), name,
                )
            return fn
    elif backend in _BACKENDS and getattr(_BACKENDS[backend], op) is not None:
        return getattr(_BACKENDS[backend], op)
    raise ValueError(
        f"backend={backend!r} does not provide sparse_attention.{op}; registered backends: "
        f"{registered_backends()} (or 'auto')"
    )


register_backend(SparseAttentionBackend(name="torch", **{op: getattr(reference, op) for op in OPS}))


def _triton_sparse_attention(q, k, v, indices, scale=None):
    """triton_sparse.sparse_attention_triton, imported on first use (importing stays light)."""
    from .triton_sparse import sparse_attention_triton

    return sparse_attention_triton(q, k, v, indices, scale)


def _triton_lightning_indexer_topk(
    q_idx, k_idx, weights, topk, cu_seqlens=None, block_size=None, causal=True, q_positions=None,
    k_scale=None,
):
    from .triton_indexer import lightning_indexer_topk_triton

    return lightning_indexer_topk_triton(
        q_idx, k_idx, weights, topk, cu_seqlens, block_size, causal, q_positions, k_scale=k_scale
    )


def _triton_lightning_indexer_sparse(q_idx, k_idx, weights, indices):
    from .triton_indexer import lightning_indexer_sparse_triton

    return lightning_indexer_sparse_triton(q_idx, k_idx, weights, indices)


def _triton_indexer_topk(
    q_idx, k_idx, weights, topk, block_size=256, causal=True, cu_seqlens=None, q_positions=None,
    k_scale=None,
):
    """indexer_topk's contract (int64) from the fused kernel; block_size (the reference's
    queries per block) is checked but not needed: the kernel bounds its memory itself."""
    reference.check_query_block(block_size)
    return _triton_lightning_indexer_topk(
        q_idx, k_idx, weights, topk, cu_seqlens, None, causal, q_positions, k_scale
    ).long()


_FP8_OPS = ("lightning_indexer_topk", "indexer_topk")  # the ops taking float8_e4m3fn rows


def _triton_supports(op: str, x: Tensor) -> bool:
    """What auto sends to Triton: bf16/fp16 CUDA tensors, and the indexer's selection on
    float8_e4m3fn ones. CPU tensors stay on the reference (backend="triton" runs them in
    Triton's interpreter, fp32 / fp16 / fp8 only, for tests), and so do fp32 CUDA tensors,
    which the kernels refuse (their tiles are sized for 16-bit operands)."""
    dtypes = (torch.bfloat16, torch.float16) + (reference.FP8_DTYPES if op in _FP8_OPS else ())
    return x.is_cuda and x.dtype in dtypes and x.shape[-1] <= 1024


if importlib.util.find_spec("triton") is not None:
    register_backend(
        SparseAttentionBackend(
            name="triton",
            sparse_attention=_triton_sparse_attention,
            lightning_indexer_topk=_triton_lightning_indexer_topk,
            indexer_topk=_triton_indexer_topk,
            lightning_indexer_sparse=_triton_lightning_indexer_sparse,
            supports=_triton_supports,
        )
    )


def apply_rope(
    x: Tensor, positions: Tensor, rope_dim: int, base: float = 10000.0, backend: str = "auto"
) -> Tensor:
    return get_op("apply_rope", backend)(x, positions, rope_dim, base)


def lightning_indexer(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    causal: bool = True,
    cu_seqlens: Optional[Tensor] = None,
    backend: str = "auto",
    q_positions: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
) -> Tensor:
    return get_op("lightning_indexer", backend)(
        q_idx, k_idx, weights, causal, cu_seqlens, q_positions=q_positions, k_scale=k_scale
    )


def lightning_indexer_sparse(
    q_idx: Tensor, k_idx: Tensor, weights: Tensor, indices: Tensor, backend: str = "auto"
) -> Tensor:
    return get_op("lightning_indexer_sparse", backend, q_idx)(q_idx, k_idx, weights, indices)


def topk_indices(scores: Tensor, topk: int, backend: str = "auto") -> Tensor:
    return get_op("topk_indices", backend)(scores, topk)


def indexer_topk(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    topk: int,
    block_size: int = 256,
    causal: bool = True,
    cu_seqlens: Optional[Tensor] = None,
    backend: str = "auto",
    q_positions: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    fp8: bool = False,
) -> Tensor:
    q_idx, k_idx, weights, k_scale = _fp8_selection_inputs(q_idx, k_idx, weights, k_scale, fp8)
    return get_op("indexer_topk", backend, q_idx)(
        q_idx, k_idx, weights, topk, block_size, causal, cu_seqlens, q_positions=q_positions,
        k_scale=k_scale,
    )


def _fp8_selection_inputs(q_idx, k_idx, weights, k_scale, fp8: bool):
    """fp8=True: the inputs rotated and quantized for fp8 scoring (indexer_fp8_inputs)."""
    if not fp8:
        return q_idx, k_idx, weights, k_scale
    reference._check(
        k_scale is None and q_idx.dtype not in reference.FP8_DTYPES,
        "fp8=True quantizes 16/32-bit q_idx / k_idx itself; already-quantized inputs go with k_scale "
        "and fp8=False",
    )
    return indexer_fp8_inputs(q_idx, k_idx, weights)


def lightning_indexer_topk(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    topk: int,
    cu_seqlens: Optional[Tensor] = None,
    block_size: Optional[int] = None,
    causal: bool = True,
    q_positions: Optional[Tensor] = None,
    backend: str = "auto",
    k_scale: Optional[Tensor] = None,
    fp8: bool = False,
) -> Tensor:
    """The indexer's key selection (reference.lightning_indexer_topk). fp8 scoring
    (DeepSeek-V3.2's): fp8=True rotates and quantizes 16/32-bit inputs itself
    (indexer_fp8_inputs); or pass its q8, k8, scaled weights and k_scale."""
    q_idx, k_idx, weights, k_scale = _fp8_selection_inputs(q_idx, k_idx, weights, k_scale, fp8)
    indices = get_op("lightning_indexer_topk", backend, q_idx)(
        q_idx, k_idx, weights, topk, cu_seqlens, block_size, causal, q_positions, k_scale=k_scale
    )
    return reference.mark_valid_indices(indices, k_idx.shape[1])  # the fused ops then skip their checks of it


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    scale: Optional[float] = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    reference._check_scale(scale)
    return get_op("sparse_attention", backend, q)(q, k, v, indices, scale)


CAUSAL_ATTENTION_BACKENDS = ("auto", "varlen", "sdpa", "torch")


@functools.lru_cache(maxsize=1)
def _varlen_api():
    """torch's varlen flash attention (torch.nn.attention.varlen.varlen_attn, torch >= 2.10) and
    the keywords this torch takes, or None where it has none. torch 2.10 took is_causal; later
    ones take window_size=(-1, 0) for causal, scale and enable_gqa."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "scale" in params, "enable_gqa" in params


def varlen_unsupported(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None) -> Optional[str]:
    """Why the varlen (flash) backend cannot take these tensors, or None where it can: bf16 or
    fp16 CUDA tensors, one head dim for q, k and v, a multiple of 8 up to 256 (the flash kernel's),
    and a torch that has varlen_attn (with a scale argument where one is given)."""
    api = _varlen_api()
    if api is None:
        return f"this torch ({torch.__version__}) has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return "it runs on CUDA tensors only"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"it takes bf16 or fp16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    D = q.shape[-1]
    if k.shape[-1] != D or v.shape[-1] != D or D % 8 or D > 256:
        return f"it takes one head dim for q, k and v, a multiple of 8 up to 256, got {D}, {k.shape[-1]}, {v.shape[-1]}"
    if scale is not None and not api[2]:
        return f"this torch's varlen_attn ({torch.__version__}) takes no scale"
    return None


def _query_runs(q_ranges, T: int, S: int) -> list[tuple[int, int]]:
    """The global [start, end) of each run of consecutive query positions, in q's row order."""
    if q_ranges is None:
        if T != S:
            raise ValueError(
                f"k: causal_attention needs as many keys as queries (T={T}), got S={S}; "
                "queries placed among more keys need q_ranges"
            )
        return [(0, T)] if T else []
    runs = [(int(a), int(b)) for a, b in q_ranges]
    bad = [(a, b) for a, b in runs if not 0 <= a <= b <= S]
    if bad or sum(b - a for a, b in runs) != T:
        raise ValueError(
            f"q_ranges: {runs} must be [start, end) ranges within the {S} keys whose lengths sum to "
            f"the {T} queries" + (f"; {bad} are not" if bad else "")
        )
    return [(a, b) for a, b in runs if b > a]


def _pieces(runs, offsets: Optional[list], S: int) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """For each run of queries [a, b), its first row in q and the pieces it splits into, one per
    packed sequence it overlaps: (lo, hi, st), the queries [lo, hi) reading keys [st, hi) (a query
    at p reads its sequence's keys up to p: causal, aligned to the window's end). The pieces'
    key windows of a run follow one another: together they are the keys [first st, b)."""
    bounds = offsets if offsets is not None else [0, S]
    out, row = [], 0
    for a, b in runs:
        i = bisect.bisect_right(bounds, a) - 1  # the sequence holding position a
        pieces = []
        while i < len(bounds) - 1 and bounds[i] < b:
            lo, hi = max(a, bounds[i]), min(b, bounds[i + 1])
            if hi > lo:
                pieces.append((lo, hi, bounds[i]))
            i += 1
        out.append((row, pieces))
        row += b - a
    return out


def _sdpa_piece(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float]) -> Tensor:
    """SDPA over [B, Lq, H, D] queries that are the last Lq of the Lk keys [B, Lk, G, D]: causal
    from the window's end (flash / cuDNN / memory-efficient kernels on CUDA)."""
    Lq, Lk, H, G = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if Lq == Lk:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=G != H)
    else:  # queries end at the keys' end: torch's lower-right causal mask, each query head its group's keys
        from torch.nn.attention.bias import causal_lower_right

        k, v = (x.repeat_interleave(H // G, dim=1) for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Lq, Lk), scale=scale)
    return o.transpose(1, 2)  # [B, Lq, H, DV]


@functools.lru_cache(maxsize=32)
def _varlen_offsets(q_lens: tuple, k_lens: tuple, device) -> Tensor:
    """[2, N + 1] int32 query and key offsets of varlen's sequences on device, made once per
    lengths (a step's layers share them; a CP rank's unpacked runs are the same every step) and
    copied from pinned memory, so the copy waits for nothing the stream runs (no host sync)."""
    cu = torch.tensor([[0, *q_lens], [0, *k_lens]], dtype=torch.int32).cumsum(1, dtype=torch.int32)
    return cu.pin_memory().to(device, non_blocking=True)


def _varlen_run(q, k, v, row, a, b, pieces, scale) -> Tensor:
    """One run's queries [a, b) (q's rows from row) in one varlen call: its pieces as sequences."""
    varlen_attn, causal, _, takes_gqa = _varlen_api()
    B, _, H, _ = q.shape
    G, L = k.shape[2], b - a
    if B == 1:
        st = pieces[0][2]
        qf, kf, vf = q[0, row : row + L], k[0, st:b], v[0, st:b]
        q_lens, k_lens = [hi - lo for lo, hi, _ in pieces], [hi - s for _, hi, s in pieces]
    else:  # a batch of unpacked rows: each its own sequence
        qf, kf, vf = q[:, row : row + L].flatten(0, 1), k[:, :b].flatten(0, 1), v[:, :b].flatten(0, 1)
        q_lens, k_lens = [L] * B, [b] * B

    cu = _varlen_offsets(tuple(q_lens), tuple(k_lens), q.device)
    if G != H and not takes_gqa:  # an older torch: each query head gets its group's keys
        kf, vf = (x.repeat_interleave(H // G, dim=1) for x in (kf, vf))
    kwargs = dict(causal)
    if scale is not None:
        kwargs["scale"] = scale
    if G != H and takes_gqa:
        kwargs["enable_gqa"] = True
    o = varlen_attn(qf, kf, vf, cu[0], cu[1], max(q_lens), max(k_lens), **kwargs)  # [B L, H, DV]
    return o.unflatten(0, (B, L))


# Where auto runs SDPA once per sequence piece rather than the varlen kernel: where
# heads x head dim x sum(Lq Lk) >= this x the pieces. A loop costs 0.26-0.37 ms per piece
# (launches, autograd, the concatenation), and on long sequences SDPA's kernels ran 1.2-1.3x the
# varlen kernel (torch 2.11 on an H100, bf16; set from a first run of 8k tokens in 5 records,
# 32k in 7 and 16k in 65 chat records; in benchmarks/results/h100/packed_attention.json the rule
# picks the faster form at 4 of 5 shapes, and at the 5-record 8k one the loop is 7% faster).
SEQUENCE_LOOP_WORK_PER_SEQUENCE = 3.6e10


def _sequence_loop_pays(pieces, heads_x_dim: int) -> bool:
    """Whether SDPA once per piece (pieces: _pieces' output) beats one varlen launch per run."""
    work = count = 0
    for _, run in pieces:
        work += sum((hi - lo) * (hi - st) for lo, hi, st in run)
        count += len(run)
    return heads_x_dim * work >= SEQUENCE_LOOP_WORK_PER_SEQUENCE * count


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Optional[Tensor] = None,
    scale: Optional[float] = None,
    backend: str = "auto",
    q_ranges: Optional[list] = None,
) -> Tensor:
    """Full causal GQA attention, q [B, T, H, D], k [B, S, G, D], v [B, S, G, DV] -> [B, T, H, DV];
    with cu_seqlens [N + 1] over the S keys (B == 1) each packed sequence attends within itself.

    q_ranges: where q's rows sit among the keys, as [start, end) runs of consecutive positions in
    row order (a context-parallel rank's pieces of the sequence: a query at p reads keys up to p);
    None: the rows are the keys' positions (T == S).

    Backends, each with memory linear in T except the reference:
    - "varlen": torch's varlen flash kernel, one launch per run of queries, every packed sequence
      in it (varlen_unsupported says what it takes: bf16/fp16 CUDA tensors, D == DV <= 256);
    - "sdpa": torch's scaled_dot_product_attention, once per packed sequence of each run (packed
      offsets read to the host once per tensor);
    - "torch": reference.dense_attention, which holds the [B, T, H, S] scores.
    "auto" takes the reference on the CPU, and on CUDA sdpa except for packed or placed queries
    that the varlen kernel takes and that make too many or too short pieces for a loop over them
    to pay (SEQUENCE_LOOP_WORK_PER_SEQUENCE). Every form computes the same attention.
    """
    if backend not in CAUSAL_ATTENTION_BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(CAUSAL_ATTENTION_BACKENDS)}")
    B, T, S, H, *_ = reference._check_attention_args(q, k, v)
    runs = _query_runs(q_ranges, T, S)
    if backend == "auto" and not q.is_cuda:
        backend = "torch"
    if backend == "torch":
        q_positions = None
        if q_ranges is not None:
            q_positions = torch.cat([torch.arange(a, b) for a, b in runs] or [torch.zeros(0, dtype=torch.int64)])
            q_positions = q_positions.to(q.device)
        return dense_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens, scale=scale, q_positions=q_positions)[0]
    if cu_seqlens is None and q_ranges is None and backend in ("auto", "sdpa"):
        return _sdpa_piece(q, k, v, scale)  # one causal block: no pieces to walk
    offsets = None if cu_seqlens is None else reference.check_cu_seqlens(cu_seqlens, B, S)
    pieces = _pieces(runs, offsets, S)
    why = varlen_unsupported(q, k, v, scale) if backend in ("auto", "varlen") else None
    if backend == "auto":
        backend = "sdpa" if why is not None or _sequence_loop_pays(pieces, H * q.shape[3]) else "varlen"
    if backend == "varlen":
        if why is not None:
            raise ValueError(f"backend: 'varlen' cannot run these inputs: {why}; use 'sdpa' or 'auto'")
        outs = [_varlen_run(q, k, v, row, a, b, run, scale)
                for (row, run), (a, b) in zip(pieces, runs)]  # fmt: skip
    else:
        outs = [
            _sdpa_piece(q[:, row + lo - a : row + hi - a], k[:, st:hi], v[:, st:hi], scale)
            for (row, run), (a, _) in zip(pieces, runs)
            for lo, hi, st in run
        ]
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs, dim=1) if outs else q.new_empty(B, 0, H, v.shape[-1])


def attention_probs_target(
    q: Tensor,
    k: Tensor,
    indices: Optional[Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = True,
    cu_seqlens: Optional[Tensor] = None,
    backend: str = "auto",
    q_positions: Optional[Tensor] = None,
) -> Tensor:
    return get_op("attention_probs_target", backend)(
        q, k, indices, scale, causal, cu_seqlens, q_positions=q_positions
    )


def indexer_kl_loss(
    index_scores: Tensor,
    attn_probs_target: Tensor,
    indices: Optional[Tensor] = None,
    backend: str = "auto",
) -> Tensor:
    return get_op("indexer_kl_loss", backend)(index_scores, attn_probs_target, indices)


# Bytes of one query chunk's intermediates in chunked_indexer_kl_loss.
KL_CHUNK_BUDGET_BYTES = 1 << 30
# fp32 [K] rows per query that a sparse-stage chunk holds with the fused (Triton) index scores.
KL_FUSED_ROWS = 16


@torch.no_grad()
def sparse_probs_target(
    q: Tensor, k: Tensor, indices: Tensor, lse: Tensor, scale: Optional[float] = None,
    budget_bytes: Optional[int] = None, backend: str = "auto",
) -> Tensor:
    """The sparse-stage KL target from the attention's own log-sum-exps, before normalising.

    q [B, T, H, D], k [B, S, G, D], indices [B, T, K], lse [B, T, H] (what sparse_attention
    returned for these inputs) -> [B, T, K] fp32 (fp64 for fp64 inputs): the sum over heads of
    exp(scale q_h . k_j - lse_h), 0 in the -1 slots; attention_probs_target(q, k, indices)
    times H, without a softmax of its own. backend "triton": one Triton program per query reads the selected key rows once
    (triton_sparse.sparse_probs_target_triton); auto takes it for 16-bit CUDA tensors with at
    most 64 heads per kv group (GQA: on the H200 at 64 heads / 4 groups / d 128 the KL loss
    took 228 ms with it against 458 without, 32k queries). Otherwise (and for absorbed MLA's
    128 heads on one latent, where the batched products won, 35.5 against 43.7 ms at 4096
    queries; both in sparse_layer.json as of 036d65f: kl_loss_fwd_bwd beside
    kl_loss_fwd_bwd_ms_gathered_target / _triton_target) the products run on gathered rows, in
    the inputs' dtype with an fp32 result on CUDA, queries in chunks of budget_bytes. (The layers take absorbed MLA's target from
    sparse_attention_with_target, which sums the products forward's probabilities instead.)
    """
    H, G = q.shape[2], k.shape[2]
    fused = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and H // max(G, 1) <= 64
    if backend == "triton" or (backend == "auto" and fused and "triton" in _BACKENDS):
        from .triton_sparse import sparse_probs_target_triton

        return sparse_probs_target_triton(q, k, indices, lse, scale)
    B, T, S, H, G, D = reference._check_attention_args(q, k, k)
    reference._check(
        tuple(lse.shape) == (B, T, H),
        f"lse must be [B, T, H] = {(B, T, H)} (sparse_attention's second output), got {tuple(lse.shape)}",
    )
    scale = D**-0.5 if scale is None else scale
    R, K = H // G, indices.shape[-1]
    out = torch.empty((B, T, K), dtype=reference._compute_dtype(q), device=q.device)
    budget = KL_CHUNK_BUDGET_BYTES if budget_bytes is None else budget_bytes
    Tc = max(1, min(T, budget // max(1, B * K * (2 * G * D * q.element_size() + 8 * H))))
    for t0 in range(0, T, Tc):
        t1 = min(T, t0 + Tc)
        n, idx = t1 - t0, indices[:, t0:t1]
        q_c = q[:, t0:t1].reshape(B, n, G, R, D)
        lse_c = lse[:, t0:t1].to(out.dtype).reshape(B, n, G, R, 1)
        lse_c = lse_c.masked_fill(lse_c == float("-inf"), 0.0)
        acc = None
        for g in range(G):  # one group's keys at a time: the gathered rows feed bmm as they are
            k_sel = reference._select_keys(k[:, :, g], idx).view(B * n, K, D)
            s = reference._bmm_f32(q_c[:, :, g].reshape(B * n, R, D), k_sel.transpose(1, 2)).view(B, n, R, K)
            p = torch.exp(s * scale - lse_c[:, :, g]).sum(2)
            acc = p if acc is None else acc + p
        out[:, t0:t1] = acc.masked_fill(idx < 0, 0.0)
    return out


def sparse_attention_with_target(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    scale: Optional[float] = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """sparse_attention plus the indexer KL loss's sparse-stage target: (o, lse, target), target
    [B, T, K] fp32 = sparse_probs_target(q, k, indices, lse, scale) (no gradient), for
    chunked_indexer_kl_loss(target=...). When the Triton backend runs its products forward
    (absorbed MLA's many heads per latent on the GPU), the target is the sum of the
    probabilities that forward makes anyway; otherwise sparse_probs_target computes it after."""
    op = get_op("sparse_attention", backend, q)
    target = None
    if "triton" in _BACKENDS and op is _BACKENDS["triton"].sparse_attention:
        from .triton_sparse import sparse_attention_triton

        o, lse, target = sparse_attention_triton(q, k, v, indices, scale, with_target=True)
    else:
        o, lse = op(q, k, v, indices, scale)
    if target is None:
        target = sparse_probs_target(q.detach(), k.detach(), indices, lse.detach(), scale, backend=backend)
    return o, lse, target


def _dense_kl_fused(backend: str, q: Tensor, k: Tensor, q_idx: Tensor, k_idx: Tensor, weights: Tensor) -> bool:
    """Whether the dense warm-up's KL loss runs fused (triton_dense_kl): backend "triton" always
    (ValueError naming the reason where the kernels cannot take the inputs); auto for 16-bit
    CUDA inputs the kernels take."""
    if "triton" not in _BACKENDS or backend not in ("auto", "triton"):
        return False
    if backend == "triton":
        return True
    from .triton_dense_kl import dense_kl_unsupported

    return (q_idx.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q_idx.dtype in (torch.bfloat16, torch.float16)
            and dense_kl_unsupported(q, k, q_idx, k_idx, weights) is None)


def chunked_indexer_kl_loss(
    q: Tensor,
    k: Tensor,
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    indices: Optional[Tensor] = None,
    scale: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    q_positions: Optional[Tensor] = None,
    tp_group=None,
    lse: Optional[Tensor] = None,
    budget_bytes: Optional[int] = None,
    backend: str = "auto",
    target: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The indexer KL loss straight from the attention and indexer inputs, in query chunks.

    q [B, T, H, D], k [B, S, G, D] (detached here: the loss trains the indexer only),
    q_idx [B, T, HI, DI], k_idx [B, S, DI], weights [B, T, HI]; indices [B, T, K] for the
    sparse stage, None for the dense warm-up; cu_seqlens / q_positions as in
    lightning_indexer. tp_group: the target is summed over its ranks' heads (each holds
    H / tp). lse [B, T, H]: the sparse stage's attention log-sum-exps (sparse_attention's
    second output); with them the target is sparse_probs_target, one product per head and
    slot, instead of a softmax of its own. target [B, T, K]: that target already made
    (sparse_attention_with_target; this rank's heads, summed over tp_group here, in place). Returns (the mean KL over the valid queries,
    valid [B, T] bool), equal to indexer_kl_loss(lightning_indexer[_sparse](...),
    attention_probs_target(...), indices).

    The sparse stage's target is computed once, without gradient, into [B, T, K]; then each
    chunk of queries computes its index scores and KL sum under activation checkpointing,
    so that only one chunk's [Tc, HI, K] intermediates are alive at a time (forward and
    backward). The dense warm-up, fused (triton_dense_kl.dense_indexer_kl_triton; auto takes
    it for 16-bit CUDA inputs, backend "triton" always, tensor parallelism never), streams
    the keys tile by tile from the main attention's per-head log-sum-exps and holds no
    [Tc, H, S] or [Tc, HI, S] tensor; otherwise each chunk computes its [Tc, H, S] target inside
    the chunk: it never holds [T, S] attention at long context. Memory is linear in T. The
    index scores and the target go through the backend's ops (auto: Triton for 16-bit CUDA
    tensors); an op the named backend lacks runs under auto.
    """
    B, T, S, H, _, _ = reference.check_kl_args(q, k, q_idx, k_idx, weights)
    if indices is not None:
        reference._check(
            isinstance(indices, Tensor) and indices.dim() == 3 and tuple(indices.shape[:2]) == (B, T)
            and not indices.is_floating_point(),
            f"indices must be an integer [B, T, K] = [{B}, {T}, K] tensor (None for the dense warm-up), got "
            + (f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, Tensor) else type(indices).__name__),
        )
    reference._check_scale(scale)
    tp = tp_group is not None and torch.distributed.get_world_size(tp_group) > 1
    if indices is None and not tp and _dense_kl_fused(backend, q, k, q_idx, k_idx, weights):
        from .triton_dense_kl import dense_indexer_kl_triton

        kl, valid = dense_indexer_kl_triton(
            q.detach(), k.detach(), q_idx, k_idx, weights, scale, cu_seqlens, q_positions, budget_bytes
        )
        return kl.sum() / valid.sum().clamp_min(1), valid
    X = S if indices is None else indices.shape[-1]
    indices_valid = indices is not None and reference.known_valid_indices(indices, S)
    HI, DI = q_idx.shape[2:]
    budget = KL_CHUNK_BUDGET_BYTES if budget_bytes is None else budget_bytes
    per_query = B * X * (4 * (2 * HI + 4) + 2 * DI)
    if indices is None:  # the chunk also makes its target
        per_query += B * X * (4 * H + 4 * k.shape[2] * k.shape[3])
    elif get_op("lightning_indexer_sparse", backend, q_idx) is not reference.lightning_indexer_sparse:
        # fused index scores make no [Tc, HI, K] logits: a chunk holds about KL_FUSED_ROWS fp32
        # [K] rows per query (scores, the KL's intermediates and their gradients); the scores'
        # key gradient buffer is bounded by the kernel itself. Fewer, larger chunks: fewer
        # launches, and fewer passes of the per-key reduce over all S keys.
        per_query = B * X * 4 * KL_FUSED_ROWS
    Tc = max(1, min(T, budget // max(per_query, 1)))
    q, k = q.detach(), k.detach()
    # backend picks the index scores' implementation; ops a backend lacks run under auto
    rest = backend if backend in ("auto", "torch") else "auto"
    if indices is None:
        pos = reference._query_positions(q_positions, T, S, q.device)
    else:
        with torch.no_grad():
            if target is not None:
                if tuple(target.shape) != tuple(indices.shape):
                    raise ValueError(f"target must be [B, T, K] = {tuple(indices.shape)} like indices "
                                     f"(sparse_attention_with_target's third output), got {tuple(target.shape)}")
            elif lse is not None:
                target = sparse_probs_target(q, k, indices, lse, scale, budget, backend)
            else:
                target = torch.cat([
                    attention_probs_target(q[:, t0:t0 + Tc], k, indices[:, t0:t0 + Tc], scale, backend=rest)
                    for t0 in range(0, T, Tc)
                ], dim=1) if T else q.new_zeros((B, 0, X), dtype=torch.float32)
            if tp:
                torch.distributed.all_reduce(target, group=tp_group)

    def chunk(t0: int, t1: int, q_idx_c: Tensor, k_idx: Tensor, weights_c: Tensor):
        if indices is None:
            with torch.no_grad():
                target_c = attention_probs_target(
                    q[:, t0:t1], k, None, scale, True, cu_seqlens, rest, q_positions=pos[t0:t1]
                )
                if tp:
                    torch.distributed.all_reduce(target_c, group=tp_group)
            scores = lightning_indexer(
                q_idx_c, k_idx, weights_c, True, cu_seqlens, rest, q_positions=pos[t0:t1]
            )
            idx = None
        else:
            idx, target_c = indices[:, t0:t1], target[:, t0:t1]
            if indices_valid:  # a slice of rows of valid indices is valid: no range check (host read) per chunk
                reference.mark_valid_indices(idx, S)
            scores = lightning_indexer_sparse(q_idx_c, k_idx, weights_c, idx, backend)
        return reference.indexer_kl_sum(scores, target_c, idx)  # (KL sum, valid [B, n])

    total, valid = [], []
    for t0 in range(0, T, Tc):
        t1 = min(T, t0 + Tc)
        args = (t0, t1, q_idx[:, t0:t1], k_idx, weights[:, t0:t1])
        if Tc >= T or not torch.is_grad_enabled():
            kl_sum, v = chunk(*args)
        else:
            kl_sum, v = torch.utils.checkpoint.checkpoint(chunk, *args, use_reentrant=False)
        total.append(kl_sum)
        valid.append(v)
    valid = torch.cat(valid, dim=1) if valid else q.new_zeros((B, 0), dtype=torch.bool)
    loss = torch.stack(total).sum() if total else q_idx.new_zeros(()).float()
    return loss / valid.sum().clamp_min(1), valid


for _name in OPS:
    globals()[_name].__doc__ = getattr(reference, _name).__doc__
del _name

__all__ = [
    *OPS,
    "SparseAttentionBackend",
    "causal_attention",
    "chunked_indexer_kl_loss",
    "sparse_probs_target",
    "sparse_attention_with_target",
    "dense_attention",
    "dense_masked_attention",
    "get_op",
    "hadamard_rotate",
    "indexer_fp8_inputs",
    "indexer_kl_valid_queries",
    "indices_to_mask",
    "mark_valid_indices",
    "positions_from_cu_seqlens",
    "quantize_fp8_rows",
    "register_backend",
    "registered_backends",
]
