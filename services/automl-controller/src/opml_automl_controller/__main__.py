"""Run the automl-controller service: ``python -m opml_automl_controller`` (configured by OPML_* variables)."""

from __future__ import annotations

import os
import socket
import sys

from opml.automl.v1 import automl_pb2, automl_pb2_grpc

from opml_automl_controller.controller import Controller, spec_of
from opml_automl_controller.jobs import OrchestratorJobs
from opml_automl_controller.metrics import PrometheusControllerMetrics
from opml_automl_controller.models import BundleStoreModels
from opml_automl_controller.nudges import Nudges
from opml_automl_controller.servicer import METHOD_ROLES, ExperimentServicer
from opml_automl_controller.settings import AutomlControllerSettings
from opml_automl_controller.state import ExperimentStore
from opml_automl_controller.surrogate import RouterPredictor
from opml_automl_controller.topics import TRACES
from opml_automl_controller.tracing import GROUP, SOURCE_PREFIXES, TraceCollector
from opml_automl_controller.trialmodel import TrialFolders
from opml_automl_controller_contract.topics import EXPERIMENTS
from opml_common.bus import EventConsumer
from opml_common.grpc.server import ServiceRegistration
from opml_common.lease import LeaderLease
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service

LEASE = "automl-controller"
"""The lease whose holder runs the experiments' loops (every replica serves the API)."""

SPEC = ServiceSpec(name="automl-controller", module="opml_automl_controller", settings=AutomlControllerSettings,
                   topics=(EXPERIMENTS, TRACES))


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """Replicas share Redis; the one holding the ``automl-controller`` lease runs the experiments (the
    others serve the API and nudge it). Experiments restored from Redis and run again by each new
    leader (their trials' jobs re-attached); each change
    saved, then announced on opml.experiments.v1; Trace trials' epoch logs consumed from
    opml.traces.v1 (tracers' sources only). At shutdown the server drains, then the consumer and
    the experiments' tasks stop; the trials' jobs go on in the orchestrator and are re-attached at
    the next start. The trials' folder is made (or refused) first."""
    settings: AutomlControllerSettings = service.settings
    folders = TrialFolders.open(settings.trials_dir)
    token = settings.job_orchestrator_token.get_secret_value() if settings.job_orchestrator_token else None
    jobs = OrchestratorJobs(settings.job_orchestrator_target, token=token)
    service.on_stop(jobs.aclose)
    models = None
    if settings.bundle_store_target is not None:
        bundle_token = settings.bundle_store_token.get_secret_value() if settings.bundle_store_token else None
        models = BundleStoreModels(settings.bundle_store_target, token=bundle_token, context=settings.model_context,
                                   trial_target=settings.bundle_store_trial_target)
        service.on_stop(models.aclose)
    serving = None
    if settings.inference_router_target is not None:
        router_token = settings.inference_router_token.get_secret_value() if settings.inference_router_token else None
        serving = RouterPredictor(settings.inference_router_target, token=router_token)
        service.on_stop(serving.aclose)
    redis, prefix = service.redis(), service.platform.redis_prefix
    lease = LeaderLease(redis, LEASE, f"{socket.gethostname()}:{os.getpid()}", prefix=prefix,
                        ttl_s=settings.lease_ttl_s, on_change=lambda leading: controller.leadership_changed(leading))
    store = await service.start(ExperimentStore(redis, prefix=prefix, fence=lambda: lease.fence))
    nudges = Nudges(redis, prefix=prefix, on_nudge=lambda kind, value: controller.on_nudge(kind, value))
    controller = Controller(
        store=store, jobs=jobs, emitter=await service.emitter(), redis_url=service.platform.redis_url,
        metrics=PrometheusControllerMetrics(service.metrics), trial_python=settings.trial_python or sys.executable,
        retry_s=settings.retry_s, models=models, trace_wait_s=settings.trace_wait_s,
        serving=serving, folders=folders, upload_ttl_s=settings.upload_grant_ttl_s, lease=lease, nudges=nudges,
        resync_s=settings.resync_s)
    # Stopped in reverse: the loops stop before the lease is released, so no successor overlaps them.
    await service.start(lease)
    await service.start(controller)
    await service.start(nudges)
    if settings.trace_metrics:
        consumer = EventConsumer(service.platform, group_id=GROUP, topics=[TRACES], source_prefixes=SOURCE_PREFIXES,
                                 handler=TraceCollector(store, spec_of=spec_of, wake=controller.wake_trace).handle,
                                 metrics=service.metrics, publisher=await service.publisher())
        service.run_in_background(consumer.run, stop=consumer.stop, name="trace metrics")
    return [ServiceRegistration(automl_pb2.DESCRIPTOR.services_by_name["ExperimentService"],
                                automl_pb2_grpc.add_ExperimentServiceServicer_to_server,
                                ExperimentServicer(controller), METHOD_ROLES)]


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
