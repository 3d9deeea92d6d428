"""MoE reference ops against direct, loop- or dense-matrix oracles, forward and every gradient.

Shape legend: T tokens, E experts, K experts per token, h hidden size, F expert FFN size,
N = T * K routed rows, G expert groups, s/b sequence length and batch of the [s, b] layout.
"""

import itertools
import math

import pytest
import torch

from megatron_moe_hybrid.ops.moe import grouped_mlp, load_balancing_loss, permute, router_topk, unpermute
from megatron_moe_hybrid.ops.moe.reference import (
    capacity_keep_mask,
    expert_capacity,
    router_z_loss,
    sequence_load_balancing_loss,
)

F64 = torch.float64
CASES = [(1, 4, 1), (7, 4, 2), (16, 8, 2), (63, 8, 3), (33, 5, 5)]
CASE_IDS = [f"T{t}-E{e}-K{k}" for t, e, k in CASES]


def _rand_topk_idx(num_tokens, num_experts, topk, gen):
    """[T, K] distinct experts per token."""
    rows = [torch.randperm(num_experts, generator=gen)[:topk] for _ in range(num_tokens)]
    return torch.stack(rows) if rows else torch.zeros(0, topk, dtype=torch.int64)


def _loop_order(topk_idx, num_experts):
    """Copy index i = t*K + k held by each permuted row, built by scanning experts then copies."""
    flat = topk_idx.flatten().tolist()
    return [i for e in range(num_experts) for i, fe in enumerate(flat) if fe == e]


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out, materialize_grads=True)


@pytest.mark.parametrize("num_tokens,num_experts,topk", CASES, ids=CASE_IDS)
def test_permute_matches_loop_oracle(num_tokens, num_experts, topk):
    gen = torch.Generator().manual_seed(num_tokens * 100 + topk)
    h = 6
    x = torch.randn(num_tokens, h, dtype=F64, generator=gen, requires_grad=True)
    topk_idx = _rand_topk_idx(num_tokens, num_experts, topk, gen)

    permuted, row_id_map, tokens_per_expert = permute(x, topk_idx, num_experts)

    order = _loop_order(topk_idx, num_experts)
    # dense [N, T] selection matrix: row j copies token order[j] // K
    select = torch.zeros(len(order), num_tokens, dtype=F64)
    for j, i in enumerate(order):
        select[j, i // topk] = 1.0
    expected = select @ x
    torch.testing.assert_close(permuted, expected, rtol=0, atol=0)
    assert row_id_map.tolist() == [order.index(i) for i in range(num_tokens * topk)]
    expected_counts = [sum(1 for v in topk_idx.flatten().tolist() if v == e) for e in range(num_experts)]
    assert tokens_per_expert.tolist() == expected_counts

    g = torch.randn_like(permuted)
    torch.testing.assert_close(_grads(permuted, [x], g)[0], _grads(expected, [x], g)[0])


@pytest.mark.parametrize("num_tokens,num_experts,topk", CASES, ids=CASE_IDS)
def test_unpermute_matches_dense_einsum(num_tokens, num_experts, topk):
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_experts)
    h = 5
    topk_idx = _rand_topk_idx(num_tokens, num_experts, topk, gen)
    _, row_id_map, _ = permute(torch.zeros(num_tokens, h, dtype=F64), topk_idx, num_experts)
    y = torch.randn(num_tokens * topk, h, dtype=F64, generator=gen, requires_grad=True)
    probs = torch.rand(num_tokens, topk, dtype=F64, generator=gen, requires_grad=True)

    out = unpermute(y, row_id_map, probs)

    # one-hot [T, K, N]: copy (t, k) reads row row_id_map[t*K+k]
    onehot = torch.zeros(num_tokens, topk, num_tokens * topk, dtype=F64)
    order = _loop_order(topk_idx, num_experts)
    for j, i in enumerate(order):
        onehot[i // topk, i % topk, j] = 1.0
    expected = torch.einsum("tk,tkn,nh->th", probs, onehot, y)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    for got, want in zip(_grads(out, [y, probs], g), _grads(expected, [y, probs], g)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("num_tokens,num_experts,topk", CASES, ids=CASE_IDS)
def test_permute_unpermute_round_trip(num_tokens, num_experts, topk):
    gen = torch.Generator().manual_seed(3 + num_tokens)
    x = torch.randn(num_tokens, 4, dtype=F64, generator=gen)
    topk_idx = _rand_topk_idx(num_tokens, num_experts, topk, gen)
    permuted, row_id_map, tokens_per_expert = permute(x, topk_idx, num_experts)
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts), tokens_per_expert)
    assert torch.equal(expert_of_row[row_id_map], topk_idx.flatten())
    probs = torch.full((num_tokens, topk), 1.0 / topk, dtype=F64)
    torch.testing.assert_close(unpermute(permuted, row_id_map, probs), x)


