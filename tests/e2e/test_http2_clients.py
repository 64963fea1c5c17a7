"""End to end: HTTP/2 clients in front of HTTP/1.1 pods (SPEC "Protocols": h2c with prior
knowledge on the proxy port, one slot per stream).

The pods are ``tests/backend.py`` (HTTP/1.1, recording their own peak concurrency and
the ``X-Request-Id`` of each request in arrival order). The clients are ``curl
--http2-prior-knowledge``, ``h2load``, and ``harness.H2Client`` (the ``h2`` library on
one connection) where a test must open and reset streams in an order of its choosing.
What is proved:

- a request over h2c reaches the HTTP/1.1 pod whole: method, path and query, headers
  (``:authority`` as Host), a body larger than HTTP/2's flow-control window, and the
  pod's answer comes back whole;
- ``h2load`` (200 requests, 4 connections, 10 streams each) gets every answer, and no pod
  ever serves more than its ``container_concurrency``;
- streams of one connection wait in the FIFO like requests do: a cc 1 pod serves them
  one at a time, in the order they were opened;
- a stream the client resets while queued leaves the queue and never reaches the pod; a
  stream reset while the pod works on it gives its slot back (the pod's request is
  dropped); the connection goes on.

Every test ends with the pods' peak within ``container_concurrency`` and the activator
idle. No test asserts on elapsed time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harness import (
    SERVICE,
    Activator,
    ActivatorFactory,
    H2Client,
    Pod,
    PodFactory,
    curl,
    download_pattern,
    make_config,
    wait_until,
)

pytestmark = pytest.mark.binary


def service(act: Activator) -> dict[str, Any]:
    result: dict[str, Any] = act.status()["services"][SERVICE]
    return result


def wait_queued(act: Activator, n: int, message: str) -> None:
    act.wait_for(lambda st: st["services"][SERVICE]["queued"] == n, message=message)


def settle(act: Activator, pods: list[Pod], cc: int = 1) -> None:
    """How every test ends: no pod served more than ``cc`` at once, the activator idle."""
    for pod in pods:
        assert pod.stats()["peak"] <= cc, (pod.address, pod.stats())
    act.wait_idle()


def test_h2c_request_reaches_an_http1_pod_whole(
    pod_factory: PodFactory, activator_factory: ActivatorFactory, tmp_path: Path
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod]))
    upload = os.urandom(200_000)  # over the 65,535-byte initial window
    (tmp_path / "upload.bin").write_bytes(upload)

    result = curl(
        "--http2-prior-knowledge",
        "-X",
        "PUT",
        "-H",
        "X-Test: h2c",
        "-H",
        "Content-Type: application/octet-stream",
        "--data-binary",
        f"@{tmp_path / 'upload.bin'}",
        "-D",
        str(tmp_path / "head.txt"),
        "-o",
        str(tmp_path / "echo.json"),
        "-w",
        "%{http_version} %{response_code}",
        f"http://{act.listen}/echo/h2?x=1&y=two",
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == "2 200", result.stdout
    head = (tmp_path / "head.txt").read_text().lower()
    assert f"x-pod: {pod.address}" in head, head
    seen = json.loads((tmp_path / "echo.json").read_text())
    assert seen["method"] == "PUT"
    assert seen["target"] == "/echo/h2?x=1&y=two"
    assert seen["http_version"] == "HTTP/1.1"
    assert seen["body_length"] == len(upload)
    assert seen["body_sha256"] == hashlib.sha256(upload).hexdigest()
    headers = seen["headers"]
    assert headers["x-test"] == "h2c"
    assert headers["content-type"] == "application/octet-stream"
    assert headers["x-forwarded-proto"] == "http"
    assert headers.get("host") == act.listen, seen["header_list"]  # :authority, kept as the Host

    size = 300_000
    download = tmp_path / "download.bin"
    result = curl("--http2-prior-knowledge", "-o", str(download), f"http://{act.listen}/download?bytes={size}")
    assert result.returncode == 0, result.stderr
    assert download.read_bytes() == download_pattern(size)
    assert pod.stats()["count"] == 2
    settle(act, [pod])


def test_curl_http2_with_a_body_over_plain_http_is_served_as_http1(
    pod_factory: PodFactory, activator_factory: ActivatorFactory, tmp_path: Path
) -> None:
    # curl --http2 against an http:// URL asks to upgrade to h2c (Connection: Upgrade,
    # HTTP2-Settings; Upgrade: h2c) with its body: activator declines the upgrade, as
    # HAProxy and nginx do, and serves the request (RFC 9113 3.1: h2c upgrade is deprecated).
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod]))
    result = curl(
        "--http2",
        "-d",
        "hello=world",
        "-o",
        str(tmp_path / "echo.json"),
        "-w",
        "%{http_version} %{response_code}",
        f"http://{act.listen}/echo/upgrade",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "1.1 200", result.stdout
    seen = json.loads((tmp_path / "echo.json").read_text())
    assert (seen["method"], seen["body_length"]) == ("POST", len("hello=world"))
    assert "upgrade" not in seen["headers"] and "http2-settings" not in seen["headers"], seen["header_list"]
    settle(act, [pod])


def test_a_graceful_stop_sends_goaway_at_once_and_the_stream_under_way_finishes(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], top={"grace_period": "60s"}))
    assert shutil.which("nghttp"), "nghttp (Debian's nghttp2-client) is needed"
    # nghttp -v prints each frame as it arrives, and follows a graceful GOAWAY (the h2
    # library, which the harness's client is built on, ends its connection at any GOAWAY).
    client = subprocess.Popen(
        ["nghttp", "-v", f"http://{act.listen}/hold?key=h"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_until(lambda: pod.held() == ["h"], message="the stream running on the pod")
        act.signal(signal.SIGTERM)
        assert client.stdout is not None
        seen = []
        for line in client.stdout:  # the GOAWAY comes when the stop begins, not after the last stream
            seen.append(line)
            if "recv GOAWAY frame" in line:
                seen.append(client.stdout.readline())  # its fields: (last_stream_id=1, error_code=NO_ERROR(0x00), ...)
                break
        assert "error_code=NO_ERROR" in seen[-1], seen[-5:]
        assert pod.held() == ["h"], "the stream under way was ended by the stop"
        assert pod.release("h") == 1
        rest, _ = client.communicate(timeout=60)
    finally:
        client.kill()
    assert client.returncode == 0, rest
    assert f"released h on {pod.address}" in rest
    assert act.wait(60) == 0


def test_h2load_gets_every_answer_and_no_pod_exceeds_its_limit(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    pods = pod_factory(2)
    act = activator_factory(make_config(pods, container_concurrency=2, queue_depth=100, queue_timeout="60s"))

    assert shutil.which("h2load"), "h2load (Debian's nghttp2-client) is needed"
    run = subprocess.run(
        ["h2load", "-n", "200", "-c", "4", "-m", "10", f"http://{act.listen}/delay?ms=5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    requests = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed", out)
    assert requests, out
    assert requests.groups() == ("200", "200", "200", "200", "0"), out
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    assert codes and codes.groups() == ("200", "0", "0", "0"), out
    assert sum(pod.stats()["count"] for pod in pods) == 200
    settle(act, pods, cc=2)


def test_h2load_with_more_streams_than_the_limit_on_one_connection_gets_every_answer(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    # 300 streams at once on one connection, over the advertised 256: nghttp2 holds back
    # what the limit does not allow once it knows it (its first flight may exceed it), and
    # activator counts streams as RFC 9113 does: no stream is refused, none errs.
    pods = pod_factory(2)
    act = activator_factory(make_config(pods, container_concurrency=0, queue_depth=1000, queue_timeout="60s"))
    run = subprocess.run(
        ["h2load", "-n", "3000", "-c", "1", "-m", "300", f"http://{act.listen}/delay?ms=1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    requests = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", out
    )
    assert requests and requests.groups() == ("3000", "3000", "3000", "3000", "0", "0"), out
    act.wait_idle()


def hold_with_upload(client: H2Client, act: Activator, request_id: str) -> int:
    """Open a stream that holds the only slot until the test ends its request body (the
    backend's ``/upload`` reads to the end before it answers); its stream id."""
    stream_id = client.send("POST", "/upload", [("x-request-id", request_id)], b"first part", end_stream=False)
    act.wait_for(lambda st: st["services"][SERVICE]["in_flight"] == 1, message=f"stream {request_id} holds the slot")
    return stream_id


def test_streams_of_one_connection_queue_fifo_for_a_cc1_pod(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], queue_timeout="60s"))
    waiters = ["b", "c", "d", "e"]

    with H2Client(act.listen) as client:
        holder = hold_with_upload(client, act, "a")
        streams = {}
        for i, rid in enumerate(waiters):
            streams[rid] = client.send("GET", f"/delay?ms=20&n={i}", [("x-request-id", rid)])
            wait_queued(act, i + 1, f"stream {rid} queued behind the others")
        assert pod.stats()["request_ids"] in ([], ["a"])  # only the holder, if its head went ahead of its body

        client.send_body(holder, b" and the end")
        first = client.response(holder)
        assert first.status == 200 and json.loads(first.body)["length"] == len(b"first part and the end"), first
        answers = {rid: client.response(sid) for rid, sid in streams.items()}

        assert {rid: a.status for rid, a in answers.items()} == dict.fromkeys(waiters, 200), answers
        assert all(a.header("x-pod") == pod.address for a in answers.values())
        assert client.terminated is None, "the connection ended"
    assert pod.stats()["request_ids"] == ["a", *waiters], "streams not served in the order they were opened"
    settle(act, [pod])


