"""HTTP/2 on both ends for tests/test_http2.py: a real server in-process, the h2 library as the client.

``H2Server`` accepts connections on a gevent listener on 127.0.0.1 and serves each with a
real ``http2.H2ServerConnection`` in its own greenlet (over TLS with ALPN ``h2`` when given
a context); the test gives the ``call_app``. ``tls_contexts`` makes a server and a client
context around a self-signed certificate.
``H2Client`` is the ``h2`` library's client side over a real gevent socket: it sends
requests (bodies within the server's flow-control windows), records every stream's
answer (informational heads, head, body, trailers, reset code, the WINDOW_UPDATE frames
the server sent for it) and the connection's GOAWAY frames. It acknowledges the DATA it
receives, except on streams it was told to ``hold``: a client that does not read.
GOAWAY frames are taken out of the server's bytes before h2 sees them (and recorded):
h2 ends its connection state on any GOAWAY, and a test wants to see the streams that
finish after one.

The session is not monkey-patched: only gevent's sockets and primitives are used, and
every wait is bounded (``BOUND``) so that a bug shows as a failure instead of a hang.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import gevent.ssl
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from gevent import socket as gsocket
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    DataReceived,
    Event,
    InformationalResponseReceived,
    PingAckReceived,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from h2.settings import SettingCodes
from hyperframe.frame import Frame, GoAwayFrame

from activator.core.config import Http2Limits, LimitsConfig
from activator.core.heads import Header
from activator.front.http2 import H2Exchange, H2ServerConnection

#: Seconds a test waits for something that should happen at once (only to turn a hang into a failure).
BOUND = 5.0
#: The client's own connection window: large, so that a stream it holds never stalls the others.
CLIENT_CONNECTION_WINDOW = 16 * 1024 * 1024
_FRAME_HEADER = 9
_GOAWAY_TYPE = 0x7


def eventually(condition: Callable[[], object], what: str) -> None:
    """Wait (polling, bounded) until ``condition()`` is true."""
    with gevent.Timeout(BOUND, AssertionError(f"{what} did not happen")):
        while not condition():
            gevent.sleep(0.01)


def make_limits(max_streams: int | None = None, **limits: Any) -> LimitsConfig:
    """Connection limits for a test server: ``LimitsConfig`` keys, and the HTTP/2 stream limit."""
    if max_streams is not None:
        limits["http2"] = Http2Limits(max_concurrent_streams=max_streams)
    return LimitsConfig(**limits)


def listener() -> gsocket.socket:
    """A listener on 127.0.0.1 whose accepted sockets have TCP_NODELAY, as the engine's have."""
    sock = gsocket.socket(gsocket.AF_INET, gsocket.SOCK_STREAM)
    sock.setsockopt(gsocket.SOL_SOCKET, gsocket.SO_REUSEADDR, 1)
    sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def tls_contexts(directory: Path) -> tuple[gevent.ssl.SSLContext, gevent.ssl.SSLContext]:
    """(server, client) contexts offering ALPN ``h2``, around a self-signed pair for 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "server.crt", directory / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = gevent.ssl.SSLContext(gevent.ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_file, key_file)
    server.set_alpn_protocols(["h2"])
    client = gevent.ssl.SSLContext(gevent.ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cert_file)
    client.set_alpn_protocols(["h2"])
    return server, client


class H2Server:
    """Real ``H2ServerConnection``s for every accepted connection (see the module docstring)."""

    def __init__(
        self,
        call_app: Callable[[H2Exchange], None],
        limits: LimitsConfig,
        tls: gevent.ssl.SSLContext | None = None,
        **options: Any,
    ) -> None:
        self.call_app = call_app
        self.limits = limits
        self.tls = tls
        self.options = options
        self.listener = listener()
        self.address: tuple[str, int] = self.listener.getsockname()
        self.connections: list[H2ServerConnection] = []
        self.serving: list[gevent.Greenlet] = []
        self._acceptor = gevent.spawn(self._accept)

    def _accept(self) -> None:
        while True:
            sock, address = self.listener.accept()
            scheme = "http"
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True)
                assert sock.selected_alpn_protocol() == "h2"
                scheme = "https"
            conn = H2ServerConnection(sock, address, self.limits, scheme, self.call_app, **self.options)
            self.connections.append(conn)
            self.serving.append(gevent.spawn(conn.serve))

    def close(self) -> None:
        self._acceptor.kill()
        self.listener.close()
        gevent.killall(self.serving)


@dataclass
class Stream:
    """What the client saw of one stream."""

    informational: list[list[Header]] = field(default_factory=list)
    headers: list[Header] | None = None
    head_ended_stream: bool = False  # the response head came with END_STREAM (no DATA, no trailers)
    data: bytearray = field(default_factory=bytearray)
    trailers: list[Header] | None = None
    ended: bool = False
    reset: int | None = None
    window_updates: int = 0  # WINDOW_UPDATE frames the server sent for this stream

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    @property
    def status(self) -> int:
        assert self.headers is not None, "no response head"
        return int(self.header(b":status") or b"0")

    def header(self, name: bytes) -> bytes | None:
        assert self.headers is not None, "no response head"
        return next((value for key, value in self.headers if key == name), None)

    def names(self) -> list[bytes]:
        assert self.headers is not None, "no response head"
        return [name for name, _ in self.headers]


class H2Client:
    """The h2 library's client over one real socket (see the module docstring)."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        handshake: bool = True,
        config: H2Configuration | None = None,
        stream_window: int | None = None,
        tls: gevent.ssl.SSLContext | None = None,
    ) -> None:
        self.sock = gsocket.create_connection(address)
        if tls is not None:
            self.sock = tls.wrap_socket(self.sock, server_hostname=address[0])
            assert self.sock.selected_alpn_protocol() == "h2"
        self.h2 = H2Connection(config or H2Configuration(client_side=True, header_encoding=None))
        self.streams: dict[int, Stream] = {}
        self.goaways: list[GoAwayFrame] = []
        self.eof = False
        self.settings_frames = 0  # SETTINGS frames received from the server
        self._held: dict[int, int] = {}  # stream -> flow-controlled bytes not acknowledged yet
        self._inbox = bytearray()  # the start of a frame not wholly received yet
        self._pings = 0
        self._pongs = 0
        self.h2.initiate_connection()
        if stream_window is not None:
            self.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: stream_window})
        self.h2.increment_flow_control_window(CLIENT_CONNECTION_WINDOW - 65535)
        self.flush()
        if handshake:
            # The server's SETTINGS frame came and was acknowledged (sent by ``flush``):
            # the server applies its limits before our first request arrives.
            self.until(lambda: self.settings_frames >= 1)

    # -- sending ---------------------------------------------------------------------------

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def request(
        self,
        path: bytes = b"/",
        method: bytes = b"GET",
        headers: Iterable[Header] = (),
        body: bytes | None = None,
        *,
        end_stream: bool | None = None,
        authority: bytes | None = b"test.example",
    ) -> int:
        """Open a stream; ``end_stream`` (default: when there is no body) ends it with its head."""
        stream_id = self.h2.get_next_available_stream_id()
        pseudo = [(b":method", method), (b":scheme", b"http"), (b":path", path)]
        if authority is not None:
            pseudo.append((b":authority", authority))
        ends = body is None if end_stream is None else end_stream
        self.streams[stream_id] = Stream()
        self.h2.send_headers(stream_id, [*pseudo, *headers], end_stream=ends)
        self.flush()
        if body is not None:
            self.send_body(stream_id, body, end=end_stream is None or end_stream)
        return stream_id

    def raw_request(self, fields: Sequence[Header], *, end_stream: bool = True) -> int:
        """Open a stream with exactly these fields (pseudo-headers included)."""
        stream_id = self.h2.get_next_available_stream_id()
        self.streams[stream_id] = Stream()
        self.h2.send_headers(stream_id, list(fields), end_stream=end_stream)
        self.flush()
        return stream_id

    def send_body(self, stream_id: int, data: bytes, *, end: bool = True) -> None:
        """All of ``data``, waiting for the server's windows as needed."""
        view = memoryview(data)
        while view:
            sent = self.send_what_fits(stream_id, bytes(view))
            view = view[sent:]
            if view:
                self.until(lambda: self._window(stream_id) > 0 or self.streams[stream_id].done)
                if self.streams[stream_id].done:
                    return
        if end:
            self.h2.end_stream(stream_id)
            self.flush()

    def send_what_fits(self, stream_id: int, data: bytes) -> int:
        """As much of ``data`` as the server's windows allow now (no waiting); how much."""
        sent = 0
        while sent < len(data):
            size = min(self._window(stream_id), self.h2.max_outbound_frame_size, len(data) - sent)
            if size <= 0:
                break
            self.h2.send_data(stream_id, data[sent : sent + size])
            sent += size
        self.flush()
        return sent

    def send_trailers(self, stream_id: int, trailers: Sequence[Header]) -> None:
        self.h2.send_headers(stream_id, list(trailers), end_stream=True)
        self.flush()

    def reset(self, stream_id: int, code: ErrorCodes = ErrorCodes.CANCEL) -> None:
        self.h2.reset_stream(stream_id, code)
        self.flush()

    def _window(self, stream_id: int) -> int:
        return self.h2.local_flow_control_window(stream_id)

    # -- not reading -----------------------------------------------------------------------

    def hold(self, stream_id: int) -> None:
        """Stop acknowledging this stream's DATA (a client that does not read it)."""
        self._held.setdefault(stream_id, 0)

    def release(self, stream_id: int) -> None:
        """Acknowledge what was held, and every DATA from now on."""
        held = self._held.pop(stream_id)
        if held:
            self.h2.acknowledge_received_data(held, stream_id)
            self.flush()

    # -- receiving -------------------------------------------------------------------------

    def pump(self) -> bool:
        """One recv, its events recorded (and acknowledged); False at EOF."""
        try:
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return False
        for event in self.h2.receive_data(self._without_goaways(data)):
            self._record(event)
        self.flush()
        return True

    def _without_goaways(self, data: bytes) -> bytes:
        """The whole frames received so far, GOAWAY frames taken out (and recorded)."""
        inbox = self._inbox
        inbox += data
        passed = bytearray()
        while len(inbox) >= _FRAME_HEADER:
            end = _FRAME_HEADER + int.from_bytes(inbox[:3], "big")
            if len(inbox) < end:
                break
            frame_bytes = bytes(inbox[:end])
            del inbox[:end]
            if frame_bytes[3] == _GOAWAY_TYPE:
                frame, _ = Frame.parse_frame_header(memoryview(frame_bytes[:_FRAME_HEADER]))
                frame.parse_body(memoryview(frame_bytes[_FRAME_HEADER:]))
                assert isinstance(frame, GoAwayFrame)
                self.goaways.append(frame)
            else:
                passed += frame_bytes
        return bytes(passed)

    def sync(self) -> None:
        """A PING round trip: the server has processed everything sent before it."""
        self._pings += 1
        expected = self._pings
        self.h2.ping(b"%08d" % expected)
        self.flush()
        self.until(lambda: self._pongs >= expected)

    def until(self, predicate: Callable[[], bool], bound: float = BOUND) -> None:
        """Read until ``predicate()``; fails at EOF or after ``bound`` seconds."""
        with gevent.Timeout(bound, AssertionError(f"still waiting after {bound}s")):
            while not predicate():
                if self.eof or not self.pump():
                    raise AssertionError("the server closed the connection first")

    def response(self, stream_id: int) -> Stream:
        """The stream once it ended (or was reset)."""
        self.until(lambda: self.streams[stream_id].done)
        return self.streams[stream_id]

    def until_closed(self, bound: float = BOUND) -> None:
        """Read (and record) until the server closes the connection."""
        with gevent.Timeout(bound, AssertionError(f"the connection was still open after {bound}s")):
            while self.pump():
                pass

    def _record(self, event: Event) -> None:
        if isinstance(event, PingAckReceived):
            self._pongs += 1
            return
        if isinstance(event, RemoteSettingsChanged):
            self.settings_frames += 1
            return
        stream_id = getattr(event, "stream_id", 0)
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if isinstance(event, ResponseReceived):
            stream.headers = list(event.headers)
            stream.head_ended_stream = event.stream_ended is not None
        elif isinstance(event, InformationalResponseReceived):
            stream.informational.append(list(event.headers))
        elif isinstance(event, DataReceived):
            stream.data += event.data
            if stream_id in self._held:
                self._held[stream_id] += event.flow_controlled_length
            else:
                self.h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
        elif isinstance(event, TrailersReceived):
            stream.trailers = list(event.headers)
        elif isinstance(event, StreamEnded):
            stream.ended = True
        elif isinstance(event, StreamReset):
            stream.reset = int(event.error_code)
        elif isinstance(event, WindowUpdated):
            stream.window_updates += 1

    def close(self) -> None:
        self.sock.close()
