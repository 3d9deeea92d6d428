"""Triton sparse attention (ops/sparse_attention/triton_sparse.py) against the PyTorch reference.

CPU: Triton's interpreter in fp32 on tiny shapes (tests/conftest.py sets TRITON_INTERPRET=1;
its bf16 loads are wrong, so no bf16 here), blocks of 16 heads / 16 slots so that every case
crosses block edges. GPU (-m gpu, the H200): bf16 at the issue's shapes against the fp32
reference on the same bf16 inputs: relative RMS error <= 5e-3 for o, <= 1e-2 for gradients,
and dk / dv bitwise equal between two backward passes (no atomics). Every buffer the kernels
write is NaN-poisoned first (triton_sparse._alloc), so an unwritten element fails.

Shape legend: B batch, T queries, S keys, H query heads, G kv groups, D, DV head dims,
K slots; q [B, T, H, D], k [B, S, G, D], v [B, S, G, DV], indices [B, T, K] in [-1, S).
"""

import types

import pytest
import torch

pytest.importorskip("triton")

from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.sparse_attention import reference, triton_sparse
from megatron_moe_hybrid.testing import assert_rel_rms, cuda_graph

interpreter = pytest.mark.skipif(
    not triton_sparse._INTERPRET,
    reason="CPU tensors need TRITON_INTERPRET=1 (conftest sets it without a GPU)",
)


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch):
    def nan_alloc(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_sparse, "_alloc", nan_alloc)


def use_form(monkeypatch, form):
    """Both passes in one form: the Triton kernels, or the batched products over gathered rows;
    "kernels+products": the kernels forward and the products backward (auto at 32 to 63 heads
    per kv group on CUDA); "kernels+fused": the kernels forward and the fused kernels backward
    (_bwd_fused_kernel)."""
    fwd, _, bwd = form.partition("+")
    monkeypatch.setattr(triton_sparse, "FORWARD_FORM", fwd)
    monkeypatch.setattr(triton_sparse, "BACKWARD_FORM", bwd or fwd)


def causal_indices(B, T, S, K, gen, device="cpu"):
    """[B, T, K] int64: query t (key position S - T + t) picks min(K, its readable keys)
    distinct random keys among s <= S - T + t, in random order; the rest of the row is -1."""
    pos = torch.arange(S - T, S, device=device)
    rows = []
    for t0 in range(0, T, 1024):  # [<=1024, S] random scores at a time
        scores = torch.rand(B, min(1024, T - t0), S, generator=gen, device=device)
        scores = scores.masked_fill(torch.arange(S, device=device) > pos[t0:t0 + 1024, None], -1.0)
        values, idx = scores.topk(min(K, S), dim=-1, sorted=False)
        rows.append(idx.masked_fill(values < 0, -1))
    idx = torch.cat(rows, dim=1)
    if K > S:
        idx = torch.cat([idx, idx.new_full((B, T, K - S), -1)], dim=-1)
    # shuffle the slots so that the -1 slots are not all at the end of a row
    perm = torch.rand(B, T, K, generator=gen, device=device).argsort(-1)
    return idx.gather(-1, perm)


def make_inputs(B, T, S, H, G, D, DV, K, shared_kv=False, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = {"q": torch.randn(B, T, H, D, generator=gen, device=device)}
    if shared_kv:  # absorbed MLA: v is the first DV channels of the one latent kv
        x["kv"] = torch.randn(B, S, G, D, generator=gen, device=device)
    else:
        x["k"] = torch.randn(B, S, G, D, generator=gen, device=device)
        x["v"] = torch.randn(B, S, G, DV, generator=gen, device=device)
    x = {n: t.to(dtype) for n, t in x.items()}
    return x, causal_indices(B, T, S, K, gen, device), DV


def run(x, indices, DV, backend, seed=1, dlse=True, cast=None):
    """o, lse and the gradients of <o, do> + <lse, dlse> (finite lse only) w.r.t. every input.
    cast: compute on x cast to this dtype (the fp32 reference of bf16 inputs)."""
    leaves = {n: t.detach().clone().to(cast or t.dtype).requires_grad_() for n, t in x.items()}
    if "kv" in leaves:
        k, v = leaves["kv"], leaves["kv"][..., :DV]
    else:
        k, v = leaves["k"], leaves["v"]
    o, lse = sa.sparse_attention(leaves["q"], k, v, indices, backend=backend)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    # rounded to the inputs' dtype, so that the fp32 reference gets the same upstream gradient
    do = torch.randn(o.shape, generator=gen, device=o.device).to(x["q"].dtype).float()
    loss = (o.float() * do).sum()
    if dlse:
        dl = torch.randn(lse.shape, generator=gen, device=o.device)
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dl).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"o": o, "lse": lse, **{f"d{n}": g for n, g in zip(leaves, grads)}}


