"""fused_recurrent_gated_delta_rule / fused_recurrent_simple_gla over torch.ops.mmh.recurrent_*.

The CPU twin ("cpp") is checked against reference.recurrent_* in fp64 and fp32 (output, final
state and every gradient); the CUDA kernel ("cuda", marked gpu) against the CPU twin in fp32
and against the fp32 reference in bf16.

Shape legend: B batch, T time, Hqk q/k heads, Hv value heads (a multiple of Hqk), K, V head
dims, N sequences. q, k [B, T, Hqk, K]; v, o [B, T, Hv, V]; g, beta [B, T, Hv];
states [N, Hv, K, V].
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_moe_hybrid import _ext
from megatron_moe_hybrid.ops import linear_attention as la
from megatron_moe_hybrid.ops.linear_attention import (
    fused_recurrent_gated_delta_rule,
    fused_recurrent_simple_gla,
    recurrent_gated_delta_rule,
    recurrent_simple_gla,
)
from megatron_moe_hybrid.ops.linear_attention.recurrent import CHECKPOINT_EVERY
from megatron_moe_hybrid.ops.linear_attention.reference import l2norm

needs_cpu_ops = pytest.mark.skipif(
    not _ext.has_cpu_ops(),
    reason="megatron_moe_hybrid._C is not built (pip install --no-build-isolation -e .)",
)
needs_cuda_ops = pytest.mark.skipif(
    not _ext.has_cuda_ops(), reason="megatron_moe_hybrid._C was built without its CUDA kernels"
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(B, T, Hqk, Hv, K, V, N=None, dtype=torch.float64, seed=0, device="cpu"):
    """The layer's regime: unit-norm q/k, g <= 0, beta in (0, 1); a random initial state."""
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": F.normalize(torch.randn(B, T, Hqk, K, generator=gen, dtype=torch.float64), dim=-1),
        "k": F.normalize(torch.randn(B, T, Hqk, K, generator=gen, dtype=torch.float64), dim=-1),
        "v": torch.randn(B, T, Hv, V, generator=gen, dtype=torch.float64),
        "g": F.logsigmoid(torch.randn(B, T, Hv, generator=gen, dtype=torch.float64) + 2),
        "beta": torch.rand(B, T, Hv, generator=gen, dtype=torch.float64),
        "initial_state": torch.randn(N or B, Hv, K, V, generator=gen, dtype=torch.float64),
    }
    return {n: t.to(device=device, dtype=dtype if n != "initial_state" else _state_dtype(dtype)) for n, t in x.items()}


def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def run(op, backend, x, *, cu_seqlens=None, grad_o=True, grad_state=True, seed=1, do_dtype=None, **kwargs):
    """Forward (o, final state) and the gradients of <o, do> + <state, dh> for every input given.

    do is drawn in fp64 and rounded to do_dtype (default: o's dtype), so that a low-precision run
    and its fp32 reference can get the same do.
    """
    x = {n: t.detach().clone().requires_grad_() for n, t in x.items() if t is not None}
    names = [n for n in NAMES if n in x and (op == "gdr" or n != "beta")]
    common = dict(
        initial_state=x.get("initial_state"), output_final_state=True, cu_seqlens=cu_seqlens, backend=backend, **kwargs
    )
    if op == "gdr":
        o, h = fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x.get("g"), x["beta"], **common)
    else:
        o, h = fused_recurrent_simple_gla(x["q"], x["k"], x["v"], x.get("g"), **common)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(do_dtype or o.dtype).to(o)
    dh = torch.randn(h.shape, generator=gen, dtype=torch.float64).to(h)
    loss = (o * do).sum() * grad_o + (h * dh).sum() * grad_state
    grads = torch.autograd.grad(loss, [x[n] for n in names], materialize_grads=True)
    return {"o": o, "state": h, **{f"d{n}": gr for n, gr in zip(names, grads, strict=True)}}


