"""Issue 4's whole sparse layer (indexer + top-k + sparse attention + indexer KL loss) and the
indexer alone, on one H200, ours against the naive PyTorch chain and dense causal SDPA.

    python benchmarks/sparse_layer.py [--jobs idx8k,idx128k,idx1m,mla8k,...] [--budget-s 300]
        [--sweep] [--out benchmarks/results/h200/sparse_layer.json]

bf16 inputs, standard normal (the indexer's scaled by 1/4). Queries are the last T of S keys
(q_positions = S - T + arange(T)), causal.

idx<S>: the lightning indexer + top-2048 alone (DeepSeek-V3.2's 64 heads x 128, 4096 queries
  over S keys): ours = lightning_indexer_topk (Triton scoring with the sort keys, torch.topk
  per memory-bounded chunk); anchor = the reference (einsum, relu, weighted head sum,
  masked, stable sort, 256 queries at a time); also torch.topk alone over one chunk's fp32
  scores, to say what top-k costs. TFLOP/s count the scoring, 2 HI DI per readable (t, s).
  --fp8: also ours with fp8 scoring (fp8=True: rows Hadamard-rotated and quantized, then the
  kernel's products on fp8 tensor cores), its scoring kernel alone, and the share of the bf16
  selection it keeps (fp8_recall_vs_bf16). From SELECT_BLOCK_MIN_KEYS keys the selection goes
  through the runs' maxima. In the same run, each of FORMS' selection forms (torch.topk's
  threshold, the radix select) times the whole indexer (<form>_ms) and the selection alone
  (selection_<form>_ms), by runs and over whole rows (<form>_whole_rows_ms) where it would take
  the runs, each checked equal to the default's; --radix-sweep times the whole-row selection and
  the thresholds alone at RADIX_SWEEP's radix configs.
mla<S> / gqa<L>: the layer's attention part, forward+backward: indexer top-k (no gradient),
  sparse attention over the selection (gradients to q, k, v), and the sparse-stage indexer
  KL loss (gradients to the indexer's q, k and weights; target from the detached q and k).
  ours = lightning_indexer_topk + Triton sparse_attention_with_target (the KL target summed
  from the products forward's probabilities, or from the attention's lse after it) +
  chunked_indexer_kl_loss; parts: the attention part includes its target; naive =
  reference indexer_topk + the gather chain of benchmarks/sparse_attention.py + the
  reference KL loss on whole [T, K] tensors; dense = causal SDPA (cuDNN / flash / efficient,
  the first that runs) with the same heads, without indexer. MLA: 128 heads, absorbed
  d 576/512, 4096 queries over S keys; GQA: 64 heads / 4 kv heads, d 128, T = S = L.
"""

import argparse
import contextlib
import math
import os
import sys
import time
import traceback

import torch
import triton
from common import write_results
from sparse_attention import measure, naive_chain, sdpa_runner

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe_hybrid.ops import sparse_attention as sa
from megatron_moe_hybrid.ops.sparse_attention import reference, triton_indexer

K, HI, DI = 2048, 64, 128
JOBS = {  # key -> (kind, T queries, S keys, H, G, D, DV)
    "idx8k": ("indexer", 4096, 8192, 0, 0, 0, 0),
    "idx32k": ("indexer", 4096, 32768, 0, 0, 0, 0),
    "idx64k": ("indexer", 4096, 65536, 0, 0, 0, 0),
    "idx128k": ("indexer", 4096, 131072, 0, 0, 0, 0),
    "idx1m": ("indexer", 4096, 1048576, 0, 0, 0, 0),
    "mla8k": ("layer", 4096, 8192, 128, 1, 576, 512),
    "mla32k": ("layer", 4096, 32768, 128, 1, 576, 512),
    "mla64k": ("layer", 4096, 65536, 128, 1, 576, 512),
    "mla128k": ("layer", 4096, 131072, 128, 1, 576, 512),
    "gqa32k": ("layer", 32768, 32768, 64, 4, 128, 128),
    "gqa64k": ("layer", 65536, 65536, 64, 4, 128, 128),
    "gqa128k": ("layer", 131072, 131072, 64, 4, 128, 128),
}
SWEEP = [{"BQ": 64, "BS": 128, "num_warps": 4, "num_stages": 2},
         {"BQ": 64, "BS": 128, "num_warps": 4, "num_stages": 3},
         {"BQ": 128, "BS": 128, "num_warps": 4, "num_stages": 2},
         {"BQ": 64, "BS": 256, "num_warps": 4, "num_stages": 2},
         {"BQ": 32, "BS": 128, "num_warps": 4, "num_stages": 2},
         {"BQ": 64, "BS": 128, "num_warps": 8, "num_stages": 2}]
