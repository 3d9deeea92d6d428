"""HybridMoEConfig: Megatron's TransformerConfig plus our grouped additions.

A YAML file has one mapping per group:

    model:             TransformerConfig fields + pattern, vocab_size
    linear_attention:  LinearAttentionConfig
    sparse_attention:  SparseAttentionConfig
    full_attention:    FullAttentionConfig
    mla:               MLAConfig
    moe:               MoEConfig
    lora:              LoRAConfig
    memory:            MemoryConfig
    parallel:          ParallelConfig
    training:          TrainingConfig

Command-line overrides are dotted: `--moe.num_experts 8`, `--model.hidden_size=128`.
`validate()` runs before Megatron's own checks, before any allocation or process
group, and raises ConfigError (a ValueError) whose message starts with the field.
"""

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import yaml
from megatron.core.transformer import TransformerConfig

from megatron_moe_hybrid.registry import (
    CHAT_TURNS,
    DATA_FORMATS,
    LAYER_KINDS,
    LINEAR_ATTENTION_VARIANTS,
    LORA_ATTENTION_TARGETS,
    LORA_TARGETS,
    MOE_DISPATCHERS,
    PACKINGS,
    ROUTER_SCORE_FUNCS,
    SPARSE_ATTENTION_STAGES,
    expand_lora_targets,
)


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix. every_rank: every
    rank of the launch raises this same error (a check over gathered values), so the CLIs print
    it once (rank 0) rather than once per rank."""

    def __init__(self, field_name: str, message: str, every_rank: bool = False):
        self.field = field_name
        self.every_rank = every_rank
        super().__init__(f"{field_name}: {message}")


@dataclass
class LinearAttentionConfig:
    variant: str = "gated_delta_rule"  # registry.LINEAR_ATTENTION_VARIANTS
    num_qk_heads: int = 4
    num_v_heads: int = 4  # a multiple of num_qk_heads; q/k heads are repeated (Qwen3-Next)
    head_k_dim: int = 32
    head_v_dim: int = 32
    conv_kernel_size: int = 4  # short causal depthwise conv; 0 disables it
    chunk_size: int = 64
    backend: str = "auto"


@dataclass
class SparseAttentionConfig:
    topk: int = 2048
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_rope_dim: int = 16  # non-interleaved RoPE on the first channels of the indexer
    rope_base: float = 10000.0
    indexer_loss_coeff: float = 0.0  # 0 disables the indexer KL loss
    stage: str = "sparse"  # "sparse" | "dense_warmup" (every weight frozen but the S layers' indexers)
    backend: str = "auto"
    # true: the top-k selects by fp8 index scores, as DeepSeek-V3.2 does (its fp8_index): each
    # q / k row Hadamard-rotated and quantized to float8_e4m3fn with its own power-of-two scale,
    # the products on fp8 tensor cores. The KL loss keeps the 16-bit scores. index_head_dim a
    # power of 2.
    indexer_fp8: bool = False


@dataclass
class FullAttentionConfig:
    """Qwen3-Next gated full attention (pattern letter A). Its heads, kv groups and head dim are
    model.num_attention_heads, model.num_query_groups and model.kv_channels."""

    partial_rotary_factor: float = 0.25  # RoPE on the first int(kv_channels * factor) channels
    rope_theta: float = 10000.0


@dataclass
class MLAConfig:
    """DeepSeek-V3.2 multi-head latent attention (pattern letter M). Its heads are
    model.num_attention_heads; its indexer's topk, index_n_heads and index_head_dim come from
    sparse_attention. DeepSeek-V3.2 uses 1536, 512, 128, 64, 128, 10000."""

    q_lora_rank: Optional[int] = 64  # None: a plain q projection (then the indexer reads the hidden states)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16  # interleaved RoPE; the indexer rotates this many of its channels
    v_head_dim: int = 32
    rope_theta: float = 10000.0
    # RoPE scaling as transformers' rope_parameters: "default", or "yarn" (DeepSeek-V3 / V3.2
    # checkpoints: factor 40, original 4096, beta 32 / 1, mscale and mscale_all_dim 1).
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position_embeddings: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0  # 0: unset (HF's None)
    rope_mscale_all_dim: float = 0.0  # > 0 also scales the softmax by mscale(factor, this)^2
    rope_attention_factor: Optional[float] = None  # cos/sin scale; None: derived from the mscales
    rope_truncate: bool = True
    # true: absorbed MLA through the fused sparse ops: W_UK folded into q and W_UV applied after
    # attention over the one shared latent kv [C + R], the indexer's top-k by
    # lightning_indexer_topk (ties to the lower key), memory linear in T (long contexts).
    # false: HF's DeepseekV32Attention step for step (dense [T, S] indexer scores, per-head k
    # and v, HF's torch.topk: logit parity with HF even where the indexer ties; small T only).
    absorbed: bool = True


@dataclass
class MoEConfig:
    num_experts: int = 8
    topk: int = 2
    ffn_hidden_size: int = 128
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # scale the shared expert by sigmoid(x @ w), w [1, h] (Qwen3-Next)
    score_func: str = "softmax"  # "softmax" | "sigmoid"
    aux_loss_coeff: float = 1e-2
    expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3)
    bias_update_rate: float = 1e-3
    capacity_factor: Optional[float] = None  # None: dropless
    drop_policy: str = "probs"  # with a capacity: drop the lowest-probability copies ("probs") or the latest ("position")
    num_groups: int = 1  # group-limited routing: experts in num_groups groups ...
    topk_groups: int = 1  # ... and each token picks its experts from its best topk_groups groups
    norm_topk_prob: Optional[bool] = None  # renormalise the top-k weights (None: for sigmoid only)
    routed_scaling_factor: float = 1.0
    aux_loss_type: str = "micro_batch"  # "micro_batch" | "seq" (per sequence) | "global" (over the global batch)
    z_loss_coeff: float = 0.0  # router z-loss (mean logsumexp^2 of the router logits)
    first_k_dense: int = 0  # the first k layers use a dense SwiGLU MLP
    dense_ffn_hidden_size: int = 256
    dispatcher: str = "static"  # "static": no host sync, fixed receive capacity | "alltoall": exact, one host sync per layer
    dispatch_capacity_factor: Optional[float] = 2.0  # static: rows per rank pair = factor x balanced share (None: T*K, never overflows)
    dispatch_chunks: int = 1  # static: chunks whose all-to-alls overlap the other chunks' experts
    permute_backend: str = "auto"  # "auto" (compiled _C op where built) | "torch" | "fused"
    # top-k routing: "auto" (the fused Triton router for CUDA logits without expert groups,
    # the reference otherwise) | "torch" | "triton" (refuses group-limited routing)
    router_backend: str = "auto"
    # the experts' grouped GEMMs: "auto" (our Triton kernel for the forward and input gradient
    # where experts hold few rows each, torch._grouped_mm otherwise and for the weight gradient;
    # a loop over experts off CUDA) | "torch" | "triton"
    grouped_gemm_backend: str = "auto"


@dataclass
class LoRAConfig:
    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # "attention": every attention kind of model.pattern (L -> linear_attention, S/M ->
    # sparse_attention, A -> full_attention); registry.LORA_TARGETS lists the rest
    targets: list = field(default_factory=lambda: ["attention", "experts"])
    target_modules: list = field(default_factory=list)  # optional regexes over module paths, further restricting targets
    rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank
    expert_adapter: str = "per_expert"  # "per_expert" | "shared" (one adapter for all local experts)
    adapters_only_checkpoint: bool = False  # checkpoints hold the adapters alone (the base comes from init_from)
    base_dtype: str = "float32"  # dtype of the frozen base weights: "float32" | "bfloat16"


@dataclass
class MemoryConfig:
    ce_chunk_size: int = 1024  # tokens per chunk of the linear + cross-entropy
    activation_offload: bool = False  # keep selected saved activations in host memory (parallel/offload.py)
    # fnmatch patterns over module paths: the innermost module running when autograd saves a tensor
    offload_modules: list[str] = field(default_factory=lambda: ["*.mlp", "*.mlp.*"])  # module-path patterns: the MoE layers; "*.self_attention" adds attention
    offload_fraction: float = 1.0  # offload in the first ceil(fraction x num_layers) layers
    offload_min_bytes: int = 1 << 20  # smaller saved tensors stay on the device
    # recompute the first N transformer layers in the backward (activation checkpointing): each
    # keeps only its input; -1 recomputes every layer
    recompute_layers: int = 0


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1  # splits each sequence over this many ranks (every layer kind; M absorbed)
    cp_layout: str = "zigzag"  # "zigzag" (rank r holds pieces r and 2CP-1-r: balanced causal work) | "contiguous"
    expert_model_parallel_size: int = 1
    world_size: Optional[int] = None  # None: from the WORLD_SIZE environment variable (torchrun)
    collective_timeout_s: float = 600.0
    fsdp: bool = False  # FSDP2 fully_shard: dense modules over data parallel, experts over expert-data parallel
    fsdp_param_dtype: str = "float32"  # mixed-precision policy: compute dtype of gathered params
    fsdp_reduce_dtype: str = "float32"  # dtype of gradient reduction


@dataclass
class TrainingConfig:
    data_path: str = "stdlib"  # "stdlib" (the standard library's docstrings), "stdlib:email", a .txt/.jsonl file or dir,
    # an indexed dataset's prefix P (P.bin + P.idx: tools/preprocess_data.py), or a blend "0.3 P1 0.7 P2"
    bad_data: str = "error"  # "error": stop naming file and line; "skip": drop the record, count it in metrics
    text_field: str = "text"  # the JSONL field holding a document
    # "text": documents, every token trained; "prompt_response": .jsonl records of prompt_field
    # and response_field, packed into samples, the loss on the response's tokens only (and the
    # end of sequence after it), averaged over the global batch's trained tokens
    # "messages": .jsonl records of messages_field, a conversation [{"role", "content"}, ...] rendered
    # in chat_format (a registry.CHAT_FORMATS name: chatml, deepseek_v3.1, llama3; a .json file of its keys;
    # or a model's Jinja chat template: its tokenizer_config.json or a chat_template.jinja),
    # the loss on the assistant turns' content and end-of-turn marker only
    data_format: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    chat_format: str = "chatml"
    # extra variables of a model's Jinja chat template, as transformers' apply_chat_template(**kwargs)
    # takes them, e.g. {enable_thinking: false} for Qwen3's (a preset or .json format takes none)
    chat_template_kwargs: dict = field(default_factory=dict)
    # one record per conversation ("whole"), per assistant turn ("split", each turn trained in the
    # context the template gives it at generation), or whole where the template allows ("auto")
    # (registry.CHAT_TURNS)
    chat_turns: str = "auto"
    # "stream": samples cut every seq_length tokens of the token stream (a document or record may
    # start in one sample and end in the next); "fit": whole documents / records per sample (next
    # fit in stream order), the rest padded and left out of the loss; "best_fit": whole too, each
    # sample filled out of stream order, longest first (best fit decreasing: less padding)
    # (registry.PACKINGS)
    packing: str = "stream"
    # attention within each record only: a micro-batch runs as one packed sequence whose pieces
    # start at every sample and at every document's / record's start (where it was written, not at
    # eos tokens; RoPE positions restart there)
    isolate_records: bool = False
    max_document_chars: Optional[int] = None  # longer documents are bad data (None: no limit)
    tokenizer_model: Optional[str] = None  # a sentencepiece .model or an HF tokenizer.json; None: train one on data_path
    # held-out text (a .txt/.jsonl file or directory, as data_path) for a validation loss: the mean
    # next-token loss over the same eval_batches global batches each time, every eval_interval
    # steps (0: at the end of the run only) and at the end; logged as eval_loss in metrics.jsonl
    eval_data_path: Optional[str] = None
    eval_interval: int = 0
    eval_batches: int = 2
    output_dir: str = "outputs/run"
    cache_dir: str = ".cache/megatron_moe_hybrid"
    seq_length: int = 128
    micro_batch_size: int = 2
    global_batch_size: int = 8
    train_steps: int = 100
    exit_after_steps: int = 0  # > 0: save and stop after this many steps of this invocation
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    # AdamW's moments in "fp32" (torch.optim.AdamW) or "bf16" (DeepSeek-V3: half the optimizer
    # state; training/optim.py's BF16StateAdamW, adam_beta2 <= 0.99)
    optimizer_state_dtype: str = "fp32"
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 1234
    log_interval: int = 1
    # also write every step's metrics (loss, lr, grad_norm, eval_loss, ...) as TensorBoard
    # scalars here (rank 0; needs the tensorboard package); None: metrics.jsonl only
    tensorboard_dir: Optional[str] = None
    save_interval: int = 50  # 0: only at the end
    keep_checkpoints: int = 2
    resume: str = "auto"  # "auto": newest complete checkpoint in output_dir; "none"; or a path
    init_from: Optional[str] = None  # a checkpoint directory whose model weights start the run
    progress_bar: bool = True
    deterministic: bool = True  # torch deterministic algorithms; bitwise-repeatable runs
    device: str = "auto"  # "auto" (CUDA when visible, one GPU per rank: LOCAL_RANK), "cuda" or "cpu"
    max_consecutive_bad_steps: int = 5  # non-finite loss/grad steps are skipped; this many in a row stop the run
    on_save_error: str = "stop"  # "stop" | "continue" when a checkpoint cannot be written (e.g. disk full)
    on_corrupt_checkpoint: str = "error"  # "error" | "previous": resume from the newest loadable one


GROUPS: dict[str, type] = {
    "linear_attention": LinearAttentionConfig,
    "sparse_attention": SparseAttentionConfig,
    "full_attention": FullAttentionConfig,
    "mla": MLAConfig,
    "moe": MoEConfig,
    "lora": LoRAConfig,
    "memory": MemoryConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
}

# Our defaults for Megatron fields that differ from Megatron's (CPU-safe, no dropout).
MODEL_DEFAULTS: dict[str, Any] = dict(
    normalization="RMSNorm",
    add_bias_linear=False,
    gated_linear_unit=True,
    activation_func=torch.nn.functional.silu,  # with gated_linear_unit: SwiGLU dense layers (Megatron's default is gelu)
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
    layernorm_epsilon=1e-6,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HybridMoEConfig(TransformerConfig):
    """TransformerConfig + the hybrid pattern, vocabulary and the grouped additions."""

    pattern: str = "LLLS"
    vocab_size: int = 1024
    linear_attention: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)
    sparse_attention: SparseAttentionConfig = field(default_factory=SparseAttentionConfig)
    full_attention: FullAttentionConfig = field(default_factory=FullAttentionConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def __post_init__(self):
        self.validate()
        super().__post_init__()

    @property
    def cp_layout(self) -> str:
        """How the context-parallel ranks split a sequence (the layers read it here)."""
        return self.parallel.cp_layout

    # Model-level helpers the builders use.
    def layer_kind(self, layer_index: int) -> str:
        return self.pattern[layer_index % len(self.pattern)]

    def is_moe_layer(self, layer_index: int) -> bool:
        return layer_index >= self.moe.first_k_dense

    def resolved_world_size(self) -> int:
        if self.parallel.world_size is not None:
            return self.parallel.world_size
        return int(os.environ.get("WORLD_SIZE", "1"))

    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.resolved_world_size() // (
            p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        )

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field; cheap, allocates nothing."""
        _validate(self)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"model": {}}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in GROUPS:
                out[f.name] = dataclasses.asdict(value)
            elif f.name in _model_keys_written():
                out["model"][f.name] = _plain(value)
        return out


