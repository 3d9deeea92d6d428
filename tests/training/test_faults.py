"""Faults injected into real (spawned, gloo) training runs: nothing is lost, nothing hangs.

Each test injects one fault of issue 13 and checks what the user gets: a clear message,
a bounded exit, and a checkpoint that still loads.
"""

import errno
import json
import multiprocessing
import os
import signal
import time

import pytest
import torch

from megatron_moe_hybrid.testing import checkpoint_tensors, spawn
from megatron_moe_hybrid.training import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run(raw, ov, mode="pretrain"):
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import run

    return run(config_from_dict(raw, ov), mode)


def _run_catching(rank, world, raw, ov):
    """Returns ("ok", losses) or (exception type name, message)."""
    try:
        return "ok", _run(raw, ov).losses
    except Exception as e:
        return type(e).__name__, str(e)


# 1. A rank dies mid-step ------------------------------------------------------------------


def _worker_dies(rank, world, store, raw, ov, kill_rank, kill_step, log_path):
    import torch.distributed as dist

    from megatron_moe_hybrid.training import trainer as trainer_mod

    log = open(log_path, "w")
    # a file store: no port picked before the bind, for another test's process to take
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if rank == kill_rank:
        original = trainer_mod.Trainer._batch_start

        def batch(self, step, micro):
            if step + 1 == kill_step and micro == 1:  # mid-step: after a forward/backward
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, step, micro)

        trainer_mod.Trainer._batch_start = batch
    try:
        _run(raw, ov)
        log.write("finished\n")
    except trainer_mod.TrainingStopped as e:
        log.write(f"stopped peer_failed={e.peer_failed}: {e}\n")
    log.flush()
    os._exit(3)  # as the CLI does after a peer failure: no teardown of a broken group


@pytest.mark.distributed
def test_dead_rank_is_named_and_survivors_exit(corpus, cache_dir, tmp_path, raw_config):
    out = str(tmp_path / "run")
    raw, ov = raw_config(corpus, cache_dir, out, **{
        "training.train_steps": 8, "training.save_interval": 2, "parallel.world_size": 2,
        "parallel.expert_model_parallel_size": 2, "parallel.collective_timeout_s": 20.0,
        "training.global_batch_size": 8,
    })
    ctx = multiprocessing.get_context("spawn")
    store = str(tmp_path / "store")
    logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
    procs = [ctx.Process(target=_worker_dies, args=(r, 2, store, raw, ov, 1, 4, logs[r])) for r in range(2)]
    for p in procs:
        p.start()
    start = time.time()
    procs[1].join(timeout=120)
    procs[0].join(timeout=60)
    survivor_alive = procs[0].is_alive()
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not survivor_alive, "rank 0 hung after rank 1 died"
    assert procs[1].exitcode == -signal.SIGKILL
    assert procs[0].exitcode == 3
    assert time.time() - start < 150
    message = open(logs[0]).read()
    assert "peer_failed=True" in message, message
    assert "rank 1 failed during step 4" in message, message
    assert "step_00000002" in message, message  # the last good checkpoint
    assert ckpt.latest_checkpoint(out).endswith("step_00000002")


# 2. Killed during a checkpoint save ---------------------------------------------------------


def _worker_killed_in_save(rank, world, raw, ov, point):
    """Kills this process during the second checkpoint save, at `point`."""
    import safetensors.torch  # noqa: F401

    calls = {"n": 0}

    def kill_on_second(original, matches=lambda *a, **k: True):
        def wrapper(*args, **kwargs):
            if matches(*args, **kwargs):
                calls["n"] += 1
                if calls["n"] == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        return wrapper

    if point == "model":
        ckpt.write_tensors = kill_on_second(
            ckpt.write_tensors, lambda path, *a, **k: os.path.basename(path).startswith("model-")
        )
    elif point == "state":
        ckpt.torch.save = kill_on_second(torch.save)
    elif point == "meta":
        ckpt._atomic_write_text = kill_on_second(ckpt._atomic_write_text)
    elif point == "rename":
        ckpt.os.replace = kill_on_second(
            os.replace, lambda src, dst, *a, **k: os.path.basename(str(dst)).startswith("step_")
        )
    _run(raw, ov)


