"""The proxy: a Falcon sink that routes by Host, waits for a slot, streams to a pod.

What this module decides, for one request:

- which service (``Topology.route``), then a slot via ``gate.acquire`` (FIFO,
  ``queue_timeout``), then the exchange with the pod through its keep-alive pool;
- what is forwarded: method, target, end-to-end headers (hop-by-hop ones and those
  named in ``Connection`` dropped), the original Host, and ``X-Forwarded-For`` /
  ``-Proto`` / ``-Host``; the body streams from the client (``wsgi.input``; pywsgi
  de-chunks chunked uploads) and the response body streams back chunk by chunk;
- a connection that could not be established (nothing sent yet) is retried once,
  on another pod when one is free;
- the slot is held until the response body has been delivered to the client (or
  the client went away) and released exactly once, by ``ProxiedBody.close`` (the
  WSGI server always calls it) or, when no response started, in ``handle``;
- activator's own answers come from ``ActivatorError`` subclasses, rendered by
  ``render_error`` (status, ``X-Activator-Reason``, ``Retry-After``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Callable

import falcon

from . import client, gate
from .core.errors import (
    ActivatorError,
    NotOriginForm,
    QueueTimeout,
    ShuttingDown,
    UpstreamConnectError,
    UpstreamTimeout,
)
from .core.config import ServiceConfig
from .core.throttler import Grant, ServiceThrottler
from .handler import CLIENT_SOCKET
from .core.topology import Forward, Topology
from .observe import Observer, RequestRecord
from .upstream import UpstreamBodyError, UpstreamBodyTimeout, UpstreamPool, UpstreamResponse

#: Marks a forwarded request with its hops, e.g. "peer vm-a" or "peer vm-a, worker 1".
FORWARDED_HEADER = "x-activator-forwarded"
FORWARDED_ENV = "HTTP_X_ACTIVATOR_FORWARDED"


#: Peer hops a request may take: the second only happens while activators disagree
#: about who owns a service's slots (one applied a new file, the other not yet).
MAX_PEER_HOPS = 2


def may_forward(marker: str | None, kind: str) -> bool:
    """Whether a request whose hops so far are ``marker`` may go on to a ``kind``.

    A request goes to an owner of the service's slots in one hop. While two
    activators' files differ, the peer it was sent to may no longer own a slot and
    know the new owner: a second peer hop is allowed, never a third, so a
    disagreement cannot loop. A request from a sibling worker goes nowhere else.
    """
    hops = [hop.split()[0] for hop in marker.split(",") if hop.strip()] if marker else []
    if "worker" in hops:
        return False
    return kind == "worker" or hops.count("peer") < MAX_PEER_HOPS


# Request headers never forwarded (RFC 9110 7.6.1), plus Expect: pywsgi already
# answered "100 Continue" to the client, and the pod gets the body with its length.
HOP_BY_HOP = frozenset((
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade",
    "expect", "content-length", "host",
))


# Statuses for which Falcon sends no body (and never iterates nor closes resp.stream).
BODILESS_STATUSES = frozenset((100, 101, 204, 304))


def forwarded_headers(env: dict[str, Any]) -> list[tuple[str, str]]:
    """The end-to-end request headers to send to the pod, in arrival order."""
    connection_tokens = {t.strip().lower() for t in env.get("HTTP_CONNECTION", "").split(",") if t.strip()}
    headers: list[tuple[str, str]] = []
    forwarded_for = None
    for key, value in env.items():
        if not key.startswith("HTTP_"):
            continue
        name = key[5:].replace("_", "-").lower()
        if name in HOP_BY_HOP or name in connection_tokens:
            continue
        if name == "x-forwarded-for":
            forwarded_for = value
            continue
        if name in ("x-forwarded-proto", "x-forwarded-host", FORWARDED_HEADER):
            continue
        headers.append((name, value))
    content_type = env.get("CONTENT_TYPE")
    if content_type:
        headers.append(("content-type", content_type))
    client = env.get("REMOTE_ADDR", "")
    host = env.get("HTTP_HOST", "")
    headers.append(("host", host))
    headers.append(("x-forwarded-for", f"{forwarded_for}, {client}" if forwarded_for else client))
    headers.append(("x-forwarded-proto", env.get("wsgi.url_scheme", "http")))
    headers.append(("x-forwarded-host", host))
    return headers


def request_body(env: dict[str, Any]) -> tuple[Any, int | None]:
    """(body, length) for the upstream request, framed as the client framed it:
    a length, chunked (body, None), or no body and no framing header (None, None)."""
    length = env.get("CONTENT_LENGTH")
    if length:
        n = int(length)
        return (env["wsgi.input"], n) if n else (None, 0)
    if "HTTP_TRANSFER_ENCODING" in env:  # the handler let only "chunked" through
        return env["wsgi.input"], None
    return None, None


def render_error(resp: falcon.Response, error: ActivatorError) -> None:
    """Activator's own answer: the one place that maps errors to responses."""
    resp.status = error.status
    resp.set_header("X-Activator-Reason", error.reason)
    if error.retry_after is not None:
        resp.set_header("Retry-After", str(error.retry_after))
    resp.content_type = "text/plain; charset=utf-8"
    resp.text = f"{error.status} {error.reason}\n"


