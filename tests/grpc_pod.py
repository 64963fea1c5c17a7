"""A real gRPC server (grpcio) for tests/test_upstream_h2.py, run as a process of its own.

Why a process: grpcio's core starts threads that live as long as the process, and its
fork handlers run at every later fork; the test session (gevent, unpatched, and many
subprocesses) stays as it was when the server lives elsewhere. The tests coordinate with
it through gRPC calls of their own (``Ack``, ``Received``), made through the client under
test: more streams on the same connection.

Service ``test.Pod``, bytes in and out (no serializers, no generated code):

- ``Unary``: answers the request itself.
- ``ServerStream``: the request is ``b"<n>"``; answers ``message 0`` ... ``message n-1``,
  each only after ``Ack`` said the previous one arrived (so the client must deliver each
  as it comes); an ack that does not come within 10 s ends the call with DEADLINE_EXCEEDED.
- ``Ack``: the request is ``b"<i>"``: message i of the running ``ServerStream`` arrived.
- ``ClientStream``: answers the messages it received joined by ``b","``, once the upload
  ended; each is counted as it arrives.
- ``Received``: how many messages the last ``ClientStream`` received so far (``b"<n>"``).
- ``Bidi``: answers each message ``m`` with ``b"echo " + m`` as soon as it arrives.
- ``Fail``: ends with INVALID_ARGUMENT ``"refused on purpose"`` before any message (a
  trailers-only answer).

Prints ``PORT <n>`` once it listens on 127.0.0.1 (an ephemeral port); runs until killed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints

ACK_WAIT = 10.0

_acks: dict[int, threading.Event] = {}
_acks_lock = threading.Lock()
_received = 0


def _ack_event(index: int) -> threading.Event:
    with _acks_lock:
        return _acks.setdefault(index, threading.Event())


def unary(request: bytes, context: Any) -> bytes:
    return request


def server_stream(request: bytes, context: Any) -> Iterator[bytes]:
    with _acks_lock:
        _acks.clear()
    for index in range(int(request)):
        if index and not _ack_event(index - 1).wait(ACK_WAIT):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no ack for message {index - 1}")
        yield b"message %d" % index


def ack(request: bytes, context: Any) -> bytes:
    _ack_event(int(request)).set()
    return b""


def client_stream(requests: Iterator[bytes], context: Any) -> bytes:
    global _received
    _received = 0
    messages = []
    for message in requests:
        messages.append(message)
        _received += 1
    return b",".join(messages)


def received(request: bytes, context: Any) -> bytes:
    return b"%d" % _received


def bidi(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    for message in requests:
        yield b"echo " + message


def fail(request: bytes, context: Any) -> bytes:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused on purpose")
    raise AssertionError("abort returns only by raising")


def main() -> None:
    handler = grpc.method_handlers_generic_handler(
        "test.Pod",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
            "Ack": grpc.unary_unary_rpc_method_handler(ack),
            "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
            "Received": grpc.unary_unary_rpc_method_handler(received),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
            "Fail": grpc.unary_unary_rpc_method_handler(fail),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
