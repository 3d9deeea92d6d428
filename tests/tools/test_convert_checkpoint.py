"""tools/convert_checkpoint.py: a random HF Qwen3-Next converts to our checkpoint with the same
logits, both round trips keep every tensor, the result reshards over EP, bad inputs are named.

Shape legend: b batch, s sequence, V vocabulary, h hidden, E experts, F expert FFN width.
Logits are [b, s, V] on both sides (our model returns them batch-first without labels).
"""

import importlib.util
import json
import math
import os

import pytest
import yaml
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_moe_hybrid.config import config_from_dict, load_config
from megatron_moe_hybrid.testing import init_megatron, spawn, teardown

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(ROOT, "tools", "convert_checkpoint.py"))
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)

VOCAB = 256
LOGIT_TOL = 1e-4  # fp32 end to end: HF and our chunked delta rules round differently; the gap grows with T
ZERO_CENTERED = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    init_megatron()
    yield
    teardown()


def hf_config(first_dense: int = 0) -> Qwen3NextConfig:
    return Qwen3NextConfig(
        hidden_size=64, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        intermediate_size=48, mlp_only_layers=list(range(first_dense)), vocab_size=VOCAB, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip


def random_hf_model(seed: int, first_dense: int = 0) -> Qwen3NextForCausalLM:
    """Every tensor random, away from HF's init (zero norms, ones dt_bias) so a mix-up shows."""
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(hf_config(first_dense)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decays exp(-A softplus(.)) spread over (0, 1)
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                p.normal_(1.0, 0.5)
            elif name.endswith("norm.weight"):  # zero-centered: the scale is 1 + w
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.1)
    return model


def save_hf(model, path) -> str:
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    out = {}
    for fname in sorted(os.listdir(hf_dir)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, fname), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def our_tensors(run_dir) -> dict[str, torch.Tensor]:
    from megatron_moe_hybrid.training.checkpoint import resolve_checkpoint

    ckpt = resolve_checkpoint(str(run_dir))
    return hf_tensors(ckpt)


def our_model(run_dir, **overrides):
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.training.checkpoint import load_model_weights

    config = load_config(os.path.join(run_dir, "config.yaml"), {"parallel.world_size": 1, **overrides})
    torch.manual_seed(1)  # a different init than the checkpoint: loading must overwrite all of it
    model = build_model(config).eval()
    assert load_model_weights(str(run_dir), model) == []
    return model


def tokens(b: int, s: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def our_logits(model, ids):  # ids [b, s] -> [b, s, V]
    b, s = ids.shape
    return model(ids, torch.arange(s).expand(b, s), None)


PARITY = [("alltoall", 2, 37), ("static", 1, 64), ("static", 3, 1), ("alltoall", 2, 71)]


@pytest.mark.parametrize("dispatcher,b,s", PARITY, ids=[f"{d}-B{b}-T{s}" for d, b, s in PARITY])
def test_converted_model_matches_hf_logits(tmp_path, dispatcher, b, s):
    check_parity(random_hf_model(seed=s), tmp_path, dispatcher, b, s)


def test_dense_layers_convert_with_swiglu_or_are_refused(tmp_path):
    """mlp_only_layers (our moe.first_k_dense) convert only where our dense MLP is SwiGLU too:
    Megatron's MLP applies config.activation_func, which our config leaves at Megatron's gelu."""
    hf = random_hf_model(seed=13, first_dense=1)
    probe = config_from_dict({"model": {"pattern": "L", "num_layers": 1, "hidden_size": 64, "num_attention_heads": 4},
                              "parallel": {"world_size": 1}})  # fmt: skip
    if probe.activation_func is torch.nn.functional.silu:
        check_parity(hf, tmp_path, "alltoall", 2, 29)
    else:
        with pytest.raises(ValueError, match=r"mlp_only_layers=\[0\]: Qwen3-Next's dense MLP layers are SwiGLU, ours compute gelu-GLU"):
            convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "ours"), progress=False)
        assert not os.path.exists(tmp_path / "ours")


def check_parity(hf, tmp_path, dispatcher: str, b: int, s: int) -> None:
    out = convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "ours"), progress=False)
    ids = tokens(b, s, seed=s + 1)
    # MLA in its HF form: HF's torch.topk leaves the indexer's ties (common: relu makes exact
    # zeros) to its kernel, and only the HF form selects through that same call; the absorbed
    # form (the default) breaks ties to the lower key and equals the HF form otherwise
    # (tests/layers/test_mla_absorbed.py)
    model = our_model(out, **{"moe.dispatcher": dispatcher, "moe.aux_loss_coeff": 0.0, "mla.absorbed": False})
    with torch.no_grad():
        expected = hf(ids).logits  # [b, s, V]
        actual = our_logits(model, ids)
    assert actual.shape == expected.shape == (b, s, VOCAB)
    torch.testing.assert_close(actual, expected, atol=LOGIT_TOL, rtol=0)
    # the logits are far from constant, so the tolerance is a real check
    assert expected.std() > 100 * LOGIT_TOL


def test_norms_become_one_plus_hf_weight(tmp_path):
    """The zero-centered decoder norms gain 1; the q/k and DeltaNet output norms do not."""
    hf = random_hf_model(seed=3)
    out = convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "ours"), progress=False)
    ours, src = our_tensors(out), hf.state_dict()
    pairs = {
        "decoder.layers.2.input_layernorm.weight": ("model.layers.2.input_layernorm.weight", 1.0),
        "decoder.layers.3.pre_mlp_layernorm.weight": ("model.layers.3.post_attention_layernorm.weight", 1.0),
        "decoder.final_layernorm.weight": ("model.norm.weight", 1.0),
        "decoder.layers.3.self_attention.q_norm.weight": ("model.layers.3.self_attn.q_norm.weight", 0.0),
        "decoder.layers.0.self_attention.out_norm.weight": ("model.layers.0.linear_attn.norm.weight", 0.0),
    }
    for name, (hf_name, shift) in pairs.items():
        torch.testing.assert_close(ours[name], src[hf_name] + shift, atol=0, rtol=0, msg=name)


