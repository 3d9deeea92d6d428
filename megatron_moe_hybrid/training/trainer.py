"""The training loop shared by pretraining and LoRA fine-tuning.

One step: for each micro-batch of this data-parallel rank, forward (the chunked loss returns
[b, s] per-token losses) and backward; then gradients are summed over replicas and divided
by the data-parallel size (parallel.data_parallel; under parallel.fsdp FSDP2 reduce-scatters
them, parallel.fsdp), clipped by the global norm, and AdamW steps (its moments in fp32 or, with
training.optimizer_state_dtype: bf16, in bf16: training/optim.py). Sample i of the run is
always the same sequence (the dataset indexes statelessly), so the data position is just
`step * global_batch_size` and resume is exact.
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_moe_hybrid.config import HybridMoEConfig, save_config
from megatron_moe_hybrid.training.optim import make_optimizer


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (bad steps, save failure, a dead rank); the message says why."""

    def __init__(self, message: str, peer_failed: bool = False):
        super().__init__(message)
        self.peer_failed = peer_failed


@dataclass
class RunResult:
    output_dir: str
    losses: list = field(default_factory=list)
    checkpoint: Optional[str] = None
    adapter_dir: Optional[str] = None
    eval_losses: list = field(default_factory=list)  # (step, held-out loss) of this invocation


# How long the other ranks wait for rank 0 to train the tokenizer and tokenize the text on a
# run's first start (a rank that dies fails the wait at once; only a hung one waits this long).
DATA_WAIT_S = 24 * 3600.0


def training_device(config: HybridMoEConfig) -> torch.device:
    """training.device resolved: this rank's GPU (LOCAL_RANK) or the CPU.

    "auto" takes the GPU when every process on this node has one of its own (LOCAL_WORLD_SIZE
    <= visible GPUs) and no gloo group was set up before (tests spawn CPU ranks over gloo);
    otherwise the CPU. "cuda" insists, and says what is wrong when it cannot."""
    want = config.training.device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if want == "auto":
        enough = torch.cuda.is_available() and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count()
        preset_gloo = dist.is_initialized() and dist.get_backend() != "nccl"
        want = "cuda" if enough and not preset_gloo else "cpu"
    if want == "cpu":
        return torch.device("cpu")
    if dist.is_initialized() and dist.get_backend() == "nccl":  # a group made elsewhere picked the GPU
        return torch.device("cuda", torch.cuda.current_device())
    if local_rank >= torch.cuda.device_count():
        from megatron_moe_hybrid.config import ConfigError

        raise ConfigError(
            "training.device",
            f"rank with LOCAL_RANK={local_rank} has no GPU of its own ({torch.cuda.device_count()} visible); "
            "launch at most one process per GPU (torchrun --nproc-per-node) or set training.device: cpu",
        )
    return torch.device("cuda", local_rank)


def init_distributed(config: HybridMoEConfig) -> None:
    """A process group (a 1-process one when not under torchrun): NCCL with one GPU per rank,
    gloo on the CPU; and Megatron's parallel_state."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        # Not under torchrun: a group of this one process, over an in-process store (no port).
        from megatron_moe_hybrid.parallel.launch import init_process_group as init

        device = training_device(config)
        timeout = timedelta(seconds=config.parallel.collective_timeout_s)
        if device.type == "cuda":
            if config.training.deterministic:  # cuBLAS is deterministic only with a fixed workspace
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.cuda.set_device(device)
            init("nccl", timeout=timeout, device_id=device)
        else:
            init("gloo", timeout=timeout)
    _check_launch(config)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    p = config.parallel
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
    )


def _check_launch(config: HybridMoEConfig) -> None:
    """Before any allocation: the launch matches the config, and every rank has the same one."""
    from megatron_moe_hybrid.config import ConfigError
    from megatron_moe_hybrid.parallel.health import check_same_config

    world = dist.get_world_size()
    p = config.parallel
    if p.world_size is None:
        # validate() ran with WORLD_SIZE from the environment (1 without torchrun): run it
        # again with the group that exists, so every size check sees the real launch.
        p.world_size = world
        config.validate()
    elif p.world_size != world:
        raise ConfigError(
            "parallel.world_size",
            f"is {p.world_size} but {world} processes were launched; launch {p.world_size} "
            "(torchrun --nproc-per-node) or leave parallel.world_size unset",
            every_rank=True,
        )
    mismatch = check_same_config(config.to_dict())
    if mismatch is not None:
        raise ConfigError(*mismatch.split(": ", 1), every_rank=True)


def _host_bytes_available() -> Optional[int]:
    """MemAvailable of this host (Linux /proc/meminfo), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_host_memory_for_initialize(meta: torch.nn.Module, device: torch.device) -> None:
    """A run from scratch draws its initial weights in host memory, piece by piece
    (models.initialize: the embedding and the output layer, then one decoder layer at a time,
    each copied into this rank's shards on its device); on a CPU run the model itself lives
    there too. Before any of it is allocated: every rank counts what it needs (a meta-device
    build: no storage, the pieces counted in fp32, as drawn); the ranks on one host (by host
    name, over all ranks) are summed against that host's available memory; if any host is
    short, every rank raises the same ConfigError naming training.init_from. meta: the model
    built on the meta device (no storage)."""
    import socket

    from megatron_moe_hybrid.config import ConfigError

    def numel(module):  # parameters and persistent buffers (a state dict also holds extra states)
        return sum(t.numel() for t in module.state_dict().values() if isinstance(t, torch.Tensor))

    layers = [numel(layer) for layer in meta.decoder.layers]
    every = numel(meta)
    need = 4 * (every - sum(layers) + max(layers, default=0))  # the pieces alive at once, fp32
    if device.type == "cpu":  # the model's own storage
        need += sum(t.numel() * t.element_size() for t in list(meta.parameters()) + list(meta.buffers()))
    mine = (socket.gethostname(), need, _host_bytes_available())
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    hosts: dict = {}
    for host, n, avail in everyone:
        total, count, least = hosts.get(host, (0, 0, None))
        hosts[host] = (total + n, count + 1, avail if least is None or avail is None else min(least, avail))
    short = {h: v for h, v in hosts.items() if v[2] is not None and v[0] > v[2]}
    if short:
        host, (total, count, avail) = max(short.items(), key=lambda kv: kv[1][0] - kv[1][2])
        where = "and holds the model there (a CPU run)" if device.type == "cpu" else "before copying it to its device"
        raise ConfigError(
            "training.init_from",
            f"is unset, so each rank draws its initial weights in host memory (the embedding, the output "
            f"layer and one decoder layer at a time) {where}: the {count} rank(s) on host {host} need "
            f"{total / 1e9:.1f} GB and {avail / 1e9:.1f} GB is available; start from a safetensors "
            "checkpoint (training.init_from: each rank reads only its shards, on its device), or raise "
            "parallel.expert_model_parallel_size / tensor_model_parallel_size so that each rank holds less",
            every_rank=True,
        )


