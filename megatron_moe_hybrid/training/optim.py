"""The trainer's optimizer: torch's AdamW, or AdamW with its two moments stored in bf16.

DeepSeek-V3 tracks AdamW's first and second moments in BF16 instead of FP32 "without
incurring observable performance degradation" (its report, section 3.3.2): that halves the
optimizer state of the trainable parameters (8 -> 4 bytes per parameter; LoRA adapters are
the whole state of a fine-tuning run). `BF16StateAdamW` does torch.optim.AdamW's update
(decoupled weight decay, bias-corrected moments, same operation order) in fp32 and rounds
each moment to bf16 once per step, to the nearest. bf16 keeps 8 significant bits, so a
moment that moves by less than ~0.4% a step stalls: the config refuses adam_beta2 above 0.99
with it (the second moment then moves by at least 1% of the gap to g^2).
"""

import math

import torch

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW over params whose state exp_avg and exp_avg_sq are bf16 (step an fp32 scalar, as
    torch's). Parameters and gradients keep their own dtype (fp32 adapters, bf16 or fp32
    weights, FSDP2 DTensor shards alike). state_dict / load_state_dict are torch's: a checkpoint
    holds the bf16 moments."""

    state_dtype = torch.bfloat16  # of the moments (checkpoint.load_optimizer_state reads them in it)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, which casts floating state to each parameter's dtype, then the moments back
        to bf16 (exact: they were saved in bf16)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != torch.bfloat16:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)  # fp32 math, one rounding each
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                p.mul_(1 - lr * weight_decay)
                step_size = lr / (1 - beta1**step)
                denom = exp_avg_sq.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss


def make_optimizer(params, lr: float, betas, weight_decay: float, state_dtype: str = "fp32") -> torch.optim.Optimizer:
    """torch.optim.AdamW for state_dtype "fp32", BF16StateAdamW for "bf16"."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPES)}, got {state_dtype!r}")
    cls = torch.optim.AdamW if state_dtype == "fp32" else BF16StateAdamW
    return cls(params, lr=lr, betas=betas, weight_decay=weight_decay)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state tensors (local shards of DTensors)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total
