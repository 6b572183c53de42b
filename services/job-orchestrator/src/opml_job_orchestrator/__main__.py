"""Run the job-orchestrator service: ``python -m opml_job_orchestrator`` (configured by OPML_* variables)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from opml.jobs.v1 import jobs_pb2, jobs_pb2_grpc

from opml_common.bus import EventPublisher, ensure_topics
from opml_common.config import PlatformSettings
from opml_common.grpc.server import GrpcServer, ServiceRegistration, wait_for_signal
from opml_common.logging import configure_logging
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.process import ServiceSpec
from opml_common.storage import redis_client
from opml_common.topics import JOBS
from opml_job_orchestrator.convert import change_to_proto, event_to_proto, job_to_proto, saved_job_from_proto
from opml_job_orchestrator.events import EVENT_SOURCE, LifecyclePublisher
from opml_job_orchestrator.executor import Executor, LocalExecutor, RetryPolicy
from opml_job_orchestrator.metrics import JobMetrics, TimedScheduler
from opml_job_orchestrator.orchestrator import LifecycleEvent, Orchestrator
from opml_job_orchestrator.scheduler import POLICY_PRESETS, Cluster, NodeSpec, Resources
from opml_job_orchestrator.servicer import METHOD_ROLES, JobServicer
from opml_job_orchestrator.settings import JobOrchestratorSettings, platform_env
from opml_job_orchestrator.state import JobStore
from opml_job_orchestrator.watch import WatchHub

logger = logging.getLogger(__name__)

SERVICE = "job-orchestrator"
SPEC = ServiceSpec(name=SERVICE, module="opml_job_orchestrator", settings=JobOrchestratorSettings)


def build_executor(settings: JobOrchestratorSettings, platform: PlatformSettings, *,
                   kubernetes_api: Any = None) -> Executor:
    """The executor ``settings.executor`` names. The Kubernetes one (and the ``kubernetes`` client)
    is imported only when selected; it connects at start, from ``k8s_kubeconfig`` or the in-cluster
    service account, unless ``kubernetes_api`` (a ``CoreV1Api``, or a test's fake) is given. Logs
    and run manifests go under ``{home}/work`` either way."""
    work_dir = settings.home / "work"
    if settings.executor == "local":
        return LocalExecutor(work_dir=work_dir, shutdown_grace_s=settings.shutdown_grace_s,
                             platform_env=platform_env(platform, secrets=True))
    from opml_job_orchestrator.executor.kubernetes import KubernetesExecutor

    assert settings.k8s_image is not None  # the settings' validator requires it
    return KubernetesExecutor(
        image=settings.k8s_image, log_dir=work_dir, namespace=settings.k8s_namespace, api=kubernetes_api,
        kubeconfig=settings.k8s_kubeconfig, context=settings.k8s_context, node_label=settings.k8s_node_label,
        checkpoint_claim=settings.k8s_checkpoint_claim, service_account=settings.k8s_service_account,
        env_from_secret=settings.k8s_env_secret, platform_env=platform_env(platform, secrets=False),
        poll_interval_s=settings.k8s_poll_interval_s, shutdown_grace_s=settings.shutdown_grace_s)


async def serve(settings: JobOrchestratorSettings, platform: PlatformSettings) -> None:
    """Serve until SIGINT/SIGTERM. Jobs are restored from Redis first; on the way out, runs still
    going are stopped and queued to resume (PREEMPTED), and unpublished events stay in the outbox."""
    metrics = ServiceMetrics(SERVICE)
    await ensure_topics(platform, [JOBS])
    redis = redis_client(platform)
    store = JobStore(redis, prefix=platform.redis_prefix)
    saved = [saved_job_from_proto(job) for job in await store.load()]
    cluster = Cluster([NodeSpec(n.name, Resources(n.cpu_millis, n.memory_mib, n.gpu))
                       for n in settings.cluster_nodes()])
    executor = build_executor(settings, platform)
    watch = WatchHub(limit=settings.watch_backlog)
    job_metrics = JobMetrics(metrics)
    for item in saved:
        job_metrics.seed(item.status, item.definition.spec.job_class)
    async with EventPublisher(platform, source=EVENT_SOURCE, metrics=metrics) as bus:
        outbox = Outbox(settings.home / "outbox", bus, metrics)
        events = LifecyclePublisher(outbox)

        def on_change(event: LifecycleEvent) -> None:
            """Every transition: saved to Redis, published on JOBS, shown to watchers, counted."""
            definition = orchestrator.definition(event.job_id)
            job = job_to_proto(definition, orchestrator.get(event.job_id))
            store.save(job)
            events.publish(event.job_id, event_to_proto(event, job))
            watch.notify(change_to_proto(event, job))
            job_metrics.observe(event, definition.spec.job_class)

        orchestrator = Orchestrator(
            scheduler=TimedScheduler(cluster, POLICY_PRESETS[settings.policy](), metrics), executor=executor,
            retry_policy=RetryPolicy(max_retries=settings.max_retries, base_delay_s=settings.retry_base_delay_s,
                                     max_delay_s=settings.retry_max_delay_s),
            listeners=[on_change], terminate_grace_s=settings.terminate_grace_s)
        await outbox.start()
        await store.start()
        try:
            await orchestrator.restore(saved)
            if saved:
                states = Counter(item.status.state.value for item in saved)
                logger.info("restored %d jobs from Redis (as saved: %s)", len(saved), dict(states))
            await orchestrator.start()
            servicer = JobServicer(orchestrator, executor, watch, durable=store.flushed,
                                   log_poll_s=settings.log_poll_s)
            registration = ServiceRegistration(jobs_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
                                               jobs_pb2_grpc.add_JobServiceServicer_to_server, servicer)
            async with GrpcServer(settings=settings, platform=platform, metrics=metrics,
                                  registrations=[registration], method_roles=METHOD_ROLES):
                await wait_for_signal()
        finally:
            await orchestrator.stop()
            await store.stop()
            await outbox.stop()
            await redis.aclose()


def main() -> None:
    platform = PlatformSettings()
    settings = JobOrchestratorSettings()
    configure_logging(SERVICE, level=platform.log_level, fmt=platform.log_format)
    asyncio.run(serve(settings, platform))


if __name__ == "__main__":
    main()
