"""The sparse attention backward in the kernels form (triton_sparse._bwd_dq_kernel and
_bwd_dkv_kernel) at absorbed MLA's per-rank head counts under tensor parallelism (32 heads at
TP 4, 16 at TP 8, where auto runs the kernels form's backward below PRODUCTS_MIN_HEADS), over
launch configs, one kernel at a time (the other at its default), against the products form;
each run's gradients are checked against the products form's.

    cd benchmarks && python device/probe_sparse_bwd_configs.py [--shape mla-h16] [--out rows.json]
"""

import argparse
import os
import sys

import torch
import triton

from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.sparse_attention import triton_sparse as ts

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import write_results  # noqa: E402
from sparse_attention import SHAPES, causal_indices  # noqa: E402

CONFIGS = {  # kernel -> (BH, BK, warps, stages); the first of each is the default as of 2026-12-05
    "dq": [(16, 64, 8, 2), (16, 64, 4, 2), (16, 128, 4, 2), (16, 128, 8, 2), (32, 64, 8, 2), (32, 64, 4, 2)],
    "dkv": [(16, 32, 8, 2), (16, 64, 8, 2), (16, 64, 4, 2), (16, 128, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2)],
}


# 128 heads on one latent (auto runs the products backward there). H100, 2026-12-05
# (results/h100/sparse_bwd_configs_mla128.json): every one 1.9-2.2x slower than the products backward.
CONFIGS_MLA = {
    "dq": [(16, 64, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 8, 1)],
    "dkv": [(16, 32, 8, 2), (32, 32, 8, 2), (64, 32, 8, 2), (64, 16, 8, 2), (32, 16, 8, 2)],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="mla-h16")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    shape, B, T, S, H, G, D, DV, K, shared = SHAPES[a.shape]
    assert shared
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16().requires_grad_()
    kv = torch.randn(B, S, G, D, generator=gen, device="cuda").bfloat16().requires_grad_()
    do = torch.randn(B, T, H, DV, generator=gen, device="cuda").bfloat16()
    indices = causal_indices(B, T, S, K, "cuda")
    slots = (indices >= 0).sum().item() / (B * T)
    bwd_flops = 2 * B * T * H * slots * (2 * D + 2 * DV + D)  # dp, dq, dk, dv and the recomputed s
    rows = []

    def fwd_bwd():
        q.grad = kv.grad = None
        o = sa.sparse_attention(q, kv, kv[..., :DV], indices, backend="triton")[0]
        o.backward(do)
        return q.grad, kv.grad

    def add(name, ms, err=None, fwd_ms=None):
        bwd = ms - fwd_ms
        rows.append(dict(name=f"sparse attention fwd+bwd, {name}", shape=shape, ms=round(ms, 3), fwd_ms=round(fwd_ms, 3),
                         bwd_tflops=round(bwd_flops / bwd / 1e9, 1), rel_rms_grads_vs_products=err))
        print(f"{name:44s} fwd+bwd {ms:8.3f} ms  bwd {bwd:7.3f} ms {bwd_flops / bwd / 1e9:6.1f} TFLOP/s  err {err}",
              flush=True)
        if a.out:
            write_results(a.out, rows)

    def fwd():
        with torch.no_grad():
            return sa.sparse_attention(q, kv, kv[..., :DV], indices, backend="triton")[0]

    fwd_ms = triton.testing.do_bench(fwd, warmup=25, rep=200, return_mode="median")
    ts.BACKWARD_FORM = "products"
    ref = [g.float().clone() for g in fwd_bwd()]
    add("products backward", triton.testing.do_bench(fwd_bwd, warmup=25, rep=200, return_mode="median"), None, fwd_ms)
    ts.BACKWARD_FORM = "kernels"
    for kernel, configs in (CONFIGS_MLA if H // G > 32 else CONFIGS).items():
        for bh, bk, warps, stages in configs:
            ts.CONFIG_OVERRIDE.clear()
            ts.CONFIG_OVERRIDE[kernel] = {"BH": bh, "BK": bk, "num_warps": warps, "num_stages": stages}
            try:
                got = fwd_bwd()
                err = [round(((g.float() - r).norm() / r.norm()).item(), 5) for g, r in zip(got, ref)]
                add(f"kernels, {kernel} BH {bh} BK {bk} warps {warps} stages {stages}",
                    triton.testing.do_bench(fwd_bwd, warmup=25, rep=200, return_mode="median"), err, fwd_ms)
            except Exception as exc:  # a config that does not compile or fit is reported
                print(f"{kernel} {bh} {bk} {warps} {stages}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    ts.CONFIG_OVERRIDE.clear()
    ts.BACKWARD_FORM = "auto"


if __name__ == "__main__":
    main()
