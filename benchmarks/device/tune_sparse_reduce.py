"""Times triton_sparse._bwd_reduce_kernel alone over BW x BL configs at one chunk of the sparse
backward (bf16 rows, S = 131072 causal keys picked at random); prints GB/s of rows read.
  c131072: job c131072's S layer, kernels form: Tc = 1024 queries x K = 2048 slots, G = 2 x F = 512
  mla: absorbed MLA's products form: Tc = 529 queries x K = 2048 slots, W = 576 (dk + dv)

    python benchmarks/device/tune_sparse_reduce.py [c131072|mla]
"""

import itertools
import sys

import torch
import triton

from megatron_moe_hybrid.ops.sparse_attention import triton_sparse as ts


def main():
    torch.manual_seed(0)
    shape = sys.argv[1] if len(sys.argv) > 1 else "c131072"
    B, Tc, K, G, F, S = {"c131072": (1, 1024, 2048, 2, 512, 131072), "mla": (1, 529, 2048, 1, 576, 131072)}[shape]
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
    for BW, BL, nw in itertools.product((64, 256, 512, 1024), (8, 16, 32), (4, 8)):
        grid = (B * S, triton.cdiv(W, BW))

        def run():
            ts._bwd_reduce_kernel[grid](C, order, offsets, acc, W, 1, W, 0, W, 1, BW=BW, BL=BL, num_warps=nw,
                                        num_stages=1)

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
