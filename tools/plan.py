"""Plan a run before launching it: parameters, memory per device, All-to-All traffic, fit.

    python tools/plan.py --config examples/configs/flagship_2p8t.yaml \
        --cluster examples/clusters/h200_128.yaml [--cluster.training full] [--json] \
        [--probe-load examples/probes/flagship_2p8t_h200.json]
    python tools/plan.py --config examples/configs/tiny.yaml --cluster.accelerators 1 \
        --cluster.expert_model_parallel_size 1 --cluster.weight_bytes 4 --measure   # check it here

The parameter count follows the layers exactly (tests compare it with the built model's
numel()). Memory is a model of what a rank holds at its peak:

    weights      base weights (bf16) / EP for experts, / data-parallel replicas under FSDP2
    gradients    trainable parameters only (fp32 main gradients)
    optimizer    fp32 master copy + Adam moments (fp32, or bf16 with optimizer_state_dtype)
                 of trainable parameters; with offload_optimizer these and the fp32 gradients live in host memory
                 (ZeRO-Offload style) and the device keeps one layer's bf16 gradient bucket
    activations  saved activations of the layers of one micro-batch: the model of fused kernels
                 (_activation_bytes_per_token), or with --probe what our layers save, measured by
                 running one layer of each kind (probe_activations)
                 Under expert parallelism the experts' rows are the static dispatcher's fixed
                 buffers (dispatch_rows: moe.dispatch_capacity_factor x the balanced share), not
                 the top-k copies: at the flagship's EP=64 and factor 2.0, 32 rows per token.
    loss         the worst moment of the backward above the saved activations: one fp32
                 [token chunk, vocabulary chunk] tile of the chunked cross-entropy, or one layer's
                 backward working set (_backward_working_bytes_per_token, or measured), whichever
                 is larger
    comm         All-to-All send/receive buffers of one MoE layer, padding included (and, with
                 context parallelism, one sparse layer's gathered keys and their gradient)

A layer too large for one device is probed at two smaller expert counts and carried to its own
(--probe-experts; probe_scaled); a probe saved on a GPU (--probe-save) plans the cluster here
(--probe-load): examples/probes/flagship_2p8t_h200.json is the flagship's, measured on an H200.

Shapes: h hidden, V vocabulary, E experts, K top-k, F expert FFN, S sequence, b micro-batch.
"""

import argparse
import json
import os
import sys
import textwrap
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_moe_hybrid.training.cli import quiet_imports  # noqa: E402

quiet_imports()  # before Megatron's import-time warnings that TE / Apex are missing

from megatron_moe_hybrid.config import (  # noqa: E402
    ConfigError,
    HybridMoEConfig,
    load_config,
    parse_overrides,
)

GiB = 1024**3


@dataclass
class Cluster:
    accelerators: int = 8
    devices_per_node: int = 8
    hbm_gib: float = 141.0  # H200
    host_gib_per_node: float = 2048.0
    intra_node_gbps: float = 450.0  # GB/s per direction (NVLink)
    inter_node_gbps: float = 50.0  # GB/s per device (400 Gb/s NIC)
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 8
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    fsdp: bool = True
    training: str = "lora"  # "lora" | "full"
    lora_rank: int = 16
    expert_adapter: str = "per_expert"  # LoRA on experts: "per_expert" | "shared" (lora.expert_adapter)
    offload_optimizer: bool = False  # master weights, Adam moments and fp32 gradients in host memory
    activation_offload: bool = False  # saved activations of MoE layers in host memory
    recompute: str = "none"  # "none" | "full" (keep layer inputs only, recompute the rest)
    micro_batch_size: int = 1
    seq_length: int = 4096
    weight_bytes: int = 2  # bf16 base weights
    master_weights: bool = True  # full training with weight_bytes < 4 keeps an fp32 master copy
    optimizer_state_dtype: str = "fp32"  # Adam's moments: "fp32" | "bf16" (training.optimizer_state_dtype)
    headroom: float = 0.9  # usable fraction of HBM (allocator fragmentation, workspaces)

    def validate(self) -> None:
        def need(cond, name, msg):
            if not cond:
                raise ConfigError(f"cluster.{name}", msg)

        need(self.training in ("lora", "full"), "training", f"{self.training!r} is not 'lora' or 'full'")
        need(self.recompute in ("none", "full"), "recompute", f"{self.recompute!r} is not 'none' or 'full'")
        need(self.optimizer_state_dtype in ("fp32", "bf16"), "optimizer_state_dtype",
             f"{self.optimizer_state_dtype!r} is not 'fp32' or 'bf16'")
        need(self.expert_adapter in ("per_expert", "shared"), "expert_adapter",
             f"{self.expert_adapter!r} is not 'per_expert' or 'shared'")
        # Megatron's two grids: dense TP x PP x CP x DP and expert TP x PP x EP x expert-DP.
        tp_pp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        for name, size in (("context_parallel_size", self.context_parallel_size),
                           ("expert_model_parallel_size", self.expert_model_parallel_size)):
            need(
                self.accelerators % (tp_pp * size) == 0,
                "accelerators",
                f"{self.accelerators} is not divisible by TP x PP x {name} = {tp_pp * size}",
            )
        for name in ("accelerators", "devices_per_node", "hbm_gib", "micro_batch_size", "seq_length", "lora_rank",
                     "tensor_model_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "host_gib_per_node", "intra_node_gbps", "inter_node_gbps"):
            need(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        need(self.weight_bytes in (1, 2, 4), "weight_bytes", f"{self.weight_bytes} is not 1, 2 or 4 (fp8, bf16, fp32)")
        need(0 < self.headroom <= 1, "headroom", f"is the usable fraction of HBM, within (0, 1]; got {self.headroom}")

    @property
    def data_parallel_size(self) -> int:
        return self.accelerators // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    @property
    def expert_data_parallel_size(self) -> int:
        return self.accelerators // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.expert_model_parallel_size
        )


def _cluster_value(key: str, value, kind: str):
    """value checked against the Cluster field's type (an int field takes an int, a float field
    a number, a bool field true/false): ConfigError naming cluster.<key>."""
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool), "str": isinstance(value, str)}[kind]
    if not ok:
        raise ConfigError(f"cluster.{key}", f"{value!r} is not {'an' if kind == 'int' else 'a'} {kind}")
    return float(value) if kind == "float" else value


