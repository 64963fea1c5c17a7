"""A WebSocket echo pod (python ``websockets``, threaded sync server).

    python -m pods.ws_echo --port 0 --control-port 0

Every message (text or binary, any size) is sent back as it came. Each open WebSocket
is one unit of work, named by its request path (``podstats.Stats``): its peak is the
number of WebSockets the pod had open at once. A WebSocket stops counting once the pod
has done its part of the close handshake (state no longer OPEN: the pod has answered the
close frame and sent its FIN), not when its handler thread gets round to returning: the
handler only wakes after the client's FIN, the very moment the proxy may hand the slot
to the next WebSocket, so counting handler lifetimes would race the next handshake.

``/refuse?status=N`` (200, 426...) is not upgraded: the pod answers N with a short text
body (counted in ``notes`` as ``refused``, never as work). No keepalive pings: a test decides when bytes flow.
"""

from __future__ import annotations

import threading
from urllib.parse import parse_qs, urlsplit

from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.sync.server import ServerConnection, serve

from pods.podstats import HOST, Stats, announce, arguments, serve_control


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    stats = Stats()

    def process_request(connection: ServerConnection, request: Request) -> Response | None:
        parts = urlsplit(request.path)
        if parts.path != "/refuse":
            return None
        stats.note("refused")
        status = int(parse_qs(parts.query).get("status", ["426"])[-1])
        return connection.respond(status, f"refused with {status}\n")

    counted: set[ServerConnection] = set()
    counted_lock = threading.Lock()

    def stop_counting(connection: ServerConnection) -> None:
        with counted_lock:
            if connection in counted:
                counted.discard(connection)
                stats.exit()

    def start_counting(connection: ServerConnection) -> None:
        with counted_lock:
            closing = [c for c in counted if c.state is not State.OPEN]
        for done in closing:
            stop_counting(done)
        with counted_lock:
            counted.add(connection)
            stats.enter(urlsplit(connection.request.path).path if connection.request else "?")

    def echo(connection: ServerConnection) -> None:
        start_counting(connection)
        try:
            for message in connection:
                connection.send(message)
        except ConnectionClosed:
            pass
        finally:
            stop_counting(connection)

    with serve(
        echo,
        HOST,
        args.port,
        process_request=process_request,
        compression=None,
        ping_interval=None,
        max_size=None,
    ) as server:
        port = server.socket.getsockname()[1]
        announce(port, serve_control(args.control_port, stats))
        server.serve_forever()


if __name__ == "__main__":
    main()
