"""Discrete-event simulation of one dynamically batching replica: the independent check of placement.

Requests arrive as a Poisson stream. The replica runs one batch at a time: when it is free and a
request waits, it dispatches as soon as ``max_batch`` requests wait or the oldest has waited
``queue_delay_ms`` (Triton's dynamic batcher), taking every waiting request up to ``max_batch``. A
batch of ``n`` takes the *true* service time of the padded batch times a log-normal jitter. Nothing
here uses the latency model the planner believes.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaRun:
    """What one simulated replica measured, after its warm-up requests."""

    p99_ms: float
    busy: float  # fraction of the measured time the replica was running a batch
    requests: int


def simulate_replica(
    service_ms: Callable[[int], float],
    *,
    max_batch: int,
    queue_delay_ms: float,
    rate_rps: float,
    requests: int,
    rng: random.Random,
    jitter: float = 0.0,
    warmup: int = 0,
) -> ReplicaRun:
    """Simulates ``warmup + requests`` arrivals at ``rate_rps`` and measures the last ``requests``.

    ``service_ms(n)`` is the mean time of a batch of ``n`` (padding included); each batch's time is
    that mean times ``exp(N(-jitter²/2, jitter))`` (mean-preserving log-normal jitter).
    """
    total = warmup + requests
    clock, arrivals = 0.0, []
    rate = rate_rps / 1000.0
    for _ in range(total):
        clock += rng.expovariate(rate)
        arrivals.append(clock)
    shift = -jitter * jitter / 2
    latencies: list[float] = []
    free_at, busy_ms, index = 0.0, 0.0, 0
    measured_from = arrivals[warmup] if warmup < total else clock
    while index < total:
        start = max(free_at, arrivals[index])
        deadline = max(start, arrivals[index] + queue_delay_ms)
        fills = index + max_batch - 1
        dispatch = max(start, arrivals[fills]) if fills < total and arrivals[fills] <= deadline else deadline
        end = bisect_right(arrivals, dispatch, index, min(index + max_batch, total))
        run = service_ms(end - index)
        if jitter:
            run *= math.exp(rng.gauss(shift, jitter))
        done = dispatch + run
        if end > warmup:
            latencies.extend(done - arrivals[i] for i in range(max(index, warmup), end))
            busy_ms += run
        free_at, index = done, end
    latencies.sort()
    span = max(free_at - measured_from, 1e-9)
    return ReplicaRun(
        p99_ms=latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)],
        busy=min(1.0, busy_ms / span),
        requests=len(latencies),
    )
