"""Model weights as a torch.distributed.checkpoint (DCP) directory that reshards on load.

Every tensor is saved with its global shape, so the checkpoint loads under any parallel layout:
routed experts are one [E, ...] tensor per weight, a DTensor sharded over the expert-parallel
group by global expert offset (a TP1/EP1 checkpoint loads as EP2 and back); tensor-parallel
weights (Megatron's `tensor_model_parallel` / `partition_dim` attributes) are sharded over the
tensor-parallel group along their partition dim; the rest is replicated (DCP writes one copy).
This is torchtitan's layout. Megatron-Core's own dist_checkpointing "torch_dist" writer wraps
the same DCP files but needs CUDA (its async writer synchronises the device), so we call DCP.

    save_dist_checkpoint(path, model)            all ranks; written atomically (tmp, rename)
    load_dist_checkpoint(path, model)            all ranks; each reads only its own shards (also
                                                 into FSDP2 shards and LoRA-wrapped base weights)
    DistCheckpointReader(path).get(key)          one tensor at a time, in the global naming of
                                                 training/checkpoint.py (experts: `<name>.expert<g>`)
"""

import json
import os
import shutil
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor, Shard

from .checkpoint import CheckpointError, _expert_params

META_FILE = "mmh_meta.json"  # ours, beside DCP's .metadata: what wrote it, which tensors are experts


DIR = "dcp"  # a run directory's dist checkpoint (tools/convert_checkpoint.py hf-to-ours --format dcp)


def is_dist_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, META_FILE))


def find_dist_checkpoint(path: str) -> Optional[str]:
    """path itself, or the run directory's dcp/ inside it, if it is a dist checkpoint; else None."""
    for d in (path, os.path.join(path, DIR)):
        if is_dist_checkpoint(d):
            return d
    return None


