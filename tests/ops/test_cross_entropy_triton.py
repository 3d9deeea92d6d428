"""Triton linear + cross-entropy against the fp64 oracle: forward and both gradients.

Without a GPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set before
the kernels are defined) on small fp32/fp16 shapes; bf16 is left to the `gpu` tests,
because the interpreter's bf16 loads are wrong on CPU.

Shape legend:
  N  tokens    D  hidden size    V  vocabulary size    C  token chunk
"""

import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from megatron_moe_hybrid.ops.cross_entropy import linear_cross_entropy  # noqa: E402
from megatron_moe_hybrid.ops.cross_entropy import triton as triton_backend  # noqa: E402
from megatron_moe_hybrid.ops.cross_entropy.triton import BLOCK_V, auto_chunk_size, triton_linear_cross_entropy  # noqa: E402
from megatron_moe_hybrid.testing import cuda_graph, spawn  # noqa: E402

IGNORE = -100
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(num_tokens, hidden_size, vocab_size, seed, ignore_frac=0.25, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, dtype=torch.float64)  # [N, D]
    weight = torch.randn(vocab_size, hidden_size, generator=gen, dtype=torch.float64) / hidden_size**0.5  # [V, D]
    labels = torch.randint(0, vocab_size, (num_tokens,), generator=gen)  # [N]
    labels[torch.rand(num_tokens, generator=gen) < ignore_frac] = IGNORE
    return hidden.to(device), weight.to(device), labels.to(device)


def oracle(hidden, weight, labels, ignore_index=IGNORE, reduction="mean", z_loss_weight=0.0, label_smoothing=0.0):
    """F.cross_entropy on the full logits plus the z-loss written out."""
    logits = hidden @ weight.T  # [N, V]
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = labels != ignore_index  # [N]
    loss = loss + z_loss_weight * torch.logsumexp(logits, dim=-1) ** 2 * valid
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)


