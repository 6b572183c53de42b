"""The embedded broker on its durable engine (tansu on SeaweedFS S3) loses no acknowledged event.

Each test runs its own DevInfra with ``kafka_storage="s3"`` (the session's broker is never killed),
publishes CloudEvents through the platform's EventPublisher (acks=all), restarts the broker, and
reads the topic from the start with a plain aiokafka consumer until every acknowledged event id
is there (never judging "caught up" from end offsets).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from opml.bundles.v1 import bundles_pb2, events_pb2

from opml_common.bus import CloudEvent, EventPublisher, ensure_topics
from opml_common.bus.producer import PublishFailed
from opml_common.config import PlatformSettings
from opml_common.topics import Topic
from opml_devstack.devinfra import DevInfra, Endpoints
from opml_devstack.testing.bus import fresh_metrics

pytestmark = pytest.mark.timeout(300)

TOPIC = Topic.of(events_pb2)
SOURCE = "opml/test-broker-durable"


@pytest.fixture
def durable(tmp_path: Path) -> Iterator[DevInfra]:
    infra = DevInfra(workdir=tmp_path / "infra", kafka_storage="s3", kafka_bucket="tansu-test")
    infra.start()
    try:
        yield infra
    finally:
        infra.stop()


def settings_of(endpoints: Endpoints, prefix: str) -> PlatformSettings:
    return PlatformSettings(kafka_bootstrap=endpoints.kafka_bootstrap, topic_prefix=prefix)


def event(i: int) -> CloudEvent:
    bundle = bundles_pb2.Bundle(bundle_name=f"model-{i % 5}", uuid=str(uuid.uuid4()), context="plant-a",
                                committed=True, tags={"stage": "candidate"})
    return CloudEvent.from_proto(events_pb2.BundleCommitted(bundle=bundle), source=SOURCE,
                                 subject=bundle.bundle_name)


async def publish(settings: PlatformSettings, count: int) -> set[str]:
    """``count`` events published one at a time (as the outbox does); the ids the broker acked."""
    acked: set[str] = set()
    async with EventPublisher(settings, source=SOURCE, metrics=fresh_metrics()[0]) as publisher:
        for i in range(count):
            e = event(i)
            await publisher.publish(TOPIC, e)
            acked.add(e.id)
    return acked


async def read_ids(settings: PlatformSettings, expected: set[str], *, timeout_s: float = 60.0) -> list[str]:
    """Every ce_id of the topic from the start, read until each expected id was seen (or time ran out)."""
    consumer = AIOKafkaConsumer(TOPIC.full_name(settings.topic_prefix), bootstrap_servers=settings.kafka_bootstrap,
                                group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    seen: list[str] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not expected <= set(seen) and loop.time() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                seen.extend(dict(record.headers)["ce_id"].decode() for record in records)
        for records in (await consumer.getmany(timeout_ms=300)).values():  # nothing unexpected after them
            seen.extend(dict(record.headers)["ce_id"].decode() for record in records)
    finally:
        await consumer.stop()
    return seen


def assert_all_there(seen: list[str], acked: set[str]) -> None:
    missing = acked - set(seen)
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged events lost, e.g. {sorted(missing)[:3]}"
    assert set(seen) == acked, f"unexpected events: {sorted(set(seen) - acked)[:3]}"
    assert len(seen) == len(set(seen)), "an event was stored twice"


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
async def test_acked_events_survive_a_broker_restart(durable: DevInfra, unique_prefix: str, how: str) -> None:
    settings = settings_of(durable.endpoints, unique_prefix)
    await ensure_topics(settings, [TOPIC])
    before = await publish(settings, 40)
    tansu = durable.process("tansu")
    old_pid = tansu.process.pid
    if how == "sigkill":
        tansu.kill()
    else:
        tansu.stop()
    tansu.start()  # the same command line: same port, same bucket
    assert tansu.process.pid != old_pid
    after = await publish(settings, 20)  # the topic still exists: no ensure_topics after the restart
    assert_all_there(await read_ids(settings, before | after), before | after)


async def test_acked_events_survive_a_crash_under_concurrent_publishing(durable: DevInfra,
                                                                       unique_prefix: str) -> None:
    """The broker is SIGKILLed while eight senders publish (as the prediction log does): every event
    acknowledged before or after the crash is there; those that failed are simply not acknowledged."""
    settings = settings_of(durable.endpoints, unique_prefix)
    await ensure_topics(settings, [TOPIC])
    tansu = durable.process("tansu")
    acked: set[str] = set()
    failed = 0
    crash_now = asyncio.Event()
    pending = [event(i) for i in range(600)]

    async with EventPublisher(settings, source=SOURCE, metrics=fresh_metrics()[0]) as publisher:
        async def sender() -> None:
            nonlocal failed
            while pending:
                e = pending.pop()
                try:
                    await publisher.publish(TOPIC, e)
                except PublishFailed:
                    failed += 1
                    continue
                acked.add(e.id)
                if len(acked) >= 200:
                    crash_now.set()

        async def crash() -> None:
            await crash_now.wait()
            await asyncio.to_thread(tansu.kill)
            await asyncio.to_thread(tansu.start)

        await asyncio.gather(crash(), *(sender() for _ in range(8)))
    assert len(acked) >= 200
    seen = await read_ids(settings, acked)
    missing = acked - set(seen)
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged events lost ({failed} publishes failed)"


async def test_acked_events_survive_a_stop_and_start_of_the_whole_infrastructure(tmp_path: Path,
                                                                                  unique_prefix: str) -> None:
    """`make down` then `make up`: a new DevInfra on the same workdir (new ports) has every event."""
    workdir = tmp_path / "infra"
    with DevInfra(workdir=workdir, kafka_storage="s3") as endpoints:
        settings = settings_of(endpoints, unique_prefix)
        await ensure_topics(settings, [TOPIC])
        acked = await publish(settings, 30)
    with DevInfra(workdir=workdir, kafka_storage="s3") as endpoints:
        settings = settings_of(endpoints, unique_prefix)
        assert_all_there(await read_ids(settings, acked), acked)
