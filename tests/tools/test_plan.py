"""tools/plan.py: exact parameter counts, and the flagship's figures."""

import importlib.util
import json
import os

import pytest
import torch
import yaml

from megatron_moe_hybrid.config import config_from_dict, load_config
from megatron_moe_hybrid.testing import init_megatron, teardown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_tool():
    spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "tools", "plan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plan = _load_tool()

VARIANTS = {
    "tiny": {},
    "simple-gla-no-conv": {"linear_attention.variant": "simple_gla", "linear_attention.conv_kernel_size": 0},
    "dense-first-no-shared": {"moe.first_k_dense": 1, "moe.shared_expert_ffn_hidden_size": 0, "model.num_layers": 8},
    "pattern-LS-layernorm-mha": {"model.pattern": "LS", "model.num_layers": 4, "model.normalization": "LayerNorm",
                                 "model.num_query_groups": 4, "moe.num_experts": 6, "moe.topk": 3},
    "all-sparse": {"model.pattern": "S", "model.num_layers": 2, "sparse_attention.index_n_heads": 2},
    "qwen3-next-LLLA-gated-shared": {"model.pattern": "LLLA", "moe.shared_expert_gate": True},
    "deepseek-v32-LLLM": {"model.pattern": "LLLM"},
    "deepseek-v32-M-plain-q": {"model.pattern": "M", "model.num_layers": 2, "mla.q_lora_rank": None},
}


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    init_megatron()
    yield
    teardown()


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_parameter_count_equals_built_model(overrides):
    from megatron_moe_hybrid.models import build_model

    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    config = config_from_dict(raw, {"parallel.world_size": 1, **overrides})
    torch.manual_seed(0)
    model = build_model(config)
    numel = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in model.parameters() if hasattr(p, "num_local_experts"))
    counted = plan.count_parameters(config)
    assert counted["total"] == numel
    assert counted["routed_experts"] == experts


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_analytic_plan_of_every_layer_kind(overrides):
    """The fused-kernel activation model (no probe) covers every letter with MoE after it (its
    MLA branch once shadowed the MoE config: an AttributeError for any M model)."""
    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    config = config_from_dict(raw, {"parallel.world_size": 1, **overrides})
    cluster = plan.Cluster(accelerators=1, expert_model_parallel_size=1, seq_length=256)
    result = plan.plan(config, cluster)
    assert result["peak_bytes"] > 0
    for i in range(config.num_layers):
        kind = config.layer_kind(i)
        assert plan._activation_bytes_per_token(config, kind, config.is_moe_layer(i), seq_length=256) > 0, kind


ALL_GROUPS = ["linear_attention", "sparse_attention", "full_attention", "indexer", "experts", "shared_expert", "dense_mlp"]


@pytest.mark.parametrize("expert_adapter", ["per_expert", "shared"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"model.pattern": "LLLM", "mla.q_lora_rank": 48}, {"model.pattern": "LLLM", "mla.q_lora_rank": None}, {"model.pattern": "LLLA"},
     {"model.pattern": "LLLS", "moe.first_k_dense": 1}],
    ids=["LLLS", "LLLM", "LLLM-plain-q", "LLLA", "LLLS-dense-first"],
)
def test_lora_parameter_count_equals_adapters(overrides, expert_adapter):
    """plan's analytic count of every target group equals the adapters apply_lora makes, group
    by group, and the default targets ("attention" + experts) take the pattern's attention kinds."""
    from megatron_moe_hybrid.layers.lora import apply_lora
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.registry import expand_lora_targets

    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    config = config_from_dict(raw, {"parallel.world_size": 1, **overrides})
    present = [g for g in ALL_GROUPS if plan.lora_parameters(config, 4, expert_adapter, [g]) > 0]
    assert set(present) >= {"linear_attention", "experts", "shared_expert"}
    assert ("dense_mlp" in present) == ("moe.first_k_dense" in overrides)
    for targets in [[g] for g in present] + [present, ["attention", "experts"]]:
        torch.manual_seed(0)
        model = build_model(config)
        apply_lora(model, targets, 4, 8.0, expert_adapter=expert_adapter)
        adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert plan.lora_parameters(config, 4, expert_adapter, targets) == adapters, targets
    kinds = {"S": "sparse_attention", "M": "sparse_attention", "A": "full_attention"}
    assert config.lora.targets == ["attention", "experts"]
    assert expand_lora_targets(config.lora.targets, config.pattern) == [
        "linear_attention", kinds[config.pattern[-1]], "experts"]  # fmt: skip


