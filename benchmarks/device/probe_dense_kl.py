"""A/B of the dense warm-up's fused indexer KL loss (ops/sparse_attention/triton_dense_kl.py) in one
process: the module as committed at BEFORE_REV (its file copied beside it as _dense_kl_before.py;
variant "before" refuses to run without it) against the current one under switch settings, each
forward+backward timed by CUDA events (median of --reps), with a kernel-time table per variant
(torch.profiler) and each variant's outputs against the first one's (relative RMS; the key-block
split sums in another order, so not bitwise).

    git show REV:megatron_moe_hybrid/ops/sparse_attention/triton_dense_kl.py \\
        > megatron_moe_hybrid/ops/sparse_attention/_dense_kl_before.py
    python benchmarks/device/probe_dense_kl.py OUT [--shapes gqa-T8192,mla-T4096] [--variants ...]

Writes OUT/probe_dense_kl.json (one row per shape and variant) and OUT/probe_dense_kl.txt.
"""

import argparse
import importlib
import json
import os
import sys

import torch
import triton
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common import time_and_peak  # noqa: E402

from megatron_moe_hybrid.ops.sparse_attention import triton_dense_kl as new  # noqa: E402
from megatron_moe_hybrid.testing import rel_rms  # noqa: E402

SHAPES = {  # name: (T, H, G, D, HI, DI), as benchmarks/dense_indexer_kl.py
    "gqa-T8192": (8192, 16, 4, 128, 64, 128),
    "mla-T4096": (4096, 128, 128, 192, 64, 128),
    "gqa-T32768": (32768, 16, 4, 128, 64, 128),
}
S2 = {"lse": (4, 2), "fwd": (8, 2), "merge": (4, 1), "dscores": (8, 2), "dq": (8, 2), "dk": (8, 2)}
S3 = {"lse": (4, 2), "fwd": (8, 3), "merge": (4, 1), "dscores": (8, 3), "dq": (8, 3), "dk": (8, 3)}
S3_FWD = dict(S2, fwd=(8, 3), dscores=(8, 3))
NO_SPLIT = {"MIN_BLOCK_TILES": 1 << 20, "DK_PROGRAMS": 0}
BACKWARD_OFF = {"LAUNCH": S3, "DQ_HEADS": 1, "DK_HEADS": 1, "DS_BF16": False, "SPLIT_HEAD_DIM": frozenset()}
TQ128 = dict.fromkeys(("lse", "fwd", "dscores"), (128, 128))  # TILE_QUERIES at 128 (either head layout)
TQ64 = dict.fromkeys(("lse", "fwd", "dscores"), (64, 64))
TILES_S2 = dict(new.LAUNCH, fwd=(8, 2), dscores=(8, 2))  # the defaults, the tiles' kernels at 2 stages
SPLIT = frozenset({"lse", "fwd", "dscores"})  # the three kernels that make main-attention products
VARIANTS = {  # name: (module, switches)
    "before": ("before", {}),
    "split-s2": ("new", {"LAUNCH": S2}),
    "split-s3": ("new", {"LAUNCH": S3}),
    "no-split-s2": ("new", dict(NO_SPLIT, LAUNCH=S2)),
    "split-s3-fwd": ("new", {"LAUNCH": S3_FWD}),
    "split-s2-b8": ("new", {"LAUNCH": S2, "MIN_BLOCK_TILES": 8}),
    "split-s3-b8": ("new", {"LAUNCH": S3, "MIN_BLOCK_TILES": 8}),
    # the backward's switches, each variant setting all of them (heads per program in dq, per step
    # in dk; the score-gradient buffer in bf16; the kernels whose head dim is taken in two parts).
    # results/h100/dense_indexer_kl_dq.json also has variants of switches since removed (dI in
    # aligned tiles, now always; dq's query tiles longest first, gone).
    **{name: ("new", dict(BACKWARD_OFF, **switches)) for name, switches in {
        "s3-dq1": {},
        "s3-dq2-ds16": {"DQ_HEADS": 2, "DS_BF16": True},
        "s3-dq2-ds16-dk2": {"DQ_HEADS": 2, "DS_BF16": True, "DK_HEADS": 2},
        "s3-dq2-ds16-dk2-splse": {"DQ_HEADS": 2, "DS_BF16": True, "DK_HEADS": 2,
                                  "SPLIT_HEAD_DIM": frozenset({"lse"})},
        "s3-dq2-ds16-dk2-sp": {"DQ_HEADS": 2, "DS_BF16": True, "DK_HEADS": 2, "SPLIT_HEAD_DIM": SPLIT},
    }.items()},
    # the lse, forward and score-gradient kernels' query tiles (TILE_QUERIES) against the defaults;
    # 128-query tiles at MLA's padded 256-wide head dim do not fit 3 stages (288 KB of shared memory).
    # results/h100/dense_indexer_kl_tiles.json timed these with the defaults of tiles-64 (the
    # switches then took one tile height per kernel and "tiles" for both the forward and the
    # score gradients; the variants here set what those did).
    "defaults": ("new", {}),
    "tiles-64": ("new", {"TILE_QUERIES": TQ64, "SPLIT_HEAD_DIM": frozenset({"lse"})}),
    "sp": ("new", {"TILE_QUERIES": TQ64, "SPLIT_HEAD_DIM": SPLIT}),
    "tq-lse128": ("new", {"TILE_QUERIES": dict(TQ64, lse=(128, 128)), "SPLIT_HEAD_DIM": frozenset({"lse"})}),
    "tq128-s2": ("new", {"TILE_QUERIES": TQ128, "SPLIT_HEAD_DIM": frozenset({"lse"}), "LAUNCH": TILES_S2}),
    "tq128-sp": ("new", {"TILE_QUERIES": TQ128, "SPLIT_HEAD_DIM": SPLIT}),
    "tq128-sp-s2": ("new", {"TILE_QUERIES": TQ128, "SPLIT_HEAD_DIM": SPLIT, "LAUNCH": TILES_S2}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="gqa-T8192,mla-T4096")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    mods = {"new": new}
    if "before" in args.variants.split(","):
        mods["before"] = importlib.import_module("megatron_moe_hybrid.ops.sparse_attention._dense_kl_before")
    rows, text = [], []
    for shape in args.shapes.split(","):
        T, H, G, D, HI, DI = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(0)

        def make(*s, div=1.0):
            return (torch.randn(*s, device="cuda", generator=gen) / div).bfloat16()

        q, k = make(1, T, H, D), make(1, T, G, D)
        leaves = [make(1, T, HI, DI, div=4).requires_grad_(), make(1, T, DI, div=4).requires_grad_(),
                  make(1, T, HI).requires_grad_()]
        first = None
        for name in args.variants.split(","):
            which, switches = VARIANTS[name]
            mod = mods[which]
            saved = {key: getattr(mod, key) for key in switches}
            for key, value in switches.items():
                setattr(mod, key, value)
            try:
                def step():
                    kl, _ = mod.dense_indexer_kl_triton(q, k, *leaves)
                    return (kl.sum(), *torch.autograd.grad(kl.sum(), leaves))

                try:
                    outs = [x.detach().float() for x in step()]
                except triton.runtime.errors.OutOfResources as err:
                    row = {"shape": shape, "variant": name, "error": str(err)[:200]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                ms, peak = time_and_peak(step, 1, args.reps)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                kernels = {}
                for e in prof.key_averages():
                    if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
                        kernels[e.key[:60]] = round(e.self_device_time_total / 1e3, 3)
                kernels = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10])
            finally:
                for key, value in saved.items():
                    setattr(mod, key, value)
            if first is None:
                first = outs
            row = {"shape": shape, "variant": name, "switches": {k: str(v) for k, v in switches.items()},
                   "fwd+bwd_ms": round(ms, 3), "peak_bytes": peak,
                   "rel_rms_loss_dq_dk_dw_vs_first": [round(rel_rms(x, y), 6) for x, y in zip(outs, first)],
                   "kernel_ms": kernels}
            rows.append(row)
            print(json.dumps(row), flush=True)
            text.append(f"{shape} {name}: {row['fwd+bwd_ms']} ms\n" + prof.key_averages().table(
                sort_by="self_device_time_total", row_limit=10))
            with open(os.path.join(args.out, "probe_dense_kl.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
            with open(os.path.join(args.out, "probe_dense_kl.txt"), "w") as f:
                f.write("\n\n".join(text))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
