"""Probe: simple GLA with gam and P computed inside the sweeps (triton_chunk.INLINE_GLA_PREP,
no prep kernel, no P [B, T, HV, C] in memory) against the prep kernel writing them first, on
the H200, in the same process.

    python benchmarks/device/probe_gla_inline.py [--shapes gla_t32k,gla_b4] [--configs 128x8:1,...]
        [--rounds 2] [--out results.json]

Per shape: both forms at each split config (BVxwarps:programs per SM; the first is the
library's default), measured in turn --rounds times (benchmarks/linear_attention.py's measure:
do_bench medians, warm), and each form's relative RMS distance from the other (output and
gradients, bf16). One results row per (shape, config): ours_ms the inline form's fwd+bwd
(median over rounds), anchor_ms the prep kernel's.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from common import write_results  # noqa: E402
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402


@contextlib.contextmanager
def settings(inline: bool, config: tuple[int, int], ppsm: int):
    saved = (tc.INLINE_GLA_PREP, tc.CONFIGS["split"], tc.SPLIT_PROGRAMS_PER_SM)
    tc.INLINE_GLA_PREP, tc.CONFIGS["split"], tc.SPLIT_PROGRAMS_PER_SM = inline, config, ppsm
    try:
        yield
    finally:
        tc.INLINE_GLA_PREP, tc.CONFIGS["split"], tc.SPLIT_PROGRAMS_PER_SM = saved


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="gla_t32k,gla_b4")
    p.add_argument("--configs", default="128x8:1,128x8:2,64x8:2,64x4:2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for key in a.shapes.split(","):
        name, B, T, H, HV, D, lengths = bench.SHAPES[key]
        x, cu = bench.make_inputs("gla", B, T, H, HV, D, lengths)
        do = torch.randn(B, T, HV, D, device="cuda").bfloat16()
        fn = bench.ours_fn("gla", cu)
        for item in a.configs.split(","):
            cfg, ppsm = item.split(":")
            config = tuple(int(n) for n in cfg.split("x"))
            ms = {True: [], False: []}
            peak, out = {}, {}
            for _ in range(a.rounds):
                for inline in (False, True):
                    with settings(inline, config, int(ppsm)):
                        m, peak[inline], out[inline] = bench.measure(fn, x, do)
                    ms[inline].append(m)
            med = {f: {mode: round(statistics.median(r[mode] for r in ms[f]), 4) for mode in ms[f][0]} for f in ms}
            (o1, g1), (o0, g0) = out[True], out[False]
            err = {"o": bench.rel_rms(o1, o0), **{f"d{n}": bench.rel_rms(a1, a0) for n, a1, a0 in zip(x, g1, g0)}}
            record = dict(shape=name, config=cfg, ppsm=int(ppsm), inline=med[True], prep=med[False],
                          rounds={str(f): ms[f] for f in ms}, rel_rms_inline_vs_prep={n: f"{e:.1e}" for n, e in err.items()},
                          peak={"inline": peak[True], "prep": peak[False]})
            print(json.dumps(record), flush=True)
            rows.append({
                "name": "gla fwd+bwd, gam and P inside the sweeps (A/B)", "shape": name + "-bf16",
                "ours_ms": med[True]["fwd+bwd"], "anchor": "the same with the prep kernel writing gam and P first",
                "anchor_ms": med[False]["fwd+bwd"], "speedup": round(med[False]["fwd+bwd"] / med[True]["fwd+bwd"], 3),
                "target_speedup": None, "ours_peak_mem_bytes": peak[True], "anchor_peak_mem_bytes": peak[False],
                "fwd_ms": med[True]["fwd"], "bwd_ms": med[True]["bwd"],
                "anchor_fwd_ms": med[False]["fwd"], "anchor_bwd_ms": med[False]["bwd"],
                "split_config": {"BV": config[0], "num_warps": config[1]}, "split_programs_per_sm": int(ppsm),
                "rel_rms_vs_anchor": {n: float(f"{e:.1e}") for n, e in err.items()},
                "notes": f"benchmarks/device/probe_gla_inline.py: both forms in turn, {a.rounds} rounds in one "
                         "process, medians of benchmarks/linear_attention.py's measure (do_bench medians)",
            })
            if a.out:
                write_results(a.out, rows)


if __name__ == "__main__":
    main()
