"""FSDP2 + expert parallelism over spawned gloo processes equals the single-process run.

Layouts: W processes = EP x expert-dp; dense modules are sharded over all W (dp = W),
experts over expert-dp = W / EP. Global batch 8 in every run, so each run sees the same
samples; a checkpoint holds whole tensors under global names whatever the layout.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_moe_hybrid.testing import checkpoint_tensors, spawn

TOL = 1e-5


def _load_training_conftest():
    """The training tests' fixtures (corpus, cache_dir, raw_config) live in their own conftest."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "training", "conftest.py")
    spec = importlib.util.spec_from_file_location("_training_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_conftest = _load_training_conftest()
corpus, cache_dir, raw_config = _conftest.corpus, _conftest.cache_dir, _conftest.raw_config


def _train(rank, world_size, raw, overrides, mode="pretrain"):
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import run

    result = run(config_from_dict(raw, overrides), mode)
    return {"losses": result.losses, "checkpoint": result.checkpoint, "adapter": result.adapter_dir}


def _grad_norms(checkpoint):
    """The logged global gradient norms of a run (its output_dir holds metrics.jsonl)."""
    output_dir = os.path.dirname(os.path.dirname(checkpoint))
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["grad_norm"] for line in f if line.strip()]


def _assert_grad_norms_close(ref_checkpoint, got_checkpoint):
    """Catches a wrong gradient scale that Adam would mostly hide from the losses."""
    ref, got = _grad_norms(ref_checkpoint), _grad_norms(got_checkpoint)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=0, rtol=1e-5)


def _assert_losses_close(ref, got):
    assert len(ref) == len(got), (ref, got)
    for a, b in zip(ref, got):
        assert abs(a - b) <= TOL, (ref, got)


def _assert_tensors_close(ref, got):
    assert ref.keys() == got.keys(), sorted(ref.keys() ^ got.keys())[:5]
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=TOL, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def _layout(world, ep):
    return {"parallel.world_size": world, "parallel.expert_model_parallel_size": ep, "parallel.fsdp": world > 1}


@pytest.fixture(scope="module")
def base_dir(corpus, cache_dir, tmp_path_factory, raw_config):
    """A small pretrained base (3 single-process steps) for the LoRA runs."""
    path = str(tmp_path_factory.mktemp("base"))
    raw, ov = raw_config(corpus, cache_dir, path, **{"training.train_steps": 3, "training.global_batch_size": 8})
    spawn(_train, 1, raw, ov)
    return path


FULL = {"training.train_steps": 3, "training.warmup_steps": 0, "training.global_batch_size": 8}


@pytest.fixture(scope="module")
def single_full(corpus, cache_dir, tmp_path_factory, raw_config):
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path_factory.mktemp("single_full")), **FULL)
    (single,) = spawn(_train, 1, raw, ov)
    assert single["losses"][0] != single["losses"][-1]  # the comparison covers optimizer updates
    return single


@pytest.mark.distributed
@pytest.mark.parametrize("world,ep", [pytest.param(2, 1, id="W2-DP2-EP1", marks=pytest.mark.slow), pytest.param(2, 2, id="W2-DP2-EP2")])
def test_full_training_with_resume_equals_single_process(world, ep, single_full, corpus, cache_dir, tmp_path, raw_config):
    """Stops after 2 steps and resumes: the sharded optimizer state must round-trip."""
    out = str(tmp_path / "fsdp")
    raw, ov = raw_config(corpus, cache_dir, out, **FULL, **_layout(world, ep), **{"training.exit_after_steps": 2})
    first = spawn(_train, world, raw, ov)
    raw, ov = raw_config(corpus, cache_dir, out, **FULL, **_layout(world, ep))
    second = spawn(_train, world, raw, ov)
    assert len(first[0]["losses"]) == 2 and len(second[0]["losses"]) == 1
    assert all(r["losses"] == second[0]["losses"] for r in second)  # the logged loss is the global mean
    _assert_losses_close(single_full["losses"], first[0]["losses"] + second[0]["losses"])
    _assert_grad_norms_close(single_full["checkpoint"], second[0]["checkpoint"])
    # The last update used the resumed Adam moments; a lost state would move the weights.
    _assert_tensors_close(checkpoint_tensors(single_full["checkpoint"]), checkpoint_tensors(second[0]["checkpoint"]))


