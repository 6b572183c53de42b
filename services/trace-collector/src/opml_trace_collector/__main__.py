"""Run the trace-collector service: ``python -m opml_trace_collector`` (configured by OPML_* variables)."""

from __future__ import annotations

import asyncio
import contextlib

from opml.traces.v1 import traces_pb2, traces_pb2_grpc

from opml_common.bus import EventConsumer, RedisDeduplicator, ensure_topics
from opml_common.config import PlatformSettings
from opml_common.grpc.server import GrpcServer, ServiceRegistration, wait_for_signal
from opml_common.logging import configure_logging
from opml_common.metrics import ServiceMetrics
from opml_common.process import ServiceSpec
from opml_common.storage import redis_client, s3_client
from opml_common.topics import TRACES
from opml_trace_collector.aggregator import Aggregator
from opml_trace_collector.captures import CaptureManager
from opml_trace_collector.inject.settings import TracerSettings
from opml_trace_collector.rebuild import RebuildingConsumer
from opml_trace_collector.servicer import METHOD_ROLES, TraceCollectorServicer
from opml_trace_collector.settings import TraceCollectorSettings
from opml_trace_collector.store import Keys, TraceStore
from opml_trace_collector.summary import Summarizer
from opml_trace_collector.tracefiles import TraceFiles

SERVICE = "trace-collector"
SPEC = ServiceSpec(name=SERVICE, module="opml_trace_collector", settings=TraceCollectorSettings,
                   other_settings=(TracerSettings,))


async def serve(settings: TraceCollectorSettings, platform: PlatformSettings) -> None:
    """Consume the tracers' events and serve the API until SIGINT/SIGTERM.

    The consumer commits an event only after its effect is in Redis; on stop it finishes the event
    in hand, so nothing is lost or applied twice across restarts. State missing from Redis, at
    start or while running, is rebuilt from the topic (:mod:`opml_trace_collector.rebuild`).
    """
    metrics = ServiceMetrics(SERVICE)
    await ensure_topics(platform, [TRACES])
    redis = redis_client(platform)
    files = TraceFiles(s3_client(platform), settings.bucket)
    await asyncio.to_thread(files.ensure_bucket)
    keys = Keys(platform.redis_prefix)
    store = TraceStore(redis, keys, series_length=settings.series_length, run_lost_after_s=settings.run_lost_after_s)
    captures = CaptureManager(redis, keys, store, bucket=settings.bucket, timeout_s=settings.capture_timeout_s,
                              metrics=metrics)
    aggregator = Aggregator(store, captures, metrics)
    consumer = RebuildingConsumer(
        store, lambda group: EventConsumer(platform, group_id=group, topics=[TRACES], handler=aggregator.handle,
                                           metrics=metrics,
                                           dedup=RedisDeduplicator(redis, prefix=platform.redis_prefix, group=group)),
        base_group=settings.consumer_group, metrics=metrics, check_interval_s=settings.state_check_interval_s)
    summarizer = Summarizer(redis, keys, store, captures, files, sample_steps=settings.summary_sample_steps)
    servicer = TraceCollectorServicer(store, captures, summarizer, files)
    registration = ServiceRegistration(
        traces_pb2.DESCRIPTOR.services_by_name["TraceCollectorService"].full_name,
        traces_pb2_grpc.add_TraceCollectorServiceServicer_to_server, servicer)
    try:
        await consumer.start()
        consuming = asyncio.create_task(consumer.run())
        expiring = asyncio.create_task(captures.run_expiry())
        try:
            async with GrpcServer(settings=settings, platform=platform, metrics=metrics,
                                  registrations=[registration], method_roles=METHOD_ROLES):
                stop = asyncio.create_task(wait_for_signal())
                await asyncio.wait({stop, consuming}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
        finally:
            expiring.cancel()
            await consumer.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await expiring
            await consuming  # ends once stopped; re-raises the failure of a consumer that died
    finally:
        await redis.aclose()


def main() -> None:
    platform = PlatformSettings()
    settings = TraceCollectorSettings()
    configure_logging(SERVICE, level=platform.log_level, fmt=platform.log_format)
    asyncio.run(serve(settings, platform))


if __name__ == "__main__":
    main()
