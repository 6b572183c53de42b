"""The event bus against a real broker (tansu or Kafka) and a real Redis, via the infra fixtures."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from datetime import UTC, datetime

import pytest
from opml.bundles.v1 import bundles_pb2, events_pb2

from opml_common.bus import (
    CloudEvent,
    EventConsumer,
    EventPublisher,
    MalformedEvent,
    RedisDeduplicator,
    ensure_topics,
)
from opml_common.config import PlatformSettings
from opml_common.errors import FailedPrecondition, Unavailable
from opml_common.storage import redis_client
from opml_common.topics import Topic
from opml_devstack.testing.bus import fresh_metrics, headers_of, read_records, running, sample, wait_until

pytestmark = pytest.mark.timeout(90)

HANDLED = "opml_bus_test_events_handled_total"


def _committed(name: str) -> events_pb2.BundleCommitted:
    return events_pb2.BundleCommitted(bundle=bundles_pb2.Bundle(bundle_name=name, uuid=uuid.uuid4().hex))


@pytest.fixture
async def redis(platform_settings: PlatformSettings):
    client = redis_client(platform_settings)
    try:
        yield client
    finally:
        keys = [key async for key in client.scan_iter(match=platform_settings.redis_prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_ensure_topics_creates_topic_and_dead_letter_idempotently(platform_settings):
    from aiokafka.admin import AIOKafkaAdminClient

    topic = Topic("opml.bustest.admin.v1", 3)
    await ensure_topics(platform_settings, [topic])
    await ensure_topics(platform_settings, [topic])  # already there: fine
    admin = AIOKafkaAdminClient(bootstrap_servers=platform_settings.kafka_bootstrap)
    await admin.start()
    try:
        names = [topic.full_name(platform_settings.topic_prefix), topic.dead_letter(platform_settings.topic_prefix)]
        assert set(names) <= set(await admin.list_topics())
        described = await admin.describe_topics(names)
        assert {d["topic"]: len(d["partitions"]) for d in described} == dict.fromkeys(names, 3)
    finally:
        await admin.close()


async def test_publish_is_read_back_by_a_plain_consumer(platform_settings):
    topic = Topic("opml.bustest.publish.v1", 2)
    await ensure_topics(platform_settings, [topic])
    metrics, registry = fresh_metrics()
    sent: dict[str, tuple[CloudEvent, events_pb2.BundleCommitted]] = {}
    async with EventPublisher(platform_settings, source="bundle-store", metrics=metrics) as publisher:
        await publisher.start()  # idempotent
        for i in range(20):
            message = _committed(f"b{i}")
            event = await publisher.publish_proto(topic, message, subject=f"b{i % 5}", extensions={"tenant": "acme"})
            sent[event.id] = (event, message)
    await publisher.stop()  # idempotent
    assert sample(registry, "opml_bus_test_events_published_total",
                  topic=topic.name, type="opml.bundles.v1.BundleCommitted") == 20

    records = await read_records(platform_settings, topic.full_name(platform_settings.topic_prefix), 20)
    assert len(records) == 20
    partitions_by_subject: dict[bytes, set[int]] = {}
    for record in records:
        headers = headers_of(record)
        event, message = sent[headers["ce_id"].decode()]
        assert headers["ce_specversion"] == b"1.0"
        assert headers["ce_source"] == b"bundle-store"
        assert headers["ce_type"] == b"opml.bundles.v1.BundleCommitted"
        assert headers["ce_subject"] == event.subject.encode()
        assert headers["ce_dataschema"] == b"proto:opml.bundles.v1.BundleCommitted"
        assert headers["content-type"] == b"application/protobuf"
        assert headers["ce_tenant"] == b"acme"
        assert record.key == event.subject.encode()  # key defaults to the subject
        assert record.value == message.SerializeToString()
        back = CloudEvent.from_kafka(record.headers, record.value)
        assert back == event
        assert back.parse(events_pb2.BundleCommitted) == message
        partitions_by_subject.setdefault(record.key, set()).add(record.partition)
    assert all(len(parts) == 1 for parts in partitions_by_subject.values())  # one subject, one partition


async def test_publish_before_start_fails_clearly(platform_settings):
    metrics, _ = fresh_metrics()
    publisher = EventPublisher(platform_settings, source="s", metrics=metrics)
    with pytest.raises(FailedPrecondition, match="not started"):
        await publisher.publish_proto(Topic("opml.bustest.none.v1"), _committed("x"), subject="x")


async def test_unreachable_broker_is_unavailable(platform_settings):
    settings = platform_settings.model_copy(update={"kafka_bootstrap": "127.0.0.1:1"})
    metrics, _ = fresh_metrics()
    with pytest.raises(Unavailable):
        await EventPublisher(settings, source="s", metrics=metrics).start()


async def test_poison_records_go_to_the_dead_letter_topic_and_the_partition_flows_on(platform_settings):
    topic = Topic("opml.bustest.poison.v1", 1)  # one partition: the good events come after the poison
    await ensure_topics(platform_settings, [topic])
    prefix = platform_settings.topic_prefix
    metrics, registry = fresh_metrics()
    handled: list[str] = []

    async def handler(event: CloudEvent) -> None:
        message = event.parse(events_pb2.BundleCommitted)  # MalformedEvent for bad bytes
        if message.bundle.bundle_name == "bug":
            raise KeyError("a bug in the handler")
        handled.append(message.bundle.bundle_name)

    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        await publisher.publish_proto(topic, _committed("good-1"), subject="k")
        # offset 1: not a CloudEvent at all
        await publisher.send_raw(topic.full_name(prefix), b"\x00garbage", key=b"k", headers=[("x-other", b"1")])
        # offset 2: a CloudEvent whose data does not parse as its type
        bad = CloudEvent(id="bad-bytes", source="test", type="opml.bundles.v1.BundleCommitted",
                         time=datetime.now(UTC),
                         data=b"\x0a\xff", subject="k")
        await publisher.publish(topic, bad)
        # offset 3: the handler has a bug (non-retriable): dead-lettered at once
        bug = await publisher.publish_proto(topic, _committed("bug"), subject="k")
        await publisher.publish_proto(topic, _committed("good-2"), subject="k")
        await publisher.publish_proto(topic, _committed("good-3"), subject="k")

        consumer = EventConsumer(platform_settings, group_id="poison", topics=[topic], handler=handler,
                                 metrics=metrics, publisher=publisher, max_attempts=3, backoff_s=0.01)
        async with running(consumer):
            await wait_until(lambda: len(handled) == 3, what="the three good events")
            await wait_until(lambda: sample(registry, "opml_bus_test_consumer_lag",
                                            topic=topic.name, partition="0") == 0 and
                             sample(registry, HANDLED, topic=topic.name, type="opml.bundles.v1.BundleCommitted",
                                    outcome="ok") == 3, what="lag 0")
        assert publisher.started  # a publisher passed in is not stopped by the consumer

    assert handled == ["good-1", "good-2", "good-3"]
    assert sample(registry, HANDLED, topic=topic.name, type="unknown", outcome="dead_lettered") == 1
    assert sample(registry, HANDLED, topic=topic.name, type="opml.bundles.v1.BundleCommitted",
                  outcome="dead_lettered") == 2
    assert sample(registry, HANDLED, topic=topic.name, type="opml.bundles.v1.BundleCommitted", outcome="retried") == 0

    dead = await read_records(platform_settings, topic.dead_letter(prefix), 3)
    assert len(dead) == 3
    by_offset = {int(headers_of(r)["opml_source_offset"]): r for r in dead}
    assert sorted(by_offset) == [1, 2, 3]
    for record in by_offset.values():
        headers = headers_of(record)
        assert headers["opml_source_topic"] == topic.full_name(prefix).encode()
        assert headers["opml_source_partition"] == b"0"
        assert headers["opml_consumer_group"] == (prefix + "poison").encode()
        assert headers["opml_attempts"] == b"1"
        assert headers["opml_error"]
        assert record.key == b"k"
    garbage = headers_of(by_offset[1])
    assert by_offset[1].value == b"\x00garbage" and garbage["x-other"] == b"1"  # the original record
    assert garbage["opml_error_type"] == b"MalformedEvent" and b"ce_specversion" in garbage["opml_error"]
    bad_headers = headers_of(by_offset[2])
    assert by_offset[2].value == b"\x0a\xff" and bad_headers["ce_id"] == b"bad-bytes"
    assert bad_headers["opml_error_type"] == b"MalformedEvent" and b"does not parse" in bad_headers["opml_error"]
    bug_headers = headers_of(by_offset[3])
    assert bug_headers["opml_error_type"] == b"KeyError" and bug_headers["ce_id"] == bug.id.encode()

    # The offsets were committed: the same group starts after the last record, and reads a new one only.
    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        await publisher.publish_proto(topic, _committed("good-4"), subject="k")
    handled.clear()
    consumer = EventConsumer(platform_settings, group_id="poison", topics=[topic], handler=handler,
                             metrics=metrics, max_attempts=3, backoff_s=0.01)
    async with running(consumer):
        await wait_until(lambda: handled, what="the new event")
    assert handled == ["good-4"]


async def test_retriable_failure_is_retried_then_succeeds(platform_settings):
    topic = Topic("opml.bustest.retry.v1", 1)
    await ensure_topics(platform_settings, [topic])
    metrics, registry = fresh_metrics()
    attempts: Counter[str] = Counter()
    done: list[str] = []

    async def handler(event: CloudEvent) -> None:
        attempts[event.id] += 1
        if attempts[event.id] <= 2:
            raise Unavailable("the model store is restarting")
        done.append(event.id)

    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        event = await publisher.publish_proto(topic, _committed("r"), subject="r")
    consumer = EventConsumer(platform_settings, group_id="retry", topics=[topic], handler=handler,
                             metrics=metrics, max_attempts=5, backoff_s=0.05)
    async with running(consumer):
        await wait_until(lambda: done, what="the event to succeed")
    labels = {"topic": topic.name, "type": "opml.bundles.v1.BundleCommitted"}
    assert done == [event.id] and attempts[event.id] == 3
    assert sample(registry, HANDLED, **labels, outcome="retried") == 2
    assert sample(registry, HANDLED, **labels, outcome="ok") == 1
    assert sample(registry, HANDLED, **labels, outcome="dead_lettered") == 0
    assert sample(registry, "opml_bus_test_event_handler_duration_seconds_count", **labels) == 3


async def test_redis_unreachable_holds_the_partition_past_max_attempts_and_dead_letters_nothing(platform_settings):
    """A Redis restart is no record's fault: its errors are retried for as long as they last."""
    import redis.exceptions

    topic = Topic("opml.bustest.redisdown.v1", 1)
    await ensure_topics(platform_settings, [topic])
    metrics, registry = fresh_metrics()
    attempts: Counter[str] = Counter()
    done: list[str] = []

    async def handler(event: CloudEvent) -> None:
        attempts[event.subject] += 1
        if event.subject == "first" and attempts["first"] <= 6:  # twice max_attempts
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        done.append(event.subject)

    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        await publisher.publish_proto(topic, _committed("f"), subject="first")
        await publisher.publish_proto(topic, _committed("s"), subject="second")
    consumer = EventConsumer(platform_settings, group_id="redisdown", topics=[topic], handler=handler,
                             metrics=metrics, max_attempts=3, backoff_s=0.01)
    async with running(consumer):
        await wait_until(lambda: len(done) == 2, what="both events handled")
    assert done == ["first", "second"] and attempts["first"] == 7  # in order: the partition waited
    labels = {"topic": topic.name, "type": "opml.bundles.v1.BundleCommitted"}
    assert sample(registry, HANDLED, **labels, outcome="retried") == 6
    assert sample(registry, HANDLED, **labels, outcome="dead_lettered") == 0


