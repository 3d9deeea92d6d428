"""The linear + cross-entropy row passes alone, in every form: how fast can a [C, V] chunk be turned into d loss / d logits?

    cd benchmarks && python device/probe_row_passes.py [--out $OUT/loss_row_passes.json]

Per chunk the loss (ops/cross_entropy/triton.py) reads the bf16 logits once for the row
statistics (max, sum-exp, target logit, logit sum) and once more to overwrite them with the
gradient: 6 bytes per element, whose floor at the device's copy bandwidth is printed first.
Variants, each at the two benchmark shapes' automatic chunks (768 x 151936, 1408 x 262144):
  - the committed kernels under other grids (PROGRAMS_PER_CHUNK), block widths and warps;
  - a stats kernel keeping a running max and sum-exp per lane with one exp per element;
  - one persistent fused kernel per row: statistics, then the gradient from a second read
    that the L2 cache may serve (4 bytes per element from HBM when it does).
Every variant's lse is checked against torch.logsumexp and its gradient against the
committed kernels' on fresh random logits.
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import time_and_peak, write_results  # noqa: E402

from megatron_moe_hybrid.ops.cross_entropy import triton as tri  # noqa: E402

SHAPES = [(768, 151936), (1408, 262144)]  # (chunk, V): the automatic trainable chunks of benchmarks/loss.py's shapes


@triton.jit
def _cf59101_stats_kernel(logits_ptr, local_ptr, part_ptr, stride_row, num_rows, num_cols, cols_per_split,
                          BLOCK_V: tl.constexpr):
    """cf59101's stats kernel (the baseline): one column range of one row -> (max, sum-exp under it, target logit or 0, logit sum) into part [4, S, C]."""
    i_row = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)  # -1: ignored, or the target is not in this shard
    col_start = i_split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, num_cols)
    row_max = tl.full([], float("-inf"), tl.float32)  # running max and sum-exp under it: one exp per element, one rescale per block
    row_sum = tl.zeros([], tl.float32)
    b_target = tl.zeros([BLOCK_V], tl.float32)
    b_logit_sum = tl.zeros([BLOCK_V], tl.float32)
    for i_col in range(col_start, col_end, BLOCK_V):
        o_col = i_col + tl.arange(0, BLOCK_V)
        m_col = o_col < col_end
        b_x = tl.load(p_row + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(b_x, axis=0))
        # while the max is still -inf the sum stays 0; subtracting -inf from -inf would give NaN
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - safe_max) + tl.sum(tl.exp(b_x - safe_max), axis=0)
        row_max = new_max
        b_target += tl.where(o_col == target_col, b_x, 0.0)
        b_logit_sum += tl.where(m_col, b_x, 0.0)
    p_out = part_ptr + i_split * num_rows + i_row
    tl.store(p_out, row_max)
    tl.store(p_out + num_splits * num_rows, row_sum)
    tl.store(p_out + 2 * num_splits * num_rows, tl.sum(b_target, axis=0))
    tl.store(p_out + 3 * num_splits * num_rows, tl.sum(b_logit_sum, axis=0))


@triton.jit
def _cf59101_grad_kernel(logits_ptr, local_ptr, lse_ptr, grad_token_ptr, stride_row, num_cols, cols_per_split,
                        z_loss_weight, label_smoothing, inv_num_classes, BLOCK_V: tl.constexpr):
    """cf59101's gradient kernel (the baseline): overwrites one column range of one row of logits with d loss / d logits (reference.py's formula)."""
    i_row = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)
    lse = tl.load(lse_ptr + i_row)
    grad_token = tl.load(grad_token_ptr + i_row)  # 0 for ignored tokens
    scale_softmax = grad_token * (1.0 + 2.0 * z_loss_weight * lse)
    target_weight = grad_token * (1.0 - label_smoothing)
    uniform = grad_token * label_smoothing * inv_num_classes
    col_start = i_split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, num_cols)
    for i_col in range(col_start, col_end, BLOCK_V):
        o_col = i_col + tl.arange(0, BLOCK_V)
        m_col = o_col < col_end
        b_x = tl.load(p_row + o_col, mask=m_col, other=0.0).to(tl.float32)
        b_grad = tl.exp(b_x - lse) * scale_softmax - uniform - tl.where(o_col == target_col, target_weight, 0.0)
        tl.store(p_row + o_col, b_grad.to(logits_ptr.dtype.element_ty), mask=m_col)


