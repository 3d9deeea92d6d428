"""The MLA sparse-attention layer (pattern letter M, DeepSeek-V3.2's shape) in its two forms, one
H200, forward+backward: mla.absorbed (W_UK folded into q, one latent kv of 576/512 for all 128
heads, the fused indexer top-k, sparse attention and chunked KL loss) against the HF-exact form
(k and v per head from the kv up-projection, dense [T, S] index scores, the same fused sparse
attention), which is what the layer runs with mla.absorbed false.

    python benchmarks/mla_layer.py [--seqs 4096,16384,32768] [--out benchmarks/results/h200/mla_layer.json]

The whole layer (projections, norms, RoPE, indexer, top-2048 attention, output projection and,
in the sparse stage, the indexer KL loss with coefficient 0.01), bf16 weights and activations,
B1, hidden 7168, 128 heads, q latent 1536, kv latent 512, nope/rope/value 128/64/128, indexer
64 heads x 128. Median of CUDA-event timings; peak memory above the inputs and weights.
"""

import argparse
import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import time_and_peak, write_results  # noqa: E402

OUT = os.path.join(HERE, "results", "h200", "mla_layer.json")
SHAPE = dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, index_heads=64,
             index_dim=128, topk=2048)


def build(absorbed: bool, seed: int = 0):
    from megatron.core.transformer import TransformerConfig

    from megatron_moe_hybrid.config import MLAConfig, SparseAttentionConfig
    from megatron_moe_hybrid.layers.mla_attention import MLAttention, MLAttentionSubmodules

    s = SHAPE
    cfg = TransformerConfig(num_layers=1, hidden_size=s["hidden"], num_attention_heads=s["heads"],
                            use_cpu_initialization=True, params_dtype=torch.float32)
    cfg.mla = MLAConfig(q_lora_rank=s["q_lora"], kv_lora_rank=s["kv_lora"], qk_nope_head_dim=s["nope"],
                        qk_rope_head_dim=s["rope"], v_head_dim=s["v"], absorbed=absorbed)
    cfg.sparse_attention = SparseAttentionConfig(topk=s["topk"], index_n_heads=s["index_heads"],
                                                 index_head_dim=s["index_dim"])
    torch.manual_seed(seed)
    layer = MLAttention(cfg, MLAttentionSubmodules())
    layer.indexer_loss_coeff = 0.01
    return layer.cuda().bfloat16().train()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="4096,16384,32768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_moe_hybrid.testing import init_megatron, rel_rms

    init_megatron()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device="cuda"))
    hf_form, absorbed = build(False), build(True)
    absorbed.load_state_dict(hf_form.state_dict())
    rows = []
    for T in [int(t) for t in args.seqs.split(",")]:
        x = torch.randn(T, 1, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        results, outs, errors = {}, {}, {}
        for name, layer in (("absorbed", absorbed), ("hf_form", hf_form)):
            def step(layer=layer):
                layer.zero_grad(set_to_none=True)
                x.grad = None
                y, _ = layer(x, attention_mask=None)
                y.backward(dy)
                return y

            try:
                outs[name] = step().detach().float()
                results[name] = time_and_peak(step, warmup=1, reps=args.reps)
                print(f"T{T} {name}: {results[name][0]:.2f} ms, peak {results[name][1] / 2**30:.2f} GiB", flush=True)
            except torch.OutOfMemoryError as e:
                traceback.print_exc(limit=-3)
                results[name] = (None, None)
                errors[name] = "OutOfMemoryError: " + str(e).splitlines()[0][:120]
            torch.cuda.empty_cache()
        (ours, ours_peak), (anchor, anchor_peak) = results["absorbed"], results["hf_form"]
        row = {"name": "mla layer fwd+bwd (sparse stage, indexer loss on)",
               "shape": f"B1-T{T}-h7168-H128-C512-R64-N128-V128-HI64-DI128-k2048-bf16",
               "ours_ms": round(ours, 3) if ours else None, "anchor": "ours, HF-exact form (mla.absorbed false)",
               "anchor_ms": round(anchor, 3) if anchor else None,
               "speedup": round(anchor / ours, 3) if ours and anchor else None, "target_speedup": None,
               "ours_peak_mem_bytes": ours_peak, "anchor_peak_mem_bytes": anchor_peak,
               "notes": f"median of {args.reps} after 1 warm-up, CUDA events; backend auto (Triton) in both; "
                        "the forms' outputs: rel. RMS difference "
                        + (f"{rel_rms(outs['absorbed'], outs['hf_form']):.2e}" if len(outs) == 2 else "n/a")}
        for name, error in errors.items():
            row["ours_error" if name == "absorbed" else "anchor_error"] = error
        rows.append(row)
        write_results(args.out, rows)


if __name__ == "__main__":
    main()
