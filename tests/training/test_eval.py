"""The held-out loss (training.eval_data_path): its value against a plain forward over the same
samples, no effect on training, EP=2 and CP=2 equal to one process, and bad input stopping
every rank with the field named."""

import json
import os

import pytest

from megatron_moe_hybrid.testing import spawn


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    """Text the run does not train on (the standard library's email package)."""
    from megatron_moe_hybrid.training.data import stdlib_corpus

    path = tmp_path_factory.mktemp("heldout") / "heldout.txt"
    path.write_text(stdlib_corpus(max_bytes=60_000, subset="email"))
    return str(path)


def _train(rank, world_size, raw, overrides):
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import run

    result = run(config_from_dict(raw, overrides), "pretrain")
    return {"losses": result.losses, "evals": result.eval_losses, "checkpoint": result.checkpoint}


def _reference_eval(rank, world_size, raw, overrides, checkpoint):
    """The mean next-token loss of a checkpoint over the first eval_batches x global_batch_size
    samples of the held-out set: one process, a plain forward of the whole set at once."""
    import torch

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron
    from megatron_moe_hybrid.training.checkpoint import load_model_weights
    from megatron_moe_hybrid.training.data import TokenDataset, batch, load_tokenizer

    overrides = dict(overrides, **{"parallel.world_size": 1, "parallel.expert_model_parallel_size": 1,
                                   "parallel.context_parallel_size": 1})  # fmt: skip
    config = config_from_dict(raw, overrides)
    t = config.training
    init_megatron(rank, world_size)
    model = build_model(config)
    load_model_weights(checkpoint, model)
    tokenizer = load_tokenizer(os.path.join(t.output_dir, "tokenizer.model"))
    data = TokenDataset(t.eval_data_path, tokenizer, t.seq_length, t.cache_dir, t.seed)
    tokens, labels = batch(data, 0, t.eval_batches * t.global_batch_size)
    model.eval()
    with torch.no_grad():
        positions = torch.arange(t.seq_length).expand_as(tokens)
        return float(model(tokens, positions, None, labels=labels).mean())


def test_eval_loss_is_the_held_out_loss_and_leaves_training_alone(corpus, cache_dir, heldout, tmp_path, raw_config):
    steps = {"training.train_steps": 4}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "plain"), **steps)
    (plain,) = spawn(_train, 1, raw, ov)
    evaluated = {**steps, "training.eval_data_path": heldout, "training.eval_interval": 3, "training.eval_batches": 2}
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "eval"), **evaluated)
    (res,) = spawn(_train, 1, raw, ov)
    assert res["losses"] == plain["losses"]  # bitwise: evaluating changes no weight, statistic or RNG
    assert [s for s, _ in res["evals"]] == [3, 4]  # every eval_interval steps, and at the end
    with open(tmp_path / "eval" / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    assert [m["step"] for m in metrics if "eval_loss" in m] == [3, 4]
    assert metrics[-1]["eval_loss"] == res["evals"][-1][1] and metrics[-1]["eval_tokens"] == 2 * 4 * 32
    (expected,) = spawn(_reference_eval, 1, raw, ov, res["checkpoint"])
    assert abs(res["evals"][-1][1] - expected) <= 1e-5, (res["evals"], expected)
    assert res["evals"][0][1] != res["evals"][1][1]  # the step between them moved the weights


@pytest.mark.distributed
def test_eval_under_ep2_cp2_and_fsdp2_equals_one_process(corpus, cache_dir, heldout, tmp_path, raw_config):
    """The held-out loss over 2 ranks (experts split; the sequence split; FSDP2's shards) is one
    process's."""
    steps = {"training.train_steps": 2, "training.eval_data_path": heldout, "training.eval_batches": 1,
             "moe.dispatcher": "alltoall"}  # fmt: skip
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "one"), **steps)
    (one,) = spawn(_train, 1, raw, ov)
    for name, extra in (("ep2", {"parallel.expert_model_parallel_size": 2}), ("cp2", {"parallel.context_parallel_size": 2}),
                        ("fsdp2", {"parallel.fsdp": True})):
        raw, ov = raw_config(corpus, cache_dir, str(tmp_path / name), **steps, **{"parallel.world_size": 2, **extra})
        two = spawn(_train, 2, raw, ov)
        assert two[0]["evals"] == two[1]["evals"]  # the logged value is the global mean
        assert abs(two[0]["evals"][-1][1] - one["evals"][-1][1]) <= 1e-5, (name, two[0]["evals"], one["evals"])


