"""LoRA fine-tune a pretrained hybrid MoE (base frozen, adapters on attention and experts).

    python -m megatron_moe_hybrid.finetune --config examples/configs/tiny_lora.yaml
    torchrun --nproc-per-node 2 -m megatron_moe_hybrid.finetune --config examples/configs/tiny_lora.yaml \
        --parallel.expert_model_parallel_size 2
"""

import sys

from megatron_moe_hybrid.training.cli import main

if __name__ == "__main__":
    sys.exit(main("finetune"))
