"""Parity of our layers with transformers' Qwen3-Next modules on tiny random configs.

Shape legend: s sequence, b micro-batch, h hidden size; our layers take [s, b, h], HF's
take [b, s, h]. Full attention: H query heads, G kv heads, D head dim, P rotary channels.
Gated DeltaNet: Hk q/k heads, Hv v heads, K / V head dims, W conv kernel.
MoE: E experts, K experts per token, F expert ffn width.

HF's modules stay partly fp32 on fp64 inputs: Qwen3NextRMSNorm casts to fp32 (x.float()), the
rotary embedding builds cos/sin in fp32 and eager attention takes its softmax in fp32. Against
them an fp64 run is only as exact as an fp32 one (~1e-7 relative), so both share one tolerance;
the fp64 runs still check that our layer keeps fp64 end to end.
"""

import dataclasses
import types

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

from megatron_moe_hybrid.config import (
    ConfigError,
    FullAttentionConfig,
    LinearAttentionConfig,
    config_from_dict,
)
from megatron_moe_hybrid.layers.gated_attention import (
    GatedAttention,
    GatedAttentionSubmodules,
    load_hf_qwen3_next_attention,
)
from megatron_moe_hybrid.layers.linear_attention import (
    LinearAttention,
    LinearAttentionSubmodules,
    load_hf_qwen3_next_gdn,
)
from megatron_moe_hybrid.layers.moe.moe_layer import load_hf_qwen3_next_moe
from megatron_moe_hybrid.testing import assert_close_to_scale, init_megatron, teardown

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers import Qwen3NextConfig  # noqa: E402

F32, F64 = torch.float32, torch.float64
# absolute tolerance on outputs; gradients (up to ~10 in size) also get it as relative tolerance
TOL = {F32: 1e-5, F64: 1e-5}


@pytest.fixture(scope="module", autouse=True)
def megatron():
    init_megatron()
    yield
    teardown()


@dataclasses.dataclass(frozen=True)
class AttnShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_factor: float

    @property
    def id(self) -> str:
        P = int(self.head_dim * self.rotary_factor)
        return f"h{self.hidden}-H{self.heads}-G{self.kv_heads}-D{self.head_dim}-P{P}"


ATTN_SHAPES = [
    AttnShape(64, 4, 2, 16, 0.25),  # Qwen3-Next's ratios: GQA, a quarter of each head rotated
    AttnShape(48, 6, 2, 8, 0.5),  # head_dim x heads != hidden, as in Qwen3-Next (16 x 256 != 2048)
    AttnShape(32, 2, 2, 16, 1.0),  # plain MHA, full rotary
]
BT = [(2, 37), (1, 64), (3, 1)]


def hf_attention(shape: AttnShape, dtype, seed: int, rope_theta: float = 10000.0):
    """HF's Qwen3NextAttention and rotary embedding, every weight random (norm weights too)."""
    hc = Qwen3NextConfig(
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rope_theta,
            "partial_rotary_factor": shape.rotary_factor,
        },
        rms_norm_eps=1e-6,
        attention_bias=False,
    )
    hc._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = qwen3_next.Qwen3NextAttention(hc, layer_idx=3)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return attn.to(dtype), qwen3_next.Qwen3NextRotaryEmbedding(hc)


def our_attention(shape: AttnShape, dtype, rope_theta: float = 10000.0) -> GatedAttention:
    cfg = TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim,
        use_cpu_initialization=True, params_dtype=dtype, layernorm_epsilon=1e-6,
    )  # fmt: skip
    cfg.full_attention = FullAttentionConfig(partial_rotary_factor=shape.rotary_factor, rope_theta=rope_theta)
    return GatedAttention(cfg, GatedAttentionSubmodules())


def hf_forward(attn, rotary, x_bsh):
    """HF's attention over [b, s, h] with an explicit additive causal mask (eager path)."""
    b, s, _ = x_bsh.shape
    positions = torch.arange(s)[None].expand(b, s)
    cos, sin = rotary(x_bsh, positions)
    mask = torch.full((s, s), float("-inf"), dtype=x_bsh.dtype).triu(1)[None, None]
    return attn(x_bsh, (cos, sin), mask)[0]


# our parameter -> HF's, for comparing every weight gradient
OUR_TO_HF = {
    "linear_q.weight": "q_proj.weight",
    "linear_k.weight": "k_proj.weight",
    "linear_v.weight": "v_proj.weight",
    "linear_proj.weight": "o_proj.weight",
    "q_norm.weight": "q_norm.weight",
    "k_norm.weight": "k_norm.weight",
}


