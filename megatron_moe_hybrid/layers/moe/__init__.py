"""MoE layer pieces: TopKRouter, the dispatchers (StaticAllToAllDispatcher: sync-free, the
default; AllToAllDispatcher: exact splits, one host sync), GroupedExperts, MoELayer.

Megatron-Core's own MoELayer takes our static dispatcher through
layers.moe.megatron_dispatcher.megatron_moe_spec()."""

from .dispatcher import AllToAllDispatcher, StaticAllToAllDispatcher
from .experts import GroupedExperts
from .moe_layer import MoELayer, SharedExpertMLP
from .router import TopKRouter

__all__ = [
    "TopKRouter",
    "AllToAllDispatcher",
    "StaticAllToAllDispatcher",
    "GroupedExperts",
    "SharedExpertMLP",
    "MoELayer",
]