# The selection's forms timed against each other in every idx job (settings, the setting from
# which length rows take the runs, whether to time the form over whole rows too): torch.topk's
# threshold with the runs' maxima from 196608 keys (the form of 8d5e6d1), and the radix select's
# kernels with the runs from 65536 keys, the qualifying runs listed first, ordered by torch.sort
# (the default) or in the kernel. (The runs kernel stepping over every run, "radix_form" in
# results/h100/indexer_radix_listed.json, was removed after that run.)
_RADIX = {"SELECT_THRESHOLD": "radix", "RADIX_RUNS_MIN_KEYS": 65536, "SELECT_SORT": "torch"}
FORMS = {"topk_form": ({"SELECT_THRESHOLD": "topk", "SELECT_BLOCK_MIN_KEYS": 196608}, "SELECT_BLOCK_MIN_KEYS", True),
         "radix_listed_torch_sort_form": (_RADIX, "RADIX_RUNS_MIN_KEYS", True),
         "radix_listed_form": ({**_RADIX, "SELECT_SORT": "kernel"}, "RADIX_RUNS_MIN_KEYS", False)}


def time_forms(fn, want, S, prefix, row, log):
    """fn timed under each of FORMS, and over whole rows where the form would take the runs at
    S keys (and FORMS asks for it), into row[prefix + form (+ "_whole_rows") + "_ms" / "_equal"]
    (fn() equal to want). The runs-only forms are skipped where rows are too short for the runs."""
    for name, (settings, runs_key, whole_rows) in FORMS.items():
        if not whole_rows and S < settings[runs_key]:
            continue
        variants = [("", settings)]
        if whole_rows and S >= settings[runs_key]:
            variants.append(("_whole_rows", {**settings, runs_key: 1 << 62}))
        for suffix, form in variants:
            with selection_form(**form):
                m, _, _, _ = measure(fn)
                same = torch.equal(fn(), want)
            key = f"{prefix}{name}{suffix}"
            row.update({f"{key}_ms": round(m, 3), f"{key}_equal": same})
            log(f"{key} {m:.3f} ms, equal {same}")
# --radix-sweep: (RADIX_BITS, RADIX_BLOCK, RADIX_CBLOCK, RADIX_WARPS, SELECT_SORT) of triton_indexer's radix select
RADIX_SWEEP = [(8, 4096, 1024, 8, "kernel"), (8, 4096, 1024, 8, "torch"), (8, 4096, 2048, 8, "kernel"),
               (8, 2048, 1024, 4, "kernel"), (8, 8192, 1024, 8, "kernel"), (8, 4096, 1024, 16, "kernel"),
               (6, 4096, 1024, 8, "kernel"), (5, 4096, 1024, 8, "kernel"), (4, 4096, 1024, 8, "kernel"),
               (4, 8192, 1024, 16, "kernel")]
NAIVE_BYTES_LIMIT = 90e9  # the naive layer's whole-[T, K] tensors, before we skip it


def indexer_inputs(T, S, gen):
    q_idx = (torch.randn(1, T, HI, DI, generator=gen, device="cuda") / 4).bfloat16()
    k_idx = (torch.randn(1, S, DI, generator=gen, device="cuda") / 4).bfloat16()
    w = (torch.randn(1, T, HI, generator=gen, device="cuda") / 4).bfloat16()
    return q_idx, k_idx, w


def readable_pairs(T, S):
    return sum(S - T + t + 1 for t in range(T))


@contextlib.contextmanager
def selection_form(**settings):
    """triton_indexer's selection settings (SELECT_THRESHOLD, SELECT_BLOCK_MIN_KEYS, RADIX_*, ...)
    for a block."""
    saved = {n: getattr(triton_indexer, n) for n in settings}
    for n, v in settings.items():
        setattr(triton_indexer, n, v)
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(triton_indexer, n, v)


