"""Opening training data at scale on the CPU, ours against the code at an earlier revision (its
own checkout, a git worktree) in the same run: a Megatron indexed dataset of many documents
(the document ends read from its index), and a run's own tokenizing of a .jsonl file (the token
cache). Each open runs in a process of its own, which reports its wall time and peak resident
memory; the indexed dataset's ends and the token caches are asserted equal.

    python benchmarks/data_at_scale.py [--documents 20000000] [--text-mb 100] [--before 310fa0f]
        [--out benchmarks/results/cpu/data_at_scale.json]
"""

import argparse
import contextlib
import json
import os
import resource
import struct
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _driver(kind: str, path: str, tokenizer: str, cache: str, out: str) -> None:
    """Opens the data as a run does (TokenDataset) and prints what it took (the --driver mode)."""
    from types import SimpleNamespace

    from megatron_moe_hybrid.training.data import TokenDataset, load_tokenizer

    tok = SimpleNamespace(eos_id=0, vocab_size=1000) if kind == "indexed" else load_tokenizer(tokenizer)
    start = time.perf_counter()
    ds = TokenDataset(path, tok, 128, cache, seed=0)
    wall = time.perf_counter() - start
    np.save(out + ".ends.npy", np.asarray(ds.ends))
    if kind == "text":
        np.save(out + ".tokens.npy", np.asarray(ds.tokens))
    print(json.dumps({"wall_s": wall, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "documents": len(ds.ends), "tokens": len(ds.tokens)}))


def _indexed(prefix: str, documents: int) -> None:
    """An index of `documents` one-sequence documents of 1-3 tokens (uint16), written a slice at a
    time; the .bin sparse."""
    from megatron_moe_hybrid.training.indexed import HEADER

    lengths = np.random.default_rng(0).integers(1, 4, documents, dtype=np.int32)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
    step, offset = 1 << 24, 0
    with open(prefix + ".idx", "wb") as f:
        f.write(HEADER + struct.pack("<QBQQ", 1, 8, documents, documents + 1) + lengths.tobytes())
        for a in range(0, documents, step):
            part = lengths[a : a + step].astype(np.int64)
            f.write(((np.cumsum(part) - part + offset) * 2).tobytes())
            offset += int(part.sum())
        for a in range(0, documents + 1, step):
            f.write(np.arange(a, min(a + step, documents + 1), dtype=np.int64).tobytes())


def _open(tree: str, kind: str, path: str, tokenizer: str, cache: str, out: str) -> dict:
    from common import run_in_tree

    return run_in_tree(tree, [os.path.abspath(__file__), "--driver", kind, path, tokenizer, cache, out])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=int, default=20_000_000)
    p.add_argument("--text-mb", type=int, default=100)
    p.add_argument("--before", default="310fa0f", help="the revision whose code is the anchor")
    p.add_argument("--before-tree", default=None, help="a checkout of --before to use (git archive's files) "
                   "instead of a worktree made here")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu", "data_at_scale.json"))
    a = p.parse_args()
    from common import anchor_tree, cpu_name, write_results
    from preprocess import _corpus

    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        before = anchor_tree(stack, a.before, a.before_tree, tmp)
        _indexed(os.path.join(tmp, "d"), a.documents)
        corpus = _corpus(tmp, a.text_mb)
        for kind, path, shape in (("indexed", os.path.join(tmp, "d"), f"indexed-{a.documents}-documents"),
                                  ("text", corpus["jsonl"], f"jsonl-{a.text_mb}MB")):
            ours = _open(ROOT, kind, path, corpus["tokenizer"], os.path.join(tmp, f"c-ours-{kind}"),
                         os.path.join(tmp, "ours"))
            again = _open(ROOT, kind, path, corpus["tokenizer"], os.path.join(tmp, f"c-ours-{kind}"),
                          os.path.join(tmp, "again"))
            anchor = _open(before, kind, path, corpus["tokenizer"], os.path.join(tmp, f"c-anchor-{kind}"),
                           os.path.join(tmp, "anchor"))
            for part in ("ends",) + (("tokens",) if kind == "text" else ()):
                x, y = (np.load(os.path.join(tmp, f"{who}.{part}.npy")) for who in ("ours", "anchor"))
                assert np.array_equal(x, y), f"{kind}: the {part} differ"
            rows.append({
                "name": {"indexed": "an indexed dataset opened (its document ends)",
                         "text": "a run's own tokenizing of .jsonl (the token cache)"}[kind],
                "shape": f"{shape}-{ours['tokens']}-tokens", "ours_ms": round(ours["wall_s"] * 1e3),
                "anchor": f"the code at {a.before}", "anchor_ms": round(anchor["wall_s"] * 1e3),
                "speedup": round(anchor["wall_s"] / ours["wall_s"], 2),
                "ours_peak_rss_bytes": ours["peak_rss_bytes"], "anchor_peak_rss_bytes": anchor["peak_rss_bytes"],
                "ours_again_ms": round(again["wall_s"] * 1e3, 2),
                "notes": "TokenDataset(path, ..., 128) in a fresh process each, one run each, a fresh cache for "
                         "the first open; ours_again: ours a second time, from its cache (what every other rank "
                         "of a host does); peak_rss: the process's whole peak (Python, torch and the data); "
                         "ends (and the text's tokens) asserted equal"})
            print(rows[-1], flush=True)
    write_results(a.out, rows, ("numpy", "tokenizers"), device=cpu_name())

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--driver":
        sys.path.insert(0, os.getcwd())
        _driver(*sys.argv[2:7])
    else:
        main()
