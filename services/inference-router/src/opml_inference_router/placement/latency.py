"""Latency models: from a profile, the p99 latency of one replica at a request rate.

A replica runs one batch at a time on its slot. Requests queue; a batch is dispatched when the
replica is free and either ``max_batch`` requests wait or the oldest has waited ``queue_delay_ms``
(Triton's dynamic batcher). A batch of ``n`` takes ``s(n)``: the profile's latency, padded up to the
pool kind's fixed batch shapes where it has them. :class:`BatchQueueModel` approximates p99 in
closed form; :mod:`opml_inference_router.sim.des` simulates the same discipline request by request,
which is how the approximation is checked.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from opml_common.errors import InvalidArgument
from opml_inference_router.placement.fleet_config import PoolKind
from opml_inference_router.placement.profile import Profile

_SCAN_STEPS = 16  # max_rate_rps scans this many rates below capacity for the first miss...
_BISECTION_STEPS = 8  # ...then narrows the miss down to 1/16/2**8 of capacity


@dataclass(frozen=True)
class ServiceCurve:
    """Time to run one batch on one replica: a profile on a pool kind, padded to its batch shapes."""

    profile: Profile
    kind: PoolKind

    def ms(self, batch: float) -> float:
        """Mean time of a batch of ``batch`` requests (rounded up to a whole request and, on kinds
        with fixed shapes, to the next shape).

        Raises:
            InvalidArgument: the batch is larger than the kind's largest shape or the profile's largest size.
        """
        if self.kind.batch_sizes:
            return self.profile.latency_ms(self.kind.padded_batch(math.ceil(batch)))
        return self.profile.latency_ms(batch)


@dataclass(frozen=True)
class Batching:
    """How a replica forms batches: at most ``max_batch`` requests, waiting at most ``queue_delay_ms``."""

    max_batch: int
    queue_delay_ms: float


def batch_caps(kind: PoolKind, model_limit: int, profile: Profile) -> list[int]:
    """Batch caps worth considering for a model on a kind: the kind's fixed shapes, or powers of two
    and the limit itself, never above the model's limit or the profile's largest measured size.
    Empty when the kind's smallest shape exceeds what the model accepts."""
    limit = min(model_limit, profile.max_batch)
    if kind.batch_sizes:
        return [shape for shape in kind.batch_sizes if shape <= limit]
    caps = [1 << power for power in range(limit.bit_length()) if 1 << power <= limit]
    return caps if caps[-1] == limit else [*caps, limit]


class LatencyModel(ABC):
    """Predicts one replica's p99 latency; policies size replica sets with it, and re-placement
    calibrates profiles against measurements through it."""

    @abstractmethod
    def p99_ms(self, service: ServiceCurve, batching: Batching, rate_rps: float) -> float:
        """The p99 latency of a replica receiving Poisson arrivals at ``rate_rps``.

        Called for every candidate (pool kind, batch cap) a policy sizes, many times per model.
        Need not be monotone in ``rate_rps`` (dynamic batching can lower p99 as the rate rises:
        batches fill before the queue delay runs out), but must be non-decreasing in the service
        times (calibration bisects on them). Returns ``math.inf`` when the replica cannot keep up.

        Raises:
            InvalidArgument: ``rate_rps`` is negative, or ``batching.max_batch`` exceeds what ``service`` covers.
        """

    def capacity_rps(self, service: ServiceCurve, batching: Batching) -> float:
        """Throughput of a replica that always runs full batches: the rate it can never exceed."""
        return batching.max_batch / service.ms(batching.max_batch) * 1000.0

    def max_rate_rps(self, service: ServiceCurve, batching: Batching, p99_ms: float) -> float:
        """The highest rate up to which the predicted p99 stays within ``p99_ms`` at *every* rate,
        so a replica planned for it also meets the target when its traffic falls; 0.0 when even a
        lone request would miss it. Found by scanning rates below capacity for the first miss
        and bisecting between it and the last rate that met the target.

        Raises:
            InvalidArgument: as :meth:`p99_ms`.
        """
        if self.p99_ms(service, batching, 0.0) > p99_ms:
            return 0.0
        capacity = self.capacity_rps(service, batching)
        low, high = 0.0, capacity
        for step in range(1, _SCAN_STEPS + 1):
            rate = capacity * step / (_SCAN_STEPS + 1)
            if self.p99_ms(service, batching, rate) > p99_ms:
                high = rate
                break
            low = rate
        for _ in range(_BISECTION_STEPS):
            middle = (low + high) / 2
            if self.p99_ms(service, batching, middle) <= p99_ms:
                low = middle
            else:
                high = middle
        return low


