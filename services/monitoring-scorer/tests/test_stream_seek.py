"""The stream's fix of faust's seek to committed offsets (pure logic, a recording stand-in for faust's
consumer): a source partition its group never committed is sought to its earliest offset, so records
faust dropped after fetching them are fetched again (stream.py, ``_seek_uncommitted_to_earliest``)."""

from __future__ import annotations

from faust.types import TP

from opml_monitoring_scorer.stream import _seek_uncommitted_to_earliest

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


async def test_a_source_partition_never_committed_is_sought_to_its_earliest_offset() -> None:
    consumer = Consumer()
    _seek_uncommitted_to_earliest(consumer, {PREDICTIONS.topic, AT_ZERO.topic})
    committed = await consumer.seek_to_committed()
    assert consumer.sought == {PREDICTIONS: 7, AT_ZERO: 7}, "committed 40 is left to aiokafka; changelogs to recovery"
    assert committed == {PREDICTIONS: None, COMMITTED: 40, AT_ZERO: 0, CHANGELOG: None}, "faust sees what was committed"
