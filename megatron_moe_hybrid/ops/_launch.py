"""Launching a Triton kernel with less host time per call than ``kernel[grid](...)``.

Triton's ``JITFunction.run`` binds and specialises every argument, builds a cache key and a
launch-metadata object on every call: on the H200 machine's host (Triton 3.6) cProfile put
about 45 us of a 65 us launch there (benchmarks/device/probe_host.py --cprofile; the profiler
inflates both). The chunked simple GLA at TP=8 (B1-T8192, 4 value heads) makes 12 launches per
forward+backward, whose kernels took 0.30 ms of device time against 1.1-1.3 ms of host time;
launched as below its host time went 1.33 -> 1.08 ms (about 20 us a launch), Gated DeltaNet's
0.99 -> 0.85 ms over 8 launches (benchmarks/results/h200/linear_attention_segments.json).

Every Triton kernel of the package launches through it: the linear-attention chunk kernels,
norms and short conv, the MoE router, layout, gathers, SwiGLU and grouped GEMM, sparse attention
and its indexer, the cross-entropy passes. It counts where a step is host-bound (small
shapes); benchmarks/device/probe_fast_launch.py times both paths (results/h200/fast_launch.json).

``@fast_launch``, above ``@triton.jit``, wraps the kernel. ``wrapped[grid](*args, **kwargs)``
takes the same arguments as the kernel, runtime arguments positionally and constexprs and
launch options (num_warps, num_stages) by keyword. The first call with a new key goes through
Triton's own path, which compiles (or finds) the kernel and launches it; the compiled kernel is
kept under the key. Later calls with the key hand the arguments to its launcher directly.

The key is at least as fine as Triton's specialisation, so a cached kernel is never launched on
arguments Triton would have compiled differently for: per runtime argument the tensor dtype and
whether its address is 16-byte aligned, None, bool value, for ints whether they are 1, divisible
by 16 and which integer type holds them, floats as one kind; every keyword's value; the device;
Triton's debug and instrumentation knobs.
Anything else (another argument type, a launch hook such as a profiler's, the interpreter, a
Triton whose launch protocol this file was not checked against) takes Triton's own path.

Checks: tests/ops/test_launch.py (the key and the launch, CPU); on the GPU, every kernel against
Triton's own path bit for bit (test_fast_launch_gpu.py and the linear-attention twin), and in
every GPU test VERIFY mode (tests/conftest.py): a cached key still launches Triton's way and
must get the cached compiled kernel back, else KeyTooCoarse.
"""

from __future__ import annotations

import torch
import triton

try:
    from triton import knobs
    from triton.runtime import driver
except ImportError:  # Triton before 3.4: no knobs; Triton's own path only
    knobs = driver = None

# Triton versions whose JITFunction.run launches as launch() below does: kernel.run(grid x, y, z,
# stream, function, packed_metadata, launch_metadata, enter hook, exit hook, every bound
# argument in signature order, constexprs included). Checked against the source of each.
# ENABLED False: every launch takes Triton's own path (tests and probes compare the two).
CHECKED_VERSIONS = ("3.6.", "3.9.")
ENABLED = knobs is not None and triton.__version__.startswith(CHECKED_VERSIONS)
# VERIFY True (the GPU tests set it, tests/conftest.py): a call whose key is cached still takes
# Triton's own path, and the compiled kernel Triton launched must be the cached one (the same
# object), else KeyTooCoarse. Every GPU test so checks the key of each kernel it launches twice.
VERIFY = False


class KeyTooCoarse(AssertionError):
    """Triton compiled a different kernel for a call whose key was cached: the key misses a
    specialisation, and a cached launch would have run the wrong binary."""


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if a is None:
        return None
    if isinstance(a, bool):  # before int: True == 1 would share int 1's key
        return (bool, a)
    if isinstance(a, int):
        return (int, a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a >= 2**63)
    if isinstance(a, float):
        return float
    raise TypeError(type(a).__name__)


def _keyword_key(item):
    """Keywords are constexprs and launch options, keyed by value; anything else (a tensor passed
    by keyword would key by identity: a new entry per call) is not cached."""
    if item[1] is None or type(item[1]) in (int, bool, float, str):
        return item
    raise TypeError(type(item[1]).__name__)


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps an empty HookChain (.calls) when none is."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastKernel:
    """A @triton.jit function launched through its cached compiled kernels (module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        self.cache: dict = {}
        self.hits = 0  # launches that took the cached kernel
        self.verified = 0  # VERIFY calls whose cached kernel was Triton's
        self.names = getattr(fn, "arg_names", None)  # None: the interpreter's kernels, Triton's path
        self.supported = self.names is not None and hasattr(fn, "device_caches")

    def __getattr__(self, name):  # device_caches, __name__, ... of the kernel itself
        if name == "fn":
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        runtime = knobs.runtime
        if not (ENABLED and self.supported) or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            return self.fn[grid](*args, **kwargs)
        device = driver.active.get_current_device()
        try:
            key = (device, tuple(map(_arg_key, args)), tuple(map(_keyword_key, kwargs.items())),
                   runtime.debug, knobs.compilation.instrumentation_mode)
            hit = self.cache.get(key)
        except TypeError:  # an argument type the key does not cover
            return self.fn[grid](*args, **kwargs)
        if hit is None:
            kernel = self.fn[grid](*args, **kwargs)
            tail = []
            for name in self.names[len(args):]:
                if name not in kwargs:
                    return kernel  # a parameter left to its default: not cached, Triton's path each time
                tail.append(kwargs[name])
            if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
                self.cache[key] = (kernel, tuple(tail))
            return kernel
        kernel, tail = hit
        if VERIFY:
            launched = self.fn[grid](*args, **kwargs)
            if launched is not kernel:
                raise KeyTooCoarse(f"{getattr(self.fn, '__name__', self.fn)}: key {key} cached one compiled "
                                   "kernel, Triton launched another for this call")
            self.verified += 1
            return launched
        self.hits += 1
        grid = tuple(grid)
        stream = driver.active.get_current_stream(device)
        kernel.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
            kernel.function, kernel.packed_metadata, None, None, None, *args, *tail,
        )
        return kernel


fast_launch = FastKernel  # the decorator: @fast_launch over @triton.jit
