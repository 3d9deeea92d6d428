"""BF16StateAdamW against torch.optim.AdamW on fresh random problems: the first step equals
torch's bitwise (the moments are rounded only after they are used), later steps stay close,
the state is half the bytes, and a state_dict round trip continues the run exactly."""

import pytest
import torch

from megatron_moe_hybrid.config import ConfigError
from megatron_moe_hybrid.testing import tiny_config
from megatron_moe_hybrid.training.optim import BF16StateAdamW, make_optimizer, optimizer_state_bytes

HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _problem(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(64, 32, generator=g)
    target = torch.randn(64, 16, generator=g)
    params = [torch.randn(32, 16, generator=g).to(dtype).requires_grad_(True),
              torch.randn(16, generator=g).to(dtype).requires_grad_(True)]

    def loss_fn():
        return ((a @ params[0].float() + params[1].float() - target) ** 2).mean()

    return params, loss_fn


def _run(opt_cls, steps, seed=0, dtype=torch.float32, **hp):
    params, loss_fn = _problem(seed, dtype)
    opt = opt_cls(params, **{**HP, **hp})
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return params, opt, losses


def test_first_step_equals_torch_adamw_bitwise():
    ours, _, _ = _run(BF16StateAdamW, 1)
    theirs, _, _ = _run(torch.optim.AdamW, 1)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_trajectory_stays_close_to_fp32_state():
    ours, opt, losses = _run(BF16StateAdamW, 40, seed=1)
    theirs, ref_opt, ref_losses = _run(torch.optim.AdamW, 40, seed=1)
    assert losses[-1] < 0.5 * losses[0]
    for a, b in zip(ours, theirs):
        assert float((a - b).norm() / b.norm()) < 1e-2
    assert abs(losses[-1] - ref_losses[-1]) < 2e-2 * ref_losses[-1]
    for state in opt.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    moments = sum(p.numel() for p in ours) * 2
    assert optimizer_state_bytes(opt) == moments * 2 + 2 * 4  # bf16 moments + two fp32 step scalars
    assert optimizer_state_bytes(ref_opt) == moments * 4 + 2 * 4


def test_bf16_parameters_step():
    params, _, losses = _run(BF16StateAdamW, 10, seed=2, dtype=torch.bfloat16)
    assert params[0].dtype == torch.bfloat16 and losses[-1] < losses[0]


def test_state_dict_round_trip_continues_exactly():
    straight, _, straight_losses = _run(BF16StateAdamW, 10, seed=3)
    params, loss_fn = _problem(3)
    opt = BF16StateAdamW(params, **HP)
    losses = []
    for step in range(10):
        if step == 5:  # a new optimizer from the saved state
            state = opt.state_dict()
            opt = BF16StateAdamW(params, **HP)
            opt.load_state_dict(state)
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses == straight_losses
    assert all(torch.equal(a, b) for a, b in zip(params, straight))
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())  # not torch's cast to fp32


def test_make_optimizer_picks_the_class():
    p = [torch.zeros(2, requires_grad=True)]
    assert type(make_optimizer(p, 1e-3, (0.9, 0.95), 0.0, "fp32")) is torch.optim.AdamW
    assert type(make_optimizer(p, 1e-3, (0.9, 0.95), 0.0, "bf16")) is BF16StateAdamW
    with pytest.raises(ValueError, match="state_dtype"):
        make_optimizer(p, 1e-3, (0.9, 0.95), 0.0, "fp8")


@pytest.mark.parametrize("overrides,field", [
    ({"training.optimizer_state_dtype": "fp16"}, "training.optimizer_state_dtype"),
    ({"training.optimizer_state_dtype": "bf16", "training.adam_beta2": 0.999}, "training.adam_beta2"),
])
def test_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config(**overrides)
