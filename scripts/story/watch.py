"""What the loop's steps read back from the bus while traffic flows: the monitoring-scorer's windows
and alerts, and the inference-router's deployment and rollout events, of one model.

A background thread consumes ``opml.quality.v1``, ``opml.alerts.v1`` and ``opml.deployments.v1`` from
their ends as they were when it started (so only what happens from then on counts, whatever earlier
runs left there), keeps what it read, and wakes the steps waiting on it: every wait is on an event
(or a bounded timeout), never on the clock alone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from opml.inference.v1 import deployment_events_pb2 as deployments
from opml.monitoring.v1 import alert_events_pb2 as alerts
from opml.monitoring.v1 import quality_events_pb2 as quality

from opml_inference_router_contract.names import EVENT_SOURCE as ROUTER
from opml_inference_router_contract.topics import DEPLOYMENTS
from opml_monitoring_scorer_contract.names import EVENT_SOURCE as SCORER
from opml_monitoring_scorer_contract.topics import ALERTS, QUALITY

MESSAGES = {f"opml.monitoring.v1.{name}": getattr(alerts, name) for name in ("AlertRaised", "AlertResolved")}
MESSAGES["opml.monitoring.v1.WindowScored"] = quality.WindowScored
MESSAGES.update({f"opml.inference.v1.{name}": getattr(deployments, name) for name in (
    "TrafficChanged", "RolloutStepStarted", "RolloutAnalysisCompleted",
    "RolloutPaused", "RolloutAborted", "RolloutPromoted")})
SOURCES = {QUALITY.name: SCORER, ALERTS.name: SCORER, DEPLOYMENTS.name: ROUTER}


@dataclass(frozen=True)
class Seen:
    """One event of the model, when this process read it (monotonic and wall clock)."""

    kind: str  # the message's name: WindowScored, AlertRaised, TrafficChanged...
    message: object
    at: float  # time.time() when read
    offset: int


@dataclass
class Watch:
    """The model's events from the moment :meth:`start` returns. Use as a context manager."""

    bootstrap: str
    prefix: str
    model: str
    events: list[Seen] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _ready: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _failure: BaseException | None = None
    _thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._consume()), name="watch", daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise SystemExit(f"could not read {QUALITY.name}, {ALERTS.name} and {DEPLOYMENTS.name} within 60 s")
        self._raise_failure()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise SystemExit(f"reading the bus failed: {self._failure!r}")

    async def _consume(self) -> None:
        topics = {topic.full_name(self.prefix): topic.name for topic in (QUALITY, ALERTS, DEPLOYMENTS)}
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False, group_id=None)
        try:
            await consumer.start()
            await consumer.topics()  # the cluster's metadata, so every topic's partitions are known
            partitions = []
            for topic in topics:
                numbers = consumer.partitions_for_topic(topic)
                if not numbers:
                    raise LookupError(f"topic {topic} does not exist (its service creates it when it starts)")
                partitions += [TopicPartition(topic, number) for number in sorted(numbers)]
            consumer.assign(partitions)
            await consumer.seek_to_end(*partitions)
            for partition in partitions:  # the positions are fixed before anyone waits on what comes next
                await consumer.position(partition)
            self._ready.set()
            while not self._stop.is_set():
                for partition, records in (await consumer.getmany(timeout_ms=300)).items():
                    for record in records:
                        self._take(topics[partition.topic], record)
        except Exception as error:  # noqa: BLE001 - handed to the waiting step, which fails with it
            self._failure = error
            self._ready.set()
        finally:
            await consumer.stop()
            with self._changed:
                self._changed.notify_all()

    def _take(self, topic: str, record) -> None:  # noqa: ANN001 - an aiokafka ConsumerRecord
        headers = {k: v.decode(errors="replace") for k, v in record.headers or ()}
        kind = headers.get("ce_type", "")
        if kind not in MESSAGES or headers.get("ce_source") != SOURCES[topic]:
            return
        message = MESSAGES[kind].FromString(record.value or b"")
        if message.model != self.model:
            return
        with self._changed:
            self.events.append(Seen(kind.rsplit(".", 1)[1], message, time.time(), record.offset))
            self._changed.notify_all()

    def wait(self, what: str, found: Callable[[list[Seen]], object], timeout_s: float):
        """Block until ``found`` (called with every event so far) returns something truthy; returns it.

        Raises: SystemExit: not within ``timeout_s`` (naming ``what``), or the bus could not be read."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                self._raise_failure()
                if result := found(list(self.events)):
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SystemExit(f"{what} did not happen within {timeout_s:.0f} s")
                self._changed.wait(min(left, 1.0))

    def of(self, kind: str, since: float = 0.0) -> list[Seen]:
        """The events of one kind read since ``since`` (time.time())."""
        with self._changed:
            return [e for e in self.events if e.kind == kind and e.at >= since]


def windows(events: list[Seen], version: str | None = None) -> dict[tuple[str, str, int], quality.WindowScored]:
    """Each window as it stands (the event with the most labels joined), by (version, segment, index)."""
    latest: dict[tuple[str, str, int], quality.WindowScored] = {}
    for seen in events:
        if seen.kind != "WindowScored" or (version is not None and seen.message.version != version):
            continue
        key = (seen.message.version, seen.message.segment, seen.message.window)
        if key not in latest or seen.message.labelled >= latest[key].labelled:
            latest[key] = seen.message
    return latest
