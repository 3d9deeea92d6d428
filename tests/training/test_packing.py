"""training.packing: fit / best_fit: whole documents / records per sample, the rest padded and left
out of the loss. The spans by hand and on random lengths, best fit against a brute-force best fit,
the samples of instruction data (each starts at a record's start, its labels the record's trained
tokens), and step 1's loss and gradient of a text run against a plain forward of the same padded
batch."""

import collections
import json
import os

import numpy as np
import pytest
import torch

from megatron_moe_hybrid.testing import spawn
from megatron_moe_hybrid.training import data
from megatron_moe_hybrid.training.data import IGNORE_INDEX, TokenDataset, best_fit_pieces, fit_spans, get_tokenizer


def test_spans_by_hand():
    # records [0, 3) [3, 5) [5, 12) [12, 14) into samples of S + 1 = 5 tokens: the first two fill one,
    # the third is longer than a sample and cut as the stream cuts (pieces overlapping by one), the
    # last joins that cut's remainder
    spans, cut = fit_spans(np.array([3, 5, 12, 14]), 4)
    assert spans.tolist() == [[0, 5], [5, 10], [9, 14]] and cut == 1
    spans, cut = fit_spans(np.array([2, 4, 6]), 2)  # each sample one record of 2 tokens: S + 1 = 3
    assert spans.tolist() == [[0, 2], [2, 4], [4, 6]] and cut == 0


def test_spans_made_a_slice_at_a_time_equal_the_whole(monkeypatch):
    """fit_spans turns the ends into Python ints a slice at a time: any slice size gives the
    spans made in one piece (the open sample carries over)."""
    from megatron_moe_hybrid.training import data

    rng = np.random.default_rng(0)
    for s in (4, 9, 31):
        ends = np.cumsum(rng.integers(1, 3 * s, size=300))
        whole = fit_spans(ends, s)
        for size in (1, 2, 3, 7, 299):
            monkeypatch.setattr(data, "_FIT_SLICE", size)
            spans, cut = fit_spans(ends, s)
            assert spans.dtype == np.int64 and spans.tolist() == whole[0].tolist() and cut == whole[1], (s, size)


@pytest.mark.parametrize("seed", range(5))
def test_spans_keep_every_record_that_fits_whole(seed):
    rng = np.random.default_rng(seed)
    s = int(rng.integers(4, 40))
    lengths = rng.integers(1, 2 * s, size=200)
    ends = np.cumsum(lengths)
    starts = np.concatenate([[0], ends[:-1]])
    spans, cut = fit_spans(ends, s)
    assert cut == int((lengths > s + 1).sum())
    assert (spans[:, 1] - spans[:, 0] <= s + 1).all() and (spans[:, 1] - spans[:, 0] >= 2).all()
    assert spans[0, 0] == 0 and spans[-1, 1] == ends[-1] and (spans[1:, 0] >= spans[:-1, 1] - 1).all()
    long = [(a, b) for a, b in zip(starts, ends) if b - a > s + 1]
    for a, b in zip(starts, ends):
        holding = [(x, y) for x, y in spans.tolist() if x <= a and b <= y]
        if b - a <= s + 1:
            assert len(holding) == 1, (a, b)  # whole, in one sample
            # and that sample ends at a record's end and starts at a record's start, or at the
            # remainder of a record cut for being longer than a sample
            x, y = holding[0]
            assert y in set(ends.tolist()), (x, y)
            assert x in set(starts.tolist()) or any(p < x < q for p, q in long), (x, y)


