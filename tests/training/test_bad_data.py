"""Bad training data (issue 13, item 6): each fault is written into tmp_path, then read
with bad_data="error" (a ValueError naming file and line) and "skip" (dropped and counted).

Shape legend:
  T  tokens in the corpus stream (documents, each followed by eos)
"""

import json
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megatron_moe_hybrid.training import data
from megatron_moe_hybrid.training.data import STAT_KEYS, TokenDataset, get_tokenizer, load_documents, load_text

VOCAB = 300
SEQ = 8
LIMIT = 400  # max_document_chars in the tests; every good document is shorter
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "xe", "zu", "qua", "pri", "st", "ng"]


def _doc(rng: random.Random, num_words: int = 20) -> str:
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(num_words)]
    return " ".join(words).capitalize() + "."


def _zero_stats(**counts) -> dict[str, int]:
    return {key: counts.get(key, 0) for key in STAT_KEYS}


def _jsonl(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


# kind -> (the bad line as written, the stats key that counts it)
_JSONL_FAULTS = {
    "not-json": (b'{"text": "unterminated', "skipped_bad_json"),
    "not-object": (b'["a", "list"]', "skipped_bad_json"),
    "missing-field": (b'{"body": "the text is under another key"}', "skipped_missing_field"),
    "non-string-field": (b'{"text": 5}', "skipped_missing_field"),
    "null-field": (b'{"text": null}', "skipped_missing_field"),
    "non-utf8": (b'{"text": "caf\xe9 latin-1"}', "skipped_non_utf8"),
    "lone-surrogate": (b'{"text": "half \\ud800 a pair"}', "skipped_non_utf8"),
    "too-long": (json.dumps({"text": "x" * (LIMIT + 1)}).encode(), "skipped_too_long"),
}


def _jsonl_with_faults(rng: random.Random, kinds: list[str], num_good: int = 9):
    """(file bytes, good documents in order, 1-based line numbers of the bad lines in order)."""
    good = [_doc(rng) for _ in range(num_good)]
    lines = [json.dumps({"text": d, "id": i}).encode() for i, d in enumerate(good)]
    lines.insert(rng.randint(0, len(lines)), b"   ")  # a blank line still counts as a line
    for kind in kinds:
        lines.insert(rng.randint(0, len(lines)), _JSONL_FAULTS[kind][0])
    bad_lines = [i + 1 for i, line in enumerate(lines) if line in {_JSONL_FAULTS[k][0] for k in kinds}]
    return b"\n".join(lines) + b"\n", good, bad_lines


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A JSONL file with one bad line of each kind."""
    path = tmp_path_factory.mktemp("corpus") / "train.jsonl"
    raw, _, _ = _jsonl_with_faults(random.Random(0), list(_JSONL_FAULTS), num_good=300)
    path.write_bytes(raw)
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    return get_tokenizer(str(corpus), VOCAB, tmp_path_factory.mktemp("cache"), bad_data="skip", max_document_chars=LIMIT)


@pytest.mark.parametrize("kind", list(_JSONL_FAULTS))
def test_jsonl_fault_raises_naming_file_and_line(tmp_path, kind):
    rng = random.Random(list(_JSONL_FAULTS).index(kind))
    path = tmp_path / "data.jsonl"
    raw, _, bad_lines = _jsonl_with_faults(rng, [kind, kind])
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=re.escape(f"{path}:{bad_lines[0]}:")) as err:
        load_text(str(path), max_document_chars=LIMIT)
    assert "training.bad_data: skip" in str(err.value)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_jsonl_skip_drops_and_counts_every_kind(tmp_path, seed):
    rng = random.Random(seed)
    kinds = rng.choices(list(_JSONL_FAULTS), k=12)
    path = tmp_path / "data.jsonl"
    raw, good, _ = _jsonl_with_faults(rng, kinds)
    path.write_bytes(raw)
    docs, stats = load_documents(str(path), bad_data="skip", max_document_chars=LIMIT)
    assert docs == good
    assert stats == _zero_stats(**Counter(_JSONL_FAULTS[k][1] for k in kinds))


def test_jsonl_text_field_picks_the_key(tmp_path):
    rng = random.Random(4)
    records = [{"body": _doc(rng), "text": _doc(rng)} for _ in range(5)]
    path = tmp_path / "data.jsonl"
    path.write_bytes(_jsonl(records) + b'{"text": "no body here"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:6:") + ".*training.text_field"):
        load_documents(str(path), text_field="body")
    docs, stats = load_documents(str(path), text_field="body", bad_data="skip")
    assert docs == [r["body"] for r in records]
    assert stats == _zero_stats(skipped_missing_field=1)


def _txt_lines(rng: random.Random) -> list[str]:
    """Lines of documents separated by a blank line (a '' line)."""
    lines = []
    for _ in range(4):
        lines += [_doc(rng, 6) for _ in range(rng.randint(1, 3))] + [""]
    return lines[:-1]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [b"caf\xe9", b"\xff\xfe", b"cut \xe2\x82"], ids=["latin1", "bom16", "truncated"])
def test_txt_non_utf8_line(tmp_path, where, bad):
    rng = random.Random(5)
    lines = [line.encode() for line in _txt_lines(rng)]
    index = {"first": 0, "middle": 3, "last": len(lines)}[where]
    lines.insert(index, b"before " + bad + b" after")
    raw = b"\n".join(lines)  # "last": no newline at the end of the file
    path = tmp_path / "data.txt"
    path.write_bytes(raw)
    byte_offset = raw.index(bad) + next(i for i, byte in enumerate(bad) if byte >= 0x80)  # the first non-ASCII byte
    with pytest.raises(ValueError, match=re.escape(f"{path}:{index + 1}: byte offset {byte_offset} ")):
        load_text(str(path))
    text, stats = _text_and_stats(path)
    assert text == b"\n".join(lines[:index] + lines[index + 1 :]).decode()
    assert stats == _zero_stats(skipped_non_utf8=1)


def _text_and_stats(path: Path, **options) -> tuple[str, dict[str, int]]:
    docs, stats = load_documents(str(path), bad_data="skip", **options)
    return "\n\n".join(docs), stats


@pytest.mark.parametrize("position", [0, 2, 4])
def test_txt_document_over_the_limit(tmp_path, position):
    rng = random.Random(6 + position)
    docs = ["\n".join(_doc(rng, 8) for _ in range(rng.randint(1, 3))) for _ in range(5)]
    docs[position] = "\n".join(_doc(rng, 12) for _ in range(9))  # over LIMIT characters
    assert len(docs[position]) > LIMIT and all(len(d) <= LIMIT for i, d in enumerate(docs) if i != position)
    path = tmp_path / "data.txt"
    path.write_text("\n\n".join(docs), encoding="utf-8")
    start_line = 1 + sum(d.count("\n") + 2 for d in docs[:position])
    with pytest.raises(ValueError, match=re.escape(f"{path}:{start_line}: ") + ".*training.max_document_chars"):
        load_text(str(path), max_document_chars=LIMIT)
    assert load_text(str(path)) == "\n\n".join(docs)  # no limit by default
    text, stats = _text_and_stats(path, max_document_chars=LIMIT)
    assert text == "\n\n".join(docs[:position] + docs[position + 1 :])
    assert stats == _zero_stats(skipped_too_long=1)


@pytest.mark.parametrize(
    "files",
    [{"a.txt": b""}, {"a.txt": b" \n\n\t\n"}, {"a.jsonl": b""}, {"d/a.txt": b"", "d/b.jsonl": b"\n", "d/c.md": b"x"}],
    ids=["empty-txt", "blank-txt", "empty-jsonl", "dir-of-empty-files"],
)
def test_empty_data_names_the_file(tmp_path, files, tokenizer):
    for name, raw in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(raw)
    data_path = str(tmp_path / next(iter(files)).split("/")[0])
    for policy in ("error", "skip"):
        with pytest.raises(ValueError, match=re.escape(repr(data_path)) + " (is empty|holds only empty files)"):
            load_text(data_path, bad_data=policy)
        with pytest.raises(ValueError, match="training.data_path.*empty"):
            get_tokenizer(data_path, VOCAB, tmp_path / "cache", bad_data=policy)
        with pytest.raises(ValueError, match="training.data_path.*empty"):
            TokenDataset(data_path, tokenizer, SEQ, tmp_path / "cache", seed=0, bad_data=policy)


def test_directory_with_some_empty_files_reads_the_others(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "kept"}\n')
    assert load_documents(str(tmp_path)) == (["kept"], _zero_stats())


def test_missing_file_names_the_field(tmp_path, tokenizer):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="training.data_path: .*does not exist"):
        get_tokenizer(missing, VOCAB, tmp_path, bad_data="skip")
    with pytest.raises(ValueError, match="training.data_path: .*does not exist"):
        TokenDataset(missing, tokenizer, SEQ, tmp_path, seed=0, bad_data="skip")


def test_nothing_left_after_skipping(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"body": "a"}\nnot json\n{"text": ""}\n')
    with pytest.raises(ValueError, match="training.data_path: .*no text left"):
        load_text(str(path), bad_data="skip")


@pytest.mark.parametrize(
    "options, field",
    [
        ({"bad_data": "ignore"}, "training.bad_data"),
        ({"text_field": ""}, "training.text_field"),
        ({"max_document_chars": 0}, "training.max_document_chars"),
        ({"max_document_chars": 1.5}, "training.max_document_chars"),
        ({"max_document_chars": True}, "training.max_document_chars"),
    ],
    ids=["policy", "field", "limit-0", "limit-float", "limit-bool"],
)
def test_bad_options_name_the_field(tmp_path, tokenizer, options, field):
    path = tmp_path / "data.txt"
    path.write_text(_doc(random.Random(7)), encoding="utf-8")
    with pytest.raises(ValueError, match=field):
        load_text(str(path), **options)
    with pytest.raises(ValueError, match=field):
        get_tokenizer(str(path), VOCAB, tmp_path, **options)
    with pytest.raises(ValueError, match=field):
        TokenDataset(str(path), tokenizer, SEQ, tmp_path, seed=0, **options)


def _reference_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """[T] every document's ids followed by eos, in file order."""
    return np.asarray([i for d in docs for i in tokenizer.encode(d) + [tokenizer.eos_id]], dtype=np.int64)


def test_data_stats_come_back_from_the_cache(tmp_path, tokenizer, monkeypatch):
    rng = random.Random(8)
    kinds = ["not-json", "missing-field", "missing-field", "non-utf8", "too-long"]
    path = tmp_path / "data.jsonl"
    raw, good, bad_lines = _jsonl_with_faults(rng, kinds)
    good_with_paragraphs = good[0] + "\n\n" + good[1]  # a record is one document, blank lines and all
    alt = _doc(rng)
    raw = _jsonl([{"text": good_with_paragraphs, "alt": alt}]) + raw
    path.write_bytes(raw)
    cache = tmp_path / "cache"
    expected = _zero_stats(skipped_bad_json=1, skipped_missing_field=2, skipped_non_utf8=1, skipped_too_long=1)

    built = TokenDataset(str(path), tokenizer, SEQ, cache, seed=0, bad_data="skip", max_document_chars=LIMIT)
    assert built.data_stats == expected
    assert np.array_equal(np.asarray(built.tokens), _reference_stream(tokenizer, [good_with_paragraphs] + good))
    (stats_file,) = cache.glob("tokens-*.stats.json")
    assert json.loads(stats_file.read_text()) == expected

    with monkeypatch.context() as patch:
        patch.setattr(data, "load_documents", lambda *a, **k: pytest.fail("the tokens were not read from the cache"))
        cached = TokenDataset(str(path), tokenizer, SEQ, cache, seed=0, bad_data="skip", max_document_chars=LIMIT)
    assert cached.data_stats == expected
    assert np.array_equal(np.asarray(cached.tokens), np.asarray(built.tokens))

    # the policy and each option that changes the text are part of the key: none of these reads the cache above
    with pytest.raises(ValueError, match=re.escape(f"{path}:{bad_lines[0] + 1}:")):
        TokenDataset(str(path), tokenizer, SEQ, cache, seed=0, max_document_chars=LIMIT)
    no_limit = TokenDataset(str(path), tokenizer, SEQ, cache, seed=0, bad_data="skip")
    assert no_limit.data_stats == {**expected, "skipped_too_long": 0}
    other_field = TokenDataset(str(path), tokenizer, SEQ, cache, seed=0, bad_data="skip", text_field="alt")
    assert np.array_equal(np.asarray(other_field.tokens), _reference_stream(tokenizer, [alt]))
    # only the first record has "alt": the 9 good ones, both "missing-field" and the "too-long" one lack it
    assert other_field.data_stats == {**expected, "skipped_missing_field": 9 + 2 + 1, "skipped_too_long": 0}
    # and so are the file's bytes: a fixed line is no longer counted
    path.write_bytes(raw.replace(_JSONL_FAULTS["not-json"][0], json.dumps({"text": "fixed"}).encode()))
    fixed = TokenDataset(str(path), tokenizer, SEQ, cache, seed=0, bad_data="skip", max_document_chars=LIMIT)
    assert fixed.data_stats == {**expected, "skipped_bad_json": 0}


def test_tokenizer_policy_is_part_of_its_key(corpus, tokenizer, monkeypatch):
    """The fixture trained with skip; error on the same file and cache must read the file, and raise."""
    cache = tokenizer.model_path.parent
    with pytest.raises(ValueError, match=re.escape(f"{corpus}:")):
        get_tokenizer(str(corpus), VOCAB, cache, max_document_chars=LIMIT)
    monkeypatch.setattr(data, "_train_sentencepiece", lambda *a: pytest.fail("retrained instead of loaded"))
    again = get_tokenizer(str(corpus), VOCAB, cache, bad_data="skip", max_document_chars=LIMIT)
    assert again.model_path == tokenizer.model_path


def test_file_format_is_part_of_the_cache_key(tmp_path, tokenizer):
    """The same bytes as .jsonl (records) and as .txt (raw text) are different corpora."""
    docs = [_doc(random.Random(9)) for _ in range(3)]
    raw = _jsonl({"text": d} for d in docs)
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "a.txt").write_bytes(raw)
    records = TokenDataset(str(tmp_path / "a.jsonl"), tokenizer, SEQ, tmp_path / "cache", seed=0)
    text = TokenDataset(str(tmp_path / "a.txt"), tokenizer, SEQ, tmp_path / "cache", seed=0)
    assert np.array_equal(np.asarray(records.tokens), _reference_stream(tokenizer, docs))
    assert np.array_equal(np.asarray(text.tokens), _reference_stream(tokenizer, [raw.decode()]))


