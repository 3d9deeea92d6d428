"""HybridMoEConfig: YAML + dotted overrides, and validate() naming the field and the fix."""

import os
import subprocess
import sys

import pytest
import yaml

from megatron_moe_hybrid.config import (
    ConfigError,
    HybridMoEConfig,
    config_from_dict,
    load_config,
    parse_overrides,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "configs", "tiny.yaml")


def tiny_raw() -> dict:
    with open(TINY) as f:
        return yaml.safe_load(f)


# (id, overrides, environment WORLD_SIZE, the field the message must name)
INVALID = [
    ("experts-not-divisible-by-ep", {"moe.num_experts": 7, "parallel.expert_model_parallel_size": 2}, 2, "moe.num_experts"),
    ("topk-gt-experts", {"moe.topk": 9}, 1, "moe.topk"),
    ("topk-zero", {"moe.topk": 0}, 1, "moe.topk"),
    ("unknown-pattern-letter", {"model.pattern": "LLLX"}, 1, "model.pattern"),
    ("empty-pattern", {"model.pattern": ""}, 1, "model.pattern"),
    ("layers-not-multiple-of-pattern", {"model.num_layers": 6}, 1, "model.num_layers"),
    ("hidden-not-divisible-by-heads", {"model.hidden_size": 66, "model.kv_channels": None}, 1, "model.hidden_size"),
    ("query-groups-not-dividing-heads", {"model.num_query_groups": 3}, 1, "model.num_query_groups"),
    ("sparse-topk-zero", {"sparse_attention.topk": 0}, 1, "sparse_attention.topk"),
    ("sparse-topk-negative", {"sparse_attention.topk": -5}, 1, "sparse_attention.topk"),
    ("lora-rank-zero", {"lora.enabled": True, "lora.rank": 0, "training.init_from": ROOT}, 1, "lora.rank"),
    ("lora-unknown-target", {"lora.enabled": True, "lora.targets": ["experst"], "training.init_from": ROOT}, 1, "lora.targets"),
    ("lora-target-without-its-layer", {"lora.enabled": True, "model.pattern": "SSSS", "training.init_from": ROOT,
                                       "lora.targets": ["linear_attention", "experts"],
                                       "training.tokenizer_model": os.path.join(ROOT, "README.md")}, 1, "lora.targets"),
    ("lora-without-base", {"lora.enabled": True, "training.resume": "none"}, 1, "training.init_from"),
    ("world-not-divisible", {"parallel.expert_model_parallel_size": 2}, 3, "parallel.expert_model_parallel_size"),
    ("negative-lr", {"training.lr": -1e-3}, 1, "training.lr"),
    ("min-lr-above-lr", {"training.min_lr": 1.0}, 1, "training.min_lr"),
    ("missing-data-path", {"training.data_path": "/nonexistent/corpus.txt"}, 1, "training.data_path"),
    ("empty-data-path", {"training.data_path": ""}, 1, "training.data_path"),
    ("unknown-variant", {"linear_attention.variant": "mamba"}, 1, "linear_attention.variant"),
    ("v-heads-not-multiple", {"linear_attention.num_v_heads": 3}, 1, "linear_attention.num_v_heads"),
    ("chunk-not-power-of-two", {"linear_attention.chunk_size": 48}, 1, "linear_attention.chunk_size"),
    ("negative-conv", {"linear_attention.conv_kernel_size": -1}, 1, "linear_attention.conv_kernel_size"),
    ("rope-dim-too-large", {"sparse_attention.index_rope_dim": 64}, 1, "sparse_attention.index_rope_dim"),
    ("unknown-stage", {"sparse_attention.stage": "warmup"}, 1, "sparse_attention.stage"),
    ("fp8-indexer-dim-not-power-of-two", {"sparse_attention.indexer_fp8": True, "sparse_attention.index_head_dim": 24},
     1, "sparse_attention.index_head_dim"),
    ("fp8-indexer-not-bool", {"sparse_attention.indexer_fp8": "yes"}, 1, "sparse_attention.indexer_fp8"),
    ("fp8-indexer-hf-form-mla", {"sparse_attention.indexer_fp8": True, "model.pattern": "LLLM", "mla.absorbed": False},
     1, "sparse_attention.indexer_fp8"),
    ("negative-indexer-coeff", {"sparse_attention.indexer_loss_coeff": -0.1}, 1, "sparse_attention.indexer_loss_coeff"),
    ("unknown-score-func", {"moe.score_func": "tanh"}, 1, "moe.score_func"),
    ("negative-aux-coeff", {"moe.aux_loss_coeff": -1.0}, 1, "moe.aux_loss_coeff"),
    ("capacity-negative", {"moe.capacity_factor": -1.0}, 1, "moe.capacity_factor"),
    ("groups-not-dividing", {"moe.num_groups": 3}, 1, "moe.num_groups"),
    ("topk-groups-too-many", {"moe.num_groups": 2, "moe.topk_groups": 3}, 1, "moe.topk_groups"),
    ("aux-loss-type", {"moe.aux_loss_type": "batch"}, 1, "moe.aux_loss_type"),
    ("first-k-dense-too-many", {"moe.first_k_dense": 9}, 1, "moe.first_k_dense"),
    ("unknown-dispatcher", {"moe.dispatcher": "deepep"}, 1, "moe.dispatcher"),
    ("unknown-permute-backend", {"moe.permute_backend": "cuda"}, 1, "moe.permute_backend"),
    ("unknown-grouped-gemm-backend", {"moe.grouped_gemm_backend": "cutlass"}, 1, "moe.grouped_gemm_backend"),
    ("zero-experts", {"moe.num_experts": 0}, 1, "moe.num_experts"),
    ("tp-unsupported", {"parallel.tensor_model_parallel_size": 2}, 2, "parallel.tensor_model_parallel_size"),
    ("pp-unsupported", {"parallel.pipeline_model_parallel_size": 2}, 2, "parallel.pipeline_model_parallel_size"),
    ("global-batch-not-multiple", {"training.global_batch_size": 6}, 2, "training.global_batch_size"),
    ("zero-seq-length", {"training.seq_length": 0}, 1, "training.seq_length"),
    ("negative-grad-clip", {"training.grad_clip": -1.0}, 1, "training.grad_clip"),
    ("bad-resume", {"training.resume": "sometimes"}, 1, "training.resume"),
    ("offload-fraction-zero", {"memory.offload_fraction": 0.0}, 1, "memory.offload_fraction"),
    ("cp-layout-unknown", {"parallel.cp_layout": "ring"}, 1, "parallel.cp_layout"),
    ("zero-ce-chunk", {"memory.ce_chunk_size": 0}, 1, "memory.ce_chunk_size"),
    ("bad-recompute", {"memory.recompute_layers": -3}, 1, "memory.recompute_layers"),
    ("bad-device", {"training.device": "gpu"}, 1, "training.device"),
    ("unknown-group", {"mooe.num_experts": 8}, 1, "mooe"),
    ("unknown-field-typo", {"moe.num_expert": 8}, 1, "moe.num_expert"),
    ("unknown-model-field", {"model.hiden_size": 8}, 1, "model.hiden_size"),
    ("wrong-type-int", {"moe.num_experts": "eight"}, 1, "moe.num_experts"),
    ("wrong-type-bool", {"lora.enabled": "yes please"}, 1, "lora.enabled"),
    ("unknown-dtype", {"model.params_dtype": "float8"}, 1, "model.params_dtype"),
    ("lora-expert-adapter", {"lora.enabled": True, "lora.expert_adapter": "each", "training.init_from": ROOT}, 1, "lora.expert_adapter"),
    ("lora-bad-regex", {"lora.enabled": True, "lora.target_modules": ["experts("], "training.init_from": ROOT}, 1, "lora.target_modules"),
    ("fsdp-dtype", {"parallel.fsdp_param_dtype": "fp8"}, 1, "parallel.fsdp_param_dtype"),
    ("on-save-error", {"training.on_save_error": "retry"}, 1, "training.on_save_error"),
    ("on-corrupt", {"training.on_corrupt_checkpoint": "skip"}, 1, "training.on_corrupt_checkpoint"),
    ("bad-data-policy", {"training.bad_data": "ignore"}, 1, "training.bad_data"),
    ("zero-bad-steps", {"training.max_consecutive_bad_steps": 0}, 1, "training.max_consecutive_bad_steps"),
    ("unknown-stdlib-package", {"training.data_path": "stdlib:nonexistent_pkg"}, 1, "training.data_path"),
    ("init-from-without-tokenizer", {"training.init_from": ROOT}, 1, "training.tokenizer_model"),
    ("isolate-records-cp-micro-2", {"training.isolate_records": True, "parallel.context_parallel_size": 2}, 2,
     "training.isolate_records"),
    ("tensorboard-dir-empty", {"training.tensorboard_dir": ""}, 1, "training.tensorboard_dir"),
    ("eval-data-missing", {"training.eval_data_path": "/no/such/heldout.txt"}, 1, "training.eval_data_path"),
    ("eval-data-empty", {"training.eval_data_path": ""}, 1, "training.eval_data_path"),
    ("eval-batches-zero", {"training.eval_batches": 0}, 1, "training.eval_batches"),
    ("eval-interval-negative", {"training.eval_interval": -1}, 1, "training.eval_interval"),
    ("lora-dropout-one", {"lora.enabled": True, "lora.dropout": 1.0, "training.init_from": ROOT}, 1, "lora.dropout"),
]


