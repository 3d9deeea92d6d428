"""tools/launch.py: a run launched here through torchrun, a Slurm script for the flagship's
cluster, the plan's verdict and bad input stopping before anything is written."""

import importlib.util
import os
import subprocess

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "configs", "tiny.yaml")
FLAGSHIP = os.path.join(ROOT, "examples", "configs", "flagship_2p8t.yaml")
CLUSTER = os.path.join(ROOT, "examples", "clusters", "h200_128.yaml")


@pytest.fixture(scope="module")
def launch():
    spec = importlib.util.spec_from_file_location("launch", os.path.join(ROOT, "tools", "launch.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


def test_runs_two_processes_here_through_torchrun(launch, tmp_path, capsys):
    """--run: torchrun --standalone with the cluster's 2 processes (EP=2, gloo on the CPU) trains
    from the resolved config, which the run keeps as its own."""
    out = tmp_path / "run"
    code = launch.main(["--config", TINY, "--cluster.accelerators", "2", "--cluster.devices_per_node", "2",
                        "--cluster.expert_model_parallel_size", "2", "--training.train_steps", "2",
                        "--training.output_dir", str(out), "--training.data_path", "stdlib:email",
                        "--training.cache_dir", str(tmp_path / "cache"), "--model.vocab_size", "512",
                        "--training.progress_bar", "false", "--run"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "--standalone --nproc-per-node 2 -m megatron_moe_hybrid.train" in printed
    resolved = _yaml(out / "launch.yaml")
    assert resolved["parallel"]["world_size"] == 2 and resolved["parallel"]["expert_model_parallel_size"] == 2
    assert _yaml(out / "config.yaml") == resolved  # the trainer ran that config
    with open(out / "metrics.jsonl") as f:
        assert [yaml.safe_load(line)["step"] for line in f] == [1, 2]


def test_slurm_script_for_the_flagship_cluster(launch, tmp_path, capsys):
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.model").write_text("")
    script = tmp_path / "ft.sbatch"
    code = launch.main(["--config", FLAGSHIP, "--cluster", CLUSTER, "--training.init_from", str(base),
                        "--training.tokenizer_model", str(base / "tokenizer.model"),
                        "--training.output_dir", str(tmp_path / "ft"), "--slurm", str(script)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "FITS" in printed, printed
    text = script.read_text()
    for line in ("#SBATCH --nodes=16", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                 '--rdzv-endpoint "$MASTER_ADDR:29500" --rdzv-id "$SLURM_JOB_ID" --nproc-per-node 8 '
                 "-m megatron_moe_hybrid.finetune --config " + str(tmp_path / "ft" / "launch.yaml")):
        assert line in text, (line, text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # the cluster file's fields set the config's: what the plan printed is what runs
    c = _yaml(tmp_path / "ft" / "launch.yaml")
    assert (c["parallel"]["world_size"], c["parallel"]["expert_model_parallel_size"], c["parallel"]["fsdp"]) == (128, 64, True)
    assert (c["lora"]["enabled"], c["lora"]["rank"], c["memory"]["recompute_layers"]) == (True, 16, -1)
    assert (c["training"]["seq_length"], c["training"]["micro_batch_size"]) == (16384, 1)


def test_a_config_field_on_the_command_line_wins_over_the_cluster_file(launch, tmp_path, capsys):
    """The cluster file says LoRA rank 16; --lora.rank 8 runs and is planned at 8. Given as both
    --cluster.lora_rank and --lora.rank with different values, the launch stops naming them."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.model").write_text("")
    args = ["--config", FLAGSHIP, "--cluster", CLUSTER, "--training.init_from", str(base),
            "--training.tokenizer_model", str(base / "tokenizer.model"), "--training.output_dir", str(tmp_path / "ft")]
    assert launch.main(args + ["--lora.rank", "8"]) == 0
    assert "LoRA r8 on" in capsys.readouterr().out
    assert _yaml(tmp_path / "ft" / "launch.yaml")["lora"]["rank"] == 8
    assert launch.main(args + ["--lora.rank", "8", "--cluster.lora_rank", "16", "--training.output_dir", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("error: cluster.lora_rank: 16 disagrees with --lora.rank 8")


def test_a_plan_that_does_not_fit_launches_nothing_unless_forced(launch, tmp_path, capsys):
    args = ["--config", FLAGSHIP, "--cluster", CLUSTER, "--cluster.training", "full", "--cluster.seq_length", "32768",
            "--training.output_dir", str(tmp_path / "big"), "--slurm", str(tmp_path / "big.sbatch")]  # fmt: skip
    assert launch.main(args) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert not (tmp_path / "big").exists() and not (tmp_path / "big.sbatch").exists()
    assert launch.main(args + ["--force"]) == 0 and (tmp_path / "big.sbatch").exists()


def test_cluster_fields_come_from_the_config_where_not_given(launch, tmp_path, capsys):
    """Without a cluster file the config's parallel sizes, recompute and micro-batch are planned;
    a config that names no world size asks for one."""
    code = launch.main(["--config", TINY, "--parallel.world_size", "2", "--parallel.expert_model_parallel_size", "2",
                        "--cluster.devices_per_node", "2", "--memory.recompute_layers", "-1",
                        "--training.output_dir", str(tmp_path / "r")])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "run: full on 2 x" in printed and "EP2" in printed and "micro-batch 2 x 128, recompute full" in printed
    assert launch.main(["--config", TINY, "--training.output_dir", str(tmp_path / "w")]) == 2
    assert capsys.readouterr().err.startswith("error: cluster.accelerators: how many accelerators?")


@pytest.mark.parametrize("args,field", [
    (["--cluster.acelerators", "8"], "cluster.acelerators"),
    (["--cluster.accelerators", "8", "--cluster.expert_model_parallel_size", "3"], "cluster.accelerators"),
    (["--cluster.accelerators", "6", "--cluster.expert_model_parallel_size", "6"], "moe.num_experts"),
    (["--cluster.accelerators", "8", "--cluster.expert_model_parallel_size", "8", "--cluster.training", "lora"],
     "training.init_from"),
    (["--cluster.accelerators", "16", "--cluster.expert_model_parallel_size", "8", "--run"], "run"),
    (["--cluster.accelerators", "12", "--cluster.expert_model_parallel_size", "4"], "cluster.accelerators"),
], ids=["unknown-field", "ep-not-dividing", "experts-not-dividing", "lora-without-base", "run-on-two-nodes",
        "not-whole-nodes"])
def test_bad_input_names_the_field_and_writes_nothing(launch, tmp_path, capsys, args, field):
    out = tmp_path / "out"
    assert launch.main(["--config", TINY, "--training.output_dir", str(out), "--training.global_batch_size", "96", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field}:") and err.count("\n") == 1, err
    assert not out.exists()


def test_weight_bytes_follow_the_model_dtype_unless_given(launch):
    tiny = {"parallel.world_size": 2, "parallel.expert_model_parallel_size": 2, "training.global_batch_size": 96}
    assert launch.resolve(TINY, None, {"devices_per_node": 2}, tiny)[1].weight_bytes == 4  # tiny.yaml: float32
    bf16 = {**tiny, "model.params_dtype": "bfloat16"}
    assert launch.resolve(TINY, None, {"devices_per_node": 2}, bf16)[1].weight_bytes == 2
    assert launch.resolve(TINY, None, {"devices_per_node": 2, "weight_bytes": 1}, tiny)[1].weight_bytes == 1
    flagship = launch.resolve(FLAGSHIP, CLUSTER, {"training": "full"}, {})
    assert flagship[1].weight_bytes == 2 and flagship[0].params_dtype.itemsize == 2
