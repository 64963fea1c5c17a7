"""A Falcon "hello" on gevent pywsgi: what the previous engine's server stack costs alone, without an upstream.

    python -m bench.hello_app --port N

``monkey.patch_all()``, an embedded ``gevent.pywsgi.WSGIServer`` on a listener we create
with TCP_NODELAY (accepted sockets inherit it), ``spawn=Pool()``, no request log; a
``falcon.App`` with one resource that answers "hello". (The new engine's ceiling, with an
upstream, is ``bench/forwarder.py``.)
"""

from gevent import monkey

monkey.patch_all()

import argparse
import socket

import falcon
import gevent.pool
from gevent.pywsgi import WSGIServer


class Hello:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "text/plain"
        resp.text = "hello"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    app = falcon.App()
    app.add_route("/", Hello())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(1024)
    server = WSGIServer(sock, app, spawn=gevent.pool.Pool(), log=None)
    print(f"READY {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
