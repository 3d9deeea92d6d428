"""Host-memory activation offload with prefetch: selected tensors that autograd saves for the
backward live in host memory between the forward and the backward.

    offload = ActivationOffload(model, modules=["*.mlp.experts"], min_bytes=1 << 20)
    with offload:
        loss = model(tokens, position_ids, None, labels=labels).mean()
    loss.backward()  # inside or outside the context
    offload.stats()  # {"bytes": ..., "tensors": ..., "stall_ms": ..., ...}

What is offloaded: a saved tensor whose innermost running module has a path matching one of
`modules` (fnmatch patterns such as "*.mlp.experts": the expert fc1 inputs and grouped-GEMM
results; "*.self_attention": the linear / sparse attention core op's tensors; a submodule such
as self_attention.linear_qkv is a module of its own), inside one of the first
ceil(fraction x L) transformer layers (modules named "...layers.<i>"), of at least min_bytes,
and neither a parameter nor a view of one. Two saves of one tensor share one host copy.
Inside torch.utils.checkpoint regions checkpoint's own hooks are the innermost ones, so what
they recompute is never offloaded; what is saved outside them is.

Ordering on CUDA (a missing one of these is the warm-up race of Megatron-LM #7398):
  device -> host: the side stream waits for the current stream (the tensor is written), copies
    into a pinned pool buffer; tensor.record_stream(side) keeps the caching allocator from
    reusing the tensor's memory before that copy has run.
  host -> device: the destination is allocated on the current stream and the side stream waits
    for the current stream (kernels queued there may still use that memory), copies and records
    an event; the current stream waits for the event before the backward reads the tensor.
  A host buffer goes back to the pool when autograd frees the saved tensor; its next
  device -> host copy is queued on the same side stream after its last host -> device copy.
Prefetch: when the backward unpacks the first tensor of layer i, the host -> device copies of
the previous offloaded layer are issued, so they run while layer i's backward does.
On CPU the same code runs with plain CPU buffers and synchronous copies (CI exercises it).

Shape legend: N elements of a flat host buffer.
"""

import fnmatch
import math
import re
import time
import weakref
from collections import defaultdict
from typing import Optional, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

# The MoE layers (router, dispatch, grouped experts, shared expert): on the H200
# (benchmarks/results/h200/offload.json) offloading them beat full recomputation by 1.44x at
# a lower peak; the experts alone by 1.38x at a 4% higher peak; adding the attention layers
# (the reference ops save many tensors) only by 1.02x.
DEFAULT_MODULES = ("*.mlp", "*.mlp.*")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")  # Megatron's TransformerBlock: decoder.layers.<i>