def _mesh(group, device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def _expert_grid_mesh(device: torch.device):
    """The (expert-parallel, expert-data-parallel) 2-D mesh over the world, from Megatron's
    groups: what an FSDP2-sharded expert weight's local rows are of the global [E, ...] tensor
    (EP splits E, then expert-dp splits each rank's E_local as FSDP2 does). Needs every rank in
    one EP x expert-dp grid (tensor and pipeline parallel size 1)."""
    from megatron.core import parallel_state as ps
    from torch.distributed.device_mesh import DeviceMesh

    ep, edp = ps.get_expert_model_parallel_world_size(), ps.get_expert_data_parallel_world_size()
    if ep * edp != dist.get_world_size():
        raise CheckpointError(
            f"a dist checkpoint loads into FSDP2-sharded experts over one EP x expert-dp grid; EP {ep} x "
            f"expert-dp {edp} != world {dist.get_world_size()}: load it before fully_shard (parallel.fsdp: false)"
        )
    mine = [dist.get_rank(), ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    grid = torch.empty(ep, edp, dtype=torch.int64)
    for rank, i, j in everyone:
        grid[i, j] = rank
    groups = [ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group()]
    return DeviceMesh.from_group(groups, device.type, mesh=grid, mesh_dim_names=("ep", "edp"))


def _dcp_state_dict(model: torch.nn.Module, tensors: Optional[dict[str, torch.Tensor]] = None,
                    names: Optional[dict[str, str]] = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """{name: DTensor (sharded over EP or TP, or FSDP2's shards) or Tensor (replicated)} viewing
    this rank's share of the model's tensors (or of `tensors`: the same names and local shapes).
    names: model name -> checkpoint name (a LoRA wrapper's `x.base.weight` read as `x.weight`).

    FSDP2-sharded parameters (DTensors over the dp or expert-dp mesh) are their own global view,
    except routed experts under EP: their FSDP2 tensor is this EP rank's [E_local, ...], which a
    (ep, expert-dp) mesh with two row splits places in the global [E, ...]."""
    from megatron.core import parallel_state as ps

    parallel = dist.is_initialized() and ps.model_parallel_is_initialized()
    ep_size = ps.get_expert_model_parallel_world_size() if parallel else 1
    tp_size = ps.get_tensor_model_parallel_world_size() if parallel else 1
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if sharded and tp_size > 1:
        raise CheckpointError("a dist checkpoint loads into an FSDP2-sharded model at tensor parallel size 1 only")
    experts = _expert_params(model)
    params = dict(model.named_parameters())
    grid = None
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if not isinstance(tensor, torch.Tensor) or name.endswith("_extra_state"):
            continue
        data = tensor.detach() if tensors is None else tensors[name]
        p = params.get(name)
        key = name if names is None else names.get(name, name)
        if isinstance(data, DTensor):  # FSDP2: shards of a global tensor
            if name in experts and ep_size > 1:
                if grid is None:
                    grid = _expert_grid_mesh(data.device)
                shape = (ep_size * data.shape[0], *data.shape[1:])
                data = DTensor.from_local(data.to_local(), grid, [Shard(0), Shard(0)], run_check=False,
                                          shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
        elif name in experts and ep_size > 1:  # [E_local, ...] rows ep_rank * E_local ... of [E, ...]
            data = DTensor.from_local(data, _mesh(ps.get_expert_model_parallel_group(), data.device), [Shard(0)],
                                      run_check=False)  # fmt: skip
        elif p is not None and getattr(p, "tensor_model_parallel", False) and tp_size > 1:
            data = DTensor.from_local(data, _mesh(ps.get_tensor_model_parallel_group(), data.device),
                                      [Shard(p.partition_dim)], run_check=False)  # fmt: skip
        out[key] = data
    return out


def save_dist_checkpoint(path: str, model: torch.nn.Module, meta: Optional[dict[str, Any]] = None) -> str:
    """Writes the model into a new directory `path` (refused if it exists); nothing partial is
    left after an error: the ranks write into a sibling temporary directory that rank 0 renames."""
    path = os.path.abspath(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if os.path.exists(path):
        raise ValueError(f"{path}: exists; a dist checkpoint is written into a new directory")
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if dist.is_initialized():
        dist.barrier()
    try:
        dcp.save(_dcp_state_dict(model), storage_writer=FileSystemWriter(tmp))
        if rank == 0:
            with open(os.path.join(tmp, META_FILE), "w") as f:
                json.dump({"format": "torch.distributed.checkpoint", "expert_tensors": sorted(_expert_params(model)),
                           **(meta or {})}, f, indent=1)
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            os.replace(tmp, path)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier()
    return path


class _LazyPlanner(DefaultSavePlanner):
    """Writes tensors that `fetch(name)` reads when DCP gets to them: the state dict it plans
    from holds meta tensors (shapes and dtypes only), so one tensor is in memory at a time."""

    def __init__(self, fetch):
        super().__init__()
        self.fetch = fetch

    def lookup_object(self, index):
        return self.fetch(index.fqn)


def save_dist_checkpoint_streaming(path: str, shapes: dict[str, torch.Tensor], fetch, meta: dict[str, Any],
                                   expert_tensors: list[str]) -> str:  # fmt: skip
    """One process writes a dist checkpoint of the tensors `shapes` describes (meta tensors, the
    global shapes and dtypes), reading each through fetch(name) only when it is written.
    Atomic like save_dist_checkpoint."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise ValueError(f"{path}: exists; a dist checkpoint is written into a new directory")
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": it is one
            warnings.simplefilter("ignore", UserWarning)
            # A file per tensor: torch's writer keeps every tensor of a file referenced until the
            # file is closed, which would hold the whole model with one file.
            writer = FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1)
            dcp.save(shapes, storage_writer=writer, planner=_LazyPlanner(fetch), no_dist=True)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump({"format": "torch.distributed.checkpoint", "expert_tensors": sorted(expert_tensors), **meta}, f,
                      indent=1)  # fmt: skip
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _stored(path: str) -> dict[str, Any]:
    """{name: TensorStorageMetadata (size, properties.dtype)} of a DCP directory."""
    return FileSystemReader(path).read_metadata().state_dict_metadata


def load_dist_checkpoint(path: str, model: torch.nn.Module, strict: bool = True) -> list[str]:
    """Loads this rank's share of every model tensor; returns the model names the checkpoint
    lacks (strict=True raises on any). Global shapes are checked before anything is read. The
    model may be FSDP2-sharded (each rank then reads its shards only) and LoRA-wrapped (a base
    tensor `<wrapper>.base.weight` is read from the checkpoint's `<wrapper>.weight`)."""
    from .checkpoint import _unwrapped_name

    if not is_dist_checkpoint(path):
        raise CheckpointError(f"{path}: not a dist checkpoint of ours (no .metadata and {META_FILE})")
    stored = _stored(path)
    state = model.state_dict()
    unwrapped = _unwrapped_name(model)
    names = {n: (n if n in stored or unwrapped(n) not in stored else unwrapped(n)) for n in state}
    # Read in the stored dtype (DCP copies bytes), then cast into the model.
    buffers = {
        name: torch.empty_like(t, dtype=stored[names[name]].properties.dtype) if names[name] in stored else t
        for name, t in state.items() if isinstance(t, torch.Tensor)
    }  # fmt: skip
    wanted = _dcp_state_dict(model, buffers, names)
    model_name = {names[n]: n for n in buffers}
    missing = sorted(model_name[k] for k in wanted if k not in stored)
    if missing and strict:
        raise CheckpointError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for key, t in wanted.items():
        if key in stored and tuple(stored[key].size) != tuple(t.shape):
            raise CheckpointError(
                f"{path}: tensor {key} has global shape {tuple(stored[key].size)}, the model expects {tuple(t.shape)}"
            )
    request = {k: v for k, v in wanted.items() if k in stored}
    dcp.load(request, storage_reader=FileSystemReader(path))
    with torch.no_grad():
        for key in request:
            name = model_name[key]
            state[name].copy_(buffers[name].to(state[name].dtype))
    return missing


class DistCheckpointReader:
    """Whole tensors of a dist checkpoint by our global names, read one at a time (experts:
    the stacked [E, ...] tensor of the last name asked for is kept, so a layer's experts are
    read once)."""

    def __init__(self, path: str):
        if not is_dist_checkpoint(path):
            raise ValueError(f"{path}: not a dist checkpoint of ours (no .metadata and {META_FILE})")
        self.dir = path
        self.stored = _stored(path)
        meta_path = os.path.join(path, META_FILE)
        self.meta = {}
        if os.path.isfile(meta_path):
            with open(meta_path) as f:
                self.meta = json.load(f)
        self.expert_names = set(self.meta.get("expert_tensors", []))
        self.file_of = {k: ".metadata" for k in self.keys()}  # as OursReader: every key it can give
        self._cached: tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def keys(self) -> list[str]:
        out = []
        for name, sh in self.stored.items():
            if name in self.expert_names:
                out += [f"{name}.expert{e}" for e in range(sh.size[0])]
            else:
                out.append(name)
        return out

    def _whole(self, name: str) -> torch.Tensor:
        if self._cached[0] != name:
            sh = self.stored[name]
            want = {name: torch.empty(tuple(sh.size), dtype=sh.properties.dtype)}
            with warnings.catch_warnings():  # "assuming ... a single process": it is one
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(want, storage_reader=FileSystemReader(self.dir), no_dist=True)
            self._cached = (name, want[name])
        return self._cached[1]

    def get(self, key: str) -> torch.Tensor:
        base, _, expert = key.rpartition(".expert")
        if base in self.expert_names and expert.isdigit():
            return self._whole(base)[int(expert)]
        if key not in self.stored:
            raise ValueError(f"{self.dir}: tensor {key!r} is missing from the checkpoint")
        return self._whole(key)
