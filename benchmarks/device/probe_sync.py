"""Where a host sync comes from: one fwd+bwd of ours' MoE layer, as benchmarks/moe.py builds it, under
torch.cuda.set_sync_debug_mode("warn"), printing the Python stack of every warning it raises.

    python benchmarks/device/probe_sync.py [--shape S1] [--routing balanced] [--steps 3]

moe.json's first row of a process used to report one host sync per layer (the rows after it none):
this showed that the one warning was torch's once-per-process notice that the mode is a prototype,
which moe.py's counter then matched. Each step prints its real syncs (moe.SYNC_WARNING) apart from
such notices.
"""

import argparse
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moe as bench  # noqa: E402  (benchmarks/moe.py)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="S1")
    p.add_argument("--routing", default="balanced")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    spec = bench.SHAPES[a.shape]
    router_weight, x, grad_out, w1, w2 = bench.case_tensors(spec, a.routing, 1.1, 0, 0, spec["experts"])
    forward, params, info, _ = bench.build_ours(spec, "static", None, router_weight, w1, w2, x, 2, 2)()
    x_leaf = x.detach().requires_grad_(True)
    leaves = [x_leaf, *params]

    def step():
        torch.autograd.grad(forward(x_leaf), leaves, grad_out)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    shown = []  # every warning that speaks of synchronizing: real syncs and torch's notices alike

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            shown.append(message)
            print(f"--- {message}")
            traceback.print_stack(limit=14)

    for i in range(a.steps):
        before = len(shown)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        step_warnings = shown[before:]
        syncs = sum(bench.SYNC_WARNING in str(m) for m in step_warnings)
        print(f"step {i}: {syncs} synchronizing call(s), {len(step_warnings) - syncs} other sync-debug "
              f"warning(s); experts: {info.get('expert_backend')}", flush=True)
    print(f"count_host_syncs as moe.py counts it: {bench.count_host_syncs(step)}")


if __name__ == "__main__":
    main()
