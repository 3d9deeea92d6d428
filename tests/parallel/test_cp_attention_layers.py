"""Qwen3-Next's gated full attention (pattern letter A) and DeepSeek-V3.2's MLA (M, absorbed
form) under context parallelism equal the single-process layer. Each CP rank feeds its pieces of
the sequence (zigzag or contiguous), packed or as a batch of 2:
- A gathers K and V, and its queries attend to every key before them (ops.causal_attention with
  q_ranges). On the CPU the layer runs the reference; the SDPA form (what CUDA runs where varlen
  cannot) is checked against it in the same ranks.
- M all-gathers the one latent kv per token and the indexer keys, and its queries select their
  top-k among every earlier key (cp_sparse_attention_core, as the S layer): output, input
  gradient, every weight gradient (the indexer's through its KL loss) and the logged indexer
  loss, under the trainer's convention (each rank's loss is P x its share of the global loss,
  the gradients averaged over the CP ranks).
fp64 on the CPU. Shape legend: s global tokens, b micro-batch, h hidden, P CP ranks.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_moe_hybrid.config import FullAttentionConfig, MLAConfig, SparseAttentionConfig
from megatron_moe_hybrid.layers.gated_attention import GatedAttention, GatedAttentionSubmodules
from megatron_moe_hybrid.layers.mla_attention import MLAttention, MLAttentionSubmodules
from megatron_moe_hybrid.parallel.context_parallel import CPLayout
from megatron_moe_hybrid.testing import (
    assert_close_to_scale,
    causal_attention_backend,
    init_megatron,
    spawn,
    teardown,
)

S, P = 24, 2
# packed: a sequence cut inside pieces and on a piece boundary (12 of 24 at P 2 zigzag: pieces of 6), an empty one
CU = [0, 5, 12, 12, 19, 24]
CASES = [(kind, packed) for kind in ("zigzag", "contiguous") for packed in (False, True)]


def _inputs(packed, hidden, seed):
    gen = torch.Generator().manual_seed(seed + packed)
    b = 1 if packed else 2
    return (torch.randn(S, b, hidden, generator=gen, dtype=torch.float64),
            torch.randn(S, b, hidden, generator=gen, dtype=torch.float64))  # fmt: skip


def _packed_params(packed):
    cu = torch.tensor(CU, dtype=torch.int32) if packed else None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu) if packed else None


def _grads(layer, x, out, go):
    """The input gradient and every parameter gradient (by name) of sum(out * go)."""
    names, leaves = zip(*layer.named_parameters())
    grads = torch.autograd.grad(out, (x, *leaves), go)
    return grads[0], dict(zip(names, grads[1:]))


# -- A: gated full attention ------------------------------------------------------------------

A_HIDDEN = 32


def _a_layer(cp_layout):
    cfg = TransformerConfig(num_layers=1, hidden_size=A_HIDDEN, num_attention_heads=4, num_query_groups=2,
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


def _a_run(layer, x, go, packed, backend=None):
    """Output, input gradient and every parameter gradient; backend forces causal_attention's."""
    x = x.detach().clone().requires_grad_(True)
    with causal_attention_backend(backend) if backend is not None else contextlib.nullcontext():
        out, _ = layer(x, packed_seq_params=_packed_params(packed))
    return (out.detach(), *_grads(layer, x, out, go))


def _a_worker(rank, world):
    init_megatron(rank, world, cp=world)
    results = []
    for kind, packed in CASES:
        layout = CPLayout.from_parallel_state(S, kind)
        x, go = _inputs(packed, A_HIDDEN, 1)
        got = {}
        for backend in (None, "sdpa"):
            out, x_grad, grads = _a_run(_a_layer(kind), layout.shard(x, 0), layout.shard(go, 0), packed, backend)
            for g in grads.values():  # the parameters' gradients sum over the ranks' tokens
                dist.all_reduce(g, group=ps.get_context_parallel_group())
            got[backend] = (out, x_grad, grads)
        results.append(dict(positions=layout.positions(), reference=got[None], sdpa=got["sdpa"]))
    return results


@pytest.mark.distributed
def test_cp2_gated_attention_equals_single_process():
    init_megatron()
    try:
        expected = [_a_run(_a_layer(kind), *_inputs(packed, A_HIDDEN, 1), packed) for kind, packed in CASES]
    finally:
        teardown()
    results = spawn(_a_worker, P)
    for i, (kind, packed) in enumerate(CASES):
        out, x_grad, grads = expected[i]
        for rank in range(P):
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


# -- M: absorbed MLA ----------------------------------------------------------------------------

M_HIDDEN = 48


def _m_layer(cp_layout, absorbed=True):
    cfg = TransformerConfig(num_layers=1, hidden_size=M_HIDDEN, num_attention_heads=3, use_cpu_initialization=True,
                            params_dtype=torch.float64)  # fmt: skip
    cfg.mla = MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                        absorbed=absorbed)  # fmt: skip
    cfg.sparse_attention = SparseAttentionConfig(topk=5, index_n_heads=3, index_head_dim=8, indexer_loss_coeff=0.1)
    cfg.cp_layout = cp_layout
    torch.manual_seed(0)
    layer = MLAttention(cfg, MLAttentionSubmodules())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
    return layer


def _m_run(layer, x, go, packed):
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x, packed_seq_params=_packed_params(packed))
    return (out.detach(), *_grads(layer, x, out, go), layer.last_indexer_loss.clone())


def _m_worker(rank, world):
    init_megatron(rank, world, cp=world)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    results = []
    for kind, packed in CASES:
        layout = CPLayout.from_parallel_state(S, kind)
        x, go = _inputs(packed, M_HIDDEN, 3)
        out, x_grad, grads, loss = _m_run(_m_layer(kind), layout.shard(x, 0), world * layout.shard(go, 0), packed)
        for g in grads.values():
            dist.all_reduce(g, group=ps.get_context_parallel_group())
            g /= world
        results.append(dict(positions=layout.positions(), out=out, x_grad=x_grad / world, grads=grads, loss=loss))
    with pytest.raises(ValueError, match="mla.absorbed"):
        _m_layer("zigzag", absorbed=False)(torch.zeros(S // world, 1, M_HIDDEN, dtype=torch.float64))
    return results


@pytest.mark.distributed
def test_cp2_mla_equals_single_process():
    init_megatron()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    try:
        expected = [_m_run(_m_layer(kind), *_inputs(packed, M_HIDDEN, 3), packed) for kind, packed in CASES]
    finally:
        teardown()
    results = spawn(_m_worker, P)
    for i, (kind, packed) in enumerate(CASES):
        out, x_grad, grads, loss = expected[i]
        assert float(loss) > 0
        for rank in range(P):
            got, name = results[rank][i], f"{kind} {'packed' if packed else 'b2'} rank {rank}"
            pos = got["positions"]
            torch.testing.assert_close(got["out"], out[pos], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} out: {m}")
            torch.testing.assert_close(got["x_grad"], x_grad[pos], rtol=1e-9, atol=1e-11,
                                       msg=lambda m: f"{name} x grad: {m}")  # fmt: skip
            torch.testing.assert_close(got["loss"], loss, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} loss: {m}")
            for key, g in grads.items():
                assert_close_to_scale(got["grads"][key], g, 1e-9, f"{name} grad {key}")