def _copy_atomic(src: str, dst: str) -> None:
    import shutil

    if os.path.abspath(src) == os.path.abspath(dst):
        return
    tmp = f"{dst}.tmp{os.getpid()}"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def lr_at(step: int, t) -> float:
    """Linear warm-up to training.lr, then cosine decay to training.min_lr at train_steps."""
    if t.warmup_steps > 0 and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.train_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _print0(*args) -> None:
    if _is_rank0():
        print(*args, flush=True)


def _data_summary(what: str, path: str, dataset, data_format: str) -> str:
    """One line on what a run reads: tokens, samples and, for records, the share of trained tokens
    (the quick check that a prompt / chat mask is what was meant)."""
    if getattr(dataset, "parts", None):  # a blend: each dataset's line, its weight first (the heaviest few)
        order = sorted(range(len(dataset.parts)), key=lambda i: -dataset.weights[i])
        shown, rest = order[:BLEND_LINES], order[BLEND_LINES:]
        line = (f"{what}: a blend of {len(dataset.parts)} datasets ({data_format}), {dataset.num_samples:,} samples of "
                f"{dataset.seq_length} tokens in one pass of each: " + "; ".join(
                    f"{dataset.weights[i]:.3g} x {_dataset_line(dataset.paths[i], dataset.parts[i], data_format)}"
                    for i in sorted(shown)))  # fmt: skip
        if rest:
            tokens = sum(len(dataset.parts[i].tokens) for i in rest)
            line += (f"; and {len(rest)} more (weights {sum(dataset.weights[i] for i in rest):.3g} in all, "
                     f"{tokens:,} tokens)")
        return line
    return f"{what}: {_dataset_line(path, dataset, data_format)}"


BLEND_LINES = 8  # datasets of a blend the data summary describes one by one: the heaviest


def _dataset_line(path: str, dataset, data_format: str) -> str:
    """_data_summary's account of one TokenDataset."""
    kind = f"indexed dataset, {dataset.tokens.dtype.name}" if dataset.indexed else data_format
    line = (f"{path} ({kind}): {len(dataset.tokens):,} tokens, {dataset.num_samples:,} samples of "
            f"{dataset.seq_length} tokens")
    if dataset.trained is not None:
        line += f"; {float(np.asarray(dataset.trained).mean()):.1%} of the tokens trained"
    if dataset.spans is not None:
        used = int((dataset.spans[:, 1] - dataset.spans[:, 0]).sum()) - dataset.num_samples  # a window's last is a label
        line += (f"; packed whole (training.packing: {dataset.packing}), "
                 f"{1 - used / (dataset.num_samples * dataset.seq_length):.1%} "
                 f"of positions padding, {dataset.cut_records:,} longer than a sample cut")
    split = dataset.data_stats.get("split_conversations", 0)
    if split:
        line += (f"; {split:,} conversations made one record per assistant turn (training.chat_turns: the template "
                 "renders their earlier turns differently once later ones follow)")
    skipped = {k: v for k, v in dataset.data_stats.items() if v and k.startswith("skipped_")}
    if skipped:
        line += f"; skipped lines (training.bad_data: skip): {skipped}"
    return line


def _indexer_parameter_ids(model: torch.nn.Module) -> set[int]:
    """id() of every parameter of the model's lightning indexers (S and M layers)."""
    return {id(p) for m in model.indexer_layers() for p in m.indexer_parameters()}


def freeze_all_but_indexers(model: torch.nn.Module) -> None:
    """The dense warm-up (sparse_attention.stage dense_warmup, DeepSeek-V3.2's first stage): every
    parameter frozen but those of the S layers' indexers (indexer_parameters()), which learn from
    the indexer KL loss alone (the trainer backwards those losses by themselves: their layers'
    indexer_loss_sink). ValueError if the model has no indexer."""
    keep = _indexer_parameter_ids(model)
    if not keep:
        raise ValueError("sparse_attention.stage dense_warmup: the model has no S layer with an indexer to train")
    for p in model.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)