def loss_and_grads(fn, hidden, weight, labels, reduction, seed, weight_trainable=True, **kwargs):
    """loss and d(sum(loss * r))/d(hidden[, weight]) for a random upstream gradient r."""
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_(weight_trainable)
    loss = fn(hidden, weight, labels, ignore_index=IGNORE, reduction=reduction, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    upstream = torch.randn(loss.shape, generator=gen, dtype=torch.float64).to(loss.device, loss.dtype)
    leaves = (hidden, weight) if weight_trainable else (hidden,)
    return (loss.detach(), *torch.autograd.grad((loss * upstream).sum(), leaves))


def relative_error(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def check_against_oracle(dtype, num_tokens, hidden_size, vocab_size, chunk_size, reduction, seed, tolerance,
                         weight_trainable=True, device=DEVICE, **options):
    hidden, weight, labels = make_inputs(num_tokens, hidden_size, vocab_size, seed, device=device)
    truth = loss_and_grads(oracle, hidden, weight, labels, reduction, seed, weight_trainable, **options)
    got = loss_and_grads(
        triton_linear_cross_entropy, hidden.to(dtype), weight.to(dtype), labels, reduction, seed, weight_trainable,
        chunk_size=chunk_size, **options,
    )
    assert got[0].dtype == torch.float32 and all(g.dtype == dtype for g in got[1:])
    for name, g, t in zip(("loss", "grad_hidden", "grad_weight"), got, truth):
        assert torch.isfinite(g).all(), name
        error = relative_error(g, t)
        assert error < tolerance, f"{name}: relative error {error:.3g} >= {tolerance}"


INTERPRET_CASES = [  # (N, D, V, C, z_loss_weight, label_smoothing)
    (16, 8, 40, 16, 0.0, 0.0),
    (37, 16, 53, 8, 1e-2, 0.0),
    (23, 8, 129, 5, 0.0, 0.1),
    (9, 4, BLOCK_V + 5, 4, 1e-3, 0.2),  # several column blocks per row, the last one partial
    (5, 3, 7, 1, 0.3, 1.0),
]
INTERPRET_IDS = [f"N{n}-D{d}-V{v}-C{c}-z{z}-ls{ls}" for n, d, v, c, z, ls in INTERPRET_CASES]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("num_tokens,hidden_size,vocab_size,chunk_size,z_loss,smoothing", INTERPRET_CASES, ids=INTERPRET_IDS)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float16, 5e-3)], ids=["fp32", "fp16"])
def test_triton_matches_oracle(dtype, tolerance, num_tokens, hidden_size, vocab_size, chunk_size, z_loss, smoothing, reduction):
    check_against_oracle(
        dtype, num_tokens, hidden_size, vocab_size, chunk_size, reduction, seed=num_tokens + vocab_size,
        tolerance=tolerance, z_loss_weight=z_loss, label_smoothing=smoothing,
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_frozen_weight(reduction):
    check_against_oracle(torch.float32, 31, 8, 45, 7, reduction, seed=5, tolerance=1e-5, weight_trainable=False, z_loss_weight=0.01)


@pytest.mark.parametrize("weight_trainable", [False, True], ids=["frozen", "trainable"])
def test_triton_per_token_loss_with_frozen_weight_makes_logits_once(monkeypatch, weight_trainable):
    """reduction "none" (the model's per-token loss) with a frozen weight (LoRA): the forward
    forms d loss_n / d hidden_n and the backward only scales rows by the upstream gradient, so
    each chunk's logits product runs once; a trainable weight needs the backward's recompute."""
    calls = []
    logits = triton_backend._Chunks.logits
    monkeypatch.setattr(triton_backend._Chunks, "logits", lambda self, rows: calls.append(rows) or logits(self, rows))
    check_against_oracle(torch.float32, 29, 8, 45, 7, "none", seed=9, tolerance=1e-5,
                         weight_trainable=weight_trainable, z_loss_weight=0.01, label_smoothing=0.1)
    chunks = -(-29 // 7)
    assert len(calls) == (2 * chunks if weight_trainable else chunks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 1.0 + 2**-20, 0.5, -3.7, float("nan")])
def test_scale_in_place_equals_torch_mul(monkeypatch, dtype, scale):
    """_scale_ is torch's x.mul_(s.to(x.dtype)) bitwise, at a length that leaves a partial block and
    more blocks than programs (each program strides over several), for a scale of 1 (skipped on
    the device: x times 1 is x), one that rounds to 1 in fp16 only, others and NaN."""
    monkeypatch.setattr(triton_backend, "SCALE_BLOCK", 16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16 * 4 * 3 + 5, generator=gen).to(dtype).to(DEVICE)
    s = torch.tensor(scale, device=DEVICE)
    want = x.clone().mul_(s.to(dtype))
    got = x.clone()
    triton_backend._scale_(got, s)
    if math.isnan(scale):
        assert torch.isnan(got).all() and torch.isnan(want).all()
    else:
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="contiguous"):
        triton_backend._scale_(x.view(-1, 1)[::2], s)


def test_scale_of_one_writes_nothing(monkeypatch):
    """Where s is 1 the kernel skips the pass, observable on signalling NaNs: any multiply (torch's
    mul_ by 1 here) quiets them, changing their bits; after _scale_ by 1 they are as they were,
    and by 0.5 they are quieted like torch's."""
    monkeypatch.setattr(triton_backend, "SCALE_BLOCK", 16)
    signalling = torch.full((16 * 4 * 3 + 5,), 0x7F800001, dtype=torch.int32, device=DEVICE)
    quieted = signalling.clone()
    quieted.view(torch.float32).mul_(torch.tensor(1.0, device=DEVICE))
    assert not torch.equal(quieted, signalling)  # the probe can see a multiply
    x = signalling.clone()
    triton_backend._scale_(x.view(torch.float32), torch.tensor(1.0, device=DEVICE))
    assert torch.equal(x, signalling)
    with np.errstate(invalid="ignore"):  # the interpreter's numpy multiply of a NaN
        triton_backend._scale_(x.view(torch.float32), torch.tensor(0.5, device=DEVICE))
    assert not torch.equal(x, signalling) and torch.isnan(x.view(torch.float32)).all()