async def test_retries_exhausted_go_to_the_dead_letter_topic(platform_settings):
    topic = Topic("opml.bustest.exhaust.v1", 1)
    await ensure_topics(platform_settings, [topic])
    metrics, registry = fresh_metrics()
    calls: list[str] = []

    async def handler(event: CloudEvent) -> None:
        calls.append(event.subject)
        if event.subject == "down":
            raise ConnectionRefusedError("feature store down")

    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        await publisher.publish_proto(topic, _committed("d"), subject="down")
        await publisher.publish_proto(topic, _committed("u"), subject="up")
    consumer = EventConsumer(platform_settings, group_id="exhaust", topics=[topic], handler=handler,
                             metrics=metrics, max_attempts=3, backoff_s=0.01)
    async with running(consumer):
        await wait_until(lambda: "up" in calls, what="the event after the failing one")
    assert calls == ["down", "down", "down", "up"]
    (dead,) = await read_records(platform_settings, topic.dead_letter(platform_settings.topic_prefix), 1)
    assert headers_of(dead)["opml_attempts"] == b"3"
    assert headers_of(dead)["opml_error_type"] == b"ConnectionRefusedError"
    labels = {"topic": topic.name, "type": "opml.bundles.v1.BundleCommitted"}
    assert sample(registry, HANDLED, **labels, outcome="retried") == 2
    assert sample(registry, HANDLED, **labels, outcome="dead_lettered") == 1