class Trainer:
    def __init__(self, config: HybridMoEConfig, mode: str = "pretrain"):
        from megatron.core import parallel_state as ps

        from megatron_moe_hybrid.models import build_model
        from megatron_moe_hybrid.parallel.data_parallel import ParallelGroups
        from megatron_moe_hybrid.training import checkpoint as ckpt
        from megatron_moe_hybrid.training.data import tokenizer_files

        self.config, self.mode = config, mode
        t = config.training
        self.device = training_device(config)
        # On CUDA a few ops have no deterministic kernel: torch warns about those instead of
        # stopping the run (the MoE and loss paths are written deterministic).
        torch.use_deterministic_algorithms(t.deterministic, warn_only=self.device.type == "cuda")
        self.rank = dist.get_rank()
        self.groups = ParallelGroups.from_parallel_state()
        self.dp_rank = ps.get_data_parallel_rank()
        self.data_dp_size = ps.get_data_parallel_world_size()  # ranks reading different samples
        self.num_micro = t.global_batch_size // (t.micro_batch_size * self.data_dp_size)
        from megatron_moe_hybrid.parallel.context_parallel import CPLayout

        # Context-parallel ranks read the same samples and keep their pieces of each sequence.
        self.cp_layout = CPLayout.from_parallel_state(t.seq_length, config.parallel.cp_layout)
        # Every run builds the model on the meta device (no storage): from scratch, its size
        # is checked against host memory before anything is written or allocated.
        # The dense warm-up backwards the indexer KL losses alone: its frozen layers keep no
        # activations, so recomputing layers would only run the S layers' forward again.
        self.dense_warmup = config.sparse_attention.stage == "dense_warmup"
        if self.dense_warmup and config.memory.recompute_layers:
            _print0("memory.recompute_layers is not applied in the dense warm-up: its frozen layers keep no "
                    "activations for a backward (only the indexers' KL losses are backwarded)")
        self.model = build_model(config, device="meta", recompute=0 if self.dense_warmup else None)
        if t.init_from is None:
            _check_host_memory_for_initialize(self.model, self.device)
        self.output_dir = t.output_dir
        if self.rank == 0:
            os.makedirs(self.output_dir, exist_ok=True)

        # Rank 0 trains/tokenises first; the others then read the cache. After each turn the
        # ranks agree whether it failed, so none waits on a rank that stopped (the failing rank
        # raises its error, the others say where to look). They agree over a gloo group of their
        # own whose timeout is DATA_WAIT_S, not parallel.collective_timeout_s: tokenizing a large
        # text corpus on first start may take hours (a rank that dies still fails the wait at once:
        # gloo sees its connection close).
        wait = timedelta(seconds=max(DATA_WAIT_S, config.parallel.collective_timeout_s))
        waiting = dist.new_group(backend="gloo", timeout=wait)
        for turn in (0, 1):
            failed: Optional[Exception] = None
            if (self.rank == 0) == (turn == 0):
                try:
                    self._load_data()
                except Exception as e:
                    failed = e
            flag = torch.tensor([float(failed is not None)])
            dist.all_reduce(flag, group=waiting)
            if failed is not None:
                raise _field_error(failed)
            if flag.item():
                raise TrainingStopped(f"rank {self.rank}: {'rank 0' if turn == 0 else 'another rank'} could not load "
                                      "the training data (tokenizer, training.data_path, training.eval_data_path); its "
                                      "error says why")  # fmt: skip
        dist.destroy_process_group(waiting)
        if self.tokenizer.vocab_size > config.vocab_size:  # every rank loaded the same tokenizer
            raise _start_error("model.vocab_size", ValueError(
                f"{config.vocab_size} is smaller than the tokenizer's {self.tokenizer.vocab_size} pieces "
                f"({self.tokenizer.model_path}); set it to at least {self.tokenizer.vocab_size}"), every_rank=True)

        _print0(f"training on {self.device.type} ({dist.get_world_size()} process(es), training.device: {t.device})")
        torch.manual_seed(t.seed)  # the same on every rank: replicated weights start equal
        from megatron_moe_hybrid.models import materialize

        # The meta-device model is wrapped (LoRA) and, with FSDP2, sharded, then given storage
        # on this rank's device and filled: each rank allocates its shards only. From scratch
        # models.initialize draws the pieces on the CPU one at a time (each from its own seed:
        # the weights build_model(config, seed=training.seed) gives, whatever the sharding); from
        # a checkpoint (safetensors, or a dist checkpoint, which reshards as it loads) each rank
        # reads its shards (a tensor the checkpoint lacks is an error, LoRA adapters excepted:
        # drawn anew, or a LoRA run's checkpoint's).
        from_scratch = t.init_from is None
        if config.lora.enabled:
            from megatron_moe_hybrid.layers.lora import apply_lora

            lo = config.lora
            self.lora_paths = apply_lora(
                self.model, lo.targets, lo.rank, lo.alpha, lo.dropout, rslora=lo.rslora,
                expert_adapter=lo.expert_adapter, target_modules=lo.target_modules,
            )
            if lo.base_dtype != "float32":
                from megatron_moe_hybrid.parallel.fsdp import _dtype

                base_dtype = _dtype(lo.base_dtype, "lora.base_dtype")
                for p in self.model.parameters():
                    if not p.requires_grad:  # the frozen base; adapters stay fp32
                        p.data = p.data.to(base_dtype)
        if self.dense_warmup:
            freeze_all_but_indexers(self.model)
        if config.parallel.fsdp:
            from megatron_moe_hybrid.parallel.fsdp import apply_fsdp

            apply_fsdp(self.model, config, device_type=self.device.type)
        if from_scratch:
            from megatron_moe_hybrid.models import initialize

            materialize(self.model, self.device)  # the LoRA adapters drawn again (into their shards)
            initialize(self.model, config, t.seed)
        else:
            materialize(self.model, self.device)  # the LoRA adapters drawn again (into their shards)
            try:
                missing = ckpt.load_model_weights(t.init_from, self.model, strict=False)
            except ckpt.CheckpointError as e:
                raise _start_error("training.init_from", e) from e
            adapters = {n for n, p in self.model.named_parameters() if p.requires_grad} if config.lora.enabled else set()
            ids = _indexer_parameter_ids(self.model)
            indexer = {n for n, p in self.model.named_parameters() if id(p) in ids}  # the indexers' tensors
            # The dense warm-up may start from a model trained with dense attention, which has
            # no indexers (DeepSeek-V3.2's from V3.1): they are drawn as from scratch.
            fresh = indexer if self.dense_warmup else set()
            lacking = [n for n in missing if n not in adapters and n not in fresh]
            if lacking:
                hint = "" if config.lora.enabled else (
                    "; if it is a LoRA run's checkpoint (its base stored as <module>.base.weight), fine-tune "
                    "it with lora.enabled and that run's lora.targets"
                )
                if indexer & set(lacking):  # (not in the warm-up: it draws them)
                    hint += ("; a checkpoint without the S layers' indexers (a model trained with dense attention) "
                             "starts with sparse_attention.stage: dense_warmup, which draws and trains them")
                raise _start_error("training.init_from", ckpt.CheckpointError(
                    f"{t.init_from}: missing tensors {lacking[:5]}{' ...' if len(lacking) > 5 else ''}{hint}"
                ))
            drawn = [n for n in missing if n in fresh]
            if drawn:
                from megatron_moe_hybrid.models import initialize

                initialize(self.model, config, t.seed, only=set(drawn))
                _print0(f"training.init_from: {len(drawn)} indexer tensors that {t.init_from} lacks drawn as from "
                        f"scratch (training.seed {t.seed}); the dense warm-up trains them")
        # the layers whose indexer KL loss each step logs (indexer_kl_loss)
        self.indexer_layers = self.model.indexer_layers() if config.sparse_attention.indexer_loss_coeff > 0 else []
        # The dense warm-up backwards the KL losses alone: the layers hand them over (with their
        # graphs) instead of carrying them on their outputs, so the frozen main path, which
        # needs no gradient, builds no graph after the first S layer either.
        self.indexer_losses: list = []
        if self.dense_warmup:
            for m in self.indexer_layers:
                m.indexer_loss_sink = self.indexer_losses
        # After fully_shard: the optimizer must hold the sharded parameters, trainable ones only.
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(
            self.params, t.lr, (t.adam_beta1, t.adam_beta2), t.weight_decay, t.optimizer_state_dtype
        )
        if config.memory.activation_offload:  # after fully_shard: it hooks the modules that run
            from megatron_moe_hybrid.parallel.offload import ActivationOffload

            self.activation_offload = ActivationOffload.from_config(self.model, config.memory)
        else:
            from contextlib import nullcontext

            self.activation_offload = nullcontext()
        torch.manual_seed(t.seed + 1000 + self.rank)  # per-rank stream (dropout, if any)
        self.step = 0
        self.consecutive_bad = 0
        self.skipped = 0
        self.first_bad: Optional[tuple[int, Optional[str]]] = None  # of the current run of bad steps
        from megatron_moe_hybrid.parallel.health import NonFiniteTracker

        self.tracker = NonFiniteTracker(self.model)
        self.last_checkpoint: Optional[str] = None
        self._maybe_resume()
        # Only now that the run has started from what it loaded: a run that stops above (a resume
        # into another model's output_dir, say) leaves that directory's config and tokenizer as they were.
        if self.rank == 0:
            save_config(config, os.path.join(self.output_dir, "config.yaml"))
            # fine-tuning runs and users reuse it: keep it with the run
            for name, path in tokenizer_files(self.tokenizer).items():
                _copy_atomic(str(path), os.path.join(self.output_dir, name))

    def _maybe_resume(self) -> None:
        from megatron_moe_hybrid.training import checkpoint as ckpt

        t = self.config.training
        if t.resume == "none":
            return
        candidates = (
            list(reversed(ckpt.list_checkpoints(self.output_dir))) if t.resume == "auto" else [t.resume]
        )
        if t.on_corrupt_checkpoint == "error":
            candidates = candidates[:1]
        for i, path in enumerate(candidates):
            error = None
            try:
                resharded_from = self._load(path)
            except ckpt.CheckpointError as e:
                error = str(e)
            # Every rank must resume from the same checkpoint: agree on the first failure.
            errors: list = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            failed = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
            if failed is not None:
                message = failed[1] if failed[0] == self.rank else f"rank {failed[0]}: {failed[1]}"
                if i + 1 < len(candidates):
                    _print0(f"warning: {message}; falling back to {candidates[i + 1]} (training.on_corrupt_checkpoint: previous)")
                    continue
                if "has shape" in message or "missing" in message and "tensors" in message:
                    message += (f" (a checkpoint of another model in {self.output_dir!r} cannot continue this run; "
                                "use a new training.output_dir, training.resume none, or that run's config)")
                raise _start_error("training.resume", ckpt.CheckpointError(message), every_rank=True)
            _print0(f"resumed from {path} at step {self.step}" + (
                f" (saved with {resharded_from}: its weights and optimizer moments resharded to this layout)"
                if resharded_from else ""))
            self.last_checkpoint = path
            if self.rank == 0:  # drop metrics of steps after the checkpoint
                self._truncate_metrics(self.step)
            return

    def _load(self, path: str) -> Optional[str]:
        """Loads the checkpoint at path; returns the layout that saved it where it was another
        (load_rank_state's resharded_from), else None."""
        from megatron_moe_hybrid.training import checkpoint as ckpt

        state = ckpt.load_rank_state(path)  # checks the layout before touching the model
        meta = ckpt.read_meta(ckpt.resolve_checkpoint(path))  # (path may name a run's output_dir)
        saved = meta.get("config", {}).get("sparse_attention", {}).get("stage")
        stage = self.config.sparse_attention.stage
        if saved is not None and saved != stage:  # every rank reads the same meta.json: all stop here
            raise _start_error("sparse_attention.stage", ckpt.CheckpointError(
                f"{path} was saved by a {saved} run and this run is {stage}: the stages train other weights "
                f"(the dense warm-up only the indexers), so one cannot resume the other's optimizer and step; "
                f"start the {stage} stage in a new training.output_dir with training.init_from: {path} "
                f"(its weights, a new schedule), or set sparse_attention.stage back to {saved}"
            ), every_rank=True)
        if self._adapters_only():
            # The frozen base came from training.init_from; the checkpoint holds the rest.
            missing = ckpt.load_model_weights(path, self.model, strict=False)
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            if trainable & set(missing):
                raise ckpt.CheckpointError(f"{path}: missing trainable tensors {sorted(trainable & set(missing))[:5]}")
        else:
            ckpt.load_model_weights(path, self.model)
        if ckpt.holds_moments(state["optimizer"]):  # an earlier version's checkpoint, in its own layout
            self.optimizer.load_state_dict(state["optimizer"])
            if self.config.parallel.fsdp:
                from megatron_moe_hybrid.parallel.fsdp import optimizer_state_from_local

                optimizer_state_from_local(self.optimizer)
        else:
            ckpt.load_optimizer_state(path, self.model, self.optimizer, state["optimizer"])
        self.step = int(state["step"])
        self.skipped = int(state.get("skipped", 0))
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return state.get("resharded_from")

    def _load_data(self) -> None:
        """The tokenizer, the training samples and, with training.eval_data_path, the held-out ones."""
        from megatron_moe_hybrid.training.data import get_tokenizer, load_tokenizer, open_dataset

        t = self.config.training
        data_opts = dict(bad_data=t.bad_data, text_field=t.text_field, max_document_chars=t.max_document_chars,
                         data_format=t.data_format, prompt_field=t.prompt_field, response_field=t.response_field,
                         messages_field=t.messages_field, chat_format=t.chat_format,
                         chat_template_kwargs=t.chat_template_kwargs, chat_turns=t.chat_turns)
        self.tokenizer = (
            load_tokenizer(t.tokenizer_model)
            if t.tokenizer_model
            else get_tokenizer(t.data_path, self.config.vocab_size, t.cache_dir, **data_opts)
        )
        self.dataset = open_dataset(t.data_path, self.tokenizer, t.seq_length, t.cache_dir, t.seed, packing=t.packing,
                                    **data_opts)
        if _is_rank0():  # the summary reads every packing's spans: rank 0 only
            print(_data_summary("data", t.data_path, self.dataset, t.data_format), flush=True)
        self.eval_dataset = None
        if t.eval_data_path is not None:
            try:
                self.eval_dataset = open_dataset(
                    t.eval_data_path, self.tokenizer, t.seq_length, t.cache_dir, t.seed, packing=t.packing, **data_opts
                )
            except ValueError as e:  # too little text for one sample
                raise _start_error("training.eval_data_path", ValueError(str(e).replace(
                    "training.seq_length: ", ""))) from e  # fmt: skip
            if _is_rank0():
                print(_data_summary("held-out data", t.eval_data_path, self.eval_dataset, t.data_format), flush=True)
            need = t.eval_batches * t.global_batch_size
            if self.eval_dataset.num_samples < need:
                raise _start_error("training.eval_batches", ValueError(
                    f"{t.eval_batches} global batches of {t.global_batch_size} samples need {need} samples of "
                    f"{t.seq_length + 1} tokens; {t.eval_data_path!r} holds {self.eval_dataset.num_samples}: lower "
                    "training.eval_batches or give more held-out text"))  # fmt: skip

    def _local(self, dataset, start: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """This rank's pieces of the micro-batch of dataset's samples from start, [b, s / CP]
        (context-parallel ranks read the same samples; averaging over them, equal shares, makes
        the loss the mean over the sequence), and the model's keyword arguments: with
        training.isolate_records the micro-batch as one packed row [1, b s / CP] and its records'
        packed_seq_params (global offsets under CP)."""
        from megatron_moe_hybrid.training.data import batch, batch_record_starts, pack_records

        size = self.config.training.micro_batch_size
        try:
            tokens, labels = batch(dataset, start, size)  # on the CPU
        except ValueError as e:  # a sample the load's checks could not see (an indexed file's id past its first
            # tokens): one line naming the field, not a traceback (torchrun then stops the other ranks); an
            # error that names no field is a bug, whose traceback stays
            if _field_named(e) is None:
                raise
            who = f"rank {self.rank}: " if dist.get_world_size() > 1 else ""
            raise TrainingStopped(f"{who}training stopped at step {self.step + 1}: {e}") from e
        if not self.config.training.isolate_records:
            return self.cp_layout.shard(tokens, 1), self.cp_layout.shard(labels, 1), {}
        from megatron.core.packed_seq_params import PackedSeqParams

        tokens, cu = pack_records(tokens, batch_record_starts(dataset, start, size))  # [1, b s], [R + 1]
        labels = labels.reshape(1, -1)
        longest = int((cu[1:] - cu[:-1]).max())
        cu = cu.to(self.device)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)  # fmt: skip
        if self.cp_layout.size > 1:  # one sample (validate()): the row is the sequence CP splits
            tokens, labels = self.cp_layout.shard(tokens, 1), self.cp_layout.shard(labels, 1)
        return tokens, labels, {"packed_seq_params": packed}

    def _positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """position_ids [b, s / CP] (the layers derive their RoPE positions from these, or per record)."""
        if self.config.training.isolate_records and self.cp_layout.size == 1:
            return torch.arange(tokens.shape[1], device=self.device).expand_as(tokens)
        return self.cp_layout.positions().expand_as(tokens).to(self.device)

    def _trained_token_scale(self, labels: list[torch.Tensor]) -> Optional[float]:
        """dp / (trained tokens of the global batch) where some labels are IGNORE_INDEX
        (prompt_response / messages data, fit packing's padding; one all-reduce of a count), else None."""
        from megatron_moe_hybrid.parallel.data_parallel import all_reduce_sum
        from megatron_moe_hybrid.training.data import IGNORE_INDEX

        if not self.dataset.masked_labels:
            return None
        local = sum(int((x != IGNORE_INDEX).sum()) for x in labels)
        count = float(all_reduce_sum(torch.tensor(float(local), device=self.device), self.groups.dp))
        return self.groups.dp_size / max(count, 1.0)  # a batch of prompts alone trains nothing

    def evaluate(self) -> dict:
        """The mean next-token loss over the held-out samples (the same eval_batches global batches
        each time, split over the data-parallel ranks as training splits its batches), without
        gradients, dropout or MoE load statistics: {"eval_loss", "eval_tokens"}."""
        from megatron_moe_hybrid.parallel.data_parallel import all_reduce_sum
        from megatron_moe_hybrid.training.data import IGNORE_INDEX

        t = self.config.training
        per_rank = t.global_batch_size // self.data_dp_size
        total = torch.zeros((), device=self.device)  # the loss summed over trained tokens (ignored ones add 0)
        trained = 0
        self.model.eval()
        try:
            with torch.no_grad():
                for b in range(t.eval_batches):
                    for micro in range(self.num_micro):
                        start = b * t.global_batch_size + self.dp_rank * per_rank + micro * t.micro_batch_size
                        tokens, labels, packed = self._local(self.eval_dataset, start)
                        loss_bs = self.model(tokens.to(self.device), self._positions(tokens), None,
                                             labels=labels.to(self.device), **packed)  # fmt: skip
                        total += loss_bs.float().sum()
                        trained += int((labels != IGNORE_INDEX).sum())  # labels on the CPU: no sync
            self._check_dispatch_overflow("the evaluation before step")
        finally:
            self.model.train()
            for layer in self.model.moe_layers():
                layer.reset_stats()
        sums = all_reduce_sum(torch.stack([total, torch.tensor(float(trained), device=self.device)]), self.groups.dp)
        loss, tokens = sums[0] / sums[1].clamp_min(1.0), int(sums[1])
        return {"eval_loss": float(loss), "eval_tokens": tokens}

    def _check_dispatch_overflow(self, when: str) -> None:
        """Raises TrainingStopped where any rank's static dispatcher dropped routed copies."""
        layers = self.model.moe_layers()
        if not layers:
            return
        overflow = torch.stack([layer.dispatch_overflow.float() for layer in layers])  # [L]
        dist.all_reduce(overflow)
        if overflow.any():
            raise TrainingStopped(self._overflow_message(overflow, when))

    def _overflow_message(self, overflow: torch.Tensor, when: str) -> str:
        return (
            f"moe.dispatch_capacity_factor={self.config.moe.dispatch_capacity_factor}: the static "
            f"dispatcher's receive capacity overflowed in {when} {self.step + 1} ({int(overflow.sum())} routed "
            f"copies not sent, first in MoE layer {int(overflow.nonzero()[0, 0])}). Raise moe.dispatch_capacity_factor "
            "(up to the expert-parallel size, which can never overflow), or set moe.dispatcher=alltoall (exact, "
            "one host sync per layer)"
        )

    def _adapters_only(self) -> bool:
        return self.config.lora.enabled and self.config.lora.adapters_only_checkpoint

    def _metrics_path(self) -> str:
        return os.path.join(self.output_dir, "metrics.jsonl")

    def _truncate_metrics(self, last_step: int) -> None:
        for path in (self._metrics_path(), os.path.join(self.output_dir, "expert_load.jsonl")):
            if not os.path.exists(path):
                continue
            with open(path) as f:
                keep = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
            with open(path, "w") as f:
                f.writelines(keep)

    def _batch_start(self, step: int, micro: int) -> int:
        """The first sample of this rank's micro-batch `micro` of `step`."""
        t = self.config.training
        per_rank = t.global_batch_size // self.data_dp_size
        return step * t.global_batch_size + self.dp_rank * per_rank + micro * t.micro_batch_size

    def _moe_stats(self) -> dict:
        """Global expert load (all ranks' routed copies) per MoE layer; updates expert bias."""
        layers = self.model.moe_layers()
        if not layers:
            return {}
        counts = torch.stack([layer.tokens_per_expert.float() for layer in layers])  # [L, E]
        overflow = torch.stack([layer.dispatch_overflow.float() for layer in layers])  # [L]
        counts = torch.cat([counts, overflow[:, None]], dim=1)  # one all-reduce for both
        dist.all_reduce(counts)  # every rank routed its own tokens
        counts, overflow = counts[:, :-1], counts[:, -1]
        if overflow.any():
            raise TrainingStopped(self._overflow_message(overflow, "step"))
        aux = torch.stack([layer.last_aux_loss.float().reshape(()) for layer in layers]).mean()
        for layer, c in zip(layers, counts):
            if self.config.moe.expert_bias and not self.dense_warmup:
                layer.router.update_expert_bias(c)  # (the dense warm-up leaves the router as it is)
            layer.reset_stats()
        if self.rank == 0:  # the full per-layer, per-expert counts of this step
            with open(os.path.join(self.output_dir, "expert_load.jsonl"), "a") as f:
                f.write(json.dumps({"step": self.step + 1, "tokens_per_expert": counts.long().tolist()}) + "\n")
        per_layer_max, per_layer_mean = counts.max(dim=1).values, counts.mean(dim=1)
        return {
            "expert_load_max": float(per_layer_max.mean()),
            "expert_load_mean": float(per_layer_mean.mean()),
            "expert_load_max_over_mean": float((per_layer_max / per_layer_mean.clamp_min(1e-9)).max()),
            "aux_loss": float(aux),
        }

    def train_step(self) -> dict:
        from megatron_moe_hybrid.parallel.data_parallel import (
            all_reduce_mean,
            clip_gradients,
            global_grad_norm,
            sync_gradients,
        )

        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        t = self.config.training
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.tracker.reset()
        # Auxiliary losses (MoE balancing, indexer KL) are averaged over micro-batches like
        # the LM loss, so the gradient does not depend on how the batch is split.
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / self.num_micro, device=self.device))
        loss_sum = torch.zeros((), device=self.device)
        kl_sum = torch.zeros((), device=self.device)  # the indexer KL, mean over the layers, summed over micro-batches
        # [b, s / CP]: this rank's pieces of each micro-batch (read on the CPU up front)
        batches = [self._local(self.dataset, self._batch_start(self.step, micro)) for micro in range(self.num_micro)]
        # Labels some tokens do not train (records' prompts, fit packing's padding): the loss is
        # the sum over the global batch's trained tokens over their count, so each rank scales its
        # sum by dp / count before the gradients' mean over the dp ranks. Otherwise every rank
        # holds as many tokens, and the mean of the micro-batches' means is that sum over count.
        scale = self._trained_token_scale([labels for _, labels, _ in batches])
        for tokens, labels, packed in batches:
            position_ids = self._positions(tokens)
            tokens, labels = tokens.to(self.device), labels.to(self.device)
            with self.activation_offload:  # a no-op context unless memory.activation_offload
                loss_bs = self.model(tokens, position_ids, None, labels=labels, **packed)  # [b, s] fp32
                loss = loss_bs.mean() if scale is None else loss_bs.sum() * scale
                if self.dense_warmup:  # the KL losses, scaled as MoEAuxLossAutoScaler scales them
                    (torch.stack(self.indexer_losses).sum() / self.num_micro).backward()
                    self.indexer_losses.clear()
                else:
                    (loss / self.num_micro if scale is None else loss).backward()
            loss_sum += loss.detach()
            if self.indexer_layers:
                kl_sum += torch.stack([m.last_indexer_loss.float().reshape(()) for m in self.indexer_layers]).mean()
        if self.config.lora.enabled:  # replicated LoRA factors hold per-TP-rank partial grads
            from megatron_moe_hybrid.layers.lora import allreduce_lora_partial_grads

            allreduce_lora_partial_grads(self.model)
        sync_gradients(self.params, self.groups)
        grad_norm = global_grad_norm(self.params, self.groups)
        # the loss and the indexer KL in one all-reduce and one read to the host
        loss_value, kl_value = all_reduce_mean(
            torch.stack([loss_sum / (self.num_micro if scale is None else 1), kl_sum / self.num_micro]), self.groups.dp
        ).tolist()
        lr = lr_at(self.step, t)
        finite = math.isfinite(grad_norm) and math.isfinite(loss_value)
        if finite:
            clip_gradients(self.params, t.grad_clip, grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.consecutive_bad = 0
        else:
            self._bad_step(loss_value, grad_norm)
        metrics = {"step": self.step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm}
        if self.indexer_layers:  # what the dense warm-up trains; the sparse stage adds it to the loss
            metrics["indexer_kl_loss"] = kl_value
        if not finite:
            metrics["bad_step"] = True
        metrics.update(self._moe_stats())
        elapsed = time.perf_counter() - start
        metrics["tokens_per_s"] = t.global_batch_size * t.seq_length / elapsed
        metrics["skipped_steps"] = self.skipped
        if self.config.memory.activation_offload:  # this step's share of the running totals
            stats = self.activation_offload.stats()
            seen_bytes, seen_stall = getattr(self, "_offload_seen", (0, 0.0))
            metrics["offload_bytes"] = stats["bytes"] - seen_bytes
            metrics["offload_stall_ms"] = stats["stall_ms"] - seen_stall
            self._offload_seen = (stats["bytes"], stats["stall_ms"])
        metrics.update(self.dataset.data_stats)  # records dropped under training.bad_data: skip (and conversations split)
        self.step += 1
        return metrics

    def _bad_step(self, loss_value: float, grad_norm: float) -> None:
        """Skips the update; stops the run after max_consecutive_bad_steps in a row."""
        self.skipped += 1
        self.consecutive_bad += 1
        first = self.tracker.first_bad()
        names: list = [None] * dist.get_world_size()
        dist.all_gather_object(names, first)
        where = next((f"{n} (on rank {r})" for r, n in enumerate(names) if n is not None), None)
        if self.consecutive_bad == 1:
            self.first_bad = (self.step + 1, where)
        _print0(
            f"warning: step {self.step + 1} skipped: loss {loss_value}, gradient norm {grad_norm}"
            + (f"; first non-finite gradient in {where}" if where else "")
        )
        limit = self.config.training.max_consecutive_bad_steps
        if self.consecutive_bad >= limit:
            first_step, first_where = self.first_bad
            raise TrainingStopped(
                f"training stopped: {self.consecutive_bad} steps in a row ({first_step}-{self.step + 1}) "
                f"had a non-finite loss or gradient (training.max_consecutive_bad_steps={limit}); "
                f"at step {first_step} the first non-finite gradient in backward order was in "
                f"{first_where or 'no parameter (the loss itself was not finite)'}; "
                f"last good checkpoint: {self.last_checkpoint or '(none)'}"
            )

    def save(self) -> Optional[str]:
        from megatron_moe_hybrid.training import checkpoint as ckpt

        # save_checkpoint writes the optimizer's moments beside the weights (each read back as its
        # parameter, under any layout) and its step counts and param groups into the state file
        state = {
            "step": self.step,
            "skipped": self.skipped,
            "rng": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        meta = {"mode": self.mode, "config": self.config.to_dict()}
        try:
            path = ckpt.save_checkpoint(
                self.output_dir, self.step, self.model, state, meta, keep=self.config.training.keep_checkpoints,
                trainable_only=self._adapters_only(), optimizer=self.optimizer,
            )
        except ckpt.CheckpointSaveError as e:
            if self.config.training.on_save_error == "stop":
                raise TrainingStopped(f"training stopped at step {self.step}: {e} (training.on_save_error: stop)") from e
            _print0(f"warning: {e}; training continues (training.on_save_error: continue)")
            return None
        self.last_checkpoint = path
        return path

    def save_adapter(self) -> str:
        """adapter/adapter_model.safetensors (and adapter_config.json): each rank writes the
        adapter tensors it owns (the checkpoint's share, checkpoint._walk_model) into a part file,
        and rank 0 joins the parts into the one file a tensor at a time, so that no rank holds more
        than one tensor (per-expert adapters of hundreds of experts are tens of GB)."""
        import shutil

        from megatron_moe_hybrid.training import checkpoint as ckpt

        final = os.path.join(self.output_dir, "adapter")
        tmp = final + ".tmp"
        parts = os.path.join(tmp, "parts")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(parts)
        dist.barrier()
        error = None
        try:
            ckpt.write_tensors(os.path.join(parts, f"rank{self.rank:05d}.safetensors"),
                               ckpt._walk_model(self.model, trainable_only=True), checksums=False)
        except OSError as e:
            error = ckpt._describe_os_error(e, parts)
        error = ckpt._first_error(error)
        if error is None and self.rank == 0:
            try:
                ckpt.join_safetensors(sorted(os.path.join(parts, f) for f in os.listdir(parts)),
                                      os.path.join(tmp, "adapter_model.safetensors"))
                shutil.rmtree(parts)
                lo = self.config.lora
                with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
                    json.dump({"r": lo.rank, "lora_alpha": lo.alpha, "lora_dropout": lo.dropout,
                               "rslora": lo.rslora, "expert_adapter": lo.expert_adapter,
                               "num_experts": self.config.moe.num_experts,
                               "targets": lo.targets, "target_modules": lo.target_modules,
                               "modules": self.lora_paths,
                               "base_checkpoint": self.config.training.init_from}, f, indent=1)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            except OSError as e:
                error = ckpt._describe_os_error(e, tmp)
        error = ckpt._first_error(error)
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise TrainingStopped(f"training stopped at step {self.step}: writing the adapter failed: {error}; "
                                  f"the checkpoint {self.last_checkpoint or '(none)'} holds it")
        return final

    def fit(self) -> RunResult:
        t = self.config.training
        result = RunResult(self.output_dir)
        bar = None
        if self.rank == 0 and t.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=t.train_steps, initial=self.step, desc=self.mode, dynamic_ncols=True,
                       file=sys.stderr)
        metrics_file = open(self._metrics_path(), "a") if self.rank == 0 else None
        board = None
        if self.rank == 0 and t.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            board = SummaryWriter(t.tensorboard_dir, purge_step=self.step + 1)  # a resume rewrites what follows
        stop_at = t.train_steps
        if t.exit_after_steps:
            stop_at = min(t.train_steps, self.step + t.exit_after_steps)
        from megatron_moe_hybrid.parallel.health import Heartbeat

        heartbeat = Heartbeat().start()
        try:
            while self.step < stop_at:
                m = self.train_step()
                result.losses.append(m["loss"])
                if self.eval_dataset is not None and (
                    self.step == stop_at or (t.eval_interval and self.step % t.eval_interval == 0)
                ):  # on the step's line of metrics.jsonl
                    m.update(self.evaluate())
                    result.eval_losses.append((self.step, m["eval_loss"]))
                if metrics_file is not None:
                    metrics_file.write(json.dumps(m) + "\n")
                    metrics_file.flush()
                if board is not None:
                    for key, value in m.items():
                        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                            board.add_scalar(f"{'eval' if key.startswith('eval_') else 'train'}/{key}", value, m["step"])
                    board.flush()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}",
                                    **({"eval_loss": f"{m['eval_loss']:.4f}"} if "eval_loss" in m else {}))
                if t.save_interval and self.step % t.save_interval == 0 and self.step < stop_at:
                    self.save()
            result.checkpoint = self.save()
            if self.mode == "finetune" and self.step >= t.train_steps:
                result.adapter_dir = self.save_adapter()
        except TrainingStopped:
            raise
        except Exception as e:
            if dist.get_world_size() == 1:
                raise
            dead, note = heartbeat.dead_ranks()
            if not dead:
                raise
            raise TrainingStopped(
                f"rank {self.rank}: rank {', '.join(map(str, dead))} failed during step {self.step + 1} "
                f"({note}; the collective reported: {str(e).splitlines()[0][:200]}); last good "
                f"checkpoint: {self.last_checkpoint or '(none)'}; restart the job to resume from it",
                peer_failed=True,
            ) from e
        finally:
            heartbeat.stop()
            if bar is not None:
                bar.close()
            if metrics_file is not None:
                metrics_file.close()
            if board is not None:
                board.close()
        return result


