"""The proxy: the Falcon app's one responder: it routes by Host, waits for a slot, and relays a pod's answer.

What this module decides, for one request (an ``exchange.ClientExchange`` the engine hands
over in the environ: an HTTP/1.x request or an HTTP/2 stream; the proxy writes the
response there itself, so that the pod's answer reaches the client unchanged: 1xx first,
every header line in its order, trailers):

- which service (``Topology.route``), then a slot via ``gate.acquire`` (FIFO,
  ``queue_timeout``), then the exchange with the pod through its keep-alive pool;
- what is forwarded: method, target, the end-to-end header lines in order, the original
  Host, ``X-Forwarded-For`` / ``-Proto`` / ``-Host`` (``core.http.pod_request_headers``);
  the body streams from the client with the client's framing, and the response streams
  back as it comes (``core.http.client_framing``);
- a connection that could not be established (nothing sent yet) is retried once, on
  another pod when one is free;
- a pod that answers before it read the whole upload has its answer relayed (and the
  client connection closed after it): that is an answer, not a transport failure;
- **one owner per request**: the ``Lease`` holds the slot from grant to the end and gives
  it back exactly once, on every path (served, pod error, timeout, client gone, body cut,
  redirect, shutdown); activator's own answers all go through ``ClientExchange.answer``
  (``core.http.own_answer``); any other exception is a bug, logged once with its
  traceback and answered 500 ``internal-error``;
- what is recorded (``observe.RequestRecord``): the status the client got, 499
  ``client-gone`` when it left before the last byte, the body bytes actually sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import falcon
import gevent
import gevent.event

from ..base import gate
from ..base.exchange import ClientExchange, PodRequest, PodResponse
from ..base.writer import Actor, TopologyWriter
from ..core import http
from ..core.autoscale import LaunchCheck, launcher_elsewhere
from ..core.config import ServiceConfig, longest_queue_timeout
from ..core.errors import (
    ActivatorError,
    ClientGone,
    DeadlineExceeded,
    InternalError,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    UpstreamBadResponse,
    UpstreamBodyError,
    UpstreamConnectError,
    UpstreamTimeout,
)
from ..core.events import LoadReported, PeerChecked, TransportFailure
from ..core.failures import CONNECT_RETRIES, FailureKind, may_retry_elsewhere
from ..core.fleet import Forward
from ..core.heads import BodyFraming, Header, ResponseHead, client_framing, connection_tokens
from ..core.load import is_news, reading_in_head
from ..core.peering import PEER_PATH
from ..core.slotexchange import Borrowed
from ..core.throttler import Grant, ServiceThrottler
from ..core.timeouts import Timeouts
from ..core.topology import Topology, may_forward
from ..fleet.peers import PeerEndpoint
from ..fleet.sharing import SlotSharing
from ..front.engine import EXCHANGE
from ..ops.observe import Observer, RequestRecord
from ..pods.clients import H2C, HTTP1, PodClient
from .tunnel import Tunnel

log = logging.getLogger("activator")

#: A request older than this, when its pod's answer comes, first checks that its client is
#: still there (one poll): a quick exchange skips the syscall, and a client that left
#: during one shows as a failed write instead.
HANGUP_CHECK_AFTER = 0.005


class SlotLease(Protocol):
    """The one owner of a request's slot: ``release`` gives it back exactly once.

    What happened to the request on the pod is recorded here too: ``answered`` when the
    pod's answer head came (its failure streak starts over on release), a transport
    failure (``failed``). ``waited``: the slot came after a wait in the queue.
    """

    answered: bool

    @property
    def pod(self) -> str: ...

    @property
    def waited(self) -> bool: ...

    def retry(self, timeout: float, client: ClientExchange) -> None:
        """Trade the slot of a failed connect for one on another pod if one is free."""

    def open_tunnel(self) -> None:
        """The request became a tunnel (counted per service: ``/status``, StatsD)."""

    def failed(self, kind: FailureKind) -> None: ...

    def release(self) -> None: ...


class Lease:
    """A slot of this process (a ``SlotLease``); a transport failure is an event for the
    topology writer."""

    __slots__ = ("actor", "answered", "grant", "throttler", "writer")

    def __init__(self, throttler: ServiceThrottler, grant: Grant, actor: Actor, writer: TopologyWriter) -> None:
        self.throttler = throttler
        self.grant: Grant | None = grant
        self.actor = actor
        self.writer = writer
        self.answered = False

    @property
    def pod(self) -> str:
        assert self.grant is not None
        return self.grant.pod.address

    @property
    def waited(self) -> bool:
        return self.grant is not None and self.grant.queued

    def retry(self, timeout: float, client: ClientExchange) -> None:
        """Trade the slot of a failed connect for one on another pod (gate.acquire_retry)."""
        failed, self.grant = self.grant, None
        assert failed is not None
        self.grant = gate.acquire_retry(self.throttler, failed, timeout, client, self.actor.act)

    def open_tunnel(self) -> None:
        """The request became a tunnel (counted per service: ``/status``, StatsD)."""
        assert self.grant is not None
        self.throttler.open_tunnel(self.grant)

    def failed(self, kind: FailureKind) -> None:
        """A transport failure on this request's pod: an event for the topology writer."""
        if self.grant is not None:
            self.writer.post(TransportFailure(self.throttler.name, self.grant.pod.address, kind))

    def release(self) -> None:
        """Give the slot back. When it went straight to a waiter, let that waiter run first:
        its request is sent before this greenlet finishes its own bookkeeping."""
        grant, self.grant = self.grant, None
        if grant is not None:
            effects = self.throttler.release(grant, time.monotonic(), self.answered)
            if effects:
                self.actor.act(effects)
                if effects.woken:
                    gevent.sleep(0)


