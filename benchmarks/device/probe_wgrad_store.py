"""Where the grouped weight gradient's time goes at issue 5's second shape (128 rows per expert):
it writes an [E, K, M] bf16 gradient from a K-deep reduction of only ~128 rows, so the store is
the work. This probe times, for fc1 and fc2's weight gradient:

- the write ceiling: dw.fill_ and a Triton kernel that only stores the same tiles;
- torch._grouped_mm's weight gradient (what GroupedMM's auto runs) and ours as it is;
- ours with the tile store changed: a streaming store (.cs), evict_first, or a TMA store from
  shared memory (tensor descriptor over dw viewed as [E * K, M]; async, so the next column
  tile's loads and products overlap it within the program's flattened loop).

Every variant's gradient is checked against torch's first.

    python benchmarks/device/probe_wgrad_store.py [--shapes S2] [--out rows.json]
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_moe_hybrid.ops.moe import grouped_triton as gt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_grouped_gemm import PEAK_TBPS, bench, routed, shape_of  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import write_results  # noqa: E402

def rel(a, b, experts=16):
    """The relative error over the first experts' gradients (a full fp32 copy of fc1's is 60 GB)."""
    a, b = a[:experts].float(), b[:experts].float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


STORES = {"plain": 0, "cs": 1, "evict_first": 2, "tma": 3}


@triton.jit
def _wgrad(x, dy, dw, dw_desc, bounds, K, M, sxm, sxk, sdm, sdn, swe, swk, swm,
           BK: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, NT: tl.constexpr, STORE: tl.constexpr,
           STORE_ONLY: tl.constexpr):
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BK)
    num_n = tl.cdiv(M, BN)
    n_groups = tl.cdiv(num_n, NT)
    e = pid // (num_k * n_groups)
    local = pid % (num_k * n_groups)
    kt = local // n_groups
    n0 = (local % n_groups) * NT
    row0 = tl.load(bounds + e)
    row_end = tl.load(bounds + e + 1)
    chunks = tl.maximum(tl.cdiv(row_end - row0, BR), 1)
    if STORE_ONLY:
        chunks = 1
    steps = (tl.minimum(n0 + NT, num_n) - n0) * chunks
    rk = (kt * BK + tl.arange(0, BK)).to(tl.int64)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for i in range(0, steps):
        n = n0 + i // chunks
        c = i % chunks
        rn = (n * BN + tl.arange(0, BN)).to(tl.int64)
        if not STORE_ONLY:
            rr = (row0 + c * BR + tl.arange(0, BR)).to(tl.int64)
            r_ok = rr < row_end
            a = tl.load(x + rr[None, :] * sxm + rk[:, None] * sxk, mask=r_ok[None, :] & (rk[:, None] < K), other=0.0)
            b = tl.load(dy + rr[:, None] * sdm + rn[None, :] * sdn, mask=r_ok[:, None] & (rn[None, :] < M), other=0.0)
            acc = tl.dot(a, b, acc)
        else:
            acc += 1.0
        if c == chunks - 1:
            val = acc.to(dw.dtype.element_ty)
            if STORE == 3:
                dw_desc.store([e * K + kt * BK, n * BN], val)
            else:
                o_ptr = dw + e.to(tl.int64) * swe + rk[:, None] * swk + rn[None, :] * swm
                o_ok = (rk[:, None] < K) & (rn[None, :] < M)
                if STORE == 1:
                    tl.store(o_ptr, val, mask=o_ok, cache_modifier=".cs")
                elif STORE == 2:
                    tl.store(o_ptr, val, mask=o_ok, eviction_policy="evict_first")
                else:
                    tl.store(o_ptr, val, mask=o_ok)
            acc = tl.zeros((BK, BN), dtype=tl.float32)


def wgrad(x, dy, bounds, config, store, store_only=False, dw=None):
    BK, BN, BR, warps, stages, nt = config
    E = bounds.shape[0] - 1
    K, M = x.shape[1], dy.shape[1]
    if dw is None:
        dw = torch.empty(E, K, M, dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor(dw.view(E * K, M), [BK, BN])
    if STORES[store] == 3:
        assert K % BK == 0 and M % BN == 0, "the TMA store variant needs whole tiles"
    grid = (E * triton.cdiv(K, BK) * triton.cdiv(triton.cdiv(M, BN), nt),)
    return _wgrad[grid](x, dy, dw, desc, bounds, K, M, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
                 dw.stride(0), dw.stride(1), dw.stride(2), BK=BK, BN=BN, BR=BR, NT=nt, STORE=STORES[store],
                 STORE_ONLY=store_only, num_warps=warps, num_stages=stages), dw


CONFIGS = [(128, 256, 64, 8, 3, 4), (128, 256, 64, 8, 3, 8), (128, 128, 64, 4, 3, 8), (128, 128, 64, 8, 3, 8)]
# fewer stages / smaller tiles: less shared memory per program, so two or three share an SM and
# one's products can run while another stores (--occupancy)
OCCUPANCY_CONFIGS = [(128, 128, 64, 4, 2, 8), (128, 128, 64, 4, 2, 16), (64, 256, 64, 4, 2, 8), (128, 64, 64, 4, 2, 8),
                     (64, 128, 64, 4, 2, 8), (128, 256, 64, 8, 2, 8), (128, 128, 32, 4, 3, 8), (64, 128, 32, 4, 3, 8)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="S2")
    p.add_argument("--out", default=None)
    p.add_argument("--occupancy", action="store_true", help="the plain store at OCCUPANCY_CONFIGS only")
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        T, h, E, k, F, counts, N, bounds, offs = routed(name, gen)
        bf = dict(device="cuda", dtype=torch.bfloat16)
        for form, (xa, dya) in {"fc1": ((N, h), (N, 2 * F)), "fc2": ((N, F), (N, h))}.items():
            x = torch.randn(*xa, **bf)
            dy = torch.randn(*dya, **bf)
            K, M = x.shape[1], dy.shape[1]
            gbytes = E * K * M * 2 / 1e9
            floor = (E * K * M * 2 + (N * K + N * M) * 2) / (PEAK_TBPS * 1e9)
            ref = torch._grouped_mm(x.t(), dy, offs=offs)
            dw = torch.empty_like(ref)
            base = dict(shape=f"{shape_of(name)}-{form}-K{K}-M{M}", floor_ms=round(floor, 3),
                        gbytes_written=round(gbytes, 2))

            def add(variant, ms, err=None, config=None):
                row = dict(base, name=f"wgrad {form} {variant}", ms=round(ms, 3), write_TBps=round(gbytes / ms, 2),
                           of_floor=round(floor / ms, 3), rel_err_vs_torch=err, config=config)
                rows.append(row)
                print(f"{name} {form} {variant:34s} {str(config or ''):24s} {ms:7.3f} ms  write {gbytes / ms:5.2f} TB/s"
                      f"  floor/ms {floor / ms:5.3f}  err {err}", flush=True)

            add("fill_ (write ceiling)", bench(lambda: dw.fill_(1.0)))
            if a.occupancy:
                for config in OCCUPANCY_CONFIGS:
                    dw.fill_(float("nan"))
                    kernel, _ = wgrad(x, dy, bounds, config, "plain", dw=dw)
                    err = rel(dw, ref)
                    meta = f"regs {kernel.n_regs} spills {kernel.n_spills} shared {kernel.metadata.shared}"
                    add(f"plain, {meta}", bench(lambda: wgrad(x, dy, bounds, config, "plain", dw=dw)), err, config)
                continue
            add("torch._grouped_mm", bench(lambda: torch._grouped_mm(x.t(), dy, offs=offs)))
            add("ours as committed", bench(lambda: gt.grouped_mm_wgrad(x, dy, bounds)),
                rel(gt.grouped_mm_wgrad(x, dy, bounds), ref), gt.WGRAD_CONFIG)
            for config in CONFIGS:
                for store in STORES:
                    try:
                        dw.fill_(float("nan"))
                        err = rel(wgrad(x, dy, bounds, config, store, dw=dw)[1], ref)
                        add(f"store {store}", bench(lambda: wgrad(x, dy, bounds, config, store, dw=dw)), err, config)
                        add(f"store only, {store}",
                            bench(lambda: wgrad(x, dy, bounds, config, store, store_only=True, dw=dw)), None, config)
                    except Exception as exc:  # a variant that fails to compile is reported, not fatal
                        print(f"{name} {form} store {store} {config}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            del x, dy, ref, dw
            torch.cuda.empty_cache()
    if a.out:
        write_results(a.out, rows)


if __name__ == "__main__":
    main()
