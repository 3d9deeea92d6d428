"""The causal short conv + SiLU in front of linear attention (ops.linear_attention.short_conv)
against fla 0.6.0's causal_conv1d (Triton) and the eager cuDNN path it replaced, on the H200.

    python benchmarks/short_conv.py            # writes benchmarks/results/h200/short_conv.json

The shape is the end-to-end model's q | k | v (issue 12): B4, T4096, C8192, W4, bf16, x a
channel slice of the [T, B, 12352] input projection, as the layer passes it. Ours reads the
slice in place; fla and the eager path take it contiguous (the copy is timed, as a layer would
pay it). Backward rows also try the backward's block shapes (BWD_CONFIG) to pick them.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import time_and_peak, write_results  # noqa: E402

from megatron_moe_hybrid.ops.linear_attention import short_conv  # noqa: E402

OUT = os.path.join(HERE, "results", "h200", "short_conv.json")
BWD_CANDIDATES = [(32, 128, 8), (64, 128, 8), (16, 128, 4), (32, 64, 4), (64, 64, 4)]


def eager(x, w):  # the layer's former path: pad, cuDNN depthwise conv, SiLU, transposes
    y = F.conv1d(F.pad(x.transpose(1, 2), (w.shape[1] - 1, 0)), w[:, None, :], groups=w.shape[0])
    return F.silu(y).transpose(1, 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    B, T, C, D, W = 4, 4096, 8192, 12352, 4
    torch.manual_seed(0)
    proj = torch.randn(T, B, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    w = (torch.randn(C, W, device="cuda") * 0.3).bfloat16().requires_grad_(True)
    dy = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    shape = f"B{B}-T{T}-C{C}-W{W}-bf16 (slice of [T, B, {D}])"
    rows = []

    def x_view():
        return proj.transpose(0, 1)[..., :C]

    def step(fn, backward):
        def run():
            y = fn()
            if backward:
                torch.autograd.grad(y, (proj, w), dy)
        return run

    anchors = {"eager (cuDNN conv1d)": lambda: eager(x_view().contiguous(), w)}
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv

        anchors["fla 0.6.0 causal_conv1d"] = lambda: fla_conv(x_view().contiguous(), w, activation="silu")[0]
    except Exception as e:  # recorded in notes
        fla_error = f"{type(e).__name__}: {e}"
    else:
        fla_error = None
    for backward in (False, True):
        configs = BWD_CANDIDATES if backward else [None]
        anchor_ms = {}
        for name, fn in anchors.items():
            anchor_ms[name], _ = time_and_peak(step(fn, backward), 3, args.reps)
        for config in configs:
            if config is not None:
                short_conv.BWD_CONFIG = config
            ms, peak = time_and_peak(step(lambda: short_conv.causal_conv1d(x_view(), w), backward), 3, args.reps)
            best_name = min(anchor_ms, key=anchor_ms.get)
            row = {"name": "short conv + SiLU " + ("fwd+bwd" if backward else "fwd")
                   + (f" (BWD_CONFIG {config})" if config else ""),
                   "shape": shape, "ours_ms": round(ms, 4), "ours_peak_mem_bytes": peak,
                   "anchor": best_name, "anchor_ms": round(anchor_ms[best_name], 4),
                   "speedup": round(anchor_ms[best_name] / ms, 3),
                   "anchors_ms": {k: round(v, 4) for k, v in anchor_ms.items()},
                   "notes": f"median of {args.reps}, CUDA events" + (f"; fla not run: {fla_error}" if fla_error else "")}
            rows.append(row)
            print(row, flush=True)
            write_results(args.out, rows, ("fla-core",))


if __name__ == "__main__":
    main()
