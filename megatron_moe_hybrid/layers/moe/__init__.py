"""MoE layer pieces: TopKRouter, AllToAllDispatcher (expert parallelism), GroupedExperts, MoELayer."""

from .dispatcher import AllToAllDispatcher
from .experts import GroupedExperts
from .moe_layer import MoELayer, SharedExpertMLP
from .router import TopKRouter

__all__ = ["TopKRouter", "AllToAllDispatcher", "GroupedExperts", "SharedExpertMLP", "MoELayer"]
