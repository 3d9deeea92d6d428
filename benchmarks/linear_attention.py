"""Chunked Gated DeltaNet and simple GLA (issue 3): our Triton kernels against fla 0.6.0, one H200.

    python benchmarks/linear_attention.py [--shapes qwen,h32,...|all] [--ops gdn,gla] [--skip-fla]
        [--fla-budget-s 240] [--breakdown] [--out benchmarks/results/h200/linear_attention.json]

bf16 q, k (L2-normalised beforehand), v, beta; fp32 g (log decay, as the layer makes it);
no initial state, no final state. Rows per shape and op: forward, backward (autograd of a
retained graph) and forward+backward, each the median of triton.testing.do_bench (warm, L2
flushed between calls), ours and fla's in the same process; the forward+backward rows also
hold both timed as one CUDA graph replayed (ours_graph_ms, anchor_graph_ms, graph_speedup):
where the kernels are short (TP=8) eager do_bench times the host's launches, the graph the
device alone (benchmarks/device/probe_host.py). Peak memory is the allocator's peak
above the inputs over one forward+backward. tflops counts algorithmic FLOPs per token and head
(D head dim, C = 64): GDN fwd+bwd 22D^2 + 36CD + 5C^2 (issue 3), fwd 6D^2 + 10CD; simple GLA
fwd+bwd 14D^2 + 14CD, fwd 4D^2 + 4CD; bwd is their difference.

fla's gated backward (chunk_bwd_dqkwg, used by both ops) refuses Triton 3.4-3.7.0 on Hopper (its issue #640, a miscompilation); the
guard is lifted here (fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True) for timing only, so its
gradients are unverified on this Triton; each row records how far ours are from fla's
(rel_rms_vs_fla) without trusting either. fla compiles and autotunes 30-170 s per op and head
count on first use: --fla-budget-s stops starting fla on new shapes after that many seconds
(those rows keep anchor_ms null and say why). --breakdown times our kernels one by one on the
first shape and prints each kernel's registers and spills. --merge and --fla-deadline let
several invocations (ordered by priority) share one results file and one fla time budget.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from common import cuda_graph, write_results

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe_hybrid.ops import linear_attention as la
from megatron_moe_hybrid.ops.linear_attention import triton_chunk as tc
from megatron_moe_hybrid.ops._launch import FastKernel

C = 64
SHAPES = {  # name -> (B, T, H qk heads, HV v heads, D, packed lengths or None)
    "qwen": ("B1-T32768-HQK16-HV32-D128", 1, 32768, 16, 32, 128, None),
    "h32": ("B1-T32768-H32-D128", 1, 32768, 32, 32, 128, None),
    "b4": ("B4-T8192-H16-D128", 4, 8192, 16, 16, 128, None),
    "h96": ("B1-T8192-H96-D128", 1, 8192, 96, 96, 128, None),
    "tp8": ("B1-T8192-HQK2-HV4-D128", 1, 8192, 2, 4, 128, None),
    "varlen": ("varlen-28672-4096-HQK16-HV32-D128", 1, 32768, 16, 32, 128, [28672, 4096]),
    "gla_t32k": ("B1-T32768-H16-D128", 1, 32768, 16, 16, 128, None),
    "gla_b4": ("B4-T8192-H16-D128", 4, 8192, 16, 16, 128, None),
}
OP_SHAPES = {  # issue 3's six shapes for both ops; simple GLA also at B1-T32768-H16
    "gdn": ["qwen", "h32", "b4", "h96", "tp8", "varlen"],
    "gla": ["gla_t32k", "gla_b4", "qwen", "h32", "h96", "tp8", "varlen"],
}
TARGET = {"gdn": 2.0, "gla": 1.5}  # fwd+bwd, issue 3
FLA_NOTE = (
    "fla's gated backward runs with its Triton-3.6 Hopper guard lifted "
    "(fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True, fla issue #640): timing only, its "
    "gradients are unverified on this Triton"
)


def flops_per_token_head(op: str, mode: str, D: int) -> float:
    if op == "gdn":
        total, fwd = 22 * D * D + 36 * C * D + 5 * C * C, 6 * D * D + 10 * C * D
    else:
        total, fwd = 14 * D * D + 14 * C * D, 4 * D * D + 4 * C * D
    return {"fwd": fwd, "bwd": total - fwd, "fwd+bwd": total}[mode]


def make_inputs(op, B, T, H, HV, D, lengths, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    x = {
        "q": F.normalize(randn(B, T, H, D), dim=-1).bfloat16(),
        "k": F.normalize(randn(B, T, H, D), dim=-1).bfloat16(),
        "v": randn(B, T, HV, D).bfloat16(),
        "g": F.logsigmoid(randn(B, T, HV) + 3),
    }
    if op == "gdn":
        x["beta"] = torch.rand(B, T, HV, generator=gen, device="cuda").bfloat16()
    for t in x.values():
        t.requires_grad_()
    cu = None
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int64)
    return x, cu


def case(op, key):
    """(shape name, inputs x, cu_seqlens, output gradient do) of SHAPES[key] for op: what the
    device probes time."""
    name, B, T, H, HV, D, lengths = SHAPES[key]
    x, cu = make_inputs(op, B, T, H, HV, D, lengths)
    return name, x, cu, torch.randn(B, T, HV, D, device="cuda").bfloat16()


def ours_fn(op, cu):
    if op == "gdn":
        return lambda x: la.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, backend="triton")[0]
    return lambda x: la.chunk_simple_gla(x["q"], x["k"], x["v"], g=x["g"], cu_seqlens=cu, backend="triton")[0]


def fla_fn(op, cu):
    import fla.ops.common.chunk_o as fla_chunk_o

    fla_chunk_o.TRITON_ABOVE_3_7_1 = True
    if op == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return lambda x: chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu)[0]
    from fla.ops.simple_gla import chunk_simple_gla

    return lambda x: chunk_simple_gla(x["q"], x["k"], x["v"], g=x["g"], cu_seqlens=cu)[0]


def fla_inputs(op, x):
    """fla's inputs for ours x, and a function taking fla's gradients to ours. fla's simple GLA
    takes one head count for q, k and v, so with grouped value heads q and k go in repeated to
    the value heads (done here, outside the timed calls: fla's own time), and the gradients of
    each group's copies are summed back."""
    H, HV = x["q"].shape[2], x["v"].shape[2]
    if op == "gdn" or H == HV:
        return x, lambda grads: grads
    r = HV // H
    expanded = {n: (t.detach().repeat_interleave(r, 2) if n in "qk" else t.detach()).requires_grad_()
                for n, t in x.items()}

    def back(grads):
        return [g.unflatten(2, (H, r)).sum(3) if n in "qk" else g for n, g in zip(x, grads)]

    return expanded, back


def measure(fn, x, do):
    """{mode: median ms}, peak bytes over one fwd+bwd above the inputs, (o, grads) of one call."""
    inputs = list(x.values())
    torch.cuda.synchronize()
    o = fn(x)  # first call compiles and autotunes
    grads = torch.autograd.grad(o, inputs, do)
    torch.cuda.synchronize()
    del o
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = fn(x)
    torch.autograd.grad(o, inputs, do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    o_keep = o.detach()
    del o

    def fwd():
        with torch.no_grad():
            fn(x)

    def fwd_bwd():
        torch.autograd.grad(fn(x), inputs, do)

    graph = [fn(x)]  # one forward whose graph every timed backward reuses

    def bwd():
        torch.autograd.grad(graph[0], inputs, do, retain_graph=True)

    ms = {
        mode: triton.testing.do_bench(f, warmup=50, rep=300, return_mode="median")
        for mode, f in (("fwd", fwd), ("bwd", bwd), ("fwd+bwd", fwd_bwd))
    }
    graph.clear()
    ms["fwd+bwd graph"] = graph_ms(fwd_bwd)
    return ms, peak, (o_keep, grads)


def graph_ms(f):
    """do_bench median (L2 flushed) of f captured once in a CUDA graph and replayed: the device's
    time alone. Where the kernels are short (the TP=8 shape), do_bench's eager calls time the
    host's launches instead (benchmarks/device/probe_host.py). A str (the error) where f does
    not capture."""
    try:
        g = cuda_graph(f)
        torch.cuda.synchronize()
        return triton.testing.do_bench(g.replay, warmup=20, rep=200, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def rel_rms(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def measure_in_turn(fn, x, do, labels, apply, rounds):
    """A/B probes: apply(label) then measure, label after label, rounds times in one process.
    ({label: {mode: median ms over the rounds}}, {label: peak bytes}, {label: (o, grads)});
    the caller restores what apply changed."""
    runs, peak, out = {label: [] for label in labels}, {}, {}
    for _ in range(rounds):
        for label in labels:
            apply(label)
            m, peak[label], out[label] = measure(fn, x, do)
            runs[label].append(m)
    def median(values):  # a str (graph capture's error) stays as it is
        values = list(values)
        return next((v for v in values if isinstance(v, str)), None) or round(statistics.median(values), 4)

    med = {label: {mode: median(r[mode] for r in runs[label]) for mode in runs[label][0]} for label in labels}
    return med, peak, out


AB_SUMMARY = ("name", "shape", "ours_ms", "anchor_ms", "speedup", "bwd_ms", "anchor_bwd_ms", "graph_ms",
              "anchor_graph_ms", "ours_peak_mem_bytes", "anchor_peak_mem_bytes", "rel_rms_vs_anchor")


def print_ab_row(row):
    """One line of an A/B row's figures (AB_SUMMARY), as the probes print them while they run."""
    print(json.dumps({k: row[k] for k in AB_SUMMARY}), flush=True)


def ab_row(name, shape, x, med, peak, out, new, old, anchor, notes, **extra):
    """A results row of an A/B probe: form new (ours_*) against form old (anchor_*), fwd+bwd
    with fwd and bwd beside it, and rel_rms_vs_anchor of the output and every gradient."""
    (o1, g1), (o0, g0) = out[new], out[old]
    err = {"o": rel_rms(o1, o0), **{f"d{n}": rel_rms(a1, a0) for n, a1, a0 in zip(x, g1, g0)}}
    return {
        "name": name, "shape": shape + "-bf16",
        "ours_ms": med[new]["fwd+bwd"], "anchor": anchor, "anchor_ms": med[old]["fwd+bwd"],
        "speedup": round(med[old]["fwd+bwd"] / med[new]["fwd+bwd"], 3), "target_speedup": None,
        "ours_peak_mem_bytes": peak[new], "anchor_peak_mem_bytes": peak[old],
        "fwd_ms": med[new]["fwd"], "bwd_ms": med[new]["bwd"],
        "anchor_fwd_ms": med[old]["fwd"], "anchor_bwd_ms": med[old]["bwd"],
        "graph_ms": med[new]["fwd+bwd graph"], "anchor_graph_ms": med[old]["fwd+bwd graph"],
        **extra,
        "rel_rms_vs_anchor": {n: float(f"{e:.1e}") for n, e in err.items()},
        "notes": notes + ", medians of benchmarks/linear_attention.py's measure (do_bench medians)",
    }


def fast_kernels() -> dict:
    """triton_chunk's kernels (each launched through ops/_launch.py's FastKernel), by name."""
    return {n: getattr(tc, n) for n in sorted(dir(tc)) if isinstance(getattr(tc, n), FastKernel)}


def resources(compiled) -> str:
    """A compiled kernel's launch options, registers and spills per thread, and shared memory."""
    md = compiled.metadata
    return (f"warps {md.num_warps} stages {md.num_stages} regs {compiled.n_regs} spills {compiled.n_spills} "
            f"shared {md.shared}")


def kernel_resources():
    """Registers, spills, warps and shared memory of each compiled variant of our kernels."""
    lines = []
    for kern in fast_kernels().values():
        jit = kern.fn
        try:
            caches = jit.device_caches
            for dev_cache in caches.values():
                for compiled in dev_cache[0].values():
                    lines.append(f"{jit.__name__}: {resources(compiled)}")
        except (AttributeError, KeyError, TypeError, IndexError) as exc:  # differs between Triton versions
            lines.append(f"{jit.__name__}: no resource report ({type(exc).__name__}: {exc})")
        best = getattr(kern, "best_config", None)
        if best is not None:
            lines.append(f"{jit.__name__}: best config {best}")
    return lines


def breakdown(op, x, cu, do):
    """{(kernel, (BV, num_warps)): ms} of each of our kernels on these inputs, called the way
    _fwd/_bwd call them without the sequence split (device/probe_split.py times that), under a
    few launch configs (triton_chunk.CONFIGS holds the defaults)."""
    q, k, v, g = (x[n].detach() for n in ("q", "k", "v", "g"))
    beta = x["beta"].detach() if op == "gdn" else None
    scale = q.shape[-1] ** -0.5
    chunks = tc._Chunks(q.shape[0], q.shape[1], cu)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BK, _ = tc._blocks(K, V)
    gdn = beta is not None
    varlen = chunks.indices is not None
    gam, P, A, w, u = tc._prep(q, k, v, g, beta, scale, chunks, store_A=True)
    o = torch.empty_like(v)
    h = torch.empty(chunks.NT, HV, K, V, dtype=q.dtype, device=q.device)
    U = torch.empty_like(v) if gdn else None
    dh, dU = torch.empty_like(h), torch.empty_like(v)
    dq = torch.empty(B, T, HV, K, dtype=q.dtype, device=q.device)
    dk, dv = torch.empty_like(dq), torch.empty_like(v)
    dg = torch.empty(B, T, HV, dtype=torch.float32, device=q.device)
    db = torch.empty_like(dg) if gdn else None
    common = {"H": H, "HV": HV, "K": K, "V": V, "BT": C, "BK": BK, "IS_VARLEN": varlen}
    saved = dict(tc.CONFIGS)

    def prep(store_A, read_A=False):
        def run(bv, nw):
            tc.CONFIGS["prep"] = (None, nw)
            tc._prep(q, k, v, g, beta, scale, chunks, store_A=store_A, A=A if read_A else None)
        return run

    def rec_fwd(store_o):
        def run(bv, nw):
            tc._recurrence_fwd_kernel[(triton.cdiv(V, bv), chunks.N * HV)](
                q, k, w, u if gdn else v, gam, P, o if store_o else None, None, None,
                None if store_o else h, None if store_o else U, None, chunks.cu_seqlens, chunks.offsets,
                scale, T, BV=bv, IS_GDN=gdn, STORE_O=store_o, STORE_H=not store_o, USE_H0=False,
                STORE_HT=False, num_warps=nw, **common)
        return run

    def rec_bwd(bv, nw):  # simple GLA's sweep forms no dU (the chunk kernel forms dv from dh)
        tc._recurrence_bwd_kernel[(triton.cdiv(V, bv), chunks.N * HV)](
            q, k, w, gam, P, do, dU if gdn else None, dh, None, None, chunks.cu_seqlens, chunks.offsets, scale, T,
            BV=bv, IS_GDN=gdn, USE_DHT=False, USE_DH0=False, STORE_DU=gdn, num_warps=nw, **common)

    def chunk_bwd(bv, nw):
        tc._chunk_bwd(chunks, q, k, v, gam, beta, A, h, dh, U, dU if gdn else None, do, dq, dk, dv, dg, db, scale,
                      config=(bv, nw), P=P)

    seq = [(16, 4), (32, 4), (64, 4), (32, 8)]
    stages = [  # in order: each stage fills what the next reads
        ("prep fwd (no grad: no A kept)", prep(False), [(None, 4), (None, 8)]),
        ("recurrence fwd + o", rec_fwd(True), seq),
        ("prep fwd storing A / bwd before A was kept", prep(True), [(None, 4), (None, 8)]),
        ("prep bwd reading the forward's A", prep(True, read_A=True), [(None, 4), (None, 8)]),
        ("recurrence fwd, store h", rec_fwd(False), seq),
        ("recurrence bwd", rec_bwd, seq),
        ("chunk bwd", chunk_bwd, [(32, 4), (32, 8), (64, 8), (16, 4)]),
    ]
    times = {}
    try:
        for name, fn, configs in stages:
            for bv, nw in configs:
                times[(name, (bv, nw))] = triton.testing.do_bench(
                    lambda fn=fn, bv=bv, nw=nw: fn(bv, nw), warmup=20, rep=100, return_mode="median"
                )
    finally:
        tc.CONFIGS.update(saved)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="all", help="comma-separated keys of SHAPES, or all")
    parser.add_argument("--ops", default="gdn,gla")
    parser.add_argument("--skip-fla", action="store_true")
    parser.add_argument("--fla-budget-s", type=float, default=math.inf)
    parser.add_argument("--fla-deadline", type=float, default=math.inf,
                        help="epoch seconds after which fla starts on no new shape (for several invocations)")
    parser.add_argument("--merge", action="store_true",
                        help="keep --out's rows of other (name, shape) pairs (for several invocations)")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--gla-prep-again", action="store_true",
                        help="simple GLA's backward runs its prep kernel again rather than taking the forward's "
                             "gam and P (triton_chunk.GLA_KEEP_P False)")
    parser.add_argument("--out", default="benchmarks/results/h200/linear_attention.json")
    args = parser.parse_args()
    if args.gla_prep_again:
        tc.GLA_KEEP_P = False
    wanted = None if args.shapes == "all" else set(args.shapes.split(","))
    versions = ("fla-core",)
    rows, start, did_breakdown = [], time.time(), False
    kept = []
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            kept = json.load(f)["rows"]
    for op in args.ops.split(","):
        for key in OP_SHAPES[op]:
            if wanted is not None and key not in wanted:
                continue
            shape, B, T, H, HV, D, lengths = SHAPES[key]
            x, cu = make_inputs(op, B, T, H, HV, D, lengths)
            do = torch.randn(B, T, HV, D, device="cuda").bfloat16()
            t0 = time.time()
            ours_ms, ours_peak, (o_ours, g_ours) = measure(ours_fn(op, cu), x, do)
            print(f"[{time.time() - start:.0f}s] {op} {shape} ours {ours_ms} ({time.time() - t0:.0f}s)", flush=True)
            fla_ms = fla_peak = None
            note = FLA_NOTE  # simple GLA's backward goes through the same guarded chunk_bwd_dqkwg
            errs = {}
            if args.skip_fla:
                note = "fla not run (--skip-fla)"
            elif time.time() - start > args.fla_budget_s or time.time() > args.fla_deadline:
                note = ("fla not run: the device time for its first-call compile and autotune "
                        "(30-170 s per op and head count) was spent")
            else:
                try:
                    t0 = time.time()
                    x_fla, back = fla_inputs(op, x)
                    if x_fla is not x:
                        note += ("; fla's simple GLA takes no grouped value heads: its q and k go in repeated to "
                                 f"the {HV} value heads (outside the timed calls), its gradients summed back for rel_rms")
                    fla_ms, fla_peak, (o_fla, g_fla) = measure(fla_fn(op, cu), x_fla, do)
                    g_fla = back(g_fla)
                    del x_fla
                    errs = {"o": rel_rms(o_ours, o_fla)}
                    errs.update({f"d{n}": rel_rms(a, b) for n, a, b in zip(x, g_ours, g_fla)})
                    print(f"[{time.time() - start:.0f}s] {op} {shape} fla {fla_ms} ({time.time() - t0:.0f}s)", flush=True)
                except Exception as exc:  # noqa: BLE001 - any fla failure becomes the row's note
                    traceback.print_exc()
                    note = f"fla failed: {type(exc).__name__}: {str(exc)[:200]}"
            tokens_heads = B * T * HV
            for mode in ("fwd", "bwd", "fwd+bwd"):
                flop = flops_per_token_head(op, mode, D) * tokens_heads
                row = {
                    "name": f"{op} {mode}", "shape": shape,
                    "ours_ms": round(ours_ms[mode], 4), "anchor": "fla 0.6.0",
                    "anchor_ms": None if fla_ms is None else round(fla_ms[mode], 4),
                    "speedup": None if fla_ms is None else round(fla_ms[mode] / ours_ms[mode], 3),
                    "target_speedup": TARGET[op] if mode == "fwd+bwd" else None,
                    "ours_peak_mem_bytes": ours_peak if mode == "fwd+bwd" else None,
                    "anchor_peak_mem_bytes": fla_peak if mode == "fwd+bwd" else None,
                    "tflops": round(flop / ours_ms[mode] / 1e9, 1),
                    "anchor_tflops": None if fla_ms is None else round(flop / fla_ms[mode] / 1e9, 1),
                    "notes": f"median of do_bench (warm, L2 flushed), bf16, backend='triton'; {note}"
                             + (f"; ours with GLA_KEEP_P {tc.GLA_KEEP_P} (True: the backward from the forward's gam "
                                "and P)" if op == "gla" else f"; ours with GDN_KEEP_PREP {tc.GDN_KEEP_PREP}")
                             + f", KEEP_STATES {tc.KEEP_STATES[op]} (True: the backward from the forward's chunk states)"
                             + (f", GLA_LIGHT_SWEEPS {tc.GLA_LIGHT_SWEEPS!r} (the light sweeps at this shape: "
                                f"{tc._gla_light(tc._chunks_of(B, T, cu))})" if op == "gla" else "")
                             + (f", FUSE_GROUP_SUM {tc.FUSE_GROUP_SUM[op]} (grouped heads' dq, dk summed in the chunk "
                                f"kernel at this shape: {tc._fuse_group_sum(tc._chunks_of(B, T, cu), H, HV, op == 'gdn')})"
                                if HV != H else ""),
                }
                if mode == "fwd+bwd":
                    ours_g = ours_ms["fwd+bwd graph"]
                    fla_g = None if fla_ms is None else fla_ms["fwd+bwd graph"]
                    row["ours_graph_ms"] = round(ours_g, 4) if isinstance(ours_g, float) else ours_g
                    row["anchor_graph_ms"] = round(fla_g, 4) if isinstance(fla_g, float) else fla_g
                    if isinstance(ours_g, float) and isinstance(fla_g, float):
                        row["graph_speedup"] = round(fla_g / ours_g, 3)
                if errs and mode == "fwd+bwd":
                    row["rel_rms_vs_fla"] = {n: float(f"{e:.2e}") for n, e in errs.items()}
                rows.append(row)
                print(
                    f"{op:4s} {mode:8s} {shape:36s} ours {row['ours_ms']:8.3f} ms  fla {row['anchor_ms']}  "
                    f"speedup {row['speedup']}  tflops {row['tflops']}"
                    + (f"  graphs: ours {row['ours_graph_ms']} fla {row['anchor_graph_ms']} speedup "
                       f"{row.get('graph_speedup')}" if mode == "fwd+bwd" else ""), flush=True,
                )
            ours_keys = {(r["name"], r["shape"]) for r in rows}
            write_results(args.out, [r for r in kept if (r["name"], r["shape"]) not in ours_keys] + rows, versions)
            if args.breakdown and not did_breakdown:
                did_breakdown = True
                for (name, (bv, nw)), ms in breakdown(op, x, cu, do).items():
                    print(f"breakdown {op} {shape}: {name:26s} BV {bv} warps {nw}: {ms:8.3f} ms", flush=True)
                for line in kernel_resources():
                    print(line, flush=True)
            del x, do, o_ours, g_ours
            torch.cuda.empty_cache()
    print(f"wrote {args.out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
