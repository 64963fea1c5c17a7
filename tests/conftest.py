"""Shared pytest setup: import paths, markers, and process fixtures.

The test session is NOT monkey-patched: the e2e tests drive real processes from plain
threads, and the tests that need gevent (races, upstream, metrics) use gevent's own
sockets and primitives directly, as the activator's modules do. (Patching part-way
through collection, or the whole session, made libev abort once in a few hundred
subprocess-heavy tests.) Nothing imports ``harness`` at module level here.
Every fixture that starts a process kills it at teardown, whatever the test's outcome;
when a test failed, the activators' output tails are printed into the report.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, settings

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
for _p in (str(REPO_ROOT), str(TESTS_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

if TYPE_CHECKING:
    from harness import Activator, NotifySocket, Pod, StatsdReceiver

# Hypothesis's time-based checks (a 200 ms deadline per example, the "too slow" health
# check) fail at random on a busy machine, and no test here asserts a duration: they are
# off in the profile a developer gets. With CI set, Hypothesis loads its own "ci" profile
# (the same, plus derandomized examples and no example database), so that a CI run is
# reproducible. How many examples a property tries is the test's own ``@settings``.
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
if settings.get_current_profile_name() == "default":
    settings.load_profile("dev")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "binary: runs the activator CLI (honours ACTIVATOR_BIN)")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    # Keep each phase's report on the item so fixtures can tell if the test failed.
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    harness = sys.modules.get("harness")
    if harness is not None:
        harness.kill_all()


@pytest.fixture(autouse=True)
def _the_session_stays_unpatched() -> Iterator[None]:
    """Fails the test that monkey-patched this process (importing ``activator.cli`` does:
    it patches at import, as the executable must). Once patched, ``subprocess`` in this
    worker is gevent's, and its child watchers hang when called from plain threads."""
    yield
    if "gevent.monkey" in sys.modules and sys.modules["gevent.monkey"].is_module_patched("socket"):
        pytest.fail("this test monkey-patched the test process (an import of activator.cli?)")


def _failed(request: pytest.FixtureRequest) -> bool:
    rep = getattr(request.node, "rep_call", None) or getattr(request.node, "rep_setup", None)
    return bool(rep is not None and rep.failed)


@pytest.fixture
def pod_factory() -> Iterator[Callable[..., list[Pod]]]:
    """``pod_factory(n=1, fail_health=False) -> list[Pod]``: pods started in parallel,
    all killed at teardown."""
    import harness

    pods: list[Pod] = []

    def make(n: int = 1, *, fail_health: bool = False) -> list[Pod]:
        new = harness.start_pods(n, fail_health=fail_health)
        pods.extend(new)
        return new

    yield make
    for pod in pods:
        pod.close()


@pytest.fixture
def activator_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Activator]]:
    """``activator_factory(config, **Activator kwargs) -> Activator`` (started and ready
    unless told otherwise), its work dir under ``tmp_path``; all killed at teardown."""
    import harness

    made: list[Activator] = []

    def make(config: harness.Config, **kwargs: Any) -> Activator:
        kwargs.setdefault("workdir", tmp_path / f"activator{len(made)}")
        act = harness.Activator(config, start=False, **{k: v for k, v in kwargs.items() if k != "start"})
        made.append(act)
        if kwargs.get("start", True):
            act.start(wait_ready=kwargs.get("wait_ready", True))
        return act

    yield make
    failed = _failed(request)
    for act in made:
        if failed:
            print(f"\n=== activator {act.command()} in {act.dir}\n{act.output_tail()}")
        act.close()


class Proxied:
    """One pod behind one activator, ``make_config([pod])``: see :func:`proxied`."""

    def __init__(self, pod: Pod, act: Activator) -> None:
        self.pod = pod
        self.act = act


@pytest.fixture(scope="module")
def _proxied_for_the_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxied]:
    import harness

    with harness.Pod() as pod:
        config = harness.make_config([pod])
        with harness.Activator(config, workdir=tmp_path_factory.mktemp("proxied")) as act:
            yield Proxied(pod, act)


@pytest.fixture
def proxied(request: pytest.FixtureRequest, _proxied_for_the_module: Proxied) -> Iterator[Proxied]:
    """One pod (``tests/backend.py``, cc 1) behind an activator with the plain config
    (``make_config([pod])``), started once per module and shared by the tests that leave
    both as they found them (no reload, no signal, no pod stopped, nothing held): each
    test gets them idle (every count in ``/status`` back to zero) and the pod's counts
    zeroed. A test that changes either starts its own (``activator_factory``)."""
    setup = _proxied_for_the_module
    setup.act.process.check_running("the shared activator (a test before this one stopped it)")
    setup.pod.process.check_running("the shared pod (a test before this one stopped it)")
    setup.act.wait_idle()
    setup.pod.reset()
    yield setup
    if _failed(request):
        print(f"\n=== shared activator {setup.act.command()} in {setup.act.dir}\n{setup.act.output_tail()}")


@pytest.fixture
def statsd_receiver() -> Iterator[StatsdReceiver]:
    """A UDP socket on 127.0.0.1 collecting StatsD lines; ``.address`` for the config."""
    import harness

    with harness.StatsdReceiver() as receiver:
        yield receiver


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    """An AF_UNIX datagram socket collecting sd_notify messages; ``.env()`` for the child."""
    import harness

    with harness.NotifySocket() as sock:
        yield sock
