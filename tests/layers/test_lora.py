"""LoRA modules against the plain formulas: linears (torch, Megatron TP=1 and TP=2), grouped
experts (per-expert and shared), target selection, merge/unmerge, frozen bf16 base.

Shape legend: N rows, r rank, E experts, h hidden, F expert FFN size, s scale.
  linear: y = x W^T + b + s (x A^T) B^T;   expert e: h1 = x W1_e + s (x A1_e^T) B1_e^T, ...
"""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from megatron_moe_hybrid.layers.lora import (
    LoRAGroupedExperts,
    LoRALinear,
    allreduce_lora_partial_grads,
    find_lora_targets,
    grouped_matmul,
    apply_lora,
    lora_scale,
    merge,
    merge_lora_,
    unmerge,
)
from megatron_moe_hybrid.testing import init_megatron, spawn, teardown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    init_megatron()
    yield
    teardown()


def _randomize_(module: nn.Module, std: float = 0.1) -> None:
    """Nonzero B (it starts at zero), so every adapter factor gets a gradient."""
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, std)


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
@pytest.mark.parametrize("n,d_in,d_out,r", [(1, 5, 3, 1), (7, 13, 11, 4), (33, 16, 24, 8)],
                         ids=["N1-I5-O3-R1", "N7-I13-O11-R4", "N33-I16-O24-R8"])
def test_linear_matches_formula(n, d_in, d_out, r, rslora):
    torch.manual_seed(n + r)
    base = nn.Linear(d_in, d_out, dtype=torch.float64)
    lora = LoRALinear(base, r, alpha=3.0, rslora=rslora, seed=5)
    assert lora.scale == (3.0 / r**0.5 if rslora else 3.0 / r)
    x = torch.randn(2, n, d_in, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(lora(x), base(x), rtol=0, atol=0)  # B = 0: exactly the base
    _randomize_(lora)
    out = lora(x)
    a, b = lora.lora_A.detach().requires_grad_(), lora.lora_B.detach().requires_grad_()
    ref = F.linear(x, base.weight, base.bias) + F.linear(F.linear(x, a), b) * lora.scale
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, lora.lora_A, lora.lora_B), g)
    want = torch.autograd.grad(ref, (x, a, b), g)
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)


def test_linear_dropout_only_touches_the_adapter_input():
    torch.manual_seed(0)
    base = nn.Linear(9, 7, dtype=torch.float64)
    lora = LoRALinear(base, 3, alpha=6.0, dropout=0.5)
    _randomize_(lora)
    x = torch.randn(5, 9, dtype=torch.float64)
    torch.manual_seed(1)
    out = lora(x)
    torch.manual_seed(1)
    ref = base(x) + F.linear(F.linear(F.dropout(x, 0.5), lora.lora_A), lora.lora_B) * lora.scale
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    lora.eval()
    ref = base(x) + F.linear(F.linear(x, lora.lora_A), lora.lora_B) * lora.scale
    torch.testing.assert_close(lora(x), ref, rtol=1e-12, atol=1e-12)


def _megatron_config(dtype=torch.float64, tp=1):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=dtype)


