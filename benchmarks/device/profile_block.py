"""Profiles one forward+backward of benchmarks/context_parallel.py's LLLS block on one GPU.

    python benchmarks/device/profile_block.py --seq 8192   # prints the top ops by time
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from context_parallel import MODEL, build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("nccl")
    device = torch.device("cuda", 0)
    config, model = build(MODEL, args.seq, 1, device)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    tokens = torch.randint(0, config.vocab_size, (1, args.seq + 1), device=device)
    pos = torch.arange(args.seq, device=device)[None]

    def step():
        model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).mean().backward()

    step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
