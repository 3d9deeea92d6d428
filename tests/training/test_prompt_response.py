"""training.data_format: prompt_response: .jsonl records of a prompt and a response, packed into
samples, the loss on the response's tokens (and the end of sequence after it) only, averaged over
the global batch's trained tokens; the tokens, the labels, the loss and its gradient against plain
constructions, DP=2 against one process, and bad records named."""

import json
import os

import numpy as np
import pytest
import torch

from megatron_moe_hybrid.testing import spawn
from megatron_moe_hybrid.training import data
from megatron_moe_hybrid.training.data import IGNORE_INDEX, TokenDataset, get_tokenizer

PAIRS = dict(data_format="prompt_response")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A .jsonl of question / answer records of uneven lengths (answers the prompts do not hold)."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(600)]
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    with open(path, "w") as f:
        for i in range(300):
            prompt = "Question %d: " % i + " ".join(rng.choice(words, rng.integers(3, 30)))
            answer = " ".join(rng.choice(words, rng.integers(1, 12))) + "."
            f.write(json.dumps({"prompt": prompt, "response": answer}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def sft_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sft-cache"))


def test_labels_are_the_responses_and_their_end(records, sft_cache):
    tok = get_tokenizer(records, 512, sft_cache, **PAIRS)
    ds = TokenDataset(records, tok, 48, sft_cache, seed=0, **PAIRS)
    # the stream, built plainly: prompt, response, eos per record; trained: response and eos
    docs, _ = data.load_documents(records, **PAIRS)
    assert len(docs) == 300 and all(isinstance(d, tuple) for d in docs)
    ids, trained = [], []
    for prompt, response in docs:
        p, r = tok.encode(prompt), tok.encode(response)
        ids += p + r + [tok.eos_id]
        trained += [False] * len(p) + [True] * (len(r) + 1)
    ids, trained = np.asarray(ids), np.asarray(trained)
    assert np.array_equal(np.asarray(ds.tokens), ids) and np.array_equal(np.asarray(ds.trained, dtype=bool), trained)
    for i in range(ds.num_samples):
        tokens, labels = ds.get(i)
        start = int(ds._permutation(0)[i]) * 48
        assert torch.equal(tokens, torch.from_numpy(ids[start : start + 48]))
        want = np.where(trained[start + 1 : start + 49], ids[start + 1 : start + 49], IGNORE_INDEX)
        assert torch.equal(labels, torch.from_numpy(want)), i
    share = float(np.mean(trained))
    assert 0.1 < share < 0.6, share  # both kinds present: the test sees prompts masked and answers kept


def test_bad_records_name_the_field_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\n{"prompt": "p"}\n{"prompt": "p", "response": "  "}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: the record has no field 'response' .*training.response_field"):
        data.load_documents(str(path), **PAIRS)
    docs, stats = data.load_documents(str(path), bad_data="skip", **PAIRS)
    assert docs == [("p", "r")] and stats["skipped_missing_field"] == 2
    renamed = tmp_path / "q.jsonl"
    renamed.write_text('{"question": "p", "answer": "r"}\n')
    assert data.load_documents(str(renamed), prompt_field="question", response_field="answer", **PAIRS)[0] == [("p", "r")]
    (tmp_path / "notes.txt").write_text("plain text\n")
    with pytest.raises(ValueError, match=r"^training.data_format: prompt_response reads .jsonl records; .*notes.txt"):
        data.load_documents(str(tmp_path), **PAIRS)
    with pytest.raises(ValueError, match=r"^training.data_format: prompt_response reads .jsonl records, not 'stdlib'"):
        data.load_documents("stdlib", **PAIRS)


def test_config_checks(tmp_path, monkeypatch):
    from megatron_moe_hybrid.config import ConfigError, load_config

    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny.yaml")
    with pytest.raises(ConfigError, match="^training.data_format: prompt_response reads .jsonl records .*training.data_path"):
        load_config(tiny, {"training.data_format": "prompt_response"})
    with pytest.raises(ConfigError, match="^training.data_format: 'prompt_responses' is not one of .*did you mean"):
        load_config(tiny, {"training.data_format": "prompt_responses"})
    with pytest.raises(ConfigError, match="^training.response_field: is empty"):
        load_config(tiny, {"training.response_field": ""})


def _train(rank, world_size, raw, overrides):
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import run

    result = run(config_from_dict(raw, overrides), "pretrain")
    return {"losses": result.losses, "evals": result.eval_losses}


def _reference_first_step(rank, world_size, raw, overrides):
    """Step 1's loss and gradient, plainly: the weights a run draws from scratch, the global
    batch's samples in one forward, the sum over trained tokens over their count."""
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron
    from megatron_moe_hybrid.training.data import batch, load_tokenizer

    overrides = dict(overrides, **{"parallel.world_size": 1})
    config = config_from_dict(raw, overrides)
    t = config.training
    init_megatron(rank, world_size)
    model = build_model(config, seed=t.seed)
    tokenizer = load_tokenizer(os.path.join(t.output_dir, "tokenizer.model"))
    ds = TokenDataset(t.data_path, tokenizer, t.seq_length, t.cache_dir, t.seed, **PAIRS)
    tokens, labels = batch(ds, 0, t.global_batch_size)
    positions = torch.arange(t.seq_length).expand_as(tokens)
    loss_bs = model(tokens, positions, None, labels=labels)
    assert float(loss_bs[labels == IGNORE_INDEX].abs().max()) == 0.0  # ignored tokens add nothing
    loss = loss_bs.sum() / (labels != IGNORE_INDEX).sum()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(norm)


def test_loss_and_gradient_are_the_trained_tokens_mean_over_ranks_and_micro_batches(
    records, sft_cache, tmp_path, raw_config
):
    """One rank (2 micro-batches) and two (DP=2, one each): the logged loss and the gradient norm
    of step 1 are the plain reference's, though the micro-batches and ranks hold different
    numbers of trained tokens (a mean of their means would differ); the two runs agree after."""
    heldout = records  # the same records: the held-out loss is checked for its masking only
    common = {"training.data_format": "prompt_response", "training.data_path": records, "training.cache_dir": sft_cache,
              "training.train_steps": 3, "training.warmup_steps": 0, "training.grad_clip": 0.0,
              "training.eval_data_path": heldout, "training.eval_batches": 1}  # fmt: skip
    raw, ov = raw_config(records, sft_cache, str(tmp_path / "one"), **common)
    (one,) = spawn(_train, 1, raw, ov)
    (loss, norm) = spawn(_reference_first_step, 1, raw, ov)[0]
    with open(tmp_path / "one" / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert abs(first["loss"] - loss) <= 1e-5 * loss and abs(first["grad_norm"] - norm) <= 1e-4 * norm, (first, loss, norm)
    raw, ov = raw_config(records, sft_cache, str(tmp_path / "two"), **common, **{"parallel.world_size": 2})
    two = spawn(_train, 2, raw, ov)
    assert two[0]["losses"] == two[1]["losses"]
    for a, b in zip(one["losses"], two[0]["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * a, (one["losses"], two[0]["losses"])
    assert abs(one["evals"][-1][1] - two[0]["evals"][-1][1]) <= 1e-5 * one["evals"][-1][1]