CPU_CASES = {  # B, T, S, H, G, D, DV, K, shared_kv
    # GQA, keys longer than queries, D and DV not powers of 2 (24 = 16 + 8), K = 19 (2 blocks)
    "B2-T9-S30-H4-G2-D24-DV20-K19": (2, 9, 30, 4, 2, 24, 20, 19, False),
    # MQA, 17 heads (2 head blocks), D = 40 = 32 + 8, early rows with -1 slots (K > t + 1)
    "B1-T12-S12-H17-G1-D40-DV16-K20": (1, 12, 12, 17, 1, 40, 16, 20, False),
    # absorbed MLA: v = kv[..., :16], D = 24
    "B1-T6-S20-H3-G1-D24-DV16-K17-sharedkv": (1, 6, 20, 3, 1, 24, 16, 17, True),
}


@interpreter
@pytest.mark.parametrize("form", ["kernels", "products", "kernels+products", "kernels+fused"])
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_triton_matches_reference_cpu(case, form, monkeypatch):
    """Both forms: the Triton kernels, and the batched products over gathered rows (for
    absorbed MLA with dk and dv in one product); and the kernels forward with the products
    backward."""
    use_form(monkeypatch, form)
    B, T, S, H, G, D, DV, K, shared = CPU_CASES[case]
    x, indices, DV = make_inputs(B, T, S, H, G, D, DV, K, shared_kv=shared, seed=len(case))
    got = run(x, indices, DV, "triton")
    ref = run(x, indices, DV, "torch")
    assert got["o"].dtype == torch.float32 and got["lse"].dtype == torch.float32
    assert_rel_rms(got, ref, 2e-6, 2e-6)


@interpreter
@pytest.mark.parametrize("form", ["kernels", "products", "kernels+fused"])
def test_row_without_keys_and_int32_indices_cpu(form, monkeypatch):
    """A query whose row is all -1 gets o = 0, lse = -inf and no gradient; a key that no
    query selected gets dk = dv = 0 (written, not left as the NaN poison)."""
    use_form(monkeypatch, form)
    x, indices, DV = make_inputs(2, 5, 9, 2, 1, 16, 16, 4, seed=3)
    indices[0, 3] = -1
    indices[1, 0, :2] = -1
    indices = indices.to(torch.int32)
    got = run(x, indices, DV, "triton")
    ref = run(x, indices, DV, "torch")
    assert_rel_rms(got, ref, 2e-6, 2e-6)
    assert torch.equal(got["o"][0, 3], torch.zeros_like(got["o"][0, 3]))
    assert torch.isneginf(got["lse"][0, 3]).all()
    assert torch.equal(got["dq"][0, 3], torch.zeros_like(got["dq"][0, 3]))
    unselected = ~reference.indices_to_mask(indices, 9).any(1)  # [B, S]
    assert unselected.any()
    assert (got["dk"][unselected] == 0).all() and (got["dv"][unselected] == 0).all()


@interpreter
@pytest.mark.parametrize("form", ["kernels", "products", "kernels+fused"])
def test_chunked_backward_matches_one_chunk_cpu(form, monkeypatch):
    """The query chunks (contribution buffer budget; the products form's forward too) change
    nothing but rounding."""
    use_form(monkeypatch, form)
    x, indices, DV = make_inputs(1, 11, 16, 2, 2, 16, 16, 7, seed=5)
    ref = run(x, indices, DV, "torch")
    one = run(x, indices, DV, "triton")
    # 3 queries per chunk: 4 chunks, the last one short
    if form != "products":
        monkeypatch.setattr(triton_sparse, "CONTRIB_BUDGET_BYTES", 3 * 1 * 7 * 2 * (16 + 16) * 4)
    else:  # forward and backward both take their chunk size from _chunk_rows
        monkeypatch.setattr(triton_sparse, "_chunk_rows", lambda sh, per_query, extra: 3)
    chunked = run(x, indices, DV, "triton")
    assert_rel_rms(one, ref, 2e-6, 2e-6)
    assert_rel_rms(chunked, ref, 2e-6, 2e-6)
    assert torch.equal(chunked["o"], one["o"]) and torch.equal(chunked["dq"], one["dq"])


