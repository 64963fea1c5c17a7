"""The launcher's decisions (``core.autoscale``): tables with a simulated clock, then
properties over random demand, boots and failures.

No process is started: a ``World`` plays the pods (a started pod turns healthy after its
boot time, or never; a stopped one stops being healthy) and the throttler's counts, and
applies the scaler's effects the way the shell does.
"""

from __future__ import annotations

from dataclasses import replace

from builders import pod, svc
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.core.autoscale import (
    Action,
    Launch,
    LaunchEffect,
    Launches,
    PodView,
    ServiceScaler,
    ServiceView,
    launch_owner,
    launcher_elsewhere,
)
from activator.core.config import ActivatorsConfig, Address, Config, LaunchConfig, ProbeConfig

PODS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def launched(*pods: str, **launch: object) -> object:
    config = LaunchConfig(command=("model", "--port", "{port}"), **launch)  # type: ignore[arg-type]
    return svc(*pods, launch=config, probe=ProbeConfig())


class World:
    """The pods and the demand as the shell would show them to the scaler."""

    def __init__(self, scaler: ServiceScaler, boot: float = 1.0, slow_stops: bool = False) -> None:
        self.scaler = scaler
        self.boot = boot
        #: A stopped pod's process ends only at ``reap`` (a grace period), not at once.
        self.slow_stops = slow_stops
        self.stopping: set[str] = set()
        self.now = 0.0
        self.in_flight = 0
        self.queued = 0
        self.requests = 0
        self.healthy: dict[str, float] = {}  # pod -> when it turns (turned) healthy
        self.running: set[str] = set()  # pods with a process
        self.drained: set[str] = set()
        self.pod_in_flight: dict[str, int] = {}
        self.effects: list[LaunchEffect] = []
        self.refused = 0
        self.started_by_us: set[str] = set()
        self.last_view = ServiceView(0, 0, 0, {})

    def view(self) -> ServiceView:
        pods = {
            address: PodView(
                address in self.running and self.healthy.get(address, 1e99) <= self.now,
                self.pod_in_flight.get(address, 0),
            )
            for address in {*self.scaler.listed, *self.scaler.pods, *self.pod_in_flight}
        }
        self.last_view = ServiceView(self.in_flight, self.queued, self.requests, pods)
        return self.last_view

    def step(self, seconds: float = 1.0, sample: bool = True) -> list[LaunchEffect]:
        self.now += seconds
        effects = self.scaler.step(self.now, self.view(), sample)
        self.act(effects)
        self.scaler.check_invariants()
        return effects

    def act(self, effects: list[LaunchEffect]) -> None:
        for effect in effects:
            self.effects.append(effect)
            if effect.action is Action.START:
                self.started_by_us.add(effect.pod)
                self.running.add(effect.pod)
                self.healthy.setdefault(effect.pod, self.now + self.boot)
            elif effect.action is Action.DRAIN:
                self.drained.add(effect.pod)
            elif effect.action is Action.STOP:
                assert effect.pod in self.started_by_us, "stopped a pod it did not start"
                seen = self.last_view.pods.get(effect.pod)
                if seen is not None and seen.healthy:
                    assert effect.pod in self.drained, "stopped a serving pod without draining it"
                    assert seen.in_flight == 0, "stopped a pod with requests in flight"
                self.healthy.pop(effect.pod, None)
                if self.slow_stops:
                    self.stopping.add(effect.pod)
                else:
                    self.running.discard(effect.pod)
                    self.act(self.scaler.ended(effect.pod, self.now, "stopped"))
            elif effect.action is Action.UNDRAIN:
                self.drained.discard(effect.pod)
            elif effect.action is Action.REFUSE_WAITERS:
                self.refused += self.queued
                self.queued = 0

    def reap(self) -> None:
        """The stopped pods' processes end."""
        for address in sorted(self.stopping):
            self.stopping.discard(address)
            self.running.discard(address)
            self.act(self.scaler.ended(address, self.now, "stopped"))

    def serving(self) -> set[str]:
        return {a for a in self.running if self.healthy.get(a, 1e99) <= self.now}

    def actions(self, since: int = 0) -> list[tuple[str, str]]:
        return [(e.action.value, e.pod) for e in self.effects[since:]]


