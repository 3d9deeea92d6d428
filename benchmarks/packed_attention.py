"""Dense causal attention over packed sequences (ops.sparse_attention.causal_attention with
cu_seqlens): what the gated full attention `A` and the sparse layer's dense warm-up run under
`training.isolate_records`, ours against the path they ran before and against what plain torch
offers, in the same run.

    python benchmarks/packed_attention.py      # writes benchmarks/results/<h200|h100>/packed_attention.json

Rows, each forward and forward+backward in bf16 (median of --reps, CUDA events; peak bytes above
the inputs):
- ours: auto (what the layers run), which takes torch's varlen flash kernel ("varlen") or SDPA
  once per sequence ("sdpa per sequence", for a few long sequences; see
  ops.sparse_attention.SEQUENCE_LOOP_WORK_PER_SEQUENCE), each also timed alone;
- anchors: the reference (`backend="torch"`, the [B, T, H, T] scores; the layers' packed path
  before this change) where its scores fit, and SDPA over the whole row with a block-diagonal
  causal mask and k, v repeated to the query heads (torch's documented way to pack without varlen).
Shapes: Qwen3-Next's full attention (16 query heads on 2 kv groups, D 256) at 8k and 32k tokens
of records of a few hundred to a few thousand tokens, and 16k tokens of short chat records.
FLOPs count each sequence's causal half: forward 4 H D sum(L^2) / 2, backward 2.5 times it.
"""

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import time_and_peak, write_results  # noqa: E402

from megatron_moe_hybrid.ops import sparse_attention as sa  # noqa: E402
from megatron_moe_hybrid.testing import rel_rms  # noqa: E402

SHAPES = {  # name: (H, G, D, T, shortest, longest record)
    "qwen3next-T8192": (16, 2, 256, 8192, 256, 4096),
    "qwen3next-T32768": (16, 2, 256, 32768, 512, 8192),
    "chat-T16384-short": (16, 2, 128, 16384, 16, 512),
    "h8d128-T32768": (8, 1, 128, 32768, 1024, 8192),
}


def lengths_for(T, shortest, longest, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < T:
        out.append(int(torch.randint(shortest, longest + 1, (1,), generator=gen)))
    out[-1] -= sum(out) - T
    return [n for n in out if n > 0]


def masked_sdpa(q, k, v, seg):
    """Whole-row SDPA with a block-diagonal causal bool mask [T, T], k/v repeated to H heads."""
    R = q.shape[2] // k.shape[2]
    T = q.shape[1]
    pos = torch.arange(T, device=q.device)
    mask = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(R, 2).transpose(1, 2), v.repeat_interleave(R, 2).transpose(1, 2),
        attn_mask=mask,
    )
    return o.transpose(1, 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    card = "h100" if "H100" in torch.cuda.get_device_name() else "h200"
    out_path = args.out or os.path.join(HERE, "results", card, "packed_attention.json")
    free = torch.cuda.mem_get_info()[0]
    rows = []
    for name in args.shapes.split(","):
        H, G, D, T, shortest, longest = SHAPES[name]
        lengths = lengths_for(T, shortest, longest, seed=T + D)
        cu = torch.tensor([0, *lengths]).cumsum(0).to("cuda", torch.int32)
        seg = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, T, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (H, G, G))
        go = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        flops_fwd = 4 * H * D * sum(n * n for n in lengths) / 2
        shape = f"B1-T{T}-H{H}-G{G}-D{D}, {len(lengths)} records of {min(lengths)}-{max(lengths)} tokens"

        forms = {
            "auto": lambda a, b, c: sa.causal_attention(a, b, c, cu_seqlens=cu),
            "varlen": lambda a, b, c: sa.causal_attention(a, b, c, cu_seqlens=cu, backend="varlen"),
            "sdpa per sequence": lambda a, b, c: sa.causal_attention(a, b, c, cu_seqlens=cu, backend="sdpa"),
            "SDPA, block-diagonal mask": lambda a, b, c: masked_sdpa(a, b, c, seg),
            "reference (before)": lambda a, b, c: sa.causal_attention(a, b, c, cu_seqlens=cu, backend="torch"),
        }
        results, outs = {}, {}
        for form, fn in forms.items():
            # the reference holds fp32 scores and probabilities [T, H, T] (and their gradients)
            if form.startswith("reference") and 4 * T * T * H * 4 > 0.8 * free:
                results[form] = None
                continue
            try:
                fwd_ms, fwd_peak = time_and_peak(lambda: fn(q, k, v), 2, args.reps)

                def step():
                    o = fn(qg, kg, vg)
                    return torch.autograd.grad(o, (qg, kg, vg), go)

                fb_ms, fb_peak = time_and_peak(step, 2, args.reps)
                o = fn(qg, kg, vg)
                grads = torch.autograd.grad(o, (qg, kg, vg), go)
                outs[form] = (o.detach(), *grads)
                results[form] = {"fwd_ms": round(fwd_ms, 4), "fwd+bwd_ms": round(fb_ms, 4), "fwd_peak_bytes": fwd_peak,
                                 "fwd+bwd_peak_bytes": fb_peak, "tflops_fwd+bwd": round(3.5 * flops_fwd / fb_ms / 1e9, 1)}  # fmt: skip
            except torch.OutOfMemoryError:
                results[form] = "out of memory"
            torch.cuda.empty_cache()
            print(name, form, results[form], flush=True)
        base = outs["varlen"]
        for form, got in outs.items():
            if form != "varlen":
                results[form]["rel_rms_o_dq_dk_dv_vs_varlen"] = [round(rel_rms(a.float(), b.float()), 5) for a, b in zip(got, base)]

        offsets = cu.tolist()
        results["auto"]["took"] = "sdpa per sequence" if sa._sequence_loop_pays(offsets, H * D) else "varlen"
        ours, sdpa, varlen = results["auto"], results["sdpa per sequence"], results["varlen"]
        for anchor in ("reference (before)", "SDPA, block-diagonal mask"):
            a = results[anchor]
            timed = isinstance(a, dict)
            rows.append({
                "name": "packed causal attention fwd+bwd", "shape": shape, "ours": f"auto ({ours['took']})",
                "ours_ms": ours["fwd+bwd_ms"], "anchor": anchor, "anchor_ms": a["fwd+bwd_ms"] if timed else None,
                "speedup": round(a["fwd+bwd_ms"] / ours["fwd+bwd_ms"], 2) if timed else None,
                "ours_peak_mem_bytes": ours["fwd+bwd_peak_bytes"],
                "anchor_peak_mem_bytes": a["fwd+bwd_peak_bytes"] if timed else None,
                "tflops": ours["tflops_fwd+bwd"],
                "fwd": {"ours_ms": ours["fwd_ms"], "anchor_ms": a["fwd_ms"] if timed else None},
                "forms": results,
                "notes": None if timed else (
                    f"the anchor did not run: {a}" if a else "the anchor was not run: its fp32 scores, probabilities and "
                    f"their gradients ({4 * 4 * T * T * H / 2**30:.0f} GiB) exceed this card's free memory"),
            })  # fmt: skip
        write_results(out_path, rows)
        print(f"{name}: auto ({ours['took']}) {ours['fwd+bwd_ms']} ms, varlen {varlen['fwd+bwd_ms']} ms, "
              f"sdpa per sequence {sdpa['fwd+bwd_ms']} ms", flush=True)
    print("wrote", out_path)


if __name__ == "__main__":
    main()
