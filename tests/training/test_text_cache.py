"""A run's own tokenizing of .txt/.jsonl text (the token cache): block by block, a batch of
documents at a time, straight into the cache files, against the whole-file form it replaced
(every file read whole, every id held in Python lists), for each data format; a bad line near the
end leaves no cache file and no temporary behind."""

import json
import random

import numpy as np
import pytest

from megatron_moe_hybrid.training import data
from megatron_moe_hybrid.training.data import TokenDataset, get_tokenizer

_WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta", "zeta", "rho", "tau", "mu"]


def _say(rng, lo, hi):
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def _whole(data_path, tokenizer, options):
    """The token cache's arrays the whole-file way (the form until 2026-12-06): each file's
    documents read whole, every id in one list."""
    opts = data._TextOptions(**options)
    stats = data._new_stats(opts)
    docs = []
    for path in data._data_files(data_path):
        raw = path.read_bytes()
        if raw.strip():
            docs += (data._jsonl_documents if path.suffix == ".jsonl" else data._text_documents)(path, raw, opts, stats)
    ids, trained, ends = [], [], []
    if opts.data_format != "text":
        records = [data._record_pieces(doc) for doc in docs]
        encoded = iter(tokenizer.encode_batch([text for pieces, _ in records for text, _ in pieces]))
        for pieces, eos_trained in records:
            for _, piece_trained in pieces:
                piece = next(encoded)
                ids += piece
                trained += [int(piece_trained)] * len(piece)
            if ids[-1] != tokenizer.eos_id:
                ids.append(tokenizer.eos_id)
                trained.append(int(eos_trained))
            ends.append(len(ids))
    else:
        for doc_ids in tokenizer.encode_batch([doc for doc in docs if doc.strip()]):
            ids += doc_ids + [tokenizer.eos_id]
            ends.append(len(ids))
    return ids, trained or None, ends, stats


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_bytes("\n\n".join(_say(rng, 1, 30) for _ in range(60)).encode()
                                          + b"\n\xff\xfe bad line\n" + b"\n\n".join(_say(rng, 1, 9).encode() for _ in range(9)))
    (root / "text" / "b.jsonl").write_text("".join(json.dumps({"text": _say(rng, 0, 25)}) + "\n" for _ in range(70))
                                           + "not json\n")
    (root / "pr.jsonl").write_text("".join(json.dumps({"prompt": _say(rng, 0, 12), "response": _say(rng, 1, 12)}) + "\n"
                                           for _ in range(80)))
    chats = []
    for i in range(50):
        turns = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": _say(rng, 1, 10)}, {"role": "assistant", "content": _say(rng, 1, 8)}]
        chats.append(json.dumps({"messages": turns}))
    (root / "chat.jsonl").write_text("\n".join(chats) + "\n")
    tokenizer = get_tokenizer(str(root / "text"), 300, root / "tok", bad_data="skip")
    return root, tokenizer


@pytest.mark.parametrize("form", ["text", "prompt_response", "messages"])
def test_the_token_cache_made_block_by_block_equals_the_whole_file_form(corpora, tmp_path, monkeypatch, form):
    root, tokenizer = corpora
    path, options = {"text": (root / "text", dict(bad_data="skip")),
                     "prompt_response": (root / "pr.jsonl", dict(data_format="prompt_response")),
                     "messages": (root / "chat.jsonl", dict(data_format="messages"))}[form]
    ids, trained, ends, stats = _whole(str(path), tokenizer, options)
    monkeypatch.setattr(data, "BLOCK_BYTES", 61)  # many blocks, documents across them
    monkeypatch.setattr(data, "ENCODE_BATCH", 2)
    ds = TokenDataset(str(path), tokenizer, 16, tmp_path / "cache", seed=0, **options)
    np.testing.assert_array_equal(np.asarray(ds.tokens), np.asarray(ids, np.int32))
    np.testing.assert_array_equal(ds.ends, np.asarray(ends, np.int64))
    assert (ds.trained is None) == (trained is None)
    if trained is not None:
        np.testing.assert_array_equal(np.asarray(ds.trained), np.asarray(trained, np.uint8))
    assert ds.data_stats == stats
    if form == "text":
        assert stats["skipped_non_utf8"] == 1 and stats["skipped_bad_json"] == 1


def test_a_bad_line_at_the_end_leaves_no_cache_behind(corpora, tmp_path, monkeypatch):
    root, tokenizer = corpora
    monkeypatch.setattr(data, "BLOCK_BYTES", 61)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"b\.jsonl:71: not valid JSON"):
        TokenDataset(str(root / "text" / "b.jsonl"), tokenizer, 16, cache, seed=0)
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == []
