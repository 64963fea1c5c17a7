"""The two client exchanges behind one adapter: the real engine, and a client of each protocol.

``ClientSide.serve(handler, **limits)`` starts the real ``engine.HttpServer`` on
127.0.0.1 with a small WSGI application (``ContractApp``) that takes
``environ[engine.EXCHANGE]`` and hands it to ``handler``, as the proxy drives it: an
``ActivatorError`` the handler raises becomes ``exchange.answer(error)``, ``ClientGone``
goes on up to the engine. The engine tells HTTP/2 (h2c with prior knowledge) from
HTTP/1.1 by the preface, so both transports are served by the same server: the
exchange is an ``http1.H1Exchange`` or an ``http2.H2Exchange``.

The client is one connection of the protocol (``Client``), the same interface for both:
``request`` (a head, with or without a body of known or unknown length, sent in one
write with what of the body is given), ``send`` (more of the body, its end, trailers),
``head``, ``wait_interim``, ``answer`` (read until the response ended or was cut),
``nothing_yet`` (nothing of the response has come: the server has sent nothing for it),
``go_away`` (HTTP/1.1: hang up; HTTP/2: reset the stream). HTTP/1.1 is h11 over a raw
socket (h11 the oracle of what a correct client reads); HTTP/2 is
``h2_helpers.H2Client``. What a response looked like is an ``Answer``, header names
lower-cased for both.

No monkey-patching; every wait is bounded so that a bug fails instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.select
import h11
from gevent import socket as gsocket
from h2.errors import ErrorCodes
from h2_helpers import H2Client, Stream, listener

from activator.base.exchange import ClientExchange
from activator.core.config import LimitsConfig
from activator.core.errors import ActivatorError, ClientGone
from activator.core.heads import Header
from activator.front.engine import EXCHANGE, HttpServer

#: Seconds a test waits for something that should happen at once (only to turn a hang
#: into a failure).
BOUND = 5.0
#: The authority every request names.
AUTHORITY = b"a.example"

Handler = Callable[[ClientExchange], None]


def wait_for(condition: Callable[[], object], bound: float = BOUND) -> bool:
    """Poll ``condition()`` until it is true or ``bound`` passed; its last value."""
    with gevent.Timeout(bound, False):
        while not condition():
            gevent.sleep(0.005)
    return bool(condition())


class ContractApp:
    """The WSGI application: ``handler(exchange)`` for every request (see the module docstring).

    ``exchanges``: every exchange it got, in order; ``returned``: how many handlers
    returned (or raised); ``raised``: what they raised.
    """

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.exchanges: list[ClientExchange] = []
        self.raised: list[BaseException] = []
        self.returned = 0

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        exchange: ClientExchange = environ[EXCHANGE]
        self.exchanges.append(exchange)
        try:
            self.handler(exchange)
        except ClientGone as error:
            self.raised.append(error)
            raise
        except ActivatorError as error:
            self.raised.append(error)
            exchange.answer(error)
        finally:
            self.returned += 1
        return []

    def wait_returned(self, count: int = 1) -> ClientExchange:
        """Wait until ``count`` handlers returned; the last exchange."""
        assert wait_for(lambda: self.returned >= count), f"{self.returned} handlers returned, not {count}"
        return self.exchanges[count - 1]


@dataclass
class Answer:
    """A response as the client read it (names lower-cased)."""

    #: 1xx heads: (status, fields).
    interims: list[tuple[int, list[Header]]] = field(default_factory=list)
    status: int | None = None
    headers: list[Header] = field(default_factory=list)
    body: bytes = b""
    trailers: list[Header] = field(default_factory=list)
    #: It ended as its framing says.
    ended: bool = False
    #: It was abandoned: HTTP/1.1, the connection closed before its end; HTTP/2, a reset.
    cut: bool = False

    @property
    def done(self) -> bool:
        return self.ended or self.cut

    def header(self, name: bytes) -> bytes | None:
        values = [value for key, value in self.headers if key == name]
        assert len(values) <= 1, f"{name!r} came {len(values)} times"
        return values[0] if values else None


class Client:
    """One client connection (see the module docstring); a request is known by its id."""

    def request(
        self,
        method: bytes,
        target: bytes,
        headers: Sequence[Header] = (),
        *,
        body: bytes | None = None,
        length: int | None = None,
        more: bool = False,
        trailers: Sequence[Header] = (),
    ) -> int:
        """Send a request head (Host or ``:authority`` first), and ``body`` with it.

        No ``body`` and not ``more``: a request without a body. ``length``: the body's
        declared length; without, a body of unknown length. ``more``: the body goes on
        (``send``); else it ends here (with ``trailers``).
        """
        raise NotImplementedError

    def send(self, rid: int, data: bytes, *, end: bool = False, trailers: Sequence[Header] = ()) -> None:
        raise NotImplementedError

    def head(self, rid: int) -> Answer:
        """Read until the final head came (or the response was cut)."""
        raise NotImplementedError

    def wait_interim(self, rid: int) -> Answer:
        """Read until a 1xx head came (or the final one, or the end)."""
        raise NotImplementedError

    def answer(self, rid: int) -> Answer:
        """Read until the response ended or was cut."""
        raise NotImplementedError

    def nothing_yet(self, rid: int) -> bool:
        """Whether nothing of the response has come. Called while the handler waits on the
        test: whatever the server sent before is here by now (HTTP/2: a PING round trip
        says so; HTTP/1.1: the server is not writing)."""
        raise NotImplementedError

    def go_away(self, rid: int) -> None:
        """The client leaves the exchange: HTTP/1.1 hangs up, HTTP/2 resets the stream."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


