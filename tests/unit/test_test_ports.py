"""The ports the test servers take: free, never twice, below the kernel's ephemeral range and outside
the range Ray keeps for its own components (a Ray head on such a port refuses to start)."""

from __future__ import annotations

import socket

from support.servers import _ephemeral_range, free_port

RAY_KEPT = range(10001, 20000)      # Ray's client server and default worker ports


def test_ports_are_distinct_bindable_and_clear_of_ray_and_the_ephemeral_range():
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port not in RAY_KEPT
        if low > 22000:
            assert port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