def test_best_fit_by_hand():
    # records [0, 3) [3, 5) [5, 12) [12, 14), samples of S + 1 = 5 tokens: the third is cut as the
    # stream cuts ([5, 10), a sample of its own), its remainder [9, 12) placed like a record; longest
    # first: [0, 3) opens a sample, [9, 12) does not fit beside it and opens a second, [3, 5) goes to
    # the first (both have room 2: the one that had it first), [12, 14) to the second
    pieces, offsets, cut = best_fit_pieces(np.array([3, 5, 12, 14]), 4)
    assert pieces.tolist() == [[5, 10], [0, 3], [3, 5], [9, 12], [12, 14]] and offsets.tolist() == [0, 1, 3, 5]
    assert cut == 1
    # where next fit leaves room behind, best fit fills it: lengths 3, 3, 2, 2 at S + 1 = 5
    ends = np.cumsum([3, 3, 2, 2])
    assert fit_spans(ends, 4)[0].tolist() == [[0, 3], [3, 8], [8, 10]]
    pieces, offsets, _ = best_fit_pieces(ends, 4)
    assert pieces.tolist() == [[0, 3], [6, 8], [3, 6], [8, 10]] and offsets.tolist() == [0, 2, 4]
    # a one-token record holds no label: placed nowhere, as next fit drops one left alone
    pieces, offsets, _ = best_fit_pieces(np.array([1, 4]), 4)
    assert pieces.tolist() == [[1, 4]] and offsets.tolist() == [0, 1]


def _brute_best_fit(items, cap):
    """Best fit decreasing by scanning every sample for the least room that holds the piece (of
    equal rooms, the sample that got its room first): a list of samples, each a list of pieces."""
    samples, room, since = [], [], []
    for t, (a, b) in enumerate(sorted(items, key=lambda p: (p[0] - p[1], p[0]))):
        fits = [i for i in range(len(samples)) if room[i] >= b - a]
        if fits:
            i = min(fits, key=lambda i: (room[i], since[i]))
            samples[i].append((a, b))
            room[i] -= b - a
            since[i] = t
        else:
            samples.append([(a, b)])
            room.append(cap - (b - a))
            since.append(t)
    return samples


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_equals_a_brute_force_best_fit_and_keeps_every_record_whole(seed):
    rng = np.random.default_rng(seed)
    s = int(rng.integers(4, 60))
    lengths = rng.integers(1, (s + 2) if seed % 2 else 2 * s, size=int(rng.integers(1, 300)))
    ends = np.cumsum(lengths)
    starts = np.concatenate([[0], ends[:-1]])
    pieces, offsets, cut = best_fit_pieces(ends, s)
    assert cut == int((lengths > s + 1).sum())
    samples = [[tuple(p) for p in pieces[offsets[i] : offsets[i + 1]].tolist()] for i in range(len(offsets) - 1)]
    assert all(sum(b - a for a, b in sample) <= s + 1 for sample in samples)
    # a record longer than a sample: its stream cuts (S + 1 tokens overlapping by one, a sample
    # each, first) and its remainder; every record or remainder of two tokens or more is placed
    # whole, once, as a brute-force best fit places it
    full, items = [], []
    for a, b in zip(starts.tolist(), ends.tolist()):
        while b - a > s + 1:
            full.append([(a, a + s + 1)])
            a += s
        if b - a > 1:
            items.append((a, b))
    assert samples[: len(full)] == full
    assert samples[len(full) :] == _brute_best_fit(items, s + 1)
    if seed % 2:  # nothing cut: never more samples than next fit in stream order here
        assert len(samples) <= len(fit_spans(ends, s)[0])


