"""A raw-bytes recording pod: the oracle of what reached a pod through activator.

What it decides, and its rules:

- It is a real TCP server on 127.0.0.1 (a port the kernel picks), run by threads of the
  test process: one thread accepts, one thread per connection, plain blocking sockets
  (the test session is not gevent-patched). Accepted sockets keep Nagle's algorithm on
  (no TCP_NODELAY), as Python's ``http.server`` does.
- Per connection it keeps every byte received, in order, and the requests h11 parses out
  of them. Each request gets a fresh ``h11.Connection(h11.SERVER)``, fed what the one
  before left over, so that the pod's raw answers never have to go through h11's state
  machine. Only a request whose end h11 saw is recorded as a request; one begun and not
  finished is the connection's ``unfinished`` request (``incomplete`` once the connection
  ended: it was cut off); bytes h11 refuses end the connection and are kept as its
  protocol error.
- It answers each complete request with ``200`` and the body ``served <target>``
  (``Content-Length``, one write; no body for HEAD), unless a :class:`Script` is set for
  the request's target: its pieces are written with one ``sendall`` each (a float is a
  pause), either as soon as the head arrived (``at_head``: before reading the body) or
  once the request is complete. ``close`` then ends the connection the way servers do
  after an early answer: shut the write side, keep reading (and recording) until the
  peer closes.
- ``peak`` is the most requests it was handling at once (head received, answer not yet
  written).
- Reading a socket and recording what it brought happen under one lock, so that
  :meth:`RecordingPod.settled` (no received byte left unread in any connection's kernel
  buffer) means every byte that reached the pod is in the records.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Self

import h11

LOCALHOST = "127.0.0.1"

Framing = Literal["content-length", "chunked", "none"]
#: What a script writes: bytes are sent with one ``sendall`` each, a float is a pause in seconds.
Step = bytes | float

# Activator may forward header sections up to its own limit (64 KiB by default); h11's
# default of 16 KiB would make the oracle refuse what it should record.
MAX_HEAD_BYTES = 1024 * 1024


@dataclass(frozen=True)
class RecordedRequest:
    """One complete request as the pod received it."""

    connection: int  # index of the pod connection it came on, in accept order
    method: bytes
    target: bytes
    http_version: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # as received: names' case kept, in order, repeats separate
    body: bytes
    framing: Framing

    def values(self, name: bytes) -> list[bytes]:
        """Every value of the header ``name`` (any case), in order."""
        return [value for header, value in self.headers if header.lower() == name.lower()]


@dataclass(frozen=True)
class Script:
    """A raw answer for one target: ``pieces`` (or a callable making them, for a long
    stream that stops when the connection breaks), written with one ``sendall`` each."""

    pieces: Sequence[Step] | Callable[[], Iterable[Step]]
    at_head: bool = False  # answer when the head arrived, before reading the body
    close: bool = False  # then shut the write side and read until the peer closes

    def steps(self) -> Iterable[Step]:
        return self.pieces() if callable(self.pieces) else self.pieces


@dataclass(frozen=True)
class ConnectionRecord:
    """A snapshot of one pod connection."""

    index: int
    raw: bytes
    requests: tuple[RecordedRequest, ...]
    unfinished: bool  # a request has begun on it and not finished
    protocol_error: str | None
    ended: bool

    @property
    def incomplete(self) -> bool:
        """The connection ended in the middle of a request (which is no request)."""
        return self.ended and self.unfinished


@dataclass(frozen=True)
class Mark:
    """Where the records stood at one moment, to see what came after it."""

    requests: int
    raw_lengths: tuple[int, ...]
    unfinished: frozenset[int]


@dataclass(frozen=True)
class Since:
    """What reached the pod after a :class:`Mark`."""

    requests: tuple[RecordedRequest, ...]
    raw: bytes  # the new bytes of every connection, connection after connection
    unfinished: tuple[int, ...]  # connections with a request begun and not finished (and not so at the mark)


@dataclass
class _Connection:
    index: int
    sock: socket.socket
    raw: bytearray = field(default_factory=bytearray)
    requests: list[RecordedRequest] = field(default_factory=list)
    unfinished: bool = False
    protocol_error: str | None = None
    ended: bool = False

    def snapshot(self) -> ConnectionRecord:
        return ConnectionRecord(
            self.index, bytes(self.raw), tuple(self.requests), self.unfinished, self.protocol_error, self.ended
        )


def default_answer(method: bytes, target: bytes) -> bytes:
    """The pod's answer when no script is set: ``200``, ``served <target>``, one write."""
    body = b"served " + target
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body)
    return head if method == b"HEAD" else head + body


def _framing(headers: Sequence[tuple[bytes, bytes]]) -> Framing:
    names = {name.lower() for name, _ in headers}
    if b"transfer-encoding" in names:
        return "chunked"  # h11 accepts no other transfer coding
    return "content-length" if b"content-length" in names else "none"