def loss_curve_text(losses: list, rows: int = 10) -> str:
    """The loss curve as `rows` windows of consecutive steps, each with its mean loss."""
    if not losses:
        return "(no steps run)"
    n = len(losses)
    bounds = sorted({round(i * n / rows) for i in range(rows + 1)})
    windows = [(a, b, sum(losses[a:b]) / (b - a)) for a, b in zip(bounds, bounds[1:]) if b > a]
    lo, hi = min(w[2] for w in windows), max(w[2] for w in windows)
    lines = []
    for a, b, mean in windows:
        bar = "#" * (1 + int(40 * (mean - lo) / (hi - lo))) if hi > lo else "#"
        lines.append(f"  steps {a + 1:5d}-{b:<5d} mean loss {mean:8.4f}  {bar}")
    return "\n".join(lines)


def check_lora_base(config: HybridMoEConfig) -> None:
    """Before launch, from the file system: a LoRA run loads base weights, from training.init_from
    or a checkpoint training.resume finds; else a ConfigError naming training.init_from (its
    adapters would train on a randomly drawn base)."""
    from megatron_moe_hybrid.training import checkpoint as ckpt

    t = config.training
    if not config.lora.enabled or t.init_from is not None:
        return
    if t.resume == "none" or (t.resume == "auto" and not ckpt.list_checkpoints(t.output_dir)):
        raise _start_error("training.init_from", ValueError(
            f"LoRA fine-tuning needs base weights and none would be loaded (training.resume {t.resume!r} finds "
            f"no checkpoint in {t.output_dir!r}); set training.init_from to a pretraining run's output_dir or "
            "checkpoint"))


