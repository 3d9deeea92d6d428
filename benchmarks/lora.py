"""LoRA against full fine-tuning of a ~1B-parameter hybrid MoE, EP=2 + FSDP2 (issue 6).

    torchrun --nproc_per_node 2 benchmarks/lora.py            # 2 H200s: EP=2, FSDP2 over DP=2
    torchrun --nproc_per_node 2 benchmarks/lora.py --tiny     # a CPU smoke run over gloo

Three step kinds on the same model, tokens and GPUs, each timed with CUDA events (median):
  full    every weight trainable: forward, backward, AdamW;
  lora    rank-16 adapters on attention and per-expert adapters, base frozen in bf16, AdamW
          on the adapters;
  frozen  the same frozen base with no adapters: forward and backward of activations only
          (the floor a LoRA step is measured against: issue 6's target is lora <= 1.1x it).
Writes benchmarks/results/h200/lora.json (rank 0).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STATE_DTYPE = "fp32"  # --optimizer-state-dtype
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200", "lora.json")

MODEL = {  # about 1.2B parameters: 8 layers LLLS x 2, 16 experts of 3 x 2048 x 1024
    "model": dict(pattern="LLLS", num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                  kv_channels=128, vocab_size=32768, params_dtype="float32", init_method_std=0.02),
    "linear_attention": dict(variant="gated_delta_rule", num_qk_heads=8, num_v_heads=16, head_k_dim=128,
                             head_v_dim=128, conv_kernel_size=4, chunk_size=64),
    "sparse_attention": dict(topk=512, index_n_heads=8, index_head_dim=64, index_rope_dim=32,
                             indexer_loss_coeff=0.0, stage="sparse"),
    "moe": dict(num_experts=16, topk=4, ffn_hidden_size=1024, shared_expert_ffn_hidden_size=1024,
                aux_loss_coeff=0.01, dispatcher="static"),
    "memory": dict(ce_chunk_size=4096),
    "parallel": dict(fsdp=True, fsdp_param_dtype="bfloat16", fsdp_reduce_dtype="float32"),
    "training": dict(seq_length=2048, micro_batch_size=2, global_batch_size=2, data_path="stdlib"),
}
TINY = {
    "model": dict(pattern="LLLS", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  kv_channels=16, vocab_size=512, params_dtype="float32"),
    "linear_attention": dict(num_qk_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, chunk_size=32),
    "sparse_attention": dict(topk=32, index_n_heads=4, index_head_dim=16, index_rope_dim=8, indexer_loss_coeff=0.0),
    "moe": dict(num_experts=8, topk=2, ffn_hidden_size=64, shared_expert_ffn_hidden_size=32, dispatcher="static"),
    "memory": dict(ce_chunk_size=128),
    "parallel": dict(fsdp=True),
    "training": dict(seq_length=64, micro_batch_size=2, global_batch_size=2, data_path="stdlib"),
}


def build(raw, kind, world, device):
    from megatron.core import parallel_state as ps

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.layers.lora import apply_lora
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.parallel.fsdp import apply_fsdp
    from megatron_moe_hybrid.training.optim import make_optimizer

    overrides = {"parallel.world_size": world, "parallel.expert_model_parallel_size": world,
                 "training.global_batch_size": raw["training"]["micro_batch_size"] * world}
    config = config_from_dict(raw, overrides)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    torch.manual_seed(0)
    model = build_model(config)
    if kind.startswith("lora"):  # "lora_shared": one adapter for all of a rank's experts (Megatron-Bridge's default)
        apply_lora(model, ["linear_attention", "sparse_attention", "experts"], rank=16, alpha=32.0,
                   expert_adapter="shared" if kind == "lora_shared" else "per_expert")
    if kind.startswith("lora") or kind == "frozen":
        for p in model.parameters():
            if kind == "frozen":
                p.requires_grad_(False)
            if not p.requires_grad:  # the frozen base in bf16; adapters stay fp32
                p.data = p.data.to(torch.bfloat16)
    model = model.to(device)
    apply_fsdp(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, 1e-4, (0.9, 0.95), 0.01, STATE_DTYPE) if params else None
    if kind == "frozen":  # activations still need their gradients: start them at the embedding
        model.embedding.register_forward_hook(lambda m, i, out: out.detach().requires_grad_(True))
    return config, model, opt


def count(model, trainable):
    from megatron_moe_hybrid.parallel.data_parallel import is_fsdp_param

    total = 0
    for p in model.parameters():
        if p.requires_grad or not trainable:
            total += p.to_local().numel() if is_fsdp_param(p) else p.numel()
    return total


def run(kind, raw, world, rank, device, reps, warmup):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_moe_hybrid.training.optim import optimizer_state_bytes

    config, model, opt = build(raw, kind, world, device)
    t = config.training
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, config.vocab_size, (t.micro_batch_size, t.seq_length + 1), generator=gen).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(t.seq_length, device=device).expand_as(inputs)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))

    def step():
        loss = model(inputs, position_ids, None, labels=labels).mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    cuda = device.type == "cuda"
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            begin = time.perf_counter()
        losses.append(float(step().detach()))
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - begin) * 1e3
        if i >= warmup:
            times.append(ms)
    ms = torch.tensor(statistics.median(times), dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    peak = torch.tensor(torch.cuda.max_memory_allocated() if cuda else 0, dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens_per_gpu = t.micro_batch_size * t.seq_length
    result = dict(
        kind=kind, ms=round(float(ms), 3), tokens_per_s_per_gpu=round(tokens_per_gpu / float(ms) * 1e3),
        peak_mem_bytes=int(peak), trainable_params_per_rank=count(model, True),
        params_per_rank=count(model, False), first_loss=losses[0], last_loss=losses[-1],
        # this rank's shards (a DTensor's numel() is the global size)
        optimizer_state_bytes_per_rank=optimizer_state_bytes(opt) if opt else 0,
        optimizer_state_dtype=STATE_DTYPE,
    )
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the tiny config (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--kinds", default="frozen,lora,lora_shared,full", help="which steps to time (frozen first)")
    ap.add_argument("--optimizer-state-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="AdamW's moments (training.optimizer_state_dtype); bf16 as DeepSeek-V3")
    args = ap.parse_args()
    global STATE_DTYPE
    STATE_DTYPE = args.optimizer_state_dtype
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron_moe_hybrid.parallel.launch import init_process_group  # plain `python`: a group of one

    init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    raw = TINY if args.tiny else MODEL
    rows = {}
    for kind in args.kinds.split(","):
        try:
            rows[kind] = run(kind, raw, world, rank, device, args.reps, args.warmup)
        except Exception as e:  # an OOM or a failure of one kind is recorded, the others still run
            rows[kind] = {"kind": kind, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        if rank == 0:
            print(rows[kind], flush=True)
    if rank == 0 and not args.tiny and set(rows) == {"frozen", "lora", "lora_shared", "full"}:
        from common import write_results

        shape = f"L8-H2048-E16-K4-F1024-T{raw['training']['seq_length']}-B{raw['training']['micro_batch_size']}-EP{world}-FSDP2-bf16"
        frozen, lora, full = rows["frozen"], rows["lora"], rows["full"]
        out = []
        for name, ours, anchor, target, note in (
            ("lora r16 step vs frozen base fwd+bwd", lora, frozen, 1 / 1.1,
             "issue 6 target: LoRA adds <= 10% over the frozen base's forward+backward (speedup >= 0.909)"),
            ("lora r16, shared expert adapter, step vs frozen base fwd+bwd", rows["lora_shared"], frozen, 1 / 1.1,
             "lora.expert_adapter=shared: one adapter for all of a rank's experts"),
            ("lora r16 step vs full fine-tuning step", lora, full, None, "same model, tokens and GPUs"),
        ):
            ok = "ms" in ours and "ms" in anchor
            out.append({
                "name": name, "shape": shape, "gpus": world,
                "ours_ms": ours.get("ms"), "anchor": f"{anchor['kind']} step", "anchor_ms": anchor.get("ms"),
                "speedup": round(anchor["ms"] / ours["ms"], 3) if ok else None, "target_speedup": target,
                "ours_peak_mem_bytes": ours.get("peak_mem_bytes"), "anchor_peak_mem_bytes": anchor.get("peak_mem_bytes"),
                "ours": ours, "anchor_detail": anchor,
                # issue 6 target: adapter optimizer state under 1% of the bf16 base per rank
                "adapter_optimizer_state_over_base": round(
                    ours["optimizer_state_bytes_per_rank"] / (2 * frozen["params_per_rank"]), 4
                ) if "optimizer_state_bytes_per_rank" in ours and "params_per_rank" in frozen else None,
                "notes": f"{note}; median of {args.reps} steps after {args.warmup}, CUDA events, max over ranks; "
                         "linear attention on backend auto (the Triton chunk kernels for FSDP2's bf16 compute), "
                         "sparse attention on the reference",
            })
        write_results(args.out, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
