"""End to end: long responses and the pod timeouts (SPEC "The YAML file":
``response_start_timeout``, ``idle_timeout``, ``request_timeout: null``).

The pods are ``tests/backend.py`` (its ``/sse`` stream, its ``/hang`` that never answers)
and ``pods.stream_pod``, whose chunked event stream sends one event each time the test
says so and nothing otherwise. What is proved:

- with ``request_timeout: null`` a server-sent-event stream lasts as long as the pod
  keeps it going, well past ``response_start_timeout``; the same stream under a short
  ``request_timeout`` is cut: the client sees the chunked body end without its last
  chunk, and the access log says ``upstream-body-timeout``;
- a pod's response head reaches the client before any body byte exists (an event stream
  whose first event is late is still open for its client);
- events are relayed one by one: each reaches the client before the pod sends the next
  (the pod sends the next only when the test has read this one);
- a pod that stops sending mid-body is cut by ``idle_timeout`` (``upstream-idle``);
- a pod that sends no head within ``response_start_timeout`` gets the client a 504
  ``upstream-timeout``, and its connection is closed.

Only the pods' behaviour is controlled: no test asserts on elapsed time. Every test ends
with the pod's peak within ``container_concurrency`` and the activator idle.
"""

from __future__ import annotations

import contextlib
import http.client
from collections.abc import Iterator

import pytest
from harness import (
    DEFAULT_TIMEOUT,
    Activator,
    ActivatorFactory,
    ModulePod,
    PodFactory,
    activator_reason,
    make_config,
    request,
    start_request,
    stream,
    wait_until,
)

pytestmark = pytest.mark.binary

#: A stream of the backend that lasts well over two seconds (ten events, 400 ms apart).
SSE_EVENTS = 10
SSE = f"/sse?n={SSE_EVENTS}&gap_ms=400"
#: Event I of ``pods.stream_pod``, as it reaches the client.
EVENT = b"id: %d\ndata: event %d\n\n"


@pytest.fixture
def stream_pod() -> Iterator[ModulePod]:
    with ModulePod("stream_pod") as pod:
        yield pod


def event_ids(body: bytes) -> list[int]:
    """The ``id:`` of every complete event in an event-stream body, in order."""
    return [int(line[4:]) for block in body.split(b"\n\n")[:-1] for line in block.split(b"\n") if line[:4] == b"id: "]


def read_to_end(resp: http.client.HTTPResponse) -> tuple[bytes, bool]:
    """Read the body piece by piece until it ends: (what came, whether it was cut: the
    connection ended before the chunked body's last chunk)."""
    got = b""
    while True:
        try:
            piece = resp.read1(65536)
        except (http.client.IncompleteRead, ConnectionError) as cut:
            partial = getattr(cut, "partial", b"")
            return got + (partial if isinstance(partial, bytes) else b""), True
        if not piece:
            return got, False
        got += piece


def read_until(resp: http.client.HTTPResponse, got: bytes, wanted: bytes) -> bytes:
    """Read on (``got`` came already) until ``wanted`` is in the body; the body so far."""
    while wanted not in got:
        piece = resp.read1(65536)
        assert piece, f"the body ended before {wanted!r}: {got!r}"
        got += piece
    return got


@contextlib.contextmanager
def first_event(act: Activator, pod: ModulePod, path: str) -> Iterator[tuple[http.client.HTTPResponse, bytes]]:
    """Open ``pod``'s event stream through ``act`` and have the pod send event 0; yield the
    response and the body read so far (event 0 whole). The head is read only once the
    pod sent a body byte: when a head alone reaches the client is another test's business."""
    conn = start_request(act.listen, path=path)
    try:
        pod.wait_stats(lambda s: s["in_flight"] == 1, "the stream open on the pod")
        pod.control("send", n=1)
        resp = conn.getresponse()
        assert resp.status == 200
        yield resp, read_until(resp, b"", EVENT % (0, 0))
    finally:
        conn.close()


def settle(act: Activator, peak: int) -> None:
    """How every test ends: the pod's peak within cc 1, the activator idle."""
    assert peak <= 1, f"the pod served {peak} requests at once"
    act.wait_idle()


def test_stream_outlives_the_pod_timeouts_with_no_request_timeout(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], request_timeout=None, idle_timeout="20s", response_start_timeout="2s"))

    with stream(act.listen, path=SSE) as resp:
        assert resp.status == 200
        assert resp.getheader("Content-Type") == "text/event-stream"
        body, cut = read_to_end(resp)

    assert not cut, f"cut after {body!r}"
    assert event_ids(body) == list(range(SSE_EVENTS))
    settle(act, pod.stats()["peak"])


