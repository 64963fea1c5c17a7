"""Hostile YAML against the config loader: a small corpus, and mutations of it.

``tests/test_configfile.py`` already fuzzes the loader with generated text and data.
This module adds what generators rarely reach: files built to hurt (alias and merge
bombs, deep nesting, Python object tags, header and StatsD line injection through
strings, NaN durations, invalid encodings), kept in ``corpus/config/``. Each file must
load to a ``Config`` or fail with a ``ConfigError`` naming the file, quickly; the same
holds for byte-level mutations of them, and for ``activator check`` on each file
(exit 0 or 2, never a traceback).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from activator.core.config import Config
from activator.core.errors import ConfigError
from activator.process.configfile import load_config

CORPUS = Path(__file__).resolve().parent / "corpus" / "config"
FILES = sorted(CORPUS.glob("*.yaml"))
PWNED = Path("/tmp/activator-fuzz-pwned")

#: What each corpus file must give: a Config, or a ConfigError whose message holds
#: the fragment (the key at fault, or the kind of problem).
EXPECTED: dict[str, str | None] = {
    "billion_laughs.yaml": "unknown key",
    "billion_laughs_in_hosts.yaml": "services.api.hosts[0]",
    "billion_laughs_mapping.yaml": "unknown key",
    "bom_crlf_valid.yaml": None,
    "confusable_keys.yaml": "unknown key",
    "deep_flow_nesting.yaml": "nesting depth",
    "deep_mapping_nesting.yaml": "services.api.a",
    "duplicate_keys.yaml": "duplicate key",
    "empty.yaml": "empty",
    "huge_numbers.yaml": "listen",
    "injection_host.yaml": "services.api.hosts[0]",
    "injection_pod_address.yaml": "services.api.pods[0]",
    "injection_probe_path.yaml": "services.api.probe.path",
    "injection_statsd_prefix.yaml": "statsd.prefix",
    "invalid_utf8.yaml": "UTF-8",
    "merge_bomb.yaml": "unknown key",
    "multi_document.yaml": "single document",
    "nan_inf_durations.yaml": "grace_period",
    "nul_byte.yaml": "control characters",
    "python_object_tags.yaml": "unsupported tag",
    "recursive_alias.yaml": "contains it",
    "surrogate_escapes.yaml": "invalid YAML",
    "tab_indentation.yaml": "invalid YAML",
    "unknown_tags.yaml": "unsupported tag",
    "yaml11_scalars.yaml": "services.api.hosts[1]",
    "yaml_2_directive.yaml": "invalid YAML",
}

#: The files also run through ``activator check`` (a process each, so a few): the ones
#: whose error message or summary is most likely to trip the printing.
CLI_FILES = [
    "billion_laughs_in_hosts.yaml",
    "billion_laughs_mapping.yaml",
    "merge_bomb.yaml",
    "bom_crlf_valid.yaml",
    "invalid_utf8.yaml",
    "injection_probe_path.yaml",
    "yaml11_scalars.yaml",
    "huge_numbers.yaml",
]

#: Seconds any one load may take (a guard against exponential blow-ups, not a timing
#: assertion: a correct loader is a thousand times faster).
GUARD_SECONDS = 20


class _TooSlow(Exception):
    pass


@contextlib.contextmanager
def guard(seconds: float = GUARD_SECONDS) -> Iterator[None]:
    """Fail instead of hanging when a load does not finish (SIGALRM, main thread)."""

    def fire(signum: int, frame: object) -> None:
        raise _TooSlow(f"a config load did not finish within {seconds}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def load(path: Path) -> Config | ConfigError:
    """The loader's verdict: a Config, or the ConfigError (anything else propagates)."""
    with guard():
        try:
            return load_config(str(path))
        except ConfigError as error:
            return error


def test_the_corpus_is_small_and_fully_described():
    assert 15 <= len(FILES) <= 40
    assert {f.name for f in FILES} == set(EXPECTED)
    assert set(CLI_FILES) <= set(EXPECTED)
    assert all(f.stat().st_size <= 4096 for f in FILES)


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_hostile_file_gives_a_config_or_a_config_error(path: Path):
    PWNED.unlink(missing_ok=True)
    result = load(path)
    expected = EXPECTED[path.name]
    if expected is None:
        assert isinstance(result, Config), result
        return
    assert isinstance(result, ConfigError), f"{path.name} was accepted: {result}"
    message = str(result)
    assert message.startswith(str(path)), message
    assert expected in message, message
    assert len(message) < 2000, "an error message that expands what it quotes"
    assert not PWNED.exists(), "a YAML tag ran code"


def test_activator_check_on_hostile_files_exits_0_or_2_without_a_traceback():
    env = dict(os.environ)
    env.pop("ACTIVATOR_CONFIG", None)
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    binary = os.environ.get("ACTIVATOR_BIN")
    command = [binary] if binary else [sys.executable, "-m", "activator"]

    def check(path: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
        done = subprocess.run(
            [*command, "check", "-c", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        return path, done

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(check, [CORPUS / name for name in CLI_FILES]))
    for path, done in results:
        output = done.stdout + done.stderr
        assert "Traceback" not in output, f"{path.name}:\n{output}"
        want = 0 if EXPECTED[path.name] is None else 2
        assert done.returncode == want, f"{path.name}: exit {done.returncode}\n{output}"
        if want == 2:
            assert str(path) in done.stderr, done.stderr


# -- mutations -------------------------------------------------------------------------

CORPUS_BYTES = [f.read_bytes() for f in FILES]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(CORPUS_BYTES)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "dup-line", "swap-lines"]))
        n = len(data)
        if kind == "flip" and n:
            data[draw(st.integers(0, n - 1))] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del data[draw(st.integers(0, n)) :]
        elif kind == "insert":
            piece = draw(
                st.sampled_from(
                    [
                        b"*a",
                        b"&a ",
                        b"<<: ",
                        b"!!",
                        b"[",
                        b"{",
                        b"\n  ",
                        b": ",
                        b"- ",
                        b"\t",
                        b"\x00",
                        b"\xff",
                        b"'",
                        b'"',
                        b"\\u",
                        b"---\n",
                        b"1e999",
                    ]
                )
                | st.binary(max_size=8)
            )
            at = draw(st.integers(0, n))
            data[at:at] = piece
        elif kind == "delete" and n:
            at = draw(st.integers(0, n - 1))
            del data[at : at + draw(st.integers(1, 16))]
        elif kind in ("dup-line", "swap-lines"):
            lines = bytes(data).split(b"\n")
            i = draw(st.integers(0, len(lines) - 1))
            j = draw(st.integers(0, len(lines) - 1))
            if kind == "dup-line":
                lines.insert(j, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            data = bytearray(b"\n".join(lines))
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_hostile_files_give_a_config_or_a_config_error(tmp_path_factory, data: bytes):
    path = tmp_path_factory.getbasetemp() / "mutated.yaml"
    path.write_bytes(data)
    PWNED.unlink(missing_ok=True)
    result = load(path)
    if isinstance(result, ConfigError):
        assert str(result).startswith(str(path)), result
        assert len(str(result)) < 5000
    assert not PWNED.exists()