class SharedLease:
    """A slot from the activator's slot exchange (``workers: N``, a ``SlotLease``): this
    worker's own (``Grant``) or a sibling's lent for this request (``Borrowed``). A
    transport failure on a borrowed slot goes back with it, to its owner, which records it.
    """

    __slots__ = ("answered", "arrival", "failure", "queued", "sharing", "slot", "throttler", "tunnel", "writer")

    def __init__(
        self,
        throttler: ServiceThrottler,
        slot: Grant | Borrowed,
        sharing: SlotSharing,
        writer: TopologyWriter,
        arrival: float,
        queued: bool,
    ) -> None:
        self.throttler = throttler
        self.slot: Grant | Borrowed | None = slot
        self.sharing = sharing
        self.writer = writer
        self.arrival = arrival
        self.queued = queued
        self.answered = False
        self.tunnel = False
        self.failure: str | None = None

    @property
    def pod(self) -> str:
        slot = self.slot
        assert slot is not None
        return slot.pod.address if isinstance(slot, Grant) else slot.pod

    @property
    def waited(self) -> bool:
        return self.queued

    def retry(self, timeout: float, client: ClientExchange) -> None:
        failed, self.slot = self.slot, None
        assert failed is not None
        self.queued = True
        if isinstance(failed, Grant):
            grant, effects = self.throttler.retry_here(failed, time.monotonic())
            self.sharing.act(effects)
            if grant is not None:
                self.slot = grant
                return
        else:
            self.sharing.borrowed_done(self.throttler, failed, False, self.failure)
            self.failure = None
        # It waited its turn already: back in line at its first arrival.
        self.slot = self.sharing.wait(self.throttler, time.monotonic() + timeout, client, self.arrival)

    def open_tunnel(self) -> None:
        slot = self.slot
        assert slot is not None
        self.tunnel = True
        if isinstance(slot, Grant):
            self.throttler.open_tunnel(slot)
        else:
            self.throttler.borrowed_tunnel()

    def failed(self, kind: FailureKind) -> None:
        slot = self.slot
        if isinstance(slot, Grant):
            self.writer.post(TransportFailure(self.throttler.name, slot.pod.address, kind))
        elif slot is not None:
            self.failure = kind.value

    def release(self) -> None:
        """Give the slot back. When it went straight to a request of this worker, let that
        request run first (as ``Lease.release``)."""
        slot, self.slot = self.slot, None
        if isinstance(slot, Grant):
            handed = self.sharing.release(self.throttler, slot, self.answered)
        elif slot is not None:
            handed = self.sharing.borrowed_done(self.throttler, slot, self.tunnel, self.failure)
        else:
            return
        if handed:
            gevent.sleep(0)


