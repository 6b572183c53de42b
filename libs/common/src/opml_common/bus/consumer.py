"""The at-least-once consumer group loop with dedup, retries and a dead-letter topic."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import redis.exceptions
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import ConsumerStoppedError, IllegalStateError, KafkaError
from aiokafka.structs import ConsumerRecord

from opml_common.bus.cloudevents import CloudEvent
from opml_common.bus.dedup import RedisDeduplicator
from opml_common.bus.producer import EventPublisher
from opml_common.bus.security import describe, kafka_client_kwargs
from opml_common.config import PlatformSettings
from opml_common.errors import FailedPrecondition, Unavailable
from opml_common.lifecycle import Component
from opml_common.metrics import ServiceMetrics
from opml_common.retry import Backoff
from opml_common.topics import Topic

log = logging.getLogger(__name__)

Handler = Callable[[CloudEvent], Awaitable[None]]

# Errors worth retrying even though they carry no ``retriable`` flag: the network and Redis.
_TRANSIENT = (ConnectionError, TimeoutError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
# Redis (the dedup store and handlers' state) unreachable: every record would fail alike, so none is
# poison; the partition waits for it, however long, instead of dead-lettering what a restart interrupts.
_STORE_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
_STORE_DOWN_MAX_DELAY_S = 2.0
_MAX_ERROR_HEADER = 4000  # characters of the error message kept in the opml_error header
_MAX_SOURCE_SHOWN = 200  # characters of a refused event's source quoted in the dead-letter reason
_POLL_TIMEOUT_MS = 200  # how long one poll waits for records; bounds how fast stop() is noticed when idle


def is_retriable(exc: BaseException) -> bool:
    """Whether a handler failure may succeed if tried again.

    An exception's ``retriable`` attribute decides when it has one (``OpmlError``, aiokafka's
    ``KafkaError``, ``MalformedEvent``); otherwise network and Redis connection/timeout errors are
    retriable and everything else (a bug, bad data) is not.
    """
    flag = getattr(exc, "retriable", None)
    if isinstance(flag, bool):
        return flag
    return isinstance(exc, _TRANSIENT)


class UntrustedSource(Exception):
    """An event's ``ce_source`` is not in the consumer's ``sources`` (nor under one of its
    ``source_prefixes``): it is not handled but dead-lettered.

    Never retriable (the same record has the same source every time). The message names the source.
    """

    retriable = False


class _Outcome:
    OK = "ok"
    DUPLICATE = "duplicate"
    RETRIED = "retried"
    DEAD_LETTERED = "dead_lettered"


class EventConsumer(Component):
    """At-least-once consumer group over CloudEvents topics.

    For each record, in offset order per partition: decode the CloudEvent; skip it if ``dedup``
    has seen its id; else call ``handler`` and mark the id; then commit offset+1. The offset is
    committed only after the handler returned, so an effect the handler made durable is never
    lost: a crash before the commit replays the event (``dedup`` skips it if it was marked, and
    handlers must be idempotent for the window between their effect and the mark; a handler whose
    effect is in Redis closes that window with :meth:`RedisDeduplicator.mark_in`).

    Failures: an exception the handler (or the dedup store) raises is retried with exponential
    backoff (``backoff_s``, doubling, at most ``max_backoff_s``) up to ``max_attempts`` attempts when
    :func:`is_retriable` says so, except that Redis being unreachable (its ConnectionError or
    TimeoutError: the dedup store, or the handler's state) is retried for as long as it lasts, the
    partition waiting, since no record is to blame and a restart of Redis must not dead-letter what
    arrives meanwhile. When the attempts run out, at once for a non-retriable error, and
    for a record that is not a CloudEvent (:class:`MalformedEvent`), the original record (key, value
    and headers) goes to ``topic.dead_letter(prefix)`` with the headers ``opml_error``,
    ``opml_error_type``, ``opml_source_topic``, ``opml_source_partition``, ``opml_source_offset``,
    ``opml_consumer_group`` and ``opml_attempts``; then its offset is committed so the partition flows
    on. A record is never dropped: if even the dead-letter publish fails, it is retried until it
    succeeds or the consumer stops (uncommitted, so the record comes again).

    Side effects:
        ``start()``: starts the dead-letter publisher, joins the group ``settings.topic_prefix +
        group_id`` and waits for a partition assignment (on tansu a new group takes about half the
        session timeout). Idempotent.
        ``run()``: starts if needed and handles records until ``stop()``; then leaves the group.
        After ``stop()``, call ``start()`` before ``run()`` again (a ``run()`` that begins after a
        ``stop()`` returns at once, so a task stopped before it was scheduled does not start).
        ``stop()``: lets ``run()`` finish the record in hand (handler, commit), leaves the group,
        and stops the internal publisher (a publisher passed in is left running). Idempotent.
        Metrics ``opml_<service>_events_handled_total{topic,type,outcome}`` (ok, duplicate, retried
        per retry, dead_lettered), ``opml_<service>_event_handler_duration_seconds{topic,type}``,
        ``opml_<service>_consumer_lag{topic,partition}`` (high watermark minus the next offset to
        handle, for every assigned partition, after each poll and while a record is retried).

    Sources: with ``sources`` (keyword-only; e.g. ``frozenset({"opml/bundle-store"})``) and/or
    ``source_prefixes`` (keyword-only; a family of sources, e.g.
    ``frozenset({"opml://trace-collector/tracer/"})`` for every tracer's
    ``opml://trace-collector/tracer/<job>/<worker>``), an event is accepted when its ``ce_source`` is
    one of ``sources`` exactly or starts with one of ``source_prefixes``. Any other event is never
    handed to ``handler`` (nor checked against or marked in ``dedup``): it goes to the dead-letter
    topic at once with :class:`UntrustedSource` as its ``opml_error`` (which names the source and what
    is accepted), is counted in ``opml_<service>_events_untrusted_total{topic}`` and
    ``events_handled_total{outcome="dead_lettered"}``, and the partition flows on. A prefix must end
    with ``/`` so that it names a path: ``opml/bundle-store/`` admits ``opml/bundle-store/x`` but not
    ``opml/bundle-store-evil``. Anyone who can write to a topic can set any ``ce_source``, so this keeps
    out the writers who are not the platform's services only where the broker's ACLs let only the
    owning service write the topic; a handler still treats an event as a hint: it checks that what the
    data claims agrees with the source (a prefix-matched source names who sent it), and re-reads what
    it acts on from the service that owns it. Both ``None`` (the default) accepts every source, which
    is there for old consumers and tests only: **every new consumer the platform adds passes
    ``sources`` or ``source_prefixes``** (the owners' ``ServiceSpec.event_source``).

    Rebalances: when partitions are revoked, the group waits until the record in hand is handled
    and committed; records fetched before the rebalance are then dropped (their new owner reads
    them from the committed offset).

    Use ``async with EventConsumer(...) as consumer: await consumer.run()``, or run it in a task
    and ``await consumer.stop()``.
    """

    def __init__(
        self,
        settings: PlatformSettings,
        *,
        group_id: str,
        topics: Sequence[Topic],
        handler: Handler,
        metrics: ServiceMetrics,
        dedup: RedisDeduplicator | None = None,
        max_attempts: int = 5,
        backoff_s: float = 0.2,
        publisher: EventPublisher | None = None,
        max_backoff_s: float = 30.0,
        max_poll_records: int = 100,
        sources: frozenset[str] | None = None,
        source_prefixes: frozenset[str] | None = None,
    ) -> None:
        """Validate the arguments; nothing is connected until :meth:`start`.

        Raises:
            ValueError: ``group_id`` is empty, ``topics`` is empty, ``max_attempts`` < 1, the backoffs
                are not ``0 <= backoff_s <= max_backoff_s``, ``max_poll_records`` < 1, ``sources`` is
                a string, an empty set or holds an empty string, or ``source_prefixes`` is a string, an
                empty set or holds a prefix that does not end with ``/`` (or is only ``/``).
        """
        super().__init__()
        if not group_id:
            raise ValueError("EventConsumer `group_id` must be non-empty, but got ''")
        if not topics:
            raise ValueError("EventConsumer `topics` must name at least one Topic, but got none")
        if max_attempts < 1:
            raise ValueError(f"EventConsumer `max_attempts` must be >= 1, but got {max_attempts}")
        if not 0 <= backoff_s <= max_backoff_s:
            raise ValueError(f"EventConsumer backoffs must satisfy 0 <= backoff_s <= max_backoff_s, but got "
                             f"{backoff_s} and {max_backoff_s}")
        if max_poll_records < 1:
            raise ValueError(f"EventConsumer `max_poll_records` must be >= 1, but got {max_poll_records}")
        if sources is not None and (isinstance(sources, str) or not sources or not all(sources)):
            raise ValueError(f"EventConsumer `sources` must be None or a non-empty set of CloudEvents sources, "
                             f"but got {sources!r}")
        if source_prefixes is not None and (
                isinstance(source_prefixes, str) or not source_prefixes
                or not all(isinstance(p, str) and len(p) > 1 and p.endswith("/") for p in source_prefixes)):
            raise ValueError(f"EventConsumer `source_prefixes` must be None or a non-empty set of prefixes that "
                             f"each end with '/', but got {source_prefixes!r}")
        self.sources = frozenset(sources) if sources is not None else None
        self.source_prefixes = tuple(sorted(source_prefixes)) if source_prefixes is not None else None
        self.settings = settings
        self.group_id = settings.topic_prefix + group_id
        self.topics = {topic.full_name(settings.topic_prefix): topic for topic in topics}
        self.handler = handler
        self.dedup = dedup
        self.max_attempts = max_attempts
        self.backoff = Backoff(base_s=backoff_s, max_s=max_backoff_s)
        # Dead-letter publishing and polling retry until they succeed, so they never spin at a zero delay.
        self._persistent_backoff = Backoff(base_s=backoff_s or 0.1, max_s=max(max_backoff_s, backoff_s or 0.1))
        self.max_poll_records = max_poll_records
        self._own_publisher = publisher is None
        self._publisher = publisher or EventPublisher(
            settings, source=f"opml-consumer/{group_id}", metrics=metrics
        )
        self._handled = metrics.counter(
            "events_handled_total",
            "Events a consumer finished with, by topic, event type and outcome "
            "(ok, duplicate, retried per retry, dead_lettered).",
            ("topic", "type", "outcome"),
        )
        self._duration = metrics.histogram(
            "event_handler_duration_seconds", "Time one handler call took, by topic and event type.", ("topic", "type")
        )
        self._untrusted = metrics.counter(
            "events_untrusted_total",
            "Events refused (and dead-lettered) because their CloudEvents source is not one this consumer "
            "accepts, by topic.", ("topic",),
        )
        self._lag = metrics.gauge(
            "consumer_lag", "Records not yet handled: high watermark minus the next offset.", ("topic", "partition")
        )
        self._consumer: AIOKafkaConsumer | None = None
        self._processing = asyncio.Lock()  # held while one record is handled and committed
        self._stopping = asyncio.Event()
        self._run_done = asyncio.Event()
        self._run_done.set()
        self._run_task: asyncio.Task | None = None
        self._generation = 0  # bumped on every rebalance: records fetched before it are stale
        self._next_offset: dict[TopicPartition, int] = {}

    # ---------------------------------------------------------------- lifecycle

    async def on_start(self) -> None:
        """Start the dead-letter publisher and join the consumer group.

        A ``start()`` of the caller's clears an earlier ``stop()``; the one ``run()`` makes does not,
        so a ``stop()`` that came while ``run()`` was joining still ends it.

        Raises:
            Unavailable: the broker cannot be reached.
        """
        if asyncio.current_task() is not self._run_task:
            self._stopping.clear()
        await self._publisher.start()
        consumer = AIOKafkaConsumer(
            **kafka_client_kwargs(self.settings),
            group_id=self.group_id,
            client_id=f"opml-consumer-{self.group_id}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=self.settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=self.settings.kafka_heartbeat_interval_ms,
            max_poll_records=self.max_poll_records,
        )
        consumer.subscribe(list(self.topics), listener=_RebalanceListener(self))
        try:
            await consumer.start()  # returns once the group assigned partitions
        except BaseException as exc:
            await consumer.stop()
            if self._own_publisher:
                await self._publisher.stop()
            if isinstance(exc, Exception):
                raise Unavailable(
                    f"consumer group {self.group_id} could not join at {describe(self.settings)}: {exc}"
                ) from exc
            raise
        self._consumer = consumer
        log.info("consumer group %s joined; assigned %s", self.group_id, sorted(consumer.assignment()))

    def assignment(self) -> set[TopicPartition]:
        """The partitions this member owns now (empty when stopped or during a rebalance)."""
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    async def stop(self) -> None:
        """Finish the record in hand, commit, leave the group (no-op when stopped)."""
        self._stopping.set()
        current = asyncio.current_task()
        if self._run_task is not None and current is not self._run_task:
            await self._run_done.wait()
        elif current is self._run_task:
            return  # called from the handler: run() closes when the record in hand is done
        await super().stop()

    async def on_stop(self) -> None:
        """Leave the group and stop the internal publisher."""
        consumer, self._consumer = self._consumer, None
        try:
            if consumer is not None:
                await consumer.stop()  # leaves the group
        finally:
            for tp in list(self._next_offset):
                self._forget(tp)
            if self._own_publisher:
                await self._publisher.stop()

    # ---------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Handle records until :meth:`stop` is called; then leave the group.

        Raises:
            FailedPrecondition: ``run()`` is already running.
            Unavailable: the broker cannot be reached at start.
            KafkaError: a non-retriable consumer error (the consumer is stopped first).
        """
        if self._run_task is not None:
            raise FailedPrecondition(f"EventConsumer.run() is already running for group {self.group_id}")
        if self._consumer is None and self._stopping.is_set():
            return  # stop() came first (e.g. before this task ran); start() again to restart
        self._run_task = asyncio.current_task()
        self._run_done.clear()
        try:
            await self.start()
            while not self._stopping.is_set():
                consumer = self._consumer
                if consumer is None:
                    break
                try:
                    batch = await consumer.getmany(timeout_ms=_POLL_TIMEOUT_MS)
                except ConsumerStoppedError:
                    break
                except KafkaError as exc:
                    if not exc.retriable:
                        raise
                    log.warning("consumer group %s: poll failed, retrying: %s", self.group_id, exc)
                    await self._sleep_unless_stopping(self._persistent_backoff.base_s)
                    continue
                generation = self._generation
                for tp, records in batch.items():  # known before any is handled: a stuck record's lag shows
                    if tp not in self._next_offset and tp in consumer.assignment():
                        self._next_offset[tp] = records[0].offset
                for tp, records in batch.items():
                    await self._handle_partition(consumer, tp, records, generation)
                    if self._stopping.is_set():
                        break
                await self._update_lag(consumer)
        finally:
            self._run_task = None
            try:
                await super().stop()
            finally:
                self._run_done.set()

    async def _handle_partition(
        self, consumer: AIOKafkaConsumer, tp: TopicPartition, records: list[ConsumerRecord], generation: int
    ) -> None:
        for record in records:
            if self._stopping.is_set():
                return
            async with self._processing:
                if generation != self._generation or tp not in consumer.assignment():
                    return  # rebalanced since the fetch: the partition's owner reads from the committed offset
                if not await self._handle_record(record):
                    return  # stopping during a retry: left uncommitted, the record comes again
                try:
                    await consumer.commit({tp: record.offset + 1})
                except KafkaError as exc:
                    # Membership changed: another member may own the partition now. The record comes
                    # again to whoever owns it; dedup makes the repeat a no-op.
                    log.warning("consumer group %s: commit of %s@%d failed: %s",
                                self.group_id, tp, record.offset + 1, exc)
                    return
                self._next_offset[tp] = record.offset + 1

    async def _handle_record(self, record: ConsumerRecord) -> bool:
        """Handle one record to a final outcome. False when stop() interrupted its retries."""
        topic = self.topics[record.topic].name
        event_type = "unknown"
        attempt = 0
        while True:
            attempt += 1
            try:
                event = CloudEvent.from_kafka(record.headers, record.value, timestamp_ms=record.timestamp)
                event_type = event.type
                self._check_source(event, topic)
                if self.dedup is not None and await self.dedup.seen(event.id):
                    outcome = _Outcome.DUPLICATE
                else:
                    started = time.perf_counter()
                    try:
                        await self.handler(event)
                    finally:
                        self._duration.labels(topic=topic, type=event_type).observe(time.perf_counter() - started)
                    if self.dedup is not None:
                        await self._mark(event.id)
                    outcome = _Outcome.OK
                break
            except Exception as exc:
                store_down = isinstance(exc, _STORE_DOWN)
                if store_down or (is_retriable(exc) and attempt < self.max_attempts):
                    self._handled.labels(topic=topic, type=event_type, outcome=_Outcome.RETRIED).inc()
                    delay = self.backoff.delay(attempt - 1)
                    if store_down:  # checked often, so the partition goes on soon after Redis is back
                        delay = min(delay, _STORE_DOWN_MAX_DELAY_S)
                        log.warning("%s@%d/%d: Redis is unreachable (%s: %s); the partition waits for it, "
                                    "retrying in %.2fs (attempt %d)", record.topic, record.partition, record.offset,
                                    type(exc).__name__, exc, delay, attempt)
                    else:
                        log.warning("%s@%d/%d: attempt %d of %d failed (%s: %s); retrying in %.2fs",
                                    record.topic, record.partition, record.offset, attempt, self.max_attempts,
                                    type(exc).__name__, exc, delay)
                    if self._consumer is not None:  # the partition waits: its lag says so
                        await self._update_lag(self._consumer)
                    if await self._sleep_unless_stopping(delay):
                        return False
                    continue
                log.error("%s@%d/%d: giving up after %d attempt(s) (%s: %s); sending it to the dead-letter topic",
                          record.topic, record.partition, record.offset, attempt, type(exc).__name__, exc,
                          exc_info=not hasattr(exc, "retriable"))  # a traceback for bugs, not for bad data
                if not await self._dead_letter(record, exc, attempt):
                    return False
                outcome = _Outcome.DEAD_LETTERED
                break
        self._handled.labels(topic=topic, type=event_type, outcome=outcome).inc()
        return True

    def accepts(self, source: str) -> bool:
        """Whether an event from ``source`` is handed to the handler (see "Sources" above)."""
        if self.sources is None and self.source_prefixes is None:
            return True
        return (self.sources is not None and source in self.sources) or (
            self.source_prefixes is not None and source.startswith(self.source_prefixes))

    def _check_source(self, event: CloudEvent, topic: str) -> None:
        """Refuse an event whose source is not allowed (before dedup, so a forged event marks nothing)."""
        if self.accepts(event.source):
            return
        self._untrusted.labels(topic=topic).inc()
        shown = event.source if len(event.source) <= _MAX_SOURCE_SHOWN else event.source[:_MAX_SOURCE_SHOWN] + "..."
        accepted = [*sorted(self.sources or ()), *(f"{prefix}*" for prefix in self.source_prefixes or ())]
        raise UntrustedSource(f"ce_source {shown!r} is not a source consumer group {self.group_id} accepts "
                              f"(accepted: {', '.join(accepted)}); the event was not handled")

    async def _mark(self, event_id: str) -> None:
        """Mark the event handled. The effect is done: a failing mark is retried on its own (not with
        the handler), and if Redis stays down the offset is committed anyway: only the protection
        against a later redelivery is lost, never the event."""
        assert self.dedup is not None
        for attempt in range(1, self.max_attempts + 1):
            try:
                await self.dedup.mark(event_id)
                return
            except Exception as exc:  # noqa: BLE001
                if not is_retriable(exc) or attempt == self.max_attempts:
                    log.error("event %s: handled, but the dedup mark failed (%s: %s); committing anyway",
                              event_id, type(exc).__name__, exc)
                    return
                await asyncio.sleep(self.backoff.delay(attempt - 1))

    async def _dead_letter(self, record: ConsumerRecord, exc: Exception, attempts: int) -> bool:
        """Copy ``record`` to its dead-letter topic with the error; retry until acked or stopping."""
        topic = self.topics[record.topic]
        headers = [*(record.headers or ()),
                   ("opml_error", (str(exc) or repr(exc))[:_MAX_ERROR_HEADER].encode("utf-8", "replace")),
                   ("opml_error_type", type(exc).__name__.encode()),
                   ("opml_source_topic", record.topic.encode()),
                   ("opml_source_partition", str(record.partition).encode()),
                   ("opml_source_offset", str(record.offset).encode()),
                   ("opml_consumer_group", self.group_id.encode()),
                   ("opml_attempts", str(attempts).encode())]
        retry = 0
        while True:
            try:
                await self._publisher.send_raw(topic.dead_letter(self.settings.topic_prefix), record.value,
                                               key=record.key, headers=headers)
                return True
            except Exception as publish_error:  # noqa: BLE001 - keep trying: the record must not be lost
                delay = self._persistent_backoff.delay(retry)
                retry += 1
                log.error("%s@%d/%d: dead-letter publish failed (%s); retrying in %.2fs",
                          record.topic, record.partition, record.offset, publish_error, delay)
                if await self._sleep_unless_stopping(delay):
                    return False

    async def _sleep_unless_stopping(self, delay: float) -> bool:
        """Sleep ``delay`` seconds; True (at once) if stop() is called meanwhile."""
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=delay)
        except TimeoutError:
            return False
        return True

    async def _update_lag(self, consumer: AIOKafkaConsumer) -> None:
        """Set the lag of every assigned partition the consumer has fetched for. One that no record was
        fetched for since its assignment starts from the consumer's position (its committed offset)."""
        for tp in list(consumer.assignment()):
            if tp not in consumer.assignment() or consumer.highwater(tp) is None:
                continue  # revoked meanwhile, or not fetched for yet
            if tp not in self._next_offset:
                try:
                    position = await consumer.position(tp)
                except IllegalStateError:
                    continue
                if tp not in consumer.assignment():
                    continue
                self._next_offset[tp] = position
            highwater = consumer.highwater(tp)
            if highwater is not None:
                topic = self.topics[tp.topic].name
                self._lag.labels(topic=topic, partition=str(tp.partition)).set(max(highwater - self._next_offset[tp], 0))

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        async with self._processing:  # the record in hand is handled and committed first
            self._generation += 1
            for tp in revoked:
                self._forget(tp)

    def _forget(self, tp: TopicPartition) -> None:
        """Drop a partition this consumer no longer owns, and its lag series."""
        if self._next_offset.pop(tp, None) is not None:
            try:
                self._lag.remove(self.topics[tp.topic].name, str(tp.partition))
            except KeyError:
                pass

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        self._generation += 1


class _RebalanceListener(ConsumerRebalanceListener):
    def __init__(self, owner: EventConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._owner._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._owner._on_assigned(assigned)
