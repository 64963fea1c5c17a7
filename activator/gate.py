"""Waiting for a slot under gevent: the only place a request blocks on the throttler.

The core decides (``ServiceThrottler.acquire`` returns a grant or a waiter); this
module does the waiting. A waiter parks its greenlet on a ``gevent.event.Event``
that the core sets when it hands the waiter a slot, bounded by ``queue_timeout``.
Whatever ends the wait (a slot, the timeout, the client hanging up, the greenlet
killed), the waiter leaves the queue, or a grant that arrived in the same instant is
released: a slot is never lost between "granted" and "woken". A client that hung up
never gets a pod, even when its slot arrived in the same instant.
"""

from __future__ import annotations

import time
from typing import Any

from gevent.event import Event

from . import client

from .core.errors import QueueTimeout
from .core.throttler import Grant, ServiceThrottler, Waiter


class Redirected(Exception):
    """The waiter was taken out of the queue to be forwarded: this process owns no slot now."""


def _wait(throttler: ServiceThrottler, first: Grant | Waiter, event: Event, timeout: float,
          client_socket: Any) -> Grant:
    if isinstance(first, Grant):
        return first
    gone = False

    def client_left() -> None:
        nonlocal gone
        gone = True
        event.set()

    watcher = client.watch(client_socket, client_left) if client_socket is not None else None
    try:
        event.wait(timeout)
    except BaseException:
        grant = throttler.abandon(first)
        if grant is not None:
            throttler.release(grant, time.monotonic())
        raise
    finally:
        if watcher is not None:
            watcher.kill(block=False)
    grant = throttler.abandon(first)
    if gone:
        if grant is not None:
            throttler.release(grant, time.monotonic())
        raise client.ClientGone()
    if grant is None:
        raise Redirected() if first.redirected else QueueTimeout()
    return grant


def acquire(throttler: ServiceThrottler, timeout: float, client_socket: Any = None) -> Grant:
    """A slot on one of the service's pods, waiting in line if needed.

    Raises QueueFull at once, QueueTimeout after ``timeout`` seconds, or ClientGone as
    soon as the client behind ``client_socket`` hangs up while waiting.
    """
    event = Event()
    first = throttler.acquire(time.monotonic(), event.set)
    return _wait(throttler, first, event, timeout, client_socket)


def acquire_retry(throttler: ServiceThrottler, failed: Grant, timeout: float, client_socket: Any = None) -> Grant:
    """A slot, preferably on another pod, for a request whose connection failed.

    ``failed`` is released here in every case (after the new slot is chosen, so its
    freed slot is not the first one offered to the retry).
    """
    event = Event()
    try:
        first = throttler.acquire_retry(failed, time.monotonic(), event.set)
    finally:
        throttler.release(failed, time.monotonic())
    return _wait(throttler, first, event, timeout, client_socket)