def test_unpermute_accumulates_half_inputs_in_fp32():
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_experts, topk = 9, 4, 3
    topk_idx = _rand_topk_idx(num_tokens, num_experts, topk, gen)
    _, row_id_map, _ = permute(torch.zeros(num_tokens, 8), topk_idx, num_experts)
    y = torch.randn(num_tokens * topk, 8, generator=gen).bfloat16()
    probs = torch.rand(num_tokens, topk, generator=gen)
    out = unpermute(y, row_id_map, probs)
    y_tk = y.float()[row_id_map].view(num_tokens, topk, 8)  # [T, K, h] fp32
    p = probs[:, :, None]  # [T, K, 1]
    expected = p[:, 0] * y_tk[:, 0] + p[:, 1] * y_tk[:, 1] + p[:, 2] * y_tk[:, 2]  # k in order
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.bfloat16(), rtol=0, atol=0)


def _direct_router(logits, topk, score_func, bias, norm):
    """Per-token Python sort by (-selection score, expert index); weights from unbiased scores."""
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    sel = scores.detach() + (0 if bias is None else bias)
    idx = torch.tensor(
        [sorted(range(logits.shape[1]), key=lambda e: (-row[e], e))[:topk] for row in sel.tolist()],
        dtype=torch.int64,
    ).view(logits.shape[0], topk)
    probs = torch.stack([scores[t, idx[t]] for t in range(logits.shape[0])]).view(-1, topk)
    if norm:
        probs = probs / probs.sum(-1, keepdim=True)
    return probs, idx, scores


@pytest.mark.parametrize("num_tokens,num_experts,topk", CASES, ids=CASE_IDS)
@pytest.mark.parametrize(
    "score_func,use_bias,norm",
    [("softmax", False, None), ("softmax", True, True), ("sigmoid", False, None), ("sigmoid", True, False)],
    ids=["softmax", "softmax-bias-norm", "sigmoid", "sigmoid-bias-nonorm"],
)
def test_router_topk_matches_direct(num_tokens, num_experts, topk, score_func, use_bias, norm):
    gen = torch.Generator().manual_seed(num_tokens + 13 * topk)
    logits = torch.randn(num_tokens, num_experts, dtype=F64, generator=gen, requires_grad=True)
    bias = torch.randn(num_experts, dtype=F64, generator=gen) if use_bias else None

    probs, idx, scores = router_topk(logits, topk, score_func, bias, norm)
    norm_default = score_func == "sigmoid" if norm is None else norm
    want_probs, want_idx, want_scores = _direct_router(logits, topk, score_func, bias, norm_default)

    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(probs, want_probs)
    torch.testing.assert_close(scores, want_scores)
    gp, gs = torch.randn_like(probs), torch.randn_like(scores)
    got = torch.autograd.grad((probs, scores), logits, (gp, gs))[0]
    want = torch.autograd.grad((want_probs, want_scores), logits, (gp, gs))[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_topk_ties_go_to_lower_expert(score_func):
    # integer logits drawn from 3 values over 8 experts: every row has exact ties
    gen = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (31, 8), generator=gen).double()
    _, idx, _ = router_topk(logits, 3, score_func)
    _, want_idx, _ = _direct_router(logits, 3, score_func, None, False)
    assert torch.equal(idx, want_idx)