def _randomize_ours(model, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                # within [0.5, 2], where w - 1 and 1 + (w - 1) are exact in fp32
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)


def test_ours_to_hf_to_ours_is_bitwise(tmp_path):
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.training.checkpoint import save_checkpoint

    hf = random_hf_model(seed=5)
    first = convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "first"), progress=False)
    config = load_config(os.path.join(first, "config.yaml"), {"parallel.world_size": 1})
    model = build_model(config)
    _randomize_ours(model, seed=6)
    run = str(tmp_path / "run")
    save_checkpoint(run, 7, model, {}, {"config": config.to_dict()})
    # small shards: the export writes an index and the import reads it back
    exported = convert.ours_to_hf(run, str(tmp_path / "hf2"), max_shard_bytes=40_000, progress=False)
    files = sorted(os.listdir(exported))
    assert convert.HF_INDEX in files and sum(f.endswith(".safetensors") for f in files) > 2
    back = convert.hf_to_ours(exported, str(tmp_path / "back"), progress=False)
    before, after = our_tensors(run), our_tensors(back)
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("variant", ["default", "shared-rslora-adapters-only"])
def test_lora_run_exports_to_hf_with_its_adapters_merged(tmp_path, variant):
    """ours-to-hf --merge-lora: a LoRA run's checkpoint (attention and per-expert adapters, all
    non-zero) becomes an HF model whose logits are the LoRA model's; without the flag it is
    refused, naming the flag. Also one shared adapter for all experts, rsLoRA's scale, the shared
    expert's adapters and an adapters-only checkpoint whose base is the run's init_from."""
    if variant == "default":
        paths = check_lora_merge(tmp_path, random_hf_model(seed=9), Qwen3NextForCausalLM, ["attention", "experts"])
        # the default targets took both of Qwen3-Next's attention kinds (the README's recipe names none)
        assert any(p.endswith(".in_proj") for p in paths) and any(p.endswith(".linear_q") for p in paths), paths
    else:
        check_lora_merge(tmp_path, random_hf_model(seed=9), Qwen3NextForCausalLM,
                         ["attention", "experts", "shared_expert"], adapters_only=True,
                         lora_overrides={"lora.expert_adapter": "shared", "lora.rslora": True})


def check_lora_merge(tmp_path, hf, hf_class, targets, adapters_only=False, lora_overrides=None, **model_overrides):
    """Each tensor MergedLoRAReader gives, one at a time, equals the whole LoRA model's merged
    (merge_lora_, the reference), and the exported HF model's logits equal the LoRA model's.
    The adapters under HF module names (hf_lora_adapter) merge into the base's HF tensors as
    the merged export holds them: W_hf + s B A for every adapted HF tensor, W_hf elsewhere."""
    from megatron_moe_hybrid.layers.lora import adapter_tensors, apply_lora, lora_scale, merge_lora_
    from megatron_moe_hybrid.training.checkpoint import model_tensors_to_save, save_checkpoint

    base = convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "base"), progress=False)
    lora = {"lora.enabled": True, "lora.rank": 4, "lora.alpha": 8.0, "training.init_from": base, "lora.targets": targets,
            "lora.adapters_only_checkpoint": adapters_only, "training.tokenizer_model": os.path.join(base, "config.yaml"),
            **(lora_overrides or {}), **model_overrides}  # fmt: skip
    config = load_config(os.path.join(base, "config.yaml"), {"parallel.world_size": 1, **lora})
    lo = config.lora
    model = our_model(base, **model_overrides)
    paths = apply_lora(model, lo.targets, lo.rank, lo.alpha, rslora=lo.rslora, expert_adapter=lo.expert_adapter)
    torch.manual_seed(10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0.0, 0.05)  # lora_B starts at zero: give every adapter a real update
    adapters = adapter_tensors(model)
    run = str(tmp_path / "run")
    save_checkpoint(run, 3, model, {}, {"config": config.to_dict()}, trainable_only=adapters_only)
    with pytest.raises(ValueError, match="holds LoRA tensors .*pass --merge-lora"):
        convert.ours_to_hf(run, str(tmp_path / "refused"), progress=False)
    exported = convert.ours_to_hf(run, str(tmp_path / "merged"), progress=False, merge_lora=True)
    merged = hf_class.from_pretrained(exported, torch_dtype=torch.float32).eval()
    ids = tokens(2, 29, seed=11)
    with torch.no_grad():
        expected = our_logits(model.eval(), ids)
        plain = hf(ids).logits
        actual = merged(ids).logits
    torch.testing.assert_close(actual, expected, atol=LOGIT_TOL, rtol=0)
    assert (expected - plain).abs().max() > 100 * LOGIT_TOL  # the adapters changed the model
    merge_lora_(model)  # the reference: the whole model merged in memory
    expected_tensors = model_tensors_to_save(model)
    reader = convert.MergedLoRAReader(convert.OursReader(run))
    assert set(reader.file_of) == set(expected_tensors)
    for key, t in expected_tensors.items():
        torch.testing.assert_close(reader.get(key), t, msg=key)
    check_hf_adapter(adapters, config, convert.ours_to_hf(base, str(tmp_path / "base_hf"), progress=False), exported,
                     lora_scale(lo.rank, lo.alpha, lo.rslora))
    return paths


