"""What the flagship's layers hold, measured on this GPU with our kernels (tools/plan.py's
probe), for the planner's verdict on examples/clusters/h200_128.yaml.

A flagship MoE layer with its 896 experts does not fit one device whole, so the probe runs one
period of the pattern (LLLS twice: the first layer is dense) at 16 and 64 experts and carries
the bytes per token to 896 (tools/plan.py carry_probes); a third probe at half the length shows
which bytes are per token and which are not.

    python benchmarks/device/probe_flagship_memory.py OUT_DIR [SEQ]   # SEQ 8192: 64 experts fill ~110 GB
"""

import importlib.util
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "tools", "plan.py"))
plan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)

from megatron_moe_hybrid.config import load_config  # noqa: E402


def main(out: str, seq: int = 8192) -> None:
    os.makedirs(out, exist_ok=True)
    cluster = plan.load_cluster(os.path.join(ROOT, "examples", "clusters", "h200_128.yaml"), {})
    config = load_config(os.path.join(ROOT, "examples", "configs", "flagship_2p8t.yaml"),
                         {"parallel.world_size": cluster.accelerators})
    probes, runs = {}, []
    for experts, length in ((16, seq), (64, seq), (16, seq // 2)):
        torch.cuda.empty_cache()
        start = time.perf_counter()
        try:
            p = plan.probe_activations(config, cluster, "cuda", num_experts=experts, seq_length=length)
            error = None
        except torch.OutOfMemoryError as e:
            p, error = None, f"out of memory: {str(e).splitlines()[0]}"
        runs.append({"num_experts": experts, "seq_length": length, "seconds": round(time.perf_counter() - start, 1),
                     "error": error,
                     "probe": None if p is None else {k: p[k] for k in plan.PROBE_KEYS}})
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "probe"}), flush=True)
        if p is not None:
            probes[(experts, length)] = p
    carried = plan.carry_probes(probes[(16, seq)], probes[(64, seq)], config.moe.num_experts)
    carried["model"] = plan.probe_model(config)
    with open(os.path.join(out, "flagship_probe.json"), "w") as f:
        json.dump(carried, f, indent=1, default=float)
        f.write("\n")
    verdicts = {}
    for name, over in (("lora-T32768", {"seq_length": 32768}), ("lora-T16384", {"seq_length": 16384}),
                       ("lora-T8192", {"seq_length": 8192})):
        cl = plan.load_cluster(os.path.join(ROOT, "examples", "clusters", "h200_128.yaml"), over)
        measured, analytic = plan.plan(config, cl, carried), plan.plan(config, cl)
        verdicts[name] = {"probe": {k: measured[k] for k in ("per_device_bytes", "peak_bytes", "budget_bytes", "fits")},
                          "analytic": {k: analytic[k] for k in ("per_device_bytes", "peak_bytes", "fits")}}
        print(name, "probe", round(measured["peak_bytes"] / 2**30, 2), measured["fits"],
              "analytic", round(analytic["peak_bytes"] / 2**30, 2), analytic["fits"], flush=True)
    # The plan against a measured step at the flagship's widths, on one GPU: 8 layers, 16 experts,
    # LoRA on a bf16 base, full recompute, two micro-batches and AdamW (tools/plan.py --measure).
    small = load_config(os.path.join(ROOT, "examples", "configs", "flagship_2p8t.yaml"),
                        {"parallel.world_size": 1, "parallel.expert_model_parallel_size": 1, "parallel.fsdp": False,
                         "model.num_layers": 8, "moe.num_experts": 16})
    one = plan.Cluster(accelerators=1, devices_per_node=1, expert_model_parallel_size=1, fsdp=False,
                       training="lora", recompute="full", seq_length=seq, hbm_gib=141.0)
    torch.cuda.empty_cache()
    start = time.perf_counter()
    probe = plan.probe_activations(small, one, "cuda")
    predicted, analytic = plan.plan(small, one, probe), plan.plan(small, one)
    measured = plan.measure_peak(small, one, "cuda")
    check = {"shape": f"L8-LLLS-H7168-E16-K16-B1-T{seq}-lora-recompute", "predicted_peak_bytes": predicted["peak_bytes"],
             "analytic_peak_bytes": analytic["peak_bytes"], "measured_peak_bytes": measured,
             "predicted_over_measured": predicted["peak_bytes"] / measured,
             "analytic_over_measured": analytic["peak_bytes"] / measured,
             "terms_bytes": predicted["per_device_bytes"], "analytic_terms_bytes": analytic["per_device_bytes"],
             "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps({k: v for k, v in check.items() if "terms" not in k}), flush=True)
    with open(os.path.join(out, "flagship_memory.json"), "w") as f:
        json.dump({"runs": runs, "verdicts": verdicts, "check": check, "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__}, f, indent=1, default=float)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
