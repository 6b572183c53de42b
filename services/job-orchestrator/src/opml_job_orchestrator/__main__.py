"""Run the job-orchestrator service: ``python -m opml_job_orchestrator`` (configured by OPML_* variables)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

from opml.jobs.v1 import jobs_pb2, jobs_pb2_grpc, pipelines_pb2, pipelines_pb2_grpc

from opml_bundle_store_contract.names import EVENT_SOURCE as BUNDLE_STORE_SOURCE
from opml_common.bus import EventConsumer, RedisDeduplicator
from opml_common.config import PlatformSettings
from opml_common.grpc.server import ServiceRegistration
from opml_common.lease import LeaderLease
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service
from opml_job_orchestrator.access import JobAccess, LeaderRequests, PipelineAccess
from opml_job_orchestrator.executor import Executor, LocalExecutor, RetryPolicy
from opml_job_orchestrator.forwarding import Forwarder, RequestConsumer
from opml_job_orchestrator.leadership import LEASE, Leadership, Tenure
from opml_job_orchestrator.metrics import JobMetrics, TimedScheduler
from opml_job_orchestrator.orchestrator import Orchestrator
from opml_job_orchestrator.pipelines import folders
from opml_job_orchestrator.pipelines.bundles import BundleStoreIO
from opml_job_orchestrator.pipelines.engine import PipelineEngine
from opml_job_orchestrator.pipelines.metrics import PipelineMetrics
from opml_job_orchestrator.pipelines.runner import Runner
from opml_job_orchestrator.pipelines.servicer import METHOD_ROLES as PIPELINE_METHOD_ROLES
from opml_job_orchestrator.pipelines.servicer import PipelineServicer
from opml_job_orchestrator.pipelines.steps import StepJobs
from opml_job_orchestrator.pipelines.store import RunStore
from opml_job_orchestrator.pipelines.triggers import (
    ALERTS_GROUP,
    SPANS_GROUP,
    AlertTrigger,
    ScheduleTrigger,
    ScorerAlerts,
    SpanTrigger,
)
from opml_job_orchestrator.recorder import JobRecorder
from opml_job_orchestrator.scheduler import POLICY_PRESETS, Cluster, NodeSpec, Resources
from opml_job_orchestrator.servicer import METHOD_ROLES, JobServicer
from opml_job_orchestrator.settings import JobOrchestratorSettings, platform_env
from opml_job_orchestrator.state import JobStore
from opml_job_orchestrator.topics import ALERTS, BUNDLES
from opml_job_orchestrator.watch import WatchHub
from opml_job_orchestrator_contract.topics import JOBS, PIPELINES
from opml_monitoring_scorer_contract.names import EVENT_SOURCE as MONITORING_SOURCE

_CONSUMER_STOP_S = 10.0

SPEC = ServiceSpec(name="job-orchestrator", module="opml_job_orchestrator", settings=JobOrchestratorSettings,
                   topics=(JOBS, PIPELINES, BUNDLES, ALERTS))


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
        shutdown_grace_s=settings.shutdown_grace_s,
        pipeline_claim=(settings.k8s_pipeline_claim, str(settings.pipeline_dir)) if settings.k8s_pipeline_claim
        else None)


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """Replicas share Redis; the one holding the ``job-orchestrator`` lease schedules (see
    :mod:`~opml_job_orchestrator.leadership`): at each take-over its jobs are restored from Redis, then
    scheduled and run; every transition goes to the :class:`JobRecorder` (Redis, fenced; the JOBS
    event, watchers, metrics). Every replica serves the API (:mod:`~opml_job_orchestrator.access`).
    At shutdown (reverse order) the server drains, the leader's runs still going are stopped and
    queued to resume (PREEMPTED), the lease is released, and unpublished events stay in the outbox."""
    settings: JobOrchestratorSettings = service.settings
    redis, prefix = service.redis(), service.platform.redis_prefix
    lease = LeaderLease(redis, LEASE, f"{socket.gethostname()}:{os.getpid()}", prefix=prefix,
                        ttl_s=settings.lease_ttl_s, on_change=lambda leading: leadership.changed(leading))
    store = JobStore(redis, prefix=prefix, fence=lambda: lease.fence)
    watch = WatchHub(limit=settings.watch_backlog)
    job_metrics = JobMetrics(service.metrics)
    recorder = JobRecorder(store=store, emitter=await service.emitter(), watch=watch, metrics=job_metrics)
    step_jobs = StepJobs(durable=store.flushed)
    run_store = RunStore(redis, prefix=prefix)
    forwarder = Forwarder(redis, prefix=prefix, timeout_s=settings.forward_timeout_s)
    pipelines = Pipelines(service, step_jobs, run_store)

    async def take_over(guard) -> Tenure:
        """A new leader's parts, as a restarted service builds them: the jobs back from Redis first."""
        cluster = Cluster([NodeSpec(n.name, Resources(n.cpu_millis, n.memory_mib, n.gpu))
                           for n in settings.cluster_nodes()])
        orchestrator = Orchestrator(
            scheduler=TimedScheduler(cluster, POLICY_PRESETS[settings.policy](), service.metrics),
            executor=build_executor(settings, service.platform),
            retry_policy=RetryPolicy(max_retries=settings.max_retries, base_delay_s=settings.retry_base_delay_s,
                                     max_delay_s=settings.retry_max_delay_s),
            listeners=[recorder, step_jobs.on_lifecycle], terminate_grace_s=settings.terminate_grace_s, guard=guard)
        step_jobs.bind(orchestrator)
        await orchestrator.restore(await recorder.load())
        await orchestrator.start()
        engine, parts = await pipelines.take_over()
        tenure = Tenure(orchestrator, engine, store.flushed, parts, ended=job_metrics.forget)
        consumer = RequestConsumer(redis, prefix=prefix, handler=LeaderRequests(leadership=leadership,
                                                                                 jobs=jobs).handle)
        await consumer.start()
        tenure.parts = [*parts, consumer]
        return tenure

    leadership = Leadership(lease=lease, redis=redis, take_over=take_over, metrics=service.metrics)
    jobs = JobAccess(leadership=leadership, store=store, forwarder=forwarder, durable=store.flushed)
    # Stopped in reverse: the tenure (orchestrator, engine) before the lease is released, so no
    # successor overlaps it, and before the store's last writes.
    await service.start(store)
    await service.start(lease)
    await service.start(leadership)
    service.run_in_background(leadership.ended, name="job-orchestrator-leadership")  # a dead loop ends the service
    # The API's own executor reads logs only and tracks no run: the kept files, or a live pod's log from the API
    # server, which the Kubernetes executor connects to at start (the local one reads files unstarted).
    logs = build_executor(settings, service.platform)
    if logs.adoptable:
        await service.start(logs)
    servicer = JobServicer(jobs, logs, watch,
                           leading=lambda: leadership.tenure is not None, log_poll_s=settings.log_poll_s)
    pipeline_access = PipelineAccess(leadership=leadership, store=run_store, forwarder=forwarder)
    return [ServiceRegistration(jobs_pb2.DESCRIPTOR.services_by_name["JobService"],
                                jobs_pb2_grpc.add_JobServiceServicer_to_server, servicer, METHOD_ROLES),
            ServiceRegistration(pipelines_pb2.DESCRIPTOR.services_by_name["Pipelines"],
                                pipelines_pb2_grpc.add_PipelinesServicer_to_server, PipelineServicer(pipeline_access),
                                PIPELINE_METHOD_ROLES)]