def flagship(**cluster_overrides):
    cluster = plan.load_cluster(os.path.join(ROOT, "examples", "clusters", "h200_128.yaml"), cluster_overrides)
    config = load_config(
        os.path.join(ROOT, "examples", "configs", "flagship_2p8t.yaml"),
        {"parallel.world_size": cluster.accelerators},
    )
    return config, cluster, plan.plan(config, cluster)


def test_flagship_figures():
    config, _, p = flagship()
    total = p["parameters"]["total"]
    assert abs(total - 2.8e12) / 2.8e12 <= 0.03, total
    assert abs(p["bf16_weights_bytes"] - 5.6e12) / 5.6e12 <= 0.03
    assert config.moe.num_experts == 896 and config.moe.topk == 16
    assert config.pattern == "LLLS" and config.sparse_attention.topk == 2048
    assert config.training.seq_length == 1 << 20


def test_flagship_lora_fits_full_needs_offload():
    _, _, lora = flagship()
    assert lora["fits"], lora["per_device_bytes"]
    _, _, full = flagship(training="full")
    assert not full["fits"] and full["dominant"] == "optimizer"
    _, _, offloaded = flagship(training="full", offload_optimizer=True)
    assert offloaded["fits"] and offloaded["fits_host"]


def test_cli_reports_and_rejects_bad_cluster(capsys):
    args = ["--config", os.path.join(ROOT, "examples", "configs", "flagship_2p8t.yaml"),
            "--cluster", os.path.join(ROOT, "examples", "clusters", "h200_128.yaml")]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "2.83T total" in out and "FITS" in out
    assert plan.main(args + ["--cluster.training", "full"]) == 1
    assert "DOES NOT FIT: the dominant term is optimizer" in capsys.readouterr().out
    assert plan.main(args + ["--cluster.accelerators", "100"]) == 2
    assert "cluster.accelerators" in capsys.readouterr().err


MEASURED = {
    "LLLS-full": ({}, {"training": "full"}),
    "LLLS-lora-T512": ({}, {"training": "lora", "seq_length": 512}),
    "LLLM-dense-first-full": ({"model.pattern": "LLLM", "moe.first_k_dense": 1}, {"training": "full", "micro_batch_size": 1}),
    # bf16 weights, gradients and Adam moments (AdamW straight on bf16 parameters, no master copy)
    "LLLS-full-bf16": ({"model.params_dtype": "bfloat16"},
                       {"training": "full", "weight_bytes": 2, "master_weights": False, "seq_length": 256}),
    # Adam's moments in bf16 (training.optimizer_state_dtype: bf16) on fp32 weights
    "LLLS-full-bf16-moments": ({}, {"training": "full", "optimizer_state_dtype": "bf16", "seq_length": 64}),
}


@pytest.mark.parametrize("model_ov,cluster_ov", list(MEASURED.values()), ids=list(MEASURED))
def test_planned_peak_is_within_10_percent_of_measured(model_ov, cluster_ov):
    """The planner with measured activations (--probe) against the peak of a real training step
    (two micro-batches, AdamW) of the same model on this CPU."""
    config = load_config(os.path.join(ROOT, "examples", "configs", "tiny.yaml"), {"parallel.world_size": 1, **model_ov})
    cluster = plan.Cluster(**{"accelerators": 1, "devices_per_node": 1, "expert_model_parallel_size": 1, "fsdp": False,
                              "micro_batch_size": 2, "seq_length": 128, "weight_bytes": 4, **cluster_ov})  # fmt: skip
    probe = plan.probe_activations(config, cluster)
    assert len(probe["layers"]) == config.num_layers and min(probe["layers"]) > 0
    predicted = plan.plan(config, cluster, probe)
    measured = plan.measure_peak(config, cluster)
    assert 0.9 <= predicted["peak_bytes"] / measured <= 1.1, (predicted["per_device_bytes"], measured)
    # activations are a large share here, so the check is not carried by the static terms alone
    assert predicted["per_device_bytes"]["activations"] > 0.3 * measured