@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("b,s", BT, ids=[f"B{b}-T{s}" for b, s in BT])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=[a.id for a in ATTN_SHAPES])
def test_gated_attention_matches_hf(shape, b, s, dtype):
    hf, rotary = hf_attention(shape, dtype, seed=s * 10 + b)
    ours = our_attention(shape, dtype)
    load_hf_qwen3_next_attention(ours, hf.state_dict())
    x = torch.randn(b, s, shape.hidden, dtype=dtype)
    dy = torch.randn(b, s, shape.hidden, dtype=dtype)

    x_hf = x.clone().requires_grad_()
    y_hf = hf_forward(hf, rotary, x_hf)
    hf_params = dict(hf.named_parameters())
    grads_hf = torch.autograd.grad((y_hf * dy).sum(), [x_hf] + [hf_params[OUR_TO_HF[n]] for n in OUR_TO_HF])

    x_ours = x.transpose(0, 1).clone().requires_grad_()  # [s, b, h]
    y_ours, bias = ours(x_ours, attention_mask=None)
    assert bias is None
    our_params = dict(ours.named_parameters())
    assert sorted(our_params) == sorted(OUR_TO_HF)
    grads_ours = torch.autograd.grad(
        (y_ours * dy.transpose(0, 1)).sum(), [x_ours] + [our_params[n] for n in OUR_TO_HF]
    )

    tol = TOL[dtype]
    torch.testing.assert_close(y_ours.transpose(0, 1), y_hf, atol=tol, rtol=0)
    torch.testing.assert_close(grads_ours[0].transpose(0, 1), grads_hf[0], atol=tol, rtol=tol)
    for name, g_ours, g_hf in zip(OUR_TO_HF, grads_ours[1:], grads_hf[1:]):
        assert_close_to_scale(g_ours, g_hf, tol, f"d{name}")


def test_gated_attention_rope_theta_is_used():
    """A large theta (Qwen3-Next uses 1e7) must reach the rotary: parity at theta=1e7, and the
    output differs from theta=1e4, so the parity above is not blind to it."""
    shape = ATTN_SHAPES[0]
    hf, rotary = hf_attention(shape, F64, seed=1, rope_theta=1e7)
    ours = our_attention(shape, F64, rope_theta=1e7)
    load_hf_qwen3_next_attention(ours, hf.state_dict())
    other = our_attention(shape, F64, rope_theta=1e4)
    load_hf_qwen3_next_attention(other, hf.state_dict())
    x = torch.randn(2, 29, shape.hidden, dtype=F64)
    with torch.no_grad():
        y = ours(x.transpose(0, 1))[0].transpose(0, 1)
        torch.testing.assert_close(y, hf_forward(hf, rotary, x), atol=TOL[F64], rtol=0)
        assert (other(x.transpose(0, 1))[0].transpose(0, 1) - y).abs().max() > 1e-3


def test_gated_attention_packed_sequences_match_separate_hf_runs():
    """Packed [s, 1, h] with cu_seqlens: each sequence equals HF run on it alone (positions
    restart, no attention across boundaries); includes an empty and a one-token sequence."""
    shape = ATTN_SHAPES[0]
    hf, rotary = hf_attention(shape, F64, seed=2)
    ours = our_attention(shape, F64)
    load_hf_qwen3_next_attention(ours, hf.state_dict())
    lengths = [13, 0, 1, 22]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = torch.randn(sum(lengths), 1, shape.hidden, dtype=F64)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with torch.no_grad():
        y = ours(x, packed_seq_params=params)[0]  # [s, 1, h]
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if end > start:
                ref = hf_forward(hf, rotary, x[start:end].transpose(0, 1))  # [1, len, h]
                torch.testing.assert_close(y[start:end].transpose(0, 1), ref, atol=TOL[F64], rtol=0)


