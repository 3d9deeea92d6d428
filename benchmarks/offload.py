"""Host-memory activation offload against full recomputation, one H200 (issue 7).

    python benchmarks/offload.py                                  # writes benchmarks/results/h200/offload.json
    python benchmarks/offload.py --tiny --out /tmp/offload.json   # CPU smoke run of the same code

Three modes on the same hybrid MoE model (bf16, EP=1, no FSDP) and tokens, one step being a
forward + backward (no optimizer; gradients are freed after each step):
  off        plain autograd: every saved activation stays on the device;
  offload    ActivationOffload around the forward: the tensors saved by the selected modules
             (--modules, default the experts and the attention core ops; --fraction of the
             layers) go to pinned host memory and are prefetched back layer by layer;
  recompute  torch.utils.checkpoint (non-reentrant) around every transformer layer.
Each mode: median step time over --reps steps after --warmup (CUDA events), peak memory
allocated above what was live before its first step (weights and tokens), and for offload the
bytes moved and the stall (device time the compute stream waited for copies).
The row's speedup is recompute_ms / offload_ms (issue 7's target: >= 1.15 with the stall under
5% of the step).
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_moe_hybrid.parallel.offload import DEFAULT_MODULES  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200", "offload.json")

MODEL = {  # lora.py's ~1.2B model: 8 layers LLLS x 2, 16 experts of 3 x 2048 x 1024
    "model": dict(pattern="LLLS", num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                  kv_channels=128, vocab_size=32768, params_dtype="bfloat16", init_method_std=0.02),
    "linear_attention": dict(variant="gated_delta_rule", num_qk_heads=8, num_v_heads=16, head_k_dim=128,
                             head_v_dim=128, conv_kernel_size=4, chunk_size=64),
    # topk 64: the reference sparse attention gathers [T, topk] keys per head, a transient that
    # at topk 512 outweighs every saved activation and would hide what offload saves
    "sparse_attention": dict(topk=64, index_n_heads=8, index_head_dim=64, index_rope_dim=32,
                             indexer_loss_coeff=0.0, stage="sparse"),
    "moe": dict(num_experts=16, topk=4, ffn_hidden_size=1024, shared_expert_ffn_hidden_size=1024,
                aux_loss_coeff=0.01, dispatcher="static"),
    "memory": dict(ce_chunk_size=4096),
    "training": dict(seq_length=8192, micro_batch_size=1, global_batch_size=1, data_path="stdlib"),
}
TINY = {
    "model": dict(pattern="LLLS", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  kv_channels=16, vocab_size=512, params_dtype="float32"),
    "linear_attention": dict(num_qk_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, chunk_size=32),
    "sparse_attention": dict(topk=32, index_n_heads=4, index_head_dim=16, index_rope_dim=8, indexer_loss_coeff=0.0),
    "moe": dict(num_experts=8, topk=2, ffn_hidden_size=64, shared_expert_ffn_hidden_size=32, dispatcher="static"),
    "memory": dict(ce_chunk_size=128),
    "training": dict(seq_length=64, micro_batch_size=2, global_batch_size=2, data_path="stdlib"),
}
MODES = ("off", "offload", "recompute")


def build(raw, device):
    from megatron.core import parallel_state as ps

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model

    config = config_from_dict(raw, {"parallel.world_size": 1})
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    torch.manual_seed(0)
    return config, build_model(config).to(device)


def batch(config, device) -> tuple:
    """(inputs, labels, position_ids), each [b, s]: one micro-batch of seeded random tokens."""
    t = config.training
    gen = torch.Generator().manual_seed(100)
    tokens = torch.randint(0, config.vocab_size, (t.micro_batch_size, t.seq_length + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(t.seq_length, device=device).expand(t.micro_batch_size, -1)


def checkpoint_every_layer(model) -> None:
    """Full recomputation: each transformer layer keeps only its inputs for the backward."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for layer in model.decoder.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def measure(step, warmup: int, reps: int, cuda: bool) -> tuple[float, int | None]:
    """(median ms, peak bytes above what was live before the first step; None on CPU)."""
    if cuda:
        from common import time_and_peak

        return time_and_peak(step, warmup, reps)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        step()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times), None


