"""tools/export_lora.py: our adapter -> PEFT -> ours round-trips exactly, reproduces the
adapted model's logits, and loads into peft's own LoRA modules.

Shape legend: r rank, h hidden, F expert FFN size, g global expert index.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import yaml

from megatron_moe_hybrid.layers.lora import adapter_tensors, apply_lora, load_adapter_tensors
from megatron_moe_hybrid.testing import init_megatron, teardown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "export_lora.py")
TARGETS = ["linear_attention", "sparse_attention", "indexer", "experts"]
_spec = importlib.util.spec_from_file_location("export_lora", TOOL)
export_lora = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(export_lora)


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    init_megatron()
    yield
    teardown()


@pytest.fixture(scope="module")
def config():
    from megatron_moe_hybrid.config import config_from_dict

    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    return config_from_dict(raw, {"parallel.world_size": 1, "training.seq_length": 32, "sparse_attention.topk": 8})


def _adapted(config, mode, randomize):
    from megatron_moe_hybrid.models import build_model

    torch.manual_seed(0)
    model = build_model(config).eval()
    paths = apply_lora(model, TARGETS, 4, 8.0, rslora=True, expert_adapter=mode)
    if randomize:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.05)
    return model, paths


def _logits(model, config):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=g)
    with torch.no_grad():
        return model(tokens, torch.arange(32).unsqueeze(0).expand(2, -1), None)


def _write_run(tmp_path, config, mode):
    """An output_dir as the trainer leaves it: adapter/adapter_model.safetensors + config."""
    model, paths = _adapted(config, mode, randomize=True)
    tensors = adapter_tensors(model)
    lo = {"r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "targets": TARGETS, "modules": paths,
          "rslora": True, "expert_adapter": mode, "num_experts": config.moe.num_experts, "base_checkpoint": None}
    run = tmp_path / f"run-{mode}"
    export_lora.write_adapter(str(run / "adapter"), tensors, lo)
    return str(run), model, tensors, lo


@pytest.mark.parametrize("mode", ["per_expert", "shared"])
def test_export_import_round_trip_reproduces_logits(tmp_path, config, mode):
    from megatron_moe_hybrid.training.checkpoint import model_tensors_to_save

    run, model, tensors, lo = _write_run(tmp_path, config, mode)
    # adapter_tensors() names what the trainer's save_adapter writes
    assert set(tensors) == set(model_tensors_to_save(model, trainable_only=True))
    out = str(tmp_path / "peft")
    export_lora.export_peft(run, out)
    peft_tensors, peft_config, _ = export_lora.read_adapter(out)
    assert peft_config["peft_type"] == "LORA" and peft_config["use_rslora"] is True
    assert peft_config["r"] == 4 and peft_config["lora_alpha"] == 8.0
    assert {"gate_proj", "up_proj", "down_proj", "in_proj", "linear_index_q"} <= set(peft_config["target_modules"])
    assert all(k.startswith("base_model.model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in peft_tensors)
    f, e_last = config.moe.ffn_hidden_size, config.moe.num_experts - 1
    gate_b = peft_tensors[f"base_model.model.decoder.layers.1.mlp.experts.{e_last}.gate_proj.lora_B.weight"]
    assert gate_b.shape == (f, 4)
    experts = model.decoder.layers[1].mlp.experts
    b1 = experts.lora_B1[e_last] if mode == "per_expert" else experts.lora_B1
    torch.testing.assert_close(gate_b, b1[:f], rtol=0, atol=0)

    back, back_config = export_lora.import_peft(out)
    assert back_config == lo
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        torch.testing.assert_close(back[k], v, rtol=0, atol=0)

    fresh, _ = _adapted(config, mode, randomize=False)
    before = _logits(fresh, config)
    load_adapter_tensors(fresh, back)
    after, want = _logits(fresh, config), _logits(model, config)
    assert not torch.allclose(before, want)
    torch.testing.assert_close(after, want, rtol=0, atol=0)


def _module_tree(peft_tensors):
    """A plain nn.Module tree with one bias-free Linear at every adapted module path."""
    root = nn.Module()
    shapes = {}
    for k, t in peft_tensors.items():
        mod, ab = k[len("base_model.model."):].rsplit(".lora_", 1)
        shapes.setdefault(mod, {})[ab[0]] = t.shape
    for mod, s in shapes.items():
        parent = root
        *parents, leaf = mod.split(".")
        for name in parents:
            if not hasattr(parent, name):
                parent.add_module(name, nn.Module())
            parent = getattr(parent, name)
        parent.add_module(leaf, nn.Linear(s["A"][1], s["B"][0], bias=False))
    return root


def test_peft_loads_the_export_onto_a_matching_module_tree(tmp_path, config):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    run, model, _, _ = _write_run(tmp_path, config, "per_expert")
    out = str(tmp_path / "peft")
    export_lora.export_peft(run, out)
    peft_tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
    cfg = peft.LoraConfig.from_pretrained(out)
    cfg.task_type = None  # a plain module tree, not a transformers causal LM
    peft_model = peft.get_peft_model(_module_tree(peft_tensors), cfg)
    result = peft.set_peft_model_state_dict(peft_model, peft_tensors)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    state = peft_model.state_dict()
    for k, v in peft_tensors.items():
        landed = state[k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")]
        torch.testing.assert_close(landed, v, rtol=0, atol=0)

    # peft's gate_proj / up_proj for expert g compute our fused gate|up halves
    g, f = 5, config.moe.ffn_hidden_size
    experts = model.decoder.layers[2].mlp.experts
    peft_experts = peft_model.base_model.model.get_submodule("decoder.layers.2.mlp.experts")
    x = torch.randn(6, config.hidden_size)
    with torch.no_grad():
        ours = x @ experts.base.weight1[g]  # [6, 2F] base, plus the adapter:
        ours = ours + experts.scale * (x @ experts.lora_A1[g].T) @ experts.lora_B1[g].T
        for proj, half in (("gate_proj", slice(0, f)), ("up_proj", slice(f, 2 * f))):
            layer = getattr(peft_experts, str(g)).get_submodule(proj)
            assert layer.scaling["default"] == pytest.approx(experts.scale)
            layer.base_layer.weight.copy_(experts.base.weight1[g][:, half].T)
            torch.testing.assert_close(layer(x), ours[:, half], rtol=1e-5, atol=1e-6)


def test_import_refuses_what_our_layout_cannot_hold(tmp_path, config):
    run, _, tensors, lo = _write_run(tmp_path, config, "shared")
    with pytest.raises(ValueError, match="num_experts"):
        export_lora.to_peft(tensors, {k: v for k, v in lo.items() if k != "num_experts"})
    peft_tensors, peft_config, _ = export_lora.to_peft(tensors, lo)
    key = "base_model.model.decoder.layers.0.mlp.experts.2.up_proj.lora_A.weight"
    bad = dict(peft_tensors)
    bad[key] = bad[key] + 1.0
    with pytest.raises(ValueError, match="gate_proj and up_proj have different lora_A"):
        export_lora.from_peft(bad, peft_config)


def test_cli(tmp_path, config):
    run, _, tensors, _ = _write_run(tmp_path, config, "per_expert")
    out, back = str(tmp_path / "peft"), str(tmp_path / "ours")
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, TOOL, run, out], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["peft_type"] == "LORA"
    r = subprocess.run([sys.executable, TOOL, out, back, "--to-ours"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    got, _, _ = export_lora.read_adapter(back)
    assert set(got) == set(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    r = subprocess.run([sys.executable, TOOL, str(tmp_path / "nowhere"), out], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "error: src:" in r.stderr
