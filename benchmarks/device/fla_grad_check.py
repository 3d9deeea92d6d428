"""Are fla 0.6.0's Gated DeltaNet gradients right on this GPU with its Triton-3.6 Hopper guard
lifted (fla issue #640)? The anchor of benchmarks/end_to_end.py trains through them.

Compares, at the end-to-end model's shapes (B1, T4096, 32 heads of 128, bf16), the gradients of
fla's chunk_gated_delta_rule (guard lifted) and of ours (Triton) with our fp32 reference.
Written when the end-to-end LoRA curves ended 17% apart; not yet run (no GPU time was left):
    source .whl/preamble.sh && PYTHONPATH=$PWD python benchmarks/device/fla_grad_check.py
"""
import torch

import fla.ops.common.chunk_o as fla_chunk_o

fla_chunk_o.TRITON_ABOVE_3_7_1 = True
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdr  # noqa: E402

from megatron_moe_hybrid.ops.linear_attention import chunk_gated_delta_rule as ours  # noqa: E402
from megatron_moe_hybrid.testing import rel_rms  # noqa: E402

torch.manual_seed(0)
B, T, H, D = 1, 4096, 32, 128
dev = "cuda"
q, k, v = (torch.randn(B, T, H, D, device=dev) for _ in range(3))
g = -torch.nn.functional.softplus(torch.randn(B, T, H, device=dev)) * 0.5
beta = torch.rand(B, T, H, device=dev)
go = torch.randn(B, T, H, D, device=dev)


def grads(fn, dtype, **kw):
    xs = [t.to(dtype).requires_grad_() for t in (q, k, v, g, beta)]
    o, _ = fn(*xs, use_qk_l2norm_in_kernel=True, **kw)
    gs = torch.autograd.grad(o, xs, go.to(o.dtype))
    return [o] + list(gs)


ref = grads(ours, torch.float32, backend="torch")
names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
for label, got in (("fla bf16 (guard lifted)", grads(fla_gdr, torch.bfloat16)),
                   ("ours triton bf16", grads(ours, torch.bfloat16, backend="triton"))):
    print(label, {n: round(rel_rms(a.float(), r), 5) for n, a, r in zip(names, got, ref)}, flush=True)
