"""MoE layer forward + backward (issue 5): ours against Megatron-Core's MoELayer and a
torchtitan-style torch._grouped_mm layer, on one H200 or two (expert parallelism over NCCL).

    python benchmarks/moe.py [--shapes S1,S2] [--routing balanced,zipf] [--zipf-s 1.1] [--reps 20]
                             [--warmup 5] [--out benchmarks/results/h200/moe.json] [--skip-megatron]
    torchrun --nproc_per_node 2 benchmarks/moe.py      # EP=2: rows with "gpus": 2, merged into --out

Shapes (bf16, SwiGLU experts, no shared expert, tokens per GPU):
    S1  hidden 2048, 64 experts, top-8, expert FFN 1408, 16384 tokens
    S2  hidden 7168, 256 experts, top-8, expert FFN 2048, 4096 tokens
Routing: "balanced" is the router as initialised (near uniform); "zipf" adds log(p_e) of a
Zipf(s) law to every token's logits: input column 0 is the constant ZIPF_C and router
column 0 is log(p) / ZIPF_C, so every implementation sees the same skew from the same
router weight and input. The router weight is rounded to bf16 values once, so that
Megatron's bf16 router holds exactly the weight that ours and the torch layer keep in fp32.

Every implementation gets the same input, output gradient and expert weights (copied in);
its forward output is compared once with ours before timing (max_rel_err_vs_ours, recorded,
never fatal). Per row: median ms of fwd+bwd (max over ranks), tokens/s per GPU, peak memory
above the inputs, and host syncs over one fwd+bwd (torch.cuda.set_sync_debug_mode("warn")).
"moe fwd+bwd static, CUDA graph" rows (1 GPU, --graphs) time ours and the grouped_mm layer each
captured with torch.cuda.make_graphed_callables: what a sync-free layer gains once the host's
launches are out of the way (both layers are free of host syncs at EP=1).
"moe fwd+bwd static, back to back" rows (1 GPU, --back-to-back) time both layers with calls
launched back to back (triton.testing.do_bench), as the layers of a step run: the host's launches
overlap the previous call's device work instead of starting from an idle GPU.
"dispatch+combine" rows time ours' six dispatcher steps with identity experts, forward only,
against raw NCCL all_to_all_single of the same bytes (2 GPUs) or a device copy (1 GPU). At EP=1
the static dispatcher also gets launch-free rows against a copy timed the same way: "permute
static" (the dispatch steps from an idle GPU), "permute static, CUDA graph" and
"dispatch+combine static, CUDA graph" (replays), and "permute kernel (scatter)" (the permute's
one data-moving kernel back to back).
One implementation failing (out of memory, missing backend) records null and the error.
On 2 GPUs a failure inside a collective can still hang both ranks until the group's timeout.

Rank 0 writes --out after every case, merging: rows of the file whose (name, shape, gpus,
anchor) the run produces are replaced, all others kept, so the 1- and 2-GPU runs share a file.

Shape legend: T tokens per GPU, h hidden size, E experts, E_local = E / ep experts per rank,
K experts per token, F expert FFN size, N rows grouped by expert, ep expert-parallel size.
"""

import argparse
import gc
import importlib.util
import json
import math
import os
import traceback
import types
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import cuda_graph, time_and_peak, write_results
from megatron_moe_hybrid.ops.moe.gather import scatter_rows
from torch.distributed import _functional_collectives as funcol

SHAPES = {
    "S1": {"hidden": 2048, "experts": 64, "topk": 8, "ffn": 1408, "tokens": 16384},
    "S2": {"hidden": 7168, "experts": 256, "topk": 8, "ffn": 2048, "tokens": 4096},
}
ROUTINGS = ("balanced", "zipf")
ZIPF_C = 1.0  # input column 0 under "zipf" routing; router column 0 carries log(p) / ZIPF_C
ROUTER_STD = 0.02  # Megatron's init_method_std: the router "as initialised"
# issue 5's targets: 1.5x the plain grouped-GEMM layer, 3x Megatron-Core; dispatch+combine at
# 90% of raw NCCL for the same bytes, permute+unpermute at 75% of the device copy bandwidth
MEGATRON_ANCHOR = "megatron-core MoELayer alltoall"
TORCH_ANCHOR = "torch._grouped_mm layer (torchtitan-style)"
OURS_VARIANTS = {  # row label -> (moe.dispatcher, moe.dispatch_chunks, needs 2+ GPUs)
    "static": ("static", 1, False),
    "static chunks2": ("static", 2, True),
    "alltoall-exact": ("alltoall", 1, False),
}


def zipf_log_probs(num_experts: int, s: float) -> torch.Tensor:
    """[E] fp32 log p_e of p_e proportional to (e + 1) ** -s."""
    if num_experts < 1 or s < 0:
        raise ValueError(f"zipf_log_probs needs num_experts >= 1 and s >= 0, got {num_experts} and {s}")
    logp = -s * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64))
    return (logp - torch.logsumexp(logp, 0)).float()


