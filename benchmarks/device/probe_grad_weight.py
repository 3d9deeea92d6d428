"""The linear + cross-entropy weight gradient, grad_weight[V, D] += g[C, V]^T h[C, D], in every form we can run.

    cd benchmarks && python device/probe_grad_weight.py [--out results/h200/loss_grad_weight.json] [--chunks 512,768,1024,1536]

At N 16384, D 4096, V 151936 (bf16), per chunk of C tokens, CUDA-event medians of:
- torch's addmm_ (cuBLAS, its heuristic's one algorithm) and the same under cuBLASLt preference;
- every candidate cuBLASLt's heuristic offers (ops/_cublaslt.py, without split-K), fastest first;
- Triton kernels: one tile per program loading the old tile after its K loop (1 or 2 programs per SM by
  tile and stage count), and a persistent TMA kernel whose async stores can overlap the next tile;
- the two gradient products on two streams as the loss runs them, with torch's and the tuned product.
Each checks its result against torch's addmm_ (relative RMS). The anchor is the bf16 8192^3 matmul.
Then the whole loss (fwd+bwd, trainable and frozen) at several chunk sizes, beside Liger.
"""

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import time_and_peak, write_results  # noqa: E402

from loss_probe import triton_grad_weight  # noqa: E402  (beside this file)

from megatron_moe_hybrid.ops import _cublaslt  # noqa: E402

N, D, V = 16384, 4096, 151936


