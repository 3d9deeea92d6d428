"""Compile our Triton kernels for the H200 on any machine, no GPU needed.

    python tools/compile_kernels.py [--op gdn,gla,sparse] [--shape qwen,b4,mla,...|all]
        [--head-dim D] [--dtype bfloat16|float16|float32] [--set NAME=VALUE ...] [--sass DIR]
        [--json PATH] [--against REV]

Runs one forward+backward of each op at each shape on CPU tensors with every Triton launch
compiled for sm_90a instead of run, by Triton's compiler and ptxas, as the first launch on an
H200 would compile it (megatron_moe_hybrid/ops/_aot.py). Prints per
kernel the launch grid and options, registers and local (spill) bytes per thread, shared
memory, how many programs fit on one SM, and a digest of the SASS: two sources whose digests
agree compile to the same machine code.

Ops and their shapes (default: the first listed; a shape key applies to the ops that have it):
    gdn, gla   chunk_gated_delta_rule, chunk_simple_gla (ops/linear_attention/triton_chunk.py)
               at benchmarks/linear_attention.py's shapes: qwen, h32, b4, h96, tp8, varlen, ...
    layer      the linear-attention layer's short conv, q/k L2 norms and gated output RMSNorm,
               at the same shapes
    sparse     sparse_attention with the indexer loss's target (ops/sparse_attention/
               triton_sparse.py) at benchmarks/sparse_attention.py's shapes: mla, mla-h32,
               mla128k, gqa8k, gqa32k, with 64 queries (the query count sets only the grids),
               each pass in the form "auto" takes on the GPU (FORWARD_FORM, BACKWARD_FORM:
               cuBLAS products around a few kernels from 32-64 heads a group, the fused
               kernels backward at GQA; --set "FORWARD_FORM='kernels'" for the kernels, --set
               "BACKWARD_FORM='kernels'" for the dq and dk/dv kernels)
    indexer    the lightning indexer's top-k (token and block mode) and its index scores at the
               selected keys, forward and backward: dsv32 (B1, T 4096, 64 heads x 128, top-2048);
               and the dense warm-up's fused KL loss (triton_dense_kl) with that indexer under
               the GQA (16 heads / 4 groups, D 128) and MLA (128 heads, D 192) main attention
    loss       chunked_linear_cross_entropy's Triton path, trainable and frozen weight: v152k,
               v262k (benchmarks/loss.py's hidden and vocab sizes, 16 tokens)
    moe        the MoE layer's router, layout, gathers, grouped GEMM and SwiGLU: S1, S2
               (benchmarks/moe.py's widths, 512 tokens, 8 experts in the GEMMs)
Every @triton.jit kernel of the package is launched by one of these (tests/ops/
test_kernels_compile.py checks that).

--against REV runs the same on git revision REV's package (a temporary worktree; this
checkout's recorders and compiler driver) and compares the SASS launch by launch: a refactor of
kernel source that compiles to the same machine code at every shape needs no new GPU run.
Exit 0 when all agree, 2 where any differs.

--set changes a switch of the op's Triton module for the run, e.g. --set STATES_TMA=True,
--set FUSE_GROUP_SUM.gdn=False, --set "CONFIGS.prep=(None, 4, 128)" (values are Python
literals). A launch over the 227 KB of shared memory a block may take raises OutOfResources
in the recording host code, as on the H200: where the host code tries a smaller config then
(sparse attention), the tool says so and goes on. Exits 1 if a kernel does not compile or an
op fails so.

The compiler is whichever Triton imports first. The CPU machines' is 3.9, whose registers and
code differ in places from the H200 machine's 3.6. For the device's compiler, put 3.6.0 first:
    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 python tools/compile_kernels.py ...
which reproduces what the H200 runs reported (the delta rule's prep kernel 217 registers;
simple GLA's whole-state o sweep 255 with 48 B spilled, its chunk kernel 196 at B1-T32768-H32).
Timing still needs the device.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib.util
import json
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS_SHAPES = {  # benchmarks/loss.py's (hidden, vocab), with LOSS_TOKENS tokens
    "v152k": ("D4096-V151936", 4096, 151936),
    "v262k": ("D7168-V262144", 7168, 262144),
}
INDEXER_SHAPES = {  # DeepSeek-V3.2's lightning indexer: (name, B, T = S, HI heads, DI dim, top-k)
    "dsv32": ("B1-T4096-HI64-DI128-K2048", 1, 4096, 64, 128, 2048),
}
# op -> the benchmark whose SHAPES it takes, or its own table
OPS = {"gdn": "linear_attention", "gla": "linear_attention", "sparse": "sparse_attention", "loss": LOSS_SHAPES,
       "moe": "moe", "layer": "linear_attention", "indexer": INDEXER_SHAPES}
SPARSE_QUERIES = 64

# Hopper per SM: 64K registers, 228 KB of shared memory of which each block reserves 1 KB.
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
BLOCK_RESERVED_SHARED = 1024


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Programs (blocks) of a kernel resident on one SM at once, by registers and shared memory
    (registers are granted per warp in 256-register units)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM_REGISTERS // (per_warp * num_warps)
    by_shared = SM_SHARED_BYTES // (shared_bytes + BLOCK_RESERVED_SHARED)
    return min(by_registers, by_shared, 64 // num_warps)


@functools.cache
def _benchmark(name: str):
    """benchmarks/<name>.py as a module (its SHAPES, input builders)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def apply_setting(modules: list, setting: str) -> None:
    """NAME=VALUE or NAME.KEY=VALUE (a dict entry) on the first of modules that has NAME;
    VALUE a Python literal."""
    if "=" not in setting:
        raise SystemExit(f"--set {setting!r}: expected NAME=VALUE, e.g. STATES_TMA=True")
    name, value = setting.split("=", 1)
    name, _, key = name.strip().partition(".")
    module = next((m for m in modules if hasattr(m, name)), None)
    if module is None:
        names = " or ".join(m.__name__.rsplit(".", 1)[-1] for m in modules)
        raise SystemExit(f"--set {setting!r}: {names} has no switch {name}")
    try:
        value = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise SystemExit(f"--set {setting!r}: {value!r} is not a Python literal (quote strings: NAME='whole')")
    if key:
        table = getattr(module, name)
        if not isinstance(table, dict) or key not in table:
            raise SystemExit(f"--set {setting!r}: {name} has no entry {key!r} (entries: {list(table)})")
        table[key] = value
    else:
        setattr(module, name, value)


