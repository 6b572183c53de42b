"""The four lines' traffic: an event producer that sends each line's patches through the
inference-router's KServe v2 front while the loop's steps run, and labels a share of them late.

Each request holds ``request_rows`` patches of one line (span rows: 16x16 grey levels) and carries
the KServe request parameter ``line`` (``parameters={"line": "3"}``), which the monitoring-scorer can
split its windows by. The lines take turns at ``rate_rps`` requests a second in all. A share of each
line's requests (``label_share``) gets its true labels ``label_delay_s`` later, the way a QA station's
verdicts come: published through the monitoring-scorer's ``SubmitLabels``, i.e. as ``LabelObserved``
events on ``opml.labels.v1`` under the platform's label source, which every monitored model accepts.
The share is small: every 200 labelled rows of a version make the scorer recalibrate its MPP, which
takes it minutes of a core for the story's 256 features on a loaded 2-core machine, and the labels
after them wait. The producer knows every patch's label, so it also keeps each answer's truth
(:meth:`Traffic.accuracy`). A line's lamps (``lighting``) can change while it runs: the story's drift.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as triton
from inspection_data import LINES, inspection_patches, span_features

from opml_monitoring_scorer_contract.client import MonitoringClient

from .context import Story

POOL_ROWS = 2000
"""Patches made at a time for one line under one lighting (a new seed for each pool)."""
TRAFFIC_SEED = 1_000_000
"""Traffic patches' seeds start here, far from the spans' (a span's seed is its day)."""


@dataclass
class Traffic:
    """Sends the lines' requests in a thread from :meth:`start` to :meth:`stop` (a context manager)."""

    story: Story
    model: str
    day: int  # the day the traffic is of (its patches' seeds)
    lighting: dict[int, float]  # each line's lamps now (1: as installed); change it with :meth:`set_lighting`
    sent: Counter = field(default_factory=Counter)  # answered requests by (version, line)
    answers: list = field(default_factory=list)  # (time.time(), version, line, rows right, rows): the truth
    failed: Counter = field(default_factory=Counter)  # by gRPC status
    labelled: int = 0  # requests whose labels were published
    errors: deque = field(default_factory=lambda: deque(maxlen=3))
    _pools: dict[tuple[int, float], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _seeds: Counter = field(default_factory=Counter)
    _due: deque = field(default_factory=deque)  # (when, request id, labels)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def set_lighting(self, line: int, lighting: float) -> None:
        with self._lock:
            self.lighting[line] = lighting

    def answered(self, version: str | None = None) -> int:
        return sum(n for (v, _), n in self.sent.items() if version is None or v == version)

    def accuracy(self, version: str, since: float, until: float = float("inf")) -> dict[str, float]:
        """Per line ("1".."4") and for "all", the share of the version's rows answered between ``since``
        and ``until`` that were right (the producer knows every patch's label: the truth the scorer's
        late labels sample)."""
        totals: dict[str, list[int]] = {}
        for at, answered_by, line, right, rows in list(self.answers):
            if answered_by == version and since <= at < until:
                for key in (str(line), "all"):
                    total = totals.setdefault(key, [0, 0])
                    total[0] += right
                    total[1] += rows
        return {key: right / rows for key, (right, rows) in sorted(totals.items())}

    def _patches(self, line: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The line's next ``rows`` patches under its lighting now (span features, labels)."""
        with self._lock:
            lighting = self.lighting.get(line, 1.0)
        key = (line, lighting)
        pool = self._pools.get(key)
        if pool is None or len(pool[1]) < rows:
            self._seeds[key] += 1
            images, labels = inspection_patches(POOL_ROWS, TRAFFIC_SEED + 1000 * self.day + self._seeds[key],
                                                line=line, lighting=lighting)
            pool = (span_features(images).astype(np.float32), labels)
        features, labels = pool[0][:rows], pool[1][:rows]
        self._pools[key] = (pool[0][rows:], pool[1][rows:])
        return features, labels

    def _run(self) -> None:
        scale = self.story.scale
        every = 1.0 / scale.rate_rps
        lines = sorted(LINES)
        with triton.InferenceServerClient(self.story.inference_target) as kserve, \
                MonitoringClient(self.story.scorer_target) as scorer:
            turn, next_at = 0, time.monotonic()
            while not self._stop.is_set():
                line = lines[turn % len(lines)]
                turn += 1
                features, labels = self._patches(line, scale.request_rows)
                request = triton.InferInput("features", list(features.shape), "FP32")
                request.set_data_from_numpy(features)
                request_id = f"line{line}-{uuid.uuid4().hex}"
                try:
                    answer = kserve.infer(self.model, [request], request_id=request_id,
                                          parameters={"line": str(line)}, client_timeout=10)
                    version = answer.get_response().model_version
                    self.sent[(version, line)] += 1
                    right = int((answer.as_numpy("defect_scores").argmax(axis=1) == labels).sum())
                    self.answers.append((time.time(), version, line, right, len(labels)))
                    if self.sent[(version, line)] % round(1 / scale.label_share) == 0:
                        self._due.append((time.monotonic() + scale.label_delay_s, request_id,
                                          [float(v) for v in labels]))
                except triton.InferenceServerException as error:
                    self.failed[error.status() or "error"] += 1
                    self.errors.append(str(error)[:200])
                self._publish_labels(scorer)
                next_at += every
                self._stop.wait(max(0.0, next_at - time.monotonic()))
                next_at = max(next_at, time.monotonic() - 1.0)  # a stall is not made up in a burst

    def _publish_labels(self, scorer: MonitoringClient) -> None:
        """The labels whose delay has passed, in one call."""
        now, ready = time.monotonic(), []
        while self._due and self._due[0][0] <= now and len(ready) < 1000:
            _, request_id, values = self._due.popleft()
            ready.append((request_id, values, None))
        if ready:
            try:
                self.labelled += scorer.submit_labels(self.model, ready)
            except Exception as error:  # noqa: BLE001 - a label lost is a gap in the truth, not a failed story
                self.errors.append(f"labels: {error}"[:200])
