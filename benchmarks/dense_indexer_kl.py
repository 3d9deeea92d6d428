"""The sparse layer's dense warm-up indexer KL loss (DeepSeek-V3.2's warm-up stage), fused
(ops/sparse_attention/triton_dense_kl.py, what chunked_indexer_kl_loss's auto now runs for
16-bit CUDA inputs) against the chunked reference that auto ran before (backend="torch":
[Tc, H, S] target and [Tc, HI, S] index scores per chunk of queries, 1 GiB budget), in the same
run; the layer's main causal attention (ops.causal_attention, flash) timed beside them for scale.

    python benchmarks/dense_indexer_kl.py      # writes benchmarks/results/<h200|h100>/dense_indexer_kl.json

bf16, forward+backward (gradients to q_idx, k_idx, weights), median of --reps (CUDA events; the
reference once where one call takes over --slow-s seconds); peak bytes above the inputs. Shapes:
the issue's GQA layout (16 heads on 4 kv groups, D 128) and DeepSeek-V3.2's MLA as the dense
warm-up runs it (128 heads, each with its own 192-wide key), with its indexer (64 heads x 128).
Accuracy: each form's loss and gradients against the reference's on the same bf16 inputs (which
computes in fp32), as relative RMS.
"""

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import peak_above, time_and_peak, write_results  # noqa: E402

from megatron_moe_hybrid.ops import sparse_attention as sa  # noqa: E402
from megatron_moe_hybrid.testing import rel_rms  # noqa: E402

SHAPES = {  # name: (T, H, G, D, HI, DI)
    "gqa-T8192": (8192, 16, 4, 128, 64, 128),
    "mla-T4096": (4096, 128, 128, 192, 64, 128),
    "gqa-T32768": (32768, 16, 4, 128, 64, 128),
    "mla-T16384": (16384, 128, 128, 192, 64, 128),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slow-s", type=float, default=3.0)
    ap.add_argument("--skip-reference-above", type=int, default=8192, help="T above which the reference is not run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    card = "h100" if "H100" in torch.cuda.get_device_name() else "h200"
    out_path = args.out or os.path.join(HERE, "results", card, "dense_indexer_kl.json")
    rows = []
    for name in args.shapes.split(","):
        T, H, G, D, HI, DI = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)

        def make(*shape, div=1.0):
            return (torch.randn(*shape, device="cuda", generator=gen) / div).bfloat16()

        q, k, v = make(1, T, H, D), make(1, T, G, D), make(1, T, G, D)
        leaves = [make(1, T, HI, DI, div=4).requires_grad_(), make(1, T, DI, div=4).requires_grad_(),
                  make(1, T, HI).requires_grad_()]

        def step(backend):
            def run():
                loss, _ = sa.chunked_indexer_kl_loss(q, k, *leaves, backend=backend)
                return (loss, *torch.autograd.grad(loss, leaves))
            return run

        forms = {"fused (auto)": step("auto")}
        if T <= args.skip_reference_above:
            forms["chunked reference (before)"] = step("torch")
        results, outs = {}, {}
        for form, fn in forms.items():
            t0 = time.time()
            first = []
            first_peak = peak_above(lambda: first.append(fn()))
            outs[form] = [x.detach().float() for x in first.pop()]
            first_s = time.time() - t0
            reps = 1 if first_s > args.slow_s else args.reps
            ms, peak = time_and_peak(fn, 0 if reps == 1 else 1, reps)
            peak = max(peak, first_peak)  # (time_and_peak measures its warm-up calls only: none for a slow form)
            results[form] = {"fwd+bwd_ms": round(ms, 3), "peak_bytes": peak, "reps": reps}
            print(name, form, results[form], flush=True)
            torch.cuda.empty_cache()
        qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
        go = torch.randn_like(q)

        def attention():
            o = sa.causal_attention(qa, ka, va)
            return torch.autograd.grad(o, (qa, ka, va), go)

        attn_ms, _ = time_and_peak(attention, 2, args.reps)
        ours = results["fused (auto)"]
        ref = results.get("chunked reference (before)")
        errors = None
        if ref is not None:
            base = outs["chunked reference (before)"]
            errors = [round(rel_rms(a, b), 5) for a, b in zip(outs["fused (auto)"], base)]
        pairs = T * (T + 1) / 2
        rows.append({
            "name": "dense warm-up indexer KL loss fwd+bwd",
            "shape": f"B1-T{T}-H{H}-G{G}-D{D}, indexer HI{HI}-DI{DI}, causal",
            "ours": "fused Triton (triton_dense_kl)", "ours_ms": ours["fwd+bwd_ms"],
            "anchor": "chunked reference (backend torch; auto's path before)",
            "anchor_ms": ref["fwd+bwd_ms"] if ref else None,
            "speedup": round(ref["fwd+bwd_ms"] / ours["fwd+bwd_ms"], 2) if ref else None,
            "target_speedup": None,
            "ours_peak_mem_bytes": ours["peak_bytes"], "anchor_peak_mem_bytes": ref["peak_bytes"] if ref else None,
            "main_attention_fwd+bwd_ms": round(attn_ms, 3),
            "tflops": round(pairs * (2 * H * D * 3 + 2 * HI * DI * 6) / ours["fwd+bwd_ms"] / 1e9, 1),
            "rel_rms_loss_dq_dk_dw_vs_reference": errors,
            "forms": results,
            "notes": ("tflops counts the products the fused kernels make over the causal pairs: the main scores 3 times "
                      "(lse, forward, backward), the index scores 6 times (forward, dI, twice in dq, twice in dk); "
                      "main_attention_fwd+bwd_ms: ops.causal_attention (auto) at the same shape, for scale"
                      + ("" if ref else f"; the reference was not run above T={args.skip_reference_above}")),
        })  # fmt: skip
        write_results(out_path, rows)
    print("wrote", out_path)


if __name__ == "__main__":
    main()
