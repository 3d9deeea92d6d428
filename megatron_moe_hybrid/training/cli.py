"""Command-line entry points: `python -m megatron_moe_hybrid.train|finetune --config X [--group.field V ...]`.

A bad configuration prints one line naming the field and exits with status 2, before any
process group or allocation.
"""

import argparse
import os
import sys
import time
import warnings


def quiet_imports() -> None:
    """Silence Megatron's import-time warnings that TE / Apex are missing: we report backends
    ourselves (`python -m megatron_moe_hybrid.env`). Called first by these CLIs and tools/plan.py."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|apex).*")


def print_launch_error(error) -> None:
    """A ConfigError raised once the ranks run: one line from rank 0 where every rank raised the
    same error (error.every_rank: a check over gathered values), else one line per rank that
    raised it, naming the rank (a GPU or host of its own)."""
    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and error.every_rank:
        if rank != "0":
            # Rank 0 prints the same line. Exiting at once could let torchrun stop rank 0 (it
            # stops every worker when one fails) before rank 0 has printed it.
            time.sleep(2.0)
            return
        print(f"error: {error}", file=sys.stderr, flush=True)
        return
    print(f"error: {f'rank {rank}: ' if world > 1 else ''}{error}", file=sys.stderr, flush=True)


def main(mode: str, argv=None) -> int:
    quiet_imports()
    parser = argparse.ArgumentParser(
        prog=f"python -m megatron_moe_hybrid.{'train' if mode == 'pretrain' else 'finetune'}",
        description="Overrides are dotted config fields, e.g. --moe.num_experts 8 --training.lr 1e-3",
    )
    example = "tiny.yaml" if mode == "pretrain" else "tiny_lora.yaml"
    parser.add_argument("--config", required=True, help=f"YAML config, e.g. examples/configs/{example}")
    args, rest = parser.parse_known_args(argv)

    from megatron_moe_hybrid.config import ConfigError, load_config, parse_overrides

    try:
        config = load_config(args.config, parse_overrides(rest))
        if mode == "finetune" and not config.lora.enabled:
            raise ConfigError("lora.enabled", "finetune needs lora.enabled: true (or use train)")
        try:  # every rank, before any process group: a rank failing alone there would leave the rest waiting
            os.makedirs(config.training.output_dir, exist_ok=True)
        except OSError as e:
            raise ConfigError("training.output_dir", f"cannot create {config.training.output_dir!r} "
                              f"({e.strerror or e}); choose a writable directory") from None
    except ConfigError as e:
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2

    from megatron_moe_hybrid.training.trainer import TrainingStopped, run

    try:
        run(config, mode)
    except ConfigError as e:  # found at launch: ranks disagree, the world size is wrong, a host is short of memory
        print_launch_error(e)
        return 2
    except TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        if e.peer_failed:  # do not wait on a process group whose peer is gone
            sys.stdout.flush()
            os._exit(1)
        return 1
    return 0
