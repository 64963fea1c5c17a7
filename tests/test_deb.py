"""packaging/build-deb.sh: the Debian package, built, linted, installed into a scratch root.

The package is built from ``$ACTIVATOR_BIN`` when it names the one-file executable, else
from a fake executable (a shell script answering ``--version`` and ``check -c FILE`` as
the real one does), which keeps the suite fast. Every package goes to ``tmp_path``,
never to the repository's ``dist/``.

Nothing is installed on this machine: dpkg works on a scratch root (``dpkg --root`` with
``--force-script-chrootless``, so the maintainer scripts run here with ``DPKG_ROOT`` set
to that root), whose dpkg database holds only this machine's libc6 and zlib1g entries so
that the package's ``Depends`` must be met for real. ``systemctl`` and
``deb-systemd-invoke`` are stubs, first in ``PATH``, that record their calls; the
maintainer scripts' logic under a running systemd (``DPKG_ROOT`` empty) is tested by
running the package's scripts with ``$ACTIVATOR_SYSTEMD_RUN_DIR`` standing in for
``/run/systemd/system``, and only with arguments that touch no file.
Needs dpkg-deb and dpkg-shlibdeps (dpkg-dev); the lint test needs lintian.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.binary,
    pytest.mark.skipif(
        not (shutil.which("dpkg-deb") and shutil.which("dpkg-shlibdeps")),
        reason="dpkg-deb and dpkg-shlibdeps are missing (apt-get install dpkg-dev)",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
BUILD_DEB = ROOT / "packaging" / "build-deb.sh"
TREE_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
VERSION_A = f"{TREE_VERSION}-1"  # what build-deb.sh derives from the executable
VERSION_B = f"{TREE_VERSION}-2"  # same contents, a higher version: an upgrade

BIN = Path("usr/bin/activator")
UNIT = Path("lib/systemd/system/activator.service")
CONF = Path("etc/activator/activator.yaml")
ENABLE_LINK = Path("etc/systemd/system/multi-user.target.wants/activator.service")
UNIT_NAME = "activator.service"
TIMEOUT = 120

# Stands in for systemctl and for deb-systemd-invoke: records "NAME ARGS" in
# $STUB_CALLS; `is-active` succeeds when $STUB_UNIT_STATE is "active"; any other call
# succeeds unless $STUB_FAIL names the stub.
STUB = """#!/bin/sh
echo "${0##*/} $*" >>"$STUB_CALLS"
case " $* " in
*" is-active "*) [ "$STUB_UNIT_STATE" = active ] ;;
*) [ "${0##*/}" != "$STUB_FAIL" ] ;;
esac
"""


def fake_executable(path: Path, version: str) -> Path:
    path.write_text(
        "#!/bin/sh\n"
        "# Stands in for the one-file executable: --version, and check -c FILE.\n"
        'case "$1" in\n'
        f"--version) echo 'activator {version}' ;;\n"
        'check) [ "$2" = -c ] && [ -f "$3" ] ;;\n'
        "*) exit 2 ;;\n"
        "esac\n"
    )
    path.chmod(0o755)
    return path


def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL, check=False, **kwargs
    )


def build_deb(executable: Path, output: Path, *options: str) -> Path:
    result = run(["bash", str(BUILD_DEB), "--output", str(output), *options, str(executable)])
    assert result.returncode == 0, result.stderr
    deb = Path(result.stdout.splitlines()[-1])
    assert deb.parent == output and deb.is_file(), result.stdout
    return deb


@pytest.fixture(scope="module")
def executable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    real = os.environ.get("ACTIVATOR_BIN")
    if real:
        return Path(real)
    return fake_executable(tmp_path_factory.mktemp("exe") / "activator", TREE_VERSION)


@pytest.fixture(scope="module")
def deb_a(executable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deb(executable, tmp_path_factory.mktemp("deb-a"))


@pytest.fixture(scope="module")
def deb_b(executable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deb(executable, tmp_path_factory.mktemp("deb-b"), "--version", VERSION_B)


def dpkg_deb(*args: str) -> str:
    result = run(["dpkg-deb", *args])
    assert result.returncode == 0, result.stderr
    return result.stdout


def package_files(deb: Path) -> dict[str, tarfile.TarInfo]:
    """The data archive's members, by path without the leading "./"."""
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return {member.name.removeprefix("./"): member for member in archive.getmembers() if member.name != "./"}


def package_file(deb: Path, path: Path) -> bytes:
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        extracted = archive.extractfile(f"./{path}")
        assert extracted is not None, path
        return extracted.read()


