"""Run the automl-controller service: ``python -m opml_automl_controller`` (configured by OPML_* variables)."""

from __future__ import annotations

import sys

from opml.automl.v1 import automl_pb2, automl_pb2_grpc

from opml_automl_controller.controller import Controller
from opml_automl_controller.jobs import OrchestratorJobs
from opml_automl_controller.metrics import PrometheusControllerMetrics
from opml_automl_controller.models import BundleStoreModels
from opml_automl_controller.servicer import METHOD_ROLES, ExperimentServicer
from opml_automl_controller.settings import AutomlControllerSettings
from opml_automl_controller.state import ExperimentStore
from opml_automl_controller.topics import EXPERIMENTS
from opml_common.grpc.server import ServiceRegistration
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service

SPEC = ServiceSpec(name="automl-controller", module="opml_automl_controller", settings=AutomlControllerSettings,
                   topics=(EXPERIMENTS,))


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """Experiments restored from Redis and run again (their trials' jobs re-attached); each change
    saved, then announced on opml.experiments.v1. At shutdown the server drains, then the
    experiments' tasks stop; the trials' jobs go on in the orchestrator and are re-attached at the
    next start."""
    settings: AutomlControllerSettings = service.settings
    token = settings.job_orchestrator_token.get_secret_value() if settings.job_orchestrator_token else None
    jobs = OrchestratorJobs(settings.job_orchestrator_target, token=token)
    service.on_stop(jobs.aclose)
    models = None
    if settings.bundle_store_target is not None:
        bundle_token = settings.bundle_store_token.get_secret_value() if settings.bundle_store_token else None
        models = BundleStoreModels(settings.bundle_store_target, token=bundle_token, context=settings.model_context)
        service.on_stop(models.aclose)
    store = await service.start(ExperimentStore(service.redis(), prefix=service.platform.redis_prefix))
    controller = await service.start(Controller(
        store=store, jobs=jobs, emitter=await service.emitter(), redis_url=service.platform.redis_url,
        metrics=PrometheusControllerMetrics(service.metrics), trial_python=settings.trial_python or sys.executable,
        retry_s=settings.retry_s, models=models))
    return [ServiceRegistration(automl_pb2.DESCRIPTOR.services_by_name["ExperimentService"],
                                automl_pb2_grpc.add_ExperimentServiceServicer_to_server,
                                ExperimentServicer(controller), METHOD_ROLES)]


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
