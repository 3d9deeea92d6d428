"""A run outside torchrun (no RANK in the environment) makes its process group of one over an
in-process store: no port is picked, so none can be taken by another process between the pick
and the bind (an EADDRINUSE failed a CI run so)."""

import os

import pytest
import torch
import torch.distributed as dist

import megatron_moe_hybrid.parallel.launch as launch
import megatron_moe_hybrid.testing as testing
from megatron_moe_hybrid.testing import init_megatron, teardown, tiny_config


def _no_port():
    raise AssertionError("a one-process group picked a port")


@pytest.fixture
def no_group(monkeypatch):
    teardown()  # whatever an earlier test of this process left
    monkeypatch.setattr(launch, "free_port", _no_port)
    monkeypatch.setattr(testing, "free_port", _no_port)
    monkeypatch.delenv("RANK", raising=False)
    yield
    teardown()


def test_the_trainer_alone_takes_no_port(no_group, monkeypatch):
    from megatron.core import parallel_state as ps

    from megatron_moe_hybrid.training import trainer

    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    trainer.init_distributed(tiny_config(**{"training.device": "cpu"}))
    t = torch.ones(3)
    dist.all_reduce(t)
    assert dist.get_world_size() == 1 and torch.equal(t, torch.ones(3))
    assert ps.model_parallel_is_initialized() and ps.get_expert_model_parallel_world_size() == 1
    assert {k: os.environ.get(k) for k in before} == before  # the environment is left as it was


def test_the_tests_group_of_one_takes_no_port(no_group):
    init_megatron()
    t = torch.arange(4.0)
    dist.all_reduce(t)
    assert dist.get_world_size() == 1 and torch.equal(t, torch.arange(4.0))