@pytest.mark.distributed
@pytest.mark.parametrize("before,after", [pytest.param((2, 2), (1, 1), id="W2-EP2-FSDP-to-W1"),
                                          pytest.param((1, 1), (2, 2), id="W1-to-W2-EP2-FSDP", marks=pytest.mark.slow)])
def test_resume_under_another_layout_equals_single_process(before, after, single_full, corpus, cache_dir, tmp_path,
                                                           raw_config, capfd):
    """A run stopped after 2 steps resumes under another world size, expert parallel and FSDP2:
    the weights and the Adam moments are resharded (the last update uses the moments), the step
    counts and data position carried over, and the run equals the single-process one."""
    out = str(tmp_path / "run")
    raw, ov = raw_config(corpus, cache_dir, out, **FULL, **_layout(*before), **{"training.exit_after_steps": 2})
    first = spawn(_train, before[0], raw, ov)
    raw, ov = raw_config(corpus, cache_dir, out, **FULL, **_layout(*after))
    second = spawn(_train, after[0], raw, ov)
    assert f"saved with world size {before[0]} and expert parallel {before[1]}: its weights and optimizer " \
           "moments resharded" in capfd.readouterr().out
    assert len(first[0]["losses"]) == 2 and len(second[0]["losses"]) == 1
    _assert_losses_close(single_full["losses"], first[0]["losses"] + second[0]["losses"])
    _assert_grad_norms_close(single_full["checkpoint"], second[0]["checkpoint"])
    ref, got = checkpoint_tensors(single_full["checkpoint"]), checkpoint_tensors(second[0]["checkpoint"])
    assert any(k.startswith("optimizer.exp_avg_sq.") for k in got)  # the moments are compared too
    _assert_tensors_close(ref, got)


@pytest.mark.distributed
def test_dense_warmup_equals_single_process(corpus, cache_dir, tmp_path, raw_config):
    """sparse_attention.stage dense_warmup over FSDP2 + EP=2: the frozen majority sharded beside the
    indexers, which alone train, from the KL losses the trainer backwards by themselves (no
    gradient reaches a module's output, so FSDP2 must still reduce the indexers' gradients)."""
    warm = {**FULL, "sparse_attention.stage": "dense_warmup", "training.lr": 1e-2}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "single"), **warm)
    (single,) = spawn(_train, 1, raw, ov)
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "fsdp"), **warm, **_layout(2, 2))
    got = spawn(_train, 2, raw, ov)
    _assert_losses_close(single["losses"], got[0]["losses"])
    _assert_grad_norms_close(single["checkpoint"], got[0]["checkpoint"])
    ref, tensors = checkpoint_tensors(single["checkpoint"]), checkpoint_tensors(got[0]["checkpoint"])
    _assert_tensors_close(ref, tensors)
    kl = [[json.loads(line)["indexer_kl_loss"] for line in open(os.path.join(str(tmp_path / d), "metrics.jsonl"))]
          for d in ("single", "fsdp")]
    torch.testing.assert_close(torch.tensor(kl[1]), torch.tensor(kl[0]), atol=0, rtol=1e-5)
    assert kl[0][-1] < kl[0][0] and min(_grad_norms(single["checkpoint"])) > 0


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_optimizer_state_with_resume_equals_single_process(corpus, cache_dir, tmp_path, raw_config):
    """training.optimizer_state_dtype bf16 over FSDP2 + EP=2 (DTensor moments, saved as local
    shards, resumed) against the single-process bf16-state run."""
    bf16 = {**FULL, "training.optimizer_state_dtype": "bf16", "training.lr": 1e-3}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "single"), **bf16)
    (single,) = spawn(_train, 1, raw, ov)
    out = str(tmp_path / "fsdp")
    raw, ov = raw_config(corpus, cache_dir, out, **bf16, **_layout(2, 2), **{"training.exit_after_steps": 2})
    first = spawn(_train, 2, raw, ov)
    raw, ov = raw_config(corpus, cache_dir, out, **bf16, **_layout(2, 2))
    second = spawn(_train, 2, raw, ov)
    _assert_losses_close(single["losses"], first[0]["losses"] + second[0]["losses"])
    # fp32 reduction-order noise can flip a moment's bf16 rounding (one step: 0.4%), which Adam
    # turns into up to ~lr / 10 on elements with near-zero gradients: a few elements only
    ref, got = checkpoint_tensors(single["checkpoint"]), checkpoint_tensors(second[0]["checkpoint"])
    assert ref.keys() == got.keys()
    off = total = 0
    for name in ref:
        diff = (got[name].float() - ref[name].float()).abs()
        assert float(diff.max()) <= 1e-4, (name, float(diff.max()))
        off += int((diff > TOL).sum())
        total += diff.numel()
    assert off <= 1e-4 * total, (off, total)
    # the saved moments are bf16 (half the bytes of fp32 state), beside the weights
    moments = [v for k, v in checkpoint_tensors(first[0]["checkpoint"]).items() if k.startswith("optimizer.exp_avg")]
    assert moments and all(v.dtype == torch.bfloat16 for v in moments)


