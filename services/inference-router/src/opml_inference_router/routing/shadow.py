"""Shadow traffic: a copy of a share of the requests the stable version answered, sent to a new version
whose answers nobody receives, and the two versions' outputs compared (a rollout's ``shadow`` step).

The caller never waits for the copy: :meth:`ShadowMirror.mirror` is called once the stable version
answered and only starts a task. The copies in flight are bounded (``max_in_flight``); a copy that
finds the bound reached is shed (counted), never queued, so a slow or failing new version costs the
callers nothing and the router a bounded amount of memory. Each copy's outcome goes to the new
version's :class:`~.window.OutcomeWindow` (the rollout's error_rate and p99 checks read it), and its
output, compared row by row with the stable version's, to the mirror's :class:`DisagreementWindow`
(the ``disagreement`` check).

Comparisons (:func:`~opml_inference_router_contract.rollout_spec.comparison_of` picks one from the
model config): ``classes`` (one class index per row: equal or not), ``scores`` (a vector of class
scores per row: the argmax, ties to the first), ``values`` (one number per row: rows whose relative
difference ``|new - stable| / max(|stable|, 1e-12)`` passes ``tolerance`` disagree; the mean
relative difference is kept too).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import InvalidArgument, OpmlError
from opml_common.kserve_codec import decode_response
from opml_common.metrics import ServiceMetrics
from opml_inference_router.routing import wire
from opml_inference_router.routing.window import OutcomeWindow
from opml_inference_router_contract.rollout_spec import CLASSES, SCORES

log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 64
"""Copies in flight per mirrored model, at most; more are shed."""

Call = Callable[[bytes, float], Awaitable[bytes]]
"""Sends a request (wire bytes) to the new version with a deadline (the clock's time); its response bytes."""


@dataclass(frozen=True)
class ShadowMeasures:
    """One mirror over one interval: copies sent (``mirrored``), shed, failed, the requests whose
    outputs were compared (``compared``, ``rows``), the rows that disagreed, and for ``values`` the
    mean relative difference (0 otherwise)."""

    mirrored: int = 0
    shed: int = 0
    failed: int = 0
    compared: int = 0
    rows: int = 0
    disagreed_rows: int = 0
    mean_difference: float = 0.0

    @property
    def disagreement(self) -> float:
        """The share of compared rows whose outputs differ."""
        return self.disagreed_rows / self.rows if self.rows else 0.0


class DisagreementWindow:
    """What the copies did since :meth:`take`."""

    __slots__ = ("mirrored", "shed", "failed", "compared", "rows", "disagreed_rows", "difference_sum")

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.mirrored = self.shed = self.failed = self.compared = self.rows = self.disagreed_rows = 0
        self.difference_sum = 0.0

    def take(self) -> ShadowMeasures:
        """What happened since the last take; starts a new interval."""
        measures = ShadowMeasures(self.mirrored, self.shed, self.failed, self.compared, self.rows,
                                  self.disagreed_rows, self.difference_sum / self.rows if self.rows else 0.0)
        self._reset()
        return measures


@dataclass(frozen=True)
class Comparison:
    """How rows of ``output`` compare (``kind``: classes, scores or values)."""

    output: str
    kind: str
    tolerance: float = 0.01

    def rows(self, new: bytes, stable: bytes) -> tuple[int, int, float]:
        """Rows compared, rows that disagree, and the sum of their relative differences (values only).

        Raises: InvalidArgument: a response lacks the output, or the two differ in rows."""
        a, b = _output(new, self.output), _output(stable, self.output)
        count = a.shape[0] if a.ndim else 1
        if (b.shape[0] if b.ndim else 1) != count:
            raise InvalidArgument("output", f"{self.output}: {count} rows from the new version, "
                                            f"{b.shape[0] if b.ndim else 1} from the stable one")
        a, b = a.reshape(count, -1), b.reshape(count, -1)
        if self.kind == SCORES:
            return count, int(np.count_nonzero(a.argmax(axis=1) != b.argmax(axis=1))), 0.0
        if self.kind == CLASSES:
            return count, int(np.count_nonzero(np.any(a != b, axis=1))), 0.0
        a, b = a[:, 0].astype(np.float64), b[:, 0].astype(np.float64)
        relative = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
        return count, int(np.count_nonzero(relative > self.tolerance)), float(relative.sum())


def _output(response: bytes, name: str) -> np.ndarray:
    message = pb.ModelInferResponse.FromString(response)
    outputs = decode_response(message)
    if name not in outputs:
        raise InvalidArgument("output", f"the response has no output {name!r} (outputs: {sorted(outputs)})")
    return outputs[name]


class ShadowMetrics:
    """``opml_inference_router_shadow_*``: what the mirrors did, by model and the version mirrored to."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.requests = metrics.counter("shadow_requests_total", "Copies of answered requests mirrored to a "
                                        "rollout's new version, by outcome (answered, failed, shed: the in-flight "
                                        "bound was reached, uncomparable: the outputs could not be compared).",
                                        ("model", "version", "outcome"))
        self.rows = metrics.counter("shadow_compared_rows_total", "Output rows compared between the stable and "
                                    "the mirrored version.", ("model", "version"))
        self.disagreed = metrics.counter("shadow_disagreed_rows_total", "Compared rows whose outputs differ "
                                         "(another class, or a relative difference over the tolerance).",
                                         ("model", "version"))
        self.in_flight = metrics.gauge("shadow_in_flight_requests", "Mirrored copies in flight.",
                                       ("model", "version"))


class ShadowMirror:
    """Mirrors ``percent`` of a model's answered requests to ``version`` through ``call``; the copies'
    outcomes go to ``outcomes`` (the version's window), the comparisons to :attr:`window`."""

    def __init__(self, *, model: str, version: str, percent: float, comparison: Comparison, call: Call,
                 outcomes: OutcomeWindow, metrics: ShadowMetrics, timeout_s: float,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.model, self.version, self.percent, self.comparison = model, version, percent, comparison
        self._call, self._outcomes, self._timeout_s = call, outcomes, timeout_s
        self._max_in_flight, self._clock, self._rng = max_in_flight, clock, rng or random.Random()
        self._tasks: set[asyncio.Task] = set()
        self.window = DisagreementWindow()
        self._answered = metrics.requests.labels(model, version, "answered")
        self._failed = metrics.requests.labels(model, version, "failed")
        self._shed = metrics.requests.labels(model, version, "shed")
        self._uncomparable = metrics.requests.labels(model, version, "uncomparable")
        self._rows, self._disagreed = metrics.rows.labels(model, version), metrics.disagreed.labels(model, version)
        metrics.in_flight.labels(model, version).set_function(lambda: len(self._tasks))

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def mirror(self, request: bytes, answered_by: str, response: bytes) -> None:
        """Starts a copy of ``request``, which ``answered_by`` answered with ``response``, when it is one
        of the share mirrored (the stable version's answers only); returns at once."""
        if answered_by == self.version or self._rng.random() * 100.0 >= self.percent:
            return
        if len(self._tasks) >= self._max_in_flight:
            self.window.shed += 1
            self._shed.inc()
            return
        copy = wire.with_field(request, wire.MODEL_VERSION, self.version)
        self.window.mirrored += 1
        task = asyncio.get_running_loop().create_task(self._send(copy, response), name=f"shadow-{self.model}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, request: bytes, stable_response: bytes) -> None:
        start = self._clock()
        try:
            response = await self._call(request, start + self._timeout_s)
        except OpmlError as error:
            self.window.failed += 1
            self._outcomes.failed(error.code)
            self._failed.inc()
            return
        except Exception:  # noqa: BLE001 - a copy must never break the router; logged, counted as failed
            log.exception("models/%s: mirroring a request to version %s failed", self.model, self.version)
            self.window.failed += 1
            self._outcomes.failed("INTERNAL")
            self._failed.inc()
            return
        self._outcomes.answered(self._clock() - start)
        self._answered.inc()
        try:
            rows, disagreed, difference = self.comparison.rows(response, stable_response)
        except (InvalidArgument, ValueError) as error:
            self._uncomparable.inc()
            log.warning("models/%s: version %s's shadow output not compared: %s", self.model, self.version, error)
            return
        window = self.window
        window.compared += 1
        window.rows += rows
        window.disagreed_rows += disagreed
        window.difference_sum += difference
        self._rows.inc(rows)
        self._disagreed.inc(disagreed)

    async def close(self) -> None:
        """Cancels the copies in flight (nobody waits for their answers)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

