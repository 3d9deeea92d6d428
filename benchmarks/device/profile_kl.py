"""Kernel-time table of chunked_indexer_kl_loss (forward + backward) at the GQA layer shape,
T = 16384 queries, K = 2048, 64 x 128 indexer heads: python benchmarks/device/profile_kl.py OUT"""

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron_moe_hybrid.ops import sparse_attention as sa

T, H, G, D, K, HI, DI = 16384, 64, 4, 128, 2048, 64, 128
gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, T, H, D, generator=gen, device="cuda").bfloat16()
k = torch.randn(1, T, G, D, generator=gen, device="cuda").bfloat16()
v = torch.randn(1, T, G, D, generator=gen, device="cuda").bfloat16()
q_idx = (torch.randn(1, T, HI, DI, generator=gen, device="cuda") / 4).bfloat16().requires_grad_()
k_idx = (torch.randn(1, T, DI, generator=gen, device="cuda") / 4).bfloat16().requires_grad_()
w = (torch.randn(1, T, HI, generator=gen, device="cuda") / 4).bfloat16().requires_grad_()
idx = sa.lightning_indexer_topk(q_idx.detach(), k_idx.detach(), w.detach(), K)
lse = sa.sparse_attention(q, k, v, idx)[1]


def step():
    loss, _ = sa.chunked_indexer_kl_loss(q, k, q_idx, k_idx, w, idx, lse=lse)
    torch.autograd.grad(loss, (q_idx, k_idx, w))


for _ in range(2):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    step()
    torch.cuda.synchronize()
out = sys.argv[1] if len(sys.argv) > 1 else "."
with open(os.path.join(out, "profile_kl.txt"), "w") as f:
    f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30))
    f.write("\n\nCPU\n")
    f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22))
