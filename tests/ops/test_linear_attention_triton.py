"""Triton chunk kernels (ops/linear_attention/triton_chunk.py) against the PyTorch reference.

CPU: Triton's interpreter in fp32 on tiny shapes (tests/conftest.py sets TRITON_INTERPRET=1;
its bf16 loads are wrong, so no bf16 here). GPU (-m gpu, the H200): bf16 at realistic sizes
against the fp32 reference: relative RMS error <= 5e-3 for outputs, <= 1e-2 for gradients.
Every buffer the kernels write is NaN-poisoned first (triton_chunk._alloc), so an unwritten
element fails. Shape legend: B batch, T time, H q/k heads, HV value heads, K, V head dims,
N sequences; q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; states [N, HV, K, V].
"""

import weakref

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from megatron_moe_hybrid.ops import linear_attention as la
from megatron_moe_hybrid.ops.linear_attention import reference, triton_chunk
from megatron_moe_hybrid.testing import assert_rel_rms, rel_rms

OPS = ("gated_delta_rule", "simple_gla")
# CPU tensors run the kernels in the interpreter, which conftest turns on only without a GPU.
interpreter = pytest.mark.skipif(
    not triton_chunk._INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1 (conftest sets it without a GPU)"
)


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch):
    def nan_alloc(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_chunk, "_alloc", nan_alloc)


