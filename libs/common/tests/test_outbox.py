"""The outbox's ordering and retry logic, with a publisher that fails on demand (pure logic)."""

import asyncio
from pathlib import Path

from opml.bundles.v1 import events_pb2

from opml_common.bus import CloudEvent
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.topics import BUNDLES
from prometheus_client import CollectorRegistry


class FlakyPublisher:
    def __init__(self) -> None:
        self.down = False
        self.sent: list[CloudEvent] = []

    async def publish(self, topic, event) -> None:
        if self.down:
            raise ConnectionError("broker down")
        self.sent.append(event)


def _event(n: int) -> CloudEvent:
    return CloudEvent.from_proto(events_pb2.BundleDeleted(uuid=str(n)), source="test", subject=str(n))


async def test_events_survive_a_broker_outage_and_a_restart(tmp_path: Path) -> None:
    publisher = FlakyPublisher()
    metrics = ServiceMetrics("test", CollectorRegistry())
    outbox = Outbox(tmp_path, publisher, metrics)
    assert await outbox.publish(BUNDLES, _event(1))
    publisher.down = True
    second = _event(2)
    assert not await outbox.publish(BUNDLES, second)
    assert not await outbox.publish(BUNDLES, _event(3))
    # The process restarts: a new outbox over the same directory publishes what was left, in order.
    publisher.down = False
    restarted = Outbox(tmp_path, publisher, metrics, retry_interval_s=0.01)
    await restarted.start()
    for _ in range(100):
        if len(publisher.sent) == 3:
            break
        await asyncio.sleep(0.01)
    await restarted.stop()
    assert [e.subject for e in publisher.sent] == ["1", "2", "3"]
    assert publisher.sent[1].id == second.id  # the same event id, so consumers can deduplicate
    assert list(tmp_path.iterdir()) == []
