"""Parity of our MLAttention (pattern letter "M") with transformers' DeepseekV32Attention.

Shape legend: s sequence, b micro-batch, h hidden size; our layer takes [s, b, h], HF's
[b, s, h]. H heads, Q / C q / kv latent ranks, N / R / V no-rope / rope / value head dims,
HI / DI indexer heads / head dim, K top-k.

HF's indexer runs under torch.no_grad and returns top-k indices, so the selection carries no
gradient in either implementation; with a fixed selection every other gradient is comparable,
and the tests check that both sides select the same keys before comparing (top-k < T included).
HF keeps parts in fp32 on fp64 inputs (RMSNorm, rotary tables, indexer scores, softmax), so an
fp64 run is only as exact as an fp32 one and both share one tolerance.
"""

import dataclasses
from typing import Optional

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

from megatron_moe_hybrid.config import (
    ConfigError,
    MLAConfig,
    SparseAttentionConfig,
    config_from_dict,
)
from megatron_moe_hybrid.layers.mla_attention import (
    MLAttention,
    MLAttentionSubmodules,
    load_hf_deepseek_v32_attention,
)
from megatron_moe_hybrid.testing import assert_close_to_scale, init_megatron, teardown

v32 = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
from transformers import DeepseekV3Config, DeepseekV32Config

F32, F64 = torch.float32, torch.float64
TOL = 1e-4  # outputs absolute; input gradients also relative; weight gradients scaled, below


@pytest.fixture(scope="module", autouse=True)
def megatron():
    init_megatron()
    yield
    teardown()


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    q_lora: Optional[int]
    kv_lora: int
    nope: int
    rope: int
    v: int
    index_heads: int
    index_dim: int
    theta: float = 10000.0
    yarn: tuple = ()  # (factor, mscale, mscale_all_dim, original_max_position_embeddings)

    @property
    def id(self) -> str:
        yarn = "-yarn" + "_".join(f"{x:g}" for x in self.yarn) if self.yarn else ""
        return (
            f"h{self.hidden}-H{self.heads}-Q{self.q_lora}-C{self.kv_lora}-N{self.nope}-R{self.rope}-V{self.v}"
            f"-HI{self.index_heads}-DI{self.index_dim}-theta{self.theta:g}{yarn}"
        )

    def hf_rope(self) -> dict:
        if not self.yarn:
            return {"rope_type": "default", "rope_theta": self.theta}
        factor, mscale, mscale_all_dim, original = self.yarn
        return {"rope_type": "yarn", "rope_theta": self.theta, "factor": factor, "mscale": mscale,
                "mscale_all_dim": mscale_all_dim, "original_max_position_embeddings": original,
                "beta_fast": 32, "beta_slow": 1}  # fmt: skip

    def our_rope(self) -> dict:
        if not self.yarn:
            return {"rope_theta": self.theta}
        factor, mscale, mscale_all_dim, original = self.yarn
        return {"rope_theta": self.theta, "rope_type": "yarn", "rope_factor": factor, "rope_mscale": mscale,
                "rope_mscale_all_dim": mscale_all_dim, "rope_original_max_position_embeddings": original}  # fmt: skip


SHAPES = [
    Shape(64, 4, 16, 16, 8, 8, 16, 4, 16),
    Shape(48, 3, 24, 8, 16, 4, 8, 2, 8, theta=5e5),  # H x (N + R) != hidden, V != N + R
    # DeepSeek-V3.2's yarn (factor 40), with mscale != mscale_all_dim so that both the cos/sin
    # factor and the softmax factor differ from 1, and a short original length so the ramp
    # crosses the 8 rope channels (kept, ramped and divided frequencies all occur)
    Shape(64, 4, 16, 16, 8, 8, 16, 4, 16, yarn=(40.0, 1.0, 0.8, 64)),
]
BT = [(2, 37), (1, 13), (2, 1)]
TOPK = {"dense": 64, "sparse": 5}  # dense: top-k >= T, every causal key kept


def hf_config(shape: Shape, topk: int, cls=DeepseekV32Config, **extra):
    hc = cls(
        hidden_size=shape.hidden, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        q_lora_rank=shape.q_lora, kv_lora_rank=shape.kv_lora, qk_nope_head_dim=shape.nope,
        qk_rope_head_dim=shape.rope, v_head_dim=shape.v, attention_bias=False,
        rope_parameters=shape.hf_rope(), **extra,
    )  # fmt: skip
    if cls is DeepseekV32Config:
        hc.index_topk, hc.index_n_heads, hc.index_head_dim = topk, shape.index_heads, shape.index_dim
    hc._attn_implementation = "eager"
    return hc


