"""Run the bundle-store service: ``python -m opml_bundle_store`` (configured by OPML_* variables)."""

from __future__ import annotations

import asyncio

from opml.bundles.v1 import bundles_pb2, bundles_pb2_grpc

from opml_bundle_store.core.grants import GrantKeys
from opml_bundle_store.core.manifest import REJECT_REASONS
from opml_bundle_store.core.store import BundleStore, lock_home
from opml_bundle_store.servicer import METHOD_ROLES, BundleStoreServicer
from opml_bundle_store.settings import BundleStoreSettings
from opml_bundle_store_contract.names import SERVICE
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.grpc.server import ServiceRegistration
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, run_service

SPEC = ServiceSpec(name=SERVICE, module="opml_bundle_store", settings=BundleStoreSettings, topics=(BUNDLES,))


async def build(service: ServiceContext) -> list[ServiceRegistration]:
    """The store over the local home and S3, announcing its changes through the outbox (events
    unpublished at exit stay there for the next start); closed after the server, before the outbox.
    The home's lock is taken first and released last: a second instance on the same home stops
    before it opens the outbox there, whose pending events the first one publishes. Without the
    manifest keys or upload-grant keys it needs (prod) or can read, it refuses to start, naming the
    setting; in dev it keeps a grant key of its own in its home. The servicer verifies the upload
    grants presented to the server (its token verifier). The shared contexts are made or bound to their
    remotes, and commits a stop left unpushed are pushed, before it serves."""
    settings: BundleStoreSettings = service.settings
    try:
        manifest_keys = settings.manifest_signing_keys(service.platform.env)
        grant_keys = settings.upload_grant_keys(service.platform.env)
    except ValueError as exc:
        raise SystemExit(f"{SERVICE}: refusing to start: {exc}") from None
    home_lock = lock_home(settings.home)
    service.on_stop(lambda: asyncio.to_thread(home_lock.close))
    grant_keys = grant_keys or GrantKeys.kept_in(settings.home)
    rejected = service.metrics.counter(
        "remote_manifests_rejected_total", "Remote manifests a pull refused and skipped, by reason.", ("reason",))
    for reason in REJECT_REASONS:
        rejected.labels(reason)
    store = BundleStore(settings.home, service.s3(max_connections=settings.transfer_workers * 2),
                        transfer_workers=settings.transfer_workers, events=await service.emitter(),
                        manifest_keys=manifest_keys, on_rejected_manifest=lambda manifest: rejected.labels(manifest.reason).inc(),
                        home_lock=home_lock, staging_ttl_s=settings.staging_ttl_s)
    service.on_stop(lambda: asyncio.to_thread(store.close))
    for context_id, remote_url in settings.shared_contexts.items():
        await asyncio.to_thread(store.share_context, context_id, remote_url)
    servicer = BundleStoreServicer(store, service.metrics, grant_keys=grant_keys,
                                   max_grant_bytes=settings.max_grant_bytes)
    return [ServiceRegistration(bundles_pb2.DESCRIPTOR.services_by_name["BundleStore"],
                                bundles_pb2_grpc.add_BundleStoreServicer_to_server, servicer, METHOD_ROLES,
                                token_verifier=servicer.verify_token)]


def main() -> None:
    run_service(SPEC, build)


if __name__ == "__main__":
    main()
