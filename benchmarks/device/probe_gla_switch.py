"""Probe: one of the backward switches in triton_chunk, on against off, on the H200, both in one
process.

    python benchmarks/device/probe_gla_switch.py --switch NAME [--op gla|gdn]
        [--shapes gla_t32k,gla_b4,qwen,h32,h96,tp8,varlen] [--rounds 2] [--out results.json]

Switches (SWITCHES; those marked uncommitted were tried and dropped, their rows kept):
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
    keep_states  KEEP_STATES[op] True against False (either op, --op): the forward's last sweep
            writes the chunk states h (and the delta rule's U) beside o and the backward reads
            them, against the backward running that sweep again to write them.
    light   GLA_LIGHT_SWEEPS True against False: simple GLA's sweeps form only the chunk states
            (h forward, dh backward) in [BK, BV] blocks, the prep kernel o from h and the chunk
            kernel dv from dh, against recurrences over whole key dims that form o (and dv where
            split) as they go.
    light_first  (until the commit after 83c705f) GLA_LIGHT_FIRST_PASS: the whole-key-dim split's
            first passes in the light sweeps' blocks; 0.97-0.98x, dropped.
    group_sum  FUSE_GROUP_SUM[op] True against False (either op): with grouped value heads the
            chunk kernel takes a q/k head's value heads in turn and sums their dq and dk on chip,
            against per-value-head copies summed by _group_sum afterwards (FUSE_GROUP_MIN_PROGRAMS
            set to 0 for the run, so the small shapes fuse too).
    gdn_keep_prep  GDN_KEEP_PREP True against False (--op gdn, with its states kept): the
            backward takes the forward's gam, P and w, its prep kernel not run again.
    h_late  (uncommitted, 2026-12-04) STORE_H_LATE: the sweeps writing the chunk states write the
            state entering chunk t + 1 right after chunk t's update, not at the start of chunk
            t + 1's step (the simple GLA o sweep writing them spills 12 registers a thread at 255,
            benchmarks/device/kernel_asm.py): 0.987x, 0.986x, 0.996x for simple GLA at
            B1-T32768-H32, -HQK16-HV32, B4-T8192-H16, 0.992x for the delta rule; dropped.
    gdn_split  GDN_SPLIT_CHUNK_BWD True against False (--op gdn): the delta rule's per-chunk
            backward as two kernels (simple GLA's with U for v, then the terms through w and u),
            against the fused kernel that spills 82 registers a thread.
    local_states  (uncommitted, 2026-12-04) GLA_LOCAL_STATES: simple GLA's whole-state split
            writing the chunk states for the backward from its first pass (segment-local, with
            each chunk's decay since the segment's start), its o sweep none, the chunk kernel
            adding e^decay times the segment's entering state (fp32, from L2) as it loads them.
            The forward gained what probe_sweep_stores.py showed (0.925 -> 0.808 ms of sweeps at
            B1-T32768-H32) but the chunk kernel lost more (1.20 -> 1.41 ms): 0.92-0.97x; dropped.
    persistent  (uncommitted, 2026-12-04) GLA_PERSISTENT_CHUNK: simple GLA's chunk kernel (dq, dk,
            dg per value head) as one program per SM walking (chunk, head) items and their V blocks
            in one pipelined loop (q, k loads masked to the last V block): 0.51x fwd+bwd at
            B1-T32768-H32 and -H16 (255 registers, 254 spilled), and on the GPU its packed bf16
            dq was wrong (0.89 relative RMS; bitwise right in the interpreter); dropped.
    sweep_p  (uncommitted, 2026-12-04) GLA_SWEEP_P: simple GLA's whole-state o sweep forming gam
            and P itself (one more [C, K] x [K, C] product and the decay mask per chunk step), no
            prep kernel in the forward: 0.90x at the four long shapes (the o sweep 0.785 -> 1.294
            ms at B1-T32768-H32 against the prep kernel's 0.213); dropped.
    states_tma  STATES_TMA "whole" (--tma true: True) against False, the default
            (either op): the sweeps write the chunk states h (forward; True: and dh, backward)
            through host-made TMA descriptors (bulk tensor stores from shared memory) rather
            than per-thread stores through a layout conversion; "whole" only where a forward
            sweep holds whole [K, V] states (simple GLA's split). True ran 0.998x and 1.003x at
            B1-T32768-H32 and -HQK16-HV32 (the forward faster, the backward's dh sweep slower),
            0.92x at B4-T8192-H16 and 0.91-0.93x for the delta rule; "whole" is not yet run.
    o_tma   O_TMA "whole" (--tma true: True) against False, the default: the forward sweeps
            forming o write it through a descriptor too, where every length is a multiple of
            the chunk. Not yet run.
    tma     STATES_TMA and O_TMA together, at the --tma form, against both off.

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

# switch -> (triton_chunk attribute, the ops it takes, row name, the "off" form as the anchor's
# description); an attribute holding a dict (KEEP_STATES) is keyed by op, the others are booleans
SWITCHES = {
    "dv": ("GLA_DV_FROM_DH", ("gla",), "gla fwd+bwd, dv from the chunk kernel, not the reverse sweep (A/B)",
           "the same with the reverse sweep forming dv"),
    "keep_p": ("GLA_KEEP_P", ("gla",), "gla fwd+bwd, the backward from the forward's gam and P (A/B)",
               "the same with the backward's prep kernel run again"),
    "keep_states": ("KEEP_STATES", ("gla", "gdn"), "{op} fwd+bwd, the backward from the forward's chunk states (A/B)",
                    "the same with the backward running the forward sweep again for them"),
    "light": ("GLA_LIGHT_SWEEPS", ("gla",), "gla fwd+bwd, light sweeps: states only, in [BK, BV] blocks (A/B)",
              "the same with whole-key-dim recurrences forming o (and dv where split)"),
    "group_sum": ("FUSE_GROUP_SUM", ("gla", "gdn"), "{op} fwd+bwd, grouped heads' dq and dk summed in the chunk kernel (A/B)",
                  "the same with _group_sum passes over per-value-head copies"),
    "gdn_split": ("GDN_SPLIT_CHUNK_BWD", ("gdn",), "gdn fwd+bwd, the per-chunk backward as two kernels (A/B)",
                  "the same with the fused per-chunk kernel"),
    "states_tma": ("STATES_TMA", ("gla", "gdn"), "{op} fwd+bwd, the chunk states written by TMA, form {tma} (A/B)",
                   "the same with per-thread stores"),
    "o_tma": ("O_TMA", ("gla", "gdn"), "{op} fwd+bwd, o written by TMA, form {tma} (A/B)",
              "the same with per-thread stores"),
    "tma": (("STATES_TMA", "O_TMA"), ("gla", "gdn"), "{op} fwd+bwd, the chunk states and o written by TMA, form {tma} (A/B)",
            "the same with per-thread stores"),
    "gdn_keep_prep": ("GDN_KEEP_PREP", ("gdn",), "gdn fwd+bwd, the backward from the forward's gam, P and w (A/B)",
                      "the same with the backward's prep kernel run again (reading A)"),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--switch", required=True, choices=sorted(SWITCHES))
    p.add_argument("--op", default="gla", choices=("gla", "gdn"))
    p.add_argument("--shapes", default="gla_t32k,gla_b4,qwen,h32,h96,tp8,varlen")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--tma", default="whole", choices=("whole", "true"),
                   help="--switch states_tma, o_tma, tma: the 'on' form ('whole' or True)")
    a = p.parse_args()
    attr, ops, row_name, anchor = SWITCHES[a.switch]
    if a.op not in ops:
        p.error(f"--switch {a.switch} takes --op {' or '.join(ops)}")
    row_name = row_name.format(op=a.op, tma=a.tma)
    attrs = attr if isinstance(attr, tuple) else (attr,)
    defaults = {name: getattr(tc, name) for name in attrs}

    def set_switch(value):
        if value and a.switch in ("states_tma", "o_tma", "tma"):
            value = True if a.tma == "true" else a.tma
        for name, default in defaults.items():
            setattr(tc, name, {**default, a.op: value} if isinstance(default, dict) else value)

    if a.switch == "group_sum":  # for the whole run
        tc.FUSE_GROUP_MIN_PROGRAMS = 0

    rows = []
    for key in a.shapes.split(","):
        shape, x, cu, do = bench.case(a.op, key)
        try:
            med, peak, out = bench.measure_in_turn(bench.ours_fn(a.op, cu), x, do, ("off", "on"),
                                                   lambda label: set_switch(label == "on"), a.rounds)
        finally:
            for attr_name, default in defaults.items():
                setattr(tc, attr_name, default)
        row = bench.ab_row(
            row_name, shape, x, med, peak, out, "on", "off", anchor,
            f"benchmarks/device/probe_gla_switch.py --switch {a.switch} --op {a.op}: both forms in turn, {a.rounds} rounds in one "
            "process",
        )
        bench.print_ab_row(row)
        rows.append(row)
        if a.out:
            write_results(a.out, rows)


if __name__ == "__main__":
    main()