def make_router_weight(num_experts, hidden, routing, zipf_s, generator, device) -> torch.Tensor:
    """[E, h] fp32 holding bf16-representable values, the same on every rank for one generator seed."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    weight = torch.randn(num_experts, hidden, generator=generator, device=device) * ROUTER_STD  # [E, h]
    if routing == "zipf":
        weight[:, 0] = zipf_log_probs(num_experts, zipf_s).to(device) / ZIPF_C
    return weight.bfloat16().float()


def make_input(tokens, hidden, routing, generator, device, dtype=torch.bfloat16) -> torch.Tensor:
    """[T, h]; under "zipf" column 0 is ZIPF_C, which turns router column 0 into a logit offset."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    x = torch.randn(tokens, hidden, generator=generator, device=device).to(dtype)  # [T, h]
    if routing == "zipf":
        x[:, 0] = ZIPF_C
    return x


def route(x, router_weight, topk):
    """x [T, h], router_weight [E, h] fp32 -> probs [T, K] fp32, topk_idx [T, K]: softmax, then top-k."""
    logits = F.linear(x.float(), router_weight)  # [T, E] fp32, as ours and Megatron's fp32 router
    return torch.topk(logits.softmax(dim=-1), topk, dim=-1)


def count_per_expert(topk_idx, num_experts) -> torch.Tensor:
    """[T, K] -> [E] int64, by scatter_add: no host sync (bincount syncs on CUDA)."""
    flat = topk_idx.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def grouped_swiglu(x_sorted, counts, w1, w2):
    """x_sorted [N, h] grouped by expert, counts [E_local] on the device, w1 [E_local, h, 2F]
    (gate | up), w2 [E_local, F, h] -> [N, h]."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E_local] end row of each expert
    gate, up = torch._grouped_mm(x_sorted, w1, offs=offs).chunk(2, dim=-1)  # [N, F] each
    return torch._grouped_mm(F.silu(gate) * up, w2, offs=offs)  # [N, h]


class GroupedMMMoE(torch.nn.Module):
    """What torchtitan runs: router, argsort permute, torch._grouped_mm SwiGLU, weighted unpermute.

    With an EP group of size > 1 rows travel by all_to_all_single with split sizes read on the
    host (.tolist(), one sync per forward), as torchtitan does; experts are split contiguously
    (rank r holds experts [r * E_local, (r + 1) * E_local)). The expert weights keep ours' row-major
    layout (torchtitan passes a transposed [E, out, in] view; torch._grouped_mm takes either).
    """

    def __init__(self, router_weight, w1, w2, topk, ep_group=None):
        super().__init__()
        self.router_weight = torch.nn.Parameter(router_weight)  # [E, h] fp32
        self.w1 = torch.nn.Parameter(w1)  # [E_local, h, 2F] gate | up
        self.w2 = torch.nn.Parameter(w2)  # [E_local, F, h]
        self.topk = topk
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        if router_weight.shape[0] != self.ep_size * w1.shape[0]:
            raise ValueError(
                f"router_weight has {router_weight.shape[0]} experts but w1 holds {w1.shape[0]} per rank "
                f"on {self.ep_size} ranks: pass w1/w2 of this rank's E / ep experts"
            )

    def forward(self, x):
        """x [T, h] -> [T, h]."""
        num_tokens, hidden = x.shape
        num_experts = self.router_weight.shape[0]
        probs, topk_idx = route(x, self.router_weight, self.topk)  # [T, K] each
        order = torch.argsort(topk_idx.flatten(), stable=True)  # [T*K] copies grouped by expert
        counts = count_per_expert(topk_idx, num_experts)  # [E]
        x_sorted = x[order // self.topk]  # [T*K, h]
        if self.ep_size == 1:
            y_sorted = grouped_swiglu(x_sorted, counts, self.w1, self.w2)
        else:
            y_sorted = self._experts_over_ep(x_sorted, counts)
        # order is a permutation of the T*K rows, so every row of the empty tensor is written
        y = torch.index_copy(torch.empty_like(y_sorted), 0, order, y_sorted)  # [T*K, h] token-major
        out = torch.bmm(probs.unsqueeze(1), y.view(num_tokens, self.topk, hidden).float())  # [T, 1, h]
        return out.squeeze(1).to(x.dtype)

    def _experts_over_ep(self, x_sorted, counts):
        """x_sorted [N_send, h] grouped by global expert, counts [E] -> expert outputs, same rows."""
        ep, num_local = self.ep_size, self.w1.shape[0]
        recv_counts = torch.empty_like(counts)  # [ep * E_local]: block src = what src sends to our experts
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        host = torch.cat([counts, recv_counts]).tolist()  # the host sync the split sizes need
        send_splits = [sum(host[r * num_local : (r + 1) * num_local]) for r in range(ep)]
        recv_host = host[ep * num_local :]
        recv_splits = [sum(recv_host[r * num_local : (r + 1) * num_local]) for r in range(ep)]
        x_recv = funcol.all_to_all_single_autograd(x_sorted, recv_splits, send_splits, self.ep_group)
        # received rows are [src][local expert] blocks; regroup them by local expert
        local_expert = torch.arange(ep * num_local, device=counts.device) % num_local  # [ep * E_local]
        expert_of_row = torch.repeat_interleave(local_expert, recv_counts, output_size=sum(recv_splits))
        regroup = torch.argsort(expert_of_row, stable=True)  # [N_recv]
        y = grouped_swiglu(x_recv[regroup], recv_counts.view(ep, num_local).sum(0), self.w1, self.w2)
        y_recv = torch.index_copy(torch.empty_like(y), 0, regroup, y)  # back to [src][local expert]
        return funcol.all_to_all_single_autograd(y_recv, send_splits, recv_splits, self.ep_group)


def distinct_rank_copies(topk_idx, num_local_experts) -> int:
    """Sum over tokens of the number of distinct EP ranks among its K experts."""
    ranks = torch.sort(topk_idx // num_local_experts, dim=-1).values  # [T, K]
    return int(ranks.shape[0] + (ranks[:, 1:] != ranks[:, :-1]).sum()) if ranks.numel() else 0


def merge_rows(old_rows, new_rows):
    """Old rows whose (name, shape, gpus, anchor) the new rows hold are replaced in place;
    the other old rows are kept; new keys are appended."""

    def key(row):
        return row["name"], row["shape"], row.get("gpus"), row.get("anchor")

    new_by_key = {key(r): r for r in new_rows}
    merged = [new_by_key.pop(key(r), r) for r in old_rows]
    return merged + [r for r in new_rows if key(r) in new_by_key]


def save(path, rows):
    old_rows = []
    if os.path.exists(path):
        with open(path) as f:
            old_rows = json.load(f).get("rows", [])
    write_results(path, merge_rows(old_rows, rows), ("transformer_engine", "grouped_gemm"))


# What torch warns for each synchronizing call in sync-debug mode "warn". Matched exactly: the first
# set_sync_debug_mode of a process also warns, once, that the mode "does not yet detect all
# synchronizing operations", and counting that notice put a false "1" in each process's first row.
SYNC_WARNING = "called a synchronizing CUDA operation"


def count_syncs_in(caught) -> int:
    """How many of these caught warnings report a synchronizing CUDA call."""
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def count_host_syncs(fn) -> int:
    """Synchronizing CUDA calls made by one fn() (each one warns in sync-debug mode "warn")."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return count_syncs_in(caught)


