"""Linear+CE on the H200: ours at several (chunk, buffers) against Liger in one process; row-kernel times."""
import json, os, statistics
import torch
from megatron_moe_hybrid.ops.cross_entropy.triton import triton_linear_cross_entropy, auto_chunk_size, _partial_stats, _splits
import megatron_moe_hybrid.ops.cross_entropy.triton as T

def t(fn, reps=8, warm=2):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

def liger(h, W, lab):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    return liger_fused_linear_cross_entropy(h, W, lab)

out = {}
for N, D, V in [(16384, 4096, 151936), (32768, 7168, 262144)]:
    torch.manual_seed(0)
    h = (torch.randn(N, D, device="cuda") / 2).bfloat16()
    W = (torch.randn(V, D, device="cuda") / D**0.5).bfloat16()
    lab = torch.randint(0, V, (N,), device="cuda"); lab[torch.rand(N, device="cuda") < 0.05] = -100
    inputs = (h.numel() + W.numel()) * 2
    # row kernels alone
    C = 512
    buf = torch.randn(C, V, device="cuda").bfloat16(); loc = lab[:C].clamp(min=-1).contiguous()
    print("splits", _splits(C, V), "stats ms", round(t(lambda: _partial_stats(buf, loc), 20, 3), 4), flush=True)
    del buf
    for trainable in (True, False):
        h.requires_grad_(True); W.requires_grad_(trainable)
        leaves = [h, W] if trainable else [h]
        grads = (h.numel() + (W.numel() if trainable else 0)) * 2
        auto = auto_chunk_size(N, D, V, trainable)
        cands = [("liger", None, None)] + [("ours", c, b) for c, b in
                 [(auto, 1), (auto // 2 // 128 * 128, 2), (512, 1), (1024, 1), (2048 if D == 7168 else 768, 1)]]
        for name, c, b in cands:
            def step():
                loss = liger(h, W, lab) if name == "liger" else triton_linear_cross_entropy(h, W, lab, chunk_size=c, buffers=b)
                torch.autograd.grad(loss, leaves)
            torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
            try:
                step(); torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
                ms = t(step, reps=8 if D == 4096 else 4, warm=1)
            except Exception as e:
                print(name, c, b, "failed", e); continue
            key = f"N{N}-D{D}-V{V}-{'trainable' if trainable else 'frozen'}-{name}-C{c}-B{b}"
            r = {"ms": round(ms, 2), "peak": peak, "over_grads": round(peak / grads, 3),
                 "incl_inputs_over_inputs_grads": round((peak + inputs) / (inputs + grads), 3)}
            out[key] = r
            print(key, r, flush=True)
    h.requires_grad_(False); W.requires_grad_(False)
    del h, W
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "loss_probe.json"), "w"), indent=1)
