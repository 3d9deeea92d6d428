"""megatron_moe_hybrid: hybrid linear/sparse-attention MoE training on Megatron-Core.

Importing the package is instant and touches no device: heavy pieces (Megatron-Core,
the compiled extension, Triton) are imported by the modules that use them.
"""

__version__ = "0.1.0"
