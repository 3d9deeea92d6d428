"""Convert a LoRA adapter written by our trainer to PEFT's format, and back.

    python tools/export_lora.py outputs/ft peft_out                 # a run: its adapter/ folder
    python tools/export_lora.py outputs/ft/adapter peft_out --num-experts 8
    python tools/export_lora.py peft_out ours_out --to-ours         # PEFT -> our names
    python tools/export_lora.py outputs/ft peft_hf --hf             # PEFT over the transformers model's modules

Shape legend: r rank, h hidden size, F expert FFN size, g a global expert index.
Ours (adapter/adapter_model.safetensors):
  <module>.lora_A [r, in], <module>.lora_B [out, r]                     linears
  <experts>.lora_A1.expert<g> [r, h], lora_B1 [2F, r] (gate | up rows),
  lora_A2 [r, F], lora_B2 [h, r]; without `.expert<g>` when one adapter is shared by all.
PEFT (its key format, one module per expert and projection as vLLM's MoE LoRA lays it out):
  base_model.model.<module>.lora_A.weight / lora_B.weight
  base_model.model.<experts>.<g>.{gate_proj,up_proj,down_proj}.lora_{A,B}.weight
<module> is our model's module path (decoder.layers.0.self_attention.in_proj, ...), so PEFT loads
the file onto our model's module tree. With --hf the modules are the transformers model's
(model.layers.0.linear_attn.in_proj_qkvz, ...; experts per expert, as the HF checkpoint files and
vLLM's MoE LoRA name them): a fused projection of ours gives each HF projection it becomes its
rows of B and the same A (convert_checkpoint.hf_lora_adapter; the run's config.yaml names the
model). Or fold the adapters into the weights:
  python tools/convert_checkpoint.py ours-to-hf --ckpt outputs/ft --out hf_out --merge-lora
Our fused gate|up adapter becomes two with the same A and B split by rows, so a PEFT adapter
imports back only where gate_proj and up_proj share A. A shared expert adapter is written
once per expert (num_experts from adapter_config.json or --num-experts).
"""

import argparse
import json
import os
import re
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."
META_KEY = "megatron_moe_hybrid.adapter_config"  # our config, kept in the file's metadata

