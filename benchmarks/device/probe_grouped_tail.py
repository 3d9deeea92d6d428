"""Two changes to the grouped GEMM's forward / input-gradient kernel, timed against the kernel as
committed and torch._grouped_mm at issue 5's shapes (random top-k routing, so experts hold
about 128 +- 11 rows at the second shape):

- TAIL: an expert's last row tile with at most BM / 2 rows runs a BM / 2-row product instead of
  a BM-row one (at ~128 rows per expert about half the experts have a second tile of a few rows,
  which otherwise costs a whole tile's tensor-core work);
- W_EVICT: the weight tiles are loaded evict_first (each is read once from HBM, the expert's
  rows are reused by every column tile and should stay in L2).

Every variant's output is checked against torch's first.

    python benchmarks/device/probe_grouped_tail.py [--shapes S2,S1] [--out rows.json]
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

from megatron_moe_hybrid.ops.moe import grouped_triton as gt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_grouped_gemm import PEAK_TBPS, PEAK_TFLOPS, bench, expert_tensors, rel, routed, shape_of  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import write_results  # noqa: E402


@triton.jit
def _product(x, w, out, e, rm, row_end, M, K, sxm, sxk, swe, swk, swm, som, som_col, n,
             BMX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, W_EVICT: tl.constexpr):
    rn = (n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK).to(tl.int64)
    row_ok = rm < row_end
    a_ptr = x + rm[:, None] * sxm + rk[None, :] * sxk
    b_ptr = w + e.to(tl.int64) * swe + rk[:, None] * swk + rn[None, :] * swm
    acc = tl.zeros((BMX, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
        if W_EVICT:
            b = tl.load(b_ptr, mask=rn[None, :] < M, other=0.0, eviction_policy="evict_first")
        else:
            b = tl.load(b_ptr, mask=rn[None, :] < M, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptr += BK * sxk
        b_ptr += BK * swk
    o_ptr = out + rm[:, None] * som + rn[None, :] * som_col
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & (rn[None, :] < M))


@triton.jit
def _mm(x, w, out, bounds, tile_bounds, E, M, K, sxm, sxk, swe, swk, swm, som, som_col,
        LOG_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        TAIL: tl.constexpr, W_EVICT: tl.constexpr):
    # as grouped_triton._grouped_mm_kernel (K a multiple of BK), plus TAIL and W_EVICT
    pid = tl.program_id(0)
    num_n = tl.cdiv(M, BN)
    t = pid // num_n
    if t >= tl.load(tile_bounds + E):
        return
    e = gt._find_expert(tile_bounds, t, E, LOG_E)
    tile0 = tl.load(tile_bounds + e)
    tiles_e = tl.load(tile_bounds + e + 1) - tile0
    local = pid - tile0 * num_n
    n = local // tiles_e
    j = local % tiles_e
    row0 = tl.load(bounds + e)
    row_end = tl.load(bounds + e + 1)
    first = row0 + j * BM
    # (each branch names its own rows: a variable may not change shape across an if)
    if TAIL:
        if row_end - first <= BM // 2:
            _product(x, w, out, e, (first + tl.arange(0, BM // 2)).to(tl.int64), row_end, M, K, sxm, sxk, swe, swk,
                     swm, som, som_col, n, BM // 2, BN, BK, W_EVICT)
        else:
            _product(x, w, out, e, (first + tl.arange(0, BM)).to(tl.int64), row_end, M, K, sxm, sxk, swe, swk, swm,
                     som, som_col, n, BM, BN, BK, W_EVICT)
    else:
        _product(x, w, out, e, (first + tl.arange(0, BM)).to(tl.int64), row_end, M, K, sxm, sxk, swe, swk, swm,
                 som, som_col, n, BM, BN, BK, W_EVICT)


def mm(x, w, bounds, tail, w_evict, config=gt.FWD_CONFIG, out=None):
    BM, BN, BK, warps, stages = config
    E = w.shape[0]
    N, K = x.shape
    M = w.shape[2]
    assert K % BK == 0
    if out is None:
        out = torch.empty(N, M, dtype=x.dtype, device=x.device)
    tiles = gt.row_tile_bounds(bounds, BM)
    grid = ((triton.cdiv(N, BM) + E) * triton.cdiv(M, BN),)
    _mm[grid](x, w, out, bounds, tiles, E, M, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
              out.stride(0), out.stride(1), LOG_E=max(1, (E - 1).bit_length()), BM=BM, BN=BN, BK=BK,
              TAIL=tail, W_EVICT=w_evict, num_warps=warps, num_stages=stages)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="S2,S1")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        T, h, E, k, F, counts, N, bounds, offs = routed(name, gen)
        bm = gt.FWD_CONFIG[0]
        tiles = int(((counts + bm - 1) // bm).sum())
        tail_tiles = int(((counts % bm > 0) & (counts % bm <= bm // 2)).sum())
        print(f"{name}: rows per expert {counts.float().mean():.1f} (min {int(counts.min())}, max {int(counts.max())}); "
              f"{tiles} row tiles of {bm}, {tail_tiles} of them last tiles of <= {bm // 2} rows", flush=True)
        x, w1, act, w2, dy1, dy2 = expert_tensors(N, h, E, F)
        forms = {
            "fc1 fwd": (x, w1), "fc2 fwd": (act, w2),
            "fc1 dx": (dy1, w1.transpose(1, 2)), "fc2 dx": (dy2, w2.transpose(1, 2)),
        }
        for form, (xa, wa) in forms.items():
            K, M = wa.shape[1], wa.shape[2]
            flops = 2 * N * K * M
            floor = max(flops / PEAK_TFLOPS / 1e9, 2 * (N * K + E * K * M + N * M) / (PEAK_TBPS * 1e9))
            ref = torch._grouped_mm(xa, wa, offs=offs)
            base = dict(shape=f"{shape_of(name)}-{form}", floor_ms=round(floor, 3), config=list(gt.FWD_CONFIG))

            def add(variant, ms, err=None):
                rows.append(dict(base, name=f"{form} {variant}", ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                                 of_floor=round(floor / ms, 3), rel_err_vs_torch=err))
                print(f"{name} {form:8s} {variant:28s} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  "
                      f"floor/ms {floor / ms:5.3f}  err {err}", flush=True)

            add("torch._grouped_mm", bench(lambda: torch._grouped_mm(xa, wa, offs=offs)))
            add("ours as committed", bench(lambda: gt.grouped_mm(xa, wa, bounds)), rel(gt.grouped_mm(xa, wa, bounds), ref))
            for tail in (False, True):
                for w_evict in (False, True):
                    out = torch.full_like(ref, float("nan"))
                    try:
                        err = rel(mm(xa, wa, bounds, tail, w_evict, out=out), ref)
                        add(f"tail {int(tail)} w_evict {int(w_evict)}",
                            bench(lambda: mm(xa, wa, bounds, tail, w_evict, out=out)), err)
                    except Exception as exc:
                        print(f"{name} {form} tail {tail} w_evict {w_evict}: {type(exc).__name__}: {str(exc)[:300]}",
                              flush=True)
            if a.out:
                write_results(a.out, rows)
        del x, w1, act, w2, dy1, dy2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
