"""The outbox against the real EventPublisher and the real broker (a broker that is down, then up),
and its ordering and retry logic with a publisher that fails on demand."""

import asyncio
import signal
import sys
from pathlib import Path

import pytest
from aiokafka.errors import KafkaTimeoutError
from opml.bundles.v1 import events_pb2
from prometheus_client import CollectorRegistry

from opml_common.bus import CloudEvent, EventPublisher, PublishFailed, ensure_topics
from opml_common.bus.consumer import is_retriable
from opml_common.config import PlatformSettings
from opml_common.errors import Unavailable
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.topics import Topic
from opml_devstack.devinfra import free_port
from opml_devstack.testing.bus import read_records, wait_until

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


async def test_outbox_over_the_real_broker_keeps_what_a_down_broker_did_not_ack(
        tmp_path: Path, platform_settings: PlatformSettings) -> None:
    """The real EventPublisher, first pointed at a port where no broker listens (the broker is down),
    then at the session's real broker: nothing the down broker did not ack is lost, nothing is sent
    twice, and the events reach the real topic in the order recorded, with their ids."""
    await ensure_topics(platform_settings, [BUNDLES])
    registry = CollectorRegistry()
    metrics = ServiceMetrics("test", registry)
    down_settings = platform_settings.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{free_port()}"})
    down = EventPublisher(down_settings, source="test", metrics=metrics)
    try:
        await down.start()
        raise AssertionError("a broker answered on an unused port")
    except Unavailable:
        pass  # down: every publish through it fails, as while the broker is away
    outbox = Outbox(tmp_path, down, metrics, retry_interval_s=0.05)
    events = [_event(n) for n in range(5)]
    assert not await outbox.publish(BUNDLES, events[0])
    await outbox.start()
    for event in events[1:]:
        outbox.record(BUNDLES, event)  # durable at once; the loop keeps failing against the down broker
    await outbox.stop()
    assert registry.get_sample_value("opml_test_outbox_pending_events") == 5
    assert len(list(tmp_path.glob("*.json"))) == 5

    # The broker is back (the service restarts against it): the next outbox over the same directory
    # publishes every pending event through the real publisher, then a new one, live.
    async with EventPublisher(platform_settings, source="test", metrics=metrics) as up:
        restarted = Outbox(tmp_path, up, metrics, retry_interval_s=60)  # no interval to wait out: start() wakes it
        await restarted.start()
        await wait_until(lambda: registry.get_sample_value("opml_test_outbox_pending_events") == 0,
                         what="the backlog to drain")
        live = _event(5)
        assert await restarted.publish(BUNDLES, live)  # acked by the real broker before it returns
        await restarted.stop()
    assert list(tmp_path.iterdir()) == []
    records = await read_records(platform_settings, BUNDLES.full_name(platform_settings.topic_prefix), 6)
    ids = [dict(r.headers)["ce_id"].decode() for r in records]
    assert len(ids) == 6, ids  # read_records polls once more after 6: none arrived twice
    by_subject = {event.subject: event.id for event in [*events, live]}
    assert sorted(ids) == sorted(by_subject.values())
    # one subject per event, so several partitions: order holds per partition, by offset
    for partition in {r.partition for r in records}:
        in_partition = [int(dict(r.headers)["ce_subject"]) for r in records if r.partition == partition]
        assert in_partition == sorted(in_partition), in_partition
    assert registry.get_sample_value("opml_test_events_published_total",
                                     {"topic": BUNDLES.name, "type": live.type}) == 6


