"""End to end: one hostile HTTP/2 connection does not starve the service (SPEC "Protocols",
HTTP/2 hardening).

A real activator in front of one ``container_concurrency: 1`` pod (``tests/backend.py``,
which records its own peak concurrency) whose requests take 200 ms. An attacker, a thread
writing raw frames (hyperframe, HPACK by ``hpack``) on connections of its own, runs one of
the known abuses of HTTP/2 and keeps at it, reconnecting whenever it is closed, until the
test tells it to stop; meanwhile a legitimate client (``curl --http2-prior-knowledge``, a
fresh connection per request) sends its requests one after the other. What is proved,
for each abuse:

- every legitimate request is answered 200 by the pod while the attack still runs (the
  attacker only stops once they all were): a hostile connection neither holds the
  process nor the queue;
- the attacker's connections end with GOAWAY ``ENHANCE_YOUR_CALM`` (or, for a client
  that reads nothing, are closed), the process says once per connection which budget it
  went past, naming the client, and ``/status`` counts it by budget (as ``/metrics`` and
  StatsD do);
- no pod ever ran more than its ``container_concurrency``, and every count is back to
  zero afterwards.

The abuses: rapid reset (CVE-2023-44487: HEADERS then RST_STREAM at once, thousands a
second), a PING flood whose acks are never read, a SETTINGS flood, empty DATA frames,
a WINDOW_UPDATE flood; and a client that opens streams and keeps them queued, which may
hold only ``limits.http2.max_queue_share`` of the queue (its extra streams get 503
``queue-full`` while the legitimate requests queue and are served). No test asserts on
elapsed time: a starved request shows as the whole test timing out.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
from harness import SERVICE, Activator, ActivatorFactory, Pod, PodFactory, curl, make_config, wait_until
from hpack import Encoder
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

pytestmark = pytest.mark.binary

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
ENHANCE_YOUR_CALM = 0xB
LEGITIMATE_REQUESTS = 5
#: Frames the attacker writes per send.
BURST = 200


class Attacker:
    """One abuse, run on connection after connection until ``stop()``; what each
    connection's end was (the GOAWAY codes it received, or None when it saw none)."""

    def __init__(self, address: tuple[str, int], send: Callable[[socket.socket, Encoder, list[int]], None]) -> None:
        self.address = address
        self.send = send
        self.ends: list[int | None] = []
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Attacker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the attacker did not stop"

    def _run(self) -> None:
        while not self._stop.is_set():
            self.connections += 1
            sock = socket.create_connection(self.address, timeout=10)
            try:
                sock.sendall(PREFACE + SettingsFrame(0).serialize() + SettingsFrame(0, flags=["ACK"]).serialize())
                encoder, stream = Encoder(), [1]
                while not self._stop.is_set():
                    self.send(sock, encoder, stream)
            except OSError:
                pass
            self.ends.append(_goaway_code(sock))
            sock.close()

    def closed_for_budget(self) -> bool:
        return any(end == ENHANCE_YOUR_CALM for end in self.ends)


def _goaway_code(sock: socket.socket) -> int | None:
    """The error code of the last GOAWAY among what the server sent (read to its end)."""
    data = b""
    try:
        sock.settimeout(5)
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    code = None
    view = memoryview(data)
    while len(view) >= 9:
        frame, length = Frame.parse_frame_header(view[:9])
        if len(view) < 9 + length:
            break
        if isinstance(frame, GoAwayFrame):
            frame.parse_body(view[9 : 9 + length])
            code = frame.error_code
        view = view[9 + length :]
    return code


def request_headers(encoder: Encoder, path: bytes, method: bytes = b"GET") -> bytes:
    return encoder.encode(
        [(b":method", method), (b":scheme", b"http"), (b":path", path), (b":authority", b"attack.example")]
    )


