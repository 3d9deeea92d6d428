"""The MoE router alone on one GPU, forward + backward: ours fused against its eager reference
and Megatron-Core 0.16's TopKRouter.

    python benchmarks/router.py [--out benchmarks/results/h200/router.json] [--reps 50]

Ours is TopKRouter with moe.router_backend "auto": the gate GEMM on split-precision bf16
operands (one Triton split kernel each way), then one Triton kernel for scores, the top-k
choice, the weights, the z-loss's logsumexp and the balance loss's per-expert sums and
counts, and one for the backward. The first anchor is the same module on "torch": the
plain-PyTorch reference router (softmax or sigmoid, a stable sort of [T, E], gather,
normalisation, the losses from the scores). The second is Megatron-Core's TopKRouter (fp32
router dtype, no Transformer Engine: its gate GEMM in fp32), on the same tokens and gate,
with its load-balancing loss "aux_loss" or "none". Inputs: bf16 tokens, an fp32 gate
[E, h]. Each row times a synchronised forward + backward (the host's launches included, as
a step sees them when the GPU waits on the router; median of --reps), and gives the GPU
kernel time and kernel count of one step from the profiler.
"""

import argparse
import os
import sys
import traceback
import types

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import time_and_peak, write_results  # noqa: E402

CASES = {  # name: T, h, E, K, score_func, norm_topk_prob, expert_bias
    "S1 (moe.py)": (16384, 2048, 64, 8, "softmax", None, False),
    "Qwen3-Next": (16384, 2048, 512, 10, "softmax", True, False),
    "DeepSeek-V3": (8192, 7168, 256, 8, "sigmoid", None, True),
    "flagship": (8192, 7168, 896, 16, "sigmoid", None, True),
}


def shape_name(case) -> str:
    t, h, e, k, score_func, norm, bias = case
    extra = "-norm" if norm else ""
    return f"T{t}-H{h}-E{e}-K{k}-{score_func}{extra}{'-bias' if bias else ''}"


def build_ours(case, backend, aux):
    from megatron.core.transformer import TransformerConfig

    from megatron_moe_hybrid.layers.moe.router import TopKRouter

    t, h, e, k, score_func, norm, bias = case
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=16, params_dtype=torch.bfloat16)
    cfg.moe = types.SimpleNamespace(
        num_experts=e, topk=k, score_func=score_func, norm_topk_prob=norm, num_groups=1, topk_groups=1,
        routed_scaling_factor=1.0, aux_loss_coeff=aux, aux_loss_type="micro_batch", z_loss_coeff=0.0,
        capacity_factor=None, drop_policy="probs", bias_update_rate=1e-3, expert_bias=bias, router_backend=backend,
    )
    with torch.device("cuda"):
        router = TopKRouter(cfg).train()
    return router


def build_megatron(case, aux):
    import megatron.core.transformer.moe.moe_utils as mu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    if not mu.HAVE_TE:
        mu.te_general_gemm = None  # else the gating GEMM raises NameError without TE
    t, h, e, k, score_func, norm, bias = case
    cfg = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=16, num_moe_experts=e, moe_router_topk=k,
        moe_router_score_function=score_func, moe_router_pre_softmax=score_func == "softmax",
        moe_router_load_balancing_type="aux_loss" if aux else "none", moe_aux_loss_coeff=aux,
        moe_router_enable_expert_bias=bias, moe_router_dtype="fp32", bf16=True, params_dtype=torch.bfloat16,
        add_bias_linear=False,
    )
    router = TopKRouter(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).cuda().train()
    router.set_layer_number(1)
    return router


def kernels_of(step):
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return round(sum(e.device_time for e in events) / 1e3, 4), len(events)


def measure(step, reps):
    ms, peak = time_and_peak(step, 5, reps)
    gpu_ms, kernels = kernels_of(step)
    return dict(ms=round(ms, 4), peak=peak, gpu_ms=gpu_ms, kernels=kernels)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/h200/router.json")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    from megatron.core import parallel_state as ps

    megatron_error = None
    try:
        from megatron_moe_hybrid.parallel.launch import init_one_process_group

        init_one_process_group("nccl")
        ps.initialize_model_parallel()
    except Exception as error:  # noqa: BLE001 - Megatron failing leaves its rows null
        traceback.print_exc()
        megatron_error = f"{type(error).__name__}: {error}"
    rows = []
    for name, case in CASES.items():
        t, h, e, k = case[:4]
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, h, device="cuda", generator=gen).bfloat16().requires_grad_(True)
        g = torch.randn(t, k, device="cuda", generator=gen)
        for aux in (0.0, 1e-2):
            res, out = {}, {}
            for backend in ("auto", "torch"):
                torch.manual_seed(0)
                router = build_ours(case, backend, aux)
                weight = router.weight.detach().clone()

                def step(router=router):
                    probs, _ = router(x)
                    probs.backward(g)

                res[backend] = measure(step, args.reps)
                with torch.no_grad():
                    out[backend] = router(x)
                del router
            same = float((out["torch"][1] == out["auto"][1]).all(-1).float().mean())
            err = float((out["torch"][0] - out["auto"][0]).abs().max())
            mega, mega_error = None, megatron_error
            if mega_error is None:
                try:
                    router = build_megatron(case, aux)
                    with torch.no_grad():
                        router.weight.copy_(weight)
                    g_dense = torch.randn(t, e, device="cuda", generator=gen)

                    def step_megatron(router=router):
                        probs, _ = router(x.view(t, 1, h))
                        probs.backward(g_dense)

                    mega = measure(step_megatron, args.reps)
                    del router
                except Exception as error:  # noqa: BLE001
                    traceback.print_exc()
                    mega_error = f"{type(error).__name__}: {str(error)[:300]}"
            ours = res["auto"]
            common = dict(
                name=f"router fwd+bwd, aux loss {'on' if aux else 'off'}", shape=shape_name(case) + "-bf16",
                ours_ms=ours["ms"], ours_peak_mem_bytes=ours["peak"], ours_gpu_ms=ours["gpu_ms"],
                ours_kernels=ours["kernels"], rows_with_the_reference_experts=same,
                probs_max_abs_diff_vs_reference=err,
            )
            for anchor, r, why in (("eager reference (moe.router_backend: torch)", res["torch"], None),
                                   ("Megatron-Core 0.16.1 TopKRouter (fp32 router dtype, no TE)", mega, mega_error)):
                row = dict(common, anchor=anchor, anchor_ms=None if r is None else r["ms"])
                row["speedup"] = None if r is None else round(r["ms"] / ours["ms"], 3)
                row["target_speedup"] = None
                if r is not None:
                    row.update(anchor_peak_mem_bytes=r["peak"], anchor_gpu_ms=r["gpu_ms"], anchor_kernels=r["kernels"])
                row["notes"] = (
                    f"aux_loss_coeff {aux}, z-loss off; median of {args.reps} synchronised fwd+bwd calls after 5; "
                    "gpu_ms / kernels: one step in the profiler" + ("" if why is None else f"; anchor failed: {why}")
                )
                rows.append(row)
                print(f"{row['name']:30s} {row['shape']:40s} ours {row['ours_ms']:.3f} ms ({ours['kernels']} kernels) | "
                      f"{anchor[:30]:30s} {row['anchor_ms']} ms -> {row['speedup']}", flush=True)
            write_results(args.out, rows)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
