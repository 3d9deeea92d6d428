"""training.packing: fit: whole documents / records per sample, the rest padded and left out of
the loss. The spans by hand and on random lengths, the samples of instruction data (each starts
at a record's start, its labels the record's trained tokens), and step 1's loss and gradient of a
text run against a plain forward of the same padded batch."""

import json
import os

import numpy as np
import pytest
import torch

from megatron_moe_hybrid.testing import spawn
from megatron_moe_hybrid.training import data
from megatron_moe_hybrid.training.data import IGNORE_INDEX, TokenDataset, fit_spans, get_tokenizer


def test_spans_by_hand():
    # records [0, 3) [3, 5) [5, 12) [12, 14) into samples of S + 1 = 5 tokens: the first two fill one,
    # the third is longer than a sample and cut as the stream cuts (pieces overlapping by one), the
    # last joins that cut's remainder
    spans, cut = fit_spans(np.array([3, 5, 12, 14]), 4)
    assert spans.tolist() == [[0, 5], [5, 10], [9, 14]] and cut == 1
    spans, cut = fit_spans(np.array([2, 4, 6]), 2)  # each sample one record of 2 tokens: S + 1 = 3
    assert spans.tolist() == [[0, 2], [2, 4], [4, 6]] and cut == 0


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
