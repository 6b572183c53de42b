"""Run the bundle-store service: ``python -m opml_bundle_store`` (configured by OPML_* variables)."""

from __future__ import annotations

import asyncio

from opml.bundles.v1 import bundles_pb2, bundles_pb2_grpc

from opml_bundle_store.core.store import BundleStore
from opml_bundle_store.servicer import EVENT_SOURCE, METHOD_ROLES, BundleStoreServicer
from opml_bundle_store.settings import BundleStoreSettings
from opml_common.bus import EventPublisher, ensure_topics
from opml_common.config import PlatformSettings
from opml_common.grpc.server import GrpcServer, ServiceRegistration, wait_for_signal
from opml_common.logging import configure_logging
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.process import ServiceSpec
from opml_common.storage import s3_client
from opml_common.topics import BUNDLES

SERVICE = "bundle-store"
SPEC = ServiceSpec(name=SERVICE, module="opml_bundle_store", settings=BundleStoreSettings)


async def serve(settings: BundleStoreSettings, platform: PlatformSettings) -> None:
    """Serve until SIGINT/SIGTERM; events still unpublished stay in the outbox for the next start."""
    metrics = ServiceMetrics(SERVICE)
    await ensure_topics(platform, [BUNDLES])
    store = BundleStore(settings.home, s3_client(platform, max_connections=settings.transfer_workers * 2),
                        transfer_workers=settings.transfer_workers)
    async with EventPublisher(platform, source=EVENT_SOURCE, metrics=metrics) as publisher:
        outbox = Outbox(settings.home / "outbox", publisher, metrics)
        await outbox.start()
        try:
            servicer = BundleStoreServicer(store, outbox, metrics)
            registration = ServiceRegistration(
                bundles_pb2.DESCRIPTOR.services_by_name["BundleStore"].full_name,
                bundles_pb2_grpc.add_BundleStoreServicer_to_server, servicer)
            async with GrpcServer(settings=settings, platform=platform, metrics=metrics,
                                  registrations=[registration], method_roles=METHOD_ROLES):
                await wait_for_signal()
        finally:
            await outbox.stop()


def main() -> None:
    platform = PlatformSettings()
    settings = BundleStoreSettings()
    configure_logging(SERVICE, level=platform.log_level, fmt=platform.log_format)
    asyncio.run(serve(settings, platform))


if __name__ == "__main__":
    main()
