"""benchmarks/end_to_end.py's step breakdown under activation recompute: a recomputed layer's
forward runs inside the backward of the region whose saved tensors are unpacked first (the
MoE); Regions.totals must count it in each recomputed region's own category instead.

A toy layer (an "attention" that sleeps, an "MoE" whose "experts" sleep) under the project's
recompute_layers, timed with the CPU clock: the sleeps set the expected totals.
"""

import importlib.util
import os
import time
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("end_to_end_bench", os.path.join(ROOT, "benchmarks", "end_to_end.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Sleep(torch.nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        time.sleep(self.seconds)
        return x * self.weight


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Sleep(0.0)
        self.experts = Sleep(0.04)
        self.shared_experts = None

    def forward(self, x):
        # the combine's saved tensors come last: torch's checkpoint stops the recompute there,
        # after the experts' forward has ended but before the MoE's has
        return self.experts(self.router(x)) * x


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention = Sleep(0.06)
        self.mlp = MoE()

    def forward(self, x):
        return x + self.mlp(self.self_attention(x))


@pytest.mark.parametrize("recompute", [False, True])
def test_recomputed_forwards_count_in_their_own_regions(e2e, recompute):
    from megatron_moe_hybrid.parallel.recompute import recompute_layers

    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[Layer(), Layer()]))
    if recompute:
        recompute_layers(model, 2)
    regions = e2e.Regions(e2e.Clock(False))
    for layer in model.decoder.layers:
        regions.attach(layer.self_attention, "attention")
        regions.attach(layer.mlp, "moe")
        regions.attach(layer.mlp.router, "router")
        regions.attach(layer.mlp.experts, "experts")
    regions.on = True
    x = torch.ones(4, requires_grad=True)
    for layer in model.decoder.layers:
        x = layer(x)
    x.sum().backward()
    t = regions.totals()
    runs = 2 if recompute else 1  # forwards per layer
    # 2 layers x runs x the sleep, plus bookkeeping (generous: a loaded CI machine)
    assert 2 * runs * 0.06e3 <= t["attention"] < 2 * runs * 0.06e3 + 60, t
    assert 2 * runs * 0.04e3 <= t["experts"] < 2 * runs * 0.04e3 + 60, t
    # the MoE region holds its experts (their recompute too), not the attention's recomputed forward
    assert t["experts"] <= t["moe"] < t["experts"] + 60, t
    # the attention's recomputed forwards; the MoE's own may be cut short by torch's checkpoint
    # (early stop after its last saved tensor), and then stay in its backward, where they belong
    if recompute:
        assert 2 * 0.06e3 <= t["recompute"] < 2 * 0.10e3 + 60, t
    else:
        assert t["recompute"] == 0.0, t