def rapid_reset(sock: socket.socket, encoder: Encoder, stream: list[int]) -> None:
    frames = []
    for _ in range(BURST // 2):
        block = request_headers(encoder, b"/delay?ms=200")
        frames.append(HeadersFrame(stream[0], data=block, flags=["END_HEADERS", "END_STREAM"]).serialize())
        frames.append(RstStreamFrame(stream[0], error_code=8).serialize())  # CANCEL
        stream[0] += 2
    sock.sendall(b"".join(frames))


def ping_flood(sock: socket.socket, encoder: Encoder, stream: list[int]) -> None:
    sock.sendall(b"".join(PingFrame(0, opaque_data=b"%08d" % i).serialize() for i in range(BURST)))


def settings_flood(sock: socket.socket, encoder: Encoder, stream: list[int]) -> None:
    sock.sendall(SettingsFrame(0).serialize() * BURST)


def empty_data(sock: socket.socket, encoder: Encoder, stream: list[int]) -> None:
    if stream[0] == 1:
        block = request_headers(encoder, b"/upload", b"POST")
        sock.sendall(HeadersFrame(1, data=block, flags=["END_HEADERS"]).serialize())
        stream[0] = 3
    sock.sendall(DataFrame(1, data=b"").serialize() * BURST)


def window_updates(sock: socket.socket, encoder: Encoder, stream: list[int]) -> None:
    sock.sendall(WindowUpdateFrame(0, window_increment=1).serialize() * BURST)


def legitimate_requests(act: Activator) -> list[str]:
    """The legitimate client's requests, one after the other, each on a connection of its own."""
    answers = []
    for index in range(LEGITIMATE_REQUESTS):
        result = curl(
            "--http2-prior-knowledge",
            "-H",
            "Host: legit.example",
            "-w",
            " %{http_code}",
            f"http://{act.listen}/delay?ms=200&legit={index}",
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        answers.append(result.stdout.rsplit(" ", 1)[-1])
    return answers


@pytest.fixture
def target(pod_factory: PodFactory, activator_factory: ActivatorFactory) -> tuple[Activator, Pod]:
    (pod,) = pod_factory(1)
    config = make_config([pod], top={"access_log": False}, hosts=["*"], queue_depth=20, queue_timeout="120s")
    return activator_factory(config), pod


def settle(act: Activator, pod: Pod) -> None:
    assert pod.stats()["peak"] <= 1, pod.stats()
    act.wait_idle()


ABUSES = {
    "rapid reset": (rapid_reset, "resets"),
    "PING flood, acks never read": (ping_flood, "pings"),
    "SETTINGS flood": (settings_flood, "settings"),
    "empty DATA frames": (empty_data, "empty_frames"),
    "WINDOW_UPDATE flood": (window_updates, "window_updates"),
}


@pytest.mark.parametrize(("send", "budget"), ABUSES.values(), ids=ABUSES.keys())
def test_a_flooding_connection_is_closed_and_the_others_are_served_meanwhile(
    target: tuple[Activator, Pod], send: Callable[[socket.socket, Encoder, list[int]], None], budget: str
) -> None:
    act, pod = target
    host, port = act.listen.rsplit(":", 1)
    with Attacker((host, int(port)), send) as attacker:
        wait_until(lambda: attacker.connections >= 2, timeout=60, message="the attacker closed once and back")
        answers = legitimate_requests(act)  # while it goes on
    assert answers == ["200"] * LEGITIMATE_REQUESTS
    lines = re.findall(r"HTTP/2 client (\S+) went past its (\S+) budget", act.stderr_text())
    assert lines and {client for client, _ in lines} == {"127.0.0.1"}, act.output_tail()
    assert {name for _, name in lines} <= {budget, "pending_acks"}, lines
    if send is not ping_flood:  # a client that reads nothing cannot see its GOAWAY
        assert attacker.closed_for_budget(), attacker.ends
    counted = act.status()["h2_goaway"]
    assert counted[budget] + counted["pending_acks"] >= 1, counted
    assert set(counted) >= {"resets", "pings", "settings", "empty_frames", "window_updates"}  # every budget, 0 or not
    settle(act, pod)


def test_a_connection_holds_at_most_its_share_of_the_queue(target: tuple[Activator, Pod]) -> None:
    act, pod = target
    host, port = act.listen.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    encoder = Encoder()
    sock.sendall(PREFACE + SettingsFrame(0).serialize() + SettingsFrame(0, flags=["ACK"]).serialize())
    frames = [
        HeadersFrame(
            1 + 2 * i, data=request_headers(encoder, b"/delay?ms=200&hog=%d" % i), flags=["END_HEADERS", "END_STREAM"]
        )
        for i in range(20)
    ]
    sock.sendall(b"".join(frame.serialize() for frame in frames))
    # queue_depth 20, max_queue_share 0.5: one slot and ten places in the queue are its; the
    # other nine streams are answered 503 queue-full at once.
    act.wait_for(lambda st: st["services"][SERVICE]["queued"] == 10, message="ten of its streams queued")
    answers = legitimate_requests(act)
    assert answers == ["200"] * LEGITIMATE_REQUESTS
    statuses = _statuses(sock, 20)
    assert sorted(statuses.values()).count(b"503") == 9, statuses
    assert sorted(statuses.values()).count(b"200") == 11, statuses
    sock.close()
    settle(act, pod)


def _statuses(sock: socket.socket, streams: int) -> dict[int, bytes]:
    """The ``:status`` of each of ``streams`` streams, read until all came."""
    from hpack import Decoder

    decoder = Decoder()
    statuses: dict[int, bytes] = {}
    data = b""
    sock.settimeout(120)
    while len(statuses) < streams:
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended with {statuses}"
        data += chunk
        while len(data) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(data[:9]))
            if len(data) < 9 + length:
                break
            frame.parse_body(memoryview(data[9 : 9 + length]))
            data = data[9 + length :]
            if isinstance(frame, HeadersFrame):
                fields: Any = dict(decoder.decode(frame.data, raw=True))
                if b":status" in fields:
                    statuses[frame.stream_id] = fields[b":status"]
    return statuses
