"""Helpers for tests: process groups on CPU over gloo, single-process or spawned.

Tests (ours and downstream users') build real process groups here rather than
mocking torch.distributed, so that distributed code is exercised as it runs.
"""

import contextlib
import os
import pickle
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_moe_hybrid.parallel.launch import free_port, init_one_process_group  # noqa: F401  (free_port: re-exported for tests)


def tiny_config(**overrides):
    """examples/configs/tiny.yaml for one process, sequences of 32 and top-8 sparse attention,
    with `overrides` ({"section.field": value}) on top."""
    import yaml

    from megatron_moe_hybrid.config import config_from_dict

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    base = {"parallel.world_size": 1, "training.seq_length": 32, "sparse_attention.topk": 8}
    base.update(overrides)
    return config_from_dict(raw, base)


def init_megatron(
    rank: int = 0,
    world_size: int = 1,
    port: int | None = None,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    cp: int = 1,
) -> None:
    """Starts a gloo group (if none) and Megatron's parallel_state on CPU."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        if world_size == 1 and port is None:  # this process alone: no port to race for
            init_one_process_group("gloo")
        else:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(port or free_port())
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )


def teardown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(rank, world_size, port, fn, args, queue, backend="gloo"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        # Plain pickle: torch's queue would pass tensors as shared memory that vanishes
        # when this process exits.
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # the parent re-raises with the child's traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any], world_size: int, *args, timeout: float = 300.0, backend: str = "gloo"
) -> list:
    """Runs fn(rank, world_size, *args) in world_size processes joined by a gloo group
    (backend="nccl": rank r on GPU r, for GPU tests).

    fn must be a module-level function; the gloo group is initialised before it runs
    (call init_megatron inside fn for Megatron's parallel_state). Returns the values
    fn returned, indexed by rank; re-raises the first child failure with its traceback.
    A port another process took between free_port() and the rendezvous (EADDRINUSE, before
    fn runs) is retried twice on a new port.
    """
    for _ in range(2):
        try:
            return _spawn_once(fn, world_size, args, timeout, backend)
        except _PortTaken:
            pass
    return _spawn_once(fn, world_size, args, timeout, backend)


class _PortTaken(RuntimeError):
    pass


def _spawn_once(fn, world_size: int, args, timeout: float, backend: str) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank} failed:\n{value}")
                break
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        taken = "EADDRINUSE" in errors[0] and "init_process_group" in errors[0] and not results
        raise (_PortTaken if taken else RuntimeError)("\n".join(errors))
    return [results[r] for r in range(world_size)]


@contextlib.contextmanager
def causal_attention_backend(backend: str):
    """ops.sparse_attention.causal_attention forced to backend while the block runs, whatever a
    layer asks for: layers ask for auto, which keeps CPU tensors on the reference, so a CPU test
    reaches the fused forms (backend="sdpa") only so."""
    from megatron_moe_hybrid.ops import sparse_attention as sa

    original = sa.causal_attention
    sa.causal_attention = lambda *a, **kw: original(*a, **{**kw, "backend": backend})
    try:
        yield
    finally:
        sa.causal_attention = original


def checkpoint_tensors(path: str, part: str = "all") -> dict[str, torch.Tensor]:
    """A saved checkpoint's tensors by name, read from its files: part "model" (the weights),
    "optimizer" (the moments, `optimizer.<key>.<name>`, in the files training.checkpoint.OPTIMIZER_PREFIX
    names) or "all"."""
    from safetensors.torch import load_file

    from megatron_moe_hybrid.training.checkpoint import OPTIMIZER_PREFIX

    if part not in ("all", "model", "optimizer"):
        raise ValueError(f"part: {part!r}; use 'all', 'model' or 'optimizer'")
    out = {}
    for f in sorted(os.listdir(path)):
        moments = f.startswith(OPTIMIZER_PREFIX)
        if f.endswith(".safetensors") and (part == "all" or moments == (part == "optimizer")):
            out.update(load_file(os.path.join(path, f)))
    return out


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str) -> None:
    """Weight gradients sum over every token: their round-off grows with their size, so the
    absolute tolerance is tol times the tensor's largest entry (rtol = tol)."""
    atol = tol * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, atol=atol, rtol=tol, msg=lambda m: f"{name}: {m}")


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp64 over the finite entries of expected; the
    non-finite entries (e.g. -inf lse of a row with no key) must be equal in both."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    finite = torch.isfinite(e)
    assert torch.equal(finite, torch.isfinite(a)), "non-finite values where the reference is finite (or back)"
    assert torch.equal(a[~finite], e[~finite]), "non-finite values differ from the reference's"
    return ((a[finite] - e[finite]).norm() / e[finite].norm().clamp_min(1e-30)).item()


def assert_rel_rms(actual: dict, expected: dict, out_tol: float, grad_tol: float) -> dict:
    """Every tensor of actual within rel_rms of expected's: grad_tol for names starting with
    "d" (gradients), out_tol for the rest. Returns the errors."""
    assert actual.keys() == expected.keys()
    errors = {n: rel_rms(actual[n], expected[n]) for n in expected}
    bad = {n: e for n, e in errors.items() if e > (grad_tol if n.startswith("d") else out_tol)}
    assert not bad, f"relative RMS errors over tolerance: {bad} (all: {errors})"
    return errors


def cuda_graph(fn) -> "torch.cuda.CUDAGraph":
    """fn captured once in a CUDA graph, after three eager calls on a side stream (as capture
    needs: allocator pools, lazy init, autotuning). What fn returned or stored in its last call
    is what a replay refills. The benchmarks time its .replay (benchmarks/common.py); GPU tests
    check it against eager calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
