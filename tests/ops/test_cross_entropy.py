"""Chunked linear + cross-entropy against the naive oracle: forward and both gradients.

Shape legend:
  N  tokens    D  hidden size    V  vocabulary size    C  chunk size
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_moe_hybrid.ops.cross_entropy import (
    available_backends,
    chunked_linear_cross_entropy,
    linear_cross_entropy,
    naive_linear_cross_entropy,
)
from megatron_moe_hybrid.testing import spawn

IGNORE = -100


def make_inputs(num_tokens, hidden_size, vocab_size, dtype, seed, ignore_frac=0.25):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, dtype=torch.float64).to(dtype)  # [N, D]
    weight = torch.randn(vocab_size, hidden_size, generator=gen, dtype=torch.float64).to(dtype)  # [V, D]
    labels = torch.randint(0, vocab_size, (num_tokens,), generator=gen)  # [N]
    labels[torch.rand(num_tokens, generator=gen) < ignore_frac] = IGNORE
    return hidden, weight, labels


def loss_and_grads(fn, hidden, weight, labels, reduction, seed, **kwargs):
    """loss and d(sum(loss * r))/d(hidden, weight) for a random upstream gradient r."""
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss = fn(hidden, weight, labels, ignore_index=IGNORE, reduction=reduction, **kwargs)
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=loss.dtype)
    grad_hidden, grad_weight = torch.autograd.grad((loss * upstream).sum(), (hidden, weight))
    return loss.detach(), grad_hidden, grad_weight


CASES = [  # (N, D, V, C): N a multiple of C, not, smaller than C, and C = 1
    (64, 16, 40, 16),
    (63, 16, 41, 16),
    (37, 8, 129, 1024),
    (5, 3, 7, 1),
    (101, 32, 257, 33),
]
CASE_IDS = [f"N{n}-D{d}-V{v}-C{c}" for n, d, v, c in CASES]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("num_tokens,hidden_size,vocab_size,chunk_size", CASES, ids=CASE_IDS)
def test_chunked_matches_naive_fp64(num_tokens, hidden_size, vocab_size, chunk_size, reduction):
    seed = num_tokens * 1000 + vocab_size
    inputs = make_inputs(num_tokens, hidden_size, vocab_size, torch.float64, seed)
    expected = loss_and_grads(naive_linear_cross_entropy, *inputs, reduction, seed)
    actual = loss_and_grads(chunked_linear_cross_entropy, *inputs, reduction, seed, chunk_size=chunk_size)
    for name, a, e in zip(("loss", "grad_hidden", "grad_weight"), actual, expected):
        assert a.dtype == torch.float64, name
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_error_at_most_twice_naive_error(dtype, reduction):
    """In low precision, the chunked error vs the fp64 truth is within ~2x the naive one's."""
    seed = 7
    inputs64 = make_inputs(75, 24, 301, torch.float64, seed)
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs64]
    truth = loss_and_grads(naive_linear_cross_entropy, *[t.to(torch.float64) if t.is_floating_point() else t for t in inputs], reduction, seed)
    naive = loss_and_grads(naive_linear_cross_entropy, *inputs, reduction, seed)
    chunked = loss_and_grads(chunked_linear_cross_entropy, *inputs, reduction, seed, chunk_size=16)
    for name, c, n, t in zip(("loss", "grad_hidden", "grad_weight"), chunked, naive, truth):
        assert c.dtype == n.dtype, name
        chunked_err = (c.double() - t).abs().max().item()
        naive_err = (n.double() - t).abs().max().item()
        assert chunked_err <= 2 * naive_err + 1e-6, f"{name}: chunked {chunked_err:.3g} vs naive {naive_err:.3g}"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_grads(reduction):
    hidden, weight, labels = make_inputs(19, 8, 11, torch.float64, seed=3)
    labels.fill_(IGNORE)
    loss, grad_hidden, grad_weight = loss_and_grads(chunked_linear_cross_entropy, hidden, weight, labels, reduction, 3, chunk_size=4)
    for name, t in (("loss", loss), ("grad_hidden", grad_hidden), ("grad_weight", grad_weight)):
        torch.testing.assert_close(t, torch.zeros_like(t), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_custom_ignore_index_and_mean_over_valid_tokens():
    hidden, weight, labels = make_inputs(30, 8, 13, torch.float64, seed=5, ignore_frac=0.0)
    labels[::3] = 12  # a real class used as ignore_index: those tokens must drop out of loss and count
    got = chunked_linear_cross_entropy(hidden, weight, labels, ignore_index=12, chunk_size=7)
    keep = labels != 12
    expected = torch.nn.functional.cross_entropy(hidden[keep] @ weight.T, labels[keep])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_saved_tensors_are_never_token_by_vocab():
    """The forward keeps hidden, weight, labels and lse only: nothing of size [N, V]."""
    num_tokens, vocab_size = 48, 97
    hidden, weight, labels = make_inputs(num_tokens, 16, vocab_size, torch.float32, seed=11)
    hidden.requires_grad_()
    weight.requires_grad_()
    saved_shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_shapes.append(tuple(t.shape)) or t, lambda t: t):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=16)
    assert saved_shapes, "the hook saw no saved tensor, so this test checks nothing"
    assert (num_tokens, vocab_size) not in saved_shapes and (16, vocab_size) not in saved_shapes, saved_shapes


