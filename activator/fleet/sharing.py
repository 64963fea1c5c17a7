"""``workers: N > 1``: the activator's one queue, in the shell (the rules: ``core.slotexchange``).

Each worker talks to the supervisor over one ``SOCK_SEQPACKET`` socket pair (one message
per datagram, ``core.slotexchange.encode``), made by the supervisor for each worker's
incarnation and inherited by it:

- ``ExchangeHub`` (the supervisor) applies every worker's messages to its
  ``SlotExchange``, one at a time, and sends what it says to whom; a worker whose socket
  ends (it exited) is forgotten (its waiters leave the queue, its borrowed slots go back).
- ``SlotSharing`` (each worker) queues the requests it cannot serve at once there
  (``wait``), offers the slots its throttlers lend (``Effects.lent``, through the
  actor), runs the requests it is granted a sibling's slot for (``Borrowed``), and
  follows the exchange's ``Contended`` flags; a slot that frees goes straight to this
  worker's first in line when no older request waits elsewhere. A request that gives up
  (queue timeout, client gone) is cancelled at the exchange at once; a slot granted to
  a request that is gone is offered again. Its reader greenlet is the only one that
  receives; sends never yield (datagrams on a local socket: a full socket buffer raises,
  and the worker is restarted rather than lose a slot silently).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import gevent
from gevent.event import Event
from gevent.queue import Queue

from ..base.gate import Client, Redirected, wait_watching
from ..core import slotexchange as wire
from ..core.errors import ClientGone, QueueFull, QueueTimeout, Shed, TenantQueueFull
from ..core.events import Event as TopologyEvent
from ..core.slotexchange import Borrowed, LedgerEffects, QueueIsFull, Redirect, SlotExchange, WasShed, WorkerLedger
from ..core.throttler import Effects, Grant, ServiceThrottler
from ..core.topology import Topology

log = logging.getLogger("activator")

DATAGRAM = 65536


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(supervisor end, worker end) of a new exchange connection."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class SlotSharing:
    """This worker's side of the exchange (see the module docstring); its bookkeeping is
    the core's ``WorkerLedger``, this does the I/O and the waking."""

    def __init__(
        self,
        sock: socket.socket,
        worker: int,
        topology: Topology,
        act: Callable[[Effects], None],
        post: Callable[[TopologyEvent], None],
    ) -> None:
        self.sock = sock
        self.topology = topology
        self.act = act
        #: Posts a topology event to the one writer (a borrower's transport failure).
        self.post = post
        # Slot ids are this incarnation's: a restarted worker never reuses its predecessor's.
        self.ledger = WorkerLedger(worker, first_slot=os.getpid() * 1_000_000)
        #: Slots handed to a request of this worker without crossing the supervisor.
        self.handed_here = 0
        self._reader: gevent.Greenlet | None = None

    def start(self) -> None:
        self._send(self.ledger.hello())
        self._reader = gevent.spawn(self._read)

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.kill(block=False)

    # -- requests ---------------------------------------------------------------

    def wait(
        self,
        throttler: ServiceThrottler,
        deadline: float,
        client: Client | None,
        arrival: float,
        klass: int = 0,
        tenant: bytes | str | None = None,
    ) -> Grant | Borrowed:
        """Queue a request this worker cannot serve at once at the exchange (in ``arrival``
        order, or its class's and tenant's place) until ``deadline``. Raises QueueFull,
        TenantQueueFull, Shed, QueueTimeout, ClientGone, or ``gate.Redirected`` when the
        service left shared mode meanwhile."""
        if isinstance(tenant, bytes):
            tenant = tenant.decode("latin-1")  # (the wire is JSON)
        waiting, messages = self.ledger.enqueue(throttler, arrival, klass, tenant)
        event = waiting.token = Event()
        self._send(messages)
        gone = keep = False
        try:
            gone = wait_watching(event, max(0.0, deadline - time.monotonic()), client)
            keep = not gone
        finally:  # killed, or the client gone: a slot that came meanwhile goes back
            self._do(self.ledger.leave(waiting, self.topology.services, keep, time.monotonic()))
        outcome = waiting.outcome
        if gone:
            raise ClientGone("the client hung up while its request was queued")
        if outcome is None:
            raise QueueTimeout()
        if isinstance(outcome, QueueIsFull):
            raise TenantQueueFull() if outcome.reason == TenantQueueFull.reason else QueueFull()
        if isinstance(outcome, WasShed):
            throttler.count_shed(klass)
            raise Shed()
        if isinstance(outcome, Redirect):
            raise Redirected()
        return outcome

    def borrowed_done(self, throttler: ServiceThrottler, slot: Borrowed, tunnel: bool, failed: str | None) -> bool:
        """The request on a borrowed slot ended: the slot goes to this worker's first in
        line (True) or back to the exchange. Does not yield."""
        return self._hand_on(self.ledger.borrowed_done(throttler, slot, tunnel, failed))

    def offer(self, throttler: ServiceThrottler, grant: Grant) -> None:
        """A slot of ours that is free (``Effects.lent``): to this worker's first in line,
        else lent to the exchange. Does not yield."""
        self._hand_on(self.ledger.offer(throttler, grant))

    def release(self, throttler: ServiceThrottler, grant: Grant, answered: bool) -> bool:
        """Give back a slot of ours; True when it went straight to a request of this
        worker. Does not yield."""
        handed = self.handed_here
        self.act(throttler.release(grant, time.monotonic(), answered))
        return self.handed_here != handed

    def _hand_on(self, out: LedgerEffects) -> bool:
        self._do(out)
        if out.woken:
            self.handed_here += 1
        return bool(out.woken)

    def resync(self) -> None:
        """After a new configuration (``WorkerLedger.resync``)."""
        self._do(self.ledger.resync(self.topology.services))

    # -- the exchange's messages --------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(DATAGRAM)
            except OSError as error:
                log.error("slot exchange: %s", error)
                data = b""
            if not data:
                log.error("the supervisor's slot exchange closed: this worker stops")
                os._exit(3)  # the supervisor is gone (or restarts us): no queue to serve
            try:
                message = wire.decode(data)
                if not isinstance(message, wire.Message):
                    raise ValueError(f"a worker's message sent to a worker: {message}")
                self._do(self.ledger.receive(message, self.topology.services, time.monotonic()))
            except Exception:  # a bug: said once, the worker goes on
                log.exception("slot exchange: could not apply %r", data[:200])

    def _do(self, out: LedgerEffects) -> None:
        self._send(out.send)
        for failure in out.failures:
            self.post(failure)
        self.act(out.effects)
        for waiting in out.woken:
            waiting.token.set()

    def _send(self, messages: list[wire.Request]) -> None:
        for message in messages:
            self.sock.send(wire.encode(message))


