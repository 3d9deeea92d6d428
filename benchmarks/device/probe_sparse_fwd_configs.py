"""The sparse attention forward kernel (triton_sparse._fwd_kernel) at absorbed MLA's shape
(128 heads on one 576-wide latent, 2048 slots per query) over launch configs with more slots per
step than the default's 16, against the products form auto runs there; each config's output is
checked against the products form's, with its registers, spills and shared memory.

    cd benchmarks && python device/probe_sparse_fwd_configs.py [--shape mla|mla-h32|mla-h16|mla128k] [--target]
        [--out rows.json]
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

CONFIGS = [  # (BH, BK, warps, stages); the first is the default as of 2026-12-05
    (64, 16, 8, 2), (64, 16, 8, 3), (64, 32, 8, 2), (64, 32, 8, 1), (64, 32, 4, 2), (64, 64, 8, 1), (64, 64, 8, 2),
    (32, 64, 8, 2), (32, 64, 4, 2),
]
CONFIGS_H32 = [(32, 16, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2), (32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 2),
               (64, 64, 8, 2)]
CONFIGS_GQA = [(16, 64, 4, 2), (16, 64, 4, 3), (16, 128, 4, 2), (16, 128, 8, 2), (16, 32, 4, 3), (16, 64, 8, 2),
               (16, 256, 8, 2)]  # d 128: the GQA shapes, 16 heads per kv group
CONFIGS_H16 = [(16, 16, 8, 2), (16, 64, 4, 2), (16, 64, 8, 2), (16, 128, 4, 2), (16, 128, 8, 2), (32, 64, 4, 2)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="mla")
    p.add_argument("--out", default=None)
    p.add_argument("--target", action="store_true",
                   help="also the forward with the indexer loss's target: products (which make it) vs kernels + "
                        "sparse_probs_target")
    a = p.parse_args()
    shape, B, T, S, H, G, D, DV, K, shared = SHAPES[a.shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(B, S, G, D, generator=gen, device="cuda").bfloat16()
    v = kv[..., :DV] if shared else torch.randn(B, S, G, DV, generator=gen, device="cuda").bfloat16()
    indices = causal_indices(B, T, S, K, "cuda")
    slots = (indices >= 0).sum().item() / (B * T)
    flops = 2 * B * T * H * slots * (D + DV)
    rows = []

    def run():
        with torch.no_grad():
            return sa.sparse_attention(q, kv, v, indices, backend="triton")[0]

    def add(name, ms, err=None, meta=None):
        rows.append(dict(name=f"sparse attention fwd, {name}", shape=shape, ms=round(ms, 3),
                         tflops=round(flops / ms / 1e9, 1), rel_rms_vs_products=err, kernel=meta))
        print(f"{name:40s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  err {err}  {meta or ''}", flush=True)
        if a.out:
            write_results(a.out, rows)

    ts.FORWARD_FORM = "products"
    ref = run().float()
    add("products (auto's form)", triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median"))
    ts.FORWARD_FORM = "kernels"
    R = H // G
    configs = CONFIGS_GQA if D <= 256 else CONFIGS_H16 if R <= 16 else CONFIGS_H32 if R <= 32 else CONFIGS
    for bh, bk, warps, stages in configs:
        ts.CONFIG_OVERRIDE.clear()
        ts.CONFIG_OVERRIDE["fwd"] = {"BH": bh, "BK": bk, "num_warps": warps, "num_stages": stages}
        try:
            o = run().float()
            err = round(((o - ref).norm() / ref.norm()).item(), 5)
            meta = None
            try:  # the last compiled variant is this config's
                k = list(ts._fwd_kernel.device_caches[torch.cuda.current_device()][0].values())[-1]
                meta = f"regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared}"
            except Exception as exc:  # noqa: BLE001 - the resource report is a nicety
                meta = f"(no resource report: {type(exc).__name__})"
            add(f"kernel BH {bh} BK {bk} warps {warps} stages {stages}",
                triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median"), err, meta)
        except Exception as exc:  # a config that does not compile or fit is reported
            print(f"BH {bh} BK {bk} warps {warps} stages {stages}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    ts.CONFIG_OVERRIDE.clear()
    if a.target:
        def with_target():
            with torch.no_grad():
                return ts.sparse_attention_triton(q, kv, v, indices, with_target=True)

        def kernels_then_target():
            with torch.no_grad():
                o, lse, target = ts.sparse_attention_triton(q, kv, v, indices, with_target=True)
                assert target is None
                return o, lse, sa.sparse_probs_target(q, kv, indices, lse)

        ts.FORWARD_FORM = "products"
        ref_t = with_target()[2]
        add("with target: products", triton.testing.do_bench(with_target, warmup=25, rep=200, return_mode="median"))
        for bh, bk, warps, stages in CONFIGS[-3:-2] if R > 32 else CONFIGS_H32[3:4] if R > 16 else CONFIGS_H16[1:2]:
            ts.FORWARD_FORM = "kernels"
            ts.CONFIG_OVERRIDE["fwd"] = {"BH": bh, "BK": bk, "num_warps": warps, "num_stages": stages}
            t = kernels_then_target()[2]
            err = round(((t - ref_t).norm() / ref_t.norm()).item(), 5)
            add(f"with target: kernel BH {bh} BK {bk} + sparse_probs_target",
                triton.testing.do_bench(kernels_then_target, warmup=25, rep=200, return_mode="median"), err)
    ts.CONFIG_OVERRIDE.clear()
    ts.FORWARD_FORM = "auto"


if __name__ == "__main__":
    main()
