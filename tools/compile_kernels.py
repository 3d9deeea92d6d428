"""Compile our linear-attention Triton kernels for the H200 on any machine, no GPU needed.

    python tools/compile_kernels.py [--op gdn,gla] [--shape qwen,b4,...|all] [--head-dim D]
        [--dtype bfloat16|float16|float32] [--set NAME=VALUE ...] [--sass DIR] [--json PATH]

Runs one forward+backward of the op at each shape (keys of benchmarks/linear_attention.py's
SHAPES, the benchmark's shapes) on empty CPU tensors with every kernel launch recorded instead
of run, then compiles each distinct launch for sm_90a with Triton's compiler and ptxas, as the
first launch on an H200 would (megatron_moe_hybrid/ops/_aot.py). Prints per kernel the launch
grid and options, registers and local (spill) bytes per thread, shared memory, how many
programs fit on one SM, and a digest of the SASS: two sources whose digests agree compile to
the same machine code.

--set changes a switch of triton_chunk for the run, e.g. --set STATES_TMA=True,
--set FUSE_GROUP_SUM.gdn=True, --set "CONFIGS.prep=(None, 4, 3, 168)" (values are Python
literals). Exits 1 if a kernel would not launch on the H200 (over 227 KB of shared memory).

The compiler is the local Triton's (3.9 on the CPU machines, 3.6 on the H200 machine), so the
figures are close to the device's, not always equal; timing still needs the device.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = {"gdn": "chunk_gated_delta_rule", "gla": "chunk_simple_gla"}

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


def _shapes() -> dict:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_linear_attention",
                                                  os.path.join(ROOT, "benchmarks", "linear_attention.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.SHAPES


def apply_setting(module, setting: str) -> None:
    """NAME=VALUE or NAME.KEY=VALUE (a dict entry) on module; VALUE a Python literal."""
    if "=" not in setting:
        raise SystemExit(f"--set {setting!r}: expected NAME=VALUE, e.g. STATES_TMA=True")
    name, value = setting.split("=", 1)
    name, _, key = name.strip().partition(".")
    if not hasattr(module, name):
        raise SystemExit(f"--set {setting!r}: triton_chunk has no switch {name}")
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


def record(op: str, shape: tuple, head_dim: int | None = None, dtype: str = "bfloat16") -> list:
    """The kernel launches of one forward+backward of op (a key of OPS) at a SHAPES entry, its
    head dim replaced by head_dim if given, q, k, v (and beta) in dtype."""
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="gdn,gla", help="gdn, gla or both (comma-separated)")
    p.add_argument("--shape", default="qwen", help="benchmark shape keys, comma-separated, or all")
    p.add_argument("--head-dim", type=int, default=None, help="instead of the shape's head dim (64, 128, 256)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a triton_chunk switch")
    p.add_argument("--sass", default=None, metavar="DIR", help="write each kernel's SASS there")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1: the kernels would be the interpreter's, which do not compile; "
                         "run with TRITON_INTERPRET unset")
    sys.path.insert(0, ROOT)
    from megatron_moe_hybrid.ops import _aot
    from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc

    shapes = _shapes()
    ops = [o.strip() for o in a.op.split(",")]
    keys = list(shapes) if a.shape == "all" else [s.strip() for s in a.shape.split(",")]
    for name, table, known in (("--op", ops, OPS), ("--shape", keys, shapes)):
        unknown = [k for k in table if k not in known]
        if unknown:
            raise SystemExit(f"{name}: unknown {unknown}; choose from {sorted(known)}")
    for setting in a.set:
        apply_setting(tc, setting)
    # The host code refuses CPU tensors outside the interpreter; here the kernels are only
    # recorded, and TMA descriptors are made as on the H200.
    tc._INTERPRET = True
    tc._device_has_tma.cache_clear()

    rows, done, failed = [], {}, 0
    for op in ops:
        for key in keys:
            for launch in record(op, shapes[key], a.head_dim, a.dtype):
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
