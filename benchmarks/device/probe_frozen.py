"""Linear + cross-entropy with a frozen weight (LoRA): where its time goes, and two ways to spend less.

    cd benchmarks && python device/probe_frozen.py [--out results/h200/loss_frozen.json] [--quick]

A frozen weight leaves two products per chunk of C tokens: the logits h[C, D] @ W^T and
grad_hidden g[C, V] @ W[V, D]. The second has a long K (the vocabulary) and a small output,
[C, D], which fills few of the 132 SMs unless K is split. Per shape and chunk this times:
- each product by torch.mm and by every cuBLASLt candidate, split-K admitted (ops/_cublaslt.py),
  with the candidate's config, its error against torch's and whether two runs are bitwise equal;
- the whole loss (fwd+bwd) with cross_entropy.triton's switches: GRAD_HIDDEN_GEMM (torch or
  cuBLASLt's timed choice) and PIPELINE_FROZEN (two [C, V] buffers, chunk i's grad_hidden on the
  side stream beside chunk i + 1's logits), beside Liger 0.8.5 in the same process;
- the trainable loss at its automatic chunk with GRAD_HIDDEN_GEMM torch / cublaslt, beside Liger.
Peaks are reported as (peak above inputs + inputs) / (inputs + gradients), issue 7's bound being 1.1.
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import time_and_peak, write_results  # noqa: E402

from megatron_moe_hybrid.ops import _cublaslt  # noqa: E402
from megatron_moe_hybrid.ops.cross_entropy import linear_cross_entropy  # noqa: E402
from megatron_moe_hybrid.ops.cross_entropy import triton as ce  # noqa: E402

SHAPES = {"S1": (16384, 4096, 151936), "S2": (32768, 7168, 262144)}


def event_ms(fn, reps=10):
    fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def product_rows(shape_name, N, D, V, chunks, W):
    rows = []
    for C in chunks:
        h = torch.randn(C, D, device="cuda", dtype=torch.bfloat16)
        g = (torch.randn(C, V, device="cuda", dtype=torch.bfloat16) * 1e-3)
        for name, a, b, tb, out in (
            ("logits h @ W^T", h, W, True, torch.empty(C, V, device="cuda", dtype=torch.bfloat16)),
            ("grad_hidden g @ W", g, W, False, torch.empty(C, D, device="cuda", dtype=torch.bfloat16)),
        ):
            flops = 2 * C * D * V
            ref = torch.mm(a, b.T if tb else b)
            torch_ms = event_ms(lambda: torch.mm(a, b.T if tb else b, out=out))
            row = {"name": f"{name} C{C}", "shape": f"{shape_name}-N{N}-D{D}-V{V}-C{C}", "torch_ms": round(torch_ms, 4),
                   "torch_tflops": round(flops / torch_ms / 1e9, 1)}
            try:
                p = _cublaslt.plan(out, a, b, transpose_b=tb, split_k=True)
                p.tune(out, a, b, accumulate=False)
                best = p.choice
                best_ms = event_ms(lambda: p.run(out, a, b, False))
                first = p.run(out, a, b, False).clone()
                second = p.run(out, a, b, False)
                err = ((first.float() - ref.float()).norm() / ref.float().norm()).item()
                row.update({
                    "lt_best_ms": round(best_ms, 4), "lt_best_tflops": round(flops / best_ms / 1e9, 1),
                    "speedup_vs_torch": round(torch_ms / best_ms, 3), "lt_best_config": p.config(best),
                    "lt_best_rel_err_vs_torch": err, "lt_best_bitwise_repeat": bool(torch.equal(first, second)),
                    "lt_candidates_ms": {str(i): round(t, 4) for i, t in sorted(p.times.items(), key=lambda kv: kv[1])},
                    "lt_candidate_configs": {str(i): p.config(i) for i in p.times},
                })
            except RuntimeError as error:
                row["lt_error"] = str(error)[:200]
            print(f"{row['shape']:36s} {name:20s} torch {torch_ms:7.3f} ms {row['torch_tflops']:6.1f} TF/s | "
                  f"lt {row.get('lt_best_ms')} ms {row.get('lt_best_tflops')} TF/s x{row.get('speedup_vs_torch')} "
                  f"err {row.get('lt_best_rel_err_vs_torch')} rep {row.get('lt_best_bitwise_repeat')} "
                  f"cfg {row.get('lt_best_config')}", flush=True)
            rows.append(row)
        del h, g
    return rows


def liger(hidden, weight, labels):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, labels)


def loss_rows(shape_name, N, D, V, variants, trainable, warmup, reps):
    torch.manual_seed(0)
    hidden = (torch.randn(N, D, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    weight = (torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(trainable)
    labels = torch.randint(0, V, (N,), device="cuda")
    leaves = [t for t in (hidden, weight) if t.requires_grad]
    elem = hidden.element_size()
    inputs = (N * D + V * D) * elem
    grads = sum(t.numel() for t in leaves) * elem
    rows, ref = [], None
    saved = (ce.GRAD_HIDDEN_GEMM, ce.PIPELINE_FROZEN)
    for label, chunk, ghidden, pipe in variants:
        ce.GRAD_HIDDEN_GEMM, ce.PIPELINE_FROZEN = ghidden, pipe
        if chunk == "liger":
            fn = liger
        else:
            def fn(h, w, y, chunk=chunk):
                return linear_cross_entropy(h, w, y, chunk_size=chunk, backend="triton")

        def step():
            loss = fn(hidden, weight, labels)
            return loss, torch.autograd.grad(loss, leaves)

        try:
            loss, got = step()
            got = [g.float() for g in got]
            if ref is None:
                ref = (loss.float(), got)
                err = 0.0
            else:
                err = max([abs(loss.float() - ref[0]).item() / abs(ref[0]).item()]
                          + [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref[1])])
            del got
            ms, peak = time_and_peak(step, warmup, reps)
            row = {"name": f"loss fwd+bwd {'trainable' if trainable else 'frozen'} {label}",
                   "shape": f"{shape_name}-N{N}-D{D}-V{V}", "ms": round(ms, 2), "peak_bytes": peak,
                   "peak_over_inputs_grads": round((peak + inputs) / (inputs + grads), 4),
                   "max_rel_err_vs_first": err, "chunk": chunk, "grad_hidden_gemm": ghidden, "pipeline": pipe}
        except (RuntimeError, torch.OutOfMemoryError, ImportError) as error:
            row = {"name": label, "shape": shape_name, "error": str(error)[:300]}
        print(row, flush=True)
        rows.append(row)
    ce.GRAD_HIDDEN_GEMM, ce.PIPELINE_FROZEN = saved
    liger_ms = next((r["ms"] for r in rows if r.get("chunk") == "liger" and "ms" in r), None)
    for r in rows:
        if liger_ms and "ms" in r:
            r["vs_liger"] = round(r["ms"] / liger_ms, 4)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/h200/loss_frozen.json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    _cublaslt.MAX_CANDIDATES = 32
    rows = []
    warmup, reps = (3, 8) if args.quick else (5, 15)
    for shape_name, (N, D, V) in SHAPES.items():
        if args.quick and shape_name != "S1":
            continue
        W = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02
        chunks = [192, 256, 384, 512, 768] if shape_name == "S1" else [384, 512, 768, 1536]
        rows += product_rows(shape_name, N, D, V, chunks, W)
        del W
        torch.cuda.empty_cache()
        base = ce.auto_chunk_size(N, D, V, False)
        half = base // 2
        variants = [("liger", "liger", "torch", False),
                    (f"chunk {base}", base, "torch", False),
                    (f"chunk {base} grad_hidden cublaslt", base, "cublaslt", False),
                    (f"pipelined 2x{half}", half, "torch", True),
                    (f"pipelined 2x{half} grad_hidden cublaslt", half, "cublaslt", True),
                    (f"pipelined 2x{base} grad_hidden cublaslt", base, "cublaslt", True),
                    (f"chunk {base} again", base, "torch", False)]
        rows += loss_rows(shape_name, N, D, V, variants, False, warmup, reps)
        torch.cuda.empty_cache()
        tbase = ce.auto_chunk_size(N, D, V, True)
        tvariants = [("liger", "liger", "torch", False),
                     (f"chunk {tbase}", tbase, "torch", False),
                     (f"chunk {tbase} grad_hidden cublaslt", tbase, "cublaslt", False)]
        rows += loss_rows(shape_name, N, D, V, tvariants, True, warmup, reps)
        torch.cuda.empty_cache()
    write_results(args.out, rows, packages=("liger-kernel",))
    print("\nsummary")
    for r in rows:
        if "ms" in r:
            print(f"{r['shape']:28s} {r['name']:70s} {r['ms']:8.2f} ms x{r.get('vs_liger')} peak {r['peak_over_inputs_grads']} err {r['max_rel_err_vs_first']:.2e}")


if __name__ == "__main__":
    main()