def make_inputs(B, T, H, K, V, HV=None, N=None, dtype=torch.float32, device="cpu", seed=0):
    """The layer's regime: unit-norm q/k, g <= 0, beta in (0, 1); drawn in fp32, then cast."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        "k": F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        "v": torch.randn(B, T, HV, V, generator=gen),
        "g": F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 3),
        "beta": torch.rand(B, T, HV, generator=gen),
        "initial_state": torch.randn(N or B, HV, K, V, generator=gen),
    }
    return {n: t.to(device=device, dtype=dtype if n in "qkv" else torch.float32) for n, t in x.items()}


def outputs_and_grads(op, x, backend, seed=1, **kwargs):
    """(o, final state) and the gradients of <o, do> + <state, dstate> w.r.t. every input."""
    x = {n: t.detach().clone().requires_grad_() for n, t in x.items() if op != "simple_gla" or n != "beta"}
    args = [x["q"], x["k"], x["v"], x["g"]] + ([x["beta"]] if op == "gated_delta_rule" else [])
    o, h = getattr(la, op)(
        *args, initial_state=x["initial_state"], output_final_state=True, backend=backend, **kwargs
    )
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device)
    dh = torch.randn(h.shape, generator=gen).to(h.device)
    grads = torch.autograd.grad((o.float() * do).sum() + (h * dh).sum(), list(x.values()), materialize_grads=True)
    return {"o": o, "state": h, **{f"d{n}": gr for n, gr in zip(x, grads)}}


CPU_CASES = {  # B, T, H, HV, K, V
    "B2-T70-H2-K16-V32": (2, 70, 2, 2, 16, 32),
    "B1-T64-H2-K32-V16": (1, 64, 2, 2, 32, 16),
    "B1-T130-H1-HV2-K32-V16": (1, 130, 1, 2, 32, 16),
    "B1-T70-H2-HV6-K16-V16": (1, 70, 2, 6, 16, 16),
    "B2-T1-H1-K16-V16": (2, 1, 1, 1, 16, 16),
}


@interpreter
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_triton_matches_reference_cpu(op, case):
    B, T, H, HV, K, V = CPU_CASES[case]
    x = make_inputs(B, T, H, K, V, HV=HV, seed=list(CPU_CASES).index(case))
    got = outputs_and_grads(op, x, "triton")
    ref = outputs_and_grads(op, x, "torch")
    assert got["o"].dtype == torch.float32 and got["state"].dtype == torch.float32
    assert_rel_rms(got, ref, 2e-5, 2e-5)


@interpreter
@pytest.mark.parametrize("cu", [None, [0, 5, 75, 140]], ids=["batch", "varlen"])
def test_backward_reads_the_forwards_A_bitwise_as_recomputing_it_cpu(cu):
    """The delta rule's forward keeps A (as fla does) and the backward's prep reads it instead of
    forming k k^T and inverting again: the same gradients, bit for bit."""
    B, T, H, HV, K, V = (2, 70, 1, 2, 16, 16) if cu is None else (1, 140, 1, 2, 16, 16)
    cu = None if cu is None else torch.tensor(cu)
    x = make_inputs(B, T, H, K, V, HV=HV, N=B if cu is None else 3, seed=3)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    chunks = triton_chunk._chunks_of(q.shape[0], T, cu)
    o, ht, split, A, _, _ = triton_chunk._fwd(q, k, v, g, beta, K**-0.5, h0, True, chunks, keep_A=True)
    assert A is not None and A.shape == (B, T, HV, triton_chunk.CHUNK) and not A.isnan().any()
    assert triton_chunk._fwd(q, k, v, g, beta, K**-0.5, h0, True, chunks)[3] is None
    gen = torch.Generator().manual_seed(4)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    read = triton_chunk._bwd(q, k, v, g, beta, K**-0.5, h0, do, dht, chunks, split, A)
    again = triton_chunk._bwd(q, k, v, g, beta, K**-0.5, h0, do, dht, chunks, split, None)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), read, again):
        assert torch.equal(a, b), name


@interpreter
def test_forward_keeps_A_only_when_a_backward_can_follow_cpu(monkeypatch):
    """A is kept for the backward with grad enabled and an input that needs one; not under
    no_grad (where autograd's needs_input_grad still reads True), nor for simple GLA."""
    seen = []
    real_fwd = triton_chunk._fwd

    def spy(*args, **kwargs):
        out = real_fwd(*args, **kwargs)
        seen.append(out[3] is not None)
        return out

    monkeypatch.setattr(triton_chunk, "_fwd", spy)
    x = {n: t.requires_grad_() for n, t in make_inputs(1, 70, 1, 16, 16, HV=2, seed=6).items()}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    la.gated_delta_rule(*args, backend="triton")
    with torch.no_grad():
        la.gated_delta_rule(*args, backend="triton")
    la.simple_gla(*args[:4], backend="triton")
    assert seen == [True, False, False]


@interpreter
@pytest.mark.parametrize("split", [False, True])
def test_simple_gla_backward_from_the_forwards_prep_is_bitwise_the_same_cpu(split, monkeypatch):
    """GLA_KEEP_P: the backward takes the forward's gam and P instead of running the prep kernel
    again (it runs once per forward+backward, not twice), with bitwise the same results; under
    no_grad nothing is kept."""
    cu = torch.tensor([0, 70, 75, 200])
    x = make_inputs(1, 200, 1, 16, 32, HV=2, N=3, seed=23)
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", 1 if split else None)
    preps, kept = [], []
    real_prep, real_fwd = triton_chunk._prep, triton_chunk._fwd
    monkeypatch.setattr(triton_chunk, "_prep", lambda *a, **kw: preps.append(1) or real_prep(*a, **kw))

    def fwd(*a, **kw):
        out = real_fwd(*a, **kw)
        kept.append(out[4] is not None)
        return out

    monkeypatch.setattr(triton_chunk, "_fwd", fwd)
    runs = {}
    for keep in (True, False):
        monkeypatch.setattr(triton_chunk, "GLA_KEEP_P", keep)
        preps.clear()
        runs[keep] = outputs_and_grads("simple_gla", x, "triton", cu_seqlens=cu)
        assert len(preps) == (1 if keep else 2)
    assert kept == [True, False]
    for name in runs[True]:
        assert torch.equal(runs[True][name], runs[False][name]), name
    monkeypatch.setattr(triton_chunk, "GLA_KEEP_P", True)
    with torch.no_grad():
        la.simple_gla(x["q"], x["k"], x["v"], x["g"], backend="triton", cu_seqlens=cu)
    assert kept == [True, False, False]


@interpreter
@pytest.mark.parametrize("op, light", [("gated_delta_rule", False), ("simple_gla", True), ("simple_gla", False)],
                         ids=["gated_delta_rule", "simple_gla-light", "simple_gla-whole"])
@pytest.mark.parametrize("split", [False, True])
def test_backward_from_the_forwards_chunk_states_is_bitwise_the_same_cpu(op, light, split, monkeypatch):
    """KEEP_STATES: the forward's last sweep writes the chunk states h (and the delta rule's U)
    beside o (under simple GLA's light sweeps: for the prep kernel, which forms o from them) and
    the backward reads them, so the forward sweep runs once per forward+backward where the
    backward would run it again; with GDN_KEEP_PREP the delta rule's backward also takes the
    forward's gam, P and w, and its prep kernel runs once, not twice. Bitwise the same results in
    every form, packed, with grouped value heads, split or not; under no_grad nothing is kept."""
    cu = torch.tensor([0, 70, 75, 200])
    x = make_inputs(1, 200, 1, 16, 32, HV=2, N=3, seed=29)
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", 1 if split else None)
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", light)
    monkeypatch.setattr(triton_chunk, "SPLIT_MAX_PROGRAMS", {**triton_chunk.SPLIT_MAX_PROGRAMS, "gla": 256, "gdn": 32})
    gdn = op == "gated_delta_rule"
    key = "gdn" if gdn else "gla"
    sweeps, kept, preps = [], [], []
    real_sweep, real_fwd, real_prep = triton_chunk._sweep_fwd, triton_chunk._fwd, triton_chunk._prep

    def sweep(*a, **kw):  # the sweeps that write the chunk states, and whether o beside them
        if kw.get("h") is not None:
            sweeps.append(kw.get("o") is not None)
        return real_sweep(*a, **kw)

    def fwd(*a, **kw):
        out = real_fwd(*a, **kw)
        kept.append((out[5] is not None, out[4] is not None and gdn))
        return out

    monkeypatch.setattr(triton_chunk, "_sweep_fwd", sweep)
    monkeypatch.setattr(triton_chunk, "_fwd", fwd)
    monkeypatch.setattr(triton_chunk, "_prep", lambda *a, **kw: preps.append(kw.get("want_u", True)) or real_prep(*a, **kw))
    runs = {}
    forms = [(True, True), (True, False), (False, True)] if gdn else [(True, True), (False, True)]
    for keep_states, keep_prep in forms:  # (False, True): the delta rule keeps no prep without states
        monkeypatch.setattr(triton_chunk, "KEEP_STATES", {**triton_chunk.KEEP_STATES, key: keep_states})
        monkeypatch.setattr(triton_chunk, "GDN_KEEP_PREP", keep_prep)
        sweeps.clear(), kept.clear(), preps.clear()
        runs[keep_states, keep_prep] = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
        if light:  # the forward's, always (o is formed from h), and without KEEP_STATES the backward's again
            assert sweeps == [False] * (1 if keep_states else 2)
        else:
            assert sweeps == [keep_states]  # once: in the forward beside o, or in the backward alone
        assert kept == [(keep_states, gdn and keep_states and keep_prep)]
        if gdn:  # the forward's prep writes u; the backward's, where it runs, only without states
            assert preps == [True] + ([] if keep_states and keep_prep else [not keep_states])
        else:
            assert preps == [True]  # GLA_KEEP_P
    for form in forms[1:]:
        for name in runs[forms[0]]:
            assert torch.equal(runs[forms[0]][name], runs[form][name]), (form, name)
    monkeypatch.setattr(triton_chunk, "KEEP_STATES", {"gla": True, "gdn": True})
    monkeypatch.setattr(triton_chunk, "GDN_KEEP_PREP", True)
    kept.clear()
    args = [x["q"], x["k"], x["v"], x["g"]] + ([x["beta"]] if gdn else [])
    with torch.no_grad():
        getattr(la, op)(*args, backend="triton", cu_seqlens=cu)
    assert kept == [(False, False)]


@interpreter
@pytest.mark.parametrize("op, light", [("gated_delta_rule", False), ("simple_gla", True), ("simple_gla", False)],
                         ids=["gated_delta_rule", "simple_gla-light", "simple_gla-whole"])
@pytest.mark.parametrize("split", [False, True])
def test_chunk_states_written_by_tma_are_bitwise_the_plain_stores_cpu(op, light, split, monkeypatch):
    """STATES_TMA: the sweeps write h (forward) and dh (backward) through TMA descriptors over
    [NT * HV * K, V] in [BK, BV] blocks (the interpreter takes them as the GPU does). True: every
    sweep writing them; "whole": only the forward sweeps holding whole [K, V] states; False (the
    default): none. Bitwise the same outputs and gradients in every form, packed with grouped
    heads, split or not, and each form writes through exactly the descriptors it names (a block
    that does not tile K exactly, K 24 in [32, BV] blocks, falls back to plain stores)."""
    cu = torch.tensor([0, 70, 75, 200])
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", 1 if split else None)
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", light)
    monkeypatch.setattr(triton_chunk, "SPLIT_MAX_PROGRAMS", {**triton_chunk.SPLIT_MAX_PROGRAMS, "gla": 256, "gdn": 32})
    made = []
    real = triton_chunk._states_desc

    def desc(h, BK, BV, q, backward=False):
        d = real(h, BK, BV, q, backward)
        if h is not None:
            made.append((backward, BK == h.shape[2] and BV == h.shape[3], d is not None))
        return d

    monkeypatch.setattr(triton_chunk, "_states_desc", desc)
    for K in (16, 24):
        x = make_inputs(1, 200, 1, K, 32, HV=2, N=3, seed=31)
        runs = {}
        for form in (False, True, "whole"):
            monkeypatch.setattr(triton_chunk, "STATES_TMA", form)
            made.clear()
            runs[form] = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
            assert made and {m[0] for m in made} == {False, True}  # h and dh both written
            for backward, whole, used in made:
                tiles = K == 16  # the blocks are [16 or 32, BV]: K 24 pads to 32
                assert used == (tiles and (form is True or (form == "whole" and whole and not backward))), (form, made)
            if K == 16 and (form is True or (form == "whole" and op == "simple_gla" and not light and split)):
                assert any(used for _, _, used in made), made  # simple GLA's split: whole states
        for form in (True, "whole"):
            for name in runs[False]:
                assert torch.equal(runs[False][name], runs[form][name]), (K, form, name)


@interpreter
@pytest.mark.parametrize("given_by", ["probe", "CONFIGS"])
def test_chunk_backward_configs_with_stages_reach_both_halves_cpu(given_by, monkeypatch):
    """A chunk-backward config with num_stages and maxnreg, as probe_gla_configs.py's
    chunk_<BV>x<warps>s<stages>r<maxnreg> gives it (replacing _chunk_bwd_config) or as
    CONFIGS["chunk_bwd"] does, reaches both kernels of the delta rule's two-kernel backward as
    launch options; the interpreter ignores them, so the results are bitwise the default's."""
    x = make_inputs(1, 130, 1, 16, 32, HV=2, seed=61)
    default = outputs_and_grads("gated_delta_rule", x, "triton")
    options = []
    for name in ("_bwd_chunk_kernel", "_bwd_chunk_gdn_w_kernel"):
        kernel = getattr(triton_chunk, name)

        class Spy:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    options.append((self.name, kwargs.get("num_stages"), kwargs.get("maxnreg")))
                    kwargs.pop("maxnreg", None)  # the interpreter takes no register cap
                    return self.kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(triton_chunk, name, Spy(kernel, name))
    BV, warps = triton_chunk._chunk_bwd_config(16, 32)[:2]  # the default's blocks: the same sums
    if given_by == "probe":
        monkeypatch.setattr(triton_chunk, "_chunk_bwd_config", lambda K, V: (BV, warps, 2, 128))
    else:
        monkeypatch.setitem(triton_chunk.CONFIGS, "chunk_bwd", (*triton_chunk.CONFIGS["chunk_bwd"][:2], 2, 128))
    got = outputs_and_grads("gated_delta_rule", x, "triton")
    assert options == [("_bwd_chunk_kernel", 2, 128), ("_bwd_chunk_gdn_w_kernel", 2, 128)]
    for name in default:
        assert torch.equal(default[name], got[name]), name


@interpreter
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("case", ["B2-T128", "varlen-64-0-128", "varlen-64-70"])
def test_output_written_by_tma_is_bitwise_the_plain_stores_cpu(op, split, case, monkeypatch):
    """O_TMA: the forward sweeps forming o write it through a descriptor over [B * T, HV, V] in
    [C, 1, BV] blocks, only where every sequence's length is a multiple of the chunk (a block store
    writes a short last chunk's rows, which belong to the next sequence); True: at every such
    sweep, "whole": where it holds whole [K, V] states. Bitwise the same outputs and gradients,
    with the states' descriptors too (STATES_TMA True), and no descriptor where a length is not a
    multiple of the chunk (here 70)."""
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", 1 if split else None)
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", False)
    monkeypatch.setattr(triton_chunk, "SPLIT_MAX_PROGRAMS", {**triton_chunk.SPLIT_MAX_PROGRAMS, "gla": 256, "gdn": 32})
    if case == "B2-T128":
        cu, x = None, make_inputs(2, 128, 1, 16, 32, HV=2, seed=41)
    else:
        lengths = [int(n) for n in case.split("-")[1:]]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        x = make_inputs(1, sum(lengths), 1, 16, 32, HV=2, N=len(lengths), seed=41)
    aligned = case != "varlen-64-70"
    made = []
    real = triton_chunk._out_desc

    def desc(o, BK, BV, q, whole_chunks):
        d = real(o, BK, BV, q, whole_chunks)
        if o is not None:
            made.append((whole_chunks, BK == q.shape[3] and BV == o.shape[3], d is not None))
        return d

    monkeypatch.setattr(triton_chunk, "_out_desc", desc)
    runs = {}
    for form, states in ((False, False), (True, False), ("whole", False), (True, True)):
        monkeypatch.setattr(triton_chunk, "O_TMA", form)
        monkeypatch.setattr(triton_chunk, "STATES_TMA", states)
        made.clear()
        runs[form, states] = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
        assert made and all(m[0] == aligned for m in made)  # the forward's sweep forming o, told the lengths
        for whole_chunks, whole, used in made:
            assert used == (whole_chunks and (form is True or (form == "whole" and whole))), (form, made)
        if form is True:
            assert any(used for _, _, used in made) == aligned
    for form in list(runs)[1:]:
        for name in runs[False, False]:
            assert torch.equal(runs[False, False][name], runs[form][name]), (form, name)


@interpreter
@pytest.mark.parametrize("segment_chunks", [None, 1])
@pytest.mark.parametrize("case", ["B2-T130-H2-K16-V32", "varlen-H1-HV2-K32-V16", "B2-T19-H2-HV4-K16-V16-strong-decay"])
def test_gated_delta_rule_chunk_backward_in_two_kernels_cpu(case, segment_chunks, monkeypatch):
    """GDN_SPLIT_CHUNK_BWD: the delta rule's per-chunk backward as simple GLA's kernel over U and
    then the terms through w and u (_bwd_chunk_gdn_w_kernel, in place on dk and dg), against the
    fused kernel and the reference: every gradient (batch, packed with empty and length-1
    sequences, grouped heads, unsplit and split, initial and final states; and a decay strong
    enough that e^(-gam) overflows on the padded rows of a short chunk unless masked there)."""
    if case.startswith("varlen"):
        cu = torch.tensor([0, 70, 70, 71, 200])
        x = make_inputs(1, 200, 1, 32, 16, HV=2, N=4, seed=47)
    elif case.endswith("strong-decay"):
        cu = None
        x = make_inputs(2, 19, 2, 16, 16, HV=4, seed=47)
        x["g"] = x["g"] * 200  # gam down to about -100 within the chunk
    else:
        cu = None
        x = make_inputs(2, 130, 2, 16, 32, seed=47)
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", segment_chunks)
    launched = []
    real = triton_chunk._chunk_bwd_gdn_w
    monkeypatch.setattr(triton_chunk, "_chunk_bwd_gdn_w", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    runs = {}
    for split in (True, False):
        monkeypatch.setattr(triton_chunk, "GDN_SPLIT_CHUNK_BWD", split)
        runs[split] = outputs_and_grads("gated_delta_rule", x, "triton", cu_seqlens=cu)
    assert launched == [1]
    assert_rel_rms(runs[True], runs[False], 1e-5, 1e-5)  # fp32: the same terms, summed in another order
    assert_rel_rms(runs[True], outputs_and_grads("gated_delta_rule", x, "torch", cu_seqlens=cu), 2e-5, 2e-5)


@interpreter
def test_gradient_of_the_initial_state_alone_cpu():
    """Only the initial state needs a gradient: the forward keeps no A and the backward forms it."""
    x = make_inputs(1, 70, 1, 16, 16, HV=2, seed=5)
    h0 = x["initial_state"].clone().requires_grad_()
    grads = {}
    for backend in ("triton", "torch"):
        o, ht = la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                    output_final_state=True, backend=backend)
        grads[backend] = torch.autograd.grad(o.square().sum() + ht.sum(), h0)[0]
    assert rel_rms(grads["triton"], grads["torch"]) < 2e-5


@interpreter
@pytest.mark.parametrize("op", OPS)
def test_varlen_with_empty_and_length_one_segments_cpu(op):
    lengths = [0, 1, 64, 70, 0, 5]
    T, H, HV, K, V = sum(lengths), 1, 2, 16, 16
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make_inputs(1, T, H, K, V, HV=HV, N=len(lengths), seed=7)
    got = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
    ref = outputs_and_grads(op, x, "torch", cu_seqlens=cu)
    assert_rel_rms(got, ref, 2e-5, 2e-5)
    # an empty segment passes its initial state through, and its gradient back
    for n in (0, 4):
        torch.testing.assert_close(got["state"][n], x["initial_state"][n])


@interpreter
def test_packed_batch_is_read_to_the_host_once_per_tensor_cpu(monkeypatch):
    """The layers of one step share their batch's cu_seqlens: only the first call reads it to
    the host (a sync) and builds the chunk index. A write to it in place is seen."""
    op, T, H, HV, K, V = "gated_delta_rule", 150, 1, 2, 16, 16
    cu = torch.tensor([0, 20, 100, 150])
    reads, tolist = [], torch.Tensor.tolist

    def spy(self):
        reads.append(self is cu)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    x = make_inputs(1, T, H, K, V, HV=HV, N=3, seed=11)
    first = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
    second = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
    assert sum(reads) == 1
    assert all(torch.equal(second[n], first[n]) for n in first)
    assert_rel_rms(first, outputs_and_grads(op, x, "torch", cu_seqlens=cu.clone()), 2e-5, 2e-5)
    cu[1:3] = torch.tensor([70, 80])  # the host copy and the chunk index of the old values are stale now
    moved = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
    assert sum(reads) == 2
    assert_rel_rms(moved, outputs_and_grads(op, x, "torch", cu_seqlens=cu.clone()), 2e-5, 2e-5)
    assert rel_rms(moved["o"], first["o"]) > 1e-2  # the check above can tell the two apart


SPLIT_CASES = {  # B, T, H, HV, K, V, lengths (packed) or None
    "B2-T200-H1-HV2-K16-V32": (2, 200, 1, 2, 16, 32, None),
    "varlen-130-0-1-200-H1-HV2-K32-V16": (1, 331, 1, 2, 32, 16, [130, 0, 1, 200]),
}


@interpreter
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(SPLIT_CASES))
@pytest.mark.parametrize("segment_chunks", [1, 2])
def test_sequence_split_matches_reference_cpu(op, case, segment_chunks, monkeypatch):
    """Sequences cut into segments of 1 or 2 chunks (the last shorter, an empty sequence one
    empty segment): forward, final state and every gradient, initial state included."""
    B, T, H, HV, K, V, lengths = SPLIT_CASES[case]
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make_inputs(B, T, H, K, V, HV=HV, N=B if lengths is None else len(lengths), seed=5)
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", segment_chunks)
    scans = []
    real_scan = triton_chunk._scan
    monkeypatch.setattr(triton_chunk, "_scan", lambda *a, **kw: scans.append(kw["reverse"]) or real_scan(*a, **kw))
    got = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
    assert scans == [False, True]  # the split ran, forward and backward
    ref = outputs_and_grads(op, x, "torch", cu_seqlens=cu)
    assert_rel_rms(got, ref, 2e-5, 2e-5)


