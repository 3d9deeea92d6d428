"""Where a host sync comes from: one fwd+bwd of ours' MoE layer, as benchmarks/moe.py builds it, under
torch.cuda.set_sync_debug_mode("warn"), printing the Python stack of every synchronizing call.

    python benchmarks/device/probe_sync.py [--shape S1] [--routing balanced] [--steps 3]

moe.json's first row of a shape reported one host sync per layer (the rows after it none); this
shows which call it is and whether it recurs after the first counted step.
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
    h, E, k, F, T = (spec[key] for key in ("hidden", "experts", "topk", "ffn", "tokens"))
    shared = torch.Generator(device="cuda").manual_seed(0)
    local = torch.Generator(device="cuda").manual_seed(1)
    router_weight = bench.make_router_weight(E, h, a.routing, 1.1, shared, "cuda")
    x = bench.make_input(T, h, a.routing, local, "cuda")
    grad_out = torch.randn(T, h, generator=local, device="cuda").bfloat16()
    bf16 = {"generator": local, "device": "cuda", "dtype": torch.bfloat16}
    w1 = torch.randn(E, h, 2 * F, **bf16) / h**0.5
    w2 = torch.randn(E, F, h, **bf16) / F**0.5
    forward, params, info, _ = bench.build_ours(spec, "static", None, router_weight, w1, w2, x, 2, 2)()
    x_leaf = x.detach().requires_grad_(True)
    leaves = [x_leaf, *params]

    def step():
        torch.autograd.grad(forward(x_leaf), leaves, grad_out)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    shown = []

    def show(message, category, filename, lineno, file=None, line=None):
        if bench.SYNC_WARNING in str(message) or "synchroniz" in str(message):
            shown.append(str(message))
            print(f"--- sync: {message}")
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
        print(f"step {i}: {len(shown) - before} synchronizing call(s); experts: {info.get('expert_backend')}", flush=True)
    print(f"count_host_syncs as moe.py counts it: {bench.count_host_syncs(step)}")


if __name__ == "__main__":
    main()
