"""Shared fixtures of the training tests: a small corpus and tokenizer cache, the tiny config."""

import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small slice of the built-in corpus keeps tokenizer training fast in tests."""
    from megatron_moe_hybrid.training.data import stdlib_corpus

    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(stdlib_corpus(max_bytes=400_000))
    return str(path)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def make_raw_config(corpus, cache_dir, output_dir, **overrides):
    """(raw YAML dict of tiny.yaml, overrides) for a fast CPU run."""
    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    ov = {
        "model.vocab_size": 512,
        "training.data_path": corpus,
        "training.cache_dir": cache_dir,
        "training.output_dir": output_dir,
        "training.seq_length": 32,
        "training.micro_batch_size": 2,
        "training.global_batch_size": 4,
        "training.warmup_steps": 2,
        "training.save_interval": 0,
        "training.progress_bar": False,
        "sparse_attention.topk": 8,
        "parallel.world_size": 1,
    }
    ov.update(overrides)
    return raw, ov


@pytest.fixture(scope="session")
def raw_config():
    return make_raw_config


@pytest.fixture(scope="session")
def records(tmp_path_factory):
    """A .jsonl of question / answer records of uneven lengths (answers the prompts do not hold):
    the instruction data of test_prompt_response.py and test_packing.py."""
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(600)]
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    with open(path, "w") as f:
        for i in range(300):
            prompt = "Question %d: " % i + " ".join(rng.choice(words, rng.integers(3, 30)))
            answer = " ".join(rng.choice(words, rng.integers(1, 12))) + "."
            f.write(json.dumps({"prompt": prompt, "response": answer}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def sft_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sft-cache"))