def architecture() -> str:
    return run(["dpkg", "--print-architecture"]).stdout.strip()


def host_glibc_version() -> str:
    version = run(["dpkg-query", "-W", "-f=${Version}", "libc6"]).stdout
    return version.split("-")[0]


# --------------------------------------------------------------------------- the package


def test_control_fields(deb_a: Path, executable: Path) -> None:
    assert deb_a.name == f"activator_{VERSION_A}_{architecture()}.deb"
    fields = dict(
        line.split(": ", 1) for line in dpkg_deb("--field", str(deb_a), "Package", "Version", "Section").splitlines()
    )
    assert fields == {"Package": "activator", "Version": VERSION_A, "Section": "net"}
    assert dpkg_deb("--field", str(deb_a), "Priority").strip() == "optional"
    assert "@" in dpkg_deb("--field", str(deb_a), "Maintainer")
    assert dpkg_deb("--field", str(deb_a), "Architecture").strip() == architecture()

    # glibc at the floor of the machine that built it; with the real executable, the zlib
    # its bootloader links to (dpkg-shlibdeps); nothing else: the rest is inside it.
    depends = [d.strip() for d in dpkg_deb("--field", str(deb_a), "Depends").split(",")]
    assert depends[0] == f"libc6 (>= {host_glibc_version()})"
    others = {re.sub(r" \(.*\)$", "", d) for d in depends[1:]}
    assert others == ({"zlib1g"} if os.environ.get("ACTIVATOR_BIN") else set())

    description = dpkg_deb("--field", str(deb_a), "Description").splitlines()
    assert description[0].startswith("request-throttling reverse proxy")
    assert len(description) > 3 and all(line.startswith(" ") for line in description[1:])

    assert dpkg_deb("--info", str(deb_a), "conffiles").split() == [f"/{CONF}"]
    assert int(dpkg_deb("--field", str(deb_a), "Installed-Size")) >= executable.stat().st_size // 1024


def test_contents_modes_and_owners(deb_a: Path, executable: Path) -> None:
    files = package_files(deb_a)
    regular = {path: member for path, member in files.items() if member.isfile()}
    assert set(regular) == {
        str(BIN),
        str(UNIT),
        str(CONF),
        "usr/share/man/man1/activator.1.gz",
        "usr/share/doc/activator/copyright",
        "usr/share/doc/activator/changelog.Debian.gz",
        "usr/share/lintian/overrides/activator",
    }
    assert all(member.isdir() for path, member in files.items() if path not in regular)
    for path, member in files.items():
        assert (member.uname, member.gname, member.uid, member.gid) == ("root", "root", 0, 0), path
        expected_mode = 0o755 if member.isdir() or path == str(BIN) else 0o644
        assert stat.S_IMODE(member.mode) == expected_mode, path

    # md5sums covers every file but the conffile, whose sum dpkg keeps itself.
    md5sums = dict(reversed(line.split("  ", 1)) for line in dpkg_deb("--info", str(deb_a), "md5sums").splitlines())
    assert set(md5sums) == set(regular) - {str(CONF)}
    assert md5sums[str(BIN)] == hashlib.md5(executable.read_bytes()).hexdigest()

    assert package_file(deb_a, BIN) == executable.read_bytes()
    assert package_file(deb_a, CONF) == (ROOT / "config" / "example.yaml").read_bytes()
    changelog = gzip.decompress(package_file(deb_a, Path("usr/share/doc/activator/changelog.Debian.gz"))).decode()
    assert changelog.startswith(f"activator ({VERSION_A}) unstable; urgency=medium\n")


def test_unit_is_the_repository_unit_run_from_usr_bin(deb_a: Path) -> None:
    packaged = package_file(deb_a, UNIT).decode().splitlines()
    assert "ExecStart=/usr/bin/activator run -c /etc/activator/activator.yaml" in packaged
    assert not any("/usr/local/" in line for line in packaged)
    # The repository's unit, line for line (derived, not forked), but for the executable's
    # path, the comment saying where this copy is installed, and the man page.
    source = (ROOT / "systemd" / "activator.service").read_text().splitlines()
    assert source[1].startswith("# Installed by ")
    expected = [line.replace("/usr/local/bin/activator", "/usr/bin/activator") for line in source]
    expected[1] = f"# Installed by the activator Debian package as /{UNIT}."
    description = next(i for i, line in enumerate(expected) if line.startswith("Description="))
    expected.insert(description + 1, "Documentation=man:activator(1)")
    assert packaged == expected


