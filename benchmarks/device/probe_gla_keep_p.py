"""Probe: simple GLA's backward from the forward's gam and P (triton_chunk.GLA_KEEP_P True: the
backward's prep kernel does not run) against the prep run again (False, the default), on the
H200, both in one process.

    python benchmarks/device/probe_gla_keep_p.py [--shapes gla_t32k,gla_b4,qwen,h32,h96,tp8,varlen]
        [--rounds 2] [--out results.json]

Per shape both forms run in turn --rounds times (benchmarks/linear_attention.py's measure:
do_bench medians, warm, and one CUDA graph replayed); one results row per shape, ours_* the kept
form's, anchor_* the default's, with their peaks above the inputs (the kept P lives from the
forward to the end of the backward) and the relative RMS distance between the two (bitwise 0 on
the CPU). The anchor fla is not in this run: benchmarks/linear_attention.py --gla-keep-p times
the kept form beside it.
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
    a = p.parse_args()
    rows = []
    for key in a.shapes.split(","):
        name, x, cu, do = bench.case("gla", key)
        fn = bench.ours_fn("gla", cu)
        try:
            med, peak, out = bench.measure_in_turn(fn, x, do, ("recomputed", "kept"),
                                                   lambda label: setattr(tc, "GLA_KEEP_P", label == "kept"),
                                                   a.rounds)
        finally:
            tc.GLA_KEEP_P = False
        row = bench.ab_row(
            "gla fwd+bwd, the backward from the forward's gam and P (A/B)", name, x, med, peak, out,
            "kept", "recomputed", "the same with the backward's prep kernel run again (the default)",
            f"benchmarks/device/probe_gla_keep_p.py: both forms in turn, {a.rounds} rounds in one process",
        )
        print(json.dumps({k: row[k] for k in ("shape", "ours_ms", "anchor_ms", "speedup", "bwd_ms", "anchor_bwd_ms",
                                              "graph_ms", "anchor_graph_ms", "ours_peak_mem_bytes",
                                              "anchor_peak_mem_bytes", "rel_rms_vs_anchor")}), flush=True)
        rows.append(row)
        if a.out:
            write_results(a.out, rows)


if __name__ == "__main__":
    main()
