"""Can a Triton grad_weight += G^T H (prefetching the old tile) beat cuBLAS addmm_ at small K?"""
import statistics
import torch, triton, triton.language as tl

@triton.jit
def gw_kernel(g_ptr, h_ptr, w_ptr, C, V, D, stride_g, stride_h, stride_w,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(V, BM); num_n = tl.cdiv(D, BN)
    width = GROUP * num_n
    group = pid // width
    first_m = group * GROUP
    size = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % size
    pid_n = (pid % width) // size
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < V) & (offs_n[None, :] < D)
    p_w = w_ptr + offs_m[:, None].to(tl.int64) * stride_w + offs_n[None, :]
    if PREFETCH:
        old = tl.load(p_w, mask=mask, other=0.0)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, C, BK):
        offs_k = k + tl.arange(0, BK)
        a = tl.load(g_ptr + offs_k[:, None].to(tl.int64) * stride_g + offs_m[None, :], mask=(offs_k[:, None] < C) & (offs_m[None, :] < V), other=0.0)
        b = tl.load(h_ptr + offs_k[:, None].to(tl.int64) * stride_h + offs_n[None, :], mask=(offs_k[:, None] < C) & (offs_n[None, :] < D), other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    if not PREFETCH:
        old = tl.load(p_w, mask=mask, other=0.0)
    acc += old.to(tl.float32)
    tl.store(p_w, acc.to(w_ptr.dtype.element_ty), mask=mask)

def gw(G, H, W, BM, BN, BK, warps, stages, prefetch=True):
    C, V = G.shape; D = H.shape[1]
    grid = (triton.cdiv(V, BM) * triton.cdiv(D, BN),)
    gw_kernel[grid](G, H, W, C, V, D, G.stride(0), H.stride(0), W.stride(0), BM=BM, BN=BN, BK=BK, GROUP=8,
                    PREFETCH=prefetch, num_warps=warps, num_stages=stages)

def t(fn, reps=20, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

V, D = 151936, 4096
W0 = (torch.randn(V, D, device="cuda") / 64).bfloat16()
for C in (512, 1024):
    G = (torch.randn(C, V, device="cuda") / 100).bfloat16(); H = torch.randn(C, D, device="cuda").bfloat16()
    f = 2 * C * V * D / 1e9
    ref = W0.clone(); ref.addmm_(G.T, H)
    W = W0.clone()
    ms = t(lambda: W.addmm_(G.T, H))
    print(f"C{C} cublas addmm_: {ms:.3f} ms {f/ms:.0f} TF/s", flush=True)
    for cfg in [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4)]:
        for pre in (True, False):
            W = W0.clone()
            try:
                gw(G, H, W, *cfg, prefetch=pre)
                err = ((W.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                ms = t(lambda: gw(G, H, W, *cfg, prefetch=pre))
                print(f"C{C} triton {cfg} prefetch={pre}: {ms:.3f} ms {f/ms:.0f} TF/s err {err:.2e}", flush=True)
            except Exception as e:
                print(cfg, "failed", str(e)[:200], flush=True)
    del G, H, W, ref
