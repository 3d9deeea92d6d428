"""The routed experts of one EP rank: SwiGLU MLPs applied to rows grouped by expert.

Shape legend: E_local experts on this rank, N rows grouped by expert, h hidden size,
F expert FFN hidden size (config.moe.ffn_hidden_size).
"""

from typing import Callable, Optional

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_moe_hybrid.ops.moe.grouped import grouped_matmul, reads_counts_on_host, swiglu_experts
from megatron_moe_hybrid.ops.moe.swiglu import swiglu

# (rows [N, in], counts) -> [N, out]: added to a matmul's output (a LoRA adapter)
Extra = Callable[[torch.Tensor, object], torch.Tensor]


class GroupedExperts(MegatronModule):
    """weight1 [E_local, h, 2F] (gate | up) and weight2 [E_local, F, h] of experts
    [expert_offset, expert_offset + E_local).

    Each expert is initialised from its own seed, derived from one draw of the global RNG
    plus its global index. So experts differ even when every EP rank runs with the same seed,
    and the experts built on any EP layout equal the matching slice of the full set.
    """

    def __init__(self, config, num_local_experts: int, expert_offset: int = 0):
        super().__init__(config)
        if num_local_experts < 1:
            raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")
        h, ffn = config.hidden_size, config.moe.ffn_hidden_size
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset
        self.gemm_backend = getattr(getattr(config, "moe", None), "grouped_gemm_backend", "auto")
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, h, 2 * ffn, dtype=config.params_dtype)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, ffn, h, dtype=config.params_dtype)
        )
        base_seed = int(torch.randint(2**62, (), device="cpu"))  # also when built under torch.device("meta")
        for e in range(num_local_experts):
            # devices=[] keeps fork_rng off CUDA; the global RNG state is restored afterwards.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(base_seed + expert_offset + e)
                config.init_method(self.weight1.data[e])
                config.output_layer_init_method(self.weight2.data[e])
        for param in (self.weight1, self.weight2):
            param.allreduce = False  # Megatron's marker: expert params skip the DP all-reduce
            param.num_local_experts = num_local_experts

    def forward(
        self,
        x_sorted: torch.Tensor,
        tokens_per_local_expert: torch.Tensor | list[int],
        fc1_extra: Optional[Extra] = None,
        fc2_extra: Optional[Extra] = None,
    ) -> torch.Tensor:
        """x_sorted [N, h] grouped by local expert, tokens_per_local_expert [E_local] (host ints,
        or a device tensor: the grouped GEMM takes it without a host sync) -> [N, h].

        fc1_extra / fc2_extra(rows, counts) are added to the outputs of the two matmuls (LoRA
        adapters): passed in here, so that the weights are used inside this module's forward,
        where FSDP2 gathers them. Rows past sum(tokens_per_local_expert) are padding; their
        outputs are unspecified."""
        w1, w2 = self.weight1, self.weight2
        if fc1_extra is None and fc2_extra is None:
            return swiglu_experts(x_sorted, tokens_per_local_expert, w1, w2, self.gemm_backend)
        counts = tokens_per_local_expert
        if reads_counts_on_host(x_sorted, w1, self.gemm_backend):  # read them once, not per product
            counts = counts.tolist() if torch.is_tensor(counts) else list(counts)
        h1 = grouped_matmul(x_sorted.to(w1.dtype), w1, counts, self.gemm_backend).to(x_sorted.dtype)  # [N, 2F]
        if fc1_extra is not None:
            h1 = h1 + fc1_extra(x_sorted, counts).to(h1.dtype)
        act = swiglu(h1)  # [N, F]: fused on CUDA
        out = grouped_matmul(act.to(w2.dtype), w2, counts, self.gemm_backend).to(act.dtype)  # [N, h]
        if fc2_extra is not None:
            out = out + fc2_extra(act, counts).to(out.dtype)
        return out