def _cu_seqlens(lengths):
    """int64 cu_seqlens [N + 1] of packed sequence lengths; None for a plain batch."""
    import torch

    return None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _gpu_path(op: str, head_dim, dtype: str) -> None:
    """The ops whose shapes fix their widths take no --head-dim, and their GPU path bf16 or fp16."""
    if head_dim is not None or dtype not in ("bfloat16", "float16"):
        raise SystemExit(f"--op {op}: its shapes fix the head dims and widths (no --head-dim), and it takes "
                         f"bf16 or fp16 on the GPU (--dtype); got --head-dim {head_dim}, --dtype {dtype}")


def record_linear(op: str, shape: tuple, head_dim: int | None = None, dtype: str = "bfloat16") -> list:
    """The kernel launches of one forward+backward of op (gdn or gla) at a linear-attention
    SHAPES entry, its head dim replaced by head_dim if given, q, k, v (and beta) in dtype; the
    tensors are left empty (the kernels are not run, and the host reads none of their values)."""
    import torch

    from megatron_moe_hybrid.ops import _aot
    from megatron_moe_hybrid.ops import linear_attention as la

    _, B, T, HQK, HV, D, lengths = shape
    D, dt = head_dim or D, getattr(torch, dtype)
    x = [torch.empty(B, T, HQK, D, dtype=dt) for _ in "qk"]
    x += [torch.empty(B, T, HV, D, dtype=dt), torch.zeros(B, T, HV)]
    if op == "gdn":
        x.append(torch.zeros(B, T, HV, dtype=dt))
    for t in x:
        t.requires_grad_()
    cu = _cu_seqlens(lengths)
    with _aot.recording() as launches:
        if op == "gdn":
            o, _ = la.chunk_gated_delta_rule(*x, cu_seqlens=cu, backend="triton")
        else:
            o, _ = la.chunk_simple_gla(x[0], x[1], x[2], g=x[3], cu_seqlens=cu, backend="triton")
        torch.autograd.grad(o, x, torch.ones_like(o))
    return launches