async def test_duplicate_event_ids_are_handled_once(platform_settings, redis):
    topic = Topic("opml.bustest.dup.v1", 2)
    await ensure_topics(platform_settings, [topic])
    metrics, registry = fresh_metrics()
    seen: Counter[str] = Counter()

    async def handler(event: CloudEvent) -> None:
        seen[event.id] += 1

    dedup = RedisDeduplicator(redis, prefix=platform_settings.redis_prefix, group="dup", ttl_s=600)
    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        events = [CloudEvent.from_proto(_committed(f"d{i}"), source="test", subject=f"s{i}") for i in range(10)]
        for event in events:
            await publisher.publish(topic, event)
        for event in events[:4]:  # the same events again (a producer retry, a replay)
            await publisher.publish(topic, event)

    consumer = EventConsumer(platform_settings, group_id="dup", topics=[topic], handler=handler,
                             metrics=metrics, dedup=dedup)
    labels = {"topic": topic.name, "type": "opml.bundles.v1.BundleCommitted"}
    async with running(consumer):
        await wait_until(lambda: len(seen) == 10 and sample(registry, HANDLED, **labels, outcome="duplicate") == 4,
                         what="10 events and 4 duplicates")
    assert seen == Counter({event.id: 1 for event in events})
    assert sample(registry, HANDLED, **labels, outcome="ok") == 10
    key = dedup.key(events[0].id)
    assert key.startswith(platform_settings.redis_prefix + "dedup:dup:")
    assert 0 < await redis.ttl(key) <= 600

    # A redelivery after a restart (the same ids again, new consumer) is skipped too.
    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        await publisher.publish(topic, events[5])
    consumer = EventConsumer(platform_settings, group_id="dup", topics=[topic], handler=handler,
                             metrics=metrics, dedup=dedup)
    async with running(consumer):
        await wait_until(lambda: sample(registry, HANDLED, **labels, outcome="duplicate") == 5, what="5th duplicate")
    assert seen[events[5].id] == 1