def _close_bits(a, b):
    """Equal to fp32 rounding: the interpreter's numpy products may order a sum by the block's
    shape (bitwise on one CPU, not on another: an AMD EPYC's BLAS differs from the CI's)."""
    return torch.allclose(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())


@interpreter
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("form", [True, False, "unsplit"])
def test_simple_gla_dv_from_the_chunk_kernel_is_bitwise_the_sweeps_cpu(form, split, monkeypatch):
    """GLA_DV_FROM_DH: simple GLA's dv formed by the chunk kernel from P and dh, or by the reverse
    sweep (unsplit and split, packed, with both states): every result bitwise the same (dv to fp32
    rounding where this CPU's numpy orders the two forms' products differently), and the
    form that ran is the one asked for ("unsplit": the chunk kernel only without the split).
    Over whole key dims (GLA_LIGHT_SWEEPS False), where the reverse sweep can form dv."""
    cu = torch.tensor([0, 70, 75, 200])
    x = make_inputs(1, 200, 1, 16, 32, HV=2, N=3, seed=21)
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", 1 if split else None)
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", False)  # the light sweeps always take the chunk kernel's
    monkeypatch.setattr(triton_chunk, "SPLIT_MAX_PROGRAMS", {**triton_chunk.SPLIT_MAX_PROGRAMS, "gla": 256 if split else 0, "gdn": 0})
    forms = []
    real = triton_chunk._chunk_bwd
    monkeypatch.setattr(triton_chunk, "_chunk_bwd", lambda *a, **kw: forms.append(kw["P"] is not None) or real(*a, **kw))
    monkeypatch.setattr(triton_chunk, "GLA_DV_FROM_DH", form)
    got = outputs_and_grads("simple_gla", x, "triton", cu_seqlens=cu)
    assert forms == [form is True or (form == "unsplit" and not split)]
    monkeypatch.setattr(triton_chunk, "GLA_DV_FROM_DH", not forms[0])
    other = outputs_and_grads("simple_gla", x, "triton", cu_seqlens=cu)
    assert forms == [forms[0], not forms[0]]
    for name in got:
        assert torch.equal(got[name], other[name]) or name == "dv" and _close_bits(got[name], other[name]), name
    assert_rel_rms(got, outputs_and_grads("simple_gla", x, "torch", cu_seqlens=cu), 2e-5, 2e-5)