def perturb(module: torch.nn.Module) -> None:
    """HF initialises norms to 1 / 0; every weight random so a swapped one shows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)


def hf_attention(shape: Shape, topk: int, dtype, seed: int):
    hc = hf_config(shape, topk)
    torch.manual_seed(seed)
    attn = v32.DeepseekV32Attention(hc, layer_idx=0)
    perturb(attn)
    return attn.to(dtype), v32.DeepseekV32RotaryEmbedding(hc)


def our_attention(shape: Shape, topk: int, dtype) -> MLAttention:
    cfg = TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        use_cpu_initialization=True, params_dtype=dtype,
    )  # fmt: skip
    cfg.mla = MLAConfig(
        q_lora_rank=shape.q_lora, kv_lora_rank=shape.kv_lora, qk_nope_head_dim=shape.nope,
        qk_rope_head_dim=shape.rope, v_head_dim=shape.v, **shape.our_rope(),
        absorbed=False,  # the HF form, step for step (test_mla_absorbed.py ties the absorbed one to it)
    )  # fmt: skip
    cfg.sparse_attention = SparseAttentionConfig(
        topk=topk, index_n_heads=shape.index_heads, index_head_dim=shape.index_dim
    )
    return MLAttention(cfg, MLAttentionSubmodules())


def hf_forward(attn, rotary, x_bsh, **kwargs):
    """HF's attention on [b, s, h] with the additive causal mask DeepseekV32Model passes to eager
    attention: 0 on readable keys, the dtype's minimum elsewhere, [b, 1, s, s]."""
    b, s, _ = x_bsh.shape
    positions = torch.arange(s)[None].expand(b, s)
    cos, sin = rotary(x_bsh, positions)
    mask = torch.full((s, s), torch.finfo(x_bsh.dtype).min, dtype=x_bsh.dtype).triu(1)
    return attn(x_bsh, (cos, sin), mask.expand(b, 1, s, s), position_ids=positions, **kwargs)[0]


def hf_selection(attn, rotary, x_bsh) -> list[list[set]]:
    """HF indexer's picks per (batch, query), restricted to causal keys."""
    b, s, _ = x_bsh.shape
    positions = torch.arange(s)[None].expand(b, s)
    cos, sin = rotary(x_bsh, positions)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x_bsh))
    mask = torch.full((s, s), torch.finfo(x_bsh.dtype).min, dtype=x_bsh.dtype).triu(1).expand(b, s, s)
    idx = attn.indexer(x_bsh, q_resid, (cos, sin), mask, positions)
    return [[{j for j in idx[i, t].tolist() if j <= t} for t in range(s)] for i in range(b)]


def our_selection(ours: MLAttention, x_bsh) -> list[list[set]]:
    from megatron_moe_hybrid.layers.mla_attention import (
        _positions_and_mask,
        rope_cos_sin,
    )

    b, s, _ = x_bsh.shape
    positions, readable = _positions_and_mask(None, s, b, x_bsh.device)
    inv_freq = next(iter(ours._inv_freq.values()))
    cos, sin = rope_cos_sin(positions, inv_freq, x_bsh.dtype, ours.rope_attention_factor)
    q_latent = ours.q_layernorm(ours.linear_q_down_proj(x_bsh)[0])
    idx = ours.index_topk(ours.index_scores(x_bsh, q_latent, cos, sin), readable)
    return [[set(idx[i, t].tolist()) - {-1} for t in range(s)] for i in range(b)]


# our parameter -> HF's; the indexer's are compared separately (neither side gives them a gradient)
OUR_TO_HF = {
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
}
INDEXER = ["linear_index_q.weight", "linear_index_k.weight", "index_k_norm.weight", "index_k_norm.bias", "linear_index_weights.weight"]  # fmt: skip