def record_sparse(op: str, shape: tuple, head_dim: int | None = None, dtype: str = "bfloat16") -> list:
    """The kernel launches of a forward+backward of sparse_attention with the indexer loss's
    sparse-stage target (sparse_attention_with_target) and of one without it (at absorbed MLA's
    heads auto's forward differs: the products make the target) at a sparse-attention SHAPES entry with
    SPARSE_QUERIES queries (random inputs, causal random top-k indices: the host's cuBLAS products
    and gathers run on the CPU, so the values are real)."""
    import torch

    from megatron_moe_hybrid.ops import _aot
    from megatron_moe_hybrid.ops import sparse_attention as sa

    _, B, T, S, H, G, D, DV, K, shared = shape
    _gpu_path(op, head_dim, dtype)
    bench = _benchmark("sparse_attention")
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    indices = bench.causal_indices(B, SPARSE_QUERIES, S, K, "cpu")
    q = torch.randn(B, SPARSE_QUERIES, H, D, generator=gen).to(dt).requires_grad_()
    k = torch.randn(B, S, G, D, generator=gen).to(dt).requires_grad_()
    v = k[..., :DV] if shared else torch.randn(B, S, G, DV, generator=gen).to(dt).requires_grad_()
    leaves = (q, k) if shared else (q, k, v)
    with _aot.recording() as launches:
        o = sa.sparse_attention_with_target(q, k, v, indices, backend="triton")[0]  # and the indexer's target
        torch.autograd.grad(o, leaves, torch.ones_like(o))
        o = sa.sparse_attention(q, k, v, indices, backend="triton")[0]
        torch.autograd.grad(o, leaves, torch.ones_like(o))
    return launches


LOSS_TOKENS = 16


@contextlib.contextmanager
def _fp32_cpu_products():
    """torch.mm of bf16 / fp16 CPU tensors computed in fp32 and rounded into its output: the
    same shapes and dtypes for the kernels that read it, at a CPU's fp32 speed. (The loss's
    logits products at vocab 151936 took 172 s each in bf16 on a 2-core CI machine, most of the
    kernels-compile test's time; their values do not matter to a recording.)"""
    import torch

    mm = torch.mm

    def fp32_mm(a, b, *, out=None):
        if a.device.type != "cpu" or a.dtype not in (torch.bfloat16, torch.float16):
            return mm(a, b, out=out)
        result = mm(a.float(), b.float()).to(a.dtype)
        return result if out is None else out.copy_(result)

    torch.mm = fp32_mm
    try:
        yield
    finally:
        torch.mm = mm


def record_loss(op: str, shape: tuple, head_dim: int | None = None, dtype: str = "bfloat16") -> list:
    """The kernel launches of chunked_linear_cross_entropy's Triton path, forward+backward, with
    a trainable weight and with a frozen one, plus z-loss and label smoothing (their kernels'
    other variants), on LOSS_TOKENS tokens (the count sets only grids and chunking), zeros for
    values. The logits products run on the CPU. FAST_EXP, which the host sets from is_cuda, is
    taken as on the GPU."""
    import torch

    from megatron_moe_hybrid.ops import _aot
    from megatron_moe_hybrid.ops.cross_entropy import triton as ce

    _gpu_path(op, head_dim, dtype)
    _, D, V = shape
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    labels = torch.randint(0, V, (LOSS_TOKENS,), generator=gen)
    with _aot.recording(as_on_device={"FAST_EXP": True}) as launches, _fp32_cpu_products():  # FAST_EXP: from is_cuda
        for trainable, z_loss, smoothing in ((True, 0.0, 0.0), (False, 1e-4, 0.1)):
            hidden = torch.zeros(LOSS_TOKENS, D, dtype=dt).requires_grad_()
            weight = torch.zeros(V, D, dtype=dt).requires_grad_(trainable)
            loss = ce.triton_linear_cross_entropy(hidden, weight, labels, z_loss_weight=z_loss,
                                                  label_smoothing=smoothing)
            torch.autograd.grad(loss, [hidden, weight] if trainable else [hidden])
    return launches


