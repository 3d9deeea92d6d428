"""Compile our Triton kernels for the H200 on any machine, no GPU needed.

    python tools/compile_kernels.py [--op gdn,gla,sparse] [--shape qwen,b4,mla,...|all]
        [--head-dim D] [--dtype bfloat16|float16|float32] [--set NAME=VALUE ...] [--sass DIR]
        [--json PATH]

Runs one forward+backward of each op at each shape on CPU tensors with every Triton launch
recorded instead of run, then compiles each launch for sm_90a with Triton's compiler and
ptxas, as the first launch on an H200 would (megatron_moe_hybrid/ops/_aot.py). Prints per
kernel the launch grid and options, registers and local (spill) bytes per thread, shared
memory, how many programs fit on one SM, and a digest of the SASS: two sources whose digests
agree compile to the same machine code.

Ops and their shapes (the benchmarks' SHAPES keys; default the first listed):
    gdn, gla   chunk_gated_delta_rule, chunk_simple_gla (ops/linear_attention/triton_chunk.py)
               at benchmarks/linear_attention.py's shapes: qwen, h32, b4, h96, tp8, varlen, ...
    sparse     sparse_attention (ops/sparse_attention/triton_sparse.py) at
               benchmarks/sparse_attention.py's: mla, mla-h32, mla128k, gqa8k, gqa32k, with 64
               queries (the query count sets only the grids) and each pass in the form "auto"
               takes on the GPU (FORWARD_FORM, BACKWARD_FORM: cuBLAS products around a few
               kernels at MLA's 128 heads; --set "FORWARD_FORM='kernels'" for the kernels)
A shape key applies to the ops that have it. The sparse-attention indexer, the cross-entropy,
MoE, norm and short-conv kernels are not covered yet: their host code reads the kernels'
results or takes CPU-only paths.

--set changes a switch of the op's Triton module for the run, e.g. --set STATES_TMA=True,
--set FUSE_GROUP_SUM.gdn=True, --set "CONFIGS.prep=(None, 4, 168)" (values are Python
literals). Exits 1 if a kernel does not compile or would not launch on the H200 (over 227 KB
of shared memory).

The compiler is the local Triton's (3.9 on the CPU machines, 3.6 on the H200 machine), so the
figures are close to the device's, not always equal; timing still needs the device.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = {"gdn": "linear_attention", "gla": "linear_attention", "sparse": "sparse_attention"}  # op -> benchmark
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
    cu = None
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    with _aot.recording() as launches:
        if op == "gdn":
            o, _ = la.chunk_gated_delta_rule(*x, cu_seqlens=cu, backend="triton")
        else:
            o, _ = la.chunk_simple_gla(x[0], x[1], x[2], g=x[3], cu_seqlens=cu, backend="triton")
        torch.autograd.grad(o, x, torch.ones_like(o))
    return launches


def record_sparse(op: str, shape: tuple, head_dim: int | None = None, dtype: str = "bfloat16") -> list:
    """The kernel launches of one forward+backward of sparse_attention at a sparse-attention
    SHAPES entry with SPARSE_QUERIES queries (random inputs, causal random top-k indices: the
    host's cuBLAS products and gathers run on the CPU, so the values are real)."""
    import torch

    from megatron_moe_hybrid.ops import _aot
    from megatron_moe_hybrid.ops import sparse_attention as sa

    _, B, T, S, H, G, D, DV, K, shared = shape
    if head_dim is not None:
        raise SystemExit("--head-dim: the sparse shapes fix their head dims (D, DV); choose another shape")
    if dtype not in ("bfloat16", "float16"):
        raise SystemExit(f"--dtype {dtype}: the triton sparse_attention takes bf16 or fp16 on the GPU")
    bench = _benchmark("sparse_attention")
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    indices = bench.causal_indices(B, SPARSE_QUERIES, S, K, "cpu")
    q = torch.randn(B, SPARSE_QUERIES, H, D, generator=gen).to(dt).requires_grad_()
    k = torch.randn(B, S, G, D, generator=gen).to(dt).requires_grad_()
    v = k[..., :DV] if shared else torch.randn(B, S, G, DV, generator=gen).to(dt).requires_grad_()
    leaves = (q, k) if shared else (q, k, v)
    with _aot.recording() as launches:
        o = sa.sparse_attention(q, k, v, indices, backend="triton")[0]
        torch.autograd.grad(o, leaves, torch.ones_like(o))
    return launches


def _as_on_the_h200() -> dict:
    """{op: (Triton module, recorder)}, each module's host code set to choose as on the H200
    while its kernels are only recorded: the checks that refuse CPU tensors outside the
    interpreter pass, TMA descriptors are made, and sparse attention's "auto" forms are the
    GPU's."""
    from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc
    from megatron_moe_hybrid.ops.sparse_attention import triton_sparse as ts

    tc._INTERPRET = True  # read by the CPU-tensor check and the TMA gate only
    tc._device_has_tma.cache_clear()
    def gpu_form(sh, q, which, pass_="forward"):
        return which if which != "auto" else ("products" if sh.R >= ts.PRODUCTS_MIN_HEADS[pass_] else "kernels")

    # its argument checks refuse bf16 CPU tensors (the interpreter's bf16 loads are wrong); the
    # recorder's inputs are well formed (record_sparse)
    ts._check, ts._form = (lambda q, k, v, indices: None), gpu_form
    return {"gdn": (tc, record_linear), "gla": (tc, record_linear), "sparse": (ts, record_sparse)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="gdn,gla", help="gdn, gla, sparse (comma-separated)")
    p.add_argument("--shape", default="default", help="benchmark shape keys, comma-separated; all; default: "
                   "each op's first")
    p.add_argument("--head-dim", type=int, default=None, help="instead of the shape's head dim (64, 128, 256)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a switch of the op's Triton module")
    p.add_argument("--sass", default=None, metavar="DIR", help="write each kernel's SASS there")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1: the kernels would be the interpreter's, which do not compile; "
                         "run with TRITON_INTERPRET unset")
    sys.path.insert(0, ROOT)
    from megatron_moe_hybrid.ops import _aot

    ops = [o.strip() for o in a.op.split(",")]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise SystemExit(f"--op: unknown {unknown}; choose from {sorted(OPS)}")
    shapes = {op: _benchmark(OPS[op]).SHAPES for op in ops}
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
        apply_setting(list(dict.fromkeys(families[op][0] for op in ops)), setting)

    rows, done, failed = [], {}, 0
    for op in ops:
        for key in wanted[op]:
            for launch in families[op][1](op, shapes[op][key], a.head_dim, a.dtype):
                try:
                    c = _aot.compile_launch(launch)
                    _aot.check_fits(c)
                except Exception as exc:  # a compile error or a launch that cannot fit: say which
                    failed += 1
                    lines = [l for l in str(exc).splitlines() if l.strip()]
                    why = " / ".join([l for l in lines if "fatal" in l or "error" in l.lower()][:2] or lines[:2])
                    print(f"{op} {key} {launch.name}: FAILED: {type(exc).__name__}: {why}", flush=True)
                    continue
                fit = programs_per_sm(c.registers, c.num_warps, c.shared_bytes)
                seen = done.setdefault((c.name, c.sass_digest), f"{op} {key}")
                print(f"{op} {key} {c.line()} per-SM {fit}" + ("" if seen == f"{op} {key}" else f" (as {seen})"),
                      flush=True)
                rows.append({"op": op, "shape": key, "kernel": c.name, "grid": list(c.grid),
                             "num_warps": c.num_warps, "num_stages": c.num_stages, "maxnreg": c.maxnreg,
                             "registers": c.registers, "local_bytes": c.local_bytes,
                             "shared_bytes": c.shared_bytes, "programs_per_sm": fit, "sass": c.sass_digest,
                             "constexprs": {k: v for k, v in c.constexprs.items() if isinstance(v, (bool, int))}})
                if a.sass:
                    os.makedirs(a.sass, exist_ok=True)
                    with open(os.path.join(a.sass, f"{c.name}_{c.sass_digest}.sass"), "w") as f:
                        f.write(c.sass)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": a.set, "rows": rows}, f, indent=2)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
