"""Launch a run on a cluster: the config checked and planned at the cluster's size before any node
is taken, one resolved config that every rank reads, and the torchrun command for each node, a
Slurm batch script, or the run itself on this node.

    python tools/launch.py --config runs/base/config.yaml --cluster examples/clusters/h200_128.yaml \
        --training.init_from runs/base --training.data_path corpus.jsonl --training.output_dir runs/ft \
        --slurm runs/ft.sbatch                       # then: sbatch runs/ft.sbatch
    python tools/launch.py --config examples/configs/tiny.yaml --cluster.accelerators 2 \
        --cluster.devices_per_node 2 --cluster.expert_model_parallel_size 2 --run   # here, 2 processes

The cluster (tools/plan.py's Cluster: a YAML file and --cluster.<field> overrides) and the model
config meet in both directions: a cluster field given in the file or on the command line sets
the config field it stands for (accelerators -> parallel.world_size, expert_model_parallel_size,
context_parallel_size, fsdp, training lora|full -> lora.enabled, lora_rank, expert_adapter,
recompute full|none -> memory.recompute_layers -1|0, activation_offload, micro_batch_size,
seq_length, optimizer_state_dtype); every other cluster field the plan needs is read from the
config (weight_bytes from model.params_dtype, or lora.base_dtype bfloat16). So the plan printed
is the plan of the run launched.

Before anything is written: the config is validated at the cluster's world size, a LoRA run's
base weights are looked for (training.init_from), and the plan must fit the devices (--force
launches anyway). Then <training.output_dir>/launch.yaml holds the resolved config (or --out):
keep it on a file system every node sees. Exit status: 0 launched / written, 1 does not fit,
2 bad arguments; with --run, torchrun's.
"""

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import fields
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import plan as planner  # noqa: E402 (tools/plan.py; quiets Megatron's import-time warnings)

from megatron_moe_hybrid.config import (  # noqa: E402
    GROUPS,
    ConfigError,
    HybridMoEConfig,
    load_config,
    parse_overrides,
    save_config,
)


def _same(v):
    return v


# cluster field -> (config field, cluster value -> config value, config value -> cluster value)
LINKED: dict[str, tuple[str, Callable, Callable]] = {
    "accelerators": ("parallel.world_size", _same, _same),
    "tensor_model_parallel_size": ("parallel.tensor_model_parallel_size", _same, _same),
    "expert_model_parallel_size": ("parallel.expert_model_parallel_size", _same, _same),
    "pipeline_model_parallel_size": ("parallel.pipeline_model_parallel_size", _same, _same),
    "context_parallel_size": ("parallel.context_parallel_size", _same, _same),
    "fsdp": ("parallel.fsdp", _same, _same),
    "training": ("lora.enabled", lambda v: v == "lora", lambda v: "lora" if v else "full"),
    "lora_rank": ("lora.rank", _same, _same),
    "expert_adapter": ("lora.expert_adapter", _same, _same),
    "activation_offload": ("memory.activation_offload", _same, _same),
    # a config recomputing its first N layers (0 < N < all) is planned as "none"
    "recompute": ("memory.recompute_layers", lambda v: -1 if v == "full" else 0, lambda v: "full" if v == -1 else "none"),
    "micro_batch_size": ("training.micro_batch_size", _same, _same),
    "seq_length": ("training.seq_length", _same, _same),
    "optimizer_state_dtype": ("training.optimizer_state_dtype", _same, _same),
}


def _config_value(raw: dict, model_ov: dict, dotted: str) -> Any:
    """A field as the config will hold it: an override, the YAML, or its group's default."""
    if dotted in model_ov:
        return model_ov[dotted]
    group, name = dotted.split(".", 1)
    values = raw.get(group) or {}
    if name in values:
        return values[name]
    return getattr(GROUPS[group](), name)


def resolve(config_path: str, cluster_path: Optional[str], cluster_ov: dict, model_ov: dict):
    """(config, cluster) of the run: the linked fields the cluster gives explicitly set the
    config's, the rest of the cluster comes from the config. ConfigError naming the field."""
    raw = planner.read_yaml_mapping(config_path, "config")
    # the cluster fields given (the file's, checked by load_cluster below, and the overrides)
    explicit = set(cluster_ov) | set(planner.read_yaml_mapping(cluster_path, "cluster") if cluster_path else {})
    # a config field named on the command line wins over the cluster file's (and must agree with
    # a --cluster.<field> given beside it)
    for name, (dotted, to_config, _) in LINKED.items():
        if dotted in model_ov and name in explicit:
            if name in cluster_ov and to_config(cluster_ov[name]) != model_ov[dotted]:
                raise ConfigError(f"cluster.{name}", f"{cluster_ov[name]!r} disagrees with --{dotted} "
                                  f"{model_ov[dotted]!r}; give one of them")  # fmt: skip
            explicit.discard(name)
    from_config = {}
    for name, (dotted, _, to_cluster) in LINKED.items():
        if name not in explicit:
            value = _config_value(raw, model_ov, dotted)
            if value is not None:  # parallel.world_size None: torchrun's, unknown here
                from_config[name] = to_cluster(value)
    if "accelerators" not in explicit and "accelerators" not in from_config:
        raise ConfigError("cluster.accelerators", "how many accelerators? give --cluster FILE, --cluster.accelerators N "
                          "or the config's parallel.world_size")  # fmt: skip
    cluster = planner.load_cluster(cluster_path, {**{k: v for k, v in cluster_ov.items() if k in explicit}, **from_config})
    linked = {LINKED[k][0]: LINKED[k][1](getattr(cluster, k)) for k in explicit if k in LINKED}
    config = load_config(config_path, {**model_ov, **linked})
    if "weight_bytes" not in explicit:  # the dtype the run holds its (base) weights in
        import torch

        lora_bf16 = config.lora.enabled and config.lora.base_dtype == "bfloat16"
        cluster.weight_bytes = (torch.bfloat16 if lora_bf16 else config.params_dtype).itemsize
    return config, cluster


