"""Training data with no download: a sentencepiece tokenizer (or a released model's own Hugging
Face tokenizer.json) and a token dataset.

The default corpus is the docstrings of the Python standard library (`data_path:
stdlib`), so every machine with Python can train. Tokenizer and token ids are cached
in `cache_dir` under content hashes; torchrun ranks may build them at the same time
(an fcntl lock serialises the work, files appear by an atomic os.replace).

Indexing is stateless: sample i is a pure function of (corpus, tokenizer, seq_length,
seed, i), so the data position of a run is just the number of samples consumed and a
resumed run sees exactly the samples it would have seen.

Files: a .jsonl file holds one JSON object per line, its `text_field` is one document;
any other file is UTF-8 text whose documents are separated by a blank line; a directory
is its *.txt and *.jsonl files in sorted order. With `data_format="prompt_response"` every
record of .jsonl files holds `prompt_field` and `response_field`: the record's tokens are its
prompt's, its response's and the end of sequence, and only the last two are trained (the
labels of the prompt's are IGNORE_INDEX). With `data_format="messages"` every record holds
`messages_field`, a conversation: a list of {"role": "system" | "user" | "assistant", "content":
str}, rendered turn by turn in `chat_format` (registry.CHAT_FORMATS, or a .json file of its keys);
only the assistant turns' content and their end-of-turn marker are trained. Bad data (a line that is not UTF-8, not
JSON, lacks the text field, or a document over `max_document_chars`) raises a ValueError
naming file and line under `bad_data="error"`, and is dropped and counted under "skip".

Shape legend:
  S  seq_length: tokens per sample (each sample reads S + 1 tokens; labels are shifted by one)
  N  number of samples in a batch
"""

import ast
import bisect
import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import json
import logging
import os
import re
import resource
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from megatron_moe_hybrid.registry import CHAT_FORMATS, CHAT_TURNS, DATA_FORMATS, PACKINGS
from megatron_moe_hybrid.training._files import atomic_write as _atomic_write
from megatron_moe_hybrid.training._files import publish, temp_beside
from megatron_moe_hybrid.training.indexed import indexed_prefix, parse_blend, read_indexed

logger = logging.getLogger(__name__)

STDLIB = "stdlib"
BAD_DATA_POLICIES = ("error", "skip")
STAT_KEYS = ("skipped_bad_json", "skipped_non_utf8", "skipped_too_long", "skipped_missing_field")
IGNORE_INDEX = -100  # a label the loss skips (the chunked cross-entropy's ignore_index)
# Part of the file cache key: bump it when load_documents changes what it reads from files.
_FILES_FORMAT_VERSION = 1
_DATA_SUFFIXES = (".txt", ".jsonl")
# json.loads turns an escaped lone surrogate ("\\ud800") into a str that UTF-8 cannot encode.
_SURROGATE = re.compile("[\ud800-\udfff]")
# Part of the stdlib cache key: bump it when stdlib_corpus changes what it extracts.
_STDLIB_CORPUS_VERSION = 1
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_DOC_SEP = "\n\n"

# Special ids sit below the 256 byte pieces; byte_fallback means no text is ever <unk>.
_UNK_ID, _BOS_ID, _EOS_ID, _PAD_ID = 0, 1, 2, 3
_MIN_VOCAB = 256 + 4 + 1
# Lines beyond this are subsampled (a fixed stride) so training stays well under 30 s on 2 cores.
_MAX_TRAIN_SENTENCES = 200_000
_SPM_OPTIONS = {
    "model_type": "bpe",
    "byte_fallback": True,
    "character_coverage": 0.9995,
    # identity + kept whitespace make decode(encode(text)) == text, newlines and tabs included
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "allow_whitespace_only_pieces": True,
    "split_digits": True,
    "unk_id": _UNK_ID,
    "bos_id": _BOS_ID,
    "eos_id": _EOS_ID,
    "pad_id": _PAD_ID,
    "input_sentence_size": 0,  # we subsample ourselves, deterministically
}


def stdlib_root(subset: str = "") -> Path:
    """The stdlib source folder, or the package folder / module file named by subset."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not subset:
        return root
    for candidate in (root / subset.replace(".", "/"), root / (subset.replace(".", "/") + ".py")):
        if candidate.exists():
            return candidate
    raise ValueError(
        f"training.data_path: 'stdlib:{subset}' names no standard-library package or module; "
        "use e.g. 'stdlib:email' or plain 'stdlib'"
    )


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 8_000_000, subset: str = "") -> str:
    """Docstrings of the standard library (or of its package/module `subset`, e.g. "email"),
    parsed with `ast` (nothing is imported).

    Files are visited in sorted order and docstrings are joined by a blank line until
    the next one would pass max_bytes (UTF-8), so the result is deterministic for a
    given Python install. Parsing takes several seconds; the result is memoised.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    docs: list[str] = []
    num_bytes = 0
    for path in _stdlib_files(stdlib_root(subset)):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
            continue  # a few stdlib files are templates or target another Python
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, _DOC_NODES) else None
            if not doc:
                continue
            size = len(doc.encode()) + len(_DOC_SEP)
            if num_bytes + size > max_bytes:
                return _DOC_SEP.join(docs)
            docs.append(doc)
            num_bytes += size
    return _DOC_SEP.join(docs)


def _stdlib_files(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)  # os.walk follows this order
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


@dataclass(frozen=True)
class _TextOptions:
    """How files are read; part of their cache keys because each changes the text."""

    bad_data: str = "error"
    text_field: str = "text"
    max_document_chars: int | None = None
    data_format: str = "text"  # "text" | "prompt_response" | "messages" (DATA_FORMATS)
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    chat_format: str = "chatml"  # a CHAT_FORMATS name or a .json file of its keys
    chat_template_kwargs: dict = field(default_factory=dict)  # extra variables of a Jinja chat template
    chat_turns: str = "auto"  # one record per conversation or per assistant turn (CHAT_TURNS)

    def __post_init__(self):
        if self.data_format not in DATA_FORMATS:
            raise ValueError(f"training.data_format: {self.data_format!r} is not one of {', '.join(DATA_FORMATS)}")
        if self.data_format == "messages":
            load_chat_format(self.chat_format, self.chat_template_kwargs)  # names the problem before any file is read
        if self.chat_turns not in CHAT_TURNS:
            raise ValueError(f"training.chat_turns: {self.chat_turns!r} is not one of {', '.join(CHAT_TURNS)}")
        for name in ("prompt_field", "response_field", "messages_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"training.{name}: {getattr(self, name)!r} must be a non-empty JSON key")
        if self.bad_data not in BAD_DATA_POLICIES:
            raise ValueError(f"training.bad_data: {self.bad_data!r} is not a policy; use 'error' or 'skip'")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"training.text_field: {self.text_field!r} must be a non-empty JSON key, e.g. 'text'")
        limit = self.max_document_chars
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(
                f"training.max_document_chars: {self.max_document_chars!r} must be a positive int, or None for no limit"
            )


def load_chat_format(chat_format: str, template_kwargs: dict | None = None) -> dict:
    """training.chat_format, checked: a CHAT_FORMATS name; a .json file holding {"bos": str,
    "roles": {role: [prefix, suffix]}, "separator": str} with an "assistant" role; or a model's own
    Jinja chat template: its tokenizer_config.json (the "chat_template" key) or a .jinja file (with
    the bos / eos tokens of a tokenizer_config.json beside it). Returns the preset's dict, or
    {"jinja": template text, "bos_token": str, "eos_token": str} (and "kwargs": template_kwargs if any).
    template_kwargs (training.chat_template_kwargs): extra variables of a Jinja template, as
    transformers' apply_chat_template(**kwargs) passes them (e.g. {"enable_thinking": false});
    refused for a preset or a .json format, which have none."""
    template_kwargs = dict(template_kwargs or {})
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(template_kwargs)
    if reserved or not all(isinstance(k, str) and k.isidentifier() for k in template_kwargs):
        bad = sorted(reserved) or [k for k in template_kwargs if not (isinstance(k, str) and k.isidentifier())]
        raise ValueError(f"training.chat_template_kwargs: {bad} cannot be set: the keys are a template's own variable "
                         "names, and messages, add_generation_prompt, bos_token and eos_token are the renderer's")
    if chat_format in CHAT_FORMATS:
        if template_kwargs:
            raise ValueError(f"training.chat_template_kwargs: {sorted(template_kwargs)} apply to a model's Jinja chat "
                             f"template; training.chat_format is the preset {chat_format!r}, which takes none: point "
                             "training.chat_format at the model's tokenizer_config.json or chat_template.jinja")
        return CHAT_FORMATS[chat_format]
    fix = (f"use one of {', '.join(CHAT_FORMATS)}, a .json file of the same keys (registry.CHAT_FORMATS), or a "
           "model's tokenizer_config.json / chat_template.jinja")
    path = Path(str(chat_format))
    if path.suffix not in (".json", ".jinja"):
        raise ValueError(f"training.chat_format: {chat_format!r} is neither a preset nor a .json or .jinja file; {fix}")
    try:
        text = path.read_text()
        spec = json.loads(text) if path.suffix == ".json" else None
    except (OSError, ValueError) as err:
        raise ValueError(f"training.chat_format: cannot read {chat_format!r} ({err}); {fix}") from None
    if spec is None or (isinstance(spec, dict) and "chat_template" in spec):
        loaded = _jinja_chat_format(chat_format, text if spec is None else spec["chat_template"], fix)
        return {**loaded, "kwargs": template_kwargs} if template_kwargs else loaded  # (cache keys without any stay)
    if template_kwargs:
        raise ValueError(f"training.chat_template_kwargs: {sorted(template_kwargs)} apply to a model's Jinja chat "
                         f"template; {chat_format} is a format of prefixes and suffixes, which takes none")
    roles = spec.get("roles") if isinstance(spec, dict) else None
    problem = None
    if not isinstance(roles, dict) or "assistant" not in roles:
        problem = 'has no "roles" mapping with an "assistant" role'
    elif any(not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)) for v in roles.values()):
        problem = 'has a role that is not [prefix, suffix] strings'
    elif not all(isinstance(spec.get(k, ""), str) for k in ("bos", "separator")):
        problem = 'has a "bos" or "separator" that is not a string'
    elif not roles["assistant"][1]:
        problem = "gives the assistant no suffix: the model would never learn where its turn ends"
    if problem:
        raise ValueError(f"training.chat_format: {chat_format} {problem}; {fix}")
    return {"bos": spec.get("bos", ""), "roles": roles, "separator": spec.get("separator", "")}


