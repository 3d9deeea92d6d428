"""The hybrid layer pattern -> Megatron TransformerBlockSubmodules.

Each layer is a Megatron TransformerLayer: norm -> self_attention -> residual, norm -> MLP ->
residual. The pattern letter picks the self-attention module (registry.LAYER_KINDS); the MLP
is our MoE layer, or Megatron's dense SwiGLU MLP for the first `moe.first_k_dense` layers.
Everything here runs on CPU: norms are Megatron's torch norms, linears its tensor-parallel
linears (no Transformer Engine needed).
"""

import sys

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_moe_hybrid.config import HybridMoEConfig
from megatron_moe_hybrid.registry import LAYER_KINDS


def _attention_spec(kind: str) -> ModuleSpec:
    module = LAYER_KINDS.get(kind)
    # Convention: `<Module>Submodules` beside the module, a dataclass whose defaults are
    # Megatron's tensor-parallel linears.
    submodules_cls = getattr(sys.modules[module.__module__], f"{module.__name__}Submodules")
    return ModuleSpec(module=module, submodules=submodules_cls())


def _mlp_spec(config: HybridMoEConfig, layer_index: int):
    if config.is_moe_layer(layer_index):
        from megatron_moe_hybrid.layers.moe import MoELayer

        # A class (not a ModuleSpec) so that TransformerLayer passes only `config`.
        return MoELayer
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        params={"ffn_hidden_size": config.moe.dense_ffn_hidden_size},
    )


class SeededTransformerLayer(TransformerLayer):
    """Megatron's TransformerLayer, drawing its initial weights from its own seed inside a
    seeded build (models.gpt.SeededBuild): layer n's weights then depend on (seed, n) alone,
    not on the layers built before it, so that one layer can be built again by itself and
    come out the same (models.gpt.initialize, which builds a model layer by layer). Without a
    seeded build it is TransformerLayer unchanged."""

    def __init__(self, config, submodules, layer_number: int = 1, **kwargs):
        from megatron_moe_hybrid.models import gpt

        build = gpt.current_seeded_build()
        if build is None:
            super().__init__(config, submodules, layer_number=layer_number, **kwargs)
            return
        if build.draws(layer_number):
            build.before_layer(layer_number)
            super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        else:  # a layer the build does not need: no storage, nothing drawn
            with torch.device("meta"):
                super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        build.after_layer(layer_number, self, config.num_layers)


def hybrid_layer_spec(config: HybridMoEConfig, layer_index: int) -> ModuleSpec:
    """The ModuleSpec of layer `layer_index` (0-based) of the hybrid stack."""
    return ModuleSpec(
        module=SeededTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=_attention_spec(config.layer_kind(layer_index)),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=_mlp_spec(config, layer_index),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def hybrid_layer_specs(config: HybridMoEConfig) -> TransformerBlockSubmodules:
    """One spec per layer following config.pattern, plus the final norm."""
    return TransformerBlockSubmodules(
        layer_specs=[hybrid_layer_spec(config, i) for i in range(config.num_layers)],
        layer_norm=WrappedTorchNorm,
    )
