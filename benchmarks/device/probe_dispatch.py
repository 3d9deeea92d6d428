"""The static dispatcher's pieces on one GPU (issue 5): the Triton expand layout against the
torch one (equality on random routings, then time per call with the host's launches in it),
and the gather kernel's tile (rows per program x warps) at the MoE shapes' gathers.

    python benchmarks/device/probe_dispatch.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import time_and_peak  # noqa: E402

from megatron_moe_hybrid.ops.moe import gather, layout  # noqa: E402


def ms_per_call(fn, reps=50, warmup=5):
    """Median ms of single calls, each from an idle GPU (so the host's launches count)."""
    return time_and_peak(fn, warmup, reps)[0]


def random_routing(tokens, topk, experts, gen, skew=False):
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    if skew:
        logits -= 1.1 * torch.log(torch.arange(1, experts + 1, device="cuda", dtype=torch.float32))
    return logits.topk(topk, dim=1).indices  # [T, K] int64


def check_and_time_layout():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens, topk, experts in ((16384, 8, 64), (4096, 8, 256), (131072, 10, 512), (16384, 16, 896)):
        for skew in (False, True):
            idx = random_routing(tokens, topk, experts, gen, skew)
            idx[::7, 0] = -1  # dropped copies
            n = int((idx >= 0).sum())
            for rows in (n, n // 2, n + 100):
                a = layout.expand_layout(idx, experts, rows, backend="torch")
                b = layout.expand_layout(idx, experts, rows, backend="triton")
                for f in ("sorted_row", "sorted_copy", "copy_pos", "tokens_per_expert", "overflow"):
                    assert torch.equal(getattr(a, f), getattr(b, f)), (tokens, topk, experts, skew, rows, f)
            t_torch = ms_per_call(lambda: layout.expand_layout(idx, experts, n, backend="torch"))
            t_triton = ms_per_call(lambda: layout.expand_layout(idx, experts, n, backend="triton"))
            print(f"expand layout T{tokens} K{topk} E{experts} skew={skew}: equal; torch {t_torch:.3f} ms, "
                  f"triton {t_triton:.3f} ms", flush=True)


def sweep_gather():
    defaults = gather.GATHER_ELEMS, gather.SCATTER_ELEMS, gather.GATHER_WARPS
    gen = torch.Generator(device="cuda").manual_seed(1)
    for tokens, topk, hidden in ((16384, 8, 2048), (4096, 8, 7168)):
        n = tokens * topk
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
        y = torch.randn(n, hidden, generator=gen, device="cuda").bfloat16()
        perm = torch.randperm(n, generator=gen, device="cuda")
        src_row = (perm // topk)[:, None]  # [N, 1] the permute's gather
        comb = perm.view(tokens, topk)  # [T, K] the combine's gather
        w = torch.rand(tokens, topk, generator=gen, device="cuda")
        copy_src = torch.empty(n * hidden // 2 + tokens * hidden // 2, dtype=torch.bfloat16, device="cuda")
        copy_dst = torch.empty_like(copy_src)
        t_copy = ms_per_call(lambda: copy_dst.copy_(copy_src))
        gb = (n + tokens) * hidden * 2 / 1e9
        print(f"\nT{tokens} K{topk} h{hidden}: device copy of the permute's bytes {t_copy:.3f} ms "
              f"({gb / t_copy:.2f} TB/s)")
        want_p = gather.gather_sum_reference(x, src_row)
        want_c = gather.gather_sum(y, comb, w, "torch")
        dest = torch.argsort(perm).view(tokens, topk)  # [T, K] output row of copy (t, k)
        w_flat = torch.rand(tokens, topk, generator=gen, device="cuda")
        want_s = gather.gather_sum(x, src_row, w_flat.view(-1)[perm][:, None], "torch")
        for elems in (1024, 4096):
            for warps in (4,):
                gather.GATHER_ELEMS, gather.SCATTER_ELEMS, gather.GATHER_WARPS = elems, elems, warps
                got_p = gather.gather_sum(x, src_row, None, "triton")
                got_c = gather.gather_sum(y, comb, w, "triton")
                got_s = gather.scatter_rows(x, dest, perm, None, "triton")
                got_sw = gather.scatter_rows(x, dest, perm, w_flat, "triton")
                assert torch.equal(got_p, want_p) and torch.equal(got_s, want_p)
                assert (got_sw.float() - want_s.float()).abs().max() <= 1e-2 * want_s.float().abs().max()
                assert (got_c.float() - want_c.float()).abs().max() <= 1e-2 * want_c.float().abs().max()
                tp = ms_per_call(lambda: gather.gather_sum(x, src_row, None, "triton"))
                ts = ms_per_call(lambda: gather.scatter_rows(x, dest, perm, None, "triton"))
                tw = ms_per_call(lambda: gather.scatter_rows(x, dest, perm, w_flat, "triton"))
                tc = ms_per_call(lambda: gather.gather_sum(y, comb, w, "triton"))
                print(f"  elems {elems:5d} warps {warps}: permute as gather {tp:.3f} ms ({gb / tp:.2f} TB/s), "
                      f"as scatter {ts:.3f} ms ({gb / ts:.2f} TB/s), weighted scatter {tw:.3f} ms, "
                      f"weighted combine {tc:.3f} ms ({gb / tc:.2f} TB/s)", flush=True)
        gather.GATHER_ELEMS, gather.SCATTER_ELEMS, gather.GATHER_WARPS = defaults
        a = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
        td = ms_per_call(lambda: gather.row_dot(a, y, comb, "triton"))
        ref = gather.row_dot_reference(a.float(), y.float(), comb)
        err = (gather.row_dot(a, y, comb, "triton") - ref).abs().max().item()
        print(f"  row_dot [T, K]: {td:.3f} ms ({(n + tokens) * hidden * 2 / 1e9 / td:.2f} TB/s), max err {err:.2e}")


if __name__ == "__main__":
    check_and_time_layout()
    sweep_gather()