@interpreter
@pytest.mark.parametrize("op", OPS)
def test_sequence_split_without_initial_or_final_state_cpu(op, monkeypatch):
    """The split's scans with no state to start from and no final state to return."""
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", 1)
    x = make_inputs(1, 150, 1, 16, 16, seed=12)
    args = {n: t.detach().clone().requires_grad_() for n, t in x.items() if n != "initial_state"}
    args_ref = {n: t.detach().clone().requires_grad_() for n, t in args.items()}
    if op == "simple_gla":
        args.pop("beta"), args_ref.pop("beta")
    o, h = getattr(la, op)(**args, backend="triton")
    o_ref, _ = getattr(la, op)(**args_ref, backend="torch")
    assert h is None
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((o * do).sum(), list(args.values()))
    grads_ref = torch.autograd.grad((o_ref * do).sum(), list(args_ref.values()))
    assert_rel_rms({"o": o, **dict(zip(args, grads))}, {"o": o_ref, **dict(zip(args, grads_ref))}, 2e-5, 2e-5)


@interpreter
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("keep_states", [True, False])
def test_wide_v_blocks_where_programs_exceed_the_sms_cpu(op, keep_states, monkeypatch):
    """More sequence-heads x V blocks than SMs: the recurrences take CONFIGS["seq_wide"]'s wider
    V block (the delta rule; "seq_wide_gla" simple GLA's: fewer waves of the same sequential
    steps); results match the reference."""
    monkeypatch.setattr(triton_chunk, "_num_sms", lambda device: 4)
    monkeypatch.setattr(triton_chunk, "SPLIT_MAX_PROGRAMS", {**triton_chunk.SPLIT_MAX_PROGRAMS, "gla": 0, "gdn": 0})
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", False)  # simple GLA over whole key dims
    monkeypatch.setattr(triton_chunk, "CONFIGS", {**triton_chunk.CONFIGS, "seq": (16, 4), "seq_wide": (32, 4),
                                                  "seq_wide_gla": (64, 8)})
    gdn = op == "gated_delta_rule"
    wide = (32, 4) if gdn else (32, 8)  # simple GLA's 64 is cut to V's 32
    assert triton_chunk._seq_config(16, 32, 2, "cpu", gdn=gdn) == (16, 4)  # 4 programs: one wave
    assert triton_chunk._seq_config(16, 32, 3, "cpu", gdn=gdn) == wide  # 6 programs at BV 16
    assert triton_chunk._seq_config(256, 32, 3, "cpu", gdn=gdn) == (16, 4)  # key head dim 256 keeps BV
    assert triton_chunk._seq_config(16, 128, 3, "cpu", gdn=False) == (64, 8)  # whole states for simple GLA
    assert triton_chunk._seq_config(16, 128, 3, "cpu", gdn=True) == (32, 4)
    # packed sequences: the delta rule's "seq_wide_varlen" (8 warps on the H200: no spill), simple GLA's unchanged
    monkeypatch.setitem(triton_chunk.CONFIGS, "seq_wide_varlen", (32, 8))
    assert triton_chunk._seq_config(16, 32, 3, "cpu", gdn=gdn, varlen=True) == ((32, 8) if gdn else wide)
    assert triton_chunk._seq_config(16, 32, 2, "cpu", gdn=gdn, varlen=True) == (16, 4)  # one wave: "seq"
    configs = []
    real = triton_chunk._sweep_fwd
    def sweep(layout, config, *a, **kw):
        configs.append(config)
        return real(layout, config, *a, **kw)

    monkeypatch.setattr(triton_chunk, "_sweep_fwd", sweep)
    monkeypatch.setattr(triton_chunk, "KEEP_STATES", {"gla": keep_states, "gdn": keep_states})
    x = make_inputs(3, 70, 1, 16, 32, seed=13)
    got = outputs_and_grads(op, x, "triton")
    # the forward's, and without KEEP_STATES the backward's sweep writing the chunk states again
    assert configs == [wide] * (1 if keep_states else 2)
    assert_rel_rms(got, outputs_and_grads(op, x, "torch"), 2e-5, 2e-5)
    # the same three sequences packed: the delta rule's recurrences take "seq_wide_varlen"
    configs.clear()
    xv = make_inputs(1, 210, 1, 16, 32, N=3, seed=14)
    cu = torch.tensor([0, 70, 140, 210])
    got = outputs_and_grads(op, xv, "triton", cu_seqlens=cu)
    assert configs == [(32, 8) if gdn else wide] * (1 if keep_states else 2)
    assert_rel_rms(got, outputs_and_grads(op, xv, "torch", cu_seqlens=cu), 2e-5, 2e-5)


