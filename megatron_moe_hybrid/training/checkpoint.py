"""Atomic, pickle-free checkpoints that reshard over expert parallelism.

Layout of one checkpoint, <output_dir>/checkpoints/step_00000020/:
    meta.json                         written last: step, world layout, config, the file list
    model-ep00000-r00000.safetensors  the weights rank 0 wrote, whole tensors under global names;
    ...                               routed experts one tensor per *global* expert (`<name>.expert<g>`)
    optim-ep00000-r00000.safetensors  the optimizer moments rank 0 wrote, `optimizer.<key>.<name>`,
    ...                               each as its parameter (experts per global expert)
    state-rank00000.pt                step counts / param groups / data position / RNG of one rank,
                                      loaded with torch.load(weights_only=True)

All ranks write into `.tmp-step_...`, rank 0 writes meta.json and renames the directory:
a checkpoint without meta.json, or a `.tmp-` one, is incomplete and never loaded. Weights and
moments load under any world size, expert-parallel size and FSDP2 or not (each rank picks its
experts by global id, from whichever file holds them, and its rows of the rest); a rank of
another layout takes the state file of rank (its rank mod the saved world size). A checkpoint of
an earlier version keeps its moments in the state files and resumes only in its own layout.

Every rank writes a share of the weights (_walk_model): each dense tensor goes to the rank given
the fewest bytes so far, experts to the expert-data-parallel replicas in turns (or, sharded by
FSDP2, to the rank whose shard holds them), and a rank streams its share into its file a tensor
at a time (SafetensorsWriter), so that no rank holds more than one tensor in host memory and the
bytes spread over all ranks. Under FSDP2 a dense tensor is gathered to its writer alone (a
collective over the mesh that shards it, so every rank walks the same names in the same order)
and a load reads this rank's rows of it: checkpoints move freely between FSDP and plain runs.
"""

import contextlib
import errno
import pickle
import json
import os
import re
import shutil
import zlib
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

CKPT_DIR = "checkpoints"
OPTIMIZER_PREFIX = "optim-"  # the optimizer's moments: optim-ep<e>-r<r>.safetensors, beside the model's files
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


def _local_experts(model: torch.nn.Module) -> dict[str, int]:
    """The routed experts' parameter names -> their local experts (as _walk and _load_tensors take them)."""
    return {n: p.num_local_experts for n, p in _expert_params(model).items()}


def _expert_dp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _mesh_ranks(t: DTensor) -> list[int]:
    return [int(r) for r in t.device_mesh.mesh.flatten().tolist()]


