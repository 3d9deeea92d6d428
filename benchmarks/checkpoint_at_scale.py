"""A trainer checkpoint's save on the CPU, ours against the code at an earlier revision (its own
checkout, a git worktree, or --before-tree) in the same run: --world gloo processes (default 4),
expert parallel --ep (2) x expert-data parallel the rest, FSDP2 on (and with --replicated, off),
a model of about 2 GB of fp32 weights by default. Each rank reports the save's wall time, the
host memory it added above what it held before (its peak resident set, reset just before the
save, less its resident set then) and the bytes of the model file it wrote, then the wall time
of loading that checkpoint back (as a resume does) and the bytes of tensor data it read; the
two checkpoints' tensors are asserted bitwise equal.

    python benchmarks/checkpoint_at_scale.py [--before 9ff926e] [--before-tree DIR] [--world 4] [--ep 2]
        [--hidden 1024] [--experts 32] [--replicated] [--optimizer] [--out benchmarks/results/cpu/checkpoint_at_scale.json]
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _worker(rank: int, world: int, out: str, ep: int, overrides: dict) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron, tiny_config
    from megatron_moe_hybrid.training import checkpoint as ckpt

    init_megatron(rank, world, ep=ep)
    with_optimizer = overrides.pop("bench.optimizer", False)
    config = tiny_config(**{"parallel.world_size": world, "parallel.expert_model_parallel_size": ep,
                            "moe.dispatcher": "alltoall", "training.global_batch_size": 2 * world, **overrides})
    torch.manual_seed(0)  # the same weights in both trees (each EP rank draws its experts alike)
    model = build_model(config)
    if config.parallel.fsdp:
        from megatron_moe_hybrid.parallel.fsdp import apply_fsdp

        apply_fsdp(model, config)
    rank_state, save_kwargs, optimizer = {"step": 1}, {}, None
    if with_optimizer:  # AdamW after one step: its moments are saved as the trainer saves them
        optimizer = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        for p in model.parameters():
            p.grad = None
        import inspect

        if "optimizer" in inspect.signature(ckpt.save_checkpoint).parameters:  # ours: moments beside the weights
            save_kwargs = {"optimizer": optimizer}
        else:  # the anchor's trainer: each rank's whole optimizer state (its local shards) in its state file
            from megatron_moe_hybrid.parallel.fsdp import optimizer_state_to_local

            state = optimizer.state_dict()
            rank_state["optimizer"] = optimizer_state_to_local(state) if config.parallel.fsdp else state
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set (VmHWM) to the current one
    dist.barrier()
    start = time.perf_counter()
    path = ckpt.save_checkpoint(out, 1, model, rank_state, {}, **save_kwargs)
    wall = time.perf_counter() - start
    added = _status("VmHWM") - before
    mine = [f for f in os.listdir(path) if f.startswith("model-") and f.endswith(f"-r{rank:05d}.safetensors")]
    state_file = os.path.join(path, f"state-rank{rank:05d}.pt")
    written = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                  if f.endswith(f"-r{rank:05d}.safetensors")) + os.path.getsize(state_file)  # fmt: skip
    # the load a resume does, of the checkpoint just written (its resident set is not compared:
    # the files it reads are memory-mapped, so their pages count in it however little it keeps)
    dist.barrier()
    start = time.perf_counter()

    def resume():
        ckpt.load_model_weights(path, model)
        if optimizer is None:
            return
        state = ckpt.load_rank_state(path)["optimizer"]
        if save_kwargs:
            ckpt.load_optimizer_state(path, model, optimizer, state)
        else:
            optimizer.load_state_dict(state)
            if config.parallel.fsdp:
                from megatron_moe_hybrid.parallel.fsdp import optimizer_state_from_local

                optimizer_state_from_local(optimizer)

    read = _counting_reads(ckpt, resume) + (os.path.getsize(state_file) if optimizer is not None else 0)
    return {"wall_s": wall, "added_peak_bytes": added, "path": path,
            "model_bytes": sum(os.path.getsize(os.path.join(path, f)) for f in mine), "written_bytes": written,
            "load_wall_s": time.perf_counter() - start, "load_read_bytes": read}


def _counting_reads(ckpt, fn) -> int:
    """Bytes of tensor data fn read through the checkpoint module's safe_open (whole tensors and
    slices): ckpt, that module of the tree that runs (tests/training/test_checkpoint.py uses it too)."""
    opened = ckpt.safe_open
    count = [0]

    def counted(t):
        count[0] += t.numel() * t.element_size()
        return t

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, index):
            return counted(self.inner[index])

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class File:
        def __init__(self, *args, **kwargs):
            self.inner = opened(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_tensor(self, key):
            return counted(self.inner.get_tensor(key))

        def get_slice(self, key):
            return Slice(self.inner.get_slice(key))

        def __getattr__(self, name):
            return getattr(self.inner, name)

    ckpt.safe_open = File
    try:
        fn()
    finally:
        ckpt.safe_open = opened
    return count[0]


def _driver(out: str, world: str, ep: str, overrides: str) -> None:
    """Saves from `world` spawned ranks and prints each rank's figures (the --driver mode)."""
    from megatron_moe_hybrid.testing import spawn

    print(json.dumps(spawn(_worker, int(world), out, int(ep), json.loads(overrides), timeout=3600)))


def _save(tree: str, out: str, world: int, ep: int, overrides: dict) -> list[dict]:
    from common import run_in_tree

    return run_in_tree(tree, [os.path.abspath(__file__), "--driver", out, str(world), str(ep), json.dumps(overrides)])


