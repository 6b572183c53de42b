"""Run the job-orchestrator service: ``python -m opml_job_orchestrator`` (configured by OPML_* variables)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from opml.jobs.v1 import jobs_pb2, jobs_pb2_grpc

from opml_common.config import PlatformSettings
from opml_common.grpc.server import ServiceRegistration
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service
from opml_job_orchestrator.topics import JOBS
from opml_job_orchestrator.convert import change_to_proto, event_to_proto, job_to_proto, saved_job_from_proto
from opml_job_orchestrator.executor import Executor, LocalExecutor, RetryPolicy
from opml_job_orchestrator.metrics import JobMetrics, TimedScheduler
from opml_job_orchestrator.orchestrator import LifecycleEvent, Orchestrator
from opml_job_orchestrator.scheduler import POLICY_PRESETS, Cluster, NodeSpec, Resources
from opml_job_orchestrator.servicer import METHOD_ROLES, JobServicer
from opml_job_orchestrator.settings import JobOrchestratorSettings, platform_env
from opml_job_orchestrator.state import JobStore
from opml_job_orchestrator.watch import WatchHub

logger = logging.getLogger(__name__)

SPEC = ServiceSpec(name="job-orchestrator", module="opml_job_orchestrator", settings=JobOrchestratorSettings,
                   topics=(JOBS,))


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


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """Jobs restored from Redis, then scheduled and run. At shutdown (reverse order) the server drains,
    runs still going are stopped and queued to resume (PREEMPTED), and unpublished events stay in the
    outbox."""
    settings: JobOrchestratorSettings = service.settings
    store = JobStore(service.redis(), prefix=service.platform.redis_prefix)
    saved = [saved_job_from_proto(job) for job in await store.load()]
    cluster = Cluster([NodeSpec(n.name, Resources(n.cpu_millis, n.memory_mib, n.gpu))
                       for n in settings.cluster_nodes()])
    executor = build_executor(settings, service.platform)
    watch = WatchHub(limit=settings.watch_backlog)
    job_metrics = JobMetrics(service.metrics)
    for item in saved:
        job_metrics.seed(item.status, item.definition.spec.job_class)
    events = await service.emitter()

    def on_change(event: LifecycleEvent) -> None:
        """Every transition: saved to Redis, published on JOBS, shown to watchers, counted."""
        definition = orchestrator.definition(event.job_id)
        job = job_to_proto(definition, orchestrator.get(event.job_id))
        store.save(job)
        try:
            events.emit(event_to_proto(event, job), subject=event.job_id)
        except OSError:  # the disk is full or gone: say so loudly, keep the orchestrator going
            logger.exception("could not record the %s event of job %s in the outbox", event.kind, event.job_id)
        watch.notify(change_to_proto(event, job))
        job_metrics.observe(event, definition.spec.job_class)

    orchestrator = Orchestrator(
        scheduler=TimedScheduler(cluster, POLICY_PRESETS[settings.policy](), service.metrics), executor=executor,
        retry_policy=RetryPolicy(max_retries=settings.max_retries, base_delay_s=settings.retry_base_delay_s,
                                 max_delay_s=settings.retry_max_delay_s),
        listeners=[on_change], terminate_grace_s=settings.terminate_grace_s)
    await service.start(store)
    await orchestrator.restore(saved)
    if saved:
        states = Counter(item.status.state.value for item in saved)
        logger.info("restored %d jobs from Redis (as saved: %s)", len(saved), dict(states))
    await service.start(orchestrator)
    servicer = JobServicer(orchestrator, executor, watch, durable=store.flushed, log_poll_s=settings.log_poll_s)
    return [ServiceRegistration(jobs_pb2.DESCRIPTOR.services_by_name["JobService"],
                                jobs_pb2_grpc.add_JobServiceServicer_to_server, servicer, METHOD_ROLES)]


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