@pytest.mark.parametrize("num_tokens,num_experts,topk", CASES + [(0, 4, 2)], ids=CASE_IDS + ["T0-E4-K2"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_load_balancing_loss_matches_formula(num_tokens, num_experts, topk, score_func):
    gen = torch.Generator().manual_seed(num_tokens + 29 * topk)
    logits = torch.randn(num_tokens, num_experts, dtype=F64, generator=gen, requires_grad=True)
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    topk_idx = _rand_topk_idx(num_tokens, num_experts, topk, gen)

    loss = load_balancing_loss(scores, topk_idx, num_experts, topk)

    flat = topk_idx.flatten().tolist()
    expected = (scores * 0).sum()  # connected to the graph even for T = 0
    for e in range(num_experts):
        f_e = flat.count(e) / (num_tokens * topk) if num_tokens else 0.0
        p_e = sum(scores[t, e] / scores[t].sum() for t in range(num_tokens)) / max(num_tokens, 1)
        expected = expected + f_e * p_e
    expected = num_experts * expected
    torch.testing.assert_close(loss, expected)
    got = torch.autograd.grad(loss, logits, retain_graph=True, materialize_grads=True)[0]
    want = torch.autograd.grad(expected, logits, materialize_grads=True)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "counts",
    [[3, 0, 5, 1], [0, 0, 0, 4], [2, 3, 4, 0], [0, 0, 0, 0], [5]],
    ids=["N9-E4", "N4-E4-first-empty", "N9-E4-last-empty", "N0-E4", "N5-E1"],
)
def test_grouped_mlp_matches_per_row_loop(counts):
    gen = torch.Generator().manual_seed(sum(counts) + len(counts))
    h, ffn = 6, 5
    num_local = len(counts)
    x = torch.randn(sum(counts), h, dtype=F64, generator=gen, requires_grad=True)
    w1 = torch.randn(num_local, h, 2 * ffn, dtype=F64, generator=gen, requires_grad=True)
    w2 = torch.randn(num_local, ffn, h, dtype=F64, generator=gen, requires_grad=True)

    out = grouped_mlp(x, torch.tensor(counts), w1, w2)

    expert_of_row = [e for e, c in enumerate(counts) for _ in range(c)]
    rows = []
    for n, e in enumerate(expert_of_row):
        gate, up = x[n] @ w1[e, :, :ffn], x[n] @ w1[e, :, ffn:]
        rows.append((gate * torch.sigmoid(gate) * up) @ w2[e])
    expected = torch.stack(rows) if rows else x[:0].clone()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grouped_mlp(x, counts, w1, w2), out, rtol=0, atol=0)

    g = torch.randn_like(out)
    got = _grads(out, [x, w1, w2], g)
    want = _grads(expected, [x, w1, w2], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for e, c in enumerate(counts):
        if c == 0:
            assert not got[1][e].any() and not got[2][e].any()


def _brute_force_groups(logits, topk, score_func, bias, num_groups, topk_groups, norm, scale):
    """Per token: score every set of topk_groups groups by the sum of its group scores, keep the
    best set (ties: the lexicographically first), then the best topk experts inside it."""
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    sel = (scores.detach() + (0 if bias is None else bias)).tolist()
    size = logits.shape[1] // num_groups
    rows = []
    for row in sel:
        def group_score(g):
            members = sorted(row[g * size:(g + 1) * size], reverse=True)
            return sum(members[:2]) if score_func == "sigmoid" else members[0]

        # ranking groups one by one equals picking the best-scoring set, ties to lower groups
        group_order = sorted(range(num_groups), key=lambda g: (-group_score(g), g))
        best_set = set(group_order[:topk_groups])
        assert sum(group_score(g) for g in best_set) == max(
            sum(group_score(g) for g in combo) for combo in itertools.combinations(range(num_groups), topk_groups)
        )
        allowed = [e for e in range(logits.shape[1]) if e // size in best_set]
        rows.append(sorted(allowed, key=lambda e: (-row[e], e))[:topk])
    idx = torch.tensor(rows, dtype=torch.int64).view(logits.shape[0], topk)
    probs = scores.gather(1, idx)
    if norm:
        probs = probs / probs.sum(-1, keepdim=True)
    return probs * scale, idx


GROUP_CASES = [(9, 8, 4, 2, 3), (16, 12, 3, 1, 2), (5, 6, 6, 3, 3), (7, 8, 2, 2, 8), (33, 16, 8, 4, 6)]
GROUP_IDS = [f"T{t}-E{e}-G{g}-Gk{gk}-K{k}" for t, e, g, gk, k in GROUP_CASES]


@pytest.mark.parametrize("num_tokens,num_experts,num_groups,topk_groups,topk", GROUP_CASES, ids=GROUP_IDS)
@pytest.mark.parametrize(
    "score_func,use_bias,norm,scale",
    [("sigmoid", True, None, 2.5), ("softmax", False, None, 1.0), ("softmax", True, True, 0.5)],
    ids=["sigmoid-bias-scale2.5", "softmax", "softmax-bias-norm-scale0.5"],
)
def test_group_limited_routing_matches_brute_force(
    num_tokens, num_experts, num_groups, topk_groups, topk, score_func, use_bias, norm, scale
):
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_groups)
    logits = torch.randn(num_tokens, num_experts, dtype=F64, generator=gen, requires_grad=True)
    bias = torch.randn(num_experts, dtype=F64, generator=gen) * 0.2 if use_bias else None

    probs, idx, _ = router_topk(logits, topk, score_func, bias, norm, num_groups, topk_groups, scale)
    norm_default = score_func == "sigmoid" if norm is None else norm
    want_probs, want_idx = _brute_force_groups(
        logits, topk, score_func, bias, num_groups, topk_groups, norm_default, scale
    )

    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(probs, want_probs)
    g = torch.randn_like(probs)
    torch.testing.assert_close(_grads(probs, [logits], g)[0], _grads(want_probs, [logits], g)[0])


def test_group_limited_routing_changes_the_choice():
    # expert 0 alone is the best, but its group is weak: group-limited routing must skip it
    logits = torch.tensor([[5.0, -5.0, -5.0, -5.0, 2.0, 2.0, 1.0, 1.0]], dtype=F64)
    _, free_idx, _ = router_topk(logits, 2, "sigmoid")
    _, group_idx, _ = router_topk(logits, 2, "sigmoid", num_groups=2, topk_groups=1)
    assert free_idx.tolist() == [[0, 4]] and group_idx.tolist() == [[4, 5]]


@pytest.mark.parametrize("seq_len,batch", [(5, 3), (1, 1), (8, 2), (0, 2)], ids=["S5-B3", "S1-B1", "S8-B2", "S0-B2"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_sequence_load_balancing_loss_matches_hand_computation(seq_len, batch, score_func, padded):
    num_experts, topk = 6, 2
    gen = torch.Generator().manual_seed(seq_len * 10 + batch)
    logits = torch.randn(seq_len, batch, num_experts, dtype=F64, generator=gen, requires_grad=True)
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    topk_idx = _rand_topk_idx(seq_len * batch, num_experts, topk, gen).view(seq_len, batch, topk)
    valid = torch.ones(seq_len, batch, dtype=torch.bool)
    if padded and batch > 1:
        valid[seq_len // 2:, 0] = False
        valid[:, 1] = False  # a sequence of padding only: left out of the mean

    loss = sequence_load_balancing_loss(scores, topk_idx, num_experts, topk, valid)

    # DeepSeek-V3 eq. (17-20) for each sequence, written out token by token
    per_seq = []
    for j in range(batch):
        tokens = [t for t in range(seq_len) if valid[t, j]]
        if not tokens:
            continue
        total = (scores * 0).sum()
        for e in range(num_experts):
            hits = sum(int(e in topk_idx[t, j].tolist()) for t in tokens)
            f_e = num_experts / (topk * len(tokens)) * hits
            p_e = sum(scores[t, j, e] / scores[t, j].sum() for t in tokens) / len(tokens)
            total = total + f_e * p_e
        per_seq.append(total)
    expected = sum(per_seq) / len(per_seq) if per_seq else (scores * 0).sum()
    torch.testing.assert_close(loss, expected)
    got = torch.autograd.grad(loss, logits, retain_graph=True, materialize_grads=True)[0]
    want = torch.autograd.grad(expected, logits, materialize_grads=True)[0]
    torch.testing.assert_close(got, want)


def test_load_balancing_loss_with_given_counts_uses_them_as_the_load():
    gen = torch.Generator().manual_seed(8)
    num_tokens, num_experts, topk = 11, 5, 2
    logits = torch.randn(num_tokens, num_experts, dtype=F64, generator=gen, requires_grad=True)
    scores = logits.sigmoid()
    topk_idx = _rand_topk_idx(num_tokens, num_experts, topk, gen)
    counts = torch.randint(0, 50, (num_experts,), generator=gen)

    loss = load_balancing_loss(scores, topk_idx, num_experts, topk, counts)

    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    expected = num_experts * sum(counts[e] / counts.sum() * p[e] for e in range(num_experts))
    torch.testing.assert_close(loss, expected)
    g = torch.autograd.grad(loss, logits, retain_graph=True)[0]
    torch.testing.assert_close(g, torch.autograd.grad(expected, logits)[0])
    own = torch.bincount(topk_idx.flatten(), minlength=num_experts)
    torch.testing.assert_close(
        load_balancing_loss(scores, topk_idx, num_experts, topk, own),
        load_balancing_loss(scores, topk_idx, num_experts, topk),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("num_tokens", [0, 1, 13], ids=["T0", "T1", "T13"])
def test_router_z_loss_matches_hand_computation(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, 7, dtype=F64, generator=gen, requires_grad=True) * 3
    loss = router_z_loss(logits)
    expected = (logits * 0).sum()
    for t in range(num_tokens):
        expected = expected + torch.log(torch.exp(logits[t]).sum()) ** 2 / num_tokens
    torch.testing.assert_close(loss, expected)
    got = torch.autograd.grad(loss, logits, retain_graph=True, materialize_grads=True)
    want = torch.autograd.grad(expected, logits, materialize_grads=True)
    torch.testing.assert_close(got[0], want[0])


def _capacity_oracle(topk_idx, probs, num_experts, capacity, policy):
    """Per expert: list its copies, rank them by policy, keep the first `capacity`."""
    num_tokens, topk = topk_idx.shape
    keep = torch.zeros(num_tokens, topk, dtype=torch.bool)
    for e in range(num_experts):
        copies = [(t, k) for t in range(num_tokens) for k in range(topk) if topk_idx[t, k] == e]
        if policy == "probs":
            copies.sort(key=lambda c: (-float(probs[c]), c[0] * topk + c[1]))
        for c in copies[:capacity]:
            keep[c] = True
    return keep


@pytest.mark.parametrize("num_tokens,num_experts,topk", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.5], ids=["cf0.5", "cf1.0", "cf1.5"])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keep_mask_matches_oracle(num_tokens, num_experts, topk, capacity_factor, policy):
    gen = torch.Generator().manual_seed(num_tokens * 3 + topk)
    # skewed routing so that some experts overflow; rounded probs create exact ties
    weights = torch.arange(num_experts, 0, -1, dtype=F64) ** 2
    topk_idx = torch.stack([torch.multinomial(weights, topk, generator=gen) for _ in range(num_tokens)])
    probs = (torch.rand(num_tokens, topk, dtype=F64, generator=gen) * 4).round() / 4
    capacity = expert_capacity(num_tokens, topk, num_experts, capacity_factor)
    assert capacity == math.ceil(capacity_factor * num_tokens * topk / num_experts)

    keep = capacity_keep_mask(topk_idx, probs, num_experts, capacity, policy)

    assert torch.equal(keep, _capacity_oracle(topk_idx, probs, num_experts, capacity, policy))
    kept_counts = torch.bincount(topk_idx[keep], minlength=num_experts)
    all_counts = torch.bincount(topk_idx.flatten(), minlength=num_experts)
    assert torch.equal(kept_counts, all_counts.clamp_max(capacity))


def test_bad_inputs_raise_value_error_naming_the_argument():
    logits = torch.randn(4, 6)
    with pytest.raises(ValueError, match="topk"):
        router_topk(logits, 7)
    with pytest.raises(ValueError, match="score_func"):
        router_topk(logits, 2, "relu")
    with pytest.raises(ValueError, match="expert_bias"):
        router_topk(logits, 2, expert_bias=torch.zeros(5))
    with pytest.raises(ValueError, match="logits"):
        router_topk(logits[0], 2)
    with pytest.raises(ValueError, match="num_groups"):
        router_topk(logits, 2, num_groups=4)
    with pytest.raises(ValueError, match="topk_groups"):
        router_topk(logits, 2, num_groups=3, topk_groups=4)
    with pytest.raises(ValueError, match="topk_groups"):
        router_topk(logits, 3, num_groups=3, topk_groups=1)
    with pytest.raises(ValueError, match="expert_counts"):
        load_balancing_loss(logits, torch.zeros(4, 2, dtype=torch.int64), 6, 2, torch.zeros(5))
    with pytest.raises(ValueError, match="valid"):
        sequence_load_balancing_loss(
            torch.rand(3, 2, 6), torch.zeros(3, 2, 2, dtype=torch.int64), 6, 2, torch.ones(2, 3, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(4, 2, 6, 0.0)
    with pytest.raises(ValueError, match="drop_policy"):
        capacity_keep_mask(torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2), 6, 1, "random")
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="topk_idx"):
        load_balancing_loss(logits, idx, 6, 3)
    with pytest.raises(ValueError, match="topk_idx"):
        permute(torch.randn(3, 2), idx, 6)
    with pytest.raises(ValueError, match="topk_idx values"):
        permute(torch.randn(4, 2), idx + 6, 6)
    with pytest.raises(ValueError, match="y must be"):
        unpermute(torch.randn(7, 2), torch.arange(8), torch.rand(4, 2))
    w1, w2 = torch.randn(2, 3, 8), torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        grouped_mlp(torch.randn(5, 3), [2, 2], w1, w2)
    with pytest.raises(ValueError, match="w1"):
        grouped_mlp(torch.randn(4, 3), [2, 2], w1, w2[:, :3])
