"""Compiling our Triton kernels for the H200 on a machine without a GPU.

An op's host code runs on CPU tensors within ``recording``, where every Triton launch is
compiled for a GPU target instead of run, the H200's sm_90a by default (``compile_launch``), by
Triton's own compiler and ptxas, exactly as a first launch on the device would compile it: the
same binder, specialisation (dtypes, 16-byte alignment, ints equal to 1 or divisible by 16),
constexprs and launch options. A launch that would not compile or fit raises into the host code
as it would there. What comes back is what ptxas reports: registers and local (spill) bytes per
thread, shared memory, and the SASS.

Why: the Triton interpreter runs our kernels on the CPU, but it accepts programs that the
compiler rejects or that cannot launch (a tile over the 227 KB of shared memory, a layout the
dot lowering does not take), and it says nothing of registers. Kernel source edited without a
device is compiled here before it reaches one (tests/ops/test_kernels_compile.py), and the
resources a config change would cost are read here for free (tools/compile_kernels.py).

Limits: the compiler is whichever Triton imports first: the CPU machines' 3.9 differs in
places from the H200 machine's 3.6, which tools/compile_kernels.py's docstring says how to put
first; and what runs fast is not decided here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import os
import re
import subprocess
import tempfile

import triton

H200 = ("cuda", 90, 32)  # backend, arch (sm_90a), warp size
# Hopper's shared memory one block may take (227 KB): a launch asking more raises OutOfResources.
MAX_SHARED_BYTES = 227 * 1024


@dataclasses.dataclass
class Launch:
    """One kernel launch as the host code made it: the @triton.jit function, grid, arguments."""

    name: str
    fn: object
    grid: tuple
    args: tuple
    kwargs: dict
    compiled: "Compiled | None" = None


@dataclasses.dataclass
class Compiled:
    """What one launch compiles to for the target, as ptxas reports it (per thread, per block)."""

    name: str
    grid: tuple
    num_warps: int
    num_stages: int
    maxnreg: int | None
    constexprs: dict
    registers: int
    local_bytes: int  # the stack frame per thread: spills (Triton's n_spills is this / 4)
    shared_bytes: int
    sass: str

    @property
    def sass_digest(self) -> str:
        return hashlib.sha256(self.sass.encode()).hexdigest()[:16]

    def line(self) -> str:
        cap = f" maxnreg {self.maxnreg}" if self.maxnreg else ""
        return (f"{self.name}: grid {self.grid} warps {self.num_warps} stages {self.num_stages}{cap}: "
                f"registers {self.registers} local {self.local_bytes} B shared {self.shared_bytes} B "
                f"sass {self.sass_digest}")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class Recording(list):
    """The launches made within recording(), in order, each compiled (Launch.compiled); and
    those the device would have refused for their shared memory (rejected), which raised
    OutOfResources to the host code as a launch on the device does."""

    def __init__(self):
        super().__init__()
        self.rejected: list[Launch] = []


@contextlib.contextmanager
def recording(target: tuple = H200, as_on_device: dict | None = None):
    """Within it every Triton launch (``kernel[grid](...)``, through ops/_launch.py's FastKernel
    or not) is compiled for target instead of run and appended to the yielded Recording; the
    call returns None to the host code, as a launch that is not awaited does. As on the device,
    a kernel that does not compile raises the compiler's error there, and one over the shared
    memory a block may take raises triton's OutOfResources (host code that catches it and tries
    a smaller config, as sparse attention's _launch does, goes on as it would on the GPU); the
    error carries the launch that raised it (.launch). as_on_device: keyword arguments (constexprs)
    that the host code sets from the device it runs on, with the GPU's values (e.g.
    {"FAST_EXP": True}), put in every launch that passes them. Raises where the kernels are the
    interpreter's (they cannot be compiled): import with TRITON_INTERPRET unset."""
    from triton.runtime.errors import OutOfResources
    from triton.runtime.jit import JITFunction

    from . import _launch

    if _interpreting():
        raise RuntimeError("TRITON_INTERPRET=1: the kernels are the interpreter's and cannot be compiled; "
                           "unset it in the process that records launches")
    launches = Recording()

    def run(self, *args, grid, warmup, **kwargs):
        kwargs.update({k: v for k, v in (as_on_device or {}).items() if k in kwargs})
        launch = Launch(self.__name__, self, tuple(grid) if not callable(grid) else grid, args, kwargs)
        try:
            launch.compiled = compile_launch(launch, target)
        except Exception as exc:
            exc.launch = launch  # which launch failed, for the caller's report
            raise
        if launch.compiled.shared_bytes > MAX_SHARED_BYTES:
            launches.rejected.append(launch)
            err = OutOfResources(launch.compiled.shared_bytes, MAX_SHARED_BYTES, "shared memory")
            err.launch = launch
            raise err
        launches.append(launch)

    saved = JITFunction.run, _launch.ENABLED
    JITFunction.run, _launch.ENABLED = run, False
    try:
        yield launches
    finally:
        JITFunction.run, _launch.ENABLED = saved


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: Triton's NVIDIA tools are missing; install the triton wheel that ships them")
    return path


_USAGE: dict[str, dict] = {}  # Triton's kernel hash -> _resource_usage of it


def _resource_usage(cubin: bytes, name: str) -> dict:
    """{REG, STACK, SHARED, LOCAL, ..., sass} of function name in cubin, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = None
    for line in out.splitlines():
        if line.strip().startswith("Function"):
            fields = line.strip().rstrip(":").split()[-1] == name
        elif fields and "REG:" in line:
            usage = {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", line)}
            # the SASS without the header line that names the temporary file
            usage["sass"] = "\n".join(l for l in sass.splitlines() if f.name not in l)
            return usage
    raise RuntimeError(f"cuobjdump found no function {name} in the compiled kernel:\n{out}")


@functools.cache
def _backend(target: tuple):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    gpu = GPUTarget(*target)
    return gpu, make_backend(gpu)


@functools.cache
def _binder(fn, target: tuple):
    """Triton's argument binder and specialiser of fn for target, as its JITFunction makes one
    per device."""
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(fn.signature, fn.params, _backend(target)[1])


def compile_launch(launch: Launch, target: tuple = H200) -> Compiled:
    """Compile launch for target as Triton's first launch of it on such a device would (Triton's
    own cache serves a kernel compiled before; ptxas's report of it is kept per kernel hash)."""
    from triton.compiler import ASTSource

    fn = launch.fn
    gpu, backend = _backend(target)
    binder = _binder(fn, target)
    kwargs = dict(launch.kwargs)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    with contextlib.redirect_stdout(io.StringIO()):  # Triton prints the whole PTX when ptxas fails
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options.__dict__)
    usage = _USAGE.get(kernel.metadata.hash)
    if usage is None:
        usage = _USAGE[kernel.metadata.hash] = _resource_usage(kernel.asm["cubin"], kernel.metadata.name)
    names = [p.name for p in fn.params]
    return Compiled(
        name=launch.name, grid=launch.grid, num_warps=options.num_warps, num_stages=options.num_stages,
        maxnreg=options.maxnreg, constexprs={names[path[0]]: v for path, v in constexprs.items()},
        registers=usage["REG"], local_bytes=max(usage.get("STACK", 0), usage.get("LOCAL", 0)),
        shared_bytes=kernel.metadata.shared, sass=usage["sass"],
    )