def check_hf_adapter(adapters, config, base_hf_dir, merged_hf_dir, scale):
    hf_adapter = convert.hf_lora_adapter(adapters, config)
    base, merged = convert.HFReader(base_hf_dir), convert.HFReader(merged_hf_dir)
    assert set(base.file_of) == set(merged.file_of)
    assert {m + ".weight" for m in hf_adapter} <= set(merged.file_of)  # every name is an HF tensor's module
    changed = 0
    for key in sorted(merged.file_of):
        want = base.get(key).double()
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module in hf_adapter:
            a, b = hf_adapter[module]
            want = want + scale * (b.double() @ a.double())
            changed += 1
        torch.testing.assert_close(merged.get(key).double(), want, rtol=1e-5, atol=1e-6, msg=key)
    assert changed == len(hf_adapter) > 0


def test_hf_named_adapter_loads_in_peft_onto_the_transformers_model(tmp_path):
    """tools/export_lora.py --hf: attention adapters (both of Qwen3-Next's kinds: GDN's in_proj
    split into in_proj_qkvz and in_proj_ba per head) as PEFT over the transformers model's
    modules; peft.PeftModel loads them onto the HF model, whose logits are then our LoRA model's."""
    import subprocess
    import sys

    peft = pytest.importorskip("peft")
    from megatron_moe_hybrid.layers.lora import adapter_tensors, apply_lora
    from safetensors.torch import save_file as save

    hf = random_hf_model(seed=9)
    base = convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "base"), progress=False)
    model = our_model(base)
    apply_lora(model, ["attention"], 4, 8.0)
    torch.manual_seed(10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0.0, 0.05)
    ours = tmp_path / "adapter"
    ours.mkdir()
    save(adapter_tensors(model), str(ours / "adapter_model.safetensors"))
    (ours / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8.0}))
    tool = os.path.join(ROOT, "tools", "export_lora.py")
    done = subprocess.run([sys.executable, tool, str(ours), str(tmp_path / "peft"), "--hf", "--config",
                           os.path.join(base, "config.yaml")], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {"in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "o_proj"} <= set(config["target_modules"])
    ids = tokens(2, 29, seed=11)
    with torch.no_grad():
        plain = hf(ids).logits
        adapted = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
        actual = adapted(ids).logits
        expected = our_logits(model.eval(), ids)
    torch.testing.assert_close(actual, expected, atol=LOGIT_TOL, rtol=0)
    assert (expected - plain).abs().max() > 100 * LOGIT_TOL  # the adapters changed the model
    missing = subprocess.run([sys.executable, tool, str(ours), str(tmp_path / "x"), "--hf"], capture_output=True, text=True)
    assert missing.returncode == 1 and "--hf needs the run's model config" in missing.stderr


def test_hf_adapter_refuses_a_model_no_family_holds():
    config = load_config(os.path.join(ROOT, "examples", "configs", "tiny.yaml"), {"parallel.world_size": 1})
    with pytest.raises(ValueError, match="^model.pattern: layer 3 is 'S'; Qwen3-Next has only"):
        convert.hf_lora_adapter({}, config)


def _train_worker(rank, world_size, raw, overrides):
    from megatron_moe_hybrid.training.trainer import run

    return run(config_from_dict(raw, overrides), "pretrain").losses


def test_converted_model_trains_with_its_own_tokenizer(tmp_path):
    """hf-to-ours copies the HF directory's tokenizer.json (and tokenizer_config.json,
    chat_template.jinja) into the run and points training.tokenizer_model at it: training from the
    converted run reads chat records in the model's own template with its own tokenizer, and keeps
    both in its output_dir."""
    from tokenizers import Tokenizer as HF, models, pre_tokenizers, trainers

    hf_dir = save_hf(random_hf_model(seed=31), tmp_path / "hf")
    tok = HF(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 40],
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["</s>", "[UNK]"]))
    tok.save(os.path.join(hf_dir, "tokenizer.json"))
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}"
                "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with open(os.path.join(hf_dir, "chat_template.jinja"), "w") as f:
        f.write(template)
    out = convert.hf_to_ours(hf_dir, str(tmp_path / "ours"), progress=False)
    raw = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert raw["training"]["tokenizer_model"] == os.path.join(out, "tokenizer.json")
    assert sorted(f for f in os.listdir(out) if f.startswith("tokenizer")) == ["tokenizer.json", "tokenizer_config.json"]
    assert os.path.isfile(os.path.join(out, "chat_template.jinja"))
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(200):
            turns = [{"role": "user", "content": f"the lazy dog {i}"}, {"role": "assistant", "content": "jumps over the fox"}]
            f.write(json.dumps({"messages": turns}) + "\n")
    ft = str(tmp_path / "ft")
    overrides = {"training.init_from": out, "training.output_dir": ft, "training.train_steps": 2,
                 "training.data_path": str(chats), "training.data_format": "messages",
                 "training.chat_format": os.path.join(out, "chat_template.jinja"),
                 "training.seq_length": 16, "training.micro_batch_size": 1,
                 "training.global_batch_size": 1, "training.warmup_steps": 1, "training.save_interval": 0,
                 "training.cache_dir": str(tmp_path / "cache"), "training.progress_bar": False,
                 "training.device": "cpu", "parallel.world_size": 1}  # fmt: skip
    (losses,) = spawn(_train_worker, 1, raw, overrides)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    kept = ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert all(os.path.isfile(os.path.join(ft, name)) for name in kept)
    exported = convert.ours_to_hf(ft, str(tmp_path / "hf_ft"), progress=False)  # the tokenizer goes back too
    assert sorted(f for f in os.listdir(exported) if f.startswith(("tokenizer", "chat"))) == kept


