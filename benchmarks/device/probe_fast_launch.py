"""Probe: host time of our Triton ops launched through ops/_launch.py's cached compiled kernels
against Triton's own path (_launch.ENABLED False), forward+backward at small shapes where the
host sets the pace. Both paths in one process, in turn, three rounds; per case and path:
  - host_us: time per call of calls issued back to back without a sync (probe_launch.per_call);
  - wall_us: the same calls with one sync at the end, per call;
  - launches: Triton launches per call (the cached kernels' hits on the fast path).

    python benchmarks/device/probe_fast_launch.py [--cases moe,sparse_gqa,sparse_mla,loss,gdn_norms] [--out DIR] [--cprofile]

Writes fast_launch.json (rows in DESIGN.md's format) to --out.
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common import write_results  # noqa: E402
from megatron_moe_hybrid.ops import _launch  # noqa: E402
from probe_launch import cprofile_top, per_call  # noqa: E402

MOE_TINY = {"hidden": 1024, "experts": 64, "topk": 8, "ffn": 512, "tokens": 2048}


def _fwd_bwd(forward, leaves, seed=0):
    out = forward()
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cot = [torch.randn(o.shape, generator=gen, device="cuda").to(o.dtype) for o in outs]

    def step():
        o = forward()
        torch.autograd.grad(o if isinstance(o, tuple) else (o,), leaves, cot)

    return step


def case_moe():
    import moe as bench_moe
    from megatron_moe_hybrid.layers.moe import MoELayer

    spec = MOE_TINY
    with torch.device("cuda"):
        layer = MoELayer(bench_moe.ours_config(spec, "static", 1), ep_group=None)
    layer.cuda()
    x = torch.randn(spec["tokens"], 1, spec["hidden"], device="cuda", dtype=torch.bfloat16).requires_grad_()
    leaves = [x, *[p for p in layer.parameters() if p.requires_grad]]
    shape = "T{tokens}-H{hidden}-E{experts}-K{topk}-F{ffn}-bf16".format(**spec)
    return "MoE layer (static dispatcher, Triton ops)", shape, _fwd_bwd(lambda: layer(x)[0], leaves)


def case_sparse(mla):
    from megatron_moe_hybrid.ops import sparse_attention as sa

    T, H, G, D, DV, K = (512, 128, 1, 576, 512, 512) if mla else (2048, 16, 4, 128, 128, 512)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, H, D, generator=gen, device="cuda").bfloat16().requires_grad_()
    k = torch.randn(1, T, G, D, generator=gen, device="cuda").bfloat16().requires_grad_()
    q_idx = torch.randn(1, T, 8, 64, generator=gen, device="cuda").bfloat16()
    k_idx = torch.randn(1, T, 64, generator=gen, device="cuda").bfloat16()
    w = torch.rand(1, T, 8, generator=gen, device="cuda").bfloat16()
    idx = sa.lightning_indexer_topk(q_idx, k_idx, w, K)
    shape = f"B1-T{T}-H{H}-G{G}-D{D}-DV{DV}-top{K}-bf16"
    name = "sparse attention, absorbed MLA (products form)" if mla else "sparse attention, GQA (kernels form)"
    return name, shape, _fwd_bwd(lambda: sa.sparse_attention(q, k, k[..., :DV], idx), [q, k])


def case_loss():
    from megatron_moe_hybrid.ops.cross_entropy import linear_cross_entropy

    N, D, V = 2048, 1024, 32768
    hidden = torch.randn(N, D, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(V, D, device="cuda") / D**0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda")
    return ("linear cross-entropy", f"N{N}-D{D}-V{V}-chunk512-bf16",
            _fwd_bwd(lambda: linear_cross_entropy(hidden, weight, labels, chunk_size=512), [hidden, weight]))


def case_gdn_norms():
    from megatron_moe_hybrid.ops.linear_attention.norms import gated_rms_norm, l2_normalize
    from megatron_moe_hybrid.ops.linear_attention.short_conv import causal_conv1d

    B, T, H, D = 1, 2048, 4, 128
    proj = torch.randn(B, T, 4 * H * D, device="cuda").bfloat16().requires_grad_()
    cw = (torch.randn(3 * H * D, 4, device="cuda") / 2).bfloat16().requires_grad_()
    nw = torch.ones(D, device="cuda").bfloat16().requires_grad_()

    def forward():
        c = causal_conv1d(proj[..., : 3 * H * D], cw)
        q, k, v = (c[..., i * H * D:(i + 1) * H * D].unflatten(-1, (H, D)) for i in range(3))
        z = proj[..., 3 * H * D:].unflatten(-1, (H, D))
        return l2_normalize(q, 1e-6), l2_normalize(k, 1e-6), gated_rms_norm(v, z, nw, 1e-6)

    return ("Gated DeltaNet layer's conv + q/k l2 norms + gated norm", f"B{B}-T{T}-H{H}-D{D}-bf16",
            _fwd_bwd(forward, [proj, cw, nw]))


CASES = {"moe": case_moe, "sparse_gqa": lambda: case_sparse(False), "sparse_mla": lambda: case_sparse(True),
         "loss": case_loss, "gdn_norms": case_gdn_norms}


def kernels():
    """Every cached-launch kernel of the package's modules loaded so far."""
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("megatron_moe_hybrid.") and m is not None]
    return list({id(k): k for m in mods for k in vars(m).values() if isinstance(k, _launch.FastKernel)}.values())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--cprofile", action="store_true",
                   help="also write cProfile's top functions (own time) per case, fast path, to cprofile_<case>.txt")
    args = p.parse_args()
    if "RANK" not in os.environ:
        import moe as bench_moe

        bench_moe.init_distributed()
    rows = []
    for key in args.cases.split(","):
        name, shape, step = CASES[key]()
        res = {True: [], False: []}
        for _ in range(3):
            for enabled in (False, True):
                _launch.ENABLED = enabled
                step()
                torch.cuda.synchronize()
                before = sum(k.hits for k in kernels())
                r = per_call(step, args.calls)
                r["cached_launches"] = (sum(k.hits for k in kernels()) - before) / (args.calls + 50)
                res[enabled].append(r)
        _launch.ENABLED = True
        if args.cprofile:
            with open(os.path.join(args.out, f"cprofile_{key}.txt"), "w") as fh:
                fh.write(cprofile_top(step, 100, f"{key} ({name}), forward+backward, cached launches"))
        med = {e: {m: statistics.median(r[m] for r in rs) for m in ("host_us", "wall_us", "cached_launches")}
               for e, rs in res.items()}
        row = {"name": f"{name}, fwd+bwd: host time, cached launches against Triton's path (A/B)",
               "shape": shape, "ours_ms": round(med[True]["wall_us"] / 1e3, 4),
               "anchor": "the same ops launched by Triton's JITFunction.run (_launch.ENABLED False)",
               "anchor_ms": round(med[False]["wall_us"] / 1e3, 4),
               "speedup": round(med[False]["wall_us"] / med[True]["wall_us"], 3),
               "host_ms": round(med[True]["host_us"] / 1e3, 4), "anchor_host_ms": round(med[False]["host_us"] / 1e3, 4),
               "cached_launches_per_call": round(med[True]["cached_launches"], 1),
               "rounds": {str(e): rs for e, rs in res.items()},
               "notes": f"probe_launch.per_call over {args.calls} calls (after 50 warm-up), 3 rounds in turn, medians; "
                        "ours_ms / anchor_ms: wall time per call with one sync at the end; host_ms: the CPU's time "
                        "per call issued without a sync"}
        rows.append(row)
        print(f"{key}: fast host {row['host_ms']} ms wall {row['ours_ms']} | triton host {row['anchor_host_ms']} "
              f"wall {row['anchor_ms']} | cached launches/call {row['cached_launches_per_call']}", flush=True)
        write_results(os.path.join(args.out, "fast_launch.json"), rows)


if __name__ == "__main__":
    main()
