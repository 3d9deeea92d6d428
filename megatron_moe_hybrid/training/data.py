"""Training data with no download: a sentencepiece tokenizer and a token dataset.

The default corpus is the docstrings of the Python standard library (`data_path:
stdlib`), so every machine with Python can train. Tokenizer and token ids are cached
in `cache_dir` under content hashes; torchrun ranks may build them at the same time
(an fcntl lock serialises the work, files appear by an atomic os.replace).

Indexing is stateless: sample i is a pure function of (corpus, tokenizer, seq_length,
seed, i), so the data position of a run is just the number of samples consumed and a
resumed run sees exactly the samples it would have seen.

Shape legend:
  S  seq_length: tokens per sample (each sample reads S + 1 tokens; labels are shifted by one)
  N  number of samples in a batch
"""

import ast
import contextlib
import fcntl
import functools
import hashlib
import io
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

STDLIB = "stdlib"
# Part of the stdlib cache key: bump it when stdlib_corpus changes what it extracts.
_STDLIB_CORPUS_VERSION = 1
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_DOC_SEP = "\n\n"

# Special ids sit below the 256 byte pieces; byte_fallback means no text is ever <unk>.
_UNK_ID, _BOS_ID, _EOS_ID, _PAD_ID = 0, 1, 2, 3
_MIN_VOCAB = 256 + 4 + 1
# Lines beyond this are subsampled (a fixed stride) so training stays well under 30 s on 2 cores.
_MAX_TRAIN_SENTENCES = 200_000
_SPM_OPTIONS = {
    "model_type": "bpe",
    "byte_fallback": True,
    "character_coverage": 0.9995,
    # identity + kept whitespace make decode(encode(text)) == text, newlines and tabs included
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "allow_whitespace_only_pieces": True,
    "split_digits": True,
    "unk_id": _UNK_ID,
    "bos_id": _BOS_ID,
    "eos_id": _EOS_ID,
    "pad_id": _PAD_ID,
    "input_sentence_size": 0,  # we subsample ourselves, deterministically
}


def stdlib_root(subset: str = "") -> Path:
    """The stdlib source folder, or the package folder / module file named by subset."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not subset:
        return root
    for candidate in (root / subset.replace(".", "/"), root / (subset.replace(".", "/") + ".py")):
        if candidate.exists():
            return candidate
    raise ValueError(
        f"training.data_path: 'stdlib:{subset}' names no standard-library package or module; "
        "use e.g. 'stdlib:email' or plain 'stdlib'"
    )


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 8_000_000, subset: str = "") -> str:
    """Docstrings of the standard library (or of its package/module `subset`, e.g. "email"),
    parsed with `ast` (nothing is imported).

    Files are visited in sorted order and docstrings are joined by a blank line until
    the next one would pass max_bytes (UTF-8), so the result is deterministic for a
    given Python install. Parsing takes several seconds; the result is memoised.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    docs: list[str] = []
    num_bytes = 0
    for path in _stdlib_files(stdlib_root(subset)):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
            continue  # a few stdlib files are templates or target another Python
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, _DOC_NODES) else None
            if not doc:
                continue
            size = len(doc.encode()) + len(_DOC_SEP)
            if num_bytes + size > max_bytes:
                return _DOC_SEP.join(docs)
            docs.append(doc)
            num_bytes += size
    return _DOC_SEP.join(docs)


def _stdlib_files(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)  # os.walk follows this order
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def load_text(data_path: str) -> str:
    """data_path "stdlib": stdlib_corpus(); a text file: its text; a directory: its *.txt files, sorted, joined by a blank line."""
    if data_path == STDLIB:
        return stdlib_corpus()
    if data_path.startswith(STDLIB + ":"):
        return stdlib_corpus(subset=data_path[len(STDLIB) + 1 :])
    path = Path(data_path)
    if not path.exists():
        raise ValueError(
            f"training.data_path: {data_path!r} does not exist; "
            f"use '{STDLIB}' for the built-in corpus or a .txt file/dir"
        )
    if path.is_file():
        return path.read_text(encoding="utf-8")
    files = sorted(path.rglob("*.txt"))
    if not files:
        raise ValueError(f"training.data_path: directory {data_path!r} holds no .txt files; add some or use '{STDLIB}'")
    return _DOC_SEP.join(f.read_text(encoding="utf-8") for f in files)


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _text_key(data_path: str) -> str:
    """A hash that changes whenever load_text(data_path) would.

    The stdlib corpus is keyed by its source files' stats instead of its text, so that
    warm caches spare every rank the multi-second parse.
    """
    if data_path != STDLIB and not data_path.startswith(STDLIB + ":"):
        return _sha256(load_text(data_path))
    root = stdlib_root(data_path[len(STDLIB) + 1 :])
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in _stdlib_files(root)]
    return _sha256(json.dumps([_STDLIB_CORPUS_VERSION, sys.version, str(root), stats]))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive lock on path + '.lock', shared by all processes that build path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _atomic_write(path: Path, write: Callable[[io.BufferedWriter], None]) -> None:
    """Readers see either no file or the whole file, never a partial one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Tokenizer:
    """A sentencepiece model: encode(str) -> ids, decode(ids) -> str, no BOS/EOS added."""

    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm

        self.model_path = Path(model_path)
        model_proto = self.model_path.read_bytes()
        self.sha256 = _sha256(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size: int = self._sp.vocab_size()
        self.eos_id: int = self._sp.eos_id()
        self.pad_id: int = self._sp.pad_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=2)

    def decode(self, ids: list[int] | torch.Tensor | np.ndarray) -> str:
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            ids = ids.tolist()
        return self._sp.decode(ids)


def get_tokenizer(data_path: str, vocab_size: int, cache_dir: str | os.PathLike) -> Tokenizer:
    """The BPE tokenizer of data_path's text, trained on first use and then loaded from cache_dir."""
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"model vocab size: {vocab_size} is too small; byte_fallback needs 256 byte pieces "
            f"+ 4 specials, so use at least {_MIN_VOCAB} (512 or more in practice)"
        )
    options = {"spm": _SPM_OPTIONS, "max_train_sentences": _MAX_TRAIN_SENTENCES}
    key = _sha256(json.dumps({"text": _text_key(data_path), "vocab_size": vocab_size, **options}, sort_keys=True))
    model_path = Path(cache_dir) / f"spm-bpe-v{vocab_size}-{key[:16]}.model"
    with _locked(model_path):
        if not model_path.exists():
            model_proto = _train_sentencepiece(load_text(data_path), vocab_size)
            _atomic_write(model_path, lambda f: f.write(model_proto))
    return Tokenizer(model_path)


