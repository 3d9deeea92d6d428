"""Per-kernel device time of one linear-attention call, ours and optionally fla's, on the GPU.

    python benchmarks/device/profile_linear.py --op gla --shapes gla_b4,qwen [--fla] [--steps 5]

For each shape and mode (fwd, fwd+bwd) prints every CUDA kernel's time per step (torch.profiler,
summed over --steps calls after two warm-up calls), the step's kernel total, and the number of
launches (a kernel launched several times per step: each launch apart, #0 first), so that a
shape's time can be read kernel by kernel (shape keys: linear_attention.SHAPES).
"""

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import linear_attention as bench  # noqa: E402


def kernel_times(step, steps):
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    evts = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
    launches = collections.Counter(e.name for e in evts)
    seen = collections.Counter()
    for evt in evts:
        # a kernel launched n times per step is reported per launch, in launch order (name #i)
        n = launches[evt.name] // steps
        name = evt.name if len(evt.name) < 60 else evt.name[:57] + "..."
        if n > 1:
            name = f"{name} #{seen[evt.name] % n}"
        seen[evt.name] += 1
        per[name][0] += evt.device_time / 1000 / steps
        per[name][1] += 1
    return per


def report(label, per, steps):
    total = sum(ms for ms, _ in per.values())
    print(f"== {label}: kernel total {total:.4f} ms per step", flush=True)
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        print(f"   {ms:8.4f} ms  x{n // steps:<3d} {name}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="gla")
    ap.add_argument("--shapes", default="gla_b4,qwen")
    ap.add_argument("--fla", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    for key in args.shapes.split(","):
        name, x, cu, do = bench.case(args.op, key)
        inputs = list(x.values())
        fns = [("ours", bench.ours_fn(args.op, cu), x, inputs)]
        if args.fla:
            fx, _ = bench.fla_inputs(args.op, x)
            fns.append(("fla", bench.fla_fn(args.op, cu), fx, list(fx.values())))
        for who, fn, xx, ins in fns:
            def fwd():
                with torch.no_grad():
                    fn(xx)

            def fwd_bwd():
                torch.autograd.grad(fn(xx), ins, do)

            for mode, step in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                report(f"{who} {args.op} {mode} {name}", kernel_times(step, args.steps), args.steps)


if __name__ == "__main__":
    main()
