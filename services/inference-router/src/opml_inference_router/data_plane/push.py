"""The router's side of the direct data plane: route tables and verdicts out, the front's reports in.

Pushes travel on the front's link as response frames with call id :data:`PUSH_ID` (the front's call
ids start at 1); their body is text, one tab-separated line per item (``native/front.cc``,
``Link::OnPush``). Reports are request frames of kind :data:`~..frames.REPORT` whose body is a run
of :data:`RECORD` headers, each followed by its strings and bytes.

Admission: the front's tokens are slots of the model's :class:`~..routing.ConcurrencyLimiter` that
this side holds for it (a lease), sized to the front's demand for the model (its calls in flight, by
Little's law from the calls it answered, directly or through the router, over each interval; a rise
taken at once, a fall over :data:`DEMAND_HOLD_S`, since the callers come in bursts) times
:data:`LEASE_HEADROOM`, plus one; none once the front sent the model nothing for ``idle_s``; never more
than the limit in force, and only slots that are free (``try_acquire``). A call of the router's path
(one the front hands over when it has no token left, or one on the router's own port) that finds no
slot free takes one the lease holds (the limiter's ``lender``; the front's table shrinks with it)
before it queues: the lease's slots are for calls yet to come, and a call queued behind them made
the limit's AIMD cut the limit for a wait no overload caused, which shrank the lease, which sent more
calls to wait (8-46% shed at 32 callers, docs/benchmarks.md). So a call waits at the router, is priced
and shed there, only when the calls really in flight fill the limit; under overload the lease empties
and every call takes the router's path. Each answered call gives its slot back with its service time
(the limiter adapts its limit to it, and hands the slot to a waiter of the router's path first) and
the lease takes one again while the limit allows.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_inference_router.frames import CODE_NAMES, KINDS, OK, RESPONSE, FrameWriter
from opml_inference_router.predictions import PredictionLog
from opml_inference_router.routing import ConcurrencyLimiter, ReplicaFailed, ReplicaSet, ReplicaState, Routed, Router
from opml_inference_router.routing.metrics import VersionMetrics
from opml_inference_router.worker.uds import SCHEME

log = logging.getLogger(__name__)

PUSH_ID = 0
RECORD = struct.Struct("<BBBBdddHHHHII")
"""A report record: type (:data:`OUTCOME`, :data:`ATTEMPT_FAILED`, :data:`BACKUP_SENT`), status (a
gRPC code number), attempts, backup won, received (unix s), call s, attempt s, then the lengths of
model, version, request id, replica (the worker's socket path), request bytes, response bytes."""
OUTCOME, ATTEMPT_FAILED, BACKUP_SENT = 0, 1, 2
LEASE_HEADROOM = 2.0
"""The lease is this many times the front's calls in flight: calls beyond it take the router's path, are
counted in the demand, and the lease grows to them within an interval."""
DEMAND_HOLD_S = 1.0
"""The front's demand falls by e-fold in this long when its calls do (it rises at once): the load
generator's callers come in bursts, and a lease that followed each interval's count swung between a
few slots, which sent the burst's calls to the router's path, and the whole limit."""
_MAX_VERDICTS = 1024
_MAX_KNOWN = 1024


class _Known(NamedTuple):
    """A model version's direct route as last pushed: what its reports are applied to."""

    states: dict[str, ReplicaState]
    metrics: VersionMetrics
    replicas: ReplicaSet


class _Lease:
    """Slots of one model's limiter held for the front; ``lent``: called when a call of the router's path
    took one (the front's table is then pushed again)."""

    __slots__ = ("limiter", "held", "wanted", "lent")

    def __init__(self, limiter: ConcurrencyLimiter, lent: Callable[[], None] | None = None) -> None:
        self.limiter, self.held, self.wanted, self.lent = limiter, 0, 0, lent
        limiter.lender = self.lend

    def lend(self) -> bool:
        """Passes a held slot on to a call of the router's path that found none free (it releases it)."""
        if not self.held:
            return False
        self.held -= 1
        if self.lent is not None:
            self.lent()
        return True

    def fit(self) -> None:
        """Takes (free ones only) or gives back slots until the lease is what the front wants, within the
        limit in force."""
        limiter = self.limiter
        target = min(self.wanted, limiter.concurrency)
        while self.held < target and limiter.try_acquire():
            self.held += 1
        while self.held > target:
            limiter.release()
            self.held -= 1

    def answered(self, service_s: float) -> None:
        """A call on the lease was answered: its slot goes back with its service time, then is taken again."""
        if self.held:
            self.held -= 1
            self.limiter.release(service_s)
        self.fit()

    def give_back(self) -> None:
        """Ends the lease: its slots go back to the limiter, which lends nothing more."""
        if self.limiter.lender == self.lend:
            self.limiter.lender = None
        for _ in range(self.held):
            self.limiter.release()
        self.held = 0


class DirectPlane(Component):
    """Keeps the native front's route table current and applies its reports (see the package's doc).

    ``auth``: callers' credentials are checked (the platform has tokens); ``interval_s``: how often
    the table is recomputed (pushed when it changed); ``verdict_ttl_s``: how long the front trusts a
    credential the router let through; ``idle_s``: how long after the front's last call of a model its
    lease is kept. Metrics: ``opml_inference_router_direct_tokens{model}`` (the
    slots leased to the front), ``opml_inference_router_direct_reported_total{type}``.
    """

    def __init__(self, router: Router, *, predictions: PredictionLog | None, metrics: ServiceMetrics, auth: bool,
                 interval_s: float = 0.02, verdict_ttl_s: float = 60.0, idle_s: float = 10.0) -> None:
        if not interval_s > 0 or not verdict_ttl_s > 0 or not idle_s > 0:
            raise ValueError(f"need interval_s, verdict_ttl_s and idle_s > 0, but got {interval_s}, {verdict_ttl_s}, "
                             f"{idle_s}")
        super().__init__()
        self._router = router
        self._predictions = predictions
        self._auth = auth
        self.interval_s = interval_s
        self.verdict_ttl_s = verdict_ttl_s
        self.idle_s = idle_s
        self._writer: FrameWriter | None = None
        self._pushed = ""  # the table the front holds
        self._leases: dict[str, _Lease] = {}
        # (model, version) -> what its reports are applied to: kept after the version stops being direct
        # (a rollout began, it was retired), for the calls still in flight then; the oldest forgotten first
        self._known: dict[tuple[str, str], _Known] = {}
        self._verdicts: dict[bytes, float] = {}  # credential -> when its verdict was pushed (monotonic)
        self._busy: dict[str, float] = {}  # model -> seconds its front calls answered this interval took
        self._demand: dict[str, float] = {}  # model -> the front's calls in flight (moving average)
        self._last_call: dict[str, float] = {}  # model -> when the front's last call of it was answered
        self._tick = time.monotonic()
        self._task: asyncio.Task | None = None
        self._tokens = metrics.gauge("direct_tokens", "Admission slots of each model leased to the native front's "
                                     "direct path.", ("model",))
        reported = metrics.counter("direct_reported_total", "Records the native front reported about its direct "
                                   "path: outcome (a call answered or failed), attempt_failed, backup_sent.",
                                   ("type",))
        self._reported = {OUTCOME: reported.labels("outcome"), ATTEMPT_FAILED: reported.labels("attempt_failed"),
                          BACKUP_SENT: reported.labels("backup_sent")}
        self.count: Any = lambda kind, code: None  # the front's call counter (FrontLink sets it)

    async def on_start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._refresh(), name="direct-data-plane")

    async def on_stop(self) -> None:
        await cancel_and_wait(self._task)
        self._send("table\t1\n")  # nothing direct any more (auth on: every call goes to the router)
        for name, lease in self._leases.items():
            lease.give_back()
            self._tokens.labels(name).set(0)
        self._leases.clear()

    def attach(self, writer: FrameWriter) -> None:
        """A (re)started front's link: it holds no table and no verdict yet."""
        self._writer = writer
        self._pushed = ""
        self._verdicts.clear()
        self.push()

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._measure()
            self.push()

    def observe(self, model: str, call_s: float) -> None:
        """A front call of ``model`` answered (directly or through the router), for the lease's size."""
        self._busy[model] = self._busy.get(model, 0.0) + call_s
        self._last_call[model] = time.monotonic()

    def _measure(self) -> None:
        """The front's calls in flight per model over the last interval (Little's law), held (DEMAND_HOLD_S)."""
        now = time.monotonic()
        elapsed, self._tick = now - self._tick, now
        busy, self._busy = self._busy, {}
        for model in list(self._last_call):
            if now - self._last_call[model] > self.idle_s:
                del self._last_call[model]
                self._demand.pop(model, None)
            else:
                self._demand[model] = max(busy.get(model, 0.0) / max(elapsed, 1e-3),
                                          self._demand.get(model, 0.0) * math.exp(-elapsed / DEMAND_HOLD_S))

    def push(self) -> None:
        """Sends the table when it differs from the one the front holds."""
        table = self._table()
        if table != self._pushed and self._send(table):
            self._pushed = table

    def allow(self, credential: bytes) -> None:
        """The router let ``credential`` call ModelInfer: the front may let its next calls through for
        ``verdict_ttl_s`` (pushed again when half of that passed)."""
        now = time.monotonic()
        if now - self._verdicts.get(credential, float("-inf")) < self.verdict_ttl_s / 2:
            return
        if len(self._verdicts) >= _MAX_VERDICTS:
            self._verdicts.clear()
        if self._send(f"verdict\t{credential.hex()}\t{self.verdict_ttl_s:g}\n"):
            self._verdicts[credential] = now

    def _send(self, text: str) -> bool:
        writer = self._writer
        if writer is None:
            return False
        body = text.encode()
        writer.write(RESPONSE.pack(len(body), PUSH_ID, OK), body)
        return True

    def _table(self) -> str:
        lines = [f"table\t{int(self._auth)}"]
        routes: set[str] = set()
        now = time.monotonic()  # the router's replica clock
        for route, served in self._router.direct_routes():
            states = list(served.replicas)
            if (not states or any(not state.name.startswith(SCHEME) for state in states)
                    or _unsafe(route.name) or _unsafe(served.version)):
                continue  # a remote (gRPC) replica, or a name the push's text cannot carry: the router's path
            ready = [state for state in states if state.down is None and state.ejected_until <= now]
            lease = self._leases.get(route.name)
            if lease is not None and lease.limiter is not route.limiter:  # the model was set anew
                lease.give_back()
                lease = None
            if not ready:
                if lease is not None:
                    lease.give_back()
                continue
            if lease is None:
                lease = self._leases[route.name] = _Lease(route.limiter, self.push)
            demand = self._demand.get(route.name)
            lease.wanted = 0 if demand is None else math.ceil(LEASE_HEADROOM * demand) + 1
            lease.fit()
            self._tokens.labels(route.name).set(lease.held)
            routes.add(route.name)
            key = (route.name, served.version)
            self._known.pop(key, None)  # to the end: the newest
            self._known[key] = _Known({state.name: state for state in states}, served.metrics, served.replicas)
            while len(self._known) > _MAX_KNOWN:
                del self._known[next(iter(self._known))]
            if not lease.held:
                continue
            policy = route.policy
            lines.append(f"model\t{route.name}\t{served.version}\t{route.max_request.bytes}\t"
                         f"{policy.default_timeout_s:g}\t{int(policy.hedge and len(ready) > 1)}\t{policy.hedge_budget:g}")
            share, extra = divmod(lease.held, len(ready))
            for index, state in enumerate(ready):
                p95 = state.latency.p95
                delay = max(p95 if p95 is not None else policy.slo_p99_ms / 1000.0 * policy.hedge_slo_fraction,
                            policy.hedge_min_delay_ms / 1000.0)
                lines.append(f"replica\t{state.name[len(SCHEME):]}\t{share + (index < extra)}\t{delay:.4f}")
        for name in [name for name in self._leases if name not in routes]:
            self._leases.pop(name).give_back()
            self._tokens.labels(name).set(0)
        return "\n".join(lines) + "\n"

    def report(self, body: bytes) -> None:
        """Applies a report of the front (its records in order); a malformed tail is logged and dropped."""
        pos, end = 0, len(body)
        while pos + RECORD.size <= end:
            (kind, status, attempts, backup_won, received, call_s, attempt_s, model_n, version_n, id_n, replica_n,
             request_n, response_n) = RECORD.unpack_from(body, pos)
            pos += RECORD.size
            if pos + model_n + version_n + id_n + replica_n + request_n + response_n > end:
                break
            model = body[pos:pos + model_n].decode("utf-8", "replace")
            pos += model_n
            version = body[pos:pos + version_n].decode("utf-8", "replace")
            pos += version_n
            request_id = body[pos:pos + id_n].decode("utf-8", "replace")
            pos += id_n
            replica = SCHEME + body[pos:pos + replica_n].decode("utf-8", "replace")
            pos += replica_n
            request = body[pos:pos + request_n]
            pos += request_n
            response = body[pos:pos + response_n]
            pos += response_n
            counter = self._reported.get(kind)
            if counter is not None:
                counter.inc()
            code = CODE_NAMES.get(status, "UNKNOWN")
            known = self._known.get((model, version))
            if kind == OUTCOME:
                self.count(KINDS["ModelInfer"], code)
                self.observe(model, call_s)
                if status == OK:
                    self._answered(model, version, request_id, replica, attempts, bool(backup_won), request,
                                   response, received, call_s, attempt_s, known)
                elif known is not None:
                    known.metrics.failed(code)
            elif kind == ATTEMPT_FAILED and known is not None:
                self._attempt_failed(model, version, replica, code, response, known)
            elif kind == BACKUP_SENT and known is not None:
                known.metrics.backups.inc()
        if pos != end:
            log.warning("dropped the malformed tail of a direct-path report", extra={"bytes": end - pos})
        self.push()  # the leases may have changed

    def _answered(self, model: str, version: str, request_id: str, replica: str, attempts: int, backup_won: bool,
                  request: bytes, response: bytes, received: float, call_s: float, attempt_s: float,
                  known: _Known | None) -> None:
        if known is not None:
            known.metrics.answered(call_s)
            if backup_won:
                known.metrics.backup_wins.inc()
            state = known.states.get(replica)
            if state is not None:
                known.replicas.succeeded(state, attempt_s)
        lease = self._leases.get(model)
        if lease is not None:
            lease.answered(call_s)
        if self._predictions is not None:  # published even when the route changed since: the log is complete
            self._predictions.record(request_id=request_id or uuid.uuid4().hex, model=model,
                                     routed=Routed(response, version, replica, attempts, backup_won),
                                     request=request, response=response, received=received, latency_s=call_s)

    def _attempt_failed(self, model: str, version: str, replica: str, code: str, message: bytes,
                        known: _Known) -> None:
        """A worker failed a direct call (the front handed the call to the router, or a backup answers):
        ejected as the router's own call would have ejected it."""
        failure = ReplicaFailed.of_status(code, message.decode("utf-8", "replace"), replica=replica)
        state = known.states.get(replica)
        if state is None:
            return
        known.replicas.failed(state, eject=failure.eject, error=failure.message)
        if failure.eject:
            known.metrics.ejected(replica)
            log.warning("replica ejected", extra={"model": model, "version": version, "replica": replica,
                                                  "code": failure.code, "error": failure.message, "via": "direct"})

def _unsafe(name: str) -> bool:
    return "\t" in name or "\n" in name
