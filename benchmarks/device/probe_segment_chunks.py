"""Probe: the sequence split's segment length forced (triton_chunk.SEGMENT_CHUNKS) against the
default plan, on the H200, where few sequence-heads leave most SMs idle (the TP=8 shape).

    python benchmarks/device/probe_segment_chunks.py [--cases gla:tp8,gdn:tp8] [--lengths 16,8,4]
        [--rounds 2] [--out results.json]

At B1-T8192 with 4 value heads, simple GLA's default plan takes MIN_SEGMENT_CHUNKS = 16
chunks per segment: 8 segments x 4 heads = 32 programs of the split's BV 128 on 132 SMs; the
delta rule does not split there. Per case the default and each forced length run in turn
--rounds times (benchmarks/linear_attention.py's measure: do_bench medians and one CUDA graph
replayed, whose time is the device's alone); one results row per forced length.
"""

import argparse
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from common import write_results  # noqa: E402
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="gla:tp8,gdn:tp8")
    p.add_argument("--lengths", default="16,8,4")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    labels = [None] + [int(n) for n in a.lengths.split(",")]
    rows = []

    def apply(length):
        tc.SEGMENT_CHUNKS = length

    for case in a.cases.split(","):
        op, key = case.split(":")
        name, x, cu, do = bench.case(op, key)
        try:
            med, peak, out = bench.measure_in_turn(bench.ours_fn(op, cu), x, do, labels, apply, a.rounds)
        finally:
            tc.SEGMENT_CHUNKS = None
        print(op, name, {str(k): v for k, v in med.items()}, flush=True)
        for length in labels[1:]:
            rows.append(bench.ab_row(
                f"{op} fwd+bwd, sequence split forced to segments of {length} chunks (A/B)", name, x, med, peak, out,
                length, None, "the default plan (simple GLA: 16-chunk segments here; the delta rule: no split)",
                f"benchmarks/device/probe_segment_chunks.py: plans in turn, {a.rounds} rounds in one process",
            ))
            if a.out:
                write_results(a.out, rows)


if __name__ == "__main__":
    main()
