"""Run the inference-router service: ``python -m opml_inference_router`` (configured by OPML_* variables).

One gRPC server carries the KServe v2 inference API (tritonclient and other KServe clients call
it) and the DeploymentService. The router starts its worker processes (the fleet file's pools that
this machine can run), rebuilds the deployments Redis remembers, publishes predictions and
deployment events, and deploys committed bundles tagged ``serve=true`` from the bundles topic.
SIGTERM: the server drains, then the consumer, the predictions and the workers stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from functools import partial

from google.protobuf.message import Message
from opml_common.bus import CloudEvent, EventConsumer, EventPublisher, RedisDeduplicator, ensure_topics
from opml_common.config import PlatformSettings
from opml_common.grpc.server import GrpcServer, wait_for_signal
from opml_common.logging import configure_logging
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.process import ServiceSpec
from opml_common.storage import redis_client
from opml_common.topics import BUNDLES, DEPLOYMENTS, PREDICTIONS

from opml_inference_router import frontend
from opml_inference_router.control import DeploymentManager, DeploymentStore, Observer, PoolManager
from opml_inference_router.control.autodeploy import GROUP, AutoDeployer
from opml_inference_router.control.bundles import BundleFetcher
from opml_inference_router.control.worker_metrics import register_worker_metrics  # workers' metrics on ours
from opml_inference_router.placement import load_fleet_config
from opml_inference_router.predictions import PredictionLog
from opml_inference_router.routing import Router
from opml_inference_router.routing.uds_replica import connect
from opml_inference_router.servicer import METHOD_ROLES, DeploymentServicer
from opml_inference_router.settings import RouterSettings
from opml_inference_router.worker.settings import WorkerSettings

SERVICE = "inference-router"
EVENT_SOURCE = "opml/inference-router"
SPEC = ServiceSpec(name=SERVICE, module="opml_inference_router", settings=RouterSettings,
                   other_settings=(WorkerSettings,))

log = logging.getLogger(__name__)


async def serve(settings: RouterSettings, platform: PlatformSettings) -> None:
    """Serve until SIGINT/SIGTERM; deployment events still unpublished stay in the outbox."""
    metrics = ServiceMetrics(SERVICE)
    await ensure_topics(platform, [BUNDLES, PREDICTIONS, DEPLOYMENTS])
    token = settings.worker_token.get_secret_value() or secrets.token_urlsafe(24)
    pools = PoolManager(load_fleet_config(settings.fleet_path), settings.fleet_path, work_dir=settings.home,
                        metrics=metrics, token=token, threads_per_replica=settings.worker_threads_per_replica,
                        startup_timeout_s=settings.worker_startup_timeout_s,
                        route_over_uds=settings.worker_transport == "uds")
    register_worker_metrics(pools, metrics)  # workers' /metrics re-exported on the router's (control/worker_metrics.py)
    router = Router(connect=partial(connect, token=token), metrics=metrics)
    redis = redis_client(platform)
    async with EventPublisher(platform, source=EVENT_SOURCE, metrics=metrics) as publisher:
        outbox = Outbox(settings.home / "outbox", publisher, metrics)
        predictions = PredictionLog(publisher, metrics)

        async def emit(message: Message, subject: str) -> None:
            await outbox.publish(DEPLOYMENTS, CloudEvent.from_proto(message, source=EVENT_SOURCE, subject=subject))

        bundle_token = settings.bundle_store_token.get_secret_value() or None
        manager = DeploymentManager(
            pools=pools, router=router, observer=Observer(metrics.registry),
            fetcher=BundleFetcher(settings.bundle_store_target, settings.home, token=bundle_token),
            store=DeploymentStore(redis, prefix=platform.redis_prefix), emit=emit,
            replan_interval_s=settings.replan_interval_s)
        consumer = EventConsumer(platform, group_id=GROUP, topics=[BUNDLES], handler=AutoDeployer(manager),
                                 metrics=metrics, publisher=publisher,
                                 dedup=RedisDeduplicator(redis, prefix=platform.redis_prefix, group=GROUP))
        inference = frontend.InferenceFrontend(router, predictions=predictions)
        deployments = DeploymentServicer(manager, allow_model_dir=platform.env == "dev")
        server = GrpcServer(settings=settings, platform=platform, metrics=metrics,
                            registrations=[inference.registration(), deployments.registration()],
                            method_roles={**frontend.METHOD_ROLES, **METHOD_ROLES})
        consuming: asyncio.Task | None = None
        # Every part is stopped even when one fails to (an AsyncExitStack unwinds them all), above all
        # the worker pools: their processes run in sessions of their own and would outlive us.
        async with contextlib.AsyncExitStack() as running:
            running.push_async_callback(redis.aclose)
            await outbox.start()
            running.push_async_callback(outbox.stop)
            await pools.start()
            running.push_async_callback(pools.stop)
            running.push_async_callback(router.close)
            await predictions.start()
            running.push_async_callback(predictions.stop)
            await manager.start()
            running.push_async_callback(manager.stop)
            if settings.autodeploy:
                consuming = asyncio.create_task(consumer.run(), name="autodeploy")
                consuming.add_done_callback(_report_end)
                running.push_async_callback(_stop_consumer, consumer, consuming)
            async with server:
                await wait_for_signal()
                inference.accepting = False


async def _stop_consumer(consumer: EventConsumer, consuming: asyncio.Task) -> None:
    await consumer.stop()
    await asyncio.gather(consuming, return_exceptions=True)  # its end (even cancelled) is reported by _report_end


def _report_end(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the autodeploy consumer stopped: %s", task.exception())


def main() -> None:
    platform = PlatformSettings()
    settings = RouterSettings()
    configure_logging(SERVICE, level=platform.log_level, fmt=platform.log_format)
    asyncio.run(serve(settings, platform))


if __name__ == "__main__":
    main()
