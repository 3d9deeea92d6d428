"""training.data_format: messages: .jsonl conversations rendered turn by turn in a chat format,
the loss on the assistant turns' content and end-of-turn marker only. The rendered text against a
hand-written ChatML string, the trained tokens decoded back to the assistant turns (a sentencepiece
tokenizer and a tokenizer.json whose ChatML markers are special tokens), a chat format file, bad
records and config values named, and a run that trains on them."""

import json
import os

import numpy as np
import pytest

from megatron_moe_hybrid.registry import CHAT_FORMATS
from megatron_moe_hybrid.testing import spawn
from megatron_moe_hybrid.training import data
from megatron_moe_hybrid.training.data import IGNORE_INDEX, TokenDataset, get_tokenizer

MESSAGES = dict(data_format="messages")


def _conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(400)]

    def say(lo, hi):
        return " ".join(rng.choice(words, rng.integers(lo, hi)))

    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(int(rng.integers(1, 4))):
            turns += [{"role": "user", "content": f"Q{i}: " + say(3, 20)}, {"role": "assistant", "content": say(1, 10) + "."}]
        out.append(turns)
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "train.jsonl"
    with open(path, "w") as f:
        for turns in _conversations(200):
            f.write(json.dumps({"messages": turns}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def chat_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("chat-cache"))


def test_chatml_renders_each_turn_and_trains_the_assistant_content_and_end_marker():
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"},
             {"role": "user", "content": "U2"}, {"role": "assistant", "content": "A2"}]
    pieces = data.render_messages(turns, CHAT_FORMATS["chatml"])
    assert "".join(text for text, _ in pieces) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n"
    )
    assert [text for text, trained in pieces if trained] == ["A1<|im_end|>", "A2<|im_end|>"]
    llama = data.render_messages(turns[1:3], CHAT_FORMATS["llama3"])
    assert llama == (("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n", False), ("A1<|eot_id|>", True))


def _trained_runs(tokens, trained, eos_id):
    """Per record (split at eos): the runs of trained tokens and the untrained tokens."""
    records, current = [], ([], [], [])
    for token, mask in zip(tokens.tolist(), trained.tolist()):
        if token == eos_id and not mask:
            records.append(current)
            current = ([], [], [])
            continue
        runs, untrained, last = current
        if mask:
            if not last or not last[-1]:
                runs.append([])
            runs[-1].append(token)
        else:
            untrained.append(token)
        last.append(mask)
    return [(runs, untrained) for runs, untrained, _ in records]


def _check_labels(ds, tok, conversations, end_marker):
    tokens, trained = np.asarray(ds.tokens), np.asarray(ds.trained, dtype=bool)
    records = _trained_runs(tokens, trained, tok.eos_id)
    assert len(records) == len(conversations)
    for (runs, _), turns in zip(records, conversations):
        want = [t["content"] + end_marker for t in turns if t["role"] == "assistant"]
        assert [tok.decode(run) for run in runs] == want
    # the dataset's labels: the next token where it is trained, IGNORE_INDEX elsewhere
    for i in range(min(ds.num_samples, 40)):
        window_tokens, labels = ds.get(i)
        start = int(ds._permutation(0)[i]) * ds.seq_length
        nxt = tokens[start + 1 : start + 1 + ds.seq_length]
        want = np.where(trained[start + 1 : start + 1 + ds.seq_length], nxt, IGNORE_INDEX)
        assert np.array_equal(labels.numpy(), want), i
    share = float(trained.mean())
    assert 0.05 < share < 0.6, share


def _hf_tokenizer(path, text, specials):
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE(unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path))
    return hf


def test_labels_are_the_assistant_turns_sentencepiece(chats, chat_cache):
    tok = get_tokenizer(chats, 512, chat_cache, **MESSAGES)
    ds = TokenDataset(chats, tok, 48, chat_cache, seed=0, **MESSAGES)
    docs, _ = data.load_documents(chats, **MESSAGES)
    conversations = [json.loads(line)["messages"] for line in open(chats)]
    assert len(docs) == len(conversations)
    _check_labels(ds, tok, conversations, "<|im_end|>")


