"""Run the trace-collector service: ``python -m opml_trace_collector`` (configured by OPML_* variables).

The consumer commits an event only after its effect is in Redis; on stop it finishes the event in
hand, so nothing is lost or applied twice across restarts. State missing from Redis, at start or
while running, is rebuilt from the topic (:mod:`opml_trace_collector.rebuild`).
"""

from __future__ import annotations

import asyncio

from opml.traces.v1 import traces_pb2, traces_pb2_grpc

from opml_common.bus import EventConsumer, RedisDeduplicator
from opml_common.grpc.server import ServiceRegistration
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service
from opml_trace_collector.aggregator import Aggregator
from opml_trace_collector.captures import CaptureManager
from opml_trace_collector.inject.settings import TracerSettings
from opml_trace_collector.rebuild import RebuildingConsumer
from opml_trace_collector.servicer import METHOD_ROLES, TraceCollectorServicer
from opml_trace_collector.settings import TraceCollectorSettings
from opml_trace_collector.store import Keys, TraceStore
from opml_trace_collector.summary import Summarizer
from opml_trace_collector.tracefiles import TraceFiles
from opml_trace_collector_contract.topics import TRACER_SOURCE_PREFIX, TRACES

SPEC = ServiceSpec(name="trace-collector", module="opml_trace_collector", settings=TraceCollectorSettings,
                   other_settings=(TracerSettings,), topics=(TRACES,))


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """The tracers' events consumed into Redis, capture expiry, and the query API over both."""
    settings: TraceCollectorSettings = service.settings
    platform, metrics, redis = service.platform, service.metrics, service.redis()
    files = TraceFiles(service.s3(), settings.bucket)
    await asyncio.to_thread(files.ensure_bucket)
    keys = Keys(platform.redis_prefix)
    store = TraceStore(redis, keys, series_length=settings.series_length, run_lost_after_s=settings.run_lost_after_s)
    captures = CaptureManager(redis, keys, store, bucket=settings.bucket, timeout_s=settings.capture_timeout_s,
                              metrics=metrics, armed=files)
    aggregator = Aggregator(store, captures, metrics)
    consumer = RebuildingConsumer(
        store, lambda group: EventConsumer(platform, group_id=group, topics=[TRACES], handler=aggregator.handle,
                                           metrics=metrics, source_prefixes=frozenset({TRACER_SOURCE_PREFIX}),
                                           dedup=RedisDeduplicator(redis, prefix=platform.redis_prefix, group=group)),
        base_group=settings.consumer_group, metrics=metrics, check_interval_s=settings.state_check_interval_s)
    await service.start(consumer)
    service.run_in_background(consumer.run, stop=consumer.stop, name="traces-consumer")
    service.run_in_background(captures.run_expiry, name="capture-expiry")
    summarizer = Summarizer(redis, keys, store, captures, files, sample_steps=settings.summary_sample_steps)
    servicer = TraceCollectorServicer(store, captures, summarizer, files)
    return [ServiceRegistration(traces_pb2.DESCRIPTOR.services_by_name["TraceCollectorService"],
                                traces_pb2_grpc.add_TraceCollectorServiceServicer_to_server, servicer, METHOD_ROLES)]


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
