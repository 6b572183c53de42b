"""Issue 16, item 1: a forged BundleCommitted must not replace a live model.

The attack as it was run: anyone who can write to the broker publishes a ``BundleCommitted`` with
source ``evil/anyone`` and ``serve=true``, naming a committed bundle that the bundle-store has tagged
``serve=false``. The router's autodeploy accepts bundle events only from the bundle-store's source
(the forged event is dead-lettered, with a reason naming the source, and counted) and re-reads the
bundle from the bundle-store before acting, so a forged event that copies the right source deploys
nothing either. A genuine commit still deploys. Real processes, the real broker, S3 and Redis.

The forged events and the genuine commit carry the same subject (the bundle name), so they are on
one partition, handled in order: once the genuine bundle serves, every forged event before it was
handled, and what it did (nothing) can be checked without waiting on the clock.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

from opml.bundles.v1 import events_pb2 as bundle_events
from opml.inference.v1 import deployments_pb2 as pb

from opml_bundle_store.__main__ import SPEC as BUNDLE_STORE
from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.names import EVENT_SOURCE as BUNDLE_STORE_SOURCE
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.bus import CloudEvent, EventPublisher
from opml_common.errors import NotFound
from opml_devstack.testing.bus import fresh_metrics, poll_until, read_records
from opml_devstack.testing.services import TOKENS
from opml_inference_router.control.autodeploy import SOURCES
from opml_inference_router_contract.client import DeploymentClient


def test_the_router_accepts_bundle_events_only_from_the_bundle_stores_source() -> None:
    assert BUNDLE_STORE.event_source == BUNDLE_STORE_SOURCE
    assert frozenset({BUNDLE_STORE.event_source}) == SOURCES


def _serving(client: DeploymentClient, model: str) -> pb.Deployment | None:
    """The deployment of ``model`` once a version of it serves, else None."""
    try:
        deployment = client.get(model)
    except NotFound:
        return None
    return deployment if any(v.state == pb.SERVING for v in deployment.versions) else None


async def _forge(settings, source: str, bundle, *, tags: dict[str, str], uuid: str | None = None) -> None:
    """Publish, straight to the broker, a BundleCommitted for ``bundle`` with ``tags`` and ``source``."""
    forged = type(bundle)()
    forged.CopyFrom(bundle)
    forged.tags.clear()
    forged.tags.update(tags)
    if uuid is not None:
        forged.uuid = uuid
    metrics, _ = fresh_metrics("attacker")
    async with EventPublisher(settings, source=source, metrics=metrics) as publisher:
        event = CloudEvent.from_proto(bundle_events.BundleCommitted(bundle=forged), source=source,
                                      subject=bundle.bundle_name)
        await publisher.publish(BUNDLES, event, key=bundle.bundle_name)


def test_a_forged_bundle_committed_deploys_nothing_and_a_genuine_commit_still_deploys(
        serving_stack, platform_settings, tmp_path: Path) -> None:
    store_service, router, files = serving_stack.store, serving_stack.router, serving_stack.files
    with BundleStoreClient(store_service.target, token=TOKENS["writer"]) as store, \
            DeploymentClient(router.target, token=TOKENS["reader"]) as deployments:
        store.create_context("lab")
        # A committed, deployable bundle the store says is NOT for serving (a candidate under review).
        candidate = store.add("lab", "mlp", files, tags={"serve": "false"}, commit=True)
        uncommitted = store.add("lab", "mlp", files, tags={"serve": "true"})  # not committed yet

        # 1. The attack as written: source evil/anyone, serve=true, naming the serve=false bundle.
        asyncio.run(_forge(platform_settings, "evil/anyone", candidate, tags={"serve": "true"}))
        # 2. The same with the bundle-store's own source: the re-read refuses it (the store says serve=false)...
        asyncio.run(_forge(platform_settings, BUNDLE_STORE_SOURCE, candidate, tags={"serve": "true"}))
        # ... a bundle that is not committed ...
        asyncio.run(_forge(platform_settings, BUNDLE_STORE_SOURCE, uncommitted, tags={"serve": "true"}))
        # ... and a "uuid" that is the bundle's name (GetBundle resolves names to the latest version).
        asyncio.run(_forge(platform_settings, BUNDLE_STORE_SOURCE, candidate, tags={"serve": "true"}, uuid="mlp"))

        # 3. A genuine commit, after the forged events on the same partition, still deploys.
        genuine = store.add("lab", "mlp", files, tags={"serve": "true"}, commit=True)
        deployment = poll_until(lambda: _serving(deployments, "mlp"), timeout_s=90, what="mlp serving")
        # Only the genuine bundle was deployed: one version, from its uuid, with all the traffic.
        assert [(v.version, v.bundle_uuid) for v in deployment.versions] == [(1, genuine.uuid)]
        assert candidate.uuid != genuine.uuid and uncommitted.uuid != genuine.uuid

    # The event from evil/anyone went to the dead-letter topic with a reason naming its source.
    dead_letter = BUNDLES.dead_letter(platform_settings.topic_prefix)
    records = asyncio.run(read_records(platform_settings, dead_letter, 1, timeout_s=20))
    assert len(records) == 1, [dict(r.headers) for r in records]
    headers = dict(records[0].headers)
    assert CloudEvent.from_kafka(records[0].headers, records[0].value).source == "evil/anyone"
    assert headers["opml_error_type"] == b"UntrustedSource"
    assert b"'evil/anyone'" in headers["opml_error"] and b"opml/bundle-store" in headers["opml_error"]
    # ... and was counted.
    port = router.env["OPML_INFERENCE_ROUTER_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    untrusted = re.search(r'^opml_\w+_events_untrusted_total\{topic="[^"]*bundles[^"]*"\} (\S+)$', text, re.M)
    assert untrusted and float(untrusted.group(1)) == 1.0, text[:2000]
    # The refusals of the re-read are in the router's log, each with what the store said.
    log = router.log_path.read_text()
    assert "the store says it is tagged serve='false'" in log
    assert "the store says it is not committed" in log
    assert "the store resolves it to bundle" in log