def reduce_max(value):
    """Max over ranks of a number or None (None stays None; all ranks call this with the same kind)."""
    if dist.get_world_size() == 1:
        return value
    t = torch.tensor([-math.inf if value is None else float(value)], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return None if t.item() == -math.inf else t.item()


def reduce_mean(value: float) -> float:
    if dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], device="cuda", dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def everyone_ok(ok: bool) -> bool:
    """Whether every rank got this far without an error; keeps the ranks' control flow together."""
    if dist.get_world_size() == 1:
        return ok
    t = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def describe(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def rel_err(got, want):
    """Max over ranks of max |got - want| / max |want|, or None when either is missing."""
    if got is None or want is None:
        return None
    err = (got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)
    return reduce_max(err.item())


def guarded(fn, *args):
    """(fn(*args), None) or (None, the error) where any rank failed; the ranks stay in step."""
    value, error = None, None
    try:
        value = fn(*args)
    except Exception as exc:  # noqa: BLE001 - one implementation failing must not end the run
        traceback.print_exc()
        error = describe(exc)
    if not everyone_ok(error is None):
        return None, error or "failed on another rank"
    return value, None


def fwd_bwd(forward, params, x, grad_out, warmup, reps, back_to_back=False):
    """Forward output once (for the agreement check), then fwd+bwd timed and its host syncs
    counted. back_to_back: the median of triton.testing.do_bench (calls launched back to back,
    the host running ahead as in a model's step) instead of one call at a time from an idle GPU."""
    x_leaf = x.detach().requires_grad_(True)
    leaves = [x_leaf, *params]

    def step():
        torch.autograd.grad(forward(x_leaf), leaves, grad_out)

    out = forward(x_leaf).detach()  # [T, h]
    ms, peak = time_and_peak(step, warmup, 1 if back_to_back else reps)  # back to back: the peak and a first ms
    if back_to_back:
        ms = back_to_back_ms(step, rep_ms=max(200.0, 2 * reps * ms))
    return {"out": out, "ms": ms, "peak": peak, "syncs": count_host_syncs(step)}


def measure(build, x, grad_out, warmup, reps, back_to_back=False):
    """Builds one implementation and measures it (fwd_bwd); never raises.

    build() -> (forward: [T, h] -> [T, h], parameters, info dict, extra: () -> dict, or None).
    Returns ms, peak, syncs (each the max over ranks), out (this rank's forward output), info,
    error, and extra: extra()'s dict, or {"error": ...}, or None.
    """
    res = {"ms": None, "peak": None, "syncs": None, "out": None, "info": {}, "error": None, "extra": None}
    built, res["error"] = guarded(build)
    if built is None:
        return res
    forward, params, res["info"], extra = built
    timed, res["error"] = guarded(fwd_bwd, forward, params, x, grad_out, warmup, reps, back_to_back)
    if timed is not None:
        res.update(
            out=timed["out"],
            ms=round(reduce_max(timed["ms"]), 3),
            peak=int(reduce_max(timed["peak"])),
            syncs=int(reduce_max(timed["syncs"])),
        )
        if extra is not None:
            value, error = guarded(extra)
            res["extra"] = value if error is None else {"error": error}
    del built, forward, params, extra
    free_memory()
    return res


def ours_config(spec, dispatcher, chunks):
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1, hidden_size=spec["hidden"], num_attention_heads=16, params_dtype=torch.bfloat16
    )
    cfg.moe = types.SimpleNamespace(
        num_experts=spec["experts"],
        topk=spec["topk"],
        ffn_hidden_size=spec["ffn"],
        shared_expert_ffn_hidden_size=0,
        score_func="softmax",
        aux_loss_coeff=0.0,
        expert_bias=False,
        bias_update_rate=1e-3,
        capacity_factor=None,
        dispatcher=dispatcher,
        permute_backend="auto",
        dispatch_capacity_factor=2.0,
        dispatch_chunks=chunks,
        expert_backend="auto",
    )
    return cfg


