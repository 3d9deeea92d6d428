"""Pretrain a hybrid MoE.

    python -m megatron_moe_hybrid.train --config examples/configs/tiny.yaml
    torchrun --nproc-per-node 2 -m megatron_moe_hybrid.train --config examples/configs/tiny.yaml \
        --parallel.expert_model_parallel_size 2
"""

import sys

from megatron_moe_hybrid.training.cli import main

if __name__ == "__main__":
    sys.exit(main("pretrain"))