@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mode", list(TOPK))
@pytest.mark.parametrize("b,s", BT, ids=[f"B{b}-T{s}" for b, s in BT])
@pytest.mark.parametrize("shape", SHAPES, ids=[x.id for x in SHAPES])
def test_mla_matches_hf(shape, b, s, mode, dtype):
    """Forward, the input gradient and every trainable weight's gradient against HF, with the
    same keys selected per query; top-k < T must really drop keys."""
    topk = TOPK[mode]
    hf, rotary = hf_attention(shape, topk, dtype, seed=s * 10 + b)
    ours = our_attention(shape, topk, dtype)
    load_hf_deepseek_v32_attention(ours, hf.state_dict())
    x = torch.randn(b, s, shape.hidden, dtype=dtype)
    dy = torch.randn(b, s, shape.hidden, dtype=dtype)

    with torch.no_grad():
        picked = our_selection(ours, x)
        assert picked == hf_selection(hf, rotary, x)
    # query t reads min(t + 1, K) keys: top-k < T must drop some causal keys
    assert [sum(map(len, rows)) for rows in picked] == [sum(min(t + 1, topk) for t in range(s))] * b

    x_hf = x.clone().requires_grad_()
    y_hf = hf_forward(hf, rotary, x_hf)
    hf_params = dict(hf.named_parameters())
    grads_hf = torch.autograd.grad((y_hf * dy).sum(), [x_hf] + [hf_params[OUR_TO_HF[n]] for n in OUR_TO_HF])

    x_ours = x.transpose(0, 1).clone().requires_grad_()  # [s, b, h]
    y_ours, bias = ours(x_ours, attention_mask=None)
    assert bias is None
    our_params = dict(ours.named_parameters())
    assert sorted(our_params) == sorted(list(OUR_TO_HF) + INDEXER)
    grads_ours = torch.autograd.grad(
        (y_ours * dy.transpose(0, 1)).sum(),
        [x_ours] + [our_params[n] for n in OUR_TO_HF] + [our_params[n] for n in INDEXER],
        allow_unused=True,
    )

    torch.testing.assert_close(y_ours.transpose(0, 1), y_hf, atol=TOL, rtol=0)
    torch.testing.assert_close(grads_ours[0].transpose(0, 1), grads_hf[0], atol=TOL, rtol=TOL)
    for name, g_ours, g_hf in zip(OUR_TO_HF, grads_ours[1:], grads_hf[1:]):
        assert_close_to_scale(g_ours, g_hf, TOL, f"d{name}")
    assert all(g is None for g in grads_ours[1 + len(OUR_TO_HF) :])


V3_BT = [(2, 29), (1, 1)]


@pytest.mark.parametrize("b,s", V3_BT, ids=[f"B{b}-T{s}" for b, s in V3_BT])
@pytest.mark.parametrize("q_lora", [16, None], ids=["Q16", "QNone"])
def test_mla_with_topk_at_least_T_is_dense_deepseek_v3(q_lora, b, s):
    """top-k >= T reduces to dense causal MLA: equal to HF's DeepseekV3Attention (interleaved
    RoPE), which also covers q_lora_rank None (a plain q_proj), unsupported by HF's V3.2."""
    shape = dataclasses.replace(SHAPES[0], q_lora=q_lora)
    hc = hf_config(shape, s, cls=DeepseekV3Config, rope_interleave=True)
    torch.manual_seed(s + b)
    hf = v3.DeepseekV3Attention(hc, layer_idx=0)
    perturb(hf)
    rotary = v3.DeepseekV3RotaryEmbedding(hc)
    ours = our_attention(shape, s, F32)
    ours_indexer = {f"indexer.{k}": v for k, v in _indexer_state(ours).items()}
    load_hf_deepseek_v32_attention(ours, {**hf.state_dict(), **ours_indexer})

    x = torch.randn(b, s, shape.hidden)
    dy = torch.randn(b, s, shape.hidden)
    x_hf = x.clone().requires_grad_()
    y_hf = hf_forward(hf, rotary, x_hf)
    (g_hf,) = torch.autograd.grad((y_hf * dy).sum(), x_hf)
    x_ours = x.transpose(0, 1).clone().requires_grad_()
    y_ours = ours(x_ours)[0]
    (g_ours,) = torch.autograd.grad((y_ours * dy.transpose(0, 1)).sum(), x_ours)
    torch.testing.assert_close(y_ours.transpose(0, 1), y_hf, atol=TOL, rtol=0)
    torch.testing.assert_close(g_ours.transpose(0, 1), g_hf, atol=TOL, rtol=TOL)


def _indexer_state(ours: MLAttention) -> dict:
    return {
        "wq_b.weight": ours.linear_index_q.weight.detach().clone(),
        "wk.weight": ours.linear_index_k.weight.detach().clone(),
        "k_norm.weight": ours.index_k_norm.weight.detach().clone(),
        "k_norm.bias": ours.index_k_norm.bias.detach().clone(),
        "weights_proj.weight": ours.linear_index_weights.weight.detach().clone(),
    }


