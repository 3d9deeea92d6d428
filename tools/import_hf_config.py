"""Turn a Hugging Face config.json into our YAML, reporting every field it could not map.

    python tools/import_hf_config.py path/to/config.json out.yaml

Known families: Qwen3-Next (`qwen3_next`: Gated DeltaNet + gated full attention (letter A) + MoE) and
DeepSeek-V3.2 (`deepseek_v32`: MLA + DSA sparse attention + MoE). The output loads with
`megatron_moe_hybrid.config.load_config`; the fields it could not represent exactly are
listed on stderr and as comments at the top of the YAML, so nothing is dropped silently.
"""

import argparse
import json
import sys
from typing import Any, Callable

import yaml

# Keys of every transformers config that say nothing about the architecture.
GENERIC_KEYS = {
    "_name_or_path", "architectures", "transformers_version", "model_type", "dtype", "torch_dtype",
    "id2label", "label2id", "output_attentions", "output_hidden_states", "return_dict", "problem_type",
    "is_encoder_decoder", "chunk_size_feed_forward", "use_cache", "bos_token_id", "eos_token_id",
    "pad_token_id", "output_router_logits", "attention_dropout", "hidden_act", "tokenizer_class",
}  # fmt: skip


class Importer:
    def __init__(self, hf: dict):
        self.hf = hf
        self.used: set[str] = set()
        self.notes: list[str] = []
        self.out: dict[str, dict] = {
            "model": {}, "linear_attention": {}, "sparse_attention": {}, "full_attention": {}, "mla": {}, "moe": {}
        }

    def take(self, key: str, group: str, field: str, convert: Callable[[Any], Any] = lambda x: x) -> None:
        if key in self.hf and self.hf[key] is not None:
            self.out[group][field] = convert(self.hf[key])
        self.used.add(key)

    def note(self, key: str, why: str, when: bool = True) -> None:
        """Marks key as handled; reports it (with why) if present and `when` holds."""
        self.used.add(key)
        if key in self.hf and when:
            self.notes.append(f"{key}={self.hf[key]!r}: {why}")

    def unmapped(self) -> list[str]:
        rest = [
            f"{k}={v!r}: not mapped" for k, v in sorted(self.hf.items())
            if k not in self.used and k not in GENERIC_KEYS
        ]
        return self.notes + rest


