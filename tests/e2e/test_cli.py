"""End to end: the command line (``activator --version / check / status / run``).

Runs the real CLI as a subprocess through ``harness.run_cli`` (``$ACTIVATOR_BIN`` when
set, else ``python -m activator``). Exit codes per SPEC.md: 0 clean, 1 runtime failure,
2 bad configuration or usage; errors name ``file:line: key: message``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from harness import (
    LOCALHOST,
    Process,
    activator_command,
    free_ports,
    make_config,
    pod_entry,
    request,
    run_cli,
    start_request,
    wait_until,
)

from activator import __version__

pytestmark = pytest.mark.binary


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


GOOD = """
    listen: 127.0.0.1:18080
    admin: 127.0.0.1:19090
    services:
      api:
        hosts: [api.example.com]
        container_concurrency: 1
        pods:
          - 127.0.0.1:8001
          - 127.0.0.1:8002
      batch:
        hosts: [batch.example.com, "*"]
        container_concurrency: 4
        pods:
          - 127.0.0.1:8101
"""


def test_version():
    result = run_cli(["--version"])
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert __version__ in out
    assert re.search(r"\d+\.\d+\.\d+", out)


def test_check_good_file_prints_services(tmp_path):
    good = write(tmp_path / "good.yaml", GOOD)
    result = run_cli(["check", "-c", str(good)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "valid" in out
    for text in (
        "api",
        "batch",
        "api.example.com",
        "127.0.0.1:8001",
        "127.0.0.1:8002",
        "127.0.0.1:8101",
    ):
        assert text in out, f"{text!r} missing from:\n{out}"


def test_check_config_from_environment(tmp_path):
    good = write(tmp_path / "env.yaml", GOOD)
    result = run_cli(["check"], env={"ACTIVATOR_CONFIG": str(good)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "127.0.0.1:8101" in result.stdout


def test_check_bad_port_exits_2_naming_file_line_and_key(tmp_path):
    write(
        tmp_path / "bad.yaml",
        """
        listen: 127.0.0.1:18080
        services:
          api:
            hosts: [api.example.com]
            pods:
              - 127.0.0.1:8001
              - 127.0.0.1:70000
        """,
    )
    result = run_cli(["check", "-c", "bad.yaml"], cwd=tmp_path)
    assert result.returncode == 2
    assert re.search(r"bad\.yaml:7: services\.api\.pods\[1\]: .*70000", result.stderr), result.stderr
    assert "port" in result.stderr


def test_check_unknown_key_and_syntax_error_exit_2(tmp_path):
    typo = write(
        tmp_path / "typo.yaml",
        """
        services:
          api:
            hosts: [api.example.com]
            queue_dept: 10
            pods: [127.0.0.1:8001]
        """,
    )
    result = run_cli(["check", "-c", str(typo)], cwd=tmp_path)
    assert result.returncode == 2
    assert re.search(r"typo\.yaml:4: services\.api(\.queue_dept)?: ", result.stderr), result.stderr
    assert "queue_dept" in result.stderr

    broken = write(tmp_path / "broken.yaml", "services:\n  api: [unclosed\n")
    result = run_cli(["check", "-c", str(broken)], cwd=tmp_path)
    assert result.returncode == 2
    assert re.search(r"broken\.yaml:\d+: ", result.stderr), result.stderr


def test_check_against_prints_the_diff(tmp_path):
    old = write(
        tmp_path / "old.yaml",
        """
        services:
          api:
            hosts: [api.example.com]
            container_concurrency: 1
            queue_timeout: 30s
            pods:
              - 127.0.0.1:8001
              - 127.0.0.1:8002
        """,
    )
    new = write(
        tmp_path / "new.yaml",
        """
        services:
          api:
            hosts: [api.example.com]
            container_concurrency: 2
            queue_timeout: 5s
            pods:
              - 127.0.0.1:8002
              - 127.0.0.1:8003
        """,
    )
    result = run_cli(["check", "-c", str(new), "--against", str(old)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()

    def line_with(*words: str) -> str:
        found = [line for line in lines if all(w in line.lower() for w in words)]
        assert found, f"no line with {words} in:\n{result.stdout}"
        return found[0]

    # The diff: pods to add and to drain, limits changed (old -> new).
    line_with("add", "127.0.0.1:8003")
    line_with("drain", "127.0.0.1:8001")
    assert not any("8002" in line and ("add" in line.lower() or "drain" in line.lower()) for line in lines)
    assert not any("8003" in line and "drain" in line.lower() for line in lines)
    assert re.search(r"1\s*->\s*2", line_with("container_concurrency", "->"))
    assert re.search(r"30s\s*->\s*5s", line_with("queue_timeout", "->"))

    same = run_cli(["check", "-c", str(old), "--against", str(old)], cwd=tmp_path)
    assert same.returncode == 0
    unchanged = [
        line
        for line in same.stdout.splitlines()
        if re.search(r"\badd\b|\bdrain\b|container_concurrency.*->|queue_timeout.*->", line)
    ]
    assert unchanged == [], unchanged


def test_check_against_invalid_new_file_exits_2(tmp_path):
    old = write(
        tmp_path / "old.yaml",
        "services:\n  api:\n    hosts: [a]\n    pods: [127.0.0.1:8001]\n",
    )
    new = write(
        tmp_path / "new.yaml",
        "services:\n  api:\n    hosts: [a]\n    pods: [127.0.0.1:0]\n",
    )
    result = run_cli(["check", "-c", str(new), "--against", str(old)], cwd=tmp_path)
    assert result.returncode == 2
    assert "new.yaml:" in result.stderr


def test_status_prints_a_table_of_a_running_instance(pod_factory, activator_factory):
    pods = pod_factory(2)
    act = activator_factory(make_config(pods))
    assert request(act.listen, path="/delay").status == 200
    result = run_cli(["status", "--admin", act.admin])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "api" in out
    for pod in pods:
        row = [line for line in out.splitlines() if pod.address in line]
        assert row, f"{pod.address} missing from:\n{out}"
        assert "healthy" in row[0]


def test_status_page_shows_every_pod_with_its_state_and_refreshes(pod_factory, activator_factory):
    busy, drained = pod_factory(2)
    act = activator_factory(make_config([busy, pod_entry(drained, drain=True)]))
    held = start_request(act.listen, path="/delay?ms=3000")
    try:
        act.wait_for(lambda st: st["services"]["api"]["in_flight"] == 1, message="one request on the pod")
        page = act.admin_get("/")
    finally:
        held.close()
    assert page.status == 200
    assert page.headers.get("content-type", "").startswith("text/html")
    html = page.body.decode()
    assert "http-equiv='refresh'" in html
    # The table rows (what comes before the first row, the charts, may name pods too).
    rows = {pod: [line for line in html.split("<tr")[1:] if pod.address in line] for pod in (busy, drained)}
    assert rows[busy] and "healthy" in rows[busy][0] and "class='busy'" in rows[busy][0], html
    assert rows[drained] and "removed" in rows[drained][0] and "class='busy'" not in rows[drained][0], html


def test_status_without_a_running_instance_fails(tmp_path):
    (port,) = free_ports(1)
    result = run_cli(["status", "--admin", f"{LOCALHOST}:{port}"], timeout=30)
    assert result.returncode == 1
    assert result.stderr.strip()


def test_run_with_a_missing_file_exits_2(tmp_path):
    result = run_cli(["run", "-c", str(tmp_path / "missing.yaml")], timeout=30)
    assert result.returncode == 2
    assert "missing.yaml" in result.stderr


def test_run_with_an_invalid_file_exits_2(tmp_path):
    bad = write(tmp_path / "bad.yaml", "listen: 127.0.0.1:99999\nservices: {}\n")
    result = run_cli(["run", "-c", str(bad)], timeout=30)
    assert result.returncode == 2
    assert re.search(r"bad\.yaml:1: listen: ", result.stderr), result.stderr


def test_usage_error_exits_2():
    result = run_cli(["no-such-command"])
    assert result.returncode == 2


def test_status_with_a_broken_file_says_so_instead_of_asking_the_default_address(tmp_path):
    broken = write(tmp_path / "broken.yaml", "admin: 127.0.0.1:99999\nservices: {}\n")
    result = run_cli(["status", "-c", str(broken)], timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(r"broken\.yaml:1: admin: ", result.stderr), result.stderr
    assert "127.0.0.1:9090" not in result.stderr and "refused" not in result.stderr
    missing = run_cli(["status", "-c", str(tmp_path / "missing.yaml")], timeout=30)
    assert missing.returncode == 2 and "missing.yaml" in missing.stderr, missing.stderr
    from_env = run_cli(["status"], env={"ACTIVATOR_CONFIG": str(broken)}, timeout=30)
    assert from_env.returncode == 2 and "broken.yaml:1: admin: " in from_env.stderr, from_env.stderr


def test_status_with_the_admin_api_off_says_so(tmp_path):
    off = write(tmp_path / "off.yaml", "admin: null\nservices: {}\n")
    result = run_cli(["status", "-c", str(off)], timeout=30)
    assert result.returncode == 2
    assert "off.yaml: admin: the admin API is off (admin: null); give its address with --admin" in result.stderr


def test_status_reads_the_admin_address_of_the_file(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod]))
    result = run_cli(["status", "-c", str(act.config_path)], timeout=30)
    assert result.returncode == 0, result.stderr
    assert pod.address in result.stdout


def test_the_demo_moves_its_ports_without_editing_its_file(tmp_path):
    listen, admin = free_ports(2)
    first_pod = free_ports(3, consecutive=True)[0]
    before = (Path(__file__).resolve().parents[2] / "config" / "demo.yaml").read_text()
    demo = Process(
        [
            *activator_command(),
            "demo",
            "--delay",
            "0.01",
            "--listen",
            f"{LOCALHOST}:{listen}",
            "--admin",
            f"{LOCALHOST}:{admin}",
            "--pods",
            str(first_pod),
        ],
        stdout_path=tmp_path / "demo.out",
        stderr_path=tmp_path / "demo.err",
        name="demo",
    )
    try:

        def served() -> bool:
            demo.check_running("the demo serving")
            try:
                return request(f"{LOCALHOST}:{listen}", path="/", timeout=5).status == 200
            except OSError:
                return False

        wait_until(served, message="the demo on its new ports")
        status = request(f"{LOCALHOST}:{admin}", path="/status").json()
        pods = [pod["address"] for pod in status["services"]["demo"]["pods"]]
        assert pods == [f"{LOCALHOST}:{first_pod + i}" for i in range(3)]
        assert f"http://{LOCALHOST}:{listen}/" in demo.stdout_text()
    finally:
        demo.kill()
    assert (Path(__file__).resolve().parents[2] / "config" / "demo.yaml").read_text() == before
