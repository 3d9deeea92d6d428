"""Linear-attention ops: chunked vs recurrent reference, textbook oracles, varlen, registry.

Shape legend: B batch, T time, H heads, K query/key head dim, V value head dim,
N sequences, C chunk size. q, k [B, T, H, K]; v, o [B, T, H, V]; g, beta [B, T, H];
state [N, H, K, V].
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_moe_hybrid.ops import linear_attention as la
from megatron_moe_hybrid.ops.linear_attention.reference import (
    chunk_gated_delta_rule,
    chunk_simple_gla,
    recurrent_gated_delta_rule,
    recurrent_simple_gla,
)

OPS = {
    "gdr": (chunk_gated_delta_rule, recurrent_gated_delta_rule),
    "gla": (chunk_simple_gla, recurrent_simple_gla),
}


def make_inputs(B, T, H, K, V, N=None, dtype=torch.float64, seed=0):
    """Random inputs in the regime the layer produces: unit-norm q/k, g <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype) + 2)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    h0 = torch.randn(N or B, H, K, V, generator=gen, dtype=dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


def call(fn, op, x, **kwargs):
    args = (x["q"], x["k"], x["v"], x["g"]) + ((x["beta"],) if op == "gdr" else ())
    return fn(*args, initial_state=x["initial_state"], output_final_state=True, **kwargs)


def outputs_and_grads(fn, op, x, do, dh, **kwargs):
    """Forward (o, final state) and the gradient of <o, do> + <state, dh> w.r.t. every input."""
    x = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, h = call(fn, op, x, **kwargs)
    names = [n for n in x if op == "gdr" or n != "beta"]
    loss = (o * do).sum() + (h * dh).sum()
    # An empty sequence leaves q, k, v unused: their gradient is zero, not missing.
    grads = torch.autograd.grad(loss, [x[n] for n in names], materialize_grads=True)
    return {"o": o, "state": h, **{f"d{n}": gr for n, gr in zip(names, grads)}}


def assert_all_close(actual, expected, atol, rtol):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=rtol, msg=name)


SHAPES = [  # B, T, H, K, V, C
    (1, 1, 1, 8, 8, 16),
    (2, 63, 4, 32, 16, 16),
    (1, 64, 2, 16, 24, 16),
    (2, 37, 3, 8, 5, 64),
    (1, 100, 2, 16, 16, 32),
]
SHAPE_IDS = [f"B{b}-T{t}-H{h}-K{k}-V{v}-C{c}" for b, t, h, k, v, c in SHAPES]


@pytest.mark.parametrize("op", ["gdr", "gla"])
@pytest.mark.parametrize("B,T,H,K,V,C", SHAPES, ids=SHAPE_IDS)
def test_chunk_matches_recurrent_fp64(op, B, T, H, K, V, C):
    chunk, recurrent = OPS[op]
    x = make_inputs(B, T, H, K, V)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    dh = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    ref = outputs_and_grads(recurrent, op, x, do, dh)
    out = outputs_and_grads(chunk, op, x, do, dh, chunk_size=C)
    assert_all_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("op", ["gdr", "gla"])
@pytest.mark.parametrize("B,T,H,K,V,C", [(2, 63, 4, 32, 16, 16), (1, 130, 2, 64, 64, 64)],
                         ids=["B2-T63-H4-K32-V16-C16", "B1-T130-H2-K64-V64-C64"])
def test_chunk_fp32_close_to_fp64(op, B, T, H, K, V, C):
    """fp32 chunked error stays within 2x the fp32 recurrent error (plus a floor)."""
    chunk, recurrent = OPS[op]
    x = make_inputs(B, T, H, K, V)
    x32 = {n: t.float() for n, t in x.items()}
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    dh = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    exact = outputs_and_grads(recurrent, op, x, do, dh)
    rec32 = outputs_and_grads(recurrent, op, x32, do.float(), dh.float())
    out32 = outputs_and_grads(chunk, op, x32, do.float(), dh.float(), chunk_size=C)
    for name in exact:
        assert out32[name].dtype == torch.float32
        err = (out32[name].double() - exact[name]).abs().max().item()
        base = (rec32[name].double() - exact[name]).abs().max().item()
        assert err <= 2 * base + 1e-4, f"{name}: chunk fp32 err {err:.2e}, recurrent {base:.2e}"


@pytest.mark.parametrize("B,T,H,K,V", [(2, 9, 2, 4, 3), (1, 17, 1, 8, 8)],
                         ids=["B2-T9-H2-K4-V3", "B1-T17-H1-K8-V8"])
