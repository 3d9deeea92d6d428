"""Checkpoints: atomic directories, no pickle on load, global expert names."""

import os

import pytest
import torch

from megatron_moe_hybrid.testing import init_megatron, teardown
from megatron_moe_hybrid.training import checkpoint as ckpt


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    init_megatron()
    yield
    teardown()


def build(seed=0):
    import yaml

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    config = config_from_dict(raw, {"parallel.world_size": 1, "model.num_layers": 4})
    torch.manual_seed(seed)
    return build_model(config)


def test_save_load_round_trip_and_expert_names(tmp_path):
    model = build(0)
    path = ckpt.save_checkpoint(str(tmp_path), 7, model, {"step": 7}, {"note": "x"})
    assert os.path.basename(path) == "step_00000007"
    assert ckpt.latest_checkpoint(str(tmp_path)) == path
    from safetensors import safe_open

    names = set()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                names |= set(h.keys())
    # experts are stored one tensor per global expert
    assert "decoder.layers.0.mlp.experts.weight1.expert7" in names
    assert "decoder.layers.0.mlp.experts.weight1" not in names

    other = build(1)
    first = next(iter(other.state_dict()))
    assert not torch.equal(model.state_dict()[first], other.state_dict()[first])
    ckpt.load_model_weights(path, other)
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), n
    assert ckpt.load_rank_state(path) == {"step": 7}


def test_incomplete_checkpoints_are_ignored_and_cleaned(tmp_path):
    model = build(0)
    root = tmp_path / ckpt.CKPT_DIR
    good = ckpt.save_checkpoint(str(tmp_path), 5, model, {"step": 5}, {})
    # a save killed half-way: a .tmp- directory, and a step directory without meta.json
    (root / ".tmp-step_00000010").mkdir()
    (root / ".tmp-step_00000010" / "model-ep00000-r00000.safetensors").write_bytes(b"partial")
    (root / "step_00000009").mkdir()
    assert ckpt.latest_checkpoint(str(tmp_path)) == good
    with pytest.raises(ckpt.CheckpointError, match="meta.json"):
        ckpt.load_model_weights(str(root / "step_00000009"), model)
    ckpt.save_checkpoint(str(tmp_path), 6, model, {"step": 6}, {})
    assert not (root / ".tmp-step_00000010").exists()


def test_keep_prunes_old_checkpoints(tmp_path):
    model = build(0)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(str(tmp_path), step, model, {"step": step}, {}, keep=2)
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))] == ["step_00000002", "step_00000003"]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _resize_meta(path):
    """Records the files' current sizes, as a checkpoint written by another program would."""
    import json

    meta_path = os.path.join(path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["files"] = {name: os.path.getsize(os.path.join(path, name)) for name in meta["files"]}
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def test_state_is_never_unpickled(tmp_path):
    model = build(0)
    path = ckpt.save_checkpoint(str(tmp_path), 1, model, {"step": 1}, {})
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "payload": _Evil(str(marker))}, os.path.join(path, "state-rank00000.pt"))
    _resize_meta(path)
    with pytest.raises(ckpt.CheckpointError, match="state-rank00000.pt: refused"):
        ckpt.load_rank_state(path)
    assert not marker.exists()


def test_wrong_shape_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build(0)
    path = ckpt.save_checkpoint(str(tmp_path), 1, model, {"step": 1}, {})
    fname = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
    tensors = load_file(os.path.join(path, fname))
    tensors["output_layer.weight"] = tensors["output_layer.weight"][:-1].contiguous()
    save_file(tensors, os.path.join(path, fname))
    _resize_meta(path)
    with pytest.raises(ckpt.CheckpointError, match="output_layer.weight"):
        ckpt.load_model_weights(path, model)


def test_inspect_tool_summarises_and_names_bad_files(tmp_path, capsys):
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", os.path.join(root, "tools", "inspect_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    model = build(0)
    path = ckpt.save_checkpoint(str(tmp_path), 3, model, {"step": 3}, {"mode": "pretrain"})
    s = tool.summarise(str(tmp_path))
    assert s["step"] == 3 and s["num_experts"] == 8
    assert s["num_params"] == sum(t.numel() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    assert tool.main([str(tmp_path)]) == 0
    assert "step 3" in capsys.readouterr().out

    fname = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
    with open(os.path.join(path, fname), "r+b") as f:
        f.write(b"\xff" * 16)  # corrupt the header
    assert tool.main([path]) == 1
    assert fname in capsys.readouterr().err
