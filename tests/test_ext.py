"""The compiled-extension loader (_ext) and `python -m megatron_moe_hybrid.env`."""

import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_moe_hybrid import _ext, env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = [
    "python", "torch", "torch cuda", "cuda device", "triton", "csrc _C cpu ops", "csrc _C cuda ops",
    "transformer-engine", "apex", "megatron-core", "sentencepiece", "safetensors", "tensorboard",
    "fla", "liger-kernel", "cut-cross-entropy",
]


def _python(code_or_args, **kwargs):
    args = code_or_args if isinstance(code_or_args, list) else ["-c", code_or_args]
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, **kwargs
    )


def test_env_cli_prints_every_backend():
    result = _python(["-m", "megatron_moe_hybrid.env"])
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    for name in BACKENDS:
        assert name in lines, f"no '{name}: ...' line in:\n{result.stdout}"
        assert lines[name].strip()
    assert lines["torch"] == torch.__version__
    assert lines["csrc _C cpu ops"] == ("yes" if _ext.has_cpu_ops() else "no")
    assert lines["csrc _C cuda ops"] == ("yes" if _ext.has_cuda_ops() else "no")
    if not torch.cuda.is_available():
        assert lines["cuda device"] == "no CUDA device"


def test_env_cli_help():
    """--help prints the usage and exits 0 (it printed the report)."""
    result = _python(["-m", "megatron_moe_hybrid.env", "--help"])
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m megatron_moe_hybrid.env")
    assert "torch:" not in result.stdout


def test_env_report_versions_or_not_installed():
    report = env.env_report()
    assert list(report)[:2] == ["megatron_moe_hybrid", "python"]
    version = re.compile(r"^\d+(\.\w+)+")
    for name in ["transformer-engine", "apex", "megatron-core", "sentencepiece", "triton", "fla", "transformers",
                 "tokenizers", "peft"]:
        assert report[name] == "not installed" or version.match(report[name]), (name, report[name])
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


def test_package_import_loads_neither_torch_nor_C():
    code = "import sys, megatron_moe_hybrid; print('torch' in sys.modules, 'megatron_moe_hybrid._C' in sys.modules)"
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_warn_missing_once_warns_once_per_feature(monkeypatch, recwarn):
    monkeypatch.setattr(_ext, "_warned", set())
    _ext.warn_missing_once("op_a on cpu")
    _ext.warn_missing_once("op_a on cpu")
    _ext.warn_missing_once("op_b on cpu", fallback="the eager loop")
    messages = [str(w.message) for w in recwarn if issubclass(w.category, _ext.MissingExtensionWarning)]
    assert len(messages) == 2
    assert "op_a on cpu" in messages[0] and "pip install --no-build-isolation -e ." in messages[0]
    assert "running the eager loop" in messages[1]


def test_require(monkeypatch):
    if _ext.has_cpu_ops():
        assert _ext.require("cpu") is _ext._C
    with pytest.raises(ValueError, match="feature must be one of"):
        _ext.require("tpu")
    monkeypatch.setattr(_ext, "_C", None)
    assert not _ext.has_cpu_ops() and not _ext.has_cuda_ops()
    for feature in ["cpu", "cuda"]:
        with pytest.raises(RuntimeError, match="pip install --no-build-isolation -e ."):
            _ext.require(feature)


def test_without_C_the_package_says_once_which_fast_path_is_missing():
    # sys.modules[...] = None makes `from megatron_moe_hybrid import _C` raise ImportError.
    code = """
import sys
sys.modules["megatron_moe_hybrid._C"] = None
import torch
from megatron_moe_hybrid import _ext
from megatron_moe_hybrid.ops.moe.fused_permute import fused_permute, fused_unpermute
assert _ext._C is None
x, idx = torch.randn(6, 4), torch.randint(3, (6, 2))
for _ in range(3):
    permuted, row_id_map, _ = fused_permute(x, idx, 3)
    fused_unpermute(permuted, row_id_map, torch.rand(6, 2))
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "MissingExtensionWarning" in line]
    assert len(warnings) == 2, result.stderr
    assert "fused_permute on cpu" in warnings[0] and "fused_unpermute on cpu" in warnings[1]