def test_recurrent_gated_delta_rule_matches_householder_form(B, T, H, K, V):
    """S_t = (I - beta k k^T) exp(g) S_{t-1} + beta k v^T, written per head with matrices."""
    x = make_inputs(B, T, H, K, V)
    o, h = call(recurrent_gated_delta_rule, "gdr", x)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for i in range(H):
            S = x["initial_state"][b, i]
            for t in range(T):
                kt, bt = x["k"][b, t, i, :, None], x["beta"][b, t, i]
                S = (eye - bt * kt @ kt.T) @ (x["g"][b, t, i].exp() * S)
                S = S + bt * kt @ x["v"][b, t, i][None]
                torch.testing.assert_close(o[b, t, i], S.T @ x["q"][b, t, i] * K**-0.5)
            torch.testing.assert_close(h[b, i], S)


@pytest.mark.parametrize("B,T,H,K,V", [(2, 29, 3, 8, 5), (1, 1, 2, 4, 4)],
                         ids=["B2-T29-H3-K8-V5", "B1-T1-H2-K4-V4"])
def test_recurrent_simple_gla_matches_attention_form(B, T, H, K, V):
    """o_t = scale * (exp(G_t) q_t^T S_0 + sum_{s <= t} exp(G_t - G_s) (q_t . k_s) v_s)."""
    x = make_inputs(B, T, H, K, V)
    o, h = call(recurrent_simple_gla, "gla", x)
    G = x["g"].cumsum(1)  # [B, T, H]
    decay = torch.exp(G[:, :, None, :] - G[:, None, :, :])  # [B, T, T, H] from s to t
    decay = decay * torch.ones(T, T, dtype=torch.bool).tril()[None, :, :, None]
    scores = torch.einsum("bthk,bshk->btsh", x["q"], x["k"]) * decay
    expected = torch.einsum("btsh,bshv->bthv", scores, x["v"])
    expected += torch.einsum("bthk,bhkv->bthv", x["q"] * G[..., None].exp(), x["initial_state"])
    torch.testing.assert_close(o, expected * K**-0.5)
    expected_h = x["initial_state"] * G[:, -1, :, None, None].exp() + torch.einsum(
        "bshk,bshv->bhkv", x["k"] * (G[:, -1:] - G).exp()[..., None], x["v"]
    )
    torch.testing.assert_close(h, expected_h)


@pytest.mark.parametrize("op", ["gdr", "gla"])
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize(
    "lengths", [(13, 24), (0, 7, 0, 31, 1), (5,)], ids=["L13-24", "L0-7-0-31-1", "L5"]
)
def test_varlen_equals_separate_sequences(op, kind, lengths):
    fn = OPS[op][0 if kind == "chunk" else 1]
    kwargs = {"chunk_size": 8} if kind == "chunk" else {}
    T, N, H, K, V = sum(lengths), len(lengths), 2, 8, 6
    x = make_inputs(1, T, H, K, V, N=N)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    do = torch.randn(1, T, H, V, dtype=torch.float64)
    dh = torch.randn(N, H, K, V, dtype=torch.float64)
    packed = outputs_and_grads(fn, op, x, do, dh, cu_seqlens=cu, **kwargs)
    for n in range(N):
        seg = slice(cu[n].item(), cu[n + 1].item())
        x_n = {name: t[:, seg] for name, t in x.items() if name != "initial_state"}
        x_n["initial_state"] = x["initial_state"][n : n + 1]
        alone = outputs_and_grads(fn, op, x_n, do[:, seg], dh[n : n + 1], **kwargs)
        assert packed.keys() == alone.keys()
        for name, value in alone.items():
            per_sequence = name in ("state", "dinitial_state")
            got = packed[name][n : n + 1] if per_sequence else packed[name][:, seg]
            torch.testing.assert_close(got, value, atol=1e-12, rtol=1e-12, msg=name)
        if lengths[n] == 0:
            torch.testing.assert_close(packed["state"][n], x["initial_state"][n])