def test_labels_are_the_assistant_turns_with_special_token_markers(chats, tmp_path):
    """A released model's tokenizer.json: ChatML's markers are single special tokens in the stream."""
    hf = _hf_tokenizer(tmp_path / "tokenizer.json", open(chats).read(), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = data.load_tokenizer(tmp_path / "tokenizer.json")
    ds = TokenDataset(chats, tok, 48, str(tmp_path / "cache"), seed=0, **MESSAGES)
    tokens = np.asarray(ds.tokens)
    im_end = hf.token_to_id("<|im_end|>")
    conversations = [json.loads(line)["messages"] for line in open(chats)]
    num_turns = sum(len(turns) for turns in conversations)
    assert int((tokens == im_end).sum()) == num_turns  # one token per end of turn, never split
    assert int((tokens == hf.token_to_id("<|im_start|>")).sum()) == num_turns
    assert np.asarray(ds.trained, dtype=bool)[tokens == im_end].sum() == sum(
        t["role"] == "assistant" for turns in conversations for t in turns)
    _check_labels(ds, tok, conversations, "<|im_end|>")


def test_deepseek_format_ends_each_answer_with_its_eos_once(chats, tmp_path):
    """deepseek_v3.1: the assistant's end marker is the tokenizer's eos, trained after every answer;
    the record gets no second, untrained eos."""
    fmt = CHAT_FORMATS["deepseek_v3.1"]
    bos, eos = fmt["bos"], fmt["roles"]["assistant"][1]
    hf = _hf_tokenizer(tmp_path / "tokenizer.json", open(chats).read(),
                       [eos, bos, "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "</think>"])
    tok = data.load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.eos_token == eos
    ds = TokenDataset(chats, tok, 48, str(tmp_path / "cache"), seed=0, data_format="messages", chat_format="deepseek_v3.1")
    tokens, trained = np.asarray(ds.tokens), np.asarray(ds.trained, dtype=bool)
    conversations = [json.loads(line)["messages"] for line in open(chats)]
    answers = [t["content"] for turns in conversations for t in turns if t["role"] == "assistant"]
    assert int((tokens == tok.eos_id).sum()) == len(answers) and trained[tokens == tok.eos_id].all()
    starts = np.flatnonzero(tokens == hf.token_to_id(bos))
    assert len(starts) == len(conversations) and starts[0] == 0 and (tokens[starts[1:] - 1] == tok.eos_id).all()
    edges = np.flatnonzero(np.diff(np.concatenate([[0], trained.astype(int), [0]])))  # run starts and ends
    runs = [tok.decode(tokens[a:b]) for a, b in zip(edges[::2], edges[1::2])]
    assert runs == [a + eos for a in answers]


def test_a_chat_format_file_and_its_cache_key(chats, chat_cache, tmp_path):
    spec = {"bos": "<s>", "roles": {"user": ["User: ", "\n"], "assistant": ["Assistant: ", "</s>"],
                                    "system": ["", "\n"]}, "separator": ""}
    path = tmp_path / "fmt.json"
    path.write_text(json.dumps(spec))
    options = dict(MESSAGES, chat_format=str(path))
    docs, _ = data.load_documents(chats, **options)
    conversations = [json.loads(line)["messages"] for line in open(chats)]
    first = conversations[1]  # no system turn
    assert docs[1] == data.render_messages(first, spec)
    assert docs[1][0] == ("<s>User: " + first[0]["content"] + "\nAssistant: ", False)
    tok = get_tokenizer(chats, 512, chat_cache, **MESSAGES)
    ds = TokenDataset(chats, tok, 48, chat_cache, seed=0, **options)
    _check_labels(ds, tok, conversations, "</s>")
    # the same file name with other contents is another cache entry
    path.write_text(json.dumps(dict(spec, roles=dict(spec["roles"], assistant=["A: ", "<end>"]))))
    again = TokenDataset(chats, tok, 48, chat_cache, seed=0, **options)
    _check_labels(again, tok, conversations, "<end>")


@pytest.mark.parametrize("spec,match", [
    ("nope", "neither a preset nor a .json or .jinja file; use one of chatml, deepseek_v3.1, llama3"),
    ({"roles": {"user": ["a", "b"]}}, 'has no "roles" mapping with an "assistant" role'),
    ({"roles": {"assistant": ["a"]}}, "not \\[prefix, suffix\\] strings"),
    ({"roles": {"assistant": ["a", ""]}}, "no suffix: the model would never learn where its turn ends"),
    ({"roles": {"assistant": ["a", "b"]}, "bos": 1}, '"bos" or "separator" that is not a string'),
])
def test_bad_chat_formats_name_the_field(tmp_path, spec, match):
    if not isinstance(spec, str):
        (tmp_path / "f.json").write_text(json.dumps(spec))
        spec = str(tmp_path / "f.json")
    with pytest.raises(ValueError, match="^training.chat_format: .*" + match):
        data.load_chat_format(spec)


def test_bad_records_name_the_turn_and_line(tmp_path):
    lines = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"conversation": []},
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
        {"messages": "hi"},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=r"c.jsonl:2: the record has no field 'messages' .*training.messages_field"):
        data.load_documents(str(path), **MESSAGES)
    docs, stats = data.load_documents(str(path), bad_data="skip", **MESSAGES)
    assert len(docs) == 1 and stats["skipped_missing_field"] == 3 and stats["skipped_bad_json"] == 2
    bad_role = tmp_path / "r.jsonl"
    bad_role.write_text(json.dumps(lines[2]) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:1: turn 1 is .*tool.*, not .*one of \['assistant', 'system', 'user'\]"):
        data.load_documents(str(bad_role), **MESSAGES)
    with pytest.raises(ValueError, match=r"^training.data_format: messages reads .jsonl records, not 'stdlib'"):
        data.load_documents("stdlib", **MESSAGES)


def test_config_checks(chats, monkeypatch, tmp_path):
    from megatron_moe_hybrid.config import ConfigError, load_config

    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny.yaml")
    with pytest.raises(ConfigError, match="^training.data_format: messages reads .jsonl records of 'messages'"):
        load_config(tiny, {"training.data_format": "messages"})
    with pytest.raises(ConfigError, match="^training.chat_format: 'chatmI' is neither a preset"):
        load_config(tiny, {"training.data_format": "messages", "training.data_path": chats,
                           "training.chat_format": "chatmI"})
    with pytest.raises(ConfigError, match="^training.messages_field: is empty"):
        load_config(tiny, {"training.messages_field": ""})
    config = load_config(tiny, {"training.data_format": "messages", "training.data_path": chats,
                                "training.chat_format": "llama3", "training.output_dir": str(tmp_path)})
    assert config.training.chat_format == "llama3"


def _train(rank, world_size, raw, overrides):
    from megatron_moe_hybrid.config import config_from_dict
    from megatron_moe_hybrid.training.trainer import run

    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(config_from_dict(raw, overrides), "pretrain")
    summary = next(line for line in out.getvalue().splitlines() if line.startswith("data: "))
    return {"losses": result.losses, "evals": result.eval_losses, "summary": summary}


def test_a_run_trains_on_conversations(chats, chat_cache, tmp_path, raw_config):
    """The trainer reads the conversations with their masks (the loss path is prompt_response's,
    tests/training/test_prompt_response.py); the loss falls and the held-out loss is logged."""
    common = {"training.data_format": "messages", "training.train_steps": 12, "training.warmup_steps": 2,
              "training.eval_data_path": chats, "training.eval_batches": 1, "training.lr": 3e-3}
    raw, ov = raw_config(chats, chat_cache, str(tmp_path / "run"), **common)
    (result,) = spawn(_train, 1, raw, ov)
    ds = TokenDataset(chats, data.load_tokenizer(tmp_path / "run" / "tokenizer.model"), 32, chat_cache, 0, **MESSAGES)
    share = float(np.asarray(ds.trained).mean())
    assert result["summary"].startswith(f"data: {chats} (messages): {len(ds.tokens):,} tokens, ")
    assert result["summary"].endswith(f"samples of 32 tokens; {share:.1%} of the tokens trained"), result["summary"]
    losses = result["losses"]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert result["evals"] and np.isfinite(result["evals"][-1][1])


# A Qwen-style ChatML template (a default system turn where the conversation has none, as Qwen2.5's)
CHATML_JINJA = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_JINJA = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _tokenizer_config(path, template, **tokens):
    path.write_text(json.dumps({"chat_template": template, **tokens}))
    return str(path)


def test_a_models_jinja_template_cuts_into_the_presets_turns(tmp_path):
    """training.chat_format as a model's tokenizer_config.json or chat_template.jinja: the pieces cut
    from the template's renderings are the preset's (ChatML's and Llama 3's, its bos from the
    tokenizer_config.json beside the .jinja file)."""
    chatml = data.load_chat_format(_tokenizer_config(tmp_path / "tokenizer_config.json", CHATML_JINJA))
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "chat_template.jinja").write_text(LLAMA3_JINJA)
    _tokenizer_config(tmp_path / "l" / "tokenizer_config.json", None, bos_token={"content": "<|begin_of_text|>"})
    llama = data.load_chat_format(str(tmp_path / "l" / "chat_template.jinja"))
    assert llama["bos_token"] == "<|begin_of_text|>"
    for turns in _conversations(30, seed=3):
        if turns[0]["role"] != "system":  # the template's default system turn, as the preset renders it
            want = data.render_messages([{"role": "system", "content": "Be brief."}] + turns, CHAT_FORMATS["chatml"])
        else:
            want = data.render_messages(turns, CHAT_FORMATS["chatml"])
        assert data.render_messages(turns, chatml) == want
        assert data.render_messages(turns, llama) == data.render_messages(turns, CHAT_FORMATS["llama3"])


def test_jinja_rendering_equals_transformers_apply_chat_template(tmp_path, chats):
    """Our template environment renders what transformers' apply_chat_template renders."""
    transformers = pytest.importorskip("transformers")
    _hf_tokenizer(tmp_path / "tokenizer.json", open(chats).read(), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    template = ("{% for m in messages %}{{ m.role | upper }}{{ m | tojson }}{% if m.role == 'user' %}{% continue %}"
                "{% endif %}<{{ m.content | length }}>{% endfor %}{% if add_generation_prompt %}ASSISTANT{% endif %}")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=template)
    ours = data.load_chat_format(_tokenizer_config(tmp_path / "tokenizer_config.json", template))
    turns = [{"role": "user", "content": "é <b>"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "again"}, {"role": "assistant", "content": "done"}]
    rendered = hf.apply_chat_template(turns, tokenize=False)
    assert "".join(text for text, _ in data.render_messages(turns, ours)) == rendered
    assert '"é <b>"' in rendered  # tojson without HTML or ASCII escaping


THINKING_JINJA = ("{% set empty = '<think></think>' if enable_thinking is defined and not enable_thinking else '' %}"
                  "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{{ empty }}{% endif %}"
                  "{{ m.content }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{{ empty }}{% endif %}")


def test_chat_template_kwargs_reach_the_template(tmp_path, chats):
    """training.chat_template_kwargs are the template's extra variables, as transformers'
    apply_chat_template(**kwargs) passes them (Qwen3's enable_thinking: an empty thinking block
    opens each assistant turn, untrained); the records' cache key holds them."""
    fmt = _tokenizer_config(tmp_path / "tokenizer_config.json", THINKING_JINJA)
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    plain = data.render_messages(turns, data.load_chat_format(fmt))
    off = data.render_messages(turns, data.load_chat_format(fmt, {"enable_thinking": False}))
    assert plain == (("<user>q</user><assistant>", False), ("a</assistant>", True))
    assert off == (("<user>q</user><assistant><think></think>", False), ("a</assistant>", True))
    transformers = pytest.importorskip("transformers")
    _hf_tokenizer(tmp_path / "tokenizer.json", open(chats).read(), ["<|endoftext|>"])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=THINKING_JINJA)
    assert hf.apply_chat_template(turns[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False) == off[0][0]
    keys = {data._text_key(str(chats), data._TextOptions(data_format="messages", chat_format=fmt, chat_template_kwargs=kw))
            for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True})}
    assert len(keys) == 3