def test_load_hf_attention_rejects_bias_and_bad_shapes():
    shape = ATTN_SHAPES[0]
    hf, _ = hf_attention(shape, F32, seed=3)
    ours = our_attention(shape, F32)
    sd = dict(hf.state_dict())
    with pytest.raises(ValueError, match=r"hf_state_dict: unexpected keys \['q_proj.bias'\]"):
        load_hf_qwen3_next_attention(ours, {**sd, "q_proj.bias": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"hf_state_dict\['k_proj.weight'\]: shape"):
        load_hf_qwen3_next_attention(ours, {**sd, "k_proj.weight": torch.zeros(8, shape.hidden)})
    with pytest.raises(ValueError, match="missing 'v_proj.weight'"):
        load_hf_qwen3_next_attention(ours, {k: v for k, v in sd.items() if k != "v_proj.weight"})
    prefixed = {f"model.layers.3.self_attn.{k}": v for k, v in sd.items()}
    load_hf_qwen3_next_attention(ours, prefixed, prefix="model.layers.3.self_attn.")
    torch.testing.assert_close(ours.linear_q.weight, sd["q_proj.weight"], atol=0, rtol=0)


def test_gated_attention_rejects_odd_rotary_width():
    shape = AttnShape(64, 4, 2, 12, 0.25)  # 12 x 0.25 = 3 channels
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        our_attention(shape, F32)


def _tiny_raw(pattern: str, num_layers: int) -> dict:
    return {
        "model": {
            "pattern": pattern, "num_layers": num_layers, "hidden_size": 64, "num_attention_heads": 4,
            "num_query_groups": 2, "kv_channels": 16, "vocab_size": 128,
        },
        "linear_attention": {"num_qk_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 16, "chunk_size": 16},
        "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 32},
        "parallel": {"world_size": 1},
        "training": {"micro_batch_size": 1, "global_batch_size": 1},
    }  # fmt: skip


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"full_attention.partial_rotary_factor": 0.0}, "full_attention.partial_rotary_factor"),
        ({"full_attention.partial_rotary_factor": 1.5}, "full_attention.partial_rotary_factor"),
        ({"full_attention.rope_theta": -1.0}, "full_attention.rope_theta"),
        ({"model.kv_channels": 12}, "full_attention.partial_rotary_factor"),  # 3 rotary channels
    ],
    ids=["factor-zero", "factor-above-one", "theta-negative", "odd-rotary-width"],
)
def test_config_validates_full_attention(overrides, field):
    with pytest.raises(ConfigError) as e:
        config_from_dict(_tiny_raw("LLLA", 4), overrides)
    assert e.value.field == field


def test_model_with_gated_attention_layers_trains_on_cpu():
    """Pattern "LA" builds through the Megatron specs (TransformerLayer's call signature) and
    every parameter of the A layers gets a finite, non-zero gradient."""
    from megatron_moe_hybrid.models import build_model

    config = config_from_dict(_tiny_raw("LA", 2), {"full_attention.rope_theta": 1e6})
    torch.manual_seed(0)
    model = build_model(config)
    attn_layers = [l.self_attention for l in model.decoder.layers if isinstance(l.self_attention, GatedAttention)]
    assert len(attn_layers) == 1 and attn_layers[0].rope_theta == 1e6
    tokens = torch.randint(0, 128, (2, 19))
    positions = torch.arange(19)[None].expand(2, 19)
    out = model(tokens, positions, attention_mask=None)
    out.float().square().mean().backward()
    for name, p in attn_layers[0].named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@dataclasses.dataclass(frozen=True)
class GdnShape:
    hidden: int
    qk_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int

    @property
    def id(self) -> str:
        return f"h{self.hidden}-Hk{self.qk_heads}-Hv{self.v_heads}-K{self.k_dim}-V{self.v_dim}-W{self.conv}"


GDN_SHAPES = [
    GdnShape(64, 2, 4, 16, 8, 4),  # Qwen3-Next's 1 : 2 q/k : v heads, K != V to catch mix-ups
    GdnShape(48, 3, 3, 8, 16, 3),
]
GDN_BT = [(2, 37), (1, 70), (2, 1)]
# HF's chunked delta rule runs in fp32 (fp64 inputs too) with its own chunking (64 vs our 16)
GDN_TOL = 1e-4
# our parameter -> HF's
GDN_OUR_TO_HF = {
    "in_proj.weight": None,  # regrouped rows: compared through the input gradient only
    "conv1d.weight": "conv1d.weight",
    "A_log": "A_log",
    "dt_bias": "dt_bias",
    "out_norm.weight": "norm.weight",
    "out_proj.weight": "out_proj.weight",
}


def hf_gdn(shape: GdnShape, dtype, seed: int):
    hc = Qwen3NextConfig(
        hidden_size=shape.hidden,
        linear_num_key_heads=shape.qk_heads,
        linear_num_value_heads=shape.v_heads,
        linear_key_head_dim=shape.k_dim,
        linear_value_head_dim=shape.v_dim,
        linear_conv_kernel_dim=shape.conv,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    gdn = qwen3_next.Qwen3NextGatedDeltaNet(hc, layer_idx=0)
    with torch.no_grad():
        for name, p in gdn.named_parameters():
            if name == "A_log":  # decays exp(-A softplus(.)) spread over (0, 1)
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())
            elif name in ("dt_bias", "norm.weight"):
                p.normal_(1.0, 0.5)
            else:
                p.normal_(0.0, 0.3)
    return gdn.to(dtype)


