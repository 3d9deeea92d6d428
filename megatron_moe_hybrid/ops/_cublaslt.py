"""cuBLASLt products with the algorithm chosen by timing, through ctypes: out = a' @ b' (+ out).

    gemm(out, a, b, transpose_a=False, transpose_b=False, accumulate=False)
        out [M, N] = a' @ b' (+ out when accumulate), a' = a.T if transpose_a else a (likewise b'),
        every tensor row-major with unit column stride, bf16 or fp16, fp32 accumulation.

torch's matmuls take the first algorithm of cuBLAS's heuristic. For the linear + cross-entropy
weight gradient, grad_weight[V, D] += g[C, V]^T h[C, D] with C (tokens of one chunk) small
next to V x D, the product reads and writes its whole output once per call, and that first
choice overlaps the traffic with the arithmetic poorly: on the H200 at V 151936, D 4096, C 768
it ran at 553 TFLOP/s where another of the heuristic's own candidates ran at 696
(benchmarks/results/h200/loss_grad_weight.json). So the first call at each shape (sizes,
transposes, strides, dtype, device) asks cuBLASLt for its candidates and times each on the
call's own buffers, then keeps the fastest for the process.

Timing on the caller's buffers is safe because each tuning call ends with the right result: a
product that overwrites (accumulate=False) runs once more with the chosen algorithm, and a shape
whose calls accumulate is tuned through `tune_with_overwrite` on a call that overwrites (the
loss's first chunk writes grad_weight, the later ones add into it): its timings of the
accumulating form scribble on memory the final overwrite replaces. No [M, N] scratch is ever
allocated. An accumulating call on a shape never tuned (a short last chunk) takes the
heuristic's first candidate. Tuning waits on CUDA events (a host sync, once per shape), so the
first call at a shape must not be inside a CUDA-graph capture.

Only candidates without split-K are kept: each output is then one fp32 reduction over K rounded
once, as torch's own product does; on the H200 every candidate's result equalled torch's bit for
bit (tests/ops/test_cublaslt.py checks each against torch). The library is the libcublasLt torch itself
loaded (found through /proc/self/maps). CUDA only: on a CPU tensor, or where cuBLASLt cannot run
the shape, `gemm` raises, and callers keep torch's product (ops/cross_entropy/triton.py says when).
"""

import ctypes
import statistics

import torch

# cublasLt.h / library_types.h values
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D bytes; the heuristic assumes 256 unless told
_ALGO_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                "inner_shape": 7, "cluster_shape": 8}
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}
MAX_WORKSPACE_BYTES = 32 * 2**20  # what a candidate may ask for; the chosen one gets exactly its own
MAX_CANDIDATES = 16
TUNE_REPS = 3


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_LIB = None
_HANDLE = None


def _lib():
    """The libcublasLt torch loaded (after one cuBLAS call), with argument types set, and one handle."""
    global _LIB, _HANDLE
    if _LIB is not None:
        return _LIB
    path = _loaded_cublaslt()
    if path is None:
        # one bf16 product makes torch load cuBLAS and cuBLASLt; on the default stream, whose torch
        # cuBLAS workspace any process with a matmul has (on a side stream it would add one)
        with torch.cuda.stream(torch.cuda.default_stream()):
            x = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
            torch.mm(x, x)
        torch.cuda.synchronize()
        path = _loaded_cublaslt()
    if path is None:
        raise RuntimeError("libcublasLt is not loaded in this process; torch's CUDA build loads it for bf16 products")
    lib = ctypes.CDLL(path)
    vp, sz, i32, u64, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_Heuristic),
                                           ctypes.POINTER(i32)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        "cublasLtMatmulAlgoConfigGetAttribute": [vp, i32, vp, sz, ctypes.POINTER(sz)],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    handle = ctypes.c_void_p()
    _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    _LIB, _HANDLE = lib, handle
    return lib


