"""The sequence split of the linear-attention recurrences (triton_chunk._plan_segments), on the H200.

    python benchmarks/device/probe_split.py [--shapes gla_t32k,qwen,...] [--ops gla,gdn] [--ppsm 2,4,8]
        [--min-chunks 16] [--fla]

Per shape and op: ours without the split (MIN_SEGMENT_CHUNKS huge), then with it at each
SPLIT_PROGRAMS_PER_SM in --ppsm; fwd / bwd / fwd+bwd medians (benchmarks/linear_attention.py's
measure), the segment count, and the split's relative RMS distance from the unsplit run
(output and gradients, bf16). --fla times fla in the same process (guard lifted as there).
Prints one JSON line per row; with --out also writes them in the results format (one row per
split setting: ours_ms the split's fwd+bwd, anchor_ms the unsplit run's, as in
results/h200/linear_attention_split.json).
"""

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from common import write_results  # noqa: E402
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402


@contextlib.contextmanager
def settings(config=None, **values):
    """triton_chunk's split constants (and CONFIGS[key] = value for config=(key, value)) set for
    the block, restored after it."""
    names = ("MIN_SEGMENT_CHUNKS", "SPLIT_MAX_PROGRAMS", "SPLIT_PROGRAMS_PER_SM", "SEGMENT_CHUNKS")
    saved, saved_configs = {n: getattr(tc, n) for n in names}, dict(tc.CONFIGS)
    try:
        for n, v in values.items():
            setattr(tc, n, v)
        if config is not None:
            tc.CONFIGS[config[0]] = config[1]
        yield
    finally:
        for n, v in saved.items():
            setattr(tc, n, v)
        tc.CONFIGS.clear()
        tc.CONFIGS.update(saved_configs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="gla_t32k,gla_b4,qwen,h32,b4,tp8,varlen")
    p.add_argument("--ops", default="gla,gdn")
    p.add_argument("--ppsm", default="2,4,8")
    p.add_argument("--min-chunks", type=int, default=16)
    p.add_argument("--fla", action="store_true")
    p.add_argument("--split-configs", default="32x4", help="BVxwarps,... for CONFIGS['split']")
    p.add_argument("--breakdown", default="", help="op:shape,... to time pass by pass")
    p.add_argument("--out", default=None, help="also write the rows here (results format)")
    a = p.parse_args()
    for item in filter(None, a.breakdown.split(",")):
        breakdown(*item.split(":"))
    if a.breakdown:
        return
    rows = []
    for op in a.ops.split(","):
        for key in a.shapes.split(","):
            if key not in bench.OP_SHAPES[op]:
                continue
            name, B, T, H, HV, D, lengths = bench.SHAPES[key]
            x, cu = bench.make_inputs(op, B, T, H, HV, D, lengths)
            do = torch.randn(B, T, HV, D, device="cuda").bfloat16()
            fn = bench.ours_fn(op, cu)
            with settings(MIN_SEGMENT_CHUNKS=10**9):
                base_ms, base_peak, (base_o, base_g) = bench.measure(fn, x, do)
            base = dict(ms=base_ms, peak=base_peak)
            print(json.dumps(dict(op=op, shape=name, split="off", ms=base_ms, peak=base_peak)), flush=True)
            if a.fla:
                ms, _, _ = bench.measure(bench.fla_fn(op, cu), x, do)
                print(json.dumps(dict(op=op, shape=name, split="fla", ms=ms)), flush=True)
            for ppsm, cfg in [(int(v), c) for v in a.ppsm.split(",") for c in a.split_configs.split(",")]:
                key_cfg = ("split_gdn" if op == "gdn" else "split", tuple(int(n) for n in cfg.split("x")))
                with settings(key_cfg, MIN_SEGMENT_CHUNKS=a.min_chunks, SPLIT_PROGRAMS_PER_SM=ppsm,
                              SPLIT_MAX_PROGRAMS={"gla": 10**9, "gdn": 10**9}):
                    seg = tc._plan_segments(tc._Chunks(B, T, cu), D, HV, D, "cuda", op == "gdn")
                    if seg is None:
                        print(json.dumps(dict(op=op, shape=name, split=ppsm, segments=None)), flush=True)
                        continue
                    ms, peak, (o, g) = bench.measure(fn, x, do)
                err = {"o": bench.rel_rms(o, base_o), **{f"d{n}": bench.rel_rms(gs, gb) for n, gs, gb in zip(x, g, base_g)}}
                record = dict(op=op, shape=name, split=ppsm, config=cfg, segments=seg.layout.N, ms=ms, peak=peak,
                              speedup={m: round(base_ms[m] / ms[m], 3) for m in ms},
                              rel_rms_vs_unsplit={n: f"{e:.1e}" for n, e in err.items()})
                print(json.dumps(record), flush=True)
                rows.append(result_row(record, base))
                if a.out:
                    write_results(a.out, rows)