def _plain(value):
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return value


def _model_keys_written() -> set[str]:
    return {
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "ffn_hidden_size", "pattern", "vocab_size", "normalization", "layernorm_epsilon",
        "init_method_std", "params_dtype", "hidden_dropout", "attention_dropout",
    }  # fmt: skip


def _check_data_path(t, name: str) -> None:
    """training.<name>, a source the data loader takes: 'stdlib', 'stdlib:<package>', a file /
    directory, a Megatron indexed dataset's prefix (P with P.bin and P.idx), or a blend of these,
    "w1 path1 w2 path2 ...". Indexed datasets hold token ids and a blend mixes sources: the
    tokenizer they were made with must be given (none is trained on them), and indexed data is
    documents, not records."""
    from megatron_moe_hybrid.training.indexed import indexed_prefix, parse_blend

    field_name = f"training.{name}"
    path = getattr(t, name)
    blend = parse_blend(path)
    indexed = []
    for weight, part in blend if blend is not None else [(1.0, path)]:
        _require(weight > 0 and math.isfinite(weight), field_name,
                 f"blend weight {weight} of {part!r} must be a positive number")
        if indexed_prefix(part) is not None:
            indexed.append(part)
        else:
            _check_text_source(part, field_name)
    if blend is not None or indexed:
        what = "a blend" if blend is not None else "an indexed dataset (token ids)"
        _require(t.tokenizer_model is not None, "training.tokenizer_model",
                 f"{field_name} is {what}: set the tokenizer its data was made with "
                 "(a sentencepiece .model or a tokenizer.json); none is trained on it")
    if indexed:
        _require(t.data_format == "text", "training.data_format",
                 f"{t.data_format} reads .jsonl records; {field_name} {indexed[0]!r} is an indexed dataset "
                 "of token ids (documents): use data_format text")


