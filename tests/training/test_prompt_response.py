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
    kwargs = {}
    if t.isolate_records:  # the whole batch as one packed row: the same records as per micro-batch
        from megatron.core.packed_seq_params import PackedSeqParams

        tokens, cu = data.pack_records(tokens, data.batch_record_starts(ds, 0, t.global_batch_size))
        labels, positions = labels.reshape(1, -1), torch.arange(tokens.shape[1])[None]
        kwargs["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    loss_bs = model(tokens, positions, None, labels=labels, **kwargs)
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


def test_pack_records_starts_a_sequence_at_every_sample_and_record():
    tokens = torch.tensor([[5, 6, 2, 7, 8, 2], [9, 2, 2, 4, 4, 4], [3, 2, 2, 2, 2, 2]])
    flat, cu = data.pack_records(tokens, [[3], [3], []])
    assert torch.equal(flat, tokens.reshape(1, 18))
    # the sample ends (6, 12) once; an eos inside a record (at 7) starts nothing
    assert cu.tolist() == [0, 3, 6, 9, 12, 18] and cu.dtype == torch.int32
    with pytest.raises(ValueError, match="^record_starts: one list per sample, got 2 for 3"):
        data.pack_records(tokens, [[3], []])


def test_record_starts_come_from_the_stored_record_ends_not_from_eos(tmp_path):
    """A prompt that spells out the end-of-sequence text (a literal eos token inside a record) does
    not start a record there: the dataset's record starts are where records were written."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    eos = "<|endoftext|>"
    hf = HF(models.BPE(unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["quick brown fox " * 50], trainers.BpeTrainer(
        vocab_size=300, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = data.load_tokenizer(tmp_path / "tokenizer.json")
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"quick {eos} brown {i}", "response": "fox"}) + "\n" for i in range(40)))
    ds = TokenDataset(str(path), tok, 16, str(tmp_path / "c"), seed=0, **PAIRS)
    ids = np.asarray(ds.tokens)
    assert (ids == tok.eos_id).sum() == 80  # one in each prompt, one closing each record
    record_ends = set(ds.ends.tolist())
    for i in range(ds.num_samples):
        start = int(ds._permutation(0)[i]) * 16
        starts = ds.record_starts(i)
        assert starts == [e - start for e in sorted(record_ends) if start < e < start + 16]
        eos_inside = [p for p in range(1, 16) if ids[start + p - 1] == tok.eos_id and start + p not in record_ends]
        assert not set(eos_inside) & set(starts)


@pytest.mark.parametrize("pattern", ["LLLS", "LLLA", "LLLM"])
def test_a_packed_micro_batch_equals_each_record_alone(pattern):
    """isolate_records' packing: each token's loss in the packed row equals the loss of its record
    run alone (linear attention's state, the short conv, sparse top-k, full attention and RoPE
    positions all restart per record); without the packing they differ (attention crosses)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron, teardown
    import yaml

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    config = config_from_dict(raw, {"parallel.world_size": 1, "model.pattern": pattern, "sparse_attention.topk": 8})
    init_megatron()
    try:
        torch.manual_seed(0)
        model = build_model(config).double().eval()
        eos, s = 2, 40
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(4, config.vocab_size, (2, s), generator=g)
        tokens[0, [9, 25]] = eos
        tokens[1, [30]] = eos
        labels = torch.randint(4, config.vocab_size, (2, s), generator=g)
        flat, cu = data.pack_records(tokens, [[10, 26], [31]])  # after each eos
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=int((cu[1:] - cu[:-1]).max()), max_seqlen_kv=int((cu[1:] - cu[:-1]).max()))
        with torch.no_grad():
            got = model(flat, torch.arange(2 * s)[None], None, labels=labels.reshape(1, -1), packed_seq_params=packed)[0]
            pieces = []
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                alone = model(flat[:, a:b], torch.arange(b - a)[None], None, labels=labels.reshape(1, -1)[:, a:b])
                pieces.append(alone[0])
            want = torch.cat(pieces)
            crossing = model(tokens, torch.arange(s).expand(2, s), None, labels=labels).reshape(-1)
        assert len(pieces) == 5
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        assert (crossing - want).abs().max() > 1e-3  # the unpacked batch lets records see each other
    finally:
        teardown()


def test_an_isolated_training_step_is_the_packed_reference(records, sft_cache, tmp_path, raw_config):
    """training.isolate_records: step 1's logged loss and gradient norm equal the plain
    reference over the batch packed per record; the gradient differs from the unpacked run's."""
    common = {"training.data_format": "prompt_response", "training.data_path": records, "training.cache_dir": sft_cache,
              "training.train_steps": 1, "training.warmup_steps": 0, "training.grad_clip": 0.0}  # fmt: skip
    raw, ov = raw_config(records, sft_cache, str(tmp_path / "iso"), **common, **{"training.isolate_records": True})
    (iso,) = spawn(_train, 1, raw, ov)
    (loss, norm) = spawn(_reference_first_step, 1, raw, ov)[0]
    with open(tmp_path / "iso" / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert abs(first["loss"] - loss) <= 1e-5 * loss and abs(first["grad_norm"] - norm) <= 1e-4 * norm, (first, loss, norm)
    raw, ov = raw_config(records, sft_cache, str(tmp_path / "crossing"), **common)
    spawn(_train, 1, raw, ov)
    with open(tmp_path / "crossing" / "metrics.jsonl") as f:
        crossing = json.loads(f.readline())
    # the loss at the initial weights is log V either way (near-zero logits); the gradient is not
    assert abs(crossing["grad_norm"] - first["grad_norm"]) > 1e-6 * norm, (crossing, first)


@pytest.mark.distributed
def test_isolated_records_under_cp2_equal_one_process(records, sft_cache, tmp_path, raw_config):
    """isolate_records with context parallelism (one sample per micro-batch, its records' offsets
    global on both ranks): the losses of one process."""
    common = {"training.data_format": "prompt_response", "training.data_path": records, "training.cache_dir": sft_cache,
              "training.train_steps": 2, "training.warmup_steps": 0, "training.isolate_records": True,
              "training.micro_batch_size": 1, "moe.dispatcher": "alltoall"}  # fmt: skip
    raw, ov = raw_config(records, sft_cache, str(tmp_path / "one"), **common)
    (one,) = spawn(_train, 1, raw, ov)
    raw, ov = raw_config(records, sft_cache, str(tmp_path / "cp2"), **common,
                         **{"parallel.world_size": 2, "parallel.context_parallel_size": 2})
    two = spawn(_train, 2, raw, ov)
    for a, b in zip(one["losses"], two[0]["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * a, (one["losses"], two[0]["losses"])