def _jinja_chat_format(where: str, template, fix: str) -> dict:
    if isinstance(template, list):  # named templates: the "default" one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"training.chat_format: {where} holds no chat template string; {fix}")
    config_path = Path(where) if where.endswith(".json") else Path(where).with_name("tokenizer_config.json")
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    tokens = {}
    for name in ("bos_token", "eos_token"):
        value = config.get(name)
        tokens[name] = (value.get("content") if isinstance(value, dict) else value) or ""
    try:
        _compiled_template(template)
    except Exception as err:  # jinja2's TemplateSyntaxError and kin
        raise ValueError(f"training.chat_format: the chat template of {where} does not compile ({err}); {fix}") from None
    return {"jinja": template, **tokens}


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    """A chat template compiled as transformers compiles it: a sandbox, trim_blocks and lstrip_blocks,
    loop controls, tojson without HTML escaping, raise_exception and strftime_now; {% generation %}
    blocks render their body."""
    import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


class ChatTemplateError(ValueError):
    """A chat template that cannot be cut into turns for this conversation."""


class ChatTemplateRewrites(ChatTemplateError):
    """A template that renders earlier turns differently once later turns follow (Qwen3's drops
    their thinking): its turns cannot be cut from one rendering, each assistant turn can be
    rendered alone in the context the template gives it (training.chat_turns: split / auto)."""


def _jinja_renderer(chat_format: dict):
    """render(turns, generation_prompt) -> the template's text, as transformers'
    apply_chat_template(tokenize=False) gives it (with training.chat_template_kwargs)."""
    template = _compiled_template(chat_format["jinja"])
    tokens = {"bos_token": chat_format["bos_token"], "eos_token": chat_format["eos_token"]}

    def render(turns, generation_prompt):
        try:
            return template.render(messages=turns, add_generation_prompt=generation_prompt, **tokens,
                                   **chat_format.get("kwargs", {}))
        except Exception as err:  # a template's raise_exception, or an error inside it
            raise ChatTemplateError(f"the chat template fails on turns 0-{len(turns) - 1} ({err})") from None

    return render


def _assistant_pieces(head: str, full: str, number: int) -> list[tuple[str, bool]]:
    """An assistant turn cut from the rendering before it with the generation prompt (head) and
    the rendering that ends with it (full): what follows head is trained, whitespace at its end not."""
    if not full.startswith(head):
        raise ChatTemplateRewrites(
            f"the chat template renders the turns before turn {number} differently once turn {number} follows "
            "(the generation prompt's rendering is not a prefix of the turn's), so the turn cannot be cut from it")
    body = full[len(head):]
    answer = body.rstrip()
    return [(answer, True), (body[len(answer):], False)]


def _render_jinja(messages: list[dict], chat_format: dict) -> list[tuple[str, bool]]:
    """(text, trained) pieces of a conversation in a model's own template, cut where rendering the
    conversation up to each turn ends; an assistant turn's head is what the template's generation
    prompt adds, its trained text what the turn adds after it (whitespace at the end untrained).
    Each cut must be a prefix of the next rendering, and the pieces must join into the whole
    conversation's rendering; a template that renders an earlier turn differently once later turns
    follow (Qwen3's thinking blocks) raises ChatTemplateRewrites."""
    render = _jinja_renderer(chat_format)

    def extend(done, text, what):
        if not text.startswith(done):
            raise ChatTemplateRewrites(
                f"the chat template renders the turns before {what} differently once {what} follows (their "
                "rendering is not a prefix of the longer one), so turns cannot be cut from it")
        return text[len(done):]

    pieces, done = [], ""
    for number, message in enumerate(messages):
        full = render(messages[: number + 1], False)
        if message["role"] == "assistant":
            head = render(messages[:number], True)
            pieces.append((extend(done, head, f"turn {number}'s generation prompt"), False))
            pieces += _assistant_pieces(head, full, number)
        else:
            pieces.append((extend(done, full, f"turn {number}"), False))
        done = full
    if render(messages, False) != done:
        raise ChatTemplateRewrites("the chat template's rendering of the whole conversation is not its turns' in order")
    return pieces


def _merged(pieces) -> tuple[tuple[str, bool], ...]:
    """Adjacent pieces of one kind merged (fewer, longer strings to tokenize), empty ones dropped."""
    merged: list[tuple[str, bool]] = []
    for text, trained in pieces:
        if not text:
            continue
        if merged and merged[-1][1] == trained:
            merged[-1] = (merged[-1][0] + text, trained)
        else:
            merged.append((text, trained))
    return tuple(merged)


def _preset_pieces(messages: list[dict], chat_format: dict, trained_from: int = 0) -> list[tuple[str, bool]]:
    """A preset / .json format's pieces: the bos, each turn's prefix, content and suffix, and the
    separator after it; the assistant turns from index trained_from on are trained."""
    pieces = [(chat_format["bos"], False)]
    for number, message in enumerate(messages):
        prefix, suffix = chat_format["roles"][message["role"]]
        trained = message["role"] == "assistant" and number >= trained_from
        pieces += [(prefix, False), (message["content"] + suffix, trained), (chat_format["separator"], False)]
    return pieces


def render_messages(messages: list[dict], chat_format: dict) -> tuple[tuple[str, bool], ...]:
    """A conversation as (text, trained) pieces: the bos, each turn's prefix, content and suffix,
    and the separator after it; trained are the assistant turns' content and suffix. In a model's
    Jinja template (chat_format "jinja") the pieces are cut from its renderings (_render_jinja).
    Adjacent pieces of one kind are merged (fewer, longer strings to tokenize)."""
    if "jinja" in chat_format:
        return _merged(_render_jinja(messages, chat_format))
    return _merged(_preset_pieces(messages, chat_format))


def render_turns(messages: list[dict], chat_format: dict) -> list[tuple[tuple[str, bool], ...]]:
    """training.chat_turns "split": one record per assistant turn, each the conversation up to and
    including that turn with only that turn trained. In a Jinja template the context is what the
    template renders before the turn with its generation prompt (what the model sees when it
    generates the turn: Qwen3's template without the thinking of earlier turns), the turn what the
    rendering ending with it adds; in a preset, the preset's pieces."""
    render = _jinja_renderer(chat_format) if "jinja" in chat_format else None
    records = []
    for number, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if render is None:
            records.append(_merged(_preset_pieces(messages[: number + 1], chat_format, trained_from=number)))
            continue
        head = render(messages[:number], True)
        full = render(messages[: number + 1], False)
        records.append(_merged([(head, False)] + _assistant_pieces(head, full, number)))
    return records


def load_documents(data_path: str, **options) -> tuple[list, dict[str, int]]:
    """(documents, counts of skipped lines by STAT_KEYS) of data_path; options are
    _TextOptions' fields (bad_data, text_field, max_document_chars, data_format, prompt_field,
    response_field, messages_field, chat_format). A document is a str; under data_format
    "prompt_response" a (prompt, response) pair; under "messages" the (text, trained) pieces of
    render_messages. document_pieces' pieces, collected.

    "stdlib" is generated, trusted text: its documents are the blank-line-separated
    paragraphs of stdlib_corpus() and the bad-data options do not apply to it.
    A non-UTF-8 line is dropped on its own (in a .txt file the rest of its document stays).
    """
    docs: list = []
    stats = _new_stats(_TextOptions(**options))
    for piece, counts in document_pieces(data_path, **options):
        docs.extend(piece)
        add_counts(stats, counts)
    return docs, stats


