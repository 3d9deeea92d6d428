"""Convert Hugging Face Qwen3-Next or DeepSeek-V3.2 safetensors to our checkpoint format, and back.

    python tools/convert_checkpoint.py hf-to-ours --hf Qwen3-Next-80B-A3B --out runs/q3n [--format dcp]
    python tools/convert_checkpoint.py ours-to-hf --ckpt runs/q3n --out q3n_hf [--max-shard-gb 5]

hf-to-ours writes a run directory: <out>/config.yaml (tools/import_hf_config.py's mapping) and
<out>/checkpoints/step_00000000/ (training/checkpoint.py's format), or with --format dcp
<out>/dcp/, a torch.distributed.checkpoint whose experts are one [E, ...] tensor per weight
(training/dist_checkpoint.py); either way `training.init_from: <out>` loads it under any
expert-parallel size, each rank reading its share. ours-to-hf takes such a directory (or any
checkpoint of ours) and writes config.json + model.safetensors (or shards with an index) that transformers'
Qwen3NextForCausalLM / DeepseekV32ForCausalLM.from_pretrained loads. The family follows the HF
config's model_type one way and our model.pattern the other (M layers: DeepSeek-V3.2).

Shape legend: h hidden, V vocabulary, E experts, F expert FFN width, Fs shared expert width,
Fd dense MLP width, H / G query / kv heads, D head dim, Hk / Hv linear q-k / v heads,
K / V their head dims, R = Hv / Hk, W conv kernel; MLA: Q / C q / kv latent ranks,
N / Rr / Vm no-rope / rope / value head dims, HI / DI indexer heads / head dim.

What changes between the formats (everything else is a rename):
  - Qwen3-Next's decoder norms (input_layernorm, post_attention_layernorm, model.norm) are
    zero-centered, x * (1 + w); ours are Megatron's torch RMSNorm, x * w: ours = 1 + hf. The
    per-head q/k norms and the Gated DeltaNet output norm keep HF's convention on both sides.
    DeepSeek-V3.2's norms are x * w already and copy as they are.
  - Experts: HF stores experts.<e>.{gate,up,down}_proj.weight ([F, h], [F, h], [h, F]); ours
    experts.weight1.expert<e> [h, 2F] (gate | up columns) and weight2.expert<e> [F, h].
  - Gated DeltaNet: HF groups in_proj_qkvz / in_proj_ba rows by q/k head, ours by piece
    (layers/linear_attention.py:load_hf_qwen3_next_gdn).
  - DeepSeek-V3.2: MLA and its indexer are renames (layers/mla_attention.py); the router's
    e_score_correction_bias is our router.expert_bias; shared_experts.{gate,up}_proj stack into
    shared_experts.linear_fc1. Its multi-token-prediction layers (model.layers.<n>.* for
    n >= num_hidden_layers) are not modelled: they are skipped and the skip is written into
    config.yaml.
In fp32, ours -> HF -> ours is bitwise; HF -> ours -> HF is bitwise except Qwen3-Next's
zero-centered norms, whose w comes back as fl(1 + w) - 1: the scale 1 + w that HF's forward
multiplies by is bitwise the same, w itself moves by at most half an ulp of 1 + w.
"""

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

HF_CONFIG = "config.json"
HF_TOKENIZER = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_CHAT_TEMPLATE = "chat_template.jinja"  # newer releases keep the chat template here, not in the config
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
OUR_CONFIG = "config.yaml"
# Our router keeps its weight and expert bias in fp32 whatever the model dtype (as transformers does).
ROUTER_KEYS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

_spec = importlib.util.spec_from_file_location(
    "import_hf_config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "import_hf_config.py")
)
import_hf_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_hf_config)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_PRECISION = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


# Names and shapes on the HF side.


def _qwen3_next_attention_shapes(config, i: int, p: str) -> dict[str, tuple]:
    h, kind = config.hidden_size, config.layer_kind(i)
    if kind == "L":
        la = config.linear_attention
        Hk, Hv, K, V = la.num_qk_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
        a = p + "linear_attn."
        return {
            a + "in_proj_qkvz.weight": (2 * Hk * K + 2 * Hv * V, h),
            a + "in_proj_ba.weight": (2 * Hv, h),
            a + "conv1d.weight": (2 * Hk * K + Hv * V, 1, la.conv_kernel_size),
            a + "A_log": (Hv,),
            a + "dt_bias": (Hv,),
            a + "norm.weight": (V,),
            a + "out_proj.weight": (h, Hv * V),
        }  # fmt: skip
    if kind == "A":
        H, G, D = config.num_attention_heads, config.num_query_groups or config.num_attention_heads, config.kv_channels
        a = p + "self_attn."
        return {
            a + "q_proj.weight": (2 * H * D, h),  # [query | output gate] per head
            a + "k_proj.weight": (G * D, h),
            a + "v_proj.weight": (G * D, h),
            a + "o_proj.weight": (h, H * D),
            a + "q_norm.weight": (D,),
            a + "k_norm.weight": (D,),
        }  # fmt: skip
    raise ValueError(
        f"model.pattern: layer {i} is {kind!r}; Qwen3-Next has only linear (L) and full (A) "
        "attention layers, so only such configs convert"
    )


def _qwen3_next_moe_shapes(config, m: str) -> dict[str, tuple]:
    h, E, F, Fs = config.hidden_size, config.moe.num_experts, config.moe.ffn_hidden_size, config.moe.shared_expert_ffn_hidden_size
    out = {m + "gate.weight": (E, h)}
    for e in range(E):
        out.update({f"{m}experts.{e}.gate_proj.weight": (F, h), f"{m}experts.{e}.up_proj.weight": (F, h),
                    f"{m}experts.{e}.down_proj.weight": (h, F)})  # fmt: skip
    out.update({
        m + "shared_expert.gate_proj.weight": (Fs, h),
        m + "shared_expert.up_proj.weight": (Fs, h),
        m + "shared_expert.down_proj.weight": (h, Fs),
        m + "shared_expert_gate.weight": (1, h),
    })  # fmt: skip
    return out


def _mla_names(config) -> dict[str, tuple[str, tuple]]:
    """HF attention key (after `self_attn.`) -> (our MLAttention parameter, shape)."""
    mla, sa, h, H = config.mla, config.sparse_attention, config.hidden_size, config.num_attention_heads
    Q, C, N, R, V = mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    HI, DI = sa.index_n_heads, sa.index_head_dim
    return {
        "q_a_proj.weight": ("linear_q_down_proj.weight", (Q, h)),
        "q_a_layernorm.weight": ("q_layernorm.weight", (Q,)),
        "q_b_proj.weight": ("linear_q_up_proj.weight", (H * (N + R), Q)),
        "kv_a_proj_with_mqa.weight": ("linear_kv_down_proj.weight", (C + R, h)),
        "kv_a_layernorm.weight": ("kv_layernorm.weight", (C,)),
        "kv_b_proj.weight": ("linear_kv_up_proj.weight", (H * (N + V), C)),
        "o_proj.weight": ("linear_proj.weight", (h, H * V)),
        "indexer.wq_b.weight": ("linear_index_q.weight", (HI * DI, Q)),
        "indexer.wk.weight": ("linear_index_k.weight", (DI, h)),
        "indexer.k_norm.weight": ("index_k_norm.weight", (DI,)),
        "indexer.k_norm.bias": ("index_k_norm.bias", (DI,)),
        "indexer.weights_proj.weight": ("linear_index_weights.weight", (HI, h)),
    }  # fmt: skip


