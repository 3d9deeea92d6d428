"""Probe: host time against device time of our chunked linear attention on the H200, where the
kernels are short (the TP=8 shape, B1-T8192-HQK2-HV4).

    python benchmarks/device/probe_host.py [--cases gla:tp8,gdn:tp8,gla:gla_b4] [--out results.json]

Per case and launch path (ops/_launch.py's cached launches, then Triton's own: fast off and
on in one process), forward+backward (autograd.grad of a fresh forward):
  - do_bench: benchmarks/linear_attention.py's measure (do_bench median, L2 flushed);
  - host: time per call of 30 calls issued back to back without a sync (the CPU's cost of one
    call, as long as the GPU keeps up; probe_launch.per_call);
  - device: the sum of the CUDA kernel times per call (torch.profiler over 10 calls), and each
    kernel's mean; measure's "fwd+bwd graph" (one CUDA graph replayed) is the same without
    the gaps between kernels.
--cprofile prints cProfile's top functions (own time) over 50 forward+backward calls per case.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402
from megatron_moe_hybrid.ops import _launch  # noqa: E402
from probe_launch import cprofile_top, per_call  # noqa: E402


def host_ms(f, calls=30):
    """Host ms per call of f issued back to back (probe_launch.per_call)."""
    return per_call(f, calls)["host_us"] / 1e3


def kernel_ms(f, calls=10):
    from torch.profiler import ProfilerActivity, profile

    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        # self time: an op's device total also counts the kernels under it (the autograd Function's)
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t and e.key:
            per[e.key] = (t / 1e3 / calls, e.count // calls)
    cpu_top = sorted(((e.self_cpu_time_total / 1e3 / calls, e.key, e.count // calls) for e in prof.key_averages()),
                     reverse=True)[:15]
    return per, cpu_top


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="gla:tp8,gdn:tp8,gla:gla_b4")
    p.add_argument("--out", default=None)
    p.add_argument("--cprofile", action="store_true")
    a = p.parse_args()
    rows = []
    for case in a.cases.split(","):
        op, key = case.split(":")
        name, x, cu, do = bench.case(op, key)
        fn = bench.ours_fn(op, cu)
        inputs = list(x.values())

        def fwd_bwd():
            torch.autograd.grad(fn(x), inputs, do)

        def fwd():
            with torch.no_grad():
                fn(x)

        row = dict(op=op, shape=name)
        for fast in (True, False, True):  # fast again last: its second reading shows the drift
            _launch.ENABLED = fast
            ms, _, _ = bench.measure(fn, x, do)
            path = "fast" if fast else "triton"
            row.setdefault(f"do_bench_ms_{path}", []).append(ms)
            row.setdefault(f"host_issue_ms_{path}", []).append(host_ms(fwd_bwd))
            row.setdefault(f"fwd_host_issue_ms_{path}", []).append(host_ms(fwd))
        _launch.ENABLED = True
        per, cpu_top = kernel_ms(fwd_bwd)
        row["kernels_ms"] = {k: round(v[0], 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])}
        row["kernel_calls"] = {k: v[1] for k, v in per.items()}
        row["kernels_sum_ms"] = round(sum(v[0] for v in per.values()), 4)
        row["cpu_self_top_ms"] = [(round(t, 4), k, n) for t, k, n in cpu_top]
        print(json.dumps(row), flush=True)
        if a.cprofile:
            print(cprofile_top(fwd_bwd, 50, f"{op} {name}, forward+backward"), flush=True)
        rows.append(row)
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