def _check_text_source(path: str, field_name: str) -> None:
    """A text source: 'stdlib', 'stdlib:<package>', or a file / directory that exists."""
    if path.startswith("stdlib:"):
        import sysconfig

        subset = os.path.join(sysconfig.get_paths()["stdlib"], path[7:].replace(".", "/"))
        _require(
            os.path.exists(subset) or os.path.exists(subset + ".py"),
            field_name,
            f"{path!r} names no standard-library package or module; use e.g. 'stdlib:email'",
        )
    else:
        _require(
            path == "stdlib" or os.path.exists(path),
            field_name,
            f"{path!r} does not exist; use 'stdlib' (the built-in corpus), a .txt/.jsonl file or directory, or an "
            "indexed dataset's prefix (P, with P.bin and P.idx)",
        )


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(field_name, message)


def _positive(value, field_name: str) -> None:
    _require(
        isinstance(value, (int, float)) and value > 0,
        field_name,
        f"must be > 0, got {value!r}",
    )


def _validate(c: HybridMoEConfig) -> None:
    # model
    _positive(c.num_layers, "model.num_layers")
    _positive(c.hidden_size, "model.hidden_size")
    _positive(c.num_attention_heads, "model.num_attention_heads")
    _positive(c.vocab_size, "model.vocab_size")
    _require(len(c.pattern) > 0, "model.pattern", "is empty; use e.g. 'LLLS'")
    for letter in c.pattern:
        _require(
            letter in LAYER_KINDS,
            "model.pattern",
            f"unknown layer letter {letter!r} in {c.pattern!r}; valid letters: "
            f"{', '.join(LAYER_KINDS.names())} (L linear attention, S sparse attention, A gated full attention, M DeepSeek-V3.2 MLA)",
        )
    _require(
        c.num_layers % len(c.pattern) == 0,
        "model.num_layers",
        f"{c.num_layers} is not a multiple of the pattern {c.pattern!r} "
        f"(length {len(c.pattern)}); use e.g. {len(c.pattern) * max(1, c.num_layers // len(c.pattern))}",
    )
    if c.kv_channels is None:
        _require(
            c.hidden_size % c.num_attention_heads == 0,
            "model.hidden_size",
            f"{c.hidden_size} is not divisible by model.num_attention_heads={c.num_attention_heads}; "
            "change one of them or set model.kv_channels",
        )
    else:
        _positive(c.kv_channels, "model.kv_channels")
    if c.num_query_groups is not None:
        _require(
            c.num_query_groups > 0 and c.num_attention_heads % c.num_query_groups == 0,
            "model.num_query_groups",
            f"{c.num_query_groups} must be > 0 and divide model.num_attention_heads="
            f"{c.num_attention_heads}",
        )
    _require(
        c.normalization in ("RMSNorm", "LayerNorm"),
        "model.normalization",
        f"{c.normalization!r} is not 'RMSNorm' or 'LayerNorm'",
    )
    _require(
        c.params_dtype in _DTYPES.values(),
        "model.params_dtype",
        f"{c.params_dtype} is not one of {', '.join(_DTYPES)}",
    )

    # linear attention
    la = c.linear_attention
    _require(
        la.variant in LINEAR_ATTENTION_VARIANTS,
        "linear_attention.variant",
        f"unknown variant {la.variant!r}; registered: {', '.join(LINEAR_ATTENTION_VARIANTS.names())}",
    )
    for name in ("num_qk_heads", "num_v_heads", "head_k_dim", "head_v_dim", "chunk_size"):
        _positive(getattr(la, name), f"linear_attention.{name}")
    _require(
        la.num_v_heads % la.num_qk_heads == 0,
        "linear_attention.num_v_heads",
        f"{la.num_v_heads} must be a multiple of linear_attention.num_qk_heads={la.num_qk_heads}",
    )
    _require(
        la.chunk_size & (la.chunk_size - 1) == 0,
        "linear_attention.chunk_size",
        f"{la.chunk_size} must be a power of two (e.g. 64)",
    )
    _require(
        la.conv_kernel_size >= 0,
        "linear_attention.conv_kernel_size",
        f"must be >= 0 (0 disables the short conv), got {la.conv_kernel_size}",
    )

    # sparse attention
    sa = c.sparse_attention
    for name in ("topk", "index_n_heads", "index_head_dim"):
        _positive(getattr(sa, name), f"sparse_attention.{name}")
    _require(
        0 <= sa.index_rope_dim <= sa.index_head_dim and sa.index_rope_dim % 2 == 0,
        "sparse_attention.index_rope_dim",
        f"{sa.index_rope_dim} must be even and within [0, sparse_attention.index_head_dim="
        f"{sa.index_head_dim}]",
    )
    _require(
        sa.indexer_loss_coeff >= 0,
        "sparse_attention.indexer_loss_coeff",
        f"must be >= 0 (0 disables the indexer loss), got {sa.indexer_loss_coeff}",
    )
    _require(
        sa.stage in SPARSE_ATTENTION_STAGES,
        "sparse_attention.stage",
        f"{sa.stage!r} is not one of {', '.join(SPARSE_ATTENTION_STAGES)}",
    )
    _positive(sa.rope_base, "sparse_attention.rope_base")
    _require(
        isinstance(sa.indexer_fp8, bool),
        "sparse_attention.indexer_fp8",
        f"must be true or false, got {sa.indexer_fp8!r}",
    )
    _require(
        not sa.indexer_fp8 or sa.index_head_dim & (sa.index_head_dim - 1) == 0,
        "sparse_attention.index_head_dim",
        f"{sa.index_head_dim} must be a power of 2 with sparse_attention.indexer_fp8 (its rows are "
        "Hadamard-rotated before quantizing, DeepSeek-V3.2 uses 128); or set indexer_fp8 false",
    )
    if sa.stage == "dense_warmup":  # DeepSeek-V3.2's warm-up: everything frozen but the S layers' indexers
        _require(
            "S" in c.pattern,
            "sparse_attention.stage",
            f"dense_warmup trains the indexers of S layers, and model.pattern {c.pattern!r} has none; "
            "set stage sparse",
        )
        _require(
            "M" not in c.pattern,
            "sparse_attention.stage",
            "dense_warmup runs in S layers only: M (MLA) layers have no dense warm-up and would train on "
            "their sparse stage; set stage sparse",
        )
        _require(
            sa.indexer_loss_coeff > 0,
            "sparse_attention.indexer_loss_coeff",
            "must be > 0 with sparse_attention.stage dense_warmup: the warm-up freezes every weight but the "
            "indexers, which learn from that loss alone (DeepSeek-V3.2's warm-up: 1000 steps at lr 1e-3)",
        )
        _require(
            not c.lora.enabled,
            "lora.enabled",
            "must be false with sparse_attention.stage dense_warmup, which trains the indexers' own weights "
            "(every other weight frozen); run the warm-up without LoRA, then fine-tune from its checkpoint",
        )

    # gated full attention
    fa = c.full_attention
    _require(
        isinstance(fa.partial_rotary_factor, (int, float)) and 0 < fa.partial_rotary_factor <= 1,
        "full_attention.partial_rotary_factor",
        f"must be within (0, 1], got {fa.partial_rotary_factor!r}; Qwen3-Next uses 0.25",
    )
    _positive(fa.rope_theta, "full_attention.rope_theta")
    if "A" in c.pattern:
        head_dim = c.kv_channels or c.hidden_size // c.num_attention_heads
        num_rotary = int(head_dim * fa.partial_rotary_factor)
        _require(
            num_rotary % 2 == 0,
            "full_attention.partial_rotary_factor",
            f"head dim {head_dim} x {fa.partial_rotary_factor} gives {num_rotary} rotary channels, "
            "which must be even; change the factor or model.kv_channels",
        )

    # multi-head latent attention
    mla = c.mla
    _require(
        mla.q_lora_rank is None or (isinstance(mla.q_lora_rank, int) and mla.q_lora_rank > 0),
        "mla.q_lora_rank",
        f"must be > 0, or null for a plain q projection; got {mla.q_lora_rank!r}",
    )
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_theta"):
        _positive(getattr(mla, name), f"mla.{name}")
    _require(
        mla.rope_type in ("default", "yarn"),
        "mla.rope_type",
        f"{mla.rope_type!r} is not 'default' or 'yarn' (the RoPE scalings MLA implements)",
    )
    if mla.rope_type == "yarn":
        for name in ("rope_factor", "rope_original_max_position_embeddings", "rope_beta_fast", "rope_beta_slow"):
            _positive(getattr(mla, name), f"mla.{name}")
        for name in ("rope_mscale", "rope_mscale_all_dim"):
            _require(getattr(mla, name) >= 0, f"mla.{name}", f"must be >= 0 (0: unset), got {getattr(mla, name)!r}")
        if mla.rope_attention_factor is not None:
            _positive(mla.rope_attention_factor, "mla.rope_attention_factor")
    _require(
        isinstance(mla.absorbed, bool), "mla.absorbed", f"must be true or false, got {mla.absorbed!r}"
    )
    _require(
        mla.qk_rope_head_dim % 2 == 0,
        "mla.qk_rope_head_dim",
        f"{mla.qk_rope_head_dim} must be even (RoPE rotates channel pairs); DeepSeek-V3.2 uses 64",
    )
    if "M" in c.pattern:
        _require(
            mla.absorbed or not sa.indexer_fp8,
            "sparse_attention.indexer_fp8",
            "must be false with mla.absorbed false: that form keeps HF's DeepseekV32Attention step for step "
            "(16-bit dense index scores, HF's torch.topk); set mla.absorbed true for the fp8 selection",
        )
        _require(
            mla.qk_rope_head_dim <= sa.index_head_dim,
            "mla.qk_rope_head_dim",
            f"{mla.qk_rope_head_dim} must be <= sparse_attention.index_head_dim={sa.index_head_dim}: "
            "the indexer rotates its first qk_rope_head_dim channels",
        )
        _require(
            c.parallel.tensor_model_parallel_size == 1,
            "parallel.tensor_model_parallel_size",
            "must be 1 with M layers: their latent projections and indexer are not split over ranks",
        )

    # MoE
    m = c.moe
    ep = c.parallel.expert_model_parallel_size
    _positive(m.num_experts, "moe.num_experts")
    _positive(m.topk, "moe.topk")
    _require(
        m.topk <= m.num_experts,
        "moe.topk",
        f"{m.topk} is larger than moe.num_experts={m.num_experts}; use at most {m.num_experts}",
    )
    _positive(ep, "parallel.expert_model_parallel_size")
    _require(
        m.num_experts % ep == 0,
        "moe.num_experts",
        f"{m.num_experts} experts cannot be split evenly over parallel.expert_model_parallel_size="
        f"{ep} ranks; use a multiple of {ep}",
    )
    _positive(m.ffn_hidden_size, "moe.ffn_hidden_size")
    _require(
        m.shared_expert_ffn_hidden_size >= 0,
        "moe.shared_expert_ffn_hidden_size",
        f"must be >= 0 (0: no shared expert), got {m.shared_expert_ffn_hidden_size}",
    )
    _require(
        m.score_func in ROUTER_SCORE_FUNCS,
        "moe.score_func",
        f"{m.score_func!r} is not one of {', '.join(ROUTER_SCORE_FUNCS)}",
    )
    _require(m.aux_loss_coeff >= 0, "moe.aux_loss_coeff", f"must be >= 0, got {m.aux_loss_coeff}")
    _require(
        m.bias_update_rate >= 0, "moe.bias_update_rate", f"must be >= 0, got {m.bias_update_rate}"
    )
    if m.capacity_factor is not None:
        _positive(m.capacity_factor, "moe.capacity_factor")
    _require(m.drop_policy in ("probs", "position"), "moe.drop_policy", f"{m.drop_policy!r} is not 'probs' or 'position'")
    _positive(m.num_groups, "moe.num_groups")
    _require(
        m.num_experts % m.num_groups == 0,
        "moe.num_groups",
        f"{m.num_groups} groups do not divide moe.num_experts={m.num_experts}",
    )
    _require(
        1 <= m.topk_groups <= m.num_groups,
        "moe.topk_groups",
        f"{m.topk_groups} must be within [1, moe.num_groups={m.num_groups}]",
    )
    _require(
        m.topk <= m.topk_groups * (m.num_experts // m.num_groups),
        "moe.topk",
        f"{m.topk} experts cannot be chosen from {m.topk_groups} groups of {m.num_experts // m.num_groups}",
    )
    _require(
        m.aux_loss_type in ("micro_batch", "seq", "global"),
        "moe.aux_loss_type",
        f"{m.aux_loss_type!r} is not one of micro_batch, seq, global",
    )
    _require(m.z_loss_coeff >= 0, "moe.z_loss_coeff", f"must be >= 0, got {m.z_loss_coeff}")
    _positive(m.routed_scaling_factor, "moe.routed_scaling_factor")
    _require(
        0 <= m.first_k_dense <= c.num_layers,
        "moe.first_k_dense",
        f"{m.first_k_dense} must be within [0, model.num_layers={c.num_layers}]",
    )
    if m.first_k_dense > 0:
        _positive(m.dense_ffn_hidden_size, "moe.dense_ffn_hidden_size")
        _require(
            c.ffn_hidden_size == m.dense_ffn_hidden_size,
            "model.ffn_hidden_size",
            f"is {c.ffn_hidden_size} but the dense layers are moe.dense_ffn_hidden_size="
            f"{m.dense_ffn_hidden_size} (Megatron's MLP reads both); leave model.ffn_hidden_size unset",
        )
    _require(
        not m.shared_expert_gate or m.shared_expert_ffn_hidden_size > 0,
        "moe.shared_expert_gate",
        "gates the shared expert, but moe.shared_expert_ffn_hidden_size is 0 (none); "
        "set that size or leave the gate false",
    )
    _require(
        m.dispatcher in MOE_DISPATCHERS,
        "moe.dispatcher",
        f"unknown dispatcher {m.dispatcher!r}; registered: {', '.join(MOE_DISPATCHERS.names())}",
    )
    if m.dispatch_capacity_factor is not None:
        _positive(m.dispatch_capacity_factor, "moe.dispatch_capacity_factor")
    _require(
        isinstance(m.dispatch_chunks, int) and m.dispatch_chunks >= 1,
        "moe.dispatch_chunks",
        f"must be an integer >= 1, got {m.dispatch_chunks!r}",
    )
    _require(
        m.permute_backend in ("auto", "torch", "fused"),
        "moe.permute_backend",
        f"{m.permute_backend!r} is not one of auto, torch, fused",
    )
    _require(
        m.router_backend in ("auto", "torch", "triton"),
        "moe.router_backend",
        f"{m.router_backend!r} is not one of auto, torch, triton",
    )
    _require(
        m.grouped_gemm_backend in ("auto", "torch", "triton"),
        "moe.grouped_gemm_backend",
        f"{m.grouped_gemm_backend!r} is not one of auto, torch, triton",
    )
    _require(
        m.router_backend != "triton" or m.topk_groups == m.num_groups,
        "moe.router_backend",
        "'triton' routes without expert groups; set moe.router_backend: auto (or torch) for "
        f"group-limited routing (num_groups={m.num_groups}, topk_groups={m.topk_groups})",
    )

    # LoRA
    lo = c.lora
    if lo.enabled:
        _positive(lo.rank, "lora.rank")
        _positive(lo.alpha, "lora.alpha")
        _require(
            0.0 <= lo.dropout < 1.0, "lora.dropout", f"must be within [0, 1), got {lo.dropout}"
        )
        _require(len(lo.targets) > 0, "lora.targets", f"is empty; choose from {', '.join(LORA_TARGETS)}")
        _require(
            lo.expert_adapter in ("per_expert", "shared"),
            "lora.expert_adapter",
            f"{lo.expert_adapter!r} is not 'per_expert' or 'shared'",
        )
        _require(lo.base_dtype in ("float32", "bfloat16"), "lora.base_dtype", f"{lo.base_dtype!r} is not float32 or bfloat16")
        for pattern in lo.target_modules:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError("lora.target_modules", f"{pattern!r} is not a valid regular expression ({e})") from None
        for t in lo.targets:
            _require(
                t in LORA_TARGETS,
                "lora.targets",
                f"unknown target {t!r}{_did_you_mean(t, LORA_TARGETS)}; valid: {', '.join(LORA_TARGETS)}",
            )
        # attention targets need their layer letter in the pattern (found here, not after the ranks start)
        for t, letters in LORA_ATTENTION_TARGETS.items():
            _require(
                t not in lo.targets or any(x in c.pattern for x in letters),
                "lora.targets",
                f"{t!r} matches no layer of model.pattern {c.pattern!r} (it needs a {' or '.join(letters)} layer); "
                "drop it from lora.targets",
            )
        # Absorbed MLA folds linear_kv_up_proj's adapter into its weights and never forms the
        # projection's input, where LoRA dropout would act (with target_modules the layer checks
        # at its first forward whether kv_up_proj got an adapter).
        _require(
            not (lo.dropout > 0 and "M" in c.pattern and c.mla.absorbed
                 and "sparse_attention" in expand_lora_targets(lo.targets, c.pattern) and not lo.target_modules),
            "lora.dropout",
            f"is {lo.dropout}, but absorbed MLA (mla.absorbed, the default for M layers) never forms the input of "
            "linear_kv_up_proj that LoRA dropout acts on; set lora.dropout 0, set mla.absorbed false, or leave "
            "sparse_attention out of lora.targets",
        )

    # memory
    mem = c.memory
    _positive(mem.ce_chunk_size, "memory.ce_chunk_size")
    _require(
        isinstance(mem.recompute_layers, int) and not isinstance(mem.recompute_layers, bool) and mem.recompute_layers >= -1,
        "memory.recompute_layers",
        f"must be an integer: 0 (off), N (the first N layers) or -1 (every layer), got {mem.recompute_layers!r}",
    )
    _require(
        isinstance(mem.offload_modules, list)
        and len(mem.offload_modules) > 0
        and all(isinstance(p, str) and p for p in mem.offload_modules),
        "memory.offload_modules",
        f"must be a non-empty list of module-path patterns such as ['*.mlp.experts', '*.self_attention'], "
        f"got {mem.offload_modules!r}",
    )
    _require(
        isinstance(mem.offload_fraction, (int, float))
        and not isinstance(mem.offload_fraction, bool)
        and 0 < mem.offload_fraction <= 1,
        "memory.offload_fraction",
        f"must be within (0, 1] (the share of layers, from the first, that offload), got {mem.offload_fraction!r}",
    )
    _require(
        isinstance(mem.offload_min_bytes, int)
        and not isinstance(mem.offload_min_bytes, bool)
        and mem.offload_min_bytes >= 0,
        "memory.offload_min_bytes",
        f"must be an integer >= 0 (0 offloads every selected tensor), got {mem.offload_min_bytes!r}",
    )

    # parallel
    p = c.parallel
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        _positive(getattr(p, name), f"parallel.{name}")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        _require(
            getattr(p, name) == 1,
            f"parallel.{name}",
            f"{getattr(p, name)} is not supported yet (only 1); use expert parallelism and data "
            "parallelism for now",
        )
    _require(
        p.cp_layout in ("zigzag", "contiguous"),
        "parallel.cp_layout",
        f"{p.cp_layout!r} is not 'zigzag' or 'contiguous'",
    )
    if p.context_parallel_size > 1:
        cp = p.context_parallel_size
        others = sorted(set(c.pattern) - {"L", "S", "A", "M"})
        _require(
            not others,
            "parallel.context_parallel_size",
            f"context parallelism covers the linear (L), sparse (S and M) and gated full (A) attention layers; the pattern "
            f"{c.pattern!r} has {', '.join(others)}: use parallel.context_parallel_size 1 for it",
        )
        _require(
            "M" not in c.pattern or c.mla.absorbed,
            "mla.absorbed",
            "context parallelism runs the M layer in its absorbed form only; set mla.absorbed true "
            "or parallel.context_parallel_size 1",
        )
        pieces = cp * (2 if p.cp_layout == "zigzag" else 1)
        _require(
            c.training.seq_length % pieces == 0,
            "training.seq_length",
            f"{c.training.seq_length} must be a multiple of {pieces} (context_parallel_size {cp} x "
            f"{pieces // cp} pieces per rank for parallel.cp_layout {p.cp_layout!r}); round it to "
            f"{max(pieces, c.training.seq_length // pieces * pieces)}",
        )
    _positive(p.collective_timeout_s, "parallel.collective_timeout_s")
    for name in ("fsdp_param_dtype", "fsdp_reduce_dtype"):
        _require(
            getattr(p, name) in _DTYPES,
            f"parallel.{name}",
            f"{getattr(p, name)!r} is not one of {', '.join(_DTYPES)}",
        )

    # training
    t = c.training
    _require(t.device in ("auto", "cuda", "cpu"), "training.device", f"{t.device!r} is not 'auto', 'cuda' or 'cpu'")
    if t.device == "cuda":
        import torch

        _require(
            torch.cuda.is_available(),
            "training.device",
            "is 'cuda' but no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver); use 'auto' or 'cpu'",
        )
    _require(t.lr >= 0, "training.lr", f"must be >= 0, got {t.lr}; a typical value is 3e-4")
    _require(
        0 <= t.min_lr <= t.lr,
        "training.min_lr",
        f"{t.min_lr} must be within [0, training.lr={t.lr}]",
    )
    _require(bool(t.data_path), "training.data_path", "is empty; use 'stdlib' or a .txt file/dir")
    _require(t.bad_data in ("error", "skip"), "training.bad_data", f"{t.bad_data!r} is not 'error' or 'skip'")
    _require(bool(t.text_field), "training.text_field", "is empty; name the JSONL field holding the text")
    _require(t.data_format in DATA_FORMATS, "training.data_format",
             f"{t.data_format!r} is not one of {', '.join(DATA_FORMATS)}{_did_you_mean(t.data_format, DATA_FORMATS)}")
    _require(t.packing in PACKINGS, "training.packing",
             f"{t.packing!r} is not one of {', '.join(PACKINGS)}{_did_you_mean(t.packing, PACKINGS)}")
    _require(t.chat_turns in CHAT_TURNS, "training.chat_turns",
             f"{t.chat_turns!r} is not one of {', '.join(CHAT_TURNS)}{_did_you_mean(t.chat_turns, CHAT_TURNS)}")
    _require(t.chat_turns == "auto" or t.data_format == "messages", "training.chat_turns",
             f"{t.chat_turns!r} applies to conversations; training.data_format is {t.data_format!r}: set "
             "data_format messages or leave chat_turns auto")
    for name in ("prompt_field", "response_field", "messages_field"):
        _require(bool(getattr(t, name)), f"training.{name}", "is empty; name the JSONL field holding it")
    _require(
        not (t.isolate_records and c.parallel.context_parallel_size > 1 and t.micro_batch_size != 1),
        "training.isolate_records",
        f"under context parallelism packs one sample per micro-batch; set training.micro_batch_size 1 "
        f"(it is {t.micro_batch_size}) or turn isolate_records off",
    )
    if t.data_format != "text":
        fields = (f"{t.prompt_field!r} and {t.response_field!r}" if t.data_format == "prompt_response"
                  else f"{t.messages_field!r}")
        for name in ("data_path", "eval_data_path"):
            path = getattr(t, name)
            _require(path is None or not (path == "stdlib" or path.startswith("stdlib:")), "training.data_format",
                     f"{t.data_format} reads .jsonl records of {fields}; training.{name} is {path!r}: point it at them")
    if t.data_format == "messages":
        from megatron_moe_hybrid.training.data import load_chat_format

        try:
            load_chat_format(t.chat_format, t.chat_template_kwargs)
        except ValueError as err:  # its message starts with the field: "training.chat_format: ..."
            name, message = str(err).split(": ", 1)
            raise ConfigError(name, message) from None
    if t.max_document_chars is not None:
        _positive(t.max_document_chars, "training.max_document_chars")
    _check_data_path(t, "data_path")
    if t.eval_data_path is not None:
        _require(bool(t.eval_data_path), "training.eval_data_path", "is empty; use a .txt/.jsonl file or directory, or null")
        _check_data_path(t, "eval_data_path")
    if t.tensorboard_dir is not None:
        import importlib.util

        _require(bool(t.tensorboard_dir), "training.tensorboard_dir", "is empty; name a directory, or null")
        _require(importlib.util.find_spec("tensorboard") is not None, "training.tensorboard_dir",
                 "needs the tensorboard package (pip install tensorboard), or leave it null")  # fmt: skip
    _require(t.eval_interval >= 0, "training.eval_interval", f"must be >= 0 (0: at the end only), got {t.eval_interval}")
    _positive(t.eval_batches, "training.eval_batches")
    if t.tokenizer_model is not None:
        _require(
            os.path.isfile(t.tokenizer_model),
            "training.tokenizer_model",
            f"{t.tokenizer_model!r} does not exist; point it at the base run's tokenizer.model (or its tokenizer.json) "
            "(written into every output_dir) or leave it unset to train one on training.data_path",
        )
    for name in ("seq_length", "micro_batch_size", "global_batch_size", "train_steps", "log_interval"):
        _positive(getattr(t, name), f"training.{name}")
    _require(t.warmup_steps >= 0, "training.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    _require(t.weight_decay >= 0, "training.weight_decay", f"must be >= 0, got {t.weight_decay}")
    _require(t.grad_clip >= 0, "training.grad_clip", f"must be >= 0 (0 disables), got {t.grad_clip}")
    _require(t.exit_after_steps >= 0, "training.exit_after_steps", f"must be >= 0 (0: off), got {t.exit_after_steps}")
    _require(t.save_interval >= 0, "training.save_interval", f"must be >= 0, got {t.save_interval}")
    _require(
        t.max_consecutive_bad_steps >= 1,
        "training.max_consecutive_bad_steps",
        f"must be >= 1, got {t.max_consecutive_bad_steps}",
    )
    _require(
        t.on_save_error in ("stop", "continue"),
        "training.on_save_error",
        f"{t.on_save_error!r} is not 'stop' or 'continue'",
    )
    _require(
        t.on_corrupt_checkpoint in ("error", "previous"),
        "training.on_corrupt_checkpoint",
        f"{t.on_corrupt_checkpoint!r} is not 'error' or 'previous'",
    )
    _require(t.keep_checkpoints >= 1, "training.keep_checkpoints", f"must be >= 1, got {t.keep_checkpoints}")
    for name in ("adam_beta1", "adam_beta2"):
        _require(0 <= getattr(t, name) < 1, f"training.{name}", f"must be within [0, 1), got {getattr(t, name)}")
    _require(
        t.optimizer_state_dtype in ("fp32", "bf16"),
        "training.optimizer_state_dtype",
        f"{t.optimizer_state_dtype!r} is not 'fp32' or 'bf16'",
    )
    _require(
        t.optimizer_state_dtype != "bf16" or t.adam_beta2 <= 0.99,
        "training.adam_beta2",
        f"{t.adam_beta2} is above 0.99, where a bf16 second moment (training.optimizer_state_dtype: bf16) "
        "moves by less than its rounding step and stalls; lower adam_beta2 (DeepSeek-V3: 0.95) or keep fp32 state",
    )
    _require(
        t.resume in ("auto", "none") or os.path.isdir(t.resume),
        "training.resume",
        f"{t.resume!r} is not 'auto', 'none' or an existing checkpoint directory",
    )
    if t.init_from is not None:
        _require(
            os.path.isdir(t.init_from),
            "training.init_from",
            f"{t.init_from!r} is not a directory; point it at a run's output_dir (its newest checkpoint) "
            "or one of its checkpoints/step_* directories",
        )
    if lo.enabled:
        _require(
            t.init_from is not None or t.resume != "none",
            "training.init_from",
            "LoRA fine-tuning needs base weights; set training.init_from to a pretraining checkpoint",
        )
    if t.init_from is not None:
        _require(
            t.tokenizer_model is not None,
            "training.tokenizer_model",
            "a run that starts from training.init_from must reuse the base model's tokenizer; "
            "set it to <base output_dir>/tokenizer.model (a converted Hugging Face model: its tokenizer.json)",
        )

    # world size last: it depends on how the job is launched
    world = c.resolved_world_size()
    _positive(world, "parallel.world_size")
    # Megatron's two grids over the same ranks: dense TP x PP x CP x DP, expert TP x PP x EP x EDP.
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    tp_pp_ep = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * ep
    _require(
        world % tp_pp_ep == 0,
        "parallel.expert_model_parallel_size",
        f"world size {world} is not divisible by tensor x expert x pipeline parallel = "
        f"{tp_pp_ep}; launch a multiple of {tp_pp_ep} processes (torchrun --nproc-per-node) or lower "
        "parallel.expert_model_parallel_size",
    )
    _require(
        world % mp == 0,
        "parallel.context_parallel_size",
        f"world size {world} is not divisible by tensor x pipeline x context parallel = {mp}; "
        f"launch a multiple of {mp} processes or lower parallel.context_parallel_size",
    )
    dp = world // mp
    _require(
        t.global_batch_size % (t.micro_batch_size * dp) == 0,
        "training.global_batch_size",
        f"{t.global_batch_size} is not a multiple of training.micro_batch_size x data-parallel size "
        f"= {t.micro_batch_size} x {dp}; use a multiple of {t.micro_batch_size * dp}",
    )


def _did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f" (did you mean {' or '.join(repr(x) for x in close)}?)" if close else ""


def _model_field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(HybridMoEConfig)
    return {
        f.name: hints.get(f.name, Any)
        for f in dataclasses.fields(HybridMoEConfig)
        if f.name not in GROUPS
    }


def _coerce(value: Any, annotation: Any, field_name: str) -> Any:
    """Checks a YAML / command-line value against the field's annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], field_name) if len(args) == 1 else value
    if annotation is torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        name = str(value).replace("torch.", "")
        _require(name in _DTYPES, field_name, f"{value!r} is not one of {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if annotation is bool:
        _require(isinstance(value, bool), field_name, f"expected true or false, got {value!r}")
        return value
    if annotation is int:
        _require(
            isinstance(value, int) and not isinstance(value, bool),
            field_name,
            f"expected an integer, got {value!r}",
        )
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool),
            field_name,
            f"expected a number, got {value!r}",
        )
        return float(value)
    if annotation is str:
        _require(isinstance(value, str), field_name, f"expected a string, got {value!r}")
        return value
    if annotation is dict or origin is dict:
        _require(isinstance(value, dict), field_name, f"expected a mapping, e.g. '{{enable_thinking: false}}', got {value!r}")
        return value
    if annotation is list or origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        _require(isinstance(value, list), field_name, f"expected a list, got {value!r}")
        return value
    return value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`--moe.num_experts 8` / `--moe.num_experts=8` -> {"moe.num_experts": 8}."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(arg, "expected an option like --moe.num_experts 8")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(key, f"--{key} needs a value")
            raw = args[i + 1]
            i += 2
        out[key.replace("-", "_") if "." not in key else key] = yaml.safe_load(raw)
    return out


def _apply_override(raw: dict, dotted: str, value: Any) -> None:
    group, _, key = dotted.partition(".")
    if not key:  # a bare key like --hidden_size is a model field
        group, key = "model", group
    raw.setdefault(group, {})
    if not isinstance(raw[group], dict):
        raise ConfigError(group, "expected a mapping")
    raw[group][key] = value


def config_from_dict(raw: dict, overrides: Optional[dict] = None) -> HybridMoEConfig:
    raw = {k: dict(v or {}) if isinstance(v, dict) or v is None else v for k, v in (raw or {}).items()}
    for dotted, value in (overrides or {}).items():
        _apply_override(raw, dotted, value)

    valid_groups = ["model", *GROUPS]
    kwargs: dict[str, Any] = dict(MODEL_DEFAULTS)
    model_types = _model_field_types()
    for group, values in raw.items():
        if group not in valid_groups:
            raise ConfigError(group, f"unknown config group{_did_you_mean(group, valid_groups)}; "
                              f"valid groups: {', '.join(valid_groups)}")
        if not isinstance(values, dict):
            raise ConfigError(group, f"expected a mapping of fields, got {values!r}")
        if group == "model":
            for key, value in values.items():
                if key not in model_types:
                    raise ConfigError(
                        f"model.{key}",
                        f"unknown field{_did_you_mean(key, model_types)}; it is not a Megatron "
                        "TransformerConfig field nor one of pattern, vocab_size",
                    )
                kwargs[key] = _coerce(value, model_types[key], f"model.{key}")
            continue
        cls = GROUPS[group]
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise ConfigError(
                    f"{group}.{key}",
                    f"unknown field{_did_you_mean(key, names)}; valid: {', '.join(names)}",
                )
        kwargs[group] = cls(
            **{k: _coerce(v, hints[k], f"{group}.{k}") for k, v in values.items()}
        )
    if "ffn_hidden_size" not in kwargs:
        # Megatron's dense MLP sizes its second linear by model.ffn_hidden_size, whatever the
        # spec passes: keep it equal to the dense layers' size (validate() checks it).
        kwargs["ffn_hidden_size"] = kwargs.get("moe", MoEConfig()).dense_ffn_hidden_size
    return HybridMoEConfig(**kwargs)


def load_config(path: Optional[str] = None, overrides: Optional[dict] = None) -> HybridMoEConfig:
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError("--config", f"{path!r} does not exist; try examples/configs/tiny.yaml")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                where = getattr(e, "problem_mark", None)
                at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
                raise ConfigError("--config", f"{path!r} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--config", f"{path!r} must hold a YAML mapping of groups")
    return config_from_dict(raw, overrides)


def save_config(config: HybridMoEConfig, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config.to_dict(), f, sort_keys=False)
