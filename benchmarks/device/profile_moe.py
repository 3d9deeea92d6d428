"""Kernel-time table of our MoE layer (static dispatcher) at issue 5's first shape, one GPU:
where the forward+backward and the dispatch+combine alone spend their time, and the GPU idle
gaps between kernels with the CPU ops that launched the kernel after each (the host falling
behind a run of small kernels).

    python benchmarks/device/profile_moe.py [--tokens 16384 --hidden 2048 --experts 64 --topk 8 --ffn 1408] [--accumulate]
    torchrun --nproc_per_node 2 benchmarks/device/profile_moe.py    (EP=2; rank 0 prints)
"""

import argparse
import json
import os
import sys
import tempfile
import types

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig
from torch.profiler import ProfilerActivity, profile

from megatron_moe_hybrid.layers.moe import MoELayer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import mean_event_ms  # noqa: E402


def idle_gaps(trace_path, min_us=15):
    """GPU idle gaps longer than min_us in a chrome trace, each with the CPU ops that launched the next kernel."""
    events = json.load(open(trace_path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"}
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    start, end = kernels[0]["ts"], kernels[0]["ts"] + kernels[0]["dur"]
    busy = sum(e["dur"] for e in kernels)
    print(f"span {(max(e['ts'] + e['dur'] for e in kernels) - start) / 1e3:.2f} ms, kernels busy {busy / 1e3:.2f} ms, {len(kernels)} kernels")
    gaps = []  # (idle us, at ms, next kernel, the innermost CPU ops that launched it)
    for e in kernels[1:]:
        gap = e["ts"] - end
        if gap > min_us:
            launch = launches.get(e["args"].get("correlation"))
            inner = sorted((c for c in cpu_ops if launch and c["ts"] <= launch["ts"] <= c["ts"] + c["dur"]), key=lambda c: c["dur"])
            gaps.append((gap, (e["ts"] - start) / 1e3, e["name"][:40], [c["name"] for c in inner[:3]]))
        end = max(end, e["ts"] + e["dur"])
    print(f"idle gaps > {min_us} us: {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)}; the 20 longest:")
    for gap, at, name, ops in sorted(gaps, reverse=True)[:20]:
        print(f"  idle {gap:6.0f} us at {at:7.3f} ms before {name:40s} <- {ops}")


def main():
    p = argparse.ArgumentParser()
    for name, default in (("tokens", 16384), ("hidden", 2048), ("experts", 64), ("topk", 8), ("ffn", 1408)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--accumulate", action="store_true",
                   help="keep the weights' .grad between calls (every call a micro-batch after the first: the "
                        "gradients are added into .grad); by default each call starts without gradients")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if world > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        group = dist.group.WORLD
    rank = 0 if group is None else dist.get_rank()
    torch.manual_seed(rank)
    cfg = TransformerConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=16, params_dtype=torch.bfloat16)
    cfg.moe = types.SimpleNamespace(
        num_experts=a.experts, topk=a.topk, ffn_hidden_size=a.ffn, shared_expert_ffn_hidden_size=0,
        score_func="softmax", aux_loss_coeff=0.0, expert_bias=False, bias_update_rate=1e-3,
        capacity_factor=None, dispatcher="static", dispatch_chunks=a.chunks,
    )
    with torch.device("cuda"):
        layer = MoELayer(cfg, ep_group=group)
    x = torch.randn(a.tokens, 1, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    probs, topk_idx = layer.router(x.view(-1, a.hidden).detach())
    d = layer.dispatcher

    def dispatch_only():
        with torch.no_grad():
            send = d.dispatch_preprocess(x.view(-1, a.hidden), topk_idx, probs)
            xs, counts = d.dispatch_postprocess(d.token_dispatch(send))
            return d.combine_postprocess(d.token_combine(d.combine_preprocess(xs)), probs)

    def step():
        if not a.accumulate:  # a step's first micro-batch: no gradient to add into
            for param in layer.parameters():
                param.grad = None
        layer(x)[0].backward(g)

    for name, fn in (("dispatch+combine (forward)", dispatch_only), ("layer forward+backward", step)):
        ms = mean_event_ms(fn, 3, 5)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        if rank == 0:
            print(f"\n== {name} (EP={world}): {ms:.3f} ms per call; kernel times over 5 calls")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
            # where the GPU waits for the host (over the 5 calls; small kernels launched back to back)
            with tempfile.TemporaryDirectory() as tmp:
                prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
                idle_gaps(os.path.join(tmp, "trace.json"))
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
