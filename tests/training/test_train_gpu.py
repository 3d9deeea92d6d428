"""The trainer on a GPU (training.device auto takes it under NCCL): the same run as on the CPU
(models.initialize draws the weights on the CPU and copies them to the device, so both start equal) to fp32-kernel tolerance, resume,
and LoRA fine-tuning from the GPU-trained checkpoint. Run on the H200 with `pytest -m gpu`."""

import os

import pytest

from megatron_moe_hybrid.testing import spawn

pytestmark = pytest.mark.gpu


def _train(rank, world_size, raw, overrides, mode="pretrain"):
    import torch

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import run

    result = run(config_from_dict(raw, overrides), mode)
    on_gpu = torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0
    return {"losses": result.losses, "checkpoint": result.checkpoint, "adapter": result.adapter_dir, "on_gpu": on_gpu,
            "evals": result.eval_losses}


def test_gpu_run_matches_cpu_resumes_and_fine_tunes(corpus, cache_dir, tmp_path, raw_config):
    from megatron_moe_hybrid.training.data import stdlib_corpus

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(stdlib_corpus(max_bytes=60_000, subset="email"))
    steps = {"training.train_steps": 8, "training.warmup_steps": 2, "training.eval_data_path": str(heldout),
             "training.eval_batches": 1}  # fmt: skip
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "cpu"), **steps)
    (cpu,) = spawn(_train, 1, raw, ov)  # gloo: the CPU
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "gpu"), **steps)
    (gpu,) = spawn(_train, 1, raw, ov, backend="nccl")
    assert gpu["on_gpu"] and not cpu["on_gpu"] and len(gpu["losses"]) == 8
    # fp32 on both; on the GPU cuBLAS and the conv/norm kernels (the tiny fp32 shapes keep the
    # Gated DeltaNet and sparse attention on their references there too)
    for a, b in zip(gpu["losses"], cpu["losses"]):
        assert abs(a - b) <= 1e-2 * abs(b), (gpu["losses"], cpu["losses"])
    # the held-out loss at the end, on the device as on the CPU
    assert [s for s, _ in gpu["evals"]] == [8] and abs(gpu["evals"][0][1] - cpu["evals"][0][1]) <= 1e-2 * cpu["evals"][0][1]

    # stop after 4 steps and resume: the same curve as the straight GPU run
    part = str(tmp_path / "part")
    raw, ov = raw_config(corpus, cache_dir, part, **steps, **{"training.exit_after_steps": 4})
    (first,) = spawn(_train, 1, raw, ov, backend="nccl")
    raw, ov = raw_config(corpus, cache_dir, part, **steps)
    (second,) = spawn(_train, 1, raw, ov, backend="nccl")
    resumed = first["losses"] + second["losses"]
    assert len(resumed) == 8
    for a, b in zip(resumed, gpu["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b), (resumed, gpu["losses"])

    # LoRA on the GPU from the GPU-trained checkpoint
    ft = str(tmp_path / "ft")
    raw, ov = raw_config(corpus, cache_dir, ft, **{
        "training.train_steps": 4, "training.init_from": str(tmp_path / "gpu"), "lora.enabled": True,
        "training.tokenizer_model": os.path.join(str(tmp_path / "gpu"), "tokenizer.model"),
        "lora.targets": ["linear_attention", "sparse_attention", "experts"], "training.lr": 1e-2,
    })
    (tuned,) = spawn(_train, 1, raw, ov, "finetune", backend="nccl")
    from safetensors.torch import load_file

    adapter = load_file(os.path.join(tuned["adapter"], "adapter_model.safetensors"))
    assert tuned["on_gpu"] and len(tuned["losses"]) == 4
    assert any(k.endswith("lora_B") and v.abs().sum() > 0 for k, v in adapter.items())


def test_bf16_optimizer_state_on_the_gpu_follows_the_cpu(corpus, cache_dir, tmp_path, raw_config):
    """training.optimizer_state_dtype bf16: the GPU run's curve equals the CPU run's (fp32 weights,
    bf16 moments on both) to the tolerance of the fp32 comparison above."""
    steps = {"training.train_steps": 6, "training.warmup_steps": 2, "training.optimizer_state_dtype": "bf16"}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "cpu"), **steps)
    (cpu,) = spawn(_train, 1, raw, ov)
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "gpu"), **steps)
    (gpu,) = spawn(_train, 1, raw, ov, backend="nccl")
    assert gpu["on_gpu"] and len(gpu["losses"]) == 6 and gpu["losses"][-1] < gpu["losses"][0]
    for a, b in zip(gpu["losses"], cpu["losses"]):
        assert abs(a - b) <= 1e-2 * abs(b), (gpu["losses"], cpu["losses"])
