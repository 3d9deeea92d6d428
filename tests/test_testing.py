"""The test harness itself (megatron_moe_hybrid/testing.py)."""


def _port_worker(rank, world_size, _unused):
    return rank


def test_spawn_retries_a_port_taken_before_the_rendezvous(monkeypatch):
    """testing.spawn: a port another process holds (EADDRINUSE at the rendezvous) is retried on
    a fresh one (the CI saw a port taken between free_port() and the bind)."""
    import socket

    from megatron_moe_hybrid import testing

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    ports = iter([holder.getsockname()[1]])
    real = testing.free_port
    monkeypatch.setattr(testing, "free_port", lambda: next(ports, None) or real())
    try:
        assert testing.spawn(_port_worker, 2, None, timeout=120) == [0, 1]
    finally:
        holder.close()
