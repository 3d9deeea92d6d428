"""Packed batches: cu_seqlens read to the host once per tensor.

The layers of one step share their batch's cu_seqlens tensor, and the ops need its values on
the host (to check them, to count chunks) and some index objects built from them. Reading a
CUDA tensor to the host is a sync, which drains the queue the host had run ahead with.
`host_offsets` reads it once per tensor and version; `derived` builds an object from it once
per tensor, version and key (callers must not modify what it returns). An entry holds the
tensor itself, so its id and memory cannot be taken by another tensor while it is cached; a
write in place bumps the version counter and reads again. Inference-mode tensors keep no
version counter: they are read on every call and nothing is cached.
"""

import collections
from collections.abc import Callable
from typing import Any

from torch import Tensor

# [cu_seqlens, its version counter, its host copy or None, {key: derived object}], newest last
_ENTRIES: collections.deque = collections.deque(maxlen=8)


def _entry(cu_seqlens: Tensor) -> list | None:
    try:
        version = cu_seqlens._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        return None
    for entry in _ENTRIES:
        if entry[0] is cu_seqlens and entry[1] == version:
            return entry
    entry = [cu_seqlens, version, None, {}]
    _ENTRIES.append(entry)
    return entry


def host_offsets(cu_seqlens: Tensor) -> list[int]:
    """cu_seqlens.tolist(), read once per tensor and version (do not modify the list)."""
    entry = _entry(cu_seqlens)
    if entry is None:
        return cu_seqlens.tolist()
    if entry[2] is None:
        entry[2] = cu_seqlens.tolist()
    return entry[2]


def derived(cu_seqlens: Tensor, key, build: Callable[[], Any]) -> Any:
    """build(), once per cu_seqlens tensor, version and key."""
    entry = _entry(cu_seqlens)
    if entry is None:
        return build()
    if key not in entry[3]:
        entry[3][key] = build()
    return entry[3][key]