def test_upstream_gradient_scales_the_forward_gradients_exactly(monkeypatch):
    """reduction "mean": the gradients formed in the forward are scaled in the backward by the
    upstream gradient; 2.0 gives exactly twice those of 1.0 (fp32, a power of two), which are the
    oracle's; an upstream 0.3 the same bits with the scaling on the device (SCALE_ON_DEVICE, the
    default) as with torch's mul_."""
    hidden, weight, labels = make_inputs(19, 8, 37, seed=4, device=DEVICE)
    grads = {}
    for upstream, on_device in ((1.0, True), (2.0, True), (0.3, True), (0.3, False)):
        monkeypatch.setattr(triton_backend, "SCALE_ON_DEVICE", on_device)
        h = hidden.float().detach().requires_grad_()
        w = weight.float().detach().requires_grad_()
        loss = triton_linear_cross_entropy(h, w, labels, ignore_index=IGNORE, chunk_size=5)
        grads[upstream, on_device] = torch.autograd.grad(loss, (h, w), torch.tensor(upstream, device=DEVICE))
    for one, two, dev, mul in zip(grads[1.0, True], grads[2.0, True], grads[0.3, True], grads[0.3, False]):
        assert torch.equal(two, 2 * one)
        assert torch.equal(dev, mul) and not torch.equal(dev, one)
    h = hidden.double().detach().requires_grad_()
    w = weight.double().detach().requires_grad_()
    truth = torch.autograd.grad(oracle(h, w, labels), (h, w))
    for got, t in zip(grads[1.0, True], truth):
        assert relative_error(got, t) < 1e-5


@pytest.mark.parametrize("reduction, weight_trainable", [("mean", True), ("sum", False), ("none", False),
                                                         ("none", True)])