def scaler(*pods: str, **launch: object) -> ServiceScaler:
    return ServiceScaler(launched(*(pods or PODS), **launch), 0.0)  # type: ignore[arg-type]


# -- from zero --------------------------------------------------------------------------------


def test_a_waiting_request_starts_the_first_pod_at_once_and_its_probe_makes_it_ready() -> None:
    world = World(scaler(stable_window=60.0), boot=3.0)
    assert world.step() == []  # nothing asked, nothing started (min: 0)
    world.queued = 1
    assert world.actions(len(world.effects)) == []
    effects = world.step(0.01, sample=False)  # the shell steps on the request, not a second later
    assert [(e.action, e.pod) for e in effects] == [(Action.START, PODS[0])]
    world.step(1.0)
    assert world.scaler.pods[PODS[0]].state is Launch.STARTING
    effects = world.step(2.0)
    assert [(e.action, e.pod) for e in effects] == [(Action.READY, PODS[0])]
    assert effects[0].seconds is not None and effects[0].seconds >= 3.0
    assert world.scaler.cold_starts == 1


def test_min_pods_are_started_without_any_request() -> None:
    world = World(scaler(min=2))
    assert [e.pod for e in world.step() if e.action is Action.START] == [PODS[0], PODS[1]]


def test_a_pod_healthy_without_being_started_here_counts_and_is_never_stopped() -> None:
    world = World(scaler(stable_window=2.0, scale_to_zero_after=1.0))
    world.running.add(PODS[0])
    world.healthy[PODS[0]] = 0.0
    world.in_flight = 1
    assert world.step() == []  # served by the pod someone else runs: nothing to start
    world.in_flight = 0
    for _ in range(10):
        world.step()
    assert world.actions() == []


# -- scaling ----------------------------------------------------------------------------------


def test_desired_is_concurrency_over_target_rounded_up_within_max() -> None:
    world = World(scaler(stable_window=10.0, target_concurrency=2.0, max=2), boot=0.5)
    world.in_flight = 3
    world.step()
    assert world.scaler.desired == 2  # ceil(3 / 2)
    world.in_flight = 20
    for _ in range(5):
        world.step()
    assert world.scaler.desired == 2  # max
    assert len([e for e in world.effects if e.action is Action.START]) == 2


def test_demand_doubling_panics_and_scales_up_before_the_stable_window_follows() -> None:
    world = World(scaler(stable_window=60.0, panic_window=6.0), boot=0.5)
    world.in_flight = 1
    for _ in range(60):
        world.step()
    assert world.scaler.desired == 1 and world.scaler.panic_since is None
    world.in_flight = 3  # tripled: the 6 s window sees it within a few samples
    for _ in range(6):
        world.step()
    assert world.scaler.panic_since is not None
    assert world.scaler.desired == 3
    assert len(world.serving()) == 3


def test_in_panic_it_never_scales_down_and_leaves_panic_after_a_stable_window() -> None:
    world = World(scaler(stable_window=10.0, panic_window=2.0), boot=0.1)
    world.in_flight = 3
    for _ in range(3):
        world.step()
    assert world.scaler.panic_since is not None and world.scaler.desired == 3
    world.in_flight = 0
    panicked = 0
    for _ in range(20):
        world.requests += 1  # still some arrivals: no scale to zero here
        world.step()
        if world.scaler.panic_since is not None:
            panicked += 1
            assert world.scaler.desired == 3
    assert panicked >= 5  # the windows' averages fell long before panic ended
    assert world.scaler.panic_since is None
    assert world.scaler.desired == 1  # the last pod stays until scale_to_zero_after


