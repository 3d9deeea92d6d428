"""The no-download data pipeline: stdlib corpus, cached sentencepiece tokenizer, token dataset.

Shape legend:
  S  seq_length    N  samples in a batch (or per epoch, num_samples)
"""

import ast
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_moe_hybrid.testing import spawn
from megatron_moe_hybrid.training import data
from megatron_moe_hybrid.training.data import TokenDataset, batch, get_tokenizer, load_text, stdlib_corpus

VOCAB = 512
SEQ = 128


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    return get_tokenizer("stdlib", VOCAB, cache_dir)


@pytest.fixture(scope="module")
def small_text_file(tmp_path_factory):
    """A slice of the corpus as a .txt file: enough for a 512-piece BPE, fast to encode."""
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text(stdlib_corpus()[:300_000], encoding="utf-8")
    return path


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_bytes())) or ""


def test_stdlib_corpus_is_large_deterministic_and_imports_nothing():
    corpus = stdlib_corpus()
    assert 1_000_000 < len(corpus.encode()) <= 8_000_000
    # a fresh, uncached parse with a small cap must be exactly a prefix of the full corpus
    head = stdlib_corpus.__wrapped__(max_bytes=150_000)
    assert 100_000 < len(head.encode()) <= 150_000
    assert corpus.startswith(head)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert _docstring(stdlib / "json" / "__init__.py") in corpus
    for skipped in ("idlelib", "turtledemo"):
        doc = _docstring(stdlib / skipped / "__init__.py") if (stdlib / skipped / "__init__.py").exists() else ""
        assert not doc or doc not in corpus, skipped
    assert "antigravity" not in sys.modules  # parsed, never imported (importing it opens a browser)


def test_stdlib_corpus_rejects_nonpositive_max_bytes():
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(0)


def test_load_text_file_and_sorted_directory(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "skip.md").write_text("not text data", encoding="utf-8")
    (tmp_path / "c.jsonl").write_text('{"text": "third"}\n{"text": "fourth", "id": 4}\n', encoding="utf-8")
    assert load_text(str(tmp_path / "b.txt")) == "second"
    assert load_text(str(tmp_path / "c.jsonl")) == "third\n\nfourth"
    assert load_text(str(tmp_path)) == "first\n\nsecond\n\nthird\n\nfourth"


@pytest.mark.parametrize("kind", ["missing", "empty-dir"])
def test_load_text_bad_path_names_the_field(tmp_path, kind):
    path = tmp_path / "nope" if kind == "missing" else tmp_path
    with pytest.raises(ValueError, match="training.data_path"):
        load_text(str(path))