def _field_error(error: Exception) -> Exception:
    """A data or tokenizer error whose message starts with the config field it is about
    ("training.data_path: ...", the data module's way) as a ConfigError, which the CLIs print
    as one line with exit status 2; any other error as it is."""
    found = _field_named(error)
    if found is None:
        return error
    converted = _start_error(found.group(1), ValueError(str(error)[found.end():]))
    converted.__cause__ = error
    return converted


def _field_named(error: Exception):
    """The match of the config field a data or tokenizer ValueError's message starts with
    ("training.data_path: ..."), or None."""
    import re

    return re.match(r"([a-z_]+(?:\.[a-z_]+)+): ", str(error)) if isinstance(error, ValueError) else None


def _start_error(field: str, error: Exception, every_rank: bool = False):
    """A run that cannot start from what it was told to load: a ConfigError naming the field (the
    CLIs print it as one line, exit status 2; every_rank: the ranks agreed on it, rank 0 prints it)."""
    from megatron_moe_hybrid.config import ConfigError

    return ConfigError(field, str(error), every_rank=every_rank)


def run(config: HybridMoEConfig, mode: str) -> RunResult:
    """Trains; raises ConfigError (bad launch) or TrainingStopped (the message says why). A run
    with lora.enabled is a fine-tune whichever entry point started it (its label, its adapter/)."""
    if config.lora.enabled:
        mode = "finetune"
    check_lora_base(config)  # before any process group or allocation
    init_distributed(config)
    peer_failed = False
    try:
        trainer = Trainer(config, mode)
        result = trainer.fit()
        records = []
        path = trainer._metrics_path()
        if trainer.rank == 0 and os.path.exists(path):
            with open(path) as f:
                records = [json.loads(line) for line in f if line.strip()]
        all_losses = [r["loss"] for r in records]
        _print0(f"\n{mode} loss curve ({len(all_losses)} steps):\n{loss_curve_text(all_losses)}")
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if evals:
            shown = evals[:: -(-len(evals) // 10)]  # at most 10, the last among them
            shown += evals[-1:] if shown[-1] != evals[-1] else []
            _print0("held-out loss (training.eval_data_path): " + ", ".join(f"step {s} {v:.4f}" for s, v in shown))
        _print0(f"metrics: {os.path.join(trainer.output_dir, 'metrics.jsonl')}")
        _print0(f"checkpoint: {result.checkpoint}")
        if result.adapter_dir:
            _print0(f"adapter saved to: {result.adapter_dir}")
        return result
    except TrainingStopped as e:
        peer_failed = e.peer_failed
        raise
    finally:
        from megatron.core import parallel_state as ps

        # After a peer died, collectives (and group teardown) could block: leave them.
        if not peer_failed:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