def _train_sentencepiece(text: str, vocab_size: int) -> bytes:
    import sentencepiece as spm

    # sentencepiece trains on lines; newlines themselves are encoded through byte_fallback
    lines = [line for line in text.split("\n") if line.strip()]
    stride = -(-len(lines) // _MAX_TRAIN_SENTENCES)  # ceil: a deterministic subsample, unlike spm's shuffle
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines[::stride]),
            model_writer=model,
            vocab_size=vocab_size,
            num_threads=2,
            minloglevel=2,
            **_SPM_OPTIONS,
        )
    except RuntimeError as err:
        raise ValueError(
            f"model vocab size: sentencepiece could not build {vocab_size} pieces from training.data_path "
            f"({len(text.encode())} bytes): {err}; use a smaller vocab size or more text"
        ) from err
    return model.getvalue()


class TokenDataset:
    """The corpus as one token stream cut into num_samples samples of S + 1 tokens.

    Documents (separated by a blank line) are followed by eos_id. get(i) reads sample
    perm_e[i % num_samples] of epoch e = i // num_samples, where perm_e is a permutation
    seeded by (seed, e): every index is valid and the order is deterministic.
    """

    def __init__(self, data_path: str, tokenizer: Tokenizer, seq_length: int, cache_dir: str | os.PathLike, seed: int):
        if seq_length < 1:
            raise ValueError(f"training.seq_length must be >= 1, got {seq_length}")
        self.seq_length = seq_length
        self.seed = seed
        self.tokens = _cached_token_ids(data_path, tokenizer, Path(cache_dir))  # [num_tokens] int32
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(
                f"training.seq_length: {seq_length} is too long for {data_path!r}, which has "
                f"{len(self.tokens)} tokens; use at most {len(self.tokens) - 1} or more text"
            )
        self._epoch_perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        """Samples per epoch; get() accepts any index >= 0."""
        return self.num_samples

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._epoch_perm is None or self._epoch_perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_perm = (epoch, rng.permutation(self.num_samples))
        return self._epoch_perm[1]

    def get(self, sample_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [S] int64, labels [S] int64) of the sample_index-th sample consumed."""
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0 (the number of samples consumed), got {sample_index}")
        epoch, position = divmod(sample_index, self.num_samples)
        start = int(self._permutation(epoch)[position]) * self.seq_length
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64))  # [S + 1]
        return window[:-1], window[1:]


def _cached_token_ids(data_path: str, tokenizer: Tokenizer, cache_dir: Path) -> np.ndarray:
    key = _sha256(f"{_text_key(data_path)}-{tokenizer.sha256}")
    ids_path = cache_dir / f"tokens-{key[:16]}.npy"
    with _locked(ids_path):
        if not ids_path.exists():
            docs = [doc for doc in load_text(data_path).split(_DOC_SEP) if doc.strip()]
            ids: list[int] = []
            for doc_ids in tokenizer.encode_batch(docs):
                ids.extend(doc_ids)
                ids.append(tokenizer.eos_id)
            array = np.asarray(ids, dtype=np.int32)  # [num_tokens]
            _atomic_write(ids_path, lambda f: np.save(f, array))
    return np.load(ids_path, mmap_mode="r")


def batch(dataset: TokenDataset, start_sample: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples start_sample .. start_sample + num_samples - 1: (tokens [N, S], labels [N, S]) int64."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    pairs = [dataset.get(i) for i in range(start_sample, start_sample + num_samples)]
    return torch.stack([t for t, _ in pairs]), torch.stack([l for _, l in pairs])