def _rows_of_shard(t: DTensor) -> Optional[int]:
    """The first global row of this rank's shard when t is sharded along dim 0 over a 1-D mesh
    (FSDP2's layout: torch.chunk's rows, ceil(n / m) a rank); None for any other layout."""
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return None
    n, m = t.shape[0], t.device_mesh.size()
    each = -(-n // m)
    first = min(t.device_mesh.get_local_rank() * each, n)
    if t.to_local().shape[0] != min(each, n - first):
        raise CheckpointError(f"a sharded tensor of {n} rows holds {t.to_local().shape[0]} on this rank, "
                              f"not torch.chunk's {min(each, n - first)}")
    return first


def _least_loaded(load: list[int], ranks, tensor: torch.Tensor) -> int:
    """Of ranks, the one given the fewest bytes so far (the lowest on a tie), given tensor's bytes:
    every rank makes the same choice from the same sequence of tensors."""
    rank = min(ranks, key=lambda r: (load[r], r))
    load[rank] += tensor.numel() * tensor.element_size()
    return rank


def _walk_model(model: torch.nn.Module, trainable_only: bool = False, load: Optional[list[int]] = None) -> list[tuple]:
    """The model's tensors as _walk gives them (trainable_only: the parameters that train)."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    items = [(name, tensor, name) for name, tensor in model.state_dict().items()
             if isinstance(tensor, torch.Tensor) and not (trainable_only and name not in trainable)]  # fmt: skip
    return _walk(items, _local_experts(model), load)


def _walk(items: list[tuple], experts: dict[str, int], load: Optional[list[int]] = None) -> list[tuple]:
    """The checkpoint's tensors in one order that every rank shares: [(global name, dtype, shape,
    mine, get)], mine: whether this rank writes it; get(): its host copy where mine, else None.
    items: [(name, tensor, parameter name)], in an order every rank shares; experts: the routed
    experts' parameter names -> their local experts (tensors [local experts, ...]); load: the
    bytes given to each rank so far (by an earlier walk of the same save), updated.

    Every get() must be called, in order, on every rank: an FSDP2-sharded dense tensor is gathered
    over its mesh (a collective) to the one rank of it that writes it, the one given the fewest
    bytes so far, so that a save's bytes spread over the ranks instead of all falling on rank 0.
    Routed experts are one entry per global expert (`<name>.expert<g>`): sharded by FSDP2 along
    the experts, each rank writes the whole experts of its own shard (no gather); replicated over
    expert-dp, the replicas take turns. Nothing is held beyond the tensor being written."""
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    ep_rank, _, expert_dp_rank = _ep_info()
    expert_dp = _expert_dp_size()
    load = [0] * world if load is None else load  # bytes given to each rank so far
    turn = 0  # replicated experts: whose turn among the expert-dp replicas
    out: list[tuple] = []
    for name, tensor, param in items:
        if param in experts:
            e_local = experts[param]
            first = _rows_of_shard(tensor) if isinstance(tensor, DTensor) else None
            if first is not None:  # FSDP2 over expert-dp: this rank's rows are whole experts
                local = tensor.to_local()
                out += [(f"{name}.expert{ep_rank * e_local + first + i}", local.dtype, tuple(local.shape[1:]), True,
                         lambda row=local[i]: _host_copy(row)) for i in range(local.shape[0])]  # fmt: skip
                continue
            whole: list = []  # a DTensor in another layout: gathered by the first entry's get(), let go by the last

            def row(i: int, mine: bool, t=tensor, whole=whole, last=e_local - 1) -> Optional[torch.Tensor]:
                if not whole:
                    whole.append(t.full_tensor() if isinstance(t, DTensor) else t)
                copy = _host_copy(whole[0][i]) if mine else None
                if i == last:
                    whole.clear()
                return copy

            for i in range(e_local):
                mine = turn % expert_dp == expert_dp_rank
                turn += 1
                out.append((f"{name}.expert{ep_rank * e_local + i}", tensor.dtype, tuple(tensor.shape[1:]), mine,
                            lambda i=i, mine=mine, row=row: row(i, mine)))  # fmt: skip
            continue
        owner = _least_loaded(load, _mesh_ranks(tensor) if isinstance(tensor, DTensor) else range(world), tensor)

        def get(t=tensor, owner=owner) -> Optional[torch.Tensor]:
            if isinstance(t, DTensor):  # every rank of the mesh takes part
                return _gather_to(t, owner)
            return _host_copy(t) if owner == rank else None

        out.append((name, tensor.dtype, tuple(tensor.shape), owner == rank, get))
    return out


def _gather_to(t: DTensor, owner: int) -> Optional[torch.Tensor]:
    """t whole in host memory on the global rank owner, None on the other ranks of its mesh (all of
    which must call this). FSDP2's layout is gathered to the owner alone: the other ranks send their
    rows and hold no more than them, and the owner holds the tensor once on its device (a CPU
    tensor is not copied again). Any other layout is gathered whole on every rank (full_tensor)."""
    if _rows_of_shard(t) is None or t.shape[0] == 0:
        whole = t.full_tensor()
        return _host_copy(whole) if owner == _rank() else None
    local = t.to_local()
    m = t.device_mesh.size()
    each = -(-t.shape[0] // m)
    if local.shape[0] < each or not local.is_contiguous():  # gather takes equal, contiguous pieces
        padded = local.new_zeros((each, *local.shape[1:]))
        padded[: local.shape[0]] = local
        local = padded
    if owner != _rank():
        dist.gather(local, None, dst=owner, group=t.device_mesh.get_group())
        return None
    buffer = local.new_empty((each * m, *local.shape[1:]))
    dist.gather(local, list(buffer.chunk(m)), dst=owner, group=t.device_mesh.get_group())
    whole = buffer[: t.shape[0]]  # contiguous: the padding rows are only ever at the end
    return whole if whole.device.type == "cpu" else _host_copy(whole)


def _is_moment(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def optimizer_scalars(state_dict: dict) -> dict:
    """An optimizer state_dict without its moments (each parameter's state tensors of one or more
    dims, e.g. AdamW's exp_avg and exp_avg_sq), a DTensor's scalar as its local value
    (weights_only-loadable): what save_checkpoint(optimizer=) puts in each rank's state file."""
    state = {k: {n: v.to_local() if isinstance(v, DTensor) else v for n, v in s.items() if not _is_moment(v)}
             for k, s in state_dict["state"].items()}  # fmt: skip
    return {**state_dict, "state": state}


def holds_moments(state_dict: dict) -> bool:
    """Whether an optimizer state_dict (of a rank's state file) holds the moments themselves, as
    checkpoints written before the optimizer files did: those resume only in their own layout."""
    return any(_is_moment(v) for s in state_dict["state"].values() for v in s.values())


def _optimizer_items(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple]:
    """The optimizer's moments as _walk's items: (`optimizer.<key>.<parameter name>`, the moment,
    the parameter's name); a moment has its parameter's shape and sharding, so it is written (and
    read back) as its parameter is. Every rank walks the same names: a parameter that never stepped
    on some rank (no gradient there) has zero moments there."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    here = [(names[id(p)], key, str(v.dtype).removeprefix("torch."))
            for p in params for key, v in optimizer.state.get(p, {}).items() if _is_moment(v)]  # fmt: skip
    moments: dict[str, set] = {}  # parameter name -> {(key, dtype)} of every rank
    for name, key, dtype in here if not dist.is_initialized() else [x for part in _gather(here) for x in part]:
        moments.setdefault(name, set()).add((key, dtype))
    items = []
    for p in params:
        name = names[id(p)]
        for key, dtype in sorted(moments.get(name, ())):
            value = optimizer.state.get(p, {}).get(key)
            if value is None:
                value = torch.zeros_like(p, dtype=getattr(torch, dtype))
            items.append((f"optimizer.{key}.{name}", value, name))
    return items


def load_optimizer_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Loads an optimizer whose moments a checkpoint holds in its optimizer files, whatever the
    layout (world size, expert parallel, FSDP2 or not) that wrote them: state_dict (the rank's
    state file's, optimizer_scalars) gives the param groups and the step counts, and each moment
    is read as its parameter's weights are (this rank's rows, this EP rank's experts), into a
    tensor of the parameter's shape and sharding in the optimizer's state dtype (its state_dtype,
    else the parameter's). A collective where the model is sharded."""
    optimizer.load_state_dict(state_dict)
    stored = _Stored(path, optimizer=True)
    names = {id(p): n for n, p in model.named_parameters()}
    keys = sorted({k.split(".", 2)[1] for k in stored.available})
    # a parameter that never stepped starts from zero moments, as it would have
    stepped = [p for group in optimizer.param_groups for p in group["params"] if optimizer.state.get(p)]
    if stepped and not keys:
        raise CheckpointError(f"{stored.path}: the state files hold the step counts of {len(stepped)} parameters "
                              "and the optimizer files no moments")
    items, targets = [], []
    for p in stepped:
        dtype = getattr(optimizer, "state_dtype", None) or p.dtype
        for key in keys:
            target = torch.empty_like(p, dtype=dtype)  # every element is read (or the load raises)
            items.append((f"optimizer.{key}.{names[id(p)]}", target, names[id(p)]))
            targets.append((p, key, target))
    missing = _load_tensors(stored, items, _local_experts(model))
    stored.raise_corrupt(sharded=any(isinstance(p, DTensor) for p in model.parameters()))
    if missing:
        raise CheckpointError(f"{stored.path}: the optimizer files lack the moments {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for p, key, target in targets:
            optimizer.state[p][key] = target


def model_tensors_to_save(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """This rank's share of the checkpoint's tensors under global names, all in memory (small
    models and tests; save_checkpoint streams them). In one process: the whole model."""
    return {name: t for name, _, _, _, get in _walk_model(model, trainable_only) if (t := get()) is not None}


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (safetensors and the checksums read host memory)."""
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class SafetensorsWriter:
    """A safetensors file written one tensor at a time, so that only the tensor being written is
    in host memory. specs, [(name, dtype, shape)], fix the header; add() takes the tensors in that
    order. checksums=True puts each tensor's CRC-32 in the header's metadata (as save_checkpoint's
    files carry them): the header goes first with placeholders of the same width and is rewritten
    over them by close(), which also fsyncs and returns the file's size."""

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, tuple]], checksums: bool = True,
                 metadata: Optional[dict[str, str]] = None):  # fmt: skip
        self.path, self.specs, self.next = path, list(specs), 0
        self.entries: dict[str, Any] = {}
        offset = 0
        for name, dtype, shape in self.specs:
            if dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{path}: tensor {name} has dtype {dtype}, which safetensors cannot hold")
            size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            self.entries[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                                  "data_offsets": [offset, offset + size]}
            offset += size
        if len(self.entries) != len(self.specs):
            raise ValueError(f"{path}: a tensor name is given twice")
        self.metadata = dict(metadata or {})
        self.checksums = checksums
        self.crcs = {name: "00000000" for name, _, _ in self.specs} if checksums else {}
        header = self._header()
        self.file = open(path, "wb")
        self.file.write(len(header).to_bytes(8, "little"))
        self.file.write(header)
        self.header_bytes = len(header)

    def _header(self) -> bytes:
        meta = {**self.metadata, **self.crcs}
        text = json.dumps({**({"__metadata__": meta} if meta else {}), **self.entries}, separators=(",", ":"))
        return (text + " " * (-len(text) % 8)).encode()  # padded with spaces to 8 bytes, as safetensors does

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.next >= len(self.specs) or self.specs[self.next][0] != name:
            want = self.specs[self.next][0] if self.next < len(self.specs) else "nothing"
            raise ValueError(f"{self.path}: tensor {name} given where the header has {want} next")
        _, dtype, shape = self.specs[self.next]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name} is {tensor.dtype} {tuple(tensor.shape)}, the header "
                             f"says {dtype} {tuple(shape)}")
        data = _bytes_of(tensor)
        if self.checksums:
            self.crcs[name] = _crc32(data)
        self.file.write(memoryview(data))
        self.next += 1

    def close(self) -> int:
        if self.next != len(self.specs):
            raise ValueError(f"{self.path}: {len(self.specs) - self.next} tensor(s) of the header never written, "
                             f"the first {self.specs[self.next][0]}")
        if self.checksums:
            header = self._header()
            assert len(header) == self.header_bytes  # fixed-width checksums: the same length as before
            self.file.seek(8)
            self.file.write(header)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return os.path.getsize(self.path)

    def abort(self) -> None:
        self.file.close()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:  # left by an error: the file stays incomplete (its directory is temporary)
            self.abort()