@triton.jit
def _lane_stats_kernel(logits_ptr, local_ptr, part_ptr, stride_row, num_rows, num_cols, cols_per_split,
                       BLOCK_V: tl.constexpr):
    """_partial_stats_kernel with a running (max, sum-exp) per lane: one exp per element, no reduction in the loop."""
    i_row = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)
    col_start = i_split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, num_cols)
    b_max = tl.full([BLOCK_V], -3.0e38, tl.float32)  # finite: masked lanes (-3e38) add exp(0) under it, 0 after the merge
    b_sum = tl.zeros([BLOCK_V], tl.float32)
    b_target = tl.zeros([BLOCK_V], tl.float32)
    b_logit_sum = tl.zeros([BLOCK_V], tl.float32)
    for i_col in range(col_start, col_end, BLOCK_V):
        o_col = i_col + tl.arange(0, BLOCK_V)
        m_col = o_col < col_end
        b_x = tl.load(p_row + o_col, mask=m_col, other=-3.0e38).to(tl.float32)
        up = b_x > b_max
        b_e = tl.exp(tl.where(up, b_max - b_x, b_x - b_max))
        b_sum = tl.where(up, b_sum * b_e + 1.0, b_sum + b_e)
        b_max = tl.maximum(b_max, b_x)
        b_target += tl.where(o_col == target_col, b_x, 0.0)
        b_logit_sum += tl.where(m_col, b_x, 0.0)
    row_max = tl.max(b_max, axis=0)
    p_out = part_ptr + i_split * num_rows + i_row
    tl.store(p_out, row_max)
    tl.store(p_out + num_splits * num_rows, tl.sum(b_sum * tl.exp(b_max - row_max), axis=0))
    tl.store(p_out + 2 * num_splits * num_rows, tl.sum(b_target, axis=0))
    tl.store(p_out + 3 * num_splits * num_rows, tl.sum(b_logit_sum, axis=0))


@triton.jit
def _fused_rows_kernel(logits_ptr, local_ptr, lse_ptr, loss_ptr, grad_token_ptr, stride_row, num_rows, num_cols,
                       BLOCK_V: tl.constexpr):
    """Persistent: each program takes whole rows; statistics over the row, then the row again (L2) -> gradient."""
    for i_row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        p_row = logits_ptr + (i_row + tl.zeros([], tl.int64)) * stride_row
        target_col = tl.load(local_ptr + i_row)
        row_max = tl.full([], float("-inf"), tl.float32)
        row_sum = tl.zeros([], tl.float32)
        b_target = tl.zeros([BLOCK_V], tl.float32)
        for i_col in range(0, num_cols, BLOCK_V):
            o_col = i_col + tl.arange(0, BLOCK_V)
            m_col = o_col < num_cols
            b_x = tl.load(p_row + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(b_x, axis=0))
            row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(b_x - new_max), axis=0)
            row_max = new_max
            b_target += tl.where(o_col == target_col, b_x, 0.0)
        lse = row_max + tl.log(row_sum)
        grad_token = tl.load(grad_token_ptr + i_row)
        tl.store(lse_ptr + i_row, lse)
        tl.store(loss_ptr + i_row, tl.where(target_col >= 0, lse - tl.sum(b_target, axis=0), 0.0))
        for i_col in range(0, num_cols, BLOCK_V):
            o_col = i_col + tl.arange(0, BLOCK_V)
            m_col = o_col < num_cols
            b_x = tl.load(p_row + o_col, mask=m_col, other=0.0).to(tl.float32)
            b_grad = tl.exp(b_x - lse) * grad_token - tl.where(o_col == target_col, grad_token, 0.0)
            tl.store(p_row + o_col, b_grad.to(logits_ptr.dtype.element_ty), mask=m_col)


