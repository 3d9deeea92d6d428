"""End to end (issue 12): a Qwen3-Next-shaped hybrid MoE trains with every fast path on, against
transformers' Qwen3NextForCausalLM + fla + PEFT on the same weights, tokens and GPU.

    python benchmarks/end_to_end.py                      # one H200: every job, ours and the anchor
    python benchmarks/end_to_end.py --jobs a4096,b4096   # some of them
    python benchmarks/end_to_end.py --tiny               # the same pipeline on a CPU (tests)
    torchrun --nproc_per_node 2 benchmarks/end_to_end.py # 2 GPUs: ours with EP=2 (the anchor on GPU 0)

Under torchrun, rank 0 makes and converts the checkpoint and runs the anchor on its GPU (transformers
has no expert parallelism; per GPU, its one-GPU run is what data parallelism could give it at
best) while the others wait; then every rank trains ours with the experts split over EP = world
size, each rank on its own batches (rank 0's are a one-GPU run's), dense gradients summed over
the ranks. Rows carry their own git_sha and command, and a GPU run merges its rows into the
results file, replacing rows of the same name.

The model is transformers' `Qwen3NextConfig()` defaults cut to 8 layers (`LLLA` twice): hidden
2048, Gated DeltaNet 16 qk / 32 v heads of 128, gated full attention 16 heads / 2 KV heads of
256, 512 experts top-10 of ffn 512 plus a gated shared expert, vocab 151936 (about 13B
parameters, 0.9B active per token). Its weights are made in two steps, as a user would: the HF
model is built with random weights and saved (safetensors), and tools/convert_checkpoint.py
converts that to our checkpoint (bf16). The router's aux loss is off on both sides (HF's
default `output_router_logits=False` trains without it).

Jobs (a step is forward, backward and the optimizer; B x T = 16384 tokens up to T=16384, B=1 above):
  a<T>  LoRA rank 16 (alpha 32) on the attention projections and every routed expert, the base
        frozen in bf16, fp32 adapters, AdamW (lr 2e-4). The anchor: PEFT `target_modules` on the attention
        linears and `target_parameters` on the fused experts, with PEFT 0.21.2: 0.18.0 takes
        transformers 5's [E, out, in] expert weights as [E, in, out], which puts the zero-
        initialised LoRA factor on the input side (a different adapter, whose curve leaves ours).
  b<T>  full-parameter training, bf16 weights, plain AdamW (bf16 states, lr 1e-5) on both sides.
  c<T>  ours only: pattern `LLLS` (our top-2048 sparse attention instead of full attention),
        LoRA as in a, random weights.
From T = 65536 our layers recompute their forward in the backward (memory.recompute_layers).
Job a4096 runs --curve_steps steps on both sides over the same batches: the first losses give
the parity check, the whole curves the 2% check.

Each row reports tokens/s per GPU, the step time (median, CUDA events), peak memory, model FLOPs
utilisation against the measured 687 TFLOP/s bf16 matmul ceiling, and a breakdown of one step
(attention, MoE = router + experts + shared expert + dispatch/combine, loss, optimizer, other)
from CUDA events recorded at module boundaries in the forward and, through identity autograd
functions, in the backward. Writes benchmarks/results/h200/end_to_end.json (after every job).
"""

import argparse
import gc
import importlib.util
import itertools
import re
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from common import git_sha, write_results  # noqa: E402

from megatron_moe_hybrid.parallel.recompute import is_recomputing  # noqa: E402

OUT = os.path.join(HERE, "results", "h200", "end_to_end.json")
MATMUL_CEILING = 687e12  # bf16 dense matmul, measured on one H200 here (issue 12)
TOKENS_PER_STEP = 16384
LORA_RANK, LORA_ALPHA = 16, 32.0
# LoRA at 2e-4, the usual LoRA rate; at 1e-3 (run at 62b5295, end_to_end.json's history in git)
# both sides' losses spiked after ~35 steps of the 8 cycled batches and the curves, within 1.6%
# until then, parted by up to 9.6%
LR = {"lora": 2e-4, "full": 1e-5}
HF_LORA_MODULES = ["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"]
HF_LORA_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
OUR_LORA_TARGETS = {"A": ["linear_attention", "full_attention", "experts"],
                    "S": ["linear_attention", "sparse_attention", "experts"]}
SPARSE = {"sparse_attention.topk": 2048, "sparse_attention.index_n_heads": 16,
          "sparse_attention.index_head_dim": 64, "sparse_attention.index_rope_dim": 32,
          "sparse_attention.indexer_loss_coeff": 0.0, "sparse_attention.stage": "sparse"}