def write_tensors(path: str, entries: list[tuple], checksums: bool = True) -> Optional[int]:
    """Writes the tensors of _walk_model's entries that this rank owns into a safetensors file at
    path, one at a time, calling every entry's get() in order (the collectives of the others);
    the file's size, or None where this rank owns none (and no file is made). An OSError (a full
    disk) is raised once every get() has been called, so that no other rank waits in a gather."""
    specs = [(name, dtype, shape) for name, dtype, shape, mine, _ in entries if mine]
    error: Optional[OSError] = None
    writer = None
    if specs:
        try:
            writer = SafetensorsWriter(path, specs, checksums=checksums)
        except OSError as e:
            error = e
    with writer if writer is not None else contextlib.nullcontext():  # aborts the file on an exception
        for name, _, _, mine, get in entries:
            t = get()
            if mine and error is None:
                try:
                    writer.add(name, t)
                except OSError as e:
                    error = e
            del t
        if error is not None:
            raise error
        return writer.close() if writer is not None else None


def join_safetensors(sources: list[str], dest: str, checksums: bool = False) -> int:
    """The tensors of several safetensors files as one file at dest, sorted by name, copied one
    tensor at a time (at most one in memory); its size."""
    dtypes = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    handles = [safe_open(path, framework="pt") for path in sources]
    where: dict[str, tuple[Any, torch.dtype, tuple]] = {}
    for path, h in zip(sources, handles):
        for key in h.keys():
            if key in where:
                raise ValueError(f"{path}: tensor {key} is in another of the files too")
            piece = h.get_slice(key)
            where[key] = (h, dtypes[piece.get_dtype()], tuple(piece.get_shape()))
    names = sorted(where)
    with SafetensorsWriter(dest, [(n, where[n][1], where[n][2]) for n in names], checksums=checksums) as writer:
        for n in names:
            writer.add(n, where[n][0].get_tensor(n))
        return writer.close()


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


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as stored, on the host (a view of a contiguous host tensor, no copy)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def _crc32(t) -> str:
    """The checksum of a tensor's bytes (or of bytes already taken by _bytes_of)."""
    return f"{zlib.crc32(t if isinstance(t, np.ndarray) else _bytes_of(t)):08x}"


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_rank_files(tmp: str, model, rank_state, trainable_only: bool, optimizer=None) -> dict[str, int]:
    """This rank's files; returns {file name: size in bytes}."""
    rank = _rank()
    ep_rank, _, _ = _ep_info()
    written = {}
    load = [0] * (dist.get_world_size() if dist.is_initialized() else 1)  # both walks spread over the ranks
    walks = [("model-", _walk_model(model, trainable_only, load))]
    if optimizer is not None:
        walks.append((OPTIMIZER_PREFIX, _walk(_optimizer_items(model, optimizer), _local_experts(model), load)))
    error: Optional[OSError] = None
    for prefix, walk in walks:
        name = f"{prefix}ep{ep_rank:05d}-r{rank:05d}.safetensors"
        try:  # after a failed file, the next walk's collectives still run
            # A CRC per tensor (in the safetensors header) lets a load name the corrupt tensor.
            size = write_tensors(os.path.join(tmp, name), walk)
        except OSError as e:
            error = error or e
            continue
        if size is not None:
            written[name] = size
    if error is not None:
        raise error
    path = os.path.join(tmp, f"state-rank{rank:05d}.pt")
    torch.save(rank_state, path)
    _fsync(path)
    written[os.path.basename(path)] = os.path.getsize(path)
    return written


