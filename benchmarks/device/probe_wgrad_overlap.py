"""The experts' two backward products side by side: input gradient dy @ w^T (reads the weights)
and weight gradient x^T @ dy (writes them), one after the other or on two streams at once.

    python benchmarks/device/probe_wgrad_overlap.py [--shapes S2,S1] [--out results.json]

At issue 5's second shape (128 rows per expert) both products are bound by memory, in opposite
directions: the input gradient streams the [E, K, M] weights in, the weight gradient streams
their gradient out, each alone well under the copy bandwidth. Run at once they could share it.
The block scheduler dispatches a grid's blocks before a later grid's unless the later one's
stream has a higher priority, so each pairing is timed with both launch orders and priorities.
Times are CUDA-event medians of the pair (fork and join included), with each product alone
beside them; every concurrent result is checked bitwise against the sequential one.
"""

import argparse
import os
import sys

import torch

from megatron_moe_hybrid.ops.moe import grouped_triton as gt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import time_and_peak, write_results  # noqa: E402

from probe_grouped_gemm import PEAK_TBPS, SHAPES, counts_for  # noqa: E402  (beside this file)


def event_ms(fn, reps=20):
    """CUDA-event median of fn() over reps calls, after 3 warm-up calls (benchmarks/common.py)."""
    return time_and_peak(fn, 3, reps)[0]


def add(rows, row):
    rows.append(row)
    print(f"{row['shape']:32s} {row['name']:62s} {row['ms']:8.3f} ms  x{row.get('vs_one_stream', '')} "
          f"{row.get('bitwise_as_sequential', '')}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="S2,S1")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    low = torch.cuda.Stream()
    high = torch.cuda.Stream(priority=-100)  # mapped to the highest priority the device has
    print("stream priorities", low.priority, high.priority, flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in a.shapes.split(","):
        T, h, E, k, F = SHAPES[name]
        N = T * k
        bounds = gt.row_bounds(counts_for(T, E, k, gen))
        for form, K, M in (("fc1", h, 2 * F), ("fc2", F, h)):
            x = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(E, K, M, device="cuda", dtype=torch.bfloat16) * 0.02
            dy = torch.randn(N, M, device="cuda", dtype=torch.bfloat16)
            tiles = gt.row_tile_bounds(bounds, gt.FWD_CONFIG[0])
            wt = w.transpose(1, 2)

            def dx_fn():
                return gt.grouped_mm(dy, wt, bounds, tiles=tiles)

            def dw_torch():
                return torch._grouped_mm(x.t(), dy, offs=bounds[1:])

            def dw_ours():
                return gt.grouped_mm_wgrad(x, dy, bounds)

            ref_dx, ref_dw = dx_fn(), {"torch": dw_torch(), "ours": dw_ours()}
            floor_ms = 2 * E * K * M * 2 / (PEAK_TBPS * 1e9)  # the weights read once and their gradient written once
            base = {"shape": f"{name}-N{N}-E{E}-K{K}-M{M}", "form": form, "floor_ms_bytes": round(floor_ms, 3)}
            alone = {"dx": event_ms(dx_fn), "dw torch": event_ms(dw_torch), "dw ours": event_ms(dw_ours)}
            for label, ms in alone.items():
                add(rows, {**base, "name": f"{form} {label} alone", "ms": round(ms, 3)})
            for dw_name, dw_fn in (("torch", dw_torch), ("ours", dw_ours)):
                seq = event_ms(lambda: (dx_fn(), dw_fn()))
                add(rows, {**base, "name": f"{form} dx then dw {dw_name}, one stream", "ms": round(seq, 3)})
                for side_name, side in (("normal", low), ("high", high)):
                    for order in ("dx first", "dw first"):
                        out = {}

                        def pair():
                            main = torch.cuda.current_stream()
                            side.wait_stream(main)
                            if order == "dx first":
                                out["dx"] = dx_fn()
                            with torch.cuda.stream(side):
                                out["dw"] = dw_fn()
                            if order == "dw first":
                                out["dx"] = dx_fn()
                            main.wait_stream(side)

                        ms = event_ms(pair)
                        pair()
                        torch.cuda.synchronize()
                        same = torch.equal(out["dx"], ref_dx) and torch.equal(out["dw"], ref_dw[dw_name])
                        add(rows, {**base, "name": f"{form} dx main + dw {dw_name} on a {side_name}-priority stream, {order}",
                                   "ms": round(ms, 3), "vs_one_stream": round(seq / ms, 3), "bitwise_as_sequential": same})
            del x, w, dy, ref_dx, ref_dw
            torch.cuda.empty_cache()
    if a.out:
        write_results(a.out, rows)


if __name__ == "__main__":
    main()
