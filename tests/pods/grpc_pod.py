"""A gRPC pod (``grpcio``, threaded), with bytes in and out: no generated code.

    python -m pods.grpc_pod --port 0 --control-port 0

The methods of :data:`SERVICE` (registered with ``grpc.method_handlers_generic_handler``
and no serializers, so requests and responses are raw bytes):

- ``Unary``: answers the request as it came;
- ``ServerStream``: the request is a count N (ASCII digits); answers N messages
  ``b"0"``, ``b"1"``...;
- ``ClientStream``: answers the requests joined with ``b"|"``;
- ``Block``: waits until the test releases it (control ``POST /release?n=K`` lets K
  blocked calls answer, oldest first) or the call is cancelled, then answers the request.

Each call is one unit of work, named by its method, from the moment its handler starts
until it returns (a stream: until its last message): its peak is the number of calls the
pod served at once. The server's thread pool is large, so the pod never limits itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from pods.podstats import HOST, Stats, announce, arguments, serve_control

SERVICE = "activator.test.Pod"


def method(name: str) -> str:
    """The full path of one of the pod's methods: ``/activator.test.Pod/Unary``."""
    return f"/{SERVICE}/{name}"


class Gate:
    """Blocked calls wait here until released (see ``Block``)."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)

    def wait(self, context: grpc.ServicerContext) -> bool:
        """Wait for a permit; False if the call was cancelled first."""
        while not self._permits.acquire(timeout=0.05):
            if not context.is_active():
                return False
        return True

    def release(self, query: dict[str, str]) -> dict[str, int]:
        n = int(query.get("n", "1"))
        self._permits.release(n)
        return {"released": n}


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    stats = Stats()
    gate = Gate()

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        with stats.track("Unary"):
            return request

    def server_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        with stats.track("ServerStream"):
            for i in range(int(request)):
                yield b"%d" % i

    def client_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        with stats.track("ClientStream"):
            return b"|".join(requests)

    def block(request: bytes, context: grpc.ServicerContext) -> bytes:
        with stats.track("Block"):
            if not gate.wait(context):
                stats.note("cancelled")  # the client's cancel reached the pod
            return request

    handlers: dict[str, Any] = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        "Block": grpc.unary_unary_rpc_method_handler(block),
    }
    server = grpc.server(ThreadPoolExecutor(max_workers=64))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(f"{HOST}:{args.port}")
    server.start()
    announce(port, serve_control(args.control_port, stats, {"release": gate.release}))
    server.wait_for_termination()


if __name__ == "__main__":
    main()
