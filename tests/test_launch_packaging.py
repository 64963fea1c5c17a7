"""What packaging/launch/ ships for ``launch: {systemd_unit: ...}``: an example pod
template unit that ``systemd-analyze verify`` accepts, and a polkit rule that lets the
activator user start and stop exactly the units of the template."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from activator.core.config import fill_launch_template

LAUNCH = Path(__file__).resolve().parents[1] / "packaging" / "launch"
TEMPLATE = LAUNCH / "model@.service"
RULE = LAUNCH / "50-activator-launch.rules"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")


def verify(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    copy = tmp_path / "model@.service"
    copy.write_text(text.replace("/usr/local/bin/model-server", "/bin/true"))
    return subprocess.run([SYSTEMD_ANALYZE, "verify", str(copy)], capture_output=True, text=True, timeout=120)


@needs_systemd_analyze
def test_the_template_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    result = verify(TEMPLATE.read_text(), tmp_path)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result


@needs_systemd_analyze
def test_verify_would_catch_a_bad_directive_in_it(tmp_path: Path) -> None:
    assert verify(TEMPLATE.read_text().replace("TimeoutStopSec=30s", "TimeoutStopSec=soon"), tmp_path).stderr


def test_the_polkit_rule_allows_the_activator_user_start_and_stop_of_the_template_units_only() -> None:
    rule = RULE.read_text()
    assert '"org.freedesktop.systemd1.manage-units"' in rule
    assert 'subject.user !== "activator"' in rule  # the unit's DynamicUser is named after it
    assert 'verb === "start" || verb === "stop"' in rule
    pattern = re.search(r"var UNITS = /(.*)/;", rule)
    assert pattern is not None
    units = re.compile(pattern.group(1))  # a JavaScript literal in the subset Python shares
    assert units.fullmatch(fill_launch_template("model@{port}.service", "127.0.0.1", 8001))
    assert not units.fullmatch("sshd.service") and not units.fullmatch("model@8001.service.d")


NODE = shutil.which("node")

JUDGE = """
const fs = require("fs");
const rules = [];
const polkit = {Result: {YES: "yes", NOT_HANDLED: "not-handled"}, addRule: (f) => rules.push(f)};
eval(fs.readFileSync(process.argv[1], "utf8"));
const [user, id, unit, verb] = process.argv.slice(2);
const action = {id: id, lookup: (key) => ({unit: unit, verb: verb})[key]};
process.stdout.write(rules.map((rule) => rule(action, {user: user})).join(","));
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed (the rule is JavaScript, as polkit runs it)")
@pytest.mark.parametrize(
    ("user", "action", "unit", "verb", "answer"),
    [
        ("activator", "org.freedesktop.systemd1.manage-units", "model@8001.service", "start", "yes"),
        ("activator", "org.freedesktop.systemd1.manage-units", "model@8001.service", "stop", "yes"),
        ("activator", "org.freedesktop.systemd1.manage-units", "model@8001.service", "restart", "not-handled"),
        ("activator", "org.freedesktop.systemd1.manage-units", "sshd.service", "stop", "not-handled"),
        ("activator", "org.freedesktop.systemd1.manage-unit-files", "model@8001.service", "start", "not-handled"),
        ("mallory", "org.freedesktop.systemd1.manage-units", "model@8001.service", "start", "not-handled"),
    ],
)
def test_the_polkit_rule_run_as_polkit_runs_it(user: str, action: str, unit: str, verb: str, answer: str) -> None:
    """The rule file evaluated by a JavaScript engine with polkit's API stubbed."""
    assert NODE is not None
    result = subprocess.run(
        [NODE, "-e", JUDGE, str(RULE), user, action, unit, verb], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == answer