def run(raw, modules, fraction, min_bytes, device, warmup, reps) -> dict:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_moe_hybrid.parallel.offload import ActivationOffload

    cuda = device.type == "cuda"
    config, model = build(raw, device)
    inputs, labels, position_ids = batch(config, device)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    offload = ActivationOffload(model, modules, fraction, min_bytes)
    results = {}
    for mode in MODES:
        if mode == "recompute":
            checkpoint_every_layer(model)
        losses = []

        def step():
            offload.reset_stats()
            if mode == "offload":
                with offload:
                    loss = model(inputs, position_ids, None, labels=labels).mean()
            else:
                loss = model(inputs, position_ids, None, labels=labels).mean()
            loss.backward()
            model.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        try:
            ms, peak = measure(step, warmup, reps, cuda)
            results[mode] = dict(ms=round(ms, 3), peak_mem_bytes=peak, first_loss=float(losses[0]))
            if mode == "offload":
                stats = offload.stats()  # of the last step
                results[mode].update(
                    offloaded_bytes=stats["bytes"], offloaded_tensors=stats["tensors"],
                    stall_ms=round(stats["device_stall_ms"] if cuda else stats["stall_ms"], 3),
                    host_stall_ms=round(stats["stall_ms"], 3), prefetched=stats["prefetched"],
                    on_demand=stats["on_demand"], pool_buffers=stats["pool_buffers"],
                )
        except torch.OutOfMemoryError as e:  # "off" may not fit: the others still run
            results[mode] = {"error": f"OutOfMemoryError: {str(e)[:200]}"}
        print(mode, results[mode], flush=True)
        if cuda:
            torch.cuda.empty_cache()
    return results


def row(results, raw, args, device_name) -> dict:
    m, t = raw["model"], raw["training"]
    off, ours, anchor = (results[k] for k in MODES)
    ok = "ms" in ours and "ms" in anchor
    shape = (f"L{m['num_layers']}-H{m['hidden_size']}-E{raw['moe']['num_experts']}-K{raw['moe']['topk']}"
             f"-F{raw['moe']['ffn_hidden_size']}-B{t['micro_batch_size']}-T{t['seq_length']}-{m['params_dtype']}")
    return {
        "name": "offload step", "shape": shape,
        "ours_ms": ours.get("ms"), "anchor": "full recomputation", "anchor_ms": anchor.get("ms"),
        "speedup": round(anchor["ms"] / ours["ms"], 3) if ok else None, "target_speedup": 1.15,
        "ours_peak_mem_bytes": ours.get("peak_mem_bytes"), "anchor_peak_mem_bytes": anchor.get("peak_mem_bytes"),
        "off_ms": off.get("ms"), "off_peak_mem_bytes": off.get("peak_mem_bytes"),
        "stall_ms": ours.get("stall_ms"),
        "stall_fraction": round(ours["stall_ms"] / ours["ms"], 4) if "ms" in ours else None,
        "offloaded_bytes": ours.get("offloaded_bytes"), "modes": results,
        "notes": f"forward+backward, no optimizer; median of {args.reps} steps after {args.warmup} on "
                 f"{device_name}; offload modules {args.modules}, fraction {args.fraction}, min {args.min_bytes} "
                 "bytes; recompute: "
                 "torch.utils.checkpoint around every layer; linear/sparse attention: torch reference backends",
    }


def write(path, rows, device_name) -> None:
    if device_name != "cpu":
        from common import write_results

        write_results(path, rows)
        return
    from common import git_sha, versions

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": "cpu", "date": time.strftime("%Y-%m-%d"), "git_sha": git_sha(),
                   "command": "python " + " ".join(sys.argv), "versions": versions(), "rows": rows}, f, indent=2)


@contextlib.contextmanager
def one_process_group():
    """A one-process gloo group for Megatron's parallel_state, unless the caller has one (the CPU
    smoke test's stays theirs); destroyed, with parallel_state, at the end. Its store is an
    in-process HashStore: no port to take (a free port picked first could be taken by another
    process before the group binds it)."""
    own_group = not dist.is_initialized()
    if own_group:
        from megatron_moe_hybrid.parallel.launch import init_one_process_group

        init_one_process_group("gloo")
    try:
        yield
    finally:
        if own_group:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the tiny config on CPU (smoke run)")
    ap.add_argument("--seq", type=int, default=None, help="override training.seq_length")
    ap.add_argument("--batch", type=int, default=None, help="override training.micro_batch_size")
    ap.add_argument("--modules", default=",".join(DEFAULT_MODULES), help="offload module patterns, comma-separated")
    ap.add_argument("--fraction", type=float, default=1.0, help="offload in this share of the layers")
    ap.add_argument("--min-bytes", type=int, default=None, help="offload threshold (default 1 MiB; tiny: 0)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    raw = {k: dict(v) for k, v in (TINY if args.tiny else MODEL).items()}
    for key, value in (("seq_length", args.seq), ("micro_batch_size", args.batch)):
        if value is not None:
            raw["training"][key] = value
    raw["training"]["global_batch_size"] = raw["training"]["micro_batch_size"]
    args.min_bytes = args.min_bytes if args.min_bytes is not None else (0 if args.tiny else 1 << 20)
    args.reps = args.reps or (3 if args.tiny else 8)
    args.modules = [p for p in args.modules.split(",") if p]
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    with one_process_group():
        results = run(raw, args.modules, args.fraction, args.min_bytes, device, args.warmup, args.reps)
        write(args.out, [row(results, raw, args, device_name)], device_name)


if __name__ == "__main__":
    main()