def node_layout(cluster: planner.Cluster) -> tuple[int, int]:
    """(nodes, processes per node)."""
    per_node = min(cluster.devices_per_node, cluster.accelerators)
    if cluster.accelerators % per_node:
        raise ConfigError("cluster.accelerators", f"{cluster.accelerators} is not a multiple of devices_per_node "
                          f"{cluster.devices_per_node}: nodes run the same number of processes")  # fmt: skip
    return cluster.accelerators // per_node, per_node


def torchrun_args(config: HybridMoEConfig, resolved: str, nodes: int, per_node: int, endpoint: str, run_id: str) -> list[str]:
    """The command each node runs (the c10d rendezvous gives the ranks; one node: standalone)."""
    entry = "megatron_moe_hybrid.finetune" if config.lora.enabled else "megatron_moe_hybrid.train"
    if nodes == 1:
        where = ["--standalone"]
    else:
        where = ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    return [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(per_node), "-m", entry,
            "--config", resolved]  # fmt: skip


def shell_line(command: list[str]) -> str:
    """The command for a shell, $VARIABLES left to it (double quotes), everything else quoted."""
    return " ".join(f'"{c}"' if c.startswith("$") else shlex.quote(c) for c in command)


def slurm_script(command: list[str], nodes: int, per_node: int, job_name: str, workdir: str) -> str:
    """An sbatch script: one task per node, each a torchrun of per_node processes meeting at the
    first node."""
    return f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --exclusive
# written by tools/launch.py: the run's resolved config is in the command below
set -euo pipefail
cd {shlex.quote(workdir)}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-8}}
srun --kill-on-bad-exit=1 {shell_line(command)}
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--cluster.<field> VALUE overrides a cluster field (tools/plan.py --help lists them); "
               "--<group>.<field> VALUE a config field, as for train / finetune.")  # fmt: skip
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--cluster", default=None, help="a YAML of Cluster fields (e.g. examples/clusters/h200_128.yaml)")
    parser.add_argument("--out", default=None, help="where the resolved config goes (default <training.output_dir>/launch.yaml)")
    parser.add_argument("--slurm", default=None, metavar="FILE", help="write an sbatch script for the run")
    parser.add_argument("--run", action="store_true", help="run it here (one node): torchrun --standalone")
    parser.add_argument("--force", action="store_true", help="launch even where the plan does not fit")
    parser.add_argument("--port", type=int, default=29500, help="the rendezvous port on the first node")
    parser.add_argument("--job-name", default="megatron_moe_hybrid")
    args, rest = parser.parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        cluster_ov = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("cluster.")}
        model_ov = {k: v for k, v in overrides.items() if not k.startswith("cluster.")}
        unknown = [k for k in cluster_ov if k not in {f.name for f in fields(planner.Cluster)}]
        if unknown:
            raise ConfigError(f"cluster.{unknown[0]}", "unknown field; tools/plan.py --help lists them")
        config, cluster = resolve(args.config, args.cluster, cluster_ov, model_ov)
        nodes, per_node = node_layout(cluster)
        if args.run and nodes > 1:
            raise ConfigError("run", f"--run starts one node's processes; this cluster has {nodes} nodes: write "
                              "--slurm FILE, or run the printed command on every node")  # fmt: skip
        from megatron_moe_hybrid.training.trainer import check_lora_base

        check_lora_base(config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = planner.plan(config, cluster)
    print(planner.report(config, cluster, result))
    if not result["fits"] and not args.force:
        print("not launched: the plan does not fit (--force launches anyway)", file=sys.stderr)
        return 1
    resolved = os.path.abspath(args.out or os.path.join(config.training.output_dir, "launch.yaml"))
    os.makedirs(os.path.dirname(resolved), exist_ok=True)
    save_config(config, resolved)
    endpoint, run_id = f"$MASTER_ADDR:{args.port}", "$SLURM_JOB_ID" if args.slurm else args.job_name
    command = torchrun_args(config, resolved, nodes, per_node, endpoint, run_id)
    print(f"resolved config: {resolved}")
    if args.slurm:
        tmp = args.slurm + ".tmp"
        with open(tmp, "w") as f:
            f.write(slurm_script(command, nodes, per_node, args.job_name, os.getcwd()))
        os.replace(tmp, args.slurm)
        print(f"slurm script: {args.slurm} (sbatch {shlex.quote(args.slurm)})")
    else:
        print(("on this node" if nodes == 1 else f"on each of the {nodes} nodes (MASTER_ADDR: the first node's address)")
              + ":\n  " + shell_line(command))  # fmt: skip
    if args.run:
        sys.stdout.flush()
        return subprocess.call(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
