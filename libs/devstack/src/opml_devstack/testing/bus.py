"""Test helpers for code that uses the bus: plain topic readers, bounded waits, a running consumer.

For tests only (no production code imports this). Every wait is bounded, and "caught up" is never
judged from end offsets (tansu and some clients disagree on them): readers wait for the records
they expect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord
from prometheus_client import CollectorRegistry

from opml_common.bus import EventConsumer, kafka_client_kwargs
from opml_common.config import PlatformSettings
from opml_common.metrics import ServiceMetrics


def fresh_metrics(service: str = "bus-test") -> tuple[ServiceMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return ServiceMetrics(service, registry=registry), registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A metric's current value (0 when the labelled series does not exist yet)."""
    return registry.get_sample_value(name, labels) or 0.0


async def read_records(settings: PlatformSettings, topic_name: str, count: int, *,
                       timeout_s: float = 20.0) -> list[ConsumerRecord]:
    """Read ``count`` records of a topic from the beginning with a plain, group-less aiokafka consumer
    (built with the platform's connection and security arguments, so it reads a SASL/TLS broker too).

    Waits until that many arrived (never judging "caught up" from end offsets) or fails after
    ``timeout_s``; a short extra poll makes sure no unexpected extra record is there.
    """
    consumer = AIOKafkaConsumer(topic_name, **kafka_client_kwargs(settings), group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    records: list[ConsumerRecord] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(records) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"read {len(records)} of {count} records from {topic_name} in {timeout_s}s")
            batch = await consumer.getmany(timeout_ms=int(min(left, 0.5) * 1000))
            for part in batch.values():
                records.extend(part)
        for part in (await consumer.getmany(timeout_ms=300)).values():
            records.extend(part)
    finally:
        await consumer.stop()
    return records


async def wait_until(predicate: Callable[[], object], *, timeout_s: float = 20.0,
                     what: str | Callable[[], str] = "condition") -> None:
    """Poll ``predicate`` (sync or async) every 20 ms until truthy; fail after ``timeout_s``.

    ``what`` says what was awaited; a callable is asked at the failure, so the message can show the
    state the predicate saw then."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what() if callable(what) else what}")
        await asyncio.sleep(0.02)



def poll_until(predicate: Callable[[], object], *, timeout_s: float = 20.0, what: str = "condition",
               every_s: float = 0.1) -> object:
    """Blocking :func:`wait_until` for synchronous tests: poll ``predicate`` every ``every_s`` until it
    returns something truthy, and return that; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)
    return result


@contextlib.asynccontextmanager
async def running(consumer: EventConsumer) -> AsyncIterator[asyncio.Task]:
    """Start ``consumer`` (joined and assigned), run it in a task, and always stop it after."""
    await consumer.start()
    task = asyncio.create_task(consumer.run())
    try:
        yield task
    finally:
        await asyncio.wait_for(consumer.stop(), timeout=15)
        await asyncio.wait_for(task, timeout=5)  # re-raises what run() raised, if anything


def headers_of(record: ConsumerRecord) -> dict[str, bytes]:
    return {name: value for name, value in record.headers}
