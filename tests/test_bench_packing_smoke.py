"""benchmarks/packing.py runs end to end on a small corpus and writes its rows (it asserts
that both best-fit forms give the same samples)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_packing_benchmark_writes_its_rows(tmp_path):
    out = tmp_path / "packing.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "packing.py"), "--documents", "3000",
                    "--out", str(out)], check=True, cwd=os.path.join(ROOT, "benchmarks"), timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["best_fit_pieces"] * 4 + ["keyed_shuffle per sample"]
    assert all(r["ours_ms"] > 0 and r["anchor_ms"] > 0 for r in rows[:4]) and rows[4]["ours_ms"] > 0