JOBS = ("a4096", "b4096x1", "b1024x1", "a32768", "c32768", "c131072")  # the rows of docs/PERFORMANCE.md's end-to-end table
RECOMPUTE_FROM = 65536  # tokens per sequence from which our layers recompute in the backward (memory.recompute_layers)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=512)
TINY_SPARSE = {"sparse_attention.topk": 32, "sparse_attention.index_n_heads": 2,
               "sparse_attention.index_head_dim": 16, "sparse_attention.index_rope_dim": 8}


def log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


# The model, both sides.


def hf_config(tiny: bool):
    from transformers import Qwen3NextConfig

    kw = dict(num_hidden_layers=8 if not tiny else 4, tie_word_embeddings=False, output_router_logits=False)
    kw["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (kw["num_hidden_layers"] // 4)
    if tiny:
        kw.update(TINY)
    return Qwen3NextConfig(**kw)


def make_hf_model(config, device, dtype, seed: int):
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3NextForCausalLM._from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


def _convert_tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(ROOT, "tools", "convert_checkpoint.py"))
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    return convert


def convert_to_ours(hf_dir: str, out_dir: str, dtype) -> str:
    return _convert_tool().hf_to_ours(hf_dir, out_dir, dtype=dtype, progress=False)


def write_config_only(hf_cfg, out_dir: str, dtype) -> None:
    """out_dir/config.yaml as convert_to_ours writes it, from the HF config alone."""
    import yaml

    raw, _ = _convert_tool().our_raw_config(hf_cfg.to_dict(), dtype)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)


def our_model(run_dir: str, device, pattern: str, seq: int, tiny: bool, load: bool, world: int = 1):
    from megatron.core import parallel_state as ps

    from megatron_moe_hybrid.config import load_config
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.training.checkpoint import load_model_weights

    overrides = {"parallel.world_size": world, "parallel.expert_model_parallel_size": world, "moe.aux_loss_coeff": 0.0, "moe.z_loss_coeff": 0.0,
                 "moe.dispatcher": "static", "training.seq_length": seq, "model.pattern": pattern}
    if seq >= RECOMPUTE_FROM and not tiny:  # activations of every layer would not fit: keep layer inputs only
        overrides["memory.recompute_layers"] = -1
    if load:  # the checkpoint fills every weight: skip Megatron's init (13B parameters)
        overrides["model.perform_initialization"] = False
    if "S" in pattern:
        overrides.update(SPARSE)
        if tiny:
            overrides.update(TINY_SPARSE)
    config = load_config(os.path.join(run_dir, "config.yaml"), overrides)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    torch.manual_seed(1)
    with torch.device(device):
        model = build_model(config).to(device)
    if load:
        missing = load_model_weights(run_dir, model)
        if missing:
            raise RuntimeError(f"{run_dir}: the converted checkpoint misses {missing[:4]}")
    return config, model


def count_active(model, config) -> dict:
    """Matmul parameters one token passes through (ours; the HF model is the same architecture),
    and the attention shapes the FLOP count needs, per layer kind."""
    moe = config.moe
    active, attn = 0, {}
    for i, layer in enumerate(model.decoder.layers):
        kind = config.layer_kind(i)
        n = sum(p.numel() for p in layer.self_attention.parameters() if p.dim() == 2)
        attn.setdefault(kind, 0)
        attn[kind] += 1
        mlp = layer.mlp
        n += mlp.router.weight.numel()
        experts = getattr(mlp.experts, "base", mlp.experts)
        n += (experts.weight1.numel() + experts.weight2.numel()) * moe.topk // experts.weight1.shape[0]
        if mlp.shared_experts is not None:
            n += sum(p.numel() for p in mlp.shared_experts.parameters() if p.dim() == 2)
        active += n
    active += model.output_layer.weight.numel()
    return {"active_matmul_params": active, "layers": attn}


def step_flops(config, counts: dict, B: int, T: int, trainable: str) -> float:
    """Model FLOPs of one step: 6 N (full) or 4 N (LoRA: no weight gradients for the frozen base)
    per token over the active matmul parameters, plus attention: full causal 6 H D T^2 per
    sequence (forward 2 H D T^2: QK^T and PV over the causal half; backward twice that), Gated
    DeltaNet (22 D^2 + 36 C D + 5 C^2) per token per value head (issue 3's count, forward and
    backward), sparse attention 12 H D sum_t min(t+1, k) plus the indexer's forward HI DI T^2."""
    per_token = (6 if trainable == "full" else 4) * counts["active_matmul_params"]
    total = per_token * B * T
    la, sa = config.linear_attention, config.sparse_attention
    D, C = la.head_k_dim, la.chunk_size
    H, Dh = config.num_attention_heads, config.kv_channels
    for kind, n in counts["layers"].items():
        if kind == "L":
            total += n * B * T * la.num_v_heads * (22 * D * D + 36 * C * D + 5 * C * C)
        elif kind == "A":
            total += n * B * 6 * H * Dh * T * T
        elif kind == "S":
            k = min(sa.topk, T)
            pairs = k * (k + 1) // 2 + (T - k) * k  # sum over queries of the keys each attends
            total += n * B * (12 * H * Dh * pairs + sa.index_n_heads * sa.index_head_dim * T * T)
    return float(total)


