"""Top-k sparse attention (issue 4): our Triton kernels against the naive gather chain and dense
causal SDPA with the same heads, one H200.

    python benchmarks/sparse_attention.py [--shapes mla,gqa8k,gqa32k] [--budget-s 120]
        [--sweep] [--profile DIR] [--out benchmarks/results/h200/sparse_attention.json]

bf16 q, k, v (standard normal), random causal selections: query t (key position S - T + t)
picks K distinct keys among s <= S - T + t (fewer, and -1 slots, while t has fewer earlier
keys). MLA is absorbed: v = kv[..., :512], the one latent kv read as both k and v.
Per shape, in the same process: ours (backend "triton"), the naive chain (gather k and v rows
by index, matmul, fp32 softmax, matmul, 1024 queries at a time, bf16 products: the issue's
anchor) and dense causal SDPA (torch.nn.functional.scaled_dot_product_attention, the first of
cuDNN / flash / efficient / math that runs, kv heads repeated to the query heads; lower-right causal
when T < S). fwd runs under no_grad; fwd+bwd is autograd.grad of <o, do> for q, k, v.
Median of CUDA-event timings (benchmarks/common.py), peak = allocator peak above the inputs.
tflops uses the issue's count per query: fwd 2 h k (d_qk + d_v), bwd 2 h k (3 d_qk + 2 d_v),
with k the mean number of valid slots (sparse) or readable keys (SDPA). bwd_ms is fwd+bwd
minus fwd. --sweep also times other launch configs of our kernels (CONFIG_OVERRIDE) on MLA;
--profile writes one profiled fwd+bwd per shape (kernel time table) to DIR; --forms times
each form of the passes (triton_sparse.FORWARD_FORM / BACKWARD_FORM: the Triton kernels, or
batched products over gathered rows; and the kernels forward with the fused kernels backward,
at its default and FUSED_SWEEP's configs, where the heads per kv group allow it) and compares
their outputs and gradients.
"""

import argparse
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from common import time_and_peak, write_results

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.sparse_attention import triton_sparse as ts

SHAPES = {  # key -> (shape, B, T, S, H, G, D, DV, K, shared kv)
    "mla": ("MLA-B1-T4096-S8192-H128-G1-D576-DV512-K2048", 1, 4096, 8192, 128, 1, 576, 512, 2048, True),
    # absorbed MLA under tensor parallelism 4: 32 of the 128 heads per rank (--forms decides auto's threshold there)
    "mla-h32": ("MLA-B1-T4096-S8192-H32-G1-D576-DV512-K2048", 1, 4096, 8192, 32, 1, 576, 512, 2048, True),
    # and under tensor parallelism 8 (DeepSeek-V3.2's 128 heads over 8 ranks): 16 per rank
    "mla-h16": ("MLA-B1-T4096-S8192-H16-G1-D576-DV512-K2048", 1, 4096, 8192, 16, 1, 576, 512, 2048, True),
    "mla128k": ("MLA-B1-T4096-S131072-H128-G1-D576-DV512-K2048", 1, 4096, 131072, 128, 1, 576, 512, 2048, True),
    "gqa8k": ("GQA-B1-T8192-H64-G4-D128-K2048", 1, 8192, 8192, 64, 4, 128, 128, 2048, False),
    "gqa32k": ("GQA-B1-T32768-H64-G4-D128-K2048", 1, 32768, 32768, 64, 4, 128, 128, 2048, False),
}
TARGET_TFLOPS = {"mla": {"fwd": 550.0, "bwd": 300.0}, "mla128k": {"fwd": 550.0, "bwd": 300.0}}  # issue 4, sparse attention on the MLA shape
NAIVE = "naive gather chain (torch bf16, 1024 queries at a time)"
NAIVE_SAVED_LIMIT = 100e9  # bytes the naive chain's autograd may keep before we skip it
DEVICE, DTYPE = "cuda", torch.bfloat16  # a CPU dry run of this script sets cpu / fp32
SWEEP = {  # kernel -> alternative configs timed with --sweep on MLA
    # (64, 32, 8 warps, 2 stages): Triton 3.6 compiles MLA's kernels forward to 251 registers, none
    # spilled, 147584 B of shared memory (tools/compile_kernels.py; 64 slots spill 384 B), untimed
    "fwd": [{"BH": 64, "BK": 16, "num_warps": 8, "num_stages": 3}, {"BH": 64, "BK": 32, "num_warps": 8, "num_stages": 2}],
    "dq": [{"BH": 16, "BK": 64, "num_warps": 8, "num_stages": 2}],
}


