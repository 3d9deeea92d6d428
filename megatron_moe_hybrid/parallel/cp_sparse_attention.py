"""Top-k sparse attention (DeepSeek-V3.2 DSA) under context parallelism: the layer's core.

Shape legend: B batch (1 when packed), Tl local tokens (this rank's queries), T global tokens
(every rank's keys), H / G query heads / kv groups, D head dim, DV value head dim, HI / DI
indexer heads / head dim, K top-k.

A rank keeps its Tl queries and all-gathers, in global order, what every query may read: the
indexer keys k_idx and the GQA/MQA-shared K and V (one head per group, small next to the
queries). Query t sits at global index layout.positions()[t], so the causal and packed masks
compare global indices and top-k returns global key indices into the gathered tensors. The
gathers are layout.gather, whose backward sums every rank's gradient of a gathered row and
hands it to the owner: the backward is the mirror of the forward with no code of its own.

Memory per rank: the gathered K, V and indexer keys are O(T) (one head per group) but
transient: the selections are index_select, whose backward needs the indices only, so what
autograd keeps is the [B, Tl, K] selected rows, linear in the local length (a test checks
the saved shapes); the reference indexer scores block_size queries at a time ([B,
block_size, HI, T]), the Triton one (auto on bf16/fp16 CUDA tensors) memory-bounded query
chunks without the per-head logits. The dense warm-up is dense attention by definition: it
keeps the gathered keys; on CUDA it runs flash kernels over this rank's pieces
(ops.causal_attention with q_ranges), on the CPU the reference, which builds [B, Tl, H, T]. The KL loss runs in query
chunks under checkpointing (ops.chunked_indexer_kl_loss), so it holds no [B, Tl, T] target.

Indexer KL loss: indexer_kl_loss is a mean over the valid queries (those with a key and a
target). A rank's loss covers its own queries, scaled by its share of the valid queries
(local count / global count), so the losses summed over the CP ranks equal the CP == 1 loss,
and so do the gradients. (SparseAttention attaches cp x this share because the trainer
averages gradients over the CP ranks.)
"""

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_moe_hybrid.ops import sparse_attention as ops
from megatron_moe_hybrid.parallel.context_parallel import CPLayout
from megatron_moe_hybrid.parallel.recompute import is_recomputing

STAGES = ("sparse", "dense_warmup")


