"""Probe: the grouped GEMM's input gradient and weight gradient in one kernel, at issue 5's
second shape (128 rows per expert), against torch._grouped_mm's pair and ours (Triton dx +
torch wgrad, what GroupedMM runs there).

Both backward products of one expert read the same dy rows: dx[rows, k] = sum_n dy[rows, n]
w[e][k, n]^T and dw[e][k, n] = x[rows, k]^T dy[rows, n]. One program per (expert, k tile)
holds the expert's rows in one R-row register tile (so only experts with at most R rows), keeps
dx[rows, k tile] in registers over the n loop, and writes each dw[k, n] tile as it goes: the
weight read (dx) and the weight-gradient write (dw) stream side by side in one kernel instead of
two kernels in turn. A probe, not a library kernel: it cannot take an expert with more than R rows.

    python benchmarks/device/probe_fused_backward.py [--out results.json]
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

from megatron_moe_hybrid.ops.moe import grouped_triton as gt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import write_results  # noqa: E402
from probe_grouped_gemm import PEAK_TBPS, PEAK_TFLOPS, bench, counts_for, rel  # noqa: E402  (beside this file)


@triton.jit
def _fused_bwd_kernel(dy, w, x, dx, dw, bounds, K, M,
                      s_dy, s_we, s_wk, s_wm, s_x, s_dx, s_dwe, s_dwk,
                      R: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BK)
    e = pid // num_k
    kt = pid % num_k
    row0 = tl.load(bounds + e)
    row_end = tl.load(bounds + e + 1)
    rows = (row0 + tl.arange(0, R)).to(tl.int64)
    r_ok = rows < row_end
    rk = (kt * BK + tl.arange(0, BK)).to(tl.int64)
    xt = tl.load(x + rows[None, :] * s_x + rk[:, None], mask=r_ok[None, :], other=0.0)  # [BK, R]
    acc_dx = tl.zeros((R, BK), dtype=tl.float32)
    for n in range(0, tl.cdiv(M, BN)):
        rn = (n * BN + tl.arange(0, BN)).to(tl.int64)
        b_dy = tl.load(dy + rows[:, None] * s_dy + rn[None, :], mask=r_ok[:, None], other=0.0)  # [R, BN]
        b_w = tl.load(w + e.to(tl.int64) * s_we + rk[:, None] * s_wk + rn[None, :] * s_wm)  # [BK, BN]
        acc_dx = tl.dot(b_dy, tl.trans(b_w), acc_dx)  # [R, BN] @ [BN, BK]
        b_dw = tl.dot(xt, b_dy)  # [BK, R] @ [R, BN]
        tl.store(dw + e.to(tl.int64) * s_dwe + rk[:, None] * s_dwk + rn[None, :], b_dw.to(dw.dtype.element_ty))
    tl.store(dx + rows[:, None] * s_dx + rk[None, :], acc_dx.to(dx.dtype.element_ty), mask=r_ok[:, None])


def fused_backward(dy, w, x, bounds, cfg):
    R, BK, BN, warps, stages = cfg
    E, K, M = w.shape
    N = x.shape[0]
    dx = torch.empty(N, K, dtype=x.dtype, device=x.device)
    dw = torch.empty(E, K, M, dtype=x.dtype, device=x.device)
    _fused_bwd_kernel[(E * triton.cdiv(K, BK),)](
        dy, w, x, dx, dw, bounds, K, M,
        dy.stride(0), w.stride(0), w.stride(1), w.stride(2), x.stride(0), dx.stride(0), dw.stride(0), dw.stride(1),
        R=R, BK=BK, BN=BN, num_warps=warps, num_stages=stages,
    )
    return dx, dw


CONFIGS = [(256, 64, 128, 8, 2), (256, 64, 64, 8, 3), (128, 64, 128, 8, 3), (128, 128, 128, 8, 2), (128, 64, 128, 4, 3)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    T, h, E, k, F = 4096, 7168, 256, 8, 2048
    N = T * k
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for routing in ("random top-8 (max 157 rows)", "exactly 128 rows each"):
        counts = counts_for(T, E, k, gen) if routing.startswith("random") else torch.full((E,), N // E, dtype=torch.int32, device="cuda")
        max_rows = int(counts.max())
        bounds = gt.row_bounds(counts)
        offs = bounds[1:].contiguous()
        bf = dict(device="cuda", dtype=torch.bfloat16)
        for form, (K, M) in (("fc1", (h, 2 * F)), ("fc2", (F, h))):
            x = torch.randn(N, K, **bf)
            w = torch.randn(E, K, M, **bf) / K**0.5
            dy = torch.randn(N, M, **bf)
            flops = 2 * 2 * N * K * M
            nbytes = 2 * (2 * E * K * M + 2 * N * K + N * M)  # w read, dw written, x read, dx written, dy read
            floor = max(flops / PEAK_TFLOPS / 1e9, nbytes / PEAK_TBPS / 1e9)
            ref_dx = torch._grouped_mm(dy, w.transpose(1, 2), offs=offs)
            ref_dw = torch._grouped_mm(x.t(), dy, offs=offs)[:8].clone()  # the first experts: keeps memory for ours
            torch.cuda.empty_cache()
            t_torch = bench(lambda: (torch._grouped_mm(dy, w.transpose(1, 2), offs=offs), torch._grouped_mm(x.t(), dy, offs=offs)))
            t_ours = bench(lambda: (gt.grouped_mm(dy, w.transpose(1, 2), bounds), torch._grouped_mm(x.t(), dy, offs=offs)))
            torch.cuda.empty_cache()
            print(f"{routing} {form}: torch pair {t_torch:.3f} ms, ours (triton dx + torch wgrad) {t_ours:.3f} ms, floor {floor:.3f}", flush=True)
            for cfg in CONFIGS:
                if cfg[0] < max_rows:
                    continue
                try:
                    gdx, gdw = fused_backward(dy, w, x, bounds, cfg)
                    err = max(rel(gdx, ref_dx), rel(gdw[:8], ref_dw))
                    del gdx, gdw
                    torch.cuda.empty_cache()
                    ms = bench(lambda: fused_backward(dy, w, x, bounds, cfg))
                except Exception as err_:  # noqa: BLE001
                    print(f"  {cfg} failed: {str(err_)[:200]}", flush=True)
                    continue
                print(f"  fused {cfg}: {ms:.3f} ms ({t_torch / ms:.2f}x torch pair, {t_ours / ms:.2f}x ours) err {err:.1e}", flush=True)
                rows.append(dict(name=f"grouped gemm {form} dx+wgrad fused (probe)", shape=f"S2-N{N}-E{E}-K{K}-M{M}-{routing}",
                                 config=list(cfg), ours_ms=round(ms, 3), anchor="torch._grouped_mm dx then wgrad",
                                 anchor_ms=round(t_torch, 3), speedup=round(t_torch / ms, 3),
                                 ours_unfused_ms=round(t_ours, 3), floor_ms=round(floor, 3), rel_err_vs_anchor=err,
                                 notes="triton.testing.do_bench median; ours_unfused = our Triton dx + torch wgrad "
                                       "(GroupedMM's backward at this shape); floor: the larger of FLOPs at 687 "
                                       "TFLOP/s and bytes at 4.27 TB/s"))
            del x, w, dy, ref_dx, ref_dw
            torch.cuda.empty_cache()
    if a.out:
        write_results(a.out, rows)


if __name__ == "__main__":
    main()