# Data: a learnable token stream (a fixed successor map with probability 3/4), so that the
# loss curves of 50 steps say something.


def batches(n: int, B: int, T: int, vocab: int, seed: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    span = min(vocab, 8192)
    succ = torch.randperm(span, generator=g)
    out = []
    for _ in range(n):
        tok = torch.empty(B, T, dtype=torch.long)
        tok[:, 0] = torch.randint(0, span, (B,), generator=g)
        follow = torch.rand(B, T, generator=g) < 0.75
        noise = torch.randint(0, span, (B, T), generator=g)
        for t in range(1, T):
            tok[:, t] = torch.where(follow[:, t], succ[tok[:, t - 1]], noise[:, t])
        ids = tok.to(device)
        # Both sides score the same T - 1 positions: HF shifts its labels inside, ours are given
        # shifted with the last position ignored.
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        out.append((ids, labels))
    return out


# Timing.


class Clock:
    """CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def stamp(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


class _Mark(torch.autograd.Function):
    """Identity that stamps the clock in the forward and, mirrored, in the backward: on a
    module's input its backward runs when the module's backward has finished, on its output
    when the module's backward starts."""

    @staticmethod
    def forward(ctx, x, regions, key, is_input):
        ctx.regions, ctx.key, ctx.is_input = regions, key, is_input
        regions.add(key, "fwd_begin" if is_input else "fwd_end")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.regions.add(ctx.key, "bwd_end" if ctx.is_input else "bwd_begin")
        return grad, None, None, None


SUBREGION_OF = {"router": "moe", "experts": "moe", "shared_expert": "moe"}  # part -> the region it is in


class Regions:
    """Per-category time of one step from stamps at module boundaries (forward and backward)."""

    def __init__(self, clock: Clock):
        self.clock, self.on, self.stamps, self.hooks = clock, False, {}, []
        self.calls = itertools.count()
        self.loss_key = None  # the open loss region: run_steps closes it on the loss value
        self.origin = None  # the first stamp: totals() places every interval on one time line

    def add(self, key, phase):
        if self.on:
            stamp = self.clock.stamp()
            self.origin = stamp if self.origin is None else self.origin
            self.stamps.setdefault(key, {})[phase] = stamp

    def mark(self, x, key, is_input):
        if not self.on or not torch.is_tensor(x) or not x.is_floating_point():
            return x
        return _Mark.apply(x, self, key, is_input)

    def attach(self, module, category: str, ends: bool = True):
        """Stamps around every call of module; ends=False: only its start (the region is
        closed elsewhere)."""

        def pre(mod, args, kwargs):
            if not self.on:
                return None
            if is_recomputing():  # a recomputed forward (inside a backward): stamps only, see totals()
                mod._recompute_key = (category, next(self.calls))
                self.add(mod._recompute_key, "rc_begin")
                return None
            mod._region_key = (category, next(self.calls))
            if category == "loss":
                self.loss_key = mod._region_key
            args = list(args)
            for i, a in enumerate(args):
                if torch.is_tensor(a):
                    args[i] = self.mark(a, mod._region_key, True)
                    return tuple(args), kwargs
            for k, a in kwargs.items():
                if torch.is_tensor(a):
                    kwargs[k] = self.mark(a, mod._region_key, True)
                    break
            return tuple(args), kwargs

        def post(mod, args, kwargs, out):
            if not self.on:
                return None
            if is_recomputing():  # (a recompute that torch's checkpoint stops early leaves no end)
                if getattr(mod, "_recompute_key", None) is not None:
                    self.add(mod._recompute_key, "rc_end")
                return None
            if torch.is_tensor(out):
                return self.mark(out, mod._region_key, False)
            if isinstance(out, tuple) and out and torch.is_tensor(out[0]):
                return (self.mark(out[0], mod._region_key, False), *out[1:])
            if hasattr(out, "keys") and out.get("last_hidden_state") is not None:
                out["last_hidden_state"] = self.mark(out["last_hidden_state"], mod._region_key, False)
            return out

        self.hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        if ends:
            self.hooks.append(module.register_forward_hook(post, with_kwargs=True))

    def begin_after(self, module, category: str):
        """Opens a region at module's output (our loss: the decoder's output onwards)."""

        def post(mod, args, out):
            if not self.on:
                return None
            self.loss_key = (category, next(self.calls))
            return self.mark(out, self.loss_key, True)

        self.hooks.append(module.register_forward_hook(post))

    def totals(self) -> dict:
        """ms per category. A recomputed forward runs inside the backward of the region whose
        saved tensors are unpacked first (a layer's MoE): each outermost recompute interval is
        taken out of the backward intervals that contain it and counted, with the recompute
        intervals nested in it, in its own categories; "recompute" is their total. (torch's
        checkpoint stops a recompute after the layer's last saved tensor: a region it cuts short
        has no end stamp, and its part stays in the backward around it, the same region's.)"""
        self.clock.sync()
        spans = []  # (category, kind, begin ms, end ms) on the time line of self.origin
        for (category, _), s in self.stamps.items():
            for kind in ("fwd", "bwd", "rc"):
                if f"{kind}_begin" in s and f"{kind}_end" in s:
                    begin = self.clock.ms(self.origin, s[f"{kind}_begin"])
                    spans.append((category, kind, begin, begin + self.clock.ms(s[f"{kind}_begin"], s[f"{kind}_end"])))
        outer, outer_end = [], float("-inf")  # recompute intervals nest or are disjoint
        for r in sorted((sp for sp in spans if sp[1] == "rc"), key=lambda sp: (sp[2], -sp[3])):
            if r[2] >= outer_end:
                outer.append(r)
                outer_end = r[3]
        out: dict[str, float] = {}
        for category, kind, begin, end in spans:
            ms = end - begin
            if kind == "bwd":  # (a part's recompute stays in its whole: the experts' in the MoE's)
                ms -= sum(r[3] - r[2] for r in outer
                          if begin <= r[2] and r[3] <= end and SUBREGION_OF.get(r[0]) != category)
            out[category] = out.get(category, 0.0) + ms
        out["recompute"] = sum(r[3] - r[2] for r in outer)
        self.stamps, self.origin = {}, None
        return out

    def remove(self):
        for h in self.hooks:
            h.remove()


def breakdown(regions: Regions, step_ms: float, optimizer_ms: float, grad_sync_ms: float = 0.0) -> dict:
    t = regions.totals()
    moe = t.get("moe", 0.0)
    parts = {
        "attention_ms": t.get("attention", 0.0),
        "moe_ms": moe,
        "moe_router_ms": t.get("router", 0.0),
        "moe_experts_ms": t.get("experts", 0.0),
        "moe_shared_expert_ms": t.get("shared_expert", 0.0),
        "moe_dispatch_combine_ms": moe - t.get("router", 0.0) - t.get("experts", 0.0) - t.get("shared_expert", 0.0),
        "loss_ms": t.get("loss", 0.0),
        "optimizer_ms": optimizer_ms,
        "grad_sync_ms": grad_sync_ms,
    }
    if t.get("recompute"):  # already inside the parts above (each recomputed region in its own)
        parts["recomputed_forwards_ms"] = t["recompute"]
    parts["other_ms"] = step_ms - parts["attention_ms"] - moe - parts["loss_ms"] - optimizer_ms - grad_sync_ms
    parts["step_ms"] = step_ms
    return {k: round(v, 3) for k, v in parts.items()}


def attach_ours(regions: Regions, model):
    for layer in model.decoder.layers:
        regions.attach(layer.self_attention, "attention")
        regions.attach(layer.mlp, "moe")
        regions.attach(layer.mlp.router, "router")
        regions.attach(layer.mlp.experts, "experts")
        if layer.mlp.shared_experts is not None:
            regions.attach(layer.mlp.shared_experts, "shared_expert")
    # The output projection and cross-entropy run fused on the decoder's output (the output
    # layer module itself is never called): the loss region opens there.
    regions.begin_after(model.decoder, "loss")


def attach_hf(regions: Regions, model):
    for layer in model.model.layers:
        regions.attach(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn, "attention")
        regions.attach(layer.mlp, "moe")
        regions.attach(layer.mlp.gate, "router")
        regions.attach(layer.mlp.experts, "experts")
        regions.attach(layer.mlp.shared_expert, "shared_expert")
    regions.attach(model.lm_head, "loss", ends=False)


# One job on one side.


def run_steps(loss_fn, opt, data, steps: int, warmup: int, clock: Clock, regions: Regions,
              first_layer_input, sync=None) -> dict:
    """steps optimizer steps over data (cycled); times those after warmup; then one more step
    with the region stamps on (and the first layer's input requiring grad, so that its
    backward closes) for the breakdown."""
    losses, times = [], []
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(steps + 1):
        breakdown_step = i == steps
        regions.on = breakdown_step
        handle = first_layer_input.register_forward_hook(
            lambda m, a, out: out.detach().requires_grad_(True)) if breakdown_step else None
        ids, labels = data[i % len(data)]
        t0 = clock.stamp()
        loss = loss_fn(ids, labels)
        if breakdown_step and regions.loss_key is not None:
            loss = _Mark.apply(loss, regions, regions.loss_key, False)
        loss.backward()
        s0 = clock.stamp()
        if sync is not None:  # expert parallelism: dense gradients summed over the ranks
            sync()
        o0 = clock.stamp()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = clock.stamp()
        if handle is not None:
            handle.remove()
        if not breakdown_step:
            losses.append(loss.detach())
            clock.sync()
            if i >= warmup:
                times.append(clock.ms(t0, t1))
        else:
            clock.sync()
            parts = breakdown(regions, clock.ms(t0, t1), clock.ms(o0, t1), clock.ms(s0, o0))
    regions.on = False
    return {"losses": [float(x) for x in losses], "step_ms": statistics.median(times), "breakdown": parts,
            "peak_mem_bytes": torch.cuda.max_memory_allocated() if clock.cuda else None,
            # cudaMalloc retries after freeing the cache: each one syncs the device (fragmentation)
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries") if clock.cuda else None}


def hf_job(model, kind: str, data, steps, warmup, clock) -> dict:
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                 target_modules=HF_LORA_MODULES, target_parameters=HF_LORA_PARAMETERS)
        net = get_peft_model(model, peft_config)
        base = net.base_model.model
    else:
        net = base = model
        for p in model.parameters():
            p.requires_grad_(True)
    net.train()
    trainable = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR[kind])
    regions = Regions(clock)
    attach_hf(regions, base)

    def loss_fn(ids, labels):
        return net(input_ids=ids, labels=ids).loss

    try:
        result = run_steps(loss_fn, opt, data, steps, warmup, clock, regions, base.model.embed_tokens)
        profile_step(PROFILE.get("anchor"), loss_fn, opt, data[0], clock)
    finally:
        regions.remove()
        del opt
    result["trainable_params"] = sum(p.numel() for p in trainable)
    if kind == "lora":
        net.unload()  # the base model back, without adapters
    return result


