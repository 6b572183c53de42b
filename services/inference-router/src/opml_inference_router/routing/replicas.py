"""Replicas of one model version and the choice of the one to call (load-aware, with ejection).

A :class:`Replica` is a connection to one worker that serves the model version; the same object
may serve several model versions (a worker hosts many). A :class:`ReplicaSet` keeps, per replica,
what the router needs to choose: requests outstanding, recent latencies, and whether the replica
is ejected after failures. Choice is the power of two choices (two random eligible replicas, the
one with fewer outstanding requests; Mitzenmacher) or least outstanding over all of them, among
the replicas of the nearest site that has room (:meth:`ReplicaSet.pick`, :class:`Sites`).
"""

from __future__ import annotations

import asyncio
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping

from opml_common.retry import Backoff
from opml_inference_router.placement.fleet_config import LOCAL_SITE
from opml_inference_router.routing.latency import LatencyWindow

Clock = Callable[[], float]

MAX_SITE_NAME = 64
"""Longest site name a request may give (:data:`~.wire.SITE_PARAMETER`); a longer one is ignored."""


class Replica(ABC):
    """One worker that serves models, as the router calls it.

    Messages are KServe v2 protobuf messages in wire format: the router forwards the bytes it
    received, so a replica never re-encodes tensors.
    """

    #: Stable identity of the worker (its address), used in metrics and prediction events.
    name: str
    #: The site the worker is at (the fleet's ``PoolConfig.site``): the router's own unless a host serves it.
    site: str = LOCAL_SITE

    @abstractmethod
    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        """Call a GRPCInferenceService ``method`` (``ModelInfer``, ``ModelMetadata``, ``ModelReady``).

        Called once per attempt; the router cancels the coroutine when another replica answered
        first (a backup request won) or the caller went away, and the call must then end at once.

        Raises:
            ReplicaFailed: the replica answered with an error or could not be reached.
        """

    @abstractmethod
    async def close(self) -> None:
        """Release the connection; called when no model version uses the replica any more."""


class ReplicaState:
    """What the router tracks about one replica of one model version."""

    __slots__ = ("replica", "site", "outstanding", "latency", "ejected_until", "failures", "removed", "down",
                 "back_at", "last_error")

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.site = replica.site
        self.outstanding = 0
        self.latency = LatencyWindow()
        self.ejected_until = 0.0
        self.failures = 0  # consecutive ejecting failures
        self.removed = False
        self.down: str | None = None  # why the control plane knows it cannot answer (its worker restarts)
        self.back_at: float | None = None  # when it is expected back (the router's clock), if known
        self.last_error = ""

    @property
    def name(self) -> str:
        return self.replica.name


class Sites:
    """The router's measured round trip to each site, to rank replicas nearest first: its own site
    (``local``) is 0 ms; a site not measured (yet) is farthest (infinity). The host registry's link
    probes update it (:meth:`measured`); one object is shared by every :class:`ReplicaSet` of a router."""

    def __init__(self) -> None:
        self._rtt_ms: dict[str, float] = {}

    def measured(self, rtt_ms: Mapping[str, float]) -> None:
        """The round trips now (site -> ms); a site left out is no longer measured (its hosts are lost)."""
        self._rtt_ms = {site: float(ms) for site, ms in rtt_ms.items()}

    def rtt_ms(self, site: str) -> float:
        if site == LOCAL_SITE:
            return 0.0
        return self._rtt_ms.get(site, math.inf)


