"""benchmarks/dense_warmup.py runs end to end on the CPU (tiny config) and writes its row: the
handed form's indexer gradients are bitwise the carried form's, and every indexer trained."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dense_warmup_benchmark_writes_its_row(tmp_path):
    out = tmp_path / "dense_warmup.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "dense_warmup.py"), "--tiny", "--reps", "1",
                    "--out", str(out)], check=True, cwd=os.path.join(ROOT, "benchmarks"), timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["name"] == "dense warm-up step" and row["ours_ms"] > 0 and row["anchor_ms"] > 0
    assert row["grads_bitwise"] is True and row["grad_rel_rms"] == 0.0
    assert row["trained_tensors"] == 2 * 5  # two S layers' indexers: q, k, weights, the k norm's two