def test_recompute_keeps_the_selection_of_the_sparse_layers_below(monkeypatch):
    """Under full recompute a sparse layer keeps its top-k selection (int32) and the indexer
    weights that check it until its recompute reuses it: alive during the backward of the layers
    above (8 layers LLLS x 2: the first S layer's, from layer 4 on), counted in the plan's
    activations. (On the H200, job c131072's peak grew by the 1 GiB this gives: docs/PERFORMANCE.md.) Not
    without recompute, and not under context parallelism, whose sparse core selects again."""
    config = load_config(os.path.join(ROOT, "examples", "configs", "tiny.yaml"),
                         {"parallel.world_size": 1, "model.num_layers": 8})
    cluster = plan.Cluster(accelerators=1, devices_per_node=1, expert_model_parallel_size=1, fsdp=False,
                           micro_batch_size=2, seq_length=256, weight_bytes=4, training="lora", recompute="full")
    per_layer = 4 * config.sparse_attention.topk + 4 * config.sparse_attention.index_n_heads
    assert plan.kept_for_recompute(config, cluster) == [0.0] * 4 + [float(per_layer)] * 4
    assert plan.kept_for_recompute(config, plan.Cluster(**{**vars(cluster), "recompute": "none"})) == [0.0] * 8
    assert plan.kept_for_recompute(config, plan.Cluster(**{**vars(cluster), "context_parallel_size": 2})) == [0.0] * 8
    # the plan's activations carry it: max over layers of (activations + kept), per token
    planned = plan.plan(config, cluster)["per_device_bytes"]["activations"]
    monkeypatch.setattr(plan, "kept_for_recompute", lambda c, cl: [0.0] * c.num_layers)
    without = plan.plan(config, cluster)["per_device_bytes"]["activations"]
    assert 0 < planned - without <= 2 * 256 * per_layer


def test_measure_refuses_a_cluster_it_cannot_run(capsys):
    tiny = os.path.join(ROOT, "examples", "configs", "tiny.yaml")
    assert plan.main(["--config", tiny, "--cluster.accelerators", "2", "--cluster.expert_model_parallel_size", "2",
                      "--training.global_batch_size", "16", "--measure"]) == 2  # fmt: skip
    assert "cluster.accelerators" in capsys.readouterr().err
    assert plan.main(["--config", tiny, "--cluster.accelerators", "1", "--cluster.expert_model_parallel_size", "1",
                      "--measure"]) == 2  # fmt: skip
    assert "pass --cluster.weight_bytes 4" in capsys.readouterr().err


