"""An in-process HTTP/2 pod for tests/test_upstream_h2.py: h2 (server side) on gevent sockets.

``H2Pod(handler)`` listens on 127.0.0.1 and speaks h2c with prior knowledge. For each
request stream, once its HEADERS came, ``handler(request)`` runs in a greenlet of its own
and answers through its ``PodRequest``: ``respond``, ``send`` (within the client's
flow-control windows, waiting for them like a real server), ``send_trailers``, ``reset``;
or acts on the whole connection (``request.connection.goaway``, ``.close``). What each
connection received is recorded as it really arrived: every request's headers (pseudo
ones included), body and trailers, and every stream the client reset.

``hold_window=True``: request DATA is acknowledged to the client only when the handler
takes it (``take_body``), so a test controls how much of an upload the client may send.
``max_concurrent_streams``, ``initial_window_size``: the SETTINGS the pod announces.
``send_settings=False``: the pod never sends its SETTINGS (a handshake that never ends).
``goaway_at_once=True``: a GOAWAY (last stream 0) right after the SETTINGS: no stream is taken.
What the pod sends is not validated by h2: a handler may send what a broken pod would.

The session is not monkey-patched: gevent sockets and primitives are used directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import gevent
import gevent.event
import gevent.lock
import h2.config
import h2.connection
import h2.events
from gevent import socket as gsocket
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame

Header = tuple[bytes, bytes]
#: Seconds a pod waits for something a test should make happen at once (a client window).
BOUND = 5.0
#: What the pod sends is not checked by h2, so that a test can send what a broken pod would.
_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None, validate_outbound_headers=False, normalize_outbound_headers=False
)


class PodRequest:
    """One request stream as the pod received it, and the pod's answer to it."""

    def __init__(self, connection: PodConnection, stream_id: int, headers: list[Header]) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.headers = headers
        self.body = bytearray()
        self.trailers: list[Header] = []
        self.ended = gevent.event.Event()  # the client's END_STREAM came
        self.reset_code: int | None = None  # the client reset the stream with this code
        #: Set when ``send`` had to wait for the client's window (it sent all it could).
        self.blocked = gevent.event.Event()
        self.sent_all = gevent.event.Event()  # ``send(..., end=True)`` returned
        self._changed = gevent.event.Event()  # pulsed on each DATA, END_STREAM or reset
        self._unacknowledged = 0

    def __repr__(self) -> str:
        return f"<PodRequest #{self.stream_id} {self.method!r} {self.path!r}>"

    def header(self, name: bytes) -> bytes | None:
        """The value of the one ``name`` field (pseudo-headers too), None if absent."""
        values = [value for key, value in self.headers if key == name]
        assert len(values) <= 1, f"{name!r} sent {len(values)} times"
        return values[0] if values else None

    @property
    def method(self) -> bytes | None:
        return self.header(b":method")

    @property
    def path(self) -> bytes | None:
        return self.header(b":path")

    # -- reading -------------------------------------------------------------------------

    def wait_until(self, done: Callable[[], bool], timeout: float = BOUND) -> bool:
        """Wait until ``done()`` (re-checked on each DATA, END_STREAM or reset); its last value."""
        with gevent.Timeout(timeout, False):
            while not done():
                self._changed.clear()
                if done():
                    break
                self._changed.wait()
        return done()

    def read_all(self) -> bytes:
        """The whole body, taken as it arrives, once the client ended it."""
        data = bytearray()
        while True:
            finished = self.ended.is_set() or self.reset_code is not None
            data += self.take_body()
            if finished:
                return bytes(data)
            assert self.wait_until(lambda: bool(self.body) or self.ended.is_set() or self.reset_code is not None), (
                "the body never ended"
            )

    def take_body(self) -> bytes:
        """What arrived so far, taken: its window goes back to the client."""
        data = bytes(self.body)
        self.body.clear()
        self.connection.acknowledge(self.stream_id, self._unacknowledged)
        self._unacknowledged = 0
        return data

    # -- answering -------------------------------------------------------------------------

    def respond(self, status: int, headers: Iterable[Header] = (), end: bool = False) -> None:
        self.connection.send_headers(self.stream_id, [(b":status", b"%d" % status), *headers], end)

    def send(self, data: bytes, end: bool = False) -> None:
        """Send ``data`` as DATA within the client's windows, waiting for them (it stops
        when the client resets the stream)."""
        connection = self.connection
        view = memoryview(data)
        while view:
            if self.reset_code is not None:
                return
            window = connection.window(self.stream_id)
            if not window:
                self.blocked.set()
                assert connection.wait_for_window(), f"the client opened no window on #{self.stream_id}"
                continue
            connection.send_data(self.stream_id, bytes(view[:window]), end and window >= len(view))
            view = view[window:]
        if end and not data:
            connection.send_data(self.stream_id, b"", True)
        if end:
            self.sent_all.set()

    def send_trailers(self, headers: list[Header]) -> None:
        self.connection.send_headers(self.stream_id, headers, True)

    def reset(self, code: ErrorCodes = ErrorCodes.INTERNAL_ERROR) -> None:
        self.connection.reset(self.stream_id, code)

    # -- what the connection's reader dispatches ---------------------------------------------

    def on_data(self, data: bytes, flow_controlled: int, hold_window: bool) -> None:
        self.body += data
        if hold_window:
            self._unacknowledged += flow_controlled
        else:
            self.connection.acknowledge(self.stream_id, flow_controlled)
        self._changed.set()

    def on_end(self) -> None:
        self.ended.set()
        self._changed.set()

    def on_reset(self, code: int) -> None:
        self.reset_code = code
        self._changed.set()


