"""Run the fl-coordinator service: ``python -m opml_fl_coordinator`` (configured by OPML_* variables)."""

from __future__ import annotations

from opml.fl.v1 import fl_pb2, fl_pb2_grpc

from opml_common.grpc.server import ServiceRegistration
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service
from opml_fl_coordinator.bundles import BundlePublisher
from opml_fl_coordinator.coordinator import Coordinator
from opml_fl_coordinator.metrics import FlMetrics
from opml_fl_coordinator.servicer import CLIENT_ROLES, FEDERATION_ROLES, FederatedClientServicer, FederationServicer
from opml_fl_coordinator.settings import FlCoordinatorSettings
from opml_fl_coordinator.store import FederationStore
from opml_fl_coordinator_contract.names import SERVICE
from opml_fl_coordinator_contract.topics import FEDERATIONS

SPEC = ServiceSpec(name=SERVICE, module="opml_fl_coordinator", settings=FlCoordinatorSettings,
                   topics=(FEDERATIONS,))


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """Federations restored from Redis and S3 (each from its last completed round), then served.
    At shutdown the server drains, then the deadline timer stops; nothing else needs saving (every
    completed round already is)."""
    settings: FlCoordinatorSettings = service.settings
    metrics = FlMetrics(service.metrics)
    store = await service.start(FederationStore(service.redis(), service.s3(), bucket=settings.bucket,
                                                prefix=service.platform.redis_prefix))
    publisher = None
    if settings.bundle_store_target:
        publisher = BundlePublisher(settings.bundle_store_target, token=settings.bundle_store_token.get_secret_value(),
                                    context=settings.bundle_context, serve=settings.serve_models)
    coordinator = await service.start(Coordinator(
        store, await service.emitter(), metrics, publisher=publisher, publish_every_round=settings.publish_every_round,
        max_federations=settings.max_federations, max_clients=settings.max_clients_per_federation))
    return [
        ServiceRegistration(fl_pb2.DESCRIPTOR.services_by_name["FederationService"],
                            fl_pb2_grpc.add_FederationServiceServicer_to_server,
                            FederationServicer(coordinator, chunk_bytes=settings.chunk_bytes,
                                               max_model_bytes=settings.max_model_bytes, metrics=metrics),
                            FEDERATION_ROLES),
        ServiceRegistration(fl_pb2.DESCRIPTOR.services_by_name["FederatedClientService"],
                            fl_pb2_grpc.add_FederatedClientServiceServicer_to_server,
                            FederatedClientServicer(coordinator, chunk_bytes=settings.chunk_bytes,
                                                    max_model_bytes=settings.max_model_bytes, metrics=metrics),
                            CLIENT_ROLES),
    ]


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
