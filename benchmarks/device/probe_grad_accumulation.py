"""Probe: the experts' weight gradient of a micro-batch after the first (w.grad already holds
a gradient), added in by autograd against added in by our weight-gradient kernel
(grouped_triton.ACCUMULATE_INTO_GRAD), on one H200.

  - kernel rows, per form (fc1, fc2) at issue 5's shapes: autograd's path is what GroupedMM
    runs without the fusion (auto: torch._grouped_mm's gradient into a new [E, K, M] buffer)
    and then AccumulateGrad's grad += dw; ours: grouped_mm_wgrad(accumulate_into=grad). do_bench
    medians, peak memory above the inputs and the gradient;
  - layer rows: the MoE layer (static dispatcher) forward+backward by .backward() into weights
    whose .grad is set (every micro-batch of a step after the first), the fusion on and off in
    turn: CUDA-event ms per call over 5 calls after 3, peak memory above the step's start.

    python benchmarks/device/probe_grad_accumulation.py [--shapes S2,S1] [--out DIR]

Writes grad_accumulation.json (DESIGN.md's row format) to --out.
"""

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import moe as bench_moe  # noqa: E402
from common import mean_event_ms, peak_above, write_results  # noqa: E402
from megatron_moe_hybrid.ops.moe import grouped_triton as gt  # noqa: E402


def kernel_rows(key, spec):
    E, h, f = spec["experts"], spec["hidden"], spec["ffn"]
    rows = spec["tokens"] * spec["topk"] // E
    counts = torch.full((E,), rows, device="cuda")
    bounds = gt.row_bounds(counts)
    out = []
    for form, (K, M) in (("fc1", (h, 2 * f)), ("fc2", (f, h))):
        x = torch.randn(E * rows, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(E * rows, M, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(E, K, M, device="cuda", dtype=torch.bfloat16)

        def autograd_adds():
            grad.add_(torch._grouped_mm(x.t(), dy, offs=bounds[1:]))

        def fused():
            gt.grouped_mm_wgrad(x, dy, bounds, accumulate_into=grad)

        ms = {n: triton.testing.do_bench(fn, rep=200) for n, fn in (("autograd", autograd_adds), ("fused", fused))}
        peak = {n: peak_above(fn) for n, fn in (("autograd", autograd_adds), ("fused", fused))}
        floor_ms = 2 * grad.numel() * grad.element_size() / 4.27e12 * 1e3  # dw read and written once
        out.append({
            "name": f"experts' {form} weight gradient added into .grad (micro-batch after the first)",
            "shape": f"{key}-T{spec['tokens']}-H{h}-E{E}-K{spec['topk']}-F{f}-{rows}rows/expert-bf16",
            "ours_ms": round(ms["fused"], 3), "anchor": "torch._grouped_mm, then grad += dw (autograd's AccumulateGrad)",
            "anchor_ms": round(ms["autograd"], 3), "speedup": round(ms["autograd"] / ms["fused"], 3),
            "ours_peak_mem_bytes": peak["fused"], "anchor_peak_mem_bytes": peak["autograd"],
            "floor_ms": round(floor_ms, 3),
            "notes": "triton.testing.do_bench medians; peaks above the inputs and the gradient; floor: the "
                     "gradient read and written once at 4.27 TB/s"})
        del x, dy, grad
        torch.cuda.empty_cache()
    return out


def layer_row(key, spec, routing="balanced"):
    E, h, f = spec["experts"], spec["hidden"], spec["ffn"]
    router_weight, x, grad_out, w1, w2 = bench_moe.case_tensors(spec, routing, 1.1, 0, 0, E)
    forward, params, info, _ = bench_moe.build_ours(spec, "static", None, router_weight, w1, w2, x, 0, 1)()
    del w1, w2
    x_leaf = x.detach().requires_grad_(True)

    def step():
        forward(x_leaf).backward(grad_out)

    step()  # the first micro-batch: .grad made
    res = {}
    for fused in (False, True, False, True):
        gt.ACCUMULATE_INTO_GRAD = fused
        res.setdefault(fused, []).append((mean_event_ms(step, 3, 5), peak_above(step)))
    gt.ACCUMULATE_INTO_GRAD = True
    ms = {k: min(v[0] for v in r) for k, r in res.items()}
    peak = {k: max(v[1] for v in r) for k, r in res.items()}
    return {
        "name": "moe fwd+bwd static, a micro-batch after the first (.backward() into set .grad)",
        "shape": f"{key}-T{spec['tokens']}-H{h}-E{E}-K{spec['topk']}-F{f}-{routing}-bf16",
        "ours_ms": round(ms[True], 3), "anchor": "the same layer with grouped_triton.ACCUMULATE_INTO_GRAD False",
        "anchor_ms": round(ms[False], 3), "speedup": round(ms[False] / ms[True], 3),
        "ours_peak_mem_bytes": peak[True], "anchor_peak_mem_bytes": peak[False],
        "rounds": {str(k): v for k, v in res.items()}, "expert_backend": info.get("expert_backend"),
        "notes": "CUDA events over 5 calls after 3, two rounds each in turn (off, on, off, on), the faster "
                 "round; peak above the step's start (weights and gradients already allocated)"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="S2,S1")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    bench_moe.init_distributed()
    rows = []
    for key in args.shapes.split(","):
        spec = bench_moe.SHAPES[key]
        for row in kernel_rows(key, spec) + [layer_row(key, spec)]:
            rows.append(row)
            print(f"{row['name'][:60]:60s} {row['shape'][:40]:40s} ours {row['ours_ms']} ms | {row['anchor_ms']} ms "
                  f"({row['speedup']}x); peak {row['ours_peak_mem_bytes'] / 2**30:.2f} / "
                  f"{row['anchor_peak_mem_bytes'] / 2**30:.2f} GiB", flush=True)
            write_results(os.path.join(args.out, "grad_accumulation.json"), rows)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
