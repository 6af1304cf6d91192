"""``shut_group_connections``: a survivor ends its gloo connections, never the store's or a
logger's (Linux: ``/proc``)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from lightning_deepcee.runtime.regroup import shut_group_connections

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc (Linux only)"
)


def _pair(port: int = 0) -> tuple[socket.socket, socket.socket, socket.socket]:
    """A listener on ``port`` (0: one the kernel picks, ephemeral), a client, the server end."""
    server = socket.socket()
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return server, client, accepted


def _fixed_port() -> int:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in range(low - 2000, low - 1000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port below the ephemeral range")


def test_connections_between_ephemeral_ports_are_shut_others_stay() -> None:
    group = _pair()  # gloo's pairs: both ends on ports the kernel chose
    store = _pair()  # the store's connection, kept by its port
    logger = _pair(_fixed_port())  # a server on a fixed port (a logger's, a data service's)
    try:
        shut = shut_group_connections(store_port=store[0].getsockname()[1])
        assert shut >= 2  # both ends of the group's connection live in this process
        for _, client, accepted in (group,):
            assert client.recv(1) == b"" and accepted.recv(1) == b""  # ended, as by an exit
        for _, client, accepted in (store, logger):
            client.sendall(b"x")
            assert accepted.recv(1) == b"x"
    finally:
        for sockets in (group, store, logger):
            for s in sockets:
                s.close()
