"""The command line: run, check, demo, status, --version.

Exit codes (SPEC.md): 0 clean exit, 1 runtime failure, 2 bad configuration or usage.
The config path is ``-c``, else ``$ACTIVATOR_CONFIG``, else
``/etc/activator/activator.yaml``. ``activator status --watch`` redraws the table every
``--interval`` seconds (in place on a terminal: clear and home; plain blocks one after
the other otherwise) until Ctrl-C or SIGTERM, which end it with exit code 0.

``activator status`` finds the admin API at ``--admin``, else in the config file: a file
named by ``-c`` or ``$ACTIVATOR_CONFIG`` that cannot be read, or that turns the admin API
off (``admin: null``), is an error (exit 2, naming the file), never a silent fall back;
only when no file is named and the default one does not exist is ``127.0.0.1:9090``
assumed.
"""

import gevent
from gevent import monkey

# Greenlets do not record who spawned them and from where (a stack extracted per spawn:
# CPU per connection, and memory each open connection keeps): nothing here reads it.
gevent.config.track_greenlet_tree = False
monkey.patch_all()

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from . import __version__
from .core.errors import ConfigError
from .ops.statustext import format_status

DEFAULT_CONFIG = "/etc/activator/activator.yaml"
DEFAULT_ADMIN = "127.0.0.1:9090"


def config_path(given: str | None) -> str:
    return given or os.environ.get("ACTIVATOR_CONFIG") or DEFAULT_CONFIG


def cmd_run(args: argparse.Namespace) -> int:
    """One activator process; with ``workers: N > 1`` the supervisor of N workers (a
    worker is this same command, started by the supervisor with its sockets)."""
    from .ops.logs import fatal, setup_logging
    from .process.configfile import load_config
    from .process.server import run
    from .process.workersockets import WorkerSockets

    setup_logging()
    try:
        config = load_config(config_path(args.config))
    except ConfigError as error:
        fatal(f"activator: {error}")
        return 2
    worker = WorkerSockets.from_env()
    if worker is None and config.workers > 1:
        from .process.workers import Supervisor

        try:
            supervisor = Supervisor(config)
        except OSError as error:  # a port taken: one line naming the address (``sockets.CannotListen``)
            fatal(f"activator: {error}")
            return 1
        return supervisor.run()
    return run(config, worker)


