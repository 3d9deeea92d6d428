"""Context parallelism of one LLLS block group (issue 9): time and memory per rank, 1 vs 2 GPUs.

    python benchmarks/context_parallel.py --seqs 8192,16384,32768 --out /tmp/cp1.json
    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --seqs 16384,32768 \\
        --baseline /tmp/cp1.json --out benchmarks/results/h200/context_parallel.json
    python benchmarks/context_parallel.py --tiny --out /tmp/cp_tiny.json   # CPU smoke run

The model is one pattern group (3 Gated DeltaNet layers, 1 top-k sparse layer, an MoE MLP in
each) between the embedding and the chunked loss, in bf16; a step is forward + backward
(no optimizer). The world size is the context-parallel size; every rank holds its zigzag
pieces of the same sequence. A single-process run tries each length in turn and records
the first that runs out of memory; a CP run with --baseline writes the results file with
the scaling efficiency t(1 GPU) / (P x t(P GPUs)) at every length both ran.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODEL = {  # one LLLS group at the lora benchmark's width, sparse attention at the flagship top-k
    "model": dict(pattern="LLLS", num_layers=4, hidden_size=2048, num_attention_heads=16, num_query_groups=1,
                  kv_channels=128, vocab_size=32768, params_dtype="float32", init_method_std=0.02),
    "linear_attention": dict(variant="gated_delta_rule", num_qk_heads=16, num_v_heads=16, head_k_dim=128,
                             head_v_dim=128, conv_kernel_size=4, chunk_size=64),
    "sparse_attention": dict(topk=2048, index_n_heads=16, index_head_dim=64, index_rope_dim=32,
                             indexer_loss_coeff=0.0, stage="sparse"),
    "moe": dict(num_experts=16, topk=4, ffn_hidden_size=1024, aux_loss_coeff=0.01),
    "memory": dict(ce_chunk_size=4096),
    "training": dict(micro_batch_size=1, global_batch_size=1, data_path="stdlib"),
}
TINY = {
    "model": dict(pattern="LLLS", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=1,
                  kv_channels=16, vocab_size=512, params_dtype="float32"),
    "linear_attention": dict(num_qk_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16, chunk_size=16),
    "sparse_attention": dict(topk=16, index_n_heads=2, index_head_dim=16, index_rope_dim=8, indexer_loss_coeff=0.0),
    "moe": dict(num_experts=4, topk=2, ffn_hidden_size=64, dispatcher="alltoall"),
    "memory": dict(ce_chunk_size=128),
    "training": dict(micro_batch_size=1, global_batch_size=1, data_path="stdlib"),
}


def build(raw, seq, world, device):
    from megatron.core import parallel_state as ps

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model

    config = config_from_dict(raw, {"parallel.world_size": world, "parallel.context_parallel_size": world,
                                    "training.seq_length": seq})
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=world)
    torch.manual_seed(0)
    model = build_model(config).to(device=device, dtype=torch.bfloat16)
    return config, model


def run(raw, seq, world, rank, device, reps, warmup):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_moe_hybrid.parallel.context_parallel import CPLayout

    config, model = build(raw, seq, world, device)
    gen = torch.Generator().manual_seed(1)  # the same sequence on every rank
    tokens = torch.randint(0, config.vocab_size, (1, seq + 1), generator=gen).to(device)
    layout = CPLayout.from_parallel_state(seq)
    inputs, labels = layout.shard(tokens[:, :-1], 1), layout.shard(tokens[:, 1:], 1)  # [1, seq / P]
    positions = layout.positions(device).expand_as(inputs)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))

    def step():
        loss = model(inputs, positions, None, labels=labels).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        begin = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - begin) * 1e3)
    ms = torch.tensor(statistics.median(times), dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    peak = torch.tensor(torch.cuda.max_memory_allocated() - base if cuda else 0, dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return {"seq": seq, "cp": world, "ms": round(float(ms), 2), "peak_mem_bytes_per_rank": int(peak),
            "tokens_per_s": round(seq / float(ms) * 1e3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,16384,32768", help="comma-separated global sequence lengths")
    ap.add_argument("--tiny", action="store_true", help="the tiny config (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--baseline", default=None, help="the single-GPU run's --out file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", default=None, help="the planner's JSON projection to add to the results")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron_moe_hybrid.parallel.launch import init_process_group  # plain `python`: a group of one

    init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    raw = TINY if args.tiny else MODEL
    runs = []
    for seq in (int(s) for s in args.seqs.split(",")):
        try:
            runs.append(run(raw, seq, world, rank, device, args.reps, args.warmup))
        except torch.OutOfMemoryError as e:
            # Only a single process may go on after an OOM: CP ranks could be stuck in a collective.
            runs.append({"seq": seq, "cp": world, "error": f"OutOfMemoryError: {str(e)[:200]}"})
            if world > 1:
                raise
            torch.cuda.empty_cache()
            if rank == 0:
                print(runs[-1], flush=True)
            break  # longer ones will not fit either
        if rank == 0:
            print(runs[-1], flush=True)
    if rank == 0:
        if args.baseline is None:
            with open(args.out, "w") as f:
                json.dump({"runs": runs}, f, indent=1)
        else:
            write(args, runs, world)
    dist.destroy_process_group()


def write(args, runs, world):
    from common import write_results

    with open(args.baseline) as f:
        single = {r["seq"]: r for r in json.load(f)["runs"]}
    rows = []
    for r in runs:
        one = single.get(r["seq"], {})
        fits_one = "ms" in one
        shape = f"LLLS-H2048-GDN16x128-SA16q1kv-top2048-E16K4-T{r['seq']}-bf16"
        rows.append({
            "name": f"LLLS block fwd+bwd, CP={world} vs 1 GPU",
            "shape": shape, "gpus": world,
            "ours_ms": r.get("ms"), "anchor": "the same block on 1 GPU (CP=1)",
            "anchor_ms": one.get("ms"),
            "speedup": round(one["ms"] / r["ms"], 3) if fits_one and "ms" in r else None,
            "scaling_efficiency": round(one["ms"] / (world * r["ms"]), 3) if fits_one and "ms" in r else None,
            "target_speedup": 1.6, "target_scaling_efficiency": 0.8,
            "ours_peak_mem_bytes": r.get("peak_mem_bytes_per_rank"),
            "anchor_peak_mem_bytes": one.get("peak_mem_bytes_per_rank"),
            "anchor_error": one.get("error") if not fits_one else None,
            "notes": (f"median of {args.reps} after {args.warmup}, wall clock with synchronize, max over ranks; "
                      "peak = max over ranks above the model and inputs; zigzag layout; reference (unfused) "
                      "Gated DeltaNet and sparse attention ops: issues 3 and 4 own the kernels"
                      + ("" if fits_one else "; does not fit on one GPU")),
        })
    extra = {"single_gpu_runs": list(single.values())}
    if args.plan:
        with open(args.plan) as f:
            extra["flagship_1M_projection"] = json.load(f)
    write_results(args.out, rows)
    with open(args.out) as f:
        result = json.load(f)
    result.update(extra)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