def test_the_cli_prints_a_bad_line_as_one_error_naming_the_field(tmp_path, capsys):
    """A bad record found while the run loads its data is one line naming training.data_path, the
    file and line and the fix, with exit status 2 (not a traceback); so is a vocabulary the text
    cannot fill, naming model.vocab_size."""
    import os

    from megatron_moe_hybrid.training.cli import main

    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny.yaml")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello world"}\nnot json\n')
    args = ["--config", tiny, "--training.train_steps", "1", "--training.cache_dir", str(tmp_path / "cache")]
    assert main("pretrain", args + ["--training.data_path", str(bad), "--training.output_dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: training.data_path: {bad}:2: not valid JSON") and err.count("\n") == 1, err
    small = tmp_path / "small.txt"
    small.write_text("only a few words here\n" * 20)
    assert main("pretrain", args + ["--training.data_path", str(small), "--training.output_dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.vocab_size: sentencepiece could not build 1024 pieces") and err.count("\n") == 1, err


def test_the_cli_names_a_vocab_smaller_than_the_tokenizer(tmp_path, capsys, corpus, tokenizer):
    """A tokenizer given by training.tokenizer_model with more pieces than model.vocab_size: one
    line naming model.vocab_size and the size it needs, exit status 2, not a traceback."""
    import os

    from megatron_moe_hybrid.training.cli import main

    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny.yaml")
    args = ["--config", tiny, "--training.train_steps", "1", "--training.cache_dir", str(tmp_path / "cache"),
            "--training.data_path", str(corpus), "--training.bad_data", "skip",
            "--training.tokenizer_model", str(tokenizer.model_path), "--model.vocab_size", str(VOCAB - 44),
            "--training.output_dir", str(tmp_path / "out")]
    assert main("pretrain", args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model.vocab_size: {VOCAB - 44} is smaller than the tokenizer's {VOCAB} pieces"), err
    assert f"set it to at least {VOCAB}" in err and err.count("\n") == 1, err
