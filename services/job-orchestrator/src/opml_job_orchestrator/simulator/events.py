"""Events in virtual time, and the queue that hands them out in a deterministic order."""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass


class EventKind(enum.IntEnum):
    """What happens; at equal times, lower values go first, so capacity is freed before it is used."""

    FINISH = 0
    """A job's current run completed its remaining work."""
    CHECKPOINT = 1
    """A running job saved a checkpoint."""
    ARRIVAL = 2
    """A job is submitted."""
    WAKEUP = 3
    """The scheduler's next deadline (a promotion or the end of a protection) is due."""


@dataclass(frozen=True, slots=True)
class Event:
    """``run`` is the job's run number when the event was planned: a preemption since makes it stale."""

    time: float
    kind: EventKind
    job_id: str = ""
    run: int = 0


class EventQueue:
    """A heap of events by (time, kind, insertion order): the same inputs give the same order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Event]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, event: Event) -> None:
        heapq.heappush(self._heap, (event.time, event.kind, next(self._order), event))

    def pop(self) -> Event:
        """The earliest event. Raises IndexError when the queue is empty."""
        return heapq.heappop(self._heap)[3]

    def next_time(self) -> float | None:
        """The time of the earliest event, or None when the queue is empty."""
        return self._heap[0][0] if self._heap else None