def result_row(r, base):
    """One printed record (and its unsplit run) as a results-format row."""
    bv, nw = (int(x) for x in r["config"].split("x"))
    return {
        "name": f"{r['op']} fwd+bwd, sequence split", "shape": r["shape"] + "-bf16",
        "ours_ms": round(r["ms"]["fwd+bwd"], 4), "anchor": "ours unsplit (one sweep per sequence-head, BV 32 or less)",
        "anchor_ms": round(base["ms"]["fwd+bwd"], 4), "speedup": round(base["ms"]["fwd+bwd"] / r["ms"]["fwd+bwd"], 3),
        "target_speedup": None, "ours_peak_mem_bytes": r["peak"], "anchor_peak_mem_bytes": base["peak"],
        "fwd_ms": round(r["ms"]["fwd"], 4), "bwd_ms": round(r["ms"]["bwd"], 4),
        "anchor_fwd_ms": round(base["ms"]["fwd"], 4), "anchor_bwd_ms": round(base["ms"]["bwd"], 4),
        "split_programs_per_sm": r["split"], "split_config": {"BV": bv, "num_warps": nw}, "segments": r["segments"],
        "rel_rms_vs_unsplit": {k: float(v) for k, v in r["rel_rms_vs_unsplit"].items()},
        "notes": "benchmarks/linear_attention.py's measure (do_bench medians, warm, L2 flushed), both in the same process",
    }


def breakdown(op, key, segment_chunks=16):
    """Each pass of the split forward on one shape, timed alone (do_bench medians, ms)."""
    import triton

    name, B, T, H, HV, D, lengths = bench.SHAPES[key]
    x, cu = bench.make_inputs(op, B, T, H, HV, D, lengths)
    q, k, v, g = (x[n].detach() for n in "qkvg")
    beta = x["beta"].detach() if op == "gdn" else None
    chunks = tc._Chunks(B, T, cu)
    with settings(SEGMENT_CHUNKS=segment_chunks):
        seg = tc._plan_segments(chunks, D, HV, D, "cuda", op == "gdn")
    scale = D**-0.5
    gam, P, _, w, u = tc._prep(q, k, v, g, beta, scale, chunks, store_A=False)
    u = u if op == "gdn" else v
    config = tc._split_config(D, D, op == "gdn")
    NS = seg.layout.N
    L = torch.empty(NS, HV, D, D, device="cuda")
    M = torch.empty(NS, HV, D, D, device="cuda")
    G = torch.empty(NS, HV, device="cuda")
    o = torch.empty_like(v)
    bench_ms = lambda f: round(triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median"), 4)  # noqa: E731
    rows = {"prep": bench_ms(lambda: tc._prep(q, k, v, g, beta, scale, chunks, store_A=False))}
    if op == "gdn":
        rows["L pass"] = bench_ms(lambda: tc._sweep_fwd(seg.layout, config, q, k, w, u, gam, P, scale, ht=L))
        rows["M pass"] = bench_ms(lambda: tc._sweep_fwd(seg.layout, config, q, k, w, u, gam, P, scale, V=D, ht=M,
                                                        zero_u=True, h0_eye=True))
        trans = M
    else:
        rows["L pass"] = bench_ms(lambda: tc._sweep_fwd(seg.layout, config, q, k, w, u, gam, P, scale, ht=L, gt=G))
        trans = G
    rows["scan"] = bench_ms(lambda: tc._scan(seg, L, trans, None, reverse=False, want_end=True))
    S_in, _ = tc._scan(seg, L, trans, None, reverse=False, want_end=True)
    rows["output pass"] = bench_ms(lambda: tc._sweep_fwd(seg.layout, config, q, k, w, u, gam, P, scale, o=o, h0=S_in))
    full = tc._layout(chunks)
    rows["unsplit sweep"] = bench_ms(lambda: tc._sweep_fwd(full, tc._seq_config(D, D, chunks.N * HV, "cuda", gdn=op == "gdn"), q, k, w, u, gam, P,
                                                           scale, o=o))
    print(json.dumps(dict(op=op, shape=name, segments=NS, breakdown_ms=rows)), flush=True)
    # split against unsplit, same inputs, directly
    fn = bench.ours_fn(op, cu)
    with torch.no_grad():
        with settings(MIN_SEGMENT_CHUNKS=10**9):
            o1 = fn(x)
        with settings(SEGMENT_CHUNKS=segment_chunks):
            o2 = fn(x)
    print(json.dumps(dict(op=op, shape=name, max_abs_diff=(o1.float() - o2.float()).abs().max().item(),
                          differing=int((o1 != o2).sum()))), flush=True)


if __name__ == "__main__":
    main()
