"""Atomic, pickle-free checkpoints that reshard over expert parallelism.

Layout of one checkpoint, <output_dir>/checkpoints/step_00000020/:
    meta.json                   written last: step, world layout, config, the file list
    model-ep00000.safetensors   weights; expert tensors split per *global* expert
    ...                         (`<name>.expert<g>`), dense tensors only in ep00000
    state-rank00000.pt          optimizer / scheduler / data position / RNG of one rank,
                                loaded with torch.load(weights_only=True)

All ranks write into `.tmp-step_...`, rank 0 writes meta.json and renames the directory:
a checkpoint without meta.json, or a `.tmp-` one, is incomplete and never loaded. Model
weights load under any expert-parallel size (each rank picks its experts by global id);
optimizer state needs the layout it was saved with.

Under FSDP2 the model's tensors are DTensors: a save gathers each one whole (a collective
over the mesh that shards it, so every rank walks the same names in the same order) and
writes the same global names as an unsharded run; a load cuts this rank's shard out of the
whole tensor. Checkpoints therefore move freely between FSDP and plain runs.
"""

import errno
import pickle
import json
import os
import re
import shutil
import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

CKPT_DIR = "checkpoints"
_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    pass


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _ep_info() -> tuple[int, int, int]:
    """(ep_rank, ep_size, expert_dp_rank)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, 0
    return (
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_data_parallel_rank(),
    )


def _expert_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if hasattr(p, "num_local_experts")}


def model_tensors_to_save(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """This rank's share of the model under global names."""
    ep_rank, _, expert_dp_rank = _ep_info()
    experts = _expert_params(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if not isinstance(tensor, torch.Tensor):
            continue
        if trainable_only and name not in trainable:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if name in experts:
            if expert_dp_rank != 0:
                continue
            e_local = experts[name].num_local_experts
            for i in range(e_local):
                out[f"{name}.expert{ep_rank * e_local + i}"] = _host_copy(tensor[i])
        elif _rank() == 0:
            out[name] = _host_copy(tensor)
    return out


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (safetensors and the checksums read host memory)."""
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints, oldest first."""
    root = os.path.join(output_dir, CKPT_DIR)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if _STEP_RE.match(name) and os.path.isfile(os.path.join(path, "meta.json")):
            found.append(path)
    return sorted(found)


def latest_checkpoint(output_dir: str) -> Optional[str]:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed on some rank; nothing partial is left behind."""


def _crc32(t: torch.Tensor) -> str:
    return f"{zlib.crc32(t.detach().contiguous().view(-1).view(torch.uint8).numpy()):08x}"


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_rank_files(tmp: str, model, rank_state, trainable_only: bool) -> dict[str, int]:
    """This rank's files; returns {file name: size in bytes}."""
    rank = _rank()
    ep_rank, _, _ = _ep_info()
    written = {}
    tensors = model_tensors_to_save(model, trainable_only)
    if tensors:
        path = os.path.join(tmp, f"model-ep{ep_rank:05d}-r{rank:05d}.safetensors")
        # A CRC per tensor (in the safetensors header) lets a load name the corrupt tensor.
        save_file(tensors, path, metadata={k: _crc32(v) for k, v in tensors.items()})
        written[os.path.basename(path)] = path
    path = os.path.join(tmp, f"state-rank{rank:05d}.pt")
    torch.save(rank_state, path)
    written[os.path.basename(path)] = path
    for p in written.values():
        _fsync(p)
    return {name: os.path.getsize(p) for name, p in written.items()}


def save_checkpoint(
    output_dir: str,
    step: int,
    model: torch.nn.Module,
    rank_state: dict[str, Any],
    meta: dict[str, Any],
    keep: int = 2,
    trainable_only: bool = False,
) -> str:
    """Collective: every rank calls it. Returns the final directory.

    If any rank fails to write (a full disk, a permission error), every rank raises
    CheckpointSaveError, the partial directory is removed and older checkpoints stay.
    """
    root = os.path.join(output_dir, CKPT_DIR)
    name = f"step_{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    rank = _rank()
    error: Optional[str] = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            for stale in os.listdir(root):  # leftovers of a crashed save
                if stale.startswith(".tmp-"):
                    shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = _describe_os_error(e, tmp)
    error = _first_error(error)
    sizes: dict[str, int] = {}
    if error is None:
        try:
            sizes = _write_rank_files(tmp, model, rank_state, trainable_only)
        except OSError as e:
            error = _describe_os_error(e, tmp)
        error = _first_error(error)
    all_sizes = _gather(sizes)
    if error is None and rank == 0:
        try:
            world = dist.get_world_size() if dist.is_initialized() else 1
            _, ep_size, _ = _ep_info()
            files = {k: v for part in all_sizes for k, v in part.items()}
            meta = dict(meta, step=step, world_size=world, expert_model_parallel_size=ep_size,
                        files=dict(sorted(files.items())))
            _atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
            if os.path.exists(final):  # re-saving the same step replaces it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(root)
        except OSError as e:
            error = _describe_os_error(e, tmp)
    error = _first_error(error)
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        previous = latest_checkpoint(output_dir)
        raise CheckpointSaveError(
            f"saving checkpoint step {step} failed: {error}; nothing of it was kept, and the "
            f"previous checkpoint {previous or '(none)'} is intact"
        )
    if rank == 0:
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def save_checkpoint_streaming(output_dir: str, step: int, parts, meta: dict[str, Any]) -> str:
    """One process writes a checkpoint from `parts`, an iterable of {global name: tensor} dicts
    (experts under `<name>.expert<g>`, as model_tensors_to_save names them), one file per part:
    only one part is in memory at a time. The same format as save_checkpoint (loads under any
    expert-parallel size); written into a temporary directory renamed at the end."""
    root = os.path.join(output_dir, CKPT_DIR)
    name = f"step_{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        files = {}
        for k, tensors in enumerate(parts):
            path = os.path.join(tmp, f"model-part{k:05d}.safetensors")
            tensors = {n: t.detach().contiguous() for n, t in tensors.items()}
            save_file(tensors, path, metadata={n: _crc32(t) for n, t in tensors.items()})
            _fsync(path)
            files[os.path.basename(path)] = os.path.getsize(path)
        state = os.path.join(tmp, "state-rank00000.pt")
        torch.save({}, state)
        files[os.path.basename(state)] = os.path.getsize(state)
        meta = dict(meta, step=step, world_size=1, expert_model_parallel_size=1, files=dict(sorted(files.items())))
        _atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _describe_os_error(e: OSError, where: str) -> str:
    if e.errno == errno.ENOSPC:
        return f"disk full (no space left on device) while writing {e.filename or where}: free space or lower training.keep_checkpoints"
    if e.errno == errno.EDQUOT:
        return f"disk quota exceeded while writing {e.filename or where}"
    return f"{e.strerror or e} while writing {e.filename or where}"


def _first_error(local: Optional[str]) -> Optional[str]:
    """The first rank's error, agreed on by every rank (so no rank waits at a barrier alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, local)
    for r, e in enumerate(errors):
        if e is not None:
            return f"rank {r}: {e}"
    return None


def _gather(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, or a run's output_dir meaning its newest complete checkpoint."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(
            f"{path}: no complete checkpoint here (no meta.json, no {CKPT_DIR}/step_*/meta.json)"
        )
    return latest


def read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no meta.json)")
    try:
        with open(meta_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({e})") from e


def verify_files(path: str) -> dict[str, Any]:
    """Checks that every file meta.json lists is there with its size; returns the meta."""
    meta = read_meta(path)
    files = meta.get("files", {})
    for name, size in files.items():
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath}: missing (the checkpoint lists it); restore it or load an older checkpoint")
        actual = os.path.getsize(fpath)
        if actual != size:
            raise CheckpointError(f"{fpath}: truncated or altered: {actual} bytes, {size} were written")
    return meta


def _unwrapped_name(model: torch.nn.Module):
    """name -> the name a checkpoint without LoRA gives it: `<wrapper>.base.<rest>` ->
    `<wrapper>.<rest>` for every LoRA wrapper of the model (a base checkpoint loaded under LoRA)."""
    from megatron_moe_hybrid.layers.lora import lora_modules

    prefixes = [f"{path}.base." for path, _ in lora_modules(model)]

    def unwrapped(name: str) -> str:
        for prefix in prefixes:
            if name.startswith(prefix):
                return prefix[: -len("base.")] + name[len(prefix):]
        return name

    return unwrapped


@torch.no_grad()
def copy_whole(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Copies the whole (unsharded) value into a model tensor, cast to its dtype; into an FSDP2
    DTensor only this rank's shard (every rank holds the whole value: no scatter)."""
    value = value.to(tensor.dtype)
    if isinstance(tensor, DTensor):
        value = distribute_tensor(value.to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None)
    tensor.copy_(value)


def load_model_weights(path: str, model: torch.nn.Module, strict: bool = True) -> list[str]:
    """Loads this rank's share of the weights; returns the names of model tensors not found.

    strict=True raises if a tensor is missing or has the wrong shape; strict=False (e.g. a
    base checkpoint loaded under LoRA) only allows *missing* names. A LoRA-wrapped base tensor
    (`<wrapper>.base.weight`) is also found under its unwrapped name (`<wrapper>.weight`). A dist checkpoint
    (training/dist_checkpoint.py, or a run directory holding one) reshards as it loads.
    """
    from .dist_checkpoint import find_dist_checkpoint, load_dist_checkpoint

    dist_dir = find_dist_checkpoint(path)
    if dist_dir is not None:
        return load_dist_checkpoint(dist_dir, model, strict=strict)
    path = resolve_checkpoint(path)
    meta = verify_files(path)
    ep_rank, _, _ = _ep_info()
    available: dict[str, str] = {}
    crcs: dict[str, str] = {}
    for fname in sorted(meta.get("files") or os.listdir(path)):
        if fname.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(path, fname), framework="pt") as f:
                    crcs.update(f.metadata() or {})
                    for key in f.keys():
                        available[key] = fname
            except Exception as e:  # safetensors raises its own types on a corrupt header
                raise CheckpointError(f"{os.path.join(path, fname)}: unreadable safetensors file ({e})") from e
    experts = _expert_params(model)
    state = model.state_dict()
    missing = []
    handles: dict[str, Any] = {}
    unwrapped = _unwrapped_name(model)

    def read(key: str) -> torch.Tensor:
        fname = available[key]
        if fname not in handles:
            handles[fname] = safe_open(os.path.join(path, fname), framework="pt")
        tensor = handles[fname].get_tensor(key)
        if key in crcs and _crc32(tensor) != crcs[key]:
            raise CheckpointError(
                f"{os.path.join(path, fname)}: tensor {key} is corrupt (checksum mismatch); "
                "load an older checkpoint (training.on_corrupt_checkpoint: previous)"
            )
        return tensor

    with torch.no_grad():
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if name in experts:
                e_local = experts[name].num_local_experts
                for stored_as in (name, unwrapped(name)):
                    keys = [f"{stored_as}.expert{ep_rank * e_local + i}" for i in range(e_local)]
                    if all(k in available for k in keys):
                        break
                else:
                    missing.append(name)
                    continue
                value = torch.stack([read(k) for k in keys])
            elif name in available or unwrapped(name) in available:
                value = read(name if name in available else unwrapped(name))
            else:
                missing.append(name)
                continue
            if value.shape != tensor.shape:
                raise CheckpointError(
                    f"{path}: tensor {name} has shape {tuple(value.shape)} in "
                    f"{available.get(name) or available.get(f'{name}.expert0')}, the model expects "
                    f"{tuple(tensor.shape)}"
                )
            copy_whole(tensor, value)
    if strict and missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return missing


def load_rank_state(path: str) -> dict[str, Any]:
    path = resolve_checkpoint(path)
    meta = verify_files(path)
    world = dist.get_world_size() if dist.is_initialized() else 1
    _, ep_size, _ = _ep_info()
    if meta["world_size"] != world or meta["expert_model_parallel_size"] != ep_size:
        raise CheckpointError(
            f"{path}: saved with world size {meta['world_size']} and expert parallel "
            f"{meta['expert_model_parallel_size']}, resumed with {world} and {ep_size}; resume "
            "with the same layout, or start a new run from its weights with training.init_from"
        )
    state_path = os.path.join(path, f"state-rank{_rank():05d}.pt")
    if not os.path.isfile(state_path):
        raise CheckpointError(f"{state_path}: missing")
    try:
        return torch.load(state_path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # never executed: torch's weights_only unpickler refused it
        raise CheckpointError(
            f"{state_path}: refused to load: it holds Python objects other than tensors and plain "
            f"containers, and checkpoints are never unpickled ({e})"
        ) from e
    except Exception as e:
        raise CheckpointError(f"{state_path}: unreadable ({type(e).__name__}: {e})") from e
