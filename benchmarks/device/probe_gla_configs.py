"""Probe: simple GLA's launch configs, each variant against the defaults, on the H200, in one
process.

    python benchmarks/device/probe_gla_configs.py [--variants seq_128x8,...] [--shapes h96]
        [--op gla|gdn] [--rounds 2] [--out results.json]

The unsplit recurrences past one wave take CONFIGS["seq_wide"] (BV 64, 4 warps: 192 programs at
B1-T8192-H96, 1.45 waves of the H200's 132 SMs), chosen against BV 32 only
(linear_attention_seq_bv.json); BV 128 (96 programs, one wave) and the sequence split were not
tried there. The chunk kernel's configs were (probe_chunk_bwd.py,
linear_attention_chunk_bwd_config.json: (64, 8) fastest for simple GLA), but not a register cap:
at (64, 8) it compiled to 196 registers a thread, one program per SM, and ran at about 60% of
its byte floor. Variants:
    chunk_<BV>x<warps>[s<stages>][r<maxnreg>]   the chunk backward at that config (--op gdn: both
                                    kernels of the two-kernel form; simple GLA's _bwd_chunk_kernel: BV up
                                    to 128; maxnreg caps its registers per thread, e.g. 128 for two
                                    8-warp programs per SM, where 196 allow one)
    seq_<BV>x<warps>                the unsplit recurrences at that config (B1-T8192-H96's path)
    light_<BV>x<warps>x<BK>[s<stages>]  the light sweeps (GLA_LIGHT_SWEEPS) at that config
    light, nolight                  GLA_LIGHT_SWEEPS True (at every shape); False
    prep_<warps>                    the prep kernel (which forms o under the light sweeps)
    prep_<warps>r<maxnreg>          the prep kernel at that many warps and at most maxnreg registers
                                    a thread (the delta rule's forward prep compiled to 217 at 4
                                    warps: two programs per SM)
    seg_<n>                         the sequence split forced to n-chunk segments (SEGMENT_CHUNKS)
    gate_<n>                        the light sweeps split up to n unsplit programs
    persm_<n>                       the light split planned for n programs per SM
    wpersm_<n>                      the whole states' split planned for n programs per SM
    split                           the sequence split where the recurrences would run unsplit
    cfg_<key>_<BV>x<warps>[x<BK>][s<stages>]  CONFIGS[key] (e.g. cfg_split_128x8x128s2: the whole
                                    states' split sweeps at 2 stages)
    <a>+<b>[+...]                   variants a, b, ... together (e.g. light+light_128x8x128: the
                                    light path's structure over whole states)

Per shape the defaults and each variant run in turn --rounds times
(benchmarks/linear_attention.py's measure: do_bench medians, warm, and one CUDA graph replayed);
one results row per (variant, shape), ours_* the variant, anchor_* the defaults, with the relative
RMS distance between the two (bf16; a different BV sums the V blocks in another order).
"""

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from common import write_results  # noqa: E402
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402

DEFAULT_VARIANTS = "seq_128x8,seq_128x4,split"


SAVED = {"_chunk_bwd_config": tc._chunk_bwd_config, "_seq_config": tc._seq_config,
         "SPLIT_MAX_PROGRAMS": dict(tc.SPLIT_MAX_PROGRAMS), "CONFIGS": dict(tc.CONFIGS),
         "SEGMENT_CHUNKS": tc.SEGMENT_CHUNKS, "SPLIT_LIGHT_PROGRAMS_PER_SM": tc.SPLIT_LIGHT_PROGRAMS_PER_SM,
         "GLA_LIGHT_SWEEPS": tc.GLA_LIGHT_SWEEPS, "SPLIT_PROGRAMS_PER_SM": tc.SPLIT_PROGRAMS_PER_SM}


def restore():
    """Every default a variant changes, back."""
    tc._chunk_bwd_config = SAVED["_chunk_bwd_config"]
    tc._seq_config = SAVED["_seq_config"]
    tc.SPLIT_MAX_PROGRAMS.clear()
    tc.SPLIT_MAX_PROGRAMS.update(SAVED["SPLIT_MAX_PROGRAMS"])
    tc.CONFIGS.clear()
    tc.CONFIGS.update(SAVED["CONFIGS"])
    tc.SEGMENT_CHUNKS = SAVED["SEGMENT_CHUNKS"]
    tc.SPLIT_LIGHT_PROGRAMS_PER_SM = SAVED["SPLIT_LIGHT_PROGRAMS_PER_SM"]
    tc.GLA_LIGHT_SWEEPS = SAVED["GLA_LIGHT_SWEEPS"]
    tc.SPLIT_PROGRAMS_PER_SM = SAVED["SPLIT_PROGRAMS_PER_SM"]


# variant <key>_<n> -> (description, set n)
INT_SETTINGS = {
    "prep": ("the prep kernel (o from the states) at {n} warps", lambda n: tc.CONFIGS.update(prep=(None, n))),
    "seg": ("the sequence split forced to {n}-chunk segments", lambda n: setattr(tc, "SEGMENT_CHUNKS", n)),
    "gate": ("the light sweeps split up to {n} unsplit programs",
             lambda n: tc.SPLIT_MAX_PROGRAMS.update(gla_light=n)),
    "persm": ("the light split planned for {n} programs per SM",
              lambda n: setattr(tc, "SPLIT_LIGHT_PROGRAMS_PER_SM", n)),
    "wpersm": ("the whole states' split planned for {n} programs per SM",
               lambda n: setattr(tc, "SPLIT_PROGRAMS_PER_SM", n)),
}


