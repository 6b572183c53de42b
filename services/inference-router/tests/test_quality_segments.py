"""The rollout's quality book keeps a version's own windows, not its segments' (a version the
monitoring-scorer monitors per segment publishes both, each segment's numbered apart)."""

from __future__ import annotations

from opml.monitoring.v1 import quality_events_pb2

from opml_inference_router.control.quality import QualityBook


async def test_a_segments_window_does_not_count_as_the_versions() -> None:
    book = QualityBook()
    whole = quality_events_pb2.WindowScored(model="m", version="2", window=0, rows=100, estimate=0.9, task="binary")
    line = quality_events_pb2.WindowScored(model="m", version="2", window=0, rows=50, estimate=0.2, task="binary",
                                           labelled=50, true_value=0.1, segment="3")
    assert await book.record(whole)
    assert not await book.record(line), "a segment's window 0 is not the version's window 0"
    quality = await book.since("m", "2", 0.0)
    assert (quality.windows, quality.predictions, quality.estimate, quality.labels) == (1, 100, 0.9, 0)
