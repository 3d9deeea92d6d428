"""The hybrid model builds through Megatron specs and runs forward/backward on CPU."""

import os

import pytest
import torch
import torch.nn.functional as F
import yaml

from megatron_moe_hybrid.config import config_from_dict
from megatron_moe_hybrid.testing import init_megatron, teardown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_config(**overrides):
    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    base = {"parallel.world_size": 1, "training.seq_length": 32, "sparse_attention.topk": 8}
    base.update(overrides)
    return config_from_dict(raw, base)


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    init_megatron()
    yield
    teardown()


def test_specs_follow_the_pattern():
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_moe_hybrid.layers.linear_attention import LinearAttention
    from megatron_moe_hybrid.layers.moe import MoELayer
    from megatron_moe_hybrid.layers.sparse_attention import SparseAttention
    from megatron_moe_hybrid.models import hybrid_layer_specs

    config = tiny_config(**{"model.num_layers": 8, "moe.first_k_dense": 1})
    specs = hybrid_layer_specs(config)
    assert isinstance(specs, TransformerBlockSubmodules)
    assert len(specs.layer_specs) == 8
    kinds = [s.submodules.self_attention.module for s in specs.layer_specs]
    assert kinds == [LinearAttention, LinearAttention, LinearAttention, SparseAttention] * 2
    assert specs.layer_specs[0].submodules.mlp.module is MLP
    assert all(s.submodules.mlp is MoELayer for s in specs.layer_specs[1:])


def test_model_is_a_gpt_model_with_the_hybrid_layers():
    from megatron.core.models.gpt import GPTModel

    from megatron_moe_hybrid.layers.linear_attention import LinearAttention
    from megatron_moe_hybrid.layers.sparse_attention import SparseAttention
    from megatron_moe_hybrid.models import build_model

    torch.manual_seed(0)
    model = build_model(tiny_config())
    assert isinstance(model, GPTModel)
    layers = model.decoder.layers
    assert len(layers) == 4
    assert [type(l.self_attention) for l in layers] == [LinearAttention] * 3 + [SparseAttention]
    assert len(model.moe_layers()) == 4


def test_forward_backward_and_chunked_loss_matches_logits():
    from megatron_moe_hybrid.models import build_model

    torch.manual_seed(0)
    config = tiny_config(**{"memory.ce_chunk_size": 7})
    model = build_model(config)
    b, s = 2, 32
    tokens = torch.randint(0, config.vocab_size, (b, s))
    labels = torch.randint(0, config.vocab_size, (b, s))
    pos = torch.arange(s).expand(b, s)

    loss_bs = model(tokens, pos, None, labels=labels)
    assert loss_bs.shape == (b, s)
    logits = model(tokens, pos, None)  # [b, s, V]
    assert logits.shape == (b, s, config.vocab_size)
    ref = F.cross_entropy(logits.reshape(b * s, -1).float(), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss_bs.reshape(-1), ref, rtol=1e-5, atol=1e-5)

    loss_bs.mean().backward()
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and p.grad is None]
    assert not missing, missing
    for n, p in params.items():
        assert torch.isfinite(p.grad).all(), n
    assert params["embedding.word_embeddings.weight"].grad.abs().sum() > 0
    assert params["output_layer.weight"].grad.abs().sum() > 0


def test_model_is_causal():
    from megatron_moe_hybrid.models import build_model

    torch.manual_seed(0)
    config = tiny_config()
    model = build_model(config).eval()
    s = 32
    tokens = torch.randint(0, config.vocab_size, (1, s))
    pos = torch.arange(s)[None]
    with torch.no_grad():
        a = model(tokens, pos, None)
        tokens2 = tokens.clone()
        tokens2[0, 20] = (tokens2[0, 20] + 1) % config.vocab_size
        b = model(tokens2, pos, None)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])