MOE_TOKENS = 512
MOE_GEMM_EXPERTS = 8


def record_moe(op: str, shape: dict, head_dim: int | None = None, dtype: str = "bfloat16") -> list:
    """The kernel launches of the MoE layer's Triton ops, each called as the static dispatcher
    and the experts call it at a benchmarks/moe.py shape with MOE_TOKENS tokens and, in the
    grouped GEMMs, MOE_GEMM_EXPERTS experts (the counts set only grids): the fused router
    (softmax, and sigmoid with an expert bias; forward and backward), the split-precision
    operands of the router GEMMs, the counting-sort layout, the
    row gathers (permute, weighted combine, the combine weights' gradient), the grouped GEMM
    (forward, input and weight gradients) and SwiGLU (forward and backward)."""
    import torch

    from megatron_moe_hybrid.ops import _aot
    from megatron_moe_hybrid.ops.moe import gather, grouped_triton, layout, swiglu, topk

    _gpu_path(op, head_dim, dtype)
    T, H, E, K, F = MOE_TOKENS, shape["hidden"], shape["experts"], shape["topk"], shape["ffn"]
    R = T * K  # expert rows: every token's K copies
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, E, (T, K), generator=gen)
    rows = torch.randperm(R, generator=gen).view(T, K)  # each copy's expert row
    G = min(E, MOE_GEMM_EXPERTS)  # the GEMMs' experts: the count sets only grids and weight bytes
    counts = torch.full((G,), R // G, dtype=torch.int32)
    counts[: R % G] += 1
    bounds = grouped_triton.row_bounds(counts)
    with _aot.recording() as launches:
        logits = torch.zeros(T, E, requires_grad=True)
        for score_func, bias in (("softmax", None), ("sigmoid", torch.zeros(E))):
            outs = topk.fused_router_topk(logits, K, score_func, bias, stats=True)
            grads = [o for o in outs if o.requires_grad]
            torch.autograd.grad(grads, logits, [torch.ones_like(o) for o in grads])
        topk.split_hi_lo(torch.zeros(E, H), dt, along_rows=True)
        topk.split_hi_lo(torch.zeros(T, E), dt, along_rows=False)
        layout.expand_layout(idx, E, R, backend="triton")
        x = torch.zeros(T, H, dtype=dt)
        y = torch.zeros(R, H, dtype=dt)
        gather.scatter_rows(x, rows, torch.zeros(R, dtype=torch.int64), None, backend="triton")  # permute
        gather.gather_sum(y, rows, torch.ones(T, K), backend="triton")  # weighted combine
        gather.gather_sum(y, rows, None, backend="triton")  # the permute's input gradient
        gather.row_dot(x, y, rows, backend="triton")  # the combine weights' gradient
        for wgrad in ("auto", "triton"):
            w1 = torch.zeros(G, H, 2 * F, dtype=dt, requires_grad=True)
            w2 = torch.zeros(G, F, H, dtype=dt, requires_grad=True)
            h1 = grouped_triton.GroupedMM.apply(y.requires_grad_(), w1, bounds, wgrad)
            act = swiglu.swiglu(h1, backend="triton")
            out = grouped_triton.GroupedMM.apply(act, w2, bounds, wgrad)
            torch.autograd.grad(out, [y, w1, w2], torch.ones_like(out))
    return launches


def record_layer(op: str, shape: tuple, head_dim: int | None = None, dtype: str = "bfloat16") -> list:
    """The kernel launches of the linear-attention layer's other Triton ops at a linear-attention
    SHAPES entry, forward and backward, as the layer calls them: the short causal conv (+ SiLU)
    over the q, k, v channels (width 4; packed where the shape is), the q and k L2 norms, the
    gated output RMSNorm (seq_first); values left empty."""
    import torch

    from megatron_moe_hybrid.ops import _aot
    from megatron_moe_hybrid.ops.linear_attention.norms import gated_rms_norm, l2_normalize
    from megatron_moe_hybrid.ops.linear_attention.short_conv import causal_conv1d

    _, B, T, HQK, HV, D, lengths = shape
    D, dt = head_dim or D, getattr(torch, dtype)
    C = 2 * HQK * D + HV * D
    cu = _cu_seqlens(lengths)
    with _aot.recording() as launches:
        x = torch.empty(B, T, C, dtype=dt, requires_grad=True)
        w = torch.empty(C, 4, dtype=dt, requires_grad=True)
        y = causal_conv1d(x, w, cu, backend="triton")
        torch.autograd.grad(y, [x, w], torch.empty_like(y))
        q = torch.empty(B, T, HQK, D, dtype=dt, requires_grad=True)
        y = l2_normalize(q, 1e-6, "triton")
        torch.autograd.grad(y, q, torch.empty_like(y))
        o = torch.empty(T, B, HV, D, dtype=dt, requires_grad=True)
        z = torch.empty(T, B, HV, D, dtype=dt, requires_grad=True)
        weight = torch.empty(D, dtype=dt, requires_grad=True)
        y = gated_rms_norm(o, z, weight, 1e-6, seq_first=True, backend="triton")
        torch.autograd.grad(y, [o, z, weight], torch.empty_like(y))
    return launches




def record_indexer(op: str, shape: tuple, head_dim: int | None = None, dtype: str = "bfloat16") -> list:
    """The kernel launches of the lightning indexer (ops/sparse_attention/triton_indexer.py):
    the top-k selection (token and block mode, and fp8 scoring: scoring, then the compaction
    after torch's selection on the CPU) and the index scores at selected keys, forward and backward (the
    sparse stage's KL loss input; its per-key reduce is sparse attention's)."""
    import torch

    from megatron_moe_hybrid.ops import _aot
    from megatron_moe_hybrid.ops.sparse_attention import triton_indexer as ti

    _gpu_path(op, head_dim, dtype)
    _, B, T, HI, DI, K = shape
    dt = getattr(torch, dtype)
    q = torch.zeros(B, T, HI, DI, dtype=dt, requires_grad=True)
    k = torch.zeros(B, T, DI, dtype=dt, requires_grad=True)
    w = torch.zeros(B, T, HI, dtype=dt, requires_grad=True)
    indices = _benchmark("sparse_attention").causal_indices(B, T, T, K, "cpu")

    class ZeroedEmpty:
        """The module's torch, with empty() zero-filled: the selection's host code reads the scoring
        kernel's output, which a recorded launch never writes (uninitialised memory there made the
        block mode's gather fail now and then)."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return torch.zeros(*args, **kwargs)

    saved, ti.torch = ti.torch, ZeroedEmpty()
    try:
        with _aot.recording() as launches:
            for block_size in (None, 64):
                ti.lightning_indexer_topk_triton(q.detach(), k.detach(), w.detach(), K, block_size=block_size)
            # fp8 scoring (sparse_attention.indexer_fp8): float8_e4m3fn rows, fp32 scaled weights
            f8 = torch.float8_e4m3fn
            ti.lightning_indexer_topk_triton(q.detach().to(f8), k.detach().to(f8), w.detach().float(), K,
                                             k_scale=torch.ones(B, T))
            # long rows (from SELECT_BLOCK_MIN_KEYS keys): the kernel also writes the runs' maxima
            settings = ti.SELECT_BLOCK_MIN_KEYS, ti.RADIX_RUNS_MIN_KEYS, ti.SELECT_THRESHOLD
            try:
                ti.SELECT_BLOCK_MIN_KEYS = ti.RADIX_RUNS_MIN_KEYS = 0
                for form in ("topk", "radix"):  # the radix select's kernels too
                    ti.SELECT_THRESHOLD = form
                    ti.lightning_indexer_topk_triton(q.detach(), k.detach(), w.detach(), K)
                # the radix form's runs kernel, at rows of more than K runs (8 of them: the grid)
                ords = torch.zeros(8, 2 * K * ti.SELECT_BLOCK, dtype=torch.int32)
                ti._select_by_runs(ords, torch.zeros(8, 2 * K, dtype=torch.int32), K, ti.SELECT_BLOCK)
            finally:
                ti.SELECT_BLOCK_MIN_KEYS, ti.RADIX_RUNS_MIN_KEYS, ti.SELECT_THRESHOLD = settings
            scores = ti.lightning_indexer_sparse_triton(q, k, w, indices)
            torch.autograd.grad(scores, [q, k, w], torch.ones_like(scores))
            # the dense warm-up's fused KL loss (triton_dense_kl), forward and backward, with the
            # main attention of the GQA layout (16 heads on 4 groups, D 128) and of MLA's (128
            # heads with their own 192-wide keys); 256 queries (the count sets only the grids)
            from megatron_moe_hybrid.ops.sparse_attention import triton_dense_kl as tdk

            n = min(T, 256)
            for H, G, D in ((16, 4, 128), (128, 128, 192)):
                qa, ka = torch.zeros(B, n, H, D, dtype=dt), torch.zeros(B, n, G, D, dtype=dt)
                leaves = [x[:, :n].detach().requires_grad_() for x in (q, k, w)]
                kl, _ = tdk.dense_indexer_kl_triton(qa, ka, *leaves)
                torch.autograd.grad(kl.sum(), leaves)
    finally:
        ti.torch = saved
    return launches


def _as_on_the_h200() -> dict:
    """{op: (Triton modules whose switches --set reaches, recorder)}, each module's host code set to choose as on the H200
    while its kernels are only recorded: the checks that refuse CPU tensors outside the
    interpreter pass, TMA descriptors are made, and sparse attention's "auto" forms are the
    GPU's."""
    from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc
    from megatron_moe_hybrid.ops.sparse_attention import triton_sparse as ts

    tc._INTERPRET = True  # read by the CPU-tensor check and the TMA gate only
    # the bf16 refusals of the interpreter (its bf16 loads are wrong) do not apply to launches only
    # compiled; the recorders' inputs are well formed
    tc._check_interpreter_dtype = lambda q: None
    if hasattr(tc, "_device_has_tma"):  # (cached; a revision before the TMA stores has none)
        tc._device_has_tma.cache_clear()
    form, on_gpu = ts._form, types.SimpleNamespace(is_cuda=True)  # _form reads only q.is_cuda

    def gpu_form(sh, q, which, pass_="forward", **kwargs):
        return form(sh, on_gpu, which, pass_, **kwargs)

    # its argument checks refuse bf16 CPU tensors (the interpreter's bf16 loads are wrong); the
    # recorder's inputs are well formed (record_sparse)
    ts._check, ts._form = (lambda q, k, v, indices: None), gpu_form
    from megatron_moe_hybrid.ops.cross_entropy import triton as ce

    from megatron_moe_hybrid.ops.moe import grouped_triton
    from megatron_moe_hybrid.ops.sparse_attention import triton_indexer as ti

    ti._check_triton_dtypes = lambda q_idx, k_idx, weights: None
    from megatron_moe_hybrid.ops.sparse_attention import triton_dense_kl as tdk

    tdk.dense_kl_unsupported = lambda *args: None  # its CPU bf16 refusal, as above
    return {"gdn": ((tc,), record_linear), "gla": ((tc,), record_linear), "sparse": ((ts,), record_sparse),
            "loss": ((ce,), record_loss), "moe": ((grouped_triton,), record_moe), "layer": ((tc,), record_layer),
            "indexer": ((ti, tdk), record_indexer)}


def _load_package(tree: str):
    """Import megatron_moe_hybrid from the checkout tree, with this checkout's ops/_aot.py as its
    ops._aot (a revision from before it still records and compiles); returns that module."""
    sys.path.insert(0, tree)
    import megatron_moe_hybrid.ops as ops_package

    if not os.path.abspath(ops_package.__file__).startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"--tree {tree}: megatron_moe_hybrid imported from {ops_package.__file__} instead")
    name = "megatron_moe_hybrid.ops._aot"
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "megatron_moe_hybrid", "ops", "_aot.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def against(rev: str, argv: list) -> int:
    """Run this tool on git revision rev's package (a temporary worktree) and on this checkout,
    with the same arguments, and compare the SASS launch by launch: 0 all the same, 2 some
    differ, 1 a run failed."""
    import subprocess
    import tempfile

    argv = [x for i, x in enumerate(argv) if x != "--against" and (i == 0 or argv[i - 1] != "--against")
            and not x.startswith("--against=")]
    argv = [x for i, x in enumerate(argv) if x != "--json" and (i == 0 or argv[i - 1] != "--json")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | (
        {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, rev], check=True,
                       capture_output=True, text=True)
        try:
            runs = {}
            for label, extra in ((rev, ["--tree", tree]), ("this checkout", [])):
                out = os.path.join(tmp, f"{len(runs)}.json")
                r = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, *extra, "--json", out],
                                   capture_output=True, text=True, env=env)
                if r.returncode != 0 or not os.path.exists(out):
                    print(f"{label}: the run failed (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
                    return 1
                with open(out) as f:
                    runs[label] = [(x["op"], x["shape"], x["kernel"], x["sass"],
                                    f"registers {x['registers']} local {x['local_bytes']} B shared {x['shared_bytes']} B")
                                   for x in json.load(f)["rows"]]
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
    return compare(runs[rev], runs["this checkout"], rev)


def compare(old: list, new: list, rev: str) -> int:
    """Print how the launches new [(op, shape, kernel, sass digest[, resources])] compare with
    rev's old: 0 all compile to the same SASS, 2 some differ or the launches themselves do."""
    if [x[:3] for x in old] != [x[:3] for x in new]:
        first = next(((x[:3], y[:3]) for x, y in zip(old, new) if x[:3] != y[:3]), None)
        print(f"the launches differ: {rev} made {len(old)}, this checkout {len(new)}"
              + (f"; first difference {first[0]} against {first[1]}" if first else ""))
        return 2
    differ = [(x, y) for x, y in zip(old, new) if x[3] != y[3]]
    for x, y in differ:
        print(f"{x[0]} {x[1]} {x[2]}: SASS {x[3]} at {rev}, {y[3]} here"
              + (f" ({x[4]} at {rev}; {y[4]} here)" if len(x) > 4 else ""))
    print(f"{len(new)} launches, {len(new) - len(differ)} compile to the same SASS as at {rev}, {len(differ)} differ")
    return 2 if differ else 0


def _plain(constexprs: dict) -> dict:
    return {k: v for k, v in constexprs.items() if isinstance(v, (bool, int))}


_FAMILIES: dict = {}  # op -> (its Triton modules, recorder), set by main before any worker forks


def _compiled_fields(c, with_sass: bool) -> dict:
    """A compiled launch as plain values (what a worker process sends back)."""
    return {"name": c.name, "line": c.line(), "grid": list(c.grid), "num_warps": c.num_warps,
            "num_stages": c.num_stages, "maxnreg": c.maxnreg, "registers": c.registers,
            "local_bytes": c.local_bytes, "shared_bytes": c.shared_bytes, "sass": c.sass_digest,
            "constexprs": _plain(c.constexprs), "sass_text": c.sass if with_sass else None}


def _record_one(job: tuple) -> dict:
    """One op at one shape, recorded and compiled: {"launches": [...], "rejected": [...]}, or
    {"failed": the line naming the launch that does not compile or fit}."""
    op, key, shape, head_dim, dtype, with_sass = job
    try:
        launches = _FAMILIES[op][1](op, shape, head_dim, dtype)
    except Exception as exc:  # a kernel that does not compile or fit, as its launch on the GPU would raise
        launch = getattr(exc, "launch", None)
        lines = [l for l in str(exc).splitlines() if l.strip()]
        why = " / ".join([l for l in lines if "fatal" in l or "error" in l.lower()][:2] or lines[:2])
        where = launch.compiled.line() if launch is not None and launch.compiled else ""
        return {"failed": f"{launch.name if launch else '?'}: FAILED: {type(exc).__name__}: {why}"
                          + (f" ({where})" if where else "")}
    return {"rejected": [_compiled_fields(launch.compiled, False) for launch in launches.rejected],
            "launches": [_compiled_fields(launch.compiled, with_sass) for launch in launches]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="gdn,gla", help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--shape", default="default", help="benchmark shape keys, comma-separated; all; default: "
                   "each op's first")
    p.add_argument("--head-dim", type=int, default=None, help="instead of the shape's head dim (64, 128, 256)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a switch of the op's Triton module")
    p.add_argument("--sass", default=None, metavar="DIR", help="write each kernel's SASS there")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    p.add_argument("--against", default=None, metavar="REV", help="compare the SASS with git revision REV's "
                   "kernels (exit 2 where any differs)")
    p.add_argument("--jobs", type=int, default=0, help="processes compiling (op, shape) pairs side by side; "
                   "0: one per CPU core")
    p.add_argument("--tree", default=None, help=argparse.SUPPRESS)  # the package's checkout (--against)
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1: the kernels would be the interpreter's, which do not compile; "
                         "run with TRITON_INTERPRET unset")
    if a.against:
        return against(a.against, [x for x in (argv if argv is not None else sys.argv[1:])])
    _aot = _load_package(a.tree or ROOT)

    ops = [o.strip() for o in a.op.split(",")]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise SystemExit(f"--op: unknown {unknown}; choose from {sorted(OPS)}")
    shapes = {op: OPS[op] if isinstance(OPS[op], dict) else _benchmark(OPS[op]).SHAPES for op in ops}
    known = {k for table in shapes.values() for k in table}
    if a.shape == "all":
        wanted = {op: list(shapes[op]) for op in ops}
    elif a.shape == "default":
        wanted = {op: [next(iter(shapes[op]))] for op in ops}
    else:
        keys = [s.strip() for s in a.shape.split(",")]
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise SystemExit(f"--shape: unknown {unknown}; choose from {sorted(known)}")
        wanted = {op: [k for k in keys if k in shapes[op]] for op in ops}
        for op, ks in wanted.items():
            if not ks:
                raise SystemExit(f"--shape: none of {keys} is a shape of --op {op} ({sorted(shapes[op])})")
    families = _as_on_the_h200()
    for setting in a.set:
        apply_setting(list(dict.fromkeys(m for op in ops for m in families[op][0])), setting)

    global _FAMILIES
    _FAMILIES = families
    jobs = [(op, key, shapes[op][key], a.head_dim, a.dtype, bool(a.sass)) for op in ops for key in wanted[op]]
    workers = min(len(jobs), a.jobs or os.cpu_count() or 1)
    rows, rejected, done, failed = [], [], {}, 0
    if workers > 1:  # forked after the switches are set: every worker records as this process would
        import multiprocessing

        pool = multiprocessing.get_context("fork").Pool(workers)
        results = pool.imap(_record_one, jobs)  # in order: the printed lines are those of one process
    else:
        pool, results = None, map(_record_one, jobs)
    for (op, key, *_), result in zip(jobs, results):
        if "failed" in result:
            failed += 1
            print(f"{op} {key} {result['failed']}", flush=True)
            continue
        for r in result["rejected"]:  # refused for its shared memory; the host code went on
            print(f"{op} {key} {r['line']}: does not fit ({r['shared_bytes']} B of shared memory, over the "
                  f"{_aot.MAX_SHARED_BYTES} a block may take): the host code took its next config", flush=True)
            rejected.append({"op": op, "shape": key, "kernel": r["name"], "num_warps": r["num_warps"],
                             "num_stages": r["num_stages"], "shared_bytes": r["shared_bytes"],
                             "constexprs": r["constexprs"]})
        for c in result["launches"]:
            fit = programs_per_sm(c["registers"], c["num_warps"], c["shared_bytes"])
            seen = done.setdefault((c["name"], c["sass"]), f"{op} {key}")
            print(f"{op} {key} {c['line']} per-SM {fit}" + ("" if seen == f"{op} {key}" else f" (as {seen})"),
                  flush=True)
            rows.append({"op": op, "shape": key, "kernel": c["name"], "grid": c["grid"],
                         "num_warps": c["num_warps"], "num_stages": c["num_stages"], "maxnreg": c["maxnreg"],
                         "registers": c["registers"], "local_bytes": c["local_bytes"],
                         "shared_bytes": c["shared_bytes"], "programs_per_sm": fit, "sass": c["sass"],
                         "constexprs": c["constexprs"]})
            if a.sass:
                os.makedirs(a.sass, exist_ok=True)
                with open(os.path.join(a.sass, f"{c['name']}_{c['sass']}.sass"), "w") as f:
                    f.write(c["sass_text"])
    if pool is not None:
        pool.close()  # every result was read above
        pool.join()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": a.set, "rows": rows, "rejected": rejected}, f, indent=2)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
