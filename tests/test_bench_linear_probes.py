"""CPU tests of the linear-attention device probes' plumbing (the device timing itself is not run
here). probe_gla_switch.py: each A/B row names the shape it timed, the "on" and "off" forms set
the switch's attributes as the probe says, and the module's defaults come back afterwards. Its
rows of 2026-12-05 had carried the switch's attribute name as their shape (a loop variable
shadowed the shape's name). probe_gla_configs.py: its variants set what they name (its seq_
variant stood in for _seq_config without the varlen keyword the forward passes it since
2026-12-05)."""

import copy
import importlib.util
import os
import sys

import pytest
import torch

_BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if _BENCH_DIR not in sys.path:
    sys.path.insert(0, _BENCH_DIR)  # the probe imports its siblings linear_attention.py and common.py
_spec = importlib.util.spec_from_file_location("probe_gla_switch",
                                               os.path.join(_BENCH_DIR, "device", "probe_gla_switch.py"))
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


@pytest.mark.parametrize("switch, op, tma, on", [
    ("o_tma", "gla", "whole", {"O_TMA": "whole"}),
    ("tma", "gdn", "true", {"STATES_TMA": True, "O_TMA": True}),
    ("group_sum", "gdn", "whole", {"FUSE_GROUP_SUM": True}),
    ("keep_states", "gla", "whole", {"KEEP_STATES": True}),
])
def test_switch_probe_rows_name_their_shapes_and_restore_the_defaults(switch, op, tma, on, monkeypatch):
    bench, tc = probe.bench, probe.tc
    defaults = {name: copy.deepcopy(getattr(tc, name)) for name in on}
    seen, written = {}, []

    def case(op_, key):
        gen = torch.Generator().manual_seed(len(key))
        x = {n: torch.randn(4, generator=gen) for n in ("q", "k", "v")}
        return bench.SHAPES[key][0], x, None, None

    def measure_in_turn(fn, x, do, labels, apply, rounds):
        med, peak, out = {}, {}, {}
        for i, label in enumerate(labels):
            apply(label)
            # what each form set: the op's entry of a per-op dict, the attribute itself otherwise
            seen[label] = {n: getattr(tc, n)[op] if isinstance(defaults[n], dict) else getattr(tc, n) for n in on}
            med[label] = {"fwd": 1.0, "bwd": 2.0, "fwd+bwd": 4.0 - i, "fwd+bwd graph": 3.0}
            peak[label], out[label] = 100 + i, (x["q"] * (i + 1), list(x.values()))
        return med, peak, out

    monkeypatch.setattr(tc, "FUSE_GROUP_MIN_PROGRAMS", tc.FUSE_GROUP_MIN_PROGRAMS)  # the group_sum probe's, per process
    monkeypatch.setattr(bench, "case", case)
    monkeypatch.setattr(bench, "ours_fn", lambda op_, cu: None)
    monkeypatch.setattr(bench, "measure_in_turn", measure_in_turn)
    monkeypatch.setattr(probe, "write_results", lambda path, rows: written.append(list(rows)))
    monkeypatch.setattr(sys, "argv", ["probe_gla_switch.py", "--switch", switch, "--op", op, "--tma", tma,
                                      "--shapes", "qwen,varlen", "--out", "unused.json"])
    probe.main()

    rows = written[-1]
    assert [r["shape"] for r in rows] == ["B1-T32768-HQK16-HV32-D128-bf16", "varlen-28672-4096-HQK16-HV32-D128-bf16"]
    assert all(r["name"].startswith(op) and r["speedup"] == 1.333 for r in rows), rows  # off 4.0 ms / on 3.0 ms
    assert seen["on"] == on and seen["off"] == {n: False for n in on}
    assert {name: getattr(tc, name) for name in on} == defaults


_cspec = importlib.util.spec_from_file_location("probe_gla_configs",
                                                os.path.join(_BENCH_DIR, "device", "probe_gla_configs.py"))
configs_probe = importlib.util.module_from_spec(_cspec)
_cspec.loader.exec_module(configs_probe)


def test_config_probe_variants_set_what_they_name(monkeypatch):
    """probe_gla_configs.py's variants, as linear_attention_switches_h200.sh passes them: each sets
    the config it names, and seq_<BV>x<warps> stands in for _seq_config under the keywords the
    forward and backward pass it (gdn, and varlen since 2026-12-05)."""
    tc = configs_probe.tc
    monkeypatch.setattr(tc, "CONFIGS", dict(tc.CONFIGS))
    monkeypatch.setattr(tc, "_seq_config", tc._seq_config)
    for name, key, config in (("prep_4", "prep", (None, 4)), ("prep_4r128", "prep", (None, 4, 128)),
                              ("cfg_seq_wide_varlen_64x4", "seq_wide_varlen", (64, 4)),
                              ("cfg_seq_wide_64x8", "seq_wide", (64, 8))):
        configs_probe.variant(name)[1]()
        assert tc.CONFIGS[key] == config, name
    configs_probe.variant("seq_32x8")[1]()
    assert tc._seq_config(128, 128, 64, "cpu", gdn=True, varlen=True) == (32, 8)
