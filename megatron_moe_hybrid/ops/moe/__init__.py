"""MoE ops: top-k routing, load-balancing loss, permute/unpermute, grouped SwiGLU experts.

The plain-PyTorch references in reference.py define the semantics; fused backends of the
same functions are checked against them.
"""

from .reference import grouped_mlp, load_balancing_loss, permute, router_topk, unpermute

__all__ = ["router_topk", "load_balancing_loss", "permute", "unpermute", "grouped_mlp"]
