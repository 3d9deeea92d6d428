"""Chrome trace (CPU + CUDA) of our MoE layer's fwd+bwd (static dispatcher, 1 GPU) and the stack of every host sync."""
import os, sys, traceback, warnings
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch
from torch.profiler import profile, ProfilerActivity
import moe as B

key = sys.argv[1] if len(sys.argv) > 1 else "S1"
rank, world = B.init_distributed()
import megatron.core.transformer.moe.moe_utils as mu
mu.te_general_gemm = None
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
ep_group = parallel_state.get_expert_model_parallel_group()
spec = B.SHAPES[key]
h, E, K, F_, T = (spec[k] for k in ("hidden", "experts", "topk", "ffn", "tokens"))
g = torch.Generator(device="cuda").manual_seed(0)
rw = B.make_router_weight(E, h, "balanced", 1.1, g, "cuda")
x = B.make_input(T, h, "balanced", g, "cuda")
go = torch.randn(T, h, generator=g, device="cuda").bfloat16()
w1 = torch.randn(E, h, 2 * F_, generator=g, device="cuda", dtype=torch.bfloat16) / h**0.5
w2 = torch.randn(E, F_, h, generator=g, device="cuda", dtype=torch.bfloat16) / F_**0.5
forward, params, info, _ = B.build_ours(spec, "static", ep_group, rw, w1, w2, x, 3, 10)()
xx = x.detach().requires_grad_()
def step():
    out = forward(xx)
    torch.autograd.grad(out, [xx] + params, go)
for _ in range(3): step()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step(); torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode(0)
print("syncs:", len(caught))
for w in caught:
    print("  ", str(w.message)[:200], w.filename, w.lineno)
# stack of syncs: re-run with error mode to get a traceback of the first one
torch.cuda.set_sync_debug_mode("error")
try:
    step(); torch.cuda.synchronize()
except RuntimeError:
    traceback.print_exc(limit=12)
torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
    step(); torch.cuda.synchronize()
prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "."), f"moe_{key}.json"))


def idle_gaps(trace_path, min_us=15):
    """GPU idle gaps longer than min_us in the trace, each with the CPU ops that launched the next kernel."""
    import json

    events = json.load(open(trace_path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"}
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    start, end = kernels[0]["ts"], kernels[0]["ts"] + kernels[0]["dur"]
    busy = sum(e["dur"] for e in kernels)
    print(f"span {(max(e['ts'] + e['dur'] for e in kernels) - start) / 1e3:.2f} ms, kernels busy {busy / 1e3:.2f} ms, {len(kernels)} kernels")
    total = 0.0
    for e in kernels[1:]:
        gap = e["ts"] - end
        if gap > min_us:
            total += gap
            launch = launches.get(e["args"].get("correlation"))
            inner = sorted((c for c in cpu_ops if launch and c["ts"] <= launch["ts"] <= c["ts"] + c["dur"]), key=lambda c: c["dur"])
            print(f"  idle {gap:6.0f} us at {(e['ts'] - start) / 1e3:7.3f} ms before {e['name'][:40]:40s} <- {[c['name'] for c in inner[:3]]}")
        end = max(end, e["ts"] + e["dur"])
    print(f"idle gaps > {min_us} us: {total / 1e3:.2f} ms")


idle_gaps(os.path.join(os.environ.get("OUT", "."), f"moe_{key}.json"))
