"""Recent latencies of a replica and their quantiles, cheap enough for every request."""

from __future__ import annotations


class LatencyWindow:
    """The last ``size`` latencies (seconds) in a ring; quantiles re-sorted every ``refresh`` samples.

    Recording is an index store (no allocation); the sort of ``size`` floats is amortized over
    ``refresh`` requests. Quantiles are ``None`` until ``min_samples`` latencies were seen, so
    callers fall back to a configured guess instead of trusting two samples.
    """

    __slots__ = ("_ring", "_size", "_count", "_refresh", "_min_samples", "_since_sort", "p50", "p95", "p99")

    def __init__(self, *, size: int = 128, refresh: int = 16, min_samples: int = 8) -> None:
        if size < 1 or refresh < 1 or not 1 <= min_samples <= size:
            raise ValueError(f"need size >= 1, refresh >= 1, 1 <= min_samples <= size, but got "
                             f"size={size}, refresh={refresh}, min_samples={min_samples}")
        self._ring = [0.0] * size
        self._size = size
        self._count = 0
        self._refresh = refresh
        self._min_samples = min_samples
        self._since_sort = 0
        self.p50: float | None = None
        self.p95: float | None = None
        self.p99: float | None = None

    @property
    def count(self) -> int:
        return self._count

    def observe(self, seconds: float) -> None:
        self._ring[self._count % self._size] = seconds
        self._count += 1
        self._since_sort += 1
        if self._count >= self._min_samples and (self._since_sort >= self._refresh or self.p50 is None):
            self._since_sort = 0
            ordered = sorted(self._ring[:min(self._count, self._size)])
            last = len(ordered) - 1
            self.p50 = ordered[int(0.50 * last)]
            self.p95 = ordered[int(round(0.95 * last))]
            self.p99 = ordered[int(round(0.99 * last))]
