"""A run from scratch without a whole-model copy in host memory: models.initialize fills a model
built on the meta device (LoRA-wrapped, FSDP2-sharded, expert-parallel) with exactly the
weights build_model(config, seed=...) draws, building the pieces on the CPU one at a time."""

import pytest
import torch

from megatron_moe_hybrid.testing import init_megatron, spawn, teardown, tiny_config


def _tensors(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture()
def megatron_state():
    init_megatron()
    yield
    teardown()


# every layer kind (L linear, S sparse, M MLA, A gated attention), a dense first layer, bf16
CASES = {
    "LLLS": {},
    "LLLM-bf16": {"model.pattern": "LLLM", "sparse_attention.index_head_dim": 16, "model.params_dtype": "bfloat16"},
    "LLLA-dense-first": {"model.pattern": "LLLA", "moe.first_k_dense": 1},
}


@pytest.mark.parametrize("case", CASES)
def test_initialize_equals_the_seeded_build(case, megatron_state):
    from megatron_moe_hybrid.models import build_model, initialize, materialize

    config = tiny_config(**CASES[case])
    want = _tensors(build_model(config, seed=5))
    model = materialize(build_model(config, device="meta"), "cpu")
    torch.manual_seed(123)  # initialize depends on its seed only, not on the RNG as it stands
    assert initialize(model, config, seed=5) == []
    _assert_same(_tensors(model), want)
    assert not torch.equal(_tensors(build_model(config, seed=6))["output_layer.weight"], want["output_layer.weight"])


def test_initialize_only_fills_the_named_tensors(megatron_state, monkeypatch):
    """only=: the named tensors get the seeded build's values, every other keeps what it held, and
    only the decoder layers holding them are drawn (the others built on the meta device); a
    name the model lacks is an error."""
    from megatron_moe_hybrid.models import build_model, gpt, initialize

    config = tiny_config(**{"model.num_layers": 8})
    want = _tensors(build_model(config, seed=5))
    model = build_model(config, seed=6)
    before = _tensors(model)
    only = {k for k in want if "linear_index_" in k and ".layers.3." in k}  # layer 4's indexer
    drawn = []
    draw = gpt.SeededBuild.before_layer
    monkeypatch.setattr(gpt.SeededBuild, "before_layer", lambda self, n: drawn.append(n) or draw(self, n))
    assert only and initialize(model, config, seed=5, only=only) == []
    assert drawn == [4]
    got = _tensors(model)
    for name in want:
        expect = want[name] if name in only else before[name]
        assert torch.equal(got[name], expect), name
    assert any(not torch.equal(want[n], before[n]) for n in only)
    with pytest.raises(ValueError, match="no tensors.*nope"):
        initialize(model, config, seed=5, only={"nope"})


def test_initialize_builds_one_layer_at_a_time(megatron_state, monkeypatch):
    """The pieces are built and handed over one at a time: when a layer reaches the model, the
    layers built before it hold no storage any more."""
    from megatron_moe_hybrid.models import build_model, gpt, initialize, materialize

    config = tiny_config()
    seen = []
    after = gpt.SeededBuild.after_layer

    def watch(self, layer_number, layer, num_layers):
        seen.append((layer_number, [n for n, _ in built if not _.weight.is_meta]))
        built.append((layer_number, layer.input_layernorm))
        after(self, layer_number, layer, num_layers)

    built = []
    monkeypatch.setattr(gpt.SeededBuild, "after_layer", watch)
    model = materialize(build_model(config, device="meta"), "cpu")
    initialize(model, config, seed=1)
    assert [n for n, _ in seen] == [1, 2, 3, 4]
    assert all(alive == [] for _, alive in seen), seen


def test_initialize_leaves_lora_adapters_and_fills_the_base(megatron_state):
    """Under LoRA the base weights (<wrapper>.base.*) are filled, in lora.base_dtype, and the
    adapters left to materialize (their names returned)."""
    from megatron_moe_hybrid.layers.lora import apply_lora
    from megatron_moe_hybrid.models import build_model, initialize, materialize

    config = tiny_config()
    want = _tensors(build_model(config, seed=2))
    model = build_model(config, device="meta")
    apply_lora(model, ["linear_attention", "experts"], rank=4, alpha=8.0)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    materialize(model, "cpu")
    left = initialize(model, config, seed=2)
    assert left and all("lora" in n for n in left), left
    got = _tensors(model)
    base = {n.replace(".base.", "."): v for n, v in got.items() if n not in left}
    assert base.keys() == want.keys()
    for name, w in want.items():
        wrapped = base[name].dtype == torch.bfloat16 and w.dtype == torch.float32
        torch.testing.assert_close(base[name], w.to(torch.bfloat16) if wrapped else w, rtol=0, atol=0, msg=name)


def _initialize_sharded(rank, world_size):
    """EP=2 with FSDP2: each rank's experts and its shards of the dense tensors, filled by
    initialize, gathered back; and the single-process seeded build for comparison (EP=1)."""
    from megatron_moe_hybrid.models import build_model, initialize, materialize
    from megatron_moe_hybrid.parallel.fsdp import apply_fsdp

    init_megatron(rank, world_size, ep=2)
    config = tiny_config(**{"parallel.world_size": world_size, "parallel.expert_model_parallel_size": 2,
                            "parallel.fsdp": True})
    model = build_model(config, device="meta")
    apply_fsdp(model, config, device_type="cpu")
    materialize(model, "cpu")
    initialize(model, config, seed=9)
    got = _tensors(model)
    want = _tensors(build_model(config, seed=9))  # this rank's experts, whole dense tensors
    return {"got": got, "want": want}


@pytest.mark.distributed
def test_initialize_into_fsdp2_and_expert_parallel_shards():
    for r in spawn(_initialize_sharded, 2):
        _assert_same(r["got"], r["want"])
