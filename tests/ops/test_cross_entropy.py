"""Chunked linear + cross-entropy against the naive oracle: forward and both gradients.

Shape legend:
  N  tokens    D  hidden size    V  vocabulary size    C  token chunk    U  vocabulary chunk
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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


def oracle(hidden, weight, labels, ignore_index=IGNORE, reduction="mean", z_loss_weight=0.0, label_smoothing=0.0):
    """F.cross_entropy on the full logits plus the z-loss written out: independent of the package."""
    logits = hidden @ weight.T  # [N, V]
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)  # [N]
    valid = labels != ignore_index  # [N]
    loss = loss + z_loss_weight * torch.logsumexp(logits, dim=-1) ** 2 * valid
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)


OPTION_CASES = [  # (N, D, V, C, U, z_loss_weight, label_smoothing)
    (64, 16, 40, 16, 8, 0.0, 0.0),
    (63, 16, 41, 16, 9, 1e-2, 0.0),
    (37, 8, 129, 10, 50, 0.0, 0.1),
    (29, 6, 31, 7, 31, 0.05, 0.2),
    (5, 3, 7, 1, 1, 0.3, 1.0),
    (50, 12, 97, 64, 8192, 1e-3, 0.05),
]
OPTION_IDS = [f"N{n}-D{d}-V{v}-C{c}-U{u}-z{z}-ls{ls}" for n, d, v, c, u, z, ls in OPTION_CASES]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("num_tokens,hidden_size,vocab_size,chunk_size,vocab_chunk,z_loss,smoothing", OPTION_CASES, ids=OPTION_IDS)
def test_vocab_chunks_z_loss_smoothing_match_f_cross_entropy(
    num_tokens, hidden_size, vocab_size, chunk_size, vocab_chunk, z_loss, smoothing, reduction
):
    seed = num_tokens * 7 + vocab_size
    inputs = make_inputs(num_tokens, hidden_size, vocab_size, torch.float64, seed)
    options = {"z_loss_weight": z_loss, "label_smoothing": smoothing}
    expected = loss_and_grads(oracle, *inputs, reduction, seed, **options)
    actual = loss_and_grads(
        chunked_linear_cross_entropy, *inputs, reduction, seed, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk, **options
    )
    for name, a, e in zip(("loss", "grad_hidden", "grad_weight"), actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_frozen_weight_gives_hidden_grad_and_no_weight_work(reduction):
    num_tokens, hidden_size, vocab_size, chunk_size, vocab_chunk = 41, 8, 53, 9, 10
    hidden, weight, labels = make_inputs(num_tokens, hidden_size, vocab_size, torch.float64, seed=17)
    options = {"z_loss_weight": 0.01, "label_smoothing": 0.1}
    upstream = torch.randn(num_tokens if reduction == "none" else (), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    # [U, D]: the weight gradient's products, for the full and the last vocabulary chunk
    weight_grad_shapes = {(vocab_chunk, hidden_size), (vocab_size % vocab_chunk, hidden_size)}

    def run(weight_trainable):
        leaves = (hidden.detach().requires_grad_(), weight.detach().requires_grad_(weight_trainable))
        loss = chunked_linear_cross_entropy(*leaves, labels, reduction=reduction, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk, **options)
        products = []
        with TorchDispatchRecorder(products):
            grads = torch.autograd.grad((loss * upstream).sum(), leaves[: 1 + weight_trainable])
        return loss, grads[0], leaves[1].grad, set(products)

    loss, grad_hidden, frozen_grad, products = run(weight_trainable=False)
    hidden_leaf = hidden.detach().requires_grad_()
    expected = oracle(hidden_leaf, weight, labels, reduction=reduction, **options)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), (hidden_leaf,))
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_hidden, expected_grad, rtol=1e-12, atol=1e-12)
    assert frozen_grad is None
    assert not weight_grad_shapes & products, f"weight-gradient products ran for a frozen weight: {products}"
    # positive control: the same recorder sees them when the weight trains
    assert weight_grad_shapes <= run(weight_trainable=True)[3]


class TorchDispatchRecorder(TorchDispatchMode):
    """Records the output shape of every matrix product (mm / addmm / bmm) run inside it."""

    def __init__(self, shapes, all_ops=False):
        super().__init__()
        self.shapes, self.all_ops = shapes, all_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and (self.all_ops or name in ("mm", "addmm", "bmm", "matmul")):
            self.shapes.append(tuple(out.shape))
        return out


def test_no_tensor_reaches_chunk_by_full_vocab():
    """With vocab_chunk_size < V, no intermediate of forward or backward has C * V elements or more."""
    num_tokens, hidden_size, vocab_size, chunk_size, vocab_chunk = 40, 4, 101, 16, 10
    hidden, weight, labels = make_inputs(num_tokens, hidden_size, vocab_size, torch.float64, seed=19)
    hidden.requires_grad_()
    weight.requires_grad_()
    shapes = []
    with TorchDispatchRecorder(shapes, all_ops=True):
        loss = chunked_linear_cross_entropy(
            hidden, weight, labels, z_loss_weight=0.1, label_smoothing=0.1, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk
        )
        torch.autograd.grad(loss, (hidden, weight))
    assert (chunk_size, vocab_chunk) in shapes, "the logits tile was not seen, so this test checks nothing"
    largest = max(math.prod(shape) for shape in shapes)
    assert largest < chunk_size * vocab_size, f"largest intermediate {largest} elements, shapes {sorted(set(shapes))}"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"backend": "cuda-fused"}, "backend"),
        ({"reduction": "avg"}, "reduction"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"vocab_start": 3}, "vocab_start"),
        ({"vocab_chunk_size": 0}, "vocab_chunk_size"),
        ({"z_loss_weight": -1.0}, "z_loss_weight"),
        ({"label_smoothing": 1.5}, "label_smoothing"),
        ({"labels": torch.full((6,), 9)}, "labels"),
        ({"labels": torch.zeros(6, dtype=torch.int32)}, "labels"),
        ({"labels": torch.zeros(5, dtype=torch.int64)}, "labels"),
        ({"weight": torch.randn(9, 5)}, "weight"),
        ({"hidden": torch.randn(6)}, "hidden"),
    ],
    ids=["backend", "reduction", "chunk_size", "vocab_start", "vocab_chunk_size", "z_loss_weight", "label_smoothing", "label-out-of-vocab", "labels-int32", "labels-len", "weight-D", "hidden-1d"],
)
def test_bad_input_raises_value_error(kwargs, match):
    args = {"hidden": torch.randn(6, 4), "weight": torch.randn(9, 4), "labels": torch.zeros(6, dtype=torch.int64)}
    args.update(kwargs)
    hidden, weight, labels = args.pop("hidden"), args.pop("weight"), args.pop("labels")
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(hidden, weight, labels, **args)


TP_CASES = [  # (N, D, V, C, U, reduction, split, z_loss_weight, label_smoothing): split = vocab rows on rank 0, uneven
    (33, 8, 37, 8, 5, "mean", 18, 0.0, 0.0),
    (20, 6, 50, 64, 8192, "sum", 25, 0.0, 0.0),
    (17, 5, 23, 4, 3, "none", 1, 0.0, 0.0),
    (29, 7, 45, 6, 7, "mean", 20, 0.02, 0.15),
    (15, 4, 31, 5, 4, "none", 9, 0.1, 0.3),
]


def _vocab_parallel_worker(rank, world_size, cases):
    group = dist.new_group(list(range(world_size)))
    results = []
    for index, (num_tokens, hidden_size, vocab_size, chunk_size, vocab_chunk, reduction, split, z_loss, smoothing) in enumerate(cases):
        hidden, weight, labels = make_inputs(num_tokens, hidden_size, vocab_size, torch.float64, seed=index)
        bounds = (0, split, vocab_size)
        shard = weight[bounds[rank] : bounds[rank + 1]]  # [V_rank, D]
        outputs = loss_and_grads(
            linear_cross_entropy, hidden, shard, labels, reduction, index,
            chunk_size=chunk_size, vocab_chunk_size=vocab_chunk, z_loss_weight=z_loss, label_smoothing=smoothing,
            tp_group=group, vocab_start=bounds[rank],
        )
        # numpy, not tensors: torch's queue shares tensor memory, which dies with the child
        results.append([t.numpy() for t in outputs])
    return results


@pytest.mark.distributed
def test_vocab_parallel_matches_single_process():
    per_rank = spawn(_vocab_parallel_worker, 2, TP_CASES)
    for index, (num_tokens, hidden_size, vocab_size, _, _, reduction, _, z_loss, smoothing) in enumerate(TP_CASES):
        inputs = make_inputs(num_tokens, hidden_size, vocab_size, torch.float64, seed=index)
        loss, grad_hidden, grad_weight = loss_and_grads(
            oracle, *inputs, reduction, index, z_loss_weight=z_loss, label_smoothing=smoothing
        )
        for rank in range(2):
            rank_loss, rank_grad_hidden, _ = map(torch.from_numpy, per_rank[rank][index])
            torch.testing.assert_close(rank_loss, loss, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(rank_grad_hidden, grad_hidden, rtol=1e-12, atol=1e-12)
        grad_weight_tp = torch.from_numpy(np.concatenate([per_rank[0][index][2], per_rank[1][index][2]]))  # [V, D]
        torch.testing.assert_close(grad_weight_tp, grad_weight, rtol=1e-12, atol=1e-12)