# -- HTTP/1.1 -------------------------------------------------------------------------------------


class H1Client(Client):
    """h11 over one socket: one request at a time."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = gsocket.create_connection(address)
        self.sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)
        self.h11 = h11.Connection(h11.CLIENT)
        self.answers: dict[int, Answer] = {}

    def request(
        self,
        method: bytes,
        target: bytes,
        headers: Sequence[Header] = (),
        *,
        body: bytes | None = None,
        length: int | None = None,
        more: bool = False,
        trailers: Sequence[Header] = (),
    ) -> int:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
        lines = [(b"Host", AUTHORITY), *headers]
        if length is not None:
            lines.append((b"Content-Length", b"%d" % length))
        elif body is not None or more:
            lines.append((b"Transfer-Encoding", b"chunked"))
        data = self.h11.send(h11.Request(method=method, target=target, headers=lines))
        rid = len(self.answers) + 1
        self.answers[rid] = Answer()
        data = (data or b"") + self._body(body or b"", end=not more, trailers=trailers)
        self.sock.sendall(data)
        return rid

    def _body(self, data: bytes, *, end: bool, trailers: Sequence[Header]) -> bytes:
        out = self.h11.send(h11.Data(data=data)) if data else b""
        if end:
            out = (out or b"") + (self.h11.send(h11.EndOfMessage(headers=list(trailers))) or b"")
        return out or b""

    def send(self, rid: int, data: bytes, *, end: bool = False, trailers: Sequence[Header] = ()) -> None:
        self.sock.sendall(self._body(data, end=end, trailers=trailers))

    def _read(self, answer: Answer, until: Callable[[], bool]) -> Answer:
        with gevent.Timeout(BOUND, AssertionError(f"the response was still incomplete after {BOUND}s: {answer}")):
            while not until() and not answer.done:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError:  # the connection ended mid-message
                    answer.cut = True
                    break
                if event is h11.NEED_DATA:
                    try:
                        data = self.sock.recv(65536)
                    except OSError:
                        data = b""
                    self.h11.receive_data(data)
                elif isinstance(event, h11.InformationalResponse):
                    answer.interims.append((event.status_code, list(event.headers)))
                elif isinstance(event, h11.Response):
                    answer.status = event.status_code
                    answer.headers = list(event.headers)
                elif isinstance(event, h11.Data):
                    answer.body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    answer.trailers = list(event.headers)
                    answer.ended = True
                elif isinstance(event, h11.ConnectionClosed):
                    answer.cut = not answer.ended
                    break
                else:
                    raise AssertionError(f"unexpected {event!r}")
        return answer

    def head(self, rid: int) -> Answer:
        answer = self.answers[rid]
        return self._read(answer, lambda: answer.status is not None)

    def wait_interim(self, rid: int) -> Answer:
        answer = self.answers[rid]
        return self._read(answer, lambda: bool(answer.interims) or answer.status is not None)

    def answer(self, rid: int) -> Answer:
        answer = self.answers[rid]
        return self._read(answer, lambda: answer.done)

    def nothing_yet(self, rid: int) -> bool:
        readable, _, _ = gevent.select.select([self.sock], [], [], 0)
        answer = self.answers[rid]
        return not readable and answer == Answer()

    def go_away(self, rid: int) -> None:
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


# -- HTTP/2 ------------------------------------------------------------------------------------------


class H2ProtocolClient(Client):
    """``h2_helpers.H2Client``: a request is a stream."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.client = H2Client(address)

    def request(
        self,
        method: bytes,
        target: bytes,
        headers: Sequence[Header] = (),
        *,
        body: bytes | None = None,
        length: int | None = None,
        more: bool = False,
        trailers: Sequence[Header] = (),
    ) -> int:
        client = self.client
        stream_id: int = client.h2.get_next_available_stream_id()
        fields = [
            (b":method", method),
            (b":scheme", b"http"),
            (b":path", target),
            (b":authority", AUTHORITY),
            *[(name.lower(), value) for name, value in headers],
        ]
        if length is not None:
            fields.append((b"content-length", b"%d" % length))
        client.streams[stream_id] = Stream()
        bodiless = body is None and not more
        client.h2.send_headers(stream_id, fields, end_stream=bodiless)
        if not bodiless:
            self._body(stream_id, body or b"", end=not more, trailers=trailers)
        client.flush()  # the head and what of the body is given: one write
        return stream_id

    def _body(self, stream_id: int, data: bytes, *, end: bool, trailers: Sequence[Header]) -> None:
        h2c = self.client.h2
        if data:
            assert len(data) <= h2c.local_flow_control_window(stream_id), "a test body fits in the first window"
            h2c.send_data(stream_id, data)
        if trailers:
            h2c.send_headers(stream_id, [(name.lower(), value) for name, value in trailers], end_stream=True)
        elif end:
            h2c.end_stream(stream_id)

    def send(self, rid: int, data: bytes, *, end: bool = False, trailers: Sequence[Header] = ()) -> None:
        self._body(rid, data, end=end, trailers=trailers)
        self.client.flush()

    def _answer(self, stream: Stream) -> Answer:
        def regular(fields: Sequence[Header]) -> list[Header]:
            return [(name, value) for name, value in fields if name[:1] != b":"]

        def status(fields: Sequence[Header]) -> int:
            return int(next(value for name, value in fields if name == b":status"))

        return Answer(
            interims=[(status(fields), regular(fields)) for fields in stream.informational],
            status=None if stream.headers is None else stream.status,
            headers=regular(stream.headers or []),
            body=bytes(stream.data),
            trailers=list(stream.trailers or []),
            ended=stream.ended,
            cut=stream.reset is not None,
        )

    def head(self, rid: int) -> Answer:
        stream = self.client.streams[rid]
        self.client.until(lambda: stream.headers is not None or stream.done)
        return self._answer(stream)

    def wait_interim(self, rid: int) -> Answer:
        stream = self.client.streams[rid]
        self.client.until(lambda: bool(stream.informational) or stream.headers is not None or stream.done)
        return self._answer(stream)

    def answer(self, rid: int) -> Answer:
        return self._answer(self.client.response(rid))

    def nothing_yet(self, rid: int) -> bool:
        self.client.sync()
        return self._answer(self.client.streams[rid]) == Answer()

    def go_away(self, rid: int) -> None:
        self.client.reset(rid, ErrorCodes.CANCEL)

    def close(self) -> None:
        self.client.close()