class Proxy:
    """The responder of every request (``EveryPath``). One instance per process; the
    topology is swapped under it."""

    def __init__(
        self,
        topology: Topology,
        observer: Observer,
        pods: Callable[[str, str], PodClient],
        writer: TopologyWriter,
        actor: Actor,
        self_name: str = "",
        client_timeout: float = 60.0,
        sharing: SlotSharing | None = None,
    ) -> None:
        self.topology = topology
        self.writer = writer
        self.actor = actor
        self.self_name = self_name
        self.observer = observer
        self.client_timeout = client_timeout
        self._pod_client = pods
        #: ``workers: N``: the activator's one queue.
        self.sharing = sharing
        #: The fleet's endpoint (``peers.PeerEndpoint``), None for a lone activator.
        self.peers: PeerEndpoint | None = None
        self.stopping = False
        #: Requests inside the proxy right now (queued or proxied); 0 means drained.
        self.active = 0
        self._timeouts_cache: dict[tuple[int, bool], tuple[ServiceConfig, Timeouts]] = {}

    def __call__(self, req: falcon.Request, resp: falcon.Response, **_: Any) -> None:
        exchange: ClientExchange = req.env[EXCHANGE]
        if self.peers is not None and exchange.head.target.startswith(PEER_PATH):
            self._serve_peer(exchange)  # the fleet's own traffic: neither logged nor counted
            return
        record = RequestRecord(time.monotonic(), exchange.client_ip, exchange.head.method, exchange.head.target)
        self.active += 1
        try:
            self._serve(exchange, record)
        except ActivatorError as error:
            self._answer(exchange, error, record)
        except Exception:
            log.exception("internal error proxying %s %r", exchange.head.method, exchange.head.target[:200])
            self._answer(exchange, InternalError(), record)
        finally:
            self.active -= 1
            record.end = time.monotonic()
            if record.status != 101:  # a tunnel counted its own bytes
                record.bytes_out = exchange.bytes_sent
                record.bytes_in = exchange.body_bytes
            if not exchange.finished and exchange.was_cut:
                record.status, record.reason = 499, "client-gone"
            elif record.status == 0:
                record.status = exchange.status
            self.observer.request_done(record)

    def _serve_peer(self, exchange: ClientExchange) -> None:
        assert self.peers is not None
        try:
            self.peers.serve(exchange)
        except ActivatorError as error:  # the checker went away, or sent a broken body
            if not exchange.started:
                exchange.answer(error)
        except Exception:
            log.exception("internal error answering a peer check")
            if not exchange.started:
                exchange.answer(InternalError())

    @staticmethod
    def _answer(exchange: ClientExchange, error: ActivatorError, record: RequestRecord) -> None:
        if isinstance(error, ClientGone):
            record.status, record.reason = 499, error.reason
            exchange.cut()
            return
        if not exchange.started:
            record.status, record.reason = error.status, error.reason
        try:
            exchange.answer(error)
        except ClientGone:
            record.status, record.reason = 499, "client-gone"

    def _serve(self, exchange: ClientExchange, record: RequestRecord) -> None:
        head = exchange.head
        throttler = self.topology.route(head.host)
        record.service = throttler.name
        if self.stopping:
            raise ShuttingDown()
        config = throttler.config
        queue_timeout = config.queue_timeout
        klass: int = 0
        tenant: bytes | str | None = None
        classifier = throttler.classifier
        if classifier.active:  # (a service without priority or fair_by pays nothing more)
            klass, tenant = classifier.classify(head.host, exchange.client_ip, head.headers, head.lower_names)
            queue_timeout = classifier.queue_timeout(klass)
            record.klass = classifier.class_name(klass)
        marker = self._marker(exchange)
        deadline = self._grpc_deadline(exchange, record)
        # Built before waiting, so that a handed-over slot is put to use at once.
        pod_headers = http.pod_request_headers(
            head.headers,
            head.lower_names,
            exchange.client_ip_bytes,
            exchange.scheme_bytes,
            head.hosts[0] if head.hosts else b"",
            connection_tokens(head.connection_values),
            head.upgrade_value if head.upgrade else None,
        )
        unreachable: tuple[str, ...] = ()  # peers a forward of this request could not reach
        redirected = 0  # waits here ended by a redirect (each allows one more peer hop)
        while True:
            target = self._forward_target(throttler, unreachable)
            if target is not None and may_forward(marker, self.topology.capped(throttler.name), redirected):
                if target.name in unreachable:
                    raise UpstreamConnectError(f"peer {target.name} ({target.address}) is unreachable")
                try:
                    self._forward(exchange, pod_headers, marker, target, config, record)
                    return
                except UpstreamConnectError as error:
                    if error.connected or error.body_read:
                        raise
                    # Nothing was sent: the peer is told down (at once when its port
                    # refused), and the request goes to another owner, or waits here.
                    unreachable += (target.name,)
                    self._peer_unreachable(target, error)
                    continue
            now = time.monotonic()
            wait = record.start + queue_timeout - now
            if deadline is not None:
                wait = min(wait, deadline - now)
            self._wake_launcher(throttler)
            share = exchange.queue_share
            if share is not None and not share.enter(throttler.name, config.queue_depth):
                raise QueueFull("this client connection holds its share of the queue already")
            try:
                lease = self._acquire(throttler, max(0.0, wait), exchange, record.start, klass, tenant)
            except gate.Redirected:
                redirected += 1
                continue  # its slots went elsewhere: it follows them, or waits here again
            except QueueTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceeded("grpc-timeout passed while queued") from None
                raise
            finally:
                if share is not None:
                    share.leave(throttler.name)
            record.queue_wait = time.monotonic() - record.start
            if deadline is not None:
                _pass_on_deadline(pod_headers, deadline)
            self._proxy(exchange, pod_headers, config, lease, record)
            return

    def _wake_launcher(self, throttler: ServiceThrottler) -> None:
        """A request about to wait for a launched service with no usable slot: the
        launcher decides now (a cold start begins now, not at the next tick). Does not yield."""
        if throttler.config.launch is not None and throttler.capacity == 0:
            self.writer.post(LaunchCheck(throttler.name))

    def _forward_target(self, throttler: ServiceThrottler, unreachable: tuple[str, ...]) -> Forward | None:
        """Where the request goes instead of waiting here (``Topology.forward_target``);
        for a launched service without a usable slot here, whose pods this activator
        launches none of, their launcher (``core.autoscale.launcher_elsewhere``), unless
        it could not be reached (then the request waits here: a pod may come up all the same)."""
        target = self.topology.forward_target(throttler.name)
        if target is None and throttler.config.launch is not None and throttler.capacity == 0:
            launcher = launcher_elsewhere(self.topology.config, throttler.config)
            return launcher if launcher is not None and launcher.name not in unreachable else None
        return target

    def _proxy(
        self,
        exchange: ClientExchange,
        pod_headers: list[Header],
        config: ServiceConfig,
        lease: SlotLease,
        record: RequestRecord,
    ) -> None:
        """The request on its pod, with its slot (given back here, whatever happens).

        A client that leaves while its request runs: an h2c pod's stream is reset (the pod
        cancels the call), an HTTP/1.1 pod's connection is closed if the service says
        ``client_gone: cancel``; either way the slot is free at once.
        """
        try:
            if config.protocol == H2C or config.client_gone == "cancel":
                with CancelWhenGone(exchange, "the client left while its request ran"):
                    response = self._answer_from_pod(exchange, pod_headers, config, lease, record)
            else:  # no watch at all (a with-statement costs some 2,000 instructions)
                response = self._answer_from_pod(exchange, pod_headers, config, lease, record)
            if response.upgraded:
                self._tunnel(exchange, response, config, record, lease)
        finally:
            lease.release()

    def _answer_from_pod(
        self,
        exchange: ClientExchange,
        pod_headers: list[Header],
        config: ServiceConfig,
        lease: SlotLease,
        record: RequestRecord,
    ) -> PodResponse:
        """The pod's answer, relayed to the client unless it switches protocols (a tunnel)."""
        response = self._send_to_pod(exchange, pod_headers, config, lease, record)
        if not response.upgraded:
            self._relay(exchange, response, record, lease)
        return response

    def _peer_unreachable(self, target: Forward, error: UpstreamConnectError) -> None:
        """A forward to ``target`` could not connect: tell the writer, and wait until it
        applied that (so that the next choice of a target knows)."""
        refused = isinstance(error.__cause__, ConnectionRefusedError)
        applied = gevent.event.Event()
        event = PeerChecked(target.name, time.monotonic(), None, f"forward: {error}", refused, forwarding=True)
        self.writer.post(event, applied)
        applied.wait()

    def _acquire(
        self,
        throttler: ServiceThrottler,
        wait: float,
        exchange: ClientExchange,
        arrival: float,
        klass: int = 0,
        tenant: bytes | str | None = None,
    ) -> SlotLease:
        """A slot for the request: this process's (in the service's queue order, as
        ``klass`` of ``tenant``), or, with ``workers: N``, one from the activator's slot
        exchange (one queue across the workers, the same order). Raises QueueFull, TenantQueueFull, Shed,
        QueueTimeout, ClientGone or gate.Redirected."""
        while True:
            sharing = self.sharing
            if sharing is None or not throttler.shared:
                grant = gate.acquire(throttler, wait, exchange, self.actor.act, klass, tenant)
                return Lease(throttler, grant, self.actor, self.writer)
            own = throttler.acquire_here()
            if own is not None:
                return SharedLease(throttler, own, sharing, self.writer, arrival, False)
            try:
                slot = sharing.wait(throttler, arrival + wait, exchange, arrival, klass, tenant)
            except gate.Redirected:
                continue  # the service left shared mode while it waited: queue here
            return SharedLease(throttler, slot, sharing, self.writer, arrival, True)

    @staticmethod
    def _marker(exchange: ClientExchange) -> str | None:
        values = exchange.head.forwarded
        return b", ".join(values).decode("latin-1") if values else None

    @staticmethod
    def _grpc_deadline(exchange: ClientExchange, record: RequestRecord) -> float | None:
        """A gRPC request's deadline (monotonic), from its ``grpc-timeout``; raises when spent."""
        if exchange.head.grpc_timeout is None:
            return None
        seconds = http.grpc_timeout(exchange.head.grpc_timeout)
        if seconds is None:
            return None
        if seconds <= 0:
            raise DeadlineExceeded("grpc-timeout spent on arrival")
        return record.start + seconds

    def _timeouts(self, config: ServiceConfig, forwarding: bool = False) -> Timeouts:
        """The pod timeouts of a service (made once per configuration and reused).

        A forwarded request's head may come only after it waited in the receiver's
        queue: its response-start and total times get the longest ``queue_timeout`` (of any
        class) on top.
        """
        key = (id(config), forwarding)
        cached = self._timeouts_cache.get(key)
        if cached is not None and cached[0] is config and cached[1].client == self.client_timeout:
            return cached[1]
        extra = longest_queue_timeout(config) if forwarding else 0.0
        total = None if config.request_timeout is None else config.request_timeout + extra
        timeouts = Timeouts(
            config.connect_timeout,
            config.response_start_timeout + extra,
            config.idle_timeout,
            total,
            self.client_timeout,
        )
        if len(self._timeouts_cache) > 1024:
            self._timeouts_cache.clear()
        self._timeouts_cache[key] = (config, timeouts)
        return timeouts

    def _send_to_pod(
        self,
        exchange: ClientExchange,
        pod_headers: list[Header],
        config: ServiceConfig,
        lease: SlotLease,
        record: RequestRecord,
    ) -> PodResponse:
        """The pod's answer head (retrying a failed connect once, on another pod if one is free)."""
        waited = lease.waited
        retries = CONNECT_RETRIES
        timeouts = self._timeouts(config)
        head = exchange.head
        request = PodRequest(
            head.method, head.target, pod_headers, exchange, head.framing, head.content_length, exchange.interim
        )
        while True:
            record.pod = pod = lease.pod
            if waited and exchange.client_gone():
                # It waited: did its client leave at the very moment the slot came?
                raise ClientGone("the client hung up as its slot came")
            sent_at = time.monotonic()
            try:
                response = self._pod_client(pod, config.protocol).request(request, timeouts)
            except UpstreamConnectError as error:
                lease.failed(error.kind)
                if may_retry_elsewhere(error.kind, error.connected, error.body_read, retries, self.stopping):
                    retries -= 1
                    lease.retry(config.queue_timeout, exchange)
                    waited = True
                    continue
                raise
            except UpstreamTimeout as error:
                lease.failed(error.kind)
                raise
            lease.answered = True
            record.upstream_start = sent_at
            if config.load is not None and config.load.path is None:
                self._note_load(config, lease.pod, response.head)
            return response

    def _note_load(self, config: ServiceConfig, address: str, head: ResponseHead) -> None:
        """The load the pod announced in its answer's ORCA header, to the topology writer
        when it is news (``core.load``). Does not yield."""
        assert config.load is not None
        reading = reading_in_head(head.headers, head.lower_names, config.load.metric)
        throttler = self.topology.services.get(config.name)
        tracker = throttler.trackers.get(address) if throttler is not None else None
        if reading is None or tracker is None:
            return
        if is_news(tracker.load, tracker.announced, reading, config.container_concurrency):
            self.writer.post(LoadReported(config.name, address, reading.figure, reading.concurrency))

    def _relay(
        self, exchange: ClientExchange, response: PodResponse, record: RequestRecord, lease: SlotLease | None
    ) -> None:
        """Stream the pod's answer to the client; the pod connection is closed or pooled.

        An answer that came whole with its head (the usual small one) goes back to the
        pool before it is written out, and its slot (``lease``) to the next waiter as soon
        as it was delivered (SPEC: the slot is held until then): the hand-off does not
        wait for the rest of this request's bookkeeping.
        """
        pooled = False
        try:
            if time.monotonic() - record.start > HANGUP_CHECK_AFTER and exchange.client_gone():
                # Nobody will read it: drop the pod connection rather than pool it.
                response.abort()
                raise ClientGone("the client hung up while the pod worked")
            pod_head = response.head
            method = exchange.head.method
            status = pod_head.status
            framing = client_framing(method, status, response.framing, exchange.head.version)
            keep_length = method == "HEAD" or status == 304
            headers = http.response_headers(
                pod_head.headers,
                pod_head.lower_names,
                framing,
                connection_tokens(pod_head.connection_values),
                keep_length=keep_length,
            )
            exchange.start(status, pod_head.reason, headers, framing, close=response.early)
            if response.complete:
                body = response.take_body()
                trailers = _trailers_relayed(response, framing)
                pooled = True
                response.close()  # nothing of it is read after this: the next request may reuse it
                exchange.finish(trailers, body)
                if lease is not None:
                    lease.release()
                return
            first = response.take_body()
            try:
                if first:
                    exchange.write(first)
                else:
                    exchange.flush()  # a stream's head goes out before its first event
                for piece in response.body():
                    exchange.write(piece)
            except UpstreamBodyError as error:
                # The head is out: the only honest signal left is cutting the connection.
                record.reason = error.log_reason
                if lease is not None:
                    lease.failed(error.kind)
                exchange.cut()
                return
            exchange.finish(_trailers_relayed(response, framing))
        finally:
            if not pooled:
                response.close()

    def _tunnel(
        self,
        exchange: ClientExchange,
        response: PodResponse,
        config: ServiceConfig,
        record: RequestRecord,
        lease: SlotLease,
    ) -> None:
        """The pod accepted an Upgrade (101): splice bytes until either side closes."""
        if not exchange.head.upgrade:  # an HTTP/2 stream, or an Upgrade activator declined
            response.abort()
            raise UpstreamBadResponse("a 101 answer to a request that asked for no upgrade")
        pod_head = response.head
        headers = http.response_headers(pod_head.headers, pod_head.lower_names, BodyFraming.NONE, keep_upgrade=True)
        pod_socket = response.detach()
        client_socket, to_pod = exchange.switch_protocols(pod_head.reason, headers)
        tunnel = Tunnel(client_socket, pod_socket, config.idle_timeout)
        lease.open_tunnel()
        try:
            tunnel.run(to_pod, response.tunnel_data)
        finally:
            pod_socket.close()
            record.bytes_in, record.bytes_out = tunnel.upstream, tunnel.downstream
            record.status = 101
            if tunnel.timed_out:
                record.reason = "tunnel-idle"

    def _forward(
        self,
        exchange: ClientExchange,
        pod_headers: list[Header],
        marker: str | None,
        target: Forward,
        config: ServiceConfig,
        record: RequestRecord,
    ) -> None:
        """Hand the request to a peer activator that owns slots.

        The receiver queues it like its own; the marker header keeps it from going on.
        While the receiver has not answered (it may be queued there), the client is
        watched: when it leaves, the forwarded connection is closed, and the receiver,
        which watches that connection like any client's, takes the request out of its
        queue at once.
        """
        record.pod = f"peer:{target.address}"
        hop = f"peer {self.self_name}"
        pod_headers = [*pod_headers, (b"X-Activator-Forwarded", (f"{marker}, {hop}" if marker else hop).encode())]
        head = exchange.head
        request = PodRequest(
            head.method, head.target, pod_headers, exchange, head.framing, head.content_length, exchange.interim
        )
        with CancelWhenGone(exchange, "the client hung up while its forwarded request waited"):
            response = self._pod_client(target.address, HTTP1).request(request, self._timeouts(config, forwarding=True))
        self._relay(exchange, response, record, None)


