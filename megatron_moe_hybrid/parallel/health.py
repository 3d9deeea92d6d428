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
            self.store.set_timeout(__import__("datetime").timedelta(seconds=5))
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
    """Remembers which parameter's gradient first went non-finite during backward."""

    def __init__(self, model: torch.nn.Module):
        self.names: list[str] = []
        self.order: list[int] = []  # parameter indices in the order their grads were accumulated
        self.flags: list[torch.Tensor] = []  # matching "non-finite" flags, on the grads' device
        self.handles = []
        for i, (name, p) in enumerate(model.named_parameters()):
            self.names.append(name)
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def _hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            self.order.append(index)
            self.flags.append(~torch.isfinite(p.grad).all())

        return hook

    def reset(self) -> None:
        self.order.clear()
        self.flags.clear()

    def first_bad(self) -> Optional[str]:
        """The first parameter (backward order) whose gradient was non-finite; syncs once."""
        if not self.flags:
            return None
        bad = torch.stack(self.flags).cpu()
        hits = bad.nonzero()
        return self.names[self.order[int(hits[0])]] if len(hits) else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