@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.slow) for p in ("model", "state", "meta")] + ["rename"])
def test_killed_during_save_keeps_previous_and_resumes(point, corpus, cache_dir, tmp_path, raw_config):
    out = str(tmp_path / "run")
    raw, ov = raw_config(corpus, cache_dir, out, **{"training.train_steps": 6, "training.save_interval": 2})
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_worker_killed_in_save, args=(0, 1, raw, ov, point))
    proc.start()
    proc.join(timeout=180)
    assert proc.exitcode == -signal.SIGKILL
    # the previous checkpoint is complete and loads; the half-written one is not listed
    good = ckpt.latest_checkpoint(out)
    assert good.endswith("step_00000002"), os.listdir(os.path.join(out, ckpt.CKPT_DIR))
    assert ckpt.load_rank_state(good)["step"] == 2
    # resume: auto picks it, cleans the partial directory and finishes
    (status, losses) = spawn(_run_catching, 1, raw, ov)[0]
    assert status == "ok", losses
    assert len(losses) == 4  # steps 3..6
    assert ckpt.latest_checkpoint(out).endswith("step_00000006")
    leftovers = [n for n in os.listdir(os.path.join(out, ckpt.CKPT_DIR)) if n.startswith(".tmp-")]
    assert leftovers == []
    assert [m["step"] for m in read_metrics(out)] == list(range(1, 7))


# 3. Corrupt or truncated checkpoints ------------------------------------------------------


@pytest.fixture()
def saved(tmp_path):
    """A single-process checkpoint of a small model and the model."""
    import yaml

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron, teardown

    init_megatron()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    torch.manual_seed(0)
    model = build_model(config_from_dict(raw, {"parallel.world_size": 1}))
    path = ckpt.save_checkpoint(str(tmp_path), 1, model, {"step": 1}, {})
    yield path, model
    teardown()


def _model_file(path):
    return next(os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors"))


def test_flipped_bytes_name_file_and_tensor(saved):
    path, model = saved
    fname = _model_file(path)
    with open(fname, "r+b") as f:
        f.seek(-64, os.SEEK_END)  # inside the last tensor's data
        data = bytearray(f.read(8))
        f.seek(-64, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in data))
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_model_weights(path, model)
    assert os.path.basename(fname) in str(info.value)
    assert "tensor" in str(info.value) and "checksum" in str(info.value)


