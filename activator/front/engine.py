"""The HTTP server: accepts connections, serves their requests through a WSGI application.

What this module decides:

- **Listening and admission.** A gevent ``StreamServer`` on a listener made by
  ``sockets.listen_socket`` (TCP_NODELAY, inherited by accepted sockets). Connections over
  ``max_connections`` are answered 503 ``too-many-connections`` at once and closed
  (stopping to accept would leave clients hanging in the backlog instead).
- **One greenlet per connection**, which parses its requests (``http1``) and serves them
  one after the other: the application is called once per request, in this greenlet.
- **The WSGI contract**, with one extension. The engine builds a WSGI environ for each
  request (``wsgi.input`` reads the body as it streams) and calls the application. An
  application that needs more than WSGI can say (1xx answers, repeated header lines in
  their order, trailers, streaming without buffering, cutting a connection) finds the
  exchange in ``environ[EXCHANGE]`` and writes its response there itself; the engine then
  ignores what the application returns (it closes it). The proxy does this for every
  request; the admin API answers through plain WSGI.
- **What the application cannot see**: requests llhttp or ``core.http`` refuse are
  answered here, with the one mapping of errors to answers (``core.http.own_answer``),
  before any application runs. An exception escaping the application is a bug: logged
  once with its traceback, answered 500 ``internal-error`` (or the connection cut if the
  response had started).
- **Stopping.** ``close()`` stops accepting; ``stopping`` makes every later answer close
  its connection; ``stop(timeout)`` waits for the connections to finish, then kills the
  rest (idle keep-alive connections are closed at once).
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote_to_bytes

import gevent
from gevent.server import StreamServer

from ..base.exchange import ClientExchange
from ..core.config import LimitsConfig
from ..core.errors import ActivatorError, BadRequest, ClientGone, InternalError, TooManyConnections
from ..core.h2budgets import Budget
from ..core.heads import BodyFraming, RequestHead, client_framing
from ..core.http import own_answer
from .http1 import H1Connection, linger
from .http2 import H2ServerConnection

log = logging.getLogger("activator")

#: The environ key of the request's exchange (see the module docstring).
EXCHANGE = "activator.exchange"

Application = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


#: Told of each request refused before any application saw it: the client's address, the
#: request's method and target ("" and b"" when its request line could not be read), the
#: refusal. Called before the answer is sent; must not yield or raise.
RefusalHook = Callable[[str, str, bytes, ActivatorError], None]
#: Told of every HTTP/2 connection closed for going past one of its budgets.
BudgetHook = Callable[[Budget], None]


class HttpServer:
    """Serves ``app`` on ``listener`` (a bound, listening, non-blocking socket)."""

    def __init__(
        self,
        listener: Any,
        app: Application,
        limits: LimitsConfig,
        *,
        tls: ssl.SSLContext | None = None,
        on_refusal: RefusalHook | None = None,
        on_budget: BudgetHook | None = None,
    ) -> None:
        self.app = app
        #: ``app`` as it is called: a Falcon app's bound ``__call__`` (CPython runs a bound
        #: Python method inline, where calling the instance recurses in C: every request
        #: parked in the queue then keeps a smaller copy of the C stack).
        self._call = _direct_call(app)
        #: What the engine enforces per connection; swapped on reload (new connections).
        self.limits = limits
        self.on_refusal = on_refusal
        self.on_budget = on_budget
        #: The TLS context for new connections (None: plain); swapped when the files change.
        self.tls = tls
        self.stopping = False
        #: Open connections and the greenlet serving each.
        self.connections: dict[H1Connection, gevent.Greenlet] = {}
        #: Connections inside an exchange right now (the others wait for a request).
        self._busy: set[H1Connection] = set()
        #: The HTTP/2 connections being served (told to stop gracefully on ``stop``).
        self._h2: set[H2ServerConnection] = set()
        self._server = StreamServer(listener, self._handle)
        host, port = listener.getsockname()[:2]
        #: What every request's environ starts from.
        self._base_environ: dict[str, Any] = {
            "SCRIPT_NAME": "",
            "SERVER_NAME": str(host),
            "SERVER_PORT": str(port),
            "wsgi.version": (1, 0),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": False,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._server.start()

    def close(self) -> None:
        """Stop accepting (the listener is closed); open connections go on."""
        self._server.close()

    def renew_connections(self) -> None:
        """The listener changed (a new TLS certificate): the connections made before it
        end gracefully, so that their clients come back to the new one. HTTP/2 ones get
        their GOAWAY now (the streams under way finish), HTTP/1.x ones close after the
        answer in progress (or now, when idle). Does not yield."""
        for h2 in list(self._h2):
            h2.stop()
        for conn, greenlet in list(self.connections.items()):
            conn.closing = True
            if conn not in self._busy:
                greenlet.kill(block=False)

    def begin_stop(self) -> None:
        """A graceful stop begins: every later answer closes its HTTP/1.x connection, and
        every HTTP/2 connection gets its GOAWAY now (the streams under way finish, the
        client opens no new one). Does not yield."""
        self.stopping = True
        for h2 in list(self._h2):
            h2.stop()

    def stop(self, timeout: float) -> None:
        """Close idle connections now, give the others ``timeout`` seconds, kill the rest."""
        self.begin_stop()
        self._server.close()
        idle = [greenlet for conn, greenlet in self.connections.items() if conn not in self._busy]
        gevent.killall(idle, block=False)
        gevent.joinall(list(self.connections.values()), timeout=timeout)
        gevent.killall(list(self.connections.values()), block=False)

    # -- one connection -------------------------------------------------------------------

    def _handle(self, sock: Any, address: Any) -> None:
        limits = self.limits
        if len(self.connections) >= limits.max_connections:
            refusal = TooManyConnections()
            if self.on_refusal is not None:
                self.on_refusal(str(address[0]), "", b"", refusal)
            try:
                sock.settimeout(limits.client_timeout)
                sock.sendall(own_answer(refusal, close=True)[0])
                linger(sock)
            except OSError:
                pass
            finally:
                sock.close()
            return
        context = self.tls
        alpn: str | None = None
        if context is not None:
            secured = _handshake(context, sock, limits.client_timeout)
            if secured is None:
                return
            sock, alpn = secured, secured.selected_alpn_protocol()
        scheme = "https" if context is not None else "http"
        conn = H1Connection(
            sock, address, limits.client_timeout, limits.max_header_bytes, limits.max_body_bytes, scheme
        )
        self.connections[conn] = gevent.getcurrent()
        try:
            if alpn == "h2" or (context is None and conn.starts_with_h2_preface()):
                self._serve_h2(conn)
            else:
                self._serve(conn)
        except ClientGone:
            pass
        except BaseException:  # killed (stop), or a bug: no lingering on the way out
            conn.cut = True
            raise
        finally:
            self.connections.pop(conn, None)
            self._busy.discard(conn)
            conn.close()

    def _serve_h2(self, conn: H1Connection) -> None:
        """An HTTP/2 connection: its streams are served by ``http2`` (one greenlet each)."""
        self._busy.add(conn)  # streams come and go; the connection counts as busy
        conn.cut = True  # HTTP/2 ends with GOAWAY, not with a lingering HTTP/1.x close
        h2 = H2ServerConnection(
            conn.sock,
            conn.client_ip,
            self.limits,
            conn.scheme,
            self._call_app,
            on_refusal=self.on_refusal,
            on_budget=self.on_budget,
        )
        self._h2.add(h2)
        try:
            if self.stopping:
                h2.stop()
            h2.serve()
        finally:
            self._h2.discard(h2)

    def _serve(self, conn: H1Connection) -> None:
        while True:
            conn.closing = conn.closing or self.stopping
            try:
                exchange = conn.next_exchange()
            except ActivatorError as refusal:
                self._refused(conn.client_ip, None, refusal)
                conn.send(own_answer(refusal, close=True)[0])
                return
            if exchange is None:
                return
            self._busy.add(conn)
            if exchange.refusal is not None:
                self._refused(conn.client_ip, exchange.head, exchange.refusal)
                exchange.answer(exchange.refusal)
            else:
                self._call_app(exchange)
            if not conn.settle(exchange):
                return
            self._busy.discard(conn)

    def _refused(self, client_ip: str, head: RequestHead | None, refusal: ActivatorError) -> None:
        log.debug("refused a request from %s: %s (%s)", client_ip, refusal.reason, refusal)
        if self.on_refusal is not None:
            self.on_refusal(client_ip, *refused_line(head), refusal)

    def _call_app(self, exchange: ClientExchange) -> None:
        environ = self._environ(exchange)
        response = _WsgiResponse(exchange)
        try:
            result = self._call(environ, response.start_response)
            try:
                if not exchange.started:
                    response.send(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
        except ClientGone:
            raise
        except Exception:
            log.exception("internal error serving %s %r", exchange.head.method, exchange.head.target[:200])
            exchange.answer(InternalError())
            return
        if not exchange.finished:
            exchange.finish()

    def _environ(self, exchange: ClientExchange) -> dict[str, Any]:
        head = exchange.head
        target = head.target
        path, _, query = target.partition(b"?")
        if b"%" in path:
            path = unquote_to_bytes(path)
        environ = self._base_environ.copy()
        environ["REQUEST_METHOD"] = head.method
        environ["PATH_INFO"] = path.decode("latin-1")
        environ["QUERY_STRING"] = query.decode("latin-1")
        environ["SERVER_PROTOCOL"] = _SERVER_PROTOCOLS.get(head.version, "HTTP/1.0")
        environ["REMOTE_ADDR"] = exchange.client_ip
        environ["wsgi.url_scheme"] = _SCHEMES[exchange.scheme_bytes]
        environ["wsgi.input"] = _Input(exchange)
        environ[EXCHANGE] = exchange
        keys = _ENVIRON_KEYS
        for (_, value), lower in zip(head.headers, head.lower_names):  # noqa: B905 (built together)
            key = keys.get(lower)
            if key is None:
                key = _environ_key(lower)
            text = value.decode("latin-1")
            previous = environ.get(key)
            environ[key] = text if previous is None else f"{previous},{text}"
        return environ


def refused_line(head: RequestHead | None) -> tuple[str, bytes]:
    """The method and target of a refused request, for its access-log line ("" and b""
    when its request line could not be read)."""
    return ("", b"") if head is None else (head.method, head.target)


def _direct_call(app: Application) -> Application:
    """``app.__call__`` when its class defines it in Python (see ``HttpServer._call``)."""
    # A plain function's ``__call__`` is a C wrapper: calling that would gain nothing.
    call = getattr(app, "__call__", app)  # noqa: B004 (not a test of callability)
    return call if isinstance(call, types.MethodType) else app


_SCHEMES = {b"http": "http", b"https": "https"}
_SERVER_PROTOCOLS = {"1.1": "HTTP/1.1", "1.0": "HTTP/1.0", "2": "HTTP/2"}

#: Header name (lower-cased bytes) -> its WSGI environ key; bounded, names are client input.
_ENVIRON_KEYS: dict[bytes, str] = {b"content-type": "CONTENT_TYPE", b"content-length": "CONTENT_LENGTH"}
_ENVIRON_KEYS_SIZE = 1024


def _environ_key(lower: bytes) -> str:
    key = "HTTP_" + lower.decode("latin-1").upper().replace("-", "_")
    if len(_ENVIRON_KEYS) < _ENVIRON_KEYS_SIZE:
        _ENVIRON_KEYS[lower] = key
    return key


class _Input:
    """``wsgi.input``: the request body as it streams (de-chunked)."""

    __slots__ = ("_exchange",)

    def __init__(self, exchange: ClientExchange) -> None:
        self._exchange = exchange

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return b"".join(iter(self._exchange.read, b""))
        return self._exchange.read(size) if size else b""

    def readline(self, size: int = -1) -> bytes:
        raise OSError("wsgi.input.readline is not supported")

    def __iter__(self) -> Any:
        return iter(self._exchange.read, b"")


class _WsgiResponse:
    """start_response, and the body an application returns, written to the exchange."""

    __slots__ = ("_exchange", "_headers", "_length", "_reason", "_status")

    def __init__(self, exchange: ClientExchange) -> None:
        self._exchange = exchange
        self._status = 0
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._length: int | None = None

    def start_response(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[..., Any]:
        if self._exchange.started:  # the application answered through the exchange itself
            return self._write_unsupported
        code, _, reason = status.partition(" ")
        self._status = int(code)
        pairs = []
        for name, value in headers:
            if name.lower() == "content-length":
                self._length = int(value)
            pairs.append((name.encode("latin-1"), value.encode("latin-1")))
        self._headers = pairs
        self._reason = reason.encode("latin-1")
        return self._write_unsupported

    def _write_unsupported(self, data: bytes) -> None:
        raise OSError("the WSGI write() callable is not supported")

    def send(self, result: Iterable[bytes]) -> None:
        exchange = self._exchange
        head = exchange.head
        length_known = BodyFraming.LENGTH if self._length is not None else BodyFraming.CHUNKED
        framing = client_framing(head.method, self._status, length_known, head.version)
        exchange.start(self._status, self._reason, self._headers, framing)
        if framing is BodyFraming.NONE:
            return
        for piece in result:
            exchange.write(piece)


def _handshake(context: ssl.SSLContext, sock: Any, timeout: float) -> Any | None:
    """The TLS side of a new connection, or None when there is none (the socket closed).

    A client that speaks plain HTTP to the TLS port (its first byte is not a TLS
    handshake record's) gets a plain 400 and a clean close, as does one whose handshake
    fails: never a reset.
    """
    try:
        sock.settimeout(timeout)  # once per connection: a timer is fine here
        first = sock.recv(1, socket.MSG_PEEK)
        if first and first[0] != _TLS_HANDSHAKE_RECORD:
            log.debug("plain HTTP (or not TLS) on the TLS port from %s", _peer(sock))
            sock.sendall(own_answer(BadRequest("this port speaks TLS (https)"), close=True)[0])
            linger(sock)
            sock.close()
            return None
        secured = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        secured.do_handshake()
        secured.settimeout(None)
        return secured
    except (OSError, ValueError) as error:
        log.debug("TLS handshake failed: %s", error)
        linger(sock)
        sock.close()
        return None


#: The first byte of a TLS record that carries a handshake (RFC 8446 5.1).
_TLS_HANDSHAKE_RECORD = 0x16


def _peer(sock: Any) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"