# best_fit_pieces as it was until 2026-12-06: one piece at a time, the least room that holds it
# found by a Fenwick tree over rooms (about 12 s per million documents)
def _one_at_a_time(ends: np.ndarray, seq_length: int) -> tuple[np.ndarray, np.ndarray, int]:
    """training.packing "best_fit": ([P, 2] int64 (start, end) pieces of the token stream,
    [samples + 1] int64 offsets: sample i is pieces[offsets[i] : offsets[i + 1]] one after
    another, at most S + 1 tokens; and how many documents were longer than a sample).

    Each document is one piece, placed longest first into the sample with the least room that
    still holds it, a new sample where none does (best fit decreasing; of samples with equal room
    the one that had it first, so the result is deterministic). A document longer than a sample is cut as the stream cuts it (S + 1-token
    pieces overlapping by one, each a sample of its own) and its remainder placed like a
    document. ends: where each document ends (exclusive), ascending."""
    cap = seq_length + 1
    items: list[tuple[int, int]] = []  # documents and remainders to place
    full: list[tuple[int, int]] = []  # the cut pieces, a sample each
    cut = 0
    prev = 0
    for end in ends.tolist():
        start = prev
        if end - start > cap:
            cut += 1
            while end - start > cap:
                full.append((start, start + cap))
                start += seq_length
        if end - start > 1:  # a one-token record, or a cut's one-token rest, holds no label
            items.append((start, end))
        prev = end
    order = sorted(range(len(items)), key=lambda i: (-(items[i][1] - items[i][0]), i))
    # samples with r tokens of room: a Fenwick tree over r counts them, free[r] lists them
    tree = [0] * (cap + 1)
    free: dict[int, collections.deque] = {}  # first come, first filled
    bins: list[list[int]] = []
    total = 0  # samples with room left
    top = 1 << cap.bit_length()

    def add(r: int, delta: int) -> None:
        while r <= cap:
            tree[r] += delta
            r += r & -r

    def below(r: int) -> int:  # samples with room < r
        n, r = 0, r - 1
        while r > 0:
            n += tree[r]
            r -= r & -r
        return n

    for i in order:
        length = items[i][1] - items[i][0]
        k = below(length) + 1  # the k-th least room is the least that is >= length
        if k > total:  # none holds it: a new sample
            bins.append([i])
            b, left = len(bins) - 1, cap - length
        else:
            r, step = 0, top  # the least room r with k samples of room <= r (Fenwick descent)
            while step:
                if r + step <= cap and tree[r + step] < k:
                    r += step
                    k -= tree[r]
                step >>= 1
            r += 1
            b = free[r].popleft()
            add(r, -1)
            total -= 1
            bins[b].append(i)
            left = r - length
        if left > 0:
            add(left, 1)
            free.setdefault(left, collections.deque()).append(b)
            total += 1
    pieces = full + [items[i] for b in bins for i in b]
    sizes = [1] * len(full) + [len(b) for b in bins]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return np.asarray(pieces, dtype=np.int64).reshape(-1, 2), offsets, cut