class ReplicaSet:
    """The replicas of one model version and how to pick one of them.

    ``policy`` is ``"p2c"`` (power of two choices) or ``"least"`` (least outstanding of all).
    Ejection: a replica that failed in a way that points at the replica (unreachable, killed) is
    skipped for ``eject_s``, doubled per consecutive failure up to ``max_eject_s``
    (:class:`~opml_common.retry.Backoff`: capped, so any number of failures gives a finite delay);
    a success resets it. When every replica is ejected the choice ignores ejection (a panic
    threshold as in Envoy): a maybe-broken replica beats refusing every request.

    Down: a replica the control plane marked down (:meth:`mark_down`: its worker died and
    restarts) is never chosen, not even in a panic, until :meth:`mark_up` or its removal.
    :meth:`changed` is an event set whenever a replica may have become routable (added, marked
    up), so requests that found none can wait for one instead of failing.

    Sites: with replicas at several sites, :meth:`pick` keeps to the nearest site that has room
    (``sites``: the router's measured round trips) and spills farther only past it. ``saturation``:
    the requests in flight at which a replica has no room, set by the router to the replica's share
    of its model's admission limit (None: never, so the nearest site takes every request).
    """

    def __init__(self, *, policy: str = "p2c", eject_s: float = 1.0, max_eject_s: float = 30.0,
                 clock: Clock, rng: random.Random | None = None, sites: Sites | None = None) -> None:
        if policy not in ("p2c", "least"):
            raise ValueError(f"policy must be 'p2c' or 'least', but got {policy!r}")
        if eject_s <= 0 or max_eject_s < eject_s:
            raise ValueError(f"need 0 < eject_s <= max_eject_s, but got eject_s={eject_s}, max_eject_s={max_eject_s}")
        self.policy = policy
        self.eject_s = eject_s
        self.max_eject_s = max_eject_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._states: list[ReplicaState] = []
        self._changed = asyncio.Event()
        self.latency = LatencyWindow()  # the version's latency over all replicas
        self.sites = sites or Sites()
        self.saturation: int | None = None
        self.multi_site = False  # replicas at more than one site: only then does a request's site matter

    @property
    def backoff(self) -> Backoff:
        """The ejection delay after the n-th consecutive failure (n from 0): capped at ``max_eject_s``."""
        return Backoff(base_s=self.eject_s, max_s=self.max_eject_s)

    def changed(self) -> asyncio.Event:
        """An event set the next time a replica may have become routable (added or marked up)."""
        return self._changed

    def retire(self) -> None:
        """Wakes every request waiting for a replica of this set: its version is no longer served, so
        they stop waiting (the router answers them NOT_FOUND)."""
        self._announce()

    def _announce(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self._states)

    def add(self, replica: Replica) -> ReplicaState:
        """Put ``replica`` into rotation (no-op when it is in already); returns its state."""
        for state in self._states:
            if state.name == replica.name:
                return state
        state = ReplicaState(replica)
        self._states = [*self._states, state]
        self._sites_changed()
        self._announce()
        return state

    def remove(self, name: str) -> ReplicaState | None:
        """Take a replica out of rotation; its in-flight calls finish. Returns its state, if any."""
        for state in self._states:
            if state.name == name:
                state.removed = True
                self._states = [s for s in self._states if s is not state]
                self._sites_changed()
                return state
        return None

    def _sites_changed(self) -> None:
        self.multi_site = len({state.site for state in self._states}) > 1

    def mark_down(self, name: str, reason: str, back_at: float | None) -> bool:
        """Takes the replica ``name`` out of every choice: ``reason`` says why, ``back_at`` when it is
        expected back. Returns whether the set has that replica."""
        for state in self._states:
            if state.name == name:
                state.down, state.back_at = reason, back_at
                return True
        return False

    def mark_up(self, name: str) -> bool:
        """Puts a replica marked down back into the choice. Returns whether it was down."""
        for state in self._states:
            if state.name == name and state.down is not None:
                state.down = state.back_at = None
                state.failures, state.ejected_until = 0, 0.0
                self._announce()
                return True
        return False

    def ready_count(self) -> int:
        """Replicas neither down nor ejected."""
        now = self._clock()
        return sum(1 for state in self._states if state.down is None and state.ejected_until <= now)

    def next_ejection_end(self) -> float | None:
        """When the first ejected (not down) replica may be tried again; ``None`` when none is ejected."""
        now = self._clock()
        ends = [state.ejected_until for state in self._states if state.down is None and state.ejected_until > now]
        return min(ends) if ends else None

    def why_down(self) -> str:
        """Why no replica is routable, for a person (worker ids and times, never addresses)."""
        if not self._states:
            return "it has no replica"
        now = self._clock()
        parts = []
        for state in self._states:
            if state.down is not None:
                if state.back_at is None:
                    parts.append(state.down)
                elif state.back_at >= now:
                    parts.append(f"{state.down}, back in ~{_seconds(state.back_at - now)}")
                else:
                    parts.append(f"{state.down}, expected back ~{_seconds(now - state.back_at)} ago")
            elif state.ejected_until > now:
                parts.append(f"a replica ejected after {state.failures} failure{'s' if state.failures != 1 else ''}"
                             f" ({state.last_error or 'unreachable'}), tried again in "
                             f"~{_seconds(state.ejected_until - now)}")
            else:
                parts.append("a replica that failed just now")
        return "; ".join(parts)

    def pick(self, exclude: Collection[ReplicaState] = (), site: str = "") -> ReplicaState | None:
        """The replica to call next, never one in ``exclude`` or down; ``None`` when none is left.

        Nearest first: the routable replicas are grouped by site, ``site`` (the client's, when the
        request names one; a site no replica is at changes nothing) first, then by the router's round
        trip to each (its own site 0 ms), and the choice (power of two choices or least outstanding)
        is made among the replicas of the first site that is not saturated. A replica is
        **saturated** when its outstanding requests reach ``saturation``: its share of the model's
        admission limit (``max_concurrency`` over the model's replicas; by default two batches of its
        own, one running and one forming), past which a request would queue behind a full batch at its
        worker, while a farther replica with room answers after one round trip. A site is saturated
        when each of its routable replicas is. Unhealthy replicas (down, ejected, or in ``exclude``:
        the ones this request tried already, or the primary a backup request hedges) are no candidates,
        so a retry or a backup goes to the next nearest. When every site is saturated the nearest one
        takes the request (admission bounds what waits there).
        """
        now = self._clock()
        candidates = [s for s in self._states if s.down is None and s.ejected_until <= now and s not in exclude]
        if not candidates:
            candidates = [s for s in self._states if s.down is None and s not in exclude]  # panic: ignore ejection
            if not candidates:
                return None
        if len(candidates) == 1:
            return candidates[0]
        if self.multi_site:
            candidates = self._nearest_with_room(candidates, site)
            if len(candidates) == 1:
                return candidates[0]
        if self.policy == "p2c":
            first, second = self._rng.sample(candidates, 2)
            return first if first.outstanding <= second.outstanding else second
        return min(candidates, key=lambda s: s.outstanding)

    def _nearest_with_room(self, candidates: list[ReplicaState], site: str) -> list[ReplicaState]:
        """The candidates at the nearest site with an unsaturated replica, those replicas only (see :meth:`pick`)."""
        by_site: dict[str, list[ReplicaState]] = {}
        for state in candidates:
            by_site.setdefault(state.site, []).append(state)
        order = sorted(by_site, key=lambda name: (name != site, self.sites.rtt_ms(name), name))
        limit = self.saturation
        if limit is None:
            return by_site[order[0]]
        for name in order:
            room = [state for state in by_site[name] if state.outstanding < limit]
            if room:
                return room
        return by_site[order[0]]

    def succeeded(self, state: ReplicaState, seconds: float) -> None:
        state.latency.observe(seconds)
        self.latency.observe(seconds)
        if state.failures:
            state.failures = 0
            state.ejected_until = 0.0

    def failed(self, state: ReplicaState, *, eject: bool, error: str = "") -> None:
        if eject:
            state.failures += 1
            state.last_error = error[:200]
            state.ejected_until = self._clock() + self.backoff.delay(state.failures - 1)


def _seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 1.5 else f"{seconds:.1f} s"
