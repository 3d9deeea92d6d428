"""tools/preprocess_data.py on the CPU: ours against the tool at an earlier revision (its own
checkout, a git worktree), in the same run, on the same generated corpus (.jsonl and .txt) and
tokenizer (a byte-level BPE trained here); the two datasets asserted byte for byte equal.

Each run records its wall time and the CPU seconds of the tool's own process (the reader and
writer) and of its worker processes: the tool's process does its share one task after another,
so its CPU seconds per GB bound the tool's throughput however many workers it has.

    python benchmarks/preprocess.py [--mb 100] [--before 310fa0f] [--workers 1,2] [--out benchmarks/results/cpu/preprocess.json]
    (on a machine without the history: git archive 310fa0f | tar -x -C .cache/anchor, then
     --before 310fa0f --before-tree .cache/anchor; --before none times ours alone)
"""

import argparse
import contextlib
import json
import os
import random
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _driver(tool: str, argv: list[str]) -> None:
    """Runs the tool's main in this process and prints what it took (the --driver mode)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("preprocess_data", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    start, own = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    rc = module.main(argv)
    wall = time.perf_counter() - start
    end, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"rc": rc, "wall_s": wall,
                      "tool_cpu_s": end.ru_utime - own.ru_utime + end.ru_stime - own.ru_stime,
                      "workers_cpu_s": children.ru_utime + children.ru_stime}))


def _corpus(root: str, mb: int) -> dict[str, str]:
    """A .jsonl and a .txt file of about mb MB each: documents of 50-600 words drawn from the
    built-in corpus's words, and a byte-level BPE tokenizer (32k) trained on a part of them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_moe_hybrid.training.data import load_documents

    docs, _ = load_documents("stdlib")
    words = " ".join(docs[:3000]).split()
    rng = random.Random(0)
    paths = {"jsonl": os.path.join(root, "corpus.jsonl"), "txt": os.path.join(root, "corpus.txt")}
    sample = []
    for kind, path in paths.items():
        with open(path, "w") as f:
            size = 0
            while size < mb << 20:
                doc = " ".join(rng.choice(words) for _ in range(rng.randint(50, 600)))
                text = json.dumps({"text": doc}) + "\n" if kind == "jsonl" else doc + "\n\n"
                size += len(text.encode())
                f.write(text)
                if len(sample) < 5000:
                    sample.append(doc)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"]))
    paths["tokenizer"] = os.path.join(root, "tokenizer.json")
    tokenizer.save(paths["tokenizer"])
    return paths


def _run(tree: str, corpus: dict, kind: str, workers: int, out: str) -> dict:
    from common import run_in_tree

    result = run_in_tree(tree, [os.path.abspath(__file__), "--driver", os.path.join(tree, "tools", "preprocess_data.py"),
                                "--", "--input", corpus[kind], "--tokenizer", corpus["tokenizer"], "--output", out,
                                "--workers", str(workers)])
    assert result["rc"] == 0, result
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=100, help="size of each generated file")
    p.add_argument("--before", default="310fa0f", help="the revision whose tool is the anchor ('none': ours only, "
                   "e.g. where the tree has no history, as on the device machine)")
    p.add_argument("--before-tree", default=None, help="a checkout of --before to use (git archive's files) "
                   "instead of a worktree made here")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu", "preprocess.json"))
    a = p.parse_args()
    from common import anchor_tree, cpu_name, write_results

    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        before = None if a.before == "none" else anchor_tree(stack, a.before, a.before_tree, tmp)
        corpus = _corpus(tmp, a.mb)
        for kind in ("jsonl", "txt"):
            gb = os.path.getsize(corpus[kind]) / 1e9
            for workers in map(int, a.workers.split(",")):
                ours = _run(ROOT, corpus, kind, workers, os.path.join(tmp, "ours"))
                anchor = _run(before, corpus, kind, workers, os.path.join(tmp, "anchor")) if before else None
                for ext in (".bin", ".idx") if before else ():
                    with open(os.path.join(tmp, "ours" + ext), "rb") as x, open(os.path.join(tmp, "anchor" + ext), "rb") as y:
                        assert x.read() == y.read(), f"the datasets differ ({ext})"
                rows.append({
                    "name": f"preprocess_data .{kind}", "shape": f"{gb * 1e3:.0f}MB-workers{workers}",
                    "ours_ms": round(ours["wall_s"] * 1e3), "anchor": f"the tool at {a.before}" if before else None,
                    "anchor_ms": round(anchor["wall_s"] * 1e3) if before else None,
                    "speedup": round(anchor["wall_s"] / ours["wall_s"], 3) if before else None,
                    "mb_per_s": round(gb * 1e3 / ours["wall_s"], 2),
                    "tool_process_cpu_s_per_gb": round(ours["tool_cpu_s"] / gb, 2),
                    "anchor_tool_process_cpu_s_per_gb": round(anchor["tool_cpu_s"] / gb, 2) if before else None,
                    "workers_cpu_s_per_gb": round(ours["workers_cpu_s"] / gb, 2),
                    "anchor_workers_cpu_s_per_gb": round(anchor["workers_cpu_s"] / gb, 2) if before else None,
                    "notes": "one run each" + (", the datasets asserted byte for byte equal" if before else "")
                             + "; tool_process: the tool's own process (reading, cutting, writing; at workers 1 "
                               "it tokenizes too); workers: its worker processes"})
                print(rows[-1], flush=True)
    write_results(a.out, rows, ("tokenizers",), device=cpu_name())

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--driver":
        sys.path.insert(0, os.getcwd())
        _driver(sys.argv[2], sys.argv[4:])
    else:
        main()