def test_hf_to_ours_to_hf_keeps_every_tensor(tmp_path):
    """Bitwise except the zero-centered norms, whose scale 1 + w is bitwise the same."""
    hf = random_hf_model(seed=8)
    src_dir = save_hf(hf, tmp_path / "hf")
    ours = convert.hf_to_ours(src_dir, str(tmp_path / "ours"), progress=False)
    exported = convert.ours_to_hf(ours, str(tmp_path / "hf2"), progress=False)
    before, after = hf_tensors(src_dir), hf_tensors(exported)
    assert sorted(before) == sorted(after)
    for name, w in before.items():
        if name.endswith(ZERO_CENTERED):
            assert torch.equal(1.0 + after[name], 1.0 + w), name
            # fl(1 + w) - 1 is exact, so w moves by the rounding of 1 + w: half an ulp of it
            assert ((after[name] - w).abs().double() <= (1.0 + w.double()).abs() * 2.0**-24).all(), name
        else:
            assert torch.equal(after[name], w), name
    # transformers reads the exported config and weights and computes the same logits
    reloaded = Qwen3NextForCausalLM.from_pretrained(exported).float().eval()
    assert reloaded.config.layer_types == hf.config.layer_types
    ids = tokens(2, 23, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=0, rtol=0)


def _ep2_worker(rank, world_size, run_dir, ids):
    init_megatron(rank, world_size, ep=2)
    overrides = {"parallel.world_size": 2, "parallel.expert_model_parallel_size": 2, "moe.dispatcher": "alltoall",
                 "moe.aux_loss_coeff": 0.0}  # fmt: skip
    model = our_model(run_dir, **overrides)
    experts = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts.weight" in n}
    with torch.no_grad():
        logits = our_logits(model, ids)
    return experts, logits


@pytest.mark.distributed
def test_converted_checkpoint_loads_under_ep2(tmp_path):
    hf = random_hf_model(seed=10)
    out = convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "ours"), progress=False)
    ids = tokens(2, 19, seed=11)
    whole = dict(our_model(out).named_parameters())
    per_rank = spawn(_ep2_worker, 2, out, ids)
    with torch.no_grad():
        expected = hf(ids).logits
    for rank, (experts, logits) in enumerate(per_rank):
        assert len(experts) == 8  # weight1, weight2 of 4 layers
        for name, local in experts.items():
            assert local.shape[0] == 4
            assert torch.equal(local, whole[name][4 * rank : 4 * (rank + 1)]), (rank, name)
        torch.testing.assert_close(logits, expected, atol=LOGIT_TOL, rtol=0)


# The torch.distributed.checkpoint format (hf-to-ours --format dcp): experts as one [E, ...]
# tensor, resharded over expert-parallel ranks as they load.


@pytest.mark.distributed
def test_dcp_checkpoint_matches_hf_and_reshards_under_ep2(tmp_path):
    hf = random_hf_model(seed=14)
    out = convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "ours"), progress=False, fmt="dcp")
    assert sorted(os.listdir(out)) == ["config.yaml", "dcp"]
    ids = tokens(2, 19, seed=15)
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(our_logits(our_model(out), ids), expected, atol=LOGIT_TOL, rtol=0)
    assert expected.std() > 100 * LOGIT_TOL
    whole = {n: p.detach() for n, p in our_model(out).named_parameters()}
    for rank, (experts, logits) in enumerate(spawn(_ep2_worker, 2, out, ids)):
        assert len(experts) == 8
        for name, local in experts.items():
            assert local.shape[0] == 4
            assert torch.equal(local, whole[name][4 * rank : 4 * (rank + 1)]), (rank, name)
        torch.testing.assert_close(logits, expected, atol=LOGIT_TOL, rtol=0)


def _ep2_save_worker(rank, world_size, run_dir, dst):
    """Loads the EP1 checkpoint as EP2, then saves it again from the two ranks."""
    from megatron_moe_hybrid.training.dist_checkpoint import save_dist_checkpoint

    init_megatron(rank, world_size, ep=2)
    overrides = {"parallel.world_size": 2, "parallel.expert_model_parallel_size": 2, "moe.dispatcher": "alltoall"}
    save_dist_checkpoint(dst, our_model(run_dir, **overrides), {"config": None})
    return True


@pytest.mark.distributed
def test_dcp_saved_from_ep2_equals_ep1_and_exports_to_hf(tmp_path):
    """EP1 -> load as EP2 -> save from 2 ranks -> every tensor equal; ours-to-hf reads a dcp run."""
    import shutil

    from megatron_moe_hybrid.training.dist_checkpoint import DistCheckpointReader

    hf = random_hf_model(seed=16)
    src_dir = save_hf(hf, tmp_path / "hf")
    out = convert.hf_to_ours(src_dir, str(tmp_path / "ours"), progress=False, fmt="dcp")
    resaved = tmp_path / "ep2" / "dcp"
    os.makedirs(resaved.parent)
    shutil.copy(os.path.join(out, "config.yaml"), resaved.parent / "config.yaml")
    assert spawn(_ep2_save_worker, 2, out, str(resaved)) == [True, True]
    a, b = DistCheckpointReader(os.path.join(out, "dcp")), DistCheckpointReader(str(resaved))
    assert sorted(a.keys()) == sorted(b.keys()) and any(".expert7" in k for k in a.keys())
    for key in a.keys():
        assert torch.equal(a.get(key), b.get(key)), key
    loads = []
    whole = DistCheckpointReader._whole

    def counted(self, name):
        loads.append(name if self._cached[0] != name else None)
        return whole(self, name)

    DistCheckpointReader._whole = counted
    try:
        exported = convert.ours_to_hf(str(resaved.parent), str(tmp_path / "hf2"), progress=False)
    finally:
        DistCheckpointReader._whole = whole
    read = [n for n in loads if n is not None]
    assert sorted(read) == sorted(b.stored), "each stored tensor read once (experts' stacks were read once per expert)"
    before, after = hf_tensors(src_dir), hf_tensors(exported)
    assert sorted(before) == sorted(after)
    for name, w in before.items():
        if name.endswith(ZERO_CENTERED):
            assert torch.equal(1.0 + after[name], 1.0 + w), name
        else:
            assert torch.equal(after[name], w), name


