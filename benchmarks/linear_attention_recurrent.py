"""Times the compiled token-by-token recurrence (fused_recurrent_*, backend "cuda") against fla 0.6.0.

    python benchmarks/linear_attention_recurrent.py --out benchmarks/results/h200/linear_attention_recurrent.json

Shapes: a long sequence, B1-T4096-H16-D128, and a decode step, B64-T1-H32-D128 with a carried
state (initial state in, final state out). fla's fused_recurrent_gated_delta_rule has no
backward, so its fwd+bwd row has no anchor (fla's fused_recurrent_simple_gla has one). Inputs are bf16 q, k, v, beta and fp32 g, unit-norm
q/k. Each row also checks that ours and fla compute the same output (relative RMS difference).
Times are medians over --reps calls with CUDA events, after warm-up; calls go through the
public functions (host overhead included, as a user sees it), and the "op" rows call
torch.ops.mmh.recurrent_fwd directly for each block layout.
"""

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import time_and_peak, write_results
from megatron_moe_hybrid.ops.linear_attention import (
    fused_recurrent_gated_delta_rule,
    fused_recurrent_simple_gla,
)

LAYOUTS = {0: "default (32 lanes x 2 cols)", 1: "32 lanes x 2 cols", 2: "16 lanes x 1 col", 3: "8 lanes x 1 col"}


def make_inputs(B, T, H, D, with_state, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    q = F.normalize(torch.randn(B, T, H, D, device=dev, generator=gen), dim=-1).to(bf)
    k = F.normalize(torch.randn(B, T, H, D, device=dev, generator=gen), dim=-1).to(bf)
    v = torch.randn(B, T, H, D, device=dev, generator=gen).to(bf)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev, generator=gen) + 2)
    beta = torch.rand(B, T, H, device=dev, generator=gen).to(bf)
    h0 = torch.randn(B, H, D, D, device=dev, generator=gen) if with_state else None
    return q, k, v, g, beta, h0