@triton.jit
def _rmw_persistent_kernel(g_desc, h_desc, w_desc, C, V, D, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           GROUP: tl.constexpr, NUM_SMS: tl.constexpr, SUB: tl.constexpr,
                           OUT_DTYPE: tl.constexpr):
    """Persistent: each program walks tiles NUM_SMS apart; TMA loads, old tile by TMA, TMA stores in SUB parts."""
    start = tl.program_id(0)
    num_m, num_n = tl.cdiv(V, BM), tl.cdiv(D, BN)
    num_tiles = num_m * num_n
    k_tiles = tl.cdiv(C, BK)
    width = GROUP * num_n
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=True):
        first_m = (tile // width) * GROUP
        size = tl.minimum(num_m - first_m, GROUP)
        pid_m = first_m + (tile % width) % size
        pid_n = (tile % width) // size
        off_m, off_n = pid_m * BM, pid_n * BN
        acc = tl.zeros([BM, BN], tl.float32)
        for ki in range(k_tiles):
            a = g_desc.load([ki * BK, off_m])  # [BK, BM]
            b = h_desc.load([ki * BK, off_n])  # [BK, BN]
            acc = tl.dot(a.T, b, acc)
        if SUB == 2:
            acc = tl.reshape(acc, (BM, 2, BN // 2))
            acc = tl.permute(acc, (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            old0 = w_desc.load([off_m, off_n]).to(tl.float32)
            w_desc.store([off_m, off_n], (acc0 + old0).to(OUT_DTYPE))
            old1 = w_desc.load([off_m, off_n + BN // 2]).to(tl.float32)
            w_desc.store([off_m, off_n + BN // 2], (acc1 + old1).to(OUT_DTYPE))
        else:
            old = w_desc.load([off_m, off_n]).to(tl.float32)
            w_desc.store([off_m, off_n], (acc + old).to(OUT_DTYPE))


def triton_rmw_persistent(g, h, w, BM, BN, BK, num_warps, num_stages, SUB=2, GROUP=8):
    from triton.tools.tensor_descriptor import TensorDescriptor

    sms = torch.cuda.get_device_properties(g.device).multi_processor_count
    g_desc = TensorDescriptor.from_tensor(g, [BK, BM])
    h_desc = TensorDescriptor.from_tensor(h, [BK, BN])
    w_desc = TensorDescriptor.from_tensor(w, [BM, BN // SUB])
    tiles = triton.cdiv(w.shape[0], BM) * triton.cdiv(w.shape[1], BN)
    _rmw_persistent_kernel[(min(sms, tiles),)](g_desc, h_desc, w_desc, g.shape[0], w.shape[0], w.shape[1],
                                               BM=BM, BN=BN, BK=BK, GROUP=GROUP, NUM_SMS=min(sms, tiles), SUB=SUB,
                                               OUT_DTYPE=tl.float16 if w.dtype == torch.float16 else tl.bfloat16,
                                               num_warps=num_warps, num_stages=num_stages)


def median_ms(fn, reps=20, warmup=3):
    return time_and_peak(fn, warmup, reps)[0]


def rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/h200/loss_grad_weight.json")
    parser.add_argument("--chunks", default="512,768,1024,1536")
    parser.add_argument("--skip-loss", action="store_true")
    parser.add_argument("--skip-gemm", action="store_true", help="only the whole loss, under each product backend")
    args = parser.parse_args()
    torch.manual_seed(0)
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ceiling_ms = median_ms(lambda: square @ square)
    ceiling = 2 * 8192**3 / ceiling_ms / 1e9
    del square
    h = (torch.randn(N, D, device="cuda") / 2).bfloat16()  # [N, D]
    w = (torch.randn(V, D, device="cuda") / D**0.5).bfloat16()  # [V, D]
    base = (torch.randn(V, D, device="cuda") / 100).bfloat16()  # what grad_weight holds before the chunk
    grad_w, grad_h = base.clone(), torch.empty_like(h)
    side = torch.cuda.Stream()
    rows = []

    def row(step, chunk, ms, flops, **extra):
        tflops = flops / ms / 1e9 if flops and ms else None
        rows.append({
            "name": f"linear+CE grad_weight: {step}", "shape": f"N{N}-D{D}-V{V}-C{chunk}-bf16",
            "ours_ms": ms and round(ms, 4), "anchor": "bf16 8192^3 matmul (TFLOP/s ceiling)",
            "anchor_ms": round(ceiling_ms, 4), "speedup": tflops and round(tflops / ceiling, 3),
            "tflops": tflops and round(tflops, 1), "anchor_tflops": round(ceiling, 1),
            "notes": "median of 20 CUDA-event timings after 3; speedup = ours' TFLOP/s over the ceiling's", **extra,
        })
        print(f"{step:60s} C{chunk:5d} {ms and round(ms, 3)} ms {tflops and round(tflops)} TFLOP/s "
              f"{ {k: v for k, v in extra.items() if k != 'candidates'} }", flush=True)
        write_results(args.out, rows)

    for chunk in [] if args.skip_gemm else [int(c) for c in args.chunks.split(",")]:
        flops = 2 * chunk * V * D
        g = (torch.randn(chunk, V, device="cuda") / 50).bfloat16()  # [C, V], a gradient-like scale
        h_c = h[:chunk]
        ref = base.clone().addmm_(g.T, h_c)

        def check(fn):
            grad_w.copy_(base)
            fn()
            torch.cuda.synchronize()
            return round(rel(grad_w, ref), 6)

        cublas = lambda: grad_w.addmm_(g.T, h_c)  # noqa: E731
        row("torch addmm_ (cuBLAS)", chunk, median_ms(cublas), flops, rel_err=check(cublas))
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row("torch addmm_ (cuBLASLt preferred)", chunk, median_ms(cublas), flops, rel_err=check(cublas))
        torch.backends.cuda.preferred_blas_library("cublas")
        try:
            tuned = _cublaslt.plan(grad_w, g, h_c, transpose_a=True)
            tuned.tune(grad_w, g, h_c, accumulate=True)
            times = tuned.times
            order = sorted(times, key=times.get)
            cands = [{"rank": i, "ms": round(times[i], 4), "tflops": round(flops / times[i] / 1e9, 1), **tuned.config(i)}
                     for i in order]
            for i in order[:3]:
                fn = lambda i=i: tuned.run(grad_w, g, h_c, accumulate=True, candidate=i)  # noqa: E731
                row(f"cuBLASLt candidate {i} (heuristic rank)", chunk, median_ms(fn), flops, rel_err=check(fn),
                    config=tuned.config(i), candidates=cands if i == order[0] else None)
        except Exception as error:  # noqa: BLE001 - a probe records what failed and goes on
            row("cuBLASLt tuned", chunk, None, flops, error=f"{type(error).__name__}: {error}"[:300])
            tuned = None
        for cfg in [(128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                    (128, 128, 128, 8, 2), (256, 128, 64, 8, 3)]:
            fn = lambda cfg=cfg: triton_grad_weight(g, h_c, grad_w, *cfg, old_first=False)  # noqa: E731
            try:
                err = check(fn)
                row(f"Triton one tile per program {cfg}", chunk, median_ms(fn), flops, rel_err=err,
                    config="BM BN BK warps stages")
            except Exception as error:  # noqa: BLE001
                row(f"Triton one tile per program {cfg}", chunk, None, flops, error=f"{type(error).__name__}: {error}"[:300])
        for cfg in [(128, 128, 64, 4, 4, 1), (128, 256, 64, 8, 3, 2), (128, 128, 64, 8, 4, 2), (128, 256, 64, 8, 4, 2)]:
            fn = lambda cfg=cfg: triton_rmw_persistent(g, h_c, grad_w, *cfg[:5], SUB=cfg[5])  # noqa: E731
            try:
                err = check(fn)
                row(f"Triton persistent TMA {cfg}", chunk, median_ms(fn), flops, rel_err=err,
                    config="BM BN BK warps stages subtiles")
            except Exception as error:  # noqa: BLE001
                row(f"Triton persistent TMA {cfg}", chunk, None, flops, error=f"{type(error).__name__}: {error}"[:300])
        w_ = w

        def both(tuned_path):
            def step():
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    if tuned_path:
                        tuned.run(grad_w, g, h_c, accumulate=True)
                    else:
                        grad_w.addmm_(g.T, h_c)
                torch.mm(g, w_, out=grad_h[:chunk])
                main.wait_stream(side)
            return step

        row("grad_hidden || grad_weight, torch addmm_ (two streams)", chunk, median_ms(both(False)), 2 * flops)
        if tuned is not None:
            row("grad_hidden || grad_weight, tuned cuBLASLt (two streams)", chunk, median_ms(both(True)), 2 * flops)
        del g, ref
        torch.cuda.empty_cache()

    if args.skip_loss:
        return
    from megatron_moe_hybrid.ops.cross_entropy import linear_cross_entropy
    from megatron_moe_hybrid.ops.cross_entropy import triton as ce


    del grad_w, grad_h, base
    torch.cuda.empty_cache()
    labels = torch.randint(0, V, (N,), device="cuda")
    labels[torch.rand(N, device="cuda") < 0.05] = -100
    variants = [("torch", True), ("cublaslt", True), ("cublaslt", False), ("torch", False)]
    for trainable, chunks in ((True, (768, 1024, 1536)), (False, (384, 512))):
        h.requires_grad_(True)
        w.requires_grad_(trainable)
        leaves = [t for t in (h, w) if t.requires_grad]
        for chunk in chunks:
            for backend, side in variants if trainable else variants[:2]:
                ce.GEMM_BACKEND, ce.SIDE_STREAM = backend, side

                def step():
                    loss = linear_cross_entropy(h, w, labels, chunk_size=chunk, backend="triton")
                    torch.autograd.grad(loss, leaves)
                ms, peak = time_and_peak(step, 2, 10)
                row(f"whole loss fwd+bwd ({'trainable' if trainable else 'frozen'}), chunk {chunk}, products "
                    f"{backend}, side stream {side}", chunk, ms, (6 if trainable else 4) * N * V * D, peak_bytes=peak)
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            def liger():
                loss = liger_fused_linear_cross_entropy(h, w, labels)
                torch.autograd.grad(loss, leaves)
            ms, peak = time_and_peak(liger, 1, 10)
            row(f"Liger 0.8.5 fwd+bwd ({'trainable' if trainable else 'frozen'})", 0, ms,
                (6 if trainable else 4) * N * V * D, peak_bytes=peak)
        except ImportError as error:
            print("no liger:", error)
    ce.GEMM_BACKEND, ce.SIDE_STREAM = "auto", False


if __name__ == "__main__":
    main()
