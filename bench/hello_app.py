"""The ceiling of any Python proxy on this stack: a Falcon "hello" on gevent pywsgi.

    python -m bench.hello_app --port N [--strict]

The same server stack as activator: ``monkey.patch_all()``, an embedded
``gevent.pywsgi.WSGIServer`` on a listener we create with TCP_NODELAY (accepted sockets
inherit it), ``spawn=Pool()``, no request log; a ``falcon.App`` with one resource that
answers "hello". ``--strict`` uses activator's own handler class (its strict request
parsing and client timeouts) instead of pywsgi's, to show what that handler costs.
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import socket  # noqa: E402

import falcon  # noqa: E402
import gevent.pool  # noqa: E402
from gevent.pywsgi import WSGIServer  # noqa: E402


class Hello:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "text/plain"
        resp.text = "hello"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--strict", action="store_true")
    args = ap.parse_args()
    app = falcon.App()
    app.add_route("/", Hello())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(1024)
    kwargs = {}
    if args.strict:
        from activator.core.config import LimitsConfig
        from activator.handler import handler_for

        kwargs["handler_class"] = handler_for(LimitsConfig())
    server = WSGIServer(sock, app, spawn=gevent.pool.Pool(), log=None, **kwargs)
    print(f"READY {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
