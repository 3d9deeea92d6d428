"""CPU test of benchmarks/loss.py's scale_ab plumbing (the device timing is not run here): each
variant runs with the switch it names, in alternating rounds, and the default comes back."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

_BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if _BENCH_DIR not in sys.path:
    sys.path.insert(0, _BENCH_DIR)  # the script imports its sibling common.py
import loss as bench  # noqa: E402

from megatron_moe_hybrid.ops.cross_entropy import triton as ce_triton  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need TRITON_INTERPRET=1")


def test_scale_ab_times_both_forms_in_turn_and_restores_the_default(monkeypatch):
    seen = []

    real_grad = torch.autograd.grad

    def grad(outputs, inputs, grad_outputs=None):
        seen.append((ce_triton.SCALE_ON_DEVICE, None if grad_outputs is None else grad_outputs.item()))
        return real_grad(outputs, inputs, grad_outputs)

    def time_and_peak(fn, warmup, reps):
        fn()  # the real step: forward and backward on CPU tensors (interpreter)
        on, up = seen[-1]
        return (1.0 if on else 1.5) + (0 if up is None else 10) + 0.1 * len(seen), 0

    monkeypatch.setattr(torch.autograd, "grad", grad)

    monkeypatch.setattr(bench, "time_and_peak", time_and_peak)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 8, generator=gen).requires_grad_()
    weight = torch.randn(13, 8, generator=gen).requires_grad_()
    labels = torch.randint(0, 13, (9,), generator=gen)
    got = bench.scale_ab(4, hidden, weight, labels, reps=1, rounds=3)
    assert seen == [(True, None), (False, None), (True, 0.5), (False, 0.5)] * 3
    assert got == {"rounds": 3, "device_ms": 1.5, "torch_mul_ms": 2.1, "speedup": round(2.1 / 1.5, 4),
                   "device_ms_half": 11.7, "torch_mul_ms_half": 12.3, "speedup_half": round(12.3 / 11.7, 4)}
    assert ce_triton.SCALE_ON_DEVICE is True