def add_counts(into: dict[str, int], counts: dict[str, int]) -> None:
    """A piece's skip counts added to the totals."""
    for key, count in counts.items():
        into[key] = into.get(key, 0) + count


def _new_stats(opts: "_TextOptions") -> dict[str, int]:
    stats = dict.fromkeys(STAT_KEYS, 0)
    if opts.data_format == "messages":
        stats["split_conversations"] = 0  # not a skip: conversations made one record per assistant turn
    return stats


def document_pieces(data_path: str, block_bytes: int | None = None,
                    **options) -> Iterator[tuple[list, dict[str, int]]]:
    """load_documents' documents in pieces, each file read block_bytes (default BLOCK_BYTES) at a
    time (file_documents), never whole: (documents, the piece's counts). The checks that need
    every file (all of them empty, no text left after skipping bad data) stop it at the end."""
    opts = _TextOptions(**options)
    records = opts.data_format != "text"
    if is_stdlib(data_path):
        if records:
            raise ValueError(f"training.data_format: {opts.data_format} reads .jsonl records, not {data_path!r}; "
                             "point training.data_path at them")
        yield _stdlib_text(data_path).split(_DOC_SEP), _new_stats(opts)
        return
    files = _data_files(data_path)
    if records and any(path.suffix != ".jsonl" for path in files):
        other = next(path for path in files if path.suffix != ".jsonl")
        raise ValueError(f"training.data_format: {opts.data_format} reads .jsonl records; {other} is not one "
                         "(move it out, or use data_format: text)")
    num_empty = 0
    text = False  # whether some document so far has text
    stats = _new_stats(opts)
    for path in files:
        if _blank_file(path):
            num_empty += 1  # an error only when every file is empty
            continue
        before = dict(stats)
        for docs, counts in file_documents(path, block_bytes, **options):
            add_counts(stats, counts)
            text = text or any(_has_text(doc) for doc in docs)
            yield docs, counts
        skipped = {k: stats[k] - before[k] for k in STAT_KEYS if stats[k] != before[k]}
        if skipped:
            logger.warning("training.data_path: skipped lines of %s: %s (bad_data: error names each)", path, skipped)
    if num_empty == len(files):
        if Path(data_path).is_file():
            raise ValueError(f"training.data_path: file {data_path!r} is empty; point it at text data")
        raise ValueError(
            f"training.data_path: directory {data_path!r} holds only empty files "
            f"({', '.join(f.name for f in files)}); point it at text data"
        )
    if not text:
        raise ValueError(
            f"training.data_path: {data_path!r} has no text left after skipping bad data ({stats}); "
            "fix the data, or check training.text_field and training.max_document_chars"
        )


def _blank_file(path: Path) -> bool:
    """Whether a file holds only whitespace, read until its first other byte."""
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            if block.strip():
                return False
    return True


BLOCK_BYTES = 64 << 20  # file_documents' piece of a file


def file_documents(path: str | Path, block_bytes: int | None = None, **options) -> Iterator[tuple[list, dict[str, int]]]:
    """The documents of one .txt or .jsonl file (data_format text) as load_documents reads them
    (the same documents, skip counts and errors with file:line and byte offset) in pieces:
    (documents, skip counts) per block_bytes (default BLOCK_BYTES) or so read, so that no file
    is ever held whole (tools/preprocess_data.py). A .jsonl file is read line by line either way. A .txt file's
    text is its decoded lines joined by newlines (the non-UTF-8 ones dropped); its documents are
    cut at a blank line that follows a non-empty line and precedes another line: there
    str.split(_DOC_SEP) of the whole text splits too. (A .txt file with two kinds of bad line
    under bad_data error stops at the first in the file: reading whole, at a non-UTF-8 one.)"""
    path, opts, block_bytes = Path(path), _TextOptions(**options), block_bytes or BLOCK_BYTES
    if path.suffix == ".jsonl":
        for raw, line, byte in jsonl_pieces(path, block_bytes):
            stats = _new_stats(opts)
            yield _jsonl_documents(path, raw, opts, stats, line, byte), stats
        return
    lines: list[str] = []  # decoded lines not yet in a document; lines[0] is line `first`
    first = searched = 1
    for piece, line, byte, last in _line_blocks(path, block_bytes):
        stats = dict.fromkeys(STAT_KEYS, 0)
        try:
            lines.extend(piece.decode("utf-8").split("\n"))
        except UnicodeDecodeError:
            lines.extend(text for _, text in _utf8_lines(path, piece, opts, stats, line, byte))
        cut = len(lines) if last else next(  # lines[cut] blank, the line before not, one after
            (j for j in range(len(lines) - 2, max(searched, 1) - 1, -1) if not lines[j] and lines[j - 1]), None)
        searched = max(1, len(lines) - 1)
        docs = []
        if cut is not None:
            docs = _split_text(path, "\n".join(lines[:cut]), opts, stats, first)
            first, lines, searched = first + cut + 1, lines[cut + 1 :], 1
        yield docs, stats


def _line_blocks(path: str | Path, block_bytes: int) -> Iterator[tuple[bytes, int, int, bool]]:
    """A file read block_bytes at a time, as whole lines: (the lines' bytes without the newline
    that ends the last, the number of the first line, its byte offset, whether the file ends there)."""
    line, byte, tail = 1, 0, b""  # the number and offset of the first line not given, its bytes so far
    with open(path, "rb") as f:
        while True:
            block = f.read(block_bytes)
            buf = tail + block
            end = buf.rfind(b"\n") if block else len(buf)  # whole lines only, until the end
            if end < 0:
                tail = buf
                continue
            lines, tail = buf[:end], buf[end + 1 :]
            yield lines, line, byte, not block
            if not block:
                return
            line += lines.count(b"\n") + 1
            byte += end + 1


def jsonl_pieces(path: str | Path, block_bytes: int | None = None,
                 piece_bytes: int | None = None) -> Iterator[tuple[bytes, int, int]]:
    """A .jsonl file in pieces of whole lines, read block_bytes (default BLOCK_BYTES) at a time:
    (its bytes without the newline that ends it, the number of its first line, that line's byte
    offset), each piece about piece_bytes (default block_bytes) or one line longer. The pieces'
    records, each parsed by _jsonl_documents from its line and offset, are the file's (the same
    documents, skip counts and errors), so that the tool's workers can parse them."""
    block_bytes = block_bytes or BLOCK_BYTES
    piece_bytes = piece_bytes or block_bytes
    for lines, line, byte, _ in _line_blocks(path, block_bytes):
        start = 0
        while True:
            stop = lines.find(b"\n", start + piece_bytes) if start + piece_bytes < len(lines) else -1
            stop = len(lines) if stop < 0 else stop
            raw = lines[start:stop]
            yield raw, line, byte
            line += raw.count(b"\n") + 1
            byte += len(raw) + 1
            start = stop + 1
            if stop == len(lines):
                break


def load_text(data_path: str, **options) -> str:
    """The documents of load_documents joined by a blank line (a prompt and its response by a
    newline, a conversation's rendered pieces by nothing): for a .txt file its text, minus skipped lines."""
    docs, _ = load_documents(data_path, **options)
    return _DOC_SEP.join(_doc_text(doc) for doc in docs)


def _record_pieces(doc) -> tuple[tuple[tuple[str, bool], ...], bool]:
    """A record of load_documents as ((text, trained) pieces, whether its closing eos is trained):
    a prompt and its response train the response and the eos after it; a conversation's pieces
    say what they train, and its closing eos, a separator, is not."""
    if isinstance(doc[0], str):  # (prompt, response)
        return ((doc[0], False), (doc[1], True)), True
    return doc, False


def _doc_text(doc) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc[0], str):  # (prompt, response)
        return "\n".join(doc)
    return "".join(text for text, _ in doc)  # (text, trained) pieces


def _has_text(doc) -> bool:
    if isinstance(doc, str):
        return bool(doc.strip())
    if isinstance(doc[0], str):
        return bool(doc[1].strip())
    return any(trained and text.strip() for text, trained in doc)


def _stdlib_text(data_path: str) -> str:
    return stdlib_corpus() if data_path == STDLIB else stdlib_corpus(subset=data_path[len(STDLIB) + 1 :])


def is_stdlib(data_path: str) -> bool:
    """Whether data_path names the built-in corpus: 'stdlib' or 'stdlib:<package>'."""
    return data_path == STDLIB or data_path.startswith(STDLIB + ":")


