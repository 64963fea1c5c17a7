"""Waiting for a slot under gevent: the only place a request blocks on the throttler.

The core decides (``ServiceThrottler.acquire`` returns a grant or a waiter); this module
does the waiting. A waiter parks its greenlet on a ``gevent.event.Event`` (its
``token``), which the shell's actor sets when a core call reports that it handed the
waiter a slot (``Effects.woken``), bounded by ``queue_timeout`` (enforced by the
process's ``deadlines`` sweeper: no timer per waiter); meanwhile the client is
watched (``ClientExchange.watch_gone``: for HTTP/1.x the process's ``HangupMonitor`` on its
socket, no greenlet of its own; for HTTP/2 a stream reset) and the waiter is woken if the
client goes away. Whatever ends the wait (a slot, the timeout, the client
hanging up, the greenlet killed), the waiter leaves the queue, or a grant that arrived in
the same instant is released: a slot is never lost between "granted" and "woken", and a
client that hung up never gets a pod.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Protocol

from gevent.event import Event

from ..core.errors import ClientGone, QueueTimeout, Shed
from ..core.throttler import Effects, Grant, ServiceThrottler, Waiter
from . import deadlines


class Client(Protocol):
    """What the gate needs of a client: to hear that it went away (``exchange.ClientExchange``)."""

    def watch_gone(self, on_gone: Callable[[], None]) -> bool: ...

    def unwatch_gone(self, on_gone: Callable[[], None]) -> None: ...


class Redirected(Exception):
    """The waiter was taken out of the queue to be forwarded: this process owns no slot now."""


class _Wait:
    """One wait of ``wait_watching``: what ends it besides ``event`` itself. Its deadline
    is expired by the process's sweeper (a ``deadlines.Expiring``: no timer per wait)."""

    __slots__ = ("deadline", "event", "gone")

    def __init__(self, deadline: float, event: Event) -> None:
        self.deadline = deadline
        self.event = event
        self.gone = False

    def expire(self) -> None:
        self.event.set()

    def client_left(self) -> None:
        self.gone = True
        self.event.set()


def wait_watching(event: Event, timeout: float, client: Client | None) -> bool:
    """Wait for ``event`` (at most ``timeout`` seconds, to the sweeper's resolution) while
    watching ``client``: True when the client hung up (before or while waiting), which
    ends the wait at once."""
    wait = _Wait(time.monotonic() + timeout, event)
    on_gone = wait.client_left
    watching = client is not None and client.watch_gone(on_gone)
    if client is not None and not watching:
        return True  # it is gone already
    sweeper = deadlines.sweeper()
    try:
        if timeout > 0:
            sweeper.add(wait)
            event.wait()
    finally:
        sweeper.discard(wait)
        if watching:
            assert client is not None
            client.unwatch_gone(on_gone)
    return wait.gone


def _wait(
    throttler: ServiceThrottler, waiter: Waiter, timeout: float, client: Client | None, act: Callable[[Effects], None]
) -> Grant:
    try:
        gone = wait_watching(waiter.token, timeout, client)
    except BaseException:
        grant = throttler.abandon(waiter)
        if grant is not None:
            act(throttler.release(grant, time.monotonic()))
        raise
    grant = throttler.abandon(waiter)
    if gone:
        if grant is not None:
            act(throttler.release(grant, time.monotonic()))
        raise ClientGone("the client hung up while its request was queued")
    if grant is None:
        if waiter.shed:
            raise Shed()
        raise Redirected() if waiter.redirected else QueueTimeout()
    return grant


def acquire(
    throttler: ServiceThrottler,
    timeout: float,
    client: Client | None,
    act: Callable[[Effects], None],
    klass: int = 0,
    tenant: Hashable | None = None,
) -> Grant:
    """A slot on one of the service's pods, waiting in line (in ``klass``, as ``tenant``)
    if needed.

    Raises QueueFull or TenantQueueFull at once, QueueTimeout after ``timeout`` seconds,
    Shed when a higher class takes its place, ClientGone as soon as ``client`` hangs up
    while waiting, or Redirected. ``act`` acts on the effects of shedding another waiter
    and of giving back a slot that came too late.
    """
    first, effects = throttler.admit(time.monotonic(), klass, tenant)
    if isinstance(first, Grant):
        return first
    first.token = Event()  # before any yield: the actor sets it when the core hands the waiter a slot
    if effects:
        act(effects)  # wakes the waiter shed to make room
    return _wait(throttler, first, timeout, client, act)


def acquire_retry(
    throttler: ServiceThrottler, failed: Grant, timeout: float, client: Client | None, act: Callable[[Effects], None]
) -> Grant:
    """A slot, preferably on another pod, for a request whose connection failed.

    ``failed`` is given back in every case (after the new slot is chosen, so its freed slot
    is not the first one offered to the retry).
    """
    first, effects = throttler.acquire_retry(failed, time.monotonic())
    if isinstance(first, Waiter):
        first.token = Event()  # the effects may hand it the failed pod's slot already
    act(effects)
    if isinstance(first, Grant):
        return first
    return _wait(throttler, first, timeout, client, act)
