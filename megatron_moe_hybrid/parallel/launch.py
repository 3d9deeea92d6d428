"""Process-group launch helpers shared by the trainer, the tests and the benchmarks."""

import os
import socket


def free_port() -> int:
    """A free TCP port on the loopback interface, for a rendezvous without torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_one_process_group(backend: str, **kwargs) -> None:
    """torch.distributed.init_process_group for a group of this one process (launched without
    torchrun), over an in-process HashStore: no port to pick, so none for another process to
    take between the pick and the bind (EADDRINUSE, seen in CI). kwargs: timeout, device_id."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def init_process_group(backend: str, **kwargs) -> None:
    """Under torchrun (RANK set): its env:// rendezvous; launched without it, a group of this one
    process (init_one_process_group). The environment is left as it is: a child started later
    would take a RANK set here for torchrun's."""
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.init_process_group(backend, **kwargs)
    else:
        init_one_process_group(backend, **kwargs)
