"""Metrics collectors: the lines a trial's job writes -> (metric, value) observations, in order.

Every kind reads the job's log stream from the job-orchestrator (the primary task: the chief, else
worker 0), so no sidecar and no path from the job to the controller are needed:

- ``StdOut`` (Katib's default): every line, each match of the filters (Katib's default filter
  ``([\\w|-]+)\\s*=\\s*([+-]?\\d*(\\.\\d+)?([Ee][+-]?\\d+)?)``, or the experiment's
  ``metricsFormat`` regexes, each with a name group and a value group).
- ``File``: the trial's command runs under :mod:`opml_automl_controller.filetail`, which copies each
  line the program appends to the file into the log with :data:`FILE_MARKER`; TEXT lines are
  matched as StdOut's, JSON lines are objects whose keys are metric names (Katib's JSON format).
- ``Push``: the trial calls :func:`opml_automl_controller.sdk.report`, which writes one
  :data:`PUSH_MARKER` line of JSON; only those lines count.
- ``Trace`` (ours): the job runs traced (``trace: true``); the trace-collector's tracer sends the
  ``logs`` of each Keras epoch with its step metrics on opml.traces.v1, the controller stores them
  per trial (:mod:`opml_automl_controller.tracing`) and :func:`epoch_observations` turns them into
  the same observations, one per epoch in order. No log line counts (the log is still followed for
  the job's end and :data:`MODEL_MARKER`).

Only the objective and additional metrics are kept (Katib does the same), values that do not
parse as finite numbers are dropped.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from opml_automl_controller.experiment import CollectorKind, MetricsCollector

DEFAULT_FILTER = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"
"""Katib's StdOut and File TEXT default (pkg/metricscollector/v1beta1/common)."""
PUSH_MARKER = "[opml-automl-push] "
FILE_MARKER = "[opml-automl-file] "
MODEL_MARKER = "[opml-automl-model] "
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
MAX_LINE_CHARS = 64 * 1024
"""Longer lines are cut before matching (a trial printing a huge line costs no more than this)."""


@dataclass(frozen=True, slots=True)
class Observation:
    metric: str
    value: float


class MetricsParser:
    """Turns a trial's log, line by line, into observations of the experiment's metrics."""

    def __init__(self, collector: MetricsCollector, metrics: Iterable[str]) -> None:
        self._kind = collector.kind
        self._json = collector.kind is CollectorKind.FILE and collector.file_format == "JSON"
        self._filters = [re.compile(f) for f in (collector.filters or (DEFAULT_FILTER,))]
        self._metrics = frozenset(metrics)
        self._partial = ""
        self.model_bundle: str | None = None
        """The uuid of the bundle the trial said it uploaded (:func:`opml_automl_controller.sdk.save_model`),
        if it did: the trial's word, a hint; the controller asks the bundle-store before it commits."""

    def feed(self, text: str) -> list[Observation]:
        """Observations in the complete lines of ``text`` (a chunk of the log; a line cut between
        chunks is kept until its end arrives)."""
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()[-MAX_LINE_CHARS:]
        return [o for line in lines for o in self.line(line)]

    def close(self) -> list[Observation]:
        """What the last line, with no newline at its end, holds."""
        rest, self._partial = self._partial, ""
        return list(self.line(rest)) if rest else []

    def line(self, line: str) -> Iterator[Observation]:
        line = line[:MAX_LINE_CHARS].rstrip("\r")
        if line.startswith(MODEL_MARKER):
            try:
                uuid = json.loads(line[len(MODEL_MARKER):]).get("uuid")
            except (ValueError, AttributeError):
                uuid = None
            if isinstance(uuid, str) and _UUID.fullmatch(uuid):
                self.model_bundle = uuid
            return
        if self._kind is CollectorKind.TRACE:
            return
        if self._kind is CollectorKind.PUSH:
            if line.startswith(PUSH_MARKER):
                yield from self._from_json(line[len(PUSH_MARKER):], key="metrics")
            return
        if self._kind is CollectorKind.FILE:
            if not line.startswith(FILE_MARKER):
                return
            line = line[len(FILE_MARKER):]
            if self._json:
                yield from self._from_json(line, key=None)
                return
        elif line.startswith((PUSH_MARKER, FILE_MARKER)):
            return
        for pattern in self._filters:
            for match in pattern.finditer(line):
                name, value = match.group(1).strip(), _number(match.group(2))
                if name in self._metrics and value is not None:
                    yield Observation(name, value)

    def _from_json(self, text: str, *, key: str | None) -> Iterator[Observation]:
        try:
            record = json.loads(text)
        except ValueError:
            return
        if key is not None:
            record = record.get(key) if isinstance(record, dict) else None
        if not isinstance(record, dict):
            return
        for name, raw in record.items():
            value = _number(raw)
            if name in self._metrics and value is not None:
                yield Observation(str(name), value)


def epoch_observations(epochs: Iterable[tuple[tuple[int, int], dict[str, float]]], metrics: Iterable[str],
                       seen: set[tuple[int, int]]) -> list[Observation]:
    """The observations of the epochs not in ``seen`` (added to it), in (fit, epoch) order: for each,
    the experiment's metrics its logs hold, as finite numbers."""
    wanted = tuple(metrics)
    found = []
    for key, logs in sorted(epochs, key=lambda item: item[0]):
        if key in seen:
            continue
        seen.add(key)
        for name in wanted:
            value = _number(logs.get(name)) if name in logs else None
            if value is not None:
                found.append(Observation(name, value))
    return found


def _number(raw: object) -> float | None:
    if isinstance(raw, bool):
        return None
    try:
        value = float(str(raw).strip()) if not isinstance(raw, int | float) else float(raw)
    except (ValueError, OverflowError):  # OverflowError: a JSON integer past a float's range
        return None
    return value if math.isfinite(value) else None


def summarize(values: list[float], strategy: str) -> float | None:
    """One value of a metric's series: Katib's metricStrategies min, max or latest."""
    if not values:
        return None
    if strategy == "min":
        return min(values)
    if strategy == "max":
        return max(values)
    return values[-1]