def _pattern(letters: list[str]) -> str:
    """The shortest unit whose repetition gives the layer letters."""
    n = len(letters)
    for size in range(1, n + 1):
        if n % size == 0 and letters == letters[:size] * (n // size):
            return "".join(letters[:size])
    return "".join(letters)


def _common_model(imp: Importer) -> None:
    imp.take("hidden_size", "model", "hidden_size")
    imp.take("num_hidden_layers", "model", "num_layers")
    imp.take("vocab_size", "model", "vocab_size")
    imp.take("rms_norm_eps", "model", "layernorm_epsilon")
    imp.take("initializer_range", "model", "init_method_std")
    imp.take("num_attention_heads", "model", "num_attention_heads")
    imp.out["model"]["normalization"] = "RMSNorm"
    imp.note("tie_word_embeddings", "tied embeddings are not supported; the output layer is separate",
             when=bool(imp.hf.get("tie_word_embeddings")))
    imp.note("max_position_embeddings", "context length is a training choice: set training.seq_length")
    imp.note("rope_parameters", "RoPE scaling is not configurable; sparse attention uses plain RoPE")
    imp.note("rope_theta", "RoPE base of the main attention is not configurable")
    imp.note("attention_bias", "our projections have no bias", when=bool(imp.hf.get("attention_bias")))
    imp.note("mlp_bias", "our MLPs have no bias", when=bool(imp.hf.get("mlp_bias")))


def import_qwen3_next(hf: dict) -> Importer:
    imp = Importer(hf)
    _common_model(imp)
    layer_types = hf.get("layer_types") or []
    imp.used.add("layer_types")
    letters = ["L" if t == "linear_attention" else "A" for t in layer_types]  # A: gated full attention
    if letters:
        imp.out["model"]["pattern"] = _pattern(letters)
    rope = hf.get("rope_parameters") or {}
    imp.notes = [n for n in imp.notes if not n.startswith("rope_parameters=")]
    if "rope_theta" in rope:
        imp.out["full_attention"]["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope or hf.get("partial_rotary_factor") is not None:
        imp.out["full_attention"]["partial_rotary_factor"] = rope.get(
            "partial_rotary_factor", hf.get("partial_rotary_factor"))
    imp.used.add("partial_rotary_factor")
    if rope.get("rope_type", "default") != "default":
        imp.notes.append(f"rope_parameters={rope!r}: RoPE scaling ({rope['rope_type']}) is not supported; plain RoPE")
    imp.take("num_key_value_heads", "model", "num_query_groups")
    imp.take("head_dim", "model", "kv_channels")
    imp.out["linear_attention"]["variant"] = "gated_delta_rule"
    imp.take("linear_num_key_heads", "linear_attention", "num_qk_heads")
    imp.take("linear_num_value_heads", "linear_attention", "num_v_heads")
    imp.take("linear_key_head_dim", "linear_attention", "head_k_dim")
    imp.take("linear_value_head_dim", "linear_attention", "head_v_dim")
    imp.take("linear_conv_kernel_dim", "linear_attention", "conv_kernel_size")
    imp.take("num_experts", "moe", "num_experts")
    imp.take("num_experts_per_tok", "moe", "topk")
    imp.take("moe_intermediate_size", "moe", "ffn_hidden_size")
    imp.take("shared_expert_intermediate_size", "moe", "shared_expert_ffn_hidden_size")
    imp.take("router_aux_loss_coef", "moe", "aux_loss_coeff")
    imp.take("intermediate_size", "moe", "dense_ffn_hidden_size")
    imp.out["moe"]["score_func"] = "softmax"
    imp.take("norm_topk_prob", "moe", "norm_topk_prob", bool)
    mlp_only = hf.get("mlp_only_layers") or []
    imp.used.add("mlp_only_layers")
    if mlp_only:
        if sorted(mlp_only) == list(range(len(mlp_only))):
            imp.out["moe"]["first_k_dense"] = len(mlp_only)
        else:
            imp.notes.append(f"mlp_only_layers={mlp_only!r}: only a prefix of dense layers is supported")
    imp.note("decoder_sparse_step", "only MoE in every layer after the first dense ones is supported",
             when=hf.get("decoder_sparse_step", 1) != 1)
    if hf.get("shared_expert_intermediate_size"):
        imp.out["moe"]["shared_expert_gate"] = True  # Qwen3-Next scales its shared expert by sigmoid(x w)
    return imp


# HF rope_parameters key -> our mla field, for rope_type "yarn"
_YARN_FIELDS = {
    "factor": "rope_factor", "original_max_position_embeddings": "rope_original_max_position_embeddings",
    "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim", "attention_factor": "rope_attention_factor", "truncate": "rope_truncate",
}  # fmt: skip


def _mla_rope(imp: Importer) -> None:
    """rope_parameters (or the older rope_scaling + rope_theta) -> mla.rope_*; yarn is exact."""
    hf = imp.hf
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    imp.used.add("rope_scaling")
    imp.notes = [n for n in imp.notes if not n.startswith(("rope_parameters=", "rope_theta="))]
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is not None:
        imp.out["mla"]["rope_theta"] = theta
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return
    if rope_type != "yarn":
        imp.notes.append(f"rope_parameters={rope!r}: RoPE scaling {rope_type!r} is not supported (default and yarn are); plain RoPE")
        return
    imp.out["mla"]["rope_type"] = "yarn"
    for key, field in _YARN_FIELDS.items():
        if rope.get(key) is not None:
            imp.out["mla"][field] = rope[key]
    if rope.get("factor") is None and hf.get("max_position_embeddings") and rope.get("original_max_position_embeddings"):
        # HF's rule for a missing factor
        imp.out["mla"]["rope_factor"] = hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
    extra = sorted(set(rope) - set(_YARN_FIELDS) - {"rope_type", "type", "rope_theta"})
    if extra:
        imp.notes.append(f"rope_parameters: {', '.join(extra)} not mapped (yarn takes {', '.join(_YARN_FIELDS)})")


def import_deepseek_v32(hf: dict) -> Importer:
    imp = Importer(hf)
    _common_model(imp)
    imp.out["model"]["pattern"] = "M"  # MLA + the lightning indexer (layers/mla_attention.py)
    imp.used.add("layer_types")
    imp.note("num_key_value_heads", "MLA shares one latent kv over all heads; the field does not apply")
    imp.take("v_head_dim", "model", "kv_channels")
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        imp.take(key, "mla", key)
    imp.used.update({"qk_head_dim", "head_dim"})  # derived: nope + rope, and rope
    _mla_rope(imp)
    imp.take("index_n_heads", "sparse_attention", "index_n_heads")
    imp.take("index_head_dim", "sparse_attention", "index_head_dim")
    imp.take("index_topk", "sparse_attention", "topk")
    imp.take("qk_rope_head_dim", "sparse_attention", "index_rope_dim")
    imp.take("n_routed_experts", "moe", "num_experts")
    imp.take("num_experts_per_tok", "moe", "topk")
    imp.take("moe_intermediate_size", "moe", "ffn_hidden_size")
    # at most every layer: HF's layers below first_k_dense_replace are dense, however many there are
    imp.take("first_k_dense_replace", "moe", "first_k_dense", lambda k: min(k, hf.get("num_hidden_layers", k)))
    imp.take("intermediate_size", "moe", "dense_ffn_hidden_size")
    n_shared = hf.get("n_shared_experts") or 0
    imp.used.add("n_shared_experts")
    if n_shared:
        imp.out["moe"]["shared_expert_ffn_hidden_size"] = n_shared * hf.get("moe_intermediate_size", 0)
    imp.out["moe"]["score_func"] = "sigmoid"
    imp.out["moe"]["expert_bias"] = True
    imp.take("norm_topk_prob", "moe", "norm_topk_prob", bool)
    imp.used.add("mlp_layer_types")
    imp.take("routed_scaling_factor", "moe", "routed_scaling_factor", float)
    imp.take("n_group", "moe", "num_groups")  # group score: the sum of a group's two best (V3)
    imp.take("topk_group", "moe", "topk_groups")
    return imp


IMPORTERS = {"qwen3_next": import_qwen3_next, "deepseek_v32": import_deepseek_v32}


def hf_defaults(hf: dict) -> tuple[dict, str | None]:
    """(the fields config.json leaves out, as transformers' config class gives them for this
    config, derived ones such as layer_types included; a note saying so, or None). A config.json
    means transformers' defaults where it is silent, not ours; without transformers (or a class
    for this model_type) nothing is filled and the note says so."""
    try:
        from transformers import AutoConfig

        full = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"}).to_dict()
    except (ImportError, ValueError, KeyError, TypeError) as e:
        return {}, f"fields absent from config.json take our defaults (transformers could not supply its own: {e})"
    filled = {k: v for k, v in full.items() if k not in hf and k not in GENERIC_KEYS}
    if not filled:
        return {}, None
    return filled, (f"config.json lacks {len(filled)} fields; transformers' defaults for {hf['model_type']} "
                    f"fill them: {', '.join(sorted(filled))}")


def import_hf_config(hf: dict) -> tuple[dict, list[str]]:
    """(our config as a dict of groups, the fields not mapped exactly). Fields config.json leaves
    out take transformers' defaults for its model_type (hf_defaults), and a note lists them."""
    model_type = hf.get("model_type")
    if model_type not in IMPORTERS:
        raise ValueError(
            f"model_type: unknown architecture {model_type!r}; supported: {', '.join(sorted(IMPORTERS))}"
        )
    filled, note = hf_defaults(hf)
    imp = IMPORTERS[model_type]({**filled, **hf})
    out = {k: v for k, v in imp.out.items() if v}
    # a field only the defaults supplied is reported where it cannot be represented (a note), not as
    # "not mapped" (the checkpoint's own config.json did not set it)
    unmapped = [line for line in imp.unmapped() if not (line.endswith(": not mapped") and line.split("=", 1)[0] in filled)]
    return out, ([note] if note else []) + unmapped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config_json")
    parser.add_argument("out_yaml")
    args = parser.parse_args(argv)
    try:
        with open(args.config_json) as f:
            hf = json.load(f)
        ours, unmapped = import_hf_config(hf)
    except (OSError, ValueError) as e:
        print(f"error: {args.config_json}: {e}", file=sys.stderr)
        return 2
    header = [f"# imported from {args.config_json} ({hf.get('model_type')})"]
    header += [f"# not mapped exactly: {line}" for line in unmapped]
    with open(args.out_yaml, "w") as f:
        f.write("\n".join(header) + "\n")
        yaml.safe_dump(ours, f, sort_keys=False)
    for line in unmapped:
        print(f"not mapped exactly: {line}", file=sys.stderr)
    print(f"wrote {args.out_yaml} ({len(unmapped)} fields not mapped exactly)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