def test_mla_packed_sequences_match_separate_hf_runs():
    """Packed [s, 1, h] with cu_seqlens and a sparse top-k: each sequence equals HF on it alone
    (positions restart, no key of another sequence is scored or read); an empty and a
    one-token sequence included."""
    shape = SHAPES[0]
    hf, rotary = hf_attention(shape, 4, F32, seed=2)
    ours = our_attention(shape, 4, F32)
    load_hf_deepseek_v32_attention(ours, hf.state_dict())
    lengths = [13, 0, 1, 22]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = torch.randn(sum(lengths), 1, shape.hidden)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with torch.no_grad():
        y = ours(x, packed_seq_params=params)[0]  # [s, 1, h]
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if end > start:
                ref = hf_forward(hf, rotary, x[start:end].transpose(0, 1))  # [1, len, h]
                torch.testing.assert_close(y[start:end].transpose(0, 1), ref, atol=TOL, rtol=0)


def test_load_hf_mla_rejects_bias_missing_and_bad_shapes():
    shape = SHAPES[0]
    hf, _ = hf_attention(shape, 4, F32, seed=3)
    ours = our_attention(shape, 4, F32)
    sd = dict(hf.state_dict())
    with pytest.raises(ValueError, match=r"hf_state_dict: unexpected keys \['o_proj.bias'\]"):
        load_hf_deepseek_v32_attention(ours, {**sd, "o_proj.bias": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"hf_state_dict\['kv_b_proj.weight'\]: shape"):
        load_hf_deepseek_v32_attention(ours, {**sd, "kv_b_proj.weight": torch.zeros(8, shape.kv_lora)})
    with pytest.raises(ValueError, match=r"missing \['indexer.wk.weight'\]"):
        load_hf_deepseek_v32_attention(ours, {k: v for k, v in sd.items() if k != "indexer.wk.weight"})
    prefixed = {f"model.layers.3.self_attn.{k}": v for k, v in sd.items()}
    load_hf_deepseek_v32_attention(ours, prefixed, prefix="model.layers.3.self_attn.")
    torch.testing.assert_close(ours.linear_kv_up_proj.weight, sd["kv_b_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(ours.index_k_norm.bias, sd["indexer.k_norm.bias"], atol=0, rtol=0)


def _tiny_raw(pattern: str, num_layers: int) -> dict:
    return {
        "model": {"pattern": pattern, "num_layers": num_layers, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128},
        "linear_attention": {"num_qk_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 16, "chunk_size": 16},
        "sparse_attention": {"topk": 6, "index_n_heads": 4, "index_head_dim": 16, "index_rope_dim": 8},
        "mla": {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16},
        "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 32},
        "parallel": {"world_size": 1},
        "training": {"micro_batch_size": 1, "global_batch_size": 1},
    }  # fmt: skip


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"mla.q_lora_rank": 0}, "mla.q_lora_rank"),
        ({"mla.kv_lora_rank": 0}, "mla.kv_lora_rank"),
        ({"mla.qk_rope_head_dim": 7}, "mla.qk_rope_head_dim"),
        ({"mla.qk_rope_head_dim": 32}, "mla.qk_rope_head_dim"),  # wider than index_head_dim 16
        ({"mla.rope_theta": -1.0}, "mla.rope_theta"),
        ({"mla.rope_type": "longrope"}, "mla.rope_type"),
        ({"mla.rope_type": "yarn", "mla.rope_factor": 0.0}, "mla.rope_factor"),
        ({"mla.rope_type": "yarn", "mla.rope_mscale_all_dim": -1.0}, "mla.rope_mscale_all_dim"),
    ],
    ids=["q-rank-zero", "kv-rank-zero", "rope-odd", "rope-wider-than-indexer", "theta-negative", "rope-type",
         "yarn-factor", "yarn-mscale"],
)
def test_config_validates_mla(overrides, field):
    with pytest.raises(ConfigError) as e:
        config_from_dict(_tiny_raw("LLLM", 4), overrides)
    assert e.value.field == field


