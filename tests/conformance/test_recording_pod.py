"""The oracle checked on its own: the recording pod records what it is sent, as sent.

Raw bytes straight to a :class:`~recording_pod.RecordingPod` (no activator in between):
pipelined requests of each framing are recorded once each, in order, with their header
lines as they came; a request cut off by the connection's end is no request; a script
``at_head`` answers before the body was sent; ``peak`` counts requests handled at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from harness import wait_until
from recording_pod import RecordingPod, Script, Step
from wire import Wire, chunked, http_request


@pytest.fixture
def pod() -> Iterator[RecordingPod]:
    with RecordingPod() as recording:
        yield recording


def test_pipelined_requests_are_recorded_once_each_in_order_with_their_framing(pod: RecordingPod) -> None:
    with Wire(pod.address) as connection:
        connection.send(
            http_request(b"POST /length HTTP/1.1", b"content-LENGTH: 5", b"X-A: 1", b"X-A: 2", body=b"hello")
            + http_request(b"POST /chunked HTTP/1.1", b"Transfer-Encoding: chunked", body=chunked(b"hello world", 4))
            + http_request(b"GET /none HTTP/1.1")
        )
        answers = [connection.read_response() for _ in range(3)]
    assert [a.body for a in answers] == [b"served /length", b"served /chunked", b"served /none"]
    length, chunks, none = pod.requests()
    assert (length.target, length.framing, length.body) == (b"/length", "content-length", b"hello")
    assert length.headers == ((b"Host", b"a.example"), (b"content-LENGTH", b"5"), (b"X-A", b"1"), (b"X-A", b"2"))
    assert (chunks.target, chunks.framing, chunks.body) == (b"/chunked", "chunked", b"hello world")
    assert (none.method, none.framing, none.body) == (b"GET", "none", b"")


def test_a_request_cut_off_by_the_connections_end_is_recorded_incomplete_not_as_a_request(pod: RecordingPod) -> None:
    data = http_request(b"POST /cut HTTP/1.1", b"Content-Length: 10", body=b"hello")
    with Wire(pod.address) as connection:
        connection.send(data)
    wait_until(lambda: pod.connections() and pod.connections()[0].ended, message="the pod saw the end")
    (record,) = pod.connections()
    assert (record.raw, record.requests, record.incomplete) == (data, (), True)
    assert pod.requests() == []


def test_an_at_head_script_answers_before_the_body_is_sent_and_then_drains(pod: RecordingPod) -> None:
    pod.set_script(
        b"/early", Script([b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\n\r\n"], at_head=True, close=True)
    )
    head = http_request(b"POST /early HTTP/1.1", b"Content-Length: 5")
    with Wire(pod.address) as connection:
        connection.send(head)
        assert connection.read_response().status == 413  # no body was sent yet
        assert connection.closed_by_peer()  # the pod's side is shut...
        connection.send(b"hello")  # ...but it still reads what comes
    wait_until(lambda: pod.connections()[0].ended, message="the pod saw the end")
    assert pod.connections()[0].raw == head + b"hello"


def test_peak_counts_requests_handled_at_once(pod: RecordingPod) -> None:
    release = threading.Event()

    def held_answer() -> Iterator[Step]:
        release.wait(30.0)
        yield b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"

    pod.set_script(b"/held", Script(held_answer))
    with Wire(pod.address) as first, Wire(pod.address) as second:
        for connection in (first, second):
            connection.send(http_request(b"GET /held HTTP/1.1"))
        wait_until(lambda: pod.peak == 2, message="both requests being handled")
        release.set()
        assert [first.read_response().status, second.read_response().status] == [200, 200]
    assert pod.peak == 2
