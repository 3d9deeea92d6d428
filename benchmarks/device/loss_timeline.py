"""Kernel timeline of one linear+CE fwd+bwd step (torch.profiler): per-kernel time and cross-stream overlap."""
import collections
import torch
from torch.profiler import profile, ProfilerActivity
from megatron_moe_hybrid.ops.cross_entropy.triton import triton_linear_cross_entropy
import megatron_moe_hybrid.ops.cross_entropy.triton as T

N, D, V = 16384, 4096, 151936
torch.manual_seed(0)
h = (torch.randn(N, D, device="cuda") / 2).bfloat16().requires_grad_()
W = (torch.randn(V, D, device="cuda") / D**0.5).bfloat16().requires_grad_()
lab = torch.randint(0, V, (N,), device="cuda")
for C in (512, 1024):
    def step():
        loss = triton_linear_cross_entropy(h, W, lab, chunk_size=C)
        torch.autograd.grad(loss, [h, W])
    for _ in range(2): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = collections.defaultdict(lambda: [0, 0.0])
    ivs = []
    for e in evs:
        k = e.name[:60]
        per[k][0] += 1; per[k][1] += e.device_time_total / 1000
        ivs.append((e.time_range.start / 1000, e.time_range.end / 1000, k))
    t0 = min(s for s, _, _ in ivs); t1 = max(e for _, e, _ in ivs)
    print(f"C{C}: span {t1 - t0:.2f} ms, kernel sum {sum(v[1] for v in per.values()):.2f} ms")
    for k, (n, ms) in sorted(per.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"   {ms:8.2f} ms  x{n:4d}  {k}")
    # which gemm overlaps which: print first 12 intervals of chunk 3
    ivs.sort()
    for s, e, k in ivs[40:60]:
        print(f"   {s - t0:9.3f} {e - t0:9.3f} {e - s:7.3f} {k[:50]}")