def _data_files(data_path: str) -> list[Path]:
    path = Path(data_path)
    if not path.exists():
        raise ValueError(
            f"training.data_path: {data_path!r} does not exist; "
            f"use '{STDLIB}' for the built-in corpus or a .txt/.jsonl file or a directory of them"
        )
    if path.is_file():
        return [path]
    files = sorted(f for f in path.rglob("*") if f.suffix in _DATA_SUFFIXES and f.is_file())
    if not files:
        raise ValueError(
            f"training.data_path: directory {data_path!r} holds no .txt or .jsonl files; add some or use '{STDLIB}'"
        )
    return files


def _bad(opts: _TextOptions, stats: dict[str, int], key: str, message: str) -> None:
    if opts.bad_data == "error":
        raise ValueError(f"training.data_path: {message}; or set training.bad_data: skip to drop and count such lines")
    stats[key] += 1


def _over_limit(opts: _TextOptions) -> str:
    return f"more than training.max_document_chars={opts.max_document_chars}; split it or raise the limit"


def _utf8_lines(
    path: Path, raw: bytes, opts: _TextOptions, stats: dict[str, int], first_line: int = 1, first_byte: int = 0
) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its newline) of every line that decodes. raw: the file,
    or a piece of it from line first_line, byte first_byte (file_documents)."""
    offset = 0  # of the line's first byte in raw
    for number, line in enumerate(raw.split(b"\n"), first_line):
        try:
            yield number, line.decode("utf-8")
        except UnicodeDecodeError as err:
            bad = offset + err.start
            problem = f"byte offset {first_byte + bad} ({line[err.start : err.start + 4]!r}...) is not UTF-8"
            _bad(opts, stats, "skipped_non_utf8", f"{path}:{number}: {problem}; re-encode the file as UTF-8")
        offset += len(line) + 1


def _text_documents(path: Path, raw: bytes, opts: _TextOptions, stats: dict[str, int]) -> list[str]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "\n".join(line for _, line in _utf8_lines(path, raw, opts, stats))
    return _split_text(path, text, opts, stats, 1)


def _split_text(path: Path, text: str, opts: _TextOptions, stats: dict[str, int], first_line: int) -> list[str]:
    """The documents of a .txt file's text (from its line first_line), the long ones dropped or
    named under training.max_document_chars."""
    docs = text.split(_DOC_SEP)
    if opts.max_document_chars is None:
        return docs
    kept, offset = [], 0
    for doc in docs:
        if len(doc) <= opts.max_document_chars:
            kept.append(doc)
        else:
            # Under "error" no line was dropped before, so the offset counts lines of the file.
            line = text.count("\n", 0, offset) + first_line
            problem = f"the document starting here has {len(doc)} characters, {_over_limit(opts)}"
            _bad(opts, stats, "skipped_too_long", f"{path}:{line}: {problem}")
        offset += len(doc) + len(_DOC_SEP)
    return kept


def _jsonl_documents(
    path: Path, raw: bytes, opts: _TextOptions, stats: dict[str, int], first_line: int = 1, first_byte: int = 0
) -> list[str]:
    docs = []
    field = {"text": opts.text_field, "prompt_response": opts.prompt_field, "messages": opts.messages_field}[opts.data_format]
    chat_format = (load_chat_format(opts.chat_format, opts.chat_template_kwargs) if opts.data_format == "messages"
                   else None)
    for number, line in _utf8_lines(path, raw, opts, stats, first_line, first_byte):
        if not line.strip():
            continue  # blank lines, e.g. a trailing newline, are no records
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            problem = f"not valid JSON ({err.msg} at column {err.colno})"
            _bad(opts, stats, "skipped_bad_json", f"{where}: {problem}; write one JSON object per line")
            continue
        if not isinstance(record, dict):
            fix = f"write one object per line, e.g. {{{json.dumps(field)}: \"...\"}}"
            _bad(opts, stats, "skipped_bad_json", f"{where}: a JSON {type(record).__name__}, not an object; {fix}")
            continue
        if chat_format is not None:
            records = _conversation(record, where, opts, stats, chat_format)
            if records is not None:
                docs.extend(records)
            continue
        keys = ("text_field",) if opts.data_format == "text" else ("prompt_field", "response_field")
        parts = [record.get(getattr(opts, key)) for key in keys]
        missing = next(((key, v) for key, v in zip(keys, parts) if not isinstance(v, str)), None)
        if missing is not None:
            key, value = missing
            found = "has no field" if value is None else f"has a {type(value).__name__}, not a string, in field"
            problem = f"the record {found} {getattr(opts, key)!r} (its keys: {sorted(record)[:8]})"
            _bad(opts, stats, "skipped_missing_field", f"{where}: {problem}; set training.{key} to the text's key")
            continue
        if opts.data_format == "prompt_response" and not parts[1].strip():
            problem = f"the response ({opts.response_field!r}) is empty: nothing to train on"
            _bad(opts, stats, "skipped_missing_field", f"{where}: {problem}; fill or drop the record")
            continue
        surrogate = next((m for m in map(_SURROGATE.search, parts) if m), None)
        if surrogate:
            problem = f"the text holds the lone surrogate escape \\u{ord(surrogate.group()):04x}, which is not UTF-8"
            _bad(opts, stats, "skipped_non_utf8", f"{where}: {problem}; fix the escape")
            continue
        size = sum(map(len, parts))
        if opts.max_document_chars is not None and size > opts.max_document_chars:
            problem = f"the document has {size} characters, {_over_limit(opts)}"
            _bad(opts, stats, "skipped_too_long", f"{where}: {problem}")
            continue
        docs.append(parts[0] if len(parts) == 1 else tuple(parts))
    return docs


def _conversation(record: dict, where: str, opts: _TextOptions, stats: dict[str, int], chat_format: dict):
    """A messages record's documents: [its render_messages pieces], or under training.chat_turns
    "split" (and "auto" where the template rewrites earlier turns, counted in
    stats["split_conversations"]) render_turns' records; None where it is bad data (reported by _bad)."""
    messages = record.get(opts.messages_field)
    roles = chat_format.get("roles")  # a Jinja template takes any role it knows (and raises on others)
    example = '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'
    if not isinstance(messages, list) or not messages:
        found = "has no field" if messages is None else f"has a {type(messages).__name__}, not a list of turns, in field"
        problem = f"the record {found} {opts.messages_field!r} (its keys: {sorted(record)[:8]})"
        _bad(opts, stats, "skipped_missing_field", f"{where}: {problem}; set training.messages_field to the "
             f"conversation's key, a list like {example}")
        return None
    for number, turn in enumerate(messages):
        role = turn.get("role") if isinstance(turn, dict) else None
        if not (isinstance(turn, dict) and isinstance(turn.get("content"), str)
                and (role in roles if roles is not None else isinstance(role, str))):
            allowed = f"one of {sorted(roles)}" if roles is not None else "a string"
            problem = f"turn {number} is {json.dumps(turn)[:80]}, not {{\"role\": {allowed}, \"content\": a string}}"
            _bad(opts, stats, "skipped_bad_json", f"{where}: {problem}; fix the turn (or add its role to "
                 "training.chat_format)")
            return None
    if not any(turn["role"] == "assistant" and turn["content"].strip() for turn in messages):
        _bad(opts, stats, "skipped_missing_field",
             f"{where}: the conversation has no assistant turn with content: nothing to train on; fill or drop the record")
        return None
    surrogate = next((m for m in (_SURROGATE.search(turn["content"]) for turn in messages) if m), None)
    if surrogate:
        problem = f"the text holds the lone surrogate escape \\u{ord(surrogate.group()):04x}, which is not UTF-8"
        _bad(opts, stats, "skipped_non_utf8", f"{where}: {problem}; fix the escape")
        return None
    size = sum(len(turn["content"]) for turn in messages)
    if opts.max_document_chars is not None and size > opts.max_document_chars:
        _bad(opts, stats, "skipped_too_long", f"{where}: the document has {size} characters, {_over_limit(opts)}")
        return None
    try:
        if opts.chat_turns == "split":
            return render_turns(messages, chat_format)
        try:
            return [render_messages(messages, chat_format)]
        except ChatTemplateRewrites:
            if opts.chat_turns == "whole":
                raise
        records = render_turns(messages, chat_format)
        stats["split_conversations"] += 1
        return records
    except ChatTemplateError as err:
        fix = ("set training.chat_turns: split (or auto) to train each assistant turn in its own record, "
               if isinstance(err, ChatTemplateRewrites) and opts.chat_turns == "whole" else "")
        _bad(opts, stats, "skipped_bad_json", f"{where}: {err}; {fix}write the format as a .json of per-role prefixes "
             "and suffixes (training.chat_format), or render the records to prompt / response pairs")
        return None


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _text_key(data_path: str, opts: _TextOptions) -> str:
    """A hash that changes whenever load_documents(data_path, **opts) would.

    Files are keyed by their bytes (not the parsed text, so that skip counts cached under
    a key belong to it); the stdlib corpus by its source files' stats, so that warm
    caches spare every rank the multi-second parse.
    """
    if not is_stdlib(data_path):
        root = Path(data_path)
        digests = []
        for path in _data_files(data_path):
            name = path.relative_to(root).as_posix() if root.is_dir() else path.name  # the suffix picks the format
            with open(path, "rb") as f:
                digests.append((name, hashlib.file_digest(f, "sha256").hexdigest()))
        return _sha256(json.dumps([_FILES_FORMAT_VERSION, _key_options(opts), digests]))
    root = stdlib_root(data_path[len(STDLIB) + 1 :])
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in _stdlib_files(root)]
    return _sha256(json.dumps([_STDLIB_CORPUS_VERSION, sys.version, str(root), stats]))


