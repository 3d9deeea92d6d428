"""Process-group launch helpers shared by the trainer and the tests."""

import socket


def free_port() -> int:
    """A free TCP port on the loopback interface, for a rendezvous without torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
