"""CPU test of benchmarks/sparse_attention.py --forms' plumbing (its device timing is not run
here): each form sets the passes it names, the fused backward runs at its default and at each
FUSED_SWEEP config (CONFIG_OVERRIDE), its gradients are compared with the kernels form's, a
group with more heads than the fused kernel takes is recorded as skipped, and the module's
forms and overrides come back afterwards."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

_BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if _BENCH_DIR not in sys.path:
    sys.path.insert(0, _BENCH_DIR)  # the script imports its sibling common.py
import sparse_attention as bench  # noqa: E402

from megatron_moe_hybrid.ops.sparse_attention import triton_sparse as ts  # noqa: E402

pytestmark = pytest.mark.skipif(not ts._INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")


def _run_forms(monkeypatch, H, G):
    gen = torch.Generator().manual_seed(H)
    B, T, S, D, K = 1, 8, 8, 16, 5
    leaves = tuple(torch.randn(B, n, h, D, generator=gen).requires_grad_() for n, h in ((T, H), (S, G), (S, G)))
    indices = bench.causal_indices(B, T, S, K, "cpu", seed=H)
    assert (indices < 0).any()  # early queries hold -1 slots
    do = torch.randn(B, T, H, D, generator=gen)
    seen = []

    def ours(q, k, v):
        seen.append((ts.FORWARD_FORM, ts.BACKWARD_FORM, dict(ts.CONFIG_OVERRIDE)))
        return bench.sa.sparse_attention(q, k, v, indices, backend="triton")[0]

    def measure(fn, budget_ms=1500.0):
        fn()
        return 1.0, 0, 1, 0.0

    monkeypatch.setattr(bench, "measure", measure)
    out = bench._forms(ours, leaves, do, lambda msg: None)
    assert (ts.FORWARD_FORM, ts.BACKWARD_FORM, ts.CONFIG_OVERRIDE) == ("auto", "auto", {})
    return out, seen


def test_forms_time_the_fused_backward_at_each_sweep_config(monkeypatch):
    out, seen = _run_forms(monkeypatch, H=4, G=2)
    names = ["kernels", "products", "kernels+fused"] + [f"kernels+fused {c}" for c in bench.FUSED_SWEEP]
    assert list(out) == names
    for name in names:
        assert "error" not in out[name], out[name]
    forms = {(f, b, tuple(sorted(c.get("fused", {}).items()))) for f, b, c in seen}
    assert ("kernels", "fused", ()) in forms and ("products", "products", ()) in forms
    for cfg in bench.FUSED_SWEEP:
        assert ("kernels", "fused", tuple(sorted(cfg.items()))) in forms
    # two heads per group: one head block in every form, so the fused backward is the kernels form's bitwise
    assert out["kernels+fused"]["bitwise_equal_to_kernels"] is True
    assert max(out["kernels+fused"]["rel_rms_o_grads_vs_kernels"]) == 0.0
    assert max(out["products"]["rel_rms_o_grads_vs_kernels"]) < 1e-5


def test_forms_record_the_fused_backward_skipped_over_its_head_limit(monkeypatch):
    monkeypatch.setattr(ts, "FUSED_MAX_HEADS", 2)
    out, seen = _run_forms(monkeypatch, H=3, G=1)
    assert list(out) == ["kernels+fused", "kernels", "products"]
    assert "3 heads per kv group" in out["kernels+fused"]["skipped"]
    assert all(b != "fused" for _, b, _ in seen)


def test_sweep_times_its_configs_in_the_kernels_form(monkeypatch):
    """--sweep's configs are of the kernels form's kernels: each run is in that form (auto takes
    the products form at MLA's 128 heads on the GPU, where they would never launch), with the
    config set, and auto comes back afterwards."""
    gen = torch.Generator().manual_seed(0)
    B, T, S, H, G, D, K = 1, 8, 8, 2, 1, 16, 5
    leaves = tuple(torch.randn(B, n, h, D, generator=gen).requires_grad_() for n, h in ((T, H), (S, G), (S, G)))
    indices = bench.causal_indices(B, T, S, K, "cpu")
    do = torch.randn(B, T, H, D, generator=gen)
    seen = []

    def ours(q, k, v):
        seen.append((ts.FORWARD_FORM, ts.BACKWARD_FORM, dict(ts.CONFIG_OVERRIDE)))
        return bench.sa.sparse_attention(q, k, v, indices, backend="triton")[0]

    monkeypatch.setattr(bench, "measure", lambda fn, budget_ms=0: (fn(), (1.0, 0, 1, 0.0))[1])
    monkeypatch.setattr(bench, "SWEEP", {"fwd": [{"BH": 16, "BK": 32, "num_warps": 4, "num_stages": 1}],
                                         "dq": [{"BH": 16, "BK": 16, "num_warps": 4, "num_stages": 1}]})
    out = bench._sweep(ours, leaves, do, lambda msg: None, 1.0, 1.0, T)
    assert [r["kernel"] for r in out] == ["fwd", "dq"] and not [r for r in out if "error" in r], out
    assert {(f, b) for f, b, _ in seen} == {("kernels", "kernels")}
    assert [c for _, _, c in seen] == [{"fwd": bench.SWEEP["fwd"][0]}, {"dq": bench.SWEEP["dq"][0]}]
    assert (ts.FORWARD_FORM, ts.BACKWARD_FORM, ts.CONFIG_OVERRIDE) == ("auto", "auto", {})