def test_truncated_file_is_named(saved):
    path, model = saved
    fname = _model_file(path)
    with open(fname, "r+b") as f:
        f.truncate(os.path.getsize(fname) // 2)
    with pytest.raises(ckpt.CheckpointError, match=os.path.basename(fname) + ".*truncated"):
        ckpt.load_model_weights(path, model)


def test_missing_shard_is_named(saved):
    path, model = saved
    fname = _model_file(path)
    os.remove(fname)
    with pytest.raises(ckpt.CheckpointError, match=os.path.basename(fname) + ".*missing"):
        ckpt.load_model_weights(path, model)


@pytest.mark.slow
def test_resume_falls_back_to_previous_checkpoint_when_asked(corpus, cache_dir, tmp_path, raw_config):
    out = str(tmp_path / "run")
    raw, ov = raw_config(corpus, cache_dir, out, **{"training.train_steps": 4, "training.save_interval": 2})
    assert spawn(_run_catching, 1, raw, ov)[0][0] == "ok"
    newest = ckpt.latest_checkpoint(out)
    assert newest.endswith("step_00000004")
    with open(_model_file(newest), "r+b") as f:
        f.truncate(100)
    longer = dict(ov, **{"training.train_steps": 6})
    status, message = spawn(_run_catching, 1, raw, longer)[0]
    # default: stop, say why, naming the field (the CLI prints it as one line, exit status 2)
    assert status == "ConfigError" and message.startswith("training.resume: ") and "truncated" in message
    status, losses = spawn(_run_catching, 1, raw, dict(longer, **{"training.on_corrupt_checkpoint": "previous"}))[0]
    assert status == "ok", losses
    assert len(losses) == 4  # resumed from step 2, ran 3..6


# 4. Full disk ---------------------------------------------------------------------------


def _enospc_on_call(n):
    calls = {"n": 0}
    original = ckpt.write_tensors

    def write_tensors(path, *args, **kwargs):
        if os.path.basename(path).startswith(ckpt.OPTIMIZER_PREFIX):  # counts the model's files (and adapter parts)
            return original(path, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return original(path, *args, **kwargs)

    return write_tensors


def test_full_disk_keeps_previous_checkpoint(saved, monkeypatch):
    path, model = saved
    output_dir = os.path.dirname(os.path.dirname(path))
    monkeypatch.setattr(ckpt, "write_tensors", _enospc_on_call(1))
    with pytest.raises(ckpt.CheckpointSaveError) as info:
        ckpt.save_checkpoint(output_dir, 2, model, {"step": 2}, {})
    message = str(info.value)
    assert "disk full" in message and "step_00000001" in message
    assert ckpt.latest_checkpoint(output_dir) == path
    assert not any(n.startswith(".tmp-") for n in os.listdir(os.path.dirname(path)))
    ckpt.load_model_weights(path, model)


def _worker_full_disk(rank, world, raw, ov, failing_rank):
    if rank == failing_rank:
        ckpt.write_tensors = _enospc_on_call(2)
    return _run_catching(rank, world, raw, ov)


@pytest.mark.distributed
def test_full_disk_on_one_rank_stops_all_ranks_cleanly(corpus, cache_dir, tmp_path, raw_config):
    out = str(tmp_path / "run")
    raw, ov = raw_config(corpus, cache_dir, out, **{
        "training.train_steps": 6, "training.save_interval": 2, "parallel.world_size": 2,
        "parallel.expert_model_parallel_size": 2, "training.global_batch_size": 8,
    })
    results = spawn(_worker_full_disk, 2, raw, ov, 1)
    for status, message in results:
        assert status == "TrainingStopped", message
        assert "disk full" in message and "step_00000002" in message and "rank 1" in message
    assert ckpt.latest_checkpoint(out).endswith("step_00000002")

    # with on_save_error: continue the run goes on and later saves succeed
    out2 = str(tmp_path / "run2")
    raw, ov = raw_config(corpus, cache_dir, out2, **{
        "training.train_steps": 6, "training.save_interval": 2, "training.on_save_error": "continue",
    })
    (status, losses), = spawn(_worker_full_disk, 1, raw, ov, 0)
    assert status == "ok" and len(losses) == 6
    names = sorted(os.listdir(os.path.join(out2, ckpt.CKPT_DIR)))
    assert names == ["step_00000002", "step_00000006"]  # step 4's save hit the full disk


def _worker_adapter_full_disk(rank, world, raw, ov):
    ckpt.write_tensors = _enospc_on_call(2)  # 1: the run's last checkpoint, 2: the adapter's part
    try:
        _run(raw, ov, mode="finetune")
        return "ok", None
    except Exception as e:
        return type(e).__name__, str(e)


@pytest.mark.slow
def test_a_full_disk_while_writing_the_adapter_stops_naming_the_checkpoint(corpus, cache_dir, tmp_path, raw_config):
    base = str(tmp_path / "base")
    raw, ov = raw_config(corpus, cache_dir, base, **{"training.train_steps": 1})
    assert spawn(_run_catching, 1, raw, ov)[0][0] == "ok"
    out = str(tmp_path / "lora")
    raw, ov = raw_config(corpus, cache_dir, out, **{"training.train_steps": 1, "lora.enabled": True,
                                                    "training.init_from": base,
                                                    "training.tokenizer_model": os.path.join(base, "tokenizer.model")})
    status, message = spawn(_worker_adapter_full_disk, 1, raw, ov)[0]
    assert status == "TrainingStopped", message
    assert "writing the adapter failed" in message and "disk full" in message and "step_00000001" in message, message
    assert not os.path.exists(os.path.join(out, "adapter")) and not os.path.exists(os.path.join(out, "adapter.tmp"))


# 5. Non-finite loss or gradients ----------------------------------------------------------


def _worker_nan(rank, world, raw, ov, bad_steps):
    """Turns the gradient reaching layer 2's MoE output into NaN during `bad_steps`."""
    import megatron_moe_hybrid.models as models

    original = models.build_model
    state = {"forwards": 0}

    def build_model(config, device=None, **kwargs):
        # every build is hooked (also the host-memory check's meta build, which never runs):
        # the model that trains is built on the meta device and keeps its hooks through
        # materialize
        model = original(config, device=device, **kwargs)
        micro = config.training.global_batch_size // config.training.micro_batch_size

        def count(module, args):
            state["forwards"] += 1

        def poison(module, grad_output):
            step = (state["forwards"] - 1) // micro + 1
            if step in bad_steps:
                return tuple(None if g is None else g * float("nan") for g in grad_output)
            return None

        model.register_forward_pre_hook(count)
        model.decoder.layers[2].mlp.register_full_backward_pre_hook(poison)
        return model

    models.build_model = build_model
    return _run_catching(rank, world, raw, ov)


def test_bad_step_is_skipped_and_counted(corpus, cache_dir, tmp_path, raw_config):
    out = str(tmp_path / "run")
    raw, ov = raw_config(corpus, cache_dir, out, **{"training.train_steps": 5})
    (status, losses), = spawn(_worker_nan, 1, raw, ov, {3})
    assert status == "ok", losses
    metrics = read_metrics(out)
    assert [m.get("bad_step", False) for m in metrics] == [False, False, True, False, False]
    assert metrics[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)


def test_consecutive_bad_steps_stop_naming_the_layer(corpus, cache_dir, tmp_path, raw_config):
    out = str(tmp_path / "run")
    raw, ov = raw_config(corpus, cache_dir, out, **{
        "training.train_steps": 8, "training.max_consecutive_bad_steps": 3,
    })
    (status, message), = spawn(_worker_nan, 1, raw, ov, {2, 3, 4, 5})
    assert status == "TrainingStopped", message
    assert "3 steps in a row (2-4)" in message, message
    assert "decoder.layers.2.mlp" in message, message


# 7. Ranks launched with different configs -------------------------------------------------


def _worker_other_config(rank, world, raw, ov):
    if rank == 1:
        ov = dict(ov, **{"moe.topk": 3})
    return _run_catching(rank, world, raw, ov)


@pytest.mark.distributed
def test_ranks_with_different_configs_stop_at_launch(corpus, cache_dir, tmp_path, raw_config):
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "run"), **{
        "parallel.world_size": 2, "training.train_steps": 2,
    })
    for status, message in spawn(_worker_other_config, 2, raw, ov):
        assert status == "ConfigError", message
        assert message.startswith("moe.topk: ranks were started with different configs"), message
        assert "\n" not in message
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "run2"), **{
        "parallel.world_size": 4, "training.global_batch_size": 8,
    })
    for status, message in spawn(_run_catching, 2, raw, ov):
        assert status == "ConfigError" and message.startswith("parallel.world_size: is 4 but 2 processes"), message
    assert not os.path.exists(str(tmp_path / "run")) and not os.path.exists(str(tmp_path / "run2"))