async def test_stop_is_graceful_and_idempotent(platform_settings):
    topic = Topic("opml.bustest.stop.v1", 1)
    await ensure_topics(platform_settings, [topic])
    metrics, _ = fresh_metrics()
    started, stop_called = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    async def slow_handler(event: CloudEvent) -> None:  # holds its event until stop() is under way
        started.set()
        await stop_called.wait()
        finished.append(event.id)

    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        first = await publisher.publish_proto(topic, _committed("a"), subject="k")
        second = await publisher.publish_proto(topic, _committed("b"), subject="k")
    consumer = EventConsumer(platform_settings, group_id="stop", topics=[topic], handler=slow_handler,
                             metrics=metrics)
    await consumer.start()
    await consumer.start()  # idempotent
    task = asyncio.create_task(consumer.run())
    try:
        await asyncio.wait_for(started.wait(), 20)
        stop_called.set()  # the handler goes on only once this task yields, inside stop()
        await asyncio.wait_for(consumer.stop(), 10)  # waits for the event in hand
        assert finished == [first.id]
        await consumer.stop()  # idempotent
    finally:
        await consumer.stop()
        await asyncio.wait_for(task, 5)

    # The first event was committed before leaving; the second was not handled: it comes next.
    finished.clear()
    consumer = EventConsumer(platform_settings, group_id="stop", topics=[topic], handler=slow_handler,
                             metrics=metrics)
    async with running(consumer):
        await wait_until(lambda: finished, what="the second event")
    assert finished == [second.id]