def _key_options(opts: _TextOptions) -> dict:
    """The options that change the text read; the prompt / response ones only where they apply
    (text data keeps the cache keys it had before they existed)."""
    options = asdict(opts)
    if opts.data_format == "text":
        del options["data_format"]
    if opts.data_format != "prompt_response":
        del options["prompt_field"], options["response_field"]
    if opts.data_format == "messages":  # a chat format file is keyed by what it holds (and its variables)
        options["chat_format"] = load_chat_format(opts.chat_format, opts.chat_template_kwargs)
    else:
        del options["messages_field"], options["chat_format"]
    if opts.data_format != "messages":
        del options["chat_turns"]
    del options["chat_template_kwargs"]  # in the loaded format's "kwargs" where they apply
    return options


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive lock on path + '.lock', shared by all processes that build path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Tokenizer:
    """A sentencepiece model: encode(str) -> ids, decode(ids) -> str, no BOS/EOS added."""

    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm

        self.model_path = Path(model_path)
        model_proto = self.model_path.read_bytes()
        self.sha256 = _sha256(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size: int = self._sp.vocab_size()
        self.eos_id: int = self._sp.eos_id()
        self.pad_id: int = self._sp.pad_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=2)

    def decode(self, ids: list[int] | torch.Tensor | np.ndarray) -> str:
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            ids = ids.tolist()
        return self._sp.decode(ids)


# End-of-text tokens of the common Hugging Face tokenizers, tried in order where tokenizer_config.json
# names none (Qwen's, Llama 3's, DeepSeek's, GPT-2's and sentencepiece-style </s>).
HF_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "</s>", "<eos>")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (a released model's own tokenizer, as
    tools/convert_checkpoint.py copies it into a converted run): the interface of Tokenizer.
    Documents end with the end-of-text token: tokenizer_config.json's eos_token beside the file
    where it names one, else the first of HF_EOS_TOKENS the vocabulary has. No special tokens
    are added in encoding."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as _HF

        self.model_path = Path(path)
        data = self.model_path.read_bytes()
        self.sha256 = _sha256(data)
        self._tok = _HF.from_str(data.decode("utf-8"))
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        eos = None
        config_path = self.model_path.with_name("tokenizer_config.json")
        if config_path.is_file():
            eos = json.loads(config_path.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
        candidates = ([eos] if eos else []) + list(HF_EOS_TOKENS)
        ids = [self._tok.token_to_id(t) for t in candidates]
        found = next(((t, i) for t, i in zip(candidates, ids) if i is not None), None)
        if found is None:
            raise ValueError(
                f"training.tokenizer_model: {path} has no end-of-text token (tried {', '.join(candidates)}); "
                "put a tokenizer_config.json naming its eos_token beside it"
            )
        self.eos_token, self.eos_id = found
        self.pad_id: int = self.eos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int] | torch.Tensor | np.ndarray) -> str:
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            ids = ids.tolist()
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(path: str | os.PathLike) -> "Tokenizer | HFTokenizer":
    """training.tokenizer_model: a Hugging Face tokenizer.json (any *.json), else a sentencepiece .model."""
    return HFTokenizer(path) if str(path).endswith(".json") else Tokenizer(path)


def tokenizer_files(tokenizer: "Tokenizer | HFTokenizer") -> dict[str, Path]:
    """{name in a run's output_dir: the file}: what a run keeps of its tokenizer."""
    if isinstance(tokenizer, HFTokenizer):
        files = {"tokenizer.json": tokenizer.model_path}
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            if tokenizer.model_path.with_name(name).is_file():
                files[name] = tokenizer.model_path.with_name(name)
        return files
    return {"tokenizer.model": tokenizer.model_path}


def get_tokenizer(data_path: str, vocab_size: int, cache_dir: str | os.PathLike, **options) -> Tokenizer:
    """The BPE tokenizer of data_path's text (read as load_text reads it; options as
    load_documents'), trained on first use and then loaded from cache_dir."""
    opts = _TextOptions(**options)
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"model.vocab_size: {vocab_size} is too small; byte_fallback needs 256 byte pieces "
            f"+ 4 specials, so use at least {_MIN_VOCAB} (512 or more in practice)"
        )
    options = {"spm": _SPM_OPTIONS, "max_train_sentences": _MAX_TRAIN_SENTENCES}
    key = _sha256(json.dumps({"text": _text_key(data_path, opts), "vocab_size": vocab_size, **options}, sort_keys=True))
    model_path = Path(cache_dir) / f"spm-bpe-v{vocab_size}-{key[:16]}.model"
    with _locked(model_path):
        if not model_path.exists():
            model_proto = _train_sentencepiece(load_text(data_path, **asdict(opts)), vocab_size)
            _atomic_write(model_path, lambda f: f.write(model_proto))
    return Tokenizer(model_path)


def _train_sentencepiece(text: str, vocab_size: int) -> bytes:
    import sentencepiece as spm

    # sentencepiece trains on lines; newlines themselves are encoded through byte_fallback
    lines = [line for line in text.split("\n") if line.strip()]
    stride = -(-len(lines) // _MAX_TRAIN_SENTENCES)  # ceil: a deterministic subsample, unlike spm's shuffle
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines[::stride]),
            model_writer=model,
            vocab_size=vocab_size,
            num_threads=2,
            minloglevel=2,
            **_SPM_OPTIONS,
        )
    except RuntimeError as err:
        raise ValueError(
            f"model.vocab_size: sentencepiece could not build {vocab_size} pieces from training.data_path "
            f"({len(text.encode())} bytes): {err}; use a smaller vocab size or more text"
        ) from err
    return model.getvalue()


SHUFFLE_TABLE_MAX = 1 << 26  # samples from which an epoch's order is keyed_shuffle, not a table (256 MB)
_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that mixes every bit into every bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=64)
def _shuffle_keys(seed: int, epoch: int, rounds: int) -> tuple[int, ...]:
    return tuple(int(k) for k in np.random.SeedSequence([seed, epoch, 0x5EED]).generate_state(rounds, np.uint64))


def keyed_shuffle(position: int, n: int, seed: int, epoch: int, rounds: int = 6) -> int:
    """The position-th element of a permutation of range(n) drawn from (seed, epoch), computed
    alone in O(1) time and memory: a balanced Feistel network over the 2h-bit integers
    (2^(2h) >= n), whose round function is splitmix64 keyed per round, walked until it lands
    below n (a bijection of range(n); under 4 steps on average, as 2^(2h) < 4 n)."""
    if not 0 <= position < n:
        raise ValueError(f"position must be in [0, {n}), got {position}")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = _shuffle_keys(seed, epoch, rounds)
    x = position
    while True:
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        x = (left << half) | right
        if x < n:
            return x


