"""The whole linear + cross-entropy (trainable weight) at several chunk sizes, interleaved with Liger, in one process.

    cd benchmarks && python device/probe_chunks.py [--out $OUT/loss_chunks.json]

At benchmarks/loss.py's two shapes: ours at each chunk and Liger, in rounds (each round times
every variant once, median of 5 CUDA-event timings after 2), so drift hits all alike. Rows
give each variant's median over the rounds and the peak above the inputs as
(peak + inputs) / (inputs + gradients), issue 7's memory measure.
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import time_and_peak, write_results  # noqa: E402

from megatron_moe_hybrid.ops.cross_entropy import linear_cross_entropy  # noqa: E402
from megatron_moe_hybrid.ops.cross_entropy.triton import auto_chunk_size  # noqa: E402

CASES = [((16384, 4096, 151936), (768, 896, 1024)), ((32768, 7168, 262144), (1408, 1536, 2048))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/h200/loss_chunks.json")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    torch.manual_seed(0)
    square = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    torch.mm(square, square)  # torch's main-stream cuBLAS workspace, as in loss.py
    rows = []
    for (num_tokens, hidden_size, vocab_size), chunks in CASES:
        hidden = (torch.randn(num_tokens, hidden_size, device="cuda") / 2).bfloat16().requires_grad_()
        weight = (torch.randn(vocab_size, hidden_size, device="cuda") / hidden_size**0.5).bfloat16().requires_grad_()
        labels = torch.randint(0, vocab_size, (num_tokens,), device="cuda")
        labels[torch.rand(num_tokens, device="cuda") < 0.05] = -100
        inputs = (hidden.numel() + weight.numel()) * 2 + labels.numel() * 8
        grads = (hidden.numel() + weight.numel()) * 2

        def step_of(chunk):
            def step():
                if chunk is None:
                    loss = liger_fused_linear_cross_entropy(hidden, weight, labels)
                else:
                    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, backend="triton")
                torch.autograd.grad(loss, [hidden, weight])
            return step

        variants = [*chunks, None]
        times, peaks = {v: [] for v in variants}, {}
        for _ in range(args.rounds):
            for v in variants:
                ms, peak = time_and_peak(step_of(v), 2, 5)
                times[v].append(ms)
                peaks[v] = peak
        liger_ms = statistics.median(times[None])
        auto = auto_chunk_size(num_tokens, hidden_size, vocab_size, True)
        for v in variants:
            ms = statistics.median(times[v])
            rows.append({
                "name": "linear+cross-entropy fwd+bwd (trainable), " + ("Liger 0.8.5" if v is None else f"ours, chunk {v}"
                                                                          + (" (automatic)" if v == auto else "")),
                "shape": f"N{num_tokens}-D{hidden_size}-V{vocab_size}-bf16-trainable",
                "ours_ms": round(ms, 2), "anchor": "liger 0.8.5", "anchor_ms": round(liger_ms, 2),
                "speedup": round(liger_ms / ms, 3), "rounds_ms": [round(t, 2) for t in times[v]],
                "peak_with_inputs_over_inputs_plus_grads": round((peaks[v] + inputs) / (inputs + grads), 4),
                "notes": f"median over {args.rounds} interleaved rounds of (median of 5 CUDA-event timings after 2)",
            })
            print(rows[-1]["name"], rows[-1]["shape"], rows[-1]["ours_ms"], "ms", rows[-1]["rounds_ms"],
                  "vs Liger", rows[-1]["speedup"], "peak", rows[-1]["peak_with_inputs_over_inputs_plus_grads"], flush=True)
        write_results(args.out, rows, ("liger-kernel",))
        del hidden, weight, labels
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
