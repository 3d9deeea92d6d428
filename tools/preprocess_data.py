"""Tokenize a corpus once, in parallel, into a Megatron indexed dataset (P.bin + P.idx), which
a run then reads in place (`--training.data_path P`): no tokenizing at start-up, nothing of the
corpus in memory, whatever its size.

    python tools/preprocess_data.py --input corpus/ --tokenizer runs/base/tokenizer.json --output data/corpus
    torchrun --nproc-per-node 8 -m megatron_moe_hybrid.train --config runs/base/config.yaml \\
        --training.data_path data/corpus --training.tokenizer_model runs/base/tokenizer.json

--input is what training.data_path takes as text: a .txt file (documents separated by a blank
line), a .jsonl file (--text-field of each line), a directory of them (sorted; read one file at
a time), or stdlib. Each non-empty document becomes its tokens and the tokenizer's end of text,
one document of the dataset: the token stream a run builds from the same text and tokenizer,
token for token. A file is read in blocks of 64 MB, never whole. Bad lines stop with file and
line, or are dropped and counted under --bad-data skip, as in training. The files are
Megatron-Core's format (version 1, uint16 ids below 65500 pieces, else int32), which Megatron-LM
reads as well; they appear at the end, whole.
"""

import argparse
import collections
import multiprocessing
import os
import sys
import time
from typing import Iterator

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_moe_hybrid.training.data import (  # noqa: E402
    STAT_KEYS, _blank_file, _data_files, add_counts, batches, file_documents, is_stdlib, jsonl_pieces, load_documents,
    load_tokenizer)
from megatron_moe_hybrid.training.indexed import IndexedWriter, dtype_for, encode_task, worker_init  # noqa: E402

BATCH = 512  # documents per task of a worker, of a .txt file (or stdlib)
TASK_BYTES = 1 << 20  # bytes of a .jsonl file per task of a worker, which parses them
AHEAD = 4  # tasks in flight per worker: the file is read ahead that far, no further


def _sources(path: str) -> list[str]:
    """What is read in turn: stdlib whole, else each file of path (a file or a sorted directory)
    that holds more than whitespace, as training skips the others."""
    if is_stdlib(path):
        return [path]
    return [str(f) for f in _data_files(path) if not _blank_file(f)]


def _tasks(sources: list[str], options: dict, dtype) -> Iterator[tuple]:
    """encode_task's tasks, in the input's order: a .jsonl file's pieces of about TASK_BYTES, which
    the workers parse (the tool's process only finds line ends), and the documents of a .txt file
    (read here in blocks: a document may span blocks) or stdlib, BATCH at a time."""
    for source in sources:
        if not is_stdlib(source) and source.endswith(".jsonl"):
            for raw, line, byte in jsonl_pieces(source, piece_bytes=TASK_BYTES):
                yield "jsonl", source, raw, options, line, byte, dtype
            continue
        # a file block by block (BLOCK_BYTES), never whole: the same documents as reading it whole
        pieces = [load_documents(source, **options)] if is_stdlib(source) else file_documents(source, **options)
        for docs, stats in batches(pieces, BATCH):
            yield "docs", docs, stats, dtype


def _write(result, writer: IndexedWriter, skipped: dict, documents: int, tokens: int) -> tuple[int, int]:
    stats, lengths, ids = result
    add_counts(skipped, stats)
    writer.add_documents(lengths, ids)
    return documents + len(lengths), tokens + ids.size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="a .txt/.jsonl file, a directory of them, or stdlib")
    p.add_argument("--tokenizer", required=True, help="a sentencepiece .model or a tokenizer.json (the run's "
                   "training.tokenizer_model)")
    p.add_argument("--output", required=True, help="the prefix P: writes P.bin and P.idx")
    p.add_argument("--text-field", default="text", help="the JSONL field holding a document")
    p.add_argument("--bad-data", choices=("error", "skip"), default="error")
    p.add_argument("--max-document-chars", type=int, default=None)
    p.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: one per core)")
    a = p.parse_args(argv)
    if not (os.path.exists(a.input) or is_stdlib(a.input)):
        print(f"error: --input: {a.input!r} does not exist", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(a.tokenizer)
    except (OSError, ValueError) as e:
        print(f"error: --tokenizer: {e}", file=sys.stderr)
        return 2
    dtype = dtype_for(tokenizer.vocab_size)
    workers = max(1, a.workers or os.cpu_count() or 1)
    start = time.time()
    writer = IndexedWriter(a.output, dtype)
    documents = tokens = 0
    skipped = dict.fromkeys(STAT_KEYS, 0)
    pool = multiprocessing.get_context("spawn").Pool(workers, worker_init, (a.tokenizer,)) if workers > 1 else None
    try:
        if pool is None:
            worker_init(a.tokenizer, pool=False)
        options = dict(bad_data=a.bad_data, text_field=a.text_field, max_document_chars=a.max_document_chars)
        tasks = _tasks(_sources(a.input), options, dtype)
        # in order, at most AHEAD tasks a worker in flight (Pool.imap would read the whole input ahead)
        pending: collections.deque = collections.deque()
        for task in tasks if pool else ():
            pending.append(pool.apply_async(encode_task, (task,)))
            while len(pending) > AHEAD * workers or (pending and pending[0].ready()):
                documents, tokens = _write(pending.popleft().get(), writer, skipped, documents, tokens)
        for result in (r.get() for r in pending) if pool else map(encode_task, tasks):
            documents, tokens = _write(result, writer, skipped, documents, tokens)
    except ValueError as e:  # a bad line: its file and line, and the fix
        writer.abort()
        print(f"error: --input: {str(e).split(': ', 1)[-1]}", file=sys.stderr)
        return 2
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    if not documents:
        writer.abort()
        print(f"error: --input: {a.input!r} holds no text", file=sys.stderr)
        return 2
    writer.close()
    dropped = {k: v for k, v in skipped.items() if v}
    print(f"{a.output}.bin / .idx: {documents:,} documents, {tokens:,} tokens ({dtype.name}) by {a.tokenizer} "
          f"in {time.time() - start:.1f} s" + (f"; skipped lines (--bad-data skip): {dropped}" if dropped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
