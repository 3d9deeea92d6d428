"""MoE ops: top-k routing, load-balancing loss, permute/unpermute, grouped SwiGLU experts.

The plain-PyTorch references in reference.py define the semantics; fused backends of the
same functions are checked against them.
"""

from .reference import grouped_mlp, load_balancing_loss, permute, router_topk, unpermute

PERMUTE_BACKENDS = ("auto", "torch", "fused")


def _check_backend(backend: str) -> None:
    if backend not in PERMUTE_BACKENDS:
        raise ValueError(f"backend: unknown permute backend {backend!r}; choose from {', '.join(PERMUTE_BACKENDS)}")
    if backend == "fused":
        from megatron_moe_hybrid import _ext

        _ext.require("cpu")


def permute_tokens(x, topk_idx, num_experts: int, backend: str = "auto"):
    """permute() through the compiled op ("fused"), the reference ("torch"), or the compiled op
    where it exists with a once-only notice otherwise ("auto")."""
    _check_backend(backend)
    if backend == "torch":
        return permute(x, topk_idx, num_experts)
    from .fused_permute import fused_permute

    return fused_permute(x, topk_idx, num_experts)


def unpermute_tokens(y, row_id_map, probs, backend: str = "auto"):
    _check_backend(backend)
    if backend == "torch":
        return unpermute(y, row_id_map, probs)
    from .fused_permute import fused_unpermute

    return fused_unpermute(y, row_id_map, probs)


__all__ = [
    "router_topk",
    "load_balancing_loss",
    "permute",
    "unpermute",
    "permute_tokens",
    "unpermute_tokens",
    "grouped_mlp",
    "PERMUTE_BACKENDS",
]