_OURS_LINEAR = re.compile(r"^(?P<mod>.+)\.lora_(?P<p>[AB])$")
_OURS_EXPERT = re.compile(r"^(?P<mod>.+)\.lora_(?P<p>[AB][12])(?:\.expert(?P<g>\d+))?$")
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<mod>.+)\.lora_(?P<p>[AB])\.weight$")
_PEFT_EXPERT = re.compile(r"^(?P<mod>.+)\.(?P<g>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def _adapter_dir(src: str) -> str:
    for d in (src, os.path.join(src, "adapter")):
        if os.path.isfile(os.path.join(d, ADAPTER_FILE)):
            return d
    raise ValueError(f"src: no {ADAPTER_FILE} in {src} or {os.path.join(src, 'adapter')}; pass an adapter dir or a run's output_dir")


def read_adapter(src: str) -> tuple[dict[str, torch.Tensor], dict, dict[str, str]]:
    """(tensors, adapter_config.json, file metadata) of an adapter dir or a run's output_dir."""
    d = _adapter_dir(src)
    with safe_open(os.path.join(d, ADAPTER_FILE), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata() or {}
    config = {}
    if os.path.isfile(os.path.join(d, CONFIG_FILE)):
        with open(os.path.join(d, CONFIG_FILE)) as f:
            config = json.load(f)
    return tensors, config, metadata


def write_adapter(dst: str, tensors: dict[str, torch.Tensor], config: dict, metadata: dict | None = None) -> str:
    os.makedirs(dst, exist_ok=True)
    # safetensors refuses shared storage: every tensor gets its own contiguous copy.
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, os.path.join(dst, ADAPTER_FILE),
              metadata={"format": "pt", **(metadata or {})})
    with open(os.path.join(dst, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
    return dst


def to_peft(tensors: dict[str, torch.Tensor], config: dict, num_experts: int | None = None):
    """Our adapter -> (PEFT tensors, PEFT adapter_config, file metadata)."""
    _check_config(config)
    out: dict[str, torch.Tensor] = {}
    shared = False
    for key, t in tensors.items():
        m = _OURS_LINEAR.match(key)
        if m:
            out[f"{PREFIX}{m['mod']}.lora_{m['p']}.weight"] = t
            continue
        m = _OURS_EXPERT.match(key)
        if not m:
            raise ValueError(f"tensors: {key!r} is not an adapter tensor name (<module>.lora_A, <experts>.lora_A1.expert<g>, ...)")
        if m["g"] is None:
            shared = True
            n = num_experts or config.get("num_experts")
            if not n:
                raise ValueError("num_experts: a shared expert adapter is written once per expert; pass --num-experts")
            experts = range(int(n))
        else:
            experts = [int(m["g"])]
        for g in experts:
            base = f"{PREFIX}{m['mod']}.{g}"
            if m["p"] == "A1":  # one A for the fused gate|up matmul: both halves read it
                out[f"{base}.gate_proj.lora_A.weight"] = t
                out[f"{base}.up_proj.lora_A.weight"] = t
            elif m["p"] == "B1":  # [2F, r]: gate rows first, as in weight1's gate | up columns
                gate, up = t.chunk(2, dim=0)
                out[f"{base}.gate_proj.lora_B.weight"] = gate
                out[f"{base}.up_proj.lora_B.weight"] = up
            else:
                out[f"{base}.down_proj.lora_{m['p'][0]}.weight"] = t
    peft_config = _peft_config(config, out)
    ours = {**config, "expert_adapter": "shared" if shared else config.get("expert_adapter", "per_expert")}
    return out, peft_config, {META_KEY: json.dumps(ours)}


def _check_config(config: dict) -> None:
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise ValueError(f"config: adapter_config.json lacks {key!r}; it is written by the trainer's save_adapter")


def _peft_config(config: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """PEFT's adapter_config.json for PEFT-keyed tensors (their modules' last names as target_modules)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(config["r"]),
        "lora_alpha": config["lora_alpha"],
        "lora_dropout": config.get("lora_dropout", 0.0),
        "use_rslora": bool(config.get("rslora", False)),
        "target_modules": sorted({_PEFT_KEY.match(k)["mod"].rsplit(".", 1)[-1] for k in tensors}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": config.get("base_checkpoint"),
    }


def from_peft(tensors: dict[str, torch.Tensor], peft_config: dict, metadata: dict | None = None):
    """PEFT tensors (+ adapter_config, + our metadata if present) -> (our tensors, our config)."""
    ours_config = json.loads((metadata or {}).get(META_KEY, "null")) or {
        "r": peft_config["r"], "lora_alpha": peft_config["lora_alpha"],
        "lora_dropout": peft_config.get("lora_dropout", 0.0), "rslora": peft_config.get("use_rslora", False),
        "expert_adapter": "per_expert",
    }
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _PEFT_KEY.match(key)
        if not m:
            raise ValueError(f"tensors: {key!r} is not a PEFT LoRA key (base_model.model.<module>.lora_A.weight)")
        e = _PEFT_EXPERT.match(m["mod"])
        if e:
            experts.setdefault((e["mod"], int(e["g"])), {})[f"{e['proj']}.{m['p']}"] = t
        else:
            out[f"{m['mod']}.lora_{m['p']}"] = t
    per_module: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for (mod, g), parts in experts.items():
        need = {f"{p}.{ab}" for p in ("gate_proj", "up_proj", "down_proj") for ab in "AB"}
        if set(parts) != need:
            raise ValueError(f"tensors: expert {g} of {mod} has {sorted(parts)}; needs {sorted(need)}")
        if not torch.equal(parts["gate_proj.A"], parts["up_proj.A"]):
            raise ValueError(
                f"tensors: {mod}.{g}: gate_proj and up_proj have different lora_A; our fused gate|up "
                "adapter shares one A, so this adapter cannot be imported"
            )
        per_module.setdefault(mod, {})[g] = {
            "A1": parts["gate_proj.A"],
            "B1": torch.cat([parts["gate_proj.B"], parts["up_proj.B"]]),
            "A2": parts["down_proj.A"],
            "B2": parts["down_proj.B"],
        }
    shared = ours_config.get("expert_adapter") == "shared"
    for mod, by_g in per_module.items():
        for g, ps in sorted(by_g.items()):
            for p, t in ps.items():
                if shared:
                    first = by_g[min(by_g)][p]
                    if not torch.equal(t, first):
                        raise ValueError(f"tensors: {mod}: experts differ but the adapter says expert_adapter: shared")
                    out[f"{mod}.lora_{p}"] = first
                else:
                    out[f"{mod}.lora_{p}.expert{g}"] = t
    return out, ours_config


def export_peft(src: str, out_dir: str, num_experts: int | None = None) -> str:
    tensors, config, _ = read_adapter(src)
    peft_tensors, peft_config, metadata = to_peft(tensors, config, num_experts)
    return write_adapter(out_dir, peft_tensors, peft_config, metadata)


def _run_config(src: str, config_path: str | None, single_process: dict):
    """The model config of the run an adapter belongs to, read whole in one process: config_path,
    else config.yaml in the run's output_dir (src, or the adapter dir's parent)."""
    from megatron_moe_hybrid.config import load_config

    candidates = [config_path] if config_path else [os.path.join(src, "config.yaml"),
                                                    os.path.join(os.path.dirname(os.path.abspath(_adapter_dir(src))),
                                                                 "config.yaml")]  # fmt: skip
    path = next((c for c in candidates if c and os.path.isfile(c)), None)
    if path is None:
        raise ValueError(f"config: --hf needs the run's model config; none of {candidates} exists: pass --config")
    return load_config(path, {**single_process, "training.init_from": None, "training.tokenizer_model": None})


def export_peft_hf(src: str, out_dir: str, config_path: str | None = None) -> str:
    """Our adapter -> PEFT over the transformers model's module paths (module docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import convert_checkpoint  # tools/convert_checkpoint.py: the families' weight export

    tensors, config, _ = read_adapter(src)
    _check_config(config)
    model_config = _run_config(src, config_path, convert_checkpoint.SINGLE_PROCESS)
    out = {}
    for mod, (a, b) in convert_checkpoint.hf_lora_adapter(tensors, model_config).items():
        out[f"{PREFIX}{mod}.lora_A.weight"] = a
        out[f"{PREFIX}{mod}.lora_B.weight"] = b
    return write_adapter(out_dir, out, _peft_config(config, out))


def import_peft(peft_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, peft_config, metadata = read_adapter(peft_dir)
    if peft_config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_dir: {peft_dir} holds a {peft_config['peft_type']} adapter, not LORA")
    return from_peft(tensors, peft_config, metadata)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="our adapter dir or a run's output_dir (with --to-ours: a PEFT adapter dir)")
    ap.add_argument("out_dir")
    ap.add_argument("--num-experts", type=int, default=None, help="experts per layer (for a shared expert adapter)")
    ap.add_argument("--to-ours", action="store_true", help="convert a PEFT adapter back to our names")
    ap.add_argument("--hf", action="store_true", help="PEFT over the transformers model's module paths (for "
                    "transformers / vLLM), not ours")
    ap.add_argument("--config", default=None, help="with --hf: the run's config.yaml (default: the run's own)")
    args = ap.parse_args(argv)
    try:
        if args.hf:
            export_peft_hf(args.src, args.out_dir, args.config)
        elif args.to_ours:
            tensors, config = import_peft(args.src)
            write_adapter(args.out_dir, tensors, config)
        else:
            export_peft(args.src, args.out_dir, args.num_experts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {os.path.join(args.out_dir, ADAPTER_FILE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