def our_job(model, config, kind: str, data, steps, warmup, clock, device) -> dict:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_moe_hybrid.layers.lora import apply_lora

    if kind == "lora":
        targets = OUR_LORA_TARGETS["S" if "S" in config.pattern else "A"]
        apply_lora(model, targets, rank=LORA_RANK, alpha=LORA_ALPHA, adapter_dtype="float32")
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = clock.cuda and all(p.is_cuda for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=LR[kind], fused=fused)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    regions = Regions(clock)
    attach_ours(regions, model)

    def loss_fn(ids, labels):
        B, T = ids.shape
        per_token = model(ids, torch.arange(T, device=ids.device).expand(B, T), None, labels=labels)  # [B, T]
        return per_token.sum() / (labels != -100).sum()

    sync = None
    if dist.get_world_size() > 1:
        from megatron_moe_hybrid.parallel.data_parallel import ParallelGroups, sync_gradients

        groups = ParallelGroups.from_parallel_state()

        def sync():
            sync_gradients(trainable, groups)

    try:
        result = run_steps(loss_fn, opt, data, steps, warmup, clock, regions, model.embedding, sync)
        profile_step(PROFILE.get("ours"), loss_fn, opt, data[0], clock)
    finally:
        regions.remove()
        del opt
    result["trainable_params"] = sum(p.numel() for p in trainable)
    return result


