"""The one HTTP/2 driver: one ``h2`` connection over one gevent socket, for either side.

The client side (``http2.H2ServerConnection``: a client of the proxy port) and the pod
side (``upstream_h2.H2PodConnection``: a ``protocol: h2c`` pod) are both an ``H2Wire``;
what differs between them (who reads, what an event means, what ends the connection) is
theirs, the rest is decided here once:

- **Frames in, in bounded batches.** What the socket brings goes through a
  ``FrameScanner`` first. It walks the 9-byte frame headers (it parses nothing else),
  refuses a frame longer than we accept at its header (``h2`` would buffer all of it
  first: an HTTP/1.x answer read as a frame header announces megabytes), counts what the
  client-side budgets count (``core.h2budgets``), takes out what the side handles itself
  (the pod side's GOAWAY frames), and cuts the bytes into batches of at most
  ``BATCH_FRAMES`` frames. Each batch is checked by the side (``_admit_batch``: its
  budgets) before ``h2`` sees it, then fed to ``h2``, its events dispatched through the
  side's handler table (``_handlers``, by event type), and after a full batch the reader
  yields to the hub: no connection's frames hold the process for long, and a freed
  slot's next waiter, or another connection, runs within one batch.
- **Frames out, in ``h2``'s order, by one writer.** ``h2`` keeps the frames its calls
  make in order; the one writer greenlet takes them (``data_to_send``) when it wakes and
  sends everything pending in one ``sendall`` under ``write_timeout``. Frames we
  serialize ourselves (``queue_frames``: our SETTINGS at the preface, a GOAWAY that lets
  streams finish) go after what ``h2`` has pending. A caller that must know its bytes
  reached the kernel takes a mark (``mark``) and waits (``wait_sent``).
- **``h2`` is only ever called without yielding**, from the reader, the writer or a
  stream's greenlet; the stream calls (``send_headers``, ``send_data``, ``end_stream``,
  ``reset``, ``acknowledge``) answer False instead of raising when the stream (or the
  connection) can no longer be sent on, and each side says what that means.
- **The end**: ``lose`` (the socket failed, or the side gave up): nothing more goes out,
  the reader's wait ends; the side is told once (``_lost``).
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import gevent
import h2.connection
import h2.events
import h2.exceptions
from gevent.event import Event
from h2.errors import ErrorCodes
from hyperframe.exceptions import HyperframeError
from hyperframe.frame import Frame, GoAwayFrame

from . import deadlines

#: One recv from the socket.
RECV_SIZE = 65536
#: Frames fed to ``h2`` between two yields to the hub.
BATCH_FRAMES = 128
#: The largest frame we accept (our SETTINGS_MAX_FRAME_SIZE is h2's default).
MAX_FRAME_SIZE = 16384
#: What a client sends first (RFC 9113 3.4).
CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

_FRAME_HEADER_SIZE = 9
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = (
    range(10)
)
_END_STREAM = 0x1
_ACK = 0x1
_END_HEADERS = 0x4

# What a batch counts, by index (``Batch.counts``).
COUNT_EMPTY, COUNT_PINGS, COUNT_SETTINGS, COUNT_WINDOW_UPDATES, COUNT_PRIORITIES, COUNT_CONTINUATIONS = range(6)


class FrameTooLarge(HyperframeError):
    """A frame longer than ``MAX_FRAME_SIZE`` (FRAME_SIZE_ERROR)."""


class Batch:
    """Frames for ``h2`` (``data``), what they count, and the GOAWAY frames taken out."""

    __slots__ = ("data", "counts", "goaways")

    def __init__(self) -> None:
        self.data = b""
        #: Frames without payload that do not end a stream, PINGs and SETTINGS that are
        #: not acks, WINDOW_UPDATEs, PRIORITYs, and the longest run of CONTINUATIONs.
        self.counts = [0, 0, 0, 0, 0, 0]
        self.goaways: list[GoAwayFrame] = []


class FrameScanner:
    """Walks the frame headers of what a peer sends (see the module docstring).

    ``preface``: bytes to pass on before the first frame (a client's preface);
    ``cut_goaway``: take GOAWAY frames out (parsed by hyperframe, which checks them).
    A frame header split across reads is held back until it is whole, so that a frame
    is never half counted and a GOAWAY never half passed on.
    """

    __slots__ = ("_preface", "_cut_goaway", "_held", "_left", "_goaway", "_continuations")

    def __init__(self, *, preface: int = 0, cut_goaway: bool = False) -> None:
        self._preface = preface
        self._cut_goaway = cut_goaway
        self._held = b""  # the start of a frame header that is not whole yet
        self._left = 0  # payload bytes of the current frame still to come
        self._goaway: bytearray | None = None  # the GOAWAY being collected, its header included
        self._continuations = 0  # CONTINUATION frames since the last HEADERS

    def feed(self, data: bytes) -> list[Batch]:  # noqa: C901 (one branch per frame type)
        """The batches of ``data``, in order. Raises ``FrameTooLarge``, or
        ``HyperframeError`` for a malformed GOAWAY. Does not yield."""
        if self._held:
            data = self._held + data
            self._held = b""
        end = len(data)
        position = 0
        if self._preface:
            position = min(self._preface, end)
            self._preface -= position
        batch = Batch()
        batches = [batch]
        passed: list[bytes] = []
        run_start = 0  # where the bytes of the batch not passed on yet begin
        frames = 0
        while position < end:
            left = self._left
            if left:
                step = min(left, end - position)
                if self._goaway is not None:
                    self._goaway += data[position : position + step]
                position += step
                self._left = left - step
                if self._goaway is not None and not self._left:
                    batch.goaways.append(_parse_goaway(self._goaway))
                    self._goaway = None
                    run_start = position
                continue
            if end - position < _FRAME_HEADER_SIZE:
                self._held = data[position:]
                break
            if frames == BATCH_FRAMES:  # this frame begins the next batch
                passed.append(data[run_start:position])
                batch.data = passed[0] if len(passed) == 1 else b"".join(passed)
                batch = Batch()
                batches.append(batch)
                passed = []
                run_start = position
                frames = 0
            length = int.from_bytes(data[position : position + 3], "big")
            if length > MAX_FRAME_SIZE:
                raise FrameTooLarge(f"a frame of {length} bytes (at most {MAX_FRAME_SIZE})")
            kind = data[position + 3]
            flags = data[position + 4]
            counts = batch.counts
            if kind <= _HEADERS or kind == _CONTINUATION:
                if not length and not flags & _END_STREAM:
                    counts[COUNT_EMPTY] += 1
                if kind == _HEADERS:
                    self._continuations = 0
                elif kind == _CONTINUATION:
                    self._continuations += 1
                    if self._continuations > counts[COUNT_CONTINUATIONS]:
                        counts[COUNT_CONTINUATIONS] = self._continuations
            elif kind == _PING:
                if not flags & _ACK:
                    counts[COUNT_PINGS] += 1
            elif kind == _SETTINGS:
                if not flags & _ACK:
                    counts[COUNT_SETTINGS] += 1
            elif kind == _WINDOW_UPDATE:
                counts[COUNT_WINDOW_UPDATES] += 1
            elif kind == _PRIORITY:
                counts[COUNT_PRIORITIES] += 1
            elif kind == _GOAWAY and self._cut_goaway:
                passed.append(data[run_start:position])
                self._goaway = bytearray(data[position : position + _FRAME_HEADER_SIZE])
                if not length:
                    batch.goaways.append(_parse_goaway(self._goaway))
                    self._goaway = None
                    run_start = position + _FRAME_HEADER_SIZE
            position += _FRAME_HEADER_SIZE
            self._left = length
            frames += 1
        if self._goaway is None:
            if run_start == 0 and position == end and not passed:
                batch.data = data  # the usual case: one batch, nothing taken out, no copy
                return batches
            passed.append(data[run_start:position])
        batch.data = b"".join(passed)
        return batches


def _parse_goaway(frame_bytes: bytearray) -> GoAwayFrame:
    view = memoryview(frame_bytes)
    frame, _ = Frame.parse_frame_header(view[:_FRAME_HEADER_SIZE])
    frame.parse_body(view[_FRAME_HEADER_SIZE:])
    assert isinstance(frame, GoAwayFrame)
    return frame


Handler = Callable[[Any], None]


class H2Wire:
    """One HTTP/2 connection's I/O (see the module docstring).

    The side gives the socket (``sock``: None until it connects, on the pod side), the
    ``h2`` connection, its scanner and its handler table, and implements ``_lost`` (and,
    for budgets or GOAWAYs, ``_admit_batch`` and ``_goaway_received``). It runs
    ``write_loop`` in a greenlet of its own and hands what it reads to ``receive``.
    """

    __slots__ = (
        "sock",
        "h2",
        "scanner",
        "write_timeout",
        "lost",
        "queued",
        "sent",
        "writer_deadline",
        "_handlers",
        "_outbox",
        "_writable",
        "_sent_marks",
        "_writing",
    )

    def __init__(
        self,
        sock: Any,
        h2conn: h2.connection.H2Connection,
        scanner: FrameScanner,
        handlers: dict[type[h2.events.Event], Handler],
        write_timeout: float,
    ) -> None:
        self.sock = sock
        self.h2 = h2conn
        self.scanner = scanner
        self.write_timeout = write_timeout
        #: The socket failed, or the side gave up: nothing more goes out.
        self.lost = False
        #: Bytes moved to the outbox, and of those, handed to the kernel.
        #: Invariant: ``sent <= queued``, and both only grow.
        self.queued = 0
        self.sent = 0
        #: The writer's own deadline: expiring shuts the socket down.
        self.writer_deadline = deadlines.Watched(sock)
        self._handlers = handlers
        self._outbox: list[bytes] = []
        self._writable = Event()
        self._sent_marks: deque[tuple[int, Callable[[], None]]] = deque()  # in mark order
        self._writing = True

    # -- frames in --------------------------------------------------------------------------

    def receive(self, data: bytes) -> bool:
        """Feed what the socket brought, batch by batch (yielding between full batches);
        False when the connection ends. Raises ``h2``'s ``ProtocolError`` and
        ``HyperframeError`` for the side to handle (``h2`` has queued its GOAWAY for the
        former)."""
        batches = self.scanner.feed(data)
        for index, batch in enumerate(batches):
            if index:
                gevent.sleep(0)  # a full batch went before: let the others run
            if self.lost or not self._admit_batch(batch):
                return False
            if batch.data:
                handlers = self._handlers
                for event in self.h2.receive_data(batch.data):
                    handler = handlers.get(type(event))
                    if handler is not None:
                        handler(event)
            for goaway in batch.goaways:
                self._goaway_received(goaway)
            self._batch_done()
        return not self.lost

    def _admit_batch(self, batch: Batch) -> bool:
        """Whether ``batch`` may go to ``h2`` (its budgets allow it). Does not yield."""
        return True

    def _goaway_received(self, goaway: GoAwayFrame) -> None:
        """A GOAWAY the scanner took out (after the frames before it in its batch)."""

    def _batch_done(self) -> None:
        """A batch's events were dispatched: wake the writer for what they made."""
        self.kick()

    # -- frames out ------------------------------------------------------------------------

    def kick(self) -> None:
        """Wake the writer: ``h2`` has frames to send. Does not yield."""
        if not self._writable.is_set():
            self._writable.set()

    def _take(self) -> None:
        """Move what ``h2`` has pending to the outbox."""
        data = self.h2.data_to_send()
        if data and not self.lost:
            self._outbox.append(data)
            self.queued += len(data)

    def queue_frames(self, data: bytes) -> None:
        """Frames we serialized ourselves, after every frame ``h2`` made before them."""
        if self.lost:
            return
        self._take()
        self._outbox.append(data)
        self.queued += len(data)
        self.kick()

    def mark(self) -> int:
        """The outbox position that covers every frame made so far. Does not yield."""
        self._take()
        self.kick()
        return self.queued

    def when_sent(self, mark: int, wake: Callable[[], None]) -> None:
        """Call ``wake()`` (it must not block) once ``sent`` reaches ``mark``, or the
        connection is lost."""
        if self.sent >= mark or self.lost:
            wake()
        else:
            self._sent_marks.append((mark, wake))

    def stop_writing(self) -> None:
        """The writer ends once the outbox is empty."""
        self._writing = False
        self.kick()

    def write_loop(self) -> None:
        """The writer greenlet: the outbox in order, each send under ``write_timeout``."""
        outbox = self._outbox
        marks = self._sent_marks
        deadline = self.writer_deadline
        while True:
            self._take()
            if not outbox:
                if self._outbox_drained() or not self._writing or self.lost:
                    return
                self._writable.clear()
                self._take()  # what came while the writer looked
                if not outbox:
                    self._writable.wait()
                continue
            data = outbox[0] if len(outbox) == 1 else b"".join(outbox)
            outbox.clear()
            deadline.sock = self.sock
            deadline.deadline = time.monotonic() + self.write_timeout
            try:
                self.sock.sendall(data)
            except (OSError, ValueError) as error:  # ValueError: a TLS layer already dropped
                self.lose(self._write_failure(error))
                return
            finally:
                deadline.deadline = 0.0
            self.sent += len(data)
            while marks and marks[0][0] <= self.sent:
                marks.popleft()[1]()

    def _outbox_drained(self) -> bool:
        """The writer sent everything; True if it should end now. Does not yield."""
        return False

    def _write_failure(self, error: BaseException) -> str:
        if self.writer_deadline.timed_out:
            return f"the peer did not take our frames within {self.write_timeout}s"
        return f"writing failed: {error!r}"

    # -- stream calls (none yields) ---------------------------------------------------------

    def window(self, stream_id: int) -> int:
        """How many body bytes one DATA frame may carry on ``stream_id`` now (0: none, or
        the stream cannot be sent on)."""
        if self.lost:
            return 0
        try:
            window = self.h2.local_flow_control_window(stream_id)
        except h2.exceptions.ProtocolError:
            return 0
        return min(window, self.h2.max_outbound_frame_size)

    def send_headers(self, stream_id: int, fields: list[tuple[bytes, bytes]], end_stream: bool) -> bool:
        return self._call(lambda: self.h2.send_headers(stream_id, fields, end_stream=end_stream))

    def send_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool = False) -> bool:
        return self._call(lambda: self.h2.send_data(stream_id, data, end_stream=end_stream))

    def end_stream(self, stream_id: int) -> bool:
        return self._call(lambda: self.h2.end_stream(stream_id))

    def reset(self, stream_id: int, code: ErrorCodes) -> bool:
        return self._call(lambda: self.h2.reset_stream(stream_id, code))

    def acknowledge(self, stream_id: int, size: int) -> None:
        """``size`` bytes of ``stream_id`` were consumed: the peer may send that much more."""
        if size:
            self._call(lambda: self.h2.acknowledge_received_data(size, stream_id))

    def refund_connection(self, size: int) -> None:
        """Give ``size`` bytes of credit back on the connection's window only."""
        if size:
            self._call(lambda: self.h2.increment_flow_control_window(size))

    def _call(self, call: Callable[[], None]) -> bool:
        """One ``h2`` call for a stream; False when it cannot be made (the connection is
        gone, or the stream closed under us)."""
        if self.lost:
            return False
        try:
            call()
        except h2.exceptions.ProtocolError:
            return False
        self.kick()
        return True

    # -- the end ----------------------------------------------------------------------------

    def lose(self, why: str) -> None:
        """The socket is done for: nothing more goes out, the reader stops, every mark
        waiter wakes, the side is told once. Does not yield."""
        if self.lost:
            return
        self.lost = True
        self._outbox.clear()
        self._writable.set()
        marks, self._sent_marks = self._sent_marks, deque()
        for _, wake in marks:
            wake()
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._lost(why)

    def _lost(self, why: str) -> None:
        """The side's part of ``lose``. Does not yield."""
        raise NotImplementedError