@pytest.mark.parametrize("chat_format, kwargs, message", [
    ("chatml", {"enable_thinking": False}, r"training.chat_template_kwargs: \['enable_thinking'\] apply to a model's "
                                           r"Jinja chat template; training.chat_format is the preset 'chatml'"),
    ("jinja", {"messages": []}, r"training.chat_template_kwargs: \['messages'\] cannot be set"),
    ("jinja", {"enable-thinking": False}, r"training.chat_template_kwargs: \['enable-thinking'\] cannot be set"),
])
def test_config_refuses_chat_template_kwargs_that_cannot_apply(tmp_path, chats, chat_format, kwargs, message):
    from megatron_moe_hybrid.config import ConfigError, load_config

    if chat_format == "jinja":
        chat_format = _tokenizer_config(tmp_path / "tokenizer_config.json", THINKING_JINJA)
    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny.yaml")
    with pytest.raises(ConfigError, match="^" + message):
        load_config(tiny, {"training.data_format": "messages", "training.data_path": str(chats),
                           "training.chat_format": chat_format, "training.chat_template_kwargs": kwargs})
    with pytest.raises(ConfigError, match="^training.chat_template_kwargs: expected a mapping"):
        load_config(tiny, {"training.chat_template_kwargs": "enable_thinking"})


