"""A/B of the sparse attention's row kernels (triton_sparse._probs_grads_kernel, the products
backward's p and ds; _softmax_kernel, the products forward's p, lse and the indexer loss's target)
with the slot count K specialised (as committed: K % 16 == 0 is known, so their masked loads and
stores of [BK] slots are 16-byte vectors) against K unspecialised (as before: do_not_specialize,
one 4-byte load per slot in the sm_90a SASS), in one process at absorbed MLA's shape.

    python benchmarks/device/probe_row_kernels.py OUT [--shape mla] [--reps 20]

Rows: each kernel alone on the chunk's inputs (CUDA events, median), and sparse_attention_with_target
forward+backward (what the layer runs to train the indexer) with both kernels in either form,
interleaved rounds; outputs of the two forms compared bitwise. Writes OUT/probe_row_kernels.json.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common import time_and_peak  # noqa: E402
from sparse_attention import SHAPES, causal_indices  # noqa: E402

from megatron_moe_hybrid.ops import sparse_attention as sa  # noqa: E402
from megatron_moe_hybrid.ops._launch import fast_launch  # noqa: E402
from megatron_moe_hybrid.ops.sparse_attention import triton_sparse as ts  # noqa: E402

KERNELS = ("_probs_grads_kernel", "_softmax_kernel")


def forms() -> dict:
    """{"specialised": {name: kernel as committed}, "unspecialised": {name: the same source, K not
    specialised}}."""
    now = {name: getattr(ts, name) for name in KERNELS}
    before = {name: fast_launch(triton.jit(do_not_specialize=["K"])(k.fn.fn)) for name, k in now.items()}
    return {"specialised": now, "unspecialised": before}


def events_ms(fn, reps: int) -> float:
    """Median ms of reps calls, each between two CUDA events, after one warm-up call."""
    return time_and_peak(fn, 1, reps)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="mla")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    shape, B, T, S, H, G, D, DV, K, shared = SHAPES[args.shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16().requires_grad_()
    kv = torch.randn(B, S, G, D, generator=gen, device="cuda").bfloat16().requires_grad_()
    indices = causal_indices(B, T, S, K, "cuda")
    variants = forms()
    rows = []

    # each kernel alone at one chunk of 256 queries (the chunk's rows as the products form makes them)
    n = 256
    N, R = B * n * G, H // G
    s = torch.randn(N * R, K, generator=gen, device="cuda")
    dp = torch.randn(N * R, K, generator=gen, device="cuda")
    lse2 = torch.randn(N * R, generator=gen, device="cuda").abs() + 10
    delta = torch.randn(N * R, generator=gen, device="cuda")
    idx = indices[:, :n].reshape(B * n, K).contiguous()
    bk = min(1024, triton.next_power_of_2(K))
    outs = {}
    for name, table in variants.items():
        ps = torch.empty(N, 2 * R, K, dtype=torch.bfloat16, device="cuda")
        p = torch.empty(B * n * H, K, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(B * n * H, device="cuda")
        psum = torch.empty(B * n, K, device="cuda")

        def probs_grads():
            table["_probs_grads_kernel"][(N * R, triton.cdiv(K, bk))](
                s, dp, lse2, delta, idx, ps, K, R, G, 0.1, 0.1 * 1.4426950408889634, BK=bk, num_warps=4)

        def softmax():
            table["_softmax_kernel"][(B * n,)](s, idx, p, lse, psum, K, H, 0.1 * 1.4426950408889634,
                                              BK=triton.next_power_of_2(K), ONE_PASS=True, PSUM=True,
                                              num_warps=8)

        for kname, fn, nbytes in (("_probs_grads_kernel", probs_grads, N * R * K * 12),
                                  ("_softmax_kernel", softmax, B * n * H * K * 6 + B * n * K * 4)):
            ms = events_ms(fn, args.reps)
            rows.append({"what": f"{kname} alone, {n} queries", "form": name, "ms": round(ms, 4),
                         "TB_per_s": round(nbytes / ms / 1e9, 2)})
            print(json.dumps(rows[-1]), flush=True)
        outs[name] = [x.clone() for x in (ps, p, lse, psum)]
    same = all(torch.equal(a, b) for a, b in zip(outs["specialised"], outs["unspecialised"]))
    rows.append({"what": "kernels alone: outputs bitwise equal", "equal": same})
    print(json.dumps(rows[-1]), flush=True)

    # the op, forward+backward with the target, the forms in interleaved rounds
    def op():
        o, lse, target = sa.sparse_attention_with_target(q, kv, kv[..., :DV], indices, backend="triton")
        loss = o.float().square().mean() + target.sum() * 1e-6
        return (o, lse, target, *torch.autograd.grad(loss, (q, kv)))

    results, times = {}, {name: [] for name in variants}
    for rnd in range(4):
        for name, table in variants.items():
            saved = {k: getattr(ts, k) for k in KERNELS}
            for k, fn in table.items():
                setattr(ts, k, fn)
            try:
                if rnd == 0:
                    results[name] = [x.detach().clone() for x in op()]
                times[name].append(events_ms(op, max(3, args.reps // 4)))
            finally:
                for k, fn in saved.items():
                    setattr(ts, k, fn)
    for name in variants:
        rows.append({"what": f"sparse_attention_with_target fwd+bwd, {shape}", "form": name,
                     "ms": round(statistics.median(times[name]), 3), "rounds_ms": [round(t, 3) for t in times[name]]})
        print(json.dumps(rows[-1]), flush=True)
    same = all(torch.equal(a, b) for a, b in zip(results["specialised"], results["unspecialised"]))
    rows.append({"what": "op: outputs and gradients bitwise equal", "equal": same})
    print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "probe_row_kernels.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "shape": shape,
                   "git_sha": os.environ.get("GIT_SHA", ""), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