def causal_indices(B, T, S, K, device, seed=0):
    """[B, T, K] int32, K distinct random keys among each query's earlier tokens, -1 padded;
    marked valid (sa.mark_valid_indices), as lightning_indexer_topk's selections are, so that the
    op skips its checks of them (the range's host read, the rows' sort) as in the layer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pos = torch.arange(S - T, S, device=device)
    rows = []
    for t0 in range(0, T, 2048):
        t1 = min(T, t0 + 2048)
        scores = torch.rand(B, t1 - t0, S, generator=gen, device=device)
        scores.masked_fill_(torch.arange(S, device=device) > pos[t0:t1, None], -1.0)
        values, idx = scores.topk(K, dim=-1, sorted=False)
        rows.append(idx.masked_fill_(values < 0, -1).to(torch.int32))
        del scores, values
    return sa.mark_valid_indices(torch.cat(rows, dim=1), S)


def naive_chain(q, k, v, indices, scale, chunk=1024):
    """Gather, matmul, softmax, matmul per 1024 queries, bf16 products, fp32 softmax."""
    B, T, H, D = q.shape
    S, G = k.shape[1], k.shape[2]
    R = H // G
    flat_k, flat_v = k.reshape(B * S, G, D), v.reshape(B * S, G, v.shape[-1])
    base = torch.arange(B, device=q.device)[:, None, None] * S
    outs = []
    for t0 in range(0, T, chunk):
        idx = indices[:, t0:t0 + chunk].long()
        c, K = idx.shape[1], idx.shape[2]
        rows = (idx.clamp(min=0) + base).reshape(-1)
        k_sel = flat_k.index_select(0, rows).view(B, c, K, G, D)
        v_sel = flat_v.index_select(0, rows).view(B, c, K, G, -1)
        q_g = q[:, t0:t0 + chunk].reshape(B, c, G, R, D)
        s = torch.einsum("bcgrd,bckgd->bcgrk", q_g, k_sel).float() * scale
        s = s.masked_fill((idx < 0)[:, :, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        o = torch.einsum("bcgrk,bckgd->bcgrd", p.to(q.dtype), v_sel)
        outs.append(o.reshape(B, c, H, -1))
    return torch.cat(outs, dim=1)


def sdpa_runner(q, k, v, T, S):
    """(fn(q, k, v) -> o, backend name) for the first SDPA backend that runs these shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = None if T == S else causal_lower_right(T, S)
    last = None
    order = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    for backend in order:

        def fn(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                if mask is None:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        try:
            with torch.enable_grad():
                o = fn(q, k, v)
                torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
            torch.cuda.synchronize()
            return fn, backend.name
        except RuntimeError as err:
            last = err
    raise RuntimeError(f"no SDPA backend ran: {last}")


def measure(fn, budget_ms=1500.0):
    """(median ms, peak bytes): one untimed call (compiles), then reps to fill about budget_ms."""
    torch.cuda.synchronize()
    t = time.time()
    fn()
    torch.cuda.synchronize()
    first_ms = (time.time() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    est = start.elapsed_time(end)
    reps = int(max(3, min(20, budget_ms / max(est, 1e-3))))
    ms, peak = time_and_peak(fn, warmup=1, reps=reps)
    return ms, peak, reps, first_ms


def fwd_bwd(run, inputs, do):
    def fn():
        with torch.enable_grad():
            o = run(*inputs)
            torch.autograd.grad(o, inputs, do)

    return fn


def no_grad(run, inputs):
    def fn():
        with torch.no_grad():
            run(*inputs)

    return fn


def rel_rms(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tflops(per_query_flops, num_queries, ms):
    return round(per_query_flops * num_queries / ms / 1e9, 1)


def bench_shape(key, args, start, rows, out_rows_path):
    shape, B, T, S, H, G, D, DV, K, shared = SHAPES[key]
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, H, D, generator=gen, device=dev).to(DTYPE).requires_grad_()
    if shared:
        kv = torch.randn(B, S, G, D, generator=gen, device=dev).to(DTYPE).requires_grad_()
        leaves = (q, kv)

        def ours(q, kv):
            return sa.sparse_attention(q, kv, kv[..., :DV], indices, backend="triton")[0]

        def naive(q, kv):
            return naive_chain(q, kv, kv[..., :DV], indices, D**-0.5)

    else:
        k = torch.randn(B, S, G, D, generator=gen, device=dev).to(DTYPE).requires_grad_()
        v = torch.randn(B, S, G, DV, generator=gen, device=dev).to(DTYPE).requires_grad_()
        leaves = (q, k, v)

        def ours(q, k, v):
            return sa.sparse_attention(q, k, v, indices, backend="triton")[0]

        def naive(q, k, v):
            return naive_chain(q, k, v, indices, D**-0.5)

    indices = causal_indices(B, T, S, K, dev)
    do = torch.randn(B, T, H, DV, generator=gen, device=dev).to(DTYPE)
    k_mean = (indices >= 0).sum().item() / (B * T)  # valid slots per query
    fwd_q = 2 * H * k_mean * (D + DV)
    bwd_q = 2 * H * k_mean * (3 * D + 2 * DV)
    res = {"fwd": {}, "fwd+bwd": {}}
    notes = {"fwd": [], "fwd+bwd": []}
    extra = {}

    def log(msg):
        print(f"[{time.time() - start:5.0f}s] {shape} {msg}", flush=True)

    # ours (configs are picked afresh per shape so that the row records this shape's)
    ts._chosen.clear()
    for mode, fn in (("fwd", no_grad(ours, leaves)), ("fwd+bwd", fwd_bwd(ours, leaves, do))):
        ms, peak, reps, first = measure(fn)
        res[mode]["ours"] = (ms, peak)
        log(f"ours {mode} {ms:.3f} ms (reps {reps}, first call {first:.0f} ms) peak {peak / 2**30:.2f} GiB")
    extra["config"] = {n: ts._chosen.get(k) for n, k in _chosen_keys(ts._chosen).items()}
    sh = ts._Shape(leaves[0], *_kv(leaves, DV), indices)
    extra["forms"] = {"fwd": ts._form(sh, leaves[0], ts.FORWARD_FORM), "bwd": ts._form(sh, leaves[0], ts.BACKWARD_FORM, "backward")}
    if args.forms:
        extra["backward_forms"] = _forms(ours, leaves, do, log)

    with torch.no_grad():
        o_ours = ours(*leaves)
    # naive chain
    saved = B * T * K * G * (D + DV) * 2 * 2 + B * T * H * K * 10
    try:
        ms, peak, reps, _ = measure(no_grad(naive, leaves))
        res["fwd"]["naive"] = (ms, peak)
        log(f"naive fwd {ms:.3f} ms peak {peak / 2**30:.2f} GiB")
        with torch.no_grad():
            extra["rel_rms_o_vs_naive"] = round(rel_rms(o_ours, naive(*leaves)), 5)
    except torch.cuda.OutOfMemoryError as err:
        notes["fwd"].append(f"naive chain OOM: {str(err)[:120]}")
    torch.cuda.empty_cache()
    if saved > NAIVE_SAVED_LIMIT:
        notes["fwd+bwd"].append(
            f"naive chain fwd+bwd skipped: its autograd would keep about {saved / 1e9:.0f} GB of "
            "gathered k/v and probabilities (the H200 has 141)"
        )
    elif time.time() - start > args.budget_s:
        notes["fwd+bwd"].append("naive chain fwd+bwd skipped: the run's time budget was spent")
    else:
        try:
            ms, peak, reps, _ = measure(fwd_bwd(naive, leaves, do))
            res["fwd+bwd"]["naive"] = (ms, peak)
            log(f"naive fwd+bwd {ms:.3f} ms peak {peak / 2**30:.2f} GiB")
        except torch.cuda.OutOfMemoryError as err:
            notes["fwd+bwd"].append(f"naive chain OOM: {str(err)[:120]}")
    torch.cuda.empty_cache()

    # dense causal SDPA with the same heads
    sdpa_backend = None
    if time.time() - start > args.budget_s:
        for lines in notes.values():
            lines.append("SDPA skipped: the run's time budget was spent")
    else:
        try:
            R = H // G
            qs = q.detach().transpose(1, 2).contiguous().requires_grad_()
            if shared:
                kvs = kv.detach().transpose(1, 2).repeat_interleave(R, dim=1)
                ks, vs = kvs.contiguous(), kvs[..., :DV].contiguous()
                del kvs
            else:
                ks = k.detach().transpose(1, 2).repeat_interleave(R, dim=1).contiguous()
                vs = v.detach().transpose(1, 2).repeat_interleave(R, dim=1).contiguous()
            ks.requires_grad_()
            vs.requires_grad_()
            # heads in groups small enough for the kernels' 32-bit offsets (MLA at 128k has
            # 128 x 131072 x 576 key elements): the same work, one call per group
            hg = math.ceil(H / max(1, math.ceil(H * S * D / 2**30)))
            run1, sdpa_backend = sdpa_runner(qs[:, :hg], ks[:, :hg], vs[:, :hg], T, S)
            if hg < H:
                sdpa_backend += f" ({-(-H // hg)} calls of {hg} heads)"

            def run(q, k, v):
                return torch.cat([run1(q[:, h:h + hg], k[:, h:h + hg], v[:, h:h + hg]) for h in range(0, H, hg)], 1)

            dos = do.transpose(1, 2).contiguous()
            for mode, fn in (("fwd", no_grad(run, (qs, ks, vs))), ("fwd+bwd", fwd_bwd(run, (qs, ks, vs), dos))):
                ms, peak, reps, _ = measure(fn)
                res[mode]["sdpa"] = (ms, peak)
                log(f"sdpa ({sdpa_backend}) {mode} {ms:.3f} ms peak {peak / 2**30:.2f} GiB")
            del qs, ks, vs, dos
        except (RuntimeError, torch.cuda.OutOfMemoryError) as err:
            traceback.print_exc()
            for lines in notes.values():
                lines.append(f"SDPA failed: {type(err).__name__}: {str(err)[:160]}")
    torch.cuda.empty_cache()
    sdpa_pairs = sum(min(S, S - T + t + 1) for t in range(T)) / T  # readable keys per query

    if args.profile:
        try:
            _profile(fwd_bwd(ours, leaves, do), os.path.join(args.profile, f"profile_{key}.txt"), log)
        except Exception as err:  # noqa: BLE001 - the profile is an extra, never fatal
            log(f"profile failed: {type(err).__name__}: {err}")

    if args.sweep and key == "mla":
        extra["sweep"] = _sweep(ours, leaves, do, log, fwd_q, bwd_q, B * T)

    for mode in ("fwd", "fwd+bwd"):
        per_q = fwd_q if mode == "fwd" else fwd_q + bwd_q
        per_q_sdpa = per_q / k_mean * sdpa_pairs
        ours_ms, ours_peak = res[mode]["ours"]
        naive_ms, naive_peak = res[mode].get("naive", (None, None))
        sdpa_ms, sdpa_peak = res[mode].get("sdpa", (None, None))
        row = {
            "name": f"sparse attention {mode}", "shape": shape,
            "ours_ms": round(ours_ms, 4), "anchor": NAIVE,
            "anchor_ms": None if naive_ms is None else round(naive_ms, 4),
            "speedup": None if naive_ms is None else round(naive_ms / ours_ms, 3),
            "ours_peak_mem_bytes": ours_peak, "anchor_peak_mem_bytes": naive_peak,
            "tflops": tflops(per_q, B * T, ours_ms),
            "anchor_tflops": None if naive_ms is None else tflops(per_q, B * T, naive_ms),
            "sdpa": None if sdpa_backend is None else f"torch SDPA {sdpa_backend}, causal, kv heads repeated",
            "sdpa_ms": None if sdpa_ms is None else round(sdpa_ms, 4),
            "sdpa_speedup": None if sdpa_ms is None else round(sdpa_ms / ours_ms, 3),
            "sdpa_peak_mem_bytes": sdpa_peak,
            "sdpa_tflops": None if sdpa_ms is None else tflops(per_q_sdpa, B * T, sdpa_ms),
            "valid_slots_per_query": round(k_mean, 1),
            "sdpa_keys_per_query": round(sdpa_pairs, 1),
        }
        if mode == "fwd+bwd":
            bwd_ms = ours_ms - res["fwd"]["ours"][0]
            row["ours_bwd_ms"] = round(bwd_ms, 4)
            row["bwd_tflops"] = tflops(bwd_q, B * T, bwd_ms)
        if key in TARGET_TFLOPS:
            row["target_tflops"] = TARGET_TFLOPS[key]["fwd" if mode == "fwd" else "bwd"]
            row["target_tflops_of"] = "fwd" if mode == "fwd" else "bwd (bwd_tflops)"
        row.update(extra)
        row["notes"] = "; ".join(
            ["median of CUDA events; fwd under no_grad; k = valid slots per query"] + notes[mode]
        )
        rows.append(row)
        write_results(out_rows_path, rows)


def _kv(leaves, DV):
    """(k, v) of the leaves: absorbed MLA's one latent read as both."""
    return (leaves[1], leaves[1][..., :DV]) if len(leaves) == 2 else (leaves[1], leaves[2])


# Launch configs of the fused backward (BACKWARD_FORM "fused") timed by --forms beside its
# default, where it runs (at most FUSED_MAX_HEADS heads per kv group: GQA, MLA under TP): Triton
# 3.6 compiles GQA's default (BK 64, 4 warps) to 226 registers, 2 programs an SM; these to 128
# (tools/compile_kernels.py --op sparse --shape gqa32k).
FUSED_SWEEP = [
    {"BH": 16, "BK": 64, "num_warps": 8, "num_stages": 2},
    {"BH": 16, "BK": 32, "num_warps": 4, "num_stages": 2},
]


def _forms(ours, leaves, do, log):
    """fwd and fwd+bwd ms with each form of both passes (triton_sparse.FORWARD_FORM /
    BACKWARD_FORM; "kernels+fused": the kernels forward and the fused kernels backward, then at
    each FUSED_SWEEP config) and the relative RMS of each form's o and gradients to the kernels
    form's (and for the fused backward whether they are bitwise the kernels form's)."""
    out, ref = {}, None
    R = leaves[0].shape[2] // leaves[1].shape[2]
    runs = [("kernels", None), ("products", None)]
    if R <= ts.FUSED_MAX_HEADS:
        runs += [("kernels+fused", None)] + [(f"kernels+fused {c}", c) for c in FUSED_SWEEP]
    else:
        out["kernels+fused"] = {"skipped": f"{R} heads per kv group, over FUSED_MAX_HEADS {ts.FUSED_MAX_HEADS}"}
    for name, cfg in runs:
        fwd_form, _, bwd_form = name.split()[0].partition("+")
        ts.FORWARD_FORM, ts.BACKWARD_FORM = fwd_form, bwd_form or fwd_form
        ts.CONFIG_OVERRIDE.clear()
        if cfg is not None:
            ts.CONFIG_OVERRIDE["fused"] = cfg
        try:
            fwd_ms, _, _, _ = measure(no_grad(ours, leaves), budget_ms=600)
            ms, peak, _, _ = measure(fwd_bwd(ours, leaves, do), budget_ms=800)
            o = ours(*leaves)
            got = (o, *torch.autograd.grad(o, leaves, do))
            out[name] = {"fwd_ms": round(fwd_ms, 4), "fwd+bwd_ms": round(ms, 4), "peak_mem_bytes": peak}
            if ref is None:
                ref = got
            else:
                out[name]["rel_rms_o_grads_vs_kernels"] = [round(rel_rms(g, r), 5) for g, r in zip(got, ref)]
                if "fused" in name:
                    out[name]["bitwise_equal_to_kernels"] = all(torch.equal(g, r) for g, r in zip(got, ref))
            o = ours(*leaves)
            again = (o, *torch.autograd.grad(o, leaves, do))
            out[name]["bitwise_repeatable"] = all(torch.equal(a, g) for a, g in zip(again, got))
            log(f"form {name}: {out[name]}")
        except Exception as err:  # noqa: BLE001 - a form that fails is recorded
            out[name] = {"error": f"{type(err).__name__}: {str(err)[:160]}"}
            log(f"form {name} failed: {err}")
        finally:
            ts.FORWARD_FORM = ts.BACKWARD_FORM = "auto"
            ts.CONFIG_OVERRIDE.clear()
        torch.cuda.empty_cache()
    return out


def _chosen_keys(chosen):
    return {key[0]: key for key in chosen}


def _profile(fn, path, log):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(table)
    log("profile:\n" + "\n".join(table.splitlines()[:16]))


def _sweep(ours, leaves, do, log, fwd_q, bwd_q, num_queries):
    """Times each alternative config of SWEEP, one kernel at a time (others at default), both
    passes in the kernels form (auto takes the products form at MLA's 128 heads on the GPU, which
    launches none of these kernels: until 2026-12-05 this sweep timed that form unawares)."""
    out = []
    for kernel, cfgs in SWEEP.items():
        for cfg in cfgs:
            ts.CONFIG_OVERRIDE.clear()
            ts.CONFIG_OVERRIDE[kernel] = cfg
            ts.FORWARD_FORM = ts.BACKWARD_FORM = "kernels"
            try:
                if kernel == "fwd":
                    ms, _, _, _ = measure(no_grad(ours, leaves), budget_ms=600)
                    out.append({"kernel": kernel, "config": cfg, "fwd_ms": round(ms, 4),
                                "tflops": tflops(fwd_q, num_queries, ms)})
                else:
                    ms, _, _, _ = measure(fwd_bwd(ours, leaves, do), budget_ms=600)
                    out.append({"kernel": kernel, "config": cfg, "fwd+bwd_ms": round(ms, 4)})
                log(f"sweep {kernel} {cfg}: {out[-1]}")
            except Exception as err:  # noqa: BLE001 - a config that fails is recorded, not fatal
                out.append({"kernel": kernel, "config": cfg, "error": f"{type(err).__name__}: {str(err)[:160]}"})
                log(f"sweep {kernel} {cfg} failed: {err}")
    ts.CONFIG_OVERRIDE.clear()
    ts.FORWARD_FORM = ts.BACKWARD_FORM = "auto"
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mla,gqa8k,gqa32k")
    parser.add_argument("--budget-s", type=float, default=math.inf,
                        help="after this many seconds, anchors (naive, SDPA) start on no new shape")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--forms", action="store_true", help="also time each form of the passes")
    parser.add_argument("--out", default="benchmarks/results/h200/sparse_attention.json")
    args = parser.parse_args()
    rows, start = [], time.time()
    for key in args.shapes.split(","):
        try:
            bench_shape(key, args, start, rows, args.out)
        except Exception:  # noqa: BLE001 - keep the other shapes' rows
            traceback.print_exc()
            rows.append({"name": "sparse attention", "shape": SHAPES[key][0], "ours_ms": None,
                         "notes": f"failed: {traceback.format_exc(limit=1)[-300:]}"})
            write_results(args.out, rows)
        torch.cuda.empty_cache()
    print("\nshape | pass | ours ms | naive ms | sdpa ms | TFLOP/s | bwd TFLOP/s | peak GiB")
    for r in rows:
        if r.get("ours_ms") is None:
            print(r["shape"], r["notes"])
            continue
        print(f"{r['shape']} | {r['name'].split()[-1]} | {r['ours_ms']} | {r['anchor_ms']} | "
              f"{r['sdpa_ms']} | {r['tflops']} | {r.get('bwd_tflops', '')} | "
              f"{r['ours_peak_mem_bytes'] / 2**30:.2f}")


if __name__ == "__main__":
    main()