def test_sequence_split_plan(monkeypatch):
    """Few sequence-heads on long sequences are split (simple GLA), into segments of
    >= MIN_SEGMENT_CHUNKS chunks; enough of them already fill the GPU and are not; the delta
    rule splits only under SPLIT_MAX_PROGRAMS["gdn"] unsplit programs (the TP=8 shape).
    Simple GLA's whole-key-dim recurrences (GLA_LIGHT_SWEEPS False; "short" takes them past
    LIGHT_MAX_CHUNKS chunks); test_light_sweeps_split_plan has the light sweeps'."""
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", False)

    def plan(B, T, HV, lengths=None, gdn=False):
        cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        chunks = triton_chunk._Chunks(B, T, cu)
        return triton_chunk._plan_segments(chunks, 128, HV, 128, "cpu", gdn)

    assert plan(1, 32768, 16, gdn=True) is None  # 64 programs at BV 32
    # the TP=8 shape, B1-T8192 with 4 value heads: the delta rule in 8 x 16 chunks (16 programs
    # per segment at its split BV 32), simple GLA in 32 x 4 (4 programs per segment at BV 128):
    # 128 programs each, one wave
    for gdn, n in ((True, 16), (False, 4)):
        counts = (plan(1, 8192, 4, gdn=gdn).layout.cu.diff()).tolist()
        assert counts == [n * triton_chunk.CHUNK] * (128 // n)

    seg = plan(1, 32768, 16)
    assert seg is not None and seg.N == 1
    counts = (seg.layout.cu[1:] - seg.layout.cu[:-1]).tolist()
    assert sum(counts) == 32768 and len(counts) > 4
    assert min(counts[:-1]) >= triton_chunk.MIN_SEGMENT_CHUNKS * triton_chunk.CHUNK
    # equal segments in one wave: 8 x 64 chunks, 128 programs on the H200's 132 SMs
    assert counts == [64 * triton_chunk.CHUNK] * 8
    for B, T, lengths, first in ((4, 8192, None, [0, 2, 4, 6, 8]), (1, 32768, [8192, 8192, 16384], [0, 2, 4, 8])):
        seg = plan(B, T, 16, lengths=lengths)  # not 63 + 63 + 2 chunks per 8192 tokens (192 programs)
        counts = (seg.layout.cu[1:] - seg.layout.cu[:-1]).tolist()
        assert counts == [64 * triton_chunk.CHUNK] * 8 and seg.first.tolist() == first
    assert plan(4, 8192, 16) is not None  # 256 programs at BV 32: still split
    assert plan(16, 8192, 32) is None  # 16 x 32 x 4 programs: no split
    assert plan(1, 256, 2) is None  # 4 chunks: no shorter segment
    seg = plan(1, 20000, 2, lengths=[100, 19900])  # only the long sequence is cut
    assert seg.first.tolist()[:2] == [0, 1] and seg.layout.N > 2
    assert seg.layout.offsets.tolist()[:2] == [0, 2]  # chunk numbers stay global


@interpreter
@pytest.mark.parametrize("segment_chunks", [None, 1, 2])
@pytest.mark.parametrize("lengths", [None, [70, 0, 1, 129]], ids=["batch", "varlen"])
def test_light_sweeps_take_blocks_of_the_key_dim_cpu(segment_chunks, lengths, monkeypatch):
    """Simple GLA's light sweeps (GLA_LIGHT_SWEEPS) in [BK, BV] = [16, 16] blocks of K 32 and V 48
    (2 x 3 programs per sequence-head), gam formed in the sweep from g, o by the prep kernel from
    the chunk states, dv by the chunk kernel from dh: output, final state and every gradient
    against the reference, unsplit and split, batched and packed with empty and length-1
    sequences, grouped value heads."""
    monkeypatch.setattr(triton_chunk, "CONFIGS", {**triton_chunk.CONFIGS, "light": (16, 4, 16)})
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", segment_chunks)
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", True)
    B, T = (2, 150) if lengths is None else (1, sum(lengths))
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make_inputs(B, T, 1, 32, 48, HV=2, N=B if lengths is None else len(lengths), seed=31)
    grids, rgrids, chunk_P = [], [], []
    real_sweep, real_rsweep, real_chunk = triton_chunk._sweep_fwd, triton_chunk._sweep_bwd, triton_chunk._chunk_bwd

    def sweep(layout, config, *a, **kw):
        grids.append((config, kw.get("o") is None, kw.get("gam_from_g")))
        return real_sweep(layout, config, *a, **kw)

    def rsweep(layout, config, *a, **kw):
        rgrids.append(config)
        return real_rsweep(layout, config, *a, **kw)

    monkeypatch.setattr(triton_chunk, "_sweep_fwd", sweep)
    monkeypatch.setattr(triton_chunk, "_sweep_bwd", rsweep)
    monkeypatch.setattr(triton_chunk, "_chunk_bwd", lambda *a, **kw: chunk_P.append(kw["P"] is not None) or real_chunk(*a, **kw))
    got = outputs_and_grads("simple_gla", x, "triton", cu_seqlens=cu)
    blocks = (16, 4, 16)
    assert grids and all(g == (blocks, True, True) for g in grids)
    assert len(grids) == (1 if segment_chunks is None else 2)  # the split's first pass and its last
    assert rgrids == [blocks] * len(grids) and chunk_P == [True]
    assert_rel_rms(got, outputs_and_grads("simple_gla", x, "torch", cu_seqlens=cu), 2e-5, 2e-5)


@interpreter
@pytest.mark.parametrize("op, light, split_bwd", [("gated_delta_rule", False, True), ("gated_delta_rule", False, False),
                                                  ("simple_gla", True, False), ("simple_gla", False, False)],
                         ids=["gated_delta_rule-two-kernels", "gated_delta_rule-one-kernel", "simple_gla-light",
                              "simple_gla-whole"])
@pytest.mark.parametrize("case", ["B1-T130-H1-HV2-K32-V16", "B1-T70-H2-HV6-K16-V16", "varlen"])
def test_grouped_heads_summed_in_the_chunk_kernel_cpu(op, light, split_bwd, case, monkeypatch):
    """FUSE_GROUP_SUM: the chunk kernel takes a q/k head's value heads in turn and sums their dq
    and dk in fp32 (no _group_sum pass), forced here for both ops at any size (simple GLA with its
    light sweeps, the chunk kernel then forming dv too, and over whole key dims; the delta rule's
    backward in two kernels, both summing groups, and in one): every output and gradient against
    the reference and against the per-value-head copies summed afterwards."""
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", light)
    monkeypatch.setattr(triton_chunk, "GDN_SPLIT_CHUNK_BWD", split_bwd)
    launched = []
    real_w = triton_chunk._chunk_bwd_gdn_w
    monkeypatch.setattr(triton_chunk, "_chunk_bwd_gdn_w", lambda *a: launched.append(a[9].shape[2]) or real_w(*a))
    if case == "varlen":
        B, T, H, HV, K, V, cu = 1, 200, 2, 4, 16, 32, torch.tensor([0, 70, 75, 200])
    else:
        (B, T, H, HV, K, V), cu = CPU_CASES[case], None
    x = make_inputs(B, T, H, K, V, HV=HV, N=B if cu is None else 3, seed=41)
    monkeypatch.setattr(triton_chunk, "FUSE_GROUP_MIN_PROGRAMS", 0)
    sums = []
    real = triton_chunk._group_sum
    monkeypatch.setattr(triton_chunk, "_group_sum", lambda *a: sums.append(1) or real(*a))
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(triton_chunk, "FUSE_GROUP_SUM", {"gla": fused, "gdn": fused})
        sums.clear()
        launched.clear()
        runs[fused] = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
        assert len(sums) == (0 if fused else 2)
        # the second kernel's dk: per q/k head where fused, else per value head
        assert launched == ([H if fused else HV] if split_bwd else [])
    assert_rel_rms(runs[True], runs[False], 1e-6, 1e-6)
    assert_rel_rms(runs[True], outputs_and_grads(op, x, "torch", cu_seqlens=cu), 2e-5, 2e-5)


def test_grouped_heads_summed_in_the_chunk_kernel_only_with_programs_to_spare(monkeypatch):
    """The default: both ops sum the groups in the chunk kernel where chunks x q/k heads reach
    FUSE_GROUP_MIN_PROGRAMS (the Qwen shape: 512 x 16), not at TP=8 (128 x 2)."""
    assert triton_chunk.FUSE_GROUP_SUM == {"gla": True, "gdn": True}
    seen = []
    stub_kernels(monkeypatch)
    real = triton_chunk._chunk_bwd
    monkeypatch.setattr(triton_chunk, "_chunk_bwd", lambda *a, **kw: seen.append(a[12].shape[2]) or real(*a, **kw))
    for op, T, H, HV, fused in (("simple_gla", 32768, 16, 32, True), ("simple_gla", 8192, 2, 4, False),
                                ("gated_delta_rule", 32768, 16, 32, True), ("gated_delta_rule", 8192, 2, 4, False)):
        args = shaped_args(op, H, HV, T)
        seen.clear()
        o, _ = getattr(la, op)(*args, backend="triton")
        torch.autograd.grad(o, args, torch.ones_like(o))
        assert seen == [H if fused else HV], (op, T)


def test_light_sweeps_for_short_sequences_only(monkeypatch):
    """GLA_LIGHT_SWEEPS "short": the light sweeps where the longest sequence has at most
    LIGHT_MAX_CHUNKS chunks, the whole-key-dim recurrences past that (on the H200 those were
    faster at 448 and 512 chunks, the light sweeps at 128)."""
    def light(B, T, lengths=None):
        cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        return triton_chunk._gla_light(triton_chunk._Chunks(B, T, cu))

    assert triton_chunk.GLA_LIGHT_SWEEPS == "short" and triton_chunk.LIGHT_MAX_CHUNKS == 256
    assert light(4, 8192) and light(1, 256 * 64) and not light(1, 256 * 64 + 1)
    assert light(1, 32768, [16384, 16384]) and not light(1, 32768, [28672, 4096])
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", False)
    assert not light(4, 8192)
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", True)
    assert light(1, 32768)


def test_light_sweeps_split_plan():
    """The light sweeps split only under SPLIT_MAX_PROGRAMS["gla_light"] unsplit programs, the
    plan's programs being each segment's [BK, BV] blocks (4 per head at K = V = 128), planned for
    SPLIT_LIGHT_PROGRAMS_PER_SM programs per SM."""
    def plan(B, T, HV):
        return triton_chunk._plan_segments(triton_chunk._Chunks(B, T, None), 128, HV, 128, "cpu", False)

    assert plan(4, 8192, 16) is None  # 256 programs unsplit (the H200 has 132 SMs)
    assert plan(1, 8192, 32) is None  # 128
    # the TP=8 shape, B1-T8192 with 4 value heads: 16 programs unsplit, 16 segments of 8 chunks:
    # 256 programs, one wave at 2 per SM
    counts = plan(1, 8192, 4).layout.cu.diff().tolist()
    assert counts == [8 * triton_chunk.CHUNK] * 16


@interpreter
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("split", [37, 64])
def test_two_halves_with_carried_state_equal_one_run_cpu(op, split):
    """Chaining through initial_state/final state: forward and every gradient, both halves."""
    x = make_inputs(2, 100, 2, 16, 16, seed=3)

    def chained(op, x, backend, **kwargs):
        first = {n: t[:, :split] if n != "initial_state" else t for n, t in x.items()}
        def args(part):
            return [part["q"], part["k"], part["v"], part["g"]] + ([part["beta"]] if op == "gated_delta_rule" else [])

        o1, h1 = getattr(la, op)(*args(first), initial_state=x["initial_state"], output_final_state=True, backend=backend)
        second = {n: t[:, split:] for n, t in x.items() if n != "initial_state"}
        o2, h2 = getattr(la, op)(*args(second), initial_state=h1, output_final_state=True, backend=backend)
        return torch.cat([o1, o2], dim=1), h2

    xs = {n: t.clone().requires_grad_() for n, t in x.items() if op != "simple_gla" or n != "beta"}
    o, h = chained(op, xs, "triton")
    gen = torch.Generator().manual_seed(2)
    do, dh = torch.randn(o.shape, generator=gen), torch.randn(h.shape, generator=gen)
    grads = torch.autograd.grad((o * do).sum() + (h * dh).sum(), list(xs.values()))
    whole = outputs_and_grads(op, x, "triton", seed=2)
    got = {"o": o, "state": h, **{f"d{n}": gr for n, gr in zip(xs, grads)}}
    assert_rel_rms(got, whole, 2e-5, 2e-5)


def _l2(x):
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


@interpreter
def test_fla_signature_gated_delta_rule_with_l2norm_in_kernel_cpu():
    x = make_inputs(1, 40, 2, 16, 16, HV=4, seed=5)
    x["q"], x["k"] = 3 * x["q"], 0.5 * x["k"]  # not unit norm: the wrapper normalises
    xs = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, h = la.chunk_gated_delta_rule(
        xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], scale=0.3, initial_state=xs["initial_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, backend="triton",
    )
    xr = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_ref, h_ref = reference.chunk_gated_delta_rule(
        _l2(xr["q"]).repeat_interleave(2, 2), _l2(xr["k"]).repeat_interleave(2, 2), xr["v"], xr["g"],
        xr["beta"], scale=0.3, initial_state=xr["initial_state"], output_final_state=True,
    )
    do = torch.randn_like(o)
    got = torch.autograd.grad((o * do).sum() + h.sum(), list(xs.values()))
    exp = torch.autograd.grad((o_ref * do).sum() + h_ref.sum(), list(xr.values()))
    assert_rel_rms(
        {"o": o, "state": h, **{f"d{n}": t for n, t in zip(xs, got)}},
        {"o": o_ref, "state": h_ref, **{f"d{n}": t for n, t in zip(xr, exp)}}, 2e-5, 2e-5,
    )


@interpreter
@pytest.mark.parametrize("decay", ["g_gamma", "none"])
def test_fla_signature_simple_gla_with_g_gamma_or_no_decay_cpu(decay):
    x = make_inputs(2, 70, 2, 16, 32, seed=6)
    g_gamma = torch.tensor([-0.05, -0.3]) if decay == "g_gamma" else None
    xs = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v")}
    o, h = la.chunk_simple_gla(xs["q"], xs["k"], xs["v"], g_gamma=g_gamma, output_final_state=True, backend="triton")
    g = torch.zeros(2, 70, 2) if g_gamma is None else g_gamma.expand(2, 70, 2)
    xr = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v")}
    o_ref, h_ref = reference.chunk_simple_gla(xr["q"], xr["k"], xr["v"], g, output_final_state=True)
    do = torch.randn_like(o)
    got = torch.autograd.grad((o * do).sum() + h.sum(), list(xs.values()))
    exp = torch.autograd.grad((o_ref * do).sum() + h_ref.sum(), list(xr.values()))
    assert_rel_rms(
        {"o": o, "state": h, **{f"d{n}": t for n, t in zip(xs, got)}},
        {"o": o_ref, "state": h_ref, **{f"d{n}": t for n, t in zip(xr, exp)}}, 2e-5, 2e-5,
    )


@interpreter
def test_no_final_state_returns_none_and_matches_cpu():
    x = make_inputs(1, 20, 1, 16, 16, seed=8)
    o, h = la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="triton")
    o_ref, _ = la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="torch")
    assert h is None
    assert rel_rms(o, o_ref) < 2e-5