def test_build_is_reproducible(deb_a: Path, executable: Path, tmp_path: Path) -> None:
    again = build_deb(executable, tmp_path)
    assert again.read_bytes() == deb_a.read_bytes()
    last_commit = run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"]).stdout.strip()
    if last_commit:
        assert {member.mtime for member in package_files(deb_a).values()} == {int(last_commit)}


def test_lintian_reports_no_error(deb_a: Path) -> None:
    if not shutil.which("lintian"):
        pytest.skip("lintian is not installed (apt-get install lintian); .ci/run installs it")
    result = run(["lintian", "--fail-on", "error", "--info", str(deb_a)])
    errors = [line for line in result.stdout.splitlines() if line.startswith("E:")]
    assert errors == [], result.stdout
    assert result.returncode == 0, result.stdout + result.stderr


def test_build_refuses_an_executable_of_another_version(tmp_path: Path) -> None:
    stale = fake_executable(tmp_path / "activator", "0.0.1-old")
    result = run(["bash", str(BUILD_DEB), "--output", str(tmp_path), str(stale)])
    assert result.returncode == 1
    assert f"version 0.0.1-old but pyproject.toml says {TREE_VERSION}" in result.stderr
    assert list(tmp_path.glob("*.deb")) == []


def test_build_rejects_bad_usage(tmp_path: Path) -> None:
    assert run(["bash", str(BUILD_DEB), "--output", str(tmp_path), str(tmp_path / "nothing")]).returncode == 1
    assert run(["bash", str(BUILD_DEB), "--bogus"]).returncode == 2
    assert run(["bash", str(BUILD_DEB), "a", "b"]).returncode == 2
    assert run(["bash", str(BUILD_DEB), "--version"]).returncode == 2


# --------------------------------------------------------------------------- scratch root


@dataclass
class ScratchRoot:
    """A directory with its own dpkg database, and the environment dpkg runs in."""

    root: Path
    env: dict[str, str]
    calls: Path

    def dpkg(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run(
            [
                "dpkg",
                f"--root={self.root}",
                f"--log={self.root.parent / 'dpkg.log'}",  # not this machine's /var/log
                "--force-script-chrootless",
                "--force-not-root",  # root is not needed for a scratch root
                *args,
            ],
            env=self.env,
        )

    def status(self) -> str:
        result = run(["dpkg-query", f"--root={self.root}", "-W", "-f=${Status} ${Version}", "activator"])
        return result.stdout if result.returncode == 0 else "not known"

    def systemd_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


def stub_path(directory: Path) -> Path:
    directory.mkdir()
    for name in ("systemctl", "deb-systemd-invoke"):
        (directory / name).write_text(STUB)
        (directory / name).chmod(0o755)
    return directory


@pytest.fixture
def scratch(tmp_path: Path) -> ScratchRoot:
    root = tmp_path / "root"
    admin = root / "var" / "lib" / "dpkg"
    for sub in ("info", "updates"):
        (admin / sub).mkdir(parents=True)
    (admin / "available").touch()
    # This machine's libc6 and zlib1g, as installed packages (without their files).
    stanzas = run(["dpkg-query", "-s", "libc6", "zlib1g"])
    assert stanzas.returncode == 0, stanzas.stderr
    (admin / "status").write_text(stanzas.stdout)
    for name in re.findall(r"^Package: (\S+)$", stanzas.stdout, re.MULTILINE):
        (admin / "info" / f"{name}:{architecture()}.list").touch()

    # A systemd that looks alive: only DPKG_ROOT may keep the scripts from calling it.
    systemd_run_dir = tmp_path / "run-systemd-system"
    systemd_run_dir.mkdir()
    stubs = stub_path(tmp_path / "stubs")
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "ACTIVATOR_SYSTEMD_RUN_DIR": str(systemd_run_dir),
        "STUB_CALLS": str(tmp_path / "systemd-calls"),
        "STUB_UNIT_STATE": "active",
    }
    return ScratchRoot(root=root, env=env, calls=tmp_path / "systemd-calls")