@pytest.mark.parametrize("seed", range(4))
def test_best_fit_equals_placing_one_piece_at_a_time(seed):
    """The grouped placement (pieces of one length together) against the one-at-a-time form on
    corpora too large for the brute force: many ties of length and of room, documents longer
    than a sample, one-token records."""
    rng = np.random.default_rng(100 + seed)
    s = [7, 64, 512, 4096][seed]
    lengths = np.concatenate([rng.integers(1, 3 * s, 3000), rng.integers(1, 12, 6000), rng.choice([2, s // 2 + 1, s + 1], 1000),
                              np.maximum(1, rng.lognormal(np.log(s) - 2, 1.2, 10000).astype(np.int64))])
    ends = np.cumsum(rng.permutation(lengths))
    got, want = best_fit_pieces(ends, s), _one_at_a_time(ends, s)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist() and got[2] == want[2]
    assert best_fit_pieces(np.zeros(0, np.int64), s)[0].shape == (0, 2)


def test_fit_samples_start_at_a_record_and_train_its_response(records, sft_cache):
    options = dict(data_format="prompt_response")
    tok = get_tokenizer(records, 512, sft_cache, **options)
    stream = TokenDataset(records, tok, 256, sft_cache, seed=0, **options)
    ds = TokenDataset(records, tok, 256, sft_cache, seed=0, packing="fit", **options)
    assert ds.masked_labels and ds.num_samples > stream.num_samples  # padding takes room
    ids, trained = np.asarray(ds.tokens), np.asarray(ds.trained, dtype=bool)
    ends = np.flatnonzero(ids == tok.eos_id) + 1  # prompt_response: each record ends with the one eos
    starts = set(np.concatenate([[0], ends[:-1]]).tolist())
    seen = padded = 0
    for i in range(ds.num_samples):
        tokens, labels = ds.get(i)
        a, b = (int(x) for x in ds.spans[int(ds._permutation(0)[i])])
        assert a in starts and tokens.shape == labels.shape == (256,)
        n = b - a - 1
        assert torch.equal(tokens[:n], torch.from_numpy(ids[a : b - 1].copy()))
        assert (tokens[n:] == tok.eos_id).all() and (labels[n:] == IGNORE_INDEX).all()
        want = np.where(trained[a + 1 : b], ids[a + 1 : b], IGNORE_INDEX)
        assert torch.equal(labels[:n], torch.from_numpy(want))
        seen += int(trained[a + 1 : b].sum())
        padded += tokens.numel() - n
    assert seen == int(trained[1:].sum())  # every trained token is a label exactly once (no record cut here)
    assert ds.cut_records == 0
    # the run's start line reports the padding the samples hold
    from megatron_moe_hybrid.training.trainer import _data_summary

    padding = padded / (ds.num_samples * 256)
    assert 0.05 < padding < 0.95
    assert _data_summary("data", records, ds, "prompt_response").endswith(
        f"packed whole (training.packing: fit), {padding:.1%} of positions padding, 0 longer than a sample cut")


def test_best_fit_samples_are_whole_records_with_less_padding(records, sft_cache):
    """best_fit on instruction data: a sample is its pieces one after another, each a whole
    record; its labels are their trained tokens (every trained token a label once), isolate_records
    starts a sequence at each piece, and fewer positions are padding than under next fit."""
    from megatron_moe_hybrid.training.trainer import _data_summary

    options = dict(data_format="prompt_response")
    tok = get_tokenizer(records, 512, sft_cache, **options)
    fit = TokenDataset(records, tok, 256, sft_cache, seed=0, packing="fit", **options)
    ds = TokenDataset(records, tok, 256, sft_cache, seed=0, packing="best_fit", **options)
    assert ds.masked_labels and ds.cut_records == 0 and ds.num_samples < fit.num_samples
    ids, trained = np.asarray(ds.tokens), np.asarray(ds.trained, dtype=bool)
    ends = np.flatnonzero(ids == tok.eos_id) + 1  # prompt_response: each record ends with the one eos
    records_at = {int(a): int(b) for a, b in zip(np.concatenate([[0], ends[:-1]]), ends)}
    labelled = np.zeros(len(ids), dtype=np.int64)
    padded = 0
    for i in range(ds.num_samples):
        tokens, labels = ds.get(i)
        pieces = ds._pieces(i)
        assert all(records_at.get(a) == b for a, b in pieces)  # whole records
        window = np.concatenate([ids[a:b] for a, b in pieces])
        mask = np.concatenate([trained[a:b] for a, b in pieces])
        n = len(window) - 1
        assert tokens.shape == labels.shape == (256,) and torch.equal(tokens[:n], torch.from_numpy(window[:-1].astype(np.int64)))
        assert torch.equal(labels[:n], torch.from_numpy(np.where(mask[1:], window[1:], IGNORE_INDEX)))
        assert (tokens[n:] == tok.eos_id).all() and (labels[n:] == IGNORE_INDEX).all()
        position = np.concatenate([np.arange(a, b) for a, b in pieces])[1:]
        np.add.at(labelled, position[mask[1:]], 1)
        assert ds.record_starts(i) == np.cumsum([b - a for a, b in pieces])[:-1].tolist()
        padded += tokens.numel() - n
    assert (labelled[trained] == 1).all() and (labelled[~trained] == 0).all()
    fit_padding = 1 - int((fit.spans[:, 1] - fit.spans[:, 0] - 1).sum()) / (fit.num_samples * 256)
    padding = padded / (ds.num_samples * 256)
    assert padding < fit_padding
    assert _data_summary("data", records, ds, "prompt_response").endswith(
        f"packed whole (training.packing: best_fit), {padding:.1%} of positions padding, 0 longer than a sample cut")


@pytest.mark.parametrize("packing", ["fit", "best_fit"])
def test_packing_is_computed_once_per_cache_and_length(records, sft_cache, monkeypatch, packing):
    """The fit / best-fit samples are kept beside the cached tokens, memory-mapped: a second dataset
    over the same data and sample length reads them back (the packing not computed), another
    length computes its own."""
    options = dict(data_format="prompt_response")
    tok = get_tokenizer(records, 512, sft_cache, **options)
    first = TokenDataset(records, tok, 200, sft_cache, seed=0, packing=packing, **options)
    calls = []
    name = {"fit": "fit_spans", "best_fit": "best_fit_pieces"}[packing]
    real = getattr(data, name)
    monkeypatch.setattr(data, name, lambda ends, s: calls.append(s) or real(ends, s))
    again = TokenDataset(records, tok, 200, sft_cache, seed=0, packing=packing, **options)
    assert calls == [] and np.array_equal(again.spans, first.spans)
    assert np.array_equal(again.sample_pieces, first.sample_pieces) and again.cut_records == first.cut_records
    assert isinstance(again.spans, np.memmap) and isinstance(again.sample_pieces, np.memmap)  # one copy a host
    TokenDataset(records, tok, 160, sft_cache, seed=0, packing=packing, **options)
    assert calls == [160]


def _train(rank, world_size, raw, overrides):
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import run

    return run(config_from_dict(raw, overrides), "pretrain").losses


def _reference_first_step(rank, world_size, raw, overrides):
    """Step 1 plainly: the global batch's padded samples in one forward, the loss summed over the
    labels that are not padding over their count."""
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron
    from megatron_moe_hybrid.training.data import batch, load_tokenizer

    config = config_from_dict(raw, dict(overrides, **{"parallel.world_size": 1}))
    t = config.training
    init_megatron(rank, world_size)
    model = build_model(config, seed=t.seed)
    tokenizer = load_tokenizer(os.path.join(t.output_dir, "tokenizer.model"))
    ds = TokenDataset(t.data_path, tokenizer, t.seq_length, t.cache_dir, t.seed, packing="fit")
    tokens, labels = batch(ds, 0, t.global_batch_size)
    assert (labels == IGNORE_INDEX).any()  # the batch has padding
    loss = model(tokens, torch.arange(t.seq_length).expand_as(tokens), None, labels=labels)
    loss = loss.sum() / (labels != IGNORE_INDEX).sum()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(norm)


def test_a_fit_packed_text_run_averages_over_the_unpadded_labels(tmp_path, raw_config):
    """Text documents packed whole: step 1's logged loss and gradient norm equal the plain
    reference's mean over the labels that are not padding (a mean over every position would
    count the padding)."""
    text = tmp_path / "docs.txt"
    rng = np.random.default_rng(1)
    words = ["".join(rng.choice(list("klmnopqrst"), rng.integers(2, 8))) for _ in range(200)]
    text.write_text("\n\n".join(" ".join(rng.choice(words, rng.integers(3, 18))) for _ in range(400)))
    common = {"training.packing": "fit", "training.train_steps": 2, "training.warmup_steps": 0, "training.grad_clip": 0.0,
              "training.micro_batch_size": 2, "training.global_batch_size": 4}  # fmt: skip
    raw, ov = raw_config(str(text), str(tmp_path / "cache"), str(tmp_path / "run"), **common)
    losses = spawn(_train, 1, raw, ov)[0]
    (loss, norm) = spawn(_reference_first_step, 1, raw, ov)[0]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert abs(first["loss"] - loss) <= 1e-5 * loss and abs(first["grad_norm"] - norm) <= 1e-4 * norm, (first, loss, norm)
    assert len(losses) == 2


def test_config_names_a_bad_packing(monkeypatch):
    from megatron_moe_hybrid.config import ConfigError, load_config

    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny.yaml")
    with pytest.raises(ConfigError, match="^training.packing: 'fits' is not one of stream, fit.*did you mean"):
        load_config(tiny, {"training.packing": "fits"})
