"""benchmarks/preprocess.py runs end to end on a small corpus and writes its rows (it asserts
that ours and the earlier revision's tool write the same dataset, byte for byte)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_preprocess_benchmark_writes_its_rows(tmp_path):
    pytest.importorskip("tokenizers")
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs the repository's history (a git worktree of the anchor revision)")
    out = tmp_path / "preprocess.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "preprocess.py"), "--mb", "1", "--workers", "1",
                    "--out", str(out)], check=True, cwd=ROOT, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["preprocess_data .jsonl", "preprocess_data .txt"]
    assert all(r["ours_ms"] > 0 and r["anchor_ms"] > 0 and r["tool_process_cpu_s_per_gb"] > 0 for r in rows)