class BatchQueueModel(LatencyModel):
    """Closed-form p99 of a dynamically batching replica under Poisson arrivals at rate λ.

    p99 ≈ wait for the batch to start + its service + backlog, where, with ``B`` the batch cap and
    ``D`` the queue delay:

    * fill wait ``w = min(D, f)``, ``f`` the 99th percentile of the time ``B - 1`` more requests
      take to arrive (0 when ``B = 1``: a lone request is a full batch);
    * typical batch size ``b``: the greatest fixed point of ``b = min(B, 1 + λ·max(w, s(b)))`` (a
      request plus those arriving while the batch fills or while the previous one runs). The
      greatest, because on kinds with fixed shapes a batch padded up to a large shape runs long,
      lets a large batch gather and stays in that slow mode;
    * service of the request's batch: ``s(max(b, 1 + k))``, ``k`` the 99th percentile of the
      Poisson(λ·w) requests that join a lone request while it waits (on a kind that batches
      poorly, one more request in the batch is what the slowest 1% see at low load);
    * wait to start: ``max(w, r)``, ``r`` the 99th percentile of the residual service a request
      finds (busy with probability ``u = λ·s(b)/b``, residual uniform on ``[0, s(b)]``):
      ``r = s(b)·(1 - 0.01/u)`` when ``u > 0.01``;
    * backlog when batches are full: the server removes ``B`` requests per ``s(B)`` while
      ``Poisson(λ·s(B))`` arrive; the queue's tail is ``P(Q > q) ≈ ρ·e^(-θq)`` with ``ρ = λ·s(B)/B``
      and ``θ`` the positive root of ``ρ(e^θ - 1) = θ`` (Cramér-Lundberg for the bulk-service random
      walk); ``q99 = ln(100ρ)/θ`` requests ahead, worth ``q99/B`` batches of ``s(B)``.

    Unstable (p99 = inf) when ``ρ >= 1``. Summing the three parts and ignoring the service-time
    jitter are the deliberate simplifications; the planner's SLO headroom covers the jitter.
    """

    def p99_ms(self, service: ServiceCurve, batching: Batching, rate_rps: float) -> float:
        if rate_rps < 0 or math.isnan(rate_rps):
            raise InvalidArgument("rate_rps", f"must be >= 0, but got {rate_rps}")
        rate = rate_rps / 1000.0  # per ms
        cap, delay = batching.max_batch, batching.queue_delay_ms
        full = service.ms(cap)
        load = rate * full / cap
        if load >= 1.0:
            return math.inf
        wait = min(delay, _fill_time_p99_ms(cap - 1, rate))
        batch = float(cap)
        for _ in range(64):
            shrunk = min(cap, 1.0 + rate * max(wait, service.ms(batch)))
            if batch - shrunk < 1e-6:
                break
            batch = shrunk
        mean_run = service.ms(batch)
        run = service.ms(max(batch, min(cap, 1 + _poisson_p99(rate * wait, cap - 1))))
        busy = rate * mean_run / batch
        residual = mean_run * (1.0 - 0.01 / busy) if busy > 0.01 else 0.0
        backlog = full / cap * math.log(100.0 * load) / _tail_exponent(load) if load > 0.01 else 0.0
        return max(wait, residual) + run + backlog


def _poisson_p99(mean: float, limit: int) -> int:
    """The 99th percentile of a Poisson count (normal approximation above a mean of 10), at most ``limit``."""
    if mean > 10:
        return min(limit, math.ceil(mean + 2.326 * math.sqrt(mean)))
    count, term = 0, math.exp(-mean)
    total = term
    while total < 0.99 and count < limit:
        count += 1
        term *= mean / count
        total += term
    return count


def _fill_time_p99_ms(others: int, rate: float) -> float:
    """99th percentile of the time until ``others`` more Poisson arrivals (a Gamma quantile, by the
    Wilson-Hilferty approximation); infinite without arrivals."""
    if others <= 0:
        return 0.0
    if rate <= 0:
        return math.inf
    spread = 1.0 / (9.0 * others)
    return others * (1.0 - spread + 2.326 * math.sqrt(spread)) ** 3 / rate


def _tail_exponent(load: float) -> float:
    """The positive root θ of ``load·(e^θ - 1) = θ`` for 0 < load < 1, by Newton's method from above
    (the left side is convex, so the iterates fall monotonically onto the root)."""
    theta = min(2.0 * (1.0 - load) / load, 2.0 * math.log(1.0 / load) + 1.0)
    for _ in range(50):
        grow = load * math.exp(theta)
        step = (grow - load - theta) / (grow - 1.0)
        theta -= step
        if step < 1e-9 * theta:
            break
    return theta


def calibration_factor(model: LatencyModel, service: ServiceCurve, batching: Batching,
                       rate_rps: float, measured_p99_ms: float) -> float:
    """The factor by which to scale a profile's latencies so that ``model`` predicts the measured
    p99 at the measured rate (at least 1: only slow-downs are learnt this way).

    Raises:
        InvalidArgument: a negative rate or a measured p99 that is not positive.
    """
    if not measured_p99_ms > 0:
        raise InvalidArgument("measured_p99_ms", f"must be > 0, but got {measured_p99_ms}")

    def predicted(factor: float) -> float:
        return model.p99_ms(ServiceCurve(service.profile.scaled(factor), service.kind), batching, rate_rps)

    if predicted(1.0) >= measured_p99_ms:
        return 1.0
    low, high = 1.0, 2.0
    while predicted(high) < measured_p99_ms and high < 1e6:
        low, high = high, high * 2
    for _ in range(30):
        middle = (low + high) / 2
        if predicted(middle) < measured_p99_ms:
            low = middle
        else:
            high = middle
    return high