def _unread_bytes(sock: socket.socket) -> int:
    """Bytes received by the kernel on ``sock`` and not read yet (FIONREAD)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 0  # closed: nothing more will be recorded


class _Parser:
    """h11 over one connection's bytes, one fresh ``h11.Connection`` per request."""

    def __init__(self, connection: int) -> None:
        self._connection = connection
        self._start_request(b"")

    def _start_request(self, data: bytes) -> None:
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        if data:  # (b"" would tell h11 the connection ended)
            self._h11.receive_data(data)
        self.head: h11.Request | None = None
        self._body = bytearray()

    def feed(self, data: bytes) -> Iterator[h11.Request | RecordedRequest]:
        """The heads and the complete requests in ``data``, in order; raises
        ``h11.RemoteProtocolError``."""
        self._h11.receive_data(data)
        while True:
            event = self._h11.next_event()
            if isinstance(event, h11.Request):
                self.head = event
                yield event
            elif isinstance(event, h11.Data):
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert self.head is not None
                headers = tuple((bytes(name), bytes(value)) for name, value in self.head.headers.raw_items())
                yield RecordedRequest(
                    self._connection,
                    bytes(self.head.method),
                    bytes(self.head.target),
                    bytes(self.head.http_version),
                    headers,
                    bytes(self._body),
                    _framing(headers),
                )
                self._start_request(self._h11.trailing_data[0])
            else:  # NEED_DATA: the rest has not arrived yet
                return

    def unfinished(self) -> bool:
        """Whether a request has begun and not finished (at the connection's end: it was
        cut off; a request's end is never the connection's end)."""
        return self.head is not None or bool(self._h11.trailing_data[0])


class RecordingPod:
    """The pod. ``address`` goes in activator's config; :meth:`close` (or ``with``) stops it."""

    def __init__(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOCALHOST, 0))
        self._listener.listen(128)
        self.address = f"{LOCALHOST}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._connections: list[_Connection] = []
        self._requests: list[RecordedRequest] = []
        self._scripts: dict[bytes, Script] = {}
        self._handling = 0
        self._peak = 0
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._start(self._accept_loop, "pod-accept")

    # control

    def set_script(self, target: bytes, script: Script) -> None:
        """Answer requests for ``target`` with ``script`` from now on."""
        with self._lock:
            self._scripts[target] = script

    # records

    @property
    def peak(self) -> int:
        with self._lock:
            return self._peak

    def requests(self) -> list[RecordedRequest]:
        """Every complete request, in the order they were completed (all connections)."""
        with self._lock:
            return list(self._requests)

    def connections(self) -> list[ConnectionRecord]:
        with self._lock:
            return [conn.snapshot() for conn in self._connections]

    def mark(self) -> Mark:
        with self._lock:
            return Mark(
                len(self._requests),
                tuple(len(conn.raw) for conn in self._connections),
                frozenset(conn.index for conn in self._connections if conn.unfinished),
            )

    def since(self, mark: Mark) -> Since:
        with self._lock:
            lengths = mark.raw_lengths + (0,) * (len(self._connections) - len(mark.raw_lengths))
            raw = b"".join(bytes(conn.raw[start:]) for conn, start in zip(self._connections, lengths, strict=True))
            unfinished = tuple(c.index for c in self._connections if c.unfinished and c.index not in mark.unfinished)
            return Since(tuple(self._requests[mark.requests :]), raw, unfinished)

    def settled(self) -> bool:
        """No byte that reached the pod is still waiting to be read (and so recorded)."""
        with self._lock:
            return all(conn.ended or _unread_bytes(conn.sock) == 0 for conn in self._connections)

    # lifecycle

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        with self._lock:
            socks = [conn.sock for conn in self._connections]
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv()
        for thread in self._threads:
            thread.join(5.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the threads

    def _start(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                conn = _Connection(len(self._connections), sock)
                self._connections.append(conn)
            self._start(self._serve, f"pod-conn-{conn.index}", conn)

    def _serve(self, conn: _Connection) -> None:
        parser = _Parser(conn.index)
        unanswered = 0  # requests of this connection counted in _handling, not answered yet
        answered_at_head = False  # the request being read already got its scripted answer
        draining = False  # after a closing script: record what comes, parse nothing
        try:
            while True:
                # Wait without consuming, then read and record in one step under the lock
                # (see settled()).
                conn.sock.recv(1, socket.MSG_PEEK)
                answers: list[tuple[bytes, bytes, Script | None]] = []
                with self._lock:
                    data = conn.sock.recv(65536)
                    conn.raw += data
                    if not data:
                        return
                    if draining:
                        continue
                    try:
                        for event in parser.feed(data):
                            if isinstance(event, h11.Request):
                                unanswered += 1
                                self._handling += 1
                                self._peak = max(self._peak, self._handling)
                                script = self._scripts.get(bytes(event.target))
                                if script is not None and script.at_head:
                                    answers.append((bytes(event.method), bytes(event.target), script))
                                    answered_at_head = True
                                continue
                            conn.requests.append(event)
                            self._requests.append(event)
                            if answered_at_head:
                                answered_at_head = False
                            else:
                                answers.append((event.method, event.target, self._scripts.get(event.target)))
                    except h11.RemoteProtocolError as exc:
                        conn.protocol_error = str(exc)
                        return
                    conn.unfinished = parser.unfinished()
                for method, target, script in answers:
                    self._write(conn, [default_answer(method, target)] if script is None else script.steps())
                    unanswered -= 1
                    with self._lock:
                        self._handling -= 1
                    if script is not None and script.close:
                        conn.sock.shutdown(socket.SHUT_WR)
                        draining = True
                        break
        except OSError:
            pass  # the peer reset the connection, or close() shut it
        finally:
            with self._lock:
                conn.ended = True
                self._handling -= unanswered
            conn.sock.close()

    @staticmethod
    def _write(conn: _Connection, steps: Iterable[Step]) -> None:
        for step in steps:
            if isinstance(step, float):
                time.sleep(step)
            else:
                conn.sock.sendall(step)