@pytest.mark.parametrize(
    "text",
    [
        "Return the sum of *a* and *b*.\n\n    >>> add(1, 2)\n    3\n",
        "  leading spaces,\ttabs,  double  spaces and trailing ",
        "unicode: naïve café ∑ λx. x 😀 — 你好\r\n",
        "",
    ],
    ids=["docstring", "whitespace", "unicode", "empty"],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_corpus_slice_and_has_specials(tokenizer):
    text = stdlib_corpus()[100_000:120_000]
    ids = tokenizer.encode(text)
    assert len(ids) < 0.75 * len(text.encode()), "a BPE of this text should compress it"
    assert tokenizer.decode(ids) == text
    assert tokenizer.vocab_size == VOCAB
    assert len({tokenizer.eos_id, tokenizer.pad_id}) == 2
    assert all(0 <= i < VOCAB for i in (tokenizer.eos_id, tokenizer.pad_id))


def test_second_call_loads_from_cache(tokenizer, cache_dir, monkeypatch):
    mtime = tokenizer.model_path.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was retrained instead of loaded from the cache")

    monkeypatch.setattr(data, "_train_sentencepiece", no_training)
    with monkeypatch.context() as patch:
        patch.setattr(data, "stdlib_corpus", lambda *a: pytest.fail("a warm cache must not parse the stdlib"))
        again = get_tokenizer("stdlib", VOCAB, cache_dir)
    assert again.model_path == tokenizer.model_path
    assert again.sha256 == tokenizer.sha256
    assert tokenizer.model_path.stat().st_mtime_ns == mtime
    with pytest.raises(AssertionError, match="retrained"):
        get_tokenizer("stdlib", VOCAB + 128, cache_dir)  # another vocab size is another cache entry


def test_tokenizer_bad_vocab_sizes_name_the_field(tmp_path, small_text_file):
    with pytest.raises(ValueError, match="^model.vocab_size: "):
        get_tokenizer("stdlib", 100, tmp_path)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("only a few words here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="^model.vocab_size: "):
        get_tokenizer(str(tiny), 4096, tmp_path)


def _build_concurrently(rank, world_size, data_path, cache_dir):
    dist.barrier()  # both ranks reach the cache at the same moment, as torchrun ranks do
    tok = get_tokenizer(data_path, VOCAB, cache_dir)
    dataset = TokenDataset(data_path, tok, SEQ, cache_dir, seed=3)
    tokens, labels = batch(dataset, 5, 4)
    # numpy, not tensors: torch's queue shares tensor memory, which dies with the child
    return tok.sha256, tok.encode("def f(x):\n    return x"), tokens.numpy(), labels.numpy()


@pytest.mark.distributed
def test_two_processes_build_the_same_cache(tmp_path, small_text_file):
    results = spawn(_build_concurrently, 2, str(small_text_file), str(tmp_path))
    (sha0, ids0, tokens0, labels0), (sha1, ids1, tokens1, labels1) = results
    assert sha0 == sha1 and ids0 == ids1
    assert tokens0.shape == (4, SEQ)
    assert np.array_equal(tokens0, tokens1) and np.array_equal(labels0, labels1)
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    # one tokenizer, one token array, the documents' ends and the skip counts beside it (no temporary files left)
    assert len(names) == 4 and names[0].startswith("spm-"), names
    key = names[2].removesuffix(".npy")
    assert key.startswith("tokens-") and names[1:] == [f"{key}.ends.npy", f"{key}.npy", f"{key}.stats.json"], names
    # and the parent, loading what the children cached, agrees
    assert get_tokenizer(str(small_text_file), VOCAB, tmp_path).sha256 == sha0


@pytest.fixture(scope="module")
def dataset(tokenizer, cache_dir):
    return TokenDataset("stdlib", tokenizer, SEQ, cache_dir, seed=1234)


def _stream_windows(dataset):
    """Every sample of one epoch, cut from the raw token stream: (tokens [N, S], labels [N, S])."""
    stream = np.asarray(dataset.tokens, dtype=np.int64)
    n, s = dataset.num_samples, dataset.seq_length
    return stream[: n * s].reshape(n, s), stream[1 : n * s + 1].reshape(n, s)


@pytest.fixture(params=["table", "keyed"])
def order_form(request, monkeypatch):
    """An epoch's order as numpy's permutation table, or (SHUFFLE_TABLE_MAX lowered below the
    corpus) keyed_shuffle, which must never build the table."""
    if request.param == "keyed":
        monkeypatch.setattr(data, "SHUFFLE_TABLE_MAX", 1)
        monkeypatch.setattr(TokenDataset, "_permutation", lambda *a: pytest.fail("keyed_shuffle builds no table"))
    return request.param


def test_keyed_shuffle_is_a_permutation_drawn_from_seed_and_epoch():
    for n in list(range(1, 70)) + [255, 256, 257, 1000, 4099]:
        order = [data.keyed_shuffle(i, n, 3, 0) for i in range(n)]
        assert sorted(order) == list(range(n)), n
    first = [data.keyed_shuffle(i, 1000, 3, 0) for i in range(1000)]
    assert sum(a == i for i, a in enumerate(first)) < 10, "shuffled"
    assert sum(a == b for a, b in zip(first, [data.keyed_shuffle(i, 1000, 3, 1) for i in range(1000)])) < 10
    assert sum(a == b for a, b in zip(first, [data.keyed_shuffle(i, 1000, 4, 0) for i in range(1000)])) < 10
    assert abs(np.corrcoef(np.arange(1000), first)[0, 1]) < 0.1
    assert data.keyed_shuffle(10**12 - 1, 10**12, 3, 0) < 10**12  # a 15T-token corpus's positions, no table
    with pytest.raises(ValueError, match=r"position must be in \[0, 10\)"):
        data.keyed_shuffle(10, 10, 3, 0)


def test_dataset_epoch_is_a_permutation_of_shifted_windows(dataset, tokenizer, order_form):
    n = dataset.num_samples
    assert n > 1000
    assert len(dataset.tokens) > n * SEQ
    assert int(np.max(dataset.tokens)) < tokenizer.vocab_size
    assert int(np.sum(np.asarray(dataset.tokens) == tokenizer.eos_id)) > 1000, "documents end with eos"
    windows, shifted = _stream_windows(dataset)
    row_of = {row.tobytes(): j for j, row in enumerate(windows)}
    assert len(row_of) == n, "windows must be distinct for this check"
    for epoch in (0, 1, 2):
        tokens, labels = batch(dataset, epoch * n, n)  # [N, S] each
        assert tokens.shape == labels.shape == (n, SEQ)
        assert tokens.dtype == labels.dtype == torch.int64
        order = [row_of[row.tobytes()] for row in tokens.numpy()]
        assert sorted(order) == list(range(n)), f"epoch {epoch} is not a permutation"
        assert np.array_equal(labels.numpy(), shifted[order])
        torch.testing.assert_close(labels[:, :-1], tokens[:, 1:], rtol=0, atol=0)
        if epoch == 0:
            first_order = order
            assert order != list(range(n)), "samples must be shuffled"
        else:
            assert order != first_order, "each epoch needs its own permutation"


def test_dataset_is_deterministic_and_stateless(dataset, tokenizer, cache_dir, monkeypatch, order_form):
    monkeypatch.setattr(tokenizer, "encode_batch", lambda texts: pytest.fail("tokens were not loaded from the cache"))
    monkeypatch.setattr(data, "stdlib_corpus", lambda *a: pytest.fail("a warm cache must not parse the stdlib"))
    fresh = TokenDataset("stdlib", tokenizer, SEQ, cache_dir, seed=1234)
    other_seed = TokenDataset("stdlib", tokenizer, SEQ, cache_dir, seed=1235)
    start = 2 * dataset.num_samples + 17  # inside epoch 2
    tokens, labels = batch(dataset, start, 9)
    # read in a different order first: any index must be answerable without history
    fresh.get(5)
    fresh_tokens, fresh_labels = batch(fresh, start, 9)
    assert torch.equal(tokens, fresh_tokens) and torch.equal(labels, fresh_labels)
    assert not torch.equal(tokens, batch(other_seed, start, 9)[0])
    for k in range(9):
        sample_tokens, sample_labels = dataset.get(start + k)
        assert torch.equal(sample_tokens, tokens[k]) and torch.equal(sample_labels, labels[k])


def test_dataset_bad_arguments_name_the_field(tokenizer, cache_dir, tmp_path, dataset):
    short = tmp_path / "short.txt"
    short.write_text("a short text of a few tokens", encoding="utf-8")
    with pytest.raises(ValueError, match="training.seq_length"):
        TokenDataset(str(short), tokenizer, 1000, cache_dir, seed=0)
    with pytest.raises(ValueError, match="training.seq_length"):
        TokenDataset(str(short), tokenizer, 0, cache_dir, seed=0)
    with pytest.raises(ValueError, match="sample_index"):
        dataset.get(-1)
    with pytest.raises(ValueError, match="num_samples"):
        batch(dataset, 0, 0)


def make_hf_tokenizer(path, vocab_size=300, eos="<|endoftext|>", text=None):
    """A byte-level BPE tokenizer.json (the `tokenizers` format of released models)."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text or stdlib_corpus()[:50_000]], trainer)
    tok.save(str(path))
    return str(path)


def test_hf_tokenizer_json_round_trips_and_ends_documents_with_its_eos(tmp_path):
    """training.tokenizer_model may be a released model's tokenizer.json: text round-trips, no
    special token is added, and documents end with its end-of-text token (tokenizer_config.json's
    eos_token where it names one, else a known end-of-text token of the vocabulary)."""
    path = make_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = data.load_tokenizer(path)
    assert isinstance(tok, data.HFTokenizer) and tok.eos_token == "<|endoftext|>"
    text = "Return the sum of two numbers.\n\tNo tabs lost: ünïcode too."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.eos_id not in ids
    assert tok.encode_batch([text, "x"]) == [ids, tok.encode("x")]
    assert max(ids) < tok.vocab_size
    # tokenizer_config.json's eos_token wins
    (tmp_path / "b").mkdir()
    other = make_hf_tokenizer(tmp_path / "b" / "tokenizer.json", eos="</s>")
    (tmp_path / "b" / "tokenizer_config.json").write_text('{"eos_token": {"content": "</s>"}}')
    assert data.load_tokenizer(other).eos_token == "</s>"
    assert set(data.tokenizer_files(data.load_tokenizer(other))) == {"tokenizer.json", "tokenizer_config.json"}
    # none found: the error names the field and the fix
    (tmp_path / "c").mkdir()
    bare = make_hf_tokenizer(tmp_path / "c" / "tokenizer.json", eos="<sep>")
    with pytest.raises(ValueError, match="^training.tokenizer_model: .* has no end-of-text token .* tokenizer_config.json"):
        data.load_tokenizer(bare)


def test_dataset_over_an_hf_tokenizer(tmp_path, small_text_file, cache_dir):
    tok = data.load_tokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json"))
    ds = TokenDataset(str(small_text_file), tok, 32, cache_dir, seed=0)
    tokens, labels = ds.get(0)
    assert tokens.shape == labels.shape == (32,) and int(tokens.max()) < tok.vocab_size
    stream = np.asarray(ds.tokens)
    documents = [d for d in load_text(str(small_text_file)).split("\n\n") if d.strip()]
    assert int((stream == tok.eos_id).sum()) == len(documents)  # each document ends with the eos token
    assert tok.decode(stream[: int(np.argmax(stream == tok.eos_id))].tolist()) == documents[0]


def test_cached_files_get_the_mode_open_gives(tmp_path):
    """A cache file (tokenizer, token ids) appears whole and readable as a plain open() would make
    it, not the owner-only mode of its temporary file: a cache_dir shared between users or
    accounts stays readable."""
    import os

    data._atomic_write(tmp_path / "ids.npy", lambda f: f.write(b"abc"))
    umask = os.umask(0)
    os.umask(umask)
    assert os.listdir(tmp_path) == ["ids.npy"] and (tmp_path / "ids.npy").read_bytes() == b"abc"
    assert os.stat(tmp_path / "ids.npy").st_mode & 0o777 == 0o666 & ~umask
