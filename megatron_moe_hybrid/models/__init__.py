"""Model builders: the hybrid pattern as Megatron layer specs, and the GPTModel subclass."""

from megatron_moe_hybrid.models.gpt import HybridMoEModel, build_model, initialize, materialize
from megatron_moe_hybrid.models.specs import hybrid_layer_spec, hybrid_layer_specs

__all__ = ["HybridMoEModel", "build_model", "hybrid_layer_spec", "hybrid_layer_specs", "initialize", "materialize"]
