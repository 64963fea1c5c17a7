"""A tunnel: after a pod's 101 (WebSocket, or any Upgrade it accepts), bytes both ways.

What this module decides:

- **Splicing.** Two directions, client to pod and pod to client, each a loop of one recv
  and one send (64 KiB at most): nothing is buffered beyond the piece in hand, so a
  slow reader slows its writer, as TCP would. The bytes that came with the upgrade
  (after the client's request head, after the pod's 101 head) go first.
- **The end.** The tunnel ends when either side closes (EOF) or fails: both sockets are
  shut down then, so the other direction ends too (a WebSocket is over when either side
  is). With ``idle_timeout``, it also ends after that long with no byte in either
  direction (a deadline, ``deadlines.Watched``).
- **What is counted**: bytes each way, for the access log line written when it closes.

The slot the tunnel's request took is held by its owner (the proxy's ``Lease``) for as
long as ``run`` runs: a WebSocket counts as one request in flight for its whole life.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import gevent

from . import deadlines

PIECE = 65536


class Tunnel(deadlines.Watched):
    """Bytes between ``client`` and ``pod`` until either closes (see the module docstring)."""

    __slots__ = ("client", "downstream", "idle_timeout", "pod", "upstream")

    def __init__(self, client: Any, pod: Any, idle_timeout: float | None) -> None:
        super().__init__(client)
        self.client = client
        self.pod = pod
        self.idle_timeout = idle_timeout
        self.upstream = 0  # client -> pod bytes
        self.downstream = 0  # pod -> client bytes

    def expire(self) -> None:
        """No byte either way for ``idle_timeout``: end both directions."""
        self.timed_out = True
        self._shut()

    def run(self, to_pod: bytes, to_client: bytes) -> None:
        """Splice until the end; ``to_pod`` / ``to_client``: bytes that came with the upgrade."""
        sweeper = deadlines.sweeper()
        sweeper.add(self)
        self._active()
        other = gevent.spawn(self._pump, self.client, self.pod, to_pod, True)
        try:
            self._pump(self.pod, self.client, to_client, False)
        finally:
            self._shut()
            other.join()
            sweeper.discard(self)

    def _pump(self, source: Any, sink: Any, first: bytes, upstream: bool) -> None:
        data = first
        try:
            while True:
                if data:
                    sink.sendall(data)
                    if upstream:
                        self.upstream += len(data)
                    else:
                        self.downstream += len(data)
                    self._active()
                data = source.recv(PIECE)
                if not data:
                    return
                self._active()
        except OSError:
            return
        finally:
            self._shut()

    def _active(self) -> None:
        if self.idle_timeout is not None:
            self.deadline = time.monotonic() + self.idle_timeout

    def _shut(self) -> None:
        for sock in (self.client, self.pod):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
