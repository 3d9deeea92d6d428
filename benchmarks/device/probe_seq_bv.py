"""Probe: the unsplit recurrences' V block (triton_chunk.CONFIGS["seq"], BV x warps) on the H200,
where sequence-heads x V / BV make more programs than one wave of SMs.

    python benchmarks/device/probe_seq_bv.py [--cases gdn:b4,gdn:h96,gla:h96,gdn:qwen]
        [--configs 32x4,64x4,64x8] [--rounds 2] [--out results.json]

At BV 32 the Gated DeltaNet recurrences of B4-T8192-H16 run 256 programs and those of
B1-T8192-H96 384, on 132 SMs that hold one each: two and three waves of 128 sequential chunk
steps, where BV 64 makes one and one and a half. Per case every config runs in turn --rounds
times (benchmarks/linear_attention.py's measure: do_bench medians, warm); one results row per
(case, config) other than the first, ours_ms its fwd+bwd (median over rounds), anchor_ms the
first config's, with the relative RMS distance between them (output and gradients, bf16).
The sequence split is off throughout (as at these cases by default).
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
    p.add_argument("--cases", default="gdn:b4,gdn:h96,gla:h96,gdn:qwen")
    p.add_argument("--configs", default="32x4,64x4,64x8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    configs = [tuple(int(n) for n in c.split("x")) for c in a.configs.split(",")]
    rows, saved, saved_split = [], dict(tc.CONFIGS), dict(tc.SPLIT_MAX_PROGRAMS)

    def apply(c):
        tc.CONFIGS["seq"] = tc.CONFIGS["seq_wide"] = c  # this config whatever the program count

    for case in a.cases.split(","):
        op, key = case.split(":")
        name, x, cu, do = bench.case(op, key)
        fn = bench.ours_fn(op, cu)
        try:
            # the sequence split off, as at these cases by default (its threshold counts programs
            # at the seq config's BV, which would turn it on for simple GLA at H96 under BV 64)
            tc.SPLIT_MAX_PROGRAMS.update(gla=0, gdn=0)
            med, peak, out = bench.measure_in_turn(fn, x, do, configs, apply, a.rounds)
        finally:
            tc.CONFIGS.update(saved)
            tc.SPLIT_MAX_PROGRAMS.update(saved_split)
        base = configs[0]
        print(json.dumps(dict(op=op, shape=name, ms={f"{c[0]}x{c[1]}": med[c] for c in configs})), flush=True)
        for c in configs[1:]:
            rows.append(bench.ab_row(
                f"{op} fwd+bwd, unsplit recurrences at BV {c[0]}, {c[1]} warps (A/B)", name, x, med, peak, out, c, base,
                f"the same at BV {base[0]}, {base[1]} warps",
                f"benchmarks/device/probe_seq_bv.py: configs in turn, {a.rounds} rounds in one process",
            ))
            if a.out:
                write_results(a.out, rows)


if __name__ == "__main__":
    main()
