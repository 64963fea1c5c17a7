"""Reading config files: line numbers in messages, duplicate keys, YAML errors, unreadable
files, anchors and merge keys, the bundled example and demo files, and a fuzz test that
any text gives a Config or a ConfigError."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from activator.core.config import Address, Config, PodConfig, ProbeConfig, describe_config
from activator.core.errors import ConfigError
from activator.process.configfile import load_config, parse_config_text

REPO = Path(__file__).resolve().parent.parent

# Line numbers matter in this file: line 14 holds the pod with a bad port.
GOOD = """\
listen: 0.0.0.0:8080
admin: 127.0.0.1:9090
limits:
  client_timeout: 60s
services:
  api:
    hosts: [api.example.com]
    container_concurrency: 1
    probe:
      path: /healthz
    pods:
      - 10.0.1.5:8000
      - {address: 10.0.1.6:8000, drain: true}
      - 10.0.1.7:8000
  web:
    hosts:
      - web.example.com
    pods: []
"""


def write(tmp_path: Path, text: str, name: str = "activator.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def error_of(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse_config_text(text, "activator.yaml")
    return caught.value


def test_a_good_file_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    assert config.path == str(tmp_path / "activator.yaml")
    assert list(config.services) == ["api", "web"]
    assert config.services["api"].pods[1] == PodConfig("10.0.1.6:8000", "10.0.1.6", 8000, drain=True)
    assert config.services["api"].probe == ProbeConfig()


def test_bad_port_names_file_line_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("10.0.1.7:8000", "10.0.1.7:70000"))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}:14: services.api.pods[2]: port must be 1..65535, got 70000"
    assert caught.value.line == 14


def test_the_filename_is_kept_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, GOOD.replace("10.0.1.7:8000", "10.0.1.7:70000"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^activator\.yaml:14: services\.api\.pods\[2\]: port"):
        load_config("activator.yaml")
    with pytest.raises(ConfigError, match=r"^\./activator\.yaml:14: "):
        load_config("./activator.yaml")


# (id, replaced text, replacement, expected line, expected key)
LINES: list[tuple[str, str, str, int, str]] = [
    ("top-level-key", "listen: 0.0.0.0:8080", "listen: 0.0.0.0", 1, "listen"),
    ("nested-key", "client_timeout: 60s", "client_timeout: 0", 4, "limits.client_timeout"),
    ("unknown-key", "container_concurrency: 1", "container_concurency: 1", 8, "services.api.container_concurency"),
    ("flow-mapping-item", "{address: 10.0.1.6:8000,", "{address: 10.0.1.6:0,", 13, "services.api.pods[1].address"),
    ("flow-list-item", "[api.example.com]", "[api.example.com, 'a b']", 7, "services.api.hosts[1]"),
    ("block-list-item", "- web.example.com", "- api.example.com", 17, "services.web.hosts[0]"),
    ("probe-field", "path: /healthz", "path: healthz", 10, "services.api.probe.path"),
    ("missing-required-key-uses-parent", "    hosts:\n      - web.example.com\n", "", 15, "services.web.hosts"),
    ("pod-in-two-services", "pods: []", "pods: [10.0.1.5:8000]", 18, "services.web.pods[0]"),
]


@pytest.mark.parametrize(("old", "new", "line", "key"), [c[1:] for c in LINES], ids=[c[0] for c in LINES])
def test_error_lines(old: str, new: str, line: int, key: str) -> None:
    assert old in GOOD
    error = error_of(GOOD.replace(old, new))
    assert (error.line, error.key) == (line, key)
    assert str(error).startswith(f"activator.yaml:{line}: {key}: ")


# -- duplicate keys ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("listen: 0.0.0.0:8080\nworkers: 1\nlisten: 0.0.0.0:8081\n", 3, "listen"),
        (
            GOOD.replace(
                "    container_concurrency: 1\n", "    container_concurrency: 1\n    container_concurrency: 2\n"
            ),
            9,
            "services.api.container_concurrency",
        ),
        (GOOD.replace("  web:", "  api:"), 15, "services.api"),
        (GOOD.replace("drain: true}", "drain: true, drain: false}"), 13, "services.api.pods[1].drain"),
        ("services: {}\nlimits: {max_connections: 1, max_connections: 2}\n", 2, "limits.max_connections"),
    ],
    ids=["top-level", "service-setting", "service-name", "flow-mapping", "same-line"],
)
def test_duplicate_keys_are_errors(text: str, line: int, key: str) -> None:
    error = error_of(text)
    assert (error.line, error.key) == (line, key)
    assert "duplicate key (first given on line" in error.detail


def test_keys_equal_after_yaml_resolution_are_duplicates() -> None:
    error = error_of("services: {}\n1: a\n0x1: b\n")
    assert error.line == 3
    assert "duplicate key" in error.detail


# -- YAML errors, tags, anchors ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("listen: 0.0.0.0:8080\nadmin: a: b\n", 2, "mapping values are not allowed"),
        ("services:\n  api:\n    hosts: [a\n", 4, "invalid YAML"),
        ("listen: 'x\n\n\n", 4, "while scanning a quoted scalar on line 1"),
        ("services:\n  api:\n   hosts: [a]\n  - b\n", 4, "invalid YAML"),
        ("a: 1\n---\nb: 2\n", 2, "another document"),
        ("listen: *nowhere\n", 1, "undefined alias"),
        ("listen: 1\nadmin: \x00\n", 2, "control characters are not allowed (character #x0000)"),
        ("listen: ü\nadmin: ü\nworkers: \x01\n", 3, "control characters"),
        ("\tlisten: 1\n", 1, "invalid YAML"),
    ],
    ids=[
        "mapping-values",
        "unclosed-flow",
        "unclosed-quote",
        "bad-indent",
        "two-documents",
        "undefined-alias",
        "nul",
        "control-after-multibyte",
        "tab",
    ],
)
def test_yaml_syntax_errors(text: str, line: int, fragment: str) -> None:
    error = error_of(text)
    assert error.line == line
    assert fragment in error.detail
    assert str(error).startswith(f"activator.yaml:{line}: ")


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("services: {}\nworkers: !!int abc\n", 2, "cannot read the value 'abc'"),
        ("services: {}\naccess_log: !!bool maybe\n", 2, "cannot read the value"),
        ("services: {}\ngrace_period: !!timestamp soon\n", 2, "cannot read the value"),
        ("services: {}\nworkers: !custom 1\n", 2, "could not determine a constructor for the tag '!custom'"),
        ("services: {}\nworkers: !!python/object:os.system ls\n", 2, "could not determine a constructor"),
        ("services: {}\nlimits: !!set {a, b}\n", 2, "unsupported tag tag:yaml.org,2002:set"),
        ("services: {}\nlimits: !!omap [a: 1]\n", 2, "unsupported tag"),
        ("services: {}\n[a]: 1\n", 2, "a key must be a plain value"),
        ("services: {}\nlimits: &l {x: *l}\n", 2, "an alias refers to a node that contains it"),
        ("services: {}\nlimits: {<<: 5}\n", 2, "<< (merge) needs a mapping"),
        ("services: {}\ngrace_period: 2001-12-14\n", 2, "got a date"),
        ("services:\n  api:\n    hosts: [a]\n    queue_depth: 10\n    queue_depth: 11\n", 5, "duplicate key"),
    ],
    ids=[
        "bad-int",
        "bad-bool",
        "bad-timestamp",
        "unknown-tag",
        "python-tag",
        "set-tag",
        "omap-tag",
        "list-key",
        "recursive-alias",
        "bad-merge",
        "date",
        "duplicate",
    ],
)
def test_values_yaml_cannot_build_are_config_errors(text: str, line: int, fragment: str) -> None:
    error = error_of(text)
    assert error.line == line
    assert fragment in error.detail


def test_deep_nesting_is_a_config_error() -> None:
    error = error_of("services: " + "[" * 200 + "]" * 200 + "\n")
    assert error.line == 1


def test_anchors_aliases_and_merge_keys() -> None:
    config = parse_config_text(
        textwrap.dedent(
            """\
            x-defaults: &defaults
              container_concurrency: 2
              queue_timeout: 5s
              probe: &probe {path: /ready, interval: 2s}
            """
        )
        .replace("x-defaults: &defaults\n", "services:\n  base: &defaults\n    hosts: [base]\n", 1)
        # The anchored service is itself a service; the others merge it and override.
        .replace("  container_concurrency: 2", "    container_concurrency: 2")
        .replace("  queue_timeout: 5s", "    queue_timeout: 5s")
        .replace("  probe: &probe", "    probe: &probe")
        + textwrap.indent(
            textwrap.dedent(
                """\
                api:
                  <<: *defaults
                  hosts: [api]
                  container_concurrency: 4
                  pods: [10.0.1.5:8000]
                web:
                  <<: [*defaults]
                  hosts: [web]
                  probe: *probe
                """
            ),
            "  ",
        ),
        "merge.yaml",
    )
    base, api, web = config.services["base"], config.services["api"], config.services["web"]
    assert base.container_concurrency == 2 and base.queue_timeout == 5.0
    assert api.hosts == ("api",) and api.container_concurrency == 4 and api.queue_timeout == 5.0
    assert api.probe == ProbeConfig(path="/ready", interval=2.0)
    assert web.container_concurrency == 2 and web.probe == api.probe


def test_errors_in_merged_values_point_into_the_merged_mapping() -> None:
    text = "services:\n  base: &d\n    hosts: [b]\n    queue_depth: -1\n  api:\n    <<: *d\n    hosts: [a]\n"
    error = error_of(text)
    assert (error.line, error.key) == (4, "services.base.queue_depth")
    error = error_of(text.replace("  base: &d\n    hosts: [b]\n", "  base: &d\n    hosts: [b]\n    hosts: [c]\n"))
    assert error.line == 4 and "duplicate key" in error.detail


def test_merged_keys_are_checked_like_others() -> None:
    text = "defaults: &d {queue_dept: 1}\nservices: {}\n"
    error = error_of(text)
    assert error.key == "defaults"
    text = "services:\n  base: &d {hosts: [b], queue_dept: 1}\n  api:\n    <<: *d\n    hosts: [a]\n"
    error = error_of(text)
    assert (error.line, error.key) == (2, "services.base.queue_dept")


def test_merge_lines_of_a_merged_key() -> None:
    text = "services:\n  api:\n    hosts: [a]\n  web:\n    <<: {hosts: [b],\n         queue_depth: -5}\n"
    error = error_of(text)
    assert (error.line, error.key) == (6, "services.web.queue_depth")


# -- the document and the file -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("", None, "the file is empty"),
        ("# nothing but a comment\n", None, "the file is empty"),
        ("- listen\n", 1, "must be a mapping, got a list"),
        ("\n\njust text\n", 3, "must be a mapping, got string 'just text'"),
    ],
)
def test_the_top_level_must_be_a_mapping(text: str, line: int | None, fragment: str) -> None:
    error = error_of(text)
    assert error.line == line
    assert error.key == ""
    assert fragment in error.detail


def test_an_explicit_empty_mapping_is_a_valid_config() -> None:
    assert parse_config_text("{}\n", "x.yaml") == Config(path="x.yaml")


def test_a_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: cannot read the file: No such file or directory"
    assert caught.value.line is None


def test_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file: Is a directory"):
        load_config(str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    os.chmod(path, 0)
    with pytest.raises(ConfigError, match="cannot read the file: Permission denied"):
        load_config(path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"listen: 0.0.0.0:8080\nservices:\n  caf\xe9: {}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert str(caught.value) == f"{path}:3: the file is not valid UTF-8"


def test_a_byte_order_mark_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert load_config(str(path)).listen == Address("0.0.0.0", 8080)


def test_lone_surrogates_in_text_are_a_config_error() -> None:
    error = error_of("services: {}\nlisten: \ud800\n")
    assert error.line == 2


# -- the bundled files -------------------------------------------------------------


def test_example_yaml_loads_and_listens_on_loopback_only() -> None:
    config = load_config(str(REPO / "config" / "example.yaml"))
    assert config.listen == Address("127.0.0.1", 8080)
    assert config.admin == Address("127.0.0.1", 9090)
    assert config.statsd is not None and config.statsd.address.host == "127.0.0.1"
    assert config.activators is None  # commented out: one VM must not give slots away
    api = config.services["api"]
    assert api.hosts == ("api.example.com",)
    assert (api.container_concurrency, api.queue_depth, api.queue_timeout) == (1, 100, 30.0)
    assert (api.connect_timeout, api.request_timeout, api.drain_timeout) == (2.0, 300.0, 3600.0)
    assert api.probe == ProbeConfig("/healthz", 1.0, 1.0, 1, 3)
    assert [(p.host, p.drain) for p in api.pods] == [("127.0.0.1", False), ("127.0.0.1", True)]


def test_demo_yaml_loads() -> None:
    config = load_config(str(REPO / "config" / "demo.yaml"))
    assert config.listen == Address("127.0.0.1", 8080)
    assert config.admin == Address("127.0.0.1", 9090)
    assert config.access_log is True
    assert list(config.services) == ["demo"]
    demo = config.services["demo"]
    assert demo.hosts == ("*",)
    assert (demo.container_concurrency, demo.queue_depth, demo.queue_timeout) == (1, 20, 10.0)
    assert (demo.connect_timeout, demo.request_timeout) == (1.0, 30.0)
    assert demo.probe == ProbeConfig(path="/healthz", interval=1.0, timeout=1.0)
    assert [p.address for p in demo.pods] == ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]


# -- fuzz --------------------------------------------------------------------------

YAML_PIECES = st.sampled_from(
    [
        "\n",
        "  ",
        "    ",
        "- ",
        ": ",
        ":",
        ",",
        "[",
        "]",
        "{",
        "}",
        "&a ",
        "*a",
        "<<: ",
        "!!int ",
        "!!str ",
        "!x ",
        "? ",
        "|\n",
        ">\n",
        "'",
        '"',
        "#",
        "---\n",
        "...\n",
        "\t",
        "listen",
        "admin",
        "services",
        "api",
        "hosts",
        "pods",
        "probe",
        "limits",
        "statsd",
        "activators",
        "peers",
        "self",
        "drain",
        "address",
        "0.0.0.0:8080",
        "10.0.1.5:8000",
        "[::1]:80",
        "*",
        "30s",
        "null",
        "true",
        "1",
        "-1",
        "1.5",
        ".inf",
        "2001-12-14",
        "1:30",
        "0x1f",
        "~",
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_any_text_gives_a_config_or_a_config_error(text: str) -> None:
    _check_text(text)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(YAML_PIECES, max_size=40).map("".join))
def test_any_yaml_like_text_gives_a_config_or_a_config_error(text: str) -> None:
    _check_text(text)


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=10)
    | st.sampled_from(["0.0.0.0:8080", "10.0.1.5:8000", "30s", "*", "api.example.com"])
)
KEYS = st.sampled_from(
    ["listen", "admin", "workers", "services", "api", "hosts", "pods", "probe", "limits", "address", "drain", "x"]
)
NESTED = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(max_size=6), inner, max_size=4),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, NESTED, max_size=5), st.sampled_from([None, "'", '"', "|", ">"]))
def test_any_nested_data_gives_a_config_or_a_config_error(data: dict[str, object], style: str | None) -> None:
    _check_text(yaml.safe_dump(data, default_style=style, allow_unicode=True))


def _check_text(text: str) -> None:
    try:
        result = parse_config_text(text, "fuzz.yaml")
    except ConfigError as error:
        assert str(error).startswith("fuzz.yaml")
        # YAML also breaks lines at \r, NEL, LS and PS, as str.splitlines does.
        assert error.line is None or 1 <= error.line <= len(text.splitlines()) + 1
    else:
        assert isinstance(result, Config)


PEERS_YAML = """
activators:
  self: vm-a
  secret_file: {path}
  peers: {{vm-a: 10.0.0.1:8080, vm-b: 10.0.0.2:8080}}
"""


def test_the_secret_file_is_read_and_never_shown(tmp_path: Path) -> None:
    secret = tmp_path / "peer.secret"
    secret.write_text("  a-long-enough-secret-value\n")
    config_file = tmp_path / "a.yaml"
    config_file.write_text(PEERS_YAML.format(path=secret))
    config = load_config(str(config_file))
    assert config.activators is not None
    assert config.activators.secret == "a-long-enough-secret-value"
    assert "a-long-enough" not in repr(config) and "a-long-enough" not in describe_config(config)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(None, "cannot read"), ("short\n", "at least 16 characters"), (b"\xff" * 20, "not UTF-8")],
)
def test_a_bad_secret_file_names_the_key(tmp_path: Path, content: str | bytes | None, fragment: str) -> None:
    secret = tmp_path / "peer.secret"
    if isinstance(content, bytes):
        secret.write_bytes(content)
    elif content is not None:
        secret.write_text(content)
    config_file = tmp_path / "a.yaml"
    config_file.write_text(PEERS_YAML.format(path=secret))
    with pytest.raises(ConfigError) as raised:
        load_config(str(config_file))
    assert raised.value.key == "activators.secret_file" and fragment in str(raised.value)
