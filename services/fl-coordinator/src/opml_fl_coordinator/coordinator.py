"""The service's core: every federation it hosts, driven on the wall clock, made durable per
completed round, announced as events. It imports no grpc: the servicer converts messages and
calls it; clients are identified by their credential before they get here.

Each :class:`~opml_fl_coordinator.federation.Federation` is synchronous and clock-free; this
class owns the clock (a timer wakes it at the next deadline), the long-poll of clients waiting for
a task, and the order of side effects: what a federation announces is queued as it happens (a
completed round with its snapshot taken at that instant), then, in order, each completed round is
saved (S3 arrays, then the Redis document) *before* its RoundCompleted event is emitted, so an
event never announces a round a restart would not find.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from opml.fl.v1 import events_pb2

from opml_common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from opml_common.events import EventEmitter
from opml_common.lifecycle import Component, cancel_and_wait
from opml_fl_coordinator import convert
from opml_fl_coordinator.bundles import BundlePublisher
from opml_fl_coordinator.config import FederationConfig, parse_config
from opml_fl_coordinator.federation import Federation, FederationListener, Phase, RoundRecord, Task, new_federation
from opml_fl_coordinator.metrics import FlMetrics, kind_of
from opml_fl_coordinator.store import FederationStore
from opml_fl_coordinator.strategy.base import Scalar
from opml_fl_coordinator_contract.weights import Weights

log = logging.getLogger(__name__)

CLIENT_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
MAX_LABELS = 16
DONE = "done"
"""What :meth:`Coordinator.pull` returns when the federation has ended."""


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class Hosted:
    """One federation as the service hosts it."""

    federation: Federation
    config_yaml: str
    model_bundle: str = ""
    pending: list[tuple[Any, ...]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    watchers: set[asyncio.Queue] = field(default_factory=set)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)


class _Bridge(FederationListener):
    """Queues what a federation announces, in order, for :meth:`Coordinator._settle`."""

    def __init__(self, hosted: Callable[[], Hosted], metrics: FlMetrics) -> None:
        self._hosted, self._metrics = hosted, metrics

    def round_started(self, federation: Federation, number: int, clients: list[str], now: float) -> None:
        self._hosted().pending.append(("event", events_pb2.RoundStarted(
            federation=federation.federation_id, round=number, clients=clients)))

    def round_completed(self, federation: Federation, record: RoundRecord) -> None:
        self._metrics.rounds.labels(federation.config.mode).inc()
        self._metrics.round_seconds.labels(federation.config.mode).observe(max(0.0, record.duration_s))
        if "accuracy" in record.metrics or "client_accuracy" in record.metrics:
            self._metrics.accuracy.labels(federation.federation_id).set(
                record.metrics.get("accuracy", record.metrics.get("client_accuracy", 0.0)))
        document, arrays = federation.snapshot()
        self._hosted().pending.append(("round", record, document, arrays))

    def client_dropped(self, federation: Federation, client_id: str, number: int, reason: str) -> None:
        self._metrics.dropped.labels(kind_of(reason)).inc()
        self._hosted().pending.append(("event", events_pb2.ClientDropped(
            federation=federation.federation_id, round=number, client_id=client_id, reason=reason)))

    def update_rejected(self, federation: Federation, client_id: str, number: int, reason: str) -> None:
        self._metrics.rejected.labels(kind_of(reason)).inc()
        self._hosted().pending.append(("event", events_pb2.UpdateRejected(
            federation=federation.federation_id, round=number, client_id=client_id, reason=reason)))

    def finished(self, federation: Federation, reason: str) -> None:
        document, arrays = federation.snapshot()
        self._hosted().pending.append(("ended", document, arrays))


class Coordinator(Component):
    """Hosts federations (see the module's docstring).

    Args:
        store: where state goes per completed round.
        emitter: the outbox emitter of the service's events.
        metrics: the service's metrics.
        publisher: commits models to bundle-store (None: models stay in the store only).
        publish_every_round: publish every round's model, not only the last.
        clock: seconds since the epoch (tests may pass another).
    """

    def __init__(self, store: FederationStore, emitter: EventEmitter, metrics: FlMetrics, *,
                 publisher: BundlePublisher | None = None, publish_every_round: bool = False,
                 max_federations: int = 100, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self._store, self._emitter, self._metrics = store, emitter, metrics
        self._publisher, self._publish_every_round = publisher, publish_every_round
        self._max_federations, self._max_clients = max_federations, max_clients
        self._clock = clock
        self._hosted: dict[str, Hosted] = {}
        self._credentials: dict[str, tuple[str, str]] = {}
        self._wake = asyncio.Event()
        self._timer: asyncio.Task | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    async def on_start(self) -> None:
        """Restores every saved federation (each continues after its last completed round once
        its clients join again) and the client credentials, then starts the deadline timer."""
        for document, arrays in await self._store.load_all():
            config = FederationConfig.model_validate(document["config"])
            hosted = self._host(document["federation_id"], config, document.get("config_yaml", ""),
                                created_at=float(document["created_at"]))
            hosted.federation.restore(document, arrays)
            hosted.model_bundle = document.get("model_bundle", "")
            log.info("restored federation %s at round %d (%s)", hosted.federation.federation_id,
                     hosted.federation.version, hosted.federation.phase.value)
        self._credentials = await self._store.credentials()
        self._gauges()
        self._timer = asyncio.create_task(self._tick_loop(), name="fl-deadlines")

    async def on_stop(self) -> None:
        """Stops the timer; federations stay as last saved (a restart continues them)."""
        timer, self._timer = self._timer, None
        await cancel_and_wait(timer)

    # --- operators -----------------------------------------------------------------------------

    async def create(self, config_yaml: str) -> Hosted:
        """Raises:
            InvalidArgument: every wrong field of the config.
            AlreadyExists: a federation of that name exists.
            ResourceExhausted: ``max_federations`` are hosted.
        """
        config = parse_config(config_yaml, what="config_yaml")
        if config.name in self._hosted:
            raise AlreadyExists(f"federation {config.name!r} already exists")
        if len(self._hosted) >= self._max_federations:
            raise ResourceExhausted(f"{self._max_federations} federations are hosted (max_federations)")
        hosted = self._host(config.name, config, config_yaml, created_at=self._clock())  # holds the name
        document, arrays = hosted.federation.snapshot()
        try:
            await self._save(hosted, document, arrays)
        except BaseException:  # not created: the caller's retry must create it (and announce it)
            del self._hosted[config.name]
            raise
        self._emitter.emit(events_pb2.FederationCreated(federation=convert.federation_to_proto(hosted)),
                           subject=config.name)
        self._gauges()
        return hosted

    def get(self, federation_id: str) -> Hosted:
        hosted = self._hosted.get(federation_id)
        if hosted is None:
            raise NotFound(f"federation {federation_id!r} not found")
        return hosted

    def list(self) -> list[Hosted]:
        return sorted(self._hosted.values(), key=lambda h: h.federation.created_at)

    async def stop_federation(self, federation_id: str) -> Hosted:
        hosted = self.get(federation_id)
        hosted.federation.stop(self._clock(), "stopped by a caller")
        await self._settle(hosted)
        return hosted

    async def watch(self, federation_id: str) -> AsyncIterator[RoundRecord]:
        """Completed rounds so far, then each as it is saved, until the federation has ended and
        its end is saved (its final model published), each round once."""
        hosted = self.get(federation_id)
        queue: asyncio.Queue = asyncio.Queue()
        hosted.watchers.add(queue)
        try:
            ended = hosted.federation.phase in (Phase.COMPLETED, Phase.STOPPED) and not hosted.pending
            last = 0
            for record in list(hosted.federation.history):
                last = record.number
                yield record
            if ended:
                return
            while (record := await queue.get()) is not None:
                if record.number > last:  # one listed above may come again from the queue
                    last = record.number
                    yield record
        finally:
            hosted.watchers.discard(queue)

    async def register_client(self, federation_id: str, client_id: str, labels: dict[str, str]) -> str:
        """A new token for ``client_id`` (its earlier ones stop working).

        Raises:
            NotFound: no such federation.
            InvalidArgument: a bad client id or labels.
            ResourceExhausted: the federation has ``max_clients`` clients.
        """
        hosted = self.get(federation_id)
        problems = []
        if not CLIENT_ID.fullmatch(client_id):
            problems.append(("client_id", f"must be 1-63 lowercase letters, digits, '.', '_' or '-', but got "
                                          f"{client_id[:80]!r}"))
        if len(labels) > MAX_LABELS or any(len(k) > 63 or len(v) > 256 for k, v in labels.items()):
            problems.append(("labels", f"at most {MAX_LABELS}, keys <= 63 and values <= 256 characters"))
        if problems:
            raise InvalidArgument.of(problems)
        known = {c for f, c in self._credentials.values() if f == federation_id}
        if client_id not in known and len(known) >= self._max_clients:
            raise ResourceExhausted(f"federation {federation_id!r} has {self._max_clients} clients (the maximum)")
        token = "flc_" + secrets.token_urlsafe(32)
        key = digest(token)
        await self._store.save_credential(key, federation_id, client_id)
        await self._store.drop_credentials(federation_id, client_id, keep=key)
        self._credentials = {k: v for k, v in self._credentials.items() if v != (federation_id, client_id)}
        self._credentials[key] = (federation_id, client_id)
        hosted.labels[client_id] = dict(labels)
        return token

    # --- clients -------------------------------------------------------------------------------

    def authenticate(self, token: str) -> tuple[str, str]:
        """(federation, client id) of a client token.

        Raises:
            Unauthenticated: no token, or not one this coordinator issued (or it was replaced).
        """
        identity = self._credentials.get(digest(token)) if token else None
        if identity is None:
            raise Unauthenticated("missing or unknown client token (send metadata 'x-opml-fl-client-token', "
                                  "issued by RegisterClient)")
        return identity

    async def join(self, federation_id: str, client_id: str, num_examples: int) -> Hosted:
        """The client is present, declaring the examples it trains on.

        Raises:
            NotFound: no such federation.
            InvalidArgument: ``num_examples`` outside [1, the federation's validation.max_examples].
        """
        hosted = self.get(federation_id)
        cap = hosted.federation.config.validation.max_examples
        if not 1 <= num_examples <= cap:
            raise InvalidArgument("num_examples", f"the examples a client trains on must be in [1, {cap}] "
                                                  f"(validation.max_examples), but got {num_examples}")
        hosted.federation.join(client_id, self._clock(), hosted.labels.get(client_id), num_examples=num_examples)
        await self._settle(hosted)
        return hosted

    async def leave(self, federation_id: str, client_id: str) -> None:
        hosted = self.get(federation_id)
        hosted.federation.leave(client_id, self._clock())
        await self._settle(hosted)

    async def pull(self, federation_id: str, client_id: str, wait_s: float) -> Task | str | None:
        """The client's task, :data:`DONE` when the federation has ended, or None after ``wait_s``
        without one.

        Raises:
            FailedPrecondition: the client never joined (a join declares its example count).
        """
        hosted = self.get(federation_id)
        if client_id not in hosted.federation.profiles.clients:
            raise FailedPrecondition(f"client {client_id!r} must join before it pulls tasks (Join declares the "
                                     "examples it trains on)")
        deadline = time.monotonic() + wait_s
        while True:
            federation = hosted.federation
            if federation.phase in (Phase.COMPLETED, Phase.STOPPED):
                return DONE
            if not federation.profiles.clients[client_id].present:
                federation.join(client_id, self._clock(), hosted.labels.get(client_id))  # pulling is being there
                await self._settle(hosted)
            task = federation.task_for(client_id)
            if task is not None:
                return task
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            changed = hosted.changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def admit(self, federation_id: str, client_id: str, task_id: int, num_examples: int) -> Task | str:
        """The task whose update the client starts to upload, so that its arrays can be bounded by
        the task's model as they arrive; or why the update is not taken (late), answered at once.

        Raises:
            InvalidArgument: field ``header.num_examples``: more examples than the client may claim
                (:meth:`Federation.examples_problem`); the task is refused with that reason.
        """
        federation = self.get(federation_id).federation
        task = federation.current_task(client_id, task_id)
        if task is None:
            reason = f"task {task_id} is not {client_id!r}'s current task (late, or the round closed)"
            self._metrics.rejected.labels(kind_of(reason)).inc()
            return reason
        problem = federation.examples_problem(client_id, task, num_examples)
        if problem is not None:
            await self.refuse(federation_id, client_id, task_id, f"num_examples {problem}")
            raise InvalidArgument("header.num_examples", problem)
        return task

    async def refuse(self, federation_id: str, client_id: str, task_id: int, reason: str) -> None:
        """The upload of task ``task_id`` was refused before it was read whole: the task ends, its
        update rejected with ``reason`` (the round need not wait for its deadline)."""
        hosted = self.get(federation_id)
        hosted.federation.refuse(client_id, task_id, reason, self._clock())
        await self._settle(hosted)

    async def upload(self, federation_id: str, client_id: str, task_id: int, weights: Weights, num_examples: int,
                     metrics: dict[str, Scalar]) -> str | None:
        """None when the update is accepted, else why it is not."""
        hosted = self.get(federation_id)
        reason = hosted.federation.submit(client_id, task_id, weights, num_examples, metrics, self._clock())
        if reason is None:
            self._metrics.updates.inc()
        elif "current task" in reason or "initial" in reason:
            self._metrics.rejected.labels(kind_of(reason)).inc()
        await self._settle(hosted)
        return reason

    async def fail(self, federation_id: str, client_id: str, task_id: int, reason: str) -> None:
        hosted = self.get(federation_id)
        hosted.federation.fail(client_id, task_id, reason, self._clock())
        await self._settle(hosted)

    # --- internals -----------------------------------------------------------------------------

    def _host(self, federation_id: str, config: FederationConfig, config_yaml: str, *, created_at: float) -> Hosted:
        holder: list[Hosted] = []
        federation = new_federation(federation_id, config, now=created_at,
                                    listener=_Bridge(lambda: holder[0], self._metrics))
        hosted = Hosted(federation, config_yaml)
        holder.append(hosted)
        self._hosted[federation_id] = hosted
        return hosted

    async def _save(self, hosted: Hosted, document: dict[str, Any], arrays: dict[str, Weights]) -> None:
        started = time.perf_counter()
        await self._store.save({**document, "config_yaml": hosted.config_yaml, "model_bundle": hosted.model_bundle},
                               arrays)
        self._metrics.save_seconds.observe(time.perf_counter() - started)

    async def _publish(self, hosted: Hosted, record: RoundRecord, weights: Weights) -> None:
        if self._publisher is None or not weights:
            return
        try:
            parent = hosted.model_bundle.rpartition("@")[2]
            hosted.model_bundle = await self._publisher.publish(hosted.federation, record, weights, parent=parent)
        except Exception as error:  # bundle-store down must not stop training; the store has the model
            log.warning("federation %s: round %d's model not published to bundle-store: %s",
                        hosted.federation.federation_id, record.number, error)

    async def _settle(self, hosted: Hosted) -> None:
        """Carry out what the federation announced, in order: save completed rounds, then emit;
        then wake whoever waits on this federation."""
        async with hosted.lock:
            while hosted.pending:
                item = hosted.pending.pop(0)
                try:
                    await self._carry_out(hosted, item)
                except BaseException:
                    hosted.pending.insert(0, item)  # retried at the next settle (the timer's, at the latest)
                    raise
        hosted.changed.set()
        hosted.changed = asyncio.Event()
        self._gauges()
        self._wake.set()

    async def _carry_out(self, hosted: Hosted, item: tuple[Any, ...]) -> None:
        subject = hosted.federation.federation_id
        if item[0] == "event":
            self._emitter.emit(item[1], subject=subject)
        elif item[0] == "round":
            _, record, document, arrays = item
            if self._publish_every_round:
                await self._publish(hosted, record, arrays["weights"])
            await self._save(hosted, document, arrays)
            self._emitter.emit(events_pb2.RoundCompleted(round=convert.round_to_proto(subject, record)),
                               subject=subject)
            for queue in hosted.watchers:
                queue.put_nowait(record)
        else:  # ended
            _, document, arrays = item
            history = hosted.federation.history
            if history and not self._publish_every_round:
                await self._publish(hosted, history[-1], arrays["weights"])
            await self._save(hosted, document, arrays)
            self._emitter.emit(events_pb2.FederationEnded(federation=convert.federation_to_proto(hosted)),
                               subject=subject)
            for queue in hosted.watchers:
                queue.put_nowait(None)

    def _gauges(self) -> None:
        counts = {phase.value: 0 for phase in Phase}
        present = 0
        for hosted in self._hosted.values():
            counts[hosted.federation.phase.value] += 1
            present += len(hosted.federation.profiles.present())
        for state, count in counts.items():
            self._metrics.federations.labels(state).set(count)
        self._metrics.clients.set(present)

    async def _tick_loop(self) -> None:
        """Poll each federation at its next deadline (and at least every second)."""
        while True:
            deadlines = [d for h in self._hosted.values() if (d := h.federation.next_deadline()) is not None]
            wait = min([1.0, *[max(0.0, d - self._clock()) for d in deadlines]])
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
            now = self._clock()
            for hosted in list(self._hosted.values()):
                deadline = hosted.federation.next_deadline()
                if (deadline is not None and deadline <= now) or hosted.pending:
                    hosted.federation.poll(now)
                    try:
                        await self._settle(hosted)
                    except Exception:
                        log.exception("federation %s: state not saved; retrying", hosted.federation.federation_id)