def _run_catching(rank, world_size, raw, overrides):
    from megatron_moe_hybrid.config import ConfigError, config_from_dict
    from megatron_moe_hybrid.training.trainer import TrainingStopped, run

    try:
        run(config_from_dict(raw, overrides), "pretrain")
    except (ConfigError, TrainingStopped) as e:
        return type(e).__name__, str(e)
    return None


def test_too_little_held_out_text_stops_every_rank_naming_the_field(corpus, cache_dir, tmp_path, raw_config):
    """Fewer held-out samples than eval_batches need: rank 0 names training.eval_batches, the other
    rank stops too (it waited at a barrier for good before), before any step."""
    small = tmp_path / "small.txt"
    small.write_text("a few words of held-out text, " * 40)
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "small"), **{
        "training.eval_data_path": str(small), "training.eval_batches": 50, "parallel.world_size": 2})  # fmt: skip
    first, second = spawn(_run_catching, 2, raw, ov, timeout=240)
    assert first[0] == "ConfigError" and first[1].startswith("training.eval_batches: 50 global batches"), first
    assert second[0] == "TrainingStopped" and "rank 0 could not load the training data" in second[1], second
    assert not os.path.exists(tmp_path / "small" / "metrics.jsonl")


def test_cli_prints_the_held_out_losses_and_one_line_for_too_little_text(
    corpus, cache_dir, heldout, tmp_path, raw_config, capsys
):
    import yaml

    from megatron_moe_hybrid.training.cli import main

    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "cli"), **{
        "training.train_steps": 2, "training.eval_data_path": heldout, "training.eval_batches": 1})  # fmt: skip
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    args = ["--config", str(config)] + [x for k, v in ov.items() for x in (f"--{k}", str(v))]
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in launch}
    assert main("pretrain", args) == 0
    # a run in this process leaves torchrun's variables as they were (a stale RANK / MASTER_PORT
    # sent later runs and their children to one port: EADDRINUSE)
    assert {k: os.environ.get(k) for k in launch} == before
    out = capsys.readouterr().out
    assert "held-out loss (training.eval_data_path): step 2 " in out, out
    assert main("pretrain", args + ["--training.eval_batches", "100000", "--training.output_dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: training.eval_batches: 100000 global batches") and err.count("\n") == 1, err


def test_tensorboard_scalars_are_the_metrics(corpus, cache_dir, heldout, tmp_path, raw_config):
    """training.tensorboard_dir: every step's numbers of metrics.jsonl as scalars (train/<key>,
    eval/<key>), read back with TensorBoard's own reader."""
    pytest.importorskip("tensorboard")  # an optional dependency (validate() names it when missing)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "run"), **{
        "training.train_steps": 3, "training.eval_data_path": heldout, "training.eval_batches": 1,
        "training.tensorboard_dir": str(board)})  # fmt: skip
    spawn(_train, 1, raw, ov)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    events = EventAccumulator(str(board))
    events.Reload()
    for key, tag in (("loss", "train/loss"), ("grad_norm", "train/grad_norm"), ("lr", "train/lr")):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(m["step"], pytest.approx(m[key], rel=1e-6)) for m in metrics], tag
    assert [(e.step, e.value) for e in events.Scalars("eval/eval_loss")] == [(3, pytest.approx(metrics[-1]["eval_loss"], rel=1e-6))]
