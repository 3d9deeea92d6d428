"""Top-k sparse attention layer (DeepSeek-V3.2 DSA), usable as Megatron's self_attention.

Shape legend: s tokens, b batch, h hidden (Megatron's [s, b, h] at the boundary);
inside, batch first: B = b, T = s, H / G query heads / kv groups on this tensor-parallel
rank, D head dim, HI / DI indexer heads / head dim, K top-k.

Per forward: qkv projection -> RoPE -> (indexer on detached input -> top-k) -> attention
-> output projection. Stage "dense_warmup" runs dense causal attention and trains only the
indexer; stage "sparse" attends over the indexer's top-k. The indexer KL loss rides on the
output through MoEAuxLossAutoScaler, so Megatron's schedule scales its gradient like the
MoE auxiliary losses (or goes to indexer_loss_sink, where a caller set one).

Context parallelism (Megatron's context_parallel_size > 1): hidden_states holds this rank's
s = T / cp tokens in the layout of config.cp_layout ("zigzag" by default), packed
cu_seqlens stay global; the core in parallel/cp_sparse_attention.py gathers the keys. CP == 1
runs the single-device code below unchanged.
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from megatron_moe_hybrid.layers.tp_linears import tp_linear_builders
from megatron_moe_hybrid.ops import sparse_attention as ops
from megatron_moe_hybrid.parallel.context_parallel import local_layout, token_positions
from megatron_moe_hybrid.parallel.cp_sparse_attention import (
    attach_cp_indexer_loss,
    carry_indexer_loss,
    cp_sparse_attention_core,
)
from megatron_moe_hybrid.parallel.recompute import reuse_in_recompute

STAGES = ("sparse", "dense_warmup")


@dataclass
class SparseAttentionSubmodules:
    """linear_qkv / linear_proj as in Megatron's SelfAttention; the rest form the indexer.

    The indexer projections gather their output: every tensor-parallel rank scores all
    tokens with all indexer heads (they are small), so top-k needs no communication.
    index_k_norm is built as index_k_norm(DI, eps=..., dtype=...) (torch.nn.LayerNorm).
    """

    linear_qkv: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_proj: Union[ModuleSpec, type] = RowParallelLinear
    linear_index_q: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_index_k: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_index_weights: Union[ModuleSpec, type] = ColumnParallelLinear
    index_k_norm: Union[ModuleSpec, type] = torch.nn.LayerNorm


def _validate(config) -> None:
    sa = getattr(config, "sparse_attention", None)
    if sa is None:
        raise ValueError("config.sparse_attention is missing; set the sparse_attention group")
    if not (isinstance(sa.topk, int) and sa.topk > 0):
        raise ValueError(f"config.sparse_attention.topk must be a positive int, got {sa.topk!r}")
    if sa.stage not in STAGES:
        raise ValueError(f"config.sparse_attention.stage must be one of {STAGES}, got {sa.stage!r}")
    if not sa.indexer_loss_coeff >= 0:
        raise ValueError(
            f"config.sparse_attention.indexer_loss_coeff must be >= 0 (0 disables the loss), "
            f"got {sa.indexer_loss_coeff!r}"
        )
    if not (sa.index_rope_dim % 2 == 0 and 0 <= sa.index_rope_dim <= sa.index_head_dim):
        raise ValueError(
            f"config.sparse_attention.index_rope_dim must be even and <= index_head_dim="
            f"{sa.index_head_dim}, got {sa.index_rope_dim!r}"
        )
    if sa.indexer_fp8 and sa.index_head_dim & (sa.index_head_dim - 1):
        raise ValueError(
            f"config.sparse_attention.index_head_dim must be a power of 2 with indexer_fp8 (Hadamard-rotated "
            f"rows), got {sa.index_head_dim}"
        )
    if config.kv_channels % 2:
        raise ValueError(f"config.kv_channels must be even for RoPE, got {config.kv_channels}")
    num_groups = config.num_query_groups or config.num_attention_heads
    tp = config.tensor_model_parallel_size
    if config.num_attention_heads % num_groups or num_groups % tp:
        raise ValueError(
            f"config.num_query_groups={num_groups} must divide num_attention_heads="
            f"{config.num_attention_heads} and be divisible by tensor_model_parallel_size={tp}"
        )
    if config.sequence_parallel:
        raise ValueError("SparseAttention does not support sequence_parallel yet; set it False")


class SparseAttention(MegatronModule):
    """Causal GQA self-attention over the lightning indexer's top-k keys per query.

    After a training forward, last_indexer_loss holds the detached, unscaled KL loss. The
    dense warm-up's freezing of everything but the indexer is the trainer's job
    (indexer_parameters() lists what stays trainable); this layer guarantees that the KL
    loss reaches nothing but those parameters. indexer_loss_sink: None (the loss rides on the
    output), or a list that each training forward appends the scaled loss to, graph and all,
    for the caller to backward (parallel/cp_sparse_attention.py: carry_indexer_loss).
    """

    def __init__(
        self,
        config,
        submodules: SparseAttentionSubmodules,
        layer_number: int = 1,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        _validate(config)
        self.layer_number = layer_number
        self.sa = config.sparse_attention
        tp = config.tensor_model_parallel_size
        self.head_dim = config.kv_channels
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.tp_group = getattr(pg_collection, "tp", None)
        self.last_indexer_loss: Optional[Tensor] = None
        self.indexer_loss_sink: Optional[list] = None
        column, row = tp_linear_builders(config, pg_collection)
        heads, groups, dim, h = config.num_attention_heads, self.num_groups * tp, self.head_dim, config.hidden_size
        self.linear_qkv = column(submodules.linear_qkv, h, (heads + 2 * groups) * dim)
        self.linear_proj = row(submodules.linear_proj, heads * dim, h)
        num_index_heads, index_dim = self.sa.index_n_heads, self.sa.index_head_dim
        self.linear_index_q = column(submodules.linear_index_q, h, num_index_heads * index_dim, gather_output=True)
        self.linear_index_k = column(submodules.linear_index_k, h, index_dim, gather_output=True)
        self.linear_index_weights = column(submodules.linear_index_weights, h, num_index_heads, gather_output=True)
        self.index_k_norm = build_module(
            submodules.index_k_norm,
            index_dim,
            eps=config.layernorm_epsilon,
            dtype=config.params_dtype,
        )

    def indexer_modules(self) -> tuple:
        """The indexer's modules (the dense warm-up's own FSDP group: parallel/fsdp.py)."""
        return (self.linear_index_q, self.linear_index_k, self.linear_index_weights, self.index_k_norm)

    def indexer_parameters(self):
        """The parameters trained by the indexer KL loss (and by nothing else)."""
        for module in self.indexer_modules():
            yield from module.parameters()

    def _qkv(self, hidden_states: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        s, b, _ = hidden_states.shape
        R, D, base = self.num_heads // self.num_groups, self.head_dim, self.sa.rope_base
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, G * (R + 2) * D]
        # Megatron's SelfAttention layout: per group, its R query heads then its key and value.
        mixed = mixed.transpose(0, 1).reshape(b, s, self.num_groups, (R + 2) * D)
        q, k, v = mixed.split([R * D, D, D], dim=-1)
        q = q.reshape(b, s, self.num_heads, D)  # [B, T, H, D]
        return ops.apply_rope(q, positions, D, base), ops.apply_rope(k, positions, D, base), v

    def _indexer(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q_idx [B, T, HI, DI], k_idx [B, T, DI], weights [B, T, HI] from detached x [s, b, h]."""
        s, b, _ = x.shape
        HI, DI = self.sa.index_n_heads, self.sa.index_head_dim
        rope_dim, base = self.sa.index_rope_dim, self.sa.rope_base
        q_idx = self.linear_index_q(x)[0].transpose(0, 1).reshape(b, s, HI, DI)
        k_idx = self.index_k_norm(self.linear_index_k(x)[0].transpose(0, 1))  # [B, T, DI]
        # DeepSeek-V3.2 scales the head weights by HI^-1/2 and the logits by DI^-1/2.
        weights = self.linear_index_weights(x)[0].transpose(0, 1) * (HI * DI) ** -0.5
        q_idx = ops.apply_rope(q_idx, positions, rope_dim, base)
        k_idx = ops.apply_rope(k_idx, positions, rope_dim, base)
        return q_idx, k_idx, weights

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        """hidden_states [s, b, h] -> (output [s, b, h], None).

        Always causal: attention_mask and Megatron's rotary embeddings (kwargs) are ignored;
        RoPE is applied here from the token positions (restarting per packed sequence).
        """
        s, b, _ = hidden_states.shape
        backend = self.sa.backend
        layout = local_layout(s, getattr(self.config, "cp_layout", "zigzag"))
        positions, cu_seqlens = token_positions(packed_seq_params, s, b, hidden_states.device, layout)
        q, k, v = self._qkv(hidden_states, positions)
        # The indexer learns only from its KL loss: its input is cut off from the main model.
        q_idx, k_idx, weights = self._indexer(hidden_states.detach(), positions)
        coeff = self.sa.indexer_loss_coeff
        with_loss = coeff > 0 and self.training and torch.is_grad_enabled()
        if layout is not None:
            return self._cp_forward(q, k, v, q_idx, k_idx, weights, layout, cu_seqlens, with_loss)

        if self.sa.stage == "sparse":
            # [B, T, K]; selection is not differentiable, so the indexer gets no gradient here.
            # A recomputed layer's backward reuses its first forward's (parallel/recompute.py).
            indices = reuse_in_recompute(self, "indices", (weights, cu_seqlens), lambda: ops.lightning_indexer_topk(
                q_idx.detach(),
                k_idx.detach(),
                weights.detach(),
                self.sa.topk,
                cu_seqlens=cu_seqlens,
                backend=backend,
                fp8=self.sa.indexer_fp8,
            ))
            if with_loss:  # the KL target too, from the attention's own probabilities where it can
                o, lse, target = ops.sparse_attention_with_target(q, k, v, indices, backend=backend)
            else:
                o, lse = ops.sparse_attention(q, k, v, indices, backend=backend)
                target = None
        else:
            indices = lse = target = None
            # flash kernels on CUDA (memory linear in T), the reference's [B, T, H, T] scores on the CPU
            o = ops.causal_attention(q, k, v, cu_seqlens=cu_seqlens, backend="torch" if backend == "torch" else "auto")
        output, bias = self.linear_proj(o.reshape(b, s, -1).transpose(0, 1))  # [s, b, h]

        if with_loss:
            loss = self._indexer_loss(q, k, q_idx, k_idx, weights, indices, lse, cu_seqlens, target)
            self.last_indexer_loss = loss.detach()
            output = carry_indexer_loss(output, coeff * loss, self.indexer_loss_sink)
        return output, bias

    def _tp_group(self):
        if self.config.tensor_model_parallel_size == 1:
            return None
        return self.tp_group or parallel_state.get_tensor_model_parallel_group()

    def _cp_forward(self, q, k, v, q_idx, k_idx, weights, layout, cu_seqlens, with_loss):
        """The forward's tail under context parallelism: the CP core, then the projection.

        The core's loss is this rank's share of the global KL loss (its queries, scaled by
        local / global valid-query count; the shares sum to the CP == 1 loss), attached as
        attach_cp_indexer_loss says; last_indexer_loss is the global value, for logging only.
        """
        b, s = q.shape[:2]
        o, loss = cp_sparse_attention_core(
            q,
            k,
            v,
            q_idx,
            k_idx,
            weights,
            layout=layout,
            topk=self.sa.topk,
            cu_seqlens=cu_seqlens,
            stage=self.sa.stage,
            indexer_loss=with_loss,
            tp_group=self._tp_group(),
            backend=self.sa.backend,
            indexer_fp8=self.sa.indexer_fp8,
        )
        output, bias = self.linear_proj(o.reshape(b, s, -1).transpose(0, 1))  # [s, b, h]
        if with_loss:
            output, self.last_indexer_loss = attach_cp_indexer_loss(
                output, loss, self.sa.indexer_loss_coeff, layout, self.indexer_loss_sink
            )
        return output, bias

    def _indexer_loss(self, q, k, q_idx, k_idx, weights, indices, lse, cu_seqlens, target=None) -> Tensor:
        # Each rank holds H / tp heads; the target sums all of them (the loss renormalises).
        tp_group = self._tp_group() if self.config.tensor_model_parallel_size > 1 else None
        loss, _ = ops.chunked_indexer_kl_loss(
            q, k, q_idx, k_idx, weights, indices,
            cu_seqlens=cu_seqlens, tp_group=tp_group, backend=self.sa.backend,
            lse=None if lse is None else lse.detach(), target=target,
        )
        return loss
