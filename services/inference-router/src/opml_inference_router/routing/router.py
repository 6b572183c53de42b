"""The routing core: which replica of which version answers a request, within its deadline.

Transport-free (no grpc import): replicas are :class:`~.replicas.Replica` objects made by a
``connect(address)`` callable, so the same code runs over gRPC workers and over fakes in tests.

Data plane, per request (:meth:`Router.infer`): model -> its request size limit (O(1): the length
of the bytes, before any copy; :mod:`.limits`) -> version (the caller's, or the traffic
split's) -> admission (the model's concurrency limit and bounded queue, shedding what cannot meet
its deadline) -> a replica by power of two choices, at the nearest site with room (the client's
site first when the request names one: :data:`~.wire.SITE_PARAMETER`; :meth:`.ReplicaSet.pick`) ->
a backup request to the next nearest replica if the first has not answered after its observed p95
latency (first answer wins, the loser is cancelled) -> on a retriable failure (replica unreachable
or killed, busy, model missing) the next nearest replica while the deadline allows, and the failed
replica ejected for a while.

Control plane (a deploy API or pool manager calls these at run time, on the router's loop):
:meth:`set_model`, :meth:`remove_model`, :meth:`add_replica`, :meth:`remove_replica`,
:meth:`set_traffic`, :meth:`start_canary`, :meth:`promote`, :meth:`rollback`, :meth:`describe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, OpmlError, Unavailable
from opml_common.metrics import ServiceMetrics
from opml_inference_router.routing import wire
from opml_inference_router.routing.admission import ConcurrencyLimiter, Shed
from opml_inference_router.routing.canary import TrafficSplit
from opml_inference_router.routing.errors import DeadlineExceeded, ReplicaFailed
from opml_inference_router.routing.limits import DEFAULT_GRPC_MAX_RECEIVE_BYTES, DEFAULT_MAX_REQUEST_BYTES, RequestLimit
from opml_inference_router.routing.metrics import RouterMetrics, VersionMetrics
from opml_inference_router.routing.policy import ModelPolicy
from opml_inference_router.routing.replicas import (
    LOCAL_SITE,
    MAX_SITE_NAME,
    Clock,
    Replica,
    ReplicaSet,
    ReplicaState,
    Sites,
)
from opml_inference_router.routing.shadow import (
    DEFAULT_MAX_IN_FLIGHT,
    Comparison,
    ShadowMeasures,
    ShadowMetrics,
    ShadowMirror,
)
from opml_inference_router.routing.window import Measures

log = logging.getLogger(__name__)

_MAX_HEDGE_TOKENS = 10.0
_WAIT_MARGIN_S = 0.005
"""Least time a request that waits for a replica to come back keeps for the call itself."""


class VersionRetired(NotFound):
    """The version a request was routed to stopped being served (rolled back, replaced) before it was
    answered: one the caller named is NOT_FOUND; one the traffic split chose is routed again."""


@dataclass(frozen=True, slots=True)
class Routed:
    """A response and how it was obtained (for the caller, metrics and the prediction log)."""

    response: bytes
    version: str
    replica: str
    attempts: int
    backup_won: bool
    site: str = LOCAL_SITE


class _Version:
    __slots__ = ("model", "version", "replicas", "metrics")

    def __init__(self, model: str, version: str, replicas: ReplicaSet, metrics: VersionMetrics) -> None:
        self.model, self.version, self.replicas, self.metrics = model, version, replicas, metrics


class _Model:
    __slots__ = ("name", "policy", "limiter", "versions", "split", "stable", "hedge_tokens", "max_request")

    def __init__(self, name: str, policy: ModelPolicy, max_request: RequestLimit) -> None:
        self.name = name
        self.policy = policy
        self.max_request = max_request
        self.limiter = ConcurrencyLimiter(limit=policy.max_concurrency, max_queue=policy.max_queue, name=name,
                                          slo_s=policy.slo_p99_ms / 1000.0)
        self.versions: dict[str, _Version] = {}
        self.split: TrafficSplit | None = None
        self.stable: str | None = None
        self.hedge_tokens = _MAX_HEDGE_TOKENS


class Router:
    """Routes KServe v2 requests (wire-format bytes) to replicas of model versions.

    ``max_request_bytes``: the request size limit of a model whose policy sets none;
    ``max_receive_bytes``: the server's message cap, above which no model's limit goes (a longer
    message never reaches the router).

    Side effects: ``add_replica`` opens a connection per new address (``connect``); ``close()``
    and removing the last user of an address close it. ``close()`` is idempotent.
    """

    def __init__(self, *, connect: Callable[[str], Replica], metrics: ServiceMetrics,
                 clock: Clock = time.monotonic, rng: random.Random | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_receive_bytes: int = DEFAULT_GRPC_MAX_RECEIVE_BYTES) -> None:
        if max_request_bytes < 1:
            raise InvalidArgument("max_request_bytes", f"must be >= 1, but got {max_request_bytes}")
        if max_receive_bytes < 1:
            raise InvalidArgument("max_receive_bytes", f"must be >= 1, but got {max_receive_bytes}")
        self.max_request_bytes = max_request_bytes
        self.max_receive_bytes = max_receive_bytes
        self._connect = connect
        self._metrics = RouterMetrics(metrics)
        self._clock = clock
        self._rng = rng or random.Random()
        self._models: dict[str, _Model] = {}
        self._connections: dict[str, tuple[Replica, int]] = {}  # address -> (replica, users)
        self._shadows: dict[str, ShadowMirror] = {}  # model -> its mirror to a rollout's new version
        self._shadow_metrics = ShadowMetrics(metrics)
        self.sites = Sites()  # the measured round trip to each site, for nearest-first choice

    def set_site_rtts(self, rtt_ms: Mapping[str, float]) -> None:
        """The measured round trip to each site now (ms; the host registry's probes), for choosing replicas."""
        self.sites.measured(rtt_ms)

    # ------------------------------------------------------------------------------------------
    # Control plane

    def set_model(self, name: str, policy: ModelPolicy) -> None:
        """Serve model ``name`` with ``policy``, or apply a new policy to it (limits take effect at once)."""
        if not name:
            raise InvalidArgument("name", "must be a non-empty model name, but got ''")
        max_request = (policy.max_request or RequestLimit(
            self.max_request_bytes, "the router's default, OPML_INFERENCE_ROUTER_MAX_REQUEST_BYTES")).capped(
            self.max_receive_bytes, "the router's gRPC message cap, OPML_INFERENCE_ROUTER_GRPC_MAX_RECEIVE_BYTES")
        model = self._models.get(name)
        if model is None:
            self._models[name] = _Model(name, policy, max_request)
            return
        model.policy = policy
        model.max_request = max_request
        model.limiter.resize(limit=policy.max_concurrency, max_queue=policy.max_queue,
                             slo_s=policy.slo_p99_ms / 1000.0)
        for served in model.versions.values():
            served.replicas.policy = policy.selection
            served.replicas.eject_s = policy.eject_s
            served.replicas.max_eject_s = max(served.replicas.max_eject_s, policy.eject_s)
        self._share(model)
        if model.split is not None:
            model.split = self._split(model, model.split.weights)

    async def remove_model(self, name: str) -> None:
        """Stop serving a model: new requests get NOT_FOUND, in-flight ones finish.

        Raises: NotFound.
        """
        model = self._model(name)
        del self._models[name]
        self._metrics.traffic(name, {})
        await self.stop_shadow(name)
        for served in model.versions.values():
            served.replicas.retire()
            for state in list(served.replicas):
                await self._drop(served, state.name)

    def add_replica(self, model: str, version: str, address: str) -> None:
        """Put the replica of ``model`` ``version`` at ``address`` into rotation (idempotent).

        The first version of a model gets all its traffic; a later one gets none until
        :meth:`start_canary`, :meth:`set_traffic` or :meth:`promote`.

        Raises: NotFound (the model was not set), InvalidArgument (empty version or address).
        """
        route = self._model(model)
        if not version:
            raise InvalidArgument("version", "must be a non-empty version, but got ''")
        if not address:
            raise InvalidArgument("address", "must be a worker address host:port, but got ''")
        served = route.versions.get(version)
        if served is None:
            replicas = ReplicaSet(policy=route.policy.selection, eject_s=route.policy.eject_s,
                                  max_eject_s=max(30.0, route.policy.eject_s), clock=self._clock, rng=self._rng,
                                  sites=self.sites)
            served = route.versions[version] = _Version(model, version, replicas,
                                                        self._metrics.version(model, version))
            if route.split is None:
                route.split = self._split(route, {version: 1.0})
                route.stable = version
            self._export_split(route)
        if any(state.name == address for state in served.replicas):
            return
        served.metrics.track(served.replicas.add(self._borrow(address)))
        self._share(route)

    @staticmethod
    def _share(route: _Model) -> None:
        """Each replica's share of the model's admission limit: where :meth:`.ReplicaSet.pick` counts it
        saturated and spills to a farther site."""
        replicas = sum(len(served.replicas) for served in route.versions.values())
        share = max(1, -(-route.policy.max_concurrency // replicas)) if replicas else None
        for served in route.versions.values():
            served.replicas.saturation = share

    @contextlib.asynccontextmanager
    async def connection(self, address: str) -> AsyncIterator[Replica]:
        """The router's connection to the worker at ``address`` (shared with the replicas there), for a
        control-plane caller that must take the path requests take: profiling a version before it is placed."""
        replica = self._borrow(address)
        try:
            yield replica
        finally:
            await self._give_back(address)

    def _borrow(self, address: str) -> Replica:
        replica, users = self._connections.get(address, (None, 0))
        if replica is None:
            replica = self._connect(address)
        self._connections[address] = (replica, users + 1)
        return replica

    async def _give_back(self, address: str) -> None:
        replica, users = self._connections.get(address, (None, 0))
        if replica is None:
            return
        if users <= 1:
            del self._connections[address]
            await replica.close()
        else:
            self._connections[address] = (replica, users - 1)

    async def remove_replica(self, model: str, version: str, address: str) -> None:
        """Take a replica out of rotation; its in-flight requests finish.

        Raises: NotFound (model, version or replica unknown).
        """
        served = self._version(self._model(model), version)
        if not any(state.name == address for state in served.replicas):
            raise NotFound(f"model {model!r} version {version!r} has no replica at {address!r}")
        await self._drop(served, address)

    def replica_down(self, address: str, reason: str, back_in_s: float | None = None) -> int:
        """Marks the replicas at ``address`` (every version it serves) down: no request is sent there
        until it is marked up or removed; requests that find every replica down wait for one (within
        their deadlines) and then fail with UNAVAILABLE naming ``reason`` and ``back_in_s`` (when the
        control plane expects it back, if it knows). Returns how many replicas were marked."""
        back_at = None if back_in_s is None else self._clock() + max(0.0, back_in_s)
        return sum(served.replicas.mark_down(address, reason, back_at)
                   for route in self._models.values() for served in route.versions.values())

    def replica_up(self, address: str) -> int:
        """Puts the replicas at ``address`` marked down back in rotation; returns how many."""
        return sum(served.replicas.mark_up(address)
                   for route in self._models.values() for served in route.versions.values())

    def set_traffic(self, model: str, weights: Mapping[str, float]) -> None:
        """Split the model's traffic (requests without a version) across versions by weight.

        Raises: NotFound (model or a weighted version unknown), InvalidArgument (bad weights).
        """
        route = self._model(model)
        for version, weight in weights.items():
            if weight > 0:
                self._version(route, version)
        route.split = self._split(route, weights)
        if route.split.only is not None:
            route.stable = route.split.only
        self._split_changed(route)

    def start_canary(self, model: str, version: str, percent: float) -> None:
        """Send ``percent`` of the traffic to ``version``, the rest to the stable version.

        Raises: NotFound, InvalidArgument (percent outside (0, 100]), FailedPrecondition (no stable version).
        """
        route = self._model(model)
        if not 0 < percent <= 100:
            raise InvalidArgument("percent", f"must be in (0, 100], but got {percent!r}")
        self._version(route, version)
        if route.stable is None or route.stable == version:
            raise FailedPrecondition(f"model {model!r} has no other stable version to keep serving "
                                     f"{100 - percent}% of its traffic; use promote instead")
        route.split = self._split(route, {route.stable: 100 - percent, version: percent})
        self._split_changed(route)

    def promote(self, model: str, version: str | None = None) -> str:
        """Give ``version`` (default: the canary) all traffic and make it the stable version.

        Returns the promoted version. Raises: NotFound, FailedPrecondition (no canary to promote).
        """
        route = self._model(model)
        if version is None:
            canaries = [v for v in (route.split.weights if route.split else {}) if v != route.stable]
            if len(canaries) != 1:
                raise FailedPrecondition(f"model {model!r} has {len(canaries)} canary versions; "
                                         "name the one to promote")
            version = canaries[0]
        self._version(route, version)
        route.split = self._split(route, {version: 1.0})
        route.stable = version
        self._split_changed(route)
        return version

    def rollback(self, model: str) -> str:
        """Send all traffic back to the stable version. Returns it. Raises: NotFound, FailedPrecondition."""
        route = self._model(model)
        if route.stable is None:
            raise FailedPrecondition(f"model {model!r} has no stable version to roll back to")
        route.split = self._split(route, {route.stable: 1.0})
        self._split_changed(route)
        return route.stable

    def describe(self, model: str) -> dict[str, Any]:
        """The model's routing state: policy, traffic split, replicas with load and ejection."""
        route = self._model(model)
        now = self._clock()
        return {
            "policy": route.policy,
            "max_request_bytes": route.max_request.bytes,
            "stable": route.stable,
            "traffic": dict(route.split.weights) if route.split else {},
            "in_flight": route.limiter.in_flight,
            "concurrency": route.limiter.concurrency,
            "waiting": route.limiter.waiting,
            "versions": {
                version: [{"replica": s.name, "outstanding": s.outstanding, "ejected": s.ejected_until > now,
                           "down": s.down,
                           "p50_ms": s.latency.p50 and s.latency.p50 * 1000,
                           "p95_ms": s.latency.p95 and s.latency.p95 * 1000} for s in served.replicas]
                for version, served in route.versions.items()
            },
        }

    def take_measures(self, model: str) -> dict[str, Measures]:
        """Version -> what its requests did since the last take (all versions over the same interval:
        what a progressive rollout compares). Raises: NotFound."""
        return {version: served.metrics.window.take() for version, served in self._model(model).versions.items()}

    def models(self) -> list[str]:
        return sorted(self._models)

    def direct_routes(self) -> Iterator[tuple[_Model, _Version]]:
        """Each model whose traffic one version takes, with no shadow: what the native front may send
        straight to a worker (:mod:`opml_inference_router.data_plane`)."""
        for route in self._models.values():
            only = route.split.only if route.split is not None else None
            if only is not None and only in route.versions and route.name not in self._shadows:
                yield route, route.versions[only]

    # -- shadow traffic (:mod:`.shadow`) ---------------------------------------------------------

    async def start_shadow(self, model: str, version: str, percent: float, comparison: Comparison, *,
                           max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        """Mirror ``percent`` of the requests the stable version answers to ``version``, at most
        ``max_in_flight`` copies at a time (replacing the model's mirror, if any).
        Raises: NotFound, InvalidArgument (percent outside (0, 100])."""
        route = self._model(model)
        served = self._version(route, version)
        if not 0 < percent <= 100:
            raise InvalidArgument("percent", f"must be in (0, 100], but got {percent!r}")
        await self.stop_shadow(model)

        async def call(request: bytes, deadline: float) -> bytes:
            return (await self._dispatch(route, served, request, deadline)).response

        self._shadows[model] = ShadowMirror(model=model, version=version, percent=percent, comparison=comparison,
                                            call=call, outcomes=served.metrics.window, metrics=self._shadow_metrics,
                                            timeout_s=route.policy.default_timeout_s, clock=self._clock,
                                            rng=self._rng, max_in_flight=max_in_flight)

    async def stop_shadow(self, model: str) -> None:
        """Stops mirroring the model's requests (copies in flight are cancelled); idempotent."""
        mirror = self._shadows.pop(model, None)
        if mirror is not None:
            await mirror.close()

    def take_shadow_measures(self, model: str) -> ShadowMeasures | None:
        """What the model's mirror did since the last take (None: it has none)."""
        mirror = self._shadows.get(model)
        return mirror.window.take() if mirror is not None else None

    async def close(self) -> None:
        """Close every replica connection (idempotent)."""
        for model in list(self._shadows):
            await self.stop_shadow(model)
        connections, self._connections = self._connections, {}
        self._models.clear()
        for replica, _users in connections.values():
            await replica.close()

    # ------------------------------------------------------------------------------------------
    # Data plane

    def is_ready(self, model: str, version: str = "") -> bool:
        """Whether the version (default: any version with traffic) has a replica in rotation."""
        route = self._models.get(model)
        if route is None:
            return False
        if version:
            served = route.versions.get(version)
            return served is not None and served.replicas.ready_count() > 0
        weights = route.split.weights if route.split else {}
        return any(route.versions[v].replicas.ready_count() > 0 for v in weights)

    async def infer(self, model: str, version: str, request: bytes, *, request_id: str = "",
                    timeout_s: float | None = None, site: str | None = None) -> Routed:
        """Answer a ModelInferRequest (wire bytes) from a replica of ``model``.

        ``version`` empty: the traffic split chooses (by ``request_id`` when sticky), and the
        forwarded request carries the chosen version. ``timeout_s``: the caller's deadline
        (default: the model's ``default_timeout_s``, which a DEADLINE_EXCEEDED then names as the source).
        ``site``: the client's site, whose replicas come first (None: the request's
        :data:`~.wire.SITE_PARAMETER`, read only when the version has replicas at several sites; an
        unknown or over-long one is ignored).

        Raises:
            NotFound: the model or version is not served.
            InvalidArgument: ``request`` is longer than the model's limit (field ``request``; checked
                first, in O(1), so nothing is copied or forwarded).
            Shed (ResourceExhausted): admission refused the request.
            Unavailable: no replica of the version is routable (every one down or ejected, or none),
                and none came back within the deadline (it waits for one while the deadline leaves
                time; the message says why each is down and when it is expected back).
            DeadlineExceeded: no replica answered in time.
            ReplicaFailed: the replicas' error when none succeeded (its code is passed on).
        """
        route = self._models.get(model)
        if route is None:
            raise NotFound(f"model {model!r} is not served by this router (served: {self.models()})")
        if version:
            served = self._version(route, version)
        elif route.split is not None:
            served = route.versions[route.split.choose(request_id)]
        else:
            raise Unavailable(f"model {model!r} has no version deployed yet")
        if len(request) > route.max_request.bytes:  # O(1), before the one copy below and any forwarding
            served.metrics.failed("INVALID_ARGUMENT")
            raise InvalidArgument("request", f"is {len(request)} bytes, more than model {model!r} accepts: "
                                             f"{route.max_request.bytes} bytes ({route.max_request.basis})")
        if not version:
            request = wire.with_field(request, wire.MODEL_VERSION, served.version)
        policy = route.policy
        start = self._clock()
        time_left = timeout_s if timeout_s is not None else policy.default_timeout_s
        limiter = route.limiter
        granted = start
        if not limiter.try_acquire():
            try:
                latency = served.replicas.latency
                await limiter.acquire(time_left_s=time_left, expected_s=latency.p50 or 0.0, tail_s=latency.p99,
                                      current_tail=lambda: latency.p99)
            except Shed as exc:
                self._metrics.shed.labels(model, exc.reason).inc()
                served.metrics.failed(exc.code)
                raise
            granted = self._clock()
        service_s: float | None = None
        try:
            try:
                routed = await self._dispatch(route, served, request, start + time_left,
                                              self._client_site(served, request, site))
            except VersionRetired:
                if version or route.split is None or self._models.get(model) is not route:
                    raise
                # routed by the traffic split, whose version a rollout took back while the request was in
                # flight: the split's version now answers it, so a rollback fails none of its requests
                served = route.versions[route.split.choose(request_id)]
                request = wire.with_field(request, wire.MODEL_VERSION, served.version)
                routed = await self._dispatch(route, served, request, start + time_left,
                                              self._client_site(served, request, site))
            service_s = self._clock() - granted
        except OpmlError as exc:
            served.metrics.failed(exc.code)
            if timeout_s is None and exc.code == "DEADLINE_EXCEEDED":
                raise DeadlineExceeded(f"model {model!r}: {policy.default_deadline_passed()} ({exc.message})") from exc
            raise
        except asyncio.CancelledError:
            served.metrics.failed("CANCELLED")
            raise
        finally:
            limiter.release(service_s)
        served.metrics.answered(self._clock() - start, routed.site)
        if self._shadows:
            self._mirror(model, request, routed)
        return routed

    @staticmethod
    def _client_site(served: _Version, request: bytes, site: str | None) -> str:
        """The client's site for the choice: '' where the version is at one site (it changes nothing there)."""
        if not served.replicas.multi_site:
            return ""
        if site is not None:
            return site if len(site) <= MAX_SITE_NAME else ""
        try:
            return wire.string_parameter(request, wire.SITE_PARAMETER, max_length=MAX_SITE_NAME)
        except wire.MalformedMessage:  # the front checked its header: whatever else is wrong, the worker says
            return ""

    def _mirror(self, model: str, request: bytes, routed: Routed) -> None:
        """A copy of an answered request to the model's shadow version, if it has one (:mod:`.shadow`:
        started here, never awaited)."""
        mirror = self._shadows.get(model)
        if mirror is not None:
            mirror.mirror(request, routed.version, routed.response)

    async def forward(self, method: str, model: str, version: str, request: bytes, *, timeout_s: float) -> bytes:
        """Pass a per-model call (``ModelMetadata``, ``ModelReady``: name = field 1, version = field 2)
        to one replica of the version; without one, of the stable version, named in the request.

        Raises: NotFound, Unavailable, ReplicaFailed.
        """
        route = self._model(model)
        served = self._version(route, version or route.stable or "")
        if not version:
            request = wire.with_field(request, wire.MODEL_VERSION, served.version)
        state = served.replicas.pick()
        if state is None:
            raise Unavailable(f"every replica of model {model!r} version {served.version!r} is down "
                              f"({served.replicas.why_down()})")
        return await state.replica.call(method, request, timeout_s=timeout_s)

    async def _dispatch(self, route: _Model, served: _Version, request: bytes, deadline: float,
                        site: str = "") -> Routed:
        """Tries up to ``max_attempts`` replicas, nearest first (``site``: the client's); when none is
        routable (every one down or ejected, or none at all) waits for one (:meth:`_wait_routable`) while
        the deadline allows, then tries again."""
        policy, replicas = route.policy, served.replicas
        tried: list[ReplicaState] = []
        attempts = 0  # since the last wait
        route.hedge_tokens = min(_MAX_HEDGE_TOKENS, route.hedge_tokens + policy.hedge_budget)
        last_error: OpmlError | None = None
        while True:
            state = replicas.pick(exclude=tried, site=site) if attempts < policy.max_attempts else None
            if state is None:
                if replicas.ready_count() > 0:  # routable replicas remain, but the attempts are spent
                    if last_error is None:  # unreachable: a routable replica is always picked
                        raise Unavailable(f"model {route.name!r} version {served.version!r} has no replica "
                                          "in rotation")
                    raise last_error
                if self._retired(route, served):  # before waiting too: retired while its call was in flight
                    raise VersionRetired(f"model {route.name!r} version {served.version!r} is no longer served "
                                         "(retired while this request was in flight)")
                await self._wait_routable(route, served, deadline)
                if self._retired(route, served):
                    raise VersionRetired(f"model {route.name!r} version {served.version!r} is no longer served "
                                         "(retired while this request waited for a replica)")
                tried, attempts = [], 0
                continue
            if tried:
                served.metrics.retries.inc()
            tried.append(state)
            attempts += 1
            try:
                if policy.hedge and len(replicas) > len(tried):
                    return await self._hedged(route, served, state, request, deadline, tried, site)
                response = await self._attempt(served, state, request, deadline)
                return Routed(response, served.version, state.name, len(tried), False, state.site)
            except ReplicaFailed as exc:
                if not exc.retriable:
                    raise
                last_error = exc
            if self._clock() >= deadline:
                raise DeadlineExceeded(f"model {route.name!r} version {served.version!r}: the deadline passed "
                                       f"after {len(tried)} replicas failed; last error: {last_error}")

    def _retired(self, route: _Model, served: _Version) -> bool:
        return self._models.get(route.name) is not route or route.versions.get(served.version) is not served

    async def _wait_routable(self, route: _Model, served: _Version, deadline: float) -> None:
        """Waits until a replica of the version may be routable again: one is added or marked up (its
        worker restarted), or an ejection ends; never past ``deadline`` minus a margin for the call
        itself (the version's p50 latency, at least :data:`_WAIT_MARGIN_S`).

        Raises:
            Unavailable: the deadline leaves no time to wait; the message says that every replica is
                down, why, and when each is expected back.
        """
        replicas = served.replicas
        margin = max(_WAIT_MARGIN_S, replicas.latency.p50 or 0.0)
        until = deadline - margin
        ejection_end = replicas.next_ejection_end()
        wake = until if ejection_end is None else min(until, ejection_end)
        now = self._clock()
        if now >= until:
            raise Unavailable(f"every replica of model {route.name!r} version {served.version!r} is down "
                              f"({replicas.why_down()})")
        changed = replicas.changed()
        served.metrics.waits.inc()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout=max(0.0, wake - now))

    async def _hedged(self, route: _Model, served: _Version, primary: ReplicaState, request: bytes,
                      deadline: float, tried: list[ReplicaState], site: str = "") -> Routed:
        """Call ``primary``; after its p95 latency, also the next nearest replica; the first success wins.

        Raises the last ReplicaFailed when every launched call failed (retriable or not)."""
        loop = asyncio.get_running_loop()
        policy, replicas = route.policy, served.replicas
        first = loop.create_task(self._attempt(served, primary, request, deadline))
        pending: dict[asyncio.Future[bytes], ReplicaState] = {first: primary}
        delay = primary.latency.p95
        if delay is None:
            delay = policy.slo_p99_ms / 1000.0 * policy.hedge_slo_fraction
        hedge_at: float | None = self._clock() + max(delay, policy.hedge_min_delay_ms / 1000.0)
        last_error: ReplicaFailed | None = None
        try:
            while pending:
                wake = deadline if hedge_at is None else min(deadline, hedge_at)
                done, _ = await asyncio.wait(pending, timeout=max(0.0, wake - self._clock()),
                                             return_when=asyncio.FIRST_COMPLETED)
                winner: tuple[bytes, ReplicaState] | None = None
                for task in done:
                    state = pending.pop(task)
                    exc = task.exception()
                    if exc is None:
                        winner = winner or (task.result(), state)
                    elif isinstance(exc, ReplicaFailed):
                        last_error = exc
                    else:
                        raise exc
                if winner is not None:
                    backup_won = winner[1] is not primary
                    if backup_won:
                        served.metrics.backup_wins.inc()
                    return Routed(winner[0], served.version, winner[1].name, len(tried), backup_won, winner[1].site)
                if last_error is not None and not last_error.retriable:
                    raise last_error
                if done:
                    continue
                if self._clock() >= deadline:
                    raise DeadlineExceeded(f"model {route.name!r} version {served.version!r}: no replica "
                                           f"answered within the deadline")
                hedge_at = None  # the hedge delay passed with the first call still running
                backup = replicas.pick(exclude=tried, site=site) if route.hedge_tokens >= 1 else None
                if backup is not None:
                    route.hedge_tokens -= 1
                    tried.append(backup)
                    served.metrics.backups.inc()
                    pending[loop.create_task(self._attempt(served, backup, request, deadline))] = backup
        finally:
            for task in pending:
                task.cancel()  # the loser: cancelling the gRPC call tells its worker to drop it
        assert last_error is not None
        raise last_error

    async def _attempt(self, served: _Version, state: ReplicaState, request: bytes, deadline: float) -> bytes:
        state.outstanding += 1
        start = self._clock()
        try:
            response = await state.replica.call("ModelInfer", request, timeout_s=max(deadline - start, 0.001))
        except ReplicaFailed as exc:
            served.replicas.failed(state, eject=exc.eject, error=exc.message)
            if exc.eject:
                served.metrics.ejected(state.name)
                log.warning("replica ejected", extra={"model": served.model, "version": served.version,
                                                      "replica": state.name, "code": exc.code, "error": exc.message,
                                                      "for_s": round(state.ejected_until - self._clock(), 3)})
            raise
        finally:
            state.outstanding -= 1
        served.replicas.succeeded(state, self._clock() - start)
        return response

    # ------------------------------------------------------------------------------------------

    def _split(self, route: _Model, weights: Mapping[str, float]) -> TrafficSplit:
        """Raises: InvalidArgument (bad weights)."""
        return TrafficSplit(weights, sticky=route.policy.sticky_canary, rng=self._rng)

    def _model(self, name: str) -> _Model:
        route = self._models.get(name)
        if route is None:
            raise NotFound(f"model {name!r} is not served by this router (served: {self.models()})")
        return route

    @staticmethod
    def _version(route: _Model, version: str) -> _Version:
        served = route.versions.get(version)
        if served is None:
            raise NotFound(f"model {route.name!r} has no version {version!r} (versions: {sorted(route.versions)})")
        return served

    async def _drop(self, served: _Version, address: str) -> None:
        state = served.replicas.remove(address)
        if state is None:
            return
        served.metrics.untrack(state)
        route = self._models.get(served.model)
        if route is not None:
            self._split_changed(route)
            self._share(route)
        await self._give_back(address)

    def _split_changed(self, route: _Model) -> None:
        """After the split or the versions changed: retired versions forgotten, each version's share exported."""
        self._forget_retired(route)
        self._export_split(route)

    def _export_split(self, route: _Model) -> None:
        weights = route.split.weights if route.split else {}
        total = sum(weight for weight in weights.values() if weight > 0)
        self._metrics.traffic(route.name, {version: max(weights.get(version, 0), 0) / total if total else 0.0
                                           for version in route.versions})

    @staticmethod
    def _forget_retired(route: _Model) -> None:
        """Forgets the versions with neither a replica nor traffic, the stable one aside (retired: rolled
        back, replaced, undeployed): a request naming one gets NOT_FOUND at once instead of waiting out its
        deadline, holding an admission slot, for a replica that is not coming; and a model deployed many
        times does not keep every old version. A version comes back with its next replica."""
        weights = route.split.weights if route.split else {}
        for version, served in list(route.versions.items()):
            if not len(served.replicas) and weights.get(version, 0) <= 0 and version != route.stable:
                del route.versions[version]
                served.replicas.retire()
