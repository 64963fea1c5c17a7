"""A tunnel: after a pod's 101 (WebSocket, or any Upgrade it accepts), bytes both ways.

What this module decides:

- **Splicing.** Two directions, client to pod and pod to client, each a loop of one recv
  and one send (64 KiB at most): nothing is buffered beyond the piece in hand, so a
  slow reader slows its writer, as TCP would. The bytes that came with the upgrade
  (after the client's request head, after the pod's 101 head) go first.
- **The end.** A side that ends its direction (EOF) has that end passed on as a
  half-close (the other side reads EOF and may still send), and the other side then
  has ``CLOSE_GRACE_SECONDS`` to end its own: the tunnel (and its slot) ends when both
  did, so the pod has finished with the connection before the slot goes to the next
  request. A side that fails (a reset) ends both at once. With ``idle_timeout``, it also
  ends after that long with no byte in either direction (a deadline,
  ``deadlines.Watched``).
- **What is counted**: bytes each way, for the access log line written when it closes.

The slot the tunnel's request took is held by its owner (the proxy's ``Lease``) for as
long as ``run`` runs: a WebSocket counts as one request in flight for its whole life.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import gevent

from ..base import deadlines
from ..front import sockets

PIECE = 65536

#: Once one side ended its direction, how long the other has to end its own.
CLOSE_GRACE_SECONDS = 5.0


class Tunnel(deadlines.Watched):
    """Bytes between ``client`` and ``pod`` until both ended (see the module docstring)."""

    __slots__ = ("client", "closing_by", "downstream", "idle_timeout", "pod", "upstream")

    def __init__(self, client: Any, pod: Any, idle_timeout: float | None) -> None:
        super().__init__(client)
        self.client = client
        self.pod = pod
        self.idle_timeout = idle_timeout
        self.upstream = 0  # client -> pod bytes
        self.downstream = 0  # pod -> client bytes
        self.closing_by = 0.0  # once a direction ended: when the other must have

    def expire(self) -> None:
        """No byte either way for ``idle_timeout``, or the close grace is over: end both."""
        self.timed_out = True
        self._shut()

    def run(self, to_pod: bytes, to_client: bytes) -> None:
        """Splice until both directions ended; ``to_pod`` / ``to_client``: bytes that came
        with the upgrade. Returns once the pod ended its side (or was cut off)."""
        sweeper = deadlines.sweeper()
        sweeper.add(self)
        self._active()
        other = gevent.spawn(self._pump, self.client, self.pod, to_pod, True)
        try:
            self._pump(self.pod, self.client, to_client, False)
            other.join()
        finally:
            self._shut()
            other.join()
            sweeper.discard(self)

    def _pump(self, source: Any, sink: Any, first: bytes, upstream: bool) -> None:
        """One direction. Its end (EOF) is passed on as a half-close, and the other side
        gets the close grace to end its own; a failure (reset) ends both at once."""
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
                    break
                self._active()
        except OSError:
            self._shut()
            return
        sockets.shutdown_keeping_tls(sink, socket.SHUT_WR)  # (a TLS client's layer stays)
        if not self.closing_by:
            self.closing_by = time.monotonic() + CLOSE_GRACE_SECONDS
            self.deadline = self.closing_by if not self.deadline else min(self.deadline, self.closing_by)

    def _active(self) -> None:
        if self.idle_timeout is not None:
            deadline = time.monotonic() + self.idle_timeout
            self.deadline = min(deadline, self.closing_by) if self.closing_by else deadline

    def _shut(self) -> None:
        for sock in (self.client, self.pod):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
