"""The outbox's ordering and retry logic, with a publisher that fails on demand (pure logic)."""

import asyncio
import signal
import sys
from pathlib import Path

from opml.bundles.v1 import events_pb2
from prometheus_client import CollectorRegistry

from opml_common.bus import CloudEvent
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.topics import Topic

BUNDLES = Topic.of(events_pb2)


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
    registry = CollectorRegistry()
    metrics = ServiceMetrics("test", registry)
    outbox = Outbox(tmp_path, publisher, metrics)
    assert await outbox.publish(BUNDLES, _event(1))
    publisher.down = True
    second = _event(2)
    assert not await outbox.publish(BUNDLES, second)
    assert not await outbox.publish(BUNDLES, _event(3))
    assert registry.get_sample_value("opml_test_outbox_pending_events") == 2
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
    assert registry.get_sample_value("opml_test_outbox_pending_events") == 0


RECORD_THEN_DIE = """
import os, signal, sys
from pathlib import Path
from prometheus_client import CollectorRegistry
from opml.bundles.v1 import events_pb2
from opml_common.bus import CloudEvent
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.topics import Topic

BUNDLES = Topic.of(events_pb2)

class Unreachable:
    async def publish(self, topic, event):
        raise AssertionError("record() must not publish")

outbox = Outbox(Path(sys.argv[1]), Unreachable(), ServiceMetrics("test", CollectorRegistry()))
for n in range(3):
    event = CloudEvent.from_proto(events_pb2.BundleDeleted(uuid=str(n)), source="test", subject=str(n))
    outbox.record(BUNDLES, event)
    print(event.id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no flush, no clean exit: only what record() wrote survives
"""


async def test_recorded_events_survive_a_kill_and_are_flushed_by_the_next_outbox(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", RECORD_THEN_DIE, str(tmp_path),
                                                   stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate()
    assert process.returncode == -signal.SIGKILL
    recorded = out.decode().split()
    assert len(recorded) == 3 and len(list(tmp_path.glob("*.json"))) == 3
    publisher = FlakyPublisher()
    restarted = Outbox(tmp_path, publisher, ServiceMetrics("test", CollectorRegistry()), retry_interval_s=60)
    await restarted.start()
    restarted.record(BUNDLES, _event(3))  # wakes the flush loop at once: no waiting for the interval
    for _ in range(200):
        if len(publisher.sent) == 4:
            break
        await asyncio.sleep(0.01)
    await restarted.stop()
    assert [e.id for e in publisher.sent[:3]] == recorded  # the same events, in the order recorded
    assert [e.subject for e in publisher.sent] == ["0", "1", "2", "3"]
    assert list(tmp_path.iterdir()) == []
