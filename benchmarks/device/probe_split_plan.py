"""Probe: the sequence split's segment plan (triton_chunk._plan_segments) against the plan
before it, simple GLA on the H200, both in the same process.

    python benchmarks/device/probe_split_plan.py [--shapes gla_t32k,gla_b4,varlen] [--rounds 2]
        [--passes] [--out results.json]

Before (d63cfcb): segments of ceil(total chunks x HV / SMs) chunks, which at B4-T8192-H16 cut
each sequence into 63 + 63 + 2 chunks (192 programs on 132 SMs) and at B1-T32768-H16 into
8 x 63 + 8 (144 programs). Now (triton_chunk._segment_length): the length whose modelled sweep
ends first, 2 x 64 and 8 x 64 chunks there (128 programs each).
Per shape both plans run in turn --rounds times (benchmarks/linear_attention.py's measure:
do_bench medians, warm); one results row per shape, ours_ms the current plan's fwd+bwd
(median over rounds), anchor_ms the earlier plan's, with the segment counts and the relative
RMS distance between the two (output and gradients, bf16). --passes first prints each kernel
of the current plan's forward and backward timed alone (printed only).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from common import write_results  # noqa: E402
from megatron_moe_hybrid.ops._intmath import cdiv  # noqa: E402
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc  # noqa: E402

current_plan = tc._plan_segments


def earlier_plan(chunks, K, HV, V, device, gdn):
    """_plan_segments as at d63cfcb (SEGMENT_CHUNKS unset)."""
    longest = max(cdiv(n, tc.CHUNK) for n in chunks.lengths)
    if chunks.N * HV * cdiv(V, tc.CONFIGS["seq"][0]) > tc.SPLIT_MAX_PROGRAMS["gdn" if gdn else "gla"]:
        return None
    BV = tc._split_config(K, V, gdn)[0]
    target = tc._num_sms(torch.device(device)) * tc.SPLIT_PROGRAMS_PER_SM
    length = max(tc.MIN_SEGMENT_CHUNKS, cdiv(chunks.NT * HV * cdiv(V, BV), target))
    if length >= longest:
        return None
    return tc._segments(tuple(chunks.starts), tuple(chunks.lengths), length, torch.device(device))


def passes(key):
    """{pass: median ms} of simple GLA's forward and backward under the current plan, each kernel
    launch timed alone the way _fwd / _bwd call it (do_bench medians)."""
    import triton

    name, B, T, H, HV, D, lengths = bench.SHAPES[key]
    x, cu = bench.make_inputs("gla", B, T, H, HV, D, lengths)
    q, k, v, g = (x[n].detach() for n in "qkvg")
    do = torch.randn_like(v)
    scale = D**-0.5
    chunks = tc._Chunks(B, T, cu)
    seg = tc._plan_segments(chunks, D, HV, D, "cuda", False)
    config = tc._split_config(D, D, False)
    gam, P, _, _, _ = tc._prep(q, k, v, g, None, scale, chunks, store_A=False)
    NS = seg.layout.N
    L = torch.empty(NS, HV, D, D, device="cuda")
    G = torch.empty(NS, HV, device="cuda")
    o = torch.empty_like(v)
    h = torch.empty(chunks.NT, HV, D, D, dtype=q.dtype, device="cuda")
    dh, dU = torch.empty_like(h), torch.empty_like(v)
    dq = torch.empty(B, T, HV, D, dtype=q.dtype, device="cuda")  # per value head, as _bwd
    dk = torch.empty_like(dq)
    dg = torch.empty(B, T, HV, device="cuda")
    ms = lambda f: round(triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median"), 4)  # noqa: E731
    tc._sweep_fwd(seg.layout, config, q, k, None, v, gam, P, scale, ht=L, gt=G)
    S_in, _ = tc._scan(seg, L, G, None, reverse=False, want_end=False)
    dS, _ = tc._scan(seg, L, G, None, reverse=True, want_end=False)  # a stand-in of the right shape
    rows = {
        "prep": ms(lambda: tc._prep(q, k, v, g, None, scale, chunks, store_A=False)),
        "fwd: L pass": ms(lambda: tc._sweep_fwd(seg.layout, config, q, k, None, v, gam, P, scale, ht=L, gt=G)),
        "fwd: scan": ms(lambda: tc._scan(seg, L, G, None, reverse=False, want_end=False)),
        "fwd: output pass": ms(lambda: tc._sweep_fwd(seg.layout, config, q, k, None, v, gam, P, scale, o=o, h0=S_in)),
        "bwd: h pass": ms(lambda: tc._sweep_fwd(seg.layout, config, q, k, None, v, gam, P, scale, h0=S_in, h=h)),
        "bwd: L pass": ms(lambda: tc._sweep_bwd(seg.layout, config, q, k, None, gam, P, do, scale, dh0=L)),
        "bwd: scan": ms(lambda: tc._scan(seg, L, G, None, reverse=True, want_end=False)),
        "bwd: dh, dv pass": ms(lambda: tc._sweep_bwd(seg.layout, config, q, k, None, gam, P, do, scale, dU=dU, dh=dh,
                                                      dht=dS)),
        "bwd: chunk kernel": ms(lambda: tc._chunk_bwd(chunks, q, k, v, gam, None, None, h, dh, None, dU, do, dq, dk,
                                                       None, dg, None, scale)),
    }
    print(json.dumps(dict(shape=name, segments=NS, passes_ms=rows)), flush=True)
    return name, NS, rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="gla_t32k,gla_b4,varlen")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--passes", action="store_true", help="also time each pass of the current plan (simple GLA)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    if a.passes:
        for key in a.shapes.split(","):
            passes(key)
    if a.rounds < 1:
        return
    for key in a.shapes.split(","):
        name, B, T, H, HV, D, lengths = bench.SHAPES[key]
        x, cu = bench.make_inputs("gla", B, T, H, HV, D, lengths)
        do = torch.randn(B, T, HV, D, device="cuda").bfloat16()
        fn = bench.ours_fn("gla", cu)
        chunks = tc._Chunks(B, T, cu)
        plans = {"now": current_plan, "before": earlier_plan}
        segments = {}
        for label, plan in plans.items():
            seg = plan(chunks, D, HV, D, "cuda", False)
            segments[label] = None if seg is None else seg.layout.N
        try:
            med, peak, out = bench.measure_in_turn(fn, x, do, ("before", "now"),
                                                   lambda label: setattr(tc, "_plan_segments", plans[label]), a.rounds)
        finally:
            tc._plan_segments = current_plan
        row = bench.ab_row(
            "gla fwd+bwd, segment plan: the modelled shortest sweep (A/B)", name, x, med, peak, out, "now", "before",
            "the same with d63cfcb's plan (ceil(chunks x HV / SMs) per segment)",
            f"benchmarks/device/probe_split_plan.py: both plans in turn, {a.rounds} rounds in one process",
            segments=segments["now"], anchor_segments=segments["before"],
        )
        print(json.dumps(dict(shape=name, segments=segments, now=med["now"], before=med["before"],
                              rel_rms=row["rel_rms_vs_anchor"])), flush=True)
        rows.append(row)
        if a.out:
            write_results(a.out, rows)


if __name__ == "__main__":
    main()
