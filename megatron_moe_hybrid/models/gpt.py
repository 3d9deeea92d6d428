"""HybridMoEModel: Megatron's GPTModel with the hybrid layer stack and a chunked loss.

Shapes: s sequence, b micro-batch, h hidden, V vocabulary.
The decoder runs in Megatron's [s, b, h] layout. With labels, the output projection and the
cross-entropy run fused over token chunks (ops.cross_entropy), so [s*b, V] logits are never
materialised; the per-token loss [b, s] is returned as GPTModel does.
"""

import torch
from megatron.core.models.gpt import GPTModel

from megatron_moe_hybrid.config import HybridMoEConfig
from megatron_moe_hybrid.models.specs import hybrid_layer_specs
from megatron_moe_hybrid.parallel.recompute import recompute_layers


class HybridMoEModel(GPTModel):
    def __init__(self, config: HybridMoEConfig, **kwargs):
        kwargs.setdefault("pre_process", True)
        kwargs.setdefault("post_process", True)
        super().__init__(
            config=config,
            transformer_layer_spec=hybrid_layer_specs(config),
            vocab_size=config.vocab_size,
            max_sequence_length=config.training.seq_length,
            # Positions are handled inside the layers: linear attention needs none, sparse
            # attention applies its own RoPE.
            position_embedding_type="none",
            share_embeddings_and_output_weights=False,
            **kwargs,
        )

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        if labels is None or not self.post_process:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        from megatron_moe_hybrid.ops.cross_entropy import linear_cross_entropy

        s, b, h = hidden_states.shape
        hidden_bsh = hidden_states.transpose(0, 1).reshape(b * s, h)  # [b*s, h]
        loss = linear_cross_entropy(
            hidden_bsh,
            self.output_layer.weight,
            labels.reshape(b * s),
            reduction="none",
            chunk_size=self.config.memory.ce_chunk_size,
        )
        return loss.view(b, s)  # [b, s] fp32

    def moe_layers(self):
        from megatron_moe_hybrid.layers.moe import MoELayer

        return [m for m in self.modules() if isinstance(m, MoELayer)]


def build_model(config: HybridMoEConfig) -> HybridMoEModel:
    """Builds the model on CPU in config.params_dtype; call after parallel_state is initialised.
    memory.recompute_layers turns on activation checkpointing (recompute_layers)."""
    model = HybridMoEModel(config)
    if config.params_dtype != torch.float32:
        model = model.to(config.params_dtype)
    n = config.memory.recompute_layers
    if n:
        recompute_layers(model, len(model.decoder.layers) if n < 0 else n)
    return model
