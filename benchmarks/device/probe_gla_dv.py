"""Probe: simple GLA's dv formed by the chunk kernel from P and dh (triton_chunk.GLA_DV_FROM_DH
True) against the reverse sweep forming it (False), at every shape whether split or not, on the
H200, both in one process.

    python benchmarks/device/probe_gla_dv.py [--shapes gla_t32k,gla_b4,qwen,h32,h96,tp8,varlen]
        [--rounds 2] [--out results.json]

The sweeps are latency-bound (each step waits on the last), so work moved out of a step into
the chunk-parallel kernel, which already loads do and dh, can shorten the backward: the reverse
sweep then takes one product per chunk step (the state gradient) rather than three, and no
longer reads P and k or writes dU; the chunk kernel takes two more products per V block. It
paid only where the sweep runs unsplit (triton_chunk.GLA_DV_FROM_DH's "unsplit"). Per shape both forms run in turn --rounds times
(benchmarks/linear_attention.py's measure: do_bench medians, warm, and one CUDA graph
replayed); one results row per shape, ours_* the new form's, anchor_* the earlier one's, with
their peaks above the inputs and the relative RMS distance between the two (bf16).
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
        variants = {"sweep": False, "chunk kernel": True}
        try:
            med, peak, out = bench.measure_in_turn(fn, x, do, tuple(variants),
                                                   lambda label: setattr(tc, "GLA_DV_FROM_DH", variants[label]),
                                                   a.rounds)
        finally:
            tc.GLA_DV_FROM_DH = "unsplit"
        row = bench.ab_row(
            "gla fwd+bwd, dv from the chunk kernel, not the reverse sweep (A/B)", name, x, med, peak, out,
            "chunk kernel", "sweep", "the same with the reverse sweep forming dv",
            f"benchmarks/device/probe_gla_dv.py: both forms in turn, {a.rounds} rounds in one process",
        )
        print(json.dumps({k: row[k] for k in ("shape", "ours_ms", "anchor_ms", "speedup", "bwd_ms", "anchor_bwd_ms",
                                              "graph_ms", "anchor_graph_ms", "ours_peak_mem_bytes",
                                              "anchor_peak_mem_bytes", "rel_rms_vs_anchor")}), flush=True)
        rows.append(row)
        if a.out:
            write_results(a.out, rows)


if __name__ == "__main__":
    main()