@interpreter
@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_products_forward_makes_the_kl_target_cpu(case, one_pass, monkeypatch):
    """with_target: the products forward's sum over heads of its probabilities equals
    sparse_probs_target from its lse (the torch form), -1 slots and rows without keys 0, with
    the softmax in one block or block by block (two passes); o and lse as without it."""
    use_form(monkeypatch, "products")
    if not one_pass:
        monkeypatch.setattr(triton_sparse, "SOFTMAX_ONE_PASS_MAX", 8)
    B, T, S, H, G, D, DV, K, shared = CPU_CASES[case]
    x, indices, DV = make_inputs(B, T, S, H, G, D, DV, K, shared_kv=shared, seed=len(case))
    indices[0, 1] = -1  # a query without keys
    k = x["kv"] if shared else x["k"]
    v = k[..., :DV] if shared else x["v"]
    o, lse, target = triton_sparse.sparse_attention_triton(x["q"], k, v, indices, with_target=True)
    want = sa.sparse_probs_target(x["q"], k, indices, lse, backend="torch")
    torch.testing.assert_close(target, want, rtol=1e-5, atol=1e-6)
    assert (target[indices < 0] == 0).all() and torch.isneginf(lse[0, 1]).all()
    o2, lse2 = sa.sparse_attention(x["q"], k, v, indices, backend="torch")
    assert_rel_rms({"o": o, "lse": lse}, {"o": o2, "lse": lse2}, 2e-6, 2e-6)
    # the ops-level function: this target from the products forward, else sparse_probs_target
    got = sa.sparse_attention_with_target(x["q"], k, v, indices, backend="triton")
    assert torch.equal(got[2], target)
    use_form(monkeypatch, "kernels")
    assert triton_sparse.sparse_attention_triton(x["q"], k, v, indices, with_target=True)[2] is None
    got = sa.sparse_attention_with_target(x["q"], k, v, indices, backend="triton")
    torch.testing.assert_close(got[2], want, rtol=1e-5, atol=1e-6)


@interpreter
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_fused_backward_equals_the_two_kernels_cpu(case, monkeypatch):
    """_bwd_fused_kernel forms the same products in the same order as _bwd_dq_kernel and
    _bwd_dkv_kernel at equal blocks: every gradient bitwise equal where the group's heads fit
    the dk/dv kernel's one 16-head block. With 17 heads that kernel sums two head blocks' partial
    products where the fused one takes a 32-head block: dk and dv equal up to rounding, and dq
    too (its rows are the same sums, but the interpreter's numpy product of a 32-row block may
    order them unlike a 16-row block's: bitwise on one CPU, not on another)."""
    B, T, S, H, G, D, DV, K, shared = CPU_CASES[case]
    x, indices, DV = make_inputs(B, T, S, H, G, D, DV, K, shared_kv=shared, seed=7)
    use_form(monkeypatch, "kernels")
    two = run(x, indices, DV, "triton")
    use_form(monkeypatch, "kernels+fused")
    fused = run(x, indices, DV, "triton")
    one_block = H // G <= triton_sparse._candidates("dkv", H // G, 0, True)[0]["BH"]
    for n in two:
        if one_block or n in ("o", "lse"):
            assert torch.equal(fused[n], two[n]), n
        else:
            assert_rel_rms({n: fused[n]}, {n: two[n]}, 1e-6, 1e-6)


