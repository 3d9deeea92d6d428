"""parallel/recompute.py's reuse_in_recompute on a toy layer: the recompute takes the first
forward's value, entries are checked against their fingerprint, bounded, and never hold a graph."""

import types

import pytest
import torch

from megatron_moe_hybrid.parallel import recompute as rc


class Toy(torch.nn.Module):
    """y = x * w + selection(x), the "selection" a no-grad result computed through reuse_in_recompute."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))
        self.calls = 0

    def select(self, x):
        self.calls += 1
        return x.detach().argsort().float()

    def forward(self, x):
        sel = rc.reuse_in_recompute(self, "sel", (x,), lambda: self.select(x))
        return x * self.w + sel


def model_of(layer):
    model = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[layer]))
    rc.recompute_layers(model, 1)
    return layer


def test_recompute_takes_the_first_forwards_value():
    layer = model_of(Toy())
    x = torch.randn(5, requires_grad=True)
    layer(x).sum().backward()
    assert layer.calls == 1  # the recompute reused it
    assert torch.equal(x.grad, torch.full((5,), 2.0))
    assert not layer._recompute_stash["sel"]  # taken
    with torch.no_grad():  # no recompute ahead: nothing kept
        layer(x)
    assert layer.calls == 2 and not layer._recompute_stash["sel"]


def test_a_stale_entry_is_dropped_and_the_stash_is_bounded():
    layer = model_of(Toy())
    for _ in range(rc.STASH_DEPTH + 2):  # forwards whose backward never runs
        layer(torch.randn(5, requires_grad=True))
    assert len(layer._recompute_stash["sel"]) == rc.STASH_DEPTH
    x = torch.randn(5, requires_grad=True)
    layer(x).sum().backward()
    calls = layer.calls
    assert not layer._recompute_stash["sel"]  # the stale ones dropped on their fingerprint, ours taken
    assert calls == rc.STASH_DEPTH + 3  # every first forward, no recompute


def test_a_recompute_without_an_entry_computes():
    layer = model_of(Toy())
    x = torch.randn(5, requires_grad=True)
    y = layer(x)
    layer._recompute_stash["sel"].clear()  # as if it had been dropped
    y.sum().backward()
    assert layer.calls == 2 and torch.equal(x.grad, torch.full((5,), 2.0))


def test_a_result_with_a_graph_is_refused():
    class Bad(Toy):
        def select(self, x):
            return x * 1.0  # would keep the first forward's graph alive on the module

    layer = model_of(Bad())
    with pytest.raises(ValueError, match="requires grad"):
        layer(torch.randn(5, requires_grad=True))