def save_checkpoint(
    output_dir: str,
    step: int,
    model: torch.nn.Module,
    rank_state: dict[str, Any],
    meta: dict[str, Any],
    keep: int = 2,
    trainable_only: bool = False,
    optimizer: Optional[torch.optim.Optimizer] = None,
) -> str:
    """Collective: every rank calls it. Returns the final directory.

    optimizer: its moments are written beside the weights (optim-*.safetensors, each moment as its
    parameter), so that load_optimizer_state reshards them, and its step counts and param groups
    into rank_state["optimizer"] (optimizer_scalars): the checkpoint resumes under any layout.

    If any rank fails to write (a full disk, a permission error), every rank raises
    CheckpointSaveError, the partial directory is removed and older checkpoints stay.
    """
    root = os.path.join(output_dir, CKPT_DIR)
    name = f"step_{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    rank = _rank()
    if optimizer is not None:
        rank_state = {**rank_state, "optimizer": optimizer_scalars(optimizer.state_dict())}
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
            sizes = _write_rank_files(tmp, model, rank_state, trainable_only, optimizer)
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
                        files=dict(sorted(files.items())), optimizer_files=optimizer is not None)
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


class _Stored:
    """The tensors of one checkpoint directory's files (model files, or with optimizer=True the
    optimizer-moment files): which file holds each key and its checksum; files opened on first use.
    read() collects checksum failures in corrupt instead of raising (see raise_corrupt)."""

    def __init__(self, path: str, optimizer: bool = False):
        self.path = resolve_checkpoint(path)
        meta = verify_files(self.path)
        self.available: dict[str, str] = {}
        self.crcs: dict[str, str] = {}
        self.handles: dict[str, Any] = {}
        self.corrupt: list[str] = []
        for fname in sorted(meta.get("files") or os.listdir(self.path)):
            if not fname.endswith(".safetensors") or fname.startswith(OPTIMIZER_PREFIX) != optimizer:
                continue
            try:
                with safe_open(os.path.join(self.path, fname), framework="pt") as f:
                    self.crcs.update(f.metadata() or {})
                    for key in f.keys():
                        self.available[key] = fname
            except Exception as e:  # safetensors raises its own types on a corrupt header
                raise CheckpointError(f"{os.path.join(self.path, fname)}: unreadable safetensors file ({e})") from e

    def handle(self, key: str):
        fname = self.available[key]
        if fname not in self.handles:
            self.handles[fname] = safe_open(os.path.join(self.path, fname), framework="pt")
        return self.handles[fname]

    def read(self, key: str) -> Optional[torch.Tensor]:
        tensor = self.handle(key).get_tensor(key)
        if key in self.crcs and _crc32(tensor) != self.crcs[key]:
            self.corrupt.append(f"{os.path.join(self.path, self.available[key])}: tensor {key} is corrupt (checksum "
                                "mismatch); load an older checkpoint (training.on_corrupt_checkpoint: previous)")
            return None
        return tensor

    def shape(self, key: str) -> tuple:
        return tuple(self.handle(key).get_slice(key).get_shape())

    def raise_corrupt(self, sharded: bool) -> None:
        """Raises the first checksum failure; sharded: on every rank (only the rank that checked a
        sharded tensor saw it fail), a collective."""
        error = self.corrupt[0] if self.corrupt else None
        if sharded:
            error = _first_error(error)
        if error is not None:
            raise CheckpointError(error)