@torch.no_grad()
def dispatch_steps(d, x, topk_idx, probs):
    """The dispatcher's first three steps -> the rows grouped by local expert [N_recv, h]."""
    from megatron_moe_hybrid.layers.moe import StaticAllToAllDispatcher

    if isinstance(d, StaticAllToAllDispatcher):  # the weights travel with the tokens, applied on the expert side
        permuted = d.dispatch_preprocess(x, topk_idx, probs)  # [ep * C, h]
    else:
        permuted = d.dispatch_preprocess(x, topk_idx)  # [N_send, h]
    return d.dispatch_postprocess(d.token_dispatch(permuted))[0]


@torch.no_grad()
def dispatch_combine(d, x, topk_idx, probs):
    """All six steps with identity experts -> [T, h]."""
    y = d.token_combine(d.combine_preprocess(dispatch_steps(d, x, topk_idx, probs)))  # [N_send, h]
    return d.combine_postprocess(y, probs)


def dispatch_only(layer, x, warmup, reps):
    """Ours' six dispatcher steps with identity experts, forward only, on x's routing."""
    with torch.no_grad():
        probs, topk_idx = layer.router(x)  # [T, K] each
    from megatron_moe_hybrid.layers.moe import StaticAllToAllDispatcher

    d = layer.dispatcher

    def step():
        return dispatch_combine(d, x, topk_idx, probs)

    want = x.float() * probs.sum(-1, keepdim=True)  # identity experts: each copy returns its token
    err = (step().float() - want).abs().max() / want.abs().max().clamp_min(1e-30)
    # copies the static dispatcher's capacity left unsent: they explain a non-zero err
    overflow = int(getattr(d, "last_overflow", 0))
    ms, peak = time_and_peak(step, warmup, reps)
    result = {"ms": ms, "peak": peak, "syncs": count_host_syncs(step), "err": err.item(), "overflow": overflow}
    if isinstance(d, StaticAllToAllDispatcher) and d.ep_size == 1:
        result["launch_free"] = permute_timings(d, x, topk_idx, probs, step, warmup, reps)
    return result


def permute_timings(d, x, topk_idx, probs, step, warmup, reps):
    """The static dispatcher at EP=1 with the host's launches out of the way: {row label: (ms,
    "permute" or "dispatch+combine" bytes, timing)}. The permute is the dispatch steps: the
    send and expand layouts and one scatter kernel that reads each token row once and writes
    its K expert-grouped copies."""

    def permute():
        return dispatch_steps(d, x, topk_idx, probs)

    permute()
    expand = d.state.expand
    # EP=1: the identity send layout, so the received rows are the tokens themselves
    return {
        "permute static": (time_and_peak(permute, warmup, reps)[0], "permute", "idle"),
        "permute static, CUDA graph": (graph_replay_ms(permute, warmup, reps), "permute", "graph"),
        "permute kernel (scatter)": (
            back_to_back_ms(lambda: scatter_rows(x, expand.copy_pos, expand.sorted_row, None, d.backend)),
            "permute", "back-to-back"),
        "dispatch+combine static, CUDA graph": (graph_replay_ms(step, warmup, reps), "dispatch+combine", "graph"),
    }


