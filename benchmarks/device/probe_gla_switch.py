"""Probe: one of simple GLA's backward switches in triton_chunk, on against off, on the H200,
both in one process.

    python benchmarks/device/probe_gla_switch.py --switch dv|keep_p
        [--shapes gla_t32k,gla_b4,qwen,h32,h96,tp8,varlen] [--rounds 2] [--out results.json]

Switches (SWITCHES):
    dv      GLA_DV_FROM_DH True against False at every shape, split or not: dv formed by the
            chunk kernel from P and dh (the reverse sweep then takes one product per chunk step,
            the state gradient, not three, and no longer reads P and k or writes dU; the chunk
            kernel takes two more products per V block) against the sweep forming it. The sweeps
            are latency-bound, so work moved out of a step can shorten the backward; it paid only
            unsplit (the default "unsplit"). Until c5b059e: probe_gla_dv.py.
    keep_p  GLA_KEEP_P True (the default since 2026-12-03) against False: the backward from the
            forward's gam and P, its prep kernel not run again. The kept P lives from the forward
            to the end of the backward, which the peaks show. fla is not in this run:
            benchmarks/linear_attention.py times the default beside it (--gla-prep-again: False).

Per shape both forms run in turn --rounds times (benchmarks/linear_attention.py's measure:
do_bench medians, warm, and one CUDA graph replayed); one results row per shape, ours_* the
switch on, anchor_* off, with their peaks above the inputs and the relative RMS distance between
the two (bf16; bitwise 0 for both switches on the CPU).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from common import write_results  # noqa: E402
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402

# switch -> (triton_chunk attribute, row name, the "off" form as the anchor's description)
SWITCHES = {
    "dv": ("GLA_DV_FROM_DH", "gla fwd+bwd, dv from the chunk kernel, not the reverse sweep (A/B)",
           "the same with the reverse sweep forming dv"),
    "keep_p": ("GLA_KEEP_P", "gla fwd+bwd, the backward from the forward's gam and P (A/B)",
               "the same with the backward's prep kernel run again"),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--switch", required=True, choices=sorted(SWITCHES))
    p.add_argument("--shapes", default="gla_t32k,gla_b4,qwen,h32,h96,tp8,varlen")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    attr, row_name, anchor = SWITCHES[a.switch]
    default = getattr(tc, attr)
    rows = []
    for key in a.shapes.split(","):
        name, x, cu, do = bench.case("gla", key)
        try:
            med, peak, out = bench.measure_in_turn(bench.ours_fn("gla", cu), x, do, ("off", "on"),
                                                   lambda label: setattr(tc, attr, label == "on"), a.rounds)
        finally:
            setattr(tc, attr, default)
        row = bench.ab_row(
            row_name, name, x, med, peak, out, "on", "off", anchor,
            f"benchmarks/device/probe_gla_switch.py --switch {a.switch}: both forms in turn, {a.rounds} rounds in one "
            "process",
        )
        bench.print_ab_row(row)
        rows.append(row)
        if a.out:
            write_results(a.out, rows)


if __name__ == "__main__":
    main()