def rel_err(actual, expected):
    """||actual - expected|| / ||expected|| in fp64 (relative RMS error)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def assert_all_close(actual, expected, tol):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        err = rel_err(actual[name], expected[name])
        print(f"{name}: {err:.2e}")  # shown with pytest -rP, to see the margin
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


SHAPES = [  # B, T, Hqk, Hv, K, V
    (1, 1, 1, 1, 8, 8),
    (2, 37, 3, 3, 8, 5),
    (1, 40, 2, 4, 16, 24),
    (2, 2 * CHECKPOINT_EVERY + 1, 2, 2, 32, 16),
]
SHAPE_IDS = [f"B{b}-T{t}-H{hq}x{hv // hq}-K{k}-V{v}" for b, t, hq, hv, k, v in SHAPES]
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}


def reference(op, x, **kwargs):
    """The token-by-token reference with q, k repeated over grouped value heads."""
    return run(op, "torch", x, **kwargs)


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("op", ["gdr", "gla"])
@pytest.mark.parametrize("B,T,Hqk,Hv,K,V", SHAPES, ids=SHAPE_IDS)
def test_cpp_matches_reference(op, dtype, B, T, Hqk, Hv, K, V):
    x = make_inputs(B, T, Hqk, Hv, K, V, dtype=dtype)
    # fp32 is compared with the fp64 reference of the same values: both errors are fp32 rounding.
    expected = reference(op, {n: t.double() for n, t in x.items()})
    assert_all_close(run(op, "cpp", x), expected, TOL[dtype])


@needs_cpu_ops
@pytest.mark.parametrize("op", ["gdr", "gla"])
@pytest.mark.parametrize(
    "grad_o,grad_state,with_h0", [(True, False, False), (False, True, True), (True, True, False)],
    ids=["o-only-no-h0", "state-only", "no-h0"],
)
def test_cpp_gradient_sources(op, grad_o, grad_state, with_h0):
    x = make_inputs(2, 21, 2, 2, 8, 6)
    if not with_h0:
        del x["initial_state"]
    flags = {"grad_o": grad_o, "grad_state": grad_state}
    assert_all_close(run(op, "cpp", x, **flags), reference(op, x, **flags), TOL[torch.float64])


@needs_cpu_ops
@pytest.mark.parametrize("op", ["gdr", "gla"])
def test_cpp_varlen_with_empty_and_length_one_segments(op):
    cu = torch.tensor([0, 0, 1, 18, 18, 35, 36])  # lengths 0, 1, 17, 0, 17, 1
    x = make_inputs(1, 35 + 1, 2, 2, 8, 8, N=6)
    assert_all_close(run(op, "cpp", x, cu_seqlens=cu), reference(op, x, cu_seqlens=cu), TOL[torch.float64])
    # int32 offsets, as some callers keep them
    out32 = run(op, "cpp", x, cu_seqlens=cu.int())
    assert_all_close(out32, reference(op, x, cu_seqlens=cu), TOL[torch.float64])


@needs_cpu_ops
@pytest.mark.parametrize("op", ["gdr", "gla"])
def test_cpp_empty_sequence_returns_the_initial_state(op):
    x = make_inputs(2, 0, 1, 1, 4, 3)
    out = run(op, "cpp", x)
    assert out["o"].shape == (2, 0, 1, 3)
    torch.testing.assert_close(out["state"], x["initial_state"], rtol=0, atol=0)
    gen = torch.Generator().manual_seed(1)
    torch.randn(out["o"].shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(out["state"].shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(out["dinitial_state"], dh, rtol=0, atol=0)


@needs_cpu_ops
@pytest.mark.parametrize("op", ["gdr", "gla"])
def test_cpp_state_chaining(op):
    """Two halves with the carried state equal one run, forward and every gradient."""
    T, cut = 45, 19
    x = make_inputs(2, T, 2, 2, 8, 8)
    whole = run(op, "cpp", x)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    fn = fused_recurrent_gated_delta_rule if op == "gdr" else fused_recurrent_simple_gla
    extra = (lambda s: (leaves["beta"][:, s],)) if op == "gdr" else (lambda s: ())
    outs, state = [], leaves["initial_state"]
    for s in (slice(0, cut), slice(cut, T)):
        o, state = fn(
            leaves["q"][:, s], leaves["k"][:, s], leaves["v"][:, s], leaves["g"][:, s], *extra(s),
            initial_state=state, output_final_state=True, backend="cpp",
        )
        outs.append(o)
    o = torch.cat(outs, dim=1)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(state.shape, generator=gen, dtype=torch.float64)
    names = [n for n in NAMES if op == "gdr" or n != "beta"]
    grads = torch.autograd.grad((o * do).sum() + (state * dh).sum(), [leaves[n] for n in names])
    chained = {"o": o, "state": state, **{f"d{n}": gr for n, gr in zip(names, grads, strict=True)}}
    assert_all_close(chained, whole, TOL[torch.float64])


@needs_cpu_ops
@pytest.mark.parametrize("op", ["gdr", "gla"])
def test_cpp_gradcheck(op):
    x = make_inputs(1, CHECKPOINT_EVERY + 3, 1, 2, 3, 2, seed=3)  # two checkpoint chunks, grouped heads
    names = [n for n in NAMES if op == "gdr" or n != "beta"]
    fn = fused_recurrent_gated_delta_rule if op == "gdr" else fused_recurrent_simple_gla

    def f(*tensors):
        t = dict(zip(names, tensors, strict=True))
        extra = (t["beta"],) if op == "gdr" else ()
        return fn(
            t["q"], t["k"], t["v"], t["g"], *extra, initial_state=t["initial_state"],
            output_final_state=True, backend="cpp",
        )

    inputs = tuple(x[n].clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@needs_cpu_ops
def test_simple_gla_g_gamma_and_no_decay():
    x = make_inputs(2, 20, 2, 2, 8, 4)
    gamma = -torch.rand(2, dtype=torch.float64).requires_grad_()
    o, h = fused_recurrent_simple_gla(
        x["q"], x["k"], x["v"], g_gamma=gamma, initial_state=x["initial_state"], output_final_state=True,
        backend="cpp",
    )
    g = gamma.detach().expand(2, 20, 2).clone().requires_grad_()
    o_ref, h_ref = recurrent_simple_gla(
        x["q"], x["k"], x["v"], g, initial_state=x["initial_state"], output_final_state=True
    )
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    (d_gamma,) = torch.autograd.grad(o.sum() + h.sum(), gamma)
    (d_g,) = torch.autograd.grad(o_ref.sum() + h_ref.sum(), g)
    torch.testing.assert_close(d_gamma, d_g.sum((0, 1)), rtol=1e-10, atol=1e-10)
    # No decay at all equals g = 0.
    o, _ = fused_recurrent_simple_gla(x["q"], x["k"], x["v"], backend="cpp")
    o_ref, _ = recurrent_simple_gla(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]))
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)


@needs_cpu_ops
def test_gated_delta_rule_without_g_is_no_decay():
    x = make_inputs(1, 20, 2, 2, 8, 4)
    del x["g"]
    ref = run("gdr", "torch", x)
    assert_all_close(run("gdr", "cpp", x), ref, TOL[torch.float64])


@needs_cpu_ops
def test_qk_l2norm_in_kernel():
    x = make_inputs(1, 20, 2, 2, 8, 4)
    x["q"], x["k"] = 3 * x["q"], 0.5 * x["k"]  # not unit-norm: the flag matters
    out = run("gdr", "cpp", x, use_qk_l2norm_in_kernel=True)
    normed = dict(x, q=l2norm(x["q"]), k=l2norm(x["k"]))
    expected = run("gdr", "torch", normed)
    for name in ("o", "state", "dv", "dg", "dbeta", "dinitial_state"):
        assert rel_err(out[name], expected[name]) <= 1e-12, name
    ref_flag = run("gdr", "torch", x, use_qk_l2norm_in_kernel=True)  # dq, dk through the norm
    assert_all_close(out, ref_flag, TOL[torch.float64])


def _bad(**changes):
    return changes


BAD_INPUTS = [
    (_bad(q=torch.zeros(1, 4, 2)), "q:"),
    (_bad(k=torch.zeros(1, 4, 2, 5)), "k:"),
    (_bad(v=torch.zeros(1, 4, 3, 4)), "v:"),
    (_bad(g=torch.zeros(1, 4)), "g:"),
    (_bad(beta=torch.zeros(1, 4, 3)), "beta:"),
    (_bad(beta=None), "beta:"),
    (_bad(initial_state=torch.zeros(2, 2, 8, 4)), "initial_state:"),
    (_bad(cu_seqlens=torch.tensor([0, 3, 2, 4])), "cu_seqlens:"),
    (_bad(cu_seqlens=torch.tensor([0.0, 4.0])), "cu_seqlens:"),
    (_bad(backend="xla"), "backend:"),
    (_bad(backend="cuda"), "backend:"),
]


@pytest.mark.parametrize("changes,match", BAD_INPUTS, ids=[m + str(i) for i, (_, m) in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_value_error_naming_the_argument(changes, match):
    x = {n: t.float() for n, t in make_inputs(1, 4, 2, 2, 8, 4).items()}
    kwargs = {"initial_state": x.pop("initial_state"), "backend": "torch"}
    kwargs.update({n: changes.pop(n) for n in ("initial_state", "cu_seqlens", "backend") if n in changes})
    x.update(changes)
    with pytest.raises(ValueError, match=match):
        fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kwargs)


def test_simple_gla_bad_g_gamma():
    x = make_inputs(1, 4, 2, 2, 8, 4)
    with pytest.raises(ValueError, match="g_gamma:"):
        fused_recurrent_simple_gla(x["q"], x["k"], x["v"], x["g"], g_gamma=torch.zeros(2), backend="torch")
    with pytest.raises(ValueError, match="g_gamma:"):
        fused_recurrent_simple_gla(x["q"], x["k"], x["v"], g_gamma=torch.zeros(3), backend="torch")


@needs_cpu_ops
def test_ops_check_their_arguments():
    x = make_inputs(1, 4, 2, 2, 8, 4, dtype=torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], None, 0.5, True)
    ck = torch.ops.mmh.recurrent_fwd(*args, 0)[2]
    assert ck.shape[0] == 0  # no checkpoints when no backward follows
    o, _, ck = torch.ops.mmh.recurrent_fwd(*args, 2)
    assert ck.shape == (4 // 2 + 1, 2, 8, 4)
    with pytest.raises(ValueError, match="k must be"):
        torch.ops.mmh.recurrent_fwd(x["q"], x["k"][..., :4], *args[2:], 2)
    with pytest.raises(ValueError, match="Hv=3 must be a positive multiple"):
        torch.ops.mmh.recurrent_fwd(x["q"], x["k"], torch.zeros(1, 4, 3, 4), None, None, None, None, 0.5, True, 2)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        torch.ops.mmh.recurrent_fwd(*args[:5], None, torch.tensor([0, 3, 2, 4]), 0.5, False, 2)
    grads = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="checkpoints must be"):
        torch.ops.mmh.recurrent_bwd(*grads, ck[:1], None, o, None, 0.5, 2)
    with pytest.raises(ValueError, match="grad_o must be"):
        torch.ops.mmh.recurrent_bwd(*grads, ck, None, o[:, :2], None, 0.5, 2)


@needs_cpu_ops
def test_auto_picks_the_compiled_op_and_says_once_when_it_is_missing(monkeypatch, recwarn):
    x = make_inputs(1, 6, 1, 1, 4, 4)
    cpp = run("gdr", "cpp", x)
    assert_all_close(run("gdr", "auto", x), cpp, 0.0)  # bitwise: auto ran the CPU twin
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_warned", set())
    for _ in range(2):
        assert_all_close(run("gdr", "auto", x), run("gdr", "torch", x), 0.0)
    warned = [w for w in recwarn if issubclass(w.category, _ext.MissingExtensionWarning)]
    assert len(warned) == 1 and "fused_recurrent_gated_delta_rule on cpu" in str(warned[0].message)
    with pytest.raises(RuntimeError, match="pip install --no-build-isolation -e ."):
        run("gdr", "cpp", x)


@needs_cpu_ops
def test_registry_backends_rank_below_the_chunked_ones():
    for op in ("gated_delta_rule", "simple_gla"):
        assert {"cpp", "cuda"} <= set(la.registered_backends(op))
    x = make_inputs(1, 20, 2, 2, 8, 4)
    assert la._pick("gated_delta_rule", "auto", x["q"]) is not la._BACKENDS["gated_delta_rule"]["cpp"]
    o, h = la.gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True,
        backend="cpp",
    )
    o_ref, h_ref = recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True
    )
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    o, _ = la.simple_gla(x["q"], x["k"], x["v"], x["g"], backend="cpp")
    torch.testing.assert_close(o, recurrent_simple_gla(x["q"], x["k"], x["v"], x["g"])[0], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- GPU (the CUDA kernel)


def poison_cuda_cache():
    """Fills freed cached blocks with NaN, so an output element the kernel does not write shows."""
    torch.empty(1 << 28, dtype=torch.uint8, device="cuda").fill_(0xFF)  # 0xFFFF... is NaN in fp32/bf16/fp16


def to(x, device, dtype):
    return {n: t.to(device=device, dtype=dtype if n != "initial_state" else torch.float32) for n, t in x.items()}


CUDA_SHAPES = [  # B, T, Hqk, Hv, K, V
    (2, 37, 3, 3, 8, 5),
    (1, 40, 2, 4, 64, 40),
    (2, 70, 2, 2, 128, 128),
    (1, 33, 2, 2, 100, 72),
]
CUDA_IDS = [f"B{b}-T{t}-H{hq}x{hv // hq}-K{k}-V{v}" for b, t, hq, hv, k, v in CUDA_SHAPES]


@pytest.mark.gpu
@needs_cuda_ops
@pytest.mark.parametrize("op", ["gdr", "gla"])
@pytest.mark.parametrize("B,T,Hqk,Hv,K,V", CUDA_SHAPES, ids=CUDA_IDS)
def test_cuda_matches_cpp_fp32(op, B, T, Hqk, Hv, K, V):
    x = make_inputs(B, T, Hqk, Hv, K, V, seed=B * T + K)
    expected = run(op, "cpp", to(x, "cpu", torch.float32))
    poison_cuda_cache()
    out = run(op, "cuda", to(x, "cuda", torch.float32))
    assert_all_close(out, expected, 1e-5)


@pytest.mark.gpu
@needs_cuda_ops
@pytest.mark.parametrize("op", ["gdr", "gla"])
def test_cuda_varlen_with_empty_and_length_one_segments(op):
    cu = torch.tensor([0, 0, 1, 18, 18, 35, 36, 100])
    x = make_inputs(1, 100, 2, 4, 128, 128, N=7)
    expected = run(op, "cpp", to(x, "cpu", torch.float32), cu_seqlens=cu)
    poison_cuda_cache()
    out = run(op, "cuda", to(x, "cuda", torch.float32), cu_seqlens=cu.cuda())
    assert_all_close(out, expected, 1e-5)


@pytest.mark.gpu
@needs_cuda_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("op", ["gdr", "gla"])
def test_cuda_low_precision_against_the_fp32_reference(op, dtype):
    """Relative RMS error against the fp32 reference on the same (rounded) inputs: 5e-3 outputs, 1e-2 gradients."""
    x = to(make_inputs(2, 128, 2, 4, 128, 128, seed=7), "cuda", dtype)
    poison_cuda_cache()
    out = run(op, "cuda", x)
    expected = run(op, "torch", {n: t.float() for n, t in x.items()}, do_dtype=dtype)
    for name in expected:
        tol = 5e-3 if name in ("o", "state") else 1e-2
        assert rel_err(out[name], expected[name]) <= tol, name


@pytest.mark.gpu
@needs_cuda_ops
def test_cuda_decode_step():
    x = make_inputs(64, 1, 32, 32, 128, 128, seed=11)
    expected = run("gdr", "cpp", to(x, "cpu", torch.float32))
    poison_cuda_cache()
    assert_all_close(run("gdr", "cuda", to(x, "cuda", torch.float32)), expected, 1e-5)


@pytest.mark.gpu
@needs_cuda_ops
@pytest.mark.parametrize("K", [64, 128])
def test_cuda_block_layouts_agree(K):
    B, T, C = 2, 50, 4
    x = to(make_inputs(B, T, 2, 2, K, 128, seed=5), "cuda", torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], None, K**-0.5, True, C)
    # Sequence n stores checkpoint j in slot n T / C + n + j; the last of the B T / C + B slots is spare.
    used = [n * T // C + n + j for n in range(B) for j in range(-(-T // C))]
    o0, h0, ck0 = torch.ops.mmh.recurrent_fwd(*args, 0)
    for layout in (1, 2, 3):
        poison_cuda_cache()
        o, h, ck = torch.ops.mmh.recurrent_fwd(*args, layout)
        for name, a, b in (("o", o, o0), ("state", h, h0), ("checkpoints", ck[used], ck0[used])):
            assert rel_err(a, b) <= 1e-6, (layout, name)


SANITIZER_SCRIPT = """
import torch
from megatron_moe_hybrid.ops.linear_attention import fused_recurrent_gated_delta_rule, fused_recurrent_simple_gla
torch.manual_seed(0)
cu = torch.tensor([0, 0, 1, 20, 45], device="cuda")
for dtype, K, V in ((torch.bfloat16, 128, 72), (torch.float32, 40, 8)):
    q, k = (torch.nn.functional.normalize(torch.randn(1, 45, 2, K, device="cuda"), dim=-1).to(dtype) for _ in range(2))
    v = torch.randn(1, 45, 4, V, device="cuda", dtype=dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 45, 4, device="cuda") + 2)
    beta = torch.rand(1, 45, 4, device="cuda")
    h0 = torch.randn(4, 4, K, V, device="cuda")
    for t in (q, k, v, g, beta, h0):
        t.requires_grad_()
    o, h = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu, backend="cuda")
    (o.float().sum() + h.sum()).backward()
    o, h = fused_recurrent_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      backend="cuda")
    (o.float().sum() + h.sum()).backward()
torch.cuda.synchronize()
print("done")
"""


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda_ops
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_cuda_kernels_under_compute_sanitizer(tool):
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        pytest.skip("compute-sanitizer is not installed")
    result = subprocess.run(
        [sanitizer, "--tool", tool, "--error-exitcode", "3", sys.executable, "-c", SANITIZER_SCRIPT],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0 and "done" in result.stdout, result.stdout[-4000:] + result.stderr[-4000:]
