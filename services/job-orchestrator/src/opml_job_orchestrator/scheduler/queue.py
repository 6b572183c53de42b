"""The pending queue, indexed so a scheduling pass costs O(groups), not O(queued jobs).

Jobs of equal shape (the same replicas' resources), class and promotion state fit or fail alike, so
the queue keeps one heap per such group, ordered by rank. A pass walks the groups' heads in rank
order; when a head cannot start, its whole group is skipped for the rest of the pass. With 10,000
queued jobs in a few dozen shapes, a pass looks at a few dozen jobs.

Removal is lazy: every entry carries the token the job had when it was pushed, and an entry whose
token is no longer the job's current one is dropped when it reaches the top of its heap.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Any

GroupKey = tuple[Hashable, ...]
_Entry = tuple[tuple[Any, ...], int, int, Any]  # (rank, submit seq, token, job)


class PendingQueue:
    """Pending jobs grouped by key, each group a heap by (rank, submit sequence)."""

    def __init__(self) -> None:
        self._groups: dict[GroupKey, list[_Entry]] = {}
        self._where: dict[str, tuple[GroupKey, int]] = {}  # job id -> (group, current token)
        self._tokens = itertools.count()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._where

    def push(self, job: Any, key: GroupKey, rank: tuple[Any, ...]) -> None:
        """Add ``job`` (which has ``job_id`` and ``seq``) to group ``key``."""
        token = next(self._tokens)
        self._where[job.job_id] = (key, token)
        heapq.heappush(self._groups.setdefault(key, []), (rank, job.seq, token, job))

    def remove(self, job_id: str) -> None:
        """Take ``job_id`` out of the queue (its heap entry is dropped later, when it surfaces)."""
        del self._where[job_id]

    def head(self, key: GroupKey) -> tuple[tuple[Any, ...], Any] | None:
        """(rank, job) of the first live entry of group ``key``, or None when the group is empty."""
        heap = self._groups.get(key)
        while heap:
            rank, _, token, job = heap[0]
            if self._where.get(job.job_id) == (key, token):
                return rank, job
            heapq.heappop(heap)
        self._groups.pop(key, None)
        return None

    def heads(self) -> list[tuple[tuple[Any, ...], int, GroupKey, Any]]:
        """(rank, seq, key, job) of every non-empty group's head: a heap to walk groups in rank order."""
        heads = []
        for key in list(self._groups):
            head = self.head(key)
            if head is not None:
                heads.append((head[0], head[1].seq, key, head[1]))
        heapq.heapify(heads)
        return heads
