"""Kernel-time table of our MoE layer (static dispatcher) at issue 5's first shape, one GPU:
where the forward+backward and the dispatch+combine alone spend their time.

    python benchmarks/device/profile_moe.py [--tokens 16384 --hidden 2048 --experts 64 --topk 8 --ffn 1408]
"""

import argparse
import types

import torch
from megatron.core.transformer import TransformerConfig
from torch.profiler import ProfilerActivity, profile

from megatron_moe_hybrid.layers.moe import MoELayer


def main():
    p = argparse.ArgumentParser()
    for name, default in (("tokens", 16384), ("hidden", 2048), ("experts", 64), ("topk", 8), ("ffn", 1408)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    cfg = TransformerConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=16, params_dtype=torch.bfloat16)
    cfg.moe = types.SimpleNamespace(
        num_experts=a.experts, topk=a.topk, ffn_hidden_size=a.ffn, shared_expert_ffn_hidden_size=0,
        score_func="softmax", aux_loss_coeff=0.0, expert_bias=False, bias_update_rate=1e-3,
        capacity_factor=None, dispatcher="static",
    )
    with torch.device("cuda"):
        layer = MoELayer(cfg)
    x = torch.randn(a.tokens, 1, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    probs, topk_idx = layer.router(x.view(-1, a.hidden).detach())
    d = layer.dispatcher

    def dispatch_only():
        with torch.no_grad():
            send = d.dispatch_preprocess(x.view(-1, a.hidden), topk_idx)
            xs, counts = d.dispatch_postprocess(d.token_dispatch(send))
            return d.combine_postprocess(d.token_combine(d.combine_preprocess(xs)), probs)

    def step():
        layer(x)[0].backward(g)

    for name, fn in (("dispatch+combine (forward)", dispatch_only), ("layer forward+backward", step)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"\n== {name}: kernel times summed over 5 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main()