def _lora_overrides(base_dir, **extra):
    return {
        "training.train_steps": 5, "training.warmup_steps": 0, "training.global_batch_size": 8,
        # Adam turns near-zero gradients into lr-sized steps, so fp32 reduction-order noise
        # moves such elements by ~lr x noise: a small lr keeps that below the tolerance.
        "training.init_from": base_dir, "training.lr": 1e-3,
        "training.tokenizer_model": os.path.join(base_dir, "tokenizer.model"),
        "lora.enabled": True, "lora.targets": ["linear_attention", "sparse_attention", "experts"],
        **extra,
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_ep2_dp2_equals_single_process(base_dir, corpus, cache_dir, tmp_path, raw_config):
    from megatron_moe_hybrid.training.checkpoint import latest_checkpoint

    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "single"), **_lora_overrides(base_dir))
    (single,) = spawn(_train, 1, raw, ov, "finetune")
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "fsdp"), **_lora_overrides(base_dir), **_layout(4, 2))
    runs = spawn(_train, 4, raw, ov, "finetune")
    _assert_losses_close(single["losses"], runs[0]["losses"])
    _assert_grad_norms_close(single["checkpoint"], runs[0]["checkpoint"])
    assert single["losses"][0] != single["losses"][-1]

    ref_adapter = load_file(os.path.join(single["adapter"], "adapter_model.safetensors"))
    got_adapter = load_file(os.path.join(runs[0]["adapter"], "adapter_model.safetensors"))
    _assert_tensors_close(ref_adapter, got_adapter)
    assert any(k.endswith("lora_B1.expert7") for k in got_adapter), sorted(got_adapter)[:5]
    assert all(v.abs().sum() > 0 for k, v in got_adapter.items() if "lora_B" in k)  # every adapter trained

    # Only adapters changed: every other weight of the fine-tuned checkpoint is the base's, and
    # the optimizer's moments are the adapters' only.
    base = checkpoint_tensors(latest_checkpoint(base_dir), "model")
    moments = list(checkpoint_tensors(runs[0]["checkpoint"], "optimizer"))
    assert moments and all("lora_" in k for k in moments), [k for k in moments if "lora_" not in k][:5]
    tuned = checkpoint_tensors(runs[0]["checkpoint"], "model")
    frozen = {k: v for k, v in tuned.items() if "lora_" not in k}
    assert len(frozen) == len(base)
    for name, value in frozen.items():
        base_name = name.replace(".base.", ".")
        assert torch.equal(value, base[base_name]), name