def device_copy(num_bytes):
    """A device copy reading + writing num_bytes in all (bf16), as a callable."""
    src = torch.empty(num_bytes // 4, dtype=torch.bfloat16, device="cuda")  # read 2 B + write 2 B each
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def graph_replay_ms(fn, warmup, reps):
    """Median ms of replays of fn captured in a CUDA graph (common.cuda_graph)."""
    return time_and_peak(cuda_graph(fn).replay, warmup, reps)[0]


def back_to_back_ms(fn, rep_ms=200.0):
    """Median ms of fn launched back to back (triton.testing.do_bench: events per call, the L2
    flushed between calls, no sync in between, so the host runs ahead of the device)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def build_ours(spec, variant, ep_group, router_weight, w1, w2, x, warmup, reps):
    from megatron_moe_hybrid.layers.moe import MoELayer

    dispatcher, chunks, _ = OURS_VARIANTS[variant]

    def build():
        # Built on the GPU: initialising 256 experts of S2 on the host takes far longer.
        with torch.device("cuda"):
            layer = MoELayer(ours_config(spec, dispatcher, chunks), ep_group=ep_group)
        layer.cuda()
        with torch.no_grad():
            layer.router.weight.copy_(router_weight)
            layer.experts.weight1.copy_(w1)
            layer.experts.weight2.copy_(w2)
        num_tokens, hidden = x.shape

        info = {"expert_backend": "not recorded (the experts never ran)"}

        from megatron_moe_hybrid.ops.moe.grouped import grouped_gemm_kind

        def record_kind(experts, args):  # what the experts run on the rows they get; once, then removed
            info["expert_backend"] = grouped_gemm_kind(args[0], experts.weight1, getattr(experts, "gemm_backend", "auto"))
            hook.remove()

        hook = layer.experts.register_forward_pre_hook(record_kind)

        def forward(x_th):
            return layer(x_th.view(num_tokens, 1, hidden))[0].view(num_tokens, hidden)

        extra = (lambda: dispatch_only(layer, x, warmup, reps)) if chunks == 1 else None
        return forward, [p for p in layer.parameters() if p.requires_grad], info, extra

    return build


def init_megatron(world, seed):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(seed)


def megatron_spec(num_experts):
    """(MoE submodule spec, whether its experts are grouped): grouped where TE or grouped_gemm exist,
    else SequentialMLP, a loop over the local experts."""
    from megatron.core.models.gpt import gpt_layer_specs

    if importlib.util.find_spec("transformer_engine") is not None:
        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=True)
        return layer.submodules.mlp, True
    has_grouped_gemm = importlib.util.find_spec("grouped_gemm") is not None
    layer = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=has_grouped_gemm, moe_use_legacy_grouped_gemm=has_grouped_gemm
    )
    return layer.submodules.mlp, has_grouped_gemm


def copy_into_megatron(layer, router_weight, w1, w2):
    """Our layout (w1 [E_local, h, 2F] gate | up, w2 [E_local, F, h]) into Megatron's experts."""
    experts = layer.experts
    kind = type(experts).__name__
    with torch.no_grad():
        layer.router.weight.copy_(router_weight)  # [E, h]
        if kind == "SequentialMLP":
            for e, expert in enumerate(experts.local_experts):
                expert.linear_fc1.weight.copy_(w1[e].t())  # [2F, h]: gate rows, then up rows
                expert.linear_fc2.weight.copy_(w2[e].t())  # [h, F]
        elif kind == "TEGroupedMLP":
            for e in range(w1.shape[0]):
                getattr(experts.linear_fc1, f"weight{e}").copy_(w1[e].t())
                getattr(experts.linear_fc2, f"weight{e}").copy_(w2[e].t())
        elif kind == "GroupedMLP":  # legacy: weight1 holds [E_local, h, 2F] in [h, E_local * 2F]
            experts.weight1.view(w1.shape).copy_(w1)
            experts.weight2.view(w2.shape).copy_(w2)
        else:
            raise NotImplementedError(f"no weight copy for Megatron experts {kind}")
    return kind


def build_megatron(spec, world, router_weight, w1, w2, x):
    def build():
        import megatron.core.transformer.moe.moe_utils as mu
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.spec_utils import build_module

        if not mu.HAVE_TE:
            mu.te_general_gemm = None  # else the router's gating GEMM raises NameError without TE
        mlp_spec, grouped = megatron_spec(spec["experts"])
        extra = {"moe_router_dtype": "fp32"} if "moe_router_dtype" in TransformerConfig.__dataclass_fields__ else {}
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=spec["hidden"],
            ffn_hidden_size=spec["ffn"],
            num_attention_heads=16,
            num_moe_experts=spec["experts"],
            moe_router_topk=spec["topk"],
            moe_ffn_hidden_size=spec["ffn"],
            moe_router_pre_softmax=True,  # softmax over all experts, then top-k: ours' "softmax"
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=grouped,
            expert_model_parallel_size=world,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            bf16=True,
            params_dtype=torch.bfloat16,
            **extra,
        )
        layer = build_module(mlp_spec, config=cfg, layer_number=1).cuda()
        kind = copy_into_megatron(layer, router_weight, w1, w2)
        num_tokens, hidden = x.shape

        def forward(x_th):
            return layer(x_th.view(num_tokens, 1, hidden))[0].view(num_tokens, hidden)

        info = {"expert_backend": kind, "router_dtype": extra.get("moe_router_dtype", "params_dtype")}
        return forward, [p for p in layer.parameters() if p.requires_grad], info, None

    return build


class _Forward(torch.nn.Module):
    """A forward closure as a module over the given parameters (what make_graphed_callables takes)."""

    def __init__(self, forward, params):
        super().__init__()
        self.fn = forward
        self.params = torch.nn.ParameterList(params)

    def forward(self, x):
        return self.fn(x)


def graphed(build, x):
    """build, with its forward+backward captured in CUDA graphs (torch.cuda.make_graphed_callables:
    three warm-up calls, then one capture per direction; each call replays them). Needs a forward
    with no host sync and static shapes; a failure is recorded like any other."""

    def build_graphed():
        forward, params, info, _ = build()
        module = _Forward(forward, params)
        sample = x.detach().clone().requires_grad_(True)
        replay = torch.cuda.make_graphed_callables(module, (sample,))
        return replay, params, {**info, "cuda_graph": True}, None

    return build_graphed


def build_torch(spec, ep_group, router_weight, w1, w2):
    def build():
        layer = GroupedMMMoE(router_weight, w1, w2, spec["topk"], ep_group)  # shares the weights: never stepped
        return layer, list(layer.parameters()), {"expert_backend": "torch._grouped_mm"}, None

    return build


def comm_anchor(world, num_bytes, warmup, reps):
    """(ms, peak, description) of moving num_bytes by NCCL all_to_all_single there and back
    (equal splits) or, on one GPU, of a device copy reading + writing num_bytes in all."""
    if world == 1:
        ms, peak = time_and_peak(device_copy(num_bytes), warmup, reps)
        return ms, peak, "device copy_ (same bytes read+written)"
    numel = math.ceil(num_bytes / 2 / 2 / world) * world  # half the bytes each way, bf16
    send = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    recv = torch.empty_like(send)

    def step():
        dist.all_to_all_single(recv, send)
        dist.all_to_all_single(send, recv)

    ms, peak = time_and_peak(step, warmup, reps)
    return ms, peak, "nccl all_to_all_single x2 (same bytes, equal splits)"