class TokenDataset:
    """The corpus as one token stream cut into num_samples samples of S + 1 tokens.

    Documents (those of load_documents) are followed by eos_id. get(i) reads sample
    perm_e[i % num_samples] of epoch e = i // num_samples, where perm_e is a permutation
    seeded by (seed, e) (numpy's below SHUFFLE_TABLE_MAX samples, else keyed_shuffle): every
    index is valid and the order is deterministic.
    data_stats counts the lines skipped under bad_data="skip" (keys STAT_KEYS), also
    when the tokens come from the cache. Under data_format "prompt_response" each record is
    its prompt's tokens, its response's and eos_id, packed into the stream like documents (a
    sample's attention reaches the records before it in the sample), and `trained` marks the
    response's tokens and the eos: the labels of the others are IGNORE_INDEX. Under "messages"
    a record is its rendered pieces' tokens and eos_id, and `trained` marks the assistant turns'
    pieces (the eos, a separator, is not trained). Each piece is tokenized alone, and a record
    whose last piece ends with eos_id already gets no second one.

    packing "stream" (the default) cuts the stream every S tokens, so a document or record may
    start in one sample and end in the next, which then sees its end without its beginning.
    packing "fit" keeps them whole: consecutive ones fill a sample while they fit in S + 1 tokens
    (next fit, in stream order), the rest of the sample is padding (eos_id, labels IGNORE_INDEX);
    one longer than a sample is cut as the stream would cut it (cut_records counts them).
    packing "best_fit" keeps them whole too, but fills samples out of stream order (best fit
    decreasing: longest first, each into the fullest sample it fits), so fewer positions are
    padding; a sample is then its pieces' tokens one after another (spans / sample_pieces).
    masked_labels says whether some labels are IGNORE_INDEX (the loss then averages over the rest).
    """

    def __init__(
        self,
        data_path: str,
        tokenizer: Tokenizer,
        seq_length: int,
        cache_dir: str | os.PathLike,
        seed: int,
        packing: str = "stream",
        **options,
    ):
        if seq_length < 1:
            raise ValueError(f"training.seq_length must be >= 1, got {seq_length}")
        if packing not in PACKINGS:
            raise ValueError(f"training.packing: {packing!r} is not one of {', '.join(PACKINGS)}")
        self.seq_length = seq_length
        self.seed = seed
        self.packing = packing
        self.pad_id = tokenizer.eos_id
        opts = _TextOptions(**options)
        self.indexed = indexed_prefix(data_path)  # a Megatron indexed dataset's prefix, or None
        self._id_limit = None
        if self.indexed is None:
            # [num_tokens] int32, [num_tokens] uint8 (records) or None, [documents] int64 ends, the skip counts
            self.tokens, self.trained, self.ends, self.data_stats, ids_path = _cached_token_ids(
                data_path, tokenizer, Path(cache_dir), opts)
        else:  # token ids made offline: the .bin memory-mapped as the stream, nothing tokenized
            if opts.data_format != "text":
                raise ValueError(f"training.data_format: {opts.data_format} reads .jsonl records; {data_path!r} is an "
                                 "indexed dataset of token ids (documents only): use data_format text")
            stat = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns)
                    for f in (self.indexed + ".bin", self.indexed + ".idx")]
            ids_path = Path(cache_dir) / f"indexed-{_sha256(json.dumps(stat))[:16]}.npy"  # names the packing's cache
            with _locked(ids_path):  # the document ends made once per host, memory-mapped by its ranks
                self.tokens, self.ends = read_indexed(self.indexed, ids_path.with_name(f"{ids_path.stem}.ends-v1.i64"))
            self.trained, self.data_stats = None, dict.fromkeys(STAT_KEYS, 0)
            self._id_limit = tokenizer.vocab_size
            self._check_ids(self.tokens[:1 << 20], "its first tokens hold")
        self.masked_labels = self.trained is not None or packing != "stream"
        # fit packings: the stream ranges [P, 2] a sample is made of, sample i's being
        # spans[sample_pieces[i] : sample_pieces[i + 1]] (one per sample under "fit")
        self.spans = self.sample_pieces = None
        self.cut_records = 0
        if packing != "stream":
            self.spans, self.sample_pieces, self.cut_records = _cached_packing(ids_path, self.ends, seq_length, packing)
        self.num_samples = (len(self.sample_pieces) - 1 if self.spans is not None
                            else (len(self.tokens) - 1) // seq_length)
        if self.num_samples < 1:
            raise ValueError(
                f"training.seq_length: {seq_length} is too long for {data_path!r}, which has "
                f"{len(self.tokens)} tokens; use at most {len(self.tokens) - 1} or more text"
            )
        self._epoch_perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        """Samples per epoch; get() accepts any index >= 0."""
        return self.num_samples

    def _permutation(self, epoch: int) -> np.ndarray:
        """perm_e of an epoch below SHUFFLE_TABLE_MAX samples (int32)."""
        if self._epoch_perm is None or self._epoch_perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_perm = (epoch, rng.permutation(self.num_samples).astype(np.int32))
        return self._epoch_perm[1]

    def _sample_at(self, epoch: int, position: int) -> int:
        """perm_e[position]: numpy's permutation below SHUFFLE_TABLE_MAX samples, above it
        keyed_shuffle (8 us a sample, benchmarks/results/cpu/packing.json), which holds no table (a table per rank and epoch would take 4 bytes a
        sample: 15 GB for 15T tokens of 4096-token samples, and a minute to draw)."""
        if self.num_samples < SHUFFLE_TABLE_MAX:
            return int(self._permutation(epoch)[position])
        return keyed_shuffle(position, self.num_samples, self.seed, epoch)

    def _pieces(self, sample_index: int) -> list[tuple[int, int]]:
        """The stream ranges [start, end) of the sample_index-th sample consumed, one after
        another its window: its S (or fewer) input tokens and, one further, the last label."""
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0 (the number of samples consumed), got {sample_index}")
        epoch, position = divmod(sample_index, self.num_samples)
        sample = self._sample_at(epoch, position)
        if self.spans is None:
            return [(sample * self.seq_length, sample * self.seq_length + self.seq_length + 1)]
        pieces = self.spans[self.sample_pieces[sample] : self.sample_pieces[sample + 1]]
        return [(int(a), int(b)) for a, b in pieces]

    def record_starts(self, sample_index: int) -> list[int]:
        """Positions p in (0, S) of the sample's input tokens where a document / record begins
        (training.isolate_records starts a sequence there): from the stored document ends, not
        from eos tokens, which a text may spell out or a chat format may end every turn with;
        and where each of a best-fit sample's pieces begins."""
        starts: list[int] = []
        offset = 0
        for start, end in self._pieces(sample_index):
            if offset:
                starts.append(offset)
            inside = self.ends[np.searchsorted(self.ends, start, side="right") : np.searchsorted(self.ends, end - 1)]
            starts.extend((inside - start + offset).tolist())
            offset += end - start
        return [p for p in starts if p < self.seq_length]

    def _check_ids(self, ids: np.ndarray, where: str) -> None:
        """An indexed dataset's ids against the tokenizer's size: one made with another tokenizer
        stops here, naming it, rather than in the embedding (a CUDA device assert)."""
        if ids.size and int(ids.max()) >= self._id_limit:
            raise ValueError(f"training.tokenizer_model: {self.indexed}: {where} token id {int(ids.max())}, "
                             f"outside the tokenizer's {self._id_limit} pieces; give the tokenizer the data was made "
                             "with")

    def get(self, sample_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [S] int64, labels [S] int64) of the sample_index-th sample consumed."""
        pieces = self._pieces(sample_index)
        # one copy of the (memory-mapped) pieces, cast as they are joined
        joined = np.concatenate([self.tokens[a:b] for a, b in pieces], dtype=np.int64)
        if self._id_limit is not None:
            self._check_ids(joined, f"sample {sample_index} holds")
        window = torch.from_numpy(joined)
        labels = window[1:]  # window: [n + 1], n <= S
        if self.trained is not None:
            trained = np.concatenate([self.trained[a:b] for a, b in pieces])[1:].astype(np.bool_)
            labels = labels.masked_fill(~torch.from_numpy(trained), IGNORE_INDEX)  # [n]
        pad = self.seq_length - labels.numel()  # fit packing: the sample's unused tail
        if pad:
            return (torch.cat([window[:-1], window.new_full((pad,), self.pad_id)]),
                    torch.cat([labels, labels.new_full((pad,), IGNORE_INDEX)]))  # fmt: skip
        return window[:-1], labels


BLEND_BLOCK = 10_000  # samples per block of a blend: each dataset's share is a whole number of them


class BlendedDataset:
    """Several datasets' samples in the proportions of their weights (Megatron's data blend,
    "0.3 P1 0.7 P2"), with TokenDataset's interface.

    Stateless as TokenDataset: every block of BLEND_BLOCK consecutive samples holds n_d samples of
    dataset d (its weight's share, rounded by largest remainder), spread through the block (the
    j-th at position (j + 1/2) / n_d of it, merged in order); block b's samples of d are d's
    samples b n_d .. (b + 1) n_d - 1, so a dataset smaller than its share repeats, each pass in a
    new order, as TokenDataset's epochs do."""

    def __init__(self, weights: list[float], parts: list[TokenDataset], paths: list[str]):
        w = np.asarray(weights, dtype=np.float64)
        if np.any(w <= 0) or not np.all(np.isfinite(w)):
            raise ValueError(f"training.data_path: blend weights must be positive numbers, got {weights}")
        share = w / w.sum() * BLEND_BLOCK
        counts = np.floor(share).astype(np.int64)
        extra = np.argsort(-(share - counts), kind="stable")[: BLEND_BLOCK - int(counts.sum())]
        counts[extra] += 1
        if np.any(counts == 0):
            small = paths[int(np.argmin(counts))]
            raise ValueError(f"training.data_path: {small!r} has a weight under 1/{BLEND_BLOCK} of the blend's; "
                             "raise it or leave the dataset out")
        keys = np.concatenate([(np.arange(n) + 0.5) / n for n in counts])
        order = np.argsort(keys, kind="stable")
        self._which = np.repeat(np.arange(len(parts)), counts)[order]  # [BLEND_BLOCK] dataset of each position
        self._local = np.concatenate([np.arange(n) for n in counts])[order]  # its sample within the block's share
        self.counts, self.parts, self.paths = counts, parts, paths
        self.weights = (w / w.sum()).tolist()
        self.seq_length = parts[0].seq_length
        self.packing = parts[0].packing
        self.masked_labels = any(p.masked_labels for p in parts)
        self.num_samples = sum(p.num_samples for p in parts)
        keys = dict.fromkeys(k for p in parts for k in p.data_stats)  # the parts' counts, summed
        self.data_stats = {k: sum(p.data_stats.get(k, 0) for p in parts) for k in keys}

    def __len__(self) -> int:
        return self.num_samples

    def _where(self, sample_index: int) -> tuple[TokenDataset, int]:
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0 (the number of samples consumed), got {sample_index}")
        block, position = divmod(sample_index, BLEND_BLOCK)
        d = int(self._which[position])
        return self.parts[d], block * int(self.counts[d]) + int(self._local[position])

    def get(self, sample_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, index = self._where(sample_index)
        return part.get(index)

    def record_starts(self, sample_index: int) -> list[int]:
        part, index = self._where(sample_index)
        return part.record_starts(index)


def open_dataset(data_path: str, tokenizer, seq_length: int, cache_dir, seed: int, packing: str = "stream",
                 **options) -> "TokenDataset | BlendedDataset":
    """data_path's samples: a TokenDataset, or for a blend ("w1 path1 w2 path2 ...") a
    BlendedDataset of one TokenDataset per path."""
    blend = parse_blend(data_path)
    if blend is None:
        return TokenDataset(data_path, tokenizer, seq_length, cache_dir, seed, packing=packing, **options)
    _open_files_for(len(blend))
    try:
        parts = [TokenDataset(path, tokenizer, seq_length, cache_dir, seed, packing=packing, **options)
                 for _, path in blend]
    except OSError as e:
        if e.errno != errno.EMFILE:
            raise
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise ValueError(_too_many_files(len(blend), _open_now() + len(blend) * FILES_PER_PART + OTHER_FILES,
                                         soft, hard)) from e
    return BlendedDataset([w for w, _ in blend], parts, [path for _, path in blend])


FILES_PER_PART = 3  # memory maps a dataset of a blend holds at most: its tokens, document ends, packing
OTHER_FILES = 256  # kept free for everything else a rank opens (sockets, logs, checkpoints)


def _open_files_for(parts: int) -> None:
    """A blend of many datasets holds FILES_PER_PART memory maps each, and each map an open file:
    hundreds of datasets pass the usual soft limit of 1024 open files ("Too many open files"),
    so the soft limit is raised toward the hard one (as far as 65536) where it is too low; past
    the hard limit the blend stops here, naming the fix, before anything is opened."""
    need = _open_now() + parts * FILES_PER_PART + OTHER_FILES  # a held-out blend comes on top of the training one
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise ValueError(_too_many_files(parts, need, soft, hard))
    target = max(need, 65536)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target if hard == resource.RLIM_INFINITY else min(target, hard), hard))


