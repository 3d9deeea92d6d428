"""ops/_launch.py's cached launches, against a stand-in for a Triton kernel (CPU): which calls
take Triton's own path and which the cached kernel, and what the cached kernel is handed. The
GPU test test_fast_launch_gives_bitwise_the_same_results_gpu runs the real kernels both ways."""

from types import SimpleNamespace

import pytest
import torch

from megatron_moe_hybrid.ops import _launch


class FakeCompiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("cached", args))


class FakeJit:
    """The parts of a triton JITFunction that FastKernel uses: x, n, flag at run time, B constexpr."""

    arg_names = ["x", "n", "flag", "B"]
    device_caches: dict = {}

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.log)
        return call


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_launch, "knobs", SimpleNamespace(
        runtime=SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None, debug=False),
        compilation=SimpleNamespace(instrumentation_mode="")))
    monkeypatch.setattr(_launch, "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 1234)))
    return _launch.FastKernel(FakeJit())


def paths(k):
    return [entry[0] for entry in k.fn.log]


def test_first_call_per_key_goes_through_triton_later_ones_hand_every_argument_to_the_cached_kernel(kernel):
    x = torch.zeros(64)
    kernel[(3, 2)](x, 5, False, B=16, num_warps=4)
    kernel[(7,)](x, 5, False, B=16, num_warps=4)
    assert paths(kernel) == ["triton", "cached"] and kernel.hits == 1
    # grid padded to three dims, the stream, the compiled function and metadata, no launch
    # metadata or hooks, then every argument in signature order, the constexpr included
    assert kernel.fn.log[1][1] == (7, 1, 1, 1234, "function", "metadata", None, None, None, x, 5, False, 16)


@pytest.mark.parametrize("first, second", [
    ((5,), (1,)),  # Triton makes int 1 a constant
    ((5,), (16,)),  # and marks ints divisible by 16
    ((5,), (2**40,)),  # int64 against int32
    ((1,), (True,)),  # bool against int 1
])
def test_ints_triton_specialises_differently_get_their_own_kernel(kernel, first, second):
    x = torch.zeros(64)
    for n in (first[0], second[0], second[0]):
        kernel[(1,)](x, n, False, B=16)
    assert paths(kernel) == ["triton", "triton", "cached"]


def test_tensor_dtype_alignment_and_none_get_their_own_kernel(kernel):
    x = torch.zeros(64)
    for t in (x, x[1:], x.half(), None, x[4:]):  # x[4:] is 16 bytes in: aligned, as x
        kernel[(1,)](t, 5, False, B=16)
    assert paths(kernel) == ["triton"] * 4 + ["cached"]


def test_keywords_knobs_and_hooks_decide_the_path(kernel, monkeypatch):
    x = torch.zeros(64)
    kernel[(1,)](x, 5, False, B=16, num_warps=4)
    kernel[(1,)](x, 5, False, B=32, num_warps=4)  # another constexpr
    kernel[(1,)](x, 5, False, B=16, num_warps=8)  # another launch option
    assert paths(kernel) == ["triton"] * 3
    monkeypatch.setattr(_launch.knobs.runtime, "debug", True)
    kernel[(1,)](x, 5, False, B=16, num_warps=4)
    monkeypatch.setattr(_launch.knobs.runtime, "debug", False)
    for hook in ("launch_enter_hook", "launch_exit_hook"):
        # a profiler's hook, alone or in a HookChain as Triton 3.6 keeps them
        for value in (print, SimpleNamespace(calls=[print])):
            monkeypatch.setattr(_launch.knobs.runtime, hook, value)
            kernel[(1,)](x, 5, False, B=16, num_warps=4)
        monkeypatch.setattr(_launch.knobs.runtime, hook, None)
    monkeypatch.setattr(_launch, "ENABLED", False)
    kernel[(1,)](x, 5, False, B=16, num_warps=4)
    assert paths(kernel) == ["triton"] * 9
    monkeypatch.setattr(_launch, "ENABLED", True)
    kernel[(1,)](x, 5, False, B=16, num_warps=4)
    # Triton 3.6's empty HookChains (no hook set) keep the cached path
    monkeypatch.setattr(_launch.knobs.runtime, "launch_enter_hook", SimpleNamespace(calls=[]))
    monkeypatch.setattr(_launch.knobs.runtime, "launch_exit_hook", SimpleNamespace(calls=[]))
    kernel[(1,)](x, 5, False, B=16, num_warps=4)
    assert paths(kernel)[-2:] == ["cached", "cached"]


def test_defaulted_parameters_and_unknown_argument_types_always_take_triton(kernel):
    x = torch.zeros(64)
    for _ in range(2):
        kernel[(1,)](x, 5, False)  # B left to a default: not cached
        kernel[(1,)](x, [5], False, B=16)  # a list: no key
        kernel[(1,)](x, 5, flag=False, B=torch.zeros(1))  # a tensor by keyword would key by identity
    assert paths(kernel) == ["triton"] * 6 and not kernel.cache


def test_verify_mode_launches_triton_and_checks_its_kernel_is_the_cached_one(kernel, monkeypatch):
    """VERIFY (GPU tests): a cached key takes Triton's path; the same compiled kernel back passes
    (counted), another one raises KeyTooCoarse."""
    x = torch.zeros(64)
    same = FakeCompiled(kernel.fn.log)
    monkeypatch.setattr(FakeJit, "__getitem__", lambda self, grid: lambda *a, **k: (self.log.append(("triton",)), same)[1])
    kernel[(1,)](x, 5, False, B=16)
    monkeypatch.setattr(_launch, "VERIFY", True)
    kernel[(1,)](x, 5, False, B=16)
    assert paths(kernel) == ["triton", "triton"] and kernel.verified == 1 and kernel.hits == 0
    # Triton compiles another kernel for a call the key lumps in with a cached one
    monkeypatch.setattr(FakeJit, "__getitem__", lambda self, grid: lambda *a, **k: FakeCompiled(self.log))
    with pytest.raises(_launch.KeyTooCoarse, match="Triton launched another"):
        kernel[(1,)](x, 5, False, B=16)