def routing_stats(topk_idx, num_experts, world):
    """Load of the busiest expert and of the busiest receiving rank, each over the mean, all ranks' tokens."""
    counts = count_per_expert(topk_idx, num_experts).double()  # [E]
    if world > 1:
        dist.all_reduce(counts)
    per_rank = counts.view(world, -1).sum(1)  # [ep]
    return {
        "expert_load_max_over_mean": round((counts.max() / counts.mean()).item(), 3),
        "rank_load_max_over_mean": round((per_rank.max() / per_rank.mean()).item(), 3),
    }


def gbps(num_bytes, ms):
    return None if ms is None else round(num_bytes / (ms * 1e-3) / 1e9, 1)


def layer_row(name, case, num_tokens, mine, theirs, anchor, target, notes):
    """A "moe fwd+bwd" row: ours (mine) against one anchor (theirs), both measure() results."""
    notes = notes + [f"ours experts: {mine['info'].get('expert_backend')}",
                     f"anchor experts: {theirs['info'].get('expert_backend')}"]
    notes += [f"{who} {res['error']}" for who, res in (("ours", mine), ("anchor", theirs)) if res["error"]]
    return {
        "name": name, **case,
        "ours_ms": mine["ms"], "anchor": anchor, "anchor_ms": theirs["ms"],
        "speedup": mine["ms"] and theirs["ms"] and round(theirs["ms"] / mine["ms"], 3),
        "target_speedup": target,
        "ours_peak_mem_bytes": mine["peak"], "anchor_peak_mem_bytes": theirs["peak"],
        "ours_tokens_per_s": mine["ms"] and round(num_tokens / mine["ms"] * 1e3),
        "anchor_tokens_per_s": theirs["ms"] and round(num_tokens / theirs["ms"] * 1e3),
        "ours_host_syncs_per_layer": mine["syncs"], "anchor_host_syncs_per_layer": theirs["syncs"],
        "max_rel_err_vs_ours": rel_err(theirs["out"], mine["out"]),
        "notes": "; ".join(notes),
    }


def case_tensors(spec, routing, zipf_s, seed, rank, num_local):
    """One case's inputs on this rank: router_weight [E, h] (the same on every rank), x [T, h],
    grad_out [T, h], w1 [E_local, h, 2F], w2 [E_local, F, h] (this rank's own)."""
    h, num_experts, ffn, num_tokens = (spec[k] for k in ("hidden", "experts", "ffn", "tokens"))
    shared = torch.Generator(device="cuda").manual_seed(seed)  # the same router on every rank
    local = torch.Generator(device="cuda").manual_seed(seed + 1 + rank)  # own tokens and experts
    router_weight = make_router_weight(num_experts, h, routing, zipf_s, shared, "cuda")
    x = make_input(num_tokens, h, routing, local, "cuda")
    grad_out = torch.randn(num_tokens, h, generator=local, device="cuda").bfloat16()
    bf16 = {"generator": local, "device": "cuda", "dtype": torch.bfloat16}
    w1 = torch.randn(num_local, h, 2 * ffn, **bf16) / h**0.5
    w2 = torch.randn(num_local, ffn, h, **bf16) / ffn**0.5
    return router_weight, x, grad_out, w1, w2