def test_scale_down_waits_for_the_stable_window_then_drains_before_stopping() -> None:
    world = World(scaler(stable_window=5.0, panic_window=5.0, scale_to_zero_after=1000.0), boot=0.1)
    world.in_flight = 2
    for _ in range(3):
        world.step()
    assert world.scaler.desired == 2
    drained_at = len(world.effects)
    world.in_flight = 1
    world.pod_in_flight = {PODS[1]: 1}  # the pod it gives up still runs a request
    downs = []
    for _ in range(8):
        downs += [e for e in world.step() if e.action in (Action.DRAIN, Action.STOP)]
    # the window's average falls to 1 only after the 2s have left it
    assert [(e.action, e.pod) for e in downs] == [(Action.DRAIN, PODS[1])]
    world.pod_in_flight = {}
    world.step()
    assert world.actions(drained_at)[-2:] == [("stop", PODS[1]), ("undrain", PODS[1])]


def test_to_zero_only_after_scale_to_zero_after_without_a_request() -> None:
    world = World(scaler(stable_window=2.0, scale_to_zero_after=10.0), boot=0.1)
    world.in_flight = 1
    world.step()
    world.step()
    world.in_flight = 0
    for _ in range(9):
        world.step()
        assert world.serving() == {PODS[0]}
    for _ in range(3):
        world.step()
    assert world.actions()[-3:] == [("drain", PODS[0]), ("stop", PODS[0]), ("undrain", PODS[0])]
    assert world.scaler.desired == 0


def test_a_request_counts_as_activity_even_between_two_samples() -> None:
    world = World(scaler(stable_window=2.0, scale_to_zero_after=5.0), boot=0.1)
    world.in_flight = 1
    world.step()
    world.step()
    world.in_flight = 0
    for _ in range(4):
        world.step()
    world.requests += 5  # five short requests that no sample saw in flight
    for _ in range(4):
        world.step()
        assert world.serving() == {PODS[0]}


def test_stops_take_booting_pods_first_then_the_latest_in_file_order() -> None:
    world = World(scaler(stable_window=1.0, panic_window=1.0, scale_to_zero_after=0.0), boot=5.0)
    world.in_flight = 3
    world.step()
    assert world.actions() == [("start", PODS[0]), ("start", PODS[1]), ("start", PODS[2])]
    world.healthy[PODS[0]] = world.now  # only the first is ready
    world.in_flight = 1
    world.step()
    world.step()
    stops = [a for a in world.actions() if a[0] in ("drain", "stop")]
    assert stops[:2] == [("stop", PODS[2]), ("stop", PODS[1])]  # booting ones, no drain needed


# -- cold starts that fail ---------------------------------------------------------------------


def test_a_pod_that_exits_at_once_is_counted_and_the_next_candidate_is_tried() -> None:
    world = World(scaler(cold_start_timeout=30.0))
    world.queued = 1
    world.step(sample=False)
    world.running.discard(PODS[0])
    failed = world.scaler.ended(PODS[0], world.now, "exit status 1")
    assert [(e.action, e.pod) for e in failed] == [(Action.FAILED, PODS[0])]
    world.act(failed)
    assert world.actions()[-1:] == [("failed", PODS[0])]
    world.step(0.01, sample=False)
    assert world.actions()[-1:] == [("start", PODS[1])]
    assert world.scaler.failed == 1


def test_a_pod_never_ready_is_stopped_after_cold_start_timeout_then_the_next_one() -> None:
    world = World(scaler(cold_start_timeout=5.0), boot=1e9)
    world.queued = 1
    world.step()
    for _ in range(5):
        world.step()
    assert world.actions()[1:] == [("failed", PODS[0]), ("stop", PODS[0]), ("start", PODS[1])]