class PodConnection:
    """One accepted connection: h2 on the server side, its reader, and its requests."""

    def __init__(self, pod: H2Pod, sock: gsocket.socket) -> None:
        self.pod = pod
        self.sock = sock
        self.h2 = h2.connection.H2Connection(_CONFIG)
        self.requests: dict[int, PodRequest] = {}
        self.resets: list[tuple[int, int]] = []  # (stream id, code) of every RST_STREAM the client sent
        self.goaway_received = False
        self.closed = gevent.event.Event()
        self._send_lock = gevent.lock.RLock()  # whoever holds it sends all that h2 has, in order
        self._window_changed = gevent.event.Event()

    # -- h2 calls (each followed by a send of what h2 produced) -------------------------------

    def _flush(self) -> None:
        with self._send_lock:
            data = self.h2.data_to_send()
            if data:
                try:
                    self.sock.sendall(data)
                except OSError:
                    pass  # the client went away: the reader sees it

    def send_headers(self, stream_id: int, headers: list[Header], end: bool) -> None:
        self.h2.send_headers(stream_id, headers, end_stream=end)
        self._flush()

    def send_data(self, stream_id: int, data: bytes, end: bool) -> None:
        self.h2.send_data(stream_id, data, end_stream=end)
        self._flush()

    def reset(self, stream_id: int, code: ErrorCodes) -> None:
        self.h2.reset_stream(stream_id, code)
        self._flush()

    def acknowledge(self, stream_id: int, flow_controlled: int) -> None:
        if flow_controlled:
            self.h2.acknowledge_received_data(flow_controlled, stream_id)
            self._flush()

    def window(self, stream_id: int) -> int:
        return min(self.h2.local_flow_control_window(stream_id), self.h2.max_outbound_frame_size)

    def wait_for_window(self) -> bool:
        """Wait for the next WINDOW_UPDATE (or settings change); False after ``BOUND``."""
        self._window_changed.clear()
        return bool(self._window_changed.wait(BOUND))

    def goaway(self, last_stream_id: int, code: ErrorCodes = ErrorCodes.NO_ERROR) -> None:
        """Send a GOAWAY and go on serving (h2's own ``close_connection`` would forbid
        finishing the streams up to ``last_stream_id``: this one frame is ours)."""
        with self._send_lock:
            self.sock.sendall(GoAwayFrame(0, last_stream_id=last_stream_id, error_code=code).serialize())

    def close(self) -> None:
        """Close the socket at once (in-flight streams are cut)."""
        self.sock.close()
        self.closed.set()

    # -- the reader --------------------------------------------------------------------------

    def serve(self) -> None:
        pod = self.pod
        self.h2.initiate_connection()
        settings: dict[SettingCodes | int, int] = {}
        if pod.max_concurrent_streams is not None:
            settings[SettingCodes.MAX_CONCURRENT_STREAMS] = pod.max_concurrent_streams
        if pod.initial_window_size is not None:
            settings[SettingCodes.INITIAL_WINDOW_SIZE] = pod.initial_window_size
        if settings:
            self.h2.update_settings(settings)
        if pod.send_settings:
            self._flush()
        else:
            self.h2.clear_outbound_data_buffer()
        if pod.goaway_at_once:
            self.goaway(last_stream_id=0)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return
                for event in self.h2.receive_data(data):
                    self._dispatch(event)
                self._flush()
        finally:
            self.closed.set()

    def _dispatch(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            request = PodRequest(self, event.stream_id, list(event.headers))
            self.requests[event.stream_id] = request
            self.pod.requests.append(request)
            self.pod.spawn(self.pod.handler, request)
        elif isinstance(event, h2.events.DataReceived):
            self.requests[event.stream_id].on_data(event.data, event.flow_controlled_length, self.pod.hold_window)
        elif isinstance(event, h2.events.TrailersReceived):
            self.requests[event.stream_id].trailers = list(event.headers)
        elif isinstance(event, h2.events.StreamEnded):
            self.requests[event.stream_id].on_end()
        elif isinstance(event, h2.events.StreamReset):
            self.resets.append((event.stream_id, event.error_code))
            reset = self.requests.get(event.stream_id)
            if reset is not None:
                reset.on_reset(event.error_code)
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self._window_changed.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway_received = True


class H2Pod:
    """The pod: an accept loop on 127.0.0.1, a ``PodConnection`` per connection (see the
    module docstring). ``requests`` holds every request stream, in arrival order."""

    def __init__(
        self,
        handler: Callable[[PodRequest], None],
        *,
        max_concurrent_streams: int | None = None,
        initial_window_size: int | None = None,
        hold_window: bool = False,
        send_settings: bool = True,
        goaway_at_once: bool = False,
    ) -> None:
        self.handler = handler
        self.max_concurrent_streams = max_concurrent_streams
        self.initial_window_size = initial_window_size
        self.hold_window = hold_window
        self.send_settings = send_settings
        self.goaway_at_once = goaway_at_once
        self.connections: list[PodConnection] = []
        self.requests: list[PodRequest] = []
        self.sock = gsocket.socket(gsocket.AF_INET, gsocket.SOCK_STREAM)
        self.sock.setsockopt(gsocket.SOL_SOCKET, gsocket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port: int = self.sock.getsockname()[1]
        self._greenlets: list[gevent.Greenlet] = [gevent.spawn(self._accept_loop)]

    def spawn(self, function: Callable[..., None], *args: object) -> None:
        self._greenlets.append(gevent.spawn(function, *args))

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return
            sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)
            connection = PodConnection(self, sock)
            self.connections.append(connection)
            self.spawn(self._serve, connection)

    @staticmethod
    def _serve(connection: PodConnection) -> None:
        try:
            connection.serve()
        except OSError:
            pass  # closed by the test, or reset by the client
        finally:
            connection.sock.close()

    def close(self) -> None:
        self.sock.close()
        for connection in self.connections:
            connection.sock.close()
        gevent.killall(self._greenlets, timeout=1)
