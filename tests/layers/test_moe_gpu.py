"""The MoE layer on the GPU: bf16 with the static dispatcher (Triton gathers, grouped GEMM)
against an fp32 copy of the same layer, and no host synchronisation over a forward+backward.

Shape legend: s sequence, b micro-batch, h hidden size, E experts, K experts per token.
"""

import types

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_moe_hybrid.layers.moe import MoELayer

pytestmark = pytest.mark.gpu


def make_config(dtype, **moe):
    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, params_dtype=dtype
    )
    fields = dict(
        num_experts=8, topk=2, ffn_hidden_size=48, shared_expert_ffn_hidden_size=0, score_func="softmax",
        aux_loss_coeff=0.01, expert_bias=False, bias_update_rate=1e-3, capacity_factor=None,
    )
    fields.update(moe)
    cfg.moe = types.SimpleNamespace(**fields)
    return cfg


def _layer(dtype, **moe):
    torch.manual_seed(0)
    cfg = make_config(dtype=torch.float32, num_experts=16, topk=4, **moe)
    return MoELayer(cfg).cuda().to(dtype)


def _run(layer, hidden, g, dtype):
    x = hidden.to(dtype).requires_grad_(True)
    out = layer(x)[0]
    params = [p for _, p in sorted(layer.named_parameters())]
    return [out] + list(torch.autograd.grad(out, [x] + params, g.to(dtype)))


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("chunks", [1, 3], ids=["chunks1", "chunks3"])
@pytest.mark.parametrize("shared", [0, 16], ids=["no-shared", "shared"])
def test_bf16_static_layer_matches_fp32(chunks, shared):
    """Output and every gradient of the bf16 static path are as close to the fp32 reference
    layer as the bf16 reference path (exact dispatcher, torch permute) is: bf16 rounding only."""
    fast = _layer(torch.bfloat16, dispatcher="static", dispatch_chunks=chunks, shared_expert_ffn_hidden_size=shared)
    ref_bf16 = _layer(torch.bfloat16, dispatcher="alltoall", permute_backend="torch", shared_expert_ffn_hidden_size=shared)
    ref = _layer(torch.float32, dispatcher="alltoall", permute_backend="torch", shared_expert_ffn_hidden_size=shared)
    ref_bf16.load_state_dict(fast.state_dict())
    ref.load_state_dict({k: v.float() for k, v in fast.state_dict().items()})
    hidden, g = torch.randn(37, 3, 32, device="cuda"), torch.randn(37, 3, 32, device="cuda")
    got = _run(fast, hidden, g, torch.bfloat16)
    base = _run(ref_bf16, hidden, g, torch.bfloat16)
    want = _run(ref, hidden, g, torch.float32)
    names = ["out", "hidden"] + [n for n, _ in sorted(fast.named_parameters())]
    for name, a, b, w in zip(names, got, base, want):
        assert _rel(a, w) <= 1.5 * _rel(b, w) + 2e-3, (name, _rel(a, w), _rel(b, w))


def test_forward_backward_never_syncs_with_the_host():
    layer = _layer(torch.bfloat16, dispatcher="static", dispatch_chunks=2, shared_expert_ffn_hidden_size=16)
    x = torch.randn(64, 2, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    layer(x)[0].backward(g)  # first call: Triton compiles, caches warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x)[0].backward(g)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert int(layer.last_dispatch_overflow) == 0


@pytest.mark.parametrize("shared", [0, 16], ids=["no-shared", "shared"])
def test_static_layer_replays_in_a_cuda_graph(shared):
    """No host sync and static shapes: the layer's forward and backward capture in CUDA graphs
    (torch.cuda.make_graphed_callables), and each replay on new tokens gives what the eager
    layer gives, output and every gradient, and counts the same tokens per expert."""
    eager = _layer(torch.bfloat16, dispatcher="static", shared_expert_ffn_hidden_size=shared)
    layer = _layer(torch.bfloat16, dispatcher="static", shared_expert_ffn_hidden_size=shared)
    layer.load_state_dict(eager.state_dict())
    params = [p for _, p in sorted(layer.named_parameters())]

    class Whole(torch.nn.Module):  # the output only, as make_graphed_callables wants
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x)[0]

    sample = torch.randn(64, 2, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(Whole(), (sample,))
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        hidden = torch.randn(64, 2, 32, device="cuda", generator=gen)
        g = torch.randn(64, 2, 32, device="cuda", generator=gen)
        eager.reset_stats()
        layer.reset_stats()
        want = _run(eager, hidden, g, torch.bfloat16)
        x = hidden.bfloat16().requires_grad_(True)
        out = graphed(x)
        got = [out] + list(torch.autograd.grad(out, [x] + params, g.bfloat16()))
        for name, a, b in zip(["out", "hidden"] + [n for n, _ in sorted(layer.named_parameters())], got, want):
            # the same kernels on the same inputs; a stale static input would be ~100% off
            assert _rel(a, b) <= 1e-3, (seed, name, _rel(a, b))
            print(seed, name, "bitwise" if torch.equal(a, b) else f"rel {_rel(a, b):.1e}")
        assert torch.equal(layer.tokens_per_expert, eager.tokens_per_expert), seed