@pytest.mark.distributed
def test_torchrun_prints_an_error_every_rank_raised_once(corpus, cache_dir, tmp_path, raw_config):
    """Under torchrun, a launch error that every rank raises (here the world size) is one line
    from rank 0, not one line per rank; the launch exits with a failure."""
    import subprocess
    import sys

    import yaml

    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "run"), **{
        "parallel.world_size": 4, "training.global_batch_size": 8})  # fmt: skip
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    args = [x for k, v in ov.items() for x in (f"--{k}", str(v))]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                        "-m", "megatron_moe_hybrid.train", "--config", str(config)] + args,
                       capture_output=True, text=True, timeout=300, env=dict(env, OMP_NUM_THREADS="1"))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("error: parallel.world_size: is 4 but 2 processes were launched"), errors


_SLOW_DATA = """
import os, sys, time
from megatron_moe_hybrid.training import trainer
load = trainer.Trainer._load_data
def slow(self):  # rank 0 tokenizes for longer than parallel.collective_timeout_s (or dies doing so)
    if self.rank == 0:
        time.sleep(float(os.environ["SLOW_DATA_S"]))
        if os.environ.get("DIE_IN_DATA"):
            os._exit(3)
    return load(self)
trainer.Trainer._load_data = slow
from megatron_moe_hybrid.training.cli import main
sys.exit(main("pretrain", sys.argv[1:]))
"""


def test_torchrun_ranks_wait_for_a_first_tokenization_longer_than_the_collective_timeout(
        corpus, cache_dir, tmp_path, raw_config):
    """On a first start rank 0 trains the tokenizer and tokenizes the text while the other ranks
    wait: a large corpus takes longer than parallel.collective_timeout_s, which must not fail
    the launch (here rank 0 takes 12 s against a 5 s timeout; the ranks then train). A rank 0
    that dies meanwhile still ends the launch at once."""
    import subprocess
    import sys

    import yaml

    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "run"), **{
        "parallel.world_size": 2, "training.train_steps": 1, "parallel.collective_timeout_s": 5})  # fmt: skip
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    script = tmp_path / "slow_data.py"
    script.write_text(_SLOW_DATA)
    args = ["--config", str(config)] + [x for k, v in ov.items() for x in (f"--{k}", str(v))]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                        str(script)] + args, capture_output=True, text=True, timeout=300,
                       env=dict(env, OMP_NUM_THREADS="1", SLOW_DATA_S="12"), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert len(read_metrics(str(tmp_path / "run"))) == 1
    # a rank 0 that dies while the others wait ends the launch at once, not after the long wait
    start = time.time()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                        str(script)] + args, capture_output=True, text=True, timeout=300,
                       env=dict(env, OMP_NUM_THREADS="1", SLOW_DATA_S="2", DIE_IN_DATA="1"), cwd=ROOT)
    assert r.returncode != 0 and time.time() - start < 120, (time.time() - start, r.stderr[-3000:])


