"""The CPU benchmarks that time ours against our own code at an earlier revision (a git worktree)
run end to end on small data and write their rows: benchmarks/preprocess.py (it asserts that both
tools write the same dataset, byte for byte), benchmarks/data_at_scale.py (the same document
ends and token cache) and benchmarks/checkpoint_at_scale.py (the same checkpoint tensors)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "preprocess": (["--mb", "1", "--workers", "1"], ["preprocess_data .jsonl", "preprocess_data .txt"],
                   "tool_process_cpu_s_per_gb"),
    "data_at_scale": (["--documents", "3000", "--text-mb", "1"],
                      ["an indexed dataset opened (its document ends)", "a run's own tokenizing of .jsonl (the token cache)"],
                      "ours_peak_rss_bytes"),
    "checkpoint_at_scale": (["--hidden", "64", "--experts", "8", "--ffn", "96", "--vocab", "1024"],
                            ["checkpoint save: most host memory a rank added", "checkpoint save: most model bytes one rank wrote",
                             "checkpoint save: wall time (slowest rank)",
                             "checkpoint load (a resume's weights): most bytes one rank read",
                             "checkpoint load: wall time (slowest rank)"], None),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(RUNS))
def test_the_benchmark_writes_its_rows(tmp_path, script):
    pytest.importorskip("tokenizers")
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs the repository's history (a git worktree of the anchor revision)")
    args, names, measured = RUNS[script]
    out = tmp_path / f"{script}.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{script}.py"), *args, "--out", str(out)],
                   check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.read_text())
    assert result["device"].startswith("CPU (")
    assert [r["name"] for r in result["rows"]] == names
    for r in result["rows"]:
        unit = "ms" if "ours_ms" in r else "bytes"  # a time, or an amount of memory or data
        assert r[f"ours_{unit}"] > 0 and r[f"anchor_{unit}"] > 0 and (measured is None or r[measured] > 0), r
