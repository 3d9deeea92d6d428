"""Our Triton grouped GEMM against torch._grouped_mm, form by form, at issue 5's two MoE shapes
on one GPU: the experts' forward (fc1, fc2), their input gradients (dy @ w^T) and their weight
gradients (x^T @ dy per expert), each with its FLOP and byte floor; a small config sweep; then
the SwiGLU experts forward+backward through each. Every output is checked against torch's first.

    python benchmarks/device/probe_grouped_gemm.py [--shapes S1,S2] [--forms fwd,dx] [--out results.json]

--out writes the rows in the results format (benchmarks/common.py write_results): each form at
each config, ours against torch._grouped_mm in the same process.
"""

import argparse
import os
import sys

import torch
import triton

from megatron_moe_hybrid.ops.moe import grouped_triton as gt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import write_results  # noqa: E402

SHAPES = {  # tokens, hidden, experts, topk, ffn
    "S1": (16384, 2048, 64, 8, 1408),
    "S2": (4096, 7168, 256, 8, 2048),
    "S1-small": (4096, 2048, 64, 8, 1408),  # 512 rows per expert: above auto's threshold
    "Q3N": (16384, 2048, 512, 10, 512),  # Qwen3-Next's experts (benchmarks/end_to_end.py): 320 rows per expert
}
FWD_CONFIGS = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3)]
# the weight gradient's (BK, BN, BR, warps, stages, column tiles per program); the first is the default
WGRAD_CONFIGS = [(128, 256, 64, 8, 3, 4), (128, 256, 64, 8, 4, 4), (128, 256, 64, 8, 3, 8), (128, 128, 64, 4, 3, 8),
                 (128, 256, 128, 8, 2, 4)]
PEAK_TFLOPS, PEAK_TBPS = 687.0, 4.27  # measured bf16 matmul and copy ceilings (issue 5's anchors)


def shape_of(name):
    T, h, E, k, F = SHAPES[name]
    return f"{name}-T{T}-H{h}-E{E}-K{k}-F{F}-{T * k // E}rows/expert-bf16"


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def counts_for(tokens, experts, topk, gen):
    scores = torch.rand(tokens, experts, generator=gen, device="cuda")
    idx = scores.topk(topk, dim=1).indices
    return torch.bincount(idx.flatten(), minlength=experts).to(torch.int32)


def routed(name, gen):
    """A SHAPES entry's routing: (T, h, E, k, F, counts [E] int32 of random top-k routing, N = T k
    rows, bounds int32 [E + 1], offs = bounds[1:] for torch._grouped_mm)."""
    T, h, E, k, F = SHAPES[name]
    counts = counts_for(T, E, k, gen)
    bounds = gt.row_bounds(counts)
    return T, h, E, k, F, counts, T * k, bounds, bounds[1:].contiguous()


