"""The whole hybrid MoE model under context parallelism equals the single-process model.

Shape legend: b micro-batch, s global sequence, P CP ranks, s / P local tokens per rank.
Each CP rank feeds its pieces of the same sequences (CPLayout.shard); its loss is the mean
over its tokens and the gradients are averaged over the CP ranks, as the trainer does.
"""

import os

import pytest
import torch
import torch.distributed as dist
import yaml

from megatron_moe_hybrid.config import config_from_dict
from megatron_moe_hybrid.testing import init_megatron, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 48


def _config(cp, layout, aux_loss_type="micro_batch", pattern="LLLS"):
    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    return config_from_dict(raw, {
        "parallel.world_size": cp, "parallel.context_parallel_size": cp, "parallel.cp_layout": layout,
        "training.seq_length": SEQ, "sparse_attention.topk": 6, "sparse_attention.indexer_loss_coeff": 0.1,
        "moe.aux_loss_type": aux_loss_type, "moe.aux_loss_coeff": 0.05, "moe.z_loss_coeff": 0.01,
        "moe.dispatcher": "alltoall", "linear_attention.chunk_size": 8, "model.pattern": pattern,
    })


# Packed: boundaries inside pieces, on a piece boundary (24 = 2 pieces of 12 at CP=2 zigzag),
# an empty sequence, and a sequence spanning several pieces.
CU_SEQLENS = [0, 5, 24, 24, 41, 48]


def _run(rank, world, layout, aux_loss_type, packed=False, device="cpu", dtype=torch.float64, pattern="LLLS"):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.parallel.context_parallel import CPLayout

    init_megatron(rank, world, cp=world)
    config = _config(world, layout, aux_loss_type, pattern)
    torch.manual_seed(0)
    model = build_model(config).to(dtype)
    for m in model.modules():  # a random expert bias takes part in the routing
        if getattr(m, "expert_bias", None) is not None:
            m.expert_bias.normal_()
    b = 1 if packed else 2
    tokens = torch.randint(0, config.vocab_size, (b, SEQ))  # [b, s], the same on every rank
    labels = torch.randint(0, config.vocab_size, (b, SEQ))
    cp = CPLayout.from_parallel_state(SEQ, layout)
    tokens, labels = cp.shard(tokens, 1), cp.shard(labels, 1)  # [b, s / P]
    if device == "cuda":
        torch.backends.cudnn.allow_tf32 = False  # the short conv: exact fp32, as on the CPU
        model, tokens, labels = model.cuda(), tokens.cuda(), labels.cuda()
    kwargs = {}
    if packed:  # global offsets on every rank (the CP convention)
        cu = torch.tensor(CU_SEQLENS, dtype=torch.int32, device=tokens.device)
        kwargs["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=SEQ, max_seqlen_kv=SEQ
        )
    loss = model(tokens, cp.positions(tokens.device).expand_as(tokens), None, labels=labels, **kwargs).mean()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if world > 1:
            dist.all_reduce(g)
            g = g / world
        grads[name] = g.cpu()
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
    return (total / world).cpu(), grads


@pytest.mark.parametrize(
    "aux_loss_type, packed, pattern",
    [("micro_batch", False, "LLLS"), ("seq", False, "LLAS"), ("micro_batch", True, "LMAS")],
    ids=["micro_batch", "seq-gated-attention", "packed-mla-gated-attention"],
)
def test_cp2_model_equals_cp1(aux_loss_type, packed, pattern):
    """LLAS, LMAS: Qwen3-Next's gated full attention (A) and DeepSeek-V3.2's MLA (M) beside the sparse layer."""
    (ref_loss, ref_grads), = spawn(_run, 1, "zigzag", aux_loss_type, packed, "cpu", torch.float64, pattern)
    for layout in ("zigzag", "contiguous"):
        for loss, grads in spawn(_run, 2, layout, aux_loss_type, packed, "cpu", torch.float64, pattern):
            torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                assert g.abs().sum() > 0 or ref_grads[name].abs().sum() == 0, name
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.slow
def test_cp4_model_equals_cp1():
    (ref_loss, ref_grads), = spawn(_run, 1, "zigzag", "micro_batch")
    for loss, grads in spawn(_run, 4, "zigzag", "micro_batch"):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-8, atol=1e-10, msg=name)


def test_cp_config_errors_name_the_field():
    from megatron_moe_hybrid.config import ConfigError

    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    cases = [
        ({"parallel.context_parallel_size": 4, "training.seq_length": 36}, "training.seq_length"),
        ({"parallel.context_parallel_size": 2, "model.pattern": "LLLM", "mla.absorbed": False}, "mla.absorbed"),
        ({"parallel.cp_layout": "ring"}, "parallel.cp_layout"),
    ]
    for overrides, field in cases:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            config_from_dict(raw, {"parallel.world_size": 4, **overrides})


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_cp2_model_equals_cp1_on_gpus(packed):
    """Over NCCL (the gathers' backward is a reduce-scatter there), fp32 on the GPU."""
    (ref_loss, ref_grads), = spawn(_run, 1, "zigzag", "micro_batch", packed, "cuda", torch.float32,
                                   backend="nccl")
    for loss, grads in spawn(_run, 2, "zigzag", "micro_batch", packed, "cuda", torch.float32, backend="nccl"):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            scale = max(1.0, ref_grads[name].abs().max().item())
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
