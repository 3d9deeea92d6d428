"""Linear-attention token mixer for Megatron: Qwen3-Next-style Gated DeltaNet or simple GLA.

Shape legend:
  s sequence, b micro-batch, h hidden size: Megatron's [s, b, h] layout at the boundary;
  B = b, T = s inside, in the ops' [B, T, H, D] layout.
  Hk local q/k heads, Hv local v heads (num_* // tensor_model_parallel_size),
  K head_k_dim, V head_v_dim, W conv kernel size, D local width of the fused in_proj.

The fused in_proj output is laid out per tensor-parallel rank as [q | k | v | z | logits]
with q, k [Hk * K], v, z [Hv * V] and per-v-head logits (b, a for Gated DeltaNet; the
decay gate for simple GLA), as in Megatron's GatedDeltaNet: rank r holds heads
r * Hv .. (r + 1) * Hv - 1 of every piece.
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor, nn

from megatron_moe_hybrid.ops.linear_attention import gated_delta_rule, simple_gla
from megatron_moe_hybrid.ops.linear_attention.norms import gated_rms_norm, l2_normalize
from megatron_moe_hybrid.ops.linear_attention.short_conv import causal_conv1d
from megatron_moe_hybrid.parallel.context_parallel import CPLayout, local_layout
from megatron_moe_hybrid.parallel.cp_linear_attention import (
    conv_halo,
    cp_gated_delta_rule,
    cp_simple_gla,
)

# variant -> number of per-v-head logits that follow q, k, v, z in the fused projection
_NUM_HEAD_LOGITS = {"gated_delta_rule": 2, "simple_gla": 1}
# fla's GLA gate normaliser: g = logsigmoid(gate) / 16 keeps the initial decay close to 1
_GLA_GATE_NORMALIZER = 16.0
_L2_NORM_EPS = 1e-6  # fla's l2norm eps, so weights trained with fla transfer unchanged


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass
class LinearAttentionSubmodules:
    in_proj: Union[ModuleSpec, type] = tensor_parallel.ColumnParallelLinear
    out_proj: Union[ModuleSpec, type] = tensor_parallel.RowParallelLinear


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm (one weight of size V shared by all heads) times silu(z), as Qwen3-Next.

    Computed in fp32 (fp64 for fp64 inputs), from x and z read in place (z may be a strided
    view). Under tensor parallelism each rank sees different heads, so the weight's gradient
    must be summed over the tensor-parallel group.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor, z: Tensor, seq_first: bool = False, backend: str = "auto") -> Tensor:
        """x, z [B, T, H, V] -> [B, T, H, V], or [T, B, H, V] with seq_first (ops.linear_attention.norms:
        one fused kernel each way on CUDA)."""
        return gated_rms_norm(x, z, self.weight, self.eps, seq_first=seq_first, backend=backend)


class LinearAttention(MegatronModule):
    """Causal linear attention usable as Megatron's self_attention submodule.

    Gated DeltaNet (variant "gated_delta_rule"): in_proj -> q, k, v, z, b, a; short causal
    depthwise conv + SiLU over q, k, v; L2-normalised q, k repeated from num_qk_heads to
    num_v_heads; beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias);
    o = gated_delta_rule(q, k, v, g, beta) -> RMSNorm(o) * silu(z) -> out_proj.
    Simple GLA (variant "simple_gla"): the same with one gate logit per head,
    g = logsigmoid(gate) / 16, and o = simple_gla(q, k, v, g).
    conv_kernel_size = 0 drops the conv and its SiLU.

    config.linear_attention carries variant, num_qk_heads, num_v_heads, head_k_dim,
    head_v_dim, conv_kernel_size, chunk_size and backend (see ops.linear_attention).
    """

    def __init__(
        self,
        config,
        submodules: LinearAttentionSubmodules,
        layer_number: int = 1,
        **kwargs,
    ):
        super().__init__(config)
        la = config.linear_attention
        tp = config.tensor_model_parallel_size
        _check_config(la, tp)
        self.layer_number = layer_number
        self.variant = la.variant
        self.backend = la.backend
        self.chunk_size = la.chunk_size
        self.num_qk_heads = la.num_qk_heads // tp
        self.num_v_heads = la.num_v_heads // tp
        self.head_k_dim = la.head_k_dim
        self.head_v_dim = la.head_v_dim
        qk_dim = self.num_qk_heads * la.head_k_dim
        v_dim = self.num_v_heads * la.head_v_dim
        num_logits = _NUM_HEAD_LOGITS[la.variant]
        # local widths of q, k, v, z and each per-head logit
        self.split_sizes = [qk_dim, qk_dim, v_dim, v_dim] + [self.num_v_heads] * num_logits
        pg_collection = kwargs.get("pg_collection")
        tp_group = pg_collection.tp if pg_collection is not None else None

        self.in_proj = build_module(
            submodules.in_proj,
            config.hidden_size,
            sum(self.split_sizes) * tp,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            tp_group=tp_group,
        )
        self.conv1d = None
        if la.conv_kernel_size > 0:
            conv_dim = 2 * qk_dim + v_dim
            self.conv1d = nn.Conv1d(
                conv_dim, conv_dim, la.conv_kernel_size, groups=conv_dim, bias=False,
                dtype=config.params_dtype,
            )
            tensor_parallel.set_tensor_model_parallel_attributes(self.conv1d.weight, True, 0, 1)
        if la.variant == "gated_delta_rule":
            # Megatron's GatedDeltaNet init: A ~ U(1, 16), dt_bias = 1
            A = torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(1, 16)
            self.A_log = nn.Parameter(A.log().to(config.params_dtype))
            self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=config.params_dtype))
            for p in (self.A_log, self.dt_bias):
                tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.out_norm = GatedRMSNorm(la.head_v_dim, config.layernorm_epsilon, config.params_dtype)
        self.out_proj = build_module(
            submodules.out_proj,
            v_dim * tp,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=tp_group,
        )

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        """hidden_states [s, b, h] -> (output [s, b, h], None).

        Always causal: attention_mask is ignored (a recurrence has no mask to apply).
        Packed sequences (packed_seq_params with cu_seqlens_q, b == 1) restart the conv and
        the state at every boundary; padded offsets (cu_seqlens_q_padded) are used when given,
        which keeps the real tokens exact because padding follows them. Other Megatron kwargs
        (rotary_pos_emb, attention_bias, ...) are ignored; an inference_context raises, since
        decoding would need a state cache this layer does not keep.

        Under context parallelism (Megatron's context_parallel_size > 1) hidden_states holds
        this rank's pieces of the sequence (CPLayout, kind config.cp_layout, default "zigzag")
        and cu_seqlens stay global: the conv reads a halo from the previous piece and the
        state passes between pieces (parallel.cp_linear_attention).
        """
        if kwargs.get("inference_context") is not None:
            raise NotImplementedError("LinearAttention keeps no state cache for decoding")
        cu_seqlens = _cu_seqlens(packed_seq_params, hidden_states)
        layout = local_layout(hidden_states.shape[0], getattr(self.config, "cp_layout", "zigzag"))
        proj, _ = self.in_proj(hidden_states)  # [s, b, D]
        proj = proj.transpose(0, 1)  # [B, T, D]
        q, k, v, z, *logits = proj.split(self.split_sizes, dim=-1)
        # the conv and the per-head norms follow the op's backend: "torch*" their references
        # (checks), "triton" their kernels, "auto" the kernels on CUDA
        norm_backend = "torch" if self.backend.startswith("torch") else "triton" if self.backend == "triton" else "auto"
        if self.conv1d is not None:
            qkv = proj[..., : sum(self.split_sizes[:3])]  # [B, T, C]: q | k | v, a view
            if layout is None:  # one kernel each way, reading the view in place
                qkv = causal_conv1d(qkv, self.conv1d.weight, cu_seqlens, backend=norm_backend)
            else:
                qkv = self._short_conv(qkv, cu_seqlens, layout)
            q, k, v = qkv.split(self.split_sizes[:3], dim=-1)
        q = l2_normalize(q.unflatten(-1, (self.num_qk_heads, self.head_k_dim)), _L2_NORM_EPS, norm_backend)  # [B, T, Hk, K]
        k = l2_normalize(k.unflatten(-1, (self.num_qk_heads, self.head_k_dim)), _L2_NORM_EPS, norm_backend)  # [B, T, Hk, K]
        # Each q/k head serves num_v_heads // num_qk_heads consecutive v heads (Qwen3-Next).
        # The ops take such grouped heads as they are; context parallelism's fold wants them
        # repeated.
        if layout is not None:
            repeat = self.num_v_heads // self.num_qk_heads
            q = q.repeat_interleave(repeat, dim=2)  # [B, T, Hv, K]
            k = k.repeat_interleave(repeat, dim=2)  # [B, T, Hv, K]
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))  # [B, T, Hv, V]
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))  # [B, T, Hv, V]
        op_kwargs = dict(cu_seqlens=cu_seqlens, chunk_size=self.chunk_size, backend=self.backend)
        if layout is not None:
            op_kwargs["layout"] = layout
        if self.variant == "gated_delta_rule":
            b, a = logits  # [B, T, Hv] each
            beta = b.sigmoid()
            # decay in fp32: softplus / exp of bf16 logits lose the small differences that matter
            g = -_at_least_fp32(self.A_log).exp() * F.softplus(_at_least_fp32(a) + self.dt_bias)
            op = gated_delta_rule if layout is None else cp_gated_delta_rule
            o, _ = op(q, k, v, g, beta, **op_kwargs)  # [B, T, Hv, V]
        else:
            (gate,) = logits  # [B, T, Hv]
            g = F.logsigmoid(_at_least_fp32(gate)) / _GLA_GATE_NORMALIZER
            op = simple_gla if layout is None else cp_simple_gla
            o, _ = op(q, k, v, g, **op_kwargs)  # [B, T, Hv, V]
        y = self.out_norm(o, z, seq_first=True, backend=norm_backend).flatten(2)  # [s, b, Hv * V]
        out, _ = self.out_proj(y)  # [s, b, h]
        return out, None

    def _short_conv(self, x: Tensor, cu_seqlens: Optional[Tensor], layout: CPLayout) -> Tensor:
        """Causal depthwise conv + SiLU over [B, T, C] under context parallelism.

        Each piece's first segment starts from the W - 1 tokens before the piece in global
        order (conv_halo: zero where they belong to an earlier packed sequence); the other
        segments begin a sequence and start from zeros. (Without context parallelism the layer
        calls ops.linear_attention.short_conv.causal_conv1d.)
        """
        weight = self.conv1d.weight  # [C, 1, W]
        halo_len = weight.shape[-1] - 1

        def conv(seg, halo=None):  # token t sees t - W + 1 .. t: the halo, else zeros, before
            seg = F.pad(seg, (halo_len, 0)) if halo is None else torch.cat([halo, seg], dim=-1)
            return F.conv1d(seg, weight, groups=weight.shape[0])

        halos = conv_halo(x, layout, halo_len, cu_seqlens)  # [NPL, B, W - 1, C]
        halos = halos.transpose(2, 3)  # [NPL, B, C, W - 1]
        x = x.transpose(1, 2)  # [B, C, T]
        segs = layout.local_segments(cu_seqlens)
        offsets, firsts = segs.cu_seqlens.tolist(), segs.first_in_piece.tolist()
        y = torch.cat(
            [
                conv(x[..., a:b], halos[a // layout.piece_len] if first else None)
                for a, b, first in zip(offsets[:-1], offsets[1:], firsts)
            ],
            dim=-1,
        )
        return F.silu(y).transpose(1, 2)  # [B, T, C]


def _check_config(la, tp: int) -> None:
    if la.variant not in _NUM_HEAD_LOGITS:
        raise ValueError(
            f"linear_attention.variant: expected one of {sorted(_NUM_HEAD_LOGITS)}, "
            f"got {la.variant!r}"
        )
    if la.num_qk_heads < 1 or la.num_v_heads % la.num_qk_heads:
        raise ValueError(
            f"linear_attention.num_v_heads: must be a multiple of num_qk_heads={la.num_qk_heads}, "
            f"got {la.num_v_heads}"
        )
    if la.num_qk_heads % tp:
        raise ValueError(
            f"linear_attention.num_qk_heads: must be divisible by tensor_model_parallel_size={tp}, "
            f"got {la.num_qk_heads}"
        )
    if la.conv_kernel_size < 0:
        raise ValueError(
            f"linear_attention.conv_kernel_size: expected >= 0 (0 disables the conv), "
            f"got {la.conv_kernel_size}"
        )


def _cu_seqlens(packed_seq_params, hidden_states: Tensor) -> Optional[Tensor]:
    if packed_seq_params is None:
        return None
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    if cu is None:
        return None
    if hidden_states.shape[1] != 1:
        raise ValueError(
            f"packed_seq_params: packed sequences need micro-batch size b == 1, "
            f"got hidden_states of shape {list(hidden_states.shape)}"
        )
    return cu  # as given (any integer dtype): a converted copy per layer would defeat the ops' per-tensor host read


def load_hf_qwen3_next_gdn(module: LinearAttention, hf_state_dict, prefix: str = "") -> None:
    """Copies a transformers Qwen3NextGatedDeltaNet state dict (keys `prefix + "in_proj_qkvz.weight"`,
    ...) into a gated_delta_rule LinearAttention, taking this tensor-parallel rank's heads.

    HF groups its fused projections by q/k head: in_proj_qkvz rows are, per q/k head, [q (K) |
    k (K) | v (R * V) | z (R * V)] and in_proj_ba rows [b (R) | a (R)], R = Hv / Hk. Our in_proj
    is [q | k | v | z | b | a] with each piece over all heads, so the rows are regrouped; the
    conv channels ([q | k | v]), A_log, dt_bias, the norm and out_proj keep HF's order.
    """
    if module.variant != "gated_delta_rule" or module.conv1d is None:
        raise ValueError(
            "module: Qwen3-Next's Gated DeltaNet needs linear_attention.variant='gated_delta_rule' "
            f"and conv_kernel_size > 0, got variant={module.variant!r} with "
            f"{'no' if module.conv1d is None else 'a'} conv"
        )
    from megatron.core import parallel_state

    tp = module.config.tensor_model_parallel_size
    rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    Hk, Hv, K, V = module.num_qk_heads * tp, module.num_v_heads * tp, module.head_k_dim, module.head_v_dim
    R = Hv // Hk
    names = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias",
             "norm.weight", "out_proj.weight")  # fmt: skip
    extra = sorted(k for k in hf_state_dict if k.startswith(prefix) and k[len(prefix):] not in names)
    missing = [prefix + n for n in names if prefix + n not in hf_state_dict]
    if extra or missing:
        raise ValueError(f"hf_state_dict: unexpected keys {extra}, missing keys {missing}")
    sd = {n: hf_state_dict[prefix + n] for n in names}
    hidden = module.config.hidden_size
    expected = {
        "in_proj_qkvz.weight": (Hk * (2 * K + 2 * R * V), hidden),
        "in_proj_ba.weight": (Hk * 2 * R, hidden),
        "conv1d.weight": (2 * Hk * K + Hv * V, 1, module.conv1d.weight.shape[-1]),
        "A_log": (Hv,),
        "dt_bias": (Hv,),
        "norm.weight": (V,),
        "out_proj.weight": (module.out_proj.weight.shape[0], Hv * V),
    }
    for n, shape in expected.items():
        if tuple(sd[n].shape) != shape:
            raise ValueError(
                f"hf_state_dict[{prefix + n!r}]: shape {tuple(sd[n].shape)}, expected {shape}; check "
                "linear_num_key_heads / linear_num_value_heads / linear_key_head_dim / "
                "linear_value_head_dim / linear_conv_kernel_dim against linear_attention.*"
            )

    def mine(w, dim=0):  # this rank's share of a tensor split evenly by heads
        return w.chunk(tp, dim=dim)[rank]

    qkvz = mine(sd["in_proj_qkvz.weight"].unflatten(0, (Hk, -1)))  # [Hk_local, 2K + 2RV, h]
    ba = mine(sd["in_proj_ba.weight"].unflatten(0, (Hk, -1)))  # [Hk_local, 2R, h]
    q, k, v, z = qkvz.split([K, K, R * V, R * V], dim=1)
    b, a = ba.split([R, R], dim=1)
    in_proj = torch.cat([t.flatten(0, 1) for t in (q, k, v, z, b, a)])  # [D, h]
    conv_q, conv_k, conv_v = sd["conv1d.weight"].split([Hk * K, Hk * K, Hv * V])
    conv = torch.cat([mine(conv_q), mine(conv_k), mine(conv_v)])  # [C_local, 1, W]
    with torch.no_grad():
        for param, w in (
            (module.in_proj.weight, in_proj),
            (module.conv1d.weight, conv),
            (module.A_log, mine(sd["A_log"])),
            (module.dt_bias, mine(sd["dt_bias"])),
            (module.out_norm.weight, sd["norm.weight"]),
            (module.out_proj.weight, mine(sd["out_proj.weight"], dim=1)),
        ):
            param.copy_(w.to(param.dtype))
