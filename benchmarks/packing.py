"""Packing and sample order on the CPU, where a run computes them (once per token cache):
best_fit_pieces against placing one piece at a time (the form it replaced, kept in
tests/training/test_packing.py), fit_spans, and keyed_shuffle per sample. Same samples asserted.

    python benchmarks/packing.py [--documents 1000000] [--out benchmarks/results/cpu/packing.json]
"""

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "training"))

from megatron_moe_hybrid.training.data import best_fit_pieces, fit_spans, keyed_shuffle  # noqa: E402
from test_packing import _one_at_a_time  # noqa: E402  (the one-at-a-time form, test's reference)

from common import cpu_name, write_results  # noqa: E402


def _seconds(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=int, default=1_000_000)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu", "packing.json"))
    a = p.parse_args()
    rows = []
    rng = np.random.default_rng(0)
    corpora = {
        "log-normal (median 490 tokens)": np.maximum(2, rng.lognormal(6.2, 1.2, a.documents).astype(np.int64)),
        "uniform 2-4097": rng.integers(2, 4098, a.documents),
        "short 2-50": rng.integers(2, 51, a.documents),
    }
    for name, lengths in corpora.items():
        ends = np.cumsum(lengths)
        for seq in (4096, 131072) if name.startswith("log") else (4096,):
            ours_s, ours = _seconds(best_fit_pieces, ends, seq)
            anchor_s, anchor = _seconds(_one_at_a_time, ends, seq)
            assert all(np.array_equal(x, y) for x, y in zip(ours[:2], anchor[:2])) and ours[2] == anchor[2]
            fit_s, _ = _seconds(fit_spans, ends, seq)
            rows.append({"name": "best_fit_pieces", "shape": f"{a.documents}-documents-{name}-S{seq}",
                         "ours_ms": round(ours_s * 1e3, 1), "anchor": "one piece at a time (Fenwick tree; until 2026-12-06)",
                         "anchor_ms": round(anchor_s * 1e3, 1), "speedup": round(anchor_s / ours_s, 2),
                         "fit_spans_ms": round(fit_s * 1e3, 1), "notes": "one call each, samples asserted equal"})
            print(rows[-1], flush=True)
    n = 3_700_000_000  # 15T tokens of 4096-token samples
    calls = 100_000
    start = time.perf_counter()
    for i in range(calls):
        keyed_shuffle(i, n, 1, 0)
    per = (time.perf_counter() - start) / calls
    rows.append({"name": "keyed_shuffle per sample", "shape": f"n{n}", "ours_ms": round(per * 1e3, 4), "anchor": None,
                 "anchor_ms": None, "speedup": None, "notes": f"mean of {calls} calls; numpy's permutation of n is not run "
                 f"(it would hold 8 n bytes: {8 * n / 1e9:.0f} GB)"})
    print(rows[-1])
    write_results(a.out, rows, ("numpy",), device=cpu_name(", one thread"))


if __name__ == "__main__":
    main()