class CancelWhenGone:
    """Within it, a client that goes away ends this greenlet's work with
    ``ClientGone``, thrown where it waits (for a pod's answer, for a forwarded one, on a
    write): the pod client it waits in closes its connection or resets its stream on the
    way out, and the slot goes back at once. The throw is decided in the hub at the moment
    it lands, so that it never reaches code after the block."""

    __slots__ = ("_exchange", "_why", "_greenlet", "_inside")

    def __init__(self, exchange: ClientExchange, why: str) -> None:
        self._exchange = exchange
        self._why = why
        self._greenlet = gevent.getcurrent()
        self._inside = False

    def __enter__(self) -> None:
        if not self._exchange.watch_gone(self._gone):
            raise ClientGone(self._why)
        self._inside = True

    def __exit__(self, *exc: object) -> None:
        if self._inside:
            self._inside = False
            self._exchange.unwatch_gone(self._gone)

    def _gone(self) -> None:
        """The watch fired (in the hub, or in an HTTP/2 connection's reader): throw from
        the hub, if the block is still running then. Does not yield."""
        if self._inside:
            gevent.get_hub().loop.run_callback(self._throw)

    def _throw(self) -> None:
        if self._inside and not self._greenlet.dead:
            self._inside = False
            self._greenlet.throw(ClientGone(self._why))


