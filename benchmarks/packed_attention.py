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
The last shape is the sparse layer's dense warm-up under CP=8 at 128k tokens: one rank's two
zigzag pieces (q_ranges) over every key.
FLOPs count the query-key pairs the causal masks keep: forward 4 H D pairs, backward 2.5 times it.
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

SHAPES = {  # name: (H, G, D, T keys, shortest, longest record (None: one sequence), this rank's query runs or None)
    "qwen3next-T8192": (16, 2, 256, 8192, 256, 4096, None),
    "qwen3next-T32768": (16, 2, 256, 32768, 512, 8192, None),
    "chat-T16384-short": (16, 2, 128, 16384, 16, 512, None),
    "h8d128-T32768": (8, 1, 128, 32768, 1024, 8192, None),
    # the sparse layer's dense warm-up under CP=8 at 128k (zigzag): rank 0's pieces 0 and 15 of 16
    "cp8-rank0-T131072": (16, 2, 128, 131072, None, None, [(0, 8192), (122880, 131072)]),
}


def lengths_for(T, shortest, longest, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < T:
        out.append(int(torch.randint(shortest, longest + 1, (1,), generator=gen)))
    out[-1] -= sum(out) - T
    return [n for n in out if n > 0]


def block_causal_mask(seg, q_pos):
    """[T, S] bool: a query reads the keys of its own sequence up to its position."""
    pos = torch.arange(seg.numel(), device=seg.device)
    return (seg[q_pos][:, None] == seg[None, :]) & (q_pos[:, None] >= pos[None, :])


def masked_sdpa(q, k, v, mask):
    """Whole-row SDPA with a block-diagonal causal bool mask (built once), k/v repeated to H heads."""
    R = q.shape[2] // k.shape[2]
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
        H, G, D, S, shortest, longest, runs = SHAPES[name]
        lengths = [S] if shortest is None else lengths_for(S, shortest, longest, seed=S + D)
        cu = None if shortest is None else torch.tensor([0, *lengths]).cumsum(0).to("cuda", torch.int32)
        seg = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))
        q_runs = runs or [(0, S)]
        q_pos = torch.cat([torch.arange(a, b, device="cuda") for a, b in q_runs])
        T = q_pos.numel()
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(1, S, G, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        go = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        pieces = sa._pieces(q_runs, None if cu is None else cu.tolist(), S)
        pairs = sum((hi - lo) * (hi - st) - (hi - lo) ** 2 / 2 for _, run in pieces for lo, hi, st in run)
        flops_fwd = 4 * H * D * pairs
        shape = (f"B1-T{S}-H{H}-G{G}-D{D}, {len(lengths)} records of {min(lengths)}-{max(lengths)} tokens" if runs is None
                 else f"B1-S{S}-H{H}-G{G}-D{D}, {T} queries at {runs} (one sequence)")  # fmt: skip
        kw = dict(cu_seqlens=cu, q_ranges=runs)
        mask = block_causal_mask(seg, q_pos)

        forms = {
            "auto": lambda a, b, c: sa.causal_attention(a, b, c, **kw),
            "varlen": lambda a, b, c: sa.causal_attention(a, b, c, backend="varlen", **kw),
            "sdpa per sequence": lambda a, b, c: sa.causal_attention(a, b, c, backend="sdpa", **kw),
            "SDPA, block-diagonal mask": lambda a, b, c: masked_sdpa(a, b, c, mask),
            "reference (before)": lambda a, b, c: sa.causal_attention(a, b, c, backend="torch", **kw),
        }
        results, outs = {}, {}
        for form, fn in forms.items():
            # the reference holds fp32 scores and probabilities [T, H, T] (and their gradients)
            if form.startswith("reference") and 4 * T * S * H * 4 > 0.8 * free:
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

        results["auto"]["took"] = "sdpa per sequence" if sa._sequence_loop_pays(pieces, H * D) else "varlen"
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
                    f"their gradients ({4 * 4 * T * S * H / 2**30:.0f} GiB) exceed this card's free memory"),
            })  # fmt: skip
        del mask
        write_results(out_path, rows)
        print(f"{name}: auto ({ours['took']}) {ours['fwd+bwd_ms']} ms, varlen {varlen['fwd+bwd_ms']} ms, "
              f"sdpa per sequence {sdpa['fwd+bwd_ms']} ms", flush=True)
    print("wrote", out_path)


if __name__ == "__main__":
    main()