def test_a_template_that_rewrites_earlier_turns_is_named_or_split(tmp_path):
    """A template whose last assistant turn renders differently (a thinking block on the last turn
    only) cannot be cut for multi-turn records: under training.chat_turns whole the record is
    named (with the fix); under auto, the default, it becomes one record per assistant turn
    (counted); a single turn is cut as before."""
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' and loop.last %}<think></think>"
                "{% endif %}{{ m.content }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>"
                "<think></think>{% endif %}")
    fmt = _tokenizer_config(tmp_path / "tokenizer_config.json", template)
    one = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    two = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
           {"role": "user", "content": "r"}, {"role": "assistant", "content": "b"}]
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": one}) + "\n" + json.dumps({"messages": two}) + "\n")
    whole = dict(data_format="messages", chat_format=fmt, chat_turns="whole")
    with pytest.raises(ValueError, match=r"c.jsonl:2: the chat template renders the turns before turn 2 differently once "
                                         r"turn 2 follows .*set training.chat_turns: split .*training.chat_format"):
        data.load_documents(str(path), **whole)
    single = (("<user>q</user><assistant><think></think>", False), ("a</assistant>", True))
    docs, stats = data.load_documents(str(path), **whole, bad_data="skip")
    assert docs == [single] and stats["skipped_bad_json"] == 1 and stats["split_conversations"] == 0
    docs, stats = data.load_documents(str(path), data_format="messages", chat_format=fmt)
    assert docs == [single, single, (("<user>q</user><assistant>a</assistant><user>r</user><assistant><think></think>", False),
                                     ("b</assistant>", True))]
    assert stats["split_conversations"] == 1 and stats["skipped_bad_json"] == 0
    with pytest.raises(ValueError, match="^training.chat_format: .* does not compile"):
        data.load_chat_format(_tokenizer_config(tmp_path / "bad.json", "{% for %}"))
    with pytest.raises(ValueError, match="^training.chat_format: .* holds no chat template string"):
        data.load_chat_format(_tokenizer_config(tmp_path / "none.json", None))