def expert_tensors(N, h, E, F):
    """Random bf16 operands of the SwiGLU experts' products: x [N, h], w1 [E, h, 2F], act [N, F],
    w2 [E, F, h] and output gradients dy1 [N, 2F], dy2 [N, h]."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    return (torch.randn(N, h, **bf), torch.randn(E, h, 2 * F, **bf) / h**0.5, torch.randn(N, F, **bf),
            torch.randn(E, F, h, **bf) / F**0.5, torch.randn(N, 2 * F, **bf), torch.randn(N, h, **bf))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="S1,S2")
    p.add_argument("--out", default=None)
    p.add_argument("--forms", default="", help="comma list: only forms whose name contains one of these (e.g. fwd,dx)")
    p.add_argument("--no-experts", action="store_true", help="skip the experts forward+backward")
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        T, h, E, k, F, counts, N, bounds, offs = routed(name, gen)
        x, w1, act, w2, dy1, dy2 = expert_tensors(N, h, E, F)
        forms = {  # name: (torch fn, ours fn(config), flops, bytes)
            "fc1 fwd": (lambda: torch._grouped_mm(x, w1, offs=offs), lambda c: gt.grouped_mm(x, w1, bounds, c),
                        2 * N * h * 2 * F, 2 * (N * h + E * h * 2 * F + N * 2 * F)),
            "fc2 fwd": (lambda: torch._grouped_mm(act, w2, offs=offs), lambda c: gt.grouped_mm(act, w2, bounds, c),
                        2 * N * F * h, 2 * (N * F + E * F * h + N * h)),
            "fc1 dx": (lambda: torch._grouped_mm(dy1, w1.transpose(1, 2), offs=offs),
                       lambda c: gt.grouped_mm(dy1, w1.transpose(1, 2), bounds, c),
                       2 * N * h * 2 * F, 2 * (N * h + E * h * 2 * F + N * 2 * F)),
            "fc2 dx": (lambda: torch._grouped_mm(dy2, w2.transpose(1, 2), offs=offs),
                       lambda c: gt.grouped_mm(dy2, w2.transpose(1, 2), bounds, c),
                       2 * N * F * h, 2 * (N * F + E * F * h + N * h)),
            "fc1 wgrad": (lambda: torch._grouped_mm(x.t(), dy1, offs=offs), lambda c: gt.grouped_mm_wgrad(x, dy1, bounds, c),
                          2 * N * h * 2 * F, 2 * (N * h + E * h * 2 * F + N * 2 * F)),
            "fc2 wgrad": (lambda: torch._grouped_mm(act.t(), dy2, offs=offs), lambda c: gt.grouped_mm_wgrad(act, dy2, bounds, c),
                          2 * N * F * h, 2 * (N * F + E * F * h + N * h)),
        }
        for form, (tfn, ofn, flops, nbytes) in forms.items():
            if not any(f in form for f in a.forms.split(",")):
                continue
            floor = max(flops / PEAK_TFLOPS / 1e9, nbytes / PEAK_TBPS / 1e9)
            ref = None
            torch.cuda.empty_cache()
            try:
                ref = tfn()
                if "wgrad" in form:
                    ref = ref[:8].clone()  # the first experts: keeps 15 GB free for ours
                t_ms = bench(tfn)
            except Exception as err:  # noqa: BLE001  (the form torch refuses is reported, not fatal)
                print(f"{name} {form}: torch failed: {str(err)[:200]}")
                ref, t_ms = None, float("nan")
            configs = WGRAD_CONFIGS if "wgrad" in form else FWD_CONFIGS
            best = None
            for c in configs:
                try:
                    out = ofn(c)
                    n_real = int(bounds[-1])
                    if ref is None:
                        err = float("nan")
                    else:
                        err = rel(out[:8], ref) if "wgrad" in form else rel(out[:n_real], ref[:n_real])
                    del out
                    ms = bench(lambda: ofn(c))
                except Exception as e:  # noqa: BLE001
                    print(f"{name} {form} {c}: failed {str(e)[:200]}; allocated "
                          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB")
                    continue
                row = dict(name=f"grouped gemm {form}", shape=shape_of(name), config=list(c), ours_ms=round(ms, 3),
                           anchor="torch._grouped_mm", anchor_ms=round(t_ms, 3), speedup=round(t_ms / ms, 3),
                           floor_ms=round(floor, 3), tflops=round(flops / ms / 1e9, 1), rel_err_vs_anchor=err,
                           notes="triton.testing.do_bench median; floor: the larger of FLOPs at 687 TFLOP/s and "
                                 "bytes (each operand once) at 4.27 TB/s")
                rows.append(row)
                if best is None or ms < best["ours_ms"]:
                    best = row
                print(f"{name} {form:9s} {str(c):22s} ours {ms:7.3f} ms  torch {t_ms:7.3f}  floor {floor:6.3f}  "
                      f"{flops / ms / 1e9:5.0f} TFLOP/s  err {err:.1e}", flush=True)
            if best:
                print(f"== {name} {form}: best {best['config']} {best['ours_ms']:.3f} ms vs torch {t_ms:.3f} "
                      f"({t_ms / best['ours_ms']:.2f}x), floor {floor:.3f}", flush=True)
        # the experts' fc1 -> SwiGLU -> fc2, forward + backward, through each
        if a.no_experts:
            continue
        from megatron_moe_hybrid.ops.moe.swiglu import swiglu

        def experts(mm):
            xx = x.detach().requires_grad_()
            ww1 = w1.detach().requires_grad_()
            ww2 = w2.detach().requires_grad_()

            def run():
                out = mm(swiglu(mm(xx, ww1)), ww2)
                out.backward(dy2)
            return run

        t_torch = bench(experts(lambda u, w: torch._grouped_mm(u, w, offs=offs)))
        t_ours = bench(experts(lambda u, w: gt.GroupedMM.apply(u, w, bounds, "triton")))
        t_hybrid = bench(experts(lambda u, w: gt.GroupedMM.apply(u, w, bounds, "torch")))
        print(f"== {name} experts fwd+bwd: ours {t_ours:.2f} ms, ours with torch's wgrad {t_hybrid:.2f}, "
              f"torch._grouped_mm {t_torch:.2f} ms ({t_torch / t_ours:.2f}x, {t_torch / t_hybrid:.2f}x)", flush=True)
        rows.append(dict(name="grouped gemm experts fwd+bwd (fc1, SwiGLU, fc2)", shape=shape_of(name),
                         ours_ms=round(t_hybrid, 3), anchor="torch._grouped_mm", anchor_ms=round(t_torch, 3),
                         speedup=round(t_torch / t_hybrid, 3), ours_all_triton_ms=round(t_ours, 3),
                         notes="ours = GroupedMM with torch._grouped_mm's weight gradient (auto); "
                               "ours_all_triton_ms with our weight-gradient kernel; gradients accumulate into .grad"))
        del x, w1, act, w2, dy1, dy2
        torch.cuda.empty_cache()
    if a.out:
        write_results(a.out, rows)


if __name__ == "__main__":
    main()
