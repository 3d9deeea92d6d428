"""Installs megatron_moe_hybrid and, where it can, its compiled ops megatron_moe_hybrid._C.

    pip install --no-build-isolation -e .     # torch must be importable while building

_C is CPU C++ wherever a C++ compiler exists, plus CUDA kernels where nvcc is found and
torch is a CUDA build. Environment:
    SKIP_CPP_BUILD=1        build no extension at all (quick install; ops use their PyTorch fallback)
    SKIP_CUDA_BUILD=1       build the CPU C++ ops only
    TORCH_CUDA_ARCH_LIST    CUDA archs, default "9.0a" (H100/H200); e.g. "8.0;9.0a", "+PTX" adds PTX
    MAX_JOBS                parallel compile jobs, read by torch's ninja build
The install never fails because a compiler, nvcc or a GPU is missing or the compile fails:
it warns and installs without _C (pip shows the warning with -v), and the package says at
run time, once, which fast path is missing.
"""

import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
VERSION = re.search(
    r'^__version__ = "([^"]+)"', (ROOT / "megatron_moe_hybrid" / "__init__.py").read_text(), re.M
).group(1)
EXT_NAME = "megatron_moe_hybrid._C"


def _warn(message: str) -> None:
    print(f"\nWARNING: {message}\n", file=sys.stderr, flush=True)


def _gencode_flags(arch_list: str) -> list[str]:
    """'9.0a;8.0+PTX' -> nvcc -gencode flags (SASS for each arch, PTX where +PTX is given)."""
    flags = []
    for entry in re.split(r"[;\s]+", arch_list.strip()):
        if not entry:
            continue
        arch, ptx = entry.removesuffix("+PTX"), entry.endswith("+PTX")
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)", arch)
        if match is None:
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST: cannot read {entry!r}; use entries like 9.0a, 8.0 or 9.0+PTX"
            )
        num = "".join(match.groups())
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _optional_build_ext(base):
    class OptionalBuildExt(base):
        """torch's BuildExtension that warns, instead of failing the install, when _C won't build."""

        def run(self):
            try:
                super().run()
            except Exception as error:  # compiler errors come as several unrelated types
                _warn(
                    f"building {EXT_NAME} failed ({type(error).__name__}: {error}); installing "
                    "without it, so the ops run their PyTorch fallback. Rebuild with "
                    "`pip install --no-build-isolation -v -e .` to see the compiler output."
                )
                # With no extensions left, the (editable) wheel does not look for the missing .so.
                self.extensions = []

    return OptionalBuildExt


def _extension_setup() -> dict:
    """ext_modules and cmdclass for setup(): empty where _C cannot or should not be built."""
    if os.environ.get("SKIP_CPP_BUILD") == "1":
        _warn(f"SKIP_CPP_BUILD=1: installing without {EXT_NAME}")
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as error:
        _warn(
            f"torch is not importable while building ({error}), so {EXT_NAME} is not built; "
            "install torch first, then `pip install --no-build-isolation -e .`"
        )
        return {}
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        _warn(f"no C++ compiler found (CXX or c++), so {EXT_NAME} is not built")
        return {}

    sources = ["csrc/permute.cpp", "csrc/linear_attention.cpp"]
    # -ffp-contract=off: no fused multiply-add, so the CPU ops round exactly like the reference;
    # -g0 drops the debug info of Python's default flags: a faster compile and a smaller .so.
    cxx_flags = ["-O2", "-g0", "-ffp-contract=off"]
    link_flags = []
    if sys.platform.startswith("linux"):
        # at::parallel_for runs serially without OpenMP; at load time torch's libgomp is reused.
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")

    cuda_home = cpp_extension.CUDA_HOME
    has_nvcc = cuda_home is not None and os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))
    if os.environ.get("SKIP_CUDA_BUILD") == "1":
        reason = "SKIP_CUDA_BUILD=1"
    elif not torch.version.cuda:
        reason = f"torch {torch.__version__} is not a CUDA build"
    elif not has_nvcc:
        reason = "nvcc was not found (set CUDA_HOME)"
    else:
        reason = None

    if reason is None:
        arch_flags = _gencode_flags(os.environ.get("TORCH_CUDA_ARCH_LIST") or "9.0a")
        extension = cpp_extension.CUDAExtension(
            name=EXT_NAME,
            sources=sources + ["csrc/cuda/permute_cuda.cu", "csrc/cuda/linear_attention_cuda.cu"],
            define_macros=[("WITH_CUDA", None)],
            # Explicit -gencode flags stop torch from adding its own arch list.
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O2", *arch_flags]},
            extra_link_args=link_flags,
        )
    else:
        print(f"building {EXT_NAME} with CPU ops only: {reason}", file=sys.stderr)
        extension = cpp_extension.CppExtension(
            name=EXT_NAME,
            sources=sources,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    return {
        "ext_modules": [extension],
        "cmdclass": {"build_ext": _optional_build_ext(cpp_extension.BuildExtension)},
    }


setup(
    name="megatron_moe_hybrid",
    version=VERSION,
    description="Megatron-Core extension: sparse MoE LMs with hybrid linear / top-k sparse attention",
    packages=find_packages(exclude=["tests", "tests.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch",
        "megatron-core>=0.16,<0.17; python_version < '3.12'",
        "megatron-core>=0.16; python_version >= '3.12'",
        "triton; platform_system == 'Linux'",
        "sentencepiece",
        "safetensors",
        "pyyaml",
        "tqdm",
        "tensorboard",
        "numpy",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "peft"],  # peft (pulls transformers): the LoRA export loads in peft
        "te": ["transformer-engine"],
        # NVIDIA Apex is not on PyPI (the PyPI "apex" is an unrelated package).
        "apex": ["apex @ git+https://github.com/NVIDIA/apex.git"],
    },
    zip_safe=False,
    **_extension_setup(),
)
