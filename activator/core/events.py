"""Topology events: everything that changes pods and services, other than requests.

The shell turns what it observes into one of these values (a new file was read, a probe
answered, a request met a transport failure, time passed) and hands it to the one
topology writer, which applies them one at a time, in order, with ``Topology.handle``.
Requests themselves only acquire and release slots. Frozen values: an event can be
queued, logged and compared.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Config, ConfigDiff
from .failures import FailureKind
from .peering import Answer, PodCounts
from .probes import Verdict


@dataclass(frozen=True)
class ConfigChanged:
    """A new valid configuration, and what it changes from the one applied before."""

    config: Config
    diff: ConfigDiff


@dataclass(frozen=True)
class ProbeReport:
    """One active probe's verdict on a pod."""

    service: str
    address: str
    verdict: Verdict
    detail: str = ""
    #: How long the probe took, in seconds (None: not measured).
    duration: float | None = None


@dataclass(frozen=True)
class TransportFailure:
    """A request to a pod failed (``core.failures``)."""

    service: str
    address: str
    kind: FailureKind


@dataclass(frozen=True)
class LoadReported:
    """A pod announced its load (``core.load``): in a response's ORCA header, or in the
    gauge read at a probe. ``figure`` / ``concurrency`` None: not announced."""

    service: str
    address: str
    figure: float | None
    concurrency: int | None


@dataclass(frozen=True)
class Tick:
    """Time passed: drain timeouts, retired services, hand-overs waited out."""


@dataclass(frozen=True)
class ViewReceived:
    """A peer's (or a sibling worker's) check came in with its view of our shares."""

    issuer: str  # a peer's name, or "worker N"
    view: PodCounts


@dataclass(frozen=True)
class PeerChecked:
    """Our check of ``peer`` (made at ``asked_at``, monotonic) got ``answer``, or none
    (``error`` says why). ``refused``: its port refused the connection, so no activator
    runs there (and none of its requests do): a hand-over need not wait for it.
    ``forwarding``: it was a request forwarded there, not a check."""

    peer: str
    asked_at: float
    answer: Answer | None
    error: str = ""
    refused: bool = False
    forwarding: bool = False


Event = ConfigChanged | ProbeReport | TransportFailure | LoadReported | Tick | ViewReceived | PeerChecked