@interpreter
def test_fused_backward_refuses_more_heads_than_its_block_cpu(monkeypatch):
    """Over FUSED_MAX_HEADS heads per group the fused form is refused by name, in the forward of a
    call that will need a backward (before its buffers and its whole forward), not in that
    backward; a forward-only call runs."""
    use_form(monkeypatch, "kernels+fused")
    monkeypatch.setattr(triton_sparse, "FUSED_MAX_HEADS", 2)
    x, indices, DV = make_inputs(1, 3, 6, 3, 1, 16, 16, 2, seed=2)
    monkeypatch.setattr(triton_sparse, "_fwd_kernel", None)  # the forward must not get that far
    with pytest.raises(ValueError, match="BACKWARD_FORM 'fused' takes at most 2 query heads per kv group"):
        run(x, indices, DV, "triton")
    monkeypatch.undo()
    use_form(monkeypatch, "kernels+fused")
    monkeypatch.setattr(triton_sparse, "FUSED_MAX_HEADS", 2)
    with torch.no_grad():
        o, _ = triton_sparse.sparse_attention_triton(x["q"], x["k"], x["v"], indices)
    assert torch.isfinite(o).all()


@interpreter
@pytest.mark.parametrize("fwd, bwd, name", [("kernel", "auto", "FORWARD_FORM"), ("fused", "auto", "FORWARD_FORM"),
                                            ("auto", "product", "BACKWARD_FORM")])
def test_an_unknown_form_is_refused_by_name_cpu(fwd, bwd, name, monkeypatch):
    """A form switch set to a value its pass does not take (a typo, or the backward-only "fused"
    for the forward) raises, naming the switch and the values it takes, instead of running the
    kernels form."""
    monkeypatch.setattr(triton_sparse, "FORWARD_FORM", fwd)
    monkeypatch.setattr(triton_sparse, "BACKWARD_FORM", bwd)
    x, indices, DV = make_inputs(1, 3, 6, 2, 1, 16, 16, 2, seed=2)
    with pytest.raises(ValueError, match=f"triton_sparse.{name} must be one of"):
        run(x, indices, DV, "triton")


@interpreter
@pytest.mark.parametrize("form", ["kernels", "products", "kernels+fused"])
def test_repeated_key_in_a_row_raises_in_backward_cpu(form, monkeypatch):
    use_form(monkeypatch, form)
    x, indices, _ = make_inputs(1, 4, 8, 2, 1, 16, 16, 3, seed=2)
    indices[0, 3, :2] = torch.tensor([5, 5])
    q = x["q"].clone().requires_grad_()
    o, _ = sa.sparse_attention(q, x["k"], x["v"], indices, backend="triton")
    with pytest.raises(ValueError, match="indices must not repeat a key"):
        o.sum().backward()


def _bad_calls():
    x, indices, _ = make_inputs(1, 4, 8, 2, 1, 16, 16, 3)
    q, k, v = x["q"], x["k"], x["v"]
    past_end = indices.clone()
    past_end[0, 2, 1] = 8  # S = 8
    return {
        "q dtype": ("q: the triton sparse_attention takes fp32 on CPU", (q.double(), k.double(), v.double(), indices)),
        "k dtype": ("k: expected torch.float32", (q, k.half(), v, indices)),
        "index range": ("indices must lie in", (q, k, v, past_end)),
        "index dtype": ("indices must be int64/int32", (q, k, v, indices.float())),
        "index shape": ("indices must be int64/int32", (q, k, v, indices[:, :2])),
        "kv groups": ("k must be", (torch.randn(1, 4, 3, 16), k.expand(1, 8, 2, 16), v, indices)),
    }


@interpreter
@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_value_error_naming_the_argument_cpu(case):
    match, args = _bad_calls()[case]
    with pytest.raises(ValueError, match=match):
        sa.sparse_attention(*args, backend="triton")


