"""End-to-end training on CPU: loss falls, resume is bitwise exact, EP=2 equals EP=1, LoRA."""

import json
import os

import pytest

from megatron_moe_hybrid.testing import checkpoint_tensors, spawn

def _train(rank, world_size, raw, overrides, mode="pretrain"):
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import run

    result = run(config_from_dict(raw, overrides), mode)
    return {"losses": result.losses, "checkpoint": result.checkpoint, "adapter": result.adapter_dir}


def _load_weights(rank, world_size, raw, overrides, path):
    """Builds an EP=1 model and loads a checkpoint into it; returns its state dict."""
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron
    from megatron_moe_hybrid.training.checkpoint import load_model_weights

    overrides = dict(overrides, **{"parallel.world_size": 1, "parallel.expert_model_parallel_size": 1})
    init_megatron(rank, world_size)
    model = build_model(config_from_dict(raw, overrides))
    load_model_weights(path, model)
    return {k: v.clone() for k, v in model.state_dict().items() if hasattr(v, "clone")}


def _initial_weights(rank, world_size, raw, overrides):
    """The weights a run from scratch starts from (build_model with training.seed draws them)."""
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron

    init_megatron(rank, world_size)
    config = config_from_dict(raw, overrides)
    model = build_model(config, seed=config.training.seed)
    return {k: v.clone() for k, v in model.state_dict().items() if hasattr(v, "clone")}


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_loss_falls(corpus, cache_dir, tmp_path, raw_config):
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "run"), **{"training.train_steps": 40})
    (res,) = spawn(_train, 1, raw, ov)
    losses = res["losses"]
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    metrics = read_metrics(str(tmp_path / "run"))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "expert_load_max", "expert_load_mean"):
        assert key in metrics[-1], key
    assert [m["step"] for m in metrics] == list(range(1, 41))
    # every step logs the per-layer, per-expert counts: all routed copies of the global batch
    with open(os.path.join(str(tmp_path / "run"), "expert_load.jsonl")) as f:
        loads = [json.loads(line) for line in f]
    assert [x["step"] for x in loads] == list(range(1, 41))
    counts = loads[-1]["tokens_per_expert"]  # [L, E]
    assert len(counts) == 4 and all(len(row) == 8 for row in counts)
    assert all(sum(row) == 4 * 32 * 2 for row in counts)  # global batch x seq x top-k


def test_resume_is_bitwise_exact(corpus, cache_dir, tmp_path, raw_config):
    steps = {"training.train_steps": 20}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "straight"), **steps)
    (straight,) = spawn(_train, 1, raw, ov)

    interrupted = str(tmp_path / "interrupted")
    raw, ov = raw_config(corpus, cache_dir, interrupted, **steps, **{"training.exit_after_steps": 10})
    (first_half,) = spawn(_train, 1, raw, ov)
    assert len(first_half["losses"]) == 10
    raw, ov = raw_config(corpus, cache_dir, interrupted, **steps)
    (second_half,) = spawn(_train, 1, raw, ov)
    assert len(second_half["losses"]) == 10

    assert first_half["losses"] + second_half["losses"] == straight["losses"]  # bitwise
    resumed = read_metrics(interrupted)
    assert [m["step"] for m in resumed] == list(range(1, 21))
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in read_metrics(str(tmp_path / "straight"))]


