"""Host cost of a kernel launch on the GPU machine: an ATen op, a trivial Triton kernel, and our
Triton ops (fused router, row gather, SwiGLU), each issued N times without a sync (host us per
call) and with a sync at the end (wall us per call); then the profiler's CPU table of one fused
router forward+backward.

    python benchmarks/device/probe_launch.py [--out DIR]
"""

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _trivial(x, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs, mask=offs < n) + 1, mask=offs < n)


def per_call(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return dict(host_us=round((t1 - t0) / n * 1e6, 2), wall_us=round((t2 - t0) / n * 1e6, 2))


def cprofile_top(fn, calls, title, rows=30, sort_by="tottime"):
    """cProfile's top functions over `calls` calls of fn (issued back to back, one sync after),
    as text headed by title."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(sort_by).print_stats(rows)
    return f"cProfile {title}: {calls} calls\n{text.getvalue()}"


def profile_table(step, iters, sort_by, rows):
    """The profiler's CPU + CUDA table of `iters` calls of step, and the profile."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows), prof


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    from megatron_moe_hybrid.ops.moe.gather import gather_sum
    from megatron_moe_hybrid.ops.moe.swiglu import swiglu
    from megatron_moe_hybrid.ops.moe.topk import _router_fwd_kernel, fused_router_topk

    x = torch.zeros(1024, device="cuda")
    logits = torch.randn(16384, 64, device="cuda")
    src = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 4096, (4096, 1), device="cuda")
    h1 = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    scores = torch.empty(16384, 64, device="cuda")
    probs = torch.empty(16384, 8, device="cuda")
    tk = torch.empty(16384, 8, device="cuda", dtype=torch.int64)
    rows = {}
    rows["aten x.add_(1)"] = per_call(lambda: x.add_(1))
    rows["aten torch.empty(16384, 8)"] = per_call(lambda: torch.empty(16384, 8, device="cuda"))
    rows["triton trivial kernel[grid](x, n, BLOCK=)"] = per_call(lambda: _trivial[(1,)](x, 1024, BLOCK=1024))
    rows["triton router fwd kernel launch only"] = per_call(lambda: _router_fwd_kernel[(1024,)](
        logits, scores, scores, probs, tk, scores, scores, scores, scores, 16384, 64, 1.0, 1, K=8, BK=8, BT=64, BE=64,
        SOFTMAX=True, HAS_BIAS=False, NORM=False, HAS_VALID=False, STATS=False, num_warps=4))
    with torch.no_grad():
        rows["fused_router_topk no grad"] = per_call(lambda: fused_router_topk(logits, 8))
        rows["torch softmax+sort+gather no grad"] = per_call(
            lambda: logits.softmax(-1).sort(dim=-1, descending=True, stable=True)[1][:, :8])
        rows["gather_sum (triton)"] = per_call(lambda: gather_sum(src, idx))
        rows["swiglu (triton)"] = per_call(lambda: swiglu(h1))
    lg = logits.clone().requires_grad_(True)
    g = torch.randn(16384, 8, device="cuda")

    def fused_step():
        p, _, _ = fused_router_topk(lg, 8)
        p.backward(g)

    rows["fused_router_topk fwd+bwd"] = per_call(fused_step, 500)
    for name, r in rows.items():
        print(f"{name:48s} host {r['host_us']:8.2f} us  wall {r['wall_us']:8.2f} us", flush=True)

    table, _ = profile_table(fused_step, 20, "cpu_time_total", 30)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_launch.json"), "w") as f:
        json.dump(dict(triton=triton.__version__, torch=torch.__version__, rows=rows), f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "probe_launch_profile.txt"), "w") as f:
        f.write(table)
    layer_profile(args.out)


def layer_profile(out):
    """The S1 MoE layer (static dispatcher) forward+backward: wall, and the profiler's CPU table."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from moe import SHAPES, ours_config

    from megatron_moe_hybrid.layers.moe import MoELayer

    spec = SHAPES["S1"]
    with torch.device("cuda"):
        layer = MoELayer(ours_config(spec, "static", 1))
    layer.cuda()
    t, h = 16384, spec["hidden"]
    x = torch.randn(t, 1, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(t, 1, h, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(x)[0].backward(g)

    for backend in ("torch", "auto"):
        layer.router.backend = backend
        r = per_call(step, 30)
        print(f"S1 layer fwd+bwd router {backend:5s}: host {r['host_us']:.1f} us wall {r['wall_us']:.1f} us per step")
    table, prof = profile_table(step, 5, "self_cpu_time_total", 45)
    print(table)
    with open(os.path.join(out, "probe_layer_profile.txt"), "w") as f:
        f.write(table)
    prof.export_chrome_trace(os.path.join(out, "layer_trace.json"))


if __name__ == "__main__":
    main()
