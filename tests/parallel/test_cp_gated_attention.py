"""Qwen3-Next's gated full attention (pattern letter A) under context parallelism equals the
single-process layer: each CP rank feeds its pieces of the sequence (zigzag or contiguous),
gathers K and V, and its queries attend to every key before them (ops.causal_attention with
q_ranges). On the CPU the layer runs the reference; the SDPA form (what CUDA runs where varlen
cannot) is checked against it in the same ranks.

Shape legend: s global tokens, b micro-batch, h hidden, P CP ranks.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

from megatron_moe_hybrid.config import FullAttentionConfig
from megatron_moe_hybrid.layers.gated_attention import GatedAttention, GatedAttentionSubmodules
from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.parallel.context_parallel import CPLayout
from megatron_moe_hybrid.testing import init_megatron, spawn, teardown

S, HIDDEN = 24, 32
# packed: a sequence cut inside pieces and on a piece boundary (12 of 24 at P 2 zigzag: pieces of 6), an empty one
CU = [0, 5, 12, 12, 19, 24]


def _layer(cp_layout):
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                            kv_channels=8, use_cpu_initialization=True, params_dtype=torch.float64,
                            layernorm_epsilon=1e-6)  # fmt: skip
    cfg.full_attention = FullAttentionConfig(partial_rotary_factor=0.5, rope_theta=10000.0)
    cfg.cp_layout = cp_layout  # HybridMoEConfig's property; the layer reads it with getattr
    torch.manual_seed(0)
    layer = GatedAttention(cfg, GatedAttentionSubmodules())
    with torch.no_grad():  # the norms' weights start at 0: give them some
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.normal_(0, 0.5)
    return layer


def _run(layer, x, go, packed, backend=None):
    """Output, input gradient and every parameter gradient (by name)."""
    cu = torch.tensor(CU, dtype=torch.int32) if packed else None
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu) if packed else None
    x = x.detach().clone().requires_grad_(True)
    original = sa.causal_attention
    if backend is not None:  # the layer asks for auto, which keeps CPU tensors on the reference
        sa.causal_attention = lambda *a, **kw: original(*a, **{**kw, "backend": backend})
    try:
        out, _ = layer(x, packed_seq_params=params)
    finally:
        sa.causal_attention = original
    names, leaves = zip(*layer.named_parameters())
    grads = torch.autograd.grad(out, (x, *leaves), go)
    return out.detach(), grads[0], dict(zip(names, grads[1:]))


CASES = [(kind, packed) for kind in ("zigzag", "contiguous") for packed in (False, True)]


def _inputs(packed):
    gen = torch.Generator().manual_seed(1 + packed)
    b = 1 if packed else 2
    return (torch.randn(S, b, HIDDEN, generator=gen, dtype=torch.float64),
            torch.randn(S, b, HIDDEN, generator=gen, dtype=torch.float64))  # fmt: skip


def _worker(rank, world):
    init_megatron(rank, world, cp=world)
    results = []
    for kind, packed in CASES:
        layout = CPLayout.from_parallel_state(S, kind)
        x, go = _inputs(packed)
        got = {}
        for backend in (None, "sdpa"):
            out, x_grad, grads = _run(_layer(kind), layout.shard(x, 0), layout.shard(go, 0), packed, backend)
            for g in grads.values():  # the parameters' gradients sum over the ranks' tokens
                dist.all_reduce(g, group=ps.get_context_parallel_group())
            got[backend] = (out, x_grad, grads)
        results.append(dict(positions=layout.positions(), reference=got[None], sdpa=got["sdpa"]))
    return results


@pytest.mark.distributed
def test_cp2_gated_attention_equals_single_process():
    init_megatron()
    try:
        expected = [_run(_layer(kind), *_inputs(packed), packed) for kind, packed in CASES]
    finally:
        teardown()
    results = spawn(_worker, 2)
    for i, (kind, packed) in enumerate(CASES):
        out, x_grad, grads = expected[i]
        for rank in range(2):
            pos = results[rank][i]["positions"]
            for form in ("reference", "sdpa"):
                got_out, got_x_grad, got_grads = results[rank][i][form]
                name = f"{kind} {'packed' if packed else 'b2'} rank {rank} {form}"
                torch.testing.assert_close(got_out, out[pos], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} out: {m}")
                torch.testing.assert_close(got_x_grad, x_grad[pos], rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{name} x grad: {m}")  # fmt: skip
                for key, g in grads.items():
                    torch.testing.assert_close(got_grads[key], g, rtol=1e-9, atol=1e-11,
                                               msg=lambda m: f"{name} {key}: {m}")  # fmt: skip
