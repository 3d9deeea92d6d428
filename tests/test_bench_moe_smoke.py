"""CPU smoke test of benchmarks/moe.py's helpers: the torch._grouped_mm anchor layer against a
per-token loop (forward and every gradient, EP=1 and EP=2 over gloo), the Zipf routing skew,
the distinct-rank byte count and the results merge. The GPU timing itself is not run here.

Shape legend: T tokens, h hidden size, E experts, E_local = E / ep, K experts per token,
F expert FFN size.
"""

import importlib.util
import math
import os
import sys

import pytest
import torch

from megatron_moe_hybrid.testing import spawn

_BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if _BENCH_DIR not in sys.path:
    sys.path.insert(0, _BENCH_DIR)  # benchmarks/moe.py imports its sibling common.py
_spec = importlib.util.spec_from_file_location("bench_moe", os.path.join(_BENCH_DIR, "moe.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def assert_close(got, want, label, **tolerances):
    torch.testing.assert_close(got, want, msg=lambda m: f"{label}: {m}", **tolerances)


def loop_reference(x, router_weight, w1, w2, topk):
    """[T, h]: token by token, sum over its top-K experts (softmax over all E) of p * SwiGLU."""
    rows = []
    for x_t in x:  # [h]
        scores = torch.softmax(router_weight @ x_t.float(), dim=0)  # [E]
        probs, experts = torch.topk(scores, topk)  # [K]
        y_t = torch.zeros_like(x_t)
        for p, e in zip(probs, experts.tolist()):
            gate, up = (x_t @ w1[e]).chunk(2)  # [F] each
            y_t = y_t + p * ((torch.nn.functional.silu(gate) * up) @ w2[e])
        rows.append(y_t)
    return torch.stack(rows)


def random_problem(num_tokens, hidden, num_experts, ffn, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)  # [T, h]
    router_weight = torch.randn(num_experts, hidden, generator=gen)  # [E, h] spread-out scores
    w1 = torch.randn(num_experts, hidden, 2 * ffn, generator=gen) / hidden**0.5  # [E, h, 2F]
    w2 = torch.randn(num_experts, ffn, hidden, generator=gen) / ffn**0.5  # [E, F, h]
    return x, router_weight, w1, w2, torch.randn(num_tokens, hidden, generator=gen)


CASES = [(13, 16, 4, 2, 8), (1, 16, 8, 3, 24), (37, 32, 6, 6, 16), (64, 24, 16, 4, 12)]
CASE_IDS = [f"T{t}-H{h}-E{e}-K{k}-F{f}" for t, h, e, k, f in CASES]


@pytest.mark.parametrize("num_tokens,hidden,num_experts,topk,ffn", CASES, ids=CASE_IDS)
def test_grouped_mm_layer_matches_loop(num_tokens, hidden, num_experts, topk, ffn):
    x, router_weight, w1, w2, grad_out = random_problem(num_tokens, hidden, num_experts, ffn, seed=num_tokens)
    layer = bench.GroupedMMMoE(router_weight.clone(), w1.clone(), w2.clone(), topk)
    x_fast = x.clone().requires_grad_(True)
    out = layer(x_fast)
    got = torch.autograd.grad(out, [x_fast, layer.router_weight, layer.w1, layer.w2], grad_out)

    ref_inputs = [t.clone().requires_grad_(True) for t in (x, router_weight, w1, w2)]
    want_out = loop_reference(*ref_inputs, topk)
    want = torch.autograd.grad(want_out, ref_inputs, grad_out)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for name, a, w in zip(["x", "router_weight", "w1", "w2"], got, want):
        assert_close(a, w, f"grad of {name}", rtol=1e-4, atol=1e-5)


def _ep_worker(rank, world_size, num_tokens, hidden, num_experts, topk, ffn):
    """EP layer on this rank's tokens, and the EP=1 layer with every expert on the same tokens."""
    _, router_weight, w1, w2, _ = random_problem(num_tokens, hidden, num_experts, ffn, seed=0)  # shared
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens (a different number) and output gradient
    x = torch.randn(num_tokens + rank, hidden, generator=gen)
    grad_out = torch.randn(num_tokens + rank, hidden, generator=gen)
    num_local = num_experts // world_size
    mine = slice(rank * num_local, (rank + 1) * num_local)
    results = {}
    for kind, group, (w1_k, w2_k) in [
        ("ep", torch.distributed.group.WORLD, (w1[mine], w2[mine])),
        ("full", None, (w1, w2)),
    ]:
        layer = bench.GroupedMMMoE(router_weight.clone(), w1_k.clone(), w2_k.clone(), topk, group)
        x_leaf = x.clone().requires_grad_(True)
        out = layer(x_leaf)
        grads = torch.autograd.grad(out, [x_leaf, layer.router_weight, layer.w1, layer.w2], grad_out)
        results[kind] = [out.detach(), *grads]
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("num_tokens,hidden,num_experts,topk,ffn", [(11, 16, 8, 3, 8)], ids=["T11-H16-E8-K3-F8"])
def test_grouped_mm_layer_ep2_matches_ep1(num_tokens, hidden, num_experts, topk, ffn):
    results = spawn(_ep_worker, 2, num_tokens, hidden, num_experts, topk, ffn)
    num_local = num_experts // 2
    for rank, res in enumerate(results):
        (out, gx, grouter, _, _), (want_out, want_gx, want_grouter, _, _) = res["ep"], res["full"]
        assert_close(out, want_out, f"rank {rank} out")
        assert_close(gx, want_gx, f"rank {rank} grad x")
        assert_close(grouter, want_grouter, f"rank {rank} grad router")
        # an expert's gradient collects every rank's tokens routed to it
        for index, name in [(3, "w1"), (4, "w2")]:
            want = sum(r["full"][index] for r in results)[rank * num_local : (rank + 1) * num_local]
            assert_close(res["ep"][index], want, f"rank {rank} grad {name}")


@pytest.mark.parametrize("num_experts,s", [(64, 1.0), (7, 1.2), (256, 1.1)], ids=["E64-s1.0", "E7-s1.2", "E256-s1.1"])
def test_zipf_log_probs(num_experts, s):
    got = bench.zipf_log_probs(num_experts, s)
    norm = sum((e + 1) ** -s for e in range(num_experts))
    want = torch.tensor([math.log((e + 1) ** -s / norm) for e in range(num_experts)])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("num_tokens,hidden,num_experts", [(4001, 64, 16), (999, 33, 8)], ids=["T4001-H64-E16", "T999-H33-E8"])
def test_zipf_routing_adds_log_p_to_every_logit(num_tokens, hidden, num_experts):
    gen = torch.Generator().manual_seed(num_tokens)
    weight = {r: bench.make_router_weight(num_experts, hidden, r, 1.1, gen.manual_seed(1), "cpu") for r in bench.ROUTINGS}
    x = {r: bench.make_input(num_tokens, hidden, r, gen.manual_seed(2), "cpu") for r in bench.ROUTINGS}
    assert torch.equal(weight["zipf"], weight["zipf"].bfloat16().float())  # Megatron's bf16 copy is exact
    torch.testing.assert_close(weight["zipf"][:, 1:], weight["balanced"][:, 1:], rtol=0, atol=0)
    torch.testing.assert_close(x["zipf"][:, 1:], x["balanced"][:, 1:], rtol=0, atol=0)
    log_p = bench.zipf_log_probs(num_experts, 1.1).bfloat16().float()  # [E]
    base = x["zipf"][:, 1:].float() @ weight["zipf"][:, 1:].t()  # [T, E] without column 0
    logits = x["zipf"].float() @ weight["zipf"].t()
    torch.testing.assert_close(logits, base + bench.ZIPF_C * log_p, rtol=1e-5, atol=1e-4)

    loads = {}
    for r in bench.ROUTINGS:
        _, idx = bench.route(x[r], weight[r], 2)  # [T, K]: expert 0 may take up to E / K times the mean
        loads[r] = bench.count_per_expert(idx, num_experts)
        assert torch.equal(loads[r], torch.bincount(idx.flatten(), minlength=num_experts))
    # skewed: expert 0 takes far more than its share, more than under the balanced router
    assert loads["zipf"][0] > 2 * loads["zipf"].float().mean() > loads["balanced"][0]
    assert loads["zipf"][0] > loads["zipf"][-1]


@pytest.mark.parametrize("num_tokens,topk,num_experts,ep", [(50, 8, 64, 2), (17, 3, 12, 4), (9, 1, 4, 4)],
                         ids=["T50-K8-E64-ep2", "T17-K3-E12-ep4", "T9-K1-E4-ep4"])
def test_distinct_rank_copies_matches_set_count(num_tokens, topk, num_experts, ep):
    gen = torch.Generator().manual_seed(num_tokens)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(num_tokens)])  # [T, K]
    num_local = num_experts // ep
    want = sum(len({e // num_local for e in row}) for row in idx.tolist())
    assert bench.distinct_rank_copies(idx, num_local) == want


def test_merge_rows_replaces_only_matching_keys():
    def row(name, gpus, anchor, ms):
        return {"name": name, "shape": "S1", "gpus": gpus, "anchor": anchor, "ours_ms": ms}

    old = [row("a", 1, "x", 1.0), row("a", 2, "x", 2.0), row("b", 2, "y", 3.0), row("a", 2, "y", 4.0)]
    new = [row("a", 2, "x", 20.0), row("c", 2, "x", 50.0), row("a", 2, "y", 40.0)]
    merged = bench.merge_rows(old, new)
    assert merged == [old[0], new[0], old[2], new[2], new[1]]
    assert bench.merge_rows([], new) == new


def test_sync_count_ignores_the_debug_modes_own_notice():
    # the first set_sync_debug_mode of a process warns once that the mode is a prototype; that notice
    # is no sync (it made each process's first moe.json row report one)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations (Triggered internally at Module.cpp:1003.)")
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp:150.)")
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp:150.)")
    assert len(caught) == 3
    assert bench.count_syncs_in(caught) == 2


def test_bad_input_raises():
    with pytest.raises(ValueError, match="routing"):
        bench.make_router_weight(8, 16, "uniform", 1.1, torch.Generator(), "cpu")
    with pytest.raises(ValueError, match="routing"):
        bench.make_input(4, 16, "skewed", torch.Generator(), "cpu")
    with pytest.raises(ValueError, match="num_experts"):
        bench.zipf_log_probs(0, 1.0)
    with pytest.raises(ValueError, match="router_weight"):
        bench.GroupedMMMoE(torch.zeros(8, 4), torch.zeros(3, 4, 6), torch.zeros(3, 3, 4), 2)
    with pytest.raises(ValueError, match="--shapes"):
        bench.parse_list("S1,S9", list(bench.SHAPES), "--shapes")


@pytest.mark.parametrize("dispatcher", ["static", "alltoall"])
def test_dispatch_helpers_return_each_token_weighted_with_identity_experts(dispatcher):
    """moe.dispatch_steps / dispatch_combine (the dispatch+combine rows, probe_permute.py) on one
    CPU rank: the expert-grouped rows are the routed copies, and with identity experts the
    combine gives each token times the sum of its routing weights."""
    from megatron_moe_hybrid.registry import MOE_DISPATCHERS

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 16, generator=gen)
    probs, topk_idx = torch.randn(37, 8, generator=gen).softmax(-1).topk(3, dim=1)
    d = MOE_DISPATCHERS.get(dispatcher)(8, None, "torch")
    grouped = bench.dispatch_steps(d, x, topk_idx, probs)
    assert grouped.shape == (37 * 3, 16)
    want = x[topk_idx.flatten().argsort(stable=True) // 3]  # copies grouped by expert, token order within
    torch.testing.assert_close(grouped, want)
    torch.testing.assert_close(bench.dispatch_combine(d, x, topk_idx, probs), x * probs.sum(-1, keepdim=True))
