"""The peer endpoint and the checks, in the shell (the rules: ``core.peering``, ``core.fleet``).

- ``PeerEndpoint`` answers ``POST /.activator/peer`` on the proxy port (and a worker's
  private port). A check without a valid proof gets 403 ``peer-auth`` and nothing else
  happens; a valid one's view goes to the topology writer (``ViewReceived``), and only
  once it was applied (so that the caps hold) is the answer made from the trackers: the
  requests running on each pod of the view, slots lent included, and the usable
  capacity per service. A check of the whole activator (scope ``activator``) that
  lands on one of several workers is relayed to its siblings (marked, so it goes no
  further) and the answers summed; if a sibling does not answer, neither does this
  worker (503): an answer must count every request.
- ``PeerChecker`` checks every target of ``Fleet.check_targets`` every
  ``activators.interval`` (each check within ``activators.timeout``), at once after a
  new file (``kick``), and posts each outcome to the writer (``PeerChecked``). Checks of
  peers go to their proxy port; checks of siblings to their private ports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import gevent
from gevent.event import Event as Flag

from ..base.exchange import ClientExchange, PodRequest
from ..core import peering
from ..core.events import Event as TopologyEvent
from ..core.events import PeerChecked, ViewReceived
from ..core.fleet import CheckTarget
from ..core.heads import BodyFraming, Header
from ..core.peering import ACTIVATOR_SCOPE, Answer, Check, PeerAuthError, PeerState
from ..core.timeouts import Timeouts
from ..core.topology import Topology
from ..pods.clients import split_address
from ..pods.http1 import FixedBody, UpstreamPool

log = logging.getLogger("activator")

#: Largest check body accepted (a view of every limited pod).
MAX_CHECK_BYTES = 4 * 1024 * 1024
#: The header that marks a check relayed to a sibling (it goes no further).
RELAYED_HEADER = b"activator-relayed"


def _secret(topology: Topology) -> str | None:
    peers = topology.config.activators
    return peers.secret if peers is not None else None


class PeerEndpoint:
    """Answers the checks of peers and siblings (see the module docstring)."""

    def __init__(
        self,
        topology: Topology,
        post: Callable[[TopologyEvent, Flag | None], None],
        me: Callable[[], str],
        sibling_secret: str | None = None,
    ) -> None:
        self.topology = topology
        self.post = post
        self.me = me
        #: With workers: the activator's own secret for its workers (made by the supervisor).
        self.sibling_secret = sibling_secret

    def serve(self, exchange: ClientExchange) -> None:
        """Answer one request to the peer path."""
        body = _read_body(exchange)
        relayed = any(name.lower() == RELAYED_HEADER for name, _ in exchange.head.headers)
        proof = next((value for name, value in exchange.head.headers if name.lower() == peering.PROOF_HEADER), None)
        try:
            if body is None or exchange.head.method != "POST":
                raise ValueError("a check is a POST with a body")
            check = peering.decode_check(body)
            self._verify(check, proof, body)
        except (PeerAuthError, ValueError) as error:
            log.warning("refused a peer check from %s: %s", exchange.client_ip, error)
            _respond(exchange, 403, b"peer-auth", b"")
            return
        applied = Flag()
        issuer = check.sender
        self.post(ViewReceived(issuer, check.view), applied)
        applied.wait()
        answers = [self._own_answer(check)]
        if check.scope == ACTIVATOR_SCOPE and not relayed and len(self.topology.workers) > 1:
            siblings = self._relay(body, proof)
            if siblings is None:
                _respond(exchange, 503, b"sibling-unavailable", b"")
                return
            answers += siblings
        answer = peering.merge_answers(self.me(), answers)
        data = peering.encode_answer(answer)
        secret = self._secret_for(check)
        headers: list[Header] = [(b"Content-Type", b"application/json")]
        if secret is not None:
            # A sibling signs as "worker N" (an activator without peers has no name).
            signer = f"worker {self.topology.worker_index}" if check.scope == peering.WORKER_SCOPE else self.me()
            headers.append((b"Activator-Peer", peering.prove(secret, signer, time.time(), data)))
        _respond(exchange, 200, b"OK", data, headers)

    def _secret_for(self, check: Check) -> str | None:
        return self.sibling_secret if check.scope == peering.WORKER_SCOPE else _secret(self.topology)

    def _verify(self, check: Check, proof: bytes | None, body: bytes) -> None:
        secret = self._secret_for(check)
        if secret is None:
            raise PeerAuthError("this activator has no peers")
        name = peering.verify(secret, proof, body, time.time())
        if name != check.sender:
            raise PeerAuthError(f"a proof by {name} for a check by {check.sender}")

    def _own_answer(self, check: Check) -> Answer:
        return self.topology.answer(check, self.me())

    def _relay(self, body: bytes, proof: bytes | None) -> list[Answer] | None:
        """The same check, to every sibling; their answers (None if one did not answer)."""
        index = self.topology.worker_index
        addresses = [a for i, a in enumerate(self.topology.workers) if i != index]
        headers: list[Header] = [(RELAYED_HEADER, b"1")]
        if proof is not None:
            headers.append((b"Activator-Peer", proof))
        jobs = [gevent.spawn(_post, address, body, headers, self._timeout()) for address in addresses]
        gevent.joinall(jobs)
        answers = []
        for job in jobs:
            outcome = job.value if job.successful() else None
            if outcome is None or isinstance(outcome, str):  # no answer, or REFUSED
                return None
            status, data, _ = outcome
            try:
                answers.append(peering.decode_answer(data) if status == 200 else None)
            except ValueError:
                return None
            if answers[-1] is None:
                return None
        return [a for a in answers if a is not None]

    def _timeout(self) -> float:
        peers = self.topology.config.activators
        return peers.timeout if peers is not None else 1.0


class PeerChecker:
    """Checks the fleet (see the module docstring)."""

    def __init__(
        self,
        topology: Topology,
        post: Callable[[TopologyEvent], None],
        me: Callable[[], str],
        sibling_secret: str | None = None,
    ) -> None:
        self.topology = topology
        self.post = post
        self.me = me
        self.sibling_secret = sibling_secret
        self._kick = Flag()
        self._greenlet: gevent.Greenlet | None = None
        #: Checks under way, by target name (one at a time per target).
        self._running: dict[str, gevent.Greenlet] = {}
        self._next_down_check = 0.0

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
        gevent.killall(list(self._running.values()), block=False)

    def kick(self) -> None:
        """Check everyone now (a new file: hand-overs wait for fresh answers). Does not yield."""
        self._kick.set()

    def _run(self) -> None:
        next_round = 0.0
        while True:
            peers = self.topology.config.activators
            interval = peers.interval if peers is not None else 1.0
            if self._kick.is_set() or time.monotonic() >= next_round:
                next_round = time.monotonic() + interval
                every = True
            else:
                every = False
            self._kick.clear()
            # Asked again soon: a holder a hand-over waits on (the slot is idle meanwhile),
            # and, less soon, a peer that is down (nothing is forwarded to it meanwhile).
            fleet = self.topology.fleet
            waited_on = fleet.handovers.waiting_on()
            down = {name for name, health in fleet.health.items() if health.state is PeerState.DOWN}
            now = time.monotonic()
            due_down = now >= self._next_down_check
            if due_down:
                self._next_down_check = now + DOWN_RECHECK_SECONDS
            for target in fleet.check_targets(self.topology.workers):
                running = self._running.get(target.name)
                again = target.name in waited_on or (due_down and target.name in down)
                if (every or again) and (running is None or running.dead):
                    self._running[target.name] = gevent.spawn(self._check, target)
            wait = next_round - time.monotonic()
            if waited_on:
                wait = min(wait, HANDOVER_RECHECK_SECONDS)
            elif down:
                wait = min(wait, max(0.0, self._next_down_check - time.monotonic()))
            self._kick.wait(max(0.0, wait))

    def _check(self, target: CheckTarget) -> None:
        peers = self.topology.config.activators
        # (a peer that left the file is asked with the secret and the name of that file)
        secret = self.sibling_secret if target.scope == peering.WORKER_SCOPE else target.secret
        sender = target.sender
        if secret is None:
            return
        body = peering.encode_check(Check(sender, target.scope, target.view))
        asked_at = time.monotonic()
        headers: list[Header] = [(b"Activator-Peer", peering.prove(secret, sender, time.time(), body))]
        timeout = peers.timeout if peers is not None else 1.0
        try:
            outcome = _post(target.address, body, headers, timeout)
            if isinstance(outcome, str):  # REFUSED
                self.post(PeerChecked(target.name, asked_at, None, "connection refused", refused=True))
                return
            if outcome is None:
                raise ValueError("no answer")
            status, data, proof = outcome
            if status != 200:
                raise ValueError(f"status {status}")
            peering.verify(secret, proof, data, time.time())
            answer = peering.decode_answer(data)
        except (PeerAuthError, ValueError) as error:
            self.post(PeerChecked(target.name, asked_at, None, str(error) or type(error).__name__))
            return
        self.post(PeerChecked(target.name, asked_at, answer))


def _read_body(exchange: ClientExchange) -> bytes | None:
    length = exchange.head.content_length
    if length is not None and length > MAX_CHECK_BYTES:
        return None
    pieces: list[bytes] = []
    size = 0
    while True:
        piece = exchange.read()
        if not piece:
            return b"".join(pieces)
        size += len(piece)
        if size > MAX_CHECK_BYTES:
            return None
        pieces.append(piece)


def _respond(
    exchange: ClientExchange, status: int, reason: bytes, body: bytes, headers: list[Header] | None = None
) -> None:
    lines = [*(headers or []), (b"Content-Length", str(len(body)).encode())]
    if status != 200:
        lines.append((b"X-Activator-Reason", reason))
    exchange.start(status, reason, lines, BodyFraming.LENGTH)
    exchange.finish(last=body)


#: How soon a holder that a hand-over waits on is asked again.
HANDOVER_RECHECK_SECONDS = 0.05
#: How soon a peer that is down is asked again (it is back as soon as it answers).
DOWN_RECHECK_SECONDS = 0.25

#: What ``_post`` returns when the peer's port refused the connection.
REFUSED = "refused"


def _post(
    address: str, body: bytes, headers: list[Header], timeout: float
) -> tuple[int, bytes, bytes | None] | str | None:
    """One POST of a check to ``address``: (status, body, its proof header); REFUSED when
    nothing listens there; None for any other failure."""
    host, port = split_address(address)
    pool = UpstreamPool(host, port, max_idle=0)
    try:
        lines = [(b"Host", address.encode()), (b"Content-Type", b"application/json"), *headers]
        request = PodRequest("POST", peering.PEER_PATH, lines, FixedBody(body), BodyFraming.LENGTH, len(body))
        response = pool.request(request, Timeouts(timeout, timeout, total=timeout))
        try:
            data = b"".join(response.body())
            proof = next((v for n, v in response.head.headers if n.lower() == peering.PROOF_HEADER), None)
            return response.head.status, data, proof
        finally:
            response.close()
    except Exception as error:  # refused, timed out, broken: no answer
        log.debug("peer check to %s: %s", address, error)
        return REFUSED if isinstance(error.__cause__, ConnectionRefusedError) else None
    finally:
        pool.close()
