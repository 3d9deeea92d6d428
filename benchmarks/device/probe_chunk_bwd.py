"""Probe: _bwd_chunk_kernel's launch config (BV, num_warps, num_stages) on the H200, on the
buffers a real backward hands it.

    python benchmarks/device/probe_chunk_bwd.py [--cases gla:gla_b4,gdn:b4]
        [--configs 64x8,64x8x1,64x4x1,...] [--out results.json]

Per case one forward+backward runs with triton_chunk._chunk_bwd wrapped to keep its arguments
(q, k, v, gam, h, dh, dU, do, ... as _bwd made them). Each config then runs the kernel alone
on them (do_bench median, L2 flushed); its dq, dk, dv, dg (and dbeta) are compared with the
default config's (relative RMS): a config that miscompiles (Triton 3.6 on Hopper, fla issue
#640) shows there. Printed as JSON lines, and written to --out.
"""

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402

OUTS = {"dq": 12, "dk": 13, "dv": 14, "dg": 15, "dbeta": 16}  # _chunk_bwd's output arguments


def captured_args(op, key):
    name, x, cu, do = bench.case(op, key)
    kept, original = [], tc._chunk_bwd

    def keep(*args, **kwargs):
        kept.append((args, kwargs))
        return original(*args, **kwargs)

    tc._chunk_bwd = keep
    try:
        torch.autograd.grad(bench.ours_fn(op, cu)(x), list(x.values()), do)
    finally:
        tc._chunk_bwd = original
    torch.cuda.synchronize()
    return name, list(kept[0][0]), kept[0][1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="gla:gla_b4,gla:h96,gdn:b4")
    p.add_argument("--configs", default="64x8,64x8x1,64x8x2,64x4,64x4x1,128x8,128x8x1,128x4x1,32x4,32x4x1")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for case in a.cases.split(","):
        op, key = case.split(":")
        name, args, kwargs = captured_args(op, key)
        K, V = args[1].shape[3], args[3].shape[3]
        default = tc._chunk_bwd_config(K, V)
        outs = {n: i for n, i in OUTS.items() if args[i] is not None}
        ref = None
        for label in [f"{default[0]}x{default[1]}"] + a.configs.split(","):
            config = tuple(int(n) for n in label.split("x"))
            run_args = list(args)
            for n, i in outs.items():
                run_args[i] = torch.full_like(args[i], float("nan"))
            try:
                tc._chunk_bwd(*run_args, config=config, **kwargs)
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(lambda: tc._chunk_bwd(*run_args, config=config, **kwargs), warmup=20, rep=200,
                                             return_mode="median")
            except Exception as e:  # noqa: BLE001 (a config that does not fit: report, go on)
                print(json.dumps(dict(op=op, shape=name, config=label, error=f"{type(e).__name__}: {e}"[:200])))
                continue
            got = {n: run_args[i].float() for n, i in outs.items()}
            if ref is None:
                ref = got
            err = {n: float(f"{bench.rel_rms(got[n], ref[n]):.1e}") for n in outs}
            err["nan"] = any(bool(t.isnan().any()) for t in got.values())
            md = None
            for dev_cache in tc._bwd_chunk_kernel.device_caches.values():
                for compiled in dev_cache[0].values():
                    md = md or {}
                    md[f"{compiled.metadata.num_warps}w{compiled.metadata.num_stages}s"] = (
                        compiled.n_regs, compiled.n_spills, compiled.metadata.shared)
            row = dict(op=op, shape=name, config=label, ms=round(ms, 4), rel_rms_vs_default=err)
            print(json.dumps(row), flush=True)
            rows.append(row)
        print("resources (regs, spills, shared) by warps/stages:", md, flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