def test_table_is_large_enough():
    assert len(INVALID) >= 25


@pytest.mark.parametrize("overrides,world,field", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_config_names_field(overrides, world, field, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as info:
        config_from_dict(tiny_raw(), overrides)
    message = str(info.value)
    assert message.startswith(field + ":"), message
    assert info.value.field == field
    assert "\n" not in message


def test_typo_lists_closest_names():
    with pytest.raises(ConfigError, match="did you mean 'num_experts'"):
        config_from_dict(tiny_raw(), {"moe.num_expert": 8})
    with pytest.raises(ConfigError, match="did you mean 'moe'"):
        config_from_dict(tiny_raw(), {"mooe.num_experts": 8})


def test_tiny_config_loads_and_is_a_transformer_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    c = load_config(TINY)
    from megatron.core.transformer import TransformerConfig

    assert isinstance(c, HybridMoEConfig) and isinstance(c, TransformerConfig)
    assert c.pattern == "LLLS" and c.num_layers == 4
    assert [c.layer_kind(i) for i in range(4)] == ["L", "L", "L", "S"]
    assert c.moe.num_experts == 8 and c.moe.topk == 2


def test_overrides_parse_and_apply(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ov = parse_overrides(["--moe.num_experts", "4", "--training.lr=1e-3", "--parallel.expert_model_parallel_size", "2",
                          "--lora.targets", "experts,linear_attention"])
    assert ov == {"moe.num_experts": 4, "training.lr": "1e-3", "parallel.expert_model_parallel_size": 2,
                  "lora.targets": "experts,linear_attention"}
    c = config_from_dict(tiny_raw(), ov)
    assert c.moe.num_experts == 4 and c.training.lr == 1e-3 and c.parallel.expert_model_parallel_size == 2
    assert c.lora.targets == ["experts", "linear_attention"]
    assert c.data_parallel_size() == 2


@pytest.mark.parametrize("pattern,kinds", [("LLLS", ["linear_attention", "sparse_attention"]),
                                            ("LLLA", ["linear_attention", "full_attention"]), ("M", ["sparse_attention"])])
def test_default_lora_targets_follow_the_pattern(pattern, kinds, monkeypatch):
    """The default lora.targets, "attention" and experts, validate for every family (a converted
    Qwen3-Next, LLLA, and DeepSeek-V3.2, M, each lacked one of the old default's attention kinds)
    and take the attention kinds the pattern has; a kind named outright must still be there."""
    from megatron_moe_hybrid.registry import expand_lora_targets

    monkeypatch.setenv("WORLD_SIZE", "1")
    over = {"lora.enabled": True, "training.init_from": ROOT, "model.pattern": pattern, "model.num_layers": 4,
            "training.tokenizer_model": os.path.join(ROOT, "README.md")}
    c = config_from_dict(tiny_raw(), over)
    assert c.lora.targets == ["attention", "experts"]
    assert expand_lora_targets(c.lora.targets, c.pattern) == kinds + ["experts"]
    assert expand_lora_targets(["linear_attention", "attention"], c.pattern) == list(dict.fromkeys(["linear_attention", *kinds]))
    missing = "full_attention" if pattern != "LLLA" else "sparse_attention"
    with pytest.raises(ConfigError, match=f"lora.targets: '{missing}' matches no layer"):
        config_from_dict(tiny_raw(), {**over, "lora.targets": [missing]})


def test_round_trip_through_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    from megatron_moe_hybrid.config import save_config

    c = load_config(TINY, {"moe.topk": 3})
    path = tmp_path / "c.yaml"
    save_config(c, str(path))
    c2 = load_config(str(path))
    assert c2.to_dict() == c.to_dict()


def test_cli_bad_config_exits_2_with_one_line():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_moe_hybrid.train", "--config", TINY,
         "--moe.num_experts", "7", "--parallel.expert_model_parallel_size", "2"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "moe.num_experts" in lines[0]


def test_cli_yaml_syntax_and_unwritable_output_dir_exit_2_with_one_line(tmp_path):
    """A YAML syntax error and an output_dir that cannot be created were tracebacks (the second
    on rank 0 only, after the process group had started)."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  pattern: [LLLS\n")
    blocker = tmp_path / "file"
    blocker.write_text("")
    for args, start, where in ((["--config", str(broken)], "error: --config: ", "line 3, column 1"),
                               (["--config", TINY, "--training.output_dir", str(blocker / "run"),
                                 "--parallel.world_size", "1"], "error: training.output_dir: cannot create", "")):
        proc = subprocess.run([sys.executable, "-m", "megatron_moe_hybrid.train", *args], capture_output=True, text=True,
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start) and where in lines[0], lines


def test_cuda_device_without_a_gpu_names_the_field(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="training.device: is 'cuda' but no CUDA device is visible"):
        config_from_dict(tiny_raw(), {"training.device": "cuda"})
