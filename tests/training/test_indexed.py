"""Megatron indexed datasets (P.bin + P.idx) as training data: our reader and writer against
Megatron-Core's, tools/preprocess_data.py against the token stream a run builds from the same
text, blends of several datasets, and the errors for bad files and mismatched tokenizers."""

import importlib.util
import json
import os
import random
import re
import struct

import numpy as np
import pytest
import torch

from megatron_moe_hybrid.config import ConfigError, load_config
from megatron_moe_hybrid.training import data, indexed
from megatron_moe_hybrid.training.data import BLEND_BLOCK, BlendedDataset, TokenDataset, get_tokenizer, open_dataset
from megatron_moe_hybrid.training.indexed import IndexedWriter, indexed_prefix, parse_blend, read_indexed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "configs", "tiny.yaml")
VOCAB = 320
SEQ = 16
_WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "lambda", "omega", "sigma", "theta", "zeta", "rho", "tau"]


def _doc(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 40)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of a .jsonl file, a .txt file (blank-line separated documents) and a blank one."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": _doc(rng)}) + "\n" for _ in range(150)))
    (root / "b.txt").write_text("\n\n".join(_doc(rng) for _ in range(150)))
    (root / "c.txt").write_text("\n \n\t\n")  # whitespace only: skipped by the run and by the tool
    return root


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    return get_tokenizer(str(corpus), VOCAB, tmp_path_factory.mktemp("tok"))


