"""Where the linear + cross-entropy time goes on one GPU: each step of one token chunk, alone.

    cd benchmarks && python device/loss_probe.py [--out results/h200/loss_parts.json]

At N 16384, D 4096, V 151936 (bf16) and chunks of 256 / 512 / 1024 tokens, CUDA-event medians of:
logits = h_c W^T, grad_hidden = g W, grad_weight += g^T h_c (cuBLAS addmm_, the [V, D]
read-modify-write), the two gradient products on two streams at once (as triton.py runs
them), and our two Triton row passes. Each row's anchor is the bf16 8192^3 matmul (the
TFLOP/s ceiling); "speedup" is then ours' TFLOP/s over the ceiling's. The grad_weight rows
at 512 and 1024 tokens also time a Triton kernel of the same product that loads the old
tile before its K loop (so the read could overlap the compute), against cuBLAS.
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import time_and_peak, write_results  # noqa: E402

from megatron_moe_hybrid.ops.cross_entropy.triton import BLOCK_V, _grad_logits_kernel, _partial_stats, _splits  # noqa: E402

N, D, V = 16384, 4096, 151936


@triton.jit
def _grad_weight_kernel(g_ptr, h_ptr, w_ptr, C, V, D, stride_g, stride_h, stride_w,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                        OLD_FIRST: tl.constexpr):
    """w[V, D] += g[C, V]^T h[C, D], the old w tile loaded before the K loop (OLD_FIRST) or after it."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(V, BM), tl.cdiv(D, BN)
    width = GROUP * num_n
    first_m = (pid // width) * GROUP
    size = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % size
    pid_n = (pid % width) // size
    o_m = pid_m * BM + tl.arange(0, BM)
    o_n = pid_n * BN + tl.arange(0, BN)
    mask = (o_m[:, None] < V) & (o_n[None, :] < D)
    p_w = w_ptr + o_m[:, None].to(tl.int64) * stride_w + o_n[None, :]
    if OLD_FIRST:
        b_old = tl.load(p_w, mask=mask, other=0.0)
    b_acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, C, BK):
        o_k = k + tl.arange(0, BK)
        b_g = tl.load(g_ptr + o_k[:, None].to(tl.int64) * stride_g + o_m[None, :],
                      mask=(o_k[:, None] < C) & (o_m[None, :] < V), other=0.0)
        b_h = tl.load(h_ptr + o_k[:, None].to(tl.int64) * stride_h + o_n[None, :],
                      mask=(o_k[:, None] < C) & (o_n[None, :] < D), other=0.0)
        b_acc = tl.dot(tl.trans(b_g), b_h, b_acc)
    if not OLD_FIRST:
        b_old = tl.load(p_w, mask=mask, other=0.0)
    tl.store(p_w, (b_acc + b_old.to(tl.float32)).to(w_ptr.dtype.element_ty), mask=mask)


def triton_grad_weight(g, h, w, BM=128, BN=256, BK=64, num_warps=8, num_stages=3, old_first=True):
    grid = (triton.cdiv(w.shape[0], BM) * triton.cdiv(w.shape[1], BN),)
    _grad_weight_kernel[grid](g, h, w, g.shape[0], w.shape[0], w.shape[1], g.stride(0), h.stride(0), w.stride(0),
                              BM=BM, BN=BN, BK=BK, GROUP=8, OLD_FIRST=old_first, num_warps=num_warps,
                              num_stages=num_stages)


def median_ms(fn, reps=20, warmup=3):
    return time_and_peak(fn, warmup, reps)[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/h200/loss_parts.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ceiling_ms = median_ms(lambda: square @ square)
    ceiling_tflops = 2 * 8192**3 / ceiling_ms / 1e9
    square = None  # free it
    h = (torch.randn(N, D, device="cuda") / 2).bfloat16()  # [N, D]
    w = (torch.randn(V, D, device="cuda") / D**0.5).bfloat16()  # [V, D]
    grad_w, grad_h = torch.zeros_like(w), torch.empty_like(h)
    labels = torch.randint(0, V, (N,), device="cuda")
    side = torch.cuda.Stream()
    rows = []

    def row(step, chunk, ms, flops, **extra):
        tflops = flops / ms / 1e9 if flops else None
        rows.append({
            "name": f"linear+CE chunk step: {step}", "shape": f"N{N}-D{D}-V{V}-C{chunk}-bf16",
            "ours_ms": round(ms, 4), "anchor": "bf16 8192^3 matmul (TFLOP/s ceiling)", "anchor_ms": round(ceiling_ms, 4),
            "speedup": tflops and round(tflops / ceiling_tflops, 3), "tflops": tflops and round(tflops, 1),
            "anchor_tflops": round(ceiling_tflops, 1),
            "notes": "median of 20 CUDA-event timings after 3; speedup = ours' TFLOP/s over the ceiling's", **extra,
        })
        print(rows[-1]["name"], rows[-1]["shape"], rows[-1]["ours_ms"], "ms", rows[-1]["tflops"], "TFLOP/s", flush=True)

    for chunk in (256, 512, 1024):
        flops = 2 * chunk * V * D
        g = torch.empty(chunk, V, device="cuda", dtype=torch.bfloat16)  # [C, V]
        h_c, local = h[:chunk], labels[:chunk].contiguous()
        row("logits (cuBLAS mm)", chunk, median_ms(lambda: torch.mm(h_c, w.T, out=g)), flops)
        row("grad_hidden (cuBLAS mm)", chunk, median_ms(lambda: torch.mm(g, w, out=grad_h[:chunk])), flops)
        cublas = median_ms(lambda: grad_w.addmm_(g.T, h_c))
        extra = {}
        if chunk >= 512:
            mine = median_ms(lambda: triton_grad_weight(g, h_c, grad_w))
            extra = {"triton_prefetch_ms": round(mine, 4), "triton_prefetch_tflops": round(flops / mine / 1e9, 1),
                     "triton_config": "BM 128, BN 256, BK 64, 8 warps, 3 stages"}
        row("grad_weight (cuBLAS addmm_)", chunk, cublas, flops, **extra)

        def both():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                grad_w.addmm_(g.T, h_c)
            torch.mm(g, w, out=grad_h[:chunk])
            main.wait_stream(side)

        row("grad_hidden || grad_weight (two streams)", chunk, median_ms(both), 2 * flops)
        row("row stats pass (Triton, S column ranges per row)", chunk, median_ms(lambda: _partial_stats(g, local)), 0,
            splits=_splits(chunk, V)[0])
        lse, ones = torch.zeros(chunk, device="cuda"), torch.ones(chunk, device="cuda")
        num_splits, cols_per_split = _splits(chunk, V)

        def grad_pass():
            _grad_logits_kernel[(chunk, num_splits)](g, local, lse, ones, g.stride(0), V, cols_per_split, 0.0, 0.0, 1.0 / V,
                                                     BLOCK_V=BLOCK_V, HAS_SMOOTHING=False, FAST_EXP=True, num_warps=4)

        row("gradient pass (Triton, in place)", chunk, median_ms(grad_pass), 0)
        g = None  # free the chunk before the next size
        write_results(args.out, rows)


if __name__ == "__main__":
    main()
