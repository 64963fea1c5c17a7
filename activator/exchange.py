"""What the proxy needs of a client's request and of a pod's answer, whatever the protocol.

The proxy (``proxy.py``) is written against these two interfaces only:

- ``ClientExchange``: one request from a client and the response to it. An HTTP/1.x
  request on a connection (``http1.H1Exchange``) or one HTTP/2 stream
  (``http2.H2Exchange``) is one.
- ``PodResponse``: one pod's answer, returned by a pod client's ``request`` once its head
  arrived: ``upstream.PodConnection`` (HTTP/1.1 pods) or ``upstream_h2.H2PodStream``
  (``protocol: h2c`` pods).

Header lines travel as ``(name, value)`` byte pairs, in the order they came, repeated
lines kept separate; ``lower_names`` holds the lower-cased names alongside (HTTP/2 names
are lower-case already). Each transport spells heads its own way: the proxy never builds
protocol bytes. Every method that waits may yield; none raises anything but the
``ActivatorError`` subclasses it names (and ``UpstreamBodyError`` from a pod's body).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from .core.errors import ActivatorError
from .core.http import BodyFraming, Header

#: What the proxy relays for each 1xx: (status, reason, header lines as the pod sent them).
InterimCallback = Callable[[int, bytes, list[Header]], None]


class ClientExchange(Protocol):
    """One client request, its body, and the response written back to it."""

    # -- the request head --------------------------------------------------------------
    method: str
    target: bytes  # origin-form (``/path?query``), or ``*``
    version: str  # "1.0", "1.1" or "2"
    headers: list[Header]  # as received, pseudo-headers excepted
    lower_names: list[bytes]
    host: str  # the validated Host (``core.http.request_host``)
    content_length: int | None
    framing: BodyFraming  # how the body arrives: NONE, LENGTH, or CHUNKED (a stream of unknown length)
    content_type: bytes | None  # a gRPC request's starts with ``application/grpc``
    grpc_timeout: bytes | None  # a gRPC request's deadline (``core.http.grpc_timeout``)
    upgrade: bool  # an HTTP/1.1 Upgrade request (a tunnel if the pod answers 101)
    upgrade_value: bytes | None
    body_bytes: int  # request body bytes received so far
    client_ip: str
    client_ip_bytes: bytes
    scheme_bytes: bytes  # b"http" or b"https"

    # Lines an HTTP/1.x exchange keeps as tuples, HTTP/2 as lists (read-only here).
    @property
    def hosts(self) -> Sequence[bytes]:
        """Host values (HTTP/2: ``:authority``)."""

    @property
    def connection_values(self) -> Sequence[bytes]:
        """``Connection`` lines (HTTP/2: none)."""

    @property
    def forwarded(self) -> Sequence[bytes]:
        """``X-Activator-Forwarded`` lines."""

    @property
    def trailers(self) -> Sequence[Header]:
        """The request's trailers, once its body ended."""

    # -- the request body (``upstream.BodySource``) -------------------------------------
    def read(self, size: int = ...) -> bytes:
        """The next piece of the body (at most ``size`` bytes); b"" at its end."""

    def raise_known_error(self) -> None:
        """Raise the body's error if what already arrived shows it (no waiting)."""

    def buffered(self) -> bool:
        """Whether a piece (or the end, or an error) is here without waiting."""

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool:
        """Wait until more body is here or ``pod_fd`` is readable; True if ``pod_fd`` is.

        Raises ``ClientTimeout`` when neither happens within ``timeout``.
        """

    # -- the client -------------------------------------------------------------------
    def watch_gone(self, on_gone: Callable[[], None]) -> bool:
        """Call ``on_gone()`` (it must not block) when the client goes away (an HTTP/1.x
        hang-up, an HTTP/2 stream reset). False if it is gone already. Does not yield."""

    def unwatch_gone(self, on_gone: Callable[[], None]) -> None:
        """End that watch (idempotent). Does not yield."""

    def client_gone(self) -> bool:
        """Whether the client is gone now (one cheap check, no waiting)."""

    # -- the response -----------------------------------------------------------------
    started: bool  # a final response began (own answers included)
    finished: bool
    status: int  # the final status sent (0 before)
    bytes_sent: int  # body bytes handed to the kernel

    @property
    def was_cut(self) -> bool:
        """The response was abandoned mid-way (client gone, pod cut)."""

    def interim(self, status: int, reason: bytes, headers: list[Header]) -> None:
        """Relay a 1xx answer (only before the final one)."""

    def start(
        self, status: int, reason: bytes | None, headers: Sequence[Header], framing: BodyFraming, close: bool = False
    ) -> None:
        """Begin the final response (sent with the first ``write`` or ``finish``).

        ``headers``: end-to-end lines (``core.http.response_headers``); ``framing``: LENGTH
        (a ``Content-Length`` line is among ``headers``), CHUNKED (a stream, trailers
        allowed), CLOSE (HTTP/1.0: ends with the connection) or NONE.
        """

    def write(self, data: bytes) -> None:
        """Send a piece of the body. Raises ``ClientGone``."""

    def flush(self) -> None:
        """Send the head now rather than with the first piece of the body (a stream whose
        first piece may be late). Raises ``ClientGone``."""

    def finish(self, trailers: Sequence[Header] = ()) -> None:
        """End the response, with trailers where the framing can carry them."""

    def answer(self, error: ActivatorError) -> None:
        """Activator's own answer for ``error`` (gRPC-shaped for a gRPC request); if the
        response already began, the only honest signal left: ``cut``."""

    def cut(self) -> None:
        """Abandon the response mid-way (HTTP/1.x: close the connection; HTTP/2: reset
        the stream)."""


class PodResponse(Protocol):
    """One pod's answer, from its head on; end it with ``close()`` or ``abort()``."""

    status: int
    reason: bytes
    headers: list[Header]
    lower_names: list[bytes]
    framing: BodyFraming  # LENGTH, CHUNKED (a stream, trailers possible), CLOSE or NONE
    content_length: int | None
    early: bool  # it came before the request was sent whole (the client connection closes after it)
    upgraded: bool  # a 101: ``detach()`` gives the socket for the tunnel
    tunnel_data: bytes  # a 101: what the pod sent after its head
    complete: bool  # the whole body is here (``take_body``)

    # Lines an HTTP/1.1 pod response keeps as tuples, HTTP/2 as lists (read-only here).
    @property
    def connection_values(self) -> Sequence[bytes]:
        """``Connection`` lines (HTTP/2: none)."""

    @property
    def trailers(self) -> Sequence[Header]:
        """Trailer fields, after the body."""

    def take_body(self) -> bytes: ...

    def body(self) -> Iterator[bytes]:
        """The body as it arrives. Raises ``UpstreamBodyError`` and its subclasses."""

    def close(self) -> None:
        """Done with it: the connection (or stream) is reused if it may be, else closed."""

    def abort(self) -> None:
        """Drop it now (the client left): never reused."""

    def detach(self) -> Any:
        """The socket of a 101 answer, for the tunnel (HTTP/1.1 pods only)."""