def our_gdn(shape: GdnShape, dtype) -> LinearAttention:
    cfg = TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=4,
        use_cpu_initialization=True, params_dtype=dtype, layernorm_epsilon=1e-6,
    )  # fmt: skip
    cfg.linear_attention = LinearAttentionConfig(
        variant="gated_delta_rule", num_qk_heads=shape.qk_heads, num_v_heads=shape.v_heads,
        head_k_dim=shape.k_dim, head_v_dim=shape.v_dim, conv_kernel_size=shape.conv, chunk_size=16,
    )  # fmt: skip
    return LinearAttention(cfg, LinearAttentionSubmodules())


@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("b,s", GDN_BT, ids=[f"B{b}-T{s}" for b, s in GDN_BT])
@pytest.mark.parametrize("shape", GDN_SHAPES, ids=[g.id for g in GDN_SHAPES])
def test_gated_deltanet_matches_hf(shape, b, s, dtype):
    """Our chunked Gated DeltaNet (chunk 16) against HF's torch fallback (chunk 64, in fp32 even
    for fp64 inputs, hence one tolerance), forward and the gradients of the input and of every
    parameter HF stores in the same layout."""
    hf = hf_gdn(shape, dtype, seed=s * 10 + b)
    ours = our_gdn(shape, dtype)
    load_hf_qwen3_next_gdn(ours, hf.state_dict())
    x = torch.randn(b, s, shape.hidden, dtype=dtype)
    dy = torch.randn(b, s, shape.hidden, dtype=dtype)
    compared = [n for n, hf_name in GDN_OUR_TO_HF.items() if hf_name is not None]

    x_hf = x.clone().requires_grad_()
    y_hf = hf(x_hf)
    hf_params = dict(hf.named_parameters())
    grads_hf = torch.autograd.grad(
        (y_hf * dy).sum(), [x_hf] + [hf_params[GDN_OUR_TO_HF[n]] for n in compared]
    )

    x_ours = x.transpose(0, 1).clone().requires_grad_()  # [s, b, h]
    y_ours, bias = ours(x_ours, attention_mask=None)
    assert bias is None
    our_params = dict(ours.named_parameters())
    assert sorted(our_params) == sorted(GDN_OUR_TO_HF)
    grads_ours = torch.autograd.grad(
        (y_ours * dy.transpose(0, 1)).sum(), [x_ours] + [our_params[n] for n in compared]
    )

    tol = GDN_TOL
    torch.testing.assert_close(y_ours.transpose(0, 1), y_hf, atol=tol, rtol=0)
    torch.testing.assert_close(grads_ours[0].transpose(0, 1), grads_hf[0], atol=tol, rtol=tol)
    for name, g_ours, g_hf in zip(compared, grads_ours[1:], grads_hf[1:]):
        assert_close_to_scale(g_ours, g_hf, tol, f"d{name}")


def test_load_hf_gdn_rejects_wrong_layouts():
    shape = GDN_SHAPES[0]
    hf = hf_gdn(shape, F32, seed=4)
    sd = dict(hf.state_dict())
    ours = our_gdn(shape, F32)
    with pytest.raises(ValueError, match=r"hf_state_dict\['in_proj_ba.weight'\]: shape"):
        load_hf_qwen3_next_gdn(ours, {**sd, "in_proj_ba.weight": torch.zeros(4, shape.hidden)})
    with pytest.raises(ValueError, match=r"unexpected keys \['conv1d.bias'\]"):
        load_hf_qwen3_next_gdn(ours, {**sd, "conv1d.bias": torch.zeros(1)})
    wrong_heads = our_gdn(dataclasses.replace(shape, qk_heads=4), F32)
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        load_hf_qwen3_next_gdn(wrong_heads, sd)


MOE_CASES = [(8, 2, True), (6, 3, False)]  # num_experts, topk, norm_topk_prob
MOE_BT = [(2, 13), (1, 1), (3, 7)]


