"""Knowing when the client went away, without reading its socket.

A queued request whose client hung up must leave the queue at once: for a
one-request-at-a-time model server, sending it later would waste a whole
inference. While a request waits for a slot, a small greenlet watches the client
socket for readability; EOF there means the client is gone, and the waiting
greenlet is woken and leaves the queue with ``ClientGone`` (see ``gate``).
Bytes that are already waiting (a request body, a pipelined request) hide the EOF
behind them, so in that case the watcher falls back to polling ``POLLRDHUP`` (the
peer closed its side), which sees through unread data.

``hung_up`` is the same check done once, without waiting: the proxy calls it right
before sending a granted request to the pod, and before returning a pod
connection to the pool.
"""

from __future__ import annotations

import select
import socket as stdlib_socket
from typing import Any, Callable

import gevent
from gevent.monkey import get_original
from gevent.socket import wait_read

from .core.errors import ActivatorError

_poll = get_original("select", "poll")  # the real poll; used with a zero timeout only
_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
RDHUP_POLL_SECONDS = 0.1


class ClientGone(ActivatorError):
    """The client closed its connection before its response started."""

    status = 499  # nginx's convention; never actually delivered
    reason = "client-gone"


def hung_up(sock: Any) -> bool:
    """True when the peer has closed (or reset) the connection. Does not yield."""
    if sock is None:
        return False
    try:
        fd = sock.fileno()
    except OSError:
        return True
    if fd < 0:
        return True
    poller = _poll()
    poller.register(fd, _HANGUP)
    return bool(poller.poll(0))


def _watch(sock: Any, on_gone: Callable[[], None]) -> None:
    try:
        wait_read(sock.fileno())
        try:
            pending = sock.recv(1, stdlib_socket.MSG_PEEK)
        except OSError:
            pending = b""
        while pending and not hung_up(sock):
            gevent.sleep(RDHUP_POLL_SECONDS)
    except (OSError, ValueError):
        pass  # the socket went away under us: that is a hang-up too
    on_gone()


def watch(sock: Any, on_gone: Callable[[], None]) -> gevent.Greenlet:
    """Call ``on_gone()`` (which must not yield) once the client of ``sock`` hangs up.

    Kill the returned greenlet when the watch is no longer needed.
    """
    return gevent.spawn(_watch, sock, on_gone)
