"""The MoE layer computes the same with the compiled permute (_C) as with the reference."""

import copy
import types

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_moe_hybrid import _ext
from megatron_moe_hybrid.layers.moe import MoELayer


@pytest.mark.skipif(not _ext.has_cpu_ops(), reason="megatron_moe_hybrid._C is not built")
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_fused_permute_backend_matches_torch(score_func):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, params_dtype=torch.float64)
    cfg.moe = types.SimpleNamespace(
        num_experts=8, topk=3, ffn_hidden_size=24, shared_expert_ffn_hidden_size=0,
        score_func=score_func, aux_loss_coeff=0.0, expert_bias=False, bias_update_rate=1e-3,
        capacity_factor=None, permute_backend="torch",
    )
    torch.manual_seed(0)
    ref = MoELayer(cfg, ep_group=None).double()
    fused_cfg = copy.copy(cfg)
    fused_cfg.moe = types.SimpleNamespace(**{**vars(cfg.moe), "permute_backend": "fused"})
    fused = MoELayer(fused_cfg, ep_group=None).double()
    fused.load_state_dict(ref.state_dict())

    x = torch.randn(13, 2, 32, dtype=torch.float64)
    outs, grads = [], []
    for layer in (ref, fused):
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
        params = [p for p in layer.parameters()]
        grads.append(torch.autograd.grad(out, [xi, *params], g))
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-12)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
