"""Model quality from the monitoring-scorer, for a rollout's ``estimated_accuracy`` and ``accuracy``
checks: the windows it publishes (WindowScored on ``opml.quality.v1``, its contract's
:data:`~opml_monitoring_scorer_contract.topics.QUALITY`), kept per model version.

The consumer accepts events only from the scorer (:data:`SOURCES`: its contract's event source;
others are dead-lettered by :class:`~opml_common.bus.EventConsumer`). A window's event is the scorer's
evidence for that window as it stood: the same window comes again as labels join it, so the one with
the most labels is kept (labels only grow; a redelivered or older one changes nothing). A malformed
event is dead-lettered (InvalidArgument).

Kept in Redis (``<prefix>inference-router:quality:{model}/{version}``, one field per window, the
newest :data:`MAX_WINDOWS` kept), so a restarted router judges with what it had consumed; without
Redis (tests, a dev router) in memory.

Events are hints where it matters: before a rollout is aborted on the scorer's numbers, they are read
again from the scorer itself (:class:`~opml_inference_router.control.scorer_windows.ScorerWindows`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

from opml.monitoring.v1 import quality_events_pb2

from opml_common.bus import CloudEvent
from opml_common.errors import InvalidArgument
from opml_monitoring_scorer_contract.names import EVENT_SOURCE as SCORER_SOURCE

log = logging.getLogger(__name__)

GROUP = "inference-router-quality"
SOURCES = frozenset({SCORER_SOURCE})
MAX_WINDOWS = 1024
"""Windows kept per model version (the newest by index)."""
MAX_NAME = 256
"""The longest model or version name an event may give (they name Redis keys)."""
_WINDOW_SCORED = quality_events_pb2.WindowScored.DESCRIPTOR.full_name


@dataclass(frozen=True)
class Window:
    """One scored window of a version, as its latest event says."""

    index: int
    rows: int
    last_time: float
    estimate: float | None
    labelled: int
    true_value: float | None
    higher_is_better: bool


@dataclass(frozen=True)
class Quality:
    """A version's windows since a time, pooled: ``predictions`` scored and their rows-weighted
    ``estimate`` (None without one), ``labels`` joined and the labels-weighted ``accuracy`` (None
    without any). ``higher_is_better``: False for a regressor (the values are MAE)."""

    predictions: int = 0
    estimate: float | None = None
    labels: int = 0
    accuracy: float | None = None
    higher_is_better: bool = True
    windows: int = 0


def pooled(windows: list[Window]) -> Quality:
    estimated = [w for w in windows if w.estimate is not None]
    labelled = [w for w in windows if w.labelled and w.true_value is not None]
    predictions, labels = sum(w.rows for w in estimated), sum(w.labelled for w in labelled)
    return Quality(
        predictions=predictions,
        estimate=sum(w.estimate * w.rows for w in estimated) / predictions if predictions else None,  # type: ignore[operator]
        labels=labels,
        accuracy=sum(w.true_value * w.labelled for w in labelled) / labels if labels else None,  # type: ignore[operator]
        higher_is_better=all(w.higher_is_better for w in windows), windows=len(windows))


class QualityBook:
    """The scorer's windows per model version (``redis``: where they are kept; None: in memory)."""

    def __init__(self, redis: Any = None, *, prefix: str = "") -> None:
        self._redis = redis
        self._prefix = f"{prefix}inference-router:quality:"
        self._memory: dict[str, dict[int, Window]] = {}

    async def record(self, event: quality_events_pb2.WindowScored) -> bool:
        """Keeps the window unless one with as many labels is kept; whether it was kept. A segment's
        window (a version the scorer monitors per segment too) is not kept: a rollout compares versions
        on their whole traffic, and a segment's windows are numbered apart from the version's.
        Raises: InvalidArgument (no model, version or rows)."""
        if not 0 < len(event.model) <= MAX_NAME or not 0 < len(event.version) <= MAX_NAME:
            raise InvalidArgument("data", f"a WindowScored must name a model and a version of 1 to {MAX_NAME} "
                                          f"characters, but got {len(event.model)} and {len(event.version)}")
        if event.rows < 0 or event.window < 0 or event.labelled < 0:
            raise InvalidArgument("data", f"a WindowScored's window, rows and labelled must be >= 0, but got "
                                          f"{event.window}, {event.rows} and {event.labelled}")
        if event.segment:
            return False
        window = Window(index=event.window, rows=event.rows, last_time=event.last_time.ToNanoseconds() / 1e9,
                        estimate=event.estimate if event.HasField("estimate") else None, labelled=event.labelled,
                        true_value=event.true_value if event.HasField("true_value") else None,
                        higher_is_better=event.task != "regression")
        key = f"{event.model}/{event.version}"
        kept = (await self._windows(key)).get(window.index)
        if kept is not None and kept.labelled >= window.labelled:
            return False
        if self._redis is None:
            windows = self._memory.setdefault(key, {})
            windows[window.index] = window
            for index in sorted(windows)[:-MAX_WINDOWS]:
                del windows[index]
            return True
        await self._redis.hset(self._prefix + key, str(window.index), json.dumps(asdict(window)))
        if await self._redis.hlen(self._prefix + key) > MAX_WINDOWS:
            indexes = sorted(int(i) for i in await self._redis.hkeys(self._prefix + key))
            await self._redis.hdel(self._prefix + key, *[str(i) for i in indexes[:-MAX_WINDOWS]])
        return True

    async def since(self, model: str, version: str | int, start_time: float) -> Quality:
        """The version's windows whose last prediction came at or after ``start_time``, pooled."""
        windows = await self._windows(f"{model}/{version}")
        return pooled([w for w in windows.values() if w.last_time >= start_time])

    async def _windows(self, key: str) -> dict[int, Window]:
        if self._redis is None:
            return self._memory.get(key, {})
        stored = await self._redis.hgetall(self._prefix + key)
        return {int(index): Window(**json.loads(value)) for index, value in stored.items()}


class QualityConsumer:
    """The handler of an ``EventConsumer`` on QUALITY (group :data:`GROUP`, ``sources=SOURCES``)."""

    def __init__(self, book: QualityBook) -> None:
        self._book = book

    async def __call__(self, event: CloudEvent) -> None:
        if event.type != _WINDOW_SCORED:
            return
        message = event.parse(quality_events_pb2.WindowScored)
        if await self._book.record(message):
            log.debug("quality of models/%s/versions/%s window %d: %d rows, %d labelled", message.model,
                      message.version, message.window, message.rows, message.labelled)
