"""Typed registries: a name maps to a class or function; config validation asks what exists.

Entries are registered as "module:attribute" strings and imported on first use, so the
config can validate names without importing Megatron or the layers.
"""

import importlib
from typing import Any, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, what: str, entries: dict[str, str] | None = None):
        self.what = what
        self._paths: dict[str, str] = dict(entries or {})
        self._loaded: dict[str, T] = {}

    def register(self, name: str, target: "str | T") -> None:
        if isinstance(target, str):
            self._paths[name] = target
            self._loaded.pop(name, None)
        else:
            self._paths[name] = f"<object {target!r}>"
            self._loaded[name] = target

    def names(self) -> list[str]:
        return sorted(self._paths)

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> T:
        if name not in self._paths:
            raise ValueError(f"unknown {self.what} {name!r}; registered: {', '.join(self.names())}")
        if name not in self._loaded:
            module, _, attr = self._paths[name].partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]


# Pattern letters of the hybrid layer stack -> the self-attention module of that layer.
LAYER_KINDS: Registry[Any] = Registry(
    "layer pattern letter",
    {
        "L": "megatron_moe_hybrid.layers.linear_attention:LinearAttention",
        "S": "megatron_moe_hybrid.layers.sparse_attention:SparseAttention",
        "A": "megatron_moe_hybrid.layers.gated_attention:GatedAttention",  # Qwen3-Next full attention
        "M": "megatron_moe_hybrid.layers.mla_attention:MLAttention",  # DeepSeek-V3.2 MLA + indexer top-k
    },
)

LINEAR_ATTENTION_VARIANTS: Registry[Any] = Registry(
    "linear_attention.variant",
    {
        "gated_delta_rule": "megatron_moe_hybrid.ops.linear_attention:gated_delta_rule",
        "simple_gla": "megatron_moe_hybrid.ops.linear_attention:simple_gla",
    },
)

MOE_DISPATCHERS: Registry[Any] = Registry(
    "moe.dispatcher",
    {
        "alltoall": "megatron_moe_hybrid.layers.moe.dispatcher:AllToAllDispatcher",
        "static": "megatron_moe_hybrid.layers.moe.dispatcher:StaticAllToAllDispatcher",
    },
)

ROUTER_SCORE_FUNCS = ("softmax", "sigmoid")
SPARSE_ATTENTION_STAGES = ("sparse", "dense_warmup")
# training.data_format: "text": documents, every token trained; "prompt_response": .jsonl records
# of a prompt and a response, the loss on the response's tokens (and the end of sequence after it);
# "messages": .jsonl records of a conversation (a list of {"role", "content"}) rendered turn by turn
# in training.chat_format, the loss on the assistant turns' content and end-of-turn marker
DATA_FORMATS = ("text", "prompt_response", "messages")
# training.packing: "stream": the token stream cut every seq_length tokens (documents may straddle
# samples); "fit": whole documents / records per sample (next fit in stream order), the rest padded
# and ignored by the loss; "best_fit": whole too, samples filled longest first (less padding)
PACKINGS = ("stream", "fit", "best_fit")
# training.chat_turns (data_format "messages"): "whole": one record per conversation, cut from the
# renderings of its turns (a template that renders earlier turns differently once later ones follow,
# as Qwen3's drops their thinking, cannot be cut: the record is bad data); "split": one record per
# assistant turn, the conversation before it as the template renders it for generation (untrained)
# and the turn (trained); "auto": whole where the template allows, else split (counted)
CHAT_TURNS = ("auto", "whole", "split")
# training.chat_format presets: the text before the conversation (bos), each role's text before and
# after its content (an assistant turn trains its content and its suffix, the end-of-turn marker the
# model learns to stop at), and the separator after every turn (untrained). A .json file of the same
# keys defines another format.
_ROLES = ("system", "user", "assistant")
CHAT_FORMATS = {
    # Qwen's (Qwen3-Next-Instruct's template for plain turns) and many others'
    "chatml": {"bos": "", "roles": {r: [f"<|im_start|>{r}\n", "<|im_end|>"] for r in _ROLES}, "separator": "\n"},
    # DeepSeek-V3.1's and V3.2's non-thinking mode (their model cards): the assistant's turn opens
    # with </think> and ends with the end of sentence, which is also their eos
    "deepseek_v3.1": {
        "bos": "<｜begin▁of▁sentence｜>",
        "roles": {
            "system": ["", ""],
            "user": ["<｜User｜>", ""],
            "assistant": ["<｜Assistant｜></think>", "<｜end▁of▁sentence｜>"],
        },
        "separator": "",
    },
    # Llama 3's
    "llama3": {
        "bos": "<|begin_of_text|>",
        "roles": {r: [f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>"] for r in _ROLES},
        "separator": "",
    },
}
LORA_TARGETS = (
    "attention",  # every attention kind the model's pattern has: the three below where present (the default)
    "linear_attention",  # in_proj / out_proj of the linear-attention layers
    "sparse_attention",  # qkv / output projections of the sparse-attention layers (S; M: MLA's q/kv down/up, output)
    "full_attention",  # q (+ gate) / k / v / output projections of the gated full-attention layers (A)
    "indexer",  # the lightning indexer's projections
    "experts",  # the grouped routed experts (per-expert adapters)
    "shared_expert",
    "dense_mlp",
)
# the layer letters each attention target acts on; "attention" stands for those of them the pattern has
LORA_ATTENTION_TARGETS = {"linear_attention": "L", "sparse_attention": "SM", "full_attention": "A"}


def expand_lora_targets(targets, pattern: str) -> list[str]:
    """lora.targets with "attention" replaced by the attention targets whose layers `pattern`
    has (in LORA_ATTENTION_TARGETS' order), each target once."""
    out: list[str] = []
    for t in targets:
        kinds = [k for k, letters in LORA_ATTENTION_TARGETS.items() if any(x in pattern for x in letters)]
        for k in kinds if t == "attention" else [t]:
            if k not in out:
                out.append(k)
    return out
