"""Host-memory activation offload (parallel/offload.py): the loss and every gradient are bitwise
those of the plain forward (toy layers in fp64, the tiny hybrid MoE model, with checkpointed
layers, EP=2 over gloo, the trainer); the right tensors are offloaded, never parameters, once
per storage; prefetch runs a layer ahead; the pool is reused; bad settings raise naming the field.

Shape legend: T tokens, h hidden size, L layers; model inputs are [b, s] token ids.
"""

import contextlib
import importlib.util
import json
import os
import sys

import pytest
import torch
import yaml
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_moe_hybrid.config import ConfigError, config_from_dict
from megatron_moe_hybrid.parallel.offload import ActivationOffload
from megatron_moe_hybrid.testing import init_megatron, spawn, teardown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F64 = torch.float64


class ToyLayer(nn.Module):
    """x @ W^T saves x and W^T (a view of a parameter), tanh saves its output y, and the square
    submodule's y * y saves y twice more."""

    def __init__(self, h: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h, h, dtype=F64) / h**0.5)
        self.square = Square()

    def forward(self, x):  # [T, h]
        y = torch.tanh(x @ self.weight.t())  # [T, h]
        return self.square(y)


class Square(nn.Module):
    def forward(self, y):  # [T, h]
        return y * y


class Toy(nn.Module):
    def __init__(self, h: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(ToyLayer(h) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def toy_grads(model, x, g, ctx):
    """(out, [d x, d every parameter]) with the forward inside ctx, the backward outside."""
    x = x.clone().requires_grad_(True)
    with ctx:
        out = model(x)
    return out, torch.autograd.grad(out, [x, *model.parameters()], g)


def assert_bitwise(got, want, label):
    out_got, grads_got = got
    out_want, grads_want = want
    assert torch.equal(out_got, out_want), f"{label}: output differs"
    for i, (a, b) in enumerate(zip(grads_got, grads_want)):
        assert torch.equal(a, b), f"{label}: gradient {i} differs (max {(a - b).abs().max()})"


TOY_CASES = [(5, 8, 3), (33, 16, 1), (64, 7, 4)]
TOY_IDS = [f"T{t}-H{h}-L{n}" for t, h, n in TOY_CASES]


@pytest.mark.parametrize("num_tokens,hidden,num_layers", TOY_CASES, ids=TOY_IDS)
def test_toy_is_bitwise_and_offloads_exactly_the_saved_activations(num_tokens, hidden, num_layers):
    torch.manual_seed(num_tokens)
    model = Toy(hidden, num_layers)
    x, g = torch.randn(num_tokens, hidden, dtype=F64), torch.randn(num_tokens, hidden, dtype=F64)
    want = toy_grads(model, x, g, contextlib.nullcontext())
    offload = ActivationOffload(model, ["layers.*.square", "layers.?"], min_bytes=0)
    assert_bitwise(toy_grads(model, x, g, offload), want, "offload")

    stats = offload.stats()
    nbytes = num_tokens * hidden * 8
    # per layer: x for the matmul and tanh's output in the layer; the square's input, saved
    # twice by the mul, is that same tanh output: one copy. weight.t() is never offloaded.
    assert stats["tensors"] == 2 * num_layers
    assert stats["deduped_saves"] == 2 * num_layers
    assert stats["bytes"] == 2 * num_layers * nbytes
    assert stats["by_module"] == {f"layers.{i}": 2 * nbytes for i in range(num_layers)}
    # the last layer's backward loads on demand; each earlier one was prefetched a layer ahead
    assert stats["on_demand"] == 2
    assert stats["prefetched"] == 2 * (num_layers - 1)


def test_parameters_and_their_views_are_never_offloaded():
    torch.manual_seed(0)
    h = 16
    model = Toy(h, 2)
    weight = model.layers[0].weight
    x = torch.randn(8, h, dtype=F64)
    seen = []
    offload = ActivationOffload(model, ["layers.*"], min_bytes=0)
    pack = offload._pack

    def spy(t):
        out = pack(t)
        if out is not t:
            seen.append(t)
        return out

    offload._pack = spy
    with offload:
        out = model(x.requires_grad_(True))
    out.sum().backward()
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(seen) == 2 * 4  # per layer: x, then y by tanh and twice by the square; never W^T
    assert all(t.untyped_storage().data_ptr() not in param_storages for t in seen)
    assert weight.grad is not None


@pytest.mark.parametrize("min_bytes", [1, 127 * 8, 128 * 8, 128 * 8 + 1], ids=lambda b: f"min{b}")
def test_min_bytes_threshold(min_bytes):
    torch.manual_seed(1)
    model = Toy(8, 2)
    x, g = torch.randn(16, 8, dtype=F64), torch.randn(16, 8, dtype=F64)  # every saved tensor is 128 fp64
    offload = ActivationOffload(model, ["layers.?"], min_bytes=min_bytes)
    assert_bitwise(toy_grads(model, x, g, offload), toy_grads(model, x, g, contextlib.nullcontext()), "offload")
    expected = 0 if min_bytes > 128 * 8 else 2 * 2 * 128 * 8
    assert offload.stats()["bytes"] == expected


def test_fraction_selects_the_first_layers_and_pool_is_reused():
    torch.manual_seed(2)
    model = Toy(8, 4)
    x, g = torch.randn(16, 8, dtype=F64), torch.randn(16, 8, dtype=F64)
    offload = ActivationOffload(model, ["layers.?"], fraction=0.5, min_bytes=0)
    want = toy_grads(model, x, g, contextlib.nullcontext())
    assert_bitwise(toy_grads(model, x, g, offload), want, "step 1")
    first = offload.stats()
    assert set(first["by_layer"]) == {0, 1}
    assert first["pool_new"] == first["tensors"] == 4 and first["pool_reused"] == 0

    offload.reset_stats()
    assert_bitwise(toy_grads(model, x, g, offload), want, "step 2")
    second = offload.stats()
    assert second["pool_new"] == 0 and second["pool_reused"] == second["tensors"] == 4
    assert second["pool_buffers"] == 4


def test_bad_arguments_raise_naming_them():
    model = Toy(4, 2)
    with pytest.raises(ValueError, match="modules: 'layers.*.nope' matches no module"):
        ActivationOffload(model, ["layers.*.nope"])
    with pytest.raises(ValueError, match="modules: expected a non-empty list"):
        ActivationOffload(model, [])
    with pytest.raises(ValueError, match="modules: expected a non-empty list"):
        ActivationOffload(model, "layers.?")
    for fraction in (0.0, 1.5, True):
        with pytest.raises(ValueError, match=r"fraction: must be within \(0, 1\]"):
            ActivationOffload(model, ["layers.?"], fraction=fraction)
    with pytest.raises(ValueError, match="min_bytes: must be an integer >= 0"):
        ActivationOffload(model, ["layers.?"], min_bytes=-1)
    with pytest.raises(ValueError, match="model: has no transformer layers"):
        ActivationOffload(nn.Sequential(nn.Linear(2, 2)), ["0"])
    offload = ActivationOffload(model, ["layers.?"])
    with offload, pytest.raises(RuntimeError, match="does not nest"):
        offload.__enter__()


def tiny_config(**overrides):
    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    base = {"parallel.world_size": 1, "training.seq_length": 32, "sparse_attention.topk": 8}
    base.update(overrides)
    return config_from_dict(raw, base)


def model_grads(model, tokens, ctx, vocab_size):
    """(loss, every parameter's gradient) of the tiny model; tokens [b, s + 1]."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]  # [b, s] each
    position_ids = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    with ctx:
        loss = model(inputs, position_ids, None, labels=labels).mean()
    return loss, torch.autograd.grad(loss, params)


def checkpoint_layers(model, which):
    for i in which:
        layer = model.decoder.layers[i]
        forward = layer.forward
        layer.forward = lambda *args, _f=forward, **kwargs: checkpoint(_f, *args, use_reentrant=False, **kwargs)


@pytest.fixture(scope="module")
def megatron_state():
    init_megatron()
    yield
    teardown()


MODEL_CASES = [(2, 32, ()), (1, 37, ()), (2, 32, (1, 3)), (1, 21, (0, 1, 2, 3))]
MODEL_IDS = ["B2-T32", "B1-T37", "B2-T32-ckpt1,3", "B1-T21-ckpt-all"]


@pytest.mark.parametrize("batch,seq,checkpointed", MODEL_CASES, ids=MODEL_IDS)
def test_hybrid_moe_model_is_bitwise(megatron_state, batch, seq, checkpointed):
    from megatron_moe_hybrid.models import build_model

    config = tiny_config(**{"training.seq_length": seq})
    torch.manual_seed(seq)
    model = build_model(config)
    checkpoint_layers(model, checkpointed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))
    want = model_grads(model, tokens, contextlib.nullcontext(), config.vocab_size)
    offload = ActivationOffload(model, modules=("*.mlp.experts", "*.self_attention"), min_bytes=0)
    assert_bitwise(model_grads(model, tokens, offload, config.vocab_size), want, "offload")

    stats = offload.stats()
    modules = set(stats["by_module"])
    # checkpoint's own hooks take what a checkpointed layer saves: only the other layers offload
    plain = [i for i in range(config.num_layers) if i not in checkpointed]
    assert set(stats["by_layer"]) == set(plain)
    assert modules == {f"decoder.layers.{i}.{m}" for i in plain for m in ("self_attention", "mlp.experts")}
    if plain:
        assert stats["bytes"] > 0 and stats["on_demand"] > 0 and stats["prefetched"] > 0
    else:
        assert stats["bytes"] == 0

    experts_only = ActivationOffload(model, ["*.mlp.experts"], min_bytes=0)
    assert_bitwise(model_grads(model, tokens, experts_only, config.vocab_size), want, "experts only")
    assert set(experts_only.stats()["by_module"]) == {f"decoder.layers.{i}.mlp.experts" for i in plain}

    nothing = ActivationOffload(model, min_bytes=1 << 40)
    assert_bitwise(model_grads(model, tokens, nothing, config.vocab_size), want, "above every tensor")
    assert nothing.stats()["bytes"] == 0 and nothing.stats()["tensors"] == 0


def test_backward_inside_the_context_and_second_step_reuses_the_pool(megatron_state):
    from megatron_moe_hybrid.models import build_model

    config = tiny_config()
    torch.manual_seed(3)
    model = build_model(config)
    checkpoint_layers(model, [2])  # its recompute runs inside the context: hooks fire again
    tokens = torch.randint(0, config.vocab_size, (2, 33))
    want = model_grads(model, tokens, contextlib.nullcontext(), config.vocab_size)
    offload = ActivationOffload(model, min_bytes=0)
    for step in range(2):
        offload.reset_stats()
        with offload:
            got = model_grads(model, tokens, contextlib.nullcontext(), config.vocab_size)
        assert_bitwise(got, want, f"step {step}")
        stats = offload.stats()
        assert stats["tensors"] > 0
    assert stats["pool_new"] == 0 and stats["pool_reused"] == stats["tensors"]


@pytest.mark.gpu
def test_cuda_streams_are_ordered_from_the_first_step(megatron_state):
    """Delays on either stream expose a missing wait (Megatron-LM #7398's warm-up race): the
    compute stream sleeps before the forward, so a device -> host copy that does not wait for it
    reads activations not yet written; the side stream sleeps before the backward, so a backward
    that does not wait for the host -> device copies reads memory not yet filled.

    Deterministic algorithms are on for both runs: on CUDA the backward of the sparse attention
    reference's row gathers accumulates with atomics in any order (two plain runs differ by
    ~1e-8 in 43 of 56 gradients on the H200, benchmarks/device/probe_determinism.py), which
    would hide whether a difference comes from a race."""
    from megatron_moe_hybrid.models import build_model

    was_on, was_warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        config = tiny_config()
        torch.manual_seed(4)
        model = build_model(config).cuda()
        tokens = torch.randint(0, config.vocab_size, (2, 33)).cuda()
        want = model_grads(model, tokens, contextlib.nullcontext(), config.vocab_size)
        offload = ActivationOffload(model, min_bytes=0)
        side = offload._side_stream(tokens.device)
        params = [p for p in model.parameters() if p.requires_grad]
        for step in range(2):
            offload.reset_stats()
            torch.cuda._sleep(20_000_000)  # [cycles] on the compute stream
            with offload:
                loss = model(tokens[:, :-1], torch.arange(32, device="cuda").expand(2, 32), None,
                             labels=tokens[:, 1:]).mean()
            with torch.cuda.stream(side):
                torch.cuda._sleep(20_000_000)
            got = (loss, torch.autograd.grad(loss, params))
            assert_bitwise(got, want, f"step {step}")
            stats = offload.stats()
            assert stats["bytes"] > 0 and stats["device_stall_ms"] > 0
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
    assert stats["pool_new"] == 0 and stats["pool_reused"] == stats["tensors"]
    assert all(b.is_pinned() for buffers in offload.pool._free.values() for b in buffers)


def _ep_worker(rank, world_size):
    from megatron_moe_hybrid.models import build_model

    init_megatron(rank, world_size, ep=2)
    results = {}
    for dispatcher in ("alltoall", "static"):
        config = tiny_config(**{"parallel.world_size": 2, "parallel.expert_model_parallel_size": 2,
                                "moe.dispatcher": dispatcher})
        torch.manual_seed(0)
        model = build_model(config)
        tokens = torch.randint(0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(rank))
        offload = ActivationOffload(model, min_bytes=0)
        results[dispatcher] = {
            "off": model_grads(model, tokens, contextlib.nullcontext(), config.vocab_size),
            "on": model_grads(model, tokens, offload, config.vocab_size),
            "stats": offload.stats(),
        }
    return results


@pytest.mark.distributed
def test_expert_parallel_ep2_is_bitwise():
    for rank, results in enumerate(spawn(_ep_worker, 2)):
        for dispatcher, res in results.items():
            assert_bitwise(res["on"], res["off"], f"rank {rank} {dispatcher}")
            assert res["stats"]["by_module"]["decoder.layers.0.mlp.experts"] > 0


def _train_worker(rank, world_size, raw, overrides):
    """Three trainer steps with offload off, then on; losses, final weights, offload stats."""
    from megatron.core import parallel_state as ps

    from megatron_moe_hybrid.training.trainer import Trainer, init_distributed

    runs = {}
    for on in (False, True):
        config = config_from_dict(raw, {**overrides, "memory.activation_offload": on,
                                        "training.output_dir": f"{overrides['training.output_dir']}-{on}"})
        init_distributed(config)
        trainer = Trainer(config)
        metrics = [trainer.train_step() for _ in range(3)]
        losses = [m["loss"] for m in metrics]
        stats = trainer.activation_offload.stats() if on else None
        runs[on] = {"losses": losses, "stats": stats, "offload_bytes": [m.get("offload_bytes") for m in metrics],
                    "weights": {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}}
    ps.destroy_model_parallel()
    return runs


def test_trainer_with_offload_gives_the_same_losses(tmp_path):
    from megatron_moe_hybrid.training.data import stdlib_corpus

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(stdlib_corpus(max_bytes=100_000))
    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    overrides = {
        "model.vocab_size": 512, "training.data_path": str(corpus), "training.cache_dir": str(tmp_path / "cache"),
        "training.output_dir": str(tmp_path / "run"), "training.seq_length": 32, "training.micro_batch_size": 2,
        "training.global_batch_size": 4, "training.warmup_steps": 1, "training.save_interval": 0,
        "training.progress_bar": False, "sparse_attention.topk": 8, "parallel.world_size": 1,
        "memory.offload_min_bytes": 4096,
    }
    (runs,) = spawn(_train_worker, 1, raw, overrides)
    off, on = runs[False], runs[True]
    # the metrics log each step's offloaded bytes; the three steps add up to the running total
    assert off["offload_bytes"] == [None] * 3
    assert all(b > 0 for b in on["offload_bytes"]) and sum(on["offload_bytes"]) == on["stats"]["bytes"]
    assert on["losses"] == off["losses"]  # bitwise
    assert on["weights"].keys() == off["weights"].keys()
    for name in off["weights"]:
        assert torch.equal(on["weights"][name], off["weights"][name]), name
    assert on["stats"]["bytes"] > 0
    # the threshold holds: every offloaded tensor was at least 4096 bytes
    assert on["stats"]["bytes"] >= 4096 * on["stats"]["tensors"]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("memory.offload_fraction", 0.0, r"memory.offload_fraction: must be within \(0, 1\]"),
        ("memory.offload_fraction", 1.25, r"memory.offload_fraction: must be within \(0, 1\]"),
        ("memory.offload_min_bytes", -1, "memory.offload_min_bytes: must be an integer >= 0"),
        ("memory.offload_modules", [], "memory.offload_modules: must be a non-empty list"),
        ("memory.offload_modules", ["*.mlp.experts", 3], "memory.offload_modules: must be a non-empty list"),
    ],
    ids=["fraction0", "fraction1.25", "min_bytes-1", "modules-empty", "modules-int"],
)
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**{field: value})


def test_config_accepts_offload_settings():
    config = tiny_config(**{"memory.activation_offload": True, "memory.offload_modules": "*.mlp.experts,*.mlp",
                            "memory.offload_fraction": 0.5, "memory.offload_min_bytes": 0})
    assert config.memory.offload_modules == ["*.mlp.experts", "*.mlp"]
    assert config.memory.offload_fraction == 0.5 and config.memory.activation_offload


def test_benchmark_tiny_runs_on_cpu(megatron_state, tmp_path):
    bench_dir = os.path.join(ROOT, "benchmarks")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)  # benchmarks/offload.py imports its sibling common.py
    spec = importlib.util.spec_from_file_location("bench_offload", os.path.join(bench_dir, "offload.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "offload.json"
    bench.main(["--tiny", "--reps", "1", "--warmup", "1", "--seq", "33", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["name"] == "offload step" and row["anchor"] == "full recomputation"
    modes = row["modes"]
    assert modes["offload"]["offloaded_bytes"] > 0
    # the same model and tokens: offload is bitwise, recomputation too (deterministic CPU ops)
    assert modes["offload"]["first_loss"] == modes["off"]["first_loss"] == modes["recompute"]["first_loss"]
    assert row["speedup"] == round(row["anchor_ms"] / row["ours_ms"], 3)