def test_auto_sends_only_16_bit_cuda_tensors_to_triton(monkeypatch, caplog):
    assert "triton" in sa.registered_backends()
    cpu = torch.randn(1, 2, 2, 16)
    assert sa.get_op("sparse_attention", "auto", cpu) is reference.sparse_attention
    assert sa.get_op("sparse_attention") is reference.sparse_attention  # no tensor: no guess
    assert sa.get_op("sparse_attention", "triton") is sa._BACKENDS["triton"].sparse_attention
    # tensors described by what supports() reads (no GPU here)
    cuda = {
        dtype: types.SimpleNamespace(is_cuda=True, dtype=dtype, shape=(1, 2, 2, 576))
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
    }
    assert sa.get_op("sparse_attention", "auto", cuda[torch.bfloat16]) is sa._BACKENDS["triton"].sparse_attention
    assert sa.get_op("sparse_attention", "auto", cuda[torch.float16]) is sa._BACKENDS["triton"].sparse_attention
    monkeypatch.setattr(sa, "_fallback_logged", set())
    with caplog.at_level("WARNING", logger=sa.__name__):
        assert sa.get_op("sparse_attention", "auto", cuda[torch.float32]) is reference.sparse_attention
        sa.get_op("sparse_attention", "auto", cuda[torch.float32])
    assert len([r for r in caplog.records if "do not take" in r.getMessage()]) == 1
    # ops the triton backend does not implement stay on torch under auto, for CUDA tensors too
    assert sa.get_op("lightning_indexer", "auto", cuda[torch.bfloat16]) is reference.lightning_indexer
    # the fused indexer top-k and selected-key scores take 16-bit CUDA tensors too
    for op in ("indexer_topk", "lightning_indexer_topk", "lightning_indexer_sparse"):
        assert sa.get_op(op, "auto", cuda[torch.bfloat16]) is getattr(sa._BACKENDS["triton"], op)
        assert sa.get_op(op, "auto", cuda[torch.float32]) is getattr(reference, op)


def test_auto_form_takes_products_for_many_heads_per_group_on_cuda(monkeypatch):
    """auto: the batched products on CUDA for 32 or more heads per kv group in the backward
    (absorbed MLA's 128, its 32 per rank under TP 4), and in a forward that makes the indexer
    loss's target for 64 or more; below that the fused kernels backward on CUDA for GQA-width
    rows (GQA's 16 heads, d 128) and the kernels for MLA's 576-wide ones; the kernels for every
    other forward and every CPU tensor; a set form wins."""
    cuda, cpu = types.SimpleNamespace(is_cuda=True), types.SimpleNamespace(is_cuda=False)
    gqa, mla = 128 + 128, 512 + 64 + 512  # a gathered row's columns (_Shape.width)
    for R, width, fwd_target, bwd in ((128, mla, "products", "products"), (64, mla, "products", "products"),
                                      (32, mla, "kernels", "products"), (16, mla, "kernels", "kernels"),
                                      (16, gqa, "kernels", "fused"), (8, gqa, "kernels", "fused")):
        sh = types.SimpleNamespace(R=R, width=width)
        assert triton_sparse._form(sh, cuda, "auto") == "kernels"
        assert triton_sparse._form(sh, cuda, "auto", with_target=True) == fwd_target
        assert triton_sparse._form(sh, cpu, "auto", with_target=True) == "kernels"
        assert triton_sparse._form(sh, cuda, "auto", "backward") == bwd
        assert triton_sparse._form(sh, cpu, "auto", "backward") == "kernels"
        assert triton_sparse._form(sh, cpu, "products") == "products"
    monkeypatch.setattr(triton_sparse, "BACKWARD_FORM", "kernels")
    for R, width in ((128, mla), (16, gqa)):
        sh = types.SimpleNamespace(R=R, width=width)
        assert triton_sparse._form(sh, cuda, triton_sparse.BACKWARD_FORM, "backward") == "kernels"


@interpreter
@pytest.mark.parametrize("form", ["kernels", "products", "kernels+fused"])
def test_no_host_read_while_capturing_cpu(form, monkeypatch):
    """While a stream captures a CUDA graph (stood in for here: _capturing answers True), forward
    and backward read nothing back to the host: the index range check and the repeated-key check
    are skipped (a capturing stream refuses host reads), and the results are those of an eager
    call. Outside capture both checks still raise."""
    use_form(monkeypatch, form)
    x, indices, DV = make_inputs(1, 6, 10, 4, 2, 16, 16, 5, seed=4)
    eager = run(x, indices, DV, "triton")
    reads = []
    for name in ("item", "__bool__", "tolist", "__int__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, _name=name: reads.append(_name) or _real(t, *a))
    monkeypatch.setattr(triton_sparse, "_capturing", lambda t: True)
    q, k, v = (t.detach().clone().requires_grad_() for t in (x["q"], x["k"], x["v"]))
    o, lse = triton_sparse.sparse_attention_triton(q, k, v, indices)
    grads = torch.autograd.grad((o * 1.5).sum() + (torch.where(torch.isfinite(lse), lse, 0.0)).sum(), (q, k, v))
    assert reads == [], reads
    monkeypatch.undo()
    use_form(monkeypatch, form)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (x["q"], x["k"], x["v"]))
    o2, lse2 = triton_sparse.sparse_attention_triton(q2, k2, v2, indices)
    grads2 = torch.autograd.grad((o2 * 1.5).sum() + (torch.where(torch.isfinite(lse2), lse2, 0.0)).sum(), (q2, k2, v2))
    assert torch.equal(o, o2) and torch.equal(lse, lse2) and torch.equal(o, eager["o"])
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)
    bad = indices.clone()
    bad[0, 0, 0] = 10
    with pytest.raises(ValueError, match="indices must lie in"):
        triton_sparse.sparse_attention_triton(x["q"], x["k"], x["v"], bad)


