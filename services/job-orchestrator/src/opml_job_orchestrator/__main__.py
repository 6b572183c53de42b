"""Run the job-orchestrator service: ``python -m opml_job_orchestrator`` (configured by OPML_* variables)."""

from __future__ import annotations

from typing import Any

from opml.jobs.v1 import jobs_pb2, jobs_pb2_grpc

from opml_common.config import PlatformSettings
from opml_common.grpc.server import ServiceRegistration
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service
from opml_job_orchestrator.executor import Executor, LocalExecutor, RetryPolicy
from opml_job_orchestrator.metrics import JobMetrics, TimedScheduler
from opml_job_orchestrator.orchestrator import Orchestrator
from opml_job_orchestrator.recorder import JobRecorder
from opml_job_orchestrator.scheduler import POLICY_PRESETS, Cluster, NodeSpec, Resources
from opml_job_orchestrator.servicer import METHOD_ROLES, JobServicer
from opml_job_orchestrator.settings import JobOrchestratorSettings, platform_env
from opml_job_orchestrator.state import JobStore
from opml_job_orchestrator.watch import WatchHub
from opml_job_orchestrator_contract.topics import JOBS

SPEC = ServiceSpec(name="job-orchestrator", module="opml_job_orchestrator", settings=JobOrchestratorSettings,
                   topics=(JOBS,))


def build_executor(settings: JobOrchestratorSettings, platform: PlatformSettings, *,
                   kubernetes_api: Any = None) -> Executor:
    """The executor ``settings.executor`` names. The Kubernetes one (and the ``kubernetes`` client)
    is imported only when selected; it connects at start, from ``k8s_kubeconfig`` or the in-cluster
    service account, unless ``kubernetes_api`` (a ``CoreV1Api``, or a test's fake) is given. Logs
    and run manifests go under ``{home}/work`` either way, unsandboxed local tasks' trace spool under
    ``{home}/trace-spool``. Tasks get what :func:`platform_env` gives
    jobs, never the service's own environment or credentials: local tasks the job credentials
    from the settings as variables, pods from the ``k8s_env_secret`` Secret. Local tasks run
    sandboxed as ``sandbox`` says, and a job's checkpoint folder is never made in ``home``."""
    work_dir = settings.home / "work"
    if settings.executor == "local":
        return LocalExecutor(work_dir=work_dir, shutdown_grace_s=settings.shutdown_grace_s,
                             platform_env=platform_env(platform, settings),
                             trace_spool_dir=settings.home / "trace-spool", sandbox=settings.sandbox,
                             sandbox_uid_base=settings.sandbox_uid_base, sandbox_uid_count=settings.sandbox_uid_count,
                             protected_dirs=[settings.home])
    from opml_job_orchestrator.executor.kubernetes import KubernetesExecutor

    assert settings.k8s_image is not None  # the settings' validator requires it
    return KubernetesExecutor(
        image=settings.k8s_image, log_dir=work_dir, namespace=settings.k8s_namespace, api=kubernetes_api,
        kubeconfig=settings.k8s_kubeconfig, context=settings.k8s_context, node_label=settings.k8s_node_label,
        checkpoint_claim=settings.k8s_checkpoint_claim, service_account=settings.k8s_service_account,
        env_from_secret=settings.k8s_env_secret, platform_env=platform_env(platform, settings, credentials=False),
        run_as_user=settings.k8s_run_as_user, poll_interval_s=settings.k8s_poll_interval_s,
        shutdown_grace_s=settings.shutdown_grace_s)


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """Jobs restored from Redis, then scheduled and run; every transition goes to the
    :class:`JobRecorder` (Redis, the JOBS event, watchers, metrics). At shutdown (reverse order) the
    server drains, runs still going are stopped and queued to resume (PREEMPTED), and unpublished
    events stay in the outbox."""
    settings: JobOrchestratorSettings = service.settings
    store = JobStore(service.redis(), prefix=service.platform.redis_prefix)
    watch = WatchHub(limit=settings.watch_backlog)
    recorder = JobRecorder(store=store, emitter=await service.emitter(), watch=watch,
                           metrics=JobMetrics(service.metrics))
    saved = await recorder.load()
    cluster = Cluster([NodeSpec(n.name, Resources(n.cpu_millis, n.memory_mib, n.gpu))
                       for n in settings.cluster_nodes()])
    executor = build_executor(settings, service.platform)
    orchestrator = Orchestrator(
        scheduler=TimedScheduler(cluster, POLICY_PRESETS[settings.policy](), service.metrics), executor=executor,
        retry_policy=RetryPolicy(max_retries=settings.max_retries, base_delay_s=settings.retry_base_delay_s,
                                 max_delay_s=settings.retry_max_delay_s),
        listeners=[recorder], terminate_grace_s=settings.terminate_grace_s)
    await service.start(store)
    await orchestrator.restore(saved)
    await service.start(orchestrator)
    service.run_in_background(orchestrator.loop_ended, name="job-orchestrator-loop")  # a dead loop ends the service
    servicer = JobServicer(orchestrator, executor, watch, durable=store.flushed, log_poll_s=settings.log_poll_s)
    return [ServiceRegistration(jobs_pb2.DESCRIPTOR.services_by_name["JobService"],
                                jobs_pb2_grpc.add_JobServiceServicer_to_server, servicer, METHOD_ROLES)]


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
