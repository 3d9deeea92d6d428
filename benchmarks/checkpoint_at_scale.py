"""A trainer checkpoint's save on the CPU, ours against the code at an earlier revision (its own
checkout, a git worktree) in the same run: 4 gloo processes, expert parallel 2 x expert-data
parallel 2, FSDP2 on (and with --replicated, off), a model of about 2 GB of fp32 weights. Each
rank reports the save's wall time, the host memory it added above what the rank held before
(its peak resident set, reset just before the save, less its resident set then) and the bytes of
the model file it wrote; the two checkpoints' tensors are asserted bitwise equal.

    python benchmarks/checkpoint_at_scale.py [--before 9ff926e] [--hidden 1024] [--experts 32]
        [--out benchmarks/results/cpu/checkpoint_at_scale.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
WORLD = 4


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _worker(rank: int, world: int, out: str, overrides: dict) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    import yaml

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron
    from megatron_moe_hybrid.training import checkpoint as ckpt

    init_megatron(rank, world, ep=2)
    with open(os.path.join(os.getcwd(), "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    config = config_from_dict(raw, {"parallel.world_size": world, "parallel.expert_model_parallel_size": 2,
                                    "moe.dispatcher": "alltoall", **overrides})
    torch.manual_seed(0)  # the same weights in both trees (each EP rank draws its experts alike)
    model = build_model(config)
    if config.parallel.fsdp:
        from megatron_moe_hybrid.parallel.fsdp import apply_fsdp

        apply_fsdp(model, config)
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set (VmHWM) to the current one
    dist.barrier()
    start = time.perf_counter()
    path = ckpt.save_checkpoint(out, 1, model, {"step": 1}, {})
    wall = time.perf_counter() - start
    mine = [f for f in os.listdir(path) if f.startswith("model-") and f.endswith(f"-r{rank:05d}.safetensors")]
    return {"wall_s": wall, "added_peak_bytes": _status("VmHWM") - before, "path": path,
            "model_bytes": sum(os.path.getsize(os.path.join(path, f)) for f in mine)}


def _driver(out: str, overrides: str) -> None:
    """Saves from WORLD spawned ranks and prints each rank's figures (the --driver mode)."""
    from megatron_moe_hybrid.testing import spawn

    print(json.dumps(spawn(_worker, WORLD, out, json.loads(overrides), timeout=3600)))


def _save(tree: str, out: str, overrides: dict) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--driver", out, json.dumps(overrides)]
    done = subprocess.run(cmd, cwd=tree, env=dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{cmd} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_same_tensors(a: str, b: str) -> int:
    """The union of each checkpoint's model files holds the same tensors, bitwise; their count."""
    import torch
    from safetensors import safe_open

    def index(path):
        out = {}
        for f in os.listdir(path):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(path, f), framework="pt") as h:
                    out.update(dict.fromkeys(h.keys(), os.path.join(path, f)))
        return out

    ia, ib = index(a), index(b)
    assert ia.keys() == ib.keys(), sorted(ia.keys() ^ ib.keys())[:5]
    for key in ia:
        with safe_open(ia[key], framework="pt") as x, safe_open(ib[key], framework="pt") as y:
            assert torch.equal(x.get_tensor(key), y.get_tensor(key)), key
    return len(ia)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--driver", nargs=2, metavar=("OUT", "OVERRIDES"), help=argparse.SUPPRESS)
    p.add_argument("--before", default="9ff926e", help="the revision whose code is the anchor")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--replicated", action="store_true", help="also without FSDP2 (experts replicated over expert-dp)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu", "checkpoint_at_scale.json"))
    a = p.parse_args()
    if a.driver:
        _driver(*a.driver)
        return
    from common import cpu_name, worktree, write_results

    model = {"model.hidden_size": a.hidden, "model.vocab_size": a.vocab, "moe.num_experts": a.experts,
             "moe.ffn_hidden_size": a.ffn, "moe.shared_expert_ffn_hidden_size": a.ffn}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, worktree(a.before, os.path.join(tmp, "before")) as before:
        so = [f for f in os.listdir(os.path.join(ROOT, "megatron_moe_hybrid")) if f.startswith("_C.")]
        for f in so:  # the built extension (an in-place build is not in git)
            os.symlink(os.path.join(ROOT, "megatron_moe_hybrid", f), os.path.join(before, "megatron_moe_hybrid", f))
        for fsdp in (True, False) if a.replicated else (True,):
            overrides = {**model, "parallel.fsdp": fsdp}
            ours = _save(ROOT, os.path.join(tmp, f"ours-{fsdp}"), overrides)
            anchor = _save(before, os.path.join(tmp, f"before-{fsdp}"), overrides)
            count = _assert_same_tensors(ours[0]["path"], anchor[0]["path"])
            total = sum(r["model_bytes"] for r in ours)
            layout = f"W{WORLD}-EP2-EDP2-{'FSDP2' if fsdp else 'replicated'}"
            shape = f"{layout}-H{a.hidden}-E{a.experts}-F{a.ffn}-V{a.vocab}-fp32-{total / 1e9:.2f}GB"
            common = {"anchor": f"save_checkpoint at {a.before}", "target_speedup": None, "tensors": count,
                      "notes": "one save each, the two checkpoints' tensors asserted bitwise equal; the ranks "
                               f"share this machine's cores; per rank [{', '.join(str(r) for r in range(WORLD))}]"}
            rows.append({"name": "checkpoint save: most host memory a rank added", "shape": shape,
                         "ours_bytes": max(r["added_peak_bytes"] for r in ours),
                         "anchor_bytes": max(r["added_peak_bytes"] for r in anchor),
                         "ours_per_rank": [r["added_peak_bytes"] for r in ours],
                         "anchor_per_rank": [r["added_peak_bytes"] for r in anchor], **common})
            rows.append({"name": "checkpoint save: most model bytes one rank wrote", "shape": shape,
                         "ours_bytes": max(r["model_bytes"] for r in ours),
                         "anchor_bytes": max(r["model_bytes"] for r in anchor), "total_bytes": total,
                         "ours_per_rank": [r["model_bytes"] for r in ours],
                         "anchor_per_rank": [r["model_bytes"] for r in anchor], **common})
            ours_s, anchor_s = max(r["wall_s"] for r in ours), max(r["wall_s"] for r in anchor)
            rows.append({"name": "checkpoint save: wall time (slowest rank)", "shape": shape,
                         "ours_ms": round(ours_s * 1e3, 1), "anchor_ms": round(anchor_s * 1e3, 1),
                         "speedup": round(anchor_s / ours_s, 2), **common})
            for r in rows[-3:]:
                print(json.dumps(r), flush=True)
    write_results(a.out, rows, ("torch", "safetensors"), device=cpu_name(f", {WORLD} processes"))


if __name__ == "__main__":
    main()