# Qwen3's way with thinking, reduced: an assistant turn before the last user turn is rendered without
# its <think>...</think> block, the turns after it with theirs.
DROP_THINKING_JINJA = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and "
    "loop.index0 < ns.last %}{{ m.content.split('</think>')[-1].lstrip() }}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_split_turns_train_each_answer_in_the_context_it_is_generated_in(tmp_path, chats):
    """training.chat_turns split (and auto, for a template that drops earlier turns' thinking): one
    record per assistant turn, the text of each equal to transformers' apply_chat_template of the
    conversation up to that turn, only that turn trained (its thinking included); the earlier
    turns' answers appear as context without their thinking. A preset splits the same way."""
    fmt = data.load_chat_format(_tokenizer_config(tmp_path / "tokenizer_config.json", DROP_THINKING_JINJA))
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "<think>add them</think>\n4"}, {"role": "user", "content": "and 3+3?"},
             {"role": "assistant", "content": "<think>again</think>\n6"}]
    with pytest.raises(data.ChatTemplateRewrites):
        data.render_messages(turns, fmt)
    records = data.render_turns(turns, fmt)
    assert [[text for text, trained in r if trained] for r in records] == [
        ["<think>add them</think>\n4<|im_end|>"], ["<think>again</think>\n6<|im_end|>"]]
    assert "add them" not in records[1][0][0] and "4<|im_end|>" in records[1][0][0]
    transformers = pytest.importorskip("transformers")
    _hf_tokenizer(tmp_path / "tokenizer.json", open(chats).read(), ["<|endoftext|>"])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                              chat_template=DROP_THINKING_JINJA)
    for record, end in zip(records, (3, 5)):
        assert "".join(text for text, _ in record) == hf.apply_chat_template(turns[:end], tokenize=False)
        assert record[0][0] == hf.apply_chat_template(turns[: end - 1], tokenize=False, add_generation_prompt=True)
    # a preset: the conversation up to each answer, that answer trained, the earlier ones not
    chatml = data.load_chat_format("chatml")
    split = data.render_turns(turns, chatml)
    for record, end, answer in zip(split, (3, 5), ("<think>add them</think>\n4<|im_end|>", "<think>again</think>\n6<|im_end|>")):
        assert "".join(t for t, _ in record) == "".join(t for t, _ in data.render_messages(turns[:end], chatml))
        assert [t for t, tr in record if tr] == [answer]


