"""What the documentation says against what the code does: a test for each promise the
README, the man page and ``config/example.yaml`` make, so that they cannot drift apart.

- The README's command table and ``activator COMMAND --help`` (the real command, run as
  a subprocess) list the same commands and the same options; so does the man page's
  synopsis.
- The defaults the README states for ``status --watch`` are those ``--help`` states.
- Every field of an access-log line is explained in the README's Access log section.
- ``config/example.yaml`` holds every key of the YAML table of the contract (SPEC.md,
  kept beside the repository in ``shared/``), commented out where a live value would
  need files of the operator's (``tls``, ``activators``): a commented-out setting is a
  ``#`` directly followed by its YAML (``#tls:``, ``#  cert: ...``), prose comments have
  a space after the ``#``. Keys of features the contract specifies but the code does not
  implement yet are listed in ``NOT_IMPLEMENTED_YET``; the day the loader accepts one,
  the test fails until it is in the example and out of that list.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import activator_command, child_env

from activator.core.errors import ConfigError
from activator.ops.observe import RequestRecord
from activator.process.configfile import parse_config_text

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAN_PAGE = (ROOT / "packaging" / "debian" / "activator.1").read_text()
EXAMPLE = ROOT / "config" / "example.yaml"
OPTION = re.compile(r"(?<![\w-])--?[a-z][a-z-]*")


def run_help(*command: str) -> str:
    done = subprocess.run(
        [*activator_command(), *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def help_options(text: str) -> list[set[str]]:
    """The options of a ``--help`` text, one set of spellings per option (``-h`` left out)."""
    section = text.split("options:", 1)[1]
    options = []
    for line in section.splitlines():
        flags = re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line)
        if flags:
            spellings = {word for word in OPTION.findall(flags.group(1))}
            if spellings != {"-h", "--help"}:
                options.append(spellings)
    return options


def commands_in_help() -> list[str]:
    found = re.search(r"\{([a-z,]+)\}", run_help())
    assert found is not None
    return found.group(1).split(",")


def readme_command_table() -> dict[str, set[str]]:
    """``{command: options}`` of the README's command table (``--version`` as a command)."""
    rows = re.findall(r"^\| `activator ([^`]+)` \|", README, re.M)
    table: dict[str, set[str]] = {}
    for usage in rows:
        command, _, rest = usage.partition(" ")
        table[command] = set(OPTION.findall(rest))
    return table


def test_the_readme_command_table_is_what_help_says() -> None:
    table = readme_command_table()
    commands = commands_in_help()
    assert set(table) == {*commands, "--version"}, "the table's commands, and --help's"
    assert "--version" in {o for spellings in help_options(run_help()) for o in spellings}
    for command in commands:
        options = help_options(run_help(command))
        shown = table[command]
        for spellings in options:
            assert spellings & shown, f"`activator {command}`: {sorted(spellings)} is in --help, not in the README"
        every = {o for spellings in options for o in spellings}
        assert shown <= every, f"`activator {command}`: the README has {sorted(shown - every)}, --help does not"


def man_synopsis() -> dict[str, set[str]]:
    synopsis = MAN_PAGE.split(".SH SYNOPSIS", 1)[1].split(".SH", 1)[0].replace("\\-", "-")
    found: dict[str, set[str]] = {}
    for block in synopsis.split(".br"):
        head = re.search(r"^\.B activator (\S+)", block, re.M)
        if head:
            found[head.group(1)] = set(OPTION.findall(block.split("\n", 2)[-1]))
    return found


def test_the_man_page_synopsis_has_every_option_of_help() -> None:
    synopsis = man_synopsis()
    assert set(synopsis) == {*commands_in_help(), "--version"}
    for command in commands_in_help():
        shown = synopsis[command]
        for spellings in help_options(run_help(command)):
            assert spellings & shown, f"man page, activator {command}: {sorted(spellings)} is missing"


def test_the_readme_states_the_watch_interval_help_states() -> None:
    interval = re.search(r"--interval S\s+seconds between refreshes \(default ([\d.]+)\)", run_help("status"))
    assert interval is not None
    default = float(interval.group(1))
    stated = re.findall(r"redraws it every (?:`--interval` seconds \(([\d.]+)\)|([\d.]+) seconds|(second)\b)", README)
    assert len(stated) >= 2, "the command table and the admin API section"
    for in_table, in_text, one in stated:
        assert float(in_table or in_text or (1 if one else 0)) == default, stated


def access_log_section() -> str:
    return README.split("### Access log", 1)[1].split("\n### ", 1)[0]


