"""Qwen3-Next's gated full attention (pattern letter "A"), usable as Megatron's self_attention.

Shape legend: s tokens, b batch, h hidden (Megatron's [s, b, h] at the boundary); inside,
batch first: B = b, T = s, H / G query heads / kv groups on this tensor-parallel rank
(head i reads group i // (H // G), as HF's repeat_kv), D head dim, P rotary channels
(int(D * partial_rotary_factor)).

Per forward, as transformers' Qwen3NextAttention: linear_q -> per head [query | gate];
zero-centred RMSNorm over D on q and k; rotate-half RoPE on the first P channels; causal
softmax GQA attention; output * sigmoid(gate); linear_proj. Heads, kv groups and D are
config.num_attention_heads, num_query_groups and kv_channels; partial_rotary_factor and
rope_theta come from config.full_attention.
"""

from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor, nn

from megatron_moe_hybrid.layers.tp_linears import tp_linear_builders
from megatron_moe_hybrid.ops import sparse_attention as ops
from megatron_moe_hybrid.ops.sparse_attention.reference import apply_rope
from megatron_moe_hybrid.parallel.context_parallel import local_layout, token_positions


@dataclass
class GatedAttentionSubmodules:
    """Separate q (with its gate), k and v projections: HF's layout, so weights copy as they are."""

    linear_q: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_k: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_v: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_proj: Union[ModuleSpec, type] = RowParallelLinear


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    """HF's rotary width: int(head_dim * partial_rotary_factor) leading channels of each head."""
    return int(head_dim * partial_rotary_factor)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3NextRMSNorm: x / rms(x) * (1 + weight), weight initialised to 0.

    Computed in fp32 (fp64 for fp64 inputs) and multiplied before the cast back, as HF does.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:  # [..., D]
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)


def _validate(config) -> None:
    fa = getattr(config, "full_attention", None)
    if fa is None:
        raise ValueError("config.full_attention is missing; set the full_attention group")
    if not 0 < fa.partial_rotary_factor <= 1:
        raise ValueError(
            f"config.full_attention.partial_rotary_factor must be in (0, 1], "
            f"got {fa.partial_rotary_factor!r}; Qwen3-Next uses 0.25"
        )
    if not fa.rope_theta > 0:
        raise ValueError(f"config.full_attention.rope_theta must be > 0, got {fa.rope_theta!r}")
    P = rotary_dim(config.kv_channels, fa.partial_rotary_factor)
    if P % 2:
        raise ValueError(
            f"config.full_attention.partial_rotary_factor: kv_channels={config.kv_channels} x "
            f"{fa.partial_rotary_factor} gives {P} rotary channels, which must be even; "
            "change the factor or model.kv_channels"
        )
    num_groups = config.num_query_groups or config.num_attention_heads
    tp = config.tensor_model_parallel_size
    if config.num_attention_heads % num_groups or num_groups % tp:
        raise ValueError(
            f"config.num_query_groups={num_groups} must divide num_attention_heads="
            f"{config.num_attention_heads} and be divisible by tensor_model_parallel_size={tp}"
        )
    if config.sequence_parallel:
        raise ValueError("GatedAttention does not support sequence_parallel yet; set it False")


