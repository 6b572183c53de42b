"""Measured rate and p99 per model version, from the router's own Prometheus metrics, for re-placement.

Each :meth:`Observer.observe` compares the ``requests_total{code="OK"}`` counter and the
``request_duration_seconds`` histogram with the previous call: the rate is the count's growth per
second, the p99 the histogram's growth read at its 99th percentile (linear within a bucket). A
version seen for the first time has no window yet and is left out (the Replanner keeps it as is).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry

from opml_inference_router.placement import ModelVersion, Observation

REQUESTS = "opml_inference_router_requests_total"
DURATION = "opml_inference_router_request_duration_seconds_bucket"
MIN_LATENCY_SAMPLES = 20  # fewer requests in a window: the p99 is not trusted (reported as 0)


class Observer:
    def __init__(self, registry: CollectorRegistry, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._clock = clock
        self._last: dict[ModelVersion, tuple[float, float, list[tuple[float, float]]]] = {}

    def observe(self, models: Iterable[ModelVersion]) -> dict[ModelVersion, Observation]:
        now = self._clock()
        samples = [sample for metric in self._registry.collect() if metric.name + "_bucket" == DURATION
                   for sample in metric.samples if sample.name == DURATION]
        observations = {}
        for model in models:
            count, buckets = self._snapshot(model, samples)
            previous = self._last.get(model)
            self._last[model] = (now, count, buckets)
            if previous is None or now <= previous[0]:
                continue
            then, old_count, old_buckets = previous
            served = max(0.0, count - old_count)
            window = [(bound, cumulative - old) for (bound, cumulative), (_, old) in zip(buckets, old_buckets)]
            p99_ms = _quantile(window, 0.99) * 1000 if served >= MIN_LATENCY_SAMPLES else 0.0
            observations[model] = Observation(rate_rps=served / (now - then), p99_ms=p99_ms)
        return observations

    def forget(self, model: ModelVersion) -> None:
        self._last.pop(model, None)

    def _snapshot(self, model: ModelVersion, samples: list) -> tuple[float, list[tuple[float, float]]]:
        labels = {"model": model.name, "version": str(model.version)}
        count = self._registry.get_sample_value(REQUESTS, {**labels, "code": "OK"}) or 0.0
        buckets = [(float(sample.labels["le"]), sample.value) for sample in samples
                   if all(sample.labels.get(key) == value for key, value in labels.items())]
        return count, sorted(buckets)


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a cumulative histogram ``[(upper bound, count <= bound)]``, in seconds."""
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    target = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= target:
            if math.isinf(bound):
                return lower
            share = (target - below) / (cumulative - below) if cumulative > below else 1.0
            return lower + (bound - lower) * share
        lower, below = bound, cumulative
    return lower