@triton.jit
def _lane_stats_prefetch_kernel(logits_ptr, local_ptr, part_ptr, stride_row, num_rows, num_cols, cols_per_split,
                                BLOCK_V: tl.constexpr):
    """_lane_stats_kernel that loads block i + 1 before computing on block i (two loads in flight per thread)."""
    i_row = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)
    col_start = i_split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, num_cols)
    b_max = tl.full([BLOCK_V], -3.0e38, tl.float32)
    b_sum = tl.zeros([BLOCK_V], tl.float32)
    b_target = tl.zeros([BLOCK_V], tl.float32)
    b_logit_sum = tl.zeros([BLOCK_V], tl.float32)
    o_next = col_start + tl.arange(0, BLOCK_V)
    b_next = tl.load(p_row + o_next, mask=o_next < col_end, other=-3.0e38)
    for i_col in range(col_start, col_end, BLOCK_V):
        o_col = i_col + tl.arange(0, BLOCK_V)
        m_col = o_col < col_end
        b_x = b_next.to(tl.float32)
        o_next = o_col + BLOCK_V
        b_next = tl.load(p_row + o_next, mask=o_next < col_end, other=-3.0e38)
        up = b_x > b_max
        b_e = tl.exp(tl.where(up, b_max - b_x, b_x - b_max))
        b_sum = tl.where(up, b_sum * b_e + 1.0, b_sum + b_e)
        b_max = tl.maximum(b_max, b_x)
        b_target += tl.where(o_col == target_col, b_x, 0.0)
        b_logit_sum += tl.where(m_col, b_x, 0.0)
    row_max = tl.max(b_max, axis=0)
    p_out = part_ptr + i_split * num_rows + i_row
    tl.store(p_out, row_max)
    tl.store(p_out + num_splits * num_rows, tl.sum(b_sum * tl.exp(b_max - row_max), axis=0))
    tl.store(p_out + 2 * num_splits * num_rows, tl.sum(b_target, axis=0))
    tl.store(p_out + 3 * num_splits * num_rows, tl.sum(b_logit_sum, axis=0))


@triton.jit
def _grad_prefetch_kernel(logits_ptr, local_ptr, lse_ptr, grad_token_ptr, stride_row, num_cols, cols_per_split,
                          z_loss_weight, label_smoothing, inv_num_classes, BLOCK_V: tl.constexpr):
    """_grad_logits_kernel that loads block i + 1 before storing block i."""
    i_row = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)
    lse = tl.load(lse_ptr + i_row)
    grad_token = tl.load(grad_token_ptr + i_row)
    scale_softmax = grad_token * (1.0 + 2.0 * z_loss_weight * lse)
    target_weight = grad_token * (1.0 - label_smoothing)
    uniform = grad_token * label_smoothing * inv_num_classes
    col_start = i_split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, num_cols)
    o_next = col_start + tl.arange(0, BLOCK_V)
    b_next = tl.load(p_row + o_next, mask=o_next < col_end, other=0.0)
    for i_col in range(col_start, col_end, BLOCK_V):
        o_col = i_col + tl.arange(0, BLOCK_V)
        m_col = o_col < col_end
        b_x = b_next.to(tl.float32)
        o_next = o_col + BLOCK_V
        b_next = tl.load(p_row + o_next, mask=o_next < col_end, other=0.0)
        b_grad = tl.exp(b_x - lse) * scale_softmax - uniform - tl.where(o_col == target_col, target_weight, 0.0)
        tl.store(p_row + o_col, b_grad.to(logits_ptr.dtype.element_ty), mask=m_col)


