"""Run the monitoring-scorer service: ``python -m opml_monitoring_scorer`` (configured by OPML_* variables)."""

from __future__ import annotations

from opml.monitoring.v1 import monitoring_pb2, monitoring_pb2_grpc

from opml_common.bus import EventConsumer, RedisDeduplicator
from opml_common.grpc.server import ServiceRegistration
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service
from opml_monitoring_scorer.bundles import BundleReader
from opml_monitoring_scorer.core.refits import Refits
from opml_monitoring_scorer.core.scorer import Scorer
from opml_monitoring_scorer.deployments import GROUP, SOURCES, DeploymentWatcher
from opml_monitoring_scorer.metrics import ScorerMetrics
from opml_monitoring_scorer.servicer import METHOD_ROLES, MonitoringServicer
from opml_monitoring_scorer.settings import MonitoringScorerSettings
from opml_monitoring_scorer.state import MonitorStore
from opml_monitoring_scorer.stream import ScoringStream
from opml_monitoring_scorer.topics import DEPLOYMENTS, LABELS, PREDICTIONS
from opml_monitoring_scorer_contract.names import SERVICE
from opml_monitoring_scorer_contract.topics import ALERTS, QUALITY

SPEC = ServiceSpec(name=SERVICE, module="opml_monitoring_scorer", settings=MonitoringScorerSettings,
                   topics=(ALERTS, QUALITY, LABELS, PREDICTIONS, DEPLOYMENTS))


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """Registrations restored (monitors retrained from their bundles), then the faust stream of
    predictions and labels, and the deployments consumer that registers what the router deploys."""
    settings: MonitoringScorerSettings = service.settings
    platform = service.platform
    metrics = ScorerMetrics(service.metrics)
    store = await service.start(MonitorStore(service.redis(), prefix=platform.redis_prefix,
                                             retention_s=settings.label_retention_s))
    reader = BundleReader(settings.bundle_store_target, token=settings.bundle_store_token.get_secret_value() or None)
    scorer = await service.start(Scorer(store=store, emitter=await service.emitter(), metrics=metrics,
                                        load_bundle=reader, seed=settings.seed,
                                        label_sources=frozenset(settings.label_sources),
                                        refits=Refits(quiet_s=settings.mpp_refit_quiet_s)))
    await service.start(ScoringStream(platform, scorer, metrics, publisher=await service.publisher(),
                                      datadir=settings.home / "faust",
                                      prediction_sources=frozenset(settings.prediction_sources)))
    if settings.autoregister:
        consumer = EventConsumer(platform, group_id=GROUP, topics=[DEPLOYMENTS], sources=SOURCES,
                                 handler=DeploymentWatcher(scorer), metrics=service.metrics,
                                 publisher=await service.publisher(),
                                 dedup=RedisDeduplicator(service.redis(), prefix=platform.redis_prefix, group=GROUP))
        service.run_in_background(consumer.run, name="deployments-consumer", stop=consumer.stop)
    return [ServiceRegistration(monitoring_pb2.DESCRIPTOR.services_by_name["MonitoringService"],
                                monitoring_pb2_grpc.add_MonitoringServiceServicer_to_server,
                                MonitoringServicer(scorer), METHOD_ROLES)]


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