def _load_tensors(stored: _Stored, items: list[tuple], experts: dict[str, int], unwrapped=lambda name: name) -> list[str]:
    """Copies this rank's share of each stored tensor into items' tensors: [(name, tensor, parameter
    name)], experts: as _walk's. A plain tensor takes the whole stored tensor; an FSDP2 DTensor only
    this rank's rows (one rank of its mesh reads it whole to check its checksum); routed experts
    this EP rank's (and under FSDP2 this shard's) global experts. A name is also found as
    unwrapped(name). Returns the names not found; raises on a shape that differs."""
    ep_rank, _, _ = _ep_info()
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    load = [0] * world  # bytes each rank has read whole to check a sharded tensor's checksum
    available, read = stored.available, stored.read
    missing = []

    def check_shape(name: str, shape: tuple, key: str, want: tuple) -> None:
        if shape != want:
            raise CheckpointError(f"{stored.path}: tensor {name} has shape {shape} in {available[key]}, "
                                  f"the model expects {want}")

    with torch.no_grad():
        for name, tensor, param in items:
            # FSDP2's shard of rows: this rank reads those rows only
            first = _rows_of_shard(tensor) if isinstance(tensor, DTensor) else None
            if param in experts:
                e_local = experts[param]
                for stored_as in (name, unwrapped(name)):
                    keys = [f"{stored_as}.expert{ep_rank * e_local + i}" for i in range(e_local)]
                    if all(k in available for k in keys):
                        break
                else:
                    missing.append(name)
                    continue
                shapes = {stored.shape(k) for k in keys}  # one shape, or the stack's is none
                check_shape(name, (e_local, *shapes.pop()) if len(shapes) == 1 else (e_local, shapes), keys[0],
                            tuple(tensor.shape))
                rows = range(e_local) if first is None else range(first, first + tensor.to_local().shape[0])
                if first is not None or not isinstance(tensor, DTensor):  # each expert into its row: no stack
                    local = tensor.to_local() if first is not None else tensor
                    for j, i in enumerate(rows):
                        part = read(keys[i])  # a whole expert, checked by its reader
                        if part is not None:
                            local[j].copy_(part)
                    continue
                parts = [read(keys[i]) for i in rows]
                if any(part is None for part in parts):
                    continue
                value = torch.stack(parts)
            elif name in available or unwrapped(name) in available:
                key = name if name in available else unwrapped(name)
                check_shape(name, stored.shape(key), key, tuple(tensor.shape))
                if first is None:
                    value = read(key)
                else:  # one rank of the mesh reads it whole to check its checksum, the others their rows
                    count = tensor.to_local().shape[0]
                    if _least_loaded(load, _mesh_ranks(tensor), tensor) == rank:
                        whole = read(key)
                        value = None if whole is None else whole[first : first + count]
                    else:
                        value = stored.handle(key).get_slice(key)[first : first + count]
            else:
                missing.append(name)
                continue
            if value is None:
                continue
            if first is None:
                copy_whole(tensor, value)
            else:
                tensor.to_local().copy_(value.to(tensor.dtype))
    return missing


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
    stored = _Stored(path)
    state = model.state_dict()
    items = [(name, tensor, name) for name, tensor in state.items() if isinstance(tensor, torch.Tensor)]
    missing = _load_tensors(stored, items, _local_experts(model), _unwrapped_name(model))
    stored.raise_corrupt(sharded=any(isinstance(t, DTensor) for t in state.values()))
    if strict and missing:
        raise CheckpointError(f"{stored.path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return missing


def load_rank_state(path: str) -> dict[str, Any]:
    """This rank's state file. Under another layout than the one that saved (world size, expert
    parallel), which only a checkpoint with optimizer files allows (save_checkpoint's optimizer=),
    that of rank (this rank mod the saved world size): the step and the optimizer's scalars are
    the same on every rank, and the RNG stream is that saved rank's; state["resharded_from"] then
    names the saved layout."""
    path = resolve_checkpoint(path)
    meta = verify_files(path)
    world = dist.get_world_size() if dist.is_initialized() else 1
    _, ep_size, _ = _ep_info()
    saved = f"world size {meta['world_size']} and expert parallel {meta['expert_model_parallel_size']}"
    same = meta["world_size"] == world and meta["expert_model_parallel_size"] == ep_size
    if not same and not meta.get("optimizer_files"):
        raise CheckpointError(
            f"{path}: saved with {saved}, resumed with {world} and {ep_size}, and each of its ranks "
            "keeps its optimizer moments in its own state file (a checkpoint of an earlier version); "
            "resume with the same layout, or start a new run from its weights with training.init_from"
        )
    state_path = os.path.join(path, f"state-rank{_rank() % meta['world_size']:05d}.pt")
    if not os.path.isfile(state_path):
        raise CheckpointError(f"{state_path}: missing")
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # never executed: torch's weights_only unpickler refused it
        raise CheckpointError(
            f"{state_path}: refused to load: it holds Python objects other than tensors and plain "
            f"containers, and checkpoints are never unpickled ({e})"
        ) from e
    except Exception as e:
        raise CheckpointError(f"{state_path}: unreadable ({type(e).__name__}: {e})") from e
    if not same:
        state["resharded_from"] = saved
    return state