def bench_indexer(key, args, rows, log):
    _, T, S, *_ = JOBS[key]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_idx, k_idx, w = indexer_inputs(T, S, gen)
    pos = torch.arange(S - T, S, device="cuda")
    flops = 2 * HI * DI * readable_pairs(T, S)

    def ours():
        return sa.lightning_indexer_topk(q_idx, k_idx, w, K, q_positions=pos)

    def ours_fp8():  # rotation and quantization included, as the layer runs it
        return sa.lightning_indexer_topk(q_idx, k_idx, w, K, q_positions=pos, fp8=True)

    block = 256 if S <= 131072 else 32  # the reference's [block, HI, S] fp32 logits: 8.6 GB

    def naive():
        return reference.indexer_topk(q_idx, k_idx, w, K, block_size=block, q_positions=pos)

    row = {"name": "lightning indexer + top-2048", "shape": f"B1-T{T}-S{S}-HI{HI}-DI{DI}-K{K}",
           "anchor": f"reference: einsum, relu, head sum, mask, stable sort ({block} queries at a time)"}
    ms, peak, reps, first = measure(ours)
    row.update(ours_ms=round(ms, 3), ours_peak_mem_bytes=peak, tflops=round(flops / ms / 1e9, 1))
    log(f"ours {ms:.3f} ms peak {peak / 2**30:.2f} GiB (first {first:.0f} ms)")
    got = ours()
    # A/B in this process: each selection form (FORMS), by the runs' maxima where it takes them and
    # over whole rows, against the default's selection
    time_forms(ours, got, S, "", row, log)
    if args.fp8:
        ms8, peak8, _, first8 = measure(ours_fp8)
        got8 = ours_fp8()
        row.update(fp8_ms=round(ms8, 3), fp8_peak_mem_bytes=peak8, fp8_speedup=round(ms / ms8, 3),
                   fp8_recall_vs_bf16=round(_recall(got8.long(), got.long()), 6))
        log(f"fp8 {ms8:.3f} ms peak {peak8 / 2**30:.2f} GiB (first {first8:.0f} ms), "
            f"{ms / ms8:.3f}x bf16, recall of bf16's selection {row['fp8_recall_vs_bf16']}")
        del got8
    # the scoring kernel alone and the selection alone over the same chunk, to split the time
    lo, hi = triton_indexer.read_ranges(1, T, S, True, None, pos, "cuda")
    keys = torch.empty((1, T, S), dtype=torch.int32, device="cuda") if T * S * 4 <= 40e9 else None
    if keys is not None:
        # from the fewest keys any form selects by runs at, the kernel also writes the runs' maxima
        runs = S >= min(settings[key] for settings, key, _ in FORMS.values())
        SB = triton_indexer.SELECT_BLOCK if runs else 0
        bmax = torch.empty((1, T, triton.cdiv(S, SB) if runs else 0), dtype=torch.int32, device="cuda")

        def score(c, fp8=None):  # fp8: (q8, k8, w8, k_scale) from indexer_fp8_inputs
            grid = (triton.cdiv(S, c["BS"]), triton.cdiv(T, c["BQ"]), 1)
            q, k, ww, ks = fp8 if fp8 is not None else (q_idx, k_idx, w, w)
            triton_indexer._score_keys_kernel[grid](
                q, k, ww, ks, lo, hi, keys, bmax, *q.stride()[:3], *k.stride()[:2],
                *ww.stride()[:2], ks.stride(0), *keys.stride()[:2], *bmax.stride()[:2], 0, T, S, HI=HI, DI=DI,
                DIP=DI, BQ=c["BQ"], BS=c["BS"], HAS_KS=fp8 is not None, SB=SB,
                num_warps=c["num_warps"], num_stages=c["num_stages"])

        inputs8 = sa.indexer_fp8_inputs(q_idx, k_idx, w) if args.fp8 else None
        if args.fp8:
            ms_s8, _, _, _ = measure(lambda: score(triton_indexer.CONFIG_FP8, inputs8))
            row.update(fp8_scoring_ms=round(ms_s8, 3), fp8_scoring_tflops=round(flops / ms_s8 / 1e9, 1))
            log(f"fp8 scoring {ms_s8:.3f} ms ({flops / ms_s8 / 1e9:.0f} TFLOP/s)")
        ms_s, _, _, _ = measure(lambda: score(triton_indexer.CONFIG))  # (leaves the keys filled)

        def select():  # as lightning_indexer_topk would select these keys
            return triton_indexer._select(keys, K, None, bmax if triton_indexer._takes_runs(S) else None)

        ms_k, _, _, _ = measure(select)
        want = select()
        time_forms(select, want, S, "selection_", row, log)  # the selection alone
        del want
        if args.radix_sweep:  # the whole-row selection of the chunk's keys, per radix config
            flat = keys.view(T, S)
            with selection_form(SELECT_THRESHOLD="topk"):
                want = triton_indexer._select_rows(flat, K)
                m, _, _, _ = measure(lambda: triton_indexer._select_rows(flat, K))
                mt, _, _, _ = measure(lambda: triton_indexer._thresholds(flat, K))
            sweep = [{"threshold": "topk", "select_rows_ms": round(m, 3), "thresholds_ms": round(mt, 3)}]
            log(f"radix sweep {sweep[-1]}")
            for bits, block, cblock, warps, order in RADIX_SWEEP:
                with selection_form(SELECT_THRESHOLD="radix", RADIX_BITS=bits, RADIX_BLOCK=block, RADIX_CBLOCK=cblock,
                                    RADIX_WARPS=warps, SELECT_SORT=order):
                    same = torch.equal(triton_indexer._select_rows(flat, K), want)
                    m, _, _, _ = measure(lambda: triton_indexer._select_rows(flat, K))
                    mt, _, _, _ = measure(lambda: triton_indexer._thresholds(flat, K))
                sweep.append({"bits": bits, "block": block, "cblock": cblock, "warps": warps, "sort": order,
                              "select_rows_ms": round(m, 3), "thresholds_ms": round(mt, 3), "equal": same})
                log(f"radix sweep {sweep[-1]}")
            del want
            row["radix_sweep"] = sweep
        fp = torch.randn(1, T, S, device="cuda")
        ms_f, _, _, _ = measure(lambda: fp.topk(K, dim=-1))
        del fp
        row.update(scoring_ms=round(ms_s, 3), scoring_tflops=round(flops / ms_s / 1e9, 1),
                   selection_ms=round(ms_k, 3), topk_fp32_ms=round(ms_f, 3))
        log(f"scoring {ms_s:.3f} ms ({flops / ms_s / 1e9:.0f} TFLOP/s), selection {ms_k:.3f} ms, "
            f"torch.topk fp32 {ms_f:.3f} ms")
        if args.sweep:
            sweep = []
            for c in SWEEP:
                for name, fp8 in (("scoring_ms", None), ("fp8_scoring_ms", inputs8)):
                    if name.startswith("fp8") and fp8 is None:
                        continue
                    try:
                        m, _, _, _ = measure(lambda c=c, fp8=fp8: score(c, fp8))
                        sweep.append({**c, name: round(m, 3)})
                    except Exception as err:  # noqa: BLE001 - a config that fails is recorded
                        sweep.append({**c, name: None, "error": f"{type(err).__name__}: {str(err)[:100]}"})
                    log(f"sweep {sweep[-1]}")
            row["sweep"] = sweep
        del keys, inputs8
    torch.cuda.empty_cache()
    try:
        ms, peak, reps, _ = measure(naive, budget_ms=500)
        row.update(anchor_ms=round(ms, 3), anchor_peak_mem_bytes=peak, speedup=round(ms / row["ours_ms"], 3))
        want = naive()
        row["equal_to_reference"] = bool(torch.equal(got.long(), want))
        row["recall_vs_reference"] = round(_recall(got.long(), want), 6)
        log(f"naive {ms:.3f} ms peak {peak / 2**30:.2f} GiB, recall {row['recall_vs_reference']}")
    except torch.cuda.OutOfMemoryError as err:
        row["notes_anchor"] = f"reference OOM: {str(err)[:120]}"
    row["notes"] = ("median of CUDA events; queries are the last T of S keys; recall = share of the "
                    "reference's selected keys that ours selects (bf16 inputs: the two sum the heads "
                    "in another order, so near-equal scores can swap at the k-th place)")
    rows.append(row)


