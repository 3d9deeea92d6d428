"""Which backends this installation can use: `python -m megatron_moe_hybrid.env`.

Prints one "name: value" line per backend: its version, or "not installed". Versions of
optional packages come from their installed metadata, so nothing heavy is imported, and
CUDA is only touched when torch reports a device.
"""

import importlib.metadata
import platform

from megatron_moe_hybrid import __version__

# Report name -> the distribution names it is published under, tried in order.
_DISTRIBUTIONS = {
    "triton": ("triton", "pytorch-triton"),
    "transformer-engine": ("transformer-engine", "transformer-engine-torch"),
    "apex": ("apex",),
    "megatron-core": ("megatron-core",),
    "sentencepiece": ("sentencepiece",),
    "safetensors": ("safetensors",),
    "tensorboard": ("tensorboard",),
    "transformers": ("transformers",),  # HF parity tests, the end-to-end anchor, converted models' configs
    "tokenizers": ("tokenizers",),  # a converted model's tokenizer.json
    "peft": ("peft",),  # tools/export_lora.py's format
    "fla": ("flash-linear-attention", "fla-core"),
    "liger-kernel": ("liger-kernel", "liger-kernel-nightly"),
    "cut-cross-entropy": ("cut-cross-entropy",),
}


def _version(distributions: tuple[str, ...]) -> str:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _torch_lines() -> dict[str, str]:
    try:
        import torch
    except ImportError:
        return {"torch": "not installed"}
    lines = {"torch": torch.__version__, "torch cuda": torch.version.cuda or "none (CPU build)"}
    # is_available() does not create a CUDA context; the device queries below do, so only with a device.
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        major, minor = torch.cuda.get_device_capability(0)
        lines["cuda device"] = f"{torch.cuda.get_device_name(0)} (sm_{major}{minor}), {count} visible"
    else:
        lines["cuda device"] = "no CUDA device"
    return lines


def _extension_lines() -> dict[str, str]:
    try:
        from megatron_moe_hybrid import _ext
    except ImportError as error:  # torch itself is missing
        return {"csrc _C": f"not loaded ({error})", "csrc _C cpu ops": "no", "csrc _C cuda ops": "no"}
    return {
        "csrc _C": _ext._C.__file__ if _ext._C is not None else "not built",
        "csrc _C cpu ops": "yes" if _ext.has_cpu_ops() else "no",
        "csrc _C cuda ops": "yes" if _ext.has_cuda_ops() else "no",
    }


def env_report() -> dict[str, str]:
    """Backend name -> version (or "not installed", "yes"/"no" for the compiled ops)."""
    report = {
        "megatron_moe_hybrid": __version__,
        "python": platform.python_version(),
        **_torch_lines(),
        "triton": _version(_DISTRIBUTIONS["triton"]),
        **_extension_lines(),
    }
    for name, distributions in _DISTRIBUTIONS.items():
        report.setdefault(name, _version(distributions))
    return report


def main(argv=None) -> None:
    import argparse

    argparse.ArgumentParser(prog="python -m megatron_moe_hybrid.env", description=__doc__.splitlines()[0]).parse_args(argv)
    for name, value in env_report().items():
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
