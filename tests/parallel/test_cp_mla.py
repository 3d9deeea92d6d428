"""DeepSeek-V3.2's MLA (pattern letter M, absorbed form) under context parallelism equals the
single-process layer: each CP rank feeds its pieces of the sequence, all-gathers the one latent
kv per token and the indexer keys, and its queries select their top-k among every earlier key
(cp_sparse_attention_core, as the S layer). Output, input gradient, every weight gradient (the
indexer's through its KL loss) and the logged indexer loss, fp64 on the CPU.

The trainer's convention: each rank's loss is P x its share of the global loss (the mean over
its own tokens) and the gradients are averaged over the CP ranks. Shape legend: s global tokens,
b micro-batch, h hidden, P CP ranks.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_moe_hybrid.config import MLAConfig, SparseAttentionConfig
from megatron_moe_hybrid.layers.mla_attention import MLAttention, MLAttentionSubmodules
from megatron_moe_hybrid.parallel.context_parallel import CPLayout
from megatron_moe_hybrid.testing import assert_close_to_scale, init_megatron, spawn, teardown

S, HIDDEN, P = 24, 48, 2
CU = [0, 5, 12, 12, 19, 24]  # cut inside pieces and on a piece boundary, an empty sequence


def _layer(cp_layout, absorbed=True):
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=3, use_cpu_initialization=True,
                            params_dtype=torch.float64)  # fmt: skip
    cfg.mla = MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                        absorbed=absorbed)  # fmt: skip
    cfg.sparse_attention = SparseAttentionConfig(topk=5, index_n_heads=3, index_head_dim=8, indexer_loss_coeff=0.1)
    cfg.cp_layout = cp_layout  # HybridMoEConfig's property; the layer reads it with getattr
    torch.manual_seed(0)
    layer = MLAttention(cfg, MLAttentionSubmodules())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
    return layer


def _run(layer, x, go, packed):
    cu = torch.tensor(CU, dtype=torch.int32) if packed else None
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu) if packed else None
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x, packed_seq_params=params)
    names, leaves = zip(*layer.named_parameters())
    grads = torch.autograd.grad(out, (x, *leaves), go)
    return out.detach(), grads[0], dict(zip(names, grads[1:])), layer.last_indexer_loss.clone()


CASES = [(kind, packed) for kind in ("zigzag", "contiguous") for packed in (False, True)]


def _inputs(packed):
    gen = torch.Generator().manual_seed(3 + packed)
    b = 1 if packed else 2
    return (torch.randn(S, b, HIDDEN, generator=gen, dtype=torch.float64),
            torch.randn(S, b, HIDDEN, generator=gen, dtype=torch.float64))  # fmt: skip


def _worker(rank, world):
    init_megatron(rank, world, cp=world)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    results = []
    for kind, packed in CASES:
        layout = CPLayout.from_parallel_state(S, kind)
        x, go = _inputs(packed)
        out, x_grad, grads, loss = _run(_layer(kind), layout.shard(x, 0), world * layout.shard(go, 0), packed)
        for g in grads.values():
            dist.all_reduce(g, group=ps.get_context_parallel_group())
            g /= world
        results.append(dict(positions=layout.positions(), out=out, x_grad=x_grad / world, grads=grads,
                            loss=loss))  # fmt: skip
    with pytest.raises(ValueError, match="mla.absorbed"):
        _layer("zigzag", absorbed=False)(torch.zeros(S // world, 1, HIDDEN, dtype=torch.float64))
    return results


@pytest.mark.distributed
def test_cp2_mla_equals_single_process():
    init_megatron()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    try:
        expected = [_run(_layer(kind), *_inputs(packed), packed) for kind, packed in CASES]
    finally:
        teardown()
    results = spawn(_worker, P)
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