def cmd_check(args: argparse.Namespace) -> int:
    from .core.config import describe_config, diff_configs
    from .core.topology import Topology
    from .front.tls import load_context
    from .process.configfile import load_config

    try:
        config = load_config(config_path(args.config))
        old = load_config(args.against) if args.against else None
        if config.tls is not None:
            load_context(config.tls, config.path)
    except ConfigError as error:
        print(f"activator: {error}", file=sys.stderr)
        return 2
    print(f"{config.path}: valid")
    print(describe_config(config))
    if config.activators is not None:
        topology = Topology(config, 0.0)
        me = config.activators.self_name
        print(f"\nthis activator ({me}) owns:")
        for name, service in config.services.items():
            owned = topology.owned_slots(service)
            total = sum(owned.values()) if owned is not None else None
            cc = service.container_concurrency
            if cc == 0:
                print(f"  {name}: every pod (container_concurrency 0, not divided)")
            else:
                all_slots = cc * sum(1 for p in service.pods if not p.drain)
                forward = topology.forward_target(name) if not total else None
                print(
                    f"  {name}: {total} of {all_slots} slots"
                    + (f" (forwards its requests to {forward.address})" if forward else "")
                    + "".join(f"\n    {a}: {n}" for a, n in sorted((owned or {}).items()) if n)
                )
    if old is not None:
        diff = diff_configs(old, config)
        print(f"\nchanges from {old.path}:")
        print(diff.describe() if not diff.is_empty() else "  (none)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .process.demo import run_demo

    return run_demo(delay=args.delay, listen=args.listen, admin=args.admin, pods=args.pods)


def fetch_status(admin: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{admin}/status", timeout=5) as response:
        status: dict[str, Any] = json.loads(response.read())
        return status


def admin_address(given: str | None, config: str | None) -> str:
    """Where ``activator status`` reads from (see the module docstring); raises ConfigError."""
    if given is not None:
        return given
    named = config or os.environ.get("ACTIVATOR_CONFIG")
    path = config_path(config)
    if not named and not os.path.exists(path):
        return DEFAULT_ADMIN
    from .process.configfile import load_config

    loaded = load_config(path)
    if loaded.admin is None:
        raise ConfigError(
            "the admin API is off (admin: null); give its address with --admin HOST:PORT", filename=path, key="admin"
        )
    return str(loaded.admin)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        admin = admin_address(args.admin, args.config)
    except ConfigError as error:
        print(f"activator: {error}", file=sys.stderr)
        return 2
    if args.watch:
        return watch_status(admin, args.interval, args.json)
    try:
        status = fetch_status(admin)
    except (OSError, urllib.error.URLError, ValueError) as error:
        print(f"activator: cannot read status from {admin}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


#: Clear the screen and go home (a terminal's "clear").
CLEAR = "\x1b[H\x1b[2J"


def watch_status(admin: str, interval: float, as_json: bool) -> int:
    """``status --watch``: the table again every ``interval`` seconds until Ctrl-C (or
    SIGTERM): exit 0. A status that cannot be read is said in place of the table, and
    tried again."""
    import gevent
    from gevent.event import Event

    stop = Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        gevent.signal_handler(signum, stop.set)
    out = sys.stdout
    redraw = out.isatty()
    try:
        while not stop.is_set():
            stamp = time.strftime("%H:%M:%S")
            try:
                status = fetch_status(admin)
                text = json.dumps(status, indent=2) if as_json else format_status(status)
            except (OSError, urllib.error.URLError, ValueError) as error:
                text = f"activator: cannot read status from {admin}: {error}"
            header = f"every {interval:g}s from {admin}, at {stamp} (Ctrl-C to stop)"
            out.write((CLEAR if redraw else "") + header + "\n" + text + "\n" + ("" if redraw else "\n"))
            out.flush()
            stop.wait(interval)
    except (KeyboardInterrupt, BrokenPipeError):  # Ctrl-C; the reader went away (``| head``)
        pass
    return 0


def _bounded(convert: type[int] | type[float], what: str, low: float, high: float, unit: str = "") -> Any:
    """An argparse ``type``: ``text`` converted, within ``low..high``, else a clear error."""

    def parse(text: str) -> int | float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low:g}..{high:g}{unit}, got {text}")
        return value

    return parse


_port = _bounded(int, "a port number", 1, 65535)
_interval = _bounded(float, "a number of seconds", 0.1, 3600, " seconds")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="activator", description="A request-throttling reverse proxy.")
    top.add_argument("--version", action="version", version=f"activator {__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the proxy")
    run.add_argument("-c", "--config", help=f"config file (default $ACTIVATOR_CONFIG or {DEFAULT_CONFIG})")
    run.set_defaults(func=cmd_run)
    check = sub.add_parser("check", help="validate a config file and print what it would serve")
    check.add_argument("-c", "--config", help="config file to check")
    check.add_argument("--against", metavar="OLD", help="print the diff a reload from OLD would apply")
    check.set_defaults(func=cmd_check)
    demo = sub.add_parser("demo", help="run demo pods and the proxy on loopback")
    demo.add_argument(
        "--delay", type=float, default=1.0, metavar="S", help="seconds each demo pod takes per request (default 1)"
    )
    demo.add_argument("--listen", metavar="HOST:PORT", help="the proxy's address (default 127.0.0.1:8080)")
    demo.add_argument("--admin", metavar="HOST:PORT", help="the admin API's address (default 127.0.0.1:9090)")
    demo.add_argument(
        "--pods", type=_port, metavar="PORT", help="the first of the demo pods' consecutive ports (default 8001)"
    )
    demo.set_defaults(func=cmd_demo)
    status = sub.add_parser("status", help="show a running instance's services and pods")
    status.add_argument(
        "--admin",
        metavar="HOST:PORT",
        help=f"admin address (default: the config file's; {DEFAULT_ADMIN} without a file named or a default one)",
    )
    status.add_argument("-c", "--config", help="config file to read the admin address from")
    status.add_argument("--json", action="store_true", help="print the raw /status JSON")
    status.add_argument("-w", "--watch", action="store_true", help="refresh until Ctrl-C")
    status.add_argument(
        "--interval", type=_interval, default=2.0, metavar="S", help="seconds between refreshes (default 2)"
    )
    status.set_defaults(func=cmd_status)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 0
