"""What the proxy needs of a client's request and of a pod's answer, whatever the protocol.

The proxy (``proxy.py``) is written against these two classes only; each transport
derives its own from them and adds only what is its own:

- ``ClientExchange``: one request from a client and the response to it. An HTTP/1.x
  request on a connection (``http1.H1Exchange``) or one HTTP/2 stream
  (``http2.H2Exchange``) is one. What both share is here once: the request head (a
  ``core.heads.RequestHead``), the body as it arrives (pieces queued by the transport,
  read by the application in order, ``Expect: 100-continue`` answered at the first
  read), and the record of the response sent (``started``, ``finished``, ``status``,
  ``bytes_sent``).
- ``PodResponse``: one pod's answer, returned by a pod client's ``request`` once its head
  arrived: ``upstream.PodConnection`` (HTTP/1.1 pods) or ``upstream_h2.H2PodStream``
  (``protocol: h2c`` pods). What both share is here: the response head (a
  ``core.heads.ResponseHead``), its framing, its trailers, and the flags the proxy reads.

Header lines travel as ``(name, value)`` byte pairs, in the order they came, repeated
lines kept separate; ``lower_names`` holds the lower-cased names alongside (HTTP/2 names
are lower-case already). Each transport spells heads its own way: the proxy never builds
protocol bytes. Every method that waits may yield; none raises anything but the
``ActivatorError`` subclasses it names (and ``UpstreamBodyError`` from a pod's body).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.errors import ActivatorError
from ..core.heads import BodyFraming, Header, RequestHead, ResponseHead
from . import deadlines

#: What the proxy relays for each 1xx: (status, reason, header lines as the pod sent them).
InterimCallback = Callable[[int, bytes, list[Header]], None]

#: The most one ``read`` returns by default.
READ_SIZE = 65536
_NO_BYTES = b""


class ClientExchange:
    """One client request, its body, and the response written back to it.

    The transport fills ``head`` and queues body pieces (``_body``, ``body_done``,
    ``body_error``); the application reads the body with ``read`` and answers with
    ``start``/``write``/``finish`` (or ``answer`` for one of activator's own answers, or
    ``interim`` for a 1xx first).
    """

    __slots__ = (
        "head",
        "client_ip",
        "client_ip_bytes",
        "scheme_bytes",
        "refusal",
        "body_bytes",
        "body_done",
        "body_error",
        "trailers",
        "started",
        "finished",
        "status",
        "bytes_sent",
        "_body",
        "_continue_sent",
    )

    def __init__(self, head: RequestHead, client_ip: str, client_ip_bytes: bytes, scheme_bytes: bytes) -> None:
        self.head = head
        self.client_ip = client_ip
        self.client_ip_bytes = client_ip_bytes
        self.scheme_bytes = scheme_bytes  # b"http" or b"https"
        #: Set when the head is refused by our rules: the application never runs, the
        #: client gets this answer.
        self.refusal: ActivatorError | None = None
        #: Request body bytes received so far.
        self.body_bytes = 0
        self.body_done = False
        self.body_error: ActivatorError | None = None
        #: The request's trailers, once its body ended.
        self.trailers: list[Header] | tuple[()] = ()
        #: A final response began (own answers included), and ended.
        self.started = False
        self.finished = False
        #: The final status sent (0 before).
        self.status = 0
        #: Response body bytes handed on to the client.
        self.bytes_sent = 0
        #: Body pieces received and not read yet (a list: it holds a piece or a few).
        self._body: list[bytes] = []
        self._continue_sent = False

    def __repr__(self) -> str:
        head = self.head
        return f"<{type(self).__name__} {head.method} {head.target[:60]!r} HTTP/{head.version}>"

    # -- the request body -----------------------------------------------------------------

    def read(self, size: int = READ_SIZE) -> bytes:
        """The next piece of the body (at most ``size`` bytes); b"" at its end.

        Raises the body's error (``ClientBodyError``, ``BodyTooLarge``, ``ClientGone``,
        ``ClientTimeout``). The first read answers ``Expect: 100-continue``.
        """
        body = self._body
        while not body:
            if self.body_error is not None:
                raise self.body_error
            if self.body_done:
                return _NO_BYTES
            if self.head.expect_continue and not self._continue_sent:
                self._continue_sent = True
                if not self.started:
                    self._send_continue()
            self._await_body()
        piece = body.pop(0)
        if len(piece) > size:
            body.insert(0, piece[size:])
            piece = piece[:size]
        elif body and len(piece) + len(body[0]) <= size:  # several pieces here already: one read
            pieces = [piece]
            taken = len(piece)
            while body and taken + len(body[0]) <= size:
                more = body.pop(0)
                pieces.append(more)
                taken += len(more)
            piece = b"".join(pieces)
        self._consumed(len(piece))
        return piece

    def raise_known_error(self) -> None:
        """Raise the body's error if what already arrived shows it (no waiting).

        Called before the first byte goes to the pod: a request whose framing is broken
        within what already arrived (the usual smuggling attempt, in one packet) reaches
        no pod at all.
        """
        if self.body_error is not None and not self._body:
            raise self.body_error

    def buffered(self) -> bool:
        """Whether a piece (or the end, or an error) is here without waiting."""
        return bool(self._body) or self.body_done or self.body_error is not None

    def exhausted(self) -> bool:
        """Every byte of the body was read and it ended whole: the next read is b""."""
        return self.body_done and not self._body and self.body_error is None

    def _await_body(self) -> None:
        """Wait until a piece, the end or an error of the body is here (or raise
        ``ClientTimeout``: then ``body_error`` says so)."""
        raise NotImplementedError

    def _send_continue(self) -> None:
        """Send ``100 Continue``."""
        raise NotImplementedError

    def _consumed(self, size: int) -> None:
        """``size`` bytes of the body were read (HTTP/2 reopens the client's window)."""

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool:
        """Wait until more body is here or ``pod_fd`` is readable; True if ``pod_fd`` is.

        Raises ``ClientTimeout`` when neither happens within ``timeout``.
        """
        raise NotImplementedError

    # -- the client -------------------------------------------------------------------------

    def watch_gone(self, on_gone: Callable[[], None]) -> bool:
        """Call ``on_gone()`` (it must not block) when the client goes away (an HTTP/1.x
        hang-up, an HTTP/2 stream reset). False if it is gone already. Does not yield."""
        raise NotImplementedError

    def unwatch_gone(self, on_gone: Callable[[], None]) -> None:
        """End that watch (idempotent). Does not yield."""
        raise NotImplementedError

    def client_gone(self) -> bool:
        """Whether the client is gone now (one cheap check, no waiting)."""
        raise NotImplementedError

    @property
    def queue_share(self) -> QueueShare | None:
        """What this request's connection holds of the queues (HTTP/2: several streams
        may wait at once), None where one connection holds one request at a time."""
        return None

    # -- the response -----------------------------------------------------------------------

    @property
    def was_cut(self) -> bool:
        """The response was abandoned mid-way (client gone, pod cut)."""
        raise NotImplementedError

    def interim(self, status: int, reason: bytes, headers: list[Header]) -> None:
        """Relay a 1xx answer (only before the final one)."""
        raise NotImplementedError

    def start(
        self, status: int, reason: bytes | None, headers: Sequence[Header], framing: BodyFraming, close: bool = False
    ) -> None:
        """Begin the final response (sent with the first ``write`` or ``finish``).

        ``headers``: end-to-end lines (``core.http.response_headers``); ``framing``: LENGTH
        (a ``Content-Length`` line is among ``headers``), CHUNKED (a stream, trailers
        allowed), CLOSE (HTTP/1.0: ends with the connection) or NONE
        (``core.heads.client_framing``).
        """
        raise NotImplementedError

    def write(self, data: bytes) -> None:
        """Send a piece of the body. Raises ``ClientGone``."""
        raise NotImplementedError

    def flush(self) -> None:
        """Send the head now rather than with the first piece of the body (a stream whose
        first piece may be late). Raises ``ClientGone``."""
        raise NotImplementedError

    def finish(self, trailers: Sequence[Header] = (), last: bytes = b"") -> None:
        """End the response, with trailers where the framing can carry them; ``last``:
        the body's last piece, sent with the end (a whole small answer: one send, and in
        HTTP/2 one DATA frame that also ends the stream). Raises ``ClientGone``."""
        raise NotImplementedError

    def answer(self, error: ActivatorError) -> None:
        """Activator's own answer for ``error`` (gRPC-shaped for a gRPC request); if the
        response already began, the only honest signal left: ``cut``."""
        raise NotImplementedError

    def cut(self) -> None:
        """Abandon the response mid-way (HTTP/1.x: close the connection; HTTP/2: reset
        the stream)."""
        raise NotImplementedError

    def switch_protocols(self, reason: bytes, headers: Sequence[Header]) -> tuple[Any, bytes]:
        """Send a pod's 101 and hand over the client socket and the bytes it sent after
        its head, for a tunnel (HTTP/1.1 only: an HTTP/2 stream never asks to upgrade)."""
        raise NotImplementedError


class QueueShare:
    """The streams of one connection waiting in each service's queue (see
    ``ClientExchange.queue_share``): one connection may hold at most ``share`` of a
    queue, so that one client cannot fill the queue that the others need."""

    __slots__ = ("share", "_waiting")

    def __init__(self, share: float) -> None:
        self.share = share
        self._waiting: dict[str, int] = {}

    def enter(self, service: str, queue_depth: int) -> bool:
        """One more of this connection's requests waits for ``service``; False (and not
        counted) when it holds its share already. Does not yield."""
        waiting = self._waiting.get(service, 0)
        if waiting >= max(1, int(queue_depth * self.share)):
            return False
        self._waiting[service] = waiting + 1
        return True

    def leave(self, service: str) -> None:
        """One of them got a slot, or left. Does not yield."""
        waiting = self._waiting[service] - 1
        if waiting:
            self._waiting[service] = waiting
        else:
            del self._waiting[service]


class BodySource(Protocol):
    """A request body as a pod client reads it (a ``ClientExchange`` is one)."""

    @property
    def trailers(self) -> Sequence[Header]:
        """The request's trailers, once its body ended."""

    def read(self, size: int = ...) -> bytes: ...

    def raise_known_error(self) -> None: ...

    def buffered(self) -> bool: ...

    def exhausted(self) -> bool:
        """Every byte was read and the body ended whole: the next read is b"" (no waiting)."""

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool: ...


@dataclass(slots=True)
class PodRequest:
    """One request as a pod client sends it: the method and target, the end-to-end header
    lines (``core.http.pod_request_headers``; the pod client adds the framing), the body
    and how it is framed, and where 1xx answers go."""

    method: str
    target: bytes
    headers: list[Header]
    body: BodySource | None = None
    framing: BodyFraming = BodyFraming.NONE
    content_length: int | None = None
    interim: InterimCallback | None = None

    @property
    def has_body(self) -> bool:
        """Whether body bytes are to be sent (not for no body or a zero length)."""
        framing = self.framing
        return (
            self.body is not None
            and framing is not BodyFraming.NONE
            and not (framing is BodyFraming.LENGTH and not self.content_length)
        )


class PodResponse(deadlines.Watched):
    """One pod's answer, from its head on; end it with ``close()`` or ``abort()``.

    The pod client fills ``head`` (and ``framing``: ``core.heads.response_framing``),
    and reads the body as the proxy asks for it. It waits on ``sock`` under deadlines.
    """

    __slots__ = ("head", "framing", "early", "upgraded", "tunnel_data", "complete", "head_done", "trailers")

    def __init__(self, sock: Any) -> None:
        super().__init__(sock)
        self.head = ResponseHead()
        #: LENGTH, CHUNKED (a stream, trailers possible), CLOSE or NONE.
        self.framing = BodyFraming.NONE
        #: It came before the request was sent whole (the client connection closes after it).
        self.early = False
        #: A 101: ``detach()`` gives the socket for the tunnel, ``tunnel_data`` what the
        #: pod sent after its head.
        self.upgraded = False
        self.tunnel_data = _NO_BYTES
        #: The whole body is here (``take_body``).
        self.complete = False
        self.head_done = False
        #: Trailer fields, after the body.
        self.trailers: list[Header] | tuple[()] = ()

    def take_body(self) -> bytes:
        """The body bytes here now (all of it when ``complete``), without waiting."""
        raise NotImplementedError

    def body(self) -> Iterator[bytes]:
        """The body as it arrives. Raises ``UpstreamBodyError`` and its subclasses."""
        raise NotImplementedError

    def close(self) -> None:
        """Done with it: the connection (or stream) is reused if it may be, else closed."""
        raise NotImplementedError

    def abort(self) -> None:
        """Drop it now (the client left): never reused."""
        raise NotImplementedError

    def detach(self) -> Any:
        """The socket of a 101 answer, for the tunnel (HTTP/1.1 pods only)."""
        raise NotImplementedError