def test_a_launch_error_of_one_rank_names_the_rank(monkeypatch, capsys):
    from megatron_moe_hybrid.config import ConfigError
    from megatron_moe_hybrid.training.cli import print_launch_error

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    print_launch_error(ConfigError("training.device", "rank with LOCAL_RANK=3 has no GPU of its own"))
    assert capsys.readouterr().err == "error: rank 3: training.device: rank with LOCAL_RANK=3 has no GPU of its own\n"
    monkeypatch.setattr("time.sleep", lambda s: None)
    print_launch_error(ConfigError("parallel.world_size", "is 4 but 2", every_rank=True))
    assert capsys.readouterr().err == ""  # rank 0 prints it
    monkeypatch.setenv("RANK", "0")
    print_launch_error(ConfigError("parallel.world_size", "is 4 but 2", every_rank=True))
    assert capsys.readouterr().err == "error: parallel.world_size: is 4 but 2\n"
    monkeypatch.setenv("WORLD_SIZE", "1")
    print_launch_error(ConfigError("training.device", "no GPU"))
    assert capsys.readouterr().err == "error: training.device: no GPU\n"


def _worker_short_host(rank, world, raw, ov):
    """Rank 1's host reports 1 MB available: the model's share does not fit."""
    from megatron_moe_hybrid.training import trainer

    trainer._host_bytes_available = lambda: 2**20 if rank == 1 else 2**50
    return _run_catching(rank, world, raw, ov)


@pytest.mark.distributed
def test_a_host_short_of_memory_for_the_cpu_build_stops_every_rank(corpus, cache_dir, tmp_path, raw_config):
    """A run from scratch draws its weights in host memory (one layer at a time, and on a CPU
    run the model lives there): when one host lacks it (its ranks' needs summed, found by host
    name), every rank stops with the same error, naming training.init_from and the numbers,
    before anything is written."""
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "run"), **{
        "parallel.world_size": 2, "training.train_steps": 2,
    })
    results = spawn(_worker_short_host, 2, raw, ov)
    for status, message in results:
        assert status == "ConfigError", message
        assert message.startswith("training.init_from: is unset, so each rank draws its initial weights"), message
        assert "the 2 rank(s) on host" in message and "0.0 GB is available" in message and "\n" not in message
    assert results[0] == results[1]
    assert not os.path.exists(str(tmp_path / "run"))


# 8. Determinism ----------------------------------------------------------------------------


def _worker_weights(rank, world, raw, ov):
    result = _run(raw, ov)
    return result.losses, result.checkpoint


@pytest.mark.slow
@pytest.mark.distributed
def test_deterministic_runs_are_bitwise_equal_with_ep2(corpus, cache_dir, tmp_path, raw_config):
    common = {"training.train_steps": 50, "parallel.world_size": 2, "parallel.expert_model_parallel_size": 2,
              "training.global_batch_size": 4, "training.micro_batch_size": 2, "training.seq_length": 16,
              "training.deterministic": True}
    runs = []
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        raw, ov = raw_config(corpus, cache_dir, str(tmp_path / name), **common, **{"training.seed": seed})
        (losses, path), _ = spawn(_worker_weights, 2, raw, ov)
        runs.append((losses, checkpoint_tensors(path)))
    (la, wa), (lb, wb), (lc, wc) = runs
    assert la == lb
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert la != lc
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


# 6. Bad data, end to end (the data module's own tests cover each fault) ---------------------