def _ep_saved_worker(rank, world_size, factor, tokens):
    """One MoE layer's forward at EP=world_size and alone (EP=1) on this rank's tokens: the
    bytes autograd saves (unique storages, parameters excluded) and the static buffers' sizes."""
    import types

    import torch.distributed as dist
    from megatron.core.transformer import TransformerConfig

    from megatron_moe_hybrid.layers.moe import MoELayer

    torch.set_num_threads(1)
    solo = [dist.new_group([r]) for r in range(world_size)]
    init_megatron(rank, world_size, ep=world_size)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32)  # fmt: skip
    cfg.moe = types.SimpleNamespace(num_experts=8, topk=2, ffn_hidden_size=48, shared_expert_ffn_hidden_size=0,
                                    score_func="softmax", aux_loss_coeff=0.0, expert_bias=False,
                                    bias_update_rate=1e-3, capacity_factor=None, dispatcher="static",
                                    dispatch_capacity_factor=factor, dispatch_chunks=1)  # fmt: skip
    out = {}
    for name, group in (("ep", None), ("one", solo[rank])):
        torch.manual_seed(0)
        layer = MoELayer(cfg, ep_group=group)
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        x = torch.randn(tokens, 1, 32, generator=torch.Generator().manual_seed(rank))
        saved = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                saved[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
        st = layer.dispatcher.state
        out[name] = {"saved": sum(saved.values()), "send_rows": world_size * st.capacity if name == "ep" else None,
                     "expert_rows": st.num_rows}  # fmt: skip
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("factor", [2.0, 1.25])
def test_expert_parallel_rows_and_saved_bytes_are_planned(factor):
    """Under EP the static dispatcher's buffers are sized by moe.dispatch_capacity_factor, not
    by the tokens' routing: the plan's rows per token (dispatch_rows) are the dispatcher's own,
    and what an MoE layer saves beyond EP=1 is the extra rows x what it saves per row. Per row
    the CPU's reference experts save expert_row_bytes and one [R, F] more (the fused SwiGLU on
    the GPU does not: the H200 probe of the flagship, test_analytic_model_follows_the_h200_probe),
    plus the larger layout's indices and weights: under 64 bytes per row sent at K=2 (at the
    flagship's K=16 about 200 of the 14 KiB a row's hidden state takes: not planned)."""
    from megatron_moe_hybrid.testing import spawn

    ep, tokens = 4, 24
    results = spawn(_ep_saved_worker, ep, factor, tokens)
    config = load_config(os.path.join(ROOT, "examples", "configs", "tiny.yaml"),
                         {"parallel.world_size": ep, "model.hidden_size": 32, "moe.num_experts": 8, "moe.topk": 2,
                          "moe.ffn_hidden_size": 48, "moe.dispatch_capacity_factor": factor})  # fmt: skip
    cluster = plan.Cluster(accelerators=ep, devices_per_node=ep, expert_model_parallel_size=ep, seq_length=tokens)
    send, rows = plan.dispatch_rows(config, cluster)
    assert rows > config.moe.topk  # the factor's padding: more rows than the top-k copies
    for r in results:
        assert r["ep"]["send_rows"] == send * tokens and r["ep"]["expert_rows"] == rows * tokens
        assert r["one"]["expert_rows"] == config.moe.topk * tokens
        per_row = plan.expert_row_bytes(config, 4) + config.moe.ffn_hidden_size * 4
        extra = (rows - config.moe.topk) * tokens * per_row
        assert extra <= r["ep"]["saved"] - r["one"]["saved"] <= extra + 64 * send * tokens, (r, extra)


H200_PROBE = os.path.join(ROOT, "examples", "probes", "flagship_2p8t_h200.json")


def test_probe_scaled_carries_saved_bytes_linearly_and_keeps_the_larger_working_set(monkeypatch):
    """What layers save is carried linearly in the expert count; the backward working sets are
    the larger of the two probes (their slope is the per-expert gradients' artefact)."""
    config, cluster, _ = flagship()
    seen = []

    def fake(c, cl, device, num_experts=None, seq_length=None):
        seen.append((num_experts, seq_length))
        n = c.num_layers
        return {"layers": [1000.0 + 4 * num_experts] * n, "head": 7.0, "layers_backward": [500.0 - num_experts] * n,
                "head_backward": 3.0 + num_experts, "probed": {"device": device, "num_experts": num_experts,
                                                               "seq_length": seq_length}}  # fmt: skip

    monkeypatch.setattr(plan, "probe_activations", fake)
    got = plan.probe_scaled(config, cluster, "cpu", (16, 64), 8192)
    assert seen == [(16, 8192), (64, 8192)]
    assert got["layers"] == [1000.0 + 4 * 896] * config.num_layers and got["head"] == 7.0
    assert got["layers_backward"] == [484.0] * config.num_layers and got["head_backward"] == 67.0
    assert got["probed"]["carried_to_num_experts"] == 896
    with pytest.raises(Exception, match="probe_experts"):
        plan.probe_scaled(config, cluster, "cpu", (8, 64))  # fewer experts than the top-16


def test_probe_save_and_load_plan_the_same(tmp_path, capsys):
    """--probe --probe-save writes what --probe-load plans with (the same peak); a probe of
    another model is refused, naming the flag; the flags that need --probe say so."""
    tiny = os.path.join(ROOT, "examples", "configs", "tiny.yaml")
    args = ["--config", tiny, "--cluster.accelerators", "1", "--cluster.expert_model_parallel_size", "1",
            "--cluster.weight_bytes", "4", "--cluster.seq_length", "64", "--json"]  # fmt: skip
    path = str(tmp_path / "probe.json")
    plan.main(args + ["--probe", "--probe-experts", "4,8", "--probe-save", path])
    probed = json.loads(capsys.readouterr().out)
    plan.main(args + ["--probe-load", path])
    loaded = json.loads(capsys.readouterr().out)
    assert loaded["peak_bytes"] == pytest.approx(probed["peak_bytes"], rel=1e-12)
    assert loaded["probe"]["probed"]["num_experts"] == [4, 8]
    assert plan.main(args + ["--probe-load", path, "--model.num_layers", "8"]) == 2
    assert "probe_load" in capsys.readouterr().err
    assert plan.main(args + ["--probe-load", path, "--moe.ffn_hidden_size", "32"]) == 2
    assert "probe_load" in capsys.readouterr().err
    assert plan.main(args + ["--probe-experts", "4,8"]) == 2
    assert "add --probe" in capsys.readouterr().err
    assert plan.main(args + ["--probe", "--probe-experts", "4"]) == 2
    assert "probe_experts" in capsys.readouterr().err


def test_analytic_model_follows_the_h200_probe():
    """The analytic model against what our kernels held on the H200 at the flagship's widths
    (examples/probes/flagship_2p8t_h200.json, benchmarks/device/probe_flagship_memory.py: one
    period of the pattern at 16 and 64 experts, 8192 tokens, the kernels' defaults): per token,
    what each kind of layer saves within 5% (the linear layers' kept chunk states and prep
    included: _kept_linear_state_bytes) and the backward working sets within 2%, at EP=1 where
    the probe ran."""
    config, cluster, _ = flagship()
    probe = plan.load_probe(H200_PROBE, config)
    assert probe["probed"]["device"] == "cuda" and probe["probed"]["num_experts"] == [16, 64]
    one = plan.Cluster(**{**vars(cluster), "accelerators": 1, "expert_model_parallel_size": 1})
    _, rows = plan.dispatch_rows(config, one)
    assert rows == config.moe.topk
    for i in range(len(config.pattern) + config.moe.first_k_dense):
        moe = config.is_moe_layer(i)
        saved = plan._activation_bytes_per_token(config, config.layer_kind(i), moe, expert_rows=rows)
        assert abs(saved / probe["layers"][i] - 1) <= 0.05, (i, saved, probe["layers"][i])
        working = plan._backward_working_bytes_per_token(config, moe, rows)
        assert abs(working / probe["layers_backward"][i] - 1) <= 0.02, (i, working, probe["layers_backward"][i])


@pytest.mark.parametrize("seq_length,fits", [(16384, True), (32768, False)])
def test_flagship_lora_verdict_by_length_analytic_and_measured(seq_length, fits):
    """EP=64 at moe.dispatch_capacity_factor 2.0 computes on 32 rows per token (twice the
    top-16) and holds one layer's backward working set: 16k tokens per micro-batch fit on 141
    GiB, 32k do not, by the analytic model and with the H200 probe alike (within 1%)."""
    config, cluster, _ = flagship(seq_length=seq_length)
    assert plan.dispatch_rows(config, cluster) == (32.0, 32.0)
    analytic = plan.plan(config, cluster)
    measured = plan.plan(config, cluster, plan.load_probe(H200_PROBE, config))
    assert analytic["fits"] == measured["fits"] == fits
    assert abs(analytic["peak_bytes"] / measured["peak_bytes"] - 1) <= 0.01


def test_probe_too_large_for_this_machine_is_refused_before_building(capsys):
    """The flagship's layers at 896 experts would take hundreds of GiB to probe: refused at
    once, naming --probe-experts, not after minutes of allocation."""
    args = ["--config", os.path.join(ROOT, "examples", "configs", "flagship_2p8t.yaml"),
            "--cluster", os.path.join(ROOT, "examples", "clusters", "h200_128.yaml"), "--probe"]  # fmt: skip
    assert plan.main(args) == 2
    assert "--probe-experts E1,E2" in capsys.readouterr().err


def _measure_ep_worker(rank, world_size, model_ov, cluster_ov):
    """This rank's peak over a training step of the tiny model at EP=world_size (no FSDP)."""
    torch.set_num_threads(1)
    init_megatron(rank, world_size, ep=world_size)
    config = load_config(os.path.join(ROOT, "examples", "configs", "tiny.yaml"),
                         {"parallel.world_size": world_size, "parallel.expert_model_parallel_size": world_size,
                          **model_ov})  # fmt: skip
    cluster = plan.Cluster(**cluster_ov)
    return plan.measure_peak(config, cluster, distributed=True)


EP_MEASURED = {
    "full-f2": ({}, {"training": "full"}),
    "lora-f2": ({}, {"training": "lora"}),
    "full-f1": ({"moe.dispatch_capacity_factor": 1.0}, {"training": "full"}),
}


@pytest.mark.distributed
@pytest.mark.parametrize("model_ov,cluster_ov", list(EP_MEASURED.values()), ids=list(EP_MEASURED))
def test_planned_peak_at_expert_parallel_is_within_10_percent_of_measured(model_ov, cluster_ov, monkeypatch):
    """EP=2 over gloo, each rank's measured peak against the plan of a 2-accelerator cluster
    with the one-process probe: the plan adds what EP holds beyond EP=1 (the static
    dispatcher's capacity-sized expert rows, the send and receive buffers) and halves the
    experts' weights. Factor 2.0 doubles the expert rows here (4 per token for the top-2): the
    plan without them falls short of the measured peak by more than 10%."""
    from megatron_moe_hybrid.testing import spawn

    base = {"accelerators": 2, "devices_per_node": 2, "expert_model_parallel_size": 2, "fsdp": False,
            "micro_batch_size": 2, "seq_length": 128, "weight_bytes": 4, **cluster_ov}  # fmt: skip
    measured = spawn(_measure_ep_worker, 2, model_ov, base)
    config = load_config(os.path.join(ROOT, "examples", "configs", "tiny.yaml"),
                         {"parallel.world_size": 2, "parallel.expert_model_parallel_size": 2, **model_ov})  # fmt: skip
    cluster = plan.Cluster(**base)
    one = plan.Cluster(**{**base, "accelerators": 1, "devices_per_node": 1, "expert_model_parallel_size": 1})
    probe = plan.probe_activations(config, one)
    predicted = plan.plan(config, cluster, probe)
    for m in measured:
        assert 0.9 <= predicted["peak_bytes"] / m <= 1.1, (predicted["per_device_bytes"], measured)
    if model_ov.get("moe.dispatch_capacity_factor", 2.0) == 2.0:  # the rows carry it: without them, short
        monkeypatch.setattr(plan, "dispatch_rows", lambda c, cl: (float(c.moe.topk), float(c.moe.topk)))
        assert max(plan.plan(config, cluster, probe)["peak_bytes"] / m for m in measured) < 0.9


@pytest.mark.parametrize("args,field", [
    (["--cluster.accelerators", "two"], "cluster.accelerators: 'two' is not an int"),
    (["--cluster.fsdp", "maybe"], "cluster.fsdp: 'maybe' is not a bool"),
    (["--cluster.headroom", "2"], "cluster.headroom: is the usable fraction"),
    (["--cluster.weight_bytes", "3"], "cluster.weight_bytes: 3 is not 1, 2 or 4"),
    (["--cluster", "/nonexistent/cluster.yaml"], "cluster: /nonexistent/cluster.yaml: No such file"),
    (["--cluster.accelerators", "1", "--cluster.expert_model_parallel_size", "1", "--probe-load", "/nonexistent.json"],
     "probe_load: /nonexistent.json: No such file"),
    (["--cluster.accelerators", "1", "--cluster.expert_model_parallel_size", "1", "--device", "gpu"], "device: 'gpu'"),
    ([], "(planned on the default cluster of 8 accelerators, EP 8; pass --cluster FILE"),
])
def test_cli_mistakes_are_one_line_exit_2(args, field, capsys):
    """Each was a traceback, a silent acceptance (fsdp 'maybe' as on, 282 GiB usable of 141), or
    a batch error that did not say it came from the hidden default cluster."""
    assert plan.main(["--config", os.path.join(ROOT, "examples", "configs", "tiny.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and err.count("\n") == 1, err


def test_without_a_cluster_file_the_config_sets_the_run(capsys):
    """tiny.yaml pretrains 2 x 128 tokens per micro-batch: planned as that run, not as the
    default cluster's LoRA at 1 x 4096."""
    args = ["--config", os.path.join(ROOT, "examples", "configs", "tiny.yaml"), "--cluster.accelerators", "1",
            "--cluster.expert_model_parallel_size", "1"]
    plan.main(args)
    out = capsys.readouterr().out
    assert "run: full on 1 x 141 GiB" in out and "micro-batch 2 x 128" in out, out
    plan.main(args + ["--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["training"] == "full" and result["cluster"]["seq_length"] == 128
    assert result["cluster"]["micro_batch_size"] == 2
    # a base config planned as the LoRA run finetune would make of it: LoRAConfig's rank and
    # expert adapters where the config leaves lora.* out (the cluster's own default is rank 16)
    plan.main(args + ["--cluster.training", "lora", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["training"] == "lora" and result["cluster"]["lora_rank"] == 8
    plan.main(args + ["--cluster.training", "lora", "--lora.rank", "4", "--lora.expert_adapter", "shared", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["lora_rank"] == 4 and result["cluster"]["expert_adapter"] == "shared"


def test_gated_full_attention_is_planned_linear_in_the_sequence():
    """The A layer runs flash kernels on the GPU (packed and under CP too): its activations per
    token do not grow with the sequence; under CP its gathered K/V are counted, and so is the M
    layer's latent kv."""
    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    config = config_from_dict(raw, {"parallel.world_size": 1, "model.pattern": "LLLA"})
    per_token = [plan._activation_bytes_per_token(config, "A", True, seq_length=s) for s in (256, 1 << 20)]
    assert per_token[0] == per_token[1] > 0
    cp_config = config_from_dict(raw, {"parallel.world_size": 2, "model.pattern": "LLLA",
                                       "parallel.context_parallel_size": 2})  # fmt: skip
    linear_only = config_from_dict(raw, {"parallel.world_size": 2, "model.pattern": "L", "model.num_layers": 3,
                                         "parallel.context_parallel_size": 2})  # fmt: skip
    traffic = {}
    for name, c in (("LLLA", cp_config), ("LLL", linear_only)):
        cluster = plan.Cluster(accelerators=2, expert_model_parallel_size=1, context_parallel_size=2, seq_length=4096)
        traffic[name] = plan.plan(c, cluster)["cp_bytes_per_micro_batch_per_device"]
    assert traffic["LLLA"] > traffic["LLL"] > 0  # the A layer's K/V gather on top of the linear layers' states
    mla = config_from_dict(raw, {"parallel.world_size": 2, "model.pattern": "LLLM", "parallel.context_parallel_size": 2})
    cluster = plan.Cluster(accelerators=2, expert_model_parallel_size=1, context_parallel_size=2, seq_length=4096)
    assert plan.plan(mla, cluster)["cp_bytes_per_micro_batch_per_device"] > traffic["LLL"]  # M's latent kv gather
