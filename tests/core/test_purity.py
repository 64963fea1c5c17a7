"""The core stays pure: importing it loads no gevent, falcon, yaml or socket.

Run in a fresh interpreter, so that nothing imported by the test runner (or by
another test) hides a forbidden import.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import activator.core

FORBIDDEN = ("gevent", "falcon", "yaml", "socket")

SCRIPT = """
import importlib, json, pkgutil, sys
import activator.core
names = sorted("activator.core." + m.name for m in pkgutil.iter_modules(activator.core.__path__))
for name in names:
    importlib.import_module(name)
forbidden = %r
loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden or m.split(".")[0] in ("_socket",))
print(json.dumps({"modules": names, "loaded": loaded}))
"""


def core_modules() -> list[str]:
    return sorted("activator.core." + m.name for m in pkgutil.iter_modules(activator.core.__path__))


def test_core_has_the_expected_modules() -> None:
    names = core_modules()
    for expected in ("states", "lb", "throttler", "topology", "config", "errors", "slots"):
        assert f"activator.core.{expected}" in names


def test_core_imports_no_gevent_falcon_yaml_or_socket() -> None:
    root = Path(activator.core.__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT % (FORBIDDEN,)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["modules"] == core_modules()
    assert report["loaded"] == [], f"activator.core pulled in {report['loaded']}"
