"""Which ops of the tiny model's forward+backward on CUDA are nondeterministic: runs it under
torch.use_deterministic_algorithms(True, warn_only=True) and prints the warnings, then compares
two plain runs bitwise, gradient by gradient.

    python benchmarks/device/probe_determinism.py [--deterministic]   (the plain runs with deterministic algorithms on)
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "parallel"))


def main():
    from test_offload import model_grads, tiny_config  # noqa: E402

    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.testing import init_megatron

    init_megatron()
    if "--deterministic" in sys.argv:
        torch.use_deterministic_algorithms(True, warn_only=True)

    config = tiny_config()
    torch.manual_seed(4)
    model = build_model(config).cuda()
    tokens = torch.randint(0, config.vocab_size, (2, 33)).cuda()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    runs = [model_grads(model, tokens, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
                        config.vocab_size) for _ in range(6)]
    differing = []
    for i, name in enumerate(names):
        diffs = [(r[1][i] - runs[0][1][i]).abs().max().item() for r in runs[1:]]
        if max(diffs) > 0:
            differing.append(f"{name} max {max(diffs):.3e}")
    loss_diff = max(abs(r[0].item() - runs[0][0].item()) for r in runs)
    print(f"loss differs by {loss_diff:.3e}; {len(differing)} of {len(names)} gradients differ between runs; "
          f"those of the last layers first: {differing[::-1][:8]}")
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model_grads(model, tokens, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), config.vocab_size)
    for w in {str(w.message)[:300] for w in caught if "deterministic" in str(w.message)}:
        print("NONDET:", w[:160])


if __name__ == "__main__":
    main()