@pytest.mark.parametrize("op", ["gdr", "gla"])
def test_low_precision_inputs_keep_fp32_state(op):
    x = {n: t.to(torch.bfloat16) for n, t in make_inputs(1, 21, 2, 8, 8).items()}
    o, h = call(OPS[op][0], op, x, chunk_size=8)
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
    o_ref, h_ref = call(OPS[op][1], op, {n: t.double() for n, t in x.items()})
    torch.testing.assert_close(o.double(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(h.double(), h_ref, atol=1e-4, rtol=1e-4)


def test_no_initial_state_means_zero_state_and_default_scale():
    x = make_inputs(2, 11, 2, 16, 4)
    o, h = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=4)
    assert h is None
    x["initial_state"] = torch.zeros_like(x["initial_state"])
    o_ref, _ = call(recurrent_gated_delta_rule, "gdr", x, scale=16**-0.5)
    torch.testing.assert_close(o, o_ref)
    o2, _ = call(recurrent_gated_delta_rule, "gdr", x, scale=0.5)
    assert not torch.allclose(o2, o_ref)


BAD_INPUTS = {
    "q-3d": (dict(q=torch.zeros(1, 4, 2)), "q"),
    "k-shape": (dict(k=torch.zeros(1, 4, 2, 7)), "k"),
    "k-dtype": (dict(k=torch.zeros(1, 4, 2, 8, dtype=torch.float64)), "k"),
    "v-heads": (dict(v=torch.zeros(1, 4, 3, 8)), "v"),
    "g-shape": (dict(g=torch.zeros(1, 4, 2, 1)), "g"),
    "beta-shape": (dict(beta=torch.zeros(1, 5, 2)), "beta"),
    "state-shape": (dict(initial_state=torch.zeros(2, 2, 8, 8)), "initial_state"),
    "cu-end": (dict(cu_seqlens=torch.tensor([0, 3])), "cu_seqlens"),
    "cu-decreasing": (dict(cu_seqlens=torch.tensor([0, 3, 2, 4])), "cu_seqlens"),
    "cu-float": (dict(cu_seqlens=torch.tensor([0.0, 4.0])), "cu_seqlens"),
    "cu-batch": (
        dict(q=torch.zeros(2, 4, 2, 8), k=torch.zeros(2, 4, 2, 8), v=torch.zeros(2, 4, 2, 8),
             g=torch.zeros(2, 4, 2), beta=torch.zeros(2, 4, 2), cu_seqlens=torch.tensor([0, 4])),
        "cu_seqlens",
    ),
    "chunk-zero": (dict(chunk_size=0), "chunk_size"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_argument(case):
    override, name = BAD_INPUTS[case]
    args = dict(q=torch.zeros(1, 4, 2, 8), k=torch.zeros(1, 4, 2, 8), v=torch.zeros(1, 4, 2, 8),
                g=torch.zeros(1, 4, 2), beta=torch.zeros(1, 4, 2))
    args.update(override)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        la.gated_delta_rule(**args)


def test_auto_picks_torch_on_cpu_and_unknown_backend_lists_registered():
    assert {"torch", "torch_recurrent", "triton"} <= set(la.registered_backends("gated_delta_rule"))
    q = torch.zeros(1, 2, 1, 4)
    assert la._pick("gated_delta_rule", "auto", q).fn.__wrapped__ is chunk_gated_delta_rule
    assert la._pick("simple_gla", "auto", q).fn.__wrapped__ is chunk_simple_gla
    with pytest.raises(ValueError, match=r"backend: 'nope'.*'torch', 'torch_recurrent'.*'triton'"):
        la.simple_gla(q, q, q, torch.zeros(1, 2, 1), backend="nope")


def test_registered_backend_is_dispatched_by_name_and_priority(monkeypatch):
    calls = []

    def fake(q, k, v, g, **kwargs):
        calls.append(kwargs)
        return v, None

    monkeypatch.setitem(la._BACKENDS, "simple_gla", dict(la._BACKENDS["simple_gla"]))
    la.register_backend("simple_gla", "fake", fake, priority=1, supports=lambda q: q.dim() == 4)
    x = make_inputs(1, 3, 1, 4, 4)
    out, _ = la.simple_gla(x["q"], x["k"], x["v"], x["g"], chunk_size=8)
    assert out is x["v"] and calls == [dict(scale=None, initial_state=None,
                                            output_final_state=False, cu_seqlens=None,
                                            chunk_size=8)]
    ref, _ = la.simple_gla(x["q"], x["k"], x["v"], x["g"], backend="torch")
    torch.testing.assert_close(ref, recurrent_simple_gla(x["q"], x["k"], x["v"], x["g"])[0])
    assert len(calls) == 1
    with pytest.raises(ValueError, match="^op:"):
        la.register_backend("nope", "fake", fake)


@pytest.mark.parametrize("op", ["gated_delta_rule", "simple_gla"])
def test_public_function_matches_reference_through_each_backend(op):
    x = make_inputs(1, 19, 2, 8, 8, seed=3)
    args = [x["q"], x["k"], x["v"], x["g"]] + ([x["beta"]] if op == "gated_delta_rule" else [])
    fn = getattr(la, op)
    o_chunk, h_chunk = fn(*args, initial_state=x["initial_state"], output_final_state=True,
                          chunk_size=4, backend="torch")
    o_rec, h_rec = fn(*args, initial_state=x["initial_state"], output_final_state=True,
                      backend="torch_recurrent")
    torch.testing.assert_close(o_chunk, o_rec)
    torch.testing.assert_close(h_chunk, h_rec)
