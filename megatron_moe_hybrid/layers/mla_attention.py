"""DeepSeek-V3.2 attention (pattern letter "M"): MLA with the DSA lightning indexer and top-k keys.

Shape legend: s tokens, b batch, h hidden (Megatron's [s, b, h] at the boundary); inside,
batch first: B = b, T = s (queries), S = s (keys), H heads, Q q latent (q_lora_rank),
C kv latent (kv_lora_rank), N / R / V the no-rope / rope / value head dims (q and k heads are
N + R wide), HI / DI indexer heads / head dim, K = min(topk, S) keys per query.

Per forward, as transformers' DeepseekV32Attention (with DeepseekV32Indexer):
  q:  x -> linear_q_down_proj -> q_layernorm (RMSNorm) = q latent -> linear_q_up_proj -> [N | R]
      (or x -> linear_q_proj when q_lora_rank is None, DeepSeek-V3's layout)
  kv: x -> linear_kv_down_proj -> [C | R]; C -> kv_layernorm -> linear_kv_up_proj -> per head
      [k_nope N | v V]; the R rope channels are one key head shared by all heads.
  RoPE on the R channels in DeepSeek's interleaved-pair form, output de-interleaved as HF writes
  it ([rotated evens | rotated odds]): q and k are permuted alike, so q . k is unchanged.
  indexer (no gradient from the main loss, as in HF): q from the q latent [HI, DI], k = LayerNorm(x @ wk) [DI]
  shared by its heads, rotate-half RoPE on their first R channels; score[t, s] =
  sum_j w[t, j] * HI^-0.5 * relu(q[t, j] . k[s] * DI^-0.5), w = x @ weights_proj; the top-K
  causal keys per query are kept.
  softmax((N + R)^-0.5 q . k) over the kept keys, times v -> linear_proj.
  Training with sparse_attention.indexer_loss_coeff > 0 adds DSA's sparse-stage indexer loss
  KL(p || softmax(score)) over the kept keys (p: the attention summed over heads, detached; the
  indexer reads detached inputs), attached like the MoE aux loss (or handed to indexer_loss_sink,
  as SparseAttention's); last_indexer_loss keeps it.
With mla.absorbed (the default) the same function runs in DeepSeek's absorbed form through
the fused sparse ops: q_nope . k_nope = (W_UK^T q_nope) . c puts every head on the one latent
kv [kv_layernorm(c) | k_rope] (MQA over C + R channels, v its first C), W_UV maps the latent
output to v's, the indexer's top-k comes from ops.lightning_indexer_topk (equal scores to the
lower key, where HF's torch.topk leaves ties open) and the KL loss from
ops.chunked_indexer_kl_loss: no [T, S] tensor, so long contexts fit
(tests/layers/test_mla_absorbed.py: equal to the HF form). mla.absorbed false keeps HF's form
step for step (its dense [B, T, HI, S] index logits and per-head k/v gathered at the selection
need 384 GiB at DeepSeek-V3.2's shape and T = 4096: benchmarks/results/h200/mla_layer.json).
Config: heads = model.num_attention_heads; dims, rope_theta and the RoPE scaling (mla.rope_type
"default" or "yarn", as HF's _compute_yarn_parameters: ramped inverse frequencies, cos/sin times
the attention factor, and with rope_mscale_all_dim the softmax scale times mscale^2) from the
mla group; topk, index_n_heads and index_head_dim from sparse_attention.
"""

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor, nn

from megatron_moe_hybrid.layers.tp_linears import tp_linear_builders
from megatron_moe_hybrid.ops import sparse_attention as ops
from megatron_moe_hybrid.parallel.recompute import reuse_in_recompute
from megatron_moe_hybrid.parallel.context_parallel import local_layout, token_positions
from megatron_moe_hybrid.parallel.cp_sparse_attention import (
    attach_cp_indexer_loss,
    carry_indexer_loss,
    cp_sparse_attention_core,
)

