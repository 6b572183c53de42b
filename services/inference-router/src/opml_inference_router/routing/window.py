"""What a model version's requests did since the control plane last looked: how many, how many failed,
and a latency histogram to read a p99 from. The progressive rollout compares a new version with the
stable one over the same interval with these (:mod:`opml_inference_router.control.analysis`).

Prometheus' histograms have the router's coarse buckets and live in the scrape path; this window is
the router's own, with fine buckets (5% apart, so a p99 is read within 5%), read and reset by one
reader, at a constant cost per request (a bisect over ~400 bounds).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

_LOWEST_S, _HIGHEST_S, _GROWTH = 1e-5, 600.0, 1.05
_BOUNDS: tuple[float, ...] = tuple(_LOWEST_S * _GROWTH ** i
                                   for i in range(math.ceil(math.log(_HIGHEST_S / _LOWEST_S, _GROWTH)) + 1))

NOT_COUNTED = frozenset({"CANCELLED"})
"""Failure codes that say nothing of the version: the caller gave up. Every other failure counts (one the
caller causes, such as a malformed request, shows on both versions alike, and the checks compare them)."""


@dataclass(frozen=True)
class Measures:
    """One version over one interval. ``p99_s``: None without a successful request. ``latencies``: the
    successful requests' histogram (counts per bucket, 5% apart, the overflow last; empty
    without one), so two versions' latencies can be compared as distributions, not only by one quantile."""

    requests: int
    errors: int
    p99_s: float | None
    latencies: tuple[int, ...] = ()

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


class OutcomeWindow:
    """Counts and latencies of one version's requests since :meth:`take`."""

    __slots__ = ("_requests", "_errors", "_buckets")

    def __init__(self) -> None:
        self._requests = self._errors = 0
        self._buckets = [0] * (len(_BOUNDS) + 1)

    def answered(self, seconds: float) -> None:
        self._requests += 1
        self._buckets[bisect.bisect_left(_BOUNDS, seconds)] += 1

    def failed(self, code: str) -> None:
        if code not in NOT_COUNTED:
            self._requests += 1
            self._errors += 1

    def take(self) -> Measures:
        """What happened since the last take; starts a new interval."""
        measures = Measures(self._requests, self._errors, _quantile(self._buckets, 0.99),
                            tuple(self._buckets) if any(self._buckets) else ())
        self._requests = self._errors = 0
        self._buckets = [0] * (len(_BOUNDS) + 1)
        return measures


def merged(parts: list[Measures]) -> Measures:
    """Several intervals (or several routers' same interval) as one: counts and histograms summed."""
    buckets = [0] * (len(_BOUNDS) + 1)
    for part in parts:
        for index, count in enumerate(part.latencies):
            buckets[index] += count
    return Measures(sum(p.requests for p in parts), sum(p.errors for p in parts), _quantile(buckets, 0.99),
                    tuple(buckets) if any(buckets) else ())


def _quantile(buckets: list[int], q: float) -> float | None:
    """The upper bound of the bucket holding the ``q`` quantile (the highest bound for the overflow)."""
    total = sum(buckets)
    if not total:
        return None
    rank, seen = math.ceil(q * total), 0
    for index, count in enumerate(buckets):
        seen += count
        if seen >= rank:
            return _BOUNDS[min(index, len(_BOUNDS) - 1)]
    return _BOUNDS[-1]
