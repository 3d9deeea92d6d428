"""Failure detection for multi-process runs: heartbeats, config agreement, non-finite grads.

- Heartbeat: a daemon thread stores `mmh/hb/<rank>` = wall time in the rendezvous store
  every `interval_s`. When a collective fails or times out, `dead_ranks()` names the ranks
  whose heartbeat went stale, so the survivors can say who failed instead of hanging.
- Config agreement: every rank's config is compared at start-up (before the model is
  built), so ranks launched with different configs stop with one line naming the field.
- NonFiniteTracker: post-accumulate-grad hooks note, in backward order, which parameter's
  gradient first became non-finite; no host sync unless the step turns out bad.
"""

import json
import threading
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group / private API changed: no heartbeats
        return None


class Heartbeat:
    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.store = _store()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Heartbeat":
        if self.store is None or self.world == 1:
            return self
        self._beat()
        self._thread = threading.Thread(target=self._run, name="mmh-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        self.store.set(f"mmh/hb/{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # the store host died; the main thread will report it
                return

    def stop(self) -> None:
        self._stop.set()

    def dead_ranks(self, wait_s: Optional[float] = None) -> tuple[list[int], str]:
        """Ranks whose heartbeat is stale (after waiting long enough to tell), and a note."""
        if self.store is None or self.world == 1:
            return [], "no heartbeat store"
        stale_s = 4 * self.interval_s
        time.sleep(stale_s if wait_s is None else wait_s)
        try:
            self.store.set_timeout(timedelta(seconds=5))
            now = time.time()
            ages = {}
            for r in range(self.world):
                ages[r] = now - float(self.store.get(f"mmh/hb/{r}").decode())
        except Exception as e:
            return [0] if self.rank != 0 else [], f"the rendezvous store (hosted by rank 0) is unreachable: {e}"
        dead = [r for r, age in ages.items() if age > stale_s and r != self.rank]
        return dead, ", ".join(f"rank {r} last seen {ages[r]:.1f} s ago" for r in dead)


def config_fingerprint(config_dict: dict) -> str:
    return json.dumps(config_dict, sort_keys=True, default=str)


def check_same_config(config_dict: dict) -> Optional[str]:
    """None when every rank has the same config, else one line naming the first difference."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    mine = config_fingerprint(config_dict)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if all(x == everyone[0] for x in everyone):
        return None
    ref = json.loads(everyone[0])
    for r, other in enumerate(everyone):
        if other == everyone[0]:
            continue
        diff = _first_difference(ref, json.loads(other))
        return (
            f"{diff[0]}: ranks were started with different configs (rank 0 has {diff[1]!r}, "
            f"rank {r} has {diff[2]!r}); launch every rank with the same config and overrides"
        )
    return None


def _first_difference(a, b, prefix: str = ""):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
    return prefix.rstrip(".") or "config", a, b


class NonFiniteTracker:
    """Names the parameter whose gradient went non-finite first in backward order.

    The hooks only record the order in which gradients are accumulated (a Python list, no
    kernels); the gradients themselves are checked only after a step turned out bad. A NaN
    or inf survives accumulation, so the earliest non-finite gradient in that order is the
    first one that went bad. Under FSDP2 the hooks do not fire and nothing is named.
    """

    def __init__(self, model: torch.nn.Module):
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.order: list[int] = []  # indices into self.params, in accumulation order
        self.handles = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, (_, p) in enumerate(self.params)
        ]

    def _hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            if len(self.order) < len(self.params):  # the first micro-batch gives the order
                self.order.append(index)

        return hook

    def reset(self) -> None:
        self.order.clear()

    def first_bad(self) -> Optional[str]:
        """The first parameter (backward order) whose gradient is non-finite; syncs once."""
        with_grad = [i for i in self.order if self.params[i][1].grad is not None]
        if not with_grad:
            return None
        bad = torch.stack([~torch.isfinite(self.params[i][1].grad).all() for i in with_grad]).cpu()
        hits = bad.nonzero()
        return self.params[with_grad[int(hits[0])]][0] if len(hits) else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