@pytest.mark.parametrize("absorbed", [False, True], ids=["hf_form", "absorbed"])
def test_model_with_mla_layers_trains_on_cpu(absorbed):
    """Pattern "LLLM" builds through the Megatron specs; every trainable weight of the M layer
    gets a finite, non-zero gradient and the indexer (trained by its own loss) gets none (in
    both forms: mla.absorbed)."""
    from megatron_moe_hybrid.models import build_model

    config = config_from_dict(_tiny_raw("LLLM", 4), {"mla.rope_theta": 1e6, "mla.absorbed": absorbed})
    torch.manual_seed(0)
    model = build_model(config)
    mla_layers = [l.self_attention for l in model.decoder.layers if isinstance(l.self_attention, MLAttention)]
    assert len(mla_layers) == 1 and mla_layers[0].rope_theta == 1e6 and mla_layers[0].topk == 6
    assert mla_layers[0].absorbed is absorbed
    tokens = torch.randint(0, 128, (2, 19))
    positions = torch.arange(19)[None].expand(2, 19)
    out = model(tokens, positions, attention_mask=None)
    out.float().square().mean().backward()
    indexer = {id(p) for p in mla_layers[0].indexer_parameters()}
    for name, p in mla_layers[0].named_parameters():
        if id(p) in indexer:
            assert p.grad is None, name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_mla_indexer_loss_trains_only_the_indexer():
    """sparse_attention.indexer_loss_coeff > 0: the indexer gets gradients, and the output, the
    input gradient and every other weight's gradient stay bitwise those of coeff = 0."""
    shape, (b, s) = SHAPES[0], (2, 23)
    hf, _ = hf_attention(shape, TOPK["sparse"], F64, seed=5)
    ours = our_attention(shape, TOPK["sparse"], F64)
    load_hf_deepseek_v32_attention(ours, hf.state_dict())
    x = torch.randn(s, b, shape.hidden, dtype=F64)
    dy = torch.randn(s, b, shape.hidden, dtype=F64)
    runs = {}
    for coeff in (0.0, 0.5):
        ours.indexer_loss_coeff = coeff
        ours.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y, _ = ours(xi, attention_mask=None)
        (y * dy).sum().backward()
        runs[coeff] = (y.detach(), xi.grad, {n: p.grad for n, p in ours.named_parameters()})
    (y0, gx0, g0), (y1, gx1, g1) = runs[0.0], runs[0.5]
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    for name in OUR_TO_HF:
        assert torch.equal(g0[name], g1[name]), name
    for name in INDEXER:
        assert g0[name] is None, name
        assert g1[name] is not None and torch.isfinite(g1[name]).all() and g1[name].abs().sum() > 0, name
    assert ours.last_indexer_loss > 0


def test_mla_indexer_loss_is_kl_to_hf_attention():
    """last_indexer_loss = mean over queries of KL(p || softmax(I over the kept keys)), with p
    HF's own sparse attention weights summed over heads and I our indexer scores (whose
    selection equals HF's, test_mla_matches_hf)."""
    from megatron_moe_hybrid.layers.mla_attention import _positions_and_mask, rope_cos_sin

    shape, (b, s), topk = SHAPES[0], (2, 19), TOPK["sparse"]
    hf, rotary = hf_attention(shape, topk, F64, seed=9)
    ours = our_attention(shape, topk, F64)
    load_hf_deepseek_v32_attention(ours, hf.state_dict())
    ours.indexer_loss_coeff = 1.0
    x = torch.randn(b, s, shape.hidden, dtype=F64)
    ours(x.transpose(0, 1).clone().requires_grad_(), attention_mask=None)

    with torch.no_grad():
        hf.config._attn_implementation = "eager"
        positions = torch.arange(s)[None].expand(b, s)
        cos, sin = rotary(x, positions)
        mask = torch.full((s, s), torch.finfo(F64).min, dtype=F64).triu(1).expand(b, 1, s, s)
        weights = hf(x, (cos, sin), mask, position_ids=positions)[1]  # [b, H, s, s], 0 off the selection
        p = weights.sum(1)
        p = p / p.sum(-1, keepdim=True)  # [b, s, s]
        pos, readable = _positions_and_mask(None, s, b, x.device)
        c, sn = rope_cos_sin(pos, next(iter(ours._inv_freq.values())), F64, ours.rope_attention_factor)
        scores = ours.index_scores(x, ours.q_layernorm(ours.linear_q_down_proj(x)[0]), c, sn)
        kept = p > 0
        log_q = scores.masked_fill(~kept, float("-inf")).log_softmax(-1)
        kl = torch.where(kept, p * (p.clamp_min(1e-300).log() - log_q), torch.zeros_like(p)).sum(-1)
    # the indexer scores in fp32, as HF's indexer computes them
    torch.testing.assert_close(ours.last_indexer_loss.double(), kl.mean(), rtol=1e-5, atol=1e-7)
