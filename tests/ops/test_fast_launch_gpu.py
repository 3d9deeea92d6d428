"""Every Triton op outside the linear-attention chunk kernels launched through ops/_launch.py's
cached compiled kernels (GPU): outputs and gradients bit for bit those of Triton's own path, and
every wrapped kernel of the op's modules took the cached path. (The chunk kernels' twin is
test_linear_attention_triton.py::test_fast_launch_gives_bitwise_the_same_results_gpu; the key
logic is tested on the CPU in test_launch.py; every other GPU test checks the keys of what it
launches, tests/conftest.py.)"""

import pytest
import torch

from megatron_moe_hybrid.ops import _launch
from megatron_moe_hybrid.ops import cross_entropy as ce
from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.cross_entropy import triton as ce_triton
from megatron_moe_hybrid.ops.linear_attention import norms, short_conv
from megatron_moe_hybrid.ops.moe import gather, grouped_triton, layout, swiglu, topk
from megatron_moe_hybrid.ops.sparse_attention import triton_indexer, triton_sparse

pytestmark = pytest.mark.gpu


def _grads(outputs, leaves, seed):
    """outputs and the gradients of sum <output, random> with respect to leaves, by name."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    outs = [o for o in outputs.values() if o.requires_grad]
    cot = [torch.randn(o.shape, generator=gen, device="cuda").to(o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, list(leaves.values()), cot, allow_unused=True)
    result = {n: o.detach() for n, o in outputs.items()}
    result.update({"d" + n: g for n, g in zip(leaves, grads) if g is not None})
    return result


def _leaves(seed, **shapes):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {n: torch.randn(s, generator=gen, device="cuda").to(dt).requires_grad_()
            for n, (s, dt) in shapes.items()}


def moe_ops():
    torch.manual_seed(0)  # every run of a family on the same inputs
    bf = torch.bfloat16
    x = _leaves(1, logits=((512, 64), torch.float32), h1=((300, 2 * 96), bf))
    probs, idx, scores = topk.routing(x["logits"], 8, "softmax", None, True, backend="triton")
    out = {"probs": probs, "scores": scores, "act": swiglu.swiglu(x["h1"], backend="triton")}
    res = _grads(out, x, 2)
    res["idx"] = idx
    a = torch.randn(200, 48, device="cuda")
    res["split_rows"] = topk.split_hi_lo(a, bf, True)
    res["split_cols"] = topk.split_hi_lo(a, bf, False)
    recv = torch.randint(-1, 16, (700, 4), device="cuda")
    lay = layout.expand_layout(recv, 16, 2500, backend="triton")
    res.update({f"layout_{n}": getattr(lay, n) for n in ("sorted_row", "sorted_copy", "copy_pos", "tokens_per_expert",
                                                         "overflow")})
    src = torch.randn(257, 1030, device="cuda").to(bf)
    gidx = torch.randint(-1, 257, (301, 8), device="cuda")
    w = torch.rand(301, 8, device="cuda")
    res["gather"] = gather.gather_sum(src, gidx, w, backend="triton")
    res["row_dot"] = gather.row_dot(torch.randn(301, 1030, device="cuda").to(bf), src, gidx, backend="triton")
    dest = torch.randperm(257 * 2, device="cuda")[: 257 * 2].view(257, 2)
    unread = torch.full((600,), -1, device="cuda")
    unread[dest.flatten()] = 0
    res["scatter"] = gather.scatter_rows(src, dest, unread, torch.rand(257, 2, device="cuda"), backend="triton")
    counts = torch.tensor([200, 0, 57, 130], device="cuda")
    g = _leaves(3, x=((int(counts.sum()), 256), bf), w=((4, 256, 384), bf))  # no padding tail: it stays unwritten
    bounds = grouped_triton.row_bounds(counts)
    res.update(_grads({"mm": grouped_triton.GroupedMM.apply(g["x"], g["w"], bounds, "triton")}, g, 4))
    return res, (topk, swiglu, layout, gather, grouped_triton)


def norm_and_conv_ops():
    x = _leaves(5, x=((2, 300, 4, 128), torch.bfloat16), z=((2, 300, 4, 128), torch.bfloat16),
                w=((128,), torch.bfloat16), c=((2, 300, 512), torch.bfloat16), cw=((512, 4), torch.bfloat16))
    out = {"gated": norms.gated_rms_norm(x["x"], x["z"], x["w"], 1e-6, backend="triton"),
           "l2": norms.l2_normalize(x["z"], 1e-6, backend="triton"),
           "conv": short_conv.causal_conv1d(x["c"], x["cw"], activation=True, backend="triton"),
           "conv_plain": short_conv.causal_conv1d(x["c"], x["cw"], activation=False, backend="triton")}
    return _grads(out, x, 6), (norms, short_conv)


def loss_ops():
    torch.manual_seed(0)
    x = _leaves(7, hidden=((1000, 256), torch.bfloat16), weight=((5000, 256), torch.bfloat16))
    labels = torch.randint(0, 5000, (1000,), device="cuda")
    labels[::7] = -100
    out = {"loss": ce.linear_cross_entropy(x["hidden"], x["weight"], labels, chunk_size=256, z_loss_weight=1e-4,
                                           label_smoothing=0.1, backend="triton")}
    return _grads(out, x, 8), (ce_triton,)


def sparse_ops(monkeypatch):
    bf = torch.bfloat16
    res = {}
    # GQA through the kernels form (its backward also fused: _bwd_fused_kernel), absorbed MLA (one
    # latent kv, 64 heads) through the products form
    cases = (("kernels", "kernels", (8, 2, 64, 64)), ("fused", "kernels", (8, 2, 64, 64)),
             ("products", "products", (64, 1, 576, 512)))  # fmt: skip
    for form, forward, (H, G, D, DV) in cases:
        monkeypatch.setattr(triton_sparse, "FORWARD_FORM", forward)
        monkeypatch.setattr(triton_sparse, "BACKWARD_FORM", form)
        T, K = 256, 64
        x = _leaves(9, q=((1, T, H, D), bf), k=((1, T, G, D), bf))
        gen = torch.Generator(device="cuda").manual_seed(10)
        q_idx, k_idx = (torch.randn(s, generator=gen, device="cuda").to(bf) for s in ((1, T, 4, 32), (1, T, 32)))
        w_idx = torch.rand(1, T, 4, generator=gen, device="cuda").to(bf)
        idx = sa.lightning_indexer_topk(q_idx, k_idx, w_idx, K)
        o, lse, target = sa.sparse_attention_with_target(x["q"], x["k"], x["k"][..., :DV], idx)
        res.update({f"{form}_{n}": t for n, t in _grads({"o": o, "lse": lse}, x, 11).items()})
        res[f"{form}_idx"], res[f"{form}_target"] = idx, target
        leaves = {n: t.detach().clone().requires_grad_() for n, t in (("q_idx", q_idx), ("k_idx", k_idx), ("w", w_idx))}
        loss, _ = sa.chunked_indexer_kl_loss(x["q"].detach(), x["k"].detach(), leaves["q_idx"], leaves["k_idx"],
                                            leaves["w"], idx, lse=lse.detach())
        res.update({f"{form}_kl_{n}": t for n, t in _grads({"kl": loss}, leaves, 12).items()})
    return res, (triton_sparse, triton_indexer)


FAMILIES = {"moe": moe_ops, "norms+conv": norm_and_conv_ops, "loss": loss_ops, "sparse": sparse_ops}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_launches_give_bitwise_the_same_results_gpu(family, monkeypatch):
    def run():  # the inputs are the same each run (seeded)
        fn = FAMILIES[family]
        return fn(monkeypatch) if family == "sparse" else fn()

    monkeypatch.setattr(_launch, "VERIFY", False)
    monkeypatch.setattr(_launch, "ENABLED", False)
    run()  # settles what is picked on first use (cuBLASLt's timed algorithm, sparse attention's configs)
    slow, modules = run()
    kernels = {f"{m.__name__}.{n}": k for m in modules for n, k in vars(m).items() if isinstance(k, _launch.FastKernel)}
    monkeypatch.setattr(_launch, "ENABLED", True)
    run()  # the first launch of each key goes Triton's way
    hits = {n: k.hits for n, k in kernels.items()}
    fast, _ = run()
    missed = [n for n, k in kernels.items() if k.hits == hits[n]]
    assert not missed, f"kernels that did not take the cached path: {missed}"
    assert slow.keys() == fast.keys()
    for n in slow:
        assert torch.equal(fast[n], slow[n]), n


def test_verify_mode_catches_a_key_too_coarse_gpu(monkeypatch):
    """With VERIFY (every GPU test), a cached key that maps to another compiled kernel than the
    one Triton picks raises: here the key is made blind to the second argument's dtype."""
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_launch, "VERIFY", True)
    src = torch.randn(64, 128, device="cuda")
    idx = torch.randint(0, 64, (32, 2), device="cuda")
    gather.gather_sum(src, idx, backend="triton")
    gather.gather_sum(src, idx, backend="triton")
    assert gather._gather_sum_kernel.verified >= 1
    real = _launch._arg_key
    monkeypatch.setattr(_launch, "_arg_key", lambda a: (torch.float32, True) if isinstance(a, torch.Tensor) else real(a))
    gather._gather_sum_kernel.cache.clear()
    gather.gather_sum(src, idx, backend="triton")  # cached under the blind key
    with pytest.raises(_launch.KeyTooCoarse):
        gather.gather_sum(src.half(), idx, backend="triton")