class ProxiedBody:
    """The response body iterable: streams the pod's answer, then releases the slot.

    ``close()`` is called by the WSGI server in every case (fully sent, client gone,
    write error); it closes the upstream response (reused only if fully read) and
    releases the grant exactly once.
    """

    __slots__ = ("_proxy", "_throttler", "_grant", "_response", "_record", "_closed")

    def __init__(self, proxy: Proxy, throttler: ServiceThrottler, grant: Grant | None,
                 response: UpstreamResponse, record: RequestRecord) -> None:
        self._proxy = proxy
        self._throttler = throttler
        self._grant = grant
        self._response = response
        self._record = record
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        record = self._record
        try:
            for chunk in self._response.chunks():
                record.bytes_out += len(chunk)
                yield chunk
        except UpstreamBodyError as exc:
            # Head already sent: the only honest signal left is cutting the connection.
            record.reason = "upstream-body-cut"
            if self._grant is not None:
                kind = "timeouts" if isinstance(exc, UpstreamBodyTimeout) else "resets"
                self._throttler.record_failure(self._grant, kind, time.monotonic())
            raise
        record.complete = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._response.close()
        finally:
            self._proxy.finish(self._throttler, self._grant, self._record)


class Proxy:
    """The Falcon sink. One instance per process; the topology is swapped under it."""

    def __init__(self, topology: Topology, observer: Observer, pools: Callable[[str], UpstreamPool],
                 self_name: str = "") -> None:
        self.topology = topology
        self.self_name = self_name
        self.observer = observer
        self._pool_for = pools
        self.stopping = False
        #: Requests inside the proxy right now (queued or proxied); 0 means drained.
        self.active = 0

    def __call__(self, req: falcon.Request, resp: falcon.Response, **_: Any) -> None:
        env = req.env
        record = RequestRecord(start=time.monotonic(), client=env.get("REMOTE_ADDR", "-"),
                               method=env["REQUEST_METHOD"], target=env.get("RAW_URI", "/"))
        self.active += 1
        body_owner = False
        try:
            if not (record.target.startswith("/") or (record.target == "*" and record.method == "OPTIONS")):
                raise NotOriginForm()
            throttler = self.topology.route(env.get("HTTP_HOST", ""))
            record.service = throttler.name
            self.observer.request_started(throttler.name)
            if self.stopping:
                raise ShuttingDown()
            response, grant = self._obtain_response(env, throttler, record)
            body_owner = self._pass_on(env, resp, throttler, grant, response, record)
        except ActivatorError as error:
            record.status = error.status
            record.reason = error.reason
            render_error(resp, error)
        finally:
            if self.stopping:
                resp.set_header("Connection", "close")  # draining: no more requests on this connection
            if not body_owner:
                self.active -= 1
                record.end = time.monotonic()
                self.observer.request_done(record)

    def _pass_on(self, env: dict[str, Any], resp: falcon.Response, throttler: ServiceThrottler,
                 grant: Grant | None, response: UpstreamResponse, record: RequestRecord) -> bool:
        """Hand the pod's response to the client; True when a ProxiedBody now owns the slot."""
        if client.hung_up(env.get(CLIENT_SOCKET)):
            # Nobody will read it: drop the pod connection rather than reuse it half-read.
            response.abort()
            if grant is not None:
                throttler.release(grant, time.monotonic())
            raise client.ClientGone()
        record.status = response.status
        resp.status = f"{response.status} {response.reason}" if response.reason else response.status
        for name, value in response.headers:
            resp.append_header(name, value)
        if response.content_length is not None:
            resp.content_length = response.content_length
        if record.method == "HEAD" or response.status in BODILESS_STATUSES:
            # Falcon drops resp.stream for these without closing it, so a ProxiedBody
            # would never release its slot: finish here instead.
            response.close()
            record.complete = True
            if grant is not None:
                throttler.release(grant, time.monotonic())
            return False
        resp.stream = ProxiedBody(self, throttler, grant, response, record)
        return True

    def _obtain_response(self, env: dict[str, Any], throttler: ServiceThrottler,
                         record: RequestRecord) -> tuple[UpstreamResponse, Grant | None]:
        """The response for this request and the grant it holds (None when forwarded).

        Waits for a slot here, unless this process owns none of the service's slots:
        then (or when they move away while it waits) it forwards to a process that does.
        """
        config = throttler.config
        marker = env.get(FORWARDED_ENV)
        # Built before waiting, so that a handed-over slot is put to use at once.
        headers = forwarded_headers(env)
        target = self.topology.forward_target(throttler.name)
        if target is None or not may_forward(marker, target.kind):
            try:
                grant = gate.acquire(throttler, config.queue_timeout, env.get(CLIENT_SOCKET))
            except gate.Redirected:
                target = self.topology.forward_target(throttler.name)
                if target is None or not may_forward(marker, target.kind):
                    raise QueueTimeout() from None
            else:
                record.queue_wait = time.monotonic() - record.start
                response, grant = self._exchange(env, headers, throttler, grant, record)
                record.pod = grant.pod.address
                return response, grant
        return self._forward(env, headers, target, config, record), None

    def _exchange(self, env: dict[str, Any], headers: list[tuple[str, str]], throttler: ServiceThrottler,
                  grant: Grant, record: RequestRecord) -> tuple[UpstreamResponse, Grant]:
        """Send the request to the granted pod (retrying a failed connect once).

        Returns the response and the grant it runs on; on error the grant is released
        and the ActivatorError propagates.
        """
        config = throttler.config
        body, length = request_body(env)
        attempts = 2
        while True:
            attempts -= 1
            pod = grant.pod
            if grant.queued and client.hung_up(env.get(CLIENT_SOCKET)):
                # It waited: did its client leave at the very moment the slot came?
                throttler.release(grant, time.monotonic())
                raise client.ClientGone()
            sent_at = time.monotonic()
            try:
                response = self._pool_for(pod.address).request(
                    env["REQUEST_METHOD"], record.target, headers, body, length,
                    connect_timeout=config.connect_timeout, request_timeout=config.request_timeout,
                )
            except UpstreamConnectError as error:
                record.pod = pod.address
                throttler.record_failure(grant, "connect_errors", time.monotonic())
                if attempts and getattr(error, "retriable", False) and not self.stopping:
                    grant = gate.acquire_retry(throttler, grant, config.queue_timeout, env.get(CLIENT_SOCKET))
                    continue
                throttler.release(grant, time.monotonic())
                raise
            except UpstreamTimeout:
                record.pod = pod.address
                throttler.record_failure(grant, "timeouts", time.monotonic())
                throttler.release(grant, time.monotonic())
                raise
            except BaseException:
                throttler.release(grant, time.monotonic())
                raise
            throttler.record_success(grant)
            record.upstream_start = sent_at
            return response, grant

    def _forward(self, env: dict[str, Any], headers: list[tuple[str, str]], target: Forward,
                 config: ServiceConfig, record: RequestRecord) -> UpstreamResponse:
        """Hand the request to a peer activator, or a sibling worker, that owns slots.

        The receiver queues it like its own; the marker header keeps it from going on.
        """
        record.pod = f"{target.kind}:{target.address}"
        record.relayed = target.kind == "worker"
        hop = f"{target.kind} {self.self_name if target.kind == 'peer' else self.topology.worker_index}"
        marker = env.get(FORWARDED_ENV)
        headers = [*headers, (FORWARDED_HEADER, f"{marker}, {hop}" if marker else hop)]
        body, length = request_body(env)
        return self._pool_for(target.address).request(
            env["REQUEST_METHOD"], record.target, headers, body, length,
            connect_timeout=config.connect_timeout,
            request_timeout=config.queue_timeout + config.request_timeout,
        )

    def finish(self, throttler: ServiceThrottler, grant: Grant | None, record: RequestRecord) -> None:
        """End of a proxied response (called once, from ProxiedBody.close)."""
        if grant is not None:
            throttler.release(grant, time.monotonic())
        self.active -= 1
        record.end = time.monotonic()
        self.observer.request_done(record)


def make_app(proxy: Proxy) -> falcon.App:
    """The WSGI app for the proxy port: every path goes to the sink."""
    app = falcon.App(media_type=None)
    app.req_options.strip_url_path_trailing_slash = False
    # prefix "" (matches any path), not "/": an absolute-form target such as
    # "GET http://elsewhere/" must reach the sink to be refused with 400, not get
    # Falcon's own 404.
    app.add_sink(proxy, prefix="")
    return app