def rel_diff(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def state_bytes(B, H, D):
    return B * H * D * D * 4


def _fwd_bwd(fn, leaves, h0, output_final_state):
    """Forward and backward of fn on fresh autograd leaves (the gradients are returned, not kept)."""
    inputs = [*leaves] + ([h0] if h0 is not None else [])
    o, h = fn(*leaves, initial_state=h0, output_final_state=output_final_state)
    loss = o.float().sum() + (h.sum() if h is not None else 0)
    return torch.autograd.grad(loss, inputs)


def bench_shape(B, T, H, D, anchors, args, add):
    decode = T == 1
    shape = f"B{B}-T{T}-H{H}-D{D}"
    q, k, v, g, beta, h0 = make_inputs(B, T, H, D, with_state=decode)
    kw = {"initial_state": h0, "output_final_state": decode}
    # bytes each call must move: q, k, v, o (bf16), g (fp32), beta (bf16), states in and out (fp32)
    bytes_min = B * T * H * (4 * D * 2 + 4 + 2) + (2 * state_bytes(B, H, D) if decode else 0)
    flops = B * T * H * 6 * D * D  # per token: S^T k, S^T q (2KV each), decay + update (2KV)
    for op, ours_fn, extra in (
        ("gdr", fused_recurrent_gated_delta_rule, (beta,)),
        ("simple_gla", fused_recurrent_simple_gla, ()),
    ):
        fla_fn = anchors[op]
        tensors = (q, k, v, g, *extra)
        ours = functools.partial(ours_fn, *tensors, backend="cuda", **kw)
        # fla's gated delta rule takes (q, k, v, g, gk, gv, beta, ...): beta by name.
        anchor = functools.partial(fla_fn, q, k, v, g, **({"beta": beta} if op == "gdr" else {}), **kw)
        (o_ours, h_ours), (o_fla, h_fla) = ours(), anchor()
        diff = max(rel_diff(o_ours, o_fla), rel_diff(h_ours, h_fla) if decode else 0.0)
        ours_ms, ours_mem = time_and_peak(ours, args.warmup, args.reps)
        fla_ms, fla_mem = time_and_peak(anchor, args.warmup, args.reps)
        add({
            "name": f"{op} fused_recurrent fwd", "shape": shape, "ours_ms": round(ours_ms, 4),
            "anchor": "fla 0.6.0 fused_recurrent", "anchor_ms": round(fla_ms, 4),
            "speedup": round(fla_ms / ours_ms, 3), "target_speedup": None,
            "ours_peak_mem_bytes": ours_mem, "anchor_peak_mem_bytes": fla_mem,
            "tflops": round(flops / ours_ms / 1e9, 2),
            "ours_gb_per_s": round(bytes_min / ours_ms / 1e6, 1),
            "anchor_gb_per_s": round(bytes_min / fla_ms / 1e6, 1),
            "ours_vs_anchor_rel_rms": diff,
            "notes": f"median of {args.reps}, CUDA events, public functions (host overhead included); "
            "bf16 q/k/v/beta, fp32 g" + ("; initial state in, final state out" if decode else ""),
        })
        if op == "gdr":
            g32, b32 = g.float().contiguous(), beta.float().contiguous()
            for layout, layout_name in LAYOUTS.items():
                call = functools.partial(
                    torch.ops.mmh.recurrent_fwd, q, k, v, g32, b32, h0, None, D**-0.5, decode, 0, layout
                )
                o_l = call()[0]
                ms, mem = time_and_peak(call, args.warmup, args.reps)
                add({
                    "name": "gdr recurrent_fwd op", "shape": shape, "ours_ms": round(ms, 4),
                    "anchor": "fla 0.6.0 fused_recurrent", "anchor_ms": round(fla_ms, 4),
                    "speedup": round(fla_ms / ms, 3), "target_speedup": None,
                    "ours_peak_mem_bytes": mem, "anchor_peak_mem_bytes": fla_mem,
                    "tflops": round(flops / ms / 1e9, 2), "ours_gb_per_s": round(bytes_min / ms / 1e6, 1),
                    "ours_vs_anchor_rel_rms": rel_diff(o_l, o_fla),
                    "notes": f"op called directly (no Python wrapper), block_layout {layout} = {layout_name}",
                })
        # Forward + backward. fla's gated delta rule fused_recurrent raises NotImplementedError in
        # backward, so that row has no anchor; its simple GLA one has a backward.
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        h0g = None if h0 is None else h0.detach().clone().requires_grad_()
        ours_fb = functools.partial(_fwd_bwd, functools.partial(ours_fn, backend="cuda"), leaves, h0g, decode)
        ms, mem = time_and_peak(ours_fb, args.warmup, args.reps)
        fla_fb_ms = fla_fb_mem = None
        if op == "simple_gla":
            fla_fb_ms, fla_fb_mem = time_and_peak(
                functools.partial(_fwd_bwd, fla_fn, leaves, h0g, decode), args.warmup, args.reps
            )
        add({
            "name": f"{op} fused_recurrent fwd+bwd", "shape": shape, "ours_ms": round(ms, 4),
            "anchor": "fla 0.6.0 fused_recurrent",
            "anchor_ms": None if fla_fb_ms is None else round(fla_fb_ms, 4),
            "speedup": None if fla_fb_ms is None else round(fla_fb_ms / ms, 3), "target_speedup": None,
            "ours_peak_mem_bytes": mem, "anchor_peak_mem_bytes": fla_fb_mem,
            "tflops": round(3 * flops / ms / 1e9, 2),
            "notes": ("fla's gated delta rule fused_recurrent has no backward (NotImplementedError), so no "
                      "anchor; " if op == "gdr" else "") + "ours stores a state checkpoint every 16 steps and recomputes",
        })


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/h200/linear_attention_recurrent.json")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_gdr
    from fla.ops.simple_gla import fused_recurrent_simple_gla as fla_gla

    rows = []

    def add(row):
        rows.append(row)
        nan = float("nan")
        print(
            f"{row['name']:<30} {row['shape']:<20} ours {row['ours_ms']:8.4f} ms  anchor "
            f"{row['anchor_ms'] or nan:8.4f} ms  x{row['speedup'] or nan:5.2f}  "
            f"diff {row.get('ours_vs_anchor_rel_rms', nan):.1e}  {row['notes'][:60]}",
            flush=True,
        )
        write_results(args.out, rows, packages=("fla-core",))

    anchors = {"gdr": fla_gdr, "simple_gla": fla_gla}
    for B, T, H, D in ((1, 4096, 16, 128), (64, 1, 32, 128)):
        bench_shape(B, T, H, D, anchors, args, add)


if __name__ == "__main__":
    main()
