"""Probe: simple GLA's fused backward (triton_chunk.FUSED_GLA_BWD: dq forward in time, dk, dv,
dg in reverse, each sweep holding whole states; no chunk states h, dh in HBM, no chunk kernel)
against the backward before it (the chunk states recomputed and stored, the state gradients
stored, then the chunk kernel), on the H200, both in the same process.

    python benchmarks/device/probe_gla_fused_bwd.py [--shapes gla_t32k,gla_b4,qwen,h32,h96,tp8,varlen]
        [--rounds 2] [--out results.json]

Per shape both forms run in turn --rounds times (benchmarks/linear_attention.py's measure:
do_bench medians, warm, and one CUDA graph replayed); one results row per shape, ours_* the
fused backward's, anchor_* the earlier one's, with their peaks above the inputs and the
relative RMS distance between the two (output and gradients, bf16).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from common import write_results  # noqa: E402
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="gla_t32k,gla_b4,qwen,h32,h96,tp8,varlen")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--stages", default="", help="more fused variants: dq,dkv num_stages pairs, e.g. 2,1;1,1")
    a = p.parse_args()
    a.stages = [tuple(int(n) for n in pair.split(",")) for pair in a.stages.split(";") if pair]
    rows = []
    for key in a.shapes.split(","):
        name, x, cu, do = bench.case("gla", key)
        fn = bench.ours_fn("gla", cu)
        configs = dict(tc.CONFIGS)
        variants = {"unfused": {}, "fused": {}, **{f"fused dq{dq} dkv{dkv}": {"gla_dq": (None, 8, dq), "gla_dkv": (None, 8, dkv)}
                                                  for dq, dkv in a.stages}}

        def apply(label):
            tc.FUSED_GLA_BWD = label != "unfused"
            tc.CONFIGS = {**configs, **variants[label]}

        try:
            med, peak, out = bench.measure_in_turn(fn, x, do, tuple(variants), apply, a.rounds)
        finally:
            tc.FUSED_GLA_BWD, tc.CONFIGS = False, configs
        for label in variants:
            print(json.dumps({"shape": name, "label": label, **med[label], "peak": peak[label]}), flush=True)
        row = bench.ab_row(
            "gla fwd+bwd, fused backward: two whole-state sweeps, no chunk states (A/B)", name, x, med, peak, out,
            "fused", "unfused", "the same with the backward before (h, dh stored, then the chunk kernel)",
            f"benchmarks/device/probe_gla_fused_bwd.py: both backwards in turn, {a.rounds} rounds in one process",
        )
        print(json.dumps({k: row[k] for k in ("shape", "ours_ms", "anchor_ms", "speedup", "bwd_ms", "anchor_bwd_ms",
                                              "graph_ms", "anchor_graph_ms", "ours_peak_mem_bytes",
                                              "anchor_peak_mem_bytes", "rel_rms_vs_anchor")}), flush=True)
        rows.append(row)
        if a.out:
            write_results(a.out, rows)


if __name__ == "__main__":
    main()