def _assert_same_tensors(a: str, b: str) -> int:
    """The union of each checkpoint's model files holds the same tensors, bitwise; their count."""
    import torch
    from safetensors import safe_open

    def index(path):
        out = {}
        for f in os.listdir(path):
            if f.startswith("model-") and f.endswith(".safetensors"):
                with safe_open(os.path.join(path, f), framework="pt") as h:
                    out.update(dict.fromkeys(h.keys(), os.path.join(path, f)))
        return out

    ia, ib = index(a), index(b)
    assert ia.keys() == ib.keys(), sorted(ia.keys() ^ ib.keys())[:5]
    for key in ia:
        with safe_open(ia[key], framework="pt") as x, safe_open(ib[key], framework="pt") as y:
            assert torch.equal(x.get_tensor(key), y.get_tensor(key)), key
    return len(ia)


def _bytes_row(name: str, shape: str, key: str, ours: list, anchor: list, common: dict, **extra) -> dict:
    """A row of the worst rank's bytes (and every rank's) of ours and the anchor."""
    return {"name": name, "shape": shape, "ours_bytes": max(r[key] for r in ours),
            "anchor_bytes": max(r[key] for r in anchor), **extra, "ours_per_rank": [r[key] for r in ours],
            "anchor_per_rank": [r[key] for r in anchor], **common}


def _time_row(name: str, shape: str, key: str, ours: list, anchor: list, common: dict) -> dict:
    """A row of the slowest rank's seconds of ours and the anchor."""
    ours_s, anchor_s = max(r[key] for r in ours), max(r[key] for r in anchor)
    return {"name": name, "shape": shape, "ours_ms": round(ours_s * 1e3, 1), "anchor_ms": round(anchor_s * 1e3, 1),
            "speedup": round(anchor_s / ours_s, 2), **common}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--driver", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--before", default="9ff926e", help="the revision whose code is the anchor")
    p.add_argument("--before-tree", default=None, help="a checkout of --before to use (git archive's files) "
                   "instead of a worktree (where there is no git repository)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--replicated", action="store_true", help="also without FSDP2 (experts replicated over expert-dp)")
    p.add_argument("--optimizer", action="store_true", help="with AdamW's moments, saved and loaded as the trainer does")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu", "checkpoint_at_scale.json"))
    a = p.parse_args()
    if a.driver:
        _driver(*a.driver)
        return
    from common import anchor_tree, cpu_name, write_results

    model = {"model.hidden_size": a.hidden, "model.vocab_size": a.vocab, "moe.num_experts": a.experts,
             "moe.ffn_hidden_size": a.ffn, "moe.shared_expert_ffn_hidden_size": a.ffn}
    rows = []
    world, ep = a.world, a.ep
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        before = anchor_tree(stack, a.before, a.before_tree, tmp)
        for fsdp in (True, False) if a.replicated else (True,):
            overrides = {**model, "parallel.fsdp": fsdp, **({"bench.optimizer": True} if a.optimizer else {})}
            ours = _save(ROOT, os.path.join(tmp, f"ours-{fsdp}"), world, ep, overrides)
            anchor = _save(before, os.path.join(tmp, f"before-{fsdp}"), world, ep, overrides)
            count = _assert_same_tensors(ours[0]["path"], anchor[0]["path"])
            total = sum(r["model_bytes"] for r in ours)
            layout = f"W{world}-EP{ep}-EDP{world // ep}-{'FSDP2' if fsdp else 'replicated'}"
            shape = f"{layout}-H{a.hidden}-E{a.experts}-F{a.ffn}-V{a.vocab}-fp32-{total / 1e9:.2f}GB"
            common = {"anchor": f"save_checkpoint at {a.before}", "target_speedup": None, "tensors": count,
                      "notes": "one save each, the two checkpoints' tensors asserted bitwise equal; the ranks "
                               f"share this machine's {os.cpu_count()} cores; *_per_rank: ranks 0-{world - 1}"}
            if a.optimizer:
                shape += "-AdamW"
                common["notes"] = common["notes"].replace("tensors asserted", "weights asserted") + (
                    "; with AdamW's moments after one step, saved as each trainer saves them (ours: beside the "
                    "weights, each moment once; the anchor: each rank's state file, torch.save) and loaded back "
                    "with the weights (bytes read include the state file)")
            rows += [
                _bytes_row("checkpoint save: most host memory a rank added", shape, "added_peak_bytes", ours, anchor, common),
                _bytes_row("checkpoint save: most model bytes one rank wrote", shape, "model_bytes", ours, anchor, common,
                           total_bytes=total),
                _time_row("checkpoint save: wall time (slowest rank)", shape, "wall_s", ours, anchor, common),
                _bytes_row(f"checkpoint load (a resume's weights{' and optimizer' if a.optimizer else ''}): most bytes "
                           "one rank read", shape, "load_read_bytes",
                           ours, anchor, common, total_bytes=total),
                _time_row("checkpoint load: wall time (slowest rank)", shape, "load_wall_s", ours, anchor, common),
            ]
            if a.optimizer:
                rows.append(_bytes_row("checkpoint save: most bytes one rank wrote (all its files)", shape,
                                       "written_bytes", ours, anchor, common,
                                       total_bytes=sum(r["written_bytes"] for r in ours),
                                       anchor_total_bytes=sum(r["written_bytes"] for r in anchor)))
            for r in rows[-6 if a.optimizer else -5:]:
                print(json.dumps(r), flush=True)
    write_results(a.out, rows, ("torch", "safetensors"), device=cpu_name(f", {world} processes"))


if __name__ == "__main__":
    main()