PROFILE: dict[str, str] = {}  # side -> path of a kernel table of one profiled step (--profile)


def profile_step(path, loss_fn, opt, batch, clock):
    """One more step under the torch profiler: the kernels by total GPU time, and the host
    syncs (aten::item / _local_scalar_dense) that stall the launch queue."""
    if not path:
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        loss_fn(*batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.sync()
    table = prof.key_averages()
    sort = "cuda_time_total" if clock.cuda else "cpu_time_total"
    syncs = sum(e.count for e in table if e.key in ("aten::item", "aten::_local_scalar_dense"))
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    with open(path, "a") as f:
        f.write(f"{kernels} GPU kernels, {syncs} host syncs (item/_local_scalar_dense)\n")
        f.write(table.table(sort_by=sort, row_limit=45, max_name_column_width=90) + "\n")
        # the same by input shapes: which tensors the elementwise and copy kernels work on
        by_shape = prof.key_averages(group_by_input_shape=True)
        f.write(by_shape.table(sort_by="self_" + sort, row_limit=60, max_name_column_width=40,
                               max_shapes_column_width=80) + "\n")


def guarded(fn, clock):
    """fn() or, on an out-of-memory error, a record of it with the peak reached."""
    try:
        return fn()
    except torch.OutOfMemoryError as e:
        traceback.print_exc(limit=-6)  # where it ran out: the innermost frames
        peak = torch.cuda.max_memory_allocated() if clock.cuda else None
        return {"error": f"OutOfMemoryError: {str(e).splitlines()[0][:200]}", "peak_mem_bytes": peak}
    except Exception as e:  # one job failing leaves the others
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        gc.collect()
        if clock.cuda:
            torch.cuda.empty_cache()


# The run.


def parse_job(job: str) -> tuple[str, int, int | None, str]:
    """"a4096" -> ("a", 4096, None, "a4096"); "b4096x1" fixes the batch at 1."""
    m = re.fullmatch(r"([abc])(\d+)(?:x(\d+))?", job)
    if m is None:
        raise SystemExit(f"error: --jobs: {job!r} is not a<T>, b<T> or c<T>, optionally x<batch> (e.g. a4096, b4096x1)")
    return m[1], int(m[2]), int(m[3]) if m[3] else None, job


def shape_of(B, T, tiny):
    return ("tiny" if tiny else "Qwen3-Next L8-H2048-E512-K10-F512") + f"-B{B}-T{T}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3-Next on the CPU, fp32 (tests)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per job (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--curve_steps", type=int, default=50, help="steps of job a at the first T on both sides")
    ap.add_argument("--tokens", type=int, default=TOKENS_PER_STEP, help="tokens per step up to this T")
    ap.add_argument("--tokens_full", type=int, default=TOKENS_PER_STEP // 2,
                    help="tokens per step of the full-parameter jobs (weights, gradients and AdamW take 104 GB)")
    ap.add_argument("--workdir", default=None, help="where the HF and converted checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--no_anchor", action="store_true")
    ap.add_argument("--profile", default=None, help="a folder: write <side>_<job>.txt kernel tables of one step")
    ap.add_argument("--emulate_ranks", type=int, default=1,
                    help="one process trains on the global batch of an EP run with this many ranks (tests)")
    args = ap.parse_args()
    jobs = [parse_job(j) for j in args.jobs.split(",") if j]

    cuda = torch.cuda.is_available() and not args.tiny
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local_rank)
    dtype = torch.bfloat16 if cuda else torch.float32
    clock = Clock(cuda)
    # rank 0 builds, saves, trains the anchor and converts while the others wait at a barrier
    from megatron_moe_hybrid.parallel.launch import init_process_group  # plain `python`: a group of one

    init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world > 1 and args.emulate_ranks > 1:
        raise SystemExit("error: --emulate_ranks: only for a single process (it stands in for an EP run's global batch)")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()  # expert-parallel size 1: the converter's group
    if cuda:
        import fla.ops.common.chunk_o as fla_chunk_o  # the anchor's kernels; see "notes" on the guard

        fla_chunk_o.TRITON_ABOVE_3_7_1 = True

    if args.workdir:
        work = args.workdir
    elif world > 1:  # one folder for every rank of this launch
        work = os.path.join(tempfile.gettempdir(), f"e2e-{os.environ['MASTER_PORT']}")
    else:
        work = tempfile.mkdtemp(prefix="e2e-")
    hf_dir, ours_dir = os.path.join(work, "hf"), os.path.join(work, "ours")
    rows = []
    cfg = hf_config(args.tiny)

    def save():
        if rank != 0:
            return
        if cuda:  # rows of earlier runs (other jobs, other GPU counts) are kept
            write_results(args.out, _merged(args.out, rows), ("transformers", "peft", "fla-core", "flash-linear-attention"))
        elif args.out != OUT:  # a CPU run never overwrites the H200 file
            _write_cpu(args.out, rows)

    def batch_of(kind, T, B=None):
        return B or max(1, (args.tokens_full if kind == "b" else args.tokens) // T)

    # Each EP rank trains on its own batches; rank 0's are those of a one-GPU run (so the
    # first-step loss compares with the anchor's), and --emulate_ranks N stacks N ranks'
    # batches in one process (the global batch of an EP=N run).
    data: dict[str, list] = {}
    first_a = next((name for k, _, _, name in jobs if k == "a"), None)
    for kind, T, B, name in jobs:
        n, per_rank = (8 if T <= 16384 else 2), batch_of(kind, T, B)
        parts = [batches(n, per_rank, T, cfg.vocab_size, seed=T + 1000 * r, device=device)
                 for r in ([rank] if args.emulate_ranks <= 1 else range(args.emulate_ranks))]
        data[name] = [tuple(torch.cat(x, dim=0) for x in zip(*group)) for group in zip(*parts)]

    # 1. The HF model with random weights, saved, then the anchor's jobs on it (one GPU: rank 0).
    anchor: dict[str, dict] = {}
    # Job c trains from Megatron's init (no HF counterpart): without the anchor it needs our
    # config only, not a 13B-parameter HF model saved and converted.
    config_only = args.no_anchor and all(kind == "c" for kind, *_ in jobs)
    if rank == 0 and config_only:
        write_config_only(cfg, ours_dir, dtype)
        log(f"config only (jobs {args.jobs}, --no_anchor): {ours_dir}/config.yaml")
    elif rank == 0:
        t0 = time.perf_counter()
        hf = make_hf_model(cfg, device, dtype, seed=0)
        os.makedirs(hf_dir, exist_ok=True)
        hf.save_pretrained(hf_dir, max_shard_size="20GB")
        log(f"HF model built and saved ({sum(p.numel() for p in hf.parameters()) / 1e9:.2f}B params) in {time.perf_counter() - t0:.0f} s")
        # LoRA jobs first: full training moves the weights (the converted copy is the saved one)
        anchor_jobs = [] if args.no_anchor else [j for j in jobs if j[0] == "a"] + [j for j in jobs if j[0] == "b"]
        for kind, T, B, name in anchor_jobs:
            steps = args.curve_steps if name == first_a else args.steps + args.warmup
            log(f"anchor {name}: B{batch_of(kind, T, B)} T{T}, {steps} steps")
            _profile_paths(args.profile, name)
            anchor[name] = guarded(lambda: hf_job(hf, {"a": "lora", "b": "full"}[kind], data[name], steps, args.warmup, clock), clock)
            log(f"anchor {name}: {_summary(anchor[name])}")
        hf = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        # 2. Our converted checkpoint.
        t0 = time.perf_counter()
        convert_to_ours(hf_dir, ours_dir, dtype)
        log(f"converted to ours in {time.perf_counter() - t0:.0f} s")
    dist.barrier()
    run_dir = os.path.abspath(ours_dir)

    # 3. Our jobs, expert-parallel over every rank.
    for kind, T, B, name in jobs:
        B = batch_of(kind, T, B) * max(1, args.emulate_ranks)
        steps = args.curve_steps if name == first_a else args.steps + args.warmup
        warmup = args.warmup
        if T >= 65536:  # seconds per step: fewer of them
            steps, warmup = 4, 1
        pattern = "LLLS" if kind == "c" else "LLLA"

        def ours_run():
            config, model = our_model(run_dir, device, pattern, T, args.tiny, load=kind != "c", world=world)
            counts = count_active(model, config)
            result = our_job(model, config, "full" if kind == "b" else "lora", data[name], steps, warmup, clock, device)
            result["timed_steps"] = steps - warmup
            result["flops"] = step_flops(config, counts, B, T, "full" if kind == "b" else "lora")
            result["active_matmul_params"] = counts["active_matmul_params"]
            del model
            return _over_ranks(result, device) if world > 1 else result

        log(f"ours {name}: B{B} T{T}, {steps} steps" + (f", EP={world}" if world > 1 else ""))
        _profile_paths(args.profile, name)
        ours = guarded(ours_run, clock)
        if rank == 0:
            log(f"ours {name}: {_summary(ours)}")
            rows.append(_row(name, kind, B, T, ours, anchor.get(name), args, cuda, world))
            save()
    if rank == 0 and first_a and "losses" in rows[0].get("ours", {}) and "losses" in (anchor.get(first_a) or {}):
        rows[0].update(_parity(rows[0]["ours"].get("rank0_losses", rows[0]["ours"]["losses"]),
                               anchor[first_a]["losses"], curve=world == 1))
        save()
    for r in rows:
        log(json.dumps({k: v for k, v in r.items() if k not in ("ours", "anchor_detail")}))
    dist.barrier()
    if not args.workdir and rank == 0:
        shutil.rmtree(work, ignore_errors=True)
    dist.destroy_process_group()
    return rows


def _over_ranks(result: dict, device) -> dict:
    """An EP run's figures: the slowest rank's step, the largest peak, the loss averaged over
    the ranks (each rank's mean over as many tokens: the global batch's mean); rank 0 keeps
    its own losses for the first-step parity with the anchor."""
    if "losses" not in result:
        return result
    world = dist.get_world_size()
    losses = torch.tensor(result["losses"], dtype=torch.float64, device=device)
    result["rank0_losses"] = list(result["losses"])
    dist.all_reduce(losses)
    result["losses"] = [float(x) / world for x in losses]
    for key in ("step_ms", "peak_mem_bytes"):
        v = torch.tensor(float(result[key] or 0), dtype=torch.float64, device=device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        result[key] = float(v) if key == "step_ms" else int(v)
    return result


def _merged(path: str, rows: list) -> list:
    """Rows already in the file whose name this run does not produce, then this run's."""
    try:
        with open(path) as f:
            old = json.load(f).get("rows", [])
    except (OSError, ValueError):
        old = []
    names = {r["name"] for r in rows}
    return [r for r in old if r.get("name") not in names] + rows


def _profile_paths(folder, job):
    if folder:
        os.makedirs(folder, exist_ok=True)
        PROFILE.update({side: os.path.join(folder, f"{side}_{job}.txt") for side in ("ours", "anchor")})


def _summary(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (f"{r['step_ms']:.1f} ms/step, peak {(r['peak_mem_bytes'] or 0) / 2**30:.1f} GiB, "
            f"losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, breakdown {r['breakdown']}")


def _row(name, kind, B, T, ours, anchor, args, cuda, world=1) -> dict:
    tokens = B * T
    ep = f", EP={world}" if world > 1 else ""
    row = {"name": {"a": "LoRA r16 step", "b": "full-parameter step", "c": "LoRA r16 step, LLLS sparse top-2048"}[kind]
           + f" ({name}{ep})", "shape": shape_of(B, T, args.tiny) + ep.replace(", ", "-"), "gpus": world,
           "git_sha": git_sha(), "command": "python " + " ".join(sys.argv)}
    ok = "step_ms" in ours
    row["ours_ms"] = round(ours["step_ms"], 3) if ok else None
    row["tokens_per_s_per_gpu"] = round(tokens / ours["step_ms"] * 1e3) if ok else None
    row["ours_peak_mem_bytes"] = ours.get("peak_mem_bytes")
    if ok and "flops" in ours:
        row["model_tflops"] = round(ours["flops"] / 1e12, 2)
        row["mfu"] = round(ours["flops"] / (ours["step_ms"] / 1e3) / MATMUL_CEILING, 4)
    row["breakdown"] = ours.get("breakdown")
    if anchor is not None:
        a_ok = "step_ms" in anchor
        row["anchor"] = "transformers Qwen3NextForCausalLM + fla 0.6.0" + (" + peft LoRA" if kind == "a" else " + AdamW")
        if world > 1:  # per GPU, the anchor's one-GPU run is what data parallelism would give it at best
            row["anchor"] += " on one GPU (no expert parallelism in transformers)"
        row["anchor_ms"] = round(anchor["step_ms"], 3) if a_ok else None
        row["anchor_tokens_per_s_per_gpu"] = round(tokens / anchor["step_ms"] * 1e3) if a_ok else None
        row["anchor_peak_mem_bytes"] = anchor.get("peak_mem_bytes")
        row["anchor_breakdown"] = anchor.get("breakdown")
        if a_ok and ok and "flops" in ours:
            row["anchor_mfu"] = round(ours["flops"] / (anchor["step_ms"] / 1e3) / MATMUL_CEILING, 4)
        row["speedup"] = round(anchor["step_ms"] / ours["step_ms"], 3) if a_ok and ok else None
        if "error" in anchor:
            row["anchor_error"] = anchor["error"]
        row["anchor_detail"] = {k: v for k, v in anchor.items() if k != "breakdown"}
    row["lr"] = LR["full" if kind == "b" else "lora"]
    row["target_speedup"] = {"a": 2.0, "b": 1.5, "c": None}[kind]
    if "error" in ours:
        row["ours_error"] = ours["error"]
    row["ours"] = {k: v for k, v in ours.items() if k != "breakdown"}
    row["notes"] = (f"median of {ours.get('timed_steps')} steps after warm-up, CUDA events; MFU = model FLOPs (see step_flops) / step time / 687 TFLOP/s; "
                    "the anchor's fla gated backward runs with its Triton-3.6 Hopper guard lifted "
                    "(fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True, fla issue #640); at this model's shapes "
                    "its gradients were checked on this GPU (benchmarks/device/fla_grad_check.py: bf16 against "
                    "an fp32 reference, 0.50-0.56% relative, as ours); breakdown from one extra step with "
                    "module-boundary events")
    if T >= RECOMPUTE_FROM and not args.tiny:
        row["notes"] += ("; ours recomputes every layer in the backward (memory.recompute_layers = -1): the "
                         "recomputed forwards run inside the backward of each layer's MoE and are counted in their "
                         "own regions (attention, router, experts, ...); breakdown.recomputed_forwards_ms is their "
                         "total, part of the others")
    return row


def _parity(ours: list, anchor: list, curve: bool = True) -> dict:
    """First-step loss (same weights, same batch) and, on one GPU, the curves over the same batches."""
    n = min(len(ours), len(anchor))
    rel = [abs(o - a) / abs(a) for o, a in zip(ours[:n], anchor[:n])]
    out = {"first_loss_ours": ours[0], "first_loss_anchor": anchor[0], "first_loss_rel_diff": rel[0]}
    if curve:  # under EP the global batch is larger than the anchor's: only the first step compares
        out.update(curve_steps=n, curve_max_rel_diff=max(rel), curve_within_2pct=max(rel) <= 0.02)
    return out


def _write_cpu(path, rows):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": "cpu", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
