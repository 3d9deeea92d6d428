"""LinearAttention layer: chunk vs recurrent backends, causality, shapes, packed sequences.

Shape legend: s sequence, b micro-batch, h hidden size; inputs and outputs are [s, b, h].
"""

import types

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

from megatron_moe_hybrid.layers.linear_attention import (
    LinearAttention,
    LinearAttentionSubmodules,
)
from megatron_moe_hybrid.testing import init_megatron, teardown

HIDDEN = 64
VARIANTS = ["gated_delta_rule", "simple_gla"]


@pytest.fixture(scope="module", autouse=True)
def megatron():
    init_megatron()
    yield
    teardown()


def make_config(variant, conv_kernel_size=4, backend="auto"):
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
        use_cpu_initialization=True, params_dtype=torch.float32,
    )
    fields = dict(
        variant=variant, num_qk_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
        conv_kernel_size=conv_kernel_size, chunk_size=16, backend=backend,
    )
    cfg.linear_attention = types.SimpleNamespace(**fields)
    return cfg


def make_layer(variant, conv_kernel_size=4, backend="auto", seed=0):
    """A float64 layer with every parameter random, so no path hides behind a zero or a one."""
    torch.manual_seed(seed)
    layer = LinearAttention(
        make_config(variant, conv_kernel_size, backend), LinearAttentionSubmodules()
    ).double()
    with torch.no_grad():
        layer.out_norm.weight.uniform_(0.5, 1.5)
        if variant == "gated_delta_rule":
            layer.dt_bias.normal_()
    return layer


def forward_and_grads(layer, x, do, **kwargs):
    """Output and the gradient of <out, do> w.r.t. the input and every parameter."""
    x = x.detach().clone().requires_grad_()
    out, bias = layer(x, attention_mask=None, **kwargs)
    assert bias is None
    names, params = zip(*layer.named_parameters())
    grads = torch.autograd.grad((out * do).sum(), (x,) + params)
    return {"out": out, "dx": grads[0], **{f"d{n}": gr for n, gr in zip(names, grads[1:])}}


VARIANT_CONV = [(v, w) for v in VARIANTS for w in (4, 0)]
VARIANT_CONV_IDS = [f"{v}-W{w}" for v, w in VARIANT_CONV]


@pytest.mark.parametrize("variant,conv", VARIANT_CONV, ids=VARIANT_CONV_IDS)
@pytest.mark.parametrize("s,b", [(37, 2), (16, 1)], ids=["s37-b2", "s16-b1"])
def test_chunk_backend_matches_recurrent_backend(variant, conv, s, b):
    layer = make_layer(variant, conv)
    x = torch.randn(s, b, HIDDEN, dtype=torch.float64)
    do = torch.randn(s, b, HIDDEN, dtype=torch.float64)
    layer.backend = "torch"
    chunk = forward_and_grads(layer, x, do)
    layer.backend = "torch_recurrent"
    recurrent = forward_and_grads(layer, x, do)
    assert chunk.keys() == recurrent.keys()
    for name in chunk:
        torch.testing.assert_close(chunk[name], recurrent[name], atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize("variant,conv", VARIANT_CONV, ids=VARIANT_CONV_IDS)
@pytest.mark.parametrize("t", [0, 13, 36])
def test_causal_changing_token_t_leaves_earlier_outputs(variant, conv, t):
    layer = make_layer(variant, conv)
    x = torch.randn(37, 2, HIDDEN, dtype=torch.float64)
    x2 = x.clone()
    x2[t] += torch.randn(2, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        out, _ = layer(x)
        out2, _ = layer(x2)
    torch.testing.assert_close(out2[:t], out[:t], atol=1e-13, rtol=0)
    assert (out2[t] - out[t]).abs().min() > 0
    if t + 1 < x.shape[0]:
        assert (out2[t + 1] - out[t + 1]).abs().max() > 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_backward_and_dtype_fp32(variant):
    torch.manual_seed(0)
    layer = LinearAttention(make_config(variant), LinearAttentionSubmodules())
    x = torch.randn(21, 3, HIDDEN, requires_grad=True)
    out, bias = layer(x, attention_mask=torch.ones(1), rotary_pos_emb=None, sequence_len_offset=0)
    assert out.shape == (21, 3, HIDDEN) and out.dtype == torch.float32 and bias is None
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("variant,conv", VARIANT_CONV, ids=VARIANT_CONV_IDS)
@pytest.mark.parametrize("padded", [False, True], ids=["cu", "cu-padded"])
def test_packed_sequences_equal_separate_runs(variant, conv, padded):
    layer = make_layer(variant, conv)
    lengths = [13, 24]
    xs = [torch.randn(n, 1, HIDDEN, dtype=torch.float64) for n in lengths]
    dos = [torch.randn(n, 1, HIDDEN, dtype=torch.float64) for n in lengths]
    cu = torch.tensor([0, 13, 37], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu if padded else None, cu_seqlens_kv_padded=cu if padded else None,
        max_seqlen_q=24, max_seqlen_kv=24,
    )
    packed = forward_and_grads(layer, torch.cat(xs), torch.cat(dos), packed_seq_params=params)
    alone = [forward_and_grads(layer, x, do) for x, do in zip(xs, dos)]
    torch.testing.assert_close(packed["out"], torch.cat([a["out"] for a in alone]))
    torch.testing.assert_close(packed["dx"], torch.cat([a["dx"] for a in alone]))
    for name in packed:
        if name not in ("out", "dx"):  # parameter gradients add up over the two sequences
            torch.testing.assert_close(packed[name], alone[0][name] + alone[1][name], msg=name)


def test_packed_sequences_need_batch_one():
    layer = make_layer("gated_delta_rule")
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match="^packed_seq_params:"):
        layer(torch.randn(8, 2, HIDDEN, dtype=torch.float64), packed_seq_params=params)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(variant="mamba"), "variant"),
        (dict(num_v_heads=3), "num_v_heads"),
        (dict(conv_kernel_size=-1), "conv_kernel_size"),
    ],
    ids=["variant", "num_v_heads", "conv_kernel_size"],
)
def test_bad_config_raises_value_error_naming_field(overrides, field):
    cfg = make_config("gated_delta_rule")
    vars(cfg.linear_attention).update(overrides)
    with pytest.raises(ValueError, match=rf"^linear_attention\.{field}:"):
        LinearAttention(cfg, LinearAttentionSubmodules())


def test_unknown_backend_raises_listing_registered():
    layer = make_layer("simple_gla", backend="bogus")
    with pytest.raises(ValueError, match=r"backend: 'bogus'.*'torch'"):
        layer(torch.randn(5, 1, HIDDEN, dtype=torch.float64))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_fused_kernels_match_the_torch_path(variant, packed):
    """backend "triton" runs the fused short conv, l2norm and gated norm (Triton's interpreter
    on CPU) inside the layer, reading the projection's strided slices: output and every
    gradient equal the torch path's."""
    torch.manual_seed(3)
    layer = LinearAttention(make_config(variant), LinearAttentionSubmodules())
    with torch.no_grad():
        layer.out_norm.weight.uniform_(0.5, 1.5)
    s, b = (29, 1) if packed else (19, 2)
    x = torch.randn(s, b, HIDDEN)
    do = torch.randn(s, b, HIDDEN)
    kwargs = {}
    if packed:
        cu = torch.tensor([0, 11, 11, 29], dtype=torch.int32)
        kwargs["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    layer.backend = "torch"
    want = forward_and_grads(layer, x, do, **kwargs)
    layer.backend = "triton"
    got = forward_and_grads(layer, x, do, **kwargs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-4, rtol=2e-4, msg=name)