# -- the adapters ----------------------------------------------------------------------------------------


class ClientSide:
    """The engine and clients of one protocol (see the module docstring)."""

    #: ``RequestHead.version`` of this protocol's requests.
    version: str

    def __init__(self) -> None:
        self._servers: list[HttpServer] = []
        self._clients: list[Client] = []

    def wire_name(self, name: bytes) -> bytes:
        """A header name as this protocol carries it (HTTP/2 names are lower-case)."""
        raise NotImplementedError

    def _client(self, address: tuple[str, int]) -> Client:
        raise NotImplementedError

    def serve(self, handler: Handler, **limits: Any) -> tuple[ContractApp, Client]:
        """The engine serving ``handler`` with these ``LimitsConfig`` limits, and a client
        connected to it."""
        app = ContractApp(handler)
        sock = listener()
        sock.setblocking(False)
        server = HttpServer(sock, app, LimitsConfig(**limits))
        server.start()
        self._servers.append(server)
        client = self._client(server.address)
        self._clients.append(client)
        return app, client

    def close(self) -> None:
        for client in self._clients:
            client.close()
        for server in self._servers:
            server.stop(BOUND)


class H1ClientSide(ClientSide):
    version = "1.1"

    def wire_name(self, name: bytes) -> bytes:
        return name

    def _client(self, address: tuple[str, int]) -> Client:
        return H1Client(address)


class H2ClientSide(ClientSide):
    version = "2"

    def wire_name(self, name: bytes) -> bytes:
        return name.lower()

    def _client(self, address: tuple[str, int]) -> Client:
        return H2ProtocolClient(address)


SIDES: dict[str, type[ClientSide]] = {"http1": H1ClientSide, "http2": H2ClientSide}