@pytest.mark.distributed
def test_ep2_equals_ep1(corpus, cache_dir, tmp_path, raw_config):
    steps = {"training.train_steps": 3, "training.warmup_steps": 0}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "ep1"), **steps)
    (ep1,) = spawn(_train, 1, raw, ov)
    raw, ov = raw_config(
        corpus, cache_dir, str(tmp_path / "ep2"), **steps,
        **{"parallel.world_size": 2, "parallel.expert_model_parallel_size": 2},
    )
    ep2 = spawn(_train, 2, raw, ov)
    assert ep2[0]["losses"] == ep2[1]["losses"]  # the logged loss is the global mean
    assert len(ep1["losses"]) == 3
    for a, b in zip(ep1["losses"], ep2[0]["losses"]):
        assert abs(a - b) <= 1e-5, (ep1["losses"], ep2[0]["losses"])
    # steps 2 and 3 differ from step 1: the comparison covers optimizer updates
    assert ep1["losses"][0] != ep1["losses"][2]

    # The EP=2 checkpoint holds the same tensors under the same global names (reshardable).
    import torch

    a, b = checkpoint_tensors(ep1["checkpoint"]), checkpoint_tensors(ep2[0]["checkpoint"])
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4, msg=name)

    # ... and loads into an EP=1 model, each expert landing in its slot
    (loaded,) = spawn(_load_weights, 1, raw, ov, ep2[0]["checkpoint"])
    w1 = loaded["decoder.layers.0.mlp.experts.weight1"]  # [E, h, 2F]
    for e in range(w1.shape[0]):
        torch.testing.assert_close(w1[e], b[f"decoder.layers.0.mlp.experts.weight1.expert{e}"], rtol=0, atol=0)


