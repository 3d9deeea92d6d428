"""Where the memory of one training step of end_to_end.py's job goes: builds the job's model
(random weights, LoRA as end_to_end does) and runs one forward + backward + optimizer step.
Prints the allocated memory after each layer's forward and after each layer's backward (a
steady climb through the backward is memory something keeps), and the live memory at the
forward's peak grouped by the innermost frame of ours (or Megatron's) that allocated it.
The allocator history is recorded over the forward only: with torch 2.11 a history recorded
while a recomputed layer runs its backward breaks the recompute with a SystemError
(pytorch #179536).

    python benchmarks/device/probe_memory.py --job c131072 [--top 30] [--layers 8]
        [--recompute N] [--override moe.dispatch_chunks=4]
    python benchmarks/device/probe_memory.py --job c256 --tiny     # the script itself, on the CPU

On the CPU (--tiny) it runs the step and reports nothing but the loss.
"""

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import end_to_end as e2e  # noqa: E402

OURS = ("megatron_moe_hybrid", "megatron/core")


def key_frame(frames) -> str:
    """The innermost frame in our package (else Megatron's), as file:line(function)."""
    for f in frames:
        name = f.get("filename", "")
        if any(p in name for p in OURS):
            short = name.split("site-packages/")[-1].split("/work/")[-1]
            return f"{short}:{f.get('line')}({f.get('name')})"
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py") and "torch/" not in name:
            return f"{os.path.basename(name)}:{f.get('line')}({f.get('name')})"
    return "(no python frame: autograd engine / C++)"


def live_at_peak(snapshot) -> tuple[int, dict]:
    """Replays the allocator trace: the highest live total and the live blocks at that point."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live, total, peak, peak_i = {}, 0, -1, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_i = total, i
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            total -= live.pop(e["addr"])
    live = {}
    for e in events[: peak_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    return peak, live


def report(blocks, top: int, title: str) -> dict:
    groups = collections.defaultdict(lambda: [0, 0])
    for e in blocks:
        g = groups[key_frame(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    total = sum(e["size"] for e in blocks)
    print(f"\n== {title}: {total / 2**30:.2f} GiB in {len(blocks)} blocks (traced allocations only)", flush=True)
    for k, (n, c) in rows[:top]:
        print(f"  {n / 2**30:8.3f} GiB  {c:6d} x  {k}", flush=True)
    return {k: [n, c] for k, (n, c) in rows[:top]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", default="c131072")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (keeps the pattern)")
    ap.add_argument("--recompute", type=int, default=None, help="memory.recompute_layers (default: end_to_end's rule)")
    ap.add_argument("--override", action="append", default=[], help="key=value (YAML value) config overrides")
    ap.add_argument("--out", default=None, help="a JSON of the grouped live memory")
    args = ap.parse_args()
    kind, T, B, _ = e2e.parse_job(args.job)
    B = B or 1
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
    dist.init_process_group("nccl" if cuda else "gloo")
    sys.path.insert(0, os.path.join(e2e.ROOT, "tools"))
    import yaml
    from import_hf_config import import_hf_config

    cfg = e2e.hf_config(args.tiny)
    raw, _ = import_hf_config(cfg.to_dict())
    raw["model"]["params_dtype"] = "bfloat16" if cuda else "float32"
    if args.layers:
        raw["model"]["num_layers"] = args.layers
    run_dir = tempfile.mkdtemp(prefix="probe-")
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(raw, f)
    pattern = "LLLS" if kind == "c" else "LLLA"
    extra = {"memory.recompute_layers": args.recompute} if args.recompute is not None else {}
    for kv in args.override:
        k, v = kv.split("=", 1)
        extra[k] = yaml.safe_load(v)
    if extra:  # our_model applies SPARSE after its own overrides (c jobs only)
        if "S" not in pattern:
            raise SystemExit("error: --recompute/--override: only for c jobs")
        e2e.SPARSE = {**e2e.SPARSE, **extra}
    t0 = time.perf_counter()
    config, model = e2e.our_model(run_dir, device, pattern, T, args.tiny, load=False)
    print(f"built in {time.perf_counter() - t0:.0f} s; recompute_layers {config.memory.recompute_layers}", flush=True)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_moe_hybrid.layers.lora import apply_lora

    if kind != "b":
        apply_lora(model, e2e.OUR_LORA_TARGETS["S" if "S" in pattern else "A"], rank=e2e.LORA_RANK,
                   alpha=e2e.LORA_ALPHA, adapter_dtype="float32")
    model.train()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=cuda)
    ids, labels = e2e.batches(1, B, T, cfg.vocab_size, seed=T, device=device)[0]
    marks = {}

    def mark(name):
        if cuda:
            torch.cuda.synchronize()
            marks[name] = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved())
            print(f"{name}: allocated {marks[name][0] / 2**30:.2f} GiB, peak so far {marks[name][1] / 2**30:.2f} GiB, "
                  f"reserved {marks[name][2] / 2**30:.2f} GiB", flush=True)

    hooks = []

    def backward_mark(i):
        def pre(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            if x is not None and x.requires_grad:
                x.register_hook(lambda g: (mark(f"backward through layer {i}"), torch.cuda.reset_peak_memory_stats() if cuda else None)[-1])
        return pre

    for i, layer in enumerate(model.decoder.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: mark(f"after layer {i} forward")))
        hooks.append(layer.register_forward_pre_hook(backward_mark(i), with_kwargs=True))
    mark("built")
    if cuda:  # the forward only: torch 2.11 with a history recorded breaks in a checkpoint's recompute
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")  # (pytorch #179536)
    result = {"job": args.job, "marks": marks}
    try:
        pos = torch.arange(T, device=device).expand(B, T)
        per_token = model(ids, pos, None, labels=labels)
        loss = per_token.sum() / (labels != -100).sum()
        for h in hooks:
            h.remove()
        mark("forward")
        if cuda:
            peak, live = live_at_peak(torch.cuda.memory._snapshot())
            result["forward_peak"] = report(live.values(), args.top, f"forward: live at its peak ({peak / 2**30:.2f} GiB)")
            torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.reset_peak_memory_stats()
        loss.backward()
        mark("backward")
        opt.step()
        mark("optimizer")
        print(f"loss {float(loss.detach()):.4f}", flush=True)
    except Exception as e:  # noqa: BLE001 - report where it stopped
        print(f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}", flush=True)
        result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        mark("at the error")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