def test_dcp_load_names_a_wrong_shape(tmp_path):
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.training.checkpoint import CheckpointError, load_model_weights

    out = convert.hf_to_ours(save_hf(random_hf_model(seed=17), tmp_path / "hf"), str(tmp_path / "ours"),
                             progress=False, fmt="dcp")  # fmt: skip
    config = load_config(os.path.join(out, "config.yaml"), {"parallel.world_size": 1, "moe.num_experts": 4})
    with pytest.raises(CheckpointError, match=r"tensor decoder\.layers\.\d\.mlp\.\w+\.weight\d? has global shape \(8"):
        load_model_weights(out, build_model(config))


def _peak_tensor_bytes(fn) -> int:
    """Highest live tensor memory (CPU allocator events) while fn() runs, above its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"):
        live += n
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_hf_to_ours_holds_one_layer_at_a_time(tmp_path, fmt):
    """A 12-layer model with 64 experts per layer: the conversion's peak tensor memory stays
    near one layer's size, far below the model's (the model is built on the meta device and
    each layer is made real, filled, written and dropped in turn)."""
    hc = hf_config()
    hc.num_hidden_layers, hc.layer_types, hc.num_experts = 12, (["linear_attention"] * 3 + ["full_attention"]) * 3, 64
    torch.manual_seed(0)
    hf = Qwen3NextForCausalLM(hc).float().eval()
    total = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    layer = sum(t.numel() * t.element_size() for k, t in hf.state_dict().items() if k.startswith("model.layers.0."))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size=layer)  # about a layer a shard
    del hf
    src = str(tmp_path / "hf")
    assert len([f for f in os.listdir(src) if f.endswith(".safetensors")]) >= 10
    peak = _peak_tensor_bytes(lambda: convert.hf_to_ours(src, str(tmp_path / "ours"), progress=False, fmt=fmt))
    assert layer * 12 > 0.9 * total  # the layers are the model
    # two mapped shards, the layer being filled, what is read into it and the bytes being
    # written: a few layers, whatever the model's depth
    assert peak < 6 * layer < total / 2, (peak, layer, total)


@pytest.fixture
def hf_dir(tmp_path):
    return save_hf(random_hf_model(seed=12), tmp_path / "hf")


def _rewrite(hf_dir, edit) -> None:
    path = os.path.join(hf_dir, convert.HF_SINGLE)
    tensors = hf_tensors(hf_dir)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(hf_dir, tmp_path):
    key = "model.layers.1.linear_attn.dt_bias"
    _rewrite(hf_dir, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=f"tensor '{key}' is missing"):
        convert.hf_to_ours(hf_dir, str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_wrong_shape_is_named(hf_dir, tmp_path):
    key = "model.layers.3.mlp.experts.5.up_proj.weight"
    _rewrite(hf_dir, lambda t: t.__setitem__(key, torch.zeros(31, 64)))
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{key}' has shape \(31, 64\), config.json implies \(32, 64\)"):
        convert.hf_to_ours(hf_dir, str(tmp_path / "out"), progress=False)


def test_unexpected_tensor_is_named(hf_dir, tmp_path):
    key = "model.layers.3.self_attn.q_proj.bias"
    _rewrite(hf_dir, lambda t: t.__setitem__(key, torch.zeros(128)))
    with pytest.raises(ValueError, match=f"unexpected tensor '{key}'"):
        convert.hf_to_ours(hf_dir, str(tmp_path / "out"), progress=False)


def test_missing_shard_is_named(hf_dir, tmp_path):
    tensors = hf_tensors(hf_dir)
    os.remove(os.path.join(hf_dir, convert.HF_SINGLE))
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    save_file({k: tensors[k] for k in halves["model-00001-of-00002.safetensors"]},
              os.path.join(hf_dir, "model-00001-of-00002.safetensors"))  # fmt: skip
    with open(os.path.join(hf_dir, convert.HF_INDEX), "w") as f:
        json.dump({"weight_map": {k: name for name, ks in halves.items() for k in ks}}, f)
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors: shard listed in"):
        convert.hf_to_ours(hf_dir, str(tmp_path / "out"), progress=False)


def test_unknown_model_type_is_named(hf_dir, tmp_path):
    path = os.path.join(hf_dir, convert.HF_CONFIG)
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(cfg, model_type="llama"), f)
    with pytest.raises(ValueError, match="model_type: unknown architecture 'llama'"):
        convert.hf_to_ours(hf_dir, str(tmp_path / "out"), progress=False)
    assert convert.main(["hf-to-ours", "--hf", hf_dir, "--out", str(tmp_path / "out")]) == 2


def test_wider_dtype_than_target_is_refused(hf_dir, tmp_path):
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' is F32, which bfloat16 cannot hold"):
        convert.hf_to_ours(hf_dir, str(tmp_path / "out"), dtype=torch.bfloat16, progress=False)


def test_failed_export_leaves_nothing(hf_dir, tmp_path, monkeypatch):
    ours = convert.hf_to_ours(hf_dir, str(tmp_path / "ours"), progress=False)
    real_save, calls = convert.save_file, []

    def disk_full_on_third_shard(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", path)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(convert, "save_file", disk_full_on_third_shard)
    with pytest.raises(OSError, match="No space left"):
        convert.ours_to_hf(ours, str(tmp_path / "hf2"), max_shard_bytes=40_000, progress=False)
    assert len(calls) == 3
    assert sorted(os.listdir(tmp_path)) == ["hf", "ours"]  # no hf2, no .tmp-hf2-*


def test_existing_output_and_foreign_layers_are_refused(hf_dir, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(ValueError, match="out_dir: .*busy exists and is not empty"):
        convert.hf_to_ours(hf_dir, str(tmp_path / "busy"), progress=False)
    raw = {"model": {"pattern": "LLLS", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 64},
           "parallel": {"world_size": 1}}  # fmt: skip
    with pytest.raises(ValueError, match="model.pattern: layer 3 is 'S'"):
        convert.export_hf_config(config_from_dict(raw))


# DeepSeek-V3.2: MLA + lightning indexer (pattern M), sigmoid group-limited routing with an expert
# bias, shared experts, standard (not zero-centered) RMSNorms, dense first layers.

v32 = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402

from megatron_moe_hybrid.layers.moe.moe_layer import MoELayer, load_hf_deepseek_v32_moe  # noqa: E402


def ds_config(index_topk: int = 64, **extra) -> DeepseekV32Config:
    hc = DeepseekV32Config(
        hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        index_n_heads=4, index_head_dim=16, index_topk=index_topk, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=32, intermediate_size=96,
        vocab_size=VOCAB, routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
        dtype="float32", **{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **extra},
    )  # fmt: skip
    hc._attn_implementation = "eager"
    return hc


def perturb_ds(module: torch.nn.Module) -> None:
    """HF initialises norms to 1, biases and e_score_correction_bias to 0: all random here."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.1 if "norm" not in name else 0.3)
        for name, buf in module.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts win
                buf.normal_(0.0, 0.1)


