"""benchmarks/data_at_scale.py runs end to end on small data and writes its rows (it asserts that
ours and the earlier revision's code give the same document ends and token cache)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_data_at_scale_benchmark_writes_its_rows(tmp_path):
    pytest.importorskip("tokenizers")
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs the repository's history (a git worktree of the anchor revision)")
    out = tmp_path / "data_at_scale.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "data_at_scale.py"), "--documents", "3000",
                    "--text-mb", "1", "--out", str(out)], check=True, cwd=ROOT, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["ours_ms"] > 0 and r["anchor_ms"] > 0 and r["ours_peak_rss_bytes"] > 0 for r in rows)
