"""The dense warm-up step (sparse_attention.stage dense_warmup): the indexer KL losses backwarded
alone against the same losses carried on the layers' outputs through the LM loss's backward.

    python benchmarks/dense_warmup.py                                    # one GPU: results/<h200|h100>/dense_warmup.json
    python benchmarks/dense_warmup.py --tiny --out /tmp/dense_warmup.json  # CPU smoke run of the same code
    python benchmarks/dense_warmup.py --cpu --out benchmarks/results/cpu/dense_warmup.json

One model (offload.py's ~1.2B hybrid MoE: 8 layers LLLS x 2, bf16, EP=1, no FSDP) frozen as the
trainer freezes it (training/trainer.py: freeze_all_but_indexers: only the two S layers'
indexers train), the same tokens, one step being a forward + backward (no optimizer; gradients
freed after each step):
  carried  each S layer carries its scaled KL loss on its output (MoEAuxLossAutoScaler), and the
           LM loss's backward takes it down: activation gradients through every layer after the
           first S layer, and their saved activations kept (the trainer's form before 2026-12-07);
  handed   each S layer hands its loss to a list (indexer_loss_sink) and the step backwards their
           sum alone: the frozen main path builds no graph (the trainer's form now).
Each form: median step time over --reps steps after --warmup (CUDA events on the GPU, the host
clock on the CPU) and peak memory allocated above what was live before its first step (GPU
only). The two forms' indexer gradients are compared (relative RMS; they are the same sums in
the same order, so bitwise on the CPU). The row's speedup is carried_ms / handed_ms.
"""

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from offload import MODEL, TINY, batch, build, measure, one_process_group, write  # noqa: E402

FORMS = ("carried", "handed")
WARMUP = dict(stage="dense_warmup", indexer_loss_coeff=0.01)


def run(raw, device, warmup, reps) -> dict:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_moe_hybrid.testing import rel_rms
    from megatron_moe_hybrid.training.trainer import freeze_all_but_indexers

    cuda = device.type == "cuda"
    config, model = build(raw, device)
    freeze_all_but_indexers(model)
    layers = model.indexer_layers()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    inputs, labels, position_ids = batch(config, device)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    results, grads = {}, {}
    for form in FORMS:
        sink = [] if form == "handed" else None
        for layer in layers:
            layer.indexer_loss_sink = sink

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(inputs, position_ids, None, labels=labels).mean()
            if sink is None:
                loss.backward()
            else:
                torch.stack(sink).sum().backward()
                sink.clear()

        try:
            ms, peak = measure(step, warmup, reps, cuda)
            grads[form] = [p.grad.float().clone() for _, p in trained]
            results[form] = dict(ms=round(ms, 3), peak_mem_bytes=peak)
        except torch.OutOfMemoryError as e:
            results[form] = {"error": f"OutOfMemoryError: {str(e)[:200]}"}
        print(form, results[form], flush=True)
        if cuda:
            torch.cuda.empty_cache()
    if len(grads) == 2:
        results["handed"]["grad_rel_rms"] = max(rel_rms(a, b) for a, b in zip(grads["handed"], grads["carried"]))
        results["handed"]["grads_bitwise"] = all(torch.equal(a, b) for a, b in zip(grads["handed"], grads["carried"]))
        if not all(g.abs().sum() > 0 for g in grads["handed"]):
            raise RuntimeError("an indexer weight got no gradient: the warm-up trains nothing there")
    results["trained_tensors"] = len(trained)
    return results


def row(results, raw, args, device_name) -> dict:
    m, t = raw["model"], raw["training"]
    ours, anchor = results["handed"], results["carried"]
    ok = "ms" in ours and "ms" in anchor
    shape = (f"L{m['num_layers']}-{m['pattern']}-H{m['hidden_size']}-E{raw['moe']['num_experts']}-K{raw['moe']['topk']}"
             f"-B{t['micro_batch_size']}-T{t['seq_length']}-{m['params_dtype']}")
    return {
        "name": "dense warm-up step", "shape": shape,
        "ours_ms": ours.get("ms"), "anchor": "the KL losses carried on the layer outputs (LM loss's backward)",
        "anchor_ms": anchor.get("ms"), "speedup": round(anchor["ms"] / ours["ms"], 3) if ok else None,
        "ours_peak_mem_bytes": ours.get("peak_mem_bytes"), "anchor_peak_mem_bytes": anchor.get("peak_mem_bytes"),
        "grad_rel_rms": ours.get("grad_rel_rms"), "grads_bitwise": ours.get("grads_bitwise"),
        "trained_tensors": results["trained_tensors"],
        "notes": f"forward+backward, no optimizer; median of {args.reps} steps after {args.warmup} on "
                 f"{device_name}; every weight frozen but the S layers' indexers (freeze_all_but_indexers); "
                 f"indexer_loss_coeff {raw['sparse_attention']['indexer_loss_coeff']}; memory.recompute_layers "
                 f"{raw['memory']['recompute_layers']}",
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the tiny config on the CPU (smoke run)")
    ap.add_argument("--cpu", action="store_true", help="the CPU, at --seq tokens of a mid-size model")
    ap.add_argument("--seq", type=int, default=None, help="override training.seq_length")
    ap.add_argument("--recompute", type=int, default=0,
                    help="memory.recompute_layers of the model (the trainer applies none in the warm-up)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    raw = {k: dict(v) for k, v in (TINY if args.tiny else MODEL).items()}
    raw["sparse_attention"].update(WARMUP)
    raw["model"]["num_layers"] = 8  # two S layers: the first one's loss backwards through the second
    if args.cpu:  # fp32, and small enough for a laptop-class CPU
        raw["model"].update(hidden_size=256, num_attention_heads=4, num_query_groups=2, kv_channels=64,
                            vocab_size=8192, params_dtype="float32")
        raw["linear_attention"].update(num_qk_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64)
        raw["moe"].update(ffn_hidden_size=256, shared_expert_ffn_hidden_size=256)
        raw["training"]["seq_length"] = 1024
    if args.seq is not None:
        raw["training"]["seq_length"] = args.seq
    raw["memory"] = dict(raw["memory"], recompute_layers=args.recompute)
    args.reps = args.reps or (3 if (args.tiny or args.cpu) else 8)
    cuda = torch.cuda.is_available() and not (args.tiny or args.cpu)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    if args.out is None:
        card = "h100" if "H100" in device_name else "h200"
        args.out = os.path.join(HERE, "results", card if cuda else "cpu", "dense_warmup.json")
    with one_process_group():
        results = run(raw, device, args.warmup, args.reps)
        write(args.out, [row(results, raw, args, device_name)], device_name)


if __name__ == "__main__":
    main()
