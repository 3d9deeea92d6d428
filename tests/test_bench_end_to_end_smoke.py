"""CPU run of benchmarks/end_to_end.py --tiny: the whole issue-12 pipeline on a tiny Qwen3-Next
(HF model with random weights, saved, converted with tools/convert_checkpoint.py, trained on
both sides). In fp32 on the CPU, HF's torch path and ours compute the same model, so the
first losses agree to rounding and the LoRA curves stay far within the 2% the issue asks; the
full-parameter jobs train the same weights on both sides; the step breakdown adds up.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
pytest.importorskip("peft")


def _run(args, out, launcher=()):
    """Rows of `end_to_end.py --tiny <args>` (2 timed steps after 1, 128 tokens a step)."""
    cmd = [sys.executable, *launcher, os.path.join(ROOT, "benchmarks", "end_to_end.py"), "--tiny",
           "--steps", "2", "--warmup", "1", "--tokens", "128", "--out", str(out), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.load(open(out))["rows"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "end_to_end.json"
    found = _run(["--jobs", "a64,b64x2,c64", "--curve_steps", "12"], out)
    return {r["name"].rsplit("(", 1)[-1].rstrip(")"): r for r in found}


def test_every_job_ran_on_both_sides(rows):
    assert set(rows) == {"a64", "b64x2", "c64"}
    for name, r in rows.items():
        assert "ours_error" not in r and "anchor_error" not in r, name
        assert r["ours_ms"] > 0 and r["tokens_per_s_per_gpu"] > 0 and r["model_tflops"] >= 0, name
    assert rows["a64"]["anchor_ms"] > 0 and rows["b64x2"]["anchor_ms"] > 0
    assert "anchor_ms" not in rows["c64"]  # the sparse pattern has no HF counterpart


def test_lora_losses_match_hf_and_fall(rows):
    a = rows["a64"]
    assert a["first_loss_rel_diff"] < 1e-5, a["first_loss_rel_diff"]
    assert a["curve_steps"] == 12 and a["curve_within_2pct"] and a["curve_max_rel_diff"] < 1e-3
    ours, anchor = a["ours"]["losses"], a["anchor_detail"]["losses"]
    assert ours[-1] < ours[0] - 0.02 and anchor[-1] < anchor[0] - 0.02  # both learn the token map
    # the same adapters: rank 16 on attention and every expert (ours fuses GDN's in_proj_qkvz
    # and in_proj_ba into one projection, so one A instead of two)
    assert 0.95 < a["ours"]["trainable_params"] / a["anchor_detail"]["trainable_params"] <= 1.0


def test_full_training_trains_the_same_weights(rows):
    b = rows["b64x2"]
    assert b["ours"]["trainable_params"] == b["anchor_detail"]["trainable_params"]
    for o, h in zip(b["ours"]["losses"], b["anchor_detail"]["losses"]):
        assert abs(o - h) <= 1e-4 * abs(h), (o, h)


def test_breakdown_adds_up(rows):
    for name, r in rows.items():
        for parts in (r["breakdown"], r.get("anchor_breakdown")):
            if parts is None:
                continue
            named = ("attention_ms", "moe_ms", "loss_ms", "optimizer_ms")
            assert all(parts[k] > 0 for k in named), (name, parts)
            inner = parts["moe_router_ms"] + parts["moe_experts_ms"] + parts["moe_shared_expert_ms"]
            assert 0 < inner <= parts["moe_ms"], (name, parts)
            assert sum(parts[k] for k in named) <= parts["step_ms"] * 1.05, (name, parts)



def test_c_jobs_without_the_anchor_need_only_the_config(rows, tmp_path):
    """--no_anchor with only c jobs (trained from Megatron's init) writes our config and no HF
    model; the run is the one after a full conversion."""
    work = tmp_path / "work"
    (c,) = _run(["--jobs", "c64", "--no_anchor", "--workdir", str(work)], tmp_path / "c.json")
    assert not (work / "hf").exists() and (work / "ours" / "config.yaml").is_file()
    assert c["ours"]["losses"] == rows["c64"]["ours"]["losses"]


def test_ep2_run_equals_one_process_on_the_global_batch(tmp_path):
    """torchrun with 2 ranks (gloo): experts split over EP=2, each rank on its own batches,
    dense gradients summed; its losses (averaged over the ranks) equal one process trained on
    both ranks' batches (--emulate_ranks 2), LoRA and full-parameter, step after step."""
    launcher = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone")
    args = ["--no_anchor", "--jobs", "a64,b64x1", "--curve_steps", "3"]
    ep = _run(args, tmp_path / "ep2.json", launcher)
    one = _run([*args, "--emulate_ranks", "2"], tmp_path / "one.json")
    assert [r["gpus"] for r in ep] == [2, 2] and [r["gpus"] for r in one] == [1, 1]
    for r_ep, r_one in zip(ep, one):
        assert r_ep["name"].endswith("EP=2)"), r_ep["name"]
        got, want = r_ep["ours"]["losses"], r_one["ours"]["losses"]
        assert len(got) == len(want) == 3  # a64: --curve_steps 3; b64x1: 2 timed + 1 warm-up
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-5 * abs(w), (r_ep["name"], got, want)
        assert got[-1] != got[0]  # the steps moved the weights


def test_active_parameter_count_and_flops(tmp_path):
    """count_active: every matmul weight a token passes through (all of attention, the router,
    top-k of E experts, the shared expert, the output layer; not the embedding), counted here
    independently from the parameter names; step_flops: 6N (4N under LoRA) per token plus
    attention, linear in B."""
    import importlib.util

    import torch

    from megatron_moe_hybrid.testing import init_megatron, teardown

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("e2e", os.path.join(ROOT, "benchmarks", "end_to_end.py"))
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    init_megatron()
    try:
        hf = e2e.make_hf_model(e2e.hf_config(True), torch.device("cpu"), torch.float32, seed=0)
        hf.save_pretrained(tmp_path / "hf")
        run = e2e.convert_to_ours(str(tmp_path / "hf"), str(tmp_path / "ours"), torch.float32)
        config, model = e2e.our_model(run, torch.device("cpu"), "LLLA", 64, True, load=True)
        counts = e2e.count_active(model, config)
        E, K = config.moe.num_experts, config.moe.topk
        want = 0
        for name, p in model.named_parameters():
            if p.dim() < 2 or name.startswith("embedding") or "conv1d" in name:
                continue
            want += p.numel() * K // E if ".experts." in name else p.numel()
        assert counts["active_matmul_params"] == want
        assert counts["layers"] == {"L": 3, "A": 1}
        f1 = e2e.step_flops(config, counts, 1, 64, "full")
        assert e2e.step_flops(config, counts, 2, 64, "full") == 2 * f1
        assert f1 - e2e.step_flops(config, counts, 1, 64, "lora") == 2 * want * 64
    finally:
        teardown()
