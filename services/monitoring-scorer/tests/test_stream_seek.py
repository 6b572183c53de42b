"""The stream's fixes of faust's seeks (pure logic, a recording stand-in for faust's consumer): a source
partition its group never committed is sought to its earliest offset, so records faust dropped after
fetching them are fetched again (stream.py, ``_seek_uncommitted_to_earliest``); each partition's records
are applied in offset order with no gap from where it was fed from, a gap sought back to its first
missing offset (``ScoringStream._in_order``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from faust.types import TP

from opml_common.config import PlatformSettings
from opml_monitoring_scorer.stream import ScoringStream, _seek_uncommitted_to_earliest

PREDICTIONS = TP("p-opml.predictions.v1", 2)
COMMITTED = TP("p-opml.predictions.v1", 1)
AT_ZERO = TP("p-opml.labels.v1", 0)
CHANGELOG = TP("p-monitoring-scorer-windows-changelog", 2)


class Consumer:
    """What faust's consumer answers: committed offsets (None: never committed), earliest offsets."""

    def __init__(self) -> None:
        self.sought: dict[TP, int] = {}

    async def seek_to_committed(self) -> dict[TP, int | None]:
        return {PREDICTIONS: None, COMMITTED: 40, AT_ZERO: 0, CHANGELOG: None}

    async def earliest_offsets(self, *partitions: TP) -> dict[TP, int]:
        return {tp: 7 for tp in partitions}

    async def seek_wait(self, partitions: dict[TP, int]) -> None:
        self.sought.update(partitions)

    async def seek(self, partition: TP, offset: int) -> None:
        self.sought[partition] = offset


async def test_a_source_partition_never_committed_is_sought_to_its_earliest_offset() -> None:
    consumer = Consumer()
    _seek_uncommitted_to_earliest(consumer, {PREDICTIONS.topic, AT_ZERO.topic})
    committed = await consumer.seek_to_committed()
    assert consumer.sought == {PREDICTIONS: 7, AT_ZERO: 7}, "committed 40 is left to aiokafka; changelogs to recovery"
    assert committed == {PREDICTIONS: None, COMMITTED: 40, AT_ZERO: 0, CHANGELOG: None}, "faust sees what was committed"


async def test_the_stream_is_told_where_each_source_partition_is_fed_from() -> None:
    consumer, told = Consumer(), {}
    _seek_uncommitted_to_earliest(consumer, {PREDICTIONS.topic, AT_ZERO.topic}, told.update)
    await consumer.seek_to_committed()
    assert told == {PREDICTIONS: 7, COMMITTED: 40, AT_ZERO: 7}, "the earliest where none was committed"


def at(offset: int, partition: int = 2) -> SimpleNamespace:
    return SimpleNamespace(topic=PREDICTIONS.topic, partition=partition, offset=offset)


async def applied(stream: ScoringStream, offsets: list[int]) -> list[int]:
    """The offsets of partition 2 the stream applies, of records coming in this order."""
    return [offset for offset in offsets if await stream._in_order(at(offset))]


async def test_records_past_a_gap_seek_back_and_are_applied_in_order_once_it_is_filled(tmp_path: Path) -> None:
    stream = ScoringStream(PlatformSettings(), scorer=None, metrics=None, publisher=None, datadir=tmp_path)
    consumer = Consumer()
    stream.app, stream._source = SimpleNamespace(consumer=consumer), PREDICTIONS.topic
    stream._fed_from({PREDICTIONS: 20, COMMITTED: 40})
    assert await applied(stream, [20, 21, 21, 20]) == [20, 21], "a record fed before is not applied again"
    # 22 never delivered: each record past it seeks back to 22 and is not applied (it comes again)
    assert await applied(stream, [23, 24]) == [] and consumer.sought == {PREDICTIONS: 22}
    consumer.sought.clear()
    assert await applied(stream, [25]) == [] and consumer.sought == {PREDICTIONS: 22}, "sought again"
    assert await applied(stream, [22, 23, 24, 25, 26]) == [22, 23, 24, 25, 26]
    consumer.sought.clear()
    assert await applied(stream, [28]) == [] and consumer.sought == {PREDICTIONS: 27}
    assert await applied(stream, [28, 29]) == [28, 29], "27 is not in the log: the seek brought 28 again"
    assert await stream._in_order(at(5, partition=3)), "a partition not sought yet takes what comes"
    assert not await stream._in_order(at(39, partition=1)), "fed from 40"
    stream._fed_from({PREDICTIONS: 20})
    assert await applied(stream, [20, 29, 30]) == [30], "a seek of a partition kept: fed again, not applied again"
    stream._forget({2})
    assert await stream._in_order(at(3)), "a revoked partition is fed from wherever it is sought next"