def test_second_backward_through_one_loss_is_refused_or_exact(reduction, weight_trainable):
    """retain_graph=True and a second backward: where the forward formed the gradients ("mean",
    "sum"), the first backward scaled them in place and returned them, so a second one would scale
    them again (and the first's results with them; it did until 2026-12-05): a RuntimeError saying
    so, the first results untouched. Where the backward scales a copy (a frozen weight's per-token
    loss) or recomputes (a trainable one's), both backwards give the same gradients."""
    hidden, weight, labels = make_inputs(13, 8, 29, seed=6, device=DEVICE)
    h = hidden.float().detach().requires_grad_()
    w = weight.float().detach().requires_grad_(weight_trainable)
    leaves = (h, w) if weight_trainable else (h,)
    loss = triton_linear_cross_entropy(h, w, labels, ignore_index=IGNORE, reduction=reduction, chunk_size=4)
    up = torch.full(loss.shape, 2.0, device=DEVICE)
    first = torch.autograd.grad(loss, leaves, up, retain_graph=True)
    kept = [g.clone() for g in first]
    if reduction != "none":
        with pytest.raises(RuntimeError, match="a second backward through the same loss"):
            torch.autograd.grad(loss, leaves, up)
    else:
        for a, b in zip(torch.autograd.grad(loss, leaves, up), kept):
            assert torch.equal(a, b)
    for a, b in zip(first, kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_triton_all_ignored_gives_zero(reduction):
    hidden, weight, labels = make_inputs(11, 8, 17, seed=2, device=DEVICE)
    labels.fill_(IGNORE)
    got = loss_and_grads(triton_linear_cross_entropy, hidden.float(), weight.float(), labels, reduction, 2, chunk_size=4)
    for name, t in zip(("loss", "grad_hidden", "grad_weight"), got):
        torch.testing.assert_close(t, torch.zeros_like(t), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_rows_split_over_many_programs(monkeypatch, reduction):
    # BLOCK_V 8: a 53-column row is cut into 7 ranges, each a program whose partial
    # (max, sum-exp, target, logit sum) the finish kernel merges; the last range is partial
    monkeypatch.setattr(triton_backend, "BLOCK_V", 8)
    assert triton_backend._splits(5, 53) == (7, 8)
    check_against_oracle(torch.float32, 23, 8, 53, 5, reduction, seed=11, tolerance=1e-5, z_loss_weight=0.01,
                         label_smoothing=0.1)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_one_program_streams_many_blocks_of_a_row(monkeypatch, reduction):
    # BLOCK_V 8 and one program per row: each program keeps a running max and sum-exp
    # over 9 blocks of a 67-column row (the last partial), rescaling the sum as the max moves;
    # logits that grow along the row make the max move at every block, so a missed rescale shows
    monkeypatch.setattr(triton_backend, "BLOCK_V", 8)
    monkeypatch.setattr(triton_backend, "PROGRAMS_PER_CHUNK", 1)
    monkeypatch.setattr(triton_backend, "GRAD_PROGRAMS_PER_CHUNK", 1)
    assert triton_backend._splits(5, 67) == (1, 72)
    hidden, weight, labels = make_inputs(13, 8, 67, seed=12, device=DEVICE)
    weight = weight + 0.3 * torch.linspace(0, 4, 67, dtype=weight.dtype, device=weight.device)[:, None] * hidden.mean(0)
    truth = loss_and_grads(oracle, hidden, weight, labels, reduction, 12, z_loss_weight=0.01)
    got = loss_and_grads(triton_linear_cross_entropy, hidden.float(), weight.float(), labels, reduction, 12,
                         chunk_size=5, z_loss_weight=0.01)
    for name, g, t in zip(("loss", "grad_hidden", "grad_weight"), got, truth):
        assert relative_error(g, t) < 1e-5, (name, relative_error(g, t))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_triton_targets_at_block_and_range_edges(monkeypatch, label_smoothing):
    # The passes read whole blocks unmasked and the row's last block masked; the target logit is
    # one load by the range that holds it, and its gradient is stored after the range's loop.
    # BLOCK_V 8, 53 columns: the stats pass cuts rows into 7 ranges of 8 (the last of 5), the gradient
    # pass into 3 ranges: 24 + 24 (three whole blocks each) + 5 (one partial block); targets on every
    # range's and block's first and last column must all come out as the oracle's.
    monkeypatch.setattr(triton_backend, "BLOCK_V", 8)
    monkeypatch.setattr(triton_backend, "GRAD_PROGRAMS_PER_CHUNK", 18)
    assert triton_backend._splits(6, 53) == (7, 8) and triton_backend._splits(6, 53, 18) == (3, 24)
    targets = torch.tensor([0, 7, 8, 15, 16, 23, 24, 31, 32, 39, 40, 47, 48, 49, 51, 52, 1, IGNORE])
    hidden, weight, labels = make_inputs(len(targets), 8, 53, seed=21, device=DEVICE)
    labels = targets.to(labels.device)
    truth = loss_and_grads(oracle, hidden, weight, labels, "mean", 22, label_smoothing=label_smoothing)
    got = loss_and_grads(triton_linear_cross_entropy, hidden.float(), weight.float(), labels, "mean", 22,
                         chunk_size=6, label_smoothing=label_smoothing)
    for name, g, t in zip(("loss", "grad_hidden", "grad_weight"), got, truth):
        assert relative_error(g, t) < 1e-5, (name, relative_error(g, t))


def test_triton_empty_batch_gives_zero_grads():
    hidden, weight, labels = make_inputs(0, 8, 17, seed=3, device=DEVICE)
    got = loss_and_grads(triton_linear_cross_entropy, hidden.float(), weight.float(), labels, "mean", 3)
    assert got[0].item() == 0.0 and got[1].shape == (0, 8)
    torch.testing.assert_close(got[2], torch.zeros_like(got[2]), rtol=0, atol=0)


def test_auto_chunk_size_bounds_the_buffer():
    # the [C, V] buffer takes about CHUNK_BUDGET of inputs + gradients, in whole 256-token (trainable)
    # or 128-token (frozen) tiles
    num_tokens, hidden_size, vocab_size = 16384, 4096, 151936
    for trainable, expected in ((True, 768), (False, 384)):  # frozen: the budget's 384, above MIN_CHUNK_FROZEN
        chunk = auto_chunk_size(num_tokens, hidden_size, vocab_size, trainable)
        assert chunk == expected
        inputs_and_grads = 2 * num_tokens * hidden_size + (2 if trainable else 1) * vocab_size * hidden_size
        budget_rows = triton_backend.CHUNK_BUDGET * inputs_and_grads / vocab_size
        least = triton_backend.MIN_CHUNK if trainable else triton_backend.MIN_CHUNK_FROZEN
        tile = 256 if trainable else 128
        assert chunk == max(least, budget_rows // tile * tile)
        assert chunk * vocab_size <= max(least * vocab_size, triton_backend.CHUNK_BUDGET * inputs_and_grads)
    assert auto_chunk_size(32768, 7168, 262144, True) == 1536  # the budget's 1596 tokens, to a multiple of 256
    assert auto_chunk_size(32768, 7168, 262144, False) == 768
    assert auto_chunk_size(1000, 8, 10**6, False) == 256  # a frozen weight's floor

    assert auto_chunk_size(100, 8, 10**6, True) == 100  # never more than the batch, never below MIN_CHUNK otherwise
    assert auto_chunk_size(1000, 8, 10**6, True) == 512


def test_backend_triton_is_selectable_and_auto_keeps_torch_on_cpu():
    hidden, weight, labels = make_inputs(13, 8, 21, seed=4)
    from megatron_moe_hybrid.ops import cross_entropy

    assert cross_entropy._auto_backend(hidden) == "torch"
    expected = oracle(hidden, weight, labels, label_smoothing=0.1)
    got = linear_cross_entropy(hidden.float().to(DEVICE), weight.float().to(DEVICE), labels.to(DEVICE), label_smoothing=0.1,
                               chunk_size=4, backend="triton")
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weight"):
        triton_linear_cross_entropy(hidden.float(), weight.half(), labels)


def _triton_vocab_parallel_worker(rank, world_size, num_tokens, hidden_size, vocab_size, split, weight_trainable=True,
                                  label_smoothing=0.1):
    group = dist.new_group(list(range(world_size)))
    hidden, weight, labels = make_inputs(num_tokens, hidden_size, vocab_size, seed=8)
    bounds = (0, split, vocab_size)
    calls = []  # the whole vocabulary's all-reduce: only label smoothing needs it
    real = triton_backend.global_vocab_size
    triton_backend.global_vocab_size = lambda *a: calls.append(a) or real(*a)
    try:
        outputs = loss_and_grads(
            triton_linear_cross_entropy, hidden.float(), weight[bounds[rank] : bounds[rank + 1]].float(), labels, "none",
            8, weight_trainable, chunk_size=6, z_loss_weight=0.01, label_smoothing=label_smoothing, tp_group=group,
            vocab_start=bounds[rank],
        )
    finally:
        triton_backend.global_vocab_size = real
    return [t.numpy() for t in outputs], len(calls)


@pytest.mark.distributed
@pytest.mark.parametrize("label_smoothing", [0.1, 0.0])
@pytest.mark.parametrize("weight_trainable", [True, False], ids=["trainable", "frozen"])
def test_triton_vocab_parallel_matches_oracle(weight_trainable, label_smoothing):
    """TP=2 over gloo equals the single-process oracle; the vocabulary size is all-reduced (a
    collective and a host read per call) only where label smoothing needs it."""
    num_tokens, hidden_size, vocab_size, split = 19, 8, 37, 15
    results = spawn(_triton_vocab_parallel_worker, 2, num_tokens, hidden_size, vocab_size, split, weight_trainable,
                    label_smoothing)
    assert [calls for _, calls in results] == [1 if label_smoothing else 0] * 2
    per_rank = [outputs for outputs, _ in results]
    inputs = make_inputs(num_tokens, hidden_size, vocab_size, seed=8)
    loss, grad_hidden, grad_weight = loss_and_grads(oracle, *inputs, "none", 8, z_loss_weight=0.01,
                                                    label_smoothing=label_smoothing)
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(per_rank[rank][0]).double(), loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(per_rank[rank][1]).double(), grad_hidden, rtol=1e-5, atol=1e-5)
    if not weight_trainable:  # the frozen path all-reduces d loss_n / d hidden_n in the forward
        return
    grad_weight_tp = torch.from_numpy(np.concatenate([per_rank[0][2], per_rank[1][2]])).double()  # [V, D]
    torch.testing.assert_close(grad_weight_tp, grad_weight, rtol=1e-5, atol=1e-5)


GPU_CASES = [  # (N, D, V, C, z_loss_weight, label_smoothing)
    (2048, 512, 50257, 512, 0.0, 0.0),
    (1999, 256, 32003, 700, 1e-4, 0.1),
]
GPU_IDS = [f"N{n}-D{d}-V{v}-C{c}-z{z}-ls{ls}" for n, d, v, c, z, ls in GPU_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("weight_trainable", [True, False], ids=["trainable", "frozen"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("num_tokens,hidden_size,vocab_size,chunk_size,z_loss,smoothing", GPU_CASES, ids=GPU_IDS)
def test_triton_bf16_on_gpu(num_tokens, hidden_size, vocab_size, chunk_size, z_loss, smoothing, reduction, weight_trainable):
    # bf16 operands: relative errors land between 1e-3 and 1e-2
    check_against_oracle(
        torch.bfloat16, num_tokens, hidden_size, vocab_size, chunk_size, reduction, seed=num_tokens, tolerance=2e-2,
        weight_trainable=weight_trainable, device="cuda", z_loss_weight=z_loss, label_smoothing=smoothing,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 0.5, 1.0 / 3, -2.5])
def test_scale_in_place_equals_torch_mul_bf16_gpu(scale):
    """On the H200 in bf16, over a [V, D]-sized gradient at the first loss shape's D (several
    strides of the 2112 programs): _scale_ equals torch's mul_ bitwise, without a host sync."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(37 * 4096 * 17 + 3, generator=gen, device="cuda").bfloat16()
    s = torch.tensor(scale, device="cuda")
    want = x.clone().mul_(s.to(x.dtype))
    got = x.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_backend._scale_(got, s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("weight_trainable", [True, False], ids=["trainable", "frozen"])
def test_triton_loss_captures_in_a_cuda_graph_gpu(weight_trainable):
    """Forward and backward captured in one CUDA graph: the label check (a host read, which a
    capturing stream refuses) is skipped while capturing, after the eager warm-up calls checked
    the labels. A replay equals the eager call bitwise, and new inputs copied into the captured
    tensors give their own loss and gradients."""
    def inputs(seed):
        hidden, weight, labels = make_inputs(2048, 512, 50257, seed=seed, device="cuda")
        return hidden.bfloat16(), weight.bfloat16(), labels

    hidden, weight, labels = inputs(3)
    leaves = [hidden.requires_grad_(), weight.requires_grad_(weight_trainable)][: 2 if weight_trainable else 1]

    def step():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=512, backend="triton")
        return (loss.detach(), *torch.autograd.grad(loss, leaves))

    eager = step()
    last = []

    def keep_last():  # the captured call's outputs are what each replay refills
        last[:] = step()

    graph = cuda_graph(keep_last)
    captured = tuple(last)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
    new_hidden, new_weight, new_labels = inputs(4)
    with torch.no_grad():
        hidden.copy_(new_hidden), weight.copy_(new_weight), labels.copy_(new_labels)
    graph.replay()
    again = step()  # eager, on the new inputs
    torch.cuda.synchronize()
    for a, b in zip(captured, again):
        assert torch.equal(a, b)
    assert not torch.equal(again[0], eager[0])


@pytest.mark.gpu
def test_triton_gpu_peak_memory_is_gradients_plus_one_chunk():
    num_tokens, hidden_size, vocab_size, chunk_size = 8192, 1024, 65536, 1024
    hidden, weight, labels = make_inputs(num_tokens, hidden_size, vocab_size, seed=1, device="cuda")
    hidden = hidden.bfloat16().requires_grad_()
    weight = weight.bfloat16().requires_grad_()
    torch.mm(hidden[:8].detach(), hidden[:8].detach().T)  # torch's cuBLAS workspace of this stream, as in any training step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)  # "auto" must pick triton on CUDA
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    gradients = (hidden.numel() + weight.numel()) * 2
    chunk = chunk_size * vocab_size * 2
    # a few MiB of slack (per-chunk statistics, the tuned product's own few-byte workspace): a second
    # torch cuBLAS workspace on the side stream (32 MiB on the H200) would not fit
    assert peak <= gradients + chunk + 8 * 2**20, f"peak {peak / 2**20:.0f} MiB > gradients + one chunk {(gradients + chunk) / 2**20:.0f} MiB + 8"
