"""util.free_port: a rendezvous port that no outgoing connection is given while the worker that binds it starts."""

from __future__ import annotations

import socket

from hybridflow.util import free_port


def test_the_port_is_free_and_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_from = int(f.read().split()[0])
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert len(ports) > 1  # drawn, not a fixed port
    for port in ports:
        assert 20000 <= port < ephemeral_from or ephemeral_from <= 20000, port  # Ray's worker ports end at 19999
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_returned(monkeypatch):
    import hybridflow.util as util

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, taken])

        class Draw:
            def randrange(self, *_):  # the taken port first, then the kernel's choice
                return next(draws, 0)

        monkeypatch.setattr(util.random, "SystemRandom", Draw)
        assert free_port("127.0.0.1") != taken