def test_when_no_candidate_comes_up_the_waiters_are_refused_and_nothing_loops() -> None:
    world = World(scaler(cold_start_timeout=5.0), boot=1e9)
    world.queued = 2
    for _ in range(20):
        world.step()
    assert [a for a, _ in world.actions()].count("start") == 3
    assert world.refused == 2
    starts = len(world.effects)
    for _ in range(3):
        world.step()  # the averages still say 1 pod; nothing waits: no new round
    assert [a for a, _ in world.actions(starts)] == []
    world.queued = 1  # a new request starts a new round, from the first pod (the
    world.step(0.01, sample=False)  # stable window still averages 2 in demand)
    assert world.actions(starts) == [("start", PODS[0]), ("start", PODS[1])]


def test_a_ready_pod_starts_a_new_round_of_candidates() -> None:
    world = World(scaler(cold_start_timeout=5.0))
    world.queued = 1
    world.step(sample=False)
    world.running.discard(PODS[0])
    world.act(world.scaler.ended(PODS[0], world.now, "exit status 1"))
    world.step(sample=False)
    world.step(2.0)
    assert world.scaler.pods[PODS[1]].state is Launch.RUNNING
    assert not any(p.failed for p in world.scaler.pods.values())


# -- reloads and several activators -------------------------------------------------------------


def test_reload_removing_the_launcher_stops_nothing_and_gives_a_drained_pod_back() -> None:
    config = launched(*PODS, stable_window=1.0, panic_window=1.0, scale_to_zero_after=0.0)
    base = Config(path="x", services={"api": config})  # type: ignore[dict-item]
    launches = Launches()
    launches.configure(base, 0.0)
    world = World(launches.services["api"], boot=0.1)
    world.in_flight = 2
    world.step()
    world.step()
    world.in_flight = 1
    world.pod_in_flight = {PODS[1]: 1}
    world.step()
    world.step()
    assert ("drain", PODS[1]) in world.actions()
    effects = launches.configure(replace(base, services={"api": replace(config, launch=None)}), world.now)  # type: ignore[type-var]
    assert [(e.action, e.pod) for e in effects] == [(Action.UNDRAIN, PODS[1])]
    assert launches.services == {}


def test_a_pod_unlisted_from_a_launched_service_is_stopped_once_drained() -> None:
    config = launched(*PODS, stable_window=100.0)
    world = World(ServiceScaler(config, 0.0), boot=0.1)  # type: ignore[arg-type]
    world.in_flight = 1
    world.step()
    world.step()
    world.pod_in_flight = {PODS[0]: 1}
    world.drained.add(PODS[0])  # the throttler drains a pod the file no longer lists
    world.scaler.configure(replace(config, pods=(pod(PODS[1]), pod(PODS[2]))), world.now, lambda a: True)  # type: ignore[type-var]
    world.step()
    assert ("stop", PODS[0]) not in world.actions()
    world.pod_in_flight = {}
    world.step()
    assert ("stop", PODS[0]) in world.actions()


def test_with_several_activators_each_pod_has_one_launcher() -> None:
    peers = {"a": Address("10.1.0.1", 8080), "b": Address("10.1.0.2", 8080)}
    pods = tuple(f"10.0.0.{i}:8000" for i in range(1, 9))
    service = launched(*pods)
    owners = {}
    for me in peers:
        config = Config(path="x", activators=ActivatorsConfig(me, peers, secret="s" * 16), services={"api": service})  # type: ignore[dict-item]
        launches = Launches()
        launches.configure(config, 0.0)
        for address in launches.services["api"].candidates:
            assert address not in owners
            owners[address] = me
    assert set(owners) == set(pods)
    assert all(owners[a] == launch_owner(a, ["a", "b"]) for a in pods)


# -- properties ------------------------------------------------------------------------------------