class GatedAttention(MegatronModule):
    """Causal GQA softmax attention with per-head q/k norm, partial RoPE and a sigmoid output gate."""

    def __init__(
        self,
        config,
        submodules: GatedAttentionSubmodules,
        layer_number: int = 1,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        _validate(config)
        self.layer_number = layer_number
        fa = config.full_attention
        tp = config.tensor_model_parallel_size
        self.head_dim = config.kv_channels
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.rotary_dim = rotary_dim(self.head_dim, fa.partial_rotary_factor)
        self.rope_theta = fa.rope_theta
        tp_group = getattr(pg_collection, "tp", None)
        if tp_group is not None:
            self.tp_rank, self.tp_size = tp_group.rank(), tp_group.size()
        else:
            self.tp_size = tp
            self.tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
        column, row = tp_linear_builders(config, pg_collection)
        heads, groups, D, h = config.num_attention_heads, self.num_groups * tp, self.head_dim, config.hidden_size
        self.linear_q = column(submodules.linear_q, h, heads * 2 * D)  # per head: D query, D gate
        self.linear_k = column(submodules.linear_k, h, groups * D)
        self.linear_v = column(submodules.linear_v, h, groups * D)
        self.linear_proj = row(submodules.linear_proj, heads * D, h)
        self.q_norm = ZeroCenteredRMSNorm(D, config.layernorm_epsilon, config.params_dtype)
        self.k_norm = ZeroCenteredRMSNorm(D, config.layernorm_epsilon, config.params_dtype)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """hidden_states [s, b, h] -> (output [s, b, h], bias None).

        Always causal: attention_mask and Megatron's rotary embeddings (kwargs) are ignored;
        RoPE is applied here from the token positions, which restart per packed sequence
        (packed_seq_params.cu_seqlens_q, b == 1). Attention dropout is not applied.

        Under context parallelism the s tokens are this rank's pieces of the sequence (the
        config's cp_layout) and cu_seqlens holds global offsets: K and V (one head per group)
        are all-gathered, and the queries attend to every key before them (the gather's
        backward hands each rank its rows' gradients).
        """
        if kwargs.get("inference_context") is not None:
            raise NotImplementedError("GatedAttention keeps no KV cache for decoding")
        s, b, _ = hidden_states.shape
        H, G, D = self.num_heads, self.num_groups, self.head_dim
        layout = local_layout(s, getattr(self.config, "cp_layout", "zigzag"))
        positions, cu_seqlens = token_positions(packed_seq_params, s, b, hidden_states.device, layout)
        x = hidden_states.transpose(0, 1)  # [B, T, h]
        # HF views q_proj's output as [H, 2D] and chunks it: query first, then gate, per head.
        q, gate = self.linear_q(x)[0].unflatten(-1, (H, 2 * D)).chunk(2, dim=-1)  # [B, T, H, D]
        k = self.linear_k(x)[0].unflatten(-1, (G, D))  # [B, T, G, D]
        v = self.linear_v(x)[0].unflatten(-1, (G, D))  # [B, T, G, D]
        q = apply_rope(self.q_norm(q), positions, self.rotary_dim, self.rope_theta)
        k = apply_rope(self.k_norm(k), positions, self.rotary_dim, self.rope_theta)
        if layout is None:
            o = ops.causal_attention(q, k, v, cu_seqlens=cu_seqlens)  # [B, T, H, D]: flash kernels on CUDA
        else:  # every rank's keys in global order; q_ranges places this rank's queries among them
            k, v = layout.gather(torch.cat([k, v], dim=-1), dim=1).split([D, D], dim=-1)
            o = ops.causal_attention(q, k, v, cu_seqlens=cu_seqlens, q_ranges=layout.rank_ranges())
        o = o * torch.sigmoid(gate)
        return self.linear_proj(o.flatten(2).transpose(0, 1).contiguous())  # [s, b, h], None


def load_hf_qwen3_next_attention(
    module: GatedAttention, hf_state_dict: Mapping[str, Tensor], prefix: str = ""
) -> None:
    """Copies a transformers Qwen3NextAttention state dict (keys `prefix + "q_proj.weight"`, ...)
    into `module`, taking this tensor-parallel rank's rows (q/k/v) or columns (o_proj).

    Every key under `prefix` must be used: biases (attention_bias=True) have no place here.
    """
    names = {
        "q_proj.weight": (module.linear_q.weight, 0),
        "k_proj.weight": (module.linear_k.weight, 0),
        "v_proj.weight": (module.linear_v.weight, 0),
        "o_proj.weight": (module.linear_proj.weight, 1),
        "q_norm.weight": (module.q_norm.weight, None),
        "k_norm.weight": (module.k_norm.weight, None),
    }
    extra = sorted(k for k in hf_state_dict if k.startswith(prefix) and k[len(prefix):] not in names)
    if extra:
        raise ValueError(
            f"hf_state_dict: unexpected keys {extra}; GatedAttention has no biases "
            "(convert a checkpoint with attention_bias=False) and takes only "
            f"{sorted(prefix + n for n in names)}"
        )
    with torch.no_grad():
        for name, (param, tp_dim) in names.items():
            key = prefix + name
            if key not in hf_state_dict:
                raise ValueError(f"hf_state_dict: missing {key!r}")
            w = hf_state_dict[key]
            if tp_dim is not None:
                # Rows of q_proj are whole heads ([query | gate] of 2D each), so an even split
                # over ranks hands each rank its own heads, as the ColumnParallelLinear expects.
                w = w.chunk(module.tp_size, dim=tp_dim)[module.tp_rank]
            if w.shape != param.shape:
                raise ValueError(
                    f"hf_state_dict[{key!r}]: shape {tuple(w.shape)} (this rank's part) does not "
                    f"match {tuple(param.shape)}; check num_attention_heads, num_key_value_heads, "
                    "head_dim and hidden_size against the HF config"
                )
            param.copy_(w.to(param.dtype))