# DeepSeek's (and HF's) fixed norm epsilon of the q / kv latents and the indexer key,
# independent of the model's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


@dataclass
class MLAttentionSubmodules:
    """HF's projections one to one, so weights copy as they are (tensor parallel size 1)."""

    linear_q_proj: Union[ModuleSpec, type] = ColumnParallelLinear  # q_lora_rank None only
    linear_q_down_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_q_up_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_kv_down_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_kv_up_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_proj: Union[ModuleSpec, type] = RowParallelLinear
    linear_index_q: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_index_k: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_index_weights: Union[ModuleSpec, type] = ColumnParallelLinear


class DeepseekRMSNorm(nn.Module):
    """DeepseekV32RMSNorm: normalised in fp32, cast back, then times weight (initialised to 1)."""

    def __init__(self, dim: int, dtype: torch.dtype, eps: float = _LATENT_NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:  # [..., D]
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(mla) -> tuple[Tensor, float, float]:
    """(inv_freq [R / 2] fp32, cos/sin factor, softmax-scale factor) for the mla config group.

    "yarn" follows transformers' _compute_yarn_parameters op for op (fp32), so converted
    DeepSeek-V3.2 checkpoints keep their logits: frequencies below the beta_slow..beta_fast
    rotation band are divided by the factor, those above are kept, a linear ramp in between."""
    R, base = mla.qk_rope_head_dim, mla.rope_theta
    pos_freqs = base ** (torch.arange(0, R, 2).to(dtype=torch.float) / R)  # [R / 2]
    if mla.rope_type == "default":
        return 1.0 / pos_freqs, 1.0, 1.0
    factor, mscale, mscale_all_dim = mla.rope_factor, mla.rope_mscale, mla.rope_mscale_all_dim
    attention_factor = mla.rope_attention_factor
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        original = mla.rope_original_max_position_embeddings
        return (R * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(mla.rope_beta_fast), correction_dim(mla.rope_beta_slow)
    if mla.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = torch.clamp((torch.arange(R // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by the factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    softmax_factor = _yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return inv_freq, attention_factor, softmax_factor


def rope_cos_sin(
    positions: Tensor, inv_freq: Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[Tensor, Tensor]:
    """[B or 1, T, R / 2] cos and sin, computed in fp32 exactly as DeepseekV32RotaryEmbedding."""
    freqs = positions.float()[..., None] * inv_freq
    return (freqs.cos() * attention_factor).to(dtype), (freqs.sin() * attention_factor).to(dtype)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, heads, R]: pairs (x0, x1), (x2, x3), ... rotated, written as HF's
    apply_rotary_pos_emb_interleave does: [rotated evens | rotated odds]."""
    cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, R / 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, heads, R]: channel i rotated with channel i + R / 2 (the indexer's RoPE)."""
    cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, R / 2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _validate(config) -> None:
    mla = getattr(config, "mla", None)
    sa = getattr(config, "sparse_attention", None)
    if mla is None or sa is None:
        raise ValueError("config.mla and config.sparse_attention are needed; set both groups")
    if mla.q_lora_rank is not None and not mla.q_lora_rank > 0:
        raise ValueError(f"config.mla.q_lora_rank must be > 0 or None (plain q_proj), got {mla.q_lora_rank!r}")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_theta"):
        if not getattr(mla, name) > 0:
            raise ValueError(f"config.mla.{name} must be > 0, got {getattr(mla, name)!r}")
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"config.mla.qk_rope_head_dim must be even for RoPE pairs, got {mla.qk_rope_head_dim}")
    if mla.qk_rope_head_dim > sa.index_head_dim:
        raise ValueError(
            f"config.mla.qk_rope_head_dim={mla.qk_rope_head_dim} must be <= sparse_attention.index_head_dim="
            f"{sa.index_head_dim}: the indexer rotates its first qk_rope_head_dim channels"
        )
    if not (isinstance(sa.topk, int) and sa.topk > 0):
        raise ValueError(f"config.sparse_attention.topk must be a positive int, got {sa.topk!r}")
    if config.tensor_model_parallel_size != 1 or config.sequence_parallel:
        raise ValueError(
            "MLAttention runs with tensor_model_parallel_size 1 and sequence_parallel False only: its "
            "latent projections and indexer are not split over ranks; set parallel.tensor_model_parallel_size 1"
        )


class MLAttention(MegatronModule):
    """Multi-head latent attention over the lightning indexer's top-k causal keys per query."""

    def __init__(
        self,
        config,
        submodules: MLAttentionSubmodules,
        layer_number: int = 1,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        _validate(config)
        self.layer_number = layer_number
        mla, sa = config.mla, config.sparse_attention
        self.num_heads = config.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = mla.q_lora_rank, mla.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.rope_theta = mla.rope_theta
        # Not a buffer: model.to(bf16) would round the frequencies; one fp32 copy per device,
        # computed on the CPU also in a meta-device build (models.materialize keeps it).
        with torch.device("cpu"):
            inv_freq, self.rope_attention_factor, softmax_factor = rope_frequencies(mla)
        self._inv_freq = {inv_freq.device: inv_freq}
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5 * softmax_factor
        self.topk = sa.topk
        self.indexer_fp8 = sa.indexer_fp8
        self.indexer_loss_coeff = sa.indexer_loss_coeff
        self.last_indexer_loss = torch.zeros(())
        self.indexer_loss_sink = None  # or a list: SparseAttention's, the same
        self.index_heads, self.index_dim = sa.index_n_heads, sa.index_head_dim
        self.backend = sa.backend
        self.absorbed = getattr(mla, "absorbed", True)
        dtype, h, H = config.params_dtype, config.hidden_size, self.num_heads
        column, row = tp_linear_builders(config, pg_collection)

        qk_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank is None:
            self.linear_q_proj = column(submodules.linear_q_proj, h, H * qk_dim)
        else:
            self.linear_q_down_proj = column(submodules.linear_q_down_proj, h, self.q_lora_rank)
            self.q_layernorm = DeepseekRMSNorm(self.q_lora_rank, dtype)
            self.linear_q_up_proj = column(submodules.linear_q_up_proj, self.q_lora_rank, H * qk_dim)
        self.linear_kv_down_proj = column(submodules.linear_kv_down_proj, h, self.kv_lora_rank + self.rope_dim)
        self.kv_layernorm = DeepseekRMSNorm(self.kv_lora_rank, dtype)
        self.linear_kv_up_proj = column(submodules.linear_kv_up_proj, self.kv_lora_rank, H * (self.nope_dim + self.v_dim))
        self.linear_proj = row(submodules.linear_proj, H * self.v_dim, h)
        # DeepSeek's indexer reads the q latent; without one (q_lora_rank None, which HF's V3.2
        # does not support) it reads the hidden states instead.
        index_q_in = h if self.q_lora_rank is None else self.q_lora_rank
        self.linear_index_q = column(submodules.linear_index_q, index_q_in, self.index_heads * self.index_dim)
        self.linear_index_k = column(submodules.linear_index_k, h, self.index_dim)
        self.index_k_norm = nn.LayerNorm(self.index_dim, eps=_LATENT_NORM_EPS, dtype=dtype)
        self.linear_index_weights = column(submodules.linear_index_weights, h, self.index_heads)


    def indexer_modules(self) -> tuple:
        """The indexer's modules (SparseAttention's, the same)."""
        return (self.linear_index_q, self.linear_index_k, self.index_k_norm, self.linear_index_weights)

    def indexer_parameters(self) -> list[nn.Parameter]:
        """The indexer's weights: the main loss gives them no gradient (top-k is discrete)."""
        return [p for m in self.indexer_modules() for p in m.parameters()]

    def index_scores(self, x: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """[B, T, S] fp32 indexer scores sum_j w[t, j] relu(q[t, j] . k[s]) (no mask).

        x [B, T, h], q_latent [B, T, Q or h]. The op order copies DeepseekV32Indexer (scores in
        fp32, the same matmuls) so that exact ties resolve as HF resolves them."""
        HI, DI = self.index_heads, self.index_dim
        q, k, w = self.index_inputs(x, q_latent, cos, sin)
        logits = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * DI**-0.5  # [B, T, HI, S]
        w = w.float() * HI**-0.5  # [B, T, HI]
        return torch.matmul(w.unsqueeze(-2), logits.relu()).squeeze(-2)  # [B, T, S]

    def index_inputs(self, x: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The indexer's q [B, T, HI, DI] and k [B, S, DI] (RoPE'd) and weights [B, T, HI],
        unscaled (index_scores applies DI^-0.5 and HI^-0.5)."""
        HI, DI, R = self.index_heads, self.index_dim, self.rope_dim
        q = self.linear_index_q(q_latent)[0].unflatten(-1, (HI, DI))  # [B, T, HI, DI]
        k = self.index_k_norm(self.linear_index_k(x)[0]).unsqueeze(2)  # [B, T, 1, DI]
        q = torch.cat([rope_half(q[..., :R], cos, sin), q[..., R:]], dim=-1)
        k = torch.cat([rope_half(k[..., :R], cos, sin), k[..., R:]], dim=-1).squeeze(2)  # [B, S, DI]
        return q, k, self.linear_index_weights(x)[0]

    @torch.no_grad()
    def index_topk(self, scores: Tensor, readable: Tensor) -> Tensor:
        """[B, T, K] int64 key indices per query (torch.topk over [B, T, S], as HF), -1 where
        the pick is not readable. scores [B, T, S] from index_scores, readable [B or 1, T, S]."""
        B, T, _ = scores.shape
        scores = scores.masked_fill(~readable, float("-inf"))
        indices = scores.topk(min(self.topk, T), dim=-1).indices  # [B, T, K]
        # Early queries have fewer than K readable keys: their extra picks are dropped here.
        picked = readable.expand(B, T, T).gather(-1, indices)
        return indices.masked_fill(~picked, -1)

    def absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """linear_kv_up_proj's weight split per head: W_UK [H, N, C] and W_UV [H, V, C], with an
        unmerged LoRA adapter's delta included (differentiable in the adapter)."""
        H, N, V, C = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        lin = self.linear_kv_up_proj
        base = getattr(lin, "base", lin)
        if getattr(base, "bias", None) is not None:
            raise ValueError("mla.absorbed: linear_kv_up_proj has a bias, which absorbed MLA does not fold in; set mla.absorbed false")
        w = lin.weight
        if hasattr(lin, "delta_weight") and not lin.merged:
            if not isinstance(lin.dropout, nn.Identity):
                raise ValueError(
                    "mla.absorbed: LoRA dropout on linear_kv_up_proj acts on its input, which absorbed MLA "
                    "never forms; set lora.dropout 0 or mla.absorbed false"
                )
            dtype = torch.promote_types(w.dtype, lin.lora_A.dtype)
            w = w.to(dtype) + lin.delta_weight().to(dtype)
        w = w.view(H, N + V, C)
        return w[:, :N], w[:, N:]

    def _absorbed_forward(self, x, q_latent, q, latent, k_rope, cos, sin, cu_seqlens, layout=None):
        """Attention over the one shared latent kv [C + R] (absorbed MLA), through the fused ops.

        q [B, T, H, N + R] (RoPE'd), latent [B, S, C], k_rope [B, S, R] (RoPE'd). q_nope . k_nope
        = (W_UK^T q_nope) . c, so q becomes [W_UK^T q_nope | q_rope] and every head reads
        kv = [kv_layernorm(latent) | k_rope]; the attention's latent output times W_UV is v's.
        The indexer's scales (DI^-0.5 inside the relu, HI^-0.5 on the weights; both positive)
        are folded into its q and weights. Under context parallelism (layout) the latent kv and
        the indexer keys are all-gathered and this rank's queries select among every earlier
        key (cp_sparse_attention_core, as the S layer)."""
        N, C = self.nope_dim, self.kv_lora_rank
        w_uk, w_uv = self.absorbed_weights()
        c = self.kv_layernorm(latent)  # [B, S, C]
        q_abs = torch.einsum("bthn,hnc->bthc", q[..., :N], w_uk.to(q.dtype))
        q_full = torch.cat([q_abs, q[..., N:]], dim=-1)  # [B, T, H, C + R]
        kv = torch.cat([c, k_rope.to(c.dtype)], dim=-1).unsqueeze(2)  # [B, S, 1, C + R]

        train_indexer = self.indexer_loss_coeff > 0 and self.training and torch.is_grad_enabled()
        with torch.set_grad_enabled(train_indexer):  # the indexer reads detached inputs, as in HF
            q_idx, k_idx, w = self.index_inputs(x.detach(), q_latent.detach(), cos, sin)
            q_idx = q_idx * self.index_dim**-0.5
            w = w * self.index_heads**-0.5
        if layout is not None:
            return self._cp_tail(q_full, kv, q_idx, k_idx, w, w_uv, cu_seqlens, layout, train_indexer)
        S = kv.shape[1]
        # [B, T, K] int32, -1 past the readable keys; a recomputed layer's backward reuses its
        # first forward's (parallel/recompute.py)
        indices = reuse_in_recompute(self, "indices", (w, cu_seqlens), lambda: ops.lightning_indexer_topk(
            q_idx.detach(), k_idx.detach(), w.detach(), min(self.topk, S), cu_seqlens=cu_seqlens,
            backend=self.backend, fp8=self.indexer_fp8,
        ))
        target = None
        if train_indexer:  # the KL target too, from the attention's own probabilities where it can
            o, lse, target = ops.sparse_attention_with_target(
                q_full, kv, kv[..., :C], indices, scale=self.scale, backend=self.backend
            )
        else:
            o, lse = ops.sparse_attention(q_full, kv, kv[..., :C], indices, scale=self.scale, backend=self.backend)
        o = torch.einsum("bthc,hvc->bthv", o, w_uv.to(o.dtype))  # [B, T, H, V]
        output, bias = self.linear_proj(o.flatten(2).transpose(0, 1).contiguous())  # [s, b, h]
        if train_indexer:
            loss, _ = ops.chunked_indexer_kl_loss(
                q_full, kv, q_idx, k_idx, w, indices, scale=self.scale, cu_seqlens=cu_seqlens,
                lse=lse.detach(), backend=self.backend, target=target,
            )
            self.last_indexer_loss = loss.detach()
            output = carry_indexer_loss(output, self.indexer_loss_coeff * loss, self.indexer_loss_sink)
        return output, bias

    def _cp_tail(self, q_full, kv, q_idx, k_idx, w, w_uv, cu_seqlens, layout, train_indexer):
        """The absorbed forward's attention and projection under context parallelism (the KL
        loss attached as SparseAttention's: attach_cp_indexer_loss)."""
        C = self.kv_lora_rank
        o, loss = cp_sparse_attention_core(
            q_full, kv, None, q_idx, k_idx, w, layout=layout, topk=min(self.topk, layout.seq_len),
            cu_seqlens=cu_seqlens, indexer_loss=train_indexer, backend=self.backend, scale=self.scale, value_dim=C,
            indexer_fp8=self.indexer_fp8,
        )  # fmt: skip
        o = torch.einsum("bthc,hvc->bthv", o, w_uv.to(o.dtype))  # [B, T, H, V]
        output, bias = self.linear_proj(o.flatten(2).transpose(0, 1).contiguous())  # [s, b, h]
        if train_indexer:
            output, self.last_indexer_loss = attach_cp_indexer_loss(
                output, loss, self.indexer_loss_coeff, layout, self.indexer_loss_sink
            )
        return output, bias

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """hidden_states [s, b, h] -> (output [s, b, h], bias None).

        Always causal: attention_mask and Megatron's rotary embeddings (kwargs) are ignored; RoPE
        positions restart per packed sequence (packed_seq_params.cu_seqlens_q, b == 1) and no
        query reads another sequence. Attention dropout is not applied.
        """
        if kwargs.get("inference_context") is not None:
            raise NotImplementedError("MLAttention keeps no KV cache for decoding")
        s, b, _ = hidden_states.shape
        H, N, R, C = self.num_heads, self.nope_dim, self.rope_dim, self.kv_lora_rank
        layout = local_layout(s, getattr(self.config, "cp_layout", "zigzag"))
        if layout is not None and not self.absorbed:
            raise ValueError("mla.absorbed: context parallelism runs the absorbed form only; set mla.absorbed true")
        if self.absorbed:
            positions, cu_seqlens = _positions_and_cu_seqlens(packed_seq_params, s, b, hidden_states.device, layout)
        else:
            positions, readable = _positions_and_mask(packed_seq_params, s, b, hidden_states.device)
        x = hidden_states.transpose(0, 1)  # [B, T, h]
        if positions.device not in self._inv_freq:
            self._inv_freq[positions.device] = next(iter(self._inv_freq.values())).to(positions.device)
        inv_freq = self._inv_freq[positions.device]
        cos, sin = rope_cos_sin(positions, inv_freq, x.dtype, self.rope_attention_factor)  # [1, T, R / 2]

        if self.q_lora_rank is None:
            q_latent = x
            q = self.linear_q_proj(x)[0]
        else:
            q_latent = self.q_layernorm(self.linear_q_down_proj(x)[0])  # [B, T, Q]
            q = self.linear_q_up_proj(q_latent)[0]
        q = q.unflatten(-1, (H, N + R))  # [B, T, H, N + R]
        q = torch.cat([q[..., :N], rope_interleaved(q[..., N:], cos, sin)], dim=-1)

        latent, k_rope = self.linear_kv_down_proj(x)[0].split([C, R], dim=-1)  # [B, S, C], [B, S, R]
        if self.absorbed:
            k_rope = rope_interleaved(k_rope.unsqueeze(2), cos, sin).squeeze(2)  # [B, S, R]
            return self._absorbed_forward(x, q_latent, q, latent, k_rope, cos, sin, cu_seqlens, layout)
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent))[0].unflatten(-1, (H, N + self.v_dim))
        k_nope, v = kv.split([N, self.v_dim], dim=-1)  # [B, S, H, N], [B, S, H, V]
        k_rope = rope_interleaved(k_rope.unsqueeze(2), cos, sin)  # [B, S, 1, R], shared by the heads
        k = torch.cat([k_nope, k_rope.expand(-1, -1, H, -1)], dim=-1)  # [B, S, H, N + R]

        train_indexer = self.indexer_loss_coeff > 0 and self.training and torch.is_grad_enabled()
        # The indexer learns only from its KL loss: its inputs are cut off from the main model.
        with torch.set_grad_enabled(train_indexer):
            scores = self.index_scores(x.detach(), q_latent.detach(), cos, sin)  # [B, T, S]
        indices = self.index_topk(scores, readable)  # [B, T, K]
        o, _ = ops.sparse_attention(q, k, v, indices, scale=self.scale, backend=self.backend)  # [B, T, H, V]
        output, bias = self.linear_proj(o.flatten(2).transpose(0, 1).contiguous())  # [s, b, h]
        if train_indexer:
            # DSA's sparse stage: KL(p || softmax(I)) over the selected keys, p the main attention
            # summed over heads (detached).
            target = ops.attention_probs_target(q.detach(), k.detach(), indices, scale=self.scale)
            selected = scores.gather(-1, indices.clamp(min=0))  # [B, T, K]
            loss = ops.indexer_kl_loss(selected, target, indices, backend=self.backend)
            self.last_indexer_loss = loss.detach()
            output = carry_indexer_loss(output, self.indexer_loss_coeff * loss, self.indexer_loss_sink)
        return output, bias


def _positions_and_cu_seqlens(packed_seq_params, s: int, b: int, device, layout=None) -> tuple[Tensor, Optional[Tensor]]:
    """[1, T] positions (token_positions') and the packed cu_seqlens on device, or None."""
    positions, cu_seqlens = token_positions(packed_seq_params, s, b, device, layout)
    return positions[None], None if cu_seqlens is None else cu_seqlens.to(device)


def _positions_and_mask(packed_seq_params, s: int, b: int, device) -> tuple[Tensor, Tensor]:
    """[1, T] positions (restarting per packed sequence) and [1, T, S] bool readable keys."""
    positions, cu_seqlens = _positions_and_cu_seqlens(packed_seq_params, s, b, device)
    t = torch.arange(s, device=device)
    causal = t[None, :] <= t[:, None]  # [T, S]
    if cu_seqlens is None:
        return positions, causal[None]
    seg = torch.searchsorted(cu_seqlens[1:], t, right=True)  # [T] sequence id
    return positions, (causal & (seg[None, :] == seg[:, None]))[None]


def _hf_names(module: MLAttention) -> dict[str, Tensor]:
    """HF key (without prefix) -> our parameter."""
    names = {}
    if module.q_lora_rank is None:
        names["q_proj.weight"] = module.linear_q_proj.weight
    else:
        names["q_a_proj.weight"] = module.linear_q_down_proj.weight
        names["q_a_layernorm.weight"] = module.q_layernorm.weight
        names["q_b_proj.weight"] = module.linear_q_up_proj.weight
    names.update({
        "kv_a_proj_with_mqa.weight": module.linear_kv_down_proj.weight,
        "kv_a_layernorm.weight": module.kv_layernorm.weight,
        "kv_b_proj.weight": module.linear_kv_up_proj.weight,
        "o_proj.weight": module.linear_proj.weight,
        "indexer.wq_b.weight": module.linear_index_q.weight,
        "indexer.wk.weight": module.linear_index_k.weight,
        "indexer.k_norm.weight": module.index_k_norm.weight,
        "indexer.k_norm.bias": module.index_k_norm.bias,
        "indexer.weights_proj.weight": module.linear_index_weights.weight,
    })  # fmt: skip
    return names


def load_hf_deepseek_v32_attention(
    module: MLAttention, hf_state_dict: Mapping[str, Tensor], prefix: str = ""
) -> None:
    """Copies a transformers DeepseekV32Attention state dict (keys `prefix + "q_a_proj.weight"`,
    ..., `prefix + "indexer.wq_b.weight"`, ...) into `module`. With q_lora_rank None the q
    projection is DeepSeek-V3's `q_proj.weight`.

    Every key under `prefix` must be used: biases (attention_bias=True) have no place here.
    """
    names = _hf_names(module)
    extra = sorted(k for k in hf_state_dict if k.startswith(prefix) and k[len(prefix):] not in names)
    if extra:
        raise ValueError(
            f"hf_state_dict: unexpected keys {extra}; MLAttention has no biases (convert a checkpoint "
            f"with attention_bias=False) and takes only {sorted(prefix + n for n in names)}"
        )
    missing = sorted(prefix + n for n in names if prefix + n not in hf_state_dict)
    if missing:
        raise ValueError(f"hf_state_dict: missing {missing}")
    with torch.no_grad():
        for name, param in names.items():
            key = prefix + name
            w = hf_state_dict[key]
            if w.shape != param.shape:
                raise ValueError(
                    f"hf_state_dict[{key!r}]: shape {tuple(w.shape)} does not match {tuple(param.shape)}; "
                    "check hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
                    "qk_rope_head_dim, v_head_dim, index_n_heads and index_head_dim against the HF config"
                )
            param.copy_(w.to(param.dtype))