class Pipelines:
    """The pipelines' parts, built again by each leader: the engine (its runs resume and re-attach to
    their steps' jobs, after the orchestrator has restored them), its schedules, and its consumers of
    committed spans and alerts."""

    def __init__(self, service: ServiceContext, step_jobs: StepJobs, run_store: RunStore) -> None:
        settings: JobOrchestratorSettings = service.settings
        self._service, self._step_jobs, self._store = service, step_jobs, run_store
        self._bundles = BundleStoreIO(settings.bundle_store_target,
                                      token=settings.bundle_store_token.get_secret_value() or None)
        service.on_stop(self._bundles.aclose)
        folders.open_pipeline_dir(settings.pipeline_dir)
        self._metrics = PipelineMetrics(service.metrics)
        self._alerts: ScorerAlerts | None = None
        if settings.pipeline_triggers:
            self._alerts = ScorerAlerts(settings.monitoring_scorer_target,
                                        token=settings.monitoring_scorer_token.get_secret_value() or None)
            service.on_stop(self._alerts.aclose)

    async def take_over(self) -> tuple[PipelineEngine, list[Any]]:
        """The started engine, and its schedule trigger and consumers (started), for one tenure."""
        service, settings = self._service, self._service.settings
        emitter = await service.emitter()
        runner = Runner(store=self._store, bundles=self._bundles, jobs=self._step_jobs, emitter=emitter,
                        metrics=self._metrics, work_dir=settings.pipeline_dir,
                        staging_dir=settings.home / "pipeline-staging",
                        step_resources=Resources(settings.pipeline_step_cpu_millis,
                                                 settings.pipeline_step_memory_mib, 0),
                        max_parallel_steps=settings.pipeline_max_parallel_steps)
        schedules: list[ScheduleTrigger] = []  # made after the engine it watches, told of every change
        engine = PipelineEngine(store=self._store, runner=runner, emitter=emitter, metrics=self._metrics,
                                changed=lambda: [s.changed() for s in schedules])
        schedules.append(ScheduleTrigger(engine))
        await engine.start()
        parts: list[Any] = [schedules[0]]
        await schedules[0].start()
        if self._alerts is not None:
            publisher = await service.publisher()
            for group, topic, source, handler in (
                    (SPANS_GROUP, BUNDLES, BUNDLE_STORE_SOURCE,
                     SpanTrigger(engine, self._bundles, self._metrics).handle),
                    (ALERTS_GROUP, ALERTS, MONITORING_SOURCE, AlertTrigger(engine, self._alerts, self._metrics).handle)):
                consumer = EventConsumer(service.platform, group_id=group, topics=[topic],
                                         sources=frozenset({source}), handler=handler, metrics=service.metrics,
                                         publisher=publisher,
                                         dedup=RedisDeduplicator(service.redis(), prefix=service.platform.redis_prefix,
                                                                 group=group))  # a redelivered event asks for no run
                parts.append(ConsumerPart(consumer))
                await parts[-1].start()
        return engine, parts


class ConsumerPart(Component):
    """An :class:`EventConsumer` run for one tenure: started in a task, stopped at its end."""

    def __init__(self, consumer: EventConsumer) -> None:
        super().__init__()
        self._consumer = consumer
        self._task: asyncio.Task[None] | None = None

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._consumer.run(), name="pipeline triggers")

    async def on_stop(self) -> None:
        """Leave the group; a consumer that cannot finish in time (the broker away) is cancelled."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._consumer.stop(), _CONSUMER_STOP_S)
        await cancel_and_wait(self._task)
        self._task = None


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