def random_ds_model(seed: int, index_topk: int = 64, **extra) -> DeepseekV32ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(ds_config(index_topk, **extra)).float().eval()
    perturb_ds(model)
    return model


DS_PARITY = [("alltoall", 2, 37, 64), ("static", 1, 1, 64), ("alltoall", 2, 29, 5)]


@pytest.mark.parametrize(
    "dispatcher,b,s,index_topk", DS_PARITY, ids=[f"{d}-B{b}-T{s}-topk{k}" for d, b, s, k in DS_PARITY]
)
def test_converted_deepseek_v32_matches_hf_logits(tmp_path, dispatcher, b, s, index_topk):
    """index_topk >= T is dense causal MLA; 5 < T makes the indexer drop keys in both models."""
    check_parity(random_ds_model(seed=s, index_topk=index_topk), tmp_path, dispatcher, b, s)


# DeepSeek-V3.2's released config: yarn, factor 40 over 4096 (here a short original length so
# that the ramp crosses the 8 rope channels; mscale != mscale_all_dim so both factors matter).
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}  # fmt: skip


def test_converted_deepseek_v32_with_yarn_matches_hf_logits(tmp_path):
    hf = random_ds_model(seed=11, index_topk=5, rope_parameters=dict(YARN))
    check_parity(hf, tmp_path, "alltoall", 2, 29)
    config = yaml.safe_load(open(tmp_path / "ours" / "config.yaml"))
    assert config["mla"]["rope_type"] == "yarn" and config["mla"]["rope_factor"] == 40.0
    # and back: the HF config written by ours-to-hf says the same RoPE
    back = convert.ours_to_hf(str(tmp_path / "ours"), str(tmp_path / "hf_back"), progress=False)
    rope = json.load(open(os.path.join(back, "config.json")))["rope_parameters"]
    assert {k: rope[k] for k in YARN} == YARN