def run_case(key, routing, args, world, rank, ep_group, megatron_error):
    spec = SHAPES[key]
    h, num_experts, topk, ffn, num_tokens = (spec[k] for k in ("hidden", "experts", "topk", "ffn", "tokens"))
    num_local = num_experts // world
    routing_name = f"zipf{args.zipf_s:g}" if routing == "zipf" else routing
    case = {
        "shape": f"{key}-T{num_tokens}-H{h}-E{num_experts}-K{topk}-F{ffn}-{routing_name}-bf16",
        "gpus": world,
        "routing": routing_name,
        "tokens_per_gpu": num_tokens,
        "launch": "python" if world == 1 else f"torchrun --nproc_per_node {world}",
    }
    router_weight, x, grad_out, w1, w2 = case_tensors(spec, routing, args.zipf_s, args.seed, rank, num_local)
    _, topk_idx = route(x, router_weight, topk)  # [T, K]
    case.update(routing_stats(topk_idx, num_experts, world))
    timing = (f"median of {args.reps} after {args.warmup} warm-up, CUDA events, max over {world} rank(s); "
              "host syncs = calls that torch.cuda.set_sync_debug_mode('warn') flags")

    ours = {}
    for variant, (_, _, needs_ep) in OURS_VARIANTS.items():
        if world > 1 or not needs_ep:
            build = build_ours(spec, variant, ep_group, router_weight, w1, w2, x, args.warmup, args.reps)
            ours[variant] = measure(build, x, grad_out, args.warmup, args.reps)
    build = build_torch(spec, ep_group, router_weight, w1, w2)
    anchors = {TORCH_ANCHOR: measure(build, x, grad_out, args.warmup, args.reps)}
    graph_rows = []
    if args.graphs and world == 1:  # both layers captured: the host's launches out of the way of both
        mine = measure(graphed(build_ours(spec, "static", ep_group, router_weight, w1, w2, x, args.warmup, args.reps), x),
                       x, grad_out, args.warmup, args.reps)
        theirs = measure(graphed(build_torch(spec, ep_group, router_weight, w1, w2), x), x, grad_out,
                         args.warmup, args.reps)
        row = layer_row("moe fwd+bwd static, CUDA graph", case, num_tokens, mine, theirs, TORCH_ANCHOR + ", CUDA graph",
                        1.5, [timing, "both captured with torch.cuda.make_graphed_callables (forward and backward graphs)"])
        row["ours_max_rel_err_vs_eager"] = rel_err(mine["out"], ours["static"]["out"]) if "static" in ours else None
        graph_rows.append(row)
    if args.back_to_back and world == 1:  # both layers launched back to back: the host runs ahead of both
        mine = measure(build_ours(spec, "static", ep_group, router_weight, w1, w2, x, args.warmup, args.reps),
                       x, grad_out, args.warmup, args.reps, back_to_back=True)
        theirs = measure(build_torch(spec, ep_group, router_weight, w1, w2), x, grad_out, args.warmup, args.reps,
                         back_to_back=True)
        graph_rows.append(layer_row(
            "moe fwd+bwd static, back to back", case, num_tokens, mine, theirs, TORCH_ANCHOR + ", back to back", 1.5,
            ["median of triton.testing.do_bench (calls launched back to back with no sync between them, as the "
             "layers of a step run; L2 flushed between calls); host syncs = calls that "
             "torch.cuda.set_sync_debug_mode('warn') flags"]))
    if not args.skip_megatron and megatron_error is None:
        build = build_megatron(spec, world, router_weight, w1, w2, x)
        anchors[MEGATRON_ANCHOR] = measure(build, x, grad_out, args.warmup, args.reps)
    elif not args.skip_megatron:
        anchors[MEGATRON_ANCHOR] = {"ms": None, "peak": None, "syncs": None, "out": None, "info": {},
                                    "error": f"parallel_state: {megatron_error}"}

    rows = [layer_row(f"moe fwd+bwd {variant}", case, num_tokens, mine, theirs, anchor,
                      3.0 if anchor == MEGATRON_ANCHOR else 1.5, [timing])
            for variant, mine in ours.items() for anchor, theirs in anchors.items()]
    rows += graph_rows
    dispatch = {v: r["extra"] for v, r in ours.items() if r["extra"] is not None}
    if dispatch:
        rows += dispatch_rows(dispatch, case, topk_idx, num_local, h, args, world, timing)
    del ours, anchors, x, grad_out, w1, w2, router_weight
    free_memory()
    return rows


def dispatch_rows(dispatch, case, topk_idx, num_local, hidden, args, world, timing):
    """Rows of ours' dispatch+combine (identity experts) against moving the same bytes raw."""
    num_tokens, topk = topk_idx.shape
    if world == 1:  # permute reads T rows and writes T*K; unpermute reads T*K and writes T
        num_bytes = 2 * (num_tokens + num_tokens * topk) * hidden * 2
        byte_rule = "bytes = least read+written by permute and unpermute, 2 (T + T*K) h * 2 B"
    else:  # dispatch and combine each carry a token once per distinct destination rank
        num_bytes = reduce_mean(2 * distinct_rank_copies(topk_idx, num_local) * hidden * 2)
        byte_rule = "bytes = 2 * distinct (token, destination rank) pairs * h * 2 B, mean over ranks"
    anchor = "device copy_ (same bytes read+written)" if world == 1 else "nccl all_to_all_single x2 (same bytes)"
    measured, anchor_error = guarded(comm_anchor, world, int(num_bytes), args.warmup, args.reps)
    anchor_ms = anchor_peak = None
    if measured is not None:
        anchor_ms, anchor_peak = round(reduce_max(measured[0]), 3), int(reduce_max(measured[1]))
    free_memory()
    rows = []
    for variant, d in dispatch.items():
        failed = "error" in d  # the same on every rank, so the reductions below stay matched
        ms = None if failed else round(reduce_max(d["ms"]), 3)
        notes = [timing, "forward only, identity experts, ours' six dispatcher steps", byte_rule]
        notes += [f"{who} {error}" for who, error in (("ours", d.get("error")), ("anchor", anchor_error)) if error]
        rows.append({
            "name": f"dispatch+combine {variant}", **case,
            "ours_ms": ms, "anchor": anchor, "anchor_ms": anchor_ms,
            "speedup": ms and anchor_ms and round(anchor_ms / ms, 3), "target_speedup": 0.75 if world == 1 else 0.9,
            "ours_peak_mem_bytes": None if failed else int(reduce_max(d["peak"])),
            "anchor_peak_mem_bytes": anchor_peak,
            "payload_bytes": int(num_bytes), "ours_GBps": gbps(num_bytes, ms), "anchor_GBps": gbps(num_bytes, anchor_ms),
            "ours_host_syncs_per_layer": None if failed else int(reduce_max(d["syncs"])),
            "max_rel_err_vs_identity": None if failed else reduce_max(d["err"]),
            "ours_overflow_copies": None if failed else int(reduce_max(d["overflow"])),
            "notes": "; ".join(notes),
        })
        if not failed and d.get("launch_free"):
            permute_bytes = (num_tokens + num_tokens * topk) * hidden * 2
            rows += launch_free_rows(d["launch_free"], case, {"permute": permute_bytes, "dispatch+combine": num_bytes},
                                     args)
    return rows


