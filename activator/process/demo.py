"""``activator demo``: slow one-at-a-time pods and the proxy, all on loopback.

Starts one demo pod per pod listed in the bundled ``config/demo.yaml`` (each a
small HTTP server in this process that takes ``--delay`` seconds per request and
reports how many requests it is running, so throttling is visible), then the proxy
with that config, prints what to try, and runs until Ctrl-C.

Its ports move without editing the bundled file: ``--listen``, ``--admin`` and
``--pods PORT`` (the first of the pods' consecutive ports) make a copy of it with those
addresses, in a temporary directory, and run that copy (its path is printed: edits to
it are reloaded, as edits to ``config/demo.yaml`` are otherwise). Bad values are
configuration errors (exit 2) naming the copy and the key.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gevent
import yaml

from ..core.config import Address, LimitsConfig
from ..core.errors import ConfigError
from ..front.engine import HttpServer
from .configfile import load_config
from .server import Runtime, listen_on, setup_logging


def demo_config_path() -> Path:
    """config/demo.yaml from the source tree, or from the one-file executable's bundle."""
    candidates = [Path(__file__).resolve().parents[2] / "config" / "demo.yaml"]
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle:
        candidates.insert(0, Path(bundle) / "config" / "demo.yaml")
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError("the bundled config/demo.yaml is missing from this installation")


class DemoPod:
    """A WSGI app that works ``delay`` seconds per request and counts its concurrency."""

    def __init__(self, name: str, delay: float) -> None:
        self.name = name
        self.delay = delay
        self.in_flight = 0
        self.peak = 0
        self.served = 0

    def __call__(self, env: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if env.get("PATH_INFO") == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            gevent.sleep(self.delay)
            self.served += 1
            body = (
                f"hello from pod {self.name}: request #{self.served}, "
                f"running {self.in_flight} now, never more than {self.peak} at once\n"
            ).encode()
        finally:
            self.in_flight -= 1
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]


def moved_config(bundled: Path, directory: str, listen: str | None, admin: str | None, pods: int | None) -> Path:
    """A copy of the demo configuration with these addresses (None: as bundled), in
    ``directory``. The pods of every service get consecutive ports from ``pods``."""
    data = yaml.safe_load(bundled.read_text())
    if listen is not None:
        data["listen"] = listen
    if admin is not None:
        data["admin"] = admin
    if pods is not None:
        port = pods
        for service in data["services"].values():
            moved = []
            for entry in service["pods"]:
                address = entry if isinstance(entry, str) else entry["address"]
                host = address.rsplit(":", 1)[0]
                moved.append(f"{host}:{port}" if isinstance(entry, str) else dict(entry, address=f"{host}:{port}"))
                port += 1
            service["pods"] = moved
    path = Path(directory) / "demo.yaml"
    header = f"# {bundled.name} for `activator demo`, with the addresses given on its command line.\n"
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return path


def run_demo(delay: float = 1.0, listen: str | None = None, admin: str | None = None, pods: int | None = None) -> int:
    setup_logging()
    bundled = demo_config_path()
    if listen is None and admin is None and pods is None:
        return _run(bundled, delay)
    with tempfile.TemporaryDirectory(prefix="activator-demo-") as directory:
        path = moved_config(bundled, directory, listen, admin, pods)
        print(f"activator demo: running {path} (config/demo.yaml with your addresses; edit it to reload)")
        return _run(path, delay)


def _run(path: Path, delay: float) -> int:
    try:
        config = load_config(str(path))
    except ConfigError as error:
        print(f"activator: {error}", file=sys.stderr)
        return 2
    pods = []
    try:
        for service in config.services.values():
            for pod in service.pods:
                server = HttpServer(listen_on(Address(pod.host, pod.port)), DemoPod(pod.address, delay), LimitsConfig())
                server.start()
                pods.append(server)
        runtime = Runtime(config)
        runtime.start()
    except OSError as error:
        print(
            f"activator demo: {error}; is another demo or service using these ports? "
            "(--listen, --admin and --pods move them)",
            file=sys.stderr,
        )
        return 1
    proxy, admin = config.listen, config.admin
    print(
        f"""
activator demo: {len(pods)} pods that take {delay:g}s per request and each accept ONE at a time
(container_concurrency 1), behind the proxy on http://{proxy}/

Try, in another terminal:
  curl -i http://{proxy}/                                   # one request, served by a pod
  for i in $(seq 8); do curl -s http://{proxy}/ & done; wait  # 8 at once: 3 run, 5 queue in order
  curl -s http://{admin}/status                             # services and pods as JSON
  open http://{admin}/ in a browser                         # the status page
  {os.path.basename(sys.argv[0]) or "activator"} status --admin {admin}                 # the same as a table

Ctrl-C to stop.
""",
        flush=True,
    )
    code = runtime.serve_forever()
    for server in pods:
        server.stop(timeout=1)
    return code