RECORD_THEN_DIE = """
import os, signal, sys
from pathlib import Path
from prometheus_client import CollectorRegistry
from aiokafka.errors import KafkaTimeoutError
from opml.bundles.v1 import events_pb2
from opml_common.bus import CloudEvent, EventPublisher, ensure_topics
from opml_common.config import PlatformSettings
from opml_devstack.devinfra import free_port
from opml_common.errors import Unavailable
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_devstack.testing.bus import read_records, wait_until
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


async def test_an_event_the_broker_refuses_for_good_is_moved_aside_and_the_next_ones_go_out(
        tmp_path: Path, platform_settings: PlatformSettings) -> None:
    """The real publisher refuses a record over its 1 MiB request limit (MessageSizeTooLargeError,
    not retriable): that event goes to the failed folder, counted, and the events after it reach the
    broker; it is not retried forever in front of them."""
    await ensure_topics(platform_settings, [BUNDLES])
    registry = CollectorRegistry()
    metrics = ServiceMetrics("test", registry)
    directory = tmp_path / "outbox"
    too_large = CloudEvent.from_proto(events_pb2.BundleDeleted(uuid="x" * (2 * 1024 * 1024)),
                                      source="test", subject="big")
    events = [_event(0), too_large, _event(1), _event(2)]
    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        outbox = Outbox(directory, publisher, metrics)
        for event in events:
            outbox.record(BUNDLES, event)
        assert await outbox.flush()
    assert list(directory.iterdir()) == []
    failed = list((tmp_path / "outbox.failed").iterdir())
    assert len(failed) == 1 and too_large.id in failed[0].name
    assert registry.get_sample_value("opml_test_outbox_failed_events_total", {"reason": "refused"}) == 1
    assert registry.get_sample_value("opml_test_outbox_pending_events") == 0
    records = await read_records(platform_settings, BUNDLES.full_name(platform_settings.topic_prefix), 3)
    assert sorted(dict(r.headers)["ce_id"].decode() for r in records) == sorted(e.id for e in events if e is not too_large)


async def test_a_file_holding_no_event_is_moved_aside_and_the_loop_publishes_the_rest(tmp_path: Path) -> None:
    """Garbage among the pending files (cut short, edited by hand) is moved to the failed folder once;
    the background loop goes on with the events after it instead of dying on it."""
    publisher = FlakyPublisher()
    registry = CollectorRegistry()
    directory = tmp_path / "outbox"
    directory.mkdir()
    (directory / "0-garbage.json").write_text('{"topic": ')  # sorts first, as the oldest pending file
    outbox = Outbox(directory, publisher, ServiceMetrics("test", registry), retry_interval_s=60)
    outbox.record(BUNDLES, _event(1))
    outbox.record(BUNDLES, _event(2))
    await outbox.start()  # wakes at once for what is pending: no interval to wait out
    await wait_until(lambda: len(publisher.sent) == 2, what="the events after the garbage to go out")
    await outbox.stop()
    assert [e.subject for e in publisher.sent] == ["1", "2"]
    assert list(directory.iterdir()) == []
    assert [p.name for p in (tmp_path / "outbox.failed").iterdir()] == ["0-garbage.json"]
    assert registry.get_sample_value("opml_test_outbox_failed_events_total", {"reason": "unreadable"}) == 1
    assert registry.get_sample_value("opml_test_outbox_failed_events_total", {"reason": "refused"}) == 0  # from the start
    assert registry.get_sample_value("opml_test_outbox_pending_events") == 0


class RacedPublisher(FlakyPublisher):
    """Publishes, then removes ``gone``: another flush of the same folder sent that file meanwhile."""

    def __init__(self, gone: list[Path]) -> None:
        super().__init__()
        self.gone = gone

    async def publish(self, topic, event) -> None:
        await super().publish(topic, event)
        for path in self.gone:
            path.unlink(missing_ok=True)


async def test_a_file_gone_during_a_flush_counts_as_sent(tmp_path: Path) -> None:
    publisher = RacedPublisher([])
    registry = CollectorRegistry()
    outbox = Outbox(tmp_path / "outbox", publisher, ServiceMetrics("test", registry))
    for n in range(3):
        outbox.record(BUNDLES, _event(n))
    publisher.gone = [sorted((tmp_path / "outbox").glob("*.json"))[1]]
    assert await outbox.flush()
    assert [e.subject for e in publisher.sent] == ["0", "2"]
    assert registry.get_sample_value("opml_test_outbox_pending_events") == 0


async def test_an_unexpected_error_of_the_flush_loop_is_logged_counted_and_survived(
        tmp_path: Path, monkeypatch, caplog) -> None:
    """The folder cannot be listed once (a failing disk): the error is logged with its traceback and
    counted, and the loop publishes the events at its next try instead of ending silently."""
    publisher = FlakyPublisher()
    registry = CollectorRegistry()
    outbox = Outbox(tmp_path / "outbox", publisher, ServiceMetrics("test", registry), retry_interval_s=0.01)
    listing = outbox._files
    failures = iter([OSError("I/O error listing the outbox")])

    def flaky_listing() -> list[Path]:
        for error in failures:
            raise error
        return listing()

    outbox.record(BUNDLES, _event(1))
    await outbox.start()
    monkeypatch.setattr(outbox, "_files", flaky_listing)  # before the loop's first turn
    await wait_until(lambda: len(publisher.sent) == 1, what="the event to go out after the error")
    await outbox.stop()
    assert registry.get_sample_value("opml_test_outbox_flush_errors_total") == 1
    assert any("background flush failed" in r.getMessage() and r.exc_info for r in caplog.records)


class BrokerAwayProducer:
    """Stands in for aiokafka's producer when the broker is away: a send ends in KafkaTimeoutError."""

    async def send_and_wait(self, *args, **kwargs) -> None:
        raise KafkaTimeoutError()


async def test_a_timeout_while_the_broker_is_away_is_retried_not_moved_aside(tmp_path: Path) -> None:
    """aiokafka flags KafkaTimeoutError not retriable; the record was not refused, the broker was away:
    the real publisher says so, and the outbox keeps the event, in order, for the next try."""
    publisher = EventPublisher(PlatformSettings(), source="test", metrics=None)
    publisher._producer = BrokerAwayProducer()
    outbox = Outbox(tmp_path / "outbox", publisher, None)
    assert not await outbox.publish(BUNDLES, _event(1))
    assert len(list((tmp_path / "outbox").glob("*.json"))) == 1
    assert not (tmp_path / "outbox.failed").exists()
    with pytest.raises(PublishFailed) as caught:  # a consumer's handler that publishes retries, not dead-letters
        await publisher.publish(BUNDLES, _event(2))
    assert caught.value.retriable and not caught.value.refused and is_retriable(caught.value)