BAD = {
    "q-fp64": ({"q": torch.zeros(1, 4, 2, 16, dtype=torch.float64)}, "q"),
    "q-K256": ({"q": torch.zeros(1, 4, 2, 256), "k": torch.zeros(1, 4, 2, 256)}, "q"),
    "k-shape": ({"k": torch.zeros(1, 4, 2, 8)}, "k"),
    "v-heads": ({"v": torch.zeros(1, 4, 3, 16), "g": torch.zeros(1, 4, 3), "beta": torch.zeros(1, 4, 3)}, "v"),
    "g-heads": ({"g": torch.zeros(1, 4, 4)}, "g"),
    "beta-shape": ({"beta": torch.zeros(1, 4)}, "beta"),
    "state-heads": ({"initial_state": torch.zeros(1, 1, 16, 16)}, "initial_state"),
    "cu-batch": ({"cu_seqlens": torch.tensor([0, 4])}, "cu_seqlens"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_inputs_raise_value_error_naming_argument(case):
    args = {"q": torch.zeros(2, 4, 2, 16), "k": torch.zeros(2, 4, 2, 16), "v": torch.zeros(2, 4, 2, 16),
                "g": torch.zeros(2, 4, 2), "beta": torch.zeros(2, 4, 2)}
    override, name = BAD[case]
    if case != "cu-batch":
        args = {n: t[:1] for n, t in args.items()}
    args.update(override)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        la.gated_delta_rule(**args, backend="triton")


def test_simple_gla_takes_key_head_dim_256_and_refuses_512():
    q = torch.zeros(1, 4, 1, 512)
    with pytest.raises(ValueError, match="^q: .*simple GLA.*K <= 256"):
        la.chunk_simple_gla(q, q, q[..., :16], g=torch.zeros(1, 4, 1), backend="triton")


@interpreter
@pytest.mark.parametrize("segment_chunks", [None, 1])
def test_simple_gla_head_dim_256_matches_reference_cpu(segment_chunks, monkeypatch):
    """K = 256 (simple GLA only), T off the chunk, grouped value heads, unsplit and split."""
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", segment_chunks)
    x = make_inputs(1, 130, 1, 256, 32, HV=2, seed=9)
    got = outputs_and_grads("simple_gla", x, "triton")
    ref = outputs_and_grads("simple_gla", x, "torch")
    assert_rel_rms(got, ref, 2e-5, 2e-5)


def test_simple_gla_decay_arguments_are_checked():
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="^g_gamma:"):
        la.chunk_simple_gla(q, q, q, g=torch.zeros(1, 4, 2), g_gamma=torch.zeros(2))
    with pytest.raises(ValueError, match="^g_gamma:"):
        la.chunk_simple_gla(q, q, q, g_gamma=torch.zeros(3))


def test_auto_picks_triton_only_for_16_bit_cuda_tensors():
    """fp32 stays on the reference: the kernels multiply in tf32."""
    cpu = torch.zeros(1, 2, 1, 16)
    assert la._pick("gated_delta_rule", "auto", cpu) is la._BACKENDS["gated_delta_rule"]["torch"]
    assert la._pick("gated_delta_rule", "auto", cpu.half()) is la._BACKENDS["gated_delta_rule"]["torch"]
    if torch.cuda.is_available():
        for dtype in (torch.bfloat16, torch.float16):
            q = cpu.to("cuda", dtype)
            assert la._pick("gated_delta_rule", "auto", q) is la._BACKENDS["gated_delta_rule"]["triton"]
            assert la._pick("simple_gla", "auto", q) is la._BACKENDS["simple_gla"]["triton"]
        for dtype in (torch.float32, torch.float64):
            q = cpu.to("cuda", dtype)
            assert la._pick("gated_delta_rule", "auto", q) is la._BACKENDS["gated_delta_rule"]["torch"]
        q256 = torch.zeros(1, 2, 1, 256, device="cuda", dtype=torch.bfloat16)  # K 256: simple GLA only
        assert la._pick("simple_gla", "auto", q256) is la._BACKENDS["simple_gla"]["triton"]
        assert la._pick("gated_delta_rule", "auto", q256) is la._BACKENDS["gated_delta_rule"]["torch"]


GPU_CASES = {  # B, T, H, HV, K, V, lengths (packed) or None
    "B2-T1000-H4-D128": (2, 1000, 4, 4, 128, 128, None),
    "B1-T1000-H2-HV4-D128": (1, 1000, 2, 4, 128, 128, None),
    "B2-T777-H4-D64": (2, 777, 4, 4, 64, 64, None),
    "varlen-300-0-1-700-64-935-H2-HV4-D128": (1, 2000, 2, 4, 128, 128, [300, 0, 1, 700, 64, 935]),
}


def gpu_inputs(case, seed):
    """(shape fields, inputs in bf16 on the GPU, cu_seqlens or None) of GPU_CASES[case]."""
    B, T, H, HV, K, V, lengths = shape = GPU_CASES[case]
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    x = make_inputs(B, T, H, K, V, HV=HV, N=B if lengths is None else len(lengths), dtype=torch.bfloat16,
                    device="cuda", seed=seed)
    return shape, x, cu


def bf16_against_reference(op, x, cu, label):
    """The Triton op in bf16 against the fp32 reference on the same bf16-rounded values: relative
    RMS error <= 5e-3 for outputs and 1e-2 for gradients, printed under label; (results, errors)."""
    got = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
    ref = outputs_and_grads(op, {n: t.float() for n, t in x.items()}, "torch", cu_seqlens=cu)
    errors = assert_rel_rms(got, ref, 5e-3, 1e-2)
    print(f"\n{op} {label} relative RMS: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    return got, errors


def stub_kernels(monkeypatch):
    """Every Triton kernel of triton_chunk launched as a no-op: what remains is the host side,
    its allocations and the arguments it passes."""
    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for name in ("_prep_kernel", "_recurrence_fwd_kernel", "_recurrence_bwd_kernel", "_bwd_chunk_kernel",
                 "_bwd_chunk_gdn_w_kernel", "_segment_scan_kernel", "_group_sum_kernel"):
        monkeypatch.setattr(triton_chunk, name, Stub())
    # no kernel reads the bf16 tensors these tests pass, so the interpreter's bf16 refusal does not apply
    monkeypatch.setattr(triton_chunk, "_check_interpreter_dtype", lambda q: None)


def shaped_args(op, HQK, HV, T):
    """q, k, v, g (and beta) at B1, D128, bf16, needing gradients: for stubbed kernels, whose
    values do not matter, only shapes and dtypes."""
    args = [torch.empty(1, T, HQK, 128, dtype=torch.bfloat16) for _ in "qk"] + [
        torch.empty(1, T, HV, 128, dtype=torch.bfloat16), torch.empty(1, T, HV)]
    if op == "gated_delta_rule":
        args.append(torch.empty(1, T, HV))
    return [a.requires_grad_() for a in args]


def count_buffers(op, HQK, HV, T, monkeypatch):
    """(peak, held): the kernels' buffers alive at once over a forward+backward, and those alive
    after the forward (o and what it kept for the backward), bytes, counted at every _alloc with
    the kernels stubbed out (B1, D128, bf16)."""
    live, peak = [0], [0]

    def counted(shape, dtype, device):
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        n = t.numel() * t.element_size()
        live[0] += n
        peak[0] = max(peak[0], live[0])
        weakref.finalize(t, lambda: live.__setitem__(0, live[0] - n))
        return t

    monkeypatch.setattr(triton_chunk, "_alloc", counted)
    stub_kernels(monkeypatch)
    args = shaped_args(op, HQK, HV, T)
    o, _ = getattr(la, op)(*args, backend="triton")
    held = live[0]
    torch.autograd.grad(o, args, torch.ones_like(o))
    del o  # and with it the graph and what the forward kept
    assert live[0] == 0
    return peak[0], held


@interpreter
@pytest.mark.parametrize("op, HQK, HV, T, bound, keep_prep", [
    ("simple_gla", 2, 4, 8192, 75.8e6, False), ("gated_delta_rule", 2, 4, 8192, 93e6, False),  # the TP=8 shape
    ("simple_gla", 16, 32, 32768, 2.04e9, False), ("gated_delta_rule", 16, 32, 32768, 2.57e9, False),  # Qwen3-Next's
    ("gated_delta_rule", 2, 4, 8192, 105.3e6, True), ("gated_delta_rule", 16, 32, 32768, 2.97e9, True),
    # the 2.8T flagship's linear layer at 32k tokens (examples/configs/flagship_2p8t.yaml, TP 1)
    ("gated_delta_rule", 32, 64, 32768, 5.13e9, False), ("gated_delta_rule", 32, 64, 32768, 5.94e9, True),
])
def test_backward_peak_memory_cpu(op, HQK, HV, T, bound, keep_prep, monkeypatch):
    """The kernels' buffers alive at once over a forward+backward (B1, D128, bf16), counted at
    every _alloc with the kernels stubbed out. This count gave the allocator's peak above the
    inputs measured on the H200 for the code measured, to within its 512-byte rounding of small
    blocks (simple GLA at TP=8: 82051200 against 82051584 in 16-chunk segments; the delta rule
    96862208 unsplit, 105250816 split; 3099590656 at B1-T32768-HQK16-HV32). Since the backward
    frees its chunk states and the split's segment states ahead of the group sums: at TP=8 79.8
    and 92.7 MB, under fla 0.6.0's 100.9 and 117.9 MB; at the Qwen shape 2.16 and 2.83 GB
    (2.45 and 3.10 before). Simple GLA keeping the forward's P for the backward (GLA_KEEP_P, the
    default since 2026-12-03) counts 2298479104 at the Qwen shape, the H200's peak to the byte
    (fla's 3.23 GB), and 79954432 at TP=8. Keeping the forward's chunk states (KEEP_STATES, the
    default since 2026-12-04) leaves every count the same: the backward held them anyway. The
    delta rule keeping its forward's gam, P and w too (GDN_KEEP_PREP, the default since 2026-12-04) counts
    105250816 at TP=8 and 3233808384 at the Qwen shape (fla's 117.9 MB and 3.77 GB): they stay
    until the backward ends, where the backward's own copies were freed before its last kernel.
    At the flagship's linear layer (HQK32-HV64, 32k tokens) the delta rule counted 5662310400
    (5.27 GiB) and, with GDN_KEEP_PREP, 6467616768 (6.02 GiB); since it sums its grouped heads' dq
    and dk in its chunk kernels too (FUSE_GROUP_SUM, 2026-12-05) 5125439488 and 5930745856 (4.77
    and 5.52 GiB), and at the Qwen shape with GDN_KEEP_PREP 2965372928, the H200's peak to the
    byte (3233808384 before). Simple GLA's light sweeps (the
    default at TP=8, 128 chunks: GLA_LIGHT_SWEEPS "short") count 75759872 there (the H200:
    75760128, against 79954432 over whole key dims): the backward no longer forms dU beside dv.
    Simple GLA summing its grouped heads' dq and dk in the chunk kernel (FUSE_GROUP_SUM, at the
    Qwen shape) counts 2030043648 there, the H200's peak to the byte (2298479104 before)."""
    monkeypatch.setattr(triton_chunk, "GDN_KEEP_PREP", keep_prep)
    peak, _ = count_buffers(op, HQK, HV, T, monkeypatch)
    assert 0 < peak <= bound


@interpreter
@pytest.mark.parametrize("op", OPS)
def test_kept_chunk_states_are_what_the_forward_holds_more_cpu(op, monkeypatch):
    """KEEP_STATES adds exactly the chunk states h ([NT, HV, K, V], bf16) and for the delta rule U
    (v's shape) to what the forward holds for the backward (GDN_KEEP_PREP then adds the prep's
    gam, P and w: fp32 [T, HV], bf16 [T, HV, C] and [T, HV, K]), and nothing to the peak (the Qwen
    shape, B1-T32768-HQK16-HV32-D128: the delta rule holds 0.40 -> 1.21 GB, simple GLA 0.42 ->
    0.95 GB, o included). Where the chunk kernel sums the grouped heads (FUSE_GROUP_SUM, simple
    GLA here) the peak can be where a recomputing backward writes the states, so keeping them
    may lower it."""
    T, HV, K = 32768, 32, 128
    counts = {}
    monkeypatch.setattr(triton_chunk, "GDN_KEEP_PREP", False)
    for keep in (False, True):
        monkeypatch.setattr(triton_chunk, "KEEP_STATES", {"gla": keep, "gdn": keep})
        counts[keep] = count_buffers(op, 16, HV, T, monkeypatch)
    h_bytes = (T // triton_chunk.CHUNK) * HV * K * K * 2
    U_bytes = T * HV * K * 2 if op == "gated_delta_rule" else 0
    assert counts[True][1] - counts[False][1] == h_bytes + U_bytes
    assert counts[True][0] <= counts[False][0]
    gdn = op == "gated_delta_rule"
    if gdn:  # GDN_KEEP_PREP (the default) adds the prep's gam, P and w
        monkeypatch.setattr(triton_chunk, "GDN_KEEP_PREP", True)
        kept = count_buffers(op, 16, HV, T, monkeypatch)
        prep_bytes = T * HV * 4 + T * HV * triton_chunk.CHUNK * 2 + T * HV * K * 2
        assert kept[1] - counts[True][1] == prep_bytes
    # what tools/plan.py counts (kept_bytes_per_token) is what the forward held more: the states
    # and, where kept, the prep (simple GLA's gam and P under GLA_KEEP_P, held in both counts)
    prep_always = 0 if gdn else T * HV * 4 + T * HV * triton_chunk.CHUNK * 2
    assert T * triton_chunk.kept_bytes_per_token(gdn, HV, K, K, 2) == (
        (kept[1] if gdn else counts[True][1]) - counts[False][1] + prep_always
    )


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_triton_bf16_matches_fp32_reference_gpu(op, case):
    _, x, cu = gpu_inputs(case, seed=11)
    # the reference sees the same bf16-rounded values, in fp32
    got, _ = bf16_against_reference(op, x, cu, case)
    assert got["o"].dtype == torch.bfloat16 and got["state"].dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", ["B1-T4000-H2-HV4-D128", "varlen-300-0-1-2700-H2-HV4-D128"])
def test_sequence_split_bf16_matches_fp32_reference_gpu(op, case, monkeypatch):
    """The split on the GPU (segments of 8 chunks, forced): bf16 against the fp32 reference, with
    an initial and a final state, so the scan's products and its reverse run in real kernels."""
    lengths = None if case.startswith("B1") else [300, 0, 1, 2700]
    T = 4000 if lengths is None else sum(lengths)
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    x = make_inputs(1, T, 2, 128, 128, HV=4, N=1 if lengths is None else len(lengths), dtype=torch.bfloat16,
                    device="cuda", seed=13)
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", 8)
    got = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
    ref = outputs_and_grads(op, {n: t.float() for n, t in x.items()}, "torch", cu_seqlens=cu)
    errors = assert_rel_rms(got, ref, 5e-3, 1e-2)
    print(f"\n{op} {case} split relative RMS: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", ["B2-T1000-H4-D128", "varlen-300-0-1-700-64-935-H2-HV4-D128"])
def test_wide_recurrences_bf16_matches_fp32_reference_gpu(op, case, monkeypatch):
    """The unsplit recurrences past one wave (here: with the GPU taken for 2 SMs), as
    B1-T8192-H96 runs them: simple GLA at BV 128 with 8 warps, the delta rule at BV 64; bf16
    against the fp32 reference."""
    (B, T, H, HV, K, V, lengths), x, cu = gpu_inputs(case, seed=17)
    monkeypatch.setattr(triton_chunk, "_num_sms", lambda device: 2)
    monkeypatch.setattr(triton_chunk, "SPLIT_MAX_PROGRAMS", {**triton_chunk.SPLIT_MAX_PROGRAMS, "gla": 0, "gdn": 0})
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", False)  # simple GLA over whole key dims
    gdn = op == "gated_delta_rule"
    N = B if lengths is None else len(lengths)
    expected = ((64, 4) if lengths is None else (64, 8)) if gdn else (128, 8)  # 8 warps packed: no spill
    assert triton_chunk._seq_config(K, V, N * HV, "cuda", gdn=gdn, varlen=lengths is not None) == expected
    bf16_against_reference(op, x, cu, f"{case} wide")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["B2-T1000-H4-D128", "varlen-300-0-1-700-64-935-H2-HV4-D128"])
def test_simple_gla_dv_from_the_chunk_kernel_bf16_gpu(case, monkeypatch):
    """Both forms of simple GLA's dv (GLA_DV_FROM_DH) compiled for the GPU, unsplit: bf16
    against the fp32 reference, and bitwise the same results."""
    _, x, cu = gpu_inputs(case, seed=17)
    monkeypatch.setattr(triton_chunk, "SPLIT_MAX_PROGRAMS", {**triton_chunk.SPLIT_MAX_PROGRAMS, "gla": 0, "gdn": 0})
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", False)  # where the reverse sweep can form dv
    got = {}
    for form in (True, False):
        monkeypatch.setattr(triton_chunk, "GLA_DV_FROM_DH", form)
        got[form] = outputs_and_grads("simple_gla", x, "triton", cu_seqlens=cu)
    for name in got[True]:
        assert torch.equal(got[True][name], got[False][name]), name
    ref = outputs_and_grads("simple_gla", {n: t.float() for n, t in x.items()}, "torch", cu_seqlens=cu)
    assert_rel_rms(got[True], ref, 5e-3, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("light", [True, False])
@pytest.mark.parametrize("segment_chunks", [None, 8])
@pytest.mark.parametrize("case", ["B2-T1000-H4-D128", "varlen-300-0-1-700-64-935-H2-HV4-D128", "B2-T777-H4-D64"])
def test_simple_gla_light_and_whole_sweeps_bf16_gpu(case, segment_chunks, light, monkeypatch):
    """Simple GLA's two forms compiled for the GPU, the light sweeps (K 128 in two blocks of 64)
    and the whole-key-dim recurrences, unsplit and split: bf16 against the fp32 reference."""
    _, x, cu = gpu_inputs(case, seed=37)
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", light)
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", segment_chunks)
    bf16_against_reference("simple_gla", x, cu, f"{case} light {light} segments {segment_chunks}")


@pytest.mark.gpu
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("case", ["B2-T1000-H4-D128", "varlen-300-0-1-700-64-935-H2-HV4-D128", "B2-T777-H4-D64"])
def test_gated_delta_rule_chunk_backward_in_two_kernels_bf16_gpu(case, split, monkeypatch):
    """GDN_SPLIT_CHUNK_BWD both ways compiled for the GPU (Triton 3.6 miscompiles some gated
    backward kernels on Hopper, fla issue #640): bf16 against the fp32 reference."""
    _, x, cu = gpu_inputs(case, seed=53)
    monkeypatch.setattr(triton_chunk, "GDN_SPLIT_CHUNK_BWD", split)
    bf16_against_reference("gated_delta_rule", x, cu, f"{case} split chunk backward {split}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("segment_chunks", [None, 8])
@pytest.mark.parametrize("case", ["B2-T1024-H2-HV4-D128", "varlen-320-0-1024-H2-HV4-D128", "B2-T1000-H4-D128"])
def test_tma_stores_bf16_gpu(op, case, segment_chunks, monkeypatch):
    """STATES_TMA and O_TMA compiled for the GPU (Hopper's bulk tensor stores), every form against
    the plain stores, unsplit and split, with chunk-aligned lengths (where o takes its descriptor)
    and not: bitwise the same in bf16, and bf16 against the fp32 reference."""
    lengths = [320, 0, 1024] if case.startswith("varlen") else None
    B, T = (1, 1344) if lengths else (2, int(case.split("-")[1][1:]))
    H, HV = (2, 4) if "HV4" in case else (4, 4)
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    x = make_inputs(B, T, H, 128, 128, HV=HV, N=len(lengths) if lengths else B, dtype=torch.bfloat16,
                    device="cuda", seed=59)
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", segment_chunks)
    monkeypatch.setattr(triton_chunk, "GLA_LIGHT_SWEEPS", False)
    plain = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
    for form in (True, "whole"):
        monkeypatch.setattr(triton_chunk, "STATES_TMA", form)
        monkeypatch.setattr(triton_chunk, "O_TMA", form)
        got, _ = bf16_against_reference(op, x, cu, f"{case} segments {segment_chunks} TMA {form}")
        for name in plain:
            assert torch.equal(plain[name], got[name]), (form, name)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", ["B1-T1000-H2-HV4-D128", "varlen-300-0-1-700-64-935-H2-HV4-D128"])
def test_grouped_heads_summed_in_the_chunk_kernel_bf16_gpu(op, case, monkeypatch):
    """FUSE_GROUP_SUM forced for both ops at any size, compiled for the GPU: bf16 against the fp32
    reference."""
    _, x, cu = gpu_inputs(case, seed=43)
    monkeypatch.setattr(triton_chunk, "FUSE_GROUP_MIN_PROGRAMS", 0)
    monkeypatch.setattr(triton_chunk, "FUSE_GROUP_SUM", {"gla": True, "gdn": True})
    bf16_against_reference(op, x, cu, f"{case} group sum fused")


@pytest.mark.gpu
@pytest.mark.parametrize("segment_chunks", [None, 4])
def test_simple_gla_head_dim_256_bf16_matches_fp32_reference_gpu(segment_chunks, monkeypatch):
    """K = V = 256 simple GLA in bf16 against the fp32 reference, unsplit and split."""
    monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", segment_chunks)
    x = make_inputs(2, 1000, 2, 256, 256, dtype=torch.bfloat16, device="cuda", seed=17)
    got = outputs_and_grads("simple_gla", x, "triton")
    ref = outputs_and_grads("simple_gla", {n: t.float() for n, t in x.items()}, "torch")
    errors = assert_rel_rms(got, ref, 5e-3, 1e-2)
    print(f"\nsimple_gla K256 segments {segment_chunks} relative RMS: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", ["B2-T1000-H2-HV4-D128", "varlen-300-0-1-2700-H2-HV4-D128"])
def test_fast_launch_gives_bitwise_the_same_results_gpu(op, case, monkeypatch):
    """ops/_launch.py's cached launches against Triton's own path: the same outputs and
    gradients bit for bit (split and unsplit, packed and not), and the cached path was taken."""
    from megatron_moe_hybrid.ops import _launch

    lengths = None if case.startswith("B2") else [300, 0, 1, 2700]
    B, T = (2, 1000) if lengths is None else (1, sum(lengths))
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    x = make_inputs(B, T, 2, 128, 128, HV=4, N=B if lengths is None else len(lengths), dtype=torch.bfloat16,
                    device="cuda", seed=19)
    kernels = [getattr(triton_chunk, n) for n in dir(triton_chunk) if isinstance(getattr(triton_chunk, n), _launch.FastKernel)]
    assert len(kernels) == 7
    monkeypatch.setattr(_launch, "VERIFY", False)
    for segment_chunks in (None, 8):
        monkeypatch.setattr(triton_chunk, "SEGMENT_CHUNKS", segment_chunks)
        monkeypatch.setattr(_launch, "ENABLED", False)
        slow = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
        monkeypatch.setattr(_launch, "ENABLED", True)
        outputs_and_grads(op, x, "triton", cu_seqlens=cu)  # the first launch of each key goes Triton's way
        hits = sum(k.hits for k in kernels)
        fast = outputs_and_grads(op, x, "triton", cu_seqlens=cu)
        assert sum(k.hits for k in kernels) - hits >= 5
        for n in slow:
            assert torch.equal(fast[n], slow[n]), n
