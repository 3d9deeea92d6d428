"""causal_attention on CUDA (-m gpu): packed sequences through torch's varlen flash kernel
(what auto runs for the gated full attention `A` and the sparse layer's dense warm-up) and
through SDPA once per sequence, in bf16/fp16 against the fp32 reference on the same inputs:
relative RMS <= 5e-3 for o, <= 1e-2 for gradients (the sparse-attention GPU tests' bounds).
"""

import pytest
import torch

from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.testing import assert_rel_rms

pytestmark = pytest.mark.gpu


def _lengths(gen, T, shortest=1, longest=900):
    """Random sequence lengths summing to T, some of 1 token, none empty unless asked."""
    out = []
    while sum(out) < T:
        out.append(int(torch.randint(shortest, longest, (1,), generator=gen)))
    out[-1] -= sum(out) - T
    return [n for n in out if n > 0]


def _case(H, G, D, lengths, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0, *lengths]).cumsum(0).cuda()
    q, k, v = (torch.randn(1, T, n, D, generator=gen).to("cuda", dtype) for n in (H, G, G))
    go = torch.randn(1, T, H, D, generator=gen).to("cuda", dtype)
    return q, k, v, go, cu


def _run(q, k, v, go, cu, backend):
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    o = sa.causal_attention(q, k, v, cu_seqlens=cu, backend=backend)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), go)
    return {"o": o, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize(
    "H,G,D,dtype",
    [(16, 2, 256, torch.bfloat16), (8, 8, 128, torch.bfloat16), (4, 1, 64, torch.bfloat16), (16, 2, 128, torch.float16)],
)
def test_packed_varlen_and_sdpa_match_fp32_reference(H, G, D, dtype, monkeypatch):
    """Qwen3-Next's A layer (16 heads on 2 groups, D 256), MHA and MQA; ragged lengths of 1 to
    900 tokens. auto takes the varlen kernel for them (counted), and both fused forms equal the
    fp32 reference within the bounds."""
    gen = torch.Generator().manual_seed(H + G + D)
    lengths = [1, *_lengths(gen, 2500), 1, 7]
    q, k, v, go, cu = _case(H, G, D, lengths, dtype, seed=D + H)
    ref = _run(q.float(), k.float(), v.float(), go.float(), cu, "torch")
    calls = []
    varlen = sa._varlen_run
    monkeypatch.setattr(sa, "_varlen_run", lambda *a: calls.append(1) or varlen(*a))
    for backend in ("auto", "sdpa"):
        got = _run(q, k, v, go, cu, backend)
        errors = assert_rel_rms({n: x.float() for n, x in got.items()}, ref, 5e-3, 1e-2)
        print(backend, {n: f"{e:.2e}" for n, e in errors.items()})
    assert len(calls) == 1, "auto did not take the varlen kernel for packed 16-bit CUDA tensors"
    assert sa.varlen_unsupported(q, k, v) is None


def test_auto_keeps_what_varlen_cannot_take_on_sdpa(monkeypatch):
    """fp32 CUDA tensors and a value head dim unlike the key's (the flash kernel takes neither)
    run per sequence through SDPA under auto, and equal the reference."""
    monkeypatch.setattr(sa, "_varlen_run", lambda *a: pytest.fail("varlen ran"))
    q, k, v, go, cu = _case(4, 2, 64, [300, 1, 211], torch.float32, seed=3)
    assert "bf16 or fp16" in sa.varlen_unsupported(q, k, v)
    got, ref = _run(q, k, v, go, cu, "auto"), _run(q, k, v, go, cu, "torch")
    assert_rel_rms(got, ref, 1e-3, 1e-3)
    q, k, v, go, cu = _case(4, 2, 64, [300, 1, 211], torch.bfloat16, seed=4)
    v = v[..., :32].contiguous()
    assert "one head dim" in sa.varlen_unsupported(q, k, v)
    got = _run(q, k, v, go[..., :32], cu, "auto")
    ref = _run(q.float(), k.float(), v.float(), go[..., :32].float(), cu, "torch")
    assert_rel_rms({n: x.float() for n, x in got.items()}, ref, 5e-3, 1e-2)


def test_packed_attention_memory_is_linear_in_tokens():
    """32k packed tokens of 16 heads at D 128: the reference would hold 64 GB of fp32 scores;
    the varlen forward and backward add a few times the inputs' bytes."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, go, cu = _case(16, 2, 128, _lengths(gen, 32768, 1000, 8000), torch.bfloat16, seed=0)
    inputs = sum(x.numel() * x.element_size() for x in (q, k, v, go))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = _run(q, k, v, go, cu, "auto")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 6 * inputs, f"{extra / 2**20:.0f} MiB above the inputs ({inputs / 2**20:.0f} MiB)"
    assert all(torch.isfinite(x).all() for x in out.values())


def _dense_warmup_layers(indexer_loss_coeff, weight_scale, seed):
    """({"torch": the S layer's dense warm-up on the reference, fp32; "auto": the same weights in
    bf16}, packed params, x, grad_out) on CUDA: hidden 512, 8 heads on 2 groups of 128, indexer
    4 x 32, five packed sequences (one of a single token). Call inside init_megatron()."""
    import types

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_moe_hybrid.layers.sparse_attention import SparseAttention, SparseAttentionSubmodules

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device="cuda"))
    cfg = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2,
                            kv_channels=128, use_cpu_initialization=True, params_dtype=torch.float32)  # fmt: skip
    layers = {}
    for backend in ("torch", "auto"):
        cfg.sparse_attention = types.SimpleNamespace(
            topk=64, index_n_heads=4, index_head_dim=32, index_rope_dim=16, rope_base=10000.0,
            indexer_loss_coeff=indexer_loss_coeff, stage="dense_warmup", backend=backend,
            indexer_fp8=False)  # fmt: skip
        torch.manual_seed(0)
        layers[backend] = SparseAttention(cfg, SparseAttentionSubmodules()).cuda()
        with torch.no_grad():
            for p in layers[backend].parameters():
                p.mul_(weight_scale)
    layers["auto"].bfloat16()
    lengths = [700, 1, 1200, 96, 51]
    cu = torch.tensor([0, *lengths]).cumsum(0).to("cuda", torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=1200,
                             max_seqlen_kv=1200)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), 1, 512, generator=gen).cuda()
    go = torch.randn(sum(lengths), 1, 512, generator=gen).cuda()
    return layers, packed, x, go


def test_sparse_layer_dense_warmup_runs_varlen_on_packed_cuda(monkeypatch):
    """The S layer's dense warm-up on a packed bf16 CUDA batch takes the varlen kernel (counted)
    and follows the same layer on the reference (backend "torch", fp32): output and input
    gradient within the bf16 bounds."""
    from megatron_moe_hybrid.testing import init_megatron, teardown

    init_megatron()
    try:
        layers, packed, x, go = _dense_warmup_layers(0.0, 1.0, seed=1)
        calls = []
        varlen = sa._varlen_run
        monkeypatch.setattr(sa, "_varlen_run", lambda *a: calls.append(1) or varlen(*a))
        got = {}
        for backend, dtype in (("torch", torch.float32), ("auto", torch.bfloat16)):
            xi = x.to(dtype).requires_grad_(True)
            out, _ = layers[backend](xi, packed_seq_params=packed)
            (dx,) = torch.autograd.grad(out, xi, go.to(dtype))
            got[backend] = {"o": out.float(), "dx": dx.float()}
        assert calls == [1]
        assert_rel_rms(got["auto"], got["torch"], 1e-2, 2e-2)
    finally:
        teardown()


def test_sparse_layer_dense_warmup_trains_the_indexer_fused_on_cuda(monkeypatch):
    """The S layer's dense warm-up with its indexer loss on (indexer_loss_coeff 0.5), packed bf16 on
    CUDA: auto runs the fused KL loss (triton_dense_kl, counted) and follows the same layer on the
    reference (backend "torch", fp32) in the logged loss, the output, the input gradient and the
    indexer's weight gradients (which come from the KL loss alone). The bounds are a bf16 layer's
    against an fp32 one's with weights x 4 (peaked scores): on an H100 (2026-12-07) the loss was
    within 7e-5, the output 1.0%, the input gradient 1.2%, the indexer's weight gradients
    0.3-5.9% (the key projection's the largest: every query's score gradients sum into it)."""
    from megatron_moe_hybrid.ops.sparse_attention import triton_dense_kl
    from megatron_moe_hybrid.testing import init_megatron, teardown

    init_megatron()
    try:
        # weights x 4: peaked attention and index scores, a KL far from 0
        layers, packed, x, go = _dense_warmup_layers(0.5, 4.0, seed=2)
        calls = []
        fused = triton_dense_kl.dense_indexer_kl_triton
        monkeypatch.setattr(triton_dense_kl, "dense_indexer_kl_triton", lambda *a, **k: calls.append(1) or fused(*a, **k))
        got = {}
        for backend, dtype in (("torch", torch.float32), ("auto", torch.bfloat16)):
            layer = layers[backend]
            xi = x.to(dtype).requires_grad_(True)
            out, _ = layer(xi, packed_seq_params=packed)
            names = [n for n, p in layer.named_parameters() if "index" in n]
            grads = torch.autograd.grad(out, [xi] + [dict(layer.named_parameters())[n] for n in names], go.to(dtype))
            got[backend] = {"loss": torch.as_tensor(float(layer.last_indexer_loss)), "o": out.float(),
                            "dx": grads[0].float(), **{"d" + n: g.float() for n, g in zip(names, grads[1:])}}
        assert calls == [1]
        assert got["torch"]["loss"] > 1e-2  # far from 0, so that the relative bounds mean something
        assert all(got["torch"][n].abs().max() > 0 for n in got["torch"] if n.startswith("dlinear_index"))
        torch.testing.assert_close(got["auto"].pop("loss"), got["torch"].pop("loss"), rtol=1e-3, atol=0)
        assert_rel_rms(got["auto"], got["torch"], 2e-2, 1e-1)
    finally:
        teardown()


@pytest.mark.parametrize("packed", [True, False])
def test_placed_queries_varlen_and_sdpa_match_fp32_reference(packed):
    """A context-parallel rank's queries (zigzag pieces 1 and 6 of 8 over 4096 keys) read every
    key before them: the varlen kernel's causal mask aligned to each piece's key window (one
    launch per run) and SDPA per piece (torch's lower-right causal mask) equal the fp32
    reference, packed (sequences cut inside the runs) and as a batch of 2."""
    S, H, G, D = 4096, 8, 2, 128
    runs = [(512, 1024), (3072, 3584)]
    gen = torch.Generator().manual_seed(7 + packed)
    B = 1 if packed else 2
    cu = torch.tensor([0, 700, 701, 3000, 3300, S]).cuda() if packed else None
    T = sum(b - a for a, b in runs)
    q = torch.randn(B, T, H, D, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(B, S, G, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    go = torch.randn(B, T, H, D, generator=gen).to("cuda", torch.bfloat16)

    def run(backend, dtype):
        leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
        o = sa.causal_attention(*leaves, cu_seqlens=cu, q_ranges=runs, backend=backend)
        return dict(zip(("o", "dq", "dk", "dv"), (o, *torch.autograd.grad(o, leaves, go.to(dtype)))))

    ref = run("torch", torch.float32)
    for backend in ("varlen", "sdpa", "auto"):
        got = run(backend, torch.bfloat16)
        errors = assert_rel_rms({n: x.float() for n, x in got.items()}, ref, 5e-3, 1e-2)
        print(backend, {n: f"{e:.2e}" for n, e in errors.items()})
