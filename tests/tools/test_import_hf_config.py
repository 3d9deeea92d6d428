"""tools/import_hf_config.py on configs made by transformers itself."""

import importlib.util
import json
import os

import pytest

from megatron_moe_hybrid.config import config_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("import_hf_config", os.path.join(ROOT, "tools", "import_hf_config.py"))
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

transformers = pytest.importorskip("transformers")


def test_qwen3_next_defaults():
    hf = transformers.Qwen3NextConfig().to_dict()
    ours, unmapped = tool.import_hf_config(hf)
    c = config_from_dict(ours, {"parallel.world_size": 1})
    assert c.pattern == "LLLA" and c.num_layers == hf["num_hidden_layers"]
    fa = c.full_attention
    assert (fa.rope_theta, fa.partial_rotary_factor) == (
        hf["rope_parameters"]["rope_theta"], hf["rope_parameters"]["partial_rotary_factor"])
    assert c.moe.shared_expert_gate and c.moe.norm_topk_prob == hf["norm_topk_prob"]
    assert c.hidden_size == hf["hidden_size"] and c.vocab_size == hf["vocab_size"]
    la = c.linear_attention
    assert (la.num_qk_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim) == (
        hf["linear_num_key_heads"], hf["linear_num_value_heads"], hf["linear_key_head_dim"], hf["linear_value_head_dim"])
    assert (c.moe.num_experts, c.moe.topk, c.moe.ffn_hidden_size) == (
        hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"])
    assert c.moe.shared_expert_ffn_hidden_size == hf["shared_expert_intermediate_size"]
    assert c.num_query_groups == hf["num_key_value_heads"] and c.kv_channels == hf["head_dim"]
    text = "\n".join(unmapped)
    assert "became S" not in text and "rope_parameters" not in text  # A layers take them as they are
    assert "max_position_embeddings" in text


def test_deepseek_v32_small():
    hf = transformers.DeepseekV32Config(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1,
        n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=64, vocab_size=512, n_group=1, topk_group=1,
    ).to_dict()
    ours, unmapped = tool.import_hf_config(hf)
    c = config_from_dict(ours, {"parallel.world_size": 1})
    assert c.pattern == "M" and c.num_layers == 4
    assert (c.mla.q_lora_rank, c.mla.kv_lora_rank, c.mla.qk_nope_head_dim, c.mla.qk_rope_head_dim, c.mla.v_head_dim) == (
        16, 16, 8, 8, 16)
    sa = c.sparse_attention
    assert (sa.topk, sa.index_n_heads, sa.index_head_dim, sa.index_rope_dim) == (64, 4, 16, 8)
    assert (c.moe.num_experts, c.moe.topk, c.moe.first_k_dense, c.moe.score_func) == (8, 2, 1, "sigmoid")
    assert c.moe.shared_expert_ffn_hidden_size == 32 and c.moe.dense_ffn_hidden_size == 96
    text = "\n".join(unmapped)
    assert "kv_lora_rank" not in text and "routed_scaling_factor" not in text  # mapped now
    assert c.moe.routed_scaling_factor == hf["routed_scaling_factor"] and c.moe.norm_topk_prob == hf["norm_topk_prob"]


def test_deepseek_v32_release_yarn_maps_exactly():
    """The released DeepSeek-V3.2 config.json writes yarn in the older rope_scaling form."""
    hf = {"model_type": "deepseek_v32", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "vocab_size": 512,
          "index_n_heads": 4, "index_head_dim": 16, "index_topk": 64, "rope_theta": 10000,
          "max_position_embeddings": 163840, "first_k_dense_replace": 0,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"}}  # fmt: skip
    ours, unmapped = tool.import_hf_config(hf)
    m = config_from_dict(ours, {"parallel.world_size": 1}).mla
    assert (m.rope_type, m.rope_theta, m.rope_factor, m.rope_original_max_position_embeddings) == ("yarn", 10000, 40, 4096)
    assert (m.rope_beta_fast, m.rope_beta_slow, m.rope_mscale, m.rope_mscale_all_dim) == (32, 1, 1.0, 1.0)
    assert not any("rope" in line for line in unmapped if not line.startswith("config.json lacks "))
    hf["rope_scaling"] = {"type": "longrope", "factor": 4.0}
    _, unmapped = tool.import_hf_config(hf)
    assert any("'longrope' is not supported" in line for line in unmapped)


def test_unknown_architecture_and_cli(tmp_path, capsys):
    with pytest.raises(ValueError, match="model_type: unknown architecture 'llama'"):
        tool.import_hf_config({"model_type": "llama"})
    src = tmp_path / "config.json"
    src.write_text(json.dumps(transformers.Qwen3NextConfig(num_hidden_layers=8).to_dict()))
    out = tmp_path / "ours.yaml"
    assert tool.main([str(src), str(out)]) == 0
    assert "# not mapped exactly:" in out.read_text()
    from megatron_moe_hybrid.config import load_config

    c = load_config(str(out), {"parallel.world_size": 1})
    assert c.num_layers == 8
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "gpt2"}))
    assert tool.main([str(bad), str(out)]) == 2
    assert "model_type: unknown architecture" in capsys.readouterr().err


def test_fields_config_json_leaves_out_take_transformers_defaults():
    """A config.json that leaves fields out means transformers' defaults for its model_type (the
    ones its config class derives included, such as layer_types), not ours; a note lists them. A
    config.json of model_type alone imported as our defaults and said "0 fields not mapped"."""
    hf = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
    ours, unmapped = tool.import_hf_config(hf)
    ref = transformers.Qwen3NextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    assert ours["linear_attention"]["num_v_heads"] == ref.linear_num_value_heads
    assert ours["moe"]["num_experts"] == ref.num_experts and ours["model"]["vocab_size"] == ref.vocab_size
    assert ours["model"]["pattern"] == "LLLA" and ours["model"]["layernorm_epsilon"] == ref.rms_norm_eps
    assert unmapped[0].startswith("config.json lacks ") and "linear_num_value_heads" in unmapped[0]
    assert not any(line.endswith(": not mapped") for line in unmapped)
    # DeepSeek-V3.2's first_k_dense_replace default (3) is more than these 2 layers: every layer dense
    ds = {"model_type": "deepseek_v32", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert tool.import_hf_config(ds)[0]["moe"]["first_k_dense"] == 2