def test_deepseek_v32_norms_and_router_copy_as_they_are(tmp_path):
    hf = random_ds_model(seed=4)
    out = convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "ours"), progress=False)
    ours, src = our_tensors(out), hf.state_dict()
    pairs = {
        "decoder.layers.1.input_layernorm.weight": "model.layers.1.input_layernorm.weight",
        "decoder.layers.2.pre_mlp_layernorm.weight": "model.layers.2.post_attention_layernorm.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "decoder.layers.2.mlp.router.expert_bias": "model.layers.2.mlp.gate.e_score_correction_bias",
        "decoder.layers.1.mlp.router.weight": "model.layers.1.mlp.gate.weight",
        "decoder.layers.0.self_attention.index_k_norm.bias": "model.layers.0.self_attn.indexer.k_norm.bias",
    }
    for name, hf_name in pairs.items():
        torch.testing.assert_close(ours[name], src[hf_name], atol=0, rtol=0, msg=name)
    gate_up = src["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2F, h]
    for e in (0, 7):
        torch.testing.assert_close(ours[f"decoder.layers.1.mlp.experts.weight1.expert{e}"], gate_up[e].t(), atol=0, rtol=0)
    fc1 = torch.cat([src["model.layers.0.mlp.gate_proj.weight"], src["model.layers.0.mlp.up_proj.weight"]])
    torch.testing.assert_close(ours["decoder.layers.0.mlp.linear_fc1.weight"], fc1, atol=0, rtol=0)


def _ours_from_hf_config(hc):
    """Our config for an HF DeepseekV32Config, as hf_to_ours builds it."""
    raw, _ = convert.import_hf_config.import_hf_config(hc.to_dict())
    raw["model"]["ffn_hidden_size"] = raw["moe"]["dense_ffn_hidden_size"]
    return config_from_dict(raw, {"parallel.world_size": 1, "moe.aux_loss_coeff": 0.0, "moe.dispatcher": "alltoall"})


MOE_BT = [(2, 13), (1, 1), (3, 7)]


@pytest.mark.parametrize("b,s", MOE_BT, ids=[f"B{b}-T{s}" for b, s in MOE_BT])
def test_deepseek_v32_moe_block_matches_hf_with_gradients(b, s):
    """load_hf_deepseek_v32_moe: our MoELayer equals DeepseekV32MoE, output and every gradient
    (input, router, experts, shared experts) in fp32."""
    hc = ds_config()
    torch.manual_seed(s + b)
    hf = v32.DeepseekV32MoE(hc).float()
    perturb_ds(hf)
    ours = MoELayer(_ours_from_hf_config(hc))
    load_hf_deepseek_v32_moe(ours, {f"mlp.{k}": v for k, v in hf.state_dict().items()}, prefix="mlp.")
    x = torch.randn(b, s, 64)
    dy = torch.randn(b, s, 64)

    x_hf = x.clone().requires_grad_()
    hp = dict(hf.named_parameters())
    hf_names = ["gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_experts.gate_proj.weight",
                "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"]  # fmt: skip
    y_hf = hf(x_hf)
    g_hf = dict(zip(["x"] + hf_names, torch.autograd.grad((y_hf * dy).sum(), [x_hf] + [hp[n] for n in hf_names])))

    x_ours = x.transpose(0, 1).clone().requires_grad_()  # [s, b, h]
    y_ours, _ = ours(x_ours)
    op = [ours.router.weight, ours.experts.weight1, ours.experts.weight2, ours.shared_experts.linear_fc1.weight,
          ours.shared_experts.linear_fc2.weight]  # fmt: skip
    dx, d_router, d_w1, d_w2, d_fc1, d_fc2 = torch.autograd.grad((y_ours * dy.transpose(0, 1)).sum(), [x_ours] + op)

    torch.testing.assert_close(y_ours.transpose(0, 1), y_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx.transpose(0, 1), g_hf["x"], atol=1e-5, rtol=1e-5)
    ours_as_hf = {
        "gate.weight": d_router,
        "experts.gate_up_proj": d_w1.transpose(1, 2),  # [E, h, 2F] -> [E, 2F, h]
        "experts.down_proj": d_w2.transpose(1, 2),
        "shared_experts.gate_proj.weight": d_fc1.chunk(2)[0],
        "shared_experts.up_proj.weight": d_fc1.chunk(2)[1],
        "shared_experts.down_proj.weight": d_fc2,
    }
    for name in hf_names:
        torch.testing.assert_close(ours_as_hf[name], g_hf[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")
    assert d_router.abs().sum() > 0 and g_hf["experts.gate_up_proj"].abs().sum() > 0


def test_load_hf_deepseek_v32_moe_names_bad_input():
    hc = ds_config()
    hf = v32.DeepseekV32MoE(hc)
    sd = dict(hf.state_dict())
    ours = MoELayer(_ours_from_hf_config(hc))
    with pytest.raises(ValueError, match=r"unexpected keys \['experts.0.gate_proj.weight'\]"):
        load_hf_deepseek_v32_moe(ours, {**sd, "experts.0.gate_proj.weight": torch.zeros(32, 64)})
    with pytest.raises(ValueError, match=r"missing \['gate.e_score_correction_bias'\]"):
        load_hf_deepseek_v32_moe(ours, {k: v for k, v in sd.items() if k != "gate.e_score_correction_bias"})
    with pytest.raises(ValueError, match=r"hf_state_dict\['experts.down_proj'\]: shape \(7, 64, 32\), expected \(8, 64, 32\)"):
        load_hf_deepseek_v32_moe(ours, {**sd, "experts.down_proj": torch.zeros(7, 64, 32)})
    no_bias = MoELayer(config_from_dict(_ours_from_hf_config(hc).to_dict(), {"moe.expert_bias": False}))
    with pytest.raises(ValueError, match="moe.expert_bias=True"):
        load_hf_deepseek_v32_moe(no_bias, sd)


def test_deepseek_v32_ours_to_hf_to_ours_is_bitwise(tmp_path):
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.training.checkpoint import save_checkpoint

    first = convert.hf_to_ours(save_hf(random_ds_model(seed=5), tmp_path / "hf"), str(tmp_path / "first"), progress=False)
    config = load_config(os.path.join(first, "config.yaml"), {"parallel.world_size": 1})
    model = build_model(config)
    _randomize_ours(model, seed=6)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.normal_(0.0, 0.2)
    run = str(tmp_path / "run")
    save_checkpoint(run, 7, model, {}, {"config": config.to_dict()})
    exported = convert.ours_to_hf(run, str(tmp_path / "hf2"), max_shard_bytes=40_000, progress=False)
    assert convert.HF_INDEX in os.listdir(exported)
    back = convert.hf_to_ours(exported, str(tmp_path / "back"), progress=False)
    before, after = our_tensors(run), our_tensors(back)
    assert sorted(before) == sorted(after)
    assert any(name.endswith("router.expert_bias") for name in before)
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_deepseek_v32_hf_to_ours_to_hf_is_bitwise(tmp_path):
    hf = random_ds_model(seed=8, index_topk=6)
    src_dir = save_hf(hf, tmp_path / "hf")
    ours = convert.hf_to_ours(src_dir, str(tmp_path / "ours"), progress=False)
    exported = convert.ours_to_hf(ours, str(tmp_path / "hf2"), progress=False)
    before, after = hf_tensors(src_dir), hf_tensors(exported)
    assert sorted(before) == sorted(after)
    for name, w in before.items():
        assert torch.equal(after[name], w), name
    # transformers reads the exported config and weights and computes the same logits
    reloaded = DeepseekV32ForCausalLM.from_pretrained(exported, attn_implementation="eager").float().eval()
    for key in ("mlp_layer_types", "index_topk", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts"):
        assert getattr(reloaded.config, key) == getattr(hf.config, key), key
    ids = tokens(2, 23, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=0, rtol=0)


@pytest.fixture
def ds_dir(tmp_path):
    return save_hf(random_ds_model(seed=12), tmp_path / "hf")


def test_deepseek_v32_mtp_layers_are_skipped_and_said_so(ds_dir, tmp_path):
    """DeepSeek-V3's checkpoints store the MTP module as layer num_hidden_layers; we skip it."""
    _rewrite(ds_dir, lambda t: t.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
                                          "model.layers.3.enorm.weight": torch.ones(64)}))  # fmt: skip
    out = convert.hf_to_ours(ds_dir, str(tmp_path / "ours"), progress=False)
    with open(os.path.join(out, "config.yaml")) as f:
        header = f.read()
    assert "# skipped 2 tensors of the multi-token-prediction layers" in header
    assert "model.layers.3.eh_proj.weight, ..." in header


def test_deepseek_v32_quantization_scales_are_named(ds_dir, tmp_path):
    key = "model.layers.1.self_attn.q_a_proj.weight_scale_inv"
    _rewrite(ds_dir, lambda t: t.__setitem__(key, torch.ones(1, 1)))
    with pytest.raises(ValueError, match=f"unexpected tensor '{key}'.*DeepSeek-V3.2 model.*quantization scales"):
        convert.hf_to_ours(ds_dir, str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_deepseek_v32_interleaved_dense_layers_are_refused(ds_dir, tmp_path):
    path = os.path.join(ds_dir, convert.HF_CONFIG)
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(cfg, mlp_layer_types=["dense", "sparse", "dense"]), f)
    with pytest.raises(ValueError, match=r"mlp_layer_types=\['dense', 'sparse', 'dense'\]: only dense layers first"):
        convert.hf_to_ours(ds_dir, str(tmp_path / "out"), progress=False)


def test_deepseek_v32_export_refuses_what_it_cannot_say(ds_dir, tmp_path):
    out = convert.hf_to_ours(ds_dir, str(tmp_path / "ours"), progress=False)
    config = load_config(os.path.join(out, "config.yaml"), {"parallel.world_size": 1})
    with pytest.raises(ValueError, match="moe.score_func: this config has no DeepSeek-V3.2 equivalent"):
        convert.export_hf_config(config_from_dict(config.to_dict(), {"moe.score_func": "softmax"}))
    with pytest.raises(ValueError, match="moe.shared_expert_ffn_hidden_size: .*n_shared_experts >= 1 times"):
        convert.export_hf_config(config_from_dict(config.to_dict(), {"moe.shared_expert_ffn_hidden_size": 48}))
    with pytest.raises(ValueError, match="model.pattern: layer 0 is 'L'; DeepSeek-V3.2 has only MLA"):
        convert.export_hf_config(config_from_dict(config.to_dict(), {"model.pattern": "LLM"}))


def _ds_ep2_worker(rank, world_size, run_dir, ids):
    init_megatron(rank, world_size, ep=2)
    overrides = {"parallel.world_size": 2, "parallel.expert_model_parallel_size": 2, "moe.dispatcher": "alltoall",
                 "moe.aux_loss_coeff": 0.0}  # fmt: skip
    model = our_model(run_dir, **overrides)
    experts = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts.weight" in n}
    with torch.no_grad():
        logits = our_logits(model, ids)
    return experts, logits


@pytest.mark.slow  # ~30 s: two spawned processes import transformers and build the model
@pytest.mark.distributed
def test_converted_deepseek_v32_loads_under_ep2(tmp_path):
    hf = random_ds_model(seed=10)
    out = convert.hf_to_ours(save_hf(hf, tmp_path / "hf"), str(tmp_path / "ours"), progress=False)
    ids = tokens(2, 19, seed=11)
    whole = dict(our_model(out).named_parameters())
    per_rank = spawn(_ds_ep2_worker, 2, out, ids)
    with torch.no_grad():
        expected = hf(ids).logits
    for rank, (experts, logits) in enumerate(per_rank):
        assert len(experts) == 4  # weight1, weight2 of the 2 MoE layers
        for name, local in experts.items():
            assert local.shape[0] == 4
            assert torch.equal(local, whole[name][4 * rank : 4 * (rank + 1)]), (rank, name)
        torch.testing.assert_close(logits, expected, atol=LOGIT_TOL, rtol=0)


def test_cli_builds_in_the_checkpoints_own_dtype(tmp_path):
    """hf-to-ours --dtype auto (the default): a bf16 checkpoint stays bf16 (float32 doubled its
    size), a float32 one stays float32."""
    hf = random_hf_model(seed=21)
    fp32_dir = save_hf(hf, tmp_path / "fp32")
    bf16_dir = save_hf(hf.to(torch.bfloat16), tmp_path / "bf16")
    assert convert.source_dtype(fp32_dir) == torch.float32 and convert.source_dtype(bf16_dir) == torch.bfloat16
    assert convert.main(["hf-to-ours", "--hf", bf16_dir, "--out", str(tmp_path / "ours")]) == 0
    assert yaml.safe_load(open(tmp_path / "ours" / "config.yaml"))["model"]["params_dtype"] == "bfloat16"
    assert all(t.dtype in (torch.bfloat16, torch.float32) for t in our_tensors(tmp_path / "ours").values())
    assert any(t.dtype == torch.bfloat16 for t in our_tensors(tmp_path / "ours").values())


def test_deepseek_v32_lora_run_exports_to_hf_with_its_adapters_merged(tmp_path):
    """As for Qwen3-Next: MLA's q/kv down and up projections, the output and the experts' adapters
    folded in; our MLA in HF's form, whose indexer top-k breaks ties as HF's does."""
    check_lora_merge(tmp_path, random_ds_model(seed=12), DeepseekV32ForCausalLM, ["sparse_attention", "experts"],
                     **{"mla.absorbed": False, "moe.aux_loss_coeff": 0.0})


def test_inspect_reads_a_dist_checkpoint_and_counts_lora(tmp_path, capsys):
    """tools/inspect_checkpoint.py on hf-to-ours --format dcp output (it said "no complete
    checkpoint here") counts the same parameters as the safetensors conversion; a path that does
    not exist says so."""
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", os.path.join(ROOT, "tools", "inspect_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    hf_dir = save_hf(random_hf_model(seed=41), tmp_path / "hf")
    plain = tool.summarise(convert.hf_to_ours(hf_dir, str(tmp_path / "st"), progress=False))
    dist = tool.summarise(convert.hf_to_ours(hf_dir, str(tmp_path / "dcp"), progress=False, fmt="dcp"))
    assert dist["shapes"] == plain["shapes"] and dist["num_params"] == plain["num_params"] > 0
    assert dist["num_experts"] == plain["num_experts"] > 0 and dist["num_lora_params"] == 0
    assert tool.main([str(tmp_path / "dcp")]) == 0 and "dist checkpoint" in capsys.readouterr().out
    assert tool.main([str(tmp_path / "nothing")]) == 1 and "does not exist" in capsys.readouterr().err
