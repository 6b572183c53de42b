"""The coordinator's core on the real Redis and S3, without a server: what a failed save leaves."""

from __future__ import annotations

import pytest
from opml.fl.v1 import events_pb2

from opml_common.errors import NotFound, Unavailable
from opml_common.events import RecordingEmitter
from opml_common.storage import redis_client, s3_client
from opml_devstack.testing.bus import fresh_metrics
from opml_fl_coordinator.coordinator import Coordinator
from opml_fl_coordinator.metrics import FlMetrics
from opml_fl_coordinator.store import FederationStore


class FailsOnce(FederationStore):
    """The real store, whose first save fails (Redis or S3 unreachable for a moment)."""

    failed = False

    async def save(self, document, arrays) -> None:
        if not self.failed:
            self.failed = True
            raise Unavailable("the store is unreachable")
        await super().save(document, arrays)


@pytest.fixture
async def store(platform_settings, unique_prefix):
    redis = redis_client(platform_settings)
    store = FailsOnce(redis, s3_client(platform_settings), bucket=f"{unique_prefix}fl".lower()[:60],
                      prefix=platform_settings.redis_prefix)
    await store.start()
    yield store
    keys = [key async for key in redis.scan_iter(f"{platform_settings.redis_prefix}*")]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()


async def test_a_create_whose_save_failed_leaves_nothing_and_can_be_retried(store) -> None:
    emitter = RecordingEmitter()
    coordinator = Coordinator(store, emitter, FlMetrics(fresh_metrics("fl-test")[0]))
    config = "name: plants\nrounds: 2\nmin_clients: 2\nselection: {clients_per_round: 2}\n"
    with pytest.raises(Unavailable):
        await coordinator.create(config)
    with pytest.raises(NotFound):
        coordinator.get("plants")
    assert coordinator.list() == [] and emitter.messages == []
    hosted = await coordinator.create(config)  # the caller's retry
    assert coordinator.get("plants") is hosted
    assert [type(m) for m in emitter.messages] == [events_pb2.FederationCreated]
    assert [document["federation_id"] for document, _ in await store.load_all()] == ["plants"]
