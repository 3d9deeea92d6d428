"""Times triton_sparse._bwd_reduce_kernel alone at job c131072's S-layer shape (one chunk of the
sparse backward: Tc = 1024 queries x K = 2048 slots, G = 2 groups x F = 512 columns, bf16 C,
S = 131072 causal keys picked at random) over BW x BL configs; prints GB/s of C read.

    python benchmarks/device/tune_sparse_reduce.py
"""

import itertools

import torch
import triton

from megatron_moe_hybrid.ops.sparse_attention import triton_sparse as ts


def main():
    torch.manual_seed(0)
    B, Tc, K, G, F, S = 1, 1024, 2048, 2, 512, 131072
    dev = "cuda"
    C = torch.randn(B, Tc, K, G, F, device=dev, dtype=torch.bfloat16)
    t = torch.arange(S - Tc, S, device=dev)[:, None]
    idx = (torch.rand(Tc, K, device=dev) * (t + 1)).long().clamp(max=S - 1)  # repeats allowed here
    keys = idx.reshape(-1).to(torch.int32)
    sorted_keys, order = torch.sort(keys, stable=True)
    offsets = torch.searchsorted(sorted_keys, torch.arange(B * S + 1, device=dev, dtype=torch.int32)).to(torch.int32)
    order = order.to(torch.int32)
    acc = torch.empty(B, S, G, F, device=dev, dtype=torch.float32)
    W = G * F
    ref = None
    for BW, BL, nw in itertools.product((256, 512, 1024), (8, 16, 32), (4, 8)):
        grid = (B * S, triton.cdiv(W, BW))

        def run():
            ts._bwd_reduce_kernel[grid](C, order, offsets, acc, W, 1, BW=BW, BL=BL, num_warps=nw, num_stages=1)

        try:
            run()
        except Exception as e:  # noqa: BLE001
            print(f"BW{BW} BL{BL} w{nw}: {type(e).__name__}")
            continue
        if ref is None:
            ref = acc.clone()
        torch.testing.assert_close(acc, ref, rtol=1e-5, atol=1e-5)
        ms = triton.testing.do_bench(run, warmup=5, rep=40)
        print(f"BW{BW:5d} BL{BL:3d} w{nw}: {ms:.3f} ms, {C.numel() * 2 / ms / 1e6:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