def _recall(got, want):
    hits, total = 0, 0
    for t0 in range(0, got.shape[1], 1024):
        g, w_ = got[:, t0:t0 + 1024], want[:, t0:t0 + 1024]
        sg = torch.sort(g, -1).values
        pos = torch.searchsorted(sg.contiguous(), w_.contiguous()).clamp(max=sg.shape[-1] - 1)
        hit = (sg.gather(-1, pos) == w_) & (w_ >= 0)
        hits += hit.sum().item()
        total += (w_ >= 0).sum().item()
    return hits / max(total, 1)


def sparse_tflops(T, S, H, D, DV, ms):
    """The sparse attention's fwd+bwd TFLOP/s by issue 4's count, 2 h k (d_qk + d_v) forward and
    2 h k (3 d_qk + 2 d_v) backward per query, k = the query's selected keys min(K, its keys)."""
    keys = sum(min(K, S - T + t + 1) for t in range(T))
    return round(2 * H * keys * (4 * D + 3 * DV) / ms / 1e9, 1)


def bench_layer(key, args, rows, log):
    _, T, S, H, G, D, DV = JOBS[key]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shared = G == 1 and D > DV
    q = torch.randn(1, T, H, D, generator=gen, device="cuda").bfloat16().requires_grad_()
    k = torch.randn(1, S, G, D, generator=gen, device="cuda").bfloat16().requires_grad_()
    v = None if shared else torch.randn(1, S, G, DV, generator=gen, device="cuda").bfloat16().requires_grad_()
    q_idx, k_idx, w = (x.requires_grad_() for x in indexer_inputs(T, S, gen))
    pos = torch.arange(S - T, S, device="cuda")
    leaves = [x for x in (q, k, v, q_idx, k_idx, w) if x is not None]
    do = torch.randn(1, T, H, DV, generator=gen, device="cuda").bfloat16()
    scale = D**-0.5

    def attn_inputs():
        return (k, k[..., :DV]) if shared else (k, v)

    def ours():
        idx = sa.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), K, q_positions=pos, fp8=args.fp8)
        kk, vv = attn_inputs()
        # as the layers do: the KL target from the attention's own probabilities where it can
        o, lse, target = sa.sparse_attention_with_target(q, kk, vv, idx, backend="triton")
        loss, _ = sa.chunked_indexer_kl_loss(q, kk, q_idx, k_idx, w, idx, lse=lse.detach(), target=target)
        return o, loss

    def naive():
        idx = reference.indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), K, q_positions=pos)
        kk, vv = attn_inputs()
        o = naive_chain(q, kk, vv, idx, scale)
        target = reference.attention_probs_target(q.detach(), kk.detach(), idx)
        scores = reference.lightning_indexer_sparse(q_idx, k_idx, w, idx)
        return o, reference.indexer_kl_loss(scores, target, idx)

    def step(run):
        def fn():
            o, loss = run()
            torch.autograd.grad((o.float() * do).sum() + loss, leaves)
        return fn

    shape = (f"MLA-B1-T{T}-S{S}-H{H}-D{D}-DV{DV}" if shared else f"GQA-B1-T{T}-H{H}-G{G}-D{D}") + f"-K{K}-HI{HI}-DI{DI}"
    shape += "-fp8-indexer" if args.fp8 else ""
    row = {"name": "sparse layer attention part fwd+bwd (indexer + top-k + sparse attention + KL loss)",
           "shape": shape, "anchor": "naive: reference indexer top-k + gather chain + reference KL loss"}
    ms, peak, reps, first = measure(step(ours), budget_ms=3000)
    row.update(ours_ms=round(ms, 2), ours_peak_mem_bytes=peak)
    log(f"ours {ms:.1f} ms peak {peak / 2**30:.2f} GiB (first {first:.0f} ms)")
    # the parts of ours, one at a time
    idx = sa.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), K, q_positions=pos, fp8=args.fp8)
    kk, vv = attn_inputs()
    with torch.no_grad():
        _, lse, target = sa.sparse_attention_with_target(q, kk, vv, idx, backend="triton")
    parts = {}
    parts["indexer_topk"] = measure(lambda: sa.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), K, q_positions=pos,
                                                                       fp8=args.fp8))[0]

    def attn():  # with the KL target (made in the forward, or after it from the lse)
        o, _, _ = sa.sparse_attention_with_target(q, kk, vv, idx, backend="triton")
        torch.autograd.grad(o, [x for x in (q, k, v) if x is not None], do)

    def kl():
        loss, _ = sa.chunked_indexer_kl_loss(q, kk, q_idx, k_idx, w, idx, lse=lse, target=target)
        torch.autograd.grad(loss, (q_idx, k_idx, w))

    parts["sparse_attention_fwd_bwd"] = measure(attn)[0]
    parts["kl_loss_fwd_bwd"] = measure(kl)[0]
    row["ours_parts_ms"] = {n: round(m, 2) for n, m in parts.items()}
    row["sparse_attention_tflops"] = sparse_tflops(T, S, H, D, DV, parts["sparse_attention_fwd_bwd"])
    log(f"parts {row['ours_parts_ms']}")
    torch.cuda.empty_cache()
    notes = ["median of CUDA events; queries are the last T of S keys"]
    naive_bytes = T * K * (H + HI) * 4 * 3 + T * K * (G * D + DI) * 2 * 2
    if naive_bytes > NAIVE_BYTES_LIMIT:
        notes.append(f"naive skipped: its whole [T, K] tensors alone would take about {naive_bytes / 1e9:.0f} GB")
    else:
        try:
            ms, peak, _, _ = measure(step(naive), budget_ms=1500)
            row.update(anchor_ms=round(ms, 2), anchor_peak_mem_bytes=peak, speedup=round(ms / row["ours_ms"], 3))
            log(f"naive {ms:.1f} ms peak {peak / 2**30:.2f} GiB")
        except torch.cuda.OutOfMemoryError as err:
            notes.append(f"naive OOM: {str(err)[:100]}")
    torch.cuda.empty_cache()
    if time.time() - args.start > args.budget_s:
        notes.append("dense SDPA skipped: the run's time budget was spent")
    else:
        try:
            R = H // G
            qs = q.detach().transpose(1, 2).contiguous().requires_grad_()
            ks = k.detach().transpose(1, 2).repeat_interleave(R, dim=1)
            vs = (ks[..., :DV] if shared else v.detach().transpose(1, 2).repeat_interleave(R, dim=1)).contiguous()
            ks = ks.contiguous().requires_grad_()
            vs.requires_grad_()
            # Heads in groups small enough for the kernels' 32-bit offsets (MLA at 128k has
            # 128 x 131072 x 576 key elements): the same work, one call per group.
            n = max(1, math.ceil(H * S * D / 2**30))
            hg = math.ceil(H / n)
            run, backend = sdpa_runner(qs[:, :hg], ks[:, :hg], vs[:, :hg], T, S)
            dos = do.transpose(1, 2).contiguous()

            def dense():
                for h0 in range(0, H, hg):
                    part = (qs[:, h0:h0 + hg], ks[:, h0:h0 + hg], vs[:, h0:h0 + hg])
                    o = run(*part)
                    torch.autograd.grad(o, (qs, ks, vs), dos[:, h0:h0 + hg])

            ms, peak, _, _ = measure(dense, budget_ms=1500)
            row.update(sdpa=f"torch SDPA {backend}, causal, kv heads repeated, no indexer, {-(-H // hg)} call(s) of {hg} heads",
                       sdpa_ms=round(ms, 2), sdpa_peak_mem_bytes=peak, sdpa_speedup=round(ms / row["ours_ms"], 3))
            log(f"sdpa {backend} {ms:.1f} ms peak {peak / 2**30:.2f} GiB")
            del qs, ks, vs, dos
        except (RuntimeError, torch.cuda.OutOfMemoryError) as err:
            notes.append(f"dense SDPA failed: {type(err).__name__}: {str(err)[:120]}")
    row["target_speedup"] = 5.0 if S >= 131072 else None
    row["notes"] = "; ".join(notes)
    rows.append(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="idx8k,idx32k,idx128k,idx1m,mla8k,mla32k,mla128k,gqa32k,gqa128k")
    parser.add_argument("--budget-s", type=float, default=math.inf)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fp8", action="store_true",
                        help="idx jobs: also time fp8 scoring (fp8=True) and its recall of the bf16 selection; "
                             "layer jobs: ours selects by fp8 scores (sparse_attention.indexer_fp8)")
    parser.add_argument("--radix-sweep", action="store_true",
                        help="idx jobs: also time the selection's thresholds at RADIX_SWEEP's radix configs")
    parser.add_argument("--out", default="benchmarks/results/h200/sparse_layer.json")
    args = parser.parse_args()
    args.start = time.time()
    rows = []
    for key in args.jobs.split(","):
        def log(msg, key=key):
            print(f"[{time.time() - args.start:5.0f}s] {key} {msg}", flush=True)
        try:
            (bench_indexer if JOBS[key][0] == "indexer" else bench_layer)(key, args, rows, log)
        except Exception:  # noqa: BLE001 - keep the other jobs' rows
            traceback.print_exc()
            rows.append({"name": key, "ours_ms": None, "notes": f"failed: {traceback.format_exc(limit=2)[-400:]}"})
        write_results(args.out, rows)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