async def test_consumer_constructor_validates(platform_settings):
    metrics, _ = fresh_metrics()

    async def handler(event: CloudEvent) -> None: ...

    for kwargs, field in [({"group_id": ""}, "group_id"), ({"topics": []}, "topics"),
                          ({"max_attempts": 0}, "max_attempts")]:
        base = {"group_id": "g", "topics": [Topic("t")], "handler": handler, "metrics": metrics}
        with pytest.raises(ValueError, match=field):
            EventConsumer(platform_settings, **{**base, **kwargs})
    assert MalformedEvent.retriable is False


async def test_rebalance_to_a_second_member_loses_nothing(platform_settings):
    """A second member joins mid-stream: the first finishes and commits the record in hand before
    giving partitions up, so (with graceful rebalances) every event is handled exactly once."""
    topic = Topic("opml.bustest.rebalance.v1", 4)
    await ensure_topics(platform_settings, [topic])
    metrics, _ = fresh_metrics()
    handled: Counter[str] = Counter()

    async def handler(event: CloudEvent) -> None:
        await asyncio.sleep(0.01)
        handled[event.id] += 1

    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        ids = [(await publisher.publish_proto(topic, _committed(f"r{i}"), subject=f"s{i}")).id for i in range(300)]
    first = EventConsumer(platform_settings, group_id="rebalance", topics=[topic], handler=handler,
                          metrics=metrics)
    second = EventConsumer(platform_settings, group_id="rebalance", topics=[topic], handler=handler,
                           metrics=metrics)
    async with running(first):
        await wait_until(lambda: len(handled) >= 30, what="the first member to start")
        async with running(second):  # returns once the group rebalanced and gave it partitions
            owned_by_second = second.assignment()
            await wait_until(lambda: len(handled) == len(ids), timeout_s=60, what="all events")
    assert len(owned_by_second) == 2 and not first.assignment()  # stopped: owns nothing
    assert set(handled) == set(ids)
    assert max(handled.values()) == 1, f"handled twice: {[i for i, n in handled.items() if n > 1]}"


async def test_lag_shows_for_a_partition_stuck_on_its_first_record_and_for_an_idle_one(platform_settings):
    """Lag was set only for partitions that had committed since their assignment: one whose first
    record kept failing, and one with nothing to do, had no series at all."""
    topic = Topic("opml.bustest.lag.v1", 2)
    await ensure_topics(platform_settings, [topic])
    metrics, registry = fresh_metrics()
    released = asyncio.Event()
    handled: list[str] = []

    async def handler(event: CloudEvent) -> None:
        if not released.is_set():
            raise ConnectionError("the downstream service is away")  # retriable: the partition waits
        handled.append(event.subject)

    def lag(partition: int) -> float | None:
        return registry.get_sample_value("opml_bus_test_consumer_lag", {"topic": topic.name, "partition": str(partition)})

    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        for n in range(3):
            await publisher.publish_proto(topic, _committed(f"m{n}"), subject="one-key")  # one partition
        consumer = EventConsumer(platform_settings, group_id="lag", topics=[topic], handler=handler,
                                 metrics=metrics, publisher=publisher, max_attempts=1000, backoff_s=0.01)
        async with running(consumer):
            await wait_until(lambda: {lag(0), lag(1)} == {0, 3},
                             what=lambda: f"lag 3 on the stuck partition, 0 on the idle one; got {lag(0)}, {lag(1)}")
            released.set()
            await wait_until(lambda: lag(0) == 0 and lag(1) == 0, what="lag 0 once handled")
    assert handled == ["one-key"] * 3
