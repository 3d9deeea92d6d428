"""Linear + cross-entropy with and without ROW_OVERLAP (each chunk in two row halves, the first half's
row passes beside the second half's logits product), interleaved with Liger, in one process.

    cd benchmarks && python device/probe_row_overlap.py [--out $OUT/loss_row_overlap.json] [--rounds 3]

At benchmarks/loss.py's two shapes, trainable and frozen weight, the automatic chunk: each round
times every variant once (median of 5 CUDA-event timings after 2), so drift hits all alike. Rows
give each variant's median over the rounds and (peak + inputs) / (inputs + gradients).
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import time_and_peak, write_results  # noqa: E402

from megatron_moe_hybrid.ops.cross_entropy import linear_cross_entropy  # noqa: E402
from megatron_moe_hybrid.ops.cross_entropy import triton as triton_backend  # noqa: E402

SHAPES = [(16384, 4096, 151936), (32768, 7168, 262144)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/h200/loss_row_overlap.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default="0,1")
    parser.add_argument("--modes", default="trainable,frozen")
    args = parser.parse_args()
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    torch.manual_seed(0)
    square = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    torch.mm(square, square)  # torch's main-stream cuBLAS workspace, as in loss.py
    rows = []
    for i in map(int, args.shapes.split(",")):
        num_tokens, hidden_size, vocab_size = SHAPES[i]
        for mode in args.modes.split(","):
            trainable = mode == "trainable"
            hidden = (torch.randn(num_tokens, hidden_size, device="cuda") / 2).bfloat16().requires_grad_()
            weight = (torch.randn(vocab_size, hidden_size, device="cuda") / hidden_size**0.5).bfloat16()
            weight.requires_grad_(trainable)
            labels = torch.randint(0, vocab_size, (num_tokens,), device="cuda")
            labels[torch.rand(num_tokens, device="cuda") < 0.05] = -100
            leaves = [hidden, weight] if trainable else [hidden]
            inputs = (hidden.numel() + weight.numel()) * 2 + labels.numel() * 8
            grads = sum(t.numel() for t in leaves) * 2

            def step_of(variant):
                def step():
                    if variant == "liger":
                        loss = liger_fused_linear_cross_entropy(hidden, weight, labels)
                    else:
                        triton_backend.ROW_OVERLAP = variant == "halves"
                        loss = linear_cross_entropy(hidden, weight, labels, backend="triton")
                    torch.autograd.grad(loss, leaves)
                return step

            variants = ["whole", "halves", "liger"]
            times, peaks = {v: [] for v in variants}, {}
            for _ in range(args.rounds):
                for v in variants:
                    ms, peak = time_and_peak(step_of(v), 2, 5)
                    times[v].append(ms)
                    peaks[v] = peak
            triton_backend.ROW_OVERLAP = True
            liger_ms = statistics.median(times["liger"])
            for v in variants:
                ms = statistics.median(times[v])
                rows.append({
                    "name": f"linear+cross-entropy fwd+bwd ({mode}), " + ("Liger 0.8.5" if v == "liger" else f"ours, chunk {v}"),
                    "shape": f"N{num_tokens}-D{hidden_size}-V{vocab_size}-bf16-{mode}",
                    "ours_ms": round(ms, 2), "anchor": "liger 0.8.5", "anchor_ms": round(liger_ms, 2),
                    "speedup": round(liger_ms / ms, 3), "rounds_ms": [round(t, 2) for t in times[v]],
                    "peak_with_inputs_over_inputs_plus_grads": round((peaks[v] + inputs) / (inputs + grads), 4),
                    "notes": f"median over {args.rounds} interleaved rounds of (median of 5 CUDA-event timings after 2); "
                             "automatic chunk",
                })
                print(rows[-1]["name"], rows[-1]["shape"], rows[-1]["ours_ms"], "ms", rows[-1]["rounds_ms"], "vs Liger",
                      rows[-1]["speedup"], "peak", rows[-1]["peak_with_inputs_over_inputs_plus_grads"], flush=True)
            write_results(args.out, rows, ("liger-kernel",))
            del hidden, weight, labels, leaves
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