def test_short_request_timeout_cuts_the_stream_without_its_last_chunk(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], request_timeout="1s", idle_timeout="20s", top={"access_log": True}))

    with stream(act.listen, path=SSE) as resp:
        assert resp.status == 200  # the head came at once: only the body outlives the limit
        body, cut = read_to_end(resp)

    assert cut, f"the stream ended cleanly after {body!r}"
    ids = event_ids(body)
    assert SSE_EVENTS - 1 not in ids, body
    assert ids == list(range(len(ids)))  # what came, came whole and in order
    line = act.wait_access(lambda r: r.target == SSE, message="the cut stream's line")
    assert line.status == 200 and line.reason == "upstream-body-timeout", line.line
    wait_until(lambda: pod.stats()["in_flight"] == 0, message="the pod saw its connection end")
    settle(act, pod.stats()["peak"])


def test_response_head_reaches_the_client_before_any_body_byte(
    stream_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(make_config([stream_pod], request_timeout=None, idle_timeout="20s"))

    # The pod sends its head and no body byte until told: an event-stream client (an
    # EventSource's "open") must see the head now, not with the first event.
    with stream(act.listen, path="/events") as resp:
        assert resp.status == 200
        assert resp.getheader("Content-Type") == "text/event-stream"
        assert stream_pod.stats()["notes"].get("sent") is None
        stream_pod.control("send", n=1)
        got = read_until(resp, b"", EVENT % (0, 0))
        stream_pod.control("end")
        rest, cut = read_to_end(resp)

    assert not cut and event_ids(got + rest) == [0]
    stream_pod.wait_stats(lambda s: s["in_flight"] == 0, "the stream over on the pod")
    settle(act, stream_pod.stats()["peak"])


def test_each_event_reaches_the_client_before_the_pod_sends_the_next(
    stream_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(make_config([stream_pod], request_timeout=None, idle_timeout="20s"))

    with first_event(act, stream_pod, "/events") as (resp, got):
        for i in range(1, 5):
            # The pod has sent the events read so far and no other: each came on its own.
            assert stream_pod.stats()["notes"].get("sent") == i
            stream_pod.control("send", n=1)
            got = read_until(resp, got, EVENT % (i, i))
        stream_pod.control("end")
        rest, cut = read_to_end(resp)

    assert not cut
    assert event_ids(got + rest) == [0, 1, 2, 3, 4]
    stream_pod.wait_stats(lambda s: s["in_flight"] == 0, "the stream over on the pod")
    settle(act, stream_pod.stats()["peak"])


def test_idle_timeout_cuts_a_pod_that_stops_sending_mid_body(
    stream_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(
        make_config([stream_pod], request_timeout=None, idle_timeout="1s", top={"access_log": True})
    )

    with first_event(act, stream_pod, "/events?stops=1") as (resp, got):
        # The pod sends nothing more, ever: only the idle timeout can end this.
        rest, cut = read_to_end(resp)

    assert cut, f"the body ended cleanly: {got + rest!r}"
    assert event_ids(got + rest) == [0]
    line = act.wait_access(lambda r: r.target == "/events?stops=1", message="the cut stream's line")
    assert line.status == 200 and line.reason == "upstream-idle", line.line
    stream_pod.wait_stats(lambda s: s["in_flight"] == 0, "the pod's connection closed by the activator")
    assert stream_pod.stats()["notes"] == {"sent": 1}
    settle(act, stream_pod.stats()["peak"])


def test_pod_slower_than_response_start_timeout_gets_504(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], response_start_timeout="1s", top={"access_log": True}))

    resp = request(act.listen, path="/hang", timeout=DEFAULT_TIMEOUT)

    assert resp.status == 504, resp.text
    assert activator_reason(resp) == "upstream-timeout"
    line = act.wait_access(lambda r: r.target == "/hang", message="the timed-out request's line")
    assert line.status == 504 and line.reason == "upstream-timeout", line.line
    # /hang answers nothing until its peer closes: the activator gave up on the connection.
    wait_until(lambda: pod.stats()["in_flight"] == 0, message="the pod's connection closed")
    assert pod.stats()["count"] == 1  # not retried: the request had reached the pod
    settle(act, pod.stats()["peak"])