def _tool():
    spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(ROOT, "tools", "preprocess_data.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.fixture(scope="module")
def prefix(corpus, tokenizer, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("indexed") / "corpus_text_document")
    tool = _tool()
    tool.TASK_BYTES, tool.AHEAD = 200, 1  # many .jsonl tasks, the workers' queue often full
    block, data.BLOCK_BYTES = data.BLOCK_BYTES, 97  # each file read in many pieces, as a large one is
    try:
        assert tool.main(["--input", str(corpus), "--tokenizer", str(tokenizer.model_path), "--output", out,
                          "--workers", "2"]) == 0
    finally:
        data.BLOCK_BYTES = block
    return out


def _megatron_indexed():
    pytest.importorskip("megatron.core")
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_our_writer_reads_back_in_megatron_and_ours(tmp_path, dtype):
    """Documents written by IndexedWriter: Megatron-Core's IndexedDataset returns each one, and
    read_indexed gives their concatenation and each one's end."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 60000, size=rng.integers(0, 50)) for _ in range(40)]
    docs[3] = docs[3][:0]  # an empty document
    writer = IndexedWriter(str(tmp_path / "d"), dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temporary left
    umask = os.umask(0)
    os.umask(umask)
    assert all(os.stat(tmp_path / f).st_mode & 0o777 == 0o666 & ~umask for f in ("d.bin", "d.idx"))  # as open() makes
    theirs = _megatron_indexed().IndexedDataset(str(tmp_path / "d"))
    assert len(theirs) == len(docs) and theirs.index.dtype == dtype
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)
    ours = read_indexed(str(tmp_path / "d"))
    np.testing.assert_array_equal(ours.tokens, np.concatenate(docs))
    lengths = [len(d) for d in docs if len(d)]
    np.testing.assert_array_equal(ours.ends, np.cumsum(lengths))


def test_megatron_builder_with_sentence_sequences_reads_in_ours(tmp_path):
    """Megatron-LM's preprocess_data with --split-sentences writes several sequences per
    document: the stream is every sequence in order and a document ends after its last one."""
    indexed = _megatron_indexed()
    rng = np.random.default_rng(2)
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    documents = []
    for _ in range(25):
        sentences = [rng.integers(0, 1000, size=rng.integers(1, 9)) for _ in range(rng.integers(1, 5))]
        builder.add_document(torch.from_numpy(np.concatenate(sentences)), [len(s) for s in sentences])
        documents.append(np.concatenate(sentences))
    builder.finalize(str(tmp_path / "m.idx"))
    ours = read_indexed(str(tmp_path / "m"))
    np.testing.assert_array_equal(ours.tokens, np.concatenate(documents))
    np.testing.assert_array_equal(ours.ends, np.cumsum([len(d) for d in documents]))
    assert indexed_prefix(str(tmp_path / "m.bin")) == indexed_prefix(str(tmp_path / "m.idx")) == str(tmp_path / "m")
    assert indexed_prefix(str(tmp_path / "nothing")) is None


@pytest.mark.parametrize("packing", ["stream", "fit", "best_fit"])
def test_preprocessed_dataset_equals_the_text_run(corpus, tokenizer, prefix, tmp_path, packing):
    """tools/preprocess_data.py's files (2 workers, each file read in 97-byte blocks, a .jsonl
    file parsed by the workers in pieces of about 200 bytes) give the
    token stream, document ends and samples that the run builds from the text itself (read
    whole) with the same tokenizer."""
    text = TokenDataset(str(corpus), tokenizer, SEQ, tmp_path / "cache", seed=3, packing=packing)
    ids = TokenDataset(prefix, tokenizer, SEQ, tmp_path / "cache", seed=3, packing=packing)
    assert ids.indexed == prefix and text.indexed is None
    np.testing.assert_array_equal(np.asarray(ids.tokens), np.asarray(text.tokens))
    np.testing.assert_array_equal(ids.ends, text.ends)
    assert ids.num_samples == text.num_samples and ids.masked_labels == text.masked_labels
    for i in list(range(12)) + [ids.num_samples + 5]:  # into a second epoch too
        for a, b in zip(ids.get(i), text.get(i)):
            assert torch.equal(a, b), (packing, i)
        assert ids.record_starts(i) == text.record_starts(i)


def test_preprocess_tool_errors_and_skips(corpus, tokenizer, tmp_path, capsys, monkeypatch):
    tool = _tool()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "alpha beta"}\nnot json\n{"text": "gamma"}\n')
    out = str(tmp_path / "o")
    assert tool.main(["--input", str(bad), "--tokenizer", str(tokenizer.model_path), "--output", out,
                      "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --input: {bad}:2: not valid JSON") and err.count("\n") == 1, err
    assert not any(f.startswith(("o.", ".o.")) for f in os.listdir(tmp_path))  # nothing half written
    assert tool.main(["--input", str(bad), "--tokenizer", str(tokenizer.model_path), "--output", out,
                      "--workers", "1", "--bad-data", "skip"]) == 0
    assert "2 documents" in capsys.readouterr().out
    assert [tokenizer.decode(d) for d in np.split(np.asarray(read_indexed(out).tokens),
                                                   read_indexed(out).ends[:-1])] == [
        "alpha beta" + tokenizer.decode([tokenizer.eos_id]), "gamma" + tokenizer.decode([tokenizer.eos_id])]
    # the workers parse a .jsonl file: a bad line in a later piece names its file and line, and
    # at most AHEAD tasks a worker are in flight (the input is not read ahead further)
    many = tmp_path / "many.jsonl"
    lines = [json.dumps({"text": f"alpha {i} beta"}) for i in range(300)]
    lines[217] = "{not json"
    many.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(tool, "TASK_BYTES", 64)
    monkeypatch.setattr(tool, "AHEAD", 2)
    given, written, most = [0], [0], [0]
    tasks, write = tool._tasks, tool._write

    def counted(*args):
        for task in tasks(*args):
            given[0] += 1
            yield task

    def count_written(*args):
        written[0] += 1
        most[0] = max(most[0], given[0] - written[0])
        return write(*args)

    monkeypatch.setattr(tool, "_tasks", counted)
    monkeypatch.setattr(tool, "_write", count_written)
    assert tool.main(["--input", str(many), "--tokenizer", str(tokenizer.model_path), "--output", out + "m",
                      "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --input: {many}:218: not valid JSON") and err.count("\n") == 1, err
    assert not any(f.startswith(("om", ".om")) for f in os.listdir(tmp_path))
    given[0] = written[0] = most[0] = 0
    assert tool.main(["--input", str(many), "--tokenizer", str(tokenizer.model_path), "--output", out + "m",
                      "--workers", "2", "--bad-data", "skip"]) == 0
    assert "299 documents" in capsys.readouterr().out and given[0] == written[0] > 100
    assert 1 <= most[0] <= 2 * 2  # AHEAD tasks a worker
    docs = [tokenizer.decode(d) for d in np.split(np.asarray(read_indexed(out + "m").tokens),
                                                  read_indexed(out + "m").ends[:-1])]
    assert docs == [f"alpha {i} beta" + tokenizer.decode([tokenizer.eos_id]) for i in range(300) if i != 217]
    monkeypatch.undo()
    # a corpus whose path merely starts with "stdlib" is files, read block by block, not the built-in corpus
    named = tmp_path / "stdlib_notes"
    named.mkdir()
    (named / "a.txt").write_text("alpha beta\n\ngamma")
    read = []
    real = tool.file_documents
    monkeypatch.setattr(tool, "file_documents", lambda path, **kw: read.append(path) or real(path, **kw))
    monkeypatch.chdir(tmp_path)  # a relative path: "stdlib_notes/a.txt"
    assert tool.main(["--input", "stdlib_notes", "--tokenizer", str(tokenizer.model_path), "--output", out + "2",
                      "--workers", "1"]) == 0
    assert read == [os.path.join("stdlib_notes", "a.txt")] and "2 documents" in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_file_read_block_by_block_gives_what_reading_it_whole_gives(tmp_path, suffix):
    """file_documents (the tool's reader, a file never whole) against load_documents on random
    files cut into blocks of 1 to 200 bytes: runs of blank lines, non-UTF-8 lines beside them,
    bad JSON, over-long documents; the documents and skip counts under bad_data skip, the error
    (file, line and byte offset) under bad_data error (where a .txt file holds two kinds of bad
    line, the first in the file rather than the first kind reading it whole looks for)."""
    rng = random.Random(hash(suffix) % 1000)
    pieces = [b"alpha beta", b"gamma", b"", b"", b"\xff\xfe bad", "dé\u00e9lta".encode(), b"  ", b"omega " * 9]
    if suffix == ".jsonl":
        pieces = [json.dumps({"text": _doc(rng)}).encode(), b"{not json", b"", b"[1]", json.dumps({"x": 1}).encode(),
                  b"\\xff" + json.dumps({"text": "z"}).encode(), json.dumps({"text": "w " * 40}).encode()]
    edges = [b"a\n\n\xff", b"a\n\n\xff\n", b"a\n\n\xff\n\xff\n\nb", b"a\n\n\n\nb", b"\n\na\n\n", b"", b"\n", b"\xff\n\na"]
    for trial in range(40 + len(edges)):
        path = tmp_path / f"f{trial}{suffix}"
        path.write_bytes(edges[trial - 40] if trial >= 40 else b"\n".join(
            rng.choice(pieces) for _ in range(rng.randint(0, 60))) + rng.choice([b"", b"\n", b"\n\n"]))
        for bad_data in ("skip", "error"):
            options = dict(bad_data=bad_data, max_document_chars=rng.choice([None, 50]))
            try:
                whole = (data._jsonl_documents if suffix == ".jsonl" else data._text_documents)(
                    path, path.read_bytes(), data._TextOptions(**options), stats := dict.fromkeys(data.STAT_KEYS, 0))
                want = (whole, stats)
            except ValueError as e:
                want = str(e)
            for block in (1, 2, 3, 7, 31, 200):
                try:
                    parts = list(data.file_documents(path, block_bytes=block, **options))
                    got = ([d for docs, _ in parts for d in docs],
                           {k: sum(s[k] for _, s in parts) for k in data.STAT_KEYS})
                except ValueError as e:
                    got = str(e)
                if suffix == ".jsonl":  # the tool's workers' pieces, parsed one by one from their line and byte
                    for piece in (1, 5, 64):
                        try:
                            parsed = [(data._jsonl_documents(path, raw, data._TextOptions(**options),
                                                             stats := dict.fromkeys(data.STAT_KEYS, 0), line, byte), stats)
                                      for raw, line, byte in data.jsonl_pieces(path, block, piece)]
                            by_piece = ([d for docs, _ in parsed for d in docs],
                                        {k: sum(s[k] for _, s in parsed) for k in data.STAT_KEYS})
                        except ValueError as e:
                            by_piece = str(e)
                        assert by_piece == want, (trial, bad_data, block, piece, path.read_bytes())
                if isinstance(want, str) and suffix == ".txt" and options["max_document_chars"]:
                    # reading whole, a .txt file's non-UTF-8 lines stop it before any long document;
                    # block by block, whichever comes first in the file
                    assert isinstance(got, str) and got.startswith(f"training.data_path: {path}:"), (got, want)
                    continue
                assert got == want, (trial, bad_data, block, path.read_bytes())


def _write_index(prefix, lengths, pointers, starts, dtype=np.uint16, tokens=None):
    """P.idx of the given arrays as they are (right or wrong) and P.bin of their tokens."""
    with open(prefix + ".idx", "wb") as f:
        f.write(indexed.HEADER + struct.pack("<QBQQ", 1, indexed._CODES[np.dtype(dtype)], len(lengths), len(starts)))
        f.write(np.asarray(lengths, np.int32).tobytes() + np.asarray(pointers, np.int64).tobytes()
                + np.asarray(starts, np.int64).tobytes())
    count = int(np.sum(np.maximum(lengths, 0))) if tokens is None else len(tokens)
    np.zeros(count, dtype).tofile(prefix + ".bin") if tokens is None else np.asarray(tokens, dtype).tofile(prefix + ".bin")


def _plain_ends(lengths, starts):
    """The ends read the plain way (the reader's form until 2026-12-06): every sequence's end,
    each document's last one, empty documents and zero-length sequences ending nowhere new."""
    seq_ends = np.cumsum(lengths, dtype=np.int64)
    last = np.asarray(starts[1:]) - 1
    ends = seq_ends[last[last >= 0]] if len(lengths) else np.zeros(0, np.int64)
    return np.unique(ends[ends > 0])


@pytest.mark.parametrize("slice_", [1, 2, 3, 7, 1 << 22])
def test_document_ends_made_a_slice_at_a_time_equal_the_plain_form(tmp_path, monkeypatch, slice_):
    """Random indexes (several sequences a document, empty documents, zero-length sequences, none
    at all) read a slice of the index at a time, into memory and into an ends file, give the
    plain form's ends; the checks on the way (negative length, a sequence out of place, document
    starts out of order) name the file at every slice size."""
    monkeypatch.setattr(indexed, "_SLICE", slice_)
    rng = np.random.default_rng(slice_)
    for trial in range(30):
        documents = int(rng.integers(0, 12))
        per_doc = rng.integers(0, 4, documents) * (rng.random(documents) > 0.2)  # sequences a document, some 0
        starts = np.concatenate([[0], np.cumsum(per_doc)]).astype(np.int64)
        lengths = rng.integers(0, 5, int(starts[-1])).astype(np.int32) * (rng.random(int(starts[-1])) > 0.2)
        pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * 2
        prefix = str(tmp_path / f"t{trial}")
        _write_index(prefix, lengths, pointers, starts)
        want = _plain_ends(lengths, starts)
        got = read_indexed(prefix)
        np.testing.assert_array_equal(got.ends, want)
        assert len(got.tokens) == int(lengths.sum())
        ends_path = tmp_path / f"t{trial}.ends"
        np.testing.assert_array_equal(read_indexed(prefix, ends_path).ends, want)
        np.testing.assert_array_equal(read_indexed(prefix, ends_path).ends, want)  # from the file
        if len(lengths) < 2 or lengths.sum() == 0:
            continue
        bad = lengths.copy()
        bad[rng.integers(len(bad))] = -1
        _write_index(prefix, bad, pointers, starts, tokens=np.zeros(int(lengths.sum())))
        with pytest.raises(ValueError, match=rf"t{trial}\.idx: a sequence has a negative length"):
            read_indexed(prefix)
        moved = pointers.copy()
        moved[rng.integers(1, len(moved))] += 2
        _write_index(prefix, lengths, moved, starts)
        with pytest.raises(ValueError, match=rf"t{trial}\.idx: its sequences are not stored one after another"):
            read_indexed(prefix, tmp_path / f"t{trial}.moved")
        assert not (tmp_path / f"t{trial}.moved").exists() and not list(tmp_path.glob(f".t{trial}.moved*"))
        if documents >= 2:  # a start past the sequence count, before the last start
            swapped = starts.copy()
            swapped[1] = starts[-1] + 1
            _write_index(prefix, lengths, pointers, swapped)
            with pytest.raises(ValueError, match=r"document starts do not run from 0 to the sequence count"):
                read_indexed(prefix)


def test_the_ends_are_made_once_and_memory_mapped(prefix, tokenizer, tmp_path, monkeypatch):
    """An indexed dataset's document ends are written once into the cache (the ranks of a host
    then share one memory-mapped copy and do not read the index again) and equal the plain read's;
    a changed dataset (another size or time) gets its own."""
    cache = tmp_path / "cache"
    first = TokenDataset(prefix, tokenizer, SEQ, cache, seed=0, packing="best_fit")
    made = sorted(p.name for p in cache.glob("*.ends-v1.i64"))
    assert len(made) == 1 and isinstance(first.ends, np.memmap)
    np.testing.assert_array_equal(first.ends, read_indexed(prefix).ends)

    def never(*args):
        raise AssertionError("the index was read again")

    monkeypatch.setattr(indexed, "_document_ends", never)
    again = TokenDataset(prefix, tokenizer, SEQ, cache, seed=0, packing="best_fit")
    np.testing.assert_array_equal(again.ends, first.ends)
    assert [again.get(i)[0].tolist() for i in range(5)] == [first.get(i)[0].tolist() for i in range(5)]
    monkeypatch.undo()
    import shutil

    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, tmp_path / ("copy" + ext))
    TokenDataset(str(tmp_path / "copy"), tokenizer, SEQ, cache, seed=0)
    assert len(list(cache.glob("*.ends-v1.i64"))) == 2


def test_writer_writes_a_slice_at_a_time_what_it_wrote_whole(tmp_path, monkeypatch):
    """IndexedWriter's index written in slices of 1-3 documents is byte for byte the one written
    in one piece."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 1000, size=rng.integers(0, 9)) for _ in range(23)]
    files = []
    for slice_ in (1, 2, 3, 1 << 22):
        monkeypatch.setattr(indexed, "_SLICE", slice_)
        writer = IndexedWriter(str(tmp_path / f"w{slice_}"), np.uint16)
        for doc in docs:
            writer.add_document(doc)
        writer.close()
        files.append((tmp_path / f"w{slice_}.idx").read_bytes())
    assert all(f == files[-1] for f in files)
    lengths = np.array([len(d) for d in docs], np.int32)
    assert files[-1][indexed._FIXED:] == (lengths.tobytes() + ((np.cumsum(lengths) - lengths) * 2).astype(np.int64).tobytes()
                                          + np.arange(len(docs) + 1, dtype=np.int64).tobytes())


def test_bad_files_name_the_file(prefix, tmp_path, tokenizer):
    import shutil

    def copy(name):
        for ext in (".bin", ".idx"):
            shutil.copy(prefix + ext, tmp_path / (name + ext))
        return str(tmp_path / name)

    short = copy("short")
    with open(short + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(short + ".bin") - 2)
    with pytest.raises(ValueError, match=r"training\.data_path: .*short\.bin: .*truncated"):
        read_indexed(short)
    header = copy("header")
    raw = bytearray(open(header + ".idx", "rb").read())
    raw[:4] = b"JUNK"
    open(header + ".idx", "wb").write(raw)
    with pytest.raises(ValueError, match=r"header\.idx: not a Megatron indexed dataset index"):
        read_indexed(header)
    version = copy("version")
    raw = bytearray(open(version + ".idx", "rb").read())
    raw[9:17] = struct.pack("<Q", 2)
    open(version + ".idx", "wb").write(raw)
    with pytest.raises(ValueError, match=r"index version 2"):
        read_indexed(version)
    gap = copy("gap")  # a second sequence that does not start where the first ends
    raw = bytearray(open(gap + ".idx", "rb").read())
    sequences = struct.unpack("<Q", raw[18:26])[0]
    at = 34 + 4 * sequences + 8  # the second sequence's byte offset
    raw[at:at + 8] = struct.pack("<q", struct.unpack("<q", raw[at:at + 8])[0] + 2)
    open(gap + ".idx", "wb").write(raw)
    with pytest.raises(ValueError, match=r"gap\.idx: its sequences are not stored one after another"):
        read_indexed(gap)
    cut = copy("cut")
    with open(cut + ".idx", "r+b") as f:
        f.truncate(40)
    with pytest.raises(ValueError, match=r"cut\.idx: truncated"):
        TokenDataset(cut, tokenizer, SEQ, tmp_path / "cache", seed=0)


def test_ids_outside_the_tokenizer_stop_naming_it(tmp_path, tokenizer):
    """Data made with a larger tokenizer: stopped at load (its first tokens) and, past them, at
    the sample that holds such an id, naming training.tokenizer_model."""
    writer = IndexedWriter(str(tmp_path / "early"), np.uint16)
    writer.add_document(np.arange(0, 40) * 20)  # up to 780 >= 320
    writer.close()
    with pytest.raises(ValueError, match=r"training\.tokenizer_model: .*early: its first tokens hold token id 780, "
                                         r"outside the tokenizer's 320 pieces"):
        TokenDataset(str(tmp_path / "early"), tokenizer, SEQ, tmp_path / "cache", seed=0)
    late = str(tmp_path / "late")  # the first 2^20 tokens (what the load checks) fine, then one outside
    writer = IndexedWriter(late, np.uint16)
    writer.add_document(np.full(1 << 20, 5))
    writer.add_document(np.array([999] + [5] * (SEQ * 4)))
    writer.close()
    ds = TokenDataset(late, tokenizer, SEQ, tmp_path / "cache", seed=0)
    i = int(np.flatnonzero(ds._permutation(0) == (1 << 20) // SEQ)[0])  # the sample whose inputs hold it
    with pytest.raises(ValueError, match=rf"training\.tokenizer_model: .*late: sample {i} holds token id 999"):
        ds.get(i)
    ds.get(int(np.flatnonzero(ds._permutation(0) == 0)[0]))  # the others load


def test_a_bad_id_mid_run_stops_it_in_one_line(tmp_path, tokenizer, capsys):
    """An id outside the tokenizer past what the load checks: the run stops at the step whose
    sample holds it, with one line naming training.tokenizer_model (exit 1), not a traceback."""
    from megatron_moe_hybrid.training.cli import main

    late = _indexed(tmp_path / "late", [np.full(1 << 20, 5), np.full(1 << 20, 999)])  # half the samples bad
    args = ["--config", TINY, "--training.train_steps", "3", "--training.cache_dir", str(tmp_path / "cache"),
            "--training.output_dir", str(tmp_path / "out"), "--training.data_path", late,
            "--training.tokenizer_model", str(tokenizer.model_path), "--model.vocab_size", str(VOCAB),
            "--training.seq_length", "64", "--training.save_interval", "0"]
    assert main("pretrain", args) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line and not line.startswith("pretrain:")]  # progress
    assert len(err) == 1 and re.fullmatch(r"error: training stopped at step 1: training\.tokenizer_model: "
                                          r".*late: sample \d+ holds token id 999, outside the tokenizer's 320 "
                                          r"pieces; give the tokenizer the data was made with", err[0]), err


def _indexed(path, docs, dtype=np.uint16):
    writer = IndexedWriter(str(path), dtype)
    for d in docs:
        writer.add_document(np.asarray(d))
    writer.close()
    return str(path)


def test_blend_is_stateless_in_proportion_and_repeats_small_parts(tmp_path, tokenizer):
    """Each block of BLEND_BLOCK samples holds each dataset's share (weights 0.7 / 0.2 / 0.1),
    spread through the block; part d's samples come in its own order, each once per pass, a small
    part repeating in new orders; a second object gives the same samples (stateless)."""
    rng = np.random.default_rng(4)
    paths = [_indexed(tmp_path / f"p{d}", [rng.integers(0, VOCAB, size=SEQ * n + 1)])
             for d, n in enumerate((3000, 900, 20))]
    blend = f"0.7 {paths[0]} 0.2 {paths[1]} 0.1 {paths[2]}"
    assert parse_blend(blend) == [(0.7, paths[0]), (0.2, paths[1]), (0.1, paths[2])]
    assert parse_blend(paths[0]) is None and parse_blend("1 a b") is None and parse_blend("x a y b") is None
    ds = open_dataset(blend, tokenizer, SEQ, tmp_path / "cache", seed=5)
    assert isinstance(ds, BlendedDataset) and list(ds.counts) == [7000, 2000, 1000]
    seen = [ds._where(i) for i in range(2 * BLEND_BLOCK)]
    for d, part in enumerate(ds.parts):
        mine = [local for p, local in seen if p is part]
        assert len(mine) == 2 * ds.counts[d] and mine == sorted(mine) == list(range(len(mine)))
    first = [ds.parts.index(p) for p, _ in seen[:BLEND_BLOCK]]
    assert max(np.diff([i for i, d in enumerate(first) if d == 2])) <= 11  # spread, every ~10th
    small = ds.parts[2]  # 20 samples a pass, 1000 a block: 50 passes, each a permutation
    got = [small._permutation(e) for e in range(3)]
    assert all(sorted(g) == list(range(20)) for g in got) and not np.array_equal(got[0], got[1])
    again = open_dataset(blend, tokenizer, SEQ, tmp_path / "cache", seed=5)
    for i in [0, 1, 7, 9999, 10000, 123456]:
        part, local = ds._where(i)
        for a, b, c in zip(ds.get(i), again.get(i), part.get(local)):
            assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="weight under 1/10000"):
        open_dataset(f"1 {paths[0]} 0.00001 {paths[1]}", tokenizer, SEQ, tmp_path / "cache", seed=5)


def _config(tmp_path, **overrides):
    ov = {"training.output_dir": str(tmp_path / "out"), "training.cache_dir": str(tmp_path / "cache")}
    ov.update(overrides)
    return load_config(TINY, ov)


def test_config_names_what_indexed_data_needs(tmp_path, prefix, tokenizer, corpus):
    with pytest.raises(ConfigError, match=r"training\.tokenizer_model: training\.data_path is an indexed dataset"):
        _config(tmp_path, **{"training.data_path": prefix}).validate()
    with pytest.raises(ConfigError, match=r"training\.tokenizer_model: training\.eval_data_path is a blend"):
        _config(tmp_path, **{"training.eval_data_path": f"1 {prefix} 1 {corpus}"}).validate()
    with pytest.raises(ConfigError, match=r"training\.data_format: prompt_response reads \.jsonl records; "
                                          r"training\.data_path .* is an indexed dataset"):
        _config(tmp_path, **{"training.data_path": prefix + ".idx", "training.data_format": "prompt_response",
                             "training.tokenizer_model": str(tokenizer.model_path)}).validate()
    with pytest.raises(ConfigError, match=r"training\.data_path: .*nowhere.* does not exist.*indexed dataset's prefix"):
        _config(tmp_path, **{"training.data_path": f"0.5 {prefix} 0.5 {tmp_path}/nowhere",
                             "training.tokenizer_model": str(tokenizer.model_path)}).validate()
    with pytest.raises(ConfigError, match=r"training\.data_path: blend weight -1\.0 .* must be a positive number"):
        _config(tmp_path, **{"training.data_path": f"-1 {prefix} 2 {prefix}",
                             "training.tokenizer_model": str(tokenizer.model_path)}).validate()
    _config(tmp_path, **{"training.data_path": f"0.5 {prefix} 0.5 {corpus}",
                         "training.tokenizer_model": str(tokenizer.model_path)}).validate()


def test_a_run_trains_on_an_indexed_blend(tmp_path, prefix, tokenizer, corpus, capsys):
    """The CLI on a blend of the indexed dataset and the text it was made from: one line per
    dataset in the data summary, and the run trains."""
    from megatron_moe_hybrid.training.cli import main

    args = ["--config", TINY, "--training.train_steps", "2", "--training.cache_dir", str(tmp_path / "cache"),
            "--training.output_dir", str(tmp_path / "out"), "--training.data_path", f"3 {prefix} 1 {corpus}",
            "--training.tokenizer_model", str(tokenizer.model_path), "--model.vocab_size", str(VOCAB),
            "--training.seq_length", "64", "--training.save_interval", "0"]
    assert main("pretrain", args) == 0
    out = capsys.readouterr().out
    assert "data: a blend of 2 datasets (text)" in out and f"0.75 x {prefix} (indexed dataset, uint16)" in out, out
    assert f"0.25 x {corpus} (text)" in out, out
    assert os.path.isfile(tmp_path / "out" / "metrics.jsonl")


def test_a_blend_of_hundreds_of_datasets_opens_under_a_low_open_file_limit(tmp_path, tokenizer):
    """Each dataset of a blend holds up to three memory maps, each an open file: 150 datasets
    under a soft limit of 256 open files raise it and open (they stopped with "Too many open
    files" before); under a hard limit of 300 the CLI stops at once with one line naming the field
    and the fix."""
    import resource
    import subprocess
    import sys

    rng = np.random.default_rng(9)
    for i in range(150):
        writer = IndexedWriter(str(tmp_path / f"p{i}"), np.uint16)
        for _ in range(4):
            writer.add_document(rng.integers(1, VOCAB, rng.integers(5, 40)))
        writer.close()
    blend = " ".join(f"1 {tmp_path / f'p{i}'}" for i in range(150))
    script = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, int(sys.argv[1])))
from megatron_moe_hybrid.training.data import load_tokenizer, open_dataset
if sys.argv[2] == "open":
    d = open_dataset({blend!r}, load_tokenizer({str(tokenizer.model_path)!r}), {SEQ}, {str(tmp_path / 'cache')!r}, 0,
                     packing="best_fit")
    [d.get(i) for i in range(0, 3000, 7)]
    print("opened", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
else:
    from megatron_moe_hybrid.training.cli import main
    sys.exit(main("pretrain", ["--config", {TINY!r}, "--training.data_path", {blend!r}, "--training.tokenizer_model",
                               {str(tokenizer.model_path)!r}, "--model.vocab_size", "{VOCAB}",
                               "--training.cache_dir", {str(tmp_path / 'cache')!r},
                               "--training.output_dir", {str(tmp_path / 'out')!r}]))
"""
    env = dict(os.environ, PYTHONPATH=ROOT)
    hard = min(20000, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    if hard < 150 * 3 + 256:
        pytest.skip(f"this machine's hard limit on open files ({hard}) is below what the blend needs")
    done = subprocess.run([sys.executable, "-c", script, str(hard), "open"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and "opened" in done.stdout, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", script, "300", "cli"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"error: training\.data_path: a blend of 150 datasets holds up to 450 memory-mapped files, more than this "
        r"process may open \(open files: 256, hard limit 300\); raise the hard limit to at least (\d+) \(ulimit -Hn, "
        r"the container's nofile, /etc/security/limits\.conf\) or blend fewer, larger datasets", lines[0]), lines
    assert 706 < int(re.search(r"at least (\d+)", lines[0]).group(1)) < 706 + 256  # and what the process has open (~100)


def test_the_summary_of_a_large_blend_names_its_heaviest_datasets(tmp_path, tokenizer):
    """A blend of 12 datasets: the data summary describes the 8 heaviest one by one and the other
    4 in one clause (their weights and tokens), not a line of hundreds of datasets."""
    from megatron_moe_hybrid.training.trainer import BLEND_LINES, _data_summary

    rng = np.random.default_rng(4)
    paths, tokens = [], {}
    for i in range(12):
        writer = IndexedWriter(str(tmp_path / f"p{i}"), np.uint16)
        docs = [rng.integers(1, VOCAB, rng.integers(5, 40)) for _ in range(6)]
        for doc in docs:
            writer.add_document(doc)
        writer.close()
        paths.append(str(tmp_path / f"p{i}"))
        tokens[paths[-1]] = sum(map(len, docs))
    weights = [i + 1 for i in range(12)]  # p11 heaviest
    blend = open_dataset(" ".join(f"{w} {p}" for w, p in zip(weights, paths)), tokenizer, SEQ, tmp_path / "cache", 0)
    line = _data_summary("data", "", blend, "text")
    assert BLEND_LINES == 8 and line.startswith("data: a blend of 12 datasets (text)")
    named = [p for p in paths if f" x {p} (indexed dataset" in line]
    assert named == paths[4:], line  # the 8 heaviest, in the blend's order
    rest = sum(weights[:4]) / sum(weights)
    assert line.endswith(f"; and 4 more (weights {rest:.3g} in all, {sum(tokens[p] for p in paths[:4]):,} tokens)"), line
