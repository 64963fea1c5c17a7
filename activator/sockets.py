"""Socket writes for the hot path.

gevent's ``sendall`` asks the kernel for the send buffer size (a ``getsockopt``
syscall) and reads the clock on every call, even for a few hundred bytes that one
``send`` takes whole. ``send_all`` tries one plain ``send`` first and falls back to
``sendall`` only for what is left, with the same blocking and timeout behaviour.
"""

from __future__ import annotations

from typing import Any


def send_all(sock: Any, data: bytes | bytearray | memoryview) -> None:
    """Send all of ``data`` on a gevent socket (yields only if the kernel buffer is full)."""
    sent = sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])