class ExchangeHub:
    """The supervisor's side: one ``SlotExchange`` for all workers (see the module docstring).

    One greenlet applies every worker's messages, in the order each worker sent them, and
    sends the answers in order: a worker hears ``Contended(False)`` before the ``Decline``
    that followed it, whichever socket is slow.
    """

    def __init__(self) -> None:
        self.exchange = SlotExchange()
        self._sockets: dict[int, socket.socket] = {}
        self._readers: dict[int, gevent.Greenlet] = {}
        self._inbox: Queue[tuple[int, socket.socket, wire.Request | None]] = Queue()
        self._applier: gevent.Greenlet | None = None

    def start(self) -> None:
        self._applier = gevent.spawn(self._apply_all)

    def attach(self, worker: int, sock: socket.socket) -> None:
        """The supervisor's end for ``worker``'s new incarnation."""
        self._sockets[worker] = sock
        self._readers[worker] = gevent.spawn(self._read, worker, sock)

    def stop(self) -> None:
        for greenlet in [*self._readers.values(), self._applier]:
            if greenlet is not None:
                greenlet.kill(block=False)

    def queued(self, service: str) -> int:
        return self.exchange.queued(service)

    def oldest_wait(self, service: str, now: float) -> float:
        arrival = self.exchange.oldest_arrival(service)
        return now - arrival if arrival is not None else 0.0

    def _read(self, worker: int, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(DATAGRAM)
            except OSError:
                data = b""
            if not data:
                self._inbox.put((worker, sock, None))
                return
            try:
                message = wire.decode(data)
            except ValueError as error:
                log.error("slot exchange: worker %d: %s", worker, error)
                continue
            if isinstance(message, wire.Message):
                log.error("slot exchange: worker %d sent a supervisor's message", worker)
                continue
            self._inbox.put((worker, sock, message))

    def _apply_all(self) -> None:
        while True:
            worker, sock, message = self._inbox.get()
            if message is not None:
                self._deliver(self.exchange.receive(message, time.monotonic()))
                continue
            sock.close()  # that incarnation ended (it ends before the next one starts)
            if self._sockets.get(worker) is sock:
                del self._sockets[worker]
                self._deliver([(wire.recipient(m), m) for m in self.exchange.forget_worker(worker)])

    def _deliver(self, messages: list[tuple[int | None, Any]]) -> None:
        for recipient, message in messages:
            data = wire.encode(message)
            targets = list(self._sockets.values()) if recipient is None else [self._sockets.get(recipient)]
            for sock in targets:
                if sock is None:
                    continue  # that worker is gone (restarting): forget_worker took care of it
                try:
                    sock.send(data)
                except OSError as error:
                    log.error("slot exchange: cannot reach a worker: %s", error)
