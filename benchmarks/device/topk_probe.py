"""torch.topk over int64 vs int32 keys, and the indexer's selection (triton_indexer._select_rows:
unsorted int32 top-k for the threshold, one compaction pass, a short stable sort) against the
int64 sort-key top-k it replaced, on random scores; then lightning_indexer_topk at issue 4's
indexer shape. Prints ms; checks the two selections are equal.

    python benchmarks/device/topk_probe.py
"""

import os
import sys

import torch

from megatron_moe_hybrid.ops.sparse_attention import lightning_indexer_topk
from megatron_moe_hybrid.ops.sparse_attention import triton_indexer as ti

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import mean_event_ms  # noqa: E402


def main():
    torch.manual_seed(0)
    K = 2048
    for rows, S in ((2048, 32768), (1024, 131072)):
        scores = torch.randn(rows, S, device="cuda")
        scores[:, S // 2:] = float("-inf")  # a causal-like half
        scores[0, : S // 4] = 1.0  # ties across the threshold
        bits = (scores + 0.0).view(torch.int32)
        ords = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        keys = ti.sort_keys(ords, torch.arange(S, device="cuda"))
        old = ti.decode_keys(keys.topk(K, dim=-1).values)
        new = ti._select_rows(ords, K)
        print(f"rows {rows} S {S}: equal {torch.equal(old, new)}", flush=True)
        for name, fn in (
            ("int64 sort-key topk (old)", lambda: ti.decode_keys(keys.topk(K, dim=-1).values)),
            ("_select_rows (new)", lambda: ti._select_rows(ords, K)),
            ("  int32 topk unsorted", lambda: ords.topk(K, dim=-1, sorted=False)),
            ("  int32 topk sorted", lambda: ords.topk(K, dim=-1)),
            ("  sort [rows, K] int32 stable", lambda: torch.sort(old, dim=-1, descending=True, stable=True)),
        ):
            ms = mean_event_ms(fn, warmup=1)
            print(f"  {name:32s} {ms:7.3f} ms  {ms * 1e3 / rows:6.2f} us/row", flush=True)
        # the compaction pass alone, per launch config
        best = ords.topk(K, dim=-1, sorted=False).values
        kth = best.amin(-1).contiguous()
        above = (best > kth[:, None]).sum(-1, dtype=torch.int32)
        cols = torch.empty((rows, K), dtype=torch.int32, device="cuda")
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                def compact(block=block, warps=warps):
                    ti._compact_kernel[(rows,)](ords, kth, above, cols, S, K, BLOCK=block, num_warps=warps)
                ms = mean_event_ms(compact, warmup=1)
                print(f"  compact BLOCK {block:5d} warps {warps:2d}   {ms:7.3f} ms  {ms * 1e3 / rows:6.2f} us/row", flush=True)
    for S in (32768, 131072):
        T, HI, DI = 4096, 64, 128
        q = (torch.randn(1, T, HI, DI, device="cuda") / 4).bfloat16()
        k = (torch.randn(1, S, DI, device="cuda") / 4).bfloat16()
        w = (torch.randn(1, T, HI, device="cuda") / 4).bfloat16()
        pos = torch.arange(S - T, S, device="cuda")
        ms = mean_event_ms(lambda: lightning_indexer_topk(q, k, w, K, q_positions=pos), warmup=1)
        print(f"lightning_indexer_topk T{T} S{S} HI{HI} DI{DI}: {ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