@pytest.mark.distributed
@pytest.mark.slow
def test_shared_expert_adapter_ep2_dp2_equals_single_process(base_dir, corpus, cache_dir, tmp_path, raw_config):
    """One adapter for all of a rank's experts: a dense parameter beside FSDP-sharded experts
    (the experts' own forward must gather them), its gradient summed over every rank."""
    shared = {**_lora_overrides(base_dir), "lora.expert_adapter": "shared"}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "single"), **shared)
    (single,) = spawn(_train, 1, raw, ov, "finetune")
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "fsdp"), **shared, **_layout(4, 2))
    runs = spawn(_train, 4, raw, ov, "finetune")
    _assert_losses_close(single["losses"], runs[0]["losses"])
    assert single["losses"][0] != single["losses"][-1]
    ref_adapter = load_file(os.path.join(single["adapter"], "adapter_model.safetensors"))
    got_adapter = load_file(os.path.join(runs[0]["adapter"], "adapter_model.safetensors"))
    _assert_tensors_close(ref_adapter, got_adapter)
    assert any("experts" in k for k in got_adapter), sorted(got_adapter)[:5]


@pytest.mark.slow
def test_adapters_only_checkpoint_bf16_base_resumes_exactly(base_dir, corpus, cache_dir, tmp_path, raw_config):
    """bf16 frozen base under FSDP (gathered as fp32 for compute); checkpoints hold adapters only."""
    opts = _lora_overrides(base_dir, **{
        "training.train_steps": 3, "lora.base_dtype": "bfloat16", "lora.adapters_only_checkpoint": True,
        "parallel.fsdp": True,
    })
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "straight"), **opts)
    (straight,) = spawn(_train, 1, raw, ov, "finetune")
    out = str(tmp_path / "interrupted")
    raw, ov = raw_config(corpus, cache_dir, out, **opts, **{"training.exit_after_steps": 2})
    (first,) = spawn(_train, 1, raw, ov, "finetune")
    raw, ov = raw_config(corpus, cache_dir, out, **opts)
    (second,) = spawn(_train, 1, raw, ov, "finetune")

    assert first["losses"] + second["losses"] == straight["losses"]  # bitwise
    saved = checkpoint_tensors(second["checkpoint"])
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:5]
    _assert_tensors_close(checkpoint_tensors(straight["checkpoint"]), saved)


def _meta_sharded_materialize(rank, world_size):
    """Built on meta, LoRA-wrapped and sharded there, then materialised: each rank's storage is
    its shards only; the adapters are the ones an unsharded build draws (their shards of them)."""
    import yaml

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.layers.lora import apply_lora
    from megatron_moe_hybrid.models import build_model, materialize
    from megatron_moe_hybrid.parallel.fsdp import apply_fsdp
    from megatron_moe_hybrid.testing import init_megatron

    init_megatron(rank, world_size, ep=2)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    config = config_from_dict(raw, {"parallel.world_size": world_size, "parallel.expert_model_parallel_size": 2,
                                    "parallel.fsdp": True})
    torch.manual_seed(0)
    plain = build_model(config)
    torch.manual_seed(1)  # apply_lora draws its base seed here (the CPU build drew from the RNG, meta does not)
    apply_lora(plain, ["linear_attention", "experts"], rank=4, alpha=8.0)
    model = build_model(config, device="meta")
    torch.manual_seed(1)
    apply_lora(model, ["linear_attention", "experts"], rank=4, alpha=8.0)
    apply_fsdp(model, config, device_type="cpu")
    materialize(model, "cpu")
    from torch.distributed.tensor import DTensor

    local, full = {"dense": 0, "experts": 0}, {"dense": 0, "experts": 0}
    adapters = 0
    plain_params = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.to_local().is_meta, name
        kind = "experts" if hasattr(p, "num_local_experts") else "dense"
        local[kind] += p.to_local().numel()
        full[kind] += p.numel()
        assert vars(p).get("num_local_experts") == getattr(plain_params[name], "num_local_experts", None), name
        if "lora_" in name:  # drawn again into the shard: the unsharded build's values
            torch.testing.assert_close(p.full_tensor(), plain_params[name].detach(), rtol=0, atol=0, msg=name)
            adapters += 1
    return {"local": local, "full": full, "adapters": adapters}