class HostBufferPool:
    """Flat host buffers [N], reused by (dtype, N, pinned) from one step to the next."""

    def __init__(self):
        self._free: dict[tuple, list] = defaultdict(list)
        self.num_buffers = 0
        self.num_new = 0  # since reset_counts()
        self.num_reused = 0

    def acquire(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        free = self._free[(dtype, numel, pin)]
        if free:
            self.num_reused += 1
            return free.pop()
        self.num_new += 1
        self.num_buffers += 1
        return torch.empty(numel, dtype=dtype, pin_memory=pin)

    def release(self, buffer: torch.Tensor, pin: bool) -> None:
        self._free[(buffer.dtype, buffer.numel(), pin)].append(buffer)

    def reset_counts(self) -> None:
        self.num_new = self.num_reused = 0


class _HostCopy:
    """One offloaded tensor: its host copy, and its device copy while the backward needs it."""

    __slots__ = ("forward", "layer", "host", "shape", "stride", "dtype", "device",
                 "saves", "unpacks_left", "on_device", "ready", "__weakref__")

    def __init__(self, forward, layer, host, like: torch.Tensor):
        self.forward, self.layer, self.host = forward, layer, host
        self.shape, self.stride, self.dtype, self.device = like.shape, host.stride(), like.dtype, like.device
        self.saves = self.unpacks_left = 1
        self.on_device: Optional[torch.Tensor] = None
        self.ready = None  # CUDA event of the host -> device copy


class _Forward:
    """What one forward offloaded, per layer in forward order (for the prefetch).

    It holds its copies weakly: autograd owns them, and a copy's death returns its buffer."""

    def __init__(self):
        self.by_layer: dict[int, list] = defaultdict(list)  # layer -> weakrefs of its copies
        self.order: list[int] = []  # layers with offloaded tensors, in forward order
        self.started: set = set()  # layers whose backward has begun
        self.seen: dict = {}  # (storage, offset, shape, stride, dtype) -> (StorageWeakRef, weakref)


def _is_dense(t: torch.Tensor) -> bool:
    """Its elements fill its storage span exactly once (any dim order): the copy keeps strides."""
    expected = 1
    for size, stride in sorted((s, st) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class ActivationOffload:
    """A context manager around the forward that keeps selected saved tensors in host memory.

    model: the module whose submodules are matched (its module paths, e.g.
        "decoder.layers.0.mlp.experts"); modules: fnmatch patterns over those paths;
    fraction: offload in the first ceil(fraction x L) of the model's L transformer layers;
    min_bytes: smaller tensors stay on the device.
    """

    def __init__(
        self,
        model: nn.Module,
        modules: Sequence[str] = DEFAULT_MODULES,
        fraction: float = 1.0,
        min_bytes: int = 1 << 20,
    ):
        if isinstance(modules, str) or not modules or not all(isinstance(p, str) for p in modules):
            raise ValueError(f"modules: expected a non-empty list of module-path patterns such as "
                             f"{list(DEFAULT_MODULES)}, got {modules!r}")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"fraction: must be within (0, 1] (the share of transformer layers, from the "
                             f"first, that offload), got {fraction!r}")
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes: must be an integer >= 0, got {min_bytes!r}")
        names = {module: name for name, module in model.named_modules()}
        layers = [m for m, name in names.items() if _LAYER.search(name)]
        if not layers:
            raise ValueError("model: has no transformer layers (modules named '...layers.<i>'); "
                             "offload groups and prefetches by layer")
        for pattern in modules:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names.values()):
                example = next((n for n in names.values() if n.endswith("mlp.experts")), names[layers[0]])
                raise ValueError(f"modules: {pattern!r} matches no module of the model; paths look like "
                                 f"{example!r} (fnmatch: '*' matches dots too)")
        self.model = model
        self.min_bytes = min_bytes
        num_layers = math.ceil(fraction * len(layers))
        self._layer_index = {m: i for i, m in enumerate(layers) if i < num_layers}
        self._selected = {m: n for m, n in names.items() if any(fnmatch.fnmatchcase(n, p) for p in modules)}
        self.pool = HostBufferPool()
        self._side_streams: dict = {}
        self._module_stack: list = []  # modules whose forward is running, innermost last
        self._layer_stack: list = []  # offloading layers whose forward is running
        self._forward: Optional[_Forward] = None
        self._param_storages: set = set()
        self._handles: list = []
        self._saved_hooks = None
        self.reset_stats()

    @classmethod
    def from_config(cls, model: nn.Module, memory) -> "ActivationOffload":
        """From a MemoryConfig (config.memory)."""
        return cls(model, memory.offload_modules, memory.offload_fraction, memory.offload_min_bytes)

    def __enter__(self) -> "ActivationOffload":
        if self._saved_hooks is not None:
            raise RuntimeError("ActivationOffload is already active; it does not nest")
        # Plain parameters only: a sharded (DTensor) one is never what an op saves.
        self._param_storages = {
            p.untyped_storage().data_ptr() for p in self.model.parameters() if type(p.data) is torch.Tensor
        }
        self._forward = _Forward()
        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(self._enter_module))
            self._handles.append(module.register_forward_hook(self._exit_module, always_call=True))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved_hooks.__exit__(*exc)
        self._saved_hooks = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._module_stack.clear()
        self._layer_stack.clear()
        self._forward = None  # its copies keep it for their backward

    def _enter_module(self, module, args) -> None:
        self._module_stack.append(module)
        if module in self._layer_index:
            self._layer_stack.append(self._layer_index[module])

    def _exit_module(self, module, args, output) -> None:
        self._module_stack.pop()
        if module in self._layer_index:
            self._layer_stack.pop()

    def _side_stream(self, device: torch.device):
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]

    def _pack(self, t: torch.Tensor):
        if not self._module_stack or not self._layer_stack:
            return t
        name = self._selected.get(self._module_stack[-1])
        # Exact torch.Tensor: nn.Parameter, DTensor and other subclasses stay where they are.
        if name is None or type(t) is not torch.Tensor or t.layout != torch.strided:
            return t
        if t.numel() == 0 or t.nbytes < self.min_bytes or isinstance(t._base, nn.Parameter):
            return t
        storage = t.untyped_storage()
        if storage.data_ptr() in self._param_storages:  # e.g. weight.detach(): shares the storage
            return t
        forward = self._forward
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        seen = forward.seen.get(key)
        # A live storage at that address is the same storage: its memory cannot have been reused.
        copy = seen[1]() if seen is not None and not seen[0].expired() else None
        if copy is not None:
            copy.saves += 1
            copy.unpacks_left += 1
            self._counts["deduped_saves"] += 1
            return copy
        copy = self._offload(t, forward, self._layer_stack[-1])
        forward.seen[key] = (StorageWeakRef(storage), weakref.ref(copy))
        self._counts["tensors"] += 1
        self._counts["bytes"] += t.nbytes
        self._by_module[name] += t.nbytes
        self._by_layer[copy.layer] += t.nbytes
        return copy

    def _offload(self, t: torch.Tensor, forward: _Forward, layer: int) -> _HostCopy:
        pin = t.is_cuda
        buffer = self.pool.acquire(t.numel(), t.dtype, pin)  # [N]
        # Dense tensors keep their strides, so the backward sees the same layout (bitwise results).
        host = buffer.as_strided(t.shape, t.stride()) if _is_dense(t) else buffer.view(t.shape)
        if t.is_cuda:
            side = self._side_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)
        else:
            host.copy_(t)
        copy = _HostCopy(forward, layer, host, t)
        weakref.finalize(copy, self.pool.release, buffer, pin)
        if layer not in forward.by_layer:
            forward.order.append(layer)
        forward.by_layer[layer].append(weakref.ref(copy))
        return copy

    def _load(self, copy: _HostCopy) -> None:
        """Issues the host -> device copy (asynchronous on CUDA)."""
        out = torch.empty_strided(copy.shape, copy.stride, dtype=copy.dtype, device=copy.device)
        if out.is_cuda:
            side = self._side_stream(out.device)
            side.wait_stream(torch.cuda.current_stream(out.device))
            with torch.cuda.stream(side):
                out.copy_(copy.host, non_blocking=True)
                copy.ready = torch.cuda.Event()
                copy.ready.record(side)
        else:
            out.copy_(copy.host)
        copy.on_device = out

    def _load_layer(self, forward: _Forward, layer: int, counter: str) -> None:
        for ref in forward.by_layer[layer]:
            copy = ref()
            if copy is not None and copy.on_device is None:
                self._load(copy)
                self._counts[counter] += 1

    def _unpack(self, saved):
        if not isinstance(saved, _HostCopy):
            return saved
        forward, copy = saved.forward, saved
        begin = time.perf_counter()
        if copy.layer not in forward.started:  # the backward reached this layer: load all of it
            forward.started.add(copy.layer)
            self._load_layer(forward, copy.layer, "on_demand")
        if copy.on_device is None:  # a second backward (retain_graph) or an out-of-order unpack
            self._load(copy)
            self._counts["on_demand"] += 1
        self._stall_s += time.perf_counter() - begin
        i = forward.order.index(copy.layer)
        if i > 0 and forward.order[i - 1] not in forward.started:
            self._load_layer(forward, forward.order[i - 1], "prefetched")
        out = copy.on_device
        if copy.ready is not None:
            begin = time.perf_counter()
            current = torch.cuda.current_stream(out.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(current)
            current.wait_event(copy.ready)
            end.record(current)
            self._stall_events.append((start, end))
            if len(self._stall_events) >= 4096:  # a run that never reads stats() keeps no backlog
                self._fold_stall_events(block=False)
            self._stall_s += time.perf_counter() - begin
        copy.unpacks_left -= 1
        if copy.unpacks_left == 0:  # every save has its tensor: autograd alone holds the device copy
            copy.on_device, copy.ready, copy.unpacks_left = None, None, copy.saves
        return out

    def reset_stats(self) -> None:
        self._counts = dict(bytes=0, tensors=0, deduped_saves=0, prefetched=0, on_demand=0)
        self._by_module: dict[str, int] = defaultdict(int)
        self._by_layer: dict[int, int] = defaultdict(int)
        self._stall_s = 0.0
        self._stall_events: list = []  # (start, end) CUDA timing events around each wait
        self._device_stall_ms = 0.0  # of the events folded so far
        self.pool.reset_counts()

    def _fold_stall_events(self, block: bool) -> None:
        pending = []
        for start, end in self._stall_events:
            if block:
                end.synchronize()
            if block or end.query():
                self._device_stall_ms += start.elapsed_time(end)
            else:
                pending.append((start, end))
        self._stall_events = pending

    def stats(self) -> dict:
        """Since the last reset_stats(): bytes and tensors offloaded (distinct copies), saves that
        shared a copy, host -> device loads issued ahead (prefetched) or when the backward asked
        (on_demand), stall_ms (host wall time the unpacks spent loading on demand and waiting;
        on CPU the on-demand copies themselves), device_stall_ms (CUDA: time the compute stream
        sat waiting for copies; synchronises), pool buffers (new / reused / total), and bytes
        by module path and by layer."""
        self._fold_stall_events(block=True)
        return {
            **self._counts,
            "stall_ms": self._stall_s * 1e3,
            "device_stall_ms": self._device_stall_ms,
            "pool_new": self.pool.num_new,
            "pool_reused": self.pool.num_reused,
            "pool_buffers": self.pool.num_buffers,
            "by_module": dict(self._by_module),
            "by_layer": dict(self._by_layer),
        }