def _pair(config, d_in, d_mid, d_out, gather):
    """A Megatron column -> row pair, as in an MLP (row input is the column's local output)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    init = nn.init.normal_
    col = ColumnParallelLinear(d_in, d_mid, config=config, init_method=init, bias=True, gather_output=gather)
    row = RowParallelLinear(d_mid, d_out, config=config, init_method=init, bias=True,
                            input_is_parallel=not gather, skip_bias_add=False)
    return col, row


@pytest.mark.parametrize("gather", [False, True], ids=["local", "gather"])
def test_megatron_linears_tp1_match_their_base(gather):
    torch.manual_seed(0)
    col, row = _pair(_megatron_config(), 6, 10, 5, gather)
    x = torch.randn(3, 2, 6, dtype=torch.float64)
    with torch.no_grad():
        ref = row(col(x)[0])[0]
    lcol, lrow = LoRALinear(col, 2, 4.0), LoRALinear(row, 2, 4.0)
    torch.testing.assert_close(lrow(lcol(x)[0])[0], ref, rtol=0, atol=0)
    _randomize_(lcol)
    _randomize_(lrow)
    out = lrow(lcol(x)[0])[0]
    s = lcol.scale
    h = F.linear(x, col.weight, col.bias) + F.linear(F.linear(x, lcol.lora_A), lcol.lora_B) * s
    want = F.linear(h, row.weight, row.bias) + F.linear(F.linear(h, lrow.lora_A), lrow.lora_B) * s
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def _tp_worker(rank, world, d_in, d_mid, d_out, r, seed):
    """The pair at TP=world, loaded with slices of the full weights drawn from `seed`."""
    init_megatron(rank, world, tp=world)
    torch.manual_seed(seed)
    full = _tp_full(d_in, d_mid, d_out, r)
    config = _megatron_config(tp=world)
    out = {}
    for gather in (False, True):
        col, row = _pair(config, d_in, d_mid, d_out, gather)
        lcol, lrow = LoRALinear(col, r, 4.0, seed=1), LoRALinear(row, r, 4.0, seed=2)
        mid = d_mid // world
        rows, cols = slice(rank * mid, (rank + 1) * mid), slice(None)
        with torch.no_grad():
            col.weight.copy_(full["w1"][rows]), col.bias.copy_(full["b1"][rows])
            row.weight.copy_(full["w2"][:, rows]), row.bias.copy_(full["b2"])
            lcol.lora_A.copy_(full["a1"][:, cols]), lcol.lora_B.copy_(full["bb1"][rows])
            lrow.lora_A.copy_(full["a2"][:, rows]), lrow.lora_B.copy_(full["bb2"])
        x = full["x"].clone().requires_grad_()
        h, _ = lcol(x)
        if gather:  # the row layer scatters the gathered input itself
            assert h.shape[-1] == d_mid
        y, _ = lrow(h)
        y.backward(full["g"])
        allreduce_lora_partial_grads(nn.ModuleList([lcol, lrow]))
        out[gather] = {"y": y.detach(), "dx": x.grad, "da1": lcol.lora_A.grad, "db1": lcol.lora_B.grad,
                       "da2": lrow.lora_A.grad, "db2": lrow.lora_B.grad}
    return out


def _tp_full(d_in, d_mid, d_out, r):
    f = lambda *s: torch.randn(*s, dtype=torch.float64)  # noqa: E731
    return {"w1": f(d_mid, d_in), "b1": f(d_mid), "w2": f(d_out, d_mid), "b2": f(d_out),
            "a1": f(r, d_in), "bb1": f(d_mid, r), "a2": f(r, d_mid), "bb2": f(d_out, r),
            "x": f(5, 2, d_in), "g": f(5, 2, d_out)}


@pytest.mark.distributed
def test_tensor_parallel_lora_matches_tp1():
    d_in, d_mid, d_out, r, seed = 7, 10, 9, 3, 11
    results = spawn(_tp_worker, 2, d_in, d_mid, d_out, r, seed)
    torch.manual_seed(seed)
    full = _tp_full(d_in, d_mid, d_out, r)
    leaves = {k: full[k].clone().requires_grad_() for k in ("x", "a1", "bb1", "a2", "bb2")}
    s = lora_scale(r, 4.0)
    x = leaves["x"]
    h = F.linear(x, full["w1"], full["b1"]) + F.linear(F.linear(x, leaves["a1"]), leaves["bb1"]) * s
    y = F.linear(h, full["w2"], full["b2"]) + F.linear(F.linear(h, leaves["a2"]), leaves["bb2"]) * s
    grads = dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), full["g"])))
    tol = dict(rtol=1e-12, atol=1e-12)
    for gather in (False, True):
        ranks = [res[gather] for res in results]
        for res in ranks:
            torch.testing.assert_close(res["y"], y, **tol)
            torch.testing.assert_close(res["dx"], grads["x"], **tol)
            # replicated factors: the partial sums were all-reduced
            torch.testing.assert_close(res["da1"], grads["a1"], **tol)
            torch.testing.assert_close(res["db2"], grads["bb2"], **tol)
        # sharded factors gather to the TP=1 gradient
        torch.testing.assert_close(torch.cat([res["db1"] for res in ranks], 0), grads["bb1"], **tol)
        torch.testing.assert_close(torch.cat([res["da2"] for res in ranks], 1), grads["a2"], **tol)


def _experts(e, h, f, offset=0, dtype=torch.float64):
    from megatron_moe_hybrid.layers.moe.experts import GroupedExperts

    config = SimpleNamespace(hidden_size=h, moe=SimpleNamespace(ffn_hidden_size=f), params_dtype=dtype,
                             init_method=nn.init.normal_, output_layer_init_method=nn.init.normal_)
    return GroupedExperts(config, e, expert_offset=offset)


def _experts_ref(x, counts, w1, w2, a1, b1, a2, b2, s):
    """The per-expert weight delta formed explicitly: the reference only."""
    outs = []
    for e, x_e in enumerate(torch.split(x, counts)):
        pick = (lambda t: t[e]) if a1.dim() == 3 else (lambda t: t)
        gate, up = (x_e @ (w1[e] + s * (pick(b1) @ pick(a1)).T)).chunk(2, -1)
        outs.append((F.silu(gate) * up) @ (w2[e] + s * (pick(b2) @ pick(a2)).T))
    return torch.cat(outs)


@pytest.mark.parametrize("mode", ["per_expert", "shared"])
@pytest.mark.parametrize("counts,h,f,r", [([3, 0, 5, 1], 8, 6, 2), ([1], 5, 3, 1), ([0, 7, 2], 12, 10, 4)],
                         ids=["E4-N9-H8-F6-R2", "E1-N1-H5-F3-R1", "E3-N9-H12-F10-R4"])
def test_grouped_experts_match_formula(counts, h, f, r, mode):
    torch.manual_seed(len(counts) * 10 + h)
    base = _experts(len(counts), h, f)
    lora = LoRAGroupedExperts(base, r, alpha=5.0, rslora=True, expert_adapter=mode, seed=3)
    x = torch.randn(sum(counts), h, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(lora(x, torch.tensor(counts)), base(x, counts), rtol=0, atol=0)
    _randomize_(lora)
    params = [lora.lora_A1, lora.lora_B1, lora.lora_A2, lora.lora_B2]
    out = lora(x, torch.tensor(counts))
    leaves = [p.detach().clone().requires_grad_() for p in params]
    ref = _experts_ref(x, counts, base.weight1, base.weight2, *leaves, lora.scale)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *params], g)
    want = torch.autograd.grad(ref, [x, *leaves], g)
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)
    assert base.weight1.grad is None or not base.weight1.requires_grad


@pytest.mark.parametrize("mode", ["per_expert", "shared"])
def test_adapter_ignores_padding_rows(mode):
    """The static dispatcher pads the rows past sum(counts) with whatever memory held (NaN on
    the H200): no adapter may carry them into its weight gradients."""
    torch.manual_seed(0)
    counts = torch.tensor([2, 0, 3])
    lora = LoRAGroupedExperts(_experts(3, 6, 4), 2, 4.0, expert_adapter=mode)
    _randomize_(lora)
    x = torch.randn(5, 6, dtype=torch.float64)
    padded = torch.cat([x, torch.full((3, 6), float("nan"), dtype=torch.float64)])
    a, b = lora.lora_A1, lora.lora_B1
    want = torch.autograd.grad(lora._adapter(x, a, b, counts).sum(), [a, b])
    out = lora._adapter(padded, a, b, counts)
    # the padding rows' outputs are never read, and their incoming gradients are garbage too
    g = torch.cat([torch.ones(5, out.shape[1], dtype=out.dtype), torch.full((3, out.shape[1]), float("nan"))])
    got = torch.autograd.grad(out, [a, b], g.to(out.dtype))
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)


def test_grouped_experts_reject_bad_counts():
    lora = LoRAGroupedExperts(_experts(3, 4, 2), 1, 1.0)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        lora(torch.randn(5, 4, dtype=torch.float64), [2, 2])


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[5, 0, 17, 1], [64, 32]], ids=["E4-N23", "E2-N96"])
def test_grouped_matmul_cuda_matches_loop(counts):
    """torch._grouped_mm (bf16, transposed stacked adapters) against the per-expert loop."""
    torch.manual_seed(0)
    e, r, d = len(counts), 16, 64
    x = torch.randn(sum(counts), d, device="cuda")
    a = torch.randn(e, r, d, device="cuda") / 8  # [E, r, in] as stored
    got = grouped_matmul(x.bfloat16(), a.bfloat16().transpose(1, 2), torch.tensor(counts, device="cuda"))
    want = grouped_matmul(x.bfloat16().float(), a.bfloat16().float().transpose(1, 2), counts)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_expert_adapter_markers_and_layout_independent_init():
    full = LoRAGroupedExperts(_experts(8, 6, 4), 2, 4.0, seed=9)
    half = LoRAGroupedExperts(_experts(4, 6, 4, offset=4), 2, 4.0, seed=9)
    assert full.lora_A1.shape == (8, 2, 6) and full.lora_B1.shape == (8, 8, 2)
    assert full.lora_A2.shape == (8, 2, 4) and full.lora_B2.shape == (8, 6, 2)
    torch.testing.assert_close(half.lora_A1, full.lora_A1[4:], rtol=0, atol=0)
    torch.testing.assert_close(half.lora_A2, full.lora_A2[4:], rtol=0, atol=0)
    for p in (full.lora_A1, full.lora_B1, full.lora_A2, full.lora_B2):
        assert p.allreduce is False and p.num_local_experts == 8
    shared = LoRAGroupedExperts(_experts(8, 6, 4), 2, 4.0, expert_adapter="shared")
    assert shared.lora_A1.shape == (2, 6) and shared.lora_B2.shape == (6, 2)
    for p in shared.parameters(recurse=False):
        assert not hasattr(p, "num_local_experts") and getattr(p, "allreduce", True)
    with pytest.raises(ValueError, match="expert_adapter"):
        LoRAGroupedExperts(_experts(2, 6, 4), 2, 4.0, expert_adapter="global")


def _tiny(**overrides):
    from megatron_moe_hybrid.config import config_from_dict

    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    base = {"parallel.world_size": 1, "training.seq_length": 32, "sparse_attention.topk": 8}
    base.update(overrides)
    return config_from_dict(raw, base)


@pytest.fixture(scope="module")
def tiny_model_factory():
    from megatron_moe_hybrid.models import build_model

    config = _tiny()

    def make(seed=0):
        torch.manual_seed(seed)
        return build_model(config).eval(), config

    return make


def _logits(model, config, seed=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=g)
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    return model(tokens, pos, None)


def test_apply_lora_freezes_the_base_and_selects_targets(tiny_model_factory):
    model, config = tiny_model_factory()
    model.double()
    ref = _logits(model, config).detach()
    paths = apply_lora(model, ["linear_attention", "indexer", "experts"], 4, 8.0)
    assert "decoder.layers.0.self_attention.in_proj" in paths
    assert "decoder.layers.3.self_attention.linear_index_k" in paths
    assert "decoder.layers.3.mlp.experts" in paths
    assert "decoder.layers.3.self_attention.linear_qkv" not in paths
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert len(trainable) == sum(4 if p.endswith("experts") else 2 for p in paths)
    # B = 0: the adapted model computes what the base does (F.linear vs Megatron's matmul round differently)
    torch.testing.assert_close(_logits(model, config), ref, rtol=1e-12, atol=1e-12)

    model, _ = tiny_model_factory()
    paths = apply_lora(model, ["linear_attention", "experts"], 2, 4.0,
                       target_modules=[r"decoder\.layers\.[01]\.self_attention\.out_proj", r".*\.3\.mlp\.experts"])
    assert paths == ["decoder.layers.0.self_attention.out_proj", "decoder.layers.1.self_attention.out_proj",
                     "decoder.layers.3.mlp.experts"]


def test_bad_targets_name_the_field_and_list_what_exists(tiny_model_factory):
    model, _ = tiny_model_factory()
    with pytest.raises(ValueError, match=r"lora\.targets: 'dense_mlp' matches no module.*experts"):
        apply_lora(model, ["experts", "dense_mlp"], 2, 4.0)
    with pytest.raises(ValueError, match=r"lora\.target_modules: 'q_proj' matches no module.*in_proj"):
        apply_lora(model, ["linear_attention"], 2, 4.0, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"lora\.targets: unknown"):
        apply_lora(model, ["atention"], 2, 4.0)
    with pytest.raises(ValueError, match=r"lora\.targets: 'attention' matches no attention module"):
        apply_lora(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["attention"], 2, 4.0)
    with pytest.raises(ValueError, match=r"lora\.rank"):
        apply_lora(model, ["experts"], 0, 4.0)
    assert all(p.requires_grad for p in model.parameters())  # a failed call changes nothing


def test_attention_target_is_every_attention_kind_of_the_model(tiny_model_factory):
    model, _ = tiny_model_factory()
    kinds = [p for _, _, p in find_lora_targets(model, ["linear_attention", "sparse_attention", "experts"])]
    assert [p for _, _, p in find_lora_targets(model, ["attention", "experts"])] == kinds
    assert [p for _, _, p in find_lora_targets(model, ["linear_attention", "attention", "experts"])] == kinds
    assert not any("index" in p for p in kinds)  # the indexer stays a target of its own


@pytest.mark.parametrize("mode", ["per_expert", "shared"])
def test_merge_equals_adapter_and_unmerge_restores(tiny_model_factory, mode):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    model, config = tiny_model_factory()
    model.double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    paths = apply_lora(model, ["linear_attention", "sparse_attention", "indexer", "experts", "shared_expert"], 3, 6.0,
               rslora=True, expert_adapter=mode)
    _randomize_(model, 0.05)
    with torch.no_grad():
        adapted = _logits(model, config)
        assert merge(model) == len(paths) == 23
        merged = _logits(model, config)
        torch.testing.assert_close(merged, adapted, rtol=1e-10, atol=1e-10)
        assert not torch.allclose(model.decoder.layers[0].mlp.experts.base.weight1,
                                  before["decoder.layers.0.mlp.experts.weight1"])
        assert unmerge(model) == 23
    for n, p in model.named_parameters():
        if "lora_" not in n:
            torch.testing.assert_close(p, before[n.replace(".base.", ".")], rtol=0, atol=1e-15)
    merge_lora_(model)
    assert not any("lora_" in n for n, _ in model.named_parameters())
    assert isinstance(model.decoder.layers[3].self_attention.linear_proj, RowParallelLinear)
    assert isinstance(model.decoder.layers[3].self_attention.linear_qkv, ColumnParallelLinear)
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, config), adapted, rtol=1e-10, atol=1e-10)


def test_bf16_base_modules_match_formula():
    """The base matmul runs in bf16 on bf16-cast inputs, the adapter in fp32."""
    torch.manual_seed(0)
    base = nn.Linear(12, 10, bias=False)
    lora = LoRALinear(base, 4, 8.0, adapter_dtype=torch.float32)
    base.to(torch.bfloat16)
    _randomize_(lora)
    x = torch.randn(7, 12, requires_grad=True)
    out = lora(x)
    ref = F.linear(x.bfloat16(), base.weight).float() + F.linear(F.linear(x, lora.lora_A), lora.lora_B) * lora.scale
    assert out.dtype == torch.float32 and lora.lora_A.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (x, lora.lora_A, lora.lora_B), g, retain_graph=True),
                    torch.autograd.grad(ref, (x, lora.lora_A, lora.lora_B), g)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    counts = [2, 0, 5]
    experts = _experts(3, 8, 6, dtype=torch.float32)
    lexp = LoRAGroupedExperts(experts, 2, 4.0, adapter_dtype=torch.float32)
    experts.to(torch.bfloat16)
    _randomize_(lexp)
    xe = torch.randn(7, 8)
    s, outs = lexp.scale, []
    for e, x_e in enumerate(torch.split(xe, counts)):
        h1 = (x_e.bfloat16() @ experts.weight1[e]).float() + s * (x_e @ lexp.lora_A1[e].T) @ lexp.lora_B1[e].T
        gate, up = h1.chunk(2, -1)
        act = F.silu(gate) * up
        outs.append((act.bfloat16() @ experts.weight2[e]).float() + s * (act @ lexp.lora_A2[e].T) @ lexp.lora_B2[e].T)
    torch.testing.assert_close(lexp(xe, counts), torch.cat(outs), rtol=0, atol=0)


def test_fp32_adapters_over_bf16_activations_compute_in_bf16():
    """bf16 activations (a bf16 model on the GPU): the fp32 adapters are cast for their GEMMs,
    as under autocast, and their gradients come back in fp32 (the optimizer's master copy)."""
    torch.manual_seed(1)
    base = nn.Linear(12, 10, bias=False).to(torch.bfloat16)
    lora = LoRALinear(base, 4, 8.0, adapter_dtype=torch.float32)
    _randomize_(lora)
    x = torch.randn(7, 12, dtype=torch.bfloat16, requires_grad=True)
    out = lora(x)
    a, b = (p.detach().bfloat16().requires_grad_() for p in (lora.lora_A, lora.lora_B))
    # the scale on the rank-r product, the sum in the second GEMM's epilogue (one rounding)
    ref = torch.addmm(F.linear(x, base.weight), F.linear(x, a) * lora.scale, b.t())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, lora.lora_A, lora.lora_B), g)
    want = torch.autograd.grad(ref, (x, a, b), g)
    assert got[1].dtype == got[2].dtype == torch.float32
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v.to(u.dtype), rtol=0, atol=0)

    counts = torch.tensor([2, 0, 5])
    experts = _experts(3, 8, 6, dtype=torch.float32).to(torch.bfloat16)
    lexp = LoRAGroupedExperts(experts, 2, 4.0, adapter_dtype=torch.float32)
    _randomize_(lexp)
    twin = LoRAGroupedExperts(experts, 2, 4.0, adapter_dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if "lora_" in n:
                p.copy_(getattr(lexp, n))
    xe = torch.randn(7, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(lexp(xe, counts), twin(xe, counts), rtol=0, atol=0)


def test_apply_lora_adapter_dtype(tiny_model_factory):
    model, _ = tiny_model_factory()
    model.to(torch.bfloat16)
    apply_lora(model, ["linear_attention", "experts"], 4, 8.0, adapter_dtype="float32")
    dtypes = {n.rsplit(".", 1)[-1]: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert dtypes and set(dtypes.values()) == {torch.float32}
    assert model.decoder.layers[0].mlp.experts.base.weight1.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="lora.adapter_dtype"):
        apply_lora(tiny_model_factory()[0], ["experts"], 4, 8.0, adapter_dtype="fp8")


def test_adapters_live_on_their_base_device(tiny_model_factory):
    """A model already on a device (the GPU; "meta" here) gets its adapters there too."""
    model, _ = tiny_model_factory()
    model.to("meta")
    apply_lora(model, ["linear_attention", "experts"], 4, 8.0, adapter_dtype="float32")
    lora = {n: p.device.type for n, p in model.named_parameters() if "lora_" in n}
    assert lora and set(lora.values()) == {"meta"}


def test_lora_linear_never_runs_a_per_token_batched_matmul():
    """Megatron hands a linear [s, 1, h] made by a transpose; matmul does not fold such a
    tensor and runs one GEMV per token (a batched matmul that rereads the weight T times).
    The wrapped linear flattens its rows: no aten::bmm, the same values and gradients."""
    from torch.profiler import profile

    torch.manual_seed(2)
    lora = LoRALinear(nn.Linear(16, 24, bias=False), 4, 8.0)
    _randomize_(lora)
    for p in lora.base.parameters():
        p.requires_grad_(False)
    # [s, 1, h] with strides (h, s*h, 1); matmul folds it only when it needs its gradient
    x = torch.randn(1, 37, 16).transpose(0, 1)
    with profile(record_shapes=True) as prof:
        out = lora(x)
        out.backward(torch.ones_like(out))
    assert not [e.input_shapes for e in prof.events() if e.name == "aten::bmm"]
    ref = x @ lora.base.weight.T + (x @ lora.lora_A.T) @ lora.lora_B.T * lora.scale
    torch.testing.assert_close(out, ref)
    assert out.shape == (37, 1, 24)


def test_bf16_base_model_trains_fp32_adapters(tiny_model_factory):
    model, config = tiny_model_factory()
    ref_model, _ = tiny_model_factory()
    apply_lora(model, ["linear_attention", "sparse_attention", "experts"], 4, 8.0, base_dtype="bfloat16")
    apply_lora(ref_model, ["linear_attention", "sparse_attention", "experts"], 4, 8.0)
    experts = model.decoder.layers[0].mlp.experts
    assert experts.base.weight1.dtype == torch.bfloat16 and experts.lora_A1.dtype == torch.float32
    assert model.decoder.layers[0].self_attention.in_proj.base.weight.dtype == torch.bfloat16
    with torch.no_grad():  # the fp32 reference on the same bf16-rounded base weights and adapters
        for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
            q.copy_(p.float())
    out, ref = _logits(model, config), _logits(ref_model, config)
    assert out.dtype == torch.float32
    # bf16 activations at every adapted matmul: close in norm, not elementwise
    assert (out - ref).norm() < 0.02 * ref.norm()
    # Elementwise gradients are not comparable across a bf16 base (routing and top-k flip);
    # the module tests above check the bf16 formula exactly.
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [p for p in model.parameters() if p.requires_grad], torch.randn_like(out))
    assert names and all("lora_" in n for n in names)
    for n, gr in zip(names, grads):
        assert gr.dtype == torch.float32 and torch.isfinite(gr).all() and gr.abs().sum() > 0, n


def test_full_attention_target_adapts_the_gated_attention_layers():
    """Pattern letter A (Qwen3-Next gated full attention): lora.targets "full_attention" wraps its
    four projections; the adapted model starts equal to the base (B = 0) and trains only adapters."""
    from megatron_moe_hybrid.models import build_model

    config = _tiny(**{"model.pattern": "LLLA"})
    torch.manual_seed(0)
    model = build_model(config).eval().double()
    ref = _logits(model, config).detach()
    paths = apply_lora(model, ["full_attention"], 4, 8.0)
    assert paths == [f"decoder.layers.3.self_attention.{n}" for n in ("linear_q", "linear_k", "linear_v", "linear_proj")]
    torch.testing.assert_close(_logits(model, config), ref, rtol=1e-12, atol=1e-12)
    loss = _logits(model, config).float().pow(2).mean()
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)


