"""Probe: what writing the chunk states costs in each of simple GLA's split forward sweeps, on the
H200.

    python benchmarks/device/probe_sweep_stores.py [--shapes h32,qwen] [--out results.json]

At B1-T32768-H32 the o sweep writing the chunk states h for the backward (KEEP_STATES) took
0.785 ms against 0.530 without them (profile_linear.py), and Triton compiled it to 255 registers
a thread with 12 spilled (kernel_asm.py); the split's first pass (states only, 137 registers)
took 0.140. Were the first pass to write each chunk's state from its segment's zero start (the
segment-local states), the backward could add the segment's entering state times the decay since
the segment's start, and the o sweep would write no states. This times, per shape, each sweep of
the split forward alone (do_bench medians, inputs prepared once): the first pass with and
without the local states, and the o sweep with and without the states.
"""

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from common import write_results  # noqa: E402
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="h32,qwen")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for key in a.shapes.split(","):
        shape, x, cu, _ = bench.case("gla", key)
        q, k, v, g = x["q"], x["k"], x["v"], x["g"]
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        scale = K ** -0.5
        chunks = tc._chunks_of(B, T, cu)
        assert not tc._gla_light(chunks), f"{shape}: the light sweeps' shape, not the whole states' split"
        seg = tc._plan_segments(chunks, K, HV, V, q.device, False)
        assert seg is not None, f"{shape}: unsplit"
        config = tc._split_config(K, V, False)
        gam, P, _, _, _ = tc._prep(q, k, v, g, None, scale, chunks, store_A=False)
        L = torch.empty(seg.layout.N, HV, K, V, dtype=torch.float32, device=q.device)
        trans = torch.empty(seg.layout.N, HV, dtype=torch.float32, device=q.device)
        h = torch.empty(chunks.NT, HV, K, V, dtype=q.dtype, device=q.device)
        o = torch.empty_like(v)
        S_in, _ = tc._scan(seg, L, trans, None, reverse=False, want_end=False)
        runs = {
            "first pass": lambda: tc._sweep_fwd(seg.layout, config, q, k, None, v, gam, P, scale, ht=L, gt=trans),
            "first pass + local states": lambda: tc._sweep_fwd(seg.layout, config, q, k, None, v, gam, P, scale,
                                                               ht=L, gt=trans, h=h),
            "o sweep": lambda: tc._sweep_fwd(seg.layout, config, q, k, None, v, gam, P, scale, o=o, h0=S_in),
            "o sweep + states": lambda: tc._sweep_fwd(seg.layout, config, q, k, None, v, gam, P, scale, o=o,
                                                      h0=S_in, h=h),
        }
        ms = {name: round(triton.testing.do_bench(fn, warmup=25, rep=200), 4) for name, fn in runs.items()}
        row = {"name": "gla split forward sweeps with and without writing chunk states (probe)", "shape": shape,
               "sweep_ms": ms, "segments": seg.layout.N, "programs": seg.layout.N * HV,
               "notes": "benchmarks/device/probe_sweep_stores.py: each sweep alone, do_bench medians (L2 flushed)"}
        print(row, flush=True)
        rows.append(row)
        if a.out:
            write_results(a.out, rows)


if __name__ == "__main__":
    main()
