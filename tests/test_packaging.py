"""packaging/: install.sh into a scratch root, and the build's module excludes.

install.sh runs with DESTDIR, so it touches nothing outside tmp_path and never calls
systemctl. The built executable itself is tested end to end by the e2e tests
(ACTIVATOR_BIN); here we only check that what build.sh leaves out of it is not needed.
"""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "packaging" / "install.sh"
BUILD = ROOT / "packaging" / "build.sh"

BIN = Path("usr/local/bin/activator")
UNIT = Path("etc/systemd/system/activator.service")
CONF = Path("etc/activator/activator.yaml")


def run_install(destdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DESTDIR": str(destdir)}
    return subprocess.run(
        ["bash", str(INSTALL), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def fake_binary(tmp_path: Path) -> Path:
    path = tmp_path / "activator-bin"
    path.write_text("#!/bin/sh\necho 'activator 0.0.0'\n")
    path.chmod(0o755)
    return path


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under root: mode, mtime and content."""
    result = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            st = path.stat()
            result[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, path.read_bytes())
    return result


def test_install_into_destdir(tmp_path: Path, fake_binary: Path) -> None:
    dest = tmp_path / "root"
    result = run_install(dest, str(fake_binary))
    assert result.returncode == 0, result

    assert (dest / BIN).read_bytes() == fake_binary.read_bytes()
    assert stat.S_IMODE((dest / BIN).stat().st_mode) == 0o755
    assert (dest / UNIT).read_bytes() == (ROOT / "systemd" / "activator.service").read_bytes()
    assert stat.S_IMODE((dest / UNIT).stat().st_mode) == 0o644
    assert (dest / CONF).read_bytes() == (ROOT / "config" / "example.yaml").read_bytes()
    # DynamicUser=yes: the service's transient user must be able to read the config.
    assert stat.S_IMODE((dest / CONF).stat().st_mode) == 0o644
    assert stat.S_IMODE((dest / CONF).parent.stat().st_mode) == 0o755
    # No stray temporary files.
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == sorted(
        map(str, (BIN, UNIT, CONF))
    )
    # systemctl is never run with DESTDIR; what it would do is said.
    assert "skipped (DESTDIR is set): systemctl daemon-reload" in result.stdout
    assert "skipped (DESTDIR is set): systemctl enable --now activator.service" in result.stdout


def test_install_is_idempotent_and_keeps_the_config(tmp_path: Path, fake_binary: Path) -> None:
    dest = tmp_path / "root"
    assert run_install(dest, str(fake_binary)).returncode == 0
    before = snapshot(dest)

    again = run_install(dest, str(fake_binary))
    assert again.returncode == 0, again
    assert snapshot(dest) == before
    assert "installed" not in again.stdout

    # An operator's configuration is never overwritten, even with a new binary.
    (dest / CONF).write_text("listen: 0.0.0.0:80\n")
    fake_binary.write_text("#!/bin/sh\necho 'activator 0.0.1'\n")
    upgrade = run_install(dest, str(fake_binary))
    assert upgrade.returncode == 0, upgrade
    assert (dest / CONF).read_text() == "listen: 0.0.0.0:80\n"
    assert (dest / BIN).read_bytes() == fake_binary.read_bytes()
    assert f"installed {dest / BIN}" in upgrade.stdout


def test_install_warns_about_an_unreadable_config(tmp_path: Path, fake_binary: Path) -> None:
    dest = tmp_path / "root"
    (dest / CONF).parent.mkdir(parents=True)
    (dest / CONF).write_text("services: {}\n")
    (dest / CONF).chmod(0o600)
    result = run_install(dest, str(fake_binary))
    assert result.returncode == 0, result
    assert "not readable by others" in result.stdout
    assert stat.S_IMODE((dest / CONF).stat().st_mode) == 0o600  # not ours to change


def test_uninstall_keeps_the_config_unless_purged(tmp_path: Path, fake_binary: Path) -> None:
    dest = tmp_path / "root"
    assert run_install(dest, str(fake_binary)).returncode == 0

    result = run_install(dest, "--uninstall")
    assert result.returncode == 0, result
    assert not (dest / BIN).exists()
    assert not (dest / UNIT).exists()
    assert (dest / CONF).exists()
    assert "skipped (DESTDIR is set): systemctl disable --now activator.service" in result.stdout

    # Again: nothing left to remove, still fine.
    assert run_install(dest, "--uninstall").returncode == 0

    purge = run_install(dest, "--uninstall", "--purge")
    assert purge.returncode == 0, purge
    assert not (dest / CONF).parent.exists()


def test_install_refuses_a_missing_binary(tmp_path: Path) -> None:
    result = run_install(tmp_path / "root", str(tmp_path / "nothing-here"))
    assert result.returncode == 1
    assert "no executable at" in result.stderr
    assert not (tmp_path / "root" / UNIT).exists()


def test_install_rejects_bad_usage(tmp_path: Path) -> None:
    assert run_install(tmp_path / "root", "--bogus").returncode == 2
    assert run_install(tmp_path / "root", "--purge").returncode == 1
    assert run_install(tmp_path / "root", "a", "b").returncode == 2


# --------------------------------------------------------------------------- build


def build_excludes() -> list[str]:
    result = subprocess.run(["bash", str(BUILD), "--print-excludes"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result
    return result.stdout.split()


def test_build_excludes_are_the_expected_ones() -> None:
    excludes = build_excludes()
    assert {"gevent.tests", "gevent.testing", "setuptools", "pkg_resources", "tkinter"} <= set(excludes)


def test_the_app_runs_without_the_excluded_modules() -> None:
    """Import everything the binary runs with the build's excludes made unimportable.

    A new import of, say, ``unittest`` or ``pkg_resources`` in activator (or in a library
    it uses) fails here rather than in the frozen executable on a VM.
    """
    excludes = build_excludes()
    program = textwrap.dedent(
        """
        import sys
        EXCLUDED = set(sys.argv[1:])

        class Block:
            def find_spec(self, name, path=None, target=None):
                parts = name.split(".")
                for i in range(1, len(parts) + 1):
                    if ".".join(parts[:i]) in EXCLUDED:
                        raise ModuleNotFoundError(f"{name} is excluded from the build")
                return None

        sys.meta_path.insert(0, Block())
        for name in list(sys.modules):
            if name.split(".")[0] in EXCLUDED or name in EXCLUDED:
                del sys.modules[name]

        # What packaging/entry.py does first.
        from gevent import monkey
        monkey.patch_all()

        import importlib, pkgutil
        import activator
        for info in pkgutil.walk_packages(activator.__path__, "activator."):
            if info.name.rsplit(".", 1)[-1] != "__main__":  # it would run the CLI
                importlib.import_module(info.name)

        # What the shell uses lazily, beyond module-level imports.
        for name in ("gevent.pool", "gevent.queue", "gevent.event",
                     "gevent.lock", "gevent.threadpool", "gevent.subprocess",
                     "gevent.server", "gevent.timeout", "gevent.signal", "gevent.ssl",
                     "falcon", "yaml", "statsd", "httptools", "h2.connection", "prometheus_client",
                     "http.client", "json", "argparse", "logging.handlers"):
            importlib.import_module(name)
        import gevent, gevent.socket, yaml
        assert "libev" in type(gevent.get_hub().loop).__module__
        gevent.socket.getaddrinfo("localhost", 80)
        yaml.load("a: 1", Loader=yaml.CSafeLoader)
        leaked = sorted(n for n in sys.modules if n.split(".")[0] in EXCLUDED or n in EXCLUDED)
        assert not leaked, leaked
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program, *excludes],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_entry_script_patches_before_anything_else() -> None:
    tree = ast.parse((ROOT / "packaging" / "entry.py").read_text())
    body = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    assert ast.unparse(body[0]) == "from gevent import monkey"
    assert ast.unparse(body[1]) == "monkey.patch_all()"
    assert any("activator.cli" in ast.unparse(node) for node in body[2:])


def test_build_script_is_valid_bash() -> None:
    for script in (BUILD, INSTALL):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
