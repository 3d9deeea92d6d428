"""benchmarks/lora.py --tiny runs its four steps on the CPU, launched by plain `python` (a group of
one over an in-process store: no fixed port for a parallel run to hold)."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # 17 s; the LoRA training itself is tested in tests/training and tests/layers
def test_lora_benchmark_tiny_runs_every_kind():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "lora.py"), "--tiny", "--reps", "2",
                          "--warmup", "1"], check=True, capture_output=True, text=True, env=env, timeout=600).stdout
    rows = {r["kind"]: r for r in map(ast.literal_eval, (line for line in out.splitlines() if line.startswith("{")))}
    assert set(rows) == {"frozen", "lora", "lora_shared", "full"}, out
    assert all("error" not in r for r in rows.values()), rows
    assert rows["frozen"]["trainable_params_per_rank"] == 0
    assert 0 < rows["lora_shared"]["trainable_params_per_rank"] < rows["lora"]["trainable_params_per_rank"]
    assert rows["full"]["trainable_params_per_rank"] == rows["full"]["params_per_rank"]
    for kind in ("lora", "lora_shared", "full"):  # same tokens, same start; training moves the loss
        assert rows[kind]["first_loss"] == pytest.approx(rows["frozen"]["first_loss"], rel=1e-5)
        assert rows[kind]["last_loss"] < rows[kind]["first_loss"]
