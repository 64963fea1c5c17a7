"""The proxy: a Falcon sink that routes by Host, waits for a slot, and relays a pod's answer.

What this module decides, for one request (an ``exchange.ClientExchange`` the engine hands
over in the environ: an HTTP/1.x request or an HTTP/2 stream; the sink writes the
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
from typing import Any

import falcon
import gevent

from . import gate
from .core import http
from .core.config import ServiceConfig
from .core.errors import (
    ActivatorError,
    ClientGone,
    DeadlineExceeded,
    InternalError,
    QueueTimeout,
    ShuttingDown,
    UpstreamBadResponse,
    UpstreamConnectError,
    UpstreamTimeout,
)
from .core.events import TransportFailure
from .core.failures import CONNECT_RETRIES, FailureKind, may_retry_elsewhere
from .core.http import BodyFraming, Header
from .core.throttler import Grant, ServiceThrottler
from .core.topology import Forward, Topology, may_forward
from .engine import EXCHANGE
from .exchange import ClientExchange, PodResponse
from .observe import Observer, RequestRecord
from .tunnel import Tunnel
from .upstream import Timeouts, UpstreamBodyError, UpstreamPool
from .writer import Actor, TopologyWriter

log = logging.getLogger("activator")

#: A request older than this, when its pod's answer comes, first checks that its client is
#: still there (one poll): a quick exchange skips the syscall, and a client that left
#: during one shows as a failed write instead.
HANGUP_CHECK_AFTER = 0.005


class Lease:
    """The one owner of a request's slot: ``release`` gives it back exactly once.

    What happened to the request on the pod is recorded here too: ``answered`` when the
    pod's answer head came (its failure streak starts over on release), a transport
    failure as an event for the topology writer.
    """

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


class Proxy:
    """The Falcon sink. One instance per process; the topology is swapped under it."""

    def __init__(
        self,
        topology: Topology,
        observer: Observer,
        pools: Callable[[str], UpstreamPool],
        writer: TopologyWriter,
        actor: Actor,
        self_name: str = "",
        client_timeout: float = 60.0,
    ) -> None:
        self.topology = topology
        self.writer = writer
        self.actor = actor
        self.self_name = self_name
        self.observer = observer
        self.client_timeout = client_timeout
        self._pool_for = pools
        self.stopping = False
        #: Requests inside the proxy right now (queued or proxied); 0 means drained.
        self.active = 0
        self._timeouts_cache: dict[tuple[int, bool], tuple[ServiceConfig, Timeouts]] = {}

    def __call__(self, req: falcon.Request, resp: falcon.Response, **_: Any) -> None:
        exchange: ClientExchange = req.env[EXCHANGE]
        record = RequestRecord(time.monotonic(), exchange.client_ip, exchange.method, exchange.target)
        self.active += 1
        try:
            self._serve(exchange, record)
        except ActivatorError as error:
            self._answer(exchange, error, record)
        except Exception:
            log.exception("internal error proxying %s %r", exchange.method, exchange.target[:200])
            self._answer(exchange, InternalError(), record)
        finally:
            self.active -= 1
            record.end = time.monotonic()
            if record.status != 101:  # a tunnel counted its own bytes
                record.bytes_out = exchange.bytes_sent
                record.bytes_in = exchange.body_bytes
            if exchange.was_cut and not exchange.finished:
                record.status, record.reason = 499, "client-gone"
            elif record.status == 0:
                record.status = exchange.status
            self.observer.request_done(record)

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
        throttler = self.topology.route(exchange.host)
        record.service = throttler.name
        if self.stopping:
            raise ShuttingDown()
        config = throttler.config
        marker = self._marker(exchange)
        deadline = self._grpc_deadline(exchange, record)
        # Built before waiting, so that a handed-over slot is put to use at once.
        pod_headers = http.pod_request_headers(
            exchange.headers,
            exchange.lower_names,
            exchange.client_ip_bytes,
            exchange.scheme_bytes,
            exchange.hosts[0] if exchange.hosts else b"",
            http.connection_tokens(exchange.connection_values),
            exchange.upgrade_value if exchange.upgrade else None,
        )
        target = self.topology.forward_target(throttler.name)
        if target is None or not may_forward(marker, target.kind):
            wait = config.queue_timeout if deadline is None else min(config.queue_timeout, deadline - record.start)
            try:
                grant = gate.acquire(throttler, wait, exchange, self.actor.act)
            except gate.Redirected:
                target = self.topology.forward_target(throttler.name)
                if target is None or not may_forward(marker, target.kind):
                    raise QueueTimeout() from None
            except QueueTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceeded("grpc-timeout passed while queued") from None
                raise
            else:
                record.queue_wait = time.monotonic() - record.start
                if deadline is not None:
                    _pass_on_deadline(pod_headers, deadline)
                lease = Lease(throttler, grant, self.actor, self.writer)
                try:
                    response = self._send_to_pod(exchange, pod_headers, config, lease, record)
                    if response.upgraded:
                        self._tunnel(exchange, response, config, record, lease)
                    else:
                        self._relay(exchange, response, record, lease)
                finally:
                    lease.release()
                return
        self._forward(exchange, pod_headers, marker, target, config, record)

    @staticmethod
    def _marker(exchange: ClientExchange) -> str | None:
        values = exchange.forwarded
        return b", ".join(values).decode("latin-1") if values else None

    @staticmethod
    def _grpc_deadline(exchange: ClientExchange, record: RequestRecord) -> float | None:
        """A gRPC request's deadline (monotonic), from its ``grpc-timeout``; raises when spent."""
        if exchange.grpc_timeout is None:
            return None
        seconds = http.grpc_timeout(exchange.grpc_timeout)
        if seconds is None:
            return None
        if seconds <= 0:
            raise DeadlineExceeded("grpc-timeout spent on arrival")
        return record.start + seconds

    def _timeouts(self, config: ServiceConfig, forwarding: bool = False) -> Timeouts:
        """The pod timeouts of a service (made once per configuration and reused).

        A forwarded request's head may come only after it waited in the receiver's
        queue: its response-start and total times get ``queue_timeout`` on top.
        """
        key = (id(config), forwarding)
        cached = self._timeouts_cache.get(key)
        if cached is not None and cached[0] is config and cached[1].client == self.client_timeout:
            return cached[1]
        extra = config.queue_timeout if forwarding else 0.0
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
        lease: Lease,
        record: RequestRecord,
    ) -> PodResponse:
        """The pod's answer head (retrying a failed connect once, on another pod if one is free)."""
        waited = lease.grant is not None and lease.grant.queued
        retries = CONNECT_RETRIES
        timeouts = self._timeouts(config)
        while True:
            record.pod = lease.pod
            if waited and exchange.client_gone():
                # It waited: did its client leave at the very moment the slot came?
                raise ClientGone("the client hung up as its slot came")
            sent_at = time.monotonic()
            try:
                response = self._pool_for(lease.pod).request(
                    exchange.method,
                    exchange.target,
                    pod_headers,
                    exchange,
                    exchange.framing,
                    exchange.content_length,
                    timeouts,
                    exchange.interim,
                )
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
            return response

    def _relay(
        self, exchange: ClientExchange, response: PodResponse, record: RequestRecord, lease: Lease | None
    ) -> None:
        """Stream the pod's answer to the client; the pod connection is closed or pooled."""
        try:
            if time.monotonic() - record.start > HANGUP_CHECK_AFTER and exchange.client_gone():
                # Nobody will read it: drop the pod connection rather than pool it.
                response.abort()
                raise ClientGone("the client hung up while the pod worked")
            status = response.status
            framing = http.client_framing(exchange.method, status, response.framing, exchange.version)
            keep_length = exchange.method == "HEAD" or status == 304
            headers = http.response_headers(
                response.headers,
                response.lower_names,
                framing,
                http.connection_tokens(response.connection_values),
                keep_length=keep_length,
            )
            exchange.start(status, response.reason, headers, framing, close=response.early)
            try:
                if response.complete:  # the whole answer came with its head (the usual small one)
                    exchange.write(response.take_body())
                else:
                    for piece in response.body():
                        exchange.write(piece)
            except UpstreamBodyError as error:
                # The head is out: the only honest signal left is cutting the connection.
                record.reason = "upstream-body-cut"
                if lease is not None:
                    lease.failed(error.kind)
                exchange.cut()
                return
            trailers = http.relayed_trailers(response.trailers) if framing is BodyFraming.CHUNKED else ()
            exchange.finish(trailers)
        finally:
            response.close()

    def _tunnel(
        self,
        exchange: ClientExchange,
        response: PodResponse,
        config: ServiceConfig,
        record: RequestRecord,
        lease: Lease,
    ) -> None:
        """The pod accepted an Upgrade (101): splice bytes until either side closes."""
        switch = getattr(exchange, "switch_protocols", None)
        if switch is None:  # only HTTP/1.1 upgrades: an HTTP/2 stream never asks for one
            response.abort()
            raise UpstreamBadResponse("a 101 answer to a request that asked for no upgrade")
        headers = http.response_headers(response.headers, response.lower_names, BodyFraming.NONE, keep_upgrade=True)
        pod_socket = response.detach()
        client_socket, to_pod = switch(response.reason, headers)
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
        """Hand the request to a peer activator, or a sibling worker, that owns slots.

        The receiver queues it like its own; the marker header keeps it from going on.
        """
        record.pod = f"{target.kind}:{target.address}"
        record.relayed = target.kind == "worker"
        hop = f"{target.kind} {self.self_name if target.kind == 'peer' else self.topology.worker_index}"
        pod_headers = [*pod_headers, (b"X-Activator-Forwarded", (f"{marker}, {hop}" if marker else hop).encode())]
        response = self._pool_for(target.address).request(
            exchange.method,
            exchange.target,
            pod_headers,
            exchange,
            exchange.framing,
            exchange.content_length,
            self._timeouts(config, forwarding=True),
            exchange.interim,
        )
        self._relay(exchange, response, record, None)


def make_app(proxy: Proxy) -> falcon.App[falcon.Request, falcon.Response]:
    """The WSGI app for the proxy port: every path goes to the sink."""
    app: falcon.App[falcon.Request, falcon.Response] = falcon.App()
    app.req_options.strip_url_path_trailing_slash = False
    # prefix "" (matches any path), not "/": every target reaches the sink.
    app.add_sink(proxy, prefix="")
    return app


def _pass_on_deadline(pod_headers: list[Header], deadline: float) -> None:
    """A gRPC request goes on with what is left of its deadline (the time queued is spent)."""
    left = http.format_grpc_timeout(deadline - time.monotonic())
    for index, (name, _) in enumerate(pod_headers):
        if name.lower() == b"grpc-timeout":
            pod_headers[index] = (name, left)