@pytest.mark.distributed
def test_meta_model_sharded_before_storage_holds_only_its_shards():
    results = spawn(_meta_sharded_materialize, 2)
    for r in results:
        assert r["adapters"] > 0
        # dense tensors split over the 2 ranks (along dim 0: a rank may hold a row more); the
        # experts are this EP rank's already, and expert-dp is 1 here
        assert r["local"]["dense"] <= 0.52 * r["full"]["dense"], r
        assert r["local"]["experts"] == r["full"]["experts"] > 0, r
    assert results[0]["local"]["dense"] + results[1]["local"]["dense"] == results[0]["full"]["dense"]


def _to_dist_checkpoint(rank, world_size, raw, overrides, src, dst):
    """The base run's safetensors checkpoint rewritten as a dist checkpoint (one process)."""
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron
    from megatron_moe_hybrid.training.checkpoint import load_model_weights
    from megatron_moe_hybrid.training.dist_checkpoint import save_dist_checkpoint

    init_megatron(rank, world_size)
    model = build_model(config_from_dict(raw, overrides))
    load_model_weights(src, model)
    save_dist_checkpoint(dst, model)
    return True


@pytest.fixture(scope="module")
def dcp_dir(base_dir, corpus, cache_dir, tmp_path_factory, raw_config):
    path = str(tmp_path_factory.mktemp("dcp") / "dcp")
    raw, ov = raw_config(corpus, cache_dir, base_dir, **{"training.train_steps": 3, "training.global_batch_size": 8})
    assert spawn(_to_dist_checkpoint, 1, raw, ov, base_dir, path) == [True]
    return path


@pytest.mark.distributed
@pytest.mark.slow
def test_dist_checkpoint_init_loads_into_fsdp_shards(base_dir, dcp_dir, corpus, cache_dir, tmp_path, raw_config):
    """training.init_from a dist checkpoint under FSDP2 + EP=2 x expert-dp 2: each rank reads its
    shards (experts through the (ep, expert-dp) grid) and the run equals one process's."""
    common = {**FULL, "training.init_from": dcp_dir, "training.tokenizer_model": os.path.join(base_dir, "tokenizer.model")}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "single"), **common)
    (single,) = spawn(_train, 1, raw, ov)
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "safetensors"), **{**common, "training.init_from": base_dir})
    (from_safetensors,) = spawn(_train, 1, raw, ov)
    assert single["losses"] == from_safetensors["losses"]  # the same weights in both formats
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "fsdp"), **common, **_layout(4, 2))
    runs = spawn(_train, 4, raw, ov)
    _assert_losses_close(single["losses"], runs[0]["losses"])
    _assert_tensors_close(checkpoint_tensors(single["checkpoint"]), checkpoint_tensors(runs[0]["checkpoint"]))


@pytest.mark.distributed
def test_lora_from_a_dist_checkpoint_under_fsdp(base_dir, dcp_dir, corpus, cache_dir, tmp_path, raw_config):
    """LoRA under FSDP2 + EP=2 from a dist checkpoint: the wrapped base weights read their
    unwrapped names, the adapters start fresh, and the run equals one process's from safetensors."""
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "single"), **_lora_overrides(base_dir))
    (single,) = spawn(_train, 1, raw, ov, "finetune")
    lora = _lora_overrides(base_dir, **{"training.init_from": dcp_dir})
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "fsdp"), **lora, **_layout(2, 2))
    runs = spawn(_train, 2, raw, ov, "finetune")
    _assert_losses_close(single["losses"], runs[0]["losses"])
    ref_adapter = load_file(os.path.join(single["adapter"], "adapter_model.safetensors"))
    _assert_tensors_close(ref_adapter, load_file(os.path.join(runs[0]["adapter"], "adapter_model.safetensors")))
