"""The static dispatcher's permute and combine on one GPU, timed without the host's launches
(issue 5: permute at 75% of the device copy bandwidth): each kernel back to back
(`triton.testing.do_bench`, median, L2 flushed between calls), the dispatch steps as a
CUDA-graph replay, and the same from an idle GPU (as `benchmarks/moe.py` times its rows);
next to a device copy of the same bytes and a write-only fill. Then a sweep of the
scatter kernel's variants (tile, warps, streaming stores), each checked bitwise against
ours first.

    python benchmarks/device/probe_permute.py [--shapes S1,S2] [--out FILE]

--out writes the figures as results rows (../shared/DESIGN.md's format; results/h200/permute_probe.json).
"""

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import time_and_peak, write_results  # noqa: E402
from moe import back_to_back_ms, device_copy, dispatch_combine, dispatch_steps, graph_replay_ms  # noqa: E402

from megatron_moe_hybrid.layers.moe import StaticAllToAllDispatcher  # noqa: E402
from megatron_moe_hybrid.ops.moe import gather, layout  # noqa: E402

SHAPES = {"S1": (16384, 8, 64, 2048), "S2": (4096, 8, 256, 7168)}  # tokens, topk, experts, hidden


@triton.jit
def _scatter_variant(src, dest, out, S, h, K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, STREAM: tl.constexpr):
    """The scatter's source-row programs (no zero-fill half: every output row is written here),
    with every destination of the tile loaded first and optional streaming stores."""
    s = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s_ok = s < S
    c_ok = cols < h
    kk = tl.arange(0, KP)
    d_all = tl.load(dest + s[:, None] * K + kk[None, :], mask=s_ok[:, None] & (kk[None, :] < K), other=-1)
    vals = tl.load(src + s[:, None] * h + cols[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
    for k in tl.static_range(K):
        d = tl.sum(tl.where(kk[None, :] == k, d_all, 0), axis=1)
        ptr = out + tl.maximum(d, 0)[:, None] * h + cols[None, :]
        m = (d >= 0)[:, None] & c_ok[None, :]
        if STREAM:
            tl.store(ptr, vals, mask=m, cache_modifier=".cs")
        else:
            tl.store(ptr, vals, mask=m)


def scatter_variant(x, dest, rows_out, rows, block, warps, stream):
    out = x.new_empty(rows_out, x.shape[1])
    grid = (triton.cdiv(x.shape[0], rows), triton.cdiv(x.shape[1], block))
    _scatter_variant[grid](x, dest, out, x.shape[0], x.shape[1], K=dest.shape[1],
                           KP=triton.next_power_of_2(dest.shape[1]), ROWS=rows, BLOCK=block, STREAM=stream,
                           num_warps=warps)
    return out


def row(name, key, ms, anchor, anchor_ms, num_bytes, notes):
    return {"name": name, "shape": key, "ours_ms": round(ms, 4), "anchor": anchor,
            "anchor_ms": None if anchor_ms is None else round(anchor_ms, 4),
            "speedup": None if anchor_ms is None else round(anchor_ms / ms, 3),
            "target_speedup": 0.75 if anchor_ms is not None else None,
            "ours_GBps": None if num_bytes is None else round(num_bytes / ms / 1e6, 1), "notes": notes}


def run_shape(key):
    tokens, topk, experts, hidden = SHAPES[key]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    probs, topk_idx = logits.softmax(-1).topk(topk, dim=1)
    d = StaticAllToAllDispatcher(experts, None, "fused")
    x_sorted = dispatch_steps(d, x, topk_idx, probs)
    ex = d.state.expand
    recv = x  # EP=1: the identity send layout, so the received rows are the tokens themselves
    n = tokens * topk
    permute_bytes = (tokens + n) * hidden * 2  # read T rows, write T*K
    total_bytes = 2 * permute_bytes  # + the combine: read T*K rows, write T
    shape = f"{key}-T{tokens}-H{hidden}-E{experts}-K{topk}-bf16"
    print(f"\n== {key}: T{tokens} K{topk} E{experts} h{hidden}; permute {permute_bytes / 1e9:.3f} GB, "
          f"permute+combine {total_bytes / 1e9:.3f} GB", flush=True)

    fill = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
    copy_p, copy_t = device_copy(permute_bytes), device_copy(total_bytes)
    t = {
        "copy, permute's bytes": back_to_back_ms(copy_p),
        "copy, permute+combine's bytes": back_to_back_ms(copy_t),
        "fill_ of the T*K rows (write only)": back_to_back_ms(lambda: fill.fill_(1.0)),
        "scatter kernel (ours, the permute)": back_to_back_ms(
            lambda: gather.scatter_rows(recv, ex.copy_pos, ex.sorted_row, None, "triton")),
        "weighted combine kernel (ours)": back_to_back_ms(
            lambda: gather.gather_sum(x_sorted, ex.copy_pos, d.state.recv_probs, "triton")),
        "expand layout (ours)": back_to_back_ms(
            lambda: layout.expand_layout(d.state.recv_expert, d.num_local_experts, d.state.num_rows, "triton")),
    }
    rows = []
    for name, ms in t.items():
        gb = permute_bytes if "permute's" in name or "scatter" in name else total_bytes
        gb = n * hidden * 2 if "fill" in name else gb
        gb = None if "layout" in name else gb
        extra = "" if gb is None else f"  {gb / ms / 1e6:7.1f} GB/s"
        print(f"  {name:44s} {ms:8.4f} ms{extra}", flush=True)
        anchor = "copy, permute's bytes" if "scatter" in name else None
        rows.append(row(name, shape, ms, anchor and "device copy_ (same bytes read+written), back-to-back",
                        anchor and t[anchor], gb, "triton.testing.do_bench median, L2 flushed between calls"))
    bw_copy = permute_bytes / t["copy, permute's bytes"]
    print(f"  scatter at {permute_bytes / t['scatter kernel (ours, the permute)'] / bw_copy:.3f} of the copy", flush=True)

    for name, fn, nbytes, anchor in (
            ("permute (dispatch steps)", lambda: dispatch_steps(d, x, topk_idx, probs), permute_bytes,
             "copy, permute's bytes"),
            ("dispatch+combine (six steps)", lambda: dispatch_combine(d, x, topk_idx, probs), total_bytes,
             "copy, permute+combine's bytes")):
        idle = time_and_peak(fn, 5, 50)[0]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
        replay = graph_replay_ms(fn, 5, 50)
        print(f"  {name:30s} from idle {idle:.4f} ms ({t[anchor] / idle:.3f} of copy; host {host:.4f} ms per call); "
              f"CUDA graph {replay:.4f} ms ({t[anchor] / replay:.3f} of copy; {nbytes / replay / 1e6:.1f} GB/s)",
              flush=True)
        copy = "device copy_ (same bytes read+written), back-to-back"
        rows.append(row(f"{name}, from idle", shape, idle, copy, t[anchor], nbytes,
                        f"median of 50 from an idle GPU; the host issued one call in {host:.4f} ms"))
        rows.append(row(f"{name}, CUDA graph", shape, replay, copy, t[anchor], nbytes, "median of 50 replays"))

    want = gather.scatter_rows(recv, ex.copy_pos, ex.sorted_row, None, "triton")
    print("  scatter variants (rows x block, warps, streaming stores): ms, fraction of copy", flush=True)
    for rows_per, block in ((1, 2048), (2, 1024), (4, 1024), (8, 512), (4, 2048), (8, 1024)):
        if block > triton.next_power_of_2(hidden):
            continue
        for warps in (4, 8):
            for stream in (False, True):
                got = scatter_variant(recv, ex.copy_pos, want.shape[0], rows_per, block, warps, stream)
                assert torch.equal(got, want), (rows_per, block, warps, stream)
                ms = back_to_back_ms(
                    lambda: scatter_variant(recv, ex.copy_pos, want.shape[0], rows_per, block, warps, stream))
                print(f"    {rows_per} x {block:4d}, {warps} warps, stream={int(stream)}: {ms:.4f} ms, "
                      f"{permute_bytes / ms / bw_copy:.3f}", flush=True)
                rows.append(row(f"scatter variant {rows_per} x {block}, {warps} warps, streaming stores {int(stream)}",
                                shape, ms, "device copy_ (same bytes read+written), back-to-back",
                                t["copy, permute's bytes"], permute_bytes,
                                "probe kernel without the zero-fill half, bitwise equal to ours; do_bench median"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="S1,S2")
    parser.add_argument("--out", default=None, help="write the rows there (results JSON)")
    args = parser.parse_args()
    rows = [r for key in args.shapes.split(",") for r in run_shape(key)]
    if args.out:
        write_results(args.out, rows)


if __name__ == "__main__":
    main()
