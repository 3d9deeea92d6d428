"""Megatron-Core's indexed datasets: token ids already made, read in place.

A pretraining corpus is tokenized once, offline and in parallel (`tools/preprocess_data.py`, or
Megatron-LM's `tools/preprocess_data.py`), into a pair of files with a common prefix P:

    P.bin  every document's token ids one after another, in the dtype the index names
    P.idx  b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B, sequence count <Q, document count
           <Q (documents + 1), then sequence lengths int32 [sequences], their byte offsets in
           P.bin int64 [sequences], and the sequence index where each document starts int64
           [documents + 1] (0 first, the sequence count last)

(Megatron-Core's `megatron.core.datasets.indexed_dataset` format, version 1, text only: no
multimodal modes). A run memory-maps P.bin as its token stream and reads only the document ends
from P.idx, so nothing of the corpus is loaded or tokenized at start-up, whatever its size.
`training.data_path` names P (or P.bin / P.idx), or a blend of several with weights,
"0.3 P1 0.7 P2", as Megatron's `--data-path` takes them (`parse_blend`).
"""

import itertools
import os
import struct
from array import array
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from megatron_moe_hybrid.training._files import atomic_write, publish, temp_beside

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# dtype codes of the format (megatron.core.datasets.indexed_dataset.DType); token ids are integers
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, sequence count, document count


class IndexedTokens(NamedTuple):
    """An indexed dataset as a token stream: tokens [num_tokens] (a read-only memory map of P.bin),
    ends [documents] int64 (where each non-empty document ends in the stream, increasing)."""

    tokens: np.ndarray
    ends: np.ndarray