class EveryPath:
    """The proxy port's Falcon router (a custom router, Falcon's extension point): every
    path and every method go to the proxy. Nothing is looked up or matched per request,
    where a sink costs a route search and a pattern match first."""

    def __init__(self, responder: Callable[..., None]) -> None:
        self._methods = _EveryMethod(responder)

    def add_route(self, uri_template: str, resource: object, **kwargs: Any) -> None:
        raise ValueError("the proxy port has no routes: every path goes to the proxy")

    def find(self, uri: str, req: falcon.Request | None = None) -> tuple[object, dict[str, Any], dict[str, Any], None]:
        """(resource, method map, path fields, template): the proxy, whatever the path."""
        return self, self._methods, {}, None


class _EveryMethod(dict[str, Any]):
    """Falcon's method map of the proxy: any method name -> the proxy's responder."""

    def __init__(self, responder: Callable[..., None]) -> None:
        super().__init__((method, responder) for method in _COMMON_METHODS)
        self._responder = responder

    def __missing__(self, method: str) -> Callable[..., None]:
        return self._responder  # not stored: an HTTP/2 method can be any token


_COMMON_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE")


def make_app(proxy: Proxy) -> falcon.App[falcon.Request, falcon.Response]:
    """The WSGI app for the proxy port: every request goes to ``proxy``."""
    # The responder is bound: one C-level call less per request (see engine).
    router = EveryPath(proxy.__call__)
    app: falcon.App[falcon.Request, falcon.Response] = falcon.App(router=router)  # type: ignore[call-overload]
    app.req_options.strip_url_path_trailing_slash = False
    return app


def _trailers_relayed(response: PodResponse, framing: BodyFraming) -> list[Header] | tuple[()]:
    """What of the pod's trailers reaches the client (only a chunked answer carries them)."""
    return http.relayed_trailers(response.trailers) if framing is BodyFraming.CHUNKED else ()


def _pass_on_deadline(pod_headers: list[Header], deadline: float) -> None:
    """A gRPC request goes on with what is left of its deadline (the time queued is spent)."""
    left = http.format_grpc_timeout(deadline - time.monotonic())
    for index, (name, _) in enumerate(pod_headers):
        if name.lower() == b"grpc-timeout":
            pod_headers[index] = (name, left)