def test_bad_jsonl_lines_error_or_are_counted(corpus, cache_dir, tmp_path, raw_config):
    docs = open(corpus).read().split("\n\n")
    data = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": d}) for d in docs[:400]]
    lines.insert(5, "{not json")
    lines.insert(9, json.dumps({"body": "no text field"}))
    data.write_text("\n".join(lines) + "\n")
    tok = os.path.join(cache_dir, "tok")
    base = {"training.data_path": str(data), "training.train_steps": 2}

    raw, ov = raw_config(corpus, tok, str(tmp_path / "a"), **base)
    status, message = spawn(_run_catching, 1, raw, ov)[0]
    # a ConfigError naming training.data_path (the CLIs print it as one line, exit status 2)
    assert status == "ConfigError" and message.startswith(f"training.data_path: {data}:6:"), message
    assert "training.bad_data: skip" in message, message

    raw, ov = raw_config(corpus, tok, str(tmp_path / "b"), **base, **{"training.bad_data": "skip"})
    status, losses = spawn(_run_catching, 1, raw, ov)[0]
    assert status == "ok", losses
    last = read_metrics(str(tmp_path / "b"))[-1]
    assert last["skipped_bad_json"] == 1 and last["skipped_missing_field"] == 1


# 6. Runs that cannot start from what they were told to load ------------------------------


def test_lora_without_base_weights_stops_naming_init_from(corpus, cache_dir, tmp_path, raw_config):
    """resume auto with no checkpoint in output_dir and no training.init_from: the adapters would
    train on a randomly drawn frozen base. It stops naming training.init_from, and writes no
    config or tokenizer into output_dir."""
    out = str(tmp_path / "lora")
    raw, ov = raw_config(corpus, cache_dir, out, **{"training.train_steps": 1, "lora.enabled": True})
    status, message = spawn(_run_catching, 1, raw, ov)[0]
    assert status == "ConfigError" and message.startswith("training.init_from: LoRA fine-tuning needs base weights")
    assert not os.path.exists(os.path.join(out, "config.yaml"))


def test_the_sparse_stage_starts_from_the_warmup_by_init_from_not_resume(corpus, cache_dir, tmp_path, raw_config):
    """A dense warm-up run's output_dir resumed with sparse_attention.stage sparse: the stages train
    other weights (the optimizer holds the indexers only), so it stops naming the field and the
    fix (it used to fail inside torch's optimizer load); the fix, training.init_from, starts the
    sparse stage from the warm-up's weights."""
    import torch

    from megatron_moe_hybrid.training.checkpoint import latest_checkpoint

    out = str(tmp_path / "warm")
    warm = {"training.train_steps": 2, "training.save_interval": 2, "sparse_attention.stage": "dense_warmup",
            "training.lr": 1e-2}
    raw, ov = raw_config(corpus, cache_dir, out, **warm)
    assert spawn(_run_catching, 1, raw, ov)[0][0] == "ok"
    sparse = {"training.train_steps": 3, "sparse_attention.stage": "sparse"}
    status, message = spawn(_run_catching, 1, raw, dict(ov, **sparse))[0]
    assert status == "ConfigError" and message.startswith("sparse_attention.stage: "), message
    assert "was saved by a dense_warmup run" in message and "training.init_from" in message
    # the fix: a new output_dir from the warm-up's weights (lr 0: the run keeps them)
    raw, ov = raw_config(corpus, cache_dir, str(tmp_path / "sparse"), **sparse, **{
        "training.init_from": out, "training.tokenizer_model": os.path.join(out, "tokenizer.model"),
        "training.lr": 0.0, "training.min_lr": 0.0, "training.save_interval": 3,
    })
    status, message = spawn(_run_catching, 1, raw, ov)[0]
    assert status == "ok", message
    warmed, started = (checkpoint_tensors(latest_checkpoint(d)) for d in (out, str(tmp_path / "sparse")))
    indexer = [k for k in warmed if "linear_index_" in k and not k.startswith("optimizer.")]
    assert indexer and all(torch.equal(started[k], warmed[k]) for k in indexer)


@pytest.mark.slow
def test_resume_into_another_models_output_dir_keeps_its_config(corpus, cache_dir, tmp_path, raw_config):
    """Resuming into a directory whose checkpoint another model wrote: it stops naming
    training.resume and the fix, and the directory's config.yaml still describes its checkpoint
    (it used to be overwritten with the new config before the load failed)."""
    out = str(tmp_path / "run")
    raw, ov = raw_config(corpus, cache_dir, out, **{"training.train_steps": 2, "training.save_interval": 2})
    assert spawn(_run_catching, 1, raw, ov)[0][0] == "ok"
    with open(os.path.join(out, "config.yaml")) as f:
        before = f.read()
    status, message = spawn(_run_catching, 1, raw, dict(ov, **{"model.hidden_size": 128, "training.train_steps": 4}))[0]
    assert status == "ConfigError" and message.startswith("training.resume: ") and "has shape" in message
    assert "use a new training.output_dir" in message
    with open(os.path.join(out, "config.yaml")) as f:
        assert f.read() == before