def _check_args(q, k, v, q_idx, k_idx, weights, layout, stage, cu_seqlens) -> None:
    if not isinstance(layout, CPLayout):
        raise ValueError(f"layout must be a CPLayout, got {type(layout).__name__}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    Tl = layout.local_len
    B = q.shape[0] if isinstance(q, Tensor) and q.dim() else None
    # The ops check the remaining dims; here: every input holds this rank's Tl tokens.
    for name, x, legend in (
        ("q", q, "[B, Tl, H, D]"),
        ("k", k, "[B, Tl, G, D]"),
        *((("v", v, "[B, Tl, G, DV]"),) if v is not None else ()),
        ("q_idx", q_idx, "[B, Tl, HI, DI]"),
        ("k_idx", k_idx, "[B, Tl, DI]"),
        ("weights", weights, "[B, Tl, HI]"),
    ):
        dims = legend.count(",") + 1
        if not (isinstance(x, Tensor) and x.dim() == dims and tuple(x.shape[:2]) == (B, Tl)):
            raise ValueError(
                f"{name} must be {legend} with B={B} (q's batch) and this rank's "
                f"Tl = layout.local_len = {Tl} tokens, got "
                f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
            )
    if cu_seqlens is not None:
        # Validates the global offsets (ValueError naming cu_seqlens) before any collective,
        # so a bad call fails on every rank at the same place.
        ops.positions_from_cu_seqlens(cu_seqlens, layout.seq_len)


def _valid_share(loss: Tensor, valid: Tensor, layout: CPLayout) -> Tensor:
    """loss (a mean over this rank's valid queries) times local count / count over all ranks."""
    if layout.size == 1:
        return loss
    num_local = valid.sum().to(loss.dtype)
    num_global = num_local.clone()
    dist.all_reduce(num_global, group=layout.group)
    return loss * (num_local / num_global.clamp_min(1))


def carry_indexer_loss(output: Tensor, scaled_loss: Tensor, sink: Optional[list]) -> Tensor:
    """output carrying scaled_loss (the coefficient applied) into the backward: through
    MoEAuxLossAutoScaler, so that Megatron's schedule scales its gradient like the MoE losses'
    (its main_loss_backward_scale); or, where the caller gave the layer a sink (the trainer's
    dense warm-up), appended to it with its graph, output untouched: the caller then backwards
    the sink's sum itself and the layers after this one build no graph for it. The recompute of
    a checkpointed layer appends nothing (its first forward did)."""
    if sink is None:
        return MoEAuxLossAutoScaler.apply(output, scaled_loss)
    if not is_recomputing():
        sink.append(scaled_loss)
    return output


def attach_cp_indexer_loss(
    output: Tensor, loss: Tensor, coeff: float, layout: CPLayout, sink: Optional[list] = None
) -> tuple[Tensor, Tensor]:
    """A layer's output carrying the indexer KL loss into the backward (carry_indexer_loss), and
    the global loss for logging. loss is this rank's share of the global loss (the core's); the
    trainer averages gradients over the CP ranks (Megatron's dp-cp group), as it must for the LM
    loss, which each rank takes as the mean over its own tokens; so the layer attaches CP x its
    share, whose average over the ranks is the CP == 1 loss (the router does the same for the
    MoE losses). A collective over layout.group."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=layout.group)
    return carry_indexer_loss(output, coeff * layout.size * loss, sink), total


def cp_sparse_attention_core(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    *,
    layout: CPLayout,
    topk: int,
    cu_seqlens: Optional[Tensor] = None,
    stage: str = "sparse",
    indexer_loss: bool = False,
    tp_group: Optional[ProcessGroup] = None,
    block_size: int = 256,
    backend: str = "auto",
    scale: Optional[float] = None,
    value_dim: Optional[int] = None,
    indexer_fp8: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Attention of this rank's queries over all earlier global tokens.

    q [B, Tl, H, D], k [B, Tl, G, D], v [B, Tl, G, DV] (RoPE applied), q_idx [B, Tl, HI, DI],
    k_idx [B, Tl, DI], weights [B, Tl, HI]: this rank's tokens in layout order. cu_seqlens
    [N + 1]: the GLOBAL packed offsets over layout.seq_len tokens (B == 1), the same on every
    rank. stage "sparse" attends over the indexer's top-k, "dense_warmup" densely.

    Returns o [B, Tl, H, DV] and, when indexer_loss, this rank's share of the indexer KL loss
    (the target from the detached q and gathered k, summed over tp_group's heads as the layer
    does; sum over the CP ranks = the CP == 1 loss), else None. Every rank of layout.group
    must call this with the same stage and indexer_loss: the gathers are collectives.

    scale: the attention's softmax scale (None: D^-0.5). v None with value_dim: the values are
    the keys' first value_dim channels (absorbed MLA's one latent kv), so only k is gathered.
    indexer_fp8: the top-k by fp8 index scores (ops.indexer_fp8_inputs; each key row quantized
    alone, so gathering then quantizing equals the CP == 1 rows).
    """
    if v is None and value_dim is None:
        raise ValueError("v: give v [B, Tl, G, DV], or value_dim for values that are k's first channels")
    _check_args(q, k, v, q_idx, k_idx, weights, layout, stage, cu_seqlens)
    q_pos = layout.positions(q.device)  # [Tl] global index of each local query
    D = k.shape[-1]
    if v is None:
        k_all = layout.gather(k, dim=1)  # [B, T, G, D]
        v_all = k_all[..., :value_dim]
    else:  # K and V travel in one gather: [B, T, G, D + DV]
        k_all, v_all = layout.gather(torch.cat([k, v], dim=-1), dim=1).split([D, v.shape[-1]], dim=-1)
    needs_index_keys = stage == "sparse" or indexer_loss
    k_idx_all = layout.gather(k_idx, dim=1) if needs_index_keys else None  # [B, T, DI]

    if stage == "sparse":
        # [B, Tl, K] global key indices; selection is not differentiable.
        indices = ops.indexer_topk(
            q_idx.detach(),
            k_idx_all.detach(),
            weights.detach(),
            topk,
            block_size,
            cu_seqlens=cu_seqlens,
            backend=backend,
            q_positions=q_pos,
            fp8=indexer_fp8,
        )
        o, lse = ops.sparse_attention(q, k_all, v_all, indices, scale=scale, backend=backend)
    else:
        indices = lse = None
        # this rank's pieces of the sequence as runs of queries among all keys: flash kernels on
        # CUDA (memory linear in the length), the reference's [B, Tl, H, T] scores on the CPU
        o = ops.causal_attention(q, k_all, v_all, cu_seqlens=cu_seqlens, q_ranges=layout.rank_ranges(), scale=scale,
                                 backend="torch" if backend == "torch" else "auto")  # fmt: skip
    if not indexer_loss:
        return o, None

    loss, valid = ops.chunked_indexer_kl_loss(
        q, k_all, q_idx, k_idx_all, weights, indices, scale=scale,
        cu_seqlens=cu_seqlens, q_positions=q_pos, tp_group=tp_group, backend=backend,
        lse=None if lse is None else lse.detach(),
    )  # valid [B, Tl]
    return o, _valid_share(loss, valid, layout)
