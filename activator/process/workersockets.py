"""The sockets a worker process inherits from its supervisor (``workers: N > 1``).

The supervisor binds every listener and passes the file descriptors down, in the
environment variable ``ACTIVATOR_WORKER`` (JSON), so that workers never race for a
port and a restarted worker gets the same ones:

- ``public``: the proxy listener, one socket shared by all workers (the kernel
  hands each accepted connection to one of them);
- ``private``: this worker's own loopback proxy port, where its siblings reach its peer
  requests for services of which they own no slot;
- ``admin``: this worker's loopback admin port, which the supervisor's admin API
  reads to show the whole activator;
- ``exchange``: this incarnation's end of its socket pair to the supervisor's slot
  exchange (``sharing.py``), made anew for each start;
- ``secret``: what the workers prove their checks of each other with (``peers.py``).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

ENV = "ACTIVATOR_WORKER"


@dataclass(frozen=True)
class WorkerSockets:
    index: int
    addresses: tuple[str, ...]  # every worker's private proxy address, by index
    public: socket.socket
    private: socket.socket
    admin: socket.socket
    exchange: socket.socket
    #: The workers' shared secret for their checks of each other (made by the supervisor).
    secret: str

    @staticmethod
    def encode(
        index: int, addresses: list[str], public: int, private: int, admin: int, exchange: int, secret: str
    ) -> str:
        return json.dumps(
            {
                "index": index,
                "addresses": addresses,
                "public": public,
                "private": private,
                "admin": admin,
                "exchange": exchange,
                "secret": secret,
            }
        )

    @classmethod
    def from_env(cls) -> WorkerSockets | None:
        raw = os.environ.get(ENV)
        if not raw:
            return None
        spec = json.loads(raw)

        def adopt(fd: int) -> socket.socket:
            sock = socket.socket(fileno=fd)  # family and type read from the descriptor
            sock.setblocking(False)
            return sock

        return cls(
            index=spec["index"],
            addresses=tuple(spec["addresses"]),
            public=adopt(spec["public"]),
            private=adopt(spec["private"]),
            admin=adopt(spec["admin"]),
            exchange=socket.socket(fileno=spec["exchange"]),  # blocking: waits yield under gevent
            secret=spec["secret"],
        )