def _deepseek_v32_attention_shapes(config, i: int, p: str) -> dict[str, tuple]:
    kind = config.layer_kind(i)
    if kind != "M":
        raise ValueError(
            f"model.pattern: layer {i} is {kind!r}; DeepSeek-V3.2 has only MLA (M) layers and Qwen3-Next only "
            "L and A layers, so a pattern of M only, or of L and A only, converts"
        )
    return {f"{p}self_attn.{k}": shape for k, (_, shape) in _mla_names(config).items()}


def _deepseek_v32_moe_shapes(config, m: str) -> dict[str, tuple]:
    h, E, F, Fs = config.hidden_size, config.moe.num_experts, config.moe.ffn_hidden_size, config.moe.shared_expert_ffn_hidden_size
    out = {m + "gate.weight": (E, h), m + "gate.e_score_correction_bias": (E,)}
    for e in range(E):
        out.update({f"{m}experts.{e}.gate_proj.weight": (F, h), f"{m}experts.{e}.up_proj.weight": (F, h),
                    f"{m}experts.{e}.down_proj.weight": (h, F)})  # fmt: skip
    out.update({
        m + "shared_experts.gate_proj.weight": (Fs, h),
        m + "shared_experts.up_proj.weight": (Fs, h),
        m + "shared_experts.down_proj.weight": (h, Fs),
    })  # fmt: skip
    return out


def hf_layer_shapes(config, i: int) -> dict[str, tuple]:
    """HF key -> shape of layer i's tensors, for our config."""
    family = family_of(config)
    h, p = config.hidden_size, f"model.layers.{i}."
    out = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    out.update(family.attention_shapes(config, i, p))
    m = p + "mlp."
    if config.is_moe_layer(i):
        out.update(family.moe_shapes(config, m))
    else:
        Fd = config.moe.dense_ffn_hidden_size
        out.update({m + "gate_proj.weight": (Fd, h), m + "up_proj.weight": (Fd, h), m + "down_proj.weight": (h, Fd)})
    return out


def hf_shapes(config) -> dict[str, tuple]:
    """Every HF key of the model -> its shape."""
    out = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for i in range(config.num_layers):
        out.update(hf_layer_shapes(config, i))
    out["model.norm.weight"] = (config.hidden_size,)
    out["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return out


def _refuse(checks: list, family: str) -> None:
    for ok, name, why in checks:
        if not ok:
            raise ValueError(f"{name}: this config has no {family} equivalent ({why})")


def _check_qwen3_next(config) -> None:
    m, la = config.moe, config.linear_attention
    _refuse([
        (la.variant == "gated_delta_rule" and la.conv_kernel_size > 0, "linear_attention.variant",
         "Qwen3-Next's linear layers are gated_delta_rule with a conv (conv_kernel_size > 0)"),
        (m.score_func == "softmax", "moe.score_func", "Qwen3-Next routes with softmax"),
        (not m.expert_bias and m.num_groups == 1 and m.routed_scaling_factor == 1.0, "moe.expert_bias",
         "Qwen3-Next has no expert bias, group-limited routing or routed scaling"),
        (m.shared_expert_ffn_hidden_size > 0 and m.shared_expert_gate, "moe.shared_expert_gate",
         "Qwen3-Next always has a shared expert scaled by a sigmoid gate"),
        (config.normalization == "RMSNorm" and not config.add_bias_linear, "model.normalization",
         "Qwen3-Next uses RMSNorm and bias-free linears"),
    ], "Qwen3-Next")  # fmt: skip


def _check_deepseek_v32(config) -> None:
    m = config.moe
    _refuse([
        (config.mla.q_lora_rank is not None, "mla.q_lora_rank",
         "DeepSeek-V3.2 always has a q latent, which its indexer reads"),
        (m.score_func == "sigmoid" and m.expert_bias, "moe.score_func",
         "DeepSeek-V3.2 routes with sigmoid scores and an expert bias (moe.expert_bias=True)"),
        (m.shared_expert_ffn_hidden_size > 0 and m.shared_expert_ffn_hidden_size % m.ffn_hidden_size == 0,
         "moe.shared_expert_ffn_hidden_size",
         f"DeepSeek-V3.2's shared experts are n_shared_experts >= 1 times moe.ffn_hidden_size={m.ffn_hidden_size} wide"),
        (not m.shared_expert_gate, "moe.shared_expert_gate", "DeepSeek-V3.2's shared experts have no gate"),
        (config.normalization == "RMSNorm" and not config.add_bias_linear, "model.normalization",
         "DeepSeek-V3.2 uses RMSNorm and bias-free linears"),
    ], "DeepSeek-V3.2")  # fmt: skip


def _check_dense_activation(config, where: str) -> None:
    act = config.activation_func
    if config.moe.first_k_dense and act is not torch.nn.functional.silu:
        raise ValueError(
            f"{where}: {family_of(config).name}'s dense MLP layers are SwiGLU, ours compute "
            f"{getattr(act, '__name__', act)}-GLU (the model's activation_func); dense layers convert "
            "once the config sets activation_func to silu"
        )


def _qwen3_next_config(config) -> dict:
    m, la, fa = config.moe, config.linear_attention, config.full_attention
    return {
        "num_key_value_heads": config.num_query_groups or config.num_attention_heads,
        "head_dim": config.kv_channels,
        "rope_parameters": {"rope_type": "default", "rope_theta": fa.rope_theta,
                            "partial_rotary_factor": fa.partial_rotary_factor},
        "layer_types": ["linear_attention" if config.layer_kind(i) == "L" else "full_attention"
                        for i in range(config.num_layers)],
        "linear_num_key_heads": la.num_qk_heads,
        "linear_num_value_heads": la.num_v_heads,
        "linear_key_head_dim": la.head_k_dim,
        "linear_value_head_dim": la.head_v_dim,
        "linear_conv_kernel_dim": la.conv_kernel_size,
        "num_experts": m.num_experts,
        "shared_expert_intermediate_size": m.shared_expert_ffn_hidden_size,
        "router_aux_loss_coef": m.aux_loss_coeff,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(m.first_k_dense)),
    }  # fmt: skip


def _mla_rope_parameters(mla) -> dict:
    """mla.rope_* -> HF's rope_parameters (the inverse of import_hf_config's _mla_rope)."""
    if mla.rope_type == "default":
        return {"rope_type": "default", "rope_theta": mla.rope_theta}
    rope = {"rope_type": "yarn", "rope_theta": mla.rope_theta}
    for key, field in import_hf_config._YARN_FIELDS.items():
        value = getattr(mla, field)
        if value is not None and not (field in ("rope_mscale", "rope_mscale_all_dim") and value == 0):
            rope[key] = value
    return rope


def _deepseek_v32_config(config) -> dict:
    m, mla, sa = config.moe, config.mla, config.sparse_attention
    return {
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_parameters": _mla_rope_parameters(mla),
        "index_topk": sa.topk,
        "index_n_heads": sa.index_n_heads,
        "index_head_dim": sa.index_head_dim,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": m.shared_expert_ffn_hidden_size // m.ffn_hidden_size,
        "n_group": m.num_groups,
        "topk_group": m.topk_groups,
        "routed_scaling_factor": m.routed_scaling_factor,
        "first_k_dense_replace": m.first_k_dense,
        "mlp_layer_types": ["dense" if i < m.first_k_dense else "sparse" for i in range(config.num_layers)],
        "mlp_bias": False,
    }  # fmt: skip