# --- GPU (bf16, the shapes) ---------------------------------------------------------

GPU_CASES = {  # B, T, S, H, G, D, DV, K, shared_kv
    "GQA-B1-T2048-H16-G4-D128-K512": (1, 2048, 2048, 16, 4, 128, 128, 512, False),
    "MLA-B1-T512-S1024-H128-G1-D576-DV512-K512-sharedkv": (1, 512, 1024, 128, 1, 576, 512, 512, True),
    "MLA-B1-T512-S1024-H128-G1-D576-DV512-K512": (1, 512, 1024, 128, 1, 576, 512, 512, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["kernels", "products", "kernels+products", "kernels+fused"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_triton_bf16_matches_fp32_reference_gpu(case, form, monkeypatch):
    if form == "kernels+fused" and GPU_CASES[case][3] // GPU_CASES[case][4] > triton_sparse.FUSED_MAX_HEADS:
        pytest.skip("the fused backward takes at most FUSED_MAX_HEADS heads per kv group (MLA's 128: no)")
    use_form(monkeypatch, form)
    B, T, S, H, G, D, DV, K, shared = GPU_CASES[case]
    x, indices, DV = make_inputs(B, T, S, H, G, D, DV, K, shared_kv=shared, device="cuda", seed=11)
    x = {n: t.to(torch.bfloat16) for n, t in x.items()}
    # the fp32 reference on the same bf16 inputs (K = 512 of S = T keys: early rows hold -1)
    ref = run(x, indices, DV, "torch", cast=torch.float32)
    got = run(x, indices, DV, "auto")
    assert got["o"].dtype == torch.bfloat16 and got["dq"].dtype == torch.bfloat16
    errors = assert_rel_rms(got, ref, 5e-3, 1e-2)
    print(case, form, {n: f"{e:.2e}" for n, e in errors.items()})
    again = run(x, indices, DV, "auto")
    for n in got:
        assert torch.equal(again[n], got[n]), f"{n} differs between two identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["kernels", "products", "kernels+fused"])
def test_forward_backward_capture_in_a_cuda_graph_gpu(form, monkeypatch):
    """Forward and backward captured in one CUDA graph (the data checks, host reads, skipped while
    capturing): a replay equals the eager call bitwise, and new inputs and indices copied into the
    captured tensors give their own results."""
    use_form(monkeypatch, form)
    B, T, S, H, G, D, DV, K = 1, 256, 512, 16, 2, 64, 64, 96

    def inputs(seed):
        x, idx, _ = make_inputs(B, T, S, H, G, D, DV, K, device="cuda", seed=seed)
        return [x[n].bfloat16() for n in ("q", "k", "v")], idx

    leaves, indices = inputs(5)
    leaves = [t.requires_grad_() for t in leaves]
    do = torch.randn(B, T, H, DV, device="cuda").bfloat16()

    def step():
        o, lse = triton_sparse.sparse_attention_triton(*leaves, indices)
        return (o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, do))

    eager = step()
    last = []
    graph = cuda_graph(lambda: last.__setitem__(slice(None), step()))
    captured = tuple(last)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
    new_leaves, new_indices = inputs(6)
    with torch.no_grad():
        for t, n in zip(leaves, new_leaves):
            t.copy_(n)
        indices.copy_(new_indices)
    graph.replay()
    again = step()
    torch.cuda.synchronize()
    for a, b in zip(captured, again):
        assert torch.equal(a, b)
    assert not torch.equal(again[0], eager[0])