def variant(name):
    """(description, apply()) of a variant name; restore() undoes any."""
    if "+" in name:
        parts = [variant(n) for n in name.split("+")]

        def apply():
            for _, part in parts:
                part()
        return " and ".join(d for d, _ in parts), apply
    m = re.fullmatch(r"cfg_([a-z_]+?)_(\d+)x(\d+)(?:x(\d+))?(?:s(\d+))?", name)
    if m:
        key = m.group(1)
        if key not in tc.CONFIGS:
            raise SystemExit(f"--variants: {name!r}: no CONFIGS[{key!r}] (keys: {sorted(tc.CONFIGS)})")
        BV, warps, BK, stages = m.group(2, 3, 4, 5)
        if stages is not None and BK is None:
            raise SystemExit(f"--variants: {name!r}: stages need a BK (x<BK>) before them")
        config = tuple(int(x) for x in (BV, warps, BK, stages) if x is not None)

        def apply():
            tc.CONFIGS[key] = config
        return f"CONFIGS[{key!r}] = {config}", apply

    m = re.fullmatch(r"chunk_(\d+)x(\d+)(?:s(\d+))?(?:r(\d+))?", name)
    if m:
        config = tuple(None if x is None else int(x) for x in m.groups())

        def apply():
            tc._chunk_bwd_config = lambda K, V: config
        return f"the chunk kernel at (BV, warps, stages, maxnreg) {config}", apply
    m = re.fullmatch(r"seq_(\d+)x(\d+)", name)
    if m:
        config = (int(m.group(1)), int(m.group(2)))

        def apply():
            tc._seq_config = lambda *args, **kwargs: config  # its keywords: gdn, varlen
        return f"the unsplit recurrences at (BV, warps) {config}", apply
    m = re.fullmatch(r"light_(\d+)x(\d+)x(\d+)(?:s(\d+))?", name)
    if m:
        config = tuple(int(x) for x in m.groups() if x is not None)

        def apply():
            tc.CONFIGS["light"] = config
        return f"the light sweeps at (BV, warps, BK) {config}", apply
    m = re.fullmatch(r"prep_(\d+)r(\d+)", name)
    if m:
        config = (None, int(m.group(1)), int(m.group(2)))

        def apply():
            tc.CONFIGS["prep"] = config
        return f"the prep kernel at {config[1]} warps, at most {config[2]} registers a thread", apply
    m = re.fullmatch(r"(prep|seg|gate|persm|wpersm)_(\d+)", name)
    if m:
        setting, n = INT_SETTINGS[m.group(1)], int(m.group(2))
        return setting[0].format(n=n), lambda: setting[1](n)
    if name in ("light", "nolight"):
        def apply():
            tc.GLA_LIGHT_SWEEPS = name == "light"
        return f"GLA_LIGHT_SWEEPS {name == 'light'}", apply
    if name == "split":
        def apply():
            tc.SPLIT_MAX_PROGRAMS["gla"] = 1 << 20
        return "the sequence split at every shape", apply
    raise SystemExit(f"--variants: unknown variant {name!r}; see the docstring")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--shapes", default="h96")
    p.add_argument("--op", default="gla", choices=("gla", "gdn"), help="the op (the variants' names keep 'gla')")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    names = a.variants.split(",")
    variants = {n: variant(n) for n in names}
    rows = []
    for key in a.shapes.split(","):
        shape, x, cu, do = bench.case(a.op, key)

        def apply(label):
            restore()
            if label != "default":
                variants[label][1]()

        fn, runnable = bench.ours_fn(a.op, cu), []
        for n in names:  # a config that does not compile (shared memory) is reported and left out
            try:
                apply(n)
                torch.autograd.grad(fn(x), list(x.values()), do)
                torch.cuda.synchronize()
                runnable.append(n)
            except Exception as exc:  # noqa: BLE001 - printed, the variant dropped
                print(json.dumps({"variant": n, "shape": shape, "failed": f"{type(exc).__name__}: {str(exc)[:300]}"}),
                      flush=True)
            finally:
                apply("default")
        try:
            med, peak, out = bench.measure_in_turn(fn, x, do, ["default"] + runnable, apply, a.rounds)
        finally:
            apply("default")
        for n in runnable:
            row = bench.ab_row(
                f"{a.op} fwd+bwd, {variants[n][0]} (A/B)", shape, x, med, peak, out, n, "default",
                f"the defaults (GLA_KEEP_P {tc.GLA_KEEP_P})",
                f"benchmarks/device/probe_gla_configs.py --variants {a.variants}: every variant and the defaults in "
                f"turn, {a.rounds} rounds in one process",
            )
            bench.print_ab_row(row)
            rows.append(row)
        if a.out:
            write_results(a.out, rows)
        del x, do, out


if __name__ == "__main__":
    main()