def _open_now() -> int:
    """Files this process has open (Linux; 0 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _too_many_files(parts: int, need: int, soft: int, hard: int) -> str:
    return (f"training.data_path: a blend of {parts} datasets holds up to {parts * FILES_PER_PART} memory-mapped "
            f"files, more than this process may open (open files: {soft}, hard limit {hard}); raise the hard limit "
            f"to at least {need} (ulimit -Hn, the container's nofile, /etc/security/limits.conf) or blend fewer, "
            "larger datasets")


def fit_spans(ends: np.ndarray, seq_length: int) -> tuple[np.ndarray, int]:
    """training.packing "fit": ([samples, 2] int64 (start, end) ranges of the token stream, each at
    most S + 1 tokens of whole documents in stream order (next fit), and how many documents were
    longer than a sample and cut into S + 1-token pieces overlapping by one, as the stream cuts).
    ends: where each document ends (exclusive), ascending."""
    from array import array

    spans = array("q")  # (start, end) pairs: 16 bytes a sample (a list of tuples took about 100)
    cut = 0
    start = prev = 0  # the open sample's start; the previous document's end
    for first in range(0, len(ends), _FIT_SLICE):  # a slice of Python ints at a time
        for end in ends[first : first + _FIT_SLICE].tolist():
            if end - prev > seq_length + 1:  # longer than a sample: close the open one, cut this one
                cut += 1
                if prev - start > 1:
                    spans.extend((start, prev))
                start = prev
                while end - start > seq_length + 1:
                    spans.extend((start, start + seq_length + 1))
                    start += seq_length
            elif end - start > seq_length + 1:  # does not fit after the open sample's documents
                spans.extend((start, prev))
                start = prev
            prev = end
    if prev - start > 1:
        spans.extend((start, prev))
    return np.frombuffer(spans, dtype=np.int64).reshape(-1, 2).copy(), cut


_FIT_SLICE = 1 << 20  # documents fit_spans turns into Python ints at a time


def best_fit_pieces(ends: np.ndarray, seq_length: int) -> tuple[np.ndarray, np.ndarray, int]:
    """training.packing "best_fit": ([P, 2] int64 (start, end) pieces of the token stream,
    [samples + 1] int64 offsets: sample i is pieces[offsets[i] : offsets[i + 1]] one after
    another, at most S + 1 tokens; and how many documents were longer than a sample).

    Each document is one piece, placed longest first into the sample with the least room that
    still holds it, a new sample where none does (best fit decreasing; of samples with equal room
    the one that had it first, so the result is deterministic). A document longer than a sample
    is cut as the stream cuts it (S + 1-token pieces overlapping by one, each a sample of its own)
    and its remainder placed like a document. ends: where each document ends (exclusive),
    ascending.

    Pieces of one length L go in together (0.24-0.70 s per million documents on one core, 20-44x
    faster than one at a time: benchmarks/results/cpu/packing.json): a sample with room r >= L,
    once the least room that holds L, stays the least (r - L is smaller, and no sample had a room
    in [L, r)), so it takes r // L pieces in a row and is left with r % L. The samples with room >= L therefore take the pieces room by room, ascending,
    each room's samples in the order they got it; the rest open new samples of cap // L pieces."""
    cap = seq_length + 1
    ends = np.asarray(ends, dtype=np.int64)
    starts = np.concatenate([np.zeros(1, np.int64), ends])[:-1]
    lengths = ends - starts
    cuts = np.where(lengths > cap, -(-(lengths - cap) // seq_length), 0)  # S + 1-token pieces per document
    nth = np.arange(cuts.sum()) - np.repeat(np.cumsum(cuts) - cuts, cuts)  # each cut piece's place in its document
    full_starts = np.repeat(starts, cuts) + seq_length * nth
    full = np.stack([full_starts, full_starts + cap], axis=1)
    item_starts = starts + seq_length * cuts
    keep = ends - item_starts > 1  # a one-token record, or a cut's one-token rest, holds no label
    items = np.stack([item_starts[keep], ends[keep]], axis=1)
    sizes = items[:, 1] - items[:, 0]
    order = np.argsort(-sizes, kind="stable")  # longest first; of equal length, in stream order
    free: dict[int, list] = {}  # room -> [samples with that room in the order they got it, how many of them are gone]
    rooms: list[int] = []  # the rooms some sample has, ascending
    placed_in: list[np.ndarray] = []  # the sample of each piece, in the order they are placed
    samples = 0
    bounds = np.flatnonzero(np.diff(sizes[order])) + 1
    for group in np.split(order, bounds) if len(order) else []:
        length, need, done = int(sizes[group[0]]), len(group), 0
        moves: list[tuple[int, list]] = []  # (new room, samples), applied once the group is placed
        at = bisect.bisect_left(rooms, length)
        while done < need and at < len(rooms):
            room = rooms[at]
            queue, gone = free[room]
            each, waiting = room // length, len(queue) - gone
            whole = min(waiting, (need - done) // each)  # samples that take `each` pieces
            taken = queue[gone : gone + whole]
            placed_in.append(np.repeat(np.asarray(taken, dtype=np.int64), each))
            done += whole * each
            moves.append((room % length, taken))
            if done < need and whole < waiting:  # the last pieces of the group: fewer than `each`
                part, sample = need - done, queue[gone + whole]
                placed_in.append(np.full(part, sample, dtype=np.int64))
                done, whole = need, whole + 1
                moves.append((room - part * length, [sample]))
            if gone + whole == len(queue):
                del free[room], rooms[at]
            else:
                free[room][1] = gone + whole
                at += 1
        if done < need:  # new samples of cap // length pieces, the last of what is left
            each, left = cap // length, need - done
            new = samples + np.arange(-(-left // each), dtype=np.int64)
            placed_in.append(np.repeat(new, each)[:left])
            samples += len(new)
            last = left - (len(new) - 1) * each
            moves.append((cap % length, new[:-1].tolist() if last < each else new.tolist()))
            if last < each:
                moves.append((cap - last * length, [int(new[-1])]))
        for room, moved in moves:
            if room > 0 and moved:
                if room not in free:
                    free[room] = [[], 0]
                    bisect.insort(rooms, room)
                free[room][0].extend(moved)
    sample_of = np.concatenate(placed_in) if placed_in else np.zeros(0, np.int64)
    by_sample = np.argsort(sample_of, kind="stable")  # each sample's pieces in the order placed
    pieces = np.concatenate([full, items[order][by_sample]]).reshape(-1, 2)
    counts = np.concatenate([np.ones(len(full), np.int64), np.bincount(sample_of, minlength=samples)])
    return pieces, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), int((cuts > 0).sum())


ENCODE_BATCH = 1024  # documents tokenized at a time when a run tokenizes its text


def batches(pieces: Iterator[tuple[list, dict]], size: int) -> Iterator[tuple[list, dict]]:
    """(documents, counts) pieces cut into at most size documents each (the counts with the first);
    a piece with none stays one (its counts)."""
    for docs, counts in pieces:
        for i in range(0, max(len(docs), 1), size):
            yield docs[i : i + size], counts if i == 0 else {}


class _NpyWriter:
    """A 1-D .npy file written a piece at a time, whose length is known only at the end: a
    temporary file beside path with a header of fixed size, rewritten with the length at
    publish(), then renamed (readers see no file or the whole one)."""

    HEADER = 128  # bytes: magic, version 1.0, the header's length, its dict padded with spaces

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = temp_beside(path)
        self.file = os.fdopen(fd, "wb")
        self.file.write(b"\0" * self.HEADER)

    def write(self, array: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes())
        self.count += len(array)

    def publish(self) -> None:
        text = repr({"descr": self.dtype.str, "fortran_order": False, "shape": (self.count,)})
        text = text.encode("latin1").ljust(self.HEADER - 10 - 1) + b"\n"
        self.file.seek(0)
        self.file.write(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        publish(self.tmp, self.path)
        self.tmp = None

    def abort(self) -> None:
        """Removes the temporary file where publish() did not run."""
        if self.tmp is not None:
            self.file.close()
            os.unlink(self.tmp)
            self.tmp = None


def _cached_token_ids(
    data_path: str, tokenizer: Tokenizer, cache_dir: Path, opts: _TextOptions
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, dict[str, int]]:
    key = _sha256(f"{_text_key(data_path, opts)}-{tokenizer.sha256}")
    ids_path = cache_dir / f"tokens-{key[:16]}.npy"
    stats_path = cache_dir / f"tokens-{key[:16]}.stats.json"  # the skip counts of the text behind ids_path
    masked = opts.data_format != "text"
    trained_path = cache_dir / f"tokens-{key[:16]}.trained.npy"  # records: which tokens are trained
    ends_path = cache_dir / f"tokens-{key[:16]}.ends.npy"  # where each document / record ends in the stream
    with _locked(ids_path):
        if not (ids_path.exists() and stats_path.exists() and ends_path.exists() and (trained_path.exists() or not masked)):
            # block by block (document_pieces): the text, its ids and their lists are never held whole
            # (a Python list of ids took 36 bytes a token), only each block's; the files appear at the end
            writers = {"ids": _NpyWriter(ids_path, np.int32), "ends": _NpyWriter(ends_path, np.int64)}
            if masked:
                writers["trained"] = _NpyWriter(trained_path, np.uint8)
            try:
                stats = _new_stats(opts)
                total = 0  # tokens written
                last = -1  # the last token written (a record's last piece may end with the eos)
                for docs, counts in batches(document_pieces(data_path, **asdict(opts)), ENCODE_BATCH):
                    add_counts(stats, counts)
                    ids: list[int] = []
                    trained: list[int] = []
                    ends: list[int] = []
                    if masked:  # records: each piece tokenized alone, the record closed by an eos
                        records = [_record_pieces(doc) for doc in docs]
                        encoded = iter(tokenizer.encode_batch([text for pieces, _ in records for text, _ in pieces]))
                        for pieces, eos_trained in records:
                            for _, piece_trained in pieces:
                                piece = next(encoded)
                                ids.extend(piece)
                                trained.extend([int(piece_trained)] * len(piece))
                            if (ids[-1] if ids else last) != tokenizer.eos_id:  # not where the last piece ends with it
                                ids.append(tokenizer.eos_id)
                                trained.append(int(eos_trained))
                            ends.append(total + len(ids))
                        writers["trained"].write(np.asarray(trained, dtype=np.uint8))
                    else:
                        for doc_ids in tokenizer.encode_batch([doc for doc in docs if doc.strip()]):
                            ids.extend(doc_ids)
                            ids.append(tokenizer.eos_id)
                            ends.append(total + len(ids))
                    writers["ids"].write(np.asarray(ids, dtype=np.int32))
                    writers["ends"].write(np.asarray(ends, dtype=np.int64))
                    total += len(ids)
                    last = ids[-1] if ids else last
                writers["ends"].publish()
                _atomic_write(stats_path, lambda f: f.write(json.dumps(stats, sort_keys=True).encode()))
                if masked:
                    writers["trained"].publish()
                writers["ids"].publish()  # last: its presence says the rest is there
            finally:
                for writer in writers.values():
                    writer.abort()
        stats = json.loads(stats_path.read_text())
    trained_array = np.load(trained_path, mmap_mode="r") if masked else None
    return np.load(ids_path, mmap_mode="r"), trained_array, np.load(ends_path), stats, ids_path


def _cached_packing(ids_path: Path, ends: np.ndarray, seq_length: int, packing: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(pieces, offsets, cut) of packing "fit" (fit_spans: one piece a sample) or "best_fit"
    (best_fit_pieces), computed once per token cache and sample length and kept beside the tokens
    (either takes under a second per million records), under the tokens' lock so that the ranks of
    a launch compute it once; memory-mapped, so the ranks of a host share one copy (a corpus of
    100M documents: about 1.7 GB)."""
    version = {"fit": "fit-v1", "best_fit": "best_fit-v2"}[packing]  # v: of the function / the file's layout
    path = ids_path.with_name(f"{ids_path.stem}.{version}-{seq_length}.npy")
    with _locked(ids_path):
        if not path.exists():
            if packing == "fit":
                pieces, cut = fit_spans(ends, seq_length)
                offsets = np.arange(len(pieces) + 1)
            else:
                pieces, offsets, cut = best_fit_pieces(ends, seq_length)
            flat = np.concatenate([[cut, len(pieces)], pieces.reshape(-1), offsets]).astype(np.int64)
            _atomic_write(path, lambda f: np.save(f, flat))
    flat = np.load(path, mmap_mode="r")  # [cut, P, pieces (2 P), offsets (samples + 1)]
    count = int(flat[1])
    return flat[2 : 2 + 2 * count].reshape(count, 2), flat[2 + 2 * count :], int(flat[0])


def pack_records(tokens: torch.Tensor, record_starts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch [N, S] as one packed row [1, N S] and its cu_seqlens [R + 1] int32: a
    sequence starts at every sample and at each of its record starts (batch_record_starts), so
    attention (and the linear attention's state) stays inside each record
    (training.isolate_records). Fit packing's padding stays with the record it follows."""
    n, s = tokens.shape
    if len(record_starts) != n:
        raise ValueError(f"record_starts: one list per sample, got {len(record_starts)} for {n} samples")
    flat = tokens.reshape(1, n * s)
    inside = [i * s + p for i, starts in enumerate(record_starts) for p in starts if 0 < p < s]
    starts = torch.cat([torch.arange(0, n * s, s), torch.tensor(inside, dtype=torch.int64), torch.tensor([n * s])])
    return flat, torch.unique(starts).to(torch.int32)  # sorted, each once


def batch(dataset: TokenDataset, start_sample: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples start_sample .. start_sample + num_samples - 1: (tokens [N, S], labels [N, S]) int64."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    pairs = [dataset.get(i) for i in range(start_sample, start_sample + num_samples)]
    return torch.stack([t for t, _ in pairs]), torch.stack([l for _, l in pairs])


def batch_record_starts(dataset: TokenDataset, start_sample: int, num_samples: int) -> list[list[int]]:
    """Where records begin inside each sample of batch(dataset, start_sample, num_samples)."""
    return [dataset.record_starts(i) for i in range(start_sample, start_sample + num_samples)]
