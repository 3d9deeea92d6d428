"""Summarise a checkpoint written by megatron_moe_hybrid (no torch pickle is read).

    python tools/inspect_checkpoint.py outputs/tiny            # a run: its newest checkpoint
    python tools/inspect_checkpoint.py outputs/tiny/checkpoints/step_00000100 --tensors
    python tools/inspect_checkpoint.py runs/base            # a dist checkpoint (hf-to-ours --format dcp) too

Prints the step, the layout it was saved with, the model shape from its config, and the
parameter count (experts counted once each, under their global ids). Exits 1 with a
message naming the file when the checkpoint is incomplete or a shard cannot be read.
"""

import argparse
import os
import re
import sys

from safetensors import safe_open

from megatron_moe_hybrid.training.checkpoint import OPTIMIZER_PREFIX, CheckpointError, read_meta, resolve_checkpoint

_EXPERT = re.compile(r"\.expert(\d+)$")


def _summarise_dist(path: str) -> dict:
    """A dist checkpoint (convert_checkpoint.py --format dcp): its metadata, no tensor read."""
    from megatron_moe_hybrid.training.dist_checkpoint import DistCheckpointReader

    reader = DistCheckpointReader(path)
    shapes = {}
    for name, sh in reader.stored.items():
        if name in reader.expert_names:
            shapes.update({f"{name}.expert{e}": tuple(sh.size[1:]) for e in range(sh.size[0])})
        else:
            shapes[name] = tuple(sh.size)
    meta = reader.meta
    return {"path": path, "step": meta.get("step", 0), "mode": meta.get("mode", "dist checkpoint"),
            "world_size": meta.get("world_size", "?"), "expert_model_parallel_size": meta.get("expert_model_parallel_size", "any"),
            "model": meta.get("config", {}).get("model", {}), "shapes": shapes}  # fmt: skip


def summarise(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: does not exist")
    from megatron_moe_hybrid.training.dist_checkpoint import find_dist_checkpoint

    dist_dir = find_dist_checkpoint(path)
    if dist_dir is not None and not os.path.isfile(os.path.join(path, "meta.json")):
        return _counts(_summarise_dist(dist_dir))
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    shapes: dict[str, tuple] = {}
    moments: dict[str, tuple] = {}  # the optimizer's, in their own files
    for fname in sorted(os.listdir(path)):
        if not fname.endswith(".safetensors"):
            continue
        into = moments if fname.startswith(OPTIMIZER_PREFIX) else shapes
        try:
            with safe_open(os.path.join(path, fname), framework="pt") as f:
                for key in f.keys():
                    into[key] = tuple(f.get_slice(key).get_shape())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{os.path.join(path, fname)}: cannot read ({e})") from e
    return _counts({"path": path, "step": meta["step"], "mode": meta.get("mode"), "world_size": meta["world_size"],
                    "expert_model_parallel_size": meta["expert_model_parallel_size"],
                    "model": meta.get("config", {}).get("model", {}), "shapes": shapes,
                    "num_optimizer_tensors": len(moments)})  # fmt: skip


def _counts(s: dict) -> dict:
    """s with its tensor, parameter, expert and LoRA counts (from s["shapes"])."""
    shapes = s["shapes"]
    numel = {k: 1 for k in shapes}
    for k, shape in shapes.items():
        for d in shape:
            numel[k] *= d
    experts = {int(m.group(1)) for k in shapes if (m := _EXPERT.search(k))}
    expert_params = sum(n for k, n in numel.items() if _EXPERT.search(k))
    return {**s, "num_tensors": len(shapes), "num_params": sum(numel.values()), "num_expert_params": expert_params,
            "num_experts": len(experts), "num_lora_params": sum(n for k, n in numel.items() if ".lora_" in k)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a checkpoint directory, or a run's output_dir")
    parser.add_argument("--tensors", action="store_true", help="list every tensor and its shape")
    args = parser.parse_args(argv)
    try:
        s = summarise(args.path)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    m = s["model"]
    print(f"checkpoint: {s['path']}")
    if s["world_size"] == "?":
        print(f"step {s['step']} ({s['mode']}), a dist checkpoint: it loads under any expert-parallel layout")
    else:
        print(f"step {s['step']} ({s['mode']}), saved by {s['world_size']} ranks with expert parallel {s['expert_model_parallel_size']}")
    if m:
        print(f"model: {m.get('num_layers')} layers pattern {m.get('pattern')}, hidden {m.get('hidden_size')}, vocab {m.get('vocab_size')}")
    print(f"tensors: {s['num_tensors']}, parameters: {s['num_params']:,} "
          f"({s['num_expert_params']:,} in {s['num_experts']} routed experts per layer)")
    if s.get("num_optimizer_tensors"):
        print(f"optimizer moments: {s['num_optimizer_tensors']} tensors (a resume under another layout reshards them)")
    if s["num_lora_params"]:
        print(f"LoRA adapters: {s['num_lora_params']:,} parameters (the rest is the frozen base)")
    if args.tensors:
        for k in sorted(s["shapes"]):
            print(f"  {k}: {list(s['shapes'][k])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
