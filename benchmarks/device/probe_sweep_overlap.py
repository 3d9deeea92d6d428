"""The linear-attention backward with its two sweeps side by side (triton_chunk.OVERLAP_SWEEPS:
the states' forward sweep on a side stream beside the reverse sweep) and one after the other,
in one process per shape: the gradients of the two must be bitwise equal, then fwd+bwd and bwd
are timed each way (benchmarks/linear_attention.py's measure: do_bench medians, L2 flushed).

    python benchmarks/device/probe_sweep_overlap.py [--ops gdn,gla] [--shapes qwen,b4,...] [--out FILE]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import linear_attention as la_bench  # noqa: E402

from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402


def run(op, key):
    shape, B, T, H, HV, D, lengths = la_bench.SHAPES[key]
    x, cu = la_bench.make_inputs(op, B, T, H, HV, D, lengths)
    do = torch.randn(B, T, HV, D, device="cuda").bfloat16()
    fn = la_bench.ours_fn(op, cu)
    res = {}
    for overlap in (False, True, False, True):  # twice each way: the spread between repeats
        tc.OVERLAP_SWEEPS = overlap
        ms, peak, (o, grads) = la_bench.measure(fn, x, do)
        res.setdefault(overlap, []).append((ms, o, grads, peak))
    tc.OVERLAP_SWEEPS = True
    base_o, base_g = res[False][0][1], res[False][0][2]
    equal = all(torch.equal(o, base_o) and all(torch.equal(a, b) for a, b in zip(g, base_g))
                for runs in res.values() for _, o, g, _ in runs)
    row = {"op": op, "shape": shape, "bitwise_equal": equal}
    for overlap, runs in res.items():
        label = "side_by_side" if overlap else "in_turn"
        for mode in ("bwd", "fwd+bwd"):
            row[f"{label}_{mode}_ms"] = [round(r[0][mode], 4) for r in runs]
        row[f"{label}_peak_bytes"] = max(r[3] for r in runs)
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="gdn,gla")
    parser.add_argument("--shapes", default="all")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    want = None if args.shapes == "all" else set(args.shapes.split(","))
    rows = [run(op, key) for op in args.ops.split(",") for key in la_bench.OP_SHAPES[op] if want is None or key in want]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
