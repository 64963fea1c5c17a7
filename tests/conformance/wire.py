"""The conformance tier's shared helpers: the activator under test, raw requests out,
raw answers in.

What it decides, and its rules:

- :func:`proxy_setup` is the setup every module uses: one recording pod, and one real
  activator (``tests/harness.py``'s ``Activator``, so ``ACTIVATOR_BIN`` is honoured) with
  one service ``a`` for the one host ``a.example`` and no catch-all. A module keeps both
  for all its tests: a test leaves nothing behind but what it sent.
- A request is the bytes a test writes by hand (:func:`http_request`, :func:`chunked`),
  so that a test says exactly what went on the wire. The default Host is ``a.example``,
  the one host of the service under test.
- :class:`Wire` is one client TCP connection (TCP_NODELAY, so that what a test sends at
  once leaves in one packet). It reads answers with a small strict reader: status line,
  header lines kept as raw ``(name, value)`` pairs in order, and a body framed the
  RFC 9112 6.3 way: none for HEAD, 1xx, 204 and 304, chunked (its trailers kept),
  Content-Length, else up to the connection's end. Pipelined answers are read one at a
  time; an interim (1xx) answer is an answer of its own. :class:`Uploader` sends a body
  from a thread while the test reads the answer, as a client uploading would.
- :meth:`Wire.closed_by_peer` is how a test sees that activator ended the connection:
  after every expected answer was read, ``recv`` returns b"" (or a reset) within a
  generous timeout; bytes instead mean the connection went on.
- :func:`wait_quiet` is how a test knows that everything activator will send a pod has
  reached the recording pod: the service's counts back to zero, the pod's kernel buffers
  read. Timeouts here only bound waits for something that must happen; nothing asserts a
  duration.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

from harness import DEFAULT_TIMEOUT, Activator, make_config, wait_until
from recording_pod import Mark, RecordingPod

HOST = b"a.example"
SERVICE = "a"
#: How long a connection may take to be closed after activator's last answer.
CLOSE_TIMEOUT = 10.0


def http_request(line: bytes, *header_lines: bytes, body: bytes = b"", host: bytes | None = HOST) -> bytes:
    """``line``, a ``Host`` line (unless ``host`` is None), ``header_lines``, CRLF endings, ``body``."""
    lines = [line, *([b"Host: " + host] if host is not None else []), *header_lines]
    return b"".join(line + b"\r\n" for line in lines) + b"\r\n" + body


#: The follow-up that must never reach a pod after a body framing error.
SMUGGLED = http_request(b"GET /SMUGGLED HTTP/1.1")


def chunked(body: bytes, piece: int) -> bytes:
    """``body`` in chunks of ``piece`` bytes (lower-case hex sizes), then the last chunk."""
    chunks = [body[i : i + piece] for i in range(0, len(body), piece)]
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


class AnswerMissing(AssertionError):
    """An answer the test waited for did not come (the connection ended, or the wait ran out)."""


@dataclass(frozen=True)
class RawResponse:
    """One response as it arrived: the status line, the header lines, the body, the trailers."""

    version: bytes
    status: int
    reason_phrase: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # in order, names as sent, repeats separate
    body: bytes = b""
    trailers: tuple[tuple[bytes, bytes], ...] = ()
    head: bytes = b""  # the raw head, status line to the empty line

    def values(self, name: bytes) -> list[bytes]:
        """Every value of the header ``name`` (any case), in order."""
        return [value for header, value in self.headers if header.lower() == name.lower()]

    def header(self, name: bytes) -> bytes | None:
        """The one value of ``name``; None when absent (two lines fail the test)."""
        values = self.values(name)
        assert len(values) <= 1, f"{name!r} sent {len(values)} times: {self.head!r}"
        return values[0] if values else None

    @property
    def activator_reason(self) -> str | None:
        """``X-Activator-Reason``: set on activator's own answers, absent on a pod's."""
        value = self.header(b"x-activator-reason")
        return None if value is None else value.decode("latin-1")

    @property
    def says_close(self) -> bool:
        """Whether a ``Connection`` header carries the ``close`` option."""
        tokens = (t.strip().lower() for value in self.values(b"connection") for t in value.split(b","))
        return b"close" in tokens

    def describe(self) -> str:
        return f"{self.head!r} + body {self.body[:200]!r}"


def _header_lines(block: bytes) -> tuple[tuple[bytes, bytes], ...]:
    """``Name: value`` lines separated by CRLF (a header section or trailers)."""
    pairs = []
    for line in block.split(b"\r\n") if block else []:
        name, colon, value = line.partition(b":")
        assert colon and name and name == name.strip(), f"malformed header line {line!r}"
        pairs.append((name, value.strip(b" \t")))
    return tuple(pairs)


class Wire:
    """One client connection to activator (see the module's rules)."""

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        self._buffer = bytearray()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def shutdown_write(self) -> None:
        """Send FIN: the client has nothing more to say."""
        self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # reading

    def _receive(self, what: str) -> bool:
        """Add what arrives to the buffer; False when the peer ended the connection."""
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            raise AnswerMissing(f"no {what} within {self.timeout}s; got so far {bytes(self._buffer)[:300]!r}") from None
        except ConnectionResetError:
            return False
        self._buffer += data
        return bool(data)

    def _fill(self, what: str) -> None:
        if not self._receive(what):
            raise AnswerMissing(f"connection ended before the {what}; got {bytes(self._buffer)[:300]!r}")

    def _take_until(self, delimiter: bytes, what: str) -> bytes:
        while (end := self._buffer.find(delimiter)) < 0:
            self._fill(what)
        data = bytes(self._buffer[:end])
        del self._buffer[: end + len(delimiter)]
        return data

    def _take(self, size: int, what: str) -> bytes:
        while len(self._buffer) < size:
            self._fill(what)
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def read_to_end(self) -> bytes:
        """Everything that arrives until the peer ends the connection (which it must do
        within the timeout)."""
        while self._receive("end of the connection"):
            pass
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    def read_response(self, head_request: bool = False) -> RawResponse:
        """The next answer on the connection (``head_request``: it answers a HEAD)."""
        head = self._take_until(b"\r\n\r\n", "response head")
        status_line, _, header_block = head.partition(b"\r\n")
        version, _, rest = status_line.partition(b" ")
        code, _, phrase = rest.partition(b" ")
        assert version in (b"HTTP/1.1", b"HTTP/1.0") and len(code) == 3 and code.isdigit(), (
            f"not a status line: {status_line!r}"
        )
        response = RawResponse(version, int(code), phrase, _header_lines(header_block), head=head + b"\r\n\r\n")
        if head_request or 100 <= response.status < 200 or response.status in (204, 304):
            return response
        if (coding := response.header(b"transfer-encoding")) is not None:
            assert coding.lower() == b"chunked", response.describe()
            body, trailers = self._chunked_body()
            return replace(response, body=body, trailers=trailers)
        if (length := response.header(b"content-length")) is not None:
            return replace(response, body=self._take(int(length), "response body"))
        return replace(response, body=self.read_to_end())

    def _chunked_body(self) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
        body = bytearray()
        while True:
            size_line = self._take_until(b"\r\n", "chunk size")
            size = int(size_line.partition(b";")[0], 16)
            if size == 0:
                break
            body += self._take(size, "chunk data")
            assert self._take(2, "chunk end") == b"\r\n", "chunk data not followed by CRLF"
        trailer_lines = []
        while line := self._take_until(b"\r\n", "trailer section"):
            trailer_lines.append(line)
        return bytes(body), _header_lines(b"\r\n".join(trailer_lines))

    def read_final_response(self, head_request: bool = False) -> tuple[list[RawResponse], RawResponse]:
        """The interim (1xx) answers, then the final one."""
        interim = []
        while (response := self.read_response(head_request)).status < 200:
            interim.append(response)
        return interim, response

    def closed_by_peer(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Whether the peer ends the connection (nothing more arrives but its end)."""
        if self._buffer:
            return False
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        finally:
            self.sock.settimeout(self.timeout)
        self._buffer += data
        return not data

    def read_until(self, marker: bytes) -> bytes:
        """The bytes up to and including ``marker`` (to read an answer only part-way)."""
        return self._take_until(marker, f"bytes {marker[:20]!r}") + marker

    def unread(self) -> bytes:
        """What arrived and was not read as an answer (for failure messages)."""
        return bytes(self._buffer)


class Uploader:
    """Sends ``pieces`` on a connection from a thread, until done or the peer stops
    taking them: a client streaming a body while it waits for the answer."""

    def __init__(self, connection: Wire, pieces: Iterable[bytes]) -> None:
        self._thread = threading.Thread(target=self._run, args=(connection, pieces), daemon=True)
        self._thread.start()

    @staticmethod
    def _run(connection: Wire, pieces: Iterable[bytes]) -> None:
        with contextlib.suppress(OSError):  # activator answered and closed: the rest is not wanted
            for piece in pieces:
                connection.send(piece)

    def join(self) -> None:
        self._thread.join(DEFAULT_TIMEOUT)


@contextlib.contextmanager
def wire(act: Activator, timeout: float = DEFAULT_TIMEOUT) -> Iterator[Wire]:
    """A fresh client connection to activator's proxy port, closed at the end."""
    with Wire(act.listen, timeout) as connection:
        yield connection


def wait_quiet(act: Activator, pod: RecordingPod, service: str = SERVICE) -> None:
    """Wait until activator holds nothing for ``service`` and the pod has recorded every
    byte it received: what a row sent can reach the pod no more after this."""
    act.wait_idle(service, message=f"service {service} idle")
    wait_until(pod.settled, message="the pod read everything it was sent")


def quiet_mark(act: Activator, pod: RecordingPod, service: str = SERVICE) -> Mark:
    """A mark of the pod's records once the exchanges before it are over (a test that
    failed half-way may have left some in flight): what comes after it is the caller's."""
    wait_quiet(act, pod, service)
    return pod.mark()


# --------------------------------------------------------------------------------------
# the activator under test


@dataclass(frozen=True)
class Proxy:
    """The activator under test and the pod behind it."""

    act: Activator
    pod: RecordingPod


def proxy_config(
    pod: RecordingPod, *, limits: dict[str, Any] | None = None, access_log: bool = False, **service: Any
) -> dict[str, Any]:
    """One service, ``a``, for the one host ``a.example`` over ``pod``, and no catch-all
    (any other Host is 404 ``unknown-host``); ``service`` overrides its keys."""
    top = {"access_log": access_log, "limits": limits or {}}
    return make_config([pod], service=SERVICE, top=top, hosts=[HOST.decode()], **service)


@contextlib.contextmanager
def proxy_setup(workdir: Path, **config: Any) -> Iterator[Proxy]:
    """A recording pod and an activator (``proxy_config(pod, **config)``), ready; both
    stopped at the end."""
    with RecordingPod() as pod, Activator(proxy_config(pod, **config), workdir=workdir) as act:
        yield Proxy(act, pod)