def test_public_function_dispatches_to_torch_backend():
    assert "torch" in available_backends()
    hidden, weight, labels = make_inputs(21, 8, 17, torch.float64, seed=13)
    for backend in ("auto", "torch"):
        got = loss_and_grads(linear_cross_entropy, hidden, weight, labels, "mean", 13, chunk_size=5, backend=backend)
        expected = loss_and_grads(naive_linear_cross_entropy, hidden, weight, labels, "mean", 13)
        for a, e in zip(got, expected):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"backend": "cuda-fused"}, "backend"),
        ({"reduction": "avg"}, "reduction"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"vocab_start": 3}, "vocab_start"),
        ({"labels": torch.full((6,), 9)}, "labels"),
        ({"labels": torch.zeros(6, dtype=torch.int32)}, "labels"),
        ({"labels": torch.zeros(5, dtype=torch.int64)}, "labels"),
        ({"weight": torch.randn(9, 5)}, "weight"),
        ({"hidden": torch.randn(6)}, "hidden"),
    ],
    ids=["backend", "reduction", "chunk_size", "vocab_start", "label-out-of-vocab", "labels-int32", "labels-len", "weight-D", "hidden-1d"],
)
def test_bad_input_raises_value_error(kwargs, match):
    args = {"hidden": torch.randn(6, 4), "weight": torch.randn(9, 4), "labels": torch.zeros(6, dtype=torch.int64)}
    args.update(kwargs)
    hidden, weight, labels = args.pop("hidden"), args.pop("weight"), args.pop("labels")
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(hidden, weight, labels, **args)


TP_CASES = [  # (N, D, V, C, reduction, split): split = vocab rows on rank 0, uneven on purpose
    (33, 8, 37, 8, "mean", 18),
    (20, 6, 50, 64, "sum", 25),
    (17, 5, 23, 4, "none", 1),
]


def _vocab_parallel_worker(rank, world_size, cases):
    group = dist.new_group(list(range(world_size)))
    results = []
    for index, (num_tokens, hidden_size, vocab_size, chunk_size, reduction, split) in enumerate(cases):
        hidden, weight, labels = make_inputs(num_tokens, hidden_size, vocab_size, torch.float64, seed=index)
        bounds = (0, split, vocab_size)
        shard = weight[bounds[rank] : bounds[rank + 1]]  # [V_rank, D]
        outputs = loss_and_grads(
            linear_cross_entropy, hidden, shard, labels, reduction, index,
            chunk_size=chunk_size, tp_group=group, vocab_start=bounds[rank],
        )
        # numpy, not tensors: torch's queue shares tensor memory, which dies with the child
        results.append([t.numpy() for t in outputs])
    return results


@pytest.mark.distributed
def test_vocab_parallel_matches_single_process():
    per_rank = spawn(_vocab_parallel_worker, 2, TP_CASES)
    for index, (num_tokens, hidden_size, vocab_size, chunk_size, reduction, split) in enumerate(TP_CASES):
        inputs = make_inputs(num_tokens, hidden_size, vocab_size, torch.float64, seed=index)
        loss, grad_hidden, grad_weight = loss_and_grads(naive_linear_cross_entropy, *inputs, reduction, index)
        for rank in range(2):
            rank_loss, rank_grad_hidden, _ = map(torch.from_numpy, per_rank[rank][index])
            torch.testing.assert_close(rank_loss, loss, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(rank_grad_hidden, grad_hidden, rtol=1e-12, atol=1e-12)
        grad_weight_tp = torch.from_numpy(np.concatenate([per_rank[0][index][2], per_rank[1][index][2]]))  # [V, D]
        torch.testing.assert_close(grad_weight_tp, grad_weight, rtol=1e-12, atol=1e-12)