TIMINGS = {  # how a launch-free row (and its copy) is timed
    "idle": "median of {reps} after {warmup} warm-up from an idle GPU, CUDA events (host launches included)",
    "graph": "median of {reps} CUDA-graph replays after {warmup} warm-up, CUDA events (no host launches)",
    "back-to-back": "median of triton.testing.do_bench (back to back, L2 flushed between calls)",
}


def launch_free_rows(timed, case, byte_counts, args):
    """Rows of the static dispatcher's permute and dispatch+combine at EP=1 (permute_timings),
    each against a device copy of the same bytes timed the same way."""
    copies = {}
    rows = []
    for name, (ms, kind, how) in timed.items():
        num_bytes = int(byte_counts[kind])
        if (num_bytes, how) not in copies:
            copy = device_copy(num_bytes)
            copies[num_bytes, how] = (time_and_peak(copy, args.warmup, args.reps)[0] if how == "idle"
                                      else graph_replay_ms(copy, args.warmup, args.reps) if how == "graph"
                                      else back_to_back_ms(copy))
            del copy
        anchor_ms = round(copies[num_bytes, how], 4)
        ms = round(ms, 4)
        rule = ("bytes = least read+written by the permute, (T + T*K) h * 2 B" if kind == "permute"
                else "bytes = least read+written by permute and unpermute, 2 (T + T*K) h * 2 B")
        what = ("the scatter kernel alone (the permute's data movement; layouts not included)"
                if name.startswith("permute kernel") else
                "ours' dispatch steps (send layout, expand layout, scatter), forward only" if kind == "permute"
                else "ours' six dispatcher steps, identity experts, forward only")
        rows.append({
            "name": name, **case, "ours_ms": ms, "anchor": f"device copy_ (same bytes read+written), {how}",
            "anchor_ms": anchor_ms, "speedup": round(anchor_ms / ms, 3), "target_speedup": 0.75,
            "payload_bytes": num_bytes, "ours_GBps": gbps(num_bytes, ms), "anchor_GBps": gbps(num_bytes, anchor_ms),
            "notes": "; ".join([TIMINGS[how].format(reps=args.reps, warmup=args.warmup), what, rule]),
        })
    free_memory()
    return rows


def init_distributed():
    from megatron_moe_hybrid.parallel.launch import init_process_group  # plain `python`: a group of one,
    # which Megatron's parallel_state needs
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return dist.get_rank(), dist.get_world_size()


def print_table(rows):
    print(f"{'name':28s} {'shape':44s} {'gpus':>4s} {'ours ms':>9s} {'anchor':28s} {'anchor ms':>9s} "
          f"{'speedup':>7s} {'syncs o/a':>9s} {'rel err':>8s}")
    for r in rows:
        syncs = f"{r.get('ours_host_syncs_per_layer')}/{r.get('anchor_host_syncs_per_layer', '-')}"
        err = r.get("max_rel_err_vs_ours", r.get("max_rel_err_vs_identity"))
        print(f"{r['name'][:28]:28s} {r['shape'][:44]:44s} {r['gpus']:>4d} {r['ours_ms']!s:>9s} "
              f"{r['anchor'][:28]:28s} {r['anchor_ms']!s:>9s} {r['speedup']!s:>7s} {syncs:>9s} "
              f"{'n/a' if err is None else f'{err:.1e}':>8s}")


def parse_list(text, allowed, flag):
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise ValueError(f"{flag} takes a comma list of {', '.join(allowed)}; got {text!r}")
    return items


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="S1,S2", help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--routing", default="balanced,zipf", help="comma list of " + ", ".join(ROUTINGS))
    parser.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the skewed routing")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/h200/moe.json")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="also time ours and the grouped_mm layer captured in CUDA graphs (1 GPU)")
    parser.add_argument("--back-to-back", action=argparse.BooleanOptionalAction, default=True,
                        help="also time ours and the grouped_mm layer launched back to back (1 GPU)")
    args = parser.parse_args()
    shapes = parse_list(args.shapes, list(SHAPES), "--shapes")
    routings = parse_list(args.routing, ROUTINGS, "--routing")
    if args.reps < 1 or args.warmup < 0:
        raise ValueError(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")

    rank, world = init_distributed()
    for key in shapes:
        if SHAPES[key]["experts"] % world:
            raise ValueError(f"{key} has {SHAPES[key]['experts']} experts, not divisible by {world} GPUs")
    ep_group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(args.seed)
    megatron_error = None
    if not args.skip_megatron:
        try:
            init_megatron(world, args.seed)
        except Exception as error:  # noqa: BLE001 - Megatron failing leaves its rows null
            traceback.print_exc()
            megatron_error = describe(error)
    rows = []
    for key in shapes:
        for routing in routings:
            case_rows = run_case(key, routing, args, world, rank, ep_group, megatron_error)
            rows += case_rows
            if rank == 0:
                for r in case_rows:
                    print(f"{r['name']:26s} {r['shape']:44s} gpus {r['gpus']} ours {r['ours_ms']} ms | "
                          f"{r['anchor'][:32]:32s} {r['anchor_ms']} ms", flush=True)
                save(args.out, rows)
    if rank == 0:
        print_table(rows)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