def _loaded_cublaslt():
    """The path of the libcublasLt mapped into this process, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcublasLt.so" in line:
                return line.split()[-1]
    return None


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


class _Plan:
    """One shape: the descriptors, the candidates, the chosen one and its workspaces (one per stream)."""

    def __init__(self, key):
        M, N, K, ta, tb, lda, ldb, ldc, dtype, (align_a, align_b, align_out) = key
        lib = _lib()
        self.lib, self.key = lib, key
        dt = _DTYPES[dtype]
        # column-major view: out^T [N, M] = b'^T a'^T, so cuBLAS's A is b's memory and its B is a's
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "desc")
        for attr, op in ((_DESC_TRANSA, _OP_T if tb else _OP_N), (_DESC_TRANSB, _OP_T if ta else _OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4), "desc attribute")
        self.layouts = [ctypes.c_void_p() for _ in range(3)]
        shapes = ((K, N, ldb) if tb else (N, K, ldb), (M, K, lda) if ta else (K, M, lda), (N, M, ldc))
        for layout, (rows, cols, ld) in zip(self.layouts, shapes):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dt, rows, cols, ld), "layout")
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ws = ctypes.c_uint64(MAX_WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "preference")
        # cuBLAS's A is b's memory, its B is a's; C and D are out
        for attr, align in zip(_PREF_MIN_ALIGNMENT, (align_b, align_a, align_out, align_out)):
            value = ctypes.c_uint32(align)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), 4), "preference")
        self.results = (_Heuristic * MAX_CANDIDATES)()
        count = ctypes.c_int(0)
        a_layout, b_layout, c_layout = self.layouts
        status = lib.cublasLtMatmulAlgoGetHeuristic(_HANDLE, self.desc, a_layout, b_layout, c_layout, c_layout, pref,
                                                    MAX_CANDIDATES, self.results, ctypes.byref(count))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        _check(status, "heuristic")
        self.candidates = [i for i in range(count.value)
                           if self.results[i].state == 0 and self.config(i).get("splitk", 1) <= 1]
        if not self.candidates:
            raise RuntimeError(f"cuBLASLt offers no algorithm without split-K for out[{M}, {N}] (K {K})")
        self.choice = None  # set by tune; until then the heuristic's first
        self.times = {}
        self.workspaces = {}
        self.one = ctypes.c_float(1.0)
        self.zero = ctypes.c_float(0.0)

    def config(self, i):
        """Candidate i's tile, stages, split-K, cluster shape ... as cuBLASLt reports them (ids, not sizes)."""
        out = {}
        algo = ctypes.byref(self.results[i].algo)
        for name, attr in _ALGO_CONFIG.items():
            size, value = ctypes.c_size_t(0), ctypes.c_uint64(0)
            # the first call asks the attribute's size; the second must pass exactly that size
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(algo, attr, None, 0, ctypes.byref(size)) != 0:
                continue
            if 0 < size.value <= 8 and self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                    algo, attr, ctypes.byref(value), size.value, ctypes.byref(size)) == 0:
                out[name] = value.value
        out["workspace_bytes"] = self.results[i].workspace_size
        return out

    def run(self, out, a, b, accumulate, candidate=None):
        i = self.candidates[0] if candidate is None and self.choice is None else (
            self.choice if candidate is None else candidate)
        stream = torch.cuda.current_stream(out.device)
        need = self.results[i].workspace_size
        ws = self.workspaces.get(stream.cuda_stream)
        if ws is None or ws.numel() < need:  # one per stream: two streams at once never share one
            ws = torch.empty(max(need, 1), dtype=torch.uint8, device=out.device)
            self.workspaces[stream.cuda_stream] = ws
        _check(self.lib.cublasLtMatmul(_HANDLE, self.desc, ctypes.byref(self.one), b.data_ptr(), self.layouts[0],
                                       a.data_ptr(), self.layouts[1],
                                       ctypes.byref(self.one if accumulate else self.zero),
                                       out.data_ptr(), self.layouts[2], out.data_ptr(), self.layouts[2],
                                       ctypes.byref(self.results[i].algo), ws.data_ptr(), need, stream.cuda_stream),
               "matmul")
        return out

    def tune(self, out, a, b, accumulate):
        """Times every candidate on these buffers with this accumulate flag and keeps the fastest."""
        for i in self.candidates:
            try:
                self.run(out, a, b, accumulate, candidate=i)  # warm-up (loads the kernel)
            except RuntimeError:
                continue
            samples = []
            for _ in range(TUNE_REPS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.run(out, a, b, accumulate, candidate=i)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            self.times[i] = statistics.median(samples)
        if not self.times:
            raise RuntimeError(f"no cuBLASLt candidate ran for out{tuple(out.shape)}")
        self.choice = min(self.times, key=self.times.get)
        for key in [k for k, ws in self.workspaces.items() if ws.numel() > self.results[self.choice].workspace_size]:
            del self.workspaces[key]  # what a slower candidate needed is not kept


_PLANS: dict[tuple, "_Plan | Exception"] = {}  # a shape cuBLASLt cannot run keeps its error: asked once


def _key(out, a, b, transpose_a, transpose_b):
    if out.dtype not in _DTYPES or a.dtype != out.dtype or b.dtype != out.dtype:
        raise ValueError(f"cuBLASLt gemm takes bf16 or fp16 of one dtype, got {a.dtype}, {b.dtype} -> {out.dtype}")
    if not (out.is_cuda and a.is_cuda and b.is_cuda):
        raise ValueError("cuBLASLt gemm runs on CUDA tensors only")
    M, N = out.shape
    K = a.shape[0] if transpose_a else a.shape[1]
    if (a.shape[1] if transpose_a else a.shape[0]) != M or (b.shape[1] if transpose_b else b.shape[0]) != K or \
            (b.shape[0] if transpose_b else b.shape[1]) != N:
        raise ValueError(f"gemm shapes do not agree: out {tuple(out.shape)}, a {tuple(a.shape)} (transposed "
                         f"{transpose_a}), b {tuple(b.shape)} (transposed {transpose_b})")
    for name, t in (("out", out), ("a", a), ("b", b)):
        if t.stride(1) != 1:
            raise ValueError(f"gemm needs {name} with unit column stride, got strides {t.stride()}")
    aligns = tuple(_alignment(t.data_ptr()) for t in (a, b, out))
    return (M, N, K, transpose_a, transpose_b, a.stride(0), b.stride(0), out.stride(0), out.dtype, aligns, out.device)


def _alignment(address: int) -> int:
    """The largest power of two up to 256 dividing a device address (a row slice starts anywhere)."""
    align = 256
    while address % align:
        align //= 2
    return align


def plan(out, a, b, transpose_a=False, transpose_b=False):
    """The _Plan of this shape (built, not yet tuned, on first sight)."""
    key = _key(out, a, b, transpose_a, transpose_b)
    if key not in _PLANS:
        try:
            _PLANS[key] = _Plan(key[:-1])
        except RuntimeError as error:
            _PLANS[key] = error
    found = _PLANS[key]
    if isinstance(found, Exception):
        raise RuntimeError(str(found))
    return found


def gemm(out, a, b, transpose_a=False, transpose_b=False, accumulate=False):
    """out = a' @ b' (+ out): see the module docstring. An overwriting product tunes on its first call."""
    p = plan(out, a, b, transpose_a, transpose_b)
    if p.choice is None and not accumulate:
        p.tune(out, a, b, accumulate=False)
    return p.run(out, a, b, accumulate)


def tune_with_overwrite(out, a, b, transpose_a=False, transpose_b=False):
    """out = a' @ b', having timed the accumulating product (out += a' @ b') on out's own memory first.

    For a shape whose later calls accumulate: the timings of the accumulating form are taken
    here, where out's content does not matter, and the last product overwrites what they left."""
    p = plan(out, a, b, transpose_a, transpose_b)
    if p.choice is None:
        p.tune(out, a, b, accumulate=True)
    return p.run(out, a, b, accumulate=False)