def test_stream_reset_while_queued_leaves_the_queue(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], queue_timeout="60s"))

    with H2Client(act.listen) as client:
        holder = hold_with_upload(client, act, "holder")
        quitter = client.send("GET", "/delay?ms=1", [("x-request-id", "quitter")])
        wait_queued(act, 1, "the second stream queued")
        client.reset(quitter)
        wait_queued(act, 0, "the reset stream out of the queue")
        assert service(act)["in_flight"] == 1

        after = client.send("GET", "/delay?ms=1", [("x-request-id", "after")])
        wait_queued(act, 1, "a third stream queued")
        client.send_body(holder, b"")
        assert client.response(holder).status == 200
        answer = client.response(after)
        assert answer.status == 200, answer
        assert client.terminated is None, "the connection ended"

    assert pod.stats()["request_ids"] == ["holder", "after"], "the reset stream reached the pod"
    settle(act, [pod])


def test_stream_reset_in_flight_keeps_its_slot_until_the_pod_answers(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    """A client that cancels while its pod works does not make room for a second request:
    the pod is still working on the first (cc=1 model servers), so the slot is held until
    the pod answers, and then the next stream runs."""
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], queue_timeout="60s"))

    with H2Client(act.listen) as client:
        held = client.send("GET", "/hold?key=first", [("x-request-id", "held")])
        wait_until(lambda: pod.held() == ["first"], message="the pod holds the first stream")
        waiter = client.send("GET", "/delay?ms=1", [("x-request-id", "waiter")])
        wait_queued(act, 1, "the next stream queued")

        client.reset(held)
        client.ping()  # the reset reached the activator (frames are read in order)
        # ... yet the waiter stays queued: the pod still works on the first.
        assert act.status()["services"][SERVICE]["queued"] == 1
        assert pod.stats()["in_flight"] == 1

        assert pod.release("first") == 1
        answer = client.response(waiter)
        assert answer.status == 200, answer
        assert client.terminated is None, "the connection ended"

    assert pod.stats()["request_ids"] == ["held", "waiter"]
    assert pod.stats()["peak"] == 1
    settle(act, [pod])