def read_yaml_mapping(path: str, field: str) -> dict:
    """A YAML file holding a mapping (empty: {}); ConfigError naming field and the file."""
    try:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(field, f"{path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(field, f"{path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(field, f"{path} must hold a mapping of fields")
    return loaded


def load_cluster(path: Optional[str], overrides: dict, defaults: Optional[dict] = None) -> Cluster:
    """The Cluster of a YAML file (path) and --cluster.<field> overrides over defaults (fields
    neither gives; Cluster's own otherwise). ConfigError naming the file or the field."""
    raw = dict(defaults or {})
    if path:
        raw.update(read_yaml_mapping(path, "cluster"))
    raw.update(overrides)
    names = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(Cluster)}
    for key in raw:
        if key not in names:
            raise ConfigError(f"cluster.{key}", f"unknown field; valid: {', '.join(names)}")
        raw[key] = _cluster_value(key, raw[key], names[key])
    cluster = Cluster(**raw)
    cluster.validate()
    return cluster


# Parameters ---------------------------------------------------------------------------------


def _norm(c: HybridMoEConfig, dim: int) -> int:
    return dim * (2 if c.normalization == "LayerNorm" else 1)


def linear_attention_params(c: HybridMoEConfig) -> int:
    la = c.linear_attention
    qk, v = la.num_qk_heads * la.head_k_dim, la.num_v_heads * la.head_v_dim
    logits = 2 if la.variant == "gated_delta_rule" else 1
    n = c.hidden_size * (2 * qk + 2 * v + logits * la.num_v_heads)  # in_proj: q k v z + head logits
    if la.conv_kernel_size:
        n += (2 * qk + v) * la.conv_kernel_size  # depthwise conv over q, k, v
    if la.variant == "gated_delta_rule":
        n += 2 * la.num_v_heads  # A_log, dt_bias
    n += la.head_v_dim  # output RMSNorm, shared by heads
    n += v * c.hidden_size  # out_proj
    return n


def sparse_attention_params(c: HybridMoEConfig) -> int:
    sa = c.sparse_attention
    heads, groups, d = c.num_attention_heads, c.num_query_groups or c.num_attention_heads, c.kv_channels
    n = c.hidden_size * (heads + 2 * groups) * d  # linear_qkv
    n += heads * d * c.hidden_size  # linear_proj
    n += c.hidden_size * sa.index_n_heads * sa.index_head_dim  # indexer queries
    n += c.hidden_size * sa.index_head_dim  # indexer key (one, shared)
    n += c.hidden_size * sa.index_n_heads  # per-head weights
    n += 2 * sa.index_head_dim  # LayerNorm on the key
    return n


def moe_params(c: HybridMoEConfig) -> tuple[int, int]:
    """(routed expert params, the rest of the MoE layer) per layer."""
    m, h = c.moe, c.hidden_size
    experts = m.num_experts * 3 * h * m.ffn_hidden_size  # SwiGLU: [h, 2F] + [F, h]
    rest = m.num_experts * h  # router
    if m.shared_expert_ffn_hidden_size:
        rest += 3 * h * m.shared_expert_ffn_hidden_size
        rest += h if getattr(m, "shared_expert_gate", False) else 0  # its [1, h] sigmoid gate
    return experts, rest


def gated_attention_params(c: HybridMoEConfig) -> int:
    """Qwen3-Next gated full attention (letter A): q (+ gate), k, v, output projections and the
    per-head q/k norms."""
    h, heads = c.hidden_size, c.num_attention_heads
    groups, d = c.num_query_groups or heads, c.kv_channels or h // heads
    return h * 2 * heads * d + 2 * h * groups * d + heads * d * h + 2 * d


def mla_attention_params(c: HybridMoEConfig) -> int:
    """DeepSeek-V3.2 MLA with the lightning indexer (letter M): q (low-rank or plain), the kv
    latent and its up-projection, the output projection, and the indexer."""
    h, heads, m, sa = c.hidden_size, c.num_attention_heads, c.mla, c.sparse_attention
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk if m.q_lora_rank else h * heads * qk
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    kv += m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    out = heads * m.v_head_dim * h
    index_in = m.q_lora_rank or h
    index = index_in * sa.index_n_heads * sa.index_head_dim + h * sa.index_head_dim + 2 * sa.index_head_dim
    index += h * sa.index_n_heads
    return q + kv + out + index


def count_parameters(c: HybridMoEConfig) -> dict[str, Any]:
    h, V = c.hidden_size, c.vocab_size
    attention = {"L": linear_attention_params(c), "S": sparse_attention_params(c), "A": gated_attention_params(c),
                 "M": mla_attention_params(c)}
    expert_per_layer, moe_rest = moe_params(c)
    dense_mlp = 3 * h * c.moe.dense_ffn_hidden_size
    counts = {"embedding": V * h, "output_layer": V * h, "final_norm": _norm(c, h)}
    attn_total = expert_total = mlp_dense = 0
    num_moe = 0
    for i in range(c.num_layers):
        attn_total += attention[c.layer_kind(i)] + 2 * _norm(c, h)  # + the layer's two norms
        if c.is_moe_layer(i):
            num_moe += 1
            expert_total += expert_per_layer
            mlp_dense += moe_rest
        else:
            mlp_dense += dense_mlp
    counts.update(attention_and_norms=attn_total, routed_experts=expert_total, mlp_other=mlp_dense)
    total = sum(counts.values())
    per_expert = 3 * h * c.moe.ffn_hidden_size
    active = total - expert_total + num_moe * c.moe.topk * per_expert
    return {"total": total, "active": active, "routed_experts": expert_total, "dense": total - expert_total,
            "num_moe_layers": num_moe, "breakdown": counts}


def lora_parameter_groups(
    c: HybridMoEConfig, rank: int, expert_adapter: str = "per_expert", targets: Optional[list] = None
) -> dict[str, int]:
    """Adapter parameters per lora.targets group (targets: default c.lora.targets, "attention"
    expanded by the pattern): an [in, rank] and a [rank, out] matrix per wrapped linear, and on
    both matmuls of every routed expert (expert_adapter "per_expert"), or one adapter pair per MoE
    layer for all its experts ("shared": a dense parameter, the same on every rank).
    lora.target_modules, which narrows the groups by module path, is not counted."""
    from megatron_moe_hybrid.registry import expand_lora_targets

    targets = expand_lora_targets(c.lora.targets if targets is None else targets, c.pattern)
    h, heads = c.hidden_size, c.num_attention_heads

    def pairs(*shapes: tuple[int, int]) -> int:  # (in, out) of each wrapped linear
        return sum(rank * (i + o) for i, o in shapes)

    la = c.linear_attention
    qk, v = la.num_qk_heads * la.head_k_dim, la.num_v_heads * la.head_v_dim
    logits = 2 if la.variant == "gated_delta_rule" else 1
    lin = pairs((h, 2 * qk + 2 * v + logits * la.num_v_heads), (v, h))  # in_proj, out_proj
    groups, d = c.num_query_groups or heads, c.kv_channels
    sparse = pairs((h, (heads + 2 * groups) * d), (heads * d, h))  # S: linear_qkv, linear_proj
    ga_d = c.kv_channels or h // heads  # A: q (+ its gate), k, v, output
    full = pairs((h, 2 * heads * ga_d), (h, groups * ga_d), (h, groups * ga_d), (heads * ga_d, h))
    m = c.mla  # M: MLA's q (down, up; or plain), kv down / up and output projections
    mqk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = pairs((h, m.q_lora_rank), (m.q_lora_rank, heads * mqk)) if m.q_lora_rank else pairs((h, heads * mqk))
    mla = q + pairs((h, m.kv_lora_rank + m.qk_rope_head_dim), (m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                    (heads * m.v_head_dim, h))  # fmt: skip
    sa = c.sparse_attention  # the indexer's query, key and head-weight projections

    def indexer(q_in: int) -> int:
        return pairs((q_in, sa.index_n_heads * sa.index_head_dim), (h, sa.index_head_dim), (h, sa.index_n_heads))

    F, Fs, Fd = c.moe.ffn_hidden_size, c.moe.shared_expert_ffn_hidden_size, c.moe.dense_ffn_hidden_size
    per_layer = {
        "experts": (1 if expert_adapter == "shared" else c.moe.num_experts) * pairs((h, 2 * F), (F, h)),
        "shared_expert": pairs((h, 2 * Fs), (Fs, h)) if Fs else 0,
        "dense_mlp": pairs((h, 2 * Fd), (Fd, h)),
    }
    counts = dict.fromkeys(targets, 0)
    for i in range(c.num_layers):
        kind = c.layer_kind(i)
        layer = {
            "linear_attention": lin if kind == "L" else 0,
            "sparse_attention": {"S": sparse, "M": mla}.get(kind, 0),
            "full_attention": full if kind == "A" else 0,
            "indexer": indexer(h if kind == "S" else m.q_lora_rank or h) if kind in "SM" else 0,
            "experts": per_layer["experts"] if c.is_moe_layer(i) else 0,
            "shared_expert": per_layer["shared_expert"] if c.is_moe_layer(i) else 0,
            "dense_mlp": 0 if c.is_moe_layer(i) else per_layer["dense_mlp"],
        }
        for t in counts:
            counts[t] += layer[t]
    return counts


def lora_parameters(
    c: HybridMoEConfig, rank: int, expert_adapter: str = "per_expert", targets: Optional[list] = None
) -> int:
    """All adapter parameters of lora_parameter_groups."""
    return sum(lora_parameter_groups(c, rank, expert_adapter, targets).values())


# Memory ---------------------------------------------------------------------------------------


def dispatch_rows(c: HybridMoEConfig, cl: Cluster) -> tuple[float, float]:
    """Rows per token of one MoE layer's fixed buffers on a rank, as the static dispatcher sizes
    them (ops.moe.layout, moe.dispatch_capacity_factor): (rows it sends and receives, ep x C;
    expert-grouped rows it computes, R). At EP=1 the layout is the identity (T sent, T x K
    computed); under EP a factor f holds f x the balanced share whether or not the tokens need
    it: the flagship's EP=64 at f=2 computes on 2 x 16 = 32 rows per token, not 16."""
    from megatron_moe_hybrid.ops.moe import layout

    m, ep = c.moe, cl.expert_model_parallel_size
    if m.dispatcher != "static":  # exact sizes: the top-k copies (one host sync per layer)
        return float(m.topk), float(m.topk)
    chunks = m.dispatch_chunks
    tokens = max(1, cl.micro_batch_size * cl.seq_length // cl.context_parallel_size // chunks)
    per_pair = layout.token_capacity(tokens, m.topk, ep, m.dispatch_capacity_factor)
    rows = layout.expert_rows(ep * per_pair, tokens, m.topk, m.num_experts // ep, m.dispatch_capacity_factor, ep)
    return ep * per_pair / tokens, rows / tokens


def expert_row_bytes(c: HybridMoEConfig, act_bytes: int = 2) -> int:
    """What the experts save per expert-grouped row: its input, fc1 output, activation, fc2 output."""
    h, F = c.hidden_size, c.moe.ffn_hidden_size
    return (h + 2 * F + F + h) * act_bytes


def _backward_working_bytes_per_token(c: HybridMoEConfig, moe: bool, expert_rows: float, act_bytes: int = 2) -> float:
    """What a layer's backward holds above what it saved, per token, at its worst moment, less
    the parameter gradients it creates: an MoE layer's is one [R, h] buffer of its experts'
    input gradient (the H200 at the flagship's widths, EP=1: 222.6 KiB per token against
    K x h x 2 = 224 KiB, in linear and sparse layers alike), a dense MLP's its [T, 3F] (107.8 KiB
    against 108). The attention's backward is smaller there and not modelled
    (benchmarks/results/h200/plan_memory.json, flagship rows)."""
    if moe:
        return expert_rows * c.hidden_size * act_bytes
    return 3 * c.moe.dense_ffn_hidden_size * act_bytes


def _kept_linear_state_bytes(c: HybridMoEConfig, act_bytes: int = 2) -> float:
    """What the Triton chunk kernels keep from forward to backward beyond their inputs, per token
    (triton_chunk.kept_bytes_per_token: the chunk states, the delta rule's U, the prep's gam, P
    and w, under its switches). The flagship's linear layer: 72 KiB per token, 8% of what it
    saves (the H200 probe)."""
    from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc

    la = c.linear_attention
    gdn = la.variant == "gated_delta_rule"
    return tc.kept_bytes_per_token(gdn, la.num_v_heads, la.head_k_dim, la.head_v_dim, act_bytes)


def cp_linear_gather_bytes(c: HybridMoEConfig, cl: Cluster) -> float:
    """One linear layer's context-parallel all-gather, as cp_linear_attention gathers it: every
    piece's state and transition, [cp x 2 pieces x b, HV, K, V + K] in fp32 (zigzag: two pieces
    per rank; without the final state's rows), whatever the length."""
    la = c.linear_attention
    rows = 2 * cl.context_parallel_size * cl.micro_batch_size
    return rows * la.num_v_heads * la.head_k_dim * (la.head_k_dim + la.head_v_dim) * 4


def _activation_bytes_per_token(
    c: HybridMoEConfig, kind: str, moe: bool, act_bytes: int = 2, seq_length: int = 0,
    expert_rows: Optional[float] = None,
) -> float:
    """Bytes a layer saves for its backward, per token (bf16 activations, fp32 where kept so);
    expert_rows: the experts' rows per token (dispatch_rows; the top-k where not given)."""
    h = c.hidden_size
    la, sa, m = c.linear_attention, c.sparse_attention, c.moe
    n = 2 * h * act_bytes  # the two norm inputs
    if kind == "L":
        qk, v = la.num_qk_heads * la.head_k_dim, la.num_v_heads * la.head_v_dim
        n += (2 * qk + 2 * v + 2 * la.num_v_heads) * act_bytes  # in_proj output
        n += (2 * qk + v) * act_bytes * 2  # conv output and its activation
        n += 3 * v * 4  # chunk output and gated-norm input (fp32)
        n += _kept_linear_state_bytes(c, act_bytes)
    elif kind == "M":  # MLA: q and the kv latent, then per form; the indexer as in S
        heads, mla = c.num_attention_heads, c.mla
        qk, latent = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.kv_lora_rank + mla.qk_rope_head_dim
        n += (heads * qk + latent) * act_bytes
        if mla.absorbed:  # q folded into the latent per head, the attention's latent output, v-space output
            n += heads * (latent + mla.kv_lora_rank + mla.v_head_dim) * act_bytes
        else:  # k and v per head, the output
            n += heads * (mla.qk_nope_head_dim + mla.v_head_dim) * act_bytes + heads * mla.v_head_dim * act_bytes
        n += heads * 4  # log-sum-exp
        n += sa.index_n_heads * sa.index_head_dim * act_bytes + sa.index_head_dim * act_bytes
        n += sa.topk * 4  # selected indices (int32)
    elif kind == "A":  # flash kernels (SDPA / varlen on CUDA): memory linear in the sequence
        heads, groups, d = c.num_attention_heads, c.num_query_groups or c.num_attention_heads, c.kv_channels
        n += (2 * heads + 2 * groups) * d * act_bytes + 2 * heads * d * act_bytes  # q+gate, k, v; out, gated
        n += heads * 4  # log-sum-exp
    else:
        heads, groups, d = c.num_attention_heads, c.num_query_groups or c.num_attention_heads, c.kv_channels
        n += (heads + 2 * groups) * d * act_bytes + heads * d * act_bytes  # qkv, attention output
        n += heads * 4  # log-sum-exp
        n += sa.index_n_heads * sa.index_head_dim * act_bytes + sa.index_head_dim * act_bytes
        n += sa.topk * 4  # selected indices (int32)
    if moe:
        k, F = m.topk if expert_rows is None else expert_rows, m.ffn_hidden_size
        n += m.num_experts * 4  # router scores
        n += k * expert_row_bytes(c, act_bytes)
        if m.shared_expert_ffn_hidden_size:
            n += 3 * m.shared_expert_ffn_hidden_size * act_bytes
    else:
        n += 3 * m.dense_ffn_hidden_size * act_bytes
    return n


def kept_for_recompute(c: HybridMoEConfig, cl: Cluster) -> list[float]:
    """Bytes per token alive during layer i's backward under full recompute, besides the layer
    inputs: each sparse layer (S, M) below i keeps its top-k selection (int32) and the indexer
    head weights it is checked against until its recompute reuses it
    (parallel/recompute.py reuse_in_recompute; not under context parallelism, whose sparse core
    selects again). Zero without recompute."""
    if cl.recompute != "full" or cl.context_parallel_size > 1 or c.sparse_attention.stage != "sparse":
        return [0.0] * c.num_layers
    sa = c.sparse_attention
    per_layer = 4 * min(sa.topk, cl.seq_length) + cl.weight_bytes * sa.index_n_heads
    kept, below = [], 0
    for i in range(c.num_layers):
        kept.append(float(below))
        below += per_layer if c.layer_kind(i) in ("S", "M") else 0
    return kept


def plan(c: HybridMoEConfig, cl: Cluster, probe: Optional[dict] = None) -> dict[str, Any]:
    """probe: probe_activations()'s measured bytes per token (per layer and of the head), used
    instead of the analytic activation model (_activation_bytes_per_token, which assumes fused
    kernels that save their inputs only)."""
    params = count_parameters(c)
    wb = cl.weight_bytes
    pp, ep, tp = cl.pipeline_model_parallel_size, cl.expert_model_parallel_size, cl.tensor_model_parallel_size
    dp, edp = cl.data_parallel_size, cl.expert_data_parallel_size
    dense_share = 1 / (tp * pp * (dp if cl.fsdp else 1))
    expert_share = 1 / (tp * pp * ep * (edp if cl.fsdp else 1))
    weights = wb * (params["dense"] * dense_share + params["routed_experts"] * expert_share)

    if cl.training == "full":
        trainable_dense, trainable_expert = params["dense"], params["routed_experts"]
    else:
        lora = lora_parameter_groups(c, cl.lora_rank, cl.expert_adapter)
        # per-expert adapters are sharded with their experts; a shared one is a dense (replicated) parameter
        trainable_expert = lora.get("experts", 0) if cl.expert_adapter == "per_expert" else 0
        trainable_dense = sum(lora.values()) - trainable_expert
        weights += 4 * (trainable_dense * dense_share + trainable_expert * expert_share)  # fp32 adapters
    trainable_local = trainable_dense * dense_share + trainable_expert * expert_share
    # Adam m, v (fp32), plus an fp32 master copy where full training keeps lower-precision weights
    master = 4 if cl.training == "full" and wb < 4 and cl.master_weights else 0
    # Without a master copy, full training keeps gradients and Adam moments in the weights'
    # dtype (torch's AdamW on bf16 parameters); LoRA adapters are fp32 either way.
    pure = cl.training == "full" and wb < 4 and not cl.master_weights
    state_bytes = wb if pure else 4
    moment_bytes = 2 if cl.optimizer_state_dtype == "bf16" else state_bytes  # BF16StateAdamW: bf16 moments
    optimizer_bytes = (master + 2 * moment_bytes) * trainable_local
    if cl.offload_optimizer:
        layer_trainable = trainable_local / max(1, c.num_layers / pp)
        gradients, optimizer = 2 * layer_trainable, 0.0  # one layer's bf16 bucket in flight
        host_optimizer = optimizer_bytes + 4 * trainable_local
    else:
        gradients, optimizer, host_optimizer = state_bytes * trainable_local, optimizer_bytes, 0.0

    tokens = cl.micro_batch_size * cl.seq_length / cl.context_parallel_size
    layers_local = c.num_layers / pp
    send_rows, rows = dispatch_rows(c, cl)
    m = c.moe
    if probe is not None:
        # The probe ran one process (EP=1: T x K expert rows); under EP the static buffers hold
        # R rows per token instead: the difference, by the analytic model's bytes per row.
        extra, ab = rows - m.topk, torch.empty((), dtype=c.params_dtype).element_size()
        per_layer = [a + (extra * expert_row_bytes(c, ab) if c.is_moe_layer(i) else 0.0)
                     for i, a in enumerate(probe["layers"])]  # fmt: skip
        work = [w + (extra * c.hidden_size * ab if c.is_moe_layer(i) else 0.0)
                for i, w in enumerate(probe["layers_backward"])]  # fmt: skip
    else:
        per_layer = [
            _activation_bytes_per_token(c, c.layer_kind(i), c.is_moe_layer(i), seq_length=cl.seq_length,
                                        expert_rows=rows)
            for i in range(c.num_layers)
        ]
        work = [_backward_working_bytes_per_token(c, c.is_moe_layer(i), rows) for i in range(c.num_layers)]
    held = kept_for_recompute(c, cl)
    if cl.recompute == "full":
        # each layer keeps its input; layer i's backward also finds the selections that the
        # sparse layers below it keep for their recompute
        activations = tokens * (layers_local * c.hidden_size * 2 + max(a + k for a, k in zip(per_layer, held)))
    else:
        kept = list(per_layer)
        if cl.activation_offload and probe is not None:
            raise ValueError("probe: measured activations do not separate the MoE part; plan offload analytically")
        if cl.activation_offload:  # MoE activations go to the host; keep one layer's worth in flight
            moe_part = [
                _activation_bytes_per_token(c, c.layer_kind(i), True, seq_length=cl.seq_length, expert_rows=rows)
                - _activation_bytes_per_token(c, c.layer_kind(i), False, seq_length=cl.seq_length)
                if c.is_moe_layer(i) else 0.0 for i in range(c.num_layers)
            ]
            kept = [b - m for b, m in zip(per_layer, moe_part)]
            kept[0] += max(moe_part)
        activations = tokens * sum(kept) / pp
    loss = 4 * min(c.memory.ce_chunk_size, tokens) * min(c.vocab_size / tp, 8192) * 2 + tokens * (
        c.hidden_size * 4
    )
    # The worst moment of the backward: the loss's (everything still saved) or layer i's (the
    # layers above it have freed theirs), measured (probe) or modelled.
    act = per_layer
    if cl.recompute == "full":
        worst = max(work[i] + act[i] + held[i] for i in range(c.num_layers)) - max(a + k for a, k in zip(act, held))
    else:
        worst = max(work[i] - sum(act[i + 1 :]) for i in range(c.num_layers))
    # The loss's working set is chunked (memory.ce_chunk_size): the model above, not the
    # probe's single micro-batch scaled by tokens.
    loss = max(tokens * (probe["head"] if probe is not None else 0.0) + loss, tokens * worst)
    a2a_tokens = tokens * send_rows  # rows each rank sends, padding included (fixed split sizes)
    comm = 2 * a2a_tokens * c.hidden_size * wb if ep > 1 else 0.0  # send + receive of one layer in flight
    if cl.fsdp:  # one unsharded layer gathered at a time (+ prefetch of the next)
        biggest = max(
            (linear_attention_params(c) if k == "L" else sparse_attention_params(c)) for k in set(c.pattern)
        ) + moe_params(c)[1] + moe_params(c)[0] / ep
        comm += 2 * biggest * wb
    cp = cl.context_parallel_size
    cp_bytes = cp_buffer = 0.0
    if cp > 1:
        # Sparse layers all-gather the keys every query may select (the MQA/GQA-shared K, V and
        # the indexer key) in the forward, and reduce-scatter their gradients in the backward;
        # one layer's gathered copy and its gradient are alive at a time; gated full attention
        # layers (A) gather their K and V the same way, MLA layers (M) their one latent kv and
        # indexer key. Linear layers all-gather each piece's state and K x K transition (fp32):
        # independent of the length.
        sa, la = c.sparse_attention, c.linear_attention
        groups = c.num_query_groups or c.num_attention_heads
        kv_token = (2 * groups * c.kv_channels + sa.index_head_dim) * wb  # bytes per token
        mla_token = (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim + sa.index_head_dim) * wb  # latent kv, indexer key
        # the linear layers' gathered tensor itself, and the fold over the pieces keeps their
        # incoming states (its V part) beside it
        state = cp_linear_gather_bytes(c, cl)
        biggest_token = max(kv_token, mla_token if "M" in c.pattern else 0)
        cp_buffer = 2 * cl.micro_batch_size * cl.seq_length * biggest_token + state * (1 + la.head_v_dim / (la.head_k_dim + la.head_v_dim))
        n_sparse = sum(c.layer_kind(i) == "S" for i in range(c.num_layers)) / pp
        n_full = sum(c.layer_kind(i) == "A" for i in range(c.num_layers)) / pp
        n_mla = sum(c.layer_kind(i) == "M" for i in range(c.num_layers)) / pp
        n_linear = sum(c.layer_kind(i) == "L" for i in range(c.num_layers)) / pp
        sparse_gather = cl.micro_batch_size * cl.seq_length * kv_token * (cp - 1) / cp
        full_gather = cl.micro_batch_size * cl.seq_length * 2 * groups * c.kv_channels * wb * (cp - 1) / cp
        mla_gather = cl.micro_batch_size * cl.seq_length * mla_token * (cp - 1) / cp
        cp_bytes = (2 * sparse_gather * n_sparse + 2 * full_gather * n_full + 2 * mla_gather * n_mla
                    + 2 * state * (cp - 1) / cp * n_linear)  # fmt: skip
        cp_bytes *= 1 if cl.recompute == "none" else 1.5
    terms = {"weights": weights, "gradients": gradients, "optimizer": optimizer, "activations": activations,
             "loss": loss, "comm_buffers": comm + cp_buffer}
    peak = sum(terms.values())
    budget = cl.hbm_gib * GiB * cl.headroom
    host_per_node = host_optimizer * cl.devices_per_node
    if cl.activation_offload:
        host_per_node += tokens * sum(per_layer) / pp * cl.devices_per_node
    fits_host = host_per_node <= cl.host_gib_per_node * GiB * cl.headroom
    # All-to-All: dispatch + combine in the forward, their mirrors in the backward.
    a2a_bytes = 4 * a2a_tokens * c.hidden_size * wb * (ep - 1) / ep * params["num_moe_layers"] / pp
    a2a_bytes *= 1 if cl.recompute == "none" else 1.5  # recomputed forward re-dispatches
    num_micro = max(1, c.training.global_batch_size // (cl.micro_batch_size * dp))
    link = cl.intra_node_gbps if ep <= cl.devices_per_node else cl.inter_node_gbps
    return {
        "parameters": params,
        "trainable_parameters": trainable_dense + trainable_expert,
        # issue 6's measure: the adapters' Adam state against the frozen base weights, per device
        "optimizer_over_base_weights": optimizer / (wb * (params["dense"] * dense_share + params["routed_experts"] * expert_share))
        if cl.training == "lora" else None,
        "bf16_weights_bytes": 2 * params["total"],
        "per_device_bytes": terms,
        "peak_bytes": peak,
        "budget_bytes": budget,
        "fits": peak <= budget and fits_host,
        "dominant": max(terms, key=terms.get),
        "host_bytes_per_node": host_per_node,
        "fits_host": fits_host,
        "a2a_bytes_per_micro_batch_per_device": a2a_bytes,
        "a2a_bytes_per_step_per_device": a2a_bytes * num_micro,
        "a2a_seconds_per_step": a2a_bytes * num_micro / (link * 1e9),
        "cp_bytes_per_micro_batch_per_device": cp_bytes,
        "cp_seconds_per_step": cp_bytes * num_micro / (cl.intra_node_gbps * 1e9),
        "micro_batches_per_step": num_micro,
        "data_parallel_size": dp,
        "expert_data_parallel_size": edp,
    }


# Measuring on this machine -----------------------------------------------------------------


def _run_config(c: HybridMoEConfig, cl: Cluster, **overrides) -> HybridMoEConfig:
    """The model config as one process runs it: world 1, no FSDP, LoRA per the cluster."""
    from megatron_moe_hybrid.config import config_from_dict

    raw = c.to_dict()
    over = {"parallel.world_size": 1, "parallel.expert_model_parallel_size": 1, "parallel.context_parallel_size": 1,
            "parallel.fsdp": False, "lora.enabled": cl.training == "lora", "lora.rank": cl.lora_rank,
            "training.micro_batch_size": cl.micro_batch_size, "training.seq_length": cl.seq_length,
            "memory.recompute_layers": -1 if cl.recompute == "full" else 0, **overrides}  # fmt: skip
    return config_from_dict(raw, over)


def _build(c: HybridMoEConfig, device: str):
    from megatron_moe_hybrid.models import build_model

    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a flagship-wide layer takes minutes on a CPU
        model = build_model(c)
    if c.lora.enabled:
        from megatron_moe_hybrid.layers.lora import apply_lora

        lo = c.lora
        apply_lora(model, lo.targets, lo.rank, lo.alpha, lo.dropout, rslora=lo.rslora,
                   expert_adapter=lo.expert_adapter, target_modules=lo.target_modules,
                   base_dtype=None if lo.base_dtype == "float32" else lo.base_dtype)  # fmt: skip
    return model.to(device).train()


def _batch(c: HybridMoEConfig, b: int, s: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, c.vocab_size, (b, s), generator=g).to(device)
    return tokens, torch.arange(s, device=device).expand(b, s)


def _peak_during(fn, device: str) -> int:
    """Highest tensor memory above the level at the call's start while fn() runs."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"):
        live += n
        peak = max(peak, live)
    return peak


def probe_activations(
    c: HybridMoEConfig, cl: Cluster, device: str = "cpu", num_experts: Optional[int] = None,
    seq_length: Optional[int] = None,
) -> dict:
    """What our layers hold for the backward, measured by running them: one decoder layer of
    each (letter, MoE or dense) kind in the model (one period of the pattern; two when the
    model has dense first layers) at micro-batch 1 and the cluster's sequence length, or
    `seq_length` (what the linear and top-k sparse layers save per token does not depend on it;
    a sparse layer's backward working set is about fixed in bytes, so a shorter probe
    overstates it per token: on the H200 at the flagship's widths 408.5 KiB at 4096 tokens,
    222.7 at 8192),
    with the model's experts or `num_experts` (see probe_scaled). Returns bytes per token:
      "layers":   saved for the backward by layer i of the real model (unique storages that
                  are not parameters; a storage two layers save counts once);
      "head":     saved outside the layers (embedding, final norm, loss);
      "layers_backward", "head_backward": the working set of that layer's (the loss's)
                  backward above what was alive when it started, less the parameter gradients
                  it creates (the gradients term holds them).
    Exact for our kernels as they are, on `device`."""
    from megatron_moe_hybrid.testing import init_megatron, teardown

    dense = min(c.moe.first_k_dense, 1)  # with dense first layers, two periods hold every kind
    tokens_n = seq_length or cl.seq_length
    # stored activations (no recompute): what each layer saves is what the probe measures
    small = _run_config(c, cl, **{"model.num_layers": len(c.pattern) * (1 + dense), "moe.first_k_dense": dense,
                                  "training.micro_batch_size": 1, "memory.recompute_layers": 0,
                                  "training.seq_length": tokens_n,
                                  "moe.num_experts": num_experts or c.moe.num_experts})  # fmt: skip
    key = lambda cfg, i: (cfg.layer_kind(i), cfg.is_moe_layer(i))  # noqa: E731
    _check_probe_fits(small, cl, device)
    with _maybe_megatron(init_megatron, teardown):
        model = _build(small, device)
        layers = list(model.decoder.layers)
        param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        where, saved, cut = ["head"], {}, {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in param_ptrs:
                saved.setdefault(where[-1], {})[st.data_ptr()] = st.nbytes()
            return t

        def enter(i):
            def hook(module, args, kwargs):
                where.append(i)
                if i == 0:  # the embedding's backward is not a layer's
                    return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach().requires_grad_()}
                return None

            return hook

        def leave(i):
            def hook(module, args, kwargs, output):
                where.pop()
                # The next layer reads a detached copy (the same storage: nothing counts twice),
                # so each layer's backward runs, and is measured, on its own.
                handed = output[0].detach().requires_grad_()
                cut[i] = (output[0], handed)
                return (handed, *output[1:])

            return hook

        hooks = []
        for i, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
            hooks.append(layer.register_forward_hook(leave(i), with_kwargs=True))
        tokens, positions = _batch(small, 1, tokens_n, device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, positions, None, labels=tokens).mean()
        for h in hooks:
            h.remove()
        seen, per = set(), {}
        for w in ["head"] + list(range(len(layers))):
            fresh = {p: n for p, n in saved.get(w, {}).items() if p not in seen}
            seen.update(fresh)
            per[w] = sum(fresh.values()) / tokens_n

        def grad_bytes(module) -> int:
            return sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)

        # Backward, the loss first, then the layers from the top, each measured on its own.
        before = grad_bytes(model)
        head_working = _peak_during(loss.backward, device) - (grad_bytes(model) - before)
        working = {}
        for i in reversed(range(len(layers))):
            out, handed = cut[i]
            before = grad_bytes(layers[i])
            working[i] = _peak_during(lambda: out.backward(handed.grad), device) - (grad_bytes(layers[i]) - before)
        by_kind = {key(small, i): (per[i], working[i] / tokens_n) for i in range(small.num_layers)}
    return {"layers": [by_kind[key(c, i)][0] for i in range(c.num_layers)], "head": per["head"],
            "layers_backward": [by_kind[key(c, i)][1] for i in range(c.num_layers)],
            "head_backward": head_working / tokens_n,
            "probed": {"device": device, "num_experts": small.moe.num_experts, "seq_length": tokens_n}}  # fmt: skip


def _memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_probe_fits(small: HybridMoEConfig, cl: Cluster, device: str) -> None:
    """Refuse, before building anything, a probe whose weights alone take over half the device."""
    weights = count_parameters(small)["total"] * cl.weight_bytes
    have = _memory_bytes(device)
    if weights > have / 2:
        raise ConfigError(
            "probe_experts",
            f"the probe's {small.num_layers} layers at {small.moe.num_experts} experts hold {weights / GiB:.1f} GiB of "
            f"weights, over half of this {device}'s {have / GiB:.0f} GiB; probe at fewer experts and carry the "
            "bytes to the model's: --probe-experts E1,E2 (the flagship's: 16,64 on an H200)",
        )


PROBE_KEYS = ("layers", "head", "layers_backward", "head_backward")


def probe_scaled(
    c: HybridMoEConfig, cl: Cluster, device: str, experts: tuple[int, int], seq_length: Optional[int] = None
) -> dict:
    """probe_activations for a model whose layers do not fit one device whole: probed at two
    smaller expert counts and carried to the model's (carry_probes). Per token, what an MoE
    layer saves is its top-k copies (independent of the count) plus [tokens, experts] router
    tensors and per-expert padding (proportional to it), so two counts fix both. Under expert
    parallelism each rank computes, on average, as many token copies as it sends, so the same
    per-token bytes hold per device."""
    e1, e2 = experts
    if not (c.moe.topk <= e1 < e2):
        raise ConfigError("probe_experts", f"need moe.topk={c.moe.topk} <= E1 < E2, got {e1},{e2}")
    a = probe_activations(c, cl, device, num_experts=e1, seq_length=seq_length)
    b = probe_activations(c, cl, device, num_experts=e2, seq_length=seq_length)
    return carry_probes(a, b, c.moe.num_experts)


def carry_probes(a: dict, b: dict, num_experts: int) -> dict:
    """Two probes of one model at expert counts E1 < E2, carried to num_experts: what the layers
    save, linearly; the backward working sets, as the larger of the two. Those are net of the
    parameter gradients the backward creates, which are a fixed size per expert (LoRA's
    per-expert adapters), not per token: per token at the probe's length they fall with the
    count (on the H200 at the flagship's layer, -160 bytes per expert per token at 4096
    tokens), which a real rank does not see (its 14 experts' gradients, in the gradients
    term), so their slope is not carried."""
    e1, e2 = a["probed"]["num_experts"], b["probed"]["num_experts"]
    if not e1 < e2 or a["probed"]["seq_length"] != b["probed"]["seq_length"]:
        raise ValueError(f"carry_probes: need E1 < E2 at one length, got {a['probed']} and {b['probed']}")
    t = (num_experts - e1) / (e2 - e1)

    def carry(x, y):
        return [u + (v - u) * t for u, v in zip(x, y)] if isinstance(x, list) else x + (y - x) * t

    def larger(x, y):
        return [max(u, v) for u, v in zip(x, y)] if isinstance(x, list) else max(x, y)

    out = {k: (larger if k.endswith("_backward") else carry)(a[k], b[k]) for k in PROBE_KEYS}
    out["probed"] = {"device": a["probed"]["device"], "num_experts": [e1, e2], "seq_length": a["probed"]["seq_length"],
                     "carried_to_num_experts": num_experts,
                     "at": {str(e1): {k: a[k] for k in PROBE_KEYS}, str(e2): {k: b[k] for k in PROBE_KEYS}}}  # fmt: skip
    return out


def load_probe(path: str, c: HybridMoEConfig) -> dict:
    """A probe saved by --probe-save, checked against the model it is used for."""
    try:
        with open(path) as f:
            probe = json.load(f)
    except OSError as e:
        raise ConfigError("probe_load", f"{path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError("probe_load", f"{path} is not JSON ({e}); write it with --probe --probe-save") from None
    missing = [k for k in PROBE_KEYS if k not in probe]
    if missing:
        raise ConfigError("probe_load", f"{path} lacks {', '.join(missing)}; write it with --probe --probe-save")
    want = probe_model(c)
    got = probe.get("model", {})
    differ = [f"{k} {got.get(k)} (model: {v})" for k, v in want.items() if got.get(k) != v]
    if differ:
        raise ConfigError("probe_load", f"{path} probed another model: {'; '.join(differ)}; probe this model again")
    return probe


def probe_model(c: HybridMoEConfig) -> dict:
    """What a saved probe must match: the dimensions that set the per-token bytes."""
    la, sa, m = c.linear_attention, c.sparse_attention, c.moe
    return {"num_layers": c.num_layers, "pattern": c.pattern, "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads, "num_query_groups": c.num_query_groups,
            "linear_attention": [la.variant, la.num_qk_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim],
            "sparse_attention": [sa.topk, sa.index_n_heads, sa.index_head_dim],
            "moe": [m.num_experts, m.topk, m.ffn_hidden_size, m.shared_expert_ffn_hidden_size, m.first_k_dense,
                    m.dense_ffn_hidden_size],
            "vocab_size": c.vocab_size, "params_dtype": str(c.params_dtype)}  # fmt: skip


class _maybe_megatron:
    """Megatron's parallel_state for one process, unless the caller has one."""

    def __init__(self, init, teardown):
        self.init, self.teardown = init, teardown

    def __enter__(self):
        from megatron.core import parallel_state as ps

        self.owned = not ps.model_parallel_is_initialized()
        if self.owned:
            self.init()

    def __exit__(self, *exc):
        if self.owned:
            self.teardown()


def _live_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure_peak(
    c: HybridMoEConfig, cl: Cluster, device: str = "cpu", micro_batches: int = 2, distributed: bool = False
) -> int:
    """Peak bytes of tensor memory over one training step of our model as the trainer runs it in
    one process (LoRA per the cluster, AdamW on the trainable parameters, gradients accumulated
    over `micro_batches` micro-batches), after a first step has created the optimizer state.
    CUDA: torch.cuda.max_memory_allocated; CPU: the profiler's allocation events on top of the
    tensors alive when the step starts. distributed: this process is one rank of the model's
    parallel layout (Megatron's parallel_state initialised for it, c's parallel fields as they
    are): its own peak, on its own tokens (no data-parallel gradient reduction)."""
    import torch

    from megatron_moe_hybrid.testing import init_megatron, teardown
    from megatron_moe_hybrid.training.optim import make_optimizer

    if distributed:
        import torch.distributed as dist

        run = _run_config(c, cl, **{"parallel.world_size": c.parallel.world_size,
                                    "parallel.expert_model_parallel_size": c.parallel.expert_model_parallel_size})  # fmt: skip
        seed = 1000 * dist.get_rank()
    else:
        run, seed = _run_config(c, cl), 0
    with _maybe_megatron(init_megatron, teardown):
        model = _build(run, device)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, 1e-5, (0.9, 0.95), 0.0, cl.optimizer_state_dtype)
        batches = [_batch(run, cl.micro_batch_size, cl.seq_length, device, seed=seed + m) for m in range(micro_batches)]

        def step():
            opt.zero_grad(set_to_none=True)
            for tokens, positions in batches:
                (model(tokens, positions, None, labels=tokens).mean() / micro_batches).backward()
            opt.step()

        step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        from torch.profiler import ProfilerActivity, profile

        state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        base = _live_bytes(list(model.parameters()) + list(model.buffers()) + state + [b for bt in batches for b in bt])
        peaks = []
        for _ in range(3 if distributed else 1):
            # distributed: the least of three steps, as gloo releases a collective's buffers when its
            # work object goes, at a moment that varies: one step's peak moved by up to 4% run to run
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                step()
            events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]")
            live = peak = 0
            for _, n in events:
                live += n
                peak = max(peak, live)
            peaks.append(peak)
            opt.zero_grad(set_to_none=True)
        return base + min(peaks)


def _fmt(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def report(c: HybridMoEConfig, cl: Cluster, p: dict) -> str:
    from megatron_moe_hybrid.registry import expand_lora_targets

    pr = p["parameters"]
    lines = [
        f"model: {c.num_layers} layers {c.pattern}, hidden {c.hidden_size}, {c.moe.num_experts} experts top-{c.moe.topk}, vocab {c.vocab_size}",
        f"parameters: {_fmt(pr['total'])} total, {_fmt(pr['active'])} active per token; bf16 weights {p['bf16_weights_bytes'] / 1e12:.2f} TB",
        f"run: {cl.training} on {cl.accelerators} x {cl.hbm_gib:.0f} GiB, TP{cl.tensor_model_parallel_size} EP{cl.expert_model_parallel_size} "
        f"PP{cl.pipeline_model_parallel_size} CP{cl.context_parallel_size} DP{p['data_parallel_size']} (expert DP {p['expert_data_parallel_size']}), "
        f"FSDP2 {'on' if cl.fsdp else 'off'}, micro-batch {cl.micro_batch_size} x {cl.seq_length}, recompute {cl.recompute}"
        + (", optimizer offloaded" if cl.offload_optimizer else ""),
        f"trainable parameters: {_fmt(p['trainable_parameters'])}"
        + (f" (LoRA r{cl.lora_rank} on {', '.join(expand_lora_targets(c.lora.targets, c.pattern))}"
           + (" narrowed by lora.target_modules, counted without it" if c.lora.target_modules else "")
           + f", {cl.expert_adapter} expert adapters; their optimizer state is "
           f"{100 * p['optimizer_over_base_weights']:.2f}% of the base weights)" if cl.training == "lora" else ""),
        "per-device memory:",
    ]
    for k, v in p["per_device_bytes"].items():
        lines.append(f"  {k:<13} {v / GiB:10.2f} GiB")
    lines.append(f"  {'peak':<13} {p['peak_bytes'] / GiB:10.2f} GiB of {p['budget_bytes'] / GiB:.1f} usable")
    if p["host_bytes_per_node"]:
        lines.append(f"host memory per node: {p['host_bytes_per_node'] / GiB:.1f} GiB of {cl.host_gib_per_node:.0f}")
    lines.append(f"All-to-All per device per step ({p['micro_batches_per_step']} micro-batches): "
                 f"{p['a2a_bytes_per_step_per_device'] / GiB:.2f} GiB (~{p['a2a_seconds_per_step']:.1f} s at link speed)")
    if cl.context_parallel_size > 1:
        lines.append(f"context parallel per device per step: {p['cp_bytes_per_micro_batch_per_device'] * p['micro_batches_per_step'] / GiB:.2f} GiB "
                     f"(~{p['cp_seconds_per_step']:.2f} s at NVLink speed)")
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    why = "host memory" if not p["fits_host"] else p["dominant"]
    lines.append(f"{verdict}: the dominant term is {why}")
    return "\n".join(lines)


def _run_shape_of(config_path: str, model_ov: dict) -> dict:
    """Cluster fields taken from the model config's own run when no cluster file is given:
    training (lora if lora.enabled, else full), seq_length, micro_batch_size, lora_rank and
    expert_adapter (the raw YAML and overrides, lora.* defaulting to LoRAConfig's as finetune's
    do; a config that does not load is reported by load_config)."""
    try:
        with open(config_path) as f:
            raw = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(raw, dict):
        return {}

    def get(group: str, name: str):
        return model_ov.get(f"{group}.{name}", (raw.get(group) or {}).get(name))

    from megatron_moe_hybrid.config import LoRAConfig

    lora = LoRAConfig()  # what finetune takes where the config leaves lora.* out (--cluster.training lora on a base)
    shape = {"training": "lora" if get("lora", "enabled") else "full", "seq_length": get("training", "seq_length"),
             "micro_batch_size": get("training", "micro_batch_size"),
             "lora_rank": get("lora", "rank") or lora.rank, "expert_adapter": get("lora", "expert_adapter") or lora.expert_adapter}
    return {k: v for k, v in shape.items() if v is not None}


CLUSTER_HELP = ("--cluster.<field> VALUE overrides one field of the cluster (its YAML file, --cluster, or the "
                "defaults). Fields and defaults: {fields}. Without --cluster, training, seq_length, micro_batch_size, "
                "lora_rank and expert_adapter come from the config's own run (lora.enabled, training.*). --<group>.<field> VALUE "
                "overrides a model config field, as for train/finetune. Exit status: 0 fits, 1 does not fit, "
                "2 bad arguments.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(textwrap.wrap(CLUSTER_HELP.format(fields=", ".join(f"{f.name}={f.default}" for f in fields(Cluster))),
                                        95, break_on_hyphens=False)))
    parser.add_argument("--config", required=True, help="the model's YAML config (e.g. examples/configs/flagship_2p8t.yaml)")
    parser.add_argument("--cluster", default=None, help="a YAML of Cluster fields (e.g. examples/clusters/h200_128.yaml)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--probe", action="store_true",
                        help="measure activations by running one layer of each kind here (else the fused-kernel model)")
    parser.add_argument("--measure", action="store_true",
                        help="also run a training step of the model here (one process) and print its measured peak")
    parser.add_argument("--device", default="cpu", help="where --probe / --measure run: cpu or cuda")
    parser.add_argument("--probe-experts", default=None, metavar="E1,E2",
                        help="--probe at two smaller expert counts and carry the bytes linearly to the model's "
                             "(for layers too large to run whole on one device)")
    parser.add_argument("--probe-seq-length", type=int, default=None,
                        help="--probe at this sequence length instead of cluster.seq_length")
    parser.add_argument("--probe-save", default=None, metavar="PATH", help="write the probe's bytes per token as JSON")
    parser.add_argument("--probe-load", default=None, metavar="PATH",
                        help="plan with a probe saved by --probe-save (for example on a GPU) instead of probing")
    args, rest = parser.parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        cluster_ov = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("cluster.")}
        model_ov = {k: v for k, v in overrides.items() if not k.startswith("cluster.")}
        defaults = None if args.cluster else _run_shape_of(args.config, model_ov)
        cluster = load_cluster(args.cluster, cluster_ov, defaults)
        model_ov.setdefault("parallel.world_size", cluster.accelerators)
        model_ov.setdefault("parallel.expert_model_parallel_size", cluster.expert_model_parallel_size)
        model_ov.setdefault("parallel.context_parallel_size", cluster.context_parallel_size)
        try:
            config = load_config(args.config, model_ov)
        except ConfigError as e:
            if args.cluster is None and not cluster_ov and e.field.startswith(("training.", "parallel.", "moe.")):
                raise ConfigError(e.field, f"{str(e).split(': ', 1)[1]} (planned on the default cluster of "
                                  f"{cluster.accelerators} accelerators, EP {cluster.expert_model_parallel_size}; "
                                  "pass --cluster FILE or --cluster.<field>, e.g. --cluster.accelerators 1 "
                                  "--cluster.expert_model_parallel_size 1)") from None
            raise
        if args.device not in ("cpu", "cuda"):
            raise ConfigError("device", f"{args.device!r} is not cpu or cuda")
        if args.device == "cuda" and (args.probe or args.measure) and not torch.cuda.is_available():
            raise ConfigError("device", "cuda: this machine has no CUDA device; probe with --device cpu, or on a GPU "
                              "with --probe-save there and --probe-load here")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        experts = None
        if args.probe_experts is not None:
            parts = args.probe_experts.split(",")
            if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
                raise ConfigError("probe_experts", f"{args.probe_experts!r} is not two counts E1,E2 (e.g. 16,32)")
            experts = tuple(int(p) for p in parts)
            if not args.probe:
                raise ConfigError("probe_experts", "applies to --probe; add --probe")
        if args.probe_load and (args.probe or args.measure):
            raise ConfigError("probe_load", "plans with a saved probe; drop --probe / --measure, or --probe-load")
        if args.probe_seq_length is not None and args.probe_seq_length <= 0:
            raise ConfigError("probe_seq_length", f"must be > 0, got {args.probe_seq_length}")
        probe = load_probe(args.probe_load, config) if args.probe_load else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.measure and (cluster.accelerators != 1 or cluster.context_parallel_size != 1):
        print("error: cluster.accelerators: --measure runs one process here; plan a 1-accelerator, "
              "CP=1 cluster (EP=1) to compare with a measurement", file=sys.stderr)  # fmt: skip
        return 2
    if (args.probe or probe is not None) and (
        cluster.tensor_model_parallel_size != 1 or cluster.context_parallel_size != 1
    ):
        print("error: cluster.tensor_model_parallel_size / context_parallel_size: a probe measures one process's "
              "unsharded layers, which TP and CP shard; plan TP=1, CP=1 with --probe, or drop it", file=sys.stderr)  # fmt: skip
        return 2
    if args.probe or args.measure:
        held = config.params_dtype if cluster.training == "full" or config.lora.base_dtype == "float32" else torch.bfloat16
        size = torch.empty((), dtype=held).element_size()
        if cluster.weight_bytes != size:
            where = "model.params_dtype" if cluster.training == "full" else "lora.base_dtype"
            print(f"error: cluster.weight_bytes: {cluster.weight_bytes}, but this model holds its weights in {held} "
                  f"({where}); pass --cluster.weight_bytes {size}", file=sys.stderr)  # fmt: skip
            return 2
    if args.probe or args.measure:
        try:
            if experts is not None:
                probe = probe_scaled(config, cluster, args.device, experts, args.probe_seq_length)
            else:
                probe = probe_activations(config, cluster, args.device, seq_length=args.probe_seq_length)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        probe["model"] = probe_model(config)
        if args.probe_save:
            tmp = args.probe_save + ".tmp"
            with open(tmp, "w") as f:
                json.dump(probe, f, indent=1, default=float)
                f.write("\n")
            os.replace(tmp, args.probe_save)
    result = plan(config, cluster, probe)
    if args.measure:
        measured = measure_peak(config, cluster, args.device)
        result.update(measured_peak_bytes=measured, predicted_over_measured=result["peak_bytes"] / measured)
    if args.json:
        print(json.dumps({**result, "cluster": asdict(cluster), "probe": probe}, indent=1, default=float))
    else:
        print(report(config, cluster, result))
        if probe is not None:
            kinds = {}
            for i, (a, w) in enumerate(zip(probe["layers"], probe["layers_backward"])):
                name = config.layer_kind(i) + ("+MoE" if config.is_moe_layer(i) else "+dense")
                kinds.setdefault(name, (a, w))
            where = probe.get("probed", {})
            print(f"measured per token ({where.get('device', '?')}, {where.get('num_experts', '?')} experts, "
                  f"{where.get('seq_length', '?')} tokens), saved / backward working set: "
                  + ", ".join(f"{k} {a / 1024:.1f} / {w / 1024:.1f} KiB" for k, (a, w) in kinds.items()))
        if args.measure:
            print(f"measured peak {result['measured_peak_bytes'] / GiB:.3f} GiB; predicted / measured = "
                  f"{result['predicted_over_measured']:.3f}")
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