def test_install_upgrade_remove_purge(scratch: ScratchRoot, deb_a: Path, deb_b: Path, executable: Path) -> None:
    root = scratch.root
    host_enable_link = Path("/") / ENABLE_LINK
    host_had_link = host_enable_link.is_symlink()

    # Install A: files in place, the service enabled by postinst (within the root).
    result = scratch.dpkg("--install", str(deb_a))
    assert result.returncode == 0, result.stdout + result.stderr
    assert scratch.status() == f"install ok installed {VERSION_A}"
    assert (root / BIN).read_bytes() == executable.read_bytes()
    assert stat.S_IMODE((root / BIN).stat().st_mode) == 0o755
    assert stat.S_IMODE((root / UNIT).stat().st_mode) == 0o644
    assert (root / CONF).read_bytes() == (ROOT / "config" / "example.yaml").read_bytes()
    assert os.readlink(root / ENABLE_LINK) == f"/{UNIT}"
    checked = run([str(root / BIN), "check", "-c", str(root / CONF)])
    assert checked.returncode == 0, checked.stderr
    # Every file as packaged: md5sums and the conffile's sum (no output is a pass).
    verify = scratch.dpkg("--verify", "activator")
    assert (verify.returncode, verify.stdout) == (0, ""), verify.stderr

    # The operator edits the config and disables the service; upgrade to B.
    edited = (root / CONF).read_text() + "# edited by the operator\n"
    (root / CONF).write_text(edited)
    (root / ENABLE_LINK).unlink()
    result = scratch.dpkg("--install", str(deb_b))
    assert result.returncode == 0, result.stdout + result.stderr
    assert scratch.status() == f"install ok installed {VERSION_B}"
    assert (root / CONF).read_text() == edited
    assert sorted(p.name for p in (root / CONF).parent.iterdir()) == ["activator.yaml"]  # no .dpkg-dist
    assert not (root / ENABLE_LINK).is_symlink(), "an upgrade re-enabled a disabled service"

    # Enabled again (what `systemctl enable` makes); remove: files go, the config stays.
    (root / ENABLE_LINK).symlink_to(f"/{UNIT}")
    (root / "etc/systemd/system/activator.service.d").mkdir()
    (root / "etc/systemd/system/activator.service.d/override.conf").write_text("[Service]\n")
    result = scratch.dpkg("--remove", "activator")
    assert result.returncode == 0, result.stdout + result.stderr
    assert scratch.status() == f"deinstall ok config-files {VERSION_B}"
    assert not (root / BIN).exists()
    assert not (root / UNIT).exists()
    assert (root / CONF).read_text() == edited

    # The operator keeps the peer secret where the README says (and has a drop-in, above).
    secret = root / CONF.parent / "peer.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    drop_in = root / "etc/systemd/system/activator.service.d/override.conf"

    # Purge: what the package installed or made goes (the config, the enable link); the
    # operator's own files stay, and purge says so.
    result = scratch.dpkg("--purge", "activator")
    assert result.returncode == 0, result.stdout + result.stderr
    assert scratch.status() == "not known"
    assert not (root / CONF).exists()
    assert not (root / ENABLE_LINK).is_symlink()
    assert secret.read_text() == "0123456789abcdef0123456789abcdef\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert drop_in.read_text() == "[Service]\n"
    said = result.stdout + result.stderr
    assert f"kept {root / CONF.parent}" in said and "activator.service.d" in said, said
    admin = root / "var" / "lib" / "dpkg"
    left = sorted(p for p in root.rglob("*") if not p.is_dir() and admin not in p.parents)
    assert left == sorted([secret, drop_in])

    # Without the operator's files, a purge leaves nothing but the dpkg database and
    # empty directories.
    secret.unlink()
    drop_in.unlink()
    result = scratch.dpkg("--install", str(deb_a))
    assert result.returncode == 0, result.stdout + result.stderr
    result = scratch.dpkg("--purge", "activator")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (root / CONF).parent.exists()
    assert not (root / "etc/systemd/system/activator.service.d").exists()
    assert "kept" not in result.stdout + result.stderr
    left = [p for p in root.rglob("*") if not p.is_dir() and admin not in p.parents]
    assert left == []

    # The scripts ran with DPKG_ROOT set: systemd was never called, this machine untouched.
    assert scratch.systemd_calls() == []
    assert host_enable_link.is_symlink() == host_had_link


# --------------------------------------------------------------------------- scripts, live