@triton.jit
def _thread_stats_kernel(logits_ptr, local_ptr, part_ptr, stride_row, num_rows, num_cols, cols_per_split,
                         BLOCK_V: tl.constexpr, GROUP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                         FAST_EXP: tl.constexpr):
    """The committed stats kernel with the running (max, sum-exp) kept per group of GROUP adjacent columns
    ([BLOCK_V // GROUP, GROUP] tiles, reduced along the group: within a thread or two, no barrier in the loop)."""
    i_row = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    p_row = logits_ptr + i_row * stride_row
    target_col = tl.load(local_ptr + i_row)
    col_start = i_split * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, num_cols)
    full_end = col_start + (col_end - col_start) // BLOCK_V * BLOCK_V
    o_tile = tl.arange(0, BLOCK_V // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [R, G]
    b_max = tl.full([BLOCK_V // GROUP], float("-inf"), tl.float32)
    b_sum = tl.zeros([BLOCK_V // GROUP], tl.float32)
    b_logit_sum = tl.zeros([BLOCK_V // GROUP, GROUP], tl.float32)
    for i_col in range(col_start, full_end, BLOCK_V):
        b_x = tl.load(p_row + i_col + o_tile).to(tl.float32)
        new_max = tl.maximum(b_max, tl.max(b_x, axis=1))
        b_sum = b_sum * tl.exp(b_max - new_max) + tl.sum(tri._exp_minus(b_x, new_max[:, None], FAST_EXP), axis=1)
        b_max = new_max
        if HAS_SMOOTHING:
            b_logit_sum += b_x
    if full_end < col_end:
        o_col = full_end + o_tile
        m_col = o_col < col_end
        b_x = tl.load(p_row + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(b_max, tl.max(b_x, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        b_sum = b_sum * tl.exp(b_max - safe_max) + tl.sum(tri._exp_minus(b_x, safe_max[:, None], FAST_EXP), axis=1)
        b_max = new_max
        if HAS_SMOOTHING:
            b_logit_sum += tl.where(m_col, b_x, 0.0)
    row_max = tl.max(b_max, axis=0)
    safe_row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(b_sum * tl.exp(b_max - safe_row_max), axis=0)
    has_target = (target_col >= col_start) & (target_col < col_end)
    target = tl.load(p_row + tl.where(has_target, target_col, 0), mask=has_target, other=0.0).to(tl.float32)
    p_out = part_ptr + i_split * num_rows + i_row
    tl.store(p_out, row_max)
    tl.store(p_out + num_splits * num_rows, row_sum)
    tl.store(p_out + 2 * num_splits * num_rows, target)
    tl.store(p_out + 3 * num_splits * num_rows, tl.sum(tl.sum(b_logit_sum, axis=1), axis=0))


def splits(num_rows, num_cols, programs, block):
    num_splits = max(1, min(triton.cdiv(num_cols, block), triton.cdiv(programs, num_rows)))
    cols_per_split = triton.cdiv(triton.cdiv(num_cols, num_splits), block) * block
    return triton.cdiv(num_cols, cols_per_split), cols_per_split


def stats(kernel, g, local, programs, block, warps, **flags):
    num_rows, num_cols = g.shape
    num_splits, cols_per_split = splits(num_rows, num_cols, programs, block)
    part = torch.empty(4, num_splits, num_rows, dtype=torch.float32, device=g.device)
    kernel[(num_rows, num_splits)](g, local, part, g.stride(0), num_rows, num_cols, cols_per_split, BLOCK_V=block,
                                   num_warps=warps, **flags)
    return part


def lse_of(part):
    row_max, sum_exp, _, _ = tri._merge_splits(part)
    return row_max + sum_exp.log()


def grad_pass(g, local, lse, grad_token, programs, block, warps, kernel=None, **flags):
    num_rows, num_cols = g.shape
    num_splits, cols_per_split = splits(num_rows, num_cols, programs, block)
    (kernel or _cf59101_grad_kernel)[(num_rows, num_splits)](g, local, lse, grad_token, g.stride(0), num_cols, cols_per_split,
                                                    0.0, 0.0, 1.0 / num_cols, BLOCK_V=block, num_warps=warps, **flags)


def median_ms(fn, reps=30):
    return time_and_peak(fn, 3, reps)[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/h200/loss_row_passes.json")
    parser.add_argument("--all", action="store_true", help="also the first round's grids and the fused persistent kernel")
    args = parser.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    big = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    copy_ms = median_ms(lambda: big[2**29:].copy_(big[: 2**29]))
    copy_tbps = 2**30 / copy_ms / 1e9
    del big
    rows = []

    def row(name, chunk, num_cols, ms, num_bytes, **extra):
        rows.append({
            "name": f"linear+CE row passes: {name}", "shape": f"C{chunk}-V{num_cols}-bf16", "ours_ms": round(ms, 4),
            "anchor": "device copy_ of the same bytes (read + written)", "anchor_ms": round(num_bytes / copy_tbps / 1e9, 4),
            "speedup": round(num_bytes / copy_tbps / 1e9 / ms, 3), "ours_TBps": round(num_bytes / ms / 1e9, 2),
            "copy_TBps": round(copy_tbps, 2), "notes": "median of 30 CUDA-event timings after 3", **extra,
        })
        print(f"{rows[-1]['name'][22:]:70s} {rows[-1]['shape']:20s} {ms:8.4f} ms {num_bytes / ms / 1e9:6.2f} TB/s", flush=True)

    print(f"copy ceiling {copy_tbps:.2f} TB/s, {sms} SMs", flush=True)
    for chunk, num_cols in SHAPES:
        elems = chunk * num_cols
        x = (torch.randn(chunk, num_cols, device="cuda") * 2).bfloat16()
        g = x.clone()
        local = torch.randint(0, num_cols, (chunk,), device="cuda")
        local[::17] = -1
        grad_token = torch.full((chunk,), 1.0 / chunk, device="cuda")
        ref_lse = torch.logsumexp(x.float(), 1)
        ref_grad = x.clone()
        _cf59101_grad_kernel[(chunk, 1)](ref_grad, local, ref_lse, grad_token, ref_grad.stride(0), num_cols, num_cols,
                                            0.0, 0.0, 1.0 / num_cols, BLOCK_V=2048, num_warps=4)
        ref_loss = torch.where(local >= 0, ref_lse - x.float().gather(1, local.clamp(min=0)[:, None])[:, 0], 0.0)
        best = {}
        smoothing_flags = {"HAS_SMOOTHING": False, "FAST_EXP": True}
        for name, programs, block, warps, kernel, flags in (
            [("cf59101 stats (baseline)", 2048, 2048, 4, _cf59101_stats_kernel, {})]
            + [("stats: unmasked blocks, one target load, ex2.ftz", p, b, w, tri._partial_stats_kernel, smoothing_flags)
               for p in (2048, 8192) for b, w in ((2048, 4), (4096, 8))]
            + [(f"stats: running max per {gr} columns", p, b, w, _thread_stats_kernel, {**smoothing_flags, "GROUP": gr})
               for gr in (8, 16, 32) for p in (2048, 8192) for b, w in ((2048, 4), (4096, 4), (4096, 8))]
        ):
            err = (lse_of(stats(kernel, x, local, programs, block, warps, **flags)) - ref_lse).abs().max().item()
            target_err = (stats(kernel, x, local, programs, block, warps, **flags)[2].sum(0)
                          - torch.where(local >= 0, x.float().gather(1, local.clamp(min=0)[:, None])[:, 0], 0.0)).abs().max().item()
            ms = median_ms(lambda: stats(kernel, x, local, programs, block, warps, **flags))
            row(f"{name}, {programs} programs, BLOCK_V {block}, {warps} warps", chunk, num_cols, ms, 2 * elems,
                max_abs_lse_err=err, max_abs_target_err=target_err)
            best.setdefault("new stats", []).append((ms, name, programs, block, warps))
        for name, programs, block, warps, kernel, flags in (
            [("cf59101 gradient (baseline)", 2048, 2048, 4, _cf59101_grad_kernel, {})]
            + [("gradient: unmasked blocks, target after a barrier, ex2.ftz", p, b, w, tri._grad_logits_kernel, smoothing_flags)
               for p in (2048, 32768) for b, w in ((2048, 4), (2048, 2), (1024, 2), (4096, 8))]
        ):
            g.copy_(x)
            grad_pass(g, local, ref_lse, grad_token, programs, block, warps, kernel, **flags)
            err = (g.float() - ref_grad.float()).abs().max().item()
            ms = median_ms(lambda: grad_pass(g, local, ref_lse, grad_token, programs, block, warps, kernel, **flags))
            row(f"{name}, {programs} programs, BLOCK_V {block}, {warps} warps", chunk, num_cols, ms, 4 * elems,
                max_abs_grad_err_vs_cf59101=err)
            best.setdefault("new grad", []).append((ms, name, programs, block, warps))
        s3, g3 = min(best["new stats"]), min(best["new grad"])
        print(f"best at C{chunk}: stats {s3}, grad {g3}: {s3[0] + g3[0]:.4f} ms = {6 * elems / (s3[0] + g3[0]) / 1e9:.2f} TB/s",
              flush=True)
        if not args.all:
            write_results(args.out, rows)
            del x, g, ref_grad
            continue
        stats_kernels = (("block-wide stats", _cf59101_stats_kernel), ("per-lane stats", _lane_stats_kernel),
                         ("per-lane stats, prefetch", _lane_stats_prefetch_kernel))
        for kernel_name, kernel in stats_kernels[:1] + stats_kernels[1:] if args.all else stats_kernels:
            for programs in (2048, 8192, 32768) if args.all else (2048, 8192):
                for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)) if args.all else ((2048, 4), (4096, 4), (8192, 8), (4096, 8)):
                    if not args.all and kernel is _cf59101_stats_kernel and (block, warps) != (2048, 4):
                        continue
                    err = (lse_of(stats(kernel, x, local, programs, block, warps)) - ref_lse).abs().max().item()
                    ms = median_ms(lambda: stats(kernel, x, local, programs, block, warps))
                    row(f"{kernel_name}, {programs} programs, BLOCK_V {block}, {warps} warps", chunk, num_cols, ms, 2 * elems,
                        max_abs_lse_err=err, splits=splits(chunk, num_cols, programs, block)[0])
                    best.setdefault("stats", []).append((ms, kernel_name, programs, block, warps))
        for grad_name, grad_kernel in (("gradient pass", None), ("gradient pass, prefetch", _grad_prefetch_kernel)):
            for programs in (2048, 8192, 32768):
                for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)) if args.all else ((2048, 4), (2048, 8), (4096, 4), (4096, 8)):
                    if grad_kernel is not None or args.all or (block, warps) == (2048, 4):
                        g.copy_(x)
                        grad_pass(g, local, ref_lse, grad_token, programs, block, warps, grad_kernel)
                        err = (g.float() - ref_grad.float()).abs().max().item()
                        ms = median_ms(lambda: grad_pass(g, local, ref_lse, grad_token, programs, block, warps, grad_kernel))
                        row(f"{grad_name}, {programs} programs, BLOCK_V {block}, {warps} warps", chunk, num_cols, ms,
                            4 * elems, max_abs_grad_err_vs_committed=err)
                        best.setdefault("grad", []).append((ms, grad_name, programs, block, warps))
        for per_sm in (1, 2, 4) if args.all else ():
            for block, warps in ((4096, 8), (8192, 16), (16384, 32)):
                if per_sm * warps > 64:
                    continue
                lse, loss = torch.empty(chunk, device="cuda"), torch.empty(chunk, device="cuda")

                def fused():
                    _fused_rows_kernel[(min(chunk, per_sm * sms),)](g, local, lse, loss, grad_token, g.stride(0), chunk,
                                                                     num_cols, BLOCK_V=block, num_warps=warps)

                g.copy_(x)
                fused()
                errs = {"max_abs_lse_err": (lse - ref_lse).abs().max().item(),
                        "max_abs_loss_err": (loss - ref_loss).abs().max().item(),
                        "max_abs_grad_err_vs_committed": (g.float() - ref_grad.float()).abs().max().item()}
                ms = median_ms(fused)  # later runs take their own gradient as logits: the same work
                row(f"fused persistent rows, {per_sm}/SM, BLOCK_V {block}, {warps} warps",
                    chunk, num_cols, ms, 6 * elems, **errs)
        s, gr = min(best["stats"]), min(best["grad"])
        print(f"best at C{chunk}: stats {s}, grad {gr}: {s[0] + gr[0]:.4f} ms = {6 * elems / (s[0] + gr[0]) / 1e9:.2f} TB/s",
              flush=True)
        write_results(args.out, rows)
        del x, g, ref_grad


if __name__ == "__main__":
    main()
