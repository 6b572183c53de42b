"""EventConsumer's allow-list of CloudEvents sources, against the real broker and Redis."""

from __future__ import annotations

import uuid

import pytest
from opml.bundles.v1 import bundles_pb2, events_pb2

from opml_common.bus import CloudEvent, EventConsumer, EventPublisher, RedisDeduplicator, ensure_topics
from opml_common.storage import redis_client
from opml_common.topics import Topic
from opml_devstack.testing.bus import fresh_metrics, headers_of, read_records, running, sample, wait_until

pytestmark = pytest.mark.timeout(90)


def _committed(name: str) -> events_pb2.BundleCommitted:
    return events_pb2.BundleCommitted(bundle=bundles_pb2.Bundle(bundle_name=name, uuid=uuid.uuid4().hex))


async def test_events_from_other_sources_are_dead_lettered_naming_the_source_and_the_partition_flows_on(
        platform_settings) -> None:
    topic = Topic("opml.bustest.sources.v1", 1)  # one partition: order is the publish order
    await ensure_topics(platform_settings, [topic])
    prefix = platform_settings.topic_prefix
    metrics, registry = fresh_metrics()
    handled: list[str] = []

    async def handler(event: CloudEvent) -> None:
        handled.append(event.parse(events_pb2.BundleCommitted).bundle.bundle_name)

    redis = redis_client(platform_settings)
    dedup = RedisDeduplicator(redis, prefix=platform_settings.redis_prefix, group="sources")
    metrics_a, _ = fresh_metrics("a")
    metrics_b, _ = fresh_metrics("b")
    try:
        async with EventPublisher(platform_settings, source="opml/bundle-store", metrics=metrics_a) as owner, \
                EventPublisher(platform_settings, source="evil/anyone", metrics=metrics_b) as forger:
            await owner.publish_proto(topic, _committed("genuine-1"), subject="k")
            forged = await forger.publish_proto(topic, _committed("forged"), subject="k")
            long_source = "x" * 5000
            await forger.publish(topic, CloudEvent.from_proto(_committed("long"), source=long_source, subject="k"))
            await owner.publish_proto(topic, _committed("genuine-2"), subject="k")

        consumer = EventConsumer(platform_settings, group_id="sources", topics=[topic], handler=handler,
                                 metrics=metrics, dedup=dedup, sources=frozenset({"opml/bundle-store"}))
        async with running(consumer):
            await wait_until(lambda: len(handled) == 2, what="the two genuine events")
        assert handled == ["genuine-1", "genuine-2"]
        # A refused event is not marked as handled: its id means nothing to the group.
        assert not await dedup.seen(forged.id)
    finally:
        await redis.aclose()

    assert sample(registry, "opml_bus_test_events_untrusted_total", topic=topic.name) == 2
    assert sample(registry, "opml_bus_test_events_handled_total", topic=topic.name,
                  type="opml.bundles.v1.BundleCommitted", outcome="dead_lettered") == 2
    dead = await read_records(platform_settings, topic.dead_letter(prefix), 2)
    assert len(dead) == 2
    first, second = (headers_of(record) for record in sorted(dead, key=lambda r: r.offset))
    assert first["ce_id"] == forged.id.encode() and first["opml_error_type"] == b"UntrustedSource"
    assert b"ce_source 'evil/anyone' is not a source" in first["opml_error"]
    assert b"opml/bundle-store" in first["opml_error"] and first["opml_attempts"] == b"1"
    assert len(second["opml_error"]) < 500 and b"xxx..." in second["opml_error"]  # a long source is cut


async def test_a_source_family_is_accepted_by_prefix_and_a_look_alike_is_dead_lettered(platform_settings) -> None:
    topic = Topic("opml.bustest.source-prefixes.v1", 1)
    await ensure_topics(platform_settings, [topic])
    metrics, registry = fresh_metrics()
    handled: list[str] = []

    async def handler(event: CloudEvent) -> None:
        handled.append(event.parse(events_pb2.BundleCommitted).bundle.bundle_name)

    family = "opml://trace-collector/tracer/"
    sends = [("opml://trace-collector/tracer/job-a/worker-0", "family-1"),
             ("opml://trace-collector/tracer-evil/job-a/worker-0", "look-alike"),  # a prefix without the '/'
             ("opml://trace-collector/spool", "sibling"),
             ("opml/bundle-store", "exact"),
             ("opml://trace-collector/tracer/job-b/worker-1", "family-2")]
    metrics_p, _ = fresh_metrics("p")
    async with EventPublisher(platform_settings, source="unused", metrics=metrics_p) as publisher:
        sent = [CloudEvent.from_proto(_committed(name), source=source, subject="k") for source, name in sends]
        for event in sent:
            await publisher.publish(topic, event)

    consumer = EventConsumer(platform_settings, group_id="source-prefixes", topics=[topic], handler=handler,
                             metrics=metrics, sources=frozenset({"opml/bundle-store"}),
                             source_prefixes=frozenset({family}))
    assert consumer.accepts("opml://trace-collector/tracer/x/y") and not consumer.accepts(family[:-1])
    async with running(consumer):
        await wait_until(lambda: len(handled) == 3, what="the family's and the exact source's events")
    assert handled == ["family-1", "exact", "family-2"]
    assert sample(registry, "opml_bus_test_events_untrusted_total", topic=topic.name) == 2
    dead = sorted(await read_records(platform_settings, topic.dead_letter(platform_settings.topic_prefix), 2),
                  key=lambda r: r.offset)
    assert [headers_of(r)["ce_id"] for r in dead] == [sent[1].id.encode(), sent[2].id.encode()]
    error = headers_of(dead[0])["opml_error"]
    assert b"'opml://trace-collector/tracer-evil/job-a/worker-0' is not a source" in error
    assert b"accepted: opml/bundle-store, opml://trace-collector/tracer/*" in error


def test_sources_must_be_a_non_empty_set(platform_settings) -> None:
    metrics, _ = fresh_metrics()

    async def handler(event: CloudEvent) -> None: ...

    for bad in ("opml/bundle-store", frozenset(), frozenset({""})):
        with pytest.raises(ValueError, match="sources"):
            EventConsumer(platform_settings, group_id="g", topics=[Topic("t", 1)], handler=handler,
                          metrics=metrics, sources=bad)
    for bad in ("opml://x/", frozenset(), frozenset({""}), frozenset({"/"}), frozenset({"opml://trace-collector"})):
        with pytest.raises(ValueError, match="source_prefixes"):
            EventConsumer(platform_settings, group_id="g", topics=[Topic("t", 1)], handler=handler,
                          metrics=metrics, source_prefixes=bad)
