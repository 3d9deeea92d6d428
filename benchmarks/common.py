"""Shared by the benchmarks: CUDA-event timing, peak memory above the inputs, the results JSON.

See ../shared/DESIGN.md ("Benchmark results") for the file format.
"""

import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
from importlib import metadata

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package, uninstalled too
from megatron_moe_hybrid.testing import cuda_graph  # noqa: E402, F401  (the benchmarks' graphs: fn captured once)


def peak_above(fn) -> int:
    """Peak bytes allocated while fn ran, above what was allocated when it began."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def mean_event_ms(fn, warmup: int = 3, calls: int = 5) -> float:
    """ms per call of fn: `calls` calls launched back to back after `warmup`, between two CUDA
    events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def time_and_peak(fn, warmup: int, reps: int) -> tuple[float, int]:
    """(median ms over reps, peak bytes allocated above what was live before the first call)."""
    peak = peak_above(lambda: [fn() for _ in range(warmup)])
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), peak


def versions(*packages: str) -> dict[str, str]:
    found = {}
    for name in ("torch", "triton", "megatron-core", *packages):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_sha() -> str:
    """GIT_SHA from the environment where given (the device machine's copy of the tree has
    reported a stale HEAD), else HEAD's short sha, with "+uncommitted" where tracked files differ
    from it (what ran is then not that commit)."""
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    def run(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        sha = run("rev-parse", "--short", "HEAD")
        return sha + ("+uncommitted" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(path: str, rows: list[dict], packages: tuple[str, ...] = (), device: str | None = None) -> None:
    """Writes the results file (again after every row, so a run cut short keeps what it measured);
    device: the CUDA device's name unless given (a CPU benchmark names the CPU)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    result = {
        "device": device or torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "git_sha": git_sha(),
        "command": "python " + " ".join(sys.argv),
        "versions": versions(*packages),
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def cpu_name(note: str = "") -> str:
    """This machine's CPU as a CPU benchmark's results name their device."""
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores){note}"


@contextlib.contextmanager
def worktree(revision: str, where: str):
    """A checkout of revision at where (a git worktree of this repository), removed at the end:
    the anchor of a benchmark that times ours against our own earlier code in the same run. The
    built extension (megatron_moe_hybrid/_C.*, an in-place build that git does not hold) is linked in."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", "-q", where, revision], check=True)
    package = os.path.join(root, "megatron_moe_hybrid")
    for f in os.listdir(package):
        if f.startswith("_C."):
            os.symlink(os.path.join(package, f), os.path.join(where, "megatron_moe_hybrid", f))
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", where], check=False)


def anchor_tree(stack: contextlib.ExitStack, revision: str, tree: str | None, tmp: str) -> str:
    """The anchor's checkout: tree (git archive's files of revision, where there is no repository,
    as on the device machine) or a worktree of revision under tmp, removed when stack closes."""
    if tree:
        return os.path.abspath(tree)
    return stack.enter_context(worktree(revision, os.path.join(tmp, "before")))


def run_in_tree(tree: str, args: list[str], timeout: float = 3600) -> dict:
    """Runs `python *args` in tree with tree's package first on the path (the caller's path after
    it, where other packages may live) and returns the JSON of the last line it printed."""
    path = os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, *args], cwd=tree, env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{args} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