@pytest.fixture(scope="module")
def scripts(deb_a: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("control")
    shutil.rmtree(directory)
    dpkg_deb("--control", str(deb_a), str(directory))
    return directory


def run_script(
    scripts: Path,
    tmp_path: Path,
    script: str,
    *args: str,
    unit_state: str,
    systemd_running: bool = True,
    fail: bool = False,
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Runs one of the package's maintainer scripts as dpkg would on this machine (DPKG_ROOT
    empty), with the stubs first in PATH; returns its result and the stubs' calls."""
    systemd_run_dir = tmp_path / "run-systemd-system"
    if systemd_running:
        systemd_run_dir.mkdir()
    calls = tmp_path / "systemd-calls"
    env = {
        **os.environ,
        "DPKG_ROOT": "",
        "PATH": f"{stub_path(tmp_path / 'stubs')}:{os.environ['PATH']}",
        "ACTIVATOR_SYSTEMD_RUN_DIR": str(systemd_run_dir),
        "STUB_CALLS": str(calls),
        "STUB_UNIT_STATE": unit_state,
        "STUB_FAIL": "deb-systemd-invoke" if fail else "",
    }
    result = run([str(scripts / script), *args], env=env)
    return result, calls.read_text().splitlines() if calls.exists() else []


RELOAD = "systemctl daemon-reload"
IS_ACTIVE = f"systemctl is-active --quiet {UNIT_NAME}"


@pytest.mark.parametrize(
    ("script", "args", "unit_state", "expected_calls"),
    [
        # An upgrade restarts the service only if it was running.
        (
            "postinst",
            ("configure", VERSION_A),
            "active",
            [RELOAD, IS_ACTIVE, f"deb-systemd-invoke restart {UNIT_NAME}"],
        ),
        ("postinst", ("configure", VERSION_A), "inactive", [RELOAD, IS_ACTIVE]),
        # A failed removal brings back the service that prerm stopped.
        ("postinst", ("abort-remove",), "inactive", [f"deb-systemd-invoke start {UNIT_NAME}"]),
        ("postinst", ("abort-upgrade", VERSION_B), "active", []),
        ("prerm", ("remove",), "active", [f"deb-systemd-invoke stop {UNIT_NAME}"]),
        # An upgrade does not stop it: postinst restarts it.
        ("prerm", ("upgrade", VERSION_B), "active", []),
        ("postrm", ("remove",), "inactive", [RELOAD]),
        ("postrm", ("upgrade", VERSION_B), "inactive", []),
    ],
)
def test_scripts_under_a_running_systemd(
    scripts: Path, tmp_path: Path, script: str, args: tuple[str, ...], unit_state: str, expected_calls: list[str]
) -> None:
    result, calls = run_script(scripts, tmp_path, script, *args, unit_state=unit_state)
    assert result.returncode == 0, result.stderr
    assert calls == expected_calls


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("postinst", ("configure", VERSION_A)),
        ("postinst", ("abort-remove",)),
        ("prerm", ("remove",)),
        ("postrm", ("remove",)),
    ],
)
def test_scripts_leave_systemd_alone_when_it_is_not_running(
    scripts: Path, tmp_path: Path, script: str, args: tuple[str, ...]
) -> None:
    result, calls = run_script(scripts, tmp_path, script, *args, unit_state="active", systemd_running=False)
    assert result.returncode == 0, result.stderr
    assert calls == []


def test_a_failed_restart_is_reported_but_leaves_the_package_configured(scripts: Path, tmp_path: Path) -> None:
    result, calls = run_script(scripts, tmp_path, "postinst", "configure", VERSION_A, unit_state="active", fail=True)
    assert result.returncode == 0, result.stderr
    assert calls[-1] == f"deb-systemd-invoke restart {UNIT_NAME}"
    assert f"'systemctl restart {UNIT_NAME}' failed" in result.stderr


def test_scripts_reject_unknown_arguments(scripts: Path, tmp_path: Path) -> None:
    for script in ("postinst", "prerm", "postrm"):
        (tmp_path / script).mkdir()
        result, calls = run_script(scripts, tmp_path / script, script, "bogus", unit_state="active")
        assert result.returncode == 1, script
        assert calls == []


def test_install_over_an_install_sh_installation(scratch: ScratchRoot, deb_a: Path) -> None:
    """What the README says to do when packaging/install.sh installed activator before:
    the operator's config (a file no package owns) is kept with --force-confold, and
    postinst warns about install.sh's unit, which would override the package's."""
    root = scratch.root
    (root / CONF).parent.mkdir(parents=True)
    (root / CONF).write_text("listen: 127.0.0.1:8081\n")
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system" / UNIT_NAME).write_text("[Service]\nExecStart=/usr/local/bin/activator run\n")

    result = scratch.dpkg("--force-confold", "--install", str(deb_a))
    assert result.returncode == 0, result.stdout + result.stderr
    assert scratch.status() == f"install ok installed {VERSION_A}"
    assert (root / CONF).read_text() == "listen: 127.0.0.1:8081\n"
    assert f"/etc/systemd/system/{UNIT_NAME} overrides the package's unit" in result.stderr
    assert scratch.systemd_calls() == []

    # Without it, nothing to say.
    (root / "etc/systemd/system" / UNIT_NAME).unlink()
    result = scratch.dpkg("--install", str(deb_a))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "overrides" not in result.stderr
