"""The one place that imports the compiled extension megatron_moe_hybrid._C.

_C registers the torch.ops.mmh ops when it loads; it is optional (see setup.py), so
callers ask has_cpu_ops() / has_cuda_ops() and fall back to PyTorch, telling the user
once with warn_missing_once(), or call require() where only the compiled path will do.
Importing this module imports torch and _C, never CUDA.
"""

import warnings
from types import ModuleType

import torch  # noqa: F401  (loads libtorch first: _C links against it)

try:
    from megatron_moe_hybrid import _C
except ImportError:
    _C = None

INSTALL_HINT = (
    "build it with `pip install --no-build-isolation -e .` from the repository root "
    "(needs a C++ compiler; the CUDA ops also need nvcc and a CUDA build of torch)"
)


class MissingExtensionWarning(UserWarning):
    """A compiled fast path is missing and a slower fallback runs instead."""


_warned: set[str] = set()


def has_cpu_ops() -> bool:
    """True when _C is built: every op has a CPU kernel."""
    return _C is not None


def has_cuda_ops() -> bool:
    """True when _C was built with its CUDA kernels (says nothing about a device being present)."""
    return _C is not None and bool(getattr(_C, "WITH_CUDA", 0))


def require(feature: str) -> ModuleType:
    """Returns _C if it has the `feature` ("cpu" or "cuda") ops, else raises with an install hint."""
    checks = {"cpu": has_cpu_ops, "cuda": has_cuda_ops}
    if feature not in checks:
        raise ValueError(f"feature must be one of {sorted(checks)}, got {feature!r}")
    if not checks[feature]():
        built = "is not built" if _C is None else "was built without its CUDA kernels"
        raise RuntimeError(f"megatron_moe_hybrid._C {built}, so its {feature} ops are missing; {INSTALL_HINT}")
    return _C


def warn_missing_once(feature: str, fallback: str = "the plain PyTorch reference") -> None:
    """Warns, once per process and feature, that the `feature` fast path is missing and `fallback` runs."""
    if feature in _warned:
        return
    _warned.add(feature)
    warnings.warn(
        f"megatron_moe_hybrid: {feature} has no compiled kernel here, running {fallback} instead; "
        f"to get it, {INSTALL_HINT}",
        MissingExtensionWarning,
        stacklevel=3,
    )