@pytest.mark.parametrize("dispatcher", ["alltoall", "static"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("b,s", MOE_BT, ids=[f"B{b}-T{s}" for b, s in MOE_BT])
@pytest.mark.parametrize(
    "num_experts,topk,norm", MOE_CASES, ids=[f"E{e}-K{k}-norm{int(n)}" for e, k, n in MOE_CASES]
)
def test_moe_block_matches_hf(num_experts, topk, norm, b, s, dtype, dispatcher):
    from megatron_moe_hybrid.config import MoEConfig
    from megatron_moe_hybrid.layers.moe import MoELayer

    hidden, ffn, shared_ffn = 32, 24, 40
    hc = Qwen3NextConfig(
        hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=topk, norm_topk_prob=norm,
        moe_intermediate_size=ffn, shared_expert_intermediate_size=shared_ffn,
    )  # fmt: skip
    torch.manual_seed(s * 10 + b)
    hf = qwen3_next.Qwen3NextSparseMoeBlock(hc)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf = hf.to(dtype)

    cfg = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True, params_dtype=dtype
    )
    cfg.moe = MoEConfig(
        num_experts=num_experts, topk=topk, ffn_hidden_size=ffn, shared_expert_ffn_hidden_size=shared_ffn,
        shared_expert_gate=True, score_func="softmax", norm_topk_prob=norm, aux_loss_coeff=0.0,
        dispatcher=dispatcher, dispatch_capacity_factor=None,
    )  # fmt: skip
    ours = MoELayer(cfg)
    load_hf_qwen3_next_moe(ours, hf.state_dict())

    x = torch.randn(b, s, hidden, dtype=dtype)
    dy = torch.randn(b, s, hidden, dtype=dtype)
    x_hf = x.clone().requires_grad_()
    y_hf = hf(x_hf)
    hf_names = ["gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj.weight",
                "shared_expert.up_proj.weight", "shared_expert.down_proj.weight", "shared_expert_gate.weight"]  # fmt: skip
    hf_params = dict(hf.named_parameters())
    g_hf = dict(zip(["x"] + hf_names, torch.autograd.grad((y_hf * dy).sum(), [x_hf] + [hf_params[n] for n in hf_names])))

    x_ours = x.transpose(0, 1).clone().requires_grad_()  # [s, b, h]
    y_ours, bias = ours(x_ours)
    assert bias is None
    our_names = ["router.weight", "experts.weight1", "experts.weight2", "shared_experts.linear_fc1.weight",
                 "shared_experts.linear_fc2.weight", "shared_experts.gate_weight"]  # fmt: skip
    our_params = dict(ours.named_parameters())
    assert sorted(our_params) == sorted(our_names)
    g = dict(zip(["x"] + our_names, torch.autograd.grad(
        (y_ours * dy.transpose(0, 1)).sum(), [x_ours] + [our_params[n] for n in our_names]
    )))  # fmt: skip

    tol = TOL[dtype]
    torch.testing.assert_close(y_ours.transpose(0, 1), y_hf, atol=tol, rtol=0)
    torch.testing.assert_close(g["x"].transpose(0, 1), g_hf["x"], atol=tol, rtol=tol)
    expected = {
        "router.weight": g_hf["gate.weight"],
        "experts.weight1": g_hf["experts.gate_up_proj"].transpose(1, 2),
        "experts.weight2": g_hf["experts.down_proj"].transpose(1, 2),
        "shared_experts.linear_fc1.weight": torch.cat(
            [g_hf["shared_expert.gate_proj.weight"], g_hf["shared_expert.up_proj.weight"]]
        ),
        "shared_experts.linear_fc2.weight": g_hf["shared_expert.down_proj.weight"],
        "shared_experts.gate_weight": g_hf["shared_expert_gate.weight"],
    }
    for name in our_names:
        assert_close_to_scale(g[name], expected[name], tol, f"d{name}")


def test_shared_expert_gate_off_keeps_the_ungated_shared_expert():
    from megatron_moe_hybrid.layers.moe.moe_layer import SharedExpertMLP

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True)
    cfg.moe = types.SimpleNamespace()  # configs predating the field: no gate
    mlp = SharedExpertMLP(cfg, 8)
    assert mlp.gate_weight is None and sorted(n for n, _ in mlp.named_parameters()) == [
        "linear_fc1.weight", "linear_fc2.weight"
    ]
    x = torch.randn(5, 16)
    gate, up = (x @ mlp.linear_fc1.weight.T).chunk(2, dim=-1)
    torch.testing.assert_close(mlp(x), (torch.nn.functional.silu(gate) * up) @ mlp.linear_fc2.weight.T)


def test_config_rejects_shared_expert_gate_without_shared_expert():
    with pytest.raises(ConfigError) as e:
        config_from_dict(_tiny_raw("L", 1), {"moe.shared_expert_gate": True})
    assert e.value.field == "moe.shared_expert_gate"