@pytest.mark.slow
def test_lora_finetune_from_pretrained(corpus, cache_dir, tmp_path, raw_config):
    import torch
    from safetensors.torch import load_file

    base_dir = str(tmp_path / "base")
    raw, ov = raw_config(corpus, cache_dir, base_dir, **{"training.train_steps": 4})
    spawn(_train, 1, raw, ov)

    ft_dir = str(tmp_path / "ft")
    raw, ov = raw_config(corpus, cache_dir, ft_dir, **{
        "training.train_steps": 4, "training.init_from": base_dir, "lora.enabled": True,
        "training.tokenizer_model": os.path.join(base_dir, "tokenizer.model"),
        "lora.targets": ["linear_attention", "sparse_attention", "experts"],
        "training.lr": 1e-2,
    })
    (ft,) = spawn(_train, 1, raw, ov, "finetune")
    adapter = load_file(os.path.join(ft["adapter"], "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(".expert7" in k for k in adapter), sorted(adapter)[:5]
    assert any(k.endswith("lora_B") and v.abs().sum() > 0 for k, v in adapter.items())

    # the frozen base is unchanged in the fine-tuned checkpoint
    from megatron_moe_hybrid.training.checkpoint import latest_checkpoint

    base = checkpoint_tensors(latest_checkpoint(base_dir), "model")
    tuned = checkpoint_tensors(latest_checkpoint(ft_dir), "model")
    name = "decoder.layers.0.self_attention.in_proj.weight"
    tuned_name = "decoder.layers.0.self_attention.in_proj.base.weight"
    assert name in base and tuned_name in tuned, (sorted(base)[:8], sorted(tuned)[:8])
    assert torch.equal(base[name], tuned[tuned_name])

    # a new LoRA run from the fine-tuned checkpoint starts from its adapters (lr 0: they stay)
    again_dir = str(tmp_path / "again")
    raw, ov = raw_config(corpus, cache_dir, again_dir, **{
        "training.train_steps": 1, "training.init_from": ft_dir, "lora.enabled": True,
        "training.tokenizer_model": os.path.join(base_dir, "tokenizer.model"),
        "lora.targets": ["linear_attention", "sparse_attention", "experts"], "training.lr": 0.0, "training.min_lr": 0.0,
    })
    spawn(_train, 1, raw, ov, "finetune")
    again = checkpoint_tensors(latest_checkpoint(again_dir), "model")
    adapters = [k for k in tuned if "lora_" in k]
    assert adapters and all(torch.equal(again[k], tuned[k]) for k in adapters)
    assert torch.equal(again[tuned_name], tuned[tuned_name])


def test_dense_warmup_trains_the_indexers_only(corpus, cache_dir, tmp_path, raw_config):
    """sparse_attention.stage dense_warmup (DeepSeek-V3.2's first stage): after a few steps every
    indexer weight has moved and every other tensor (the expert bias buffer among them, which
    the sparse stage updates each step) is bitwise what the run started from; the indexer KL
    loss is logged each step and falls."""
    import torch

    run_dir = str(tmp_path / "warmup")
    raw, ov = raw_config(corpus, cache_dir, run_dir, **{
        "training.train_steps": 3, "sparse_attention.stage": "dense_warmup", "moe.expert_bias": True,
        "training.lr": 1e-2,
    })
    (res,) = spawn(_train, 1, raw, ov)
    assert len(res["losses"]) == 3 and all(x == x for x in res["losses"])
    (before,) = spawn(_initial_weights, 1, raw, ov)
    (after,) = spawn(_load_weights, 1, raw, ov, res["checkpoint"])
    assert set(before) == set(after)
    indexer = {k for k in before if any(m in k for m in ("linear_index_", "index_k_norm"))}
    assert indexer and all(".layers.3." in k for k in indexer), sorted(indexer)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == indexer, (sorted(changed - indexer)[:5], sorted(indexer - changed)[:5])
    assert any("expert_bias" in k for k in before)  # a buffer the sparse stage would have moved
    kl = [m["indexer_kl_loss"] for m in read_metrics(run_dir)]
    assert len(kl) == 3 and all(x > 0 for x in kl) and kl[-1] < kl[0], kl  # (deterministic on the CPU)


def _warmup_step(rank, world_size, raw, overrides):
    """One dense warm-up step by the trainer, and the same step as it ran before the layers handed
    their KL losses to the trainer (each loss carried on its layer's output, the LM loss's
    backward taking it down): gradients, weights after the step, the metrics, and whether the
    last layer's output had a graph."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import Trainer, init_distributed

    runs = {}
    for form in ("carried", "trainer"):
        config = config_from_dict(raw, dict(overrides, **{"training.output_dir": overrides["training.output_dir"] + form}))
        init_distributed(config)
        trainer = Trainer(config)
        if form == "carried":
            for m in trainer.indexer_layers:
                m.indexer_loss_sink = None
            trainer.dense_warmup = False  # the LM loss's backward (the expert bias is off here)
        graphs = []
        trainer.model.decoder.layers[-1].register_forward_hook(lambda m, i, o: graphs.append(o[0].requires_grad))
        metrics = trainer.train_step()
        runs[form] = {
            "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None},
            "weights": {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)},
            "metrics": metrics, "graphs": graphs, "losses_left": len(trainer.indexer_losses),
            "recomputed": [getattr(layer, "_recomputed", False) for layer in trainer.model.decoder.layers],
        }
    ps.destroy_model_parallel()
    return runs


def test_dense_warmup_backwards_the_kl_losses_alone(corpus, cache_dir, tmp_path, raw_config):
    """The warm-up step backwards the S layers' KL losses by themselves: the same gradients, bitwise,
    as the LM loss's backward that carried them (two micro-batches, two S layers), with no graph
    on the frozen layers after the first S layer. memory.recompute_layers is not applied (it
    would only run the S layers' forward again)."""
    import torch

    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "w"), **{
        "sparse_attention.stage": "dense_warmup", "model.num_layers": 8, "training.lr": 1e-2,
        "memory.recompute_layers": -1,
    })
    (runs,) = spawn(_warmup_step, 1, raw, ov)
    carried, ours = runs["carried"], runs["trainer"]
    assert ours["recomputed"] == [False] * 8
    assert carried["graphs"] == [True, True] and ours["graphs"] == [False, False]  # 2 micro-batches
    assert ours["losses_left"] == 0
    assert carried["grads"].keys() == ours["grads"].keys()
    assert len(ours["grads"]) == 2 * 5 and all("linear_index_" in n or "index_k_norm" in n for n in ours["grads"])
    for name, grad in carried["grads"].items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(ours["grads"][name], grad), name
    for name, w in carried["weights"].items():
        assert torch.equal(ours["weights"][name], w), name
    for key in ("loss", "grad_norm", "indexer_kl_loss"):
        assert ours["metrics"][key] == carried["metrics"][key], key


def _strip_indexers(checkpoint):
    """Removes the S layers' indexer tensors (weights and optimizer moments) from a checkpoint, as
    a model trained with dense attention would have none; meta.json's file sizes follow."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(checkpoint, "meta.json")) as f:
        meta = json.load(f)
    removed = 0
    for name in meta["files"]:
        path = os.path.join(checkpoint, name)
        if name.endswith(".safetensors"):
            tensors = load_file(path)
            kept = {k: v for k, v in tensors.items() if "linear_index_" not in k and "index_k_norm" not in k}
            removed += len(tensors) - len(kept)
            save_file(kept, path)
        meta["files"][name] = os.path.getsize(path)
    with open(os.path.join(checkpoint, "meta.json"), "w") as f:
        json.dump(meta, f)
    return removed


def test_dense_warmup_starts_from_a_checkpoint_without_indexers(corpus, cache_dir, tmp_path, raw_config):
    """DeepSeek-V3.2's recipe: the dense warm-up from a model trained with dense attention, whose
    checkpoint has no indexers. training.init_from loads every other tensor and draws the
    indexers as a run from scratch would (lr 0 here, so the run keeps what it started from); the
    sparse stage from that checkpoint stops naming training.init_from and the warm-up as the fix."""
    import torch

    base = str(tmp_path / "base")
    raw, ov = raw_config(corpus, cache_dir, base, **{"training.train_steps": 2, "training.save_interval": 2})
    (res,) = spawn(_train, 1, raw, ov)
    assert _strip_indexers(res["checkpoint"]) > 0
    start = {"training.init_from": base, "training.tokenizer_model": os.path.join(base, "tokenizer.model"),
             "training.train_steps": 1, "training.save_interval": 1}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "sparse"), **start)
    with pytest.raises(RuntimeError, match="missing tensors.*sparse_attention.stage: dense_warmup"):
        spawn(_train, 1, raw, ov)
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "warm"), **start, **{
        "sparse_attention.stage": "dense_warmup", "training.lr": 0.0, "training.min_lr": 0.0})
    (warm,) = spawn(_train, 1, raw, ov)
    assert len(warm["losses"]) == 1 and warm["losses"][0] == warm["losses"][0]
    (after,) = spawn(_load_weights, 1, raw, ov, warm["checkpoint"])
    (drawn,) = spawn(_initial_weights, 1, raw, ov)  # training.seed's from-scratch weights
    indexer = {k for k in after if "linear_index_" in k or "index_k_norm" in k}
    assert indexer
    for k in indexer:
        assert torch.equal(after[k], drawn[k]), k
    stored = checkpoint_tensors(res["checkpoint"], "model")
    assert stored and not indexer & set(stored)
    same_names = set(stored) & set(after)  # (the experts are stored one tensor each)
    assert len(same_names) > 20
    for k in same_names:
        assert torch.equal(after[k], stored[k]), k


def test_dense_warmup_config_names_what_it_needs(corpus, cache_dir, tmp_path, raw_config):
    from megatron_moe_hybrid.config import ConfigError, config_from_dict

    warm = {"sparse_attention.stage": "dense_warmup"}
    for extra, field in (({"sparse_attention.indexer_loss_coeff": 0.0}, "sparse_attention.indexer_loss_coeff"),
                         ({"lora.enabled": True}, "lora.enabled"),
                         ({"model.pattern": "LLLL"}, "sparse_attention.stage")):
        raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "x"), **warm, **extra)
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            config_from_dict(raw, ov)


@pytest.mark.slow
def test_lora_options_reach_the_adapter_and_export(corpus, cache_dir, tmp_path, raw_config):
    import importlib.util

    base_dir = str(tmp_path / "base")
    raw, ov = raw_config(corpus, cache_dir, base_dir, **{"training.train_steps": 2})
    spawn(_train, 1, raw, ov)
    ft_dir = str(tmp_path / "ft")
    raw, ov = raw_config(corpus, cache_dir, ft_dir, **{
        "training.train_steps": 2, "training.init_from": base_dir, "lora.enabled": True,
        "training.tokenizer_model": os.path.join(base_dir, "tokenizer.model"),
        "lora.rslora": True, "lora.expert_adapter": "shared", "lora.rank": 4,
        "lora.targets": ["linear_attention", "experts"],
        "lora.target_modules": [r"decoder\.layers\.[01]\..*"],
    })
    (ft,) = spawn(_train, 1, raw, ov, "finetune")
    with open(os.path.join(ft["adapter"], "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["rslora"] is True and cfg["expert_adapter"] == "shared"
    assert cfg["modules"] and all(m.startswith(("decoder.layers.0.", "decoder.layers.1.")) for m in cfg["modules"])

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("export_lora", os.path.join(root, "tools", "export_lora.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = str(tmp_path / "peft")
    assert tool.main([ft_dir, out]) == 0
    with open(os.path.join(out, "adapter_config.json")) as f:
        peft_cfg = json.load(f)
    assert peft_cfg["peft_type"] == "LORA" and peft_cfg["use_rslora"] is True and peft_cfg["r"] == 4


def _train_expect_stop(rank, world_size, raw, overrides):
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import TrainingStopped, run

    try:
        run(config_from_dict(raw, overrides), "pretrain")
    except TrainingStopped as e:
        return str(e)
    return None


def test_static_dispatch_overflow_stops_with_the_fix(corpus, cache_dir, tmp_path, raw_config):
    """A receive capacity far too small: the first step stops on every rank, naming the field."""
    raw, ov = raw_config(
        corpus, cache_dir, str(tmp_path / "overflow"),
        **{"parallel.world_size": 2, "parallel.expert_model_parallel_size": 2, "moe.dispatch_capacity_factor": 0.05},
    )
    messages = spawn(_train_expect_stop, 2, raw, ov)
    for message in messages:
        assert message is not None and "moe.dispatch_capacity_factor=0.05" in message and "overflowed" in message


@pytest.mark.distributed
def test_cp2_equals_cp1(corpus, cache_dir, tmp_path, raw_config):
    """Context parallelism: each rank trains on its zigzag pieces of the same sequences."""
    steps = {"training.train_steps": 3, "training.warmup_steps": 0, "moe.dispatcher": "alltoall"}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "cp1"), **steps)
    (cp1,) = spawn(_train, 1, raw, ov)
    # plain; with FSDP2 over the dp x cp ranks; with the experts split over the same 2 ranks
    for fsdp, ep in ((False, 1), (True, 1), (False, 2)):
        raw, ov = raw_config(
            corpus, cache_dir, str(tmp_path / f"cp2-fsdp{fsdp}-ep{ep}"), **steps,
            **{"parallel.world_size": 2, "parallel.context_parallel_size": 2, "parallel.fsdp": fsdp,
               "parallel.expert_model_parallel_size": ep},
        )
        cp2 = spawn(_train, 2, raw, ov)
        assert cp2[0]["losses"] == cp2[1]["losses"]  # the logged loss is the global mean
        for a, b in zip(cp1["losses"], cp2[0]["losses"], strict=True):
            assert abs(a - b) <= 1e-5, (fsdp, ep, cp1["losses"], cp2[0]["losses"])
    assert cp1["losses"][0] != cp1["losses"][2]


@pytest.mark.distributed
def test_dense_warmup_cp2_equals_cp1(corpus, cache_dir, tmp_path, raw_config):
    """The dense warm-up under context parallelism: each rank backwards its share of the KL losses
    (CP x its share, attach_cp_indexer_loss) through the gathered indexer keys; plain and with
    FSDP2 over the dp x cp ranks, the logged KL and the trained indexers equal the CP=1 run's."""
    import torch

    steps = {"training.train_steps": 3, "training.warmup_steps": 0, "sparse_attention.stage": "dense_warmup",
             "training.lr": 1e-2, "training.save_interval": 3}
    raw1, ov1 = raw_config(corpus, cache_dir, str(tmp_path / "cp1"), **steps)
    (cp1,) = spawn(_train, 1, raw1, ov1)
    kl1 = [m["indexer_kl_loss"] for m in read_metrics(str(tmp_path / "cp1"))]
    (weights1,) = spawn(_load_weights, 1, raw1, ov1, cp1["checkpoint"])
    for fsdp in (False, True):
        out = str(tmp_path / f"cp2-fsdp{fsdp}")
        raw, ov = raw_config(corpus, cache_dir, out, **steps, **{
            "parallel.world_size": 2, "parallel.context_parallel_size": 2, "parallel.fsdp": fsdp})
        cp2 = spawn(_train, 2, raw, ov)
        kl2 = [m["indexer_kl_loss"] for m in read_metrics(out)]
        torch.testing.assert_close(torch.tensor(kl2), torch.tensor(kl1), rtol=0, atol=2e-8)
        # the gradient's scale too (Adam's steps would hide a factor): the logged global norms
        norms = [[m["grad_norm"] for m in read_metrics(d)] for d in (str(tmp_path / "cp1"), out)]
        torch.testing.assert_close(torch.tensor(norms[1]), torch.tensor(norms[0]), rtol=1e-3, atol=0)
        (weights2,) = spawn(_load_weights, 1, raw1, ov1, cp2[0]["checkpoint"])
        indexer = [k for k in weights1 if "linear_index_" in k or "index_k_norm" in k]
        assert indexer
        for k in weights1:
            # Adam's normalised steps amplify rounding where a gradient is near 0: 1e-5 of 3e-2 moved
            torch.testing.assert_close(weights2[k], weights1[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert kl1[-1] < kl1[0]


def _train_counting_fused(rank, world_size, raw, overrides, fused):
    """_train with grouped_triton.ACCUMULATE_INTO_GRAD set, counting the weight gradients the
    experts' backward added into .grad itself."""
    from megatron_moe_hybrid.ops.moe import grouped_triton as gt

    gt.ACCUMULATE_INTO_GRAD = fused
    added, real = [], gt.grouped_mm_wgrad

    def counting(*args, **kwargs):
        added.append(kwargs.get("accumulate_into") is not None)
        return real(*args, **kwargs)

    gt.grouped_mm_wgrad = counting
    result = _train(rank, world_size, raw, overrides)
    return dict(result, added=sum(added), wgrads=len(added))


@pytest.mark.slow
def test_micro_batches_with_the_experts_gradient_added_in_place_equal_autograd(corpus, cache_dir, tmp_path, raw_config):
    """Two micro-batches per step through the Triton grouped GEMM (the interpreter, fp32): the
    second adds the experts' weight gradients into .grad in the kernel. In fp32 that is the same
    sum autograd makes (the gradient is not rounded before the add), so the losses are bitwise
    those of the run where autograd adds."""
    steps = {"training.train_steps": 2, "moe.grouped_gemm_backend": "triton"}
    runs = {}
    for fused in (True, False):
        raw, ov = raw_config(corpus, cache_dir, str(tmp_path / f"fused{fused}"), **steps)
        (runs[fused],) = spawn(_train_counting_fused, 1, raw, ov, fused)
    # 4 layers x 2 expert weights x 2 steps x 2 micro-batches: the second micro-batch's are
    # added in place (with the trainer's post-accumulate hooks, NonFiniteTracker, on every weight)
    assert runs[True]["added"] == 16 and runs[True]["wgrads"] == 32
    assert runs[False]["added"] == 0 and runs[False]["wgrads"] == 32
    assert runs[True]["losses"] == runs[False]["losses"]


def test_a_lora_run_started_by_train_is_a_finetune(corpus, cache_dir, tmp_path, raw_config):
    """`train` with lora.enabled labelled its run "pretrain" and wrote no adapter/: a LoRA run is a
    fine-tune whichever entry point starts it."""
    base_dir = str(tmp_path / "base")
    raw, ov = raw_config(corpus, cache_dir, base_dir, **{"training.train_steps": 1})
    spawn(_train, 1, raw, ov)
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "ft"), **{
        "training.train_steps": 1, "training.init_from": base_dir, "lora.enabled": True,
        "training.tokenizer_model": os.path.join(base_dir, "tokenizer.model")})
    (ft,) = spawn(_train, 1, raw, ov, "pretrain")
    assert ft["adapter"] and os.path.isfile(os.path.join(ft["adapter"], "adapter_model.safetensors"))