def test_mla_layers_take_sparse_attention_and_indexer_targets():
    """Pattern letter M (DeepSeek-V3.2 MLA + indexer): the default targets adapt MLA's q/kv
    down/up and output projections, "indexer" its indexer; B = 0 starts at the base, only the
    adapters train, and merging gives the adapted logits."""
    from megatron_moe_hybrid.models import build_model

    config = _tiny(**{"model.pattern": "LLLM", "sparse_attention.index_head_dim": 16})
    torch.manual_seed(0)
    model = build_model(config).eval().double()
    ref = _logits(model, config).detach()
    paths = apply_lora(model, ["sparse_attention", "indexer"], 4, 8.0)
    mla = [p.rsplit(".", 1)[1] for p in paths if p.startswith("decoder.layers.3.")]
    assert mla == ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
                   "linear_index_q", "linear_index_k", "linear_index_weights"]
    torch.testing.assert_close(_logits(model, config), ref, rtol=1e-12, atol=1e-12)
    _randomize_(model, 0.05)
    loss = _logits(model, config).float().pow(2).mean()
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(".lora_" in n for n in grads)
    # the main loss reaches the MLA adapters, not the indexer's (top-k is discrete)
    assert any("linear_kv_up_proj.lora_" in n for n in grads)
    assert not any("linear_index" in n for n in grads)
    with torch.no_grad():
        adapted = _logits(model, config)
        assert merge(model) == len(paths)
        torch.testing.assert_close(_logits(model, config), adapted, rtol=1e-10, atol=1e-10)