def test_every_field_of_an_access_line_is_explained() -> None:
    line = RequestRecord(0.0, "127.0.0.1", "GET", b"/").access_line(0.0)
    fields = re.findall(r" (\w+)=", line)
    assert fields == ["Tw", "Tr", "Tt", "bytes", "in"]
    section = access_log_section()
    for field in fields:
        assert f"`{field}`" in section, f"{field}= is not explained in the README's Access log section"
    assert "request line" in section and "client" in section


# -- config/example.yaml against the contract's table --------------------------------------

#: Keys the contract (SPEC.md) specifies for features not implemented yet: the example
#: leaves them out. When the loader accepts one, the test below fails: add the key to
#: config/example.yaml and take it out of here.
NOT_IMPLEMENTED_YET: tuple[str, ...] = ()
#: Maps whose keys are the operator's names, not keys of the format.
NAMED = ("services", "activators.peers", "services.*.priority.hosts", "services.*.priority.queue_timeout")


def spec_path() -> Path | None:
    for parent in ROOT.parents:
        candidate = parent / "shared" / "SPEC.md"
        if candidate.is_file():
            return candidate
    return None


def key_paths(node: Any, prefix: str = "") -> Iterator[str]:
    """Every key of a YAML document, as dotted paths (``services.*.probe.path``), the
    names of ``NAMED`` maps as ``*`` and list items as ``[]``; not below the keys of
    ``NOT_IMPLEMENTED_YET``."""
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}{key}"
            yield path
            if path in NOT_IMPLEMENTED_YET:
                continue
            if path in NAMED:
                for child in value.values():
                    yield f"{path}.*"
                    yield from key_paths(child, f"{path}.*.")
            else:
                yield from key_paths(value, f"{path}.")
    elif isinstance(node, list):
        for item in node:
            yield from key_paths(item, f"{prefix}[].")


def uncommented(text: str) -> str:
    """``text`` with its commented-out settings (see the module docstring) made live,
    nested ones too (``#  #secret: x``): a block starts at ``#KEY:`` and goes on over the
    lines commented at the same column; one ``#`` is taken off each."""
    comment = re.compile(r"^(\s*)#(.*)$")
    lines = text.splitlines()
    while True:
        out: list[str] = []
        block: str | None = None  # the indentation of the block being uncommented
        for line in lines:
            found = comment.match(line)
            starts = found is not None and re.match(r"[A-Za-z_][\w-]*:", found.group(2)) is not None
            if found is not None and (starts or found.group(1) == block):
                block = found.group(1)
                out.append(found.group(1) + found.group(2))
            else:
                block = None
                out.append(line)
        if out == lines:
            return "\n".join(lines) + "\n"
        lines = out


def test_uncommenting_keeps_prose_and_makes_settings_live() -> None:
    text = "# Prose: with a colon.\n#tls:\n#  cert: a\n#  #secret: x\nlisten: 1\n"
    assert yaml.safe_load(uncommented(text)) == {"tls": {"cert": "a", "secret": "x"}, "listen": 1}


@pytest.fixture(scope="module")
def spec_keys() -> set[str]:
    path = spec_path()
    if path is None:
        pytest.skip("the contract (shared/SPEC.md beside the repository) is not here")
    block = path.read_text().split("## The YAML file", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    return set(key_paths(yaml.safe_load(block)))


def test_the_example_holds_every_key_of_the_contract(spec_keys: set[str]) -> None:
    example = set(key_paths(yaml.safe_load(uncommented(EXAMPLE.read_text()))))
    missing = spec_keys - example - set(NOT_IMPLEMENTED_YET)
    assert not missing, f"config/example.yaml lacks {sorted(missing)}"
    for key in NOT_IMPLEMENTED_YET:
        assert key in spec_keys, f"{key} is not in the contract any more: take it out of NOT_IMPLEMENTED_YET"
    assert {"activators.secret", "activators.secret_file", "tls.cert", "tls.key"} <= example


def test_the_example_is_a_valid_file_as_it_is() -> None:
    parse_config_text(EXAMPLE.read_text(), "example.yaml")


def test_keys_not_implemented_yet_are_still_refused() -> None:
    """Fails the day the loader accepts one of them: then add it to the example and take it
    out of ``NOT_IMPLEMENTED_YET`` (empty today: every key of the contract is loaded)."""
    for key in NOT_IMPLEMENTED_YET:
        name = key.rsplit(".", 1)[1]
        text = f"services:\n  api:\n    hosts: [a.example.com]\n    {name}: null\n    pods: []\n"
        with pytest.raises(ConfigError, match=name):
            parse_config_text(text, "probe.yaml")