moves = st.lists(
    st.tuples(
        st.sampled_from(["tick"] * 6 + ["event", "demand", "demand", "exit", "reap"]),  # exits are rare
        st.integers(0, 8),
        st.integers(0, 2),
    ),
    min_size=30,
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(
    steps=moves,
    minimum=st.integers(0, 2),
    maximum=st.integers(2, 3),
    boot=st.sampled_from([0.5, 3.0, 1e9]),
    external=st.booleans(),
    slow_stops=st.booleans(),
)
def test_properties_over_random_demand_boots_and_exits(
    steps: list[tuple[str, int, int]], minimum: int, maximum: int, boot: float, external: bool, slow_stops: bool
) -> None:
    """Never above max (of the pods it runs), never below min except while booting or
    after failures, never stops a pod it did not start, never stops a serving pod
    without draining it first and waiting for its last request (``World.act``)."""
    world = World(
        scaler(
            min=minimum,
            max=maximum,
            stable_window=4.0,
            panic_window=2.0,
            scale_to_zero_after=3.0,
            cold_start_timeout=5.0,
        ),
        boot=boot,
        slow_stops=slow_stops,
    )
    if external:
        world.running.add(PODS[2])
        world.healthy[PODS[2]] = 0.0
    world.step()
    for kind, demand, which in steps:
        if kind == "demand":
            world.queued, world.in_flight = demand // 2, demand - demand // 2
            world.requests += demand
            world.pod_in_flight = {a: 1 for a in list(world.serving())[: world.in_flight]}
            world.step(0.01, sample=False)
        elif kind == "reap":
            world.reap()
        elif kind == "exit":
            address = PODS[which]
            if address in world.started_by_us and address in world.running and address not in world.stopping:
                world.running.discard(address)
                world.healthy.pop(address, None)
                world.act(world.scaler.ended(address, world.now, "exited"))
        else:
            world.step(1.0 if kind == "tick" else 0.01, sample=kind == "tick")
        ours = {a for a in world.running if a in world.started_by_us}
        assert len(ours) <= maximum
        busy = any(p.state in (Launch.STARTING, Launch.STOPPING) for p in world.scaler.pods.values())
        failures = world.scaler.failed > 0
        if not busy and not failures and boot < 1e9 and kind not in ("exit", "reap"):  # a step follows them
            assert len(world.serving() | ours) >= minimum


def test_a_pod_not_probed_yet_is_not_started_and_its_waiters_are_not_refused() -> None:
    """After a restart, a pod left running is pending until its first probe: starting it
    again would run a second process on its port."""
    world = World(scaler())
    world.queued = 1
    unknown = ServiceView(0, 1, 0, {a: PodView(False, 0, probed=False) for a in PODS})
    assert world.scaler.step(1.0, unknown) == []
    probed = ServiceView(0, 1, 0, {**unknown.pods, PODS[0]: PodView(True, 0, probed=True)})
    assert world.scaler.step(1.1, probed) == []  # healthy, not ours: it serves, nothing to start
    assert world.scaler.pods[PODS[0]].state is Launch.STOPPED


def test_a_request_where_no_pod_is_launched_goes_to_the_first_pod_s_launcher() -> None:
    peers = {"a": Address("10.1.0.1", 8080), "b": Address("10.1.0.2", 8080)}
    address = PODS[0]
    owner = launch_owner(address, ["a", "b"])
    other = "b" if owner == "a" else "a"
    service = launched(address)

    def config(me: str) -> Config:
        return Config(path="x", activators=ActivatorsConfig(me, peers, secret="s" * 16), services={"api": service})  # type: ignore[dict-item]

    forward = launcher_elsewhere(config(other), service)  # type: ignore[arg-type]
    assert forward is not None and (forward.name, forward.address) == (owner, str(peers[owner]))
    assert launcher_elsewhere(config(owner), service) is None  # type: ignore[arg-type]  # it starts it itself
    alone = Config(path="x", services={"api": service})  # type: ignore[dict-item]
    assert launcher_elsewhere(alone, service) is None  # type: ignore[arg-type]
    assert launcher_elsewhere(config(other), replace(service, launch=None)) is None  # type: ignore[type-var]