def indexed_prefix(path: str) -> str | None:
    """The prefix P of the indexed dataset that path names (P, P.bin or P.idx) where both P.bin
    and P.idx exist; None for anything else."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        return prefix
    return None


def parse_blend(data_path: str) -> list[tuple[float, str]] | None:
    """Megatron's blend syntax, "w1 path1 w2 path2 ...": [(weight, path)] with weights > 0
    (normalised by the caller); None where data_path is not one (a single path)."""
    words = data_path.split()
    if len(words) < 2 or len(words) % 2:
        return None
    try:
        weights = [float(w) for w in words[0::2]]
    except ValueError:
        return None
    return list(zip(weights, words[1::2]))


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 below 65500 ids (Megatron's rule), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


_SLICE = 1 << 22  # sequences / documents a step of the index's checks, ends and writing: no temporaries its size


def _bad(path: Path, what: str) -> ValueError:
    return ValueError(f"training.data_path: {path}: {what}; write it again with tools/preprocess_data.py "
                      "(or Megatron-LM's tools/preprocess_data.py)")


def _document_ends(idx: Path, lengths: np.ndarray, pointers: np.ndarray, starts: np.ndarray,
                   itemsize: int) -> Iterator[np.ndarray]:
    """Where each non-empty document ends in the token stream, in increasing pieces, a slice of
    the index at a time (the memory of a slice, whatever the index's size), checking first that
    the index describes its data: lengths >= 0, sequences stored one after another in the .bin
    (as every writer of the format puts them), document starts running from 0 to the sequence
    count in order."""
    sequences, documents = len(lengths), len(starts)
    offset = 0  # tokens before the slice
    for a in range(0, sequences, _SLICE):
        lens = lengths[a : a + _SLICE]
        if np.any(lens < 0):
            raise _bad(idx, "a sequence has a negative length")
        seq_ends = offset + np.cumsum(lens, dtype=np.int64)
        if np.any(pointers[a : a + _SLICE] != (seq_ends - lens) * itemsize):
            raise _bad(idx, "its sequences are not stored one after another in the .bin")
        offset = int(seq_ends[-1])
    if documents < 1 or starts[0] != 0 or starts[-1] != sequences:
        raise _bad(idx, "its document starts do not run from 0 to the sequence count in order")
    for a in range(1, documents, _SLICE):
        if np.any(np.diff(starts[a - 1 : a + _SLICE]) < 0):
            raise _bad(idx, "its document starts do not run from 0 to the sequence count in order")
    last_end = 0  # the last end given: empty documents and zero-length sequences end nowhere new
    for a in range(1, documents, _SLICE):
        last = np.asarray(starts[a : a + _SLICE]) - 1  # each document's last sequence; -1: none yet
        last = last[last >= 0]
        ends = pointers[last] // itemsize + lengths[last]  # the sequences are where they should be
        ends = ends[ends > np.concatenate([[last_end], ends[:-1]])]
        if len(ends):
            last_end = int(ends[-1])
            yield ends


def read_indexed(prefix: str, ends_path: Path | None = None) -> IndexedTokens:
    """P.bin memory-mapped and the document ends of P.idx. A file that is not one of these, is
    truncated, or whose index does not describe its data raises ValueError naming the file (under
    training.data_path, as the data module's errors).

    With ends_path the ends are written there once (raw int64, atomically; the caller holds its
    lock and names it by the files' sizes and times) and memory-mapped, so that the ranks of a host
    share one copy and read the index once (benchmarks/results/cpu/data_at_scale.json, 20M
    documents: 2.1 s once, then 1.2 ms a rank, where reading them whole took every rank 22.3 s)."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        fixed = f.read(_FIXED)
    if len(fixed) < _FIXED or fixed[: len(HEADER)] != HEADER:
        raise _bad(idx, f"not a Megatron indexed dataset index (it does not start with {HEADER!r})")
    version, code, sequences, documents = struct.unpack("<QBQQ", fixed[len(HEADER):])
    if version != VERSION:
        raise _bad(idx, f"index version {version}; this reader takes version {VERSION}")
    if code not in DTYPES or not np.issubdtype(DTYPES[code], np.integer):
        raise _bad(idx, f"dtype code {code} is not an integer token dtype ({', '.join(map(str, _CODES.values()))})")
    need = _FIXED + sequences * (4 + 8) + documents * 8
    if size < need:
        raise _bad(idx, f"truncated: {size} bytes, its counts ({sequences} sequences, {documents - 1} documents) "
                        f"need {need}")
    dtype = np.dtype(DTYPES[code])
    if ends_path is not None and ends_path.exists():
        ends = _ends_file(ends_path)
    else:
        index = np.memmap(idx, dtype=np.uint8, mode="r")
        lengths = np.frombuffer(index, dtype=np.int32, count=sequences, offset=_FIXED)
        pointers = np.frombuffer(index, dtype=np.int64, count=sequences, offset=_FIXED + 4 * sequences)
        starts = np.frombuffer(index, dtype=np.int64, count=documents, offset=_FIXED + 12 * sequences)
        pieces = _document_ends(idx, lengths, pointers, starts, dtype.itemsize)
        if ends_path is None:
            ends = np.concatenate([np.zeros(0, np.int64), *pieces])
        else:
            atomic_write(ends_path, lambda f: f.writelines(piece.astype("<i8", copy=False).tobytes() for piece in pieces))
            ends = _ends_file(ends_path)
    num_tokens = int(ends[-1]) if len(ends) else 0  # the last document ends at the last sequence's end
    if bin_.stat().st_size != num_tokens * dtype.itemsize:
        raise _bad(bin_, f"{bin_.stat().st_size} bytes where its index describes {num_tokens} tokens of "
                         f"{dtype.name} ({num_tokens * dtype.itemsize} bytes): truncated, or another dataset's")
    tokens = (np.memmap(bin_, dtype=dtype, mode="r") if num_tokens else np.zeros(0, dtype))
    return IndexedTokens(tokens, ends)


def _ends_file(path: Path) -> np.ndarray:
    """A written ends file, memory-mapped (an empty one cannot be)."""
    return np.memmap(path, dtype="<i8", mode="r") if path.stat().st_size else np.zeros(0, np.int64)


class IndexedWriter:
    """Writes P.bin and P.idx, one sequence per document; both appear at close() (atomically,
    the index last), never half written."""

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES or not np.issubdtype(self.dtype, np.integer):
            raise ValueError(f"dtype {self.dtype} is not an integer dtype of the format")
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        fd, self._bin_tmp = temp_beside(prefix, ".bin.tmp")
        self._bin = os.fdopen(fd, "wb")
        self._lengths = array("i")  # int32, 4 bytes a document (a list would hold a 36-byte int each)
        self._limit = np.iinfo(self.dtype).max

    def add_document(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > self._limit):
            raise ValueError(f"token ids {ids.min()}..{ids.max()} do not fit {self.dtype.name}")
        self.add_documents(np.array([ids.size]), ids.astype(self.dtype, copy=False))

    def add_documents(self, lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Documents one after another: their lengths [documents] and token ids [sum(lengths)],
        already of the writer's dtype (encode_task's), in one write."""
        if tokens.dtype != self.dtype or int(np.sum(lengths, dtype=np.int64)) != tokens.size:
            raise ValueError(f"add_documents takes {self.dtype.name} ids, as many as the lengths add up to")
        self._bin.write(np.ascontiguousarray(tokens).tobytes())
        self._lengths.frombytes(np.asarray(lengths, dtype=np.int32).tobytes())

    def close(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        n = len(lengths)
        fd, idx_tmp = temp_beside(self.prefix, ".idx.tmp")  # written whole before either file appears
        with os.fdopen(fd, "wb") as f:  # a slice at a time: no int64 temporaries of the corpus's size
            f.write(HEADER + struct.pack("<QBQQ", VERSION, _CODES[self.dtype], n, n + 1))
            f.write(lengths.tobytes())
            offset = 0
            for a in range(0, n, _SLICE):
                ends = offset + np.cumsum(lengths[a : a + _SLICE], dtype=np.int64)
                f.write(((ends - lengths[a : a + _SLICE]) * self.dtype.itemsize).tobytes())
                offset = int(ends[-1])
            for a in range(0, n + 1, _SLICE):
                f.write(np.arange(a, min(a + _SLICE, n + 1), dtype=np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        publish(self._bin_tmp, self.prefix + ".bin")
        publish(idx_tmp, self.prefix + ".idx")

    def abort(self) -> None:
        """Leaves no file behind (a failed tokenization)."""
        self._bin.close()
        os.unlink(self._bin_tmp)


# Workers of tools/preprocess_data.py (here so that spawned processes can import them): each
# loads the tokenizer once and turns batches of documents, or pieces of a .jsonl file it parses
# itself, into their ids and the end of text.
_WORKER_TOKENIZER = None


def worker_init(tokenizer_path: str, pool: bool = True) -> None:
    global _WORKER_TOKENIZER
    from megatron_moe_hybrid.training.data import load_tokenizer

    if pool:  # one process per core already: no thread pool per process on top (HF tokenizers)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"

    _WORKER_TOKENIZER = load_tokenizer(tokenizer_path)


def encode_task(task: tuple) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
    """One task of the tool, in a worker: (skip counts, lengths int32 [documents], token ids
    [tokens] of the dataset's dtype) of each non-empty document's tokens and the end of text.
    task: ("docs", documents, skip counts, dtype), documents the tool's process read, or ("jsonl",
    path, raw, options, first_line, first_byte, dtype), a piece of a .jsonl file (jsonl_pieces)
    that the worker parses: its records, skip counts and errors (file:line) are the file's."""
    from megatron_moe_hybrid.training.data import STAT_KEYS, _jsonl_documents, _TextOptions

    if task[0] == "docs":
        _, docs, stats, dtype = task
    else:
        _, path, raw, options, line, byte, dtype = task
        stats = dict.fromkeys(STAT_KEYS, 0)
        docs = _jsonl_documents(Path(path), raw, _TextOptions(**options), stats, line, byte)
    docs = [d for d in docs if d.strip()]  # as a run's token stream skips them
    eos = _WORKER_TOKENIZER.eos_id
    encoded = _WORKER_TOKENIZER.encode_batch(docs) if docs else []
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int32, count=len(encoded))
    tokens = np.fromiter(itertools.chain.from_iterable(ids + [eos] for ids in encoded), dtype=np.int64,
                         count=int(lengths.sum(dtype=np.int64)))
    limit = np.iinfo(dtype).max
    if tokens.size and (tokens.min() < 0 or tokens.max() > limit):
        raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit {np.dtype(dtype).name}")
    return stats, lengths, tokens.astype(dtype)