def export_hf_config(config) -> dict:
    """Our config -> a Qwen3NextConfig or DeepseekV32Config dict (the inverse of
    tools/import_hf_config.py); the family follows model.pattern (M: DeepSeek-V3.2)."""
    family = family_of(config)
    for i in range(config.num_layers):
        family.attention_shapes(config, i, "")  # refuses layer kinds the family does not have
    family.check(config)
    _check_dense_activation(config, f"moe.first_k_dense={config.moe.first_k_dense}")
    m = config.moe
    norm_topk_prob = m.norm_topk_prob if m.norm_topk_prob is not None else m.score_func == "sigmoid"
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "dtype": _DTYPE_NAMES[config.params_dtype],
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.layernorm_epsilon,
        "initializer_range": config.init_method_std,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "num_attention_heads": config.num_attention_heads,
        "num_experts_per_tok": m.topk,
        "moe_intermediate_size": m.ffn_hidden_size,
        "intermediate_size": m.dense_ffn_hidden_size,
        "norm_topk_prob": bool(norm_topk_prob),
        **family.export_config(config),
    }  # fmt: skip


# What differs between the families.


def _fused_experts(get: Callable[[str], torch.Tensor], m: str, num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors (the files' layout) -> the fused layout of transformers' modules."""
    gate_up = torch.stack([
        torch.cat([get(f"{m}experts.{e}.gate_proj.weight"), get(f"{m}experts.{e}.up_proj.weight")])
        for e in range(num_experts)
    ])  # [E, 2F, h]  # fmt: skip
    down = torch.stack([get(f"{m}experts.{e}.down_proj.weight") for e in range(num_experts)])  # [E, h, F]
    return {m + "experts.gate_up_proj": gate_up, m + "experts.down_proj": down}


def _hf_experts(get: Callable[[str], torch.Tensor], num_experts: int, m: str, hm: str) -> dict[str, torch.Tensor]:
    """Our experts of MoE layer m -> HF's per-expert tensors under hm."""
    out = {}
    # every expert's weight1, then every expert's weight2: a dist checkpoint's reader keeps one
    # stacked [E, ...] tensor, and alternating read each whole once per expert
    for e in range(num_experts):
        gate, up = get(f"{m}experts.weight1.expert{e}").t().chunk(2)  # [h, 2F] -> [F, h] each
        out[f"{hm}experts.{e}.gate_proj.weight"] = gate
        out[f"{hm}experts.{e}.up_proj.weight"] = up
    for e in range(num_experts):
        out[f"{hm}experts.{e}.down_proj.weight"] = get(f"{m}experts.weight2.expert{e}").t()  # [h, F]
    return out


def _load_qwen3_next_attention(module, config, i: int, get, p: str) -> None:
    from megatron_moe_hybrid.layers.gated_attention import load_hf_qwen3_next_attention
    from megatron_moe_hybrid.layers.linear_attention import load_hf_qwen3_next_gdn

    sd = {k: get(k) for k in _qwen3_next_attention_shapes(config, i, p)}
    if config.layer_kind(i) == "L":
        load_hf_qwen3_next_gdn(module, sd, prefix=p + "linear_attn.")
    else:
        load_hf_qwen3_next_attention(module, sd, prefix=p + "self_attn.")


def _load_qwen3_next_moe(module, config, get, m: str) -> None:
    from megatron_moe_hybrid.layers.moe.moe_layer import load_hf_qwen3_next_moe

    sd = {k: get(k) for k in _qwen3_next_moe_shapes(config, m) if ".experts." not in k}
    sd.update(_fused_experts(get, m, config.moe.num_experts))
    load_hf_qwen3_next_moe(module, sd, prefix=m)


def _export_qwen3_next_attention(get, config, i: int, o: str, p: str) -> dict[str, torch.Tensor]:
    a = o + "self_attention."
    if config.layer_kind(i) == "L":
        la = config.linear_attention
        Hk, Hv, K, V = la.num_qk_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
        in_proj = get(a + "in_proj.weight")  # [q | k | v | z | b | a] rows, each over all heads
        q, k, v, z, b, a_ = (t.unflatten(0, (Hk, -1)) for t in in_proj.split([Hk * K, Hk * K, Hv * V, Hv * V, Hv, Hv]))
        h = p + "linear_attn."
        return {
            h + "in_proj_qkvz.weight": torch.cat([q, k, v, z], dim=1).flatten(0, 1),  # [Hk * (2K + 2RV), h]
            h + "in_proj_ba.weight": torch.cat([b, a_], dim=1).flatten(0, 1),  # [Hk * 2R, h]
            h + "conv1d.weight": get(a + "conv1d.weight"),
            h + "A_log": get(a + "A_log"),
            h + "dt_bias": get(a + "dt_bias"),
            h + "norm.weight": get(a + "out_norm.weight"),
            h + "out_proj.weight": get(a + "out_proj.weight"),
        }  # fmt: skip
    h = p + "self_attn."
    names = (("linear_q", "q_proj"), ("linear_k", "k_proj"), ("linear_v", "v_proj"), ("linear_proj", "o_proj"),
             ("q_norm", "q_norm"), ("k_norm", "k_norm"))  # fmt: skip
    return {f"{h}{hf}.weight": get(f"{a}{ours}.weight") for ours, hf in names}


def _export_qwen3_next_moe(get, config, m: str, hm: str) -> dict[str, torch.Tensor]:
    out = {hm + "gate.weight": get(m + "router.weight")}
    out.update(_hf_experts(get, config.moe.num_experts, m, hm))
    gate, up = get(m + "shared_experts.linear_fc1.weight").chunk(2)  # [2Fs, h]: gate | up
    out.update({
        hm + "shared_expert.gate_proj.weight": gate,
        hm + "shared_expert.up_proj.weight": up,
        hm + "shared_expert.down_proj.weight": get(m + "shared_experts.linear_fc2.weight"),
        hm + "shared_expert_gate.weight": get(m + "shared_experts.gate_weight"),
    })  # fmt: skip
    return out


def _load_deepseek_v32_attention(module, config, i: int, get, p: str) -> None:
    from megatron_moe_hybrid.layers.mla_attention import load_hf_deepseek_v32_attention

    sd = {k: get(k) for k in _deepseek_v32_attention_shapes(config, i, p)}
    load_hf_deepseek_v32_attention(module, sd, prefix=p + "self_attn.")


def _load_deepseek_v32_moe(module, config, get, m: str) -> None:
    from megatron_moe_hybrid.layers.moe.moe_layer import load_hf_deepseek_v32_moe

    sd = {k: get(k) for k in _deepseek_v32_moe_shapes(config, m) if ".experts." not in k}
    sd.update(_fused_experts(get, m, config.moe.num_experts))
    load_hf_deepseek_v32_moe(module, sd, prefix=m)


def _export_deepseek_v32_attention(get, config, i: int, o: str, p: str) -> dict[str, torch.Tensor]:
    return {f"{p}self_attn.{hf}": get(f"{o}self_attention.{ours}") for hf, (ours, _) in _mla_names(config).items()}


def _export_deepseek_v32_moe(get, config, m: str, hm: str) -> dict[str, torch.Tensor]:
    out = {hm + "gate.weight": get(m + "router.weight"), hm + "gate.e_score_correction_bias": get(m + "router.expert_bias")}
    out.update(_hf_experts(get, config.moe.num_experts, m, hm))
    gate, up = get(m + "shared_experts.linear_fc1.weight").chunk(2)  # [2Fs, h]: gate | up
    out.update({
        hm + "shared_experts.gate_proj.weight": gate,
        hm + "shared_experts.up_proj.weight": up,
        hm + "shared_experts.down_proj.weight": get(m + "shared_experts.linear_fc2.weight"),
    })  # fmt: skip
    return out


def _is_mtp_layer(key: str, config) -> bool:
    """DeepSeek-V3's multi-token-prediction modules are stored as layers past num_hidden_layers."""
    match = re.match(r"model\.layers\.(\d+)\.", key)
    return match is not None and int(match.group(1)) >= config.num_layers


@dataclass(frozen=True)
class Family:
    """What differs between the HF families; embeddings, the two decoder norms, dense SwiGLU MLPs
    (gate_proj / up_proj / down_proj), the final norm and lm_head convert alike."""

    name: str
    model_type: str
    architecture: str
    norm_offset: float  # our decoder norm weight = HF's + norm_offset
    attention_shapes: Callable  # (config, i, "model.layers.<i>.") -> {HF key: shape}
    moe_shapes: Callable  # (config, "model.layers.<i>.mlp.") -> {HF key: shape}
    check: Callable  # (config) -> None; ValueError naming the field the family cannot represent
    export_config: Callable  # (config) -> the family's config.json fields
    load_attention: Callable  # (our attention module, config, i, get HF tensor, HF prefix)
    load_moe: Callable  # (our MoELayer, config, get HF tensor, HF mlp prefix)
    export_attention: Callable  # (get our tensor, config, i, our prefix, HF prefix) -> {HF key: tensor}
    export_moe: Callable  # (get our tensor, config, our mlp prefix, HF mlp prefix) -> {HF key: tensor}
    skipped: Callable  # (HF key, config) -> True for tensors we do not model
    skipped_why: str


FAMILIES = {
    "qwen3_next": Family(
        "Qwen3-Next", "qwen3_next", "Qwen3NextForCausalLM", 1.0,
        _qwen3_next_attention_shapes, _qwen3_next_moe_shapes, _check_qwen3_next, _qwen3_next_config,
        _load_qwen3_next_attention, _load_qwen3_next_moe, _export_qwen3_next_attention, _export_qwen3_next_moe,
        lambda key, config: key.startswith("mtp."), "the multi-token-prediction head (transformers ignores it too)",
    ),
    "deepseek_v32": Family(
        "DeepSeek-V3.2", "deepseek_v32", "DeepseekV32ForCausalLM", 0.0,
        _deepseek_v32_attention_shapes, _deepseek_v32_moe_shapes, _check_deepseek_v32, _deepseek_v32_config,
        _load_deepseek_v32_attention, _load_deepseek_v32_moe, _export_deepseek_v32_attention, _export_deepseek_v32_moe,
        _is_mtp_layer, "the multi-token-prediction layers past num_hidden_layers (transformers ignores them too)",
    ),
}  # fmt: skip


def family_of(config) -> Family:
    """DeepSeek-V3.2 if the pattern has MLA (M) layers, else Qwen3-Next."""
    kinds = {config.layer_kind(i) for i in range(config.num_layers)}
    return FAMILIES["deepseek_v32" if "M" in kinds else "qwen3_next"]


# Reading HF checkpoints.


class HFReader:
    """Lazy reads from a directory of safetensors files, tensors on demand; at most OPEN shards are
    open (mapped) at a time, so a conversion that goes layer by layer holds about one shard."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        self.file_of: dict[str, str] = {}
        index = os.path.join(hf_dir, HF_INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.file_of = dict(json.load(f)["weight_map"])
            for fname in sorted(set(self.file_of.values())):
                if not os.path.isfile(os.path.join(hf_dir, fname)):
                    raise FileNotFoundError(f"{os.path.join(hf_dir, fname)}: shard listed in {index} is missing")
        else:
            files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"{hf_dir}: no {HF_SINGLE}, {HF_INDEX} or *.safetensors file")
            for fname in files:
                with safe_open(os.path.join(hf_dir, fname), framework="pt") as f:
                    self.file_of.update({k: fname for k in f.keys()})
        self._handles: dict[str, object] = {}

    def path(self, key: str) -> str:
        return os.path.join(self.dir, self.file_of[key])

    OPEN = 2  # shards mapped at a time: the layer being converted may straddle two

    def _handle(self, key: str):
        fname = self.file_of[key]
        if fname in self._handles:
            self._handles[fname] = self._handles.pop(fname)  # most recent last
        else:
            while len(self._handles) >= self.OPEN:  # unmap the least recently used shard
                del self._handles[next(iter(self._handles))]
            self._handles[fname] = safe_open(os.path.join(self.dir, fname), framework="pt")
        return self._handles[fname]

    def shape(self, key: str) -> tuple:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)


def _check_hf_tensors(reader: HFReader, config, dtype: torch.dtype, tie: bool) -> None:
    """Every expected tensor is there with its shape and a floating dtype; nothing unknown is."""
    expected = hf_shapes(config)
    if tie and "lm_head.weight" not in reader.file_of:
        del expected["lm_head.weight"]
    missing = [k for k in expected if k not in reader.file_of]
    if missing:
        raise ValueError(
            f"{reader.dir}: tensor {missing[0]!r} is missing from the checkpoint"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; it is expected by config.json"
        )
    family = family_of(config)
    unknown = sorted(k for k in reader.file_of if k not in expected and not family.skipped(k, config))
    if unknown:
        raise ValueError(
            f"{reader.path(unknown[0])}: unexpected tensor {unknown[0]!r}"
            f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; it has no place in a "
            f"{family.name} model of this config.json (biases and quantization scales are not supported)"
        )
    for key, shape in expected.items():
        actual = reader.shape(key)
        if actual != shape:
            raise ValueError(f"{reader.path(key)}: tensor {key!r} has shape {actual}, config.json implies {shape}")
        stored = reader._handle(key).get_slice(key).get_dtype()  # safetensors' name, e.g. "BF16"
        t_dtype = _SAFETENSORS_DTYPES.get(stored)
        if t_dtype is None:
            raise ValueError(f"{reader.path(key)}: tensor {key!r} is {stored}; only float checkpoints convert (dequantize it first)")
        target = torch.promote_types(dtype, torch.float32) if key.endswith(ROUTER_KEYS) else dtype
        if _PRECISION[t_dtype] > _PRECISION[target]:
            raise ValueError(
                f"{reader.path(key)}: tensor {key!r} is {stored}, which {_DTYPE_NAMES[target]} cannot hold "
                "exactly; convert with dtype=torch.float32 (--dtype float32)"
            )


def source_dtype(hf_dir: str) -> torch.dtype:
    """The dtype that holds every tensor of an HF checkpoint exactly (its router's excepted, which
    is held in fp32 anyway): bf16 for a bf16 checkpoint, float32 where dtypes mix or one is wider."""
    reader = HFReader(hf_dir)
    found = set()
    for key in reader.file_of:
        if key.endswith(ROUTER_KEYS):
            continue
        t_dtype = _SAFETENSORS_DTYPES.get(reader._handle(key).get_slice(key).get_dtype())
        if t_dtype is not None:
            found.add(t_dtype)
    if len(found) == 1 and next(iter(found)) in _DTYPE_NAMES:
        return next(iter(found))
    return torch.float32


def _sibling_tmp(out_dir: str) -> str:
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"out_dir: {out_dir} exists and is not empty; choose a new directory")
    return os.path.join(os.path.dirname(out_dir), f".tmp-{os.path.basename(out_dir)}-{os.getpid()}")


def _atomically(out_dir: str, write: Callable[[str], None]) -> str:
    """Runs write(tmp) in a sibling temp dir and renames it to out_dir; nothing is left on error."""
    tmp = _sibling_tmp(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write(tmp)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.abspath(out_dir)


class _SingleProcess:
    """Megatron's parallel_state for building the model: a world-1 group unless one exists."""

    def __enter__(self):
        from megatron.core import parallel_state as ps

        self.owned = not ps.model_parallel_is_initialized()
        if self.owned:
            from megatron_moe_hybrid.testing import init_megatron

            init_megatron()
        elif ps.get_expert_model_parallel_world_size() != 1 or ps.get_tensor_model_parallel_world_size() != 1:
            raise ValueError(
                "hf_to_ours runs with tensor and expert parallel size 1 (the checkpoint it writes loads "
                "under any expert-parallel size); call it outside a parallel run"
            )
        return self

    def __exit__(self, *exc):
        if self.owned:
            from megatron_moe_hybrid.testing import teardown

            teardown()


FORMATS = ("safetensors", "dcp")


def our_raw_config(hf_config: dict, dtype, where: str = "config.json") -> tuple[dict, list[str]]:
    """(our config as a dict of groups, the fields not mapped exactly) for a transformers
    config.json, as hf-to-ours writes it into the run directory (models built in `dtype`)."""
    try:
        raw, unmapped = import_hf_config.import_hf_config(hf_config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if dtype != torch.float32:
        raw["model"]["params_dtype"] = _DTYPE_NAMES[dtype]
    if raw.get("moe", {}).get("first_k_dense"):
        # Megatron 0.16.1's MLP sizes linear_fc2's input by config.ffn_hidden_size whatever
        # ffn_hidden_size the spec passes, so the dense layers need the two to agree.
        raw["model"]["ffn_hidden_size"] = raw["moe"]["dense_ffn_hidden_size"]
    return raw, unmapped


def hf_to_ours(
    hf_dir: str, out_dir: str, dtype: torch.dtype = torch.float32, progress: bool = True, fmt: str = "safetensors"
) -> str:
    """HF Qwen3-Next or DeepSeek-V3.2 (config.json + safetensors) -> a run directory of ours;
    returns its path. fmt "safetensors": our checkpoint (experts by global index); "dcp": a
    torch.distributed.checkpoint under <out>/dcp (experts one [E, ...] tensor). Both load
    under any expert-parallel size (training.init_from).

    The model is built in `dtype` (float32 holds bf16/fp16 checkpoints exactly); a tensor wider
    than `dtype` is refused rather than rounded (the router's, held in fp32, excepted).
    """
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.training.checkpoint import save_checkpoint_streaming

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype: {dtype} is not one of {', '.join(_DTYPE_NAMES.values())}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt: {fmt!r} is not one of {', '.join(FORMATS)}")
    config_path = os.path.join(hf_dir, HF_CONFIG)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path}: missing; hf_dir must hold a transformers config.json")
    with open(config_path) as f:
        hf_config = json.load(f)
    raw, unmapped = our_raw_config(hf_config, dtype, config_path)
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{config_path}: model_type {model_type!r} converts only as far as its config "
            f"(tools/import_hf_config.py); weight conversion supports {', '.join(sorted(FAMILIES))}"
        )
    config = config_from_dict(raw, {"parallel.world_size": 1})
    family = family_of(config)
    dense_key = "mlp_only_layers" if "mlp_only_layers" in hf_config else "mlp_layer_types"
    _check_dense_activation(config, f"{config_path}: {dense_key}={hf_config.get(dense_key)}")
    try:
        exported = export_hf_config(config)  # refuses what the family has and our config cannot say
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from e
    for key in ("mlp_only_layers", "mlp_layer_types"):
        if key in hf_config and hf_config[key] != exported.get(key):
            raise ValueError(
                f"{config_path}: {key}={hf_config[key]!r}: only dense layers first, then MoE layers convert "
                f"(moe.first_k_dense); this would be {exported.get(key)!r}"
            )
    tie = bool(hf_config.get("tie_word_embeddings"))
    reader = HFReader(hf_dir)
    _check_hf_tensors(reader, config, dtype, tie)
    skipped = sorted(k for k in reader.file_of if family.skipped(k, config))

    def norm(key):  # HF's decoder norm -> ours
        w = reader.get(key).to(dtype)
        return family.norm_offset + w if family.norm_offset else w

    with _SingleProcess():
        # The model on the meta device: each part (the embedding, a layer, the head) is made
        # real, filled from the HF tensors, written and dropped in turn, so that only one
        # layer's tensors are ever in memory.
        with torch.device("meta"):
            model = build_model(config)
        expert_names = {n for n, p in model.named_parameters() if hasattr(p, "num_local_experts")}
        shapes = {n: t for n, t in model.state_dict().items() if isinstance(t, torch.Tensor)}

        def part(module, prefix: str, fill) -> dict[str, torch.Tensor]:
            module.to_empty(device="cpu")
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    if t.is_floating_point():
                        t.fill_(float("nan"))  # whatever no HF tensor fills shows, below
                fill()
            out: dict[str, torch.Tensor] = {}
            for n, t in module.state_dict(prefix=prefix).items():
                if not isinstance(t, torch.Tensor):
                    continue
                if n in expert_names:
                    out.update({f"{n}.expert{e}": t[e] for e in range(t.shape[0])})
                else:
                    out[n] = t
            unfilled = sorted(n for n, t in out.items() if t.is_floating_point() and t.isnan().any())
            if unfilled:
                raise ValueError(f"{hf_dir}: no HF tensor fills {', '.join(unfilled[:4])}: this converter misses a "
                                 f"mapping for {family.model_type}")  # fmt: skip
            module.to("meta")  # out keeps the real tensors until they are written
            return out

        def fill_layer(i: int):
            layer, p = model.decoder.layers[i], f"model.layers.{i}."

            def fill():
                layer.input_layernorm.weight.copy_(norm(p + "input_layernorm.weight"))
                layer.pre_mlp_layernorm.weight.copy_(norm(p + "post_attention_layernorm.weight"))
                family.load_attention(layer.self_attention, config, i, reader.get, p)
                m = p + "mlp."
                if config.is_moe_layer(i):
                    family.load_moe(layer.mlp, config, reader.get, m)
                else:
                    layer.mlp.linear_fc1.weight.copy_(torch.cat([reader.get(m + "gate_proj.weight"), reader.get(m + "up_proj.weight")]))
                    layer.mlp.linear_fc2.weight.copy_(reader.get(m + "down_proj.weight"))

            return fill

        head = "model.embed_tokens.weight" if tie and "lm_head.weight" not in reader.file_of else "lm_head.weight"

        def parts():
            yield part(model.embedding, "embedding.",
                       lambda: model.embedding.word_embeddings.weight.copy_(reader.get("model.embed_tokens.weight")))
            for i in tqdm(range(config.num_layers), desc="hf-to-ours layers", disable=not progress):
                yield part(model.decoder.layers[i], f"decoder.layers.{i}.", fill_layer(i))
            yield {**part(model.decoder.final_layernorm, "decoder.final_layernorm.",
                          lambda: model.decoder.final_layernorm.weight.copy_(norm("model.norm.weight"))),
                   **part(model.output_layer, "output_layer.", lambda: model.output_layer.weight.copy_(reader.get(head)))}  # fmt: skip

        def write(tmp):
            meta = {"mode": "converted", "source": os.path.abspath(hf_dir), "source_format": f"hf:{model_type}",
                    "config": config.to_dict()}  # fmt: skip
            if fmt == "dcp":
                from megatron_moe_hybrid.training.dist_checkpoint import DIR, save_dist_checkpoint_streaming

                # Our format first (one layer at a time), then DCP reads it back one tensor at a time.
                stage = save_checkpoint_streaming(os.path.join(tmp, ".stage"), 0, parts(), meta)
                staged = OursReader(stage)

                def fetch(name: str) -> torch.Tensor:
                    if name in expert_names:
                        return torch.stack([staged.get(f"{name}.expert{e}") for e in range(shapes[name].shape[0])])
                    return staged.get(name)

                save_dist_checkpoint_streaming(os.path.join(tmp, DIR), shapes, fetch, meta, sorted(expert_names))
                shutil.rmtree(os.path.join(tmp, ".stage"))
            else:
                save_checkpoint_streaming(tmp, 0, parts(), meta)
            header = [f"# converted from {os.path.abspath(hf_dir)} ({model_type})"]
            header += [f"# not mapped exactly: {line}" for line in unmapped]
            if skipped:
                header.append(f"# skipped {len(skipped)} tensors of {family.skipped_why}: {skipped[0]}, ...")
            if _copy_hf_tokenizer(hf_dir, tmp):  # the model's own, kept with the run; training reads it
                raw.setdefault("training", {})["tokenizer_model"] = os.path.join(os.path.abspath(out_dir), HF_TOKENIZER)
            else:
                header.append(f"# {hf_dir} has no {HF_TOKENIZER}: set training.tokenizer_model before training on text")
            with open(os.path.join(tmp, OUR_CONFIG), "w") as f:
                f.write("\n".join(header) + "\n")
                yaml.safe_dump(raw, f, sort_keys=False)

        return _atomically(out_dir, write)


# Writing HF checkpoints.


class OursReader:
    """Tensors of one checkpoint of ours by global name (experts as `<name>.expert<g>`), CRC-checked."""

    def __init__(self, ckpt_dir: str):
        from megatron_moe_hybrid.training.checkpoint import OPTIMIZER_PREFIX, resolve_checkpoint, verify_files

        self.dir = resolve_checkpoint(ckpt_dir)
        self.meta = verify_files(self.dir)
        self.file_of: dict[str, str] = {}
        self.crc: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        for fname in sorted(self.meta.get("files", {})):
            if fname.endswith(".safetensors") and not fname.startswith(OPTIMIZER_PREFIX):  # the weights only
                with safe_open(os.path.join(self.dir, fname), framework="pt") as handle:
                    self.crc.update(handle.metadata() or {})
                    self.file_of.update({k: fname for k in handle.keys()})

    def _handle(self, fname: str):
        if fname in self._handles:
            self._handles[fname] = self._handles.pop(fname)  # most recent last
        else:
            while len(self._handles) >= HFReader.OPEN:  # files mapped at a time, as HFReader
                del self._handles[next(iter(self._handles))]
            self._handles[fname] = safe_open(os.path.join(self.dir, fname), framework="pt")
        return self._handles[fname]

    def get(self, key: str) -> torch.Tensor:
        if key not in self.file_of:
            raise ValueError(f"{self.dir}: tensor {key!r} is missing from the checkpoint")
        t = self._handle(self.file_of[key]).get_tensor(key)
        crc = f"{zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()):08x}"
        if key in self.crc and crc != self.crc[key]:
            raise ValueError(f"{os.path.join(self.dir, self.file_of[key])}: tensor {key!r} is corrupt (checksum mismatch)")
        return t


def _read_our_config(reader: OursReader):
    from megatron_moe_hybrid.config import config_from_dict

    return config_from_dict(_raw_our_config(reader), {**SINGLE_PROCESS, "lora.enabled": False})


class MergedLoRAReader:
    """OursReader's interface over a LoRA run's checkpoint with every adapter folded into its
    base weight, W + s B A (per expert for the experts' adapters, [h, 2F] / [F, h] there: the
    transpose), under the plain model's names; one tensor at a time, so a model of any size
    merges in the memory of its largest layer. The adapters are found by their names in the
    checkpoint (<module>.lora_A / lora_B; experts lora_A1 / B1 / A2 / B2, per expert or one
    shared), their scale from the run's config (lora.rank, alpha, rslora). The sum is taken in
    the run's model.params_dtype, as the trained model held it. An adapters-only checkpoint
    (lora.adapters_only_checkpoint) takes its base weights from the run's training.init_from."""

    def __init__(self, reader: OursReader):
        from megatron_moe_hybrid.config import config_from_dict
        from megatron_moe_hybrid.layers.lora import lora_scale

        raw = _raw_our_config(reader)
        lo = raw.get("lora") or {}
        if not lo.get("enabled"):
            raise ValueError(f"{reader.dir}: holds LoRA tensors but its config has lora.enabled false; cannot tell "
                             "their rank and scale")
        config = config_from_dict(raw, {**SINGLE_PROCESS, "training.init_from": None, "training.tokenizer_model": None,
                                        "training.resume": "auto"})  # fmt: skip
        self.reader, self.dir, self.meta = reader, reader.dir, reader.meta
        self.scale = lora_scale(config.lora.rank, config.lora.alpha, config.lora.rslora)
        self.dtype = config.params_dtype
        self.base = None  # where the base weights are: this checkpoint, or the run's init_from
        if config.lora.adapters_only_checkpoint:
            init_from = (raw.get("training") or {}).get("init_from")
            if not (init_from and os.path.isdir(init_from)):
                raise ValueError(f"{reader.dir}: an adapters-only checkpoint (lora.adapters_only_checkpoint) whose base, "
                                 f"the run's training.init_from {init_from!r}, is not here; convert from a checkpoint "
                                 "that holds the base too")
            self.base = _ours_reader(init_from)
        # wrapped module path -> "linear" | "experts"
        self.wrapped: dict[str, str] = {}
        for k in reader.file_of:
            path, _, leaf = re.sub(r"\.expert\d+$", "", k).rpartition(".")
            if leaf in ("lora_A", "lora_A1"):
                self.wrapped[path] = "linear" if leaf == "lora_A" else "experts"
        self._shared: tuple[Optional[str], dict] = (None, {})  # the last experts module's shared adapters
        names = set(self.base.file_of) if self.base is not None else set()
        for k in reader.file_of:
            if ".lora_" not in k:
                names.add(self._plain(k))
        self.file_of = dict.fromkeys(sorted(names), "(merged as read)")

    def _plain(self, key: str) -> str:
        for path in self._prefixes(key):
            if key.startswith(path + ".base."):
                return path + key[len(path) + 5:]
        return key

    def _prefixes(self, key: str) -> Iterator[str]:
        parts = key.split(".")
        for n in range(len(parts) - 1, 0, -1):
            path = ".".join(parts[:n])
            if path in self.wrapped:
                yield path

    def _stored(self, key: str, path: Optional[str]) -> torch.Tensor:
        """A base tensor as stored: this checkpoint's <module>.base.<rest> (path: the wrapped
        module key belongs to, or None), or init_from's."""
        if path is not None and self.base is None:
            return self.reader.get(path + ".base" + key[len(path):])
        return (self.base or self.reader).get(key)

    def _adapter(self, path: str, name: str, expert: Optional[int]) -> torch.Tensor:
        if expert is None or f"{path}.{name}.expert{expert}" in self.reader.file_of:
            return self.reader.get(f"{path}.{name}" + ("" if expert is None else f".expert{expert}")).to(self.dtype)
        if self._shared[0] != path:  # one adapter for every expert of the layer: read once
            self._shared = (path, {})
        if name not in self._shared[1]:
            self._shared[1][name] = self.reader.get(f"{path}.{name}").to(self.dtype)
        return self._shared[1][name]

    def get(self, key: str) -> torch.Tensor:
        if key not in self.file_of:
            raise ValueError(f"{self.dir}: tensor {key!r} is missing from the merged model")
        path = next(self._prefixes(key), None)
        w = self._stored(key, path)
        if path is None:
            return w
        rest = key[len(path) + 1:]
        w = w.to(self.dtype)
        with torch.no_grad():
            if self.wrapped[path] == "linear":
                if rest != "weight":
                    return w  # a bias: no adapter
                delta = (self._adapter(path, "lora_B", None) @ self._adapter(path, "lora_A", None)) * self.scale
                return w + delta.to(w.dtype)
            m = re.fullmatch(r"weight([12])\.expert(\d+)", rest)
            if m is None:
                return w
            i, e = m.group(1), int(m.group(2))
            b, a = self._adapter(path, "lora_B" + i, e), self._adapter(path, "lora_A" + i, e)
            return w + ((b @ a).transpose(-1, -2) * self.scale).to(w.dtype)


_ADAPTER_LINEAR = re.compile(r"^(?P<mod>.+)\.lora_(?P<p>[AB])$")
_ADAPTER_EXPERT = re.compile(r"^(?P<mod>.+)\.lora_(?P<p>[AB][12])(?:\.expert(?P<g>\d+))?$")
_HF_EXPERT_KEY = re.compile(r"\.experts\.(?P<g>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class _AdapterProbe:
    """A reader for one layer's export (_hf_layer) in which the chosen keys hold LoRA B factors,
    laid out as the weight they adapt (rows the weight's output rows), and every other key is a
    meta tensor of its shape: the export's row splits and permutations carry the B factors to
    the HF tensors they belong to, and leave the rest on the meta device."""

    def __init__(self, shapes: dict[str, torch.Size], real: dict[str, torch.Tensor]):
        self.shapes, self.real = shapes, real

    def get(self, key: str) -> torch.Tensor:
        if key in self.real:
            return self.real[key]
        if key not in self.shapes:
            raise ValueError(f"config: the model has no {key!r}, which the HF export reads; the run's config does not "
                             "describe the model the adapter was trained on")
        return torch.empty(self.shapes[key], device="meta")


def hf_lora_adapter(tensors: dict[str, torch.Tensor], config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Our adapter (the trainer's adapter file: <module>.lora_A / lora_B; experts lora_A1 / B1 /
    A2 / B2, per expert or one shared) -> {HF module path: (lora_A [r, in], lora_B [out, r])} over
    the transformers model's modules, whose merge W_hf + s B A equals ours-to-hf --merge-lora.

    A fused projection of ours adapts several HF projections with one A: each gets that A and its
    rows of B, as the weight's export splits them (Qwen3-Next's in_proj into in_proj_qkvz and
    in_proj_ba, per head; the experts' gate | up into gate_proj and up_proj; MLA's projections
    one to one). Found by running the weight export itself on the B factors (_AdapterProbe), so
    the mapping is the converter's; a B whose rows the export would mix with its columns is refused.
    """
    from megatron_moe_hybrid.models import build_model

    export_hf_config(config)  # refuses, naming the field, a model the HF families cannot hold
    family = family_of(config)
    with _SingleProcess(), torch.device("meta"):
        model = build_model(config)
    shapes: dict[str, torch.Size] = {}
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            continue
        if re.search(r"\.experts\.weight[12]$", name):
            shapes.update({f"{name}.expert{e}": t.shape[1:] for e in range(t.shape[0])})
        else:
            shapes[name] = t.shape
    linear: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[str, dict[str, dict]] = {}  # experts module -> factor -> {expert or None: tensor}
    for key, t in tensors.items():
        m = _ADAPTER_LINEAR.match(key)
        if m and m["mod"] + ".weight" in shapes:
            linear.setdefault(m["mod"], {})[m["p"]] = t
            continue
        m = _ADAPTER_EXPERT.match(key)
        if m is None or m["mod"] + ".weight1.expert0" not in shapes:
            raise ValueError(f"tensors: {key!r} adapts no module of this model (its config's pattern and sizes)")
        experts.setdefault(m["mod"], {}).setdefault(m["p"], {})[None if m["g"] is None else int(m["g"])] = t
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer_of(path: str) -> int:
        found = re.match(r"decoder\.layers\.(\d+)\.", path)
        if found is None:
            raise ValueError(f"tensors: {path!r} is not inside a decoder layer; only layers' adapters export to HF names")
        return int(found.group(1))

    def derived(i: int, real: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        got = {k: v for k, v in _hf_layer(_AdapterProbe(shapes, real), config, i).items() if v.device.type != "meta"}
        if not got:
            raise ValueError(f"tensors: no HF tensor of layer {i} comes from {sorted(real)[:2]}: the {family.name} "
                             "export does not carry this adapter")
        for k, v in got.items():
            if not k.endswith(".weight") or v.dim() != 2 or v.shape[1] != rank:
                raise ValueError(f"tensors: the export turns the adapter of {sorted(real)[0]} into {k} {tuple(v.shape)}, "
                                 "not rows of B; this projection cannot be adapted under HF names")
        return got

    for path, ab in sorted(linear.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"tensors: {path} has lora_{''.join(sorted(ab))} only; an adapter needs lora_A and lora_B")
        for k, b in derived(layer_of(path), {path + ".weight": ab["B"]}, ab["A"].shape[0]).items():
            out[k[: -len(".weight")]] = (ab["A"], b)
    for path, factors in sorted(experts.items()):
        if set(factors) != {"A1", "B1", "A2", "B2"}:
            raise ValueError(f"tensors: {path} has lora_{sorted(factors)}; the experts' adapter needs A1, B1, A2 and B2")
        count = sum(1 for k in shapes if k.startswith(path + ".weight1.expert"))

        def factor(name, e):
            by_expert = factors[name]
            if e in by_expert:
                return by_expert[e]
            if None in by_expert:
                return by_expert[None]
            raise ValueError(f"tensors: {path}.lora_{name} has no adapter for expert {e}")

        # ours: weight1.expert<e> [h, 2F] += s (B1 A1)^T, weight2.expert<e> [F, h] += s (B2 A2)^T; the
        # export reads weight^T's rows, so the probe holds B^T where the weight is
        real = {}
        for e in range(count):
            real[f"{path}.weight1.expert{e}"] = factor("B1", e).t()
            real[f"{path}.weight2.expert{e}"] = factor("B2", e).t()
        rank = factor("A1", 0).shape[0]
        for k, b in derived(layer_of(path), real, rank).items():
            m = _HF_EXPERT_KEY.search(k)
            if m is None:
                raise ValueError(f"tensors: the export turns {path}'s adapters into {k}, not a per-expert projection")
            a = factor("A2" if m["proj"] == "down_proj" else "A1", int(m["g"]))
            out[k[: -len(".weight")]] = (a, b.contiguous())
    return out


def _ours_reader(path: str):
    """A checkpoint of ours, safetensors or dist, by OursReader's interface."""
    from megatron_moe_hybrid.training.dist_checkpoint import DistCheckpointReader, find_dist_checkpoint

    dist_dir = find_dist_checkpoint(path)
    return OursReader(path) if dist_dir is None else DistCheckpointReader(dist_dir)


# A checkpoint read whole in one process: the layout it was trained with does not matter.
SINGLE_PROCESS = {"parallel.world_size": 1, "parallel.expert_model_parallel_size": 1,
                  "parallel.tensor_model_parallel_size": 1, "parallel.context_parallel_size": 1, "parallel.fsdp": False}


def _run_file(reader, name: str) -> Optional[str]:
    """A file of the run a checkpoint belongs to: in its directory, or the run directory one or two
    levels up (<run>/checkpoints/step_*); None where there is none."""
    for d in (reader.dir, os.path.dirname(reader.dir), os.path.dirname(os.path.dirname(reader.dir))):
        if os.path.isfile(os.path.join(d, name)):
            return os.path.join(d, name)
    return None


def _copy_hf_tokenizer(src_dir: str, dst_dir: str) -> bool:
    """Copies src_dir's Hugging Face tokenizer.json (and tokenizer_config.json, chat_template.jinja)
    into dst_dir; whether there was one."""
    if not os.path.isfile(os.path.join(src_dir, HF_TOKENIZER)):
        return False
    for name in (HF_TOKENIZER, HF_TOKENIZER_CONFIG, HF_CHAT_TEMPLATE):
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return True


def _raw_our_config(reader: OursReader) -> dict:
    raw = reader.meta.get("config")
    if raw is None:  # a checkpoint without its config in meta.json: the run's config.yaml beside it
        path = _run_file(reader, OUR_CONFIG)
        if path is None:
            raise FileNotFoundError(f"{reader.dir}: meta.json holds no config and no {OUR_CONFIG} is beside it")
        with open(path) as f:
            raw = yaml.safe_load(f)
    return raw


def _hf_layer(reader: OursReader, config, i: int) -> dict[str, torch.Tensor]:
    """Layer i of our checkpoint -> its HF tensors."""
    family, get = family_of(config), reader.get
    o, p = f"decoder.layers.{i}.", f"model.layers.{i}."
    out = {
        p + "input_layernorm.weight": _hf_norm(get(o + "input_layernorm.weight"), family),
        p + "post_attention_layernorm.weight": _hf_norm(get(o + "pre_mlp_layernorm.weight"), family),
    }
    out.update(family.export_attention(get, config, i, o, p))
    m, hm = o + "mlp.", p + "mlp."
    if config.is_moe_layer(i):
        out.update(family.export_moe(get, config, m, hm))
    else:
        gate, up = get(m + "linear_fc1.weight").chunk(2)  # Megatron's GLU: [gate | up] rows
        out.update({hm + "gate_proj.weight": gate, hm + "up_proj.weight": up, hm + "down_proj.weight": get(m + "linear_fc2.weight")})
    return out


def _hf_norm(w: torch.Tensor, family: Family) -> torch.Tensor:
    return w - family.norm_offset if family.norm_offset else w


def _hf_tensors(reader: OursReader, config, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    yield "model.embed_tokens.weight", reader.get("embedding.word_embeddings.weight")
    for i in tqdm(range(config.num_layers), desc="ours-to-hf layers", disable=not progress):
        yield from _hf_layer(reader, config, i).items()
    yield "model.norm.weight", _hf_norm(reader.get("decoder.final_layernorm.weight"), family_of(config))
    yield "lm_head.weight", reader.get("output_layer.weight")


def ours_to_hf(ckpt_dir: str, out_dir: str, max_shard_bytes: Optional[int] = None, progress: bool = True,
               merge_lora: bool = False) -> str:
    """A checkpoint of ours (a step dir, or a run dir meaning its newest) -> HF config.json +
    model.safetensors, or shards of at most max_shard_bytes with model.safetensors.index.json.
    merge_lora: a LoRA run's checkpoint is exported with its adapters folded into the base
    weights (MergedLoRAReader, one tensor at a time); without it such a checkpoint is refused.
    Written into a temp dir renamed at the end: after an error nothing is left at out_dir."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: must be > 0 (or None for one file), got {max_shard_bytes}")
    _sibling_tmp(out_dir)  # refuse a non-empty out_dir before any work
    reader = _ours_reader(ckpt_dir)
    config = _read_our_config(reader)
    hf_config = export_hf_config(config)
    expected = hf_shapes(config)
    lora = sorted(k for k in reader.file_of if ".lora_" in k)
    if lora and not merge_lora:
        raise ValueError(f"{reader.dir}: holds LoRA tensors ({lora[0]!r}, ...); pass --merge-lora (merge_lora=True) to "
                         "fold the adapters into the base weights, or export the adapter alone with tools/export_lora.py")
    if lora:
        reader = MergedLoRAReader(reader)

    def write(tmp):
        with open(os.path.join(tmp, HF_CONFIG), "w") as f:
            json.dump(hf_config, f, indent=2)
        # the run's Hugging Face tokenizer, where it has one (a converted model's, kept by its runs)
        tokenizer = _run_file(reader, HF_TOKENIZER)
        if tokenizer is not None:
            _copy_hf_tokenizer(os.path.dirname(tokenizer), tmp)
        shard_keys: list[list[str]] = []  # keys of each shard written so far
        current: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush():
            # A shard is written as soon as it is full: at most one shard is in memory.
            save_file(current, os.path.join(tmp, f"shard-{len(shard_keys) + 1:05d}.safetensors"), metadata={"format": "pt"})
            shard_keys.append(list(current))
            current.clear()

        for key, t in _hf_tensors(reader, config, progress):
            if tuple(t.shape) != expected[key]:
                raise ValueError(f"{reader.dir}: HF tensor {key!r} would have shape {tuple(t.shape)}, expected {expected[key]}")
            nbytes = t.numel() * t.element_size()
            if max_shard_bytes is not None and current and size + nbytes > max_shard_bytes:
                flush()
                size = 0
            current[key] = t.contiguous().clone()  # safetensors refuses views sharing storage
            size += nbytes
            total += nbytes
        flush()
        n = len(shard_keys)
        if n == 1:
            os.replace(os.path.join(tmp, "shard-00001.safetensors"), os.path.join(tmp, HF_SINGLE))
            return
        weight_map = {}
        for j, keys in enumerate(shard_keys, start=1):
            name = f"model-{j:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(tmp, f"shard-{j:05d}.safetensors"), os.path.join(tmp, name))
            weight_map.update({k: name for k in keys})
        with open(os.path.join(tmp, HF_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    return _atomically(out_dir, write)


def main(argv=None) -> int:
    from megatron_moe_hybrid.training.cli import quiet_imports

    quiet_imports()  # Megatron's import-time warnings that TE / Apex are missing
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-ours", help="HF Qwen3-Next or DeepSeek-V3.2 safetensors -> our run directory")
    a.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    a.add_argument("--out", required=True, help="new run directory (config.yaml + checkpoints/)")
    a.add_argument("--dtype", default="auto", choices=["auto", *sorted(_DTYPE_NAMES.values())],
                   help="the dtype our model is built and saved in; auto (default): the checkpoint's own (bf16 "
                        "stays bf16; float32 where dtypes mix). A dtype that cannot hold a tensor exactly is refused")
    a.add_argument("--format", default="safetensors", choices=FORMATS,
                   help="safetensors: our checkpoint format; dcp: torch.distributed.checkpoint (resharding on load)")
    b = sub.add_parser("ours-to-hf", help="our checkpoint -> HF config.json + safetensors")
    b.add_argument("--ckpt", required=True, help="a checkpoint dir, a run dir (its newest checkpoint or its dcp/)")
    b.add_argument("--out", required=True, help="new directory for the HF files")
    b.add_argument("--max-shard-gb", type=float, default=None, help="split into shards of at most this size")
    b.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run's checkpoint: fold its adapters into the base weights (the model is built whole "
                        "in host memory)")
    args = parser.parse_args(argv)
    try:
        if args.command == "hf-to-ours":
            dtype = source_dtype(args.hf) if args.dtype == "auto" else {v: k for k, v in _DTYPE_NAMES.items()}[args.dtype]
            out = hf_to_ours(args.hf, args.out, dtype=dtype, fmt=args.format)
        else:
            shard = None if args.max_shard_gb is None else int(args.max_shard_gb * 2**30)
            out = ours_to_hf(args.ckpt, args.out, max_shard_bytes=shard, merge_lora=args.merge_lora)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