def test_split_turns_in_a_dataset_and_its_cache_key(chats, chat_cache, tmp_path):
    """Under chat_turns split every conversation of n assistant turns is n records whose trained
    tokens are that turn's; the mode is part of the records' cache key; the config names a bad value."""
    from megatron_moe_hybrid.config import ConfigError, load_config

    tok = get_tokenizer(chats, 512, chat_cache, **MESSAGES)
    conversations = [json.loads(line)["messages"] for line in open(chats)]
    ds = TokenDataset(chats, tok, 48, chat_cache, seed=0, data_format="messages", chat_turns="split")
    tokens, trained = np.asarray(ds.tokens), np.asarray(ds.trained, dtype=bool)
    records = _trained_runs(tokens, trained, tok.eos_id)
    want = [[t["content"] + "<|im_end|>"] for turns in conversations for t in turns if t["role"] == "assistant"]
    assert len(records) == len(want) > len(conversations)
    assert [[tok.decode(run) for run in runs] for runs, _ in records] == want
    assert ds.data_stats["split_conversations"] == 0  # split asked: not counted as a fallback
    # auto with a template that rewrites earlier turns: the multi-turn conversations split, named in the data line
    from megatron_moe_hybrid.training.trainer import _data_summary

    last_only = _tokenizer_config(tmp_path / "tokenizer_config.json", (
        "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' and loop.last %}<think></think>{% endif %}"
        "{{ m.content }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant><think></think>{% endif %}"))
    auto = TokenDataset(chats, tok, 48, chat_cache, seed=0, data_format="messages", chat_format=last_only)
    multi = sum(sum(t["role"] == "assistant" for t in turns) > 1 for turns in conversations)
    assert auto.data_stats["split_conversations"] == multi > 0
    assert f"{multi:,} conversations made one record per assistant turn" in _data_summary("data", chats, auto, "messages")
    keys = {data._text_key(chats, data._TextOptions(data_format="messages", chat_turns=mode))
            for mode in ("auto", "whole", "split")}
    assert len(keys) == 3
    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny.yaml")
    with pytest.raises(ConfigError, match="^training.chat_turns: 'splt' is not one of auto, whole, split"):
        load_config(tiny, {"training.data_format": "messages", "training.data_path": chats, "training.chat_turns": "splt"})
    with pytest.raises(ConfigError, match="^training.chat_turns: 'split' applies to conversations"):
        load_config(tiny, {"training.chat_turns": "split"})


def test_a_dataset_in_a_models_template(chats, chat_cache, tmp_path):
    fmt = _tokenizer_config(tmp_path / "tokenizer_config.json", CHATML_JINJA)
    tok = get_tokenizer(chats, 512, chat_cache, **MESSAGES)
    ds = TokenDataset(chats, tok, 48, chat_cache, seed=0, data_format="messages", chat_format=fmt)
    _check_labels(ds, tok, [json.loads(line)["messages"] for line in open(chats)], "<|im_end|>")


def test_isolate_records_keeps_a_conversation_whole_when_eos_ends_every_turn(chats, tmp_path):
    """An instruct tokenizer whose eos is ChatML's <|im_end|>, which also ends every turn: the
    records isolate_records packs start at conversations, not at turns (the stored record ends)."""
    _hf_tokenizer(tmp_path / "tokenizer.json", open(chats).read(), ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = data.load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.eos_token == "<|im_end|>"
    ds = TokenDataset(chats, tok, 64, str(tmp_path / "cache"), seed=0, **MESSAGES)
    ids = np.asarray(ds.tokens)
    conversation_starts = set(np.concatenate([[0], ds.ends[:-1]]).tolist())
    assert len(conversation_starts) == 200
    turn_starts = set((np.flatnonzero(ids[1:] == tok._tok.token_to_id("<|im_start|>")) + 1).tolist()) - conversation_starts
    assert turn_starts  # turns that follow an <|im_end|> inside a conversation
    tokens, labels = data.batch(ds, 0, 8)
    flat, cu = data.pack_records(tokens, data.batch_record_starts(ds, 0, 8))
    for i in range(8):
        start = int(ds._permutation(0)[i]) * 64
        inside = [int(c) - i * 64 for c in cu.tolist() if i * 64 < c < (i + 1) * 64]
        assert {start + p for p in inside} <= conversation_starts
        assert not {start + p for p in inside} & turn_starts
