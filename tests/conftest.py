import os

import pytest

# Keep CPU tests fast and reproducible on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Without a GPU, Triton kernels run in its interpreter. The flag is read when a kernel is
# decorated, so it must be set before any test module imports one.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped where no CUDA device exists (CI, developer machines)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error reported elsewhere
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Tests import the package from this checkout even where it is not pip-installed.
import sys  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")


@pytest.fixture(autouse=True)
def _verify_fast_launch_keys(request, monkeypatch):
    """In GPU tests every kernel launched through ops/_launch.py's cache is checked: a call whose
    key is cached takes Triton's own path and must get the cached compiled kernel back
    (_launch.VERIFY). Tests of the cached path itself set VERIFY back to False."""
    if "gpu" in request.keywords:
        from megatron_moe_hybrid.ops import _launch

        monkeypatch.setattr(_launch, "VERIFY", True)
