"""The scorer's domain: registered model versions, closing a window (score, history, rules, alerts)
and joining late labels. The stream (stream.py) feeds it; the servicer queries it.

Registrations and rule overrides live in Redis, shared by every scorer process of the group: a
version registered through another process's API (or its deployments consumer: one process of the
group handles each ModelDeployed) is adopted from Redis when its predictions first come to this one
(:meth:`Scorer.adopt`), and a version's rules are re-read from Redis at each window close, so rules
set through any process apply wherever the version's partition is scored.

Every change is announced here, once: an alert raised or resolved is saved, then emitted through the
outbox (at least once; the event id is derived from the model version, rule, change and window, so a
replay after a crash re-announces it under the same id and consumers that deduplicate apply it once).
Each window saved, at its close and each time labels join it (once per batch of labels), is announced
as WindowScored on ``opml.quality.v1`` (its id derived from the version, window and labels joined),
which a progressive rollout of the inference-router compares versions with.

A version monitored per segment (monitoring.yaml ``segment``, core/segments.py) has, besides its own
windows (segment "", every prediction), windows per segment: each scored by the segment's monitor,
saved, announced and stepping its own rule states under the segment's key
(``{model}/{version}#{segment}``), its events and alerts carrying the segment. A segment's monitor is
fitted on the reference rows of its value (reference.npz's ``segment.<parameter>`` column: its drift
baselines, CBPE calibration and MPP), so a segment whose inputs differ from the others' by design is
judged against its own; the value ranges of data quality stay the whole reference's. A segment with
fewer than ``MIN_SEGMENT_ROWS`` reference rows (or a reference without the column) is judged against
the whole reference, and the status's limitations say so. A label joins the prediction's window of the
version and of its segment in one step, and teaches both their MPPs.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
import uuid
import zipfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opml.inference.v1 import events_pb2 as inference_events
from opml.monitoring.v1 import alert_events_pb2, label_events_pb2, quality_events_pb2

from opml_common.bus import UntrustedSource
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, brief
from opml_common.events import EventEmitter
from opml_common.lifecycle import Component
from opml_monitoring_scorer.core.config import MonitoringConfig
from opml_monitoring_scorer.core.decode import Batch, decode_prediction, decode_predictions
from opml_monitoring_scorer.core.monitor import ModelMonitor, WindowScore
from opml_monitoring_scorer.core.mpp import MPP
from opml_monitoring_scorer.core.records import AlertRecord, window_record
from opml_monitoring_scorer.core.reference import ReferenceSet, Task
from opml_monitoring_scorer.core.refits import Refits
from opml_monitoring_scorer.core.rules import Rule, RuleState, Transition, observe, parse_rules, step
from opml_monitoring_scorer.core.segments import SEPARATOR, window_key
from opml_monitoring_scorer.metrics import ScorerMetrics
from opml_monitoring_scorer.state import LabelOrigin, MonitorStore, ParkedLabel, TruthJoin, values_digest
from opml_monitoring_scorer_contract.names import LABEL_SOURCE
from opml_monitoring_scorer_contract.reference import (
    MAX_REFERENCE_BYTES,
    MAX_REFERENCE_ROWS,
    REFERENCE_FILE,
    reference_npz,
)
from opml_monitoring_scorer_contract.reference import MONITORING_FILE as CONFIG_FILE

log = logging.getLogger(__name__)

MAX_RULES_BYTES = 64 * 1024
MIN_SEGMENT_ROWS = 100
"""Fewest reference rows of a segment's value that make its own monitor (fewer: the whole reference's):
the reference set's own minimum, below which drift tests and calibrations are mostly noise."""
MAX_BASELINE_ROWS = 10_000
MAX_BASELINE_BYTES = 32 * 1024 * 1024
"""The most of a first window kept as the baseline of a version without a reference (its first rows)."""
MAX_SOURCE_SHOWN = 200
"""Characters of a refused label's source quoted in the dead-letter reason."""
MAX_SUBMITTED_LABELS = 1000
"""Most labels one SubmitLabels call publishes."""
MAX_REQUEST_ID_CHARS = 256
MAX_LABEL_VALUES = 100_000
BundleLoader = Callable[[str, str], Awaitable[tuple[str, dict[str, bytes]]]]
"""(context, bundle ref) -> (bundle uuid, {file name: bytes} of the files the scorer reads)."""


def model_version(model: str, version: str) -> str:
    return f"{model}/{version}"


def load_reference(data: bytes, *, task: Task | None, min_rows: int = 100) -> ReferenceSet:
    """``reference.npz``: ``feature.<name>`` columns, ``predicted``, optional ``scores``, ``labels`` and
    ``segment.<parameter>`` columns.

    Raises:
        InvalidArgument: the file is too large (stored or expanded), not an npz, an array holds more
            than ``MAX_REFERENCE_ROWS`` rows, or its arrays break the rules (all named).
    """
    if len(data) > MAX_REFERENCE_BYTES:
        raise InvalidArgument(REFERENCE_FILE, f"holds {len(data)} bytes, more than {MAX_REFERENCE_BYTES}")
    _check_sizes(data)
    try:
        arrays = dict(np.load(io.BytesIO(data), allow_pickle=False))
    except Exception as exc:  # noqa: BLE001 - zipfile/np raise many types for a bad file
        raise InvalidArgument(REFERENCE_FILE, f"is not a numpy .npz of arrays: {brief(str(exc))}") from None
    features = {k.removeprefix("feature."): v for k, v in arrays.items() if k.startswith("feature.")}
    segments = {k.removeprefix("segment."): v for k, v in arrays.items() if k.startswith("segment.")}
    if "predicted" not in arrays:
        raise InvalidArgument(f"{REFERENCE_FILE}.predicted", "is missing: the model's outputs on the reference")
    scores = arrays.get("scores")
    if task is None:
        task = (Task.REGRESSION if scores is None
                else Task.MULTICLASS if scores.ndim == 2 and scores.shape[1] > 2 else Task.BINARY)
    return ReferenceSet.build(task=task, features=features, predicted=arrays["predicted"], scores=scores,
                              labels=arrays.get("labels"), segments=segments, min_rows=min_rows)


def _check_sizes(data: bytes) -> None:
    """What an npz expands to, from its zip directory and its arrays' .npy headers, before any array
    is read: a compressed npz of zeros is about a thousandth of its arrays' size.

    Raises: InvalidArgument: not an npz, expanded over ``MAX_REFERENCE_BYTES``, or an array of more
        than ``MAX_REFERENCE_ROWS`` rows."""
    problems = []
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
            expanded = sum(entry.file_size for entry in entries)
            if expanded > MAX_REFERENCE_BYTES:
                raise InvalidArgument(REFERENCE_FILE, f"expands to {expanded} bytes, more than {MAX_REFERENCE_BYTES}")
            for entry in entries:
                with archive.open(entry) as stream:
                    version = np.lib.format.read_magic(stream)
                    header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                              else np.lib.format.read_array_header_2_0)
                    shape = header(stream)[0]
                if shape and shape[0] > MAX_REFERENCE_ROWS:
                    problems.append((f"{REFERENCE_FILE}.{entry.filename.removesuffix('.npy')}",
                                     f"holds {shape[0]} rows, more than {MAX_REFERENCE_ROWS}"))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise InvalidArgument(REFERENCE_FILE, f"is not a numpy .npz of arrays: {brief(str(exc))}") from None
    if problems:
        raise InvalidArgument.of(problems)


def dump_reference(reference: ReferenceSet) -> bytes:
    """The inverse of :func:`load_reference` (tests and benches)."""
    return reference_npz(reference.features, predicted=reference.outputs.predicted, scores=reference.outputs.scores,
                         labels=reference.labels, segments=reference.segments)


@dataclass(frozen=True)
class SubmittedLabel:
    """The truth of one served request, as a user submits it: its values (one per row), known at
    ``time`` (epoch seconds; None: when submitted)."""

    request_id: str
    values: tuple[float, ...]
    time: float | None = None


@dataclass(frozen=True)
class Joinable:
    """A prediction a late label may join: its version, window index, PredictionMade bytes, request id
    (and the source partition it came from, for the stream's bookkeeping), and its segment and the
    segment's window index ("" and -1: in none)."""

    key: str
    window: int
    raw_event: bytes
    request_id: str
    partition: int = -1
    segment: str = ""
    segment_window: int = -1


@dataclass
class Monitored:
    model: str
    version: str
    context: str
    bundle: str
    bundle_uuid: str
    source: str                     # "api" or "deployment"
    config: MonitoringConfig
    monitor: ModelMonitor | None    # None until a reference exists (none in the bundle: the first window)
    rules: tuple[Rule, ...]
    limitations: list[str] = field(default_factory=list)
    rules_text: str | None = None
    """The rules override (SetRules) ``rules`` was parsed from; None: the config's rules."""
    segments: dict[str, ModelMonitor] = field(default_factory=dict)
    """Each segment's monitor, made when first needed (:meth:`Scorer.segment_monitor`)."""

    @property
    def key(self) -> str:
        return model_version(self.model, self.version)


class Unscorable(Exception):
    """A window the estimators cannot score: it would fail the same way on every retry."""


class Scorer(Component):
    """Side effects: ``restore()`` rebuilds every registered version's monitor from its bundle;
    ``start()`` restores, ``stop()`` does nothing.

    ``label_sources``: the producers whose labels are accepted for every model (besides the ones each
    model's monitoring.yaml names). ``label_emitter``: where :meth:`submit_labels` publishes, under the
    platform's label source (default: ``emitter`` under :data:`LABEL_SOURCE`)."""

    def __init__(self, *, store: MonitorStore, emitter: EventEmitter, metrics: ScorerMetrics,
                 load_bundle: BundleLoader, seed: int = 0,
                 label_sources: frozenset[str] = frozenset({LABEL_SOURCE}),
                 label_emitter: EventEmitter | None = None, refits: Refits | None = None) -> None:
        super().__init__()
        self.store = store
        self.label_sources = frozenset(label_sources)
        self.emitter = emitter
        self.label_emitter = label_emitter if label_emitter is not None else emitter.with_source(LABEL_SOURCE)
        self.metrics = metrics
        self.load_bundle = load_bundle
        self.seed = seed
        self.models: dict[str, Monitored] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.refits = refits if refits is not None else Refits()

    async def on_start(self) -> None:
        await self.restore()

    async def on_stop(self) -> None:
        await self.refits.stop()

    async def restore(self) -> None:
        for key, saved in (await self.store.registrations()).items():
            try:
                await self._build(saved["model"], saved["version"], saved["context"], saved["bundle_uuid"],
                                  source=saved["source"], save=False)
            except Exception as exc:  # noqa: BLE001 - one broken registration never stops the others
                log.error("monitoring of %s not restored: %s", key, exc)

    # ------------------------------------------------------------------ registration
    async def register(self, model: str, version: str, context: str, bundle: str, *, source: str = "api") -> Monitored:
        """Monitors ``model`` ``version`` from bundle ``bundle`` of ``context``.

        Raises:
            InvalidArgument: a name is empty, or the bundle's monitoring.yaml / reference.npz are invalid.
            NotFound: the bundle does not exist. Unavailable: the bundle-store cannot be reached.
        """
        problems = [(f, "must not be empty") for f, v in (("model", model), ("version", version),
                                                          ("reference.context", context),
                                                          ("reference.bundle", bundle)) if not v]
        if problems:
            raise InvalidArgument.of(problems)
        return await self._build(model, version, context, bundle, source=source, save=True)

    async def monitor_unreferenced(self, model: str, version: str, *, source: str = "deployment") -> Monitored:
        """Monitors ``model`` ``version`` with no bundle (the router deployed it from a directory, which
        is on the router's machine, not the scorer's): the default config, the first window as the baseline."""
        key = model_version(model, version)
        if key in self.models:
            return self.models[key]
        return await self._build(model, version, "", "", source=source, save=True)

    async def _build(self, model: str, version: str, context: str, bundle: str, *, source: str,
                     save: bool) -> Monitored:
        """``bundle`` empty: no bundle to read (see :meth:`monitor_unreferenced`)."""
        bundle_uuid, files = await self.load_bundle(context, bundle) if bundle else ("", {})
        config = MonitoringConfig()
        if CONFIG_FILE in files:
            config = MonitoringConfig.parse(files[CONFIG_FILE], what=CONFIG_FILE)
        monitor, limitations = None, []
        if REFERENCE_FILE in files:
            reference = load_reference(files[REFERENCE_FILE], task=config.task)
            monitor = await asyncio.to_thread(ModelMonitor, reference, config, seed=self.seed)
            limitations = list(monitor.limitations)
            if config.segment_parameter and config.segment_parameter not in reference.segments:
                limitations.append(f"the reference has no segment.{config.segment_parameter} column: every segment "
                                   "is judged against the whole reference")
        elif not bundle:
            limitations.append("deployed without a bundle (from a directory): default monitoring config, drift "
                               "and data quality against the first window, no performance estimate")
        else:
            limitations.append(f"the bundle has no {REFERENCE_FILE}: drift and data quality against the first "
                               "window, no performance estimate")
        key = model_version(model, version)
        if monitor is None and (kept := await self.store.baseline(key)) is not None:
            monitor = await asyncio.to_thread(_kept_monitor, kept, config)
        await self.store.add_label_producers(config.label_producers)
        rules = config.rules
        override = await self.store.get_rules(key)
        if override is not None:
            rules = _rules_of(override)
        monitored = Monitored(model, version, context, bundle, bundle_uuid, source, config, monitor, rules,
                              limitations, override)
        self.models[key] = monitored
        self.metrics.registered.set(len(self.models))
        if save:
            await self.store.save_registration(key, {"model": model, "version": version, "context": context,
                                                     "bundle": bundle, "bundle_uuid": bundle_uuid, "source": source})
        log.info("monitoring %s from %s (%s)", key, f"bundle {context}/{bundle_uuid}" if bundle else "no bundle",
                 "; ".join(limitations) or "full")
        return monitored

    async def adopt(self, key: str) -> Monitored | None:
        """The version ``key`` as another scorer process registered it (in Redis), built here; None when
        nobody registered it.

        Raises: what :meth:`register` raises (the bundle is gone or invalid; Unavailable)."""
        if key in self.models:
            return self.models[key]
        saved = await self.store.registration(key)
        if saved is None:
            return None
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self.models:
                await self._build(saved["model"], saved["version"], saved["context"], saved["bundle_uuid"],
                                  source=saved["source"], save=False)
        return self.models[key]

    async def find(self, key: str) -> Monitored:
        """``key`` (model/version) as registered through any scorer process, its rules as last set.

        Raises: NotFound: nobody registered it; what :meth:`adopt` raises."""
        monitored = await self.adopt(key)
        if monitored is None:
            return self.get(key)  # raises NotFound
        await self._refresh_rules(monitored)
        return monitored

    async def _refresh_rules(self, monitored: Monitored) -> None:
        """The rules override as set through any scorer process (Redis)."""
        override = await self.store.get_rules(monitored.key)
        if override is not None and override != monitored.rules_text:
            monitored.rules, monitored.rules_text = _rules_of(override), override

    async def on_deployed(self, event: inference_events.PredictionMade | object) -> Monitored | None:
        """A ModelDeployed: monitors the deployed version from its bundle; a model_dir deploy's directory
        is a path on the router's machine, so that version is monitored with its first window as baseline."""
        deployment, version = event.deployment, event.version
        status = next((v for v in deployment.versions if v.version == version), None)
        if status is None:
            log.warning("deployment of %s names no status of its version %s: not monitored", deployment.model,
                        version)
            return None
        if not status.HasField("bundle"):
            return await self.monitor_unreferenced(deployment.model, str(version))
        key = model_version(deployment.model, str(version))
        if key in self.models and self.models[key].bundle_uuid == status.bundle_uuid:
            return self.models[key]
        return await self.register(deployment.model, str(version), status.bundle.context,
                                   status.bundle_uuid or status.bundle.bundle, source="deployment")

    def get(self, key: str) -> Monitored:
        """Raises: NotFound: ``key`` (model/version) is not monitored."""
        monitored = self.models.get(key)
        if monitored is None:
            raise NotFound(f"models/{key.replace('/', '/versions/', 1)} is not monitored")
        return monitored

    async def set_rules(self, key: str, text: str) -> tuple[Rule, ...]:
        """Raises: NotFound; InvalidArgument: the YAML is too large, invalid, or a rule breaks one (rules[i].field)."""
        monitored = await self.find(key)
        if len(text.encode()) > MAX_RULES_BYTES:
            raise InvalidArgument("yaml", f"holds more than {MAX_RULES_BYTES} bytes")
        rules = _rules_of(text)
        await self.store.set_rules(key, text)
        monitored.rules, monitored.rules_text = rules, text
        return rules

    # ------------------------------------------------------------------ the stream's calls
    def decode(self, monitored: Monitored, event: inference_events.PredictionMade) -> Batch:
        """Raises: InvalidArgument: the KServe v2 messages do not decode, or their columns or scores
        disagree with the reference (:meth:`ModelMonitor.check`); the stream dead-letters it."""
        config = monitored.config
        task = monitored.monitor.task if monitored.monitor else (config.task or Task.MULTICLASS)
        return self._checked(monitored, decode_prediction(
            event, task=task, feature_names=config.feature_names, scores_output=config.scores_output,
            predicted_output=config.predicted_output))

    def decode_many(self, monitored: Monitored, events: Sequence[inference_events.PredictionMade],
                    ) -> tuple[Batch, list[int]]:
        """Events of one version decoded together: their rows, and each event's row count.

        Raises: InvalidArgument: one does not decode or disagrees with the reference, or their layouts
            differ (decode them one by one)."""
        config = monitored.config
        task = monitored.monitor.task if monitored.monitor else (config.task or Task.MULTICLASS)
        batch, counts = decode_predictions(events, task=task, feature_names=config.feature_names,
                                           scores_output=config.scores_output,
                                           predicted_output=config.predicted_output)
        return self._checked(monitored, batch), counts

    @staticmethod
    def _checked(monitored: Monitored, batch: Batch) -> Batch:
        if monitored.monitor is not None:  # none yet: the first window becomes the reference
            monitored.monitor.check(batch)
        return batch

    async def close_window(self, key: str, index: int, events: list[bytes], first_time: float,
                           last_time: float) -> WindowScore | None:
        """Scores a closed window of PredictionMade bytes (see :meth:`score_window`)."""
        monitored = self.get(key)
        batches = []
        for raw in events:
            try:
                batches.append(self.decode(monitored, inference_events.PredictionMade.FromString(raw)))
            except InvalidArgument:  # checked when it arrived; a config change may have made it undecodable
                self.metrics.rejected.labels("malformed").inc()
        return await self.score_window(key, index, Batch.concat(batches), first_time, last_time)

    async def score_window(self, key: str, index: int, batch: Batch, first_time: float | None,
                           last_time: float | None, *, segment: str = "") -> WindowScore | None:
        """Scores a closed window (its events' rows, decoded as they arrived) of the version ``key``, or
        of its ``segment``, saves it, steps the rules (once per window: a replayed close does not step
        them again) and emits the alerts' changes.

        Raises: Unscorable: the estimators fail on its rows, or a segment's window closed before the
            version has a baseline (what the store raises propagates)."""
        started = time.perf_counter()
        monitored = self.get(key)
        wk = window_key(key, segment)
        first_time = first_time if first_time is not None else 0.0
        last_time = last_time if last_time is not None else first_time
        if monitored.monitor is None:
            if not len(batch):
                return None
            if segment:  # the version's own window (every prediction) is the baseline, not one segment's
                raise Unscorable(f"window {index} of {wk} cannot be scored: {key} has no baseline yet")
            monitored.monitor = await self._baseline(monitored, index, batch)
        monitor = await self.segment_monitor(monitored, segment)
        try:
            score = await asyncio.to_thread(monitor.score, batch, index=index, first_time=first_time,
                                            last_time=last_time)
        except Exception as exc:  # noqa: BLE001 - pure computation: it would fail again on a retry
            raise _unscorable(wk, index, exc) from exc
        labelled, total = await self.store.truth(wk, index)
        if labelled:
            score.labelled, score.true = labelled, total / labelled
        record = window_record(score, segment=segment)
        if segment:
            await self.store.add_segment(key, segment)
        await self.store.save_window(wk, record)
        self._announce_window(monitored, record)
        await self._apply_rules(monitored, score, segment)
        self._export(monitored, score, segment)
        self.metrics.close_seconds.labels(monitored.model, monitored.version, segment).observe(
            time.perf_counter() - started)
        return score

    async def segment_monitor(self, monitored: Monitored, segment: str) -> ModelMonitor | None:
        """The monitor of ``segment``'s windows ("": the version's own): fitted on the reference rows of
        the segment's value, made the first time it is asked for; the version's monitor where the
        reference has fewer than ``MIN_SEGMENT_ROWS`` of them or none (said in the limitations), or
        where they make no monitor."""
        monitor = monitored.monitor
        if not segment or monitor is None:
            return monitor
        if (found := monitored.segments.get(segment)) is not None:
            return found
        parameter = monitored.config.segment_parameter
        rows = monitor.reference.segment(parameter, segment) if parameter else None
        built = monitor
        if rows is not None and len(rows) < MIN_SEGMENT_ROWS:
            monitored.limitations.append(f"segment {segment[:64]}: {len(rows)} reference rows, fewer than "
                                         f"{MIN_SEGMENT_ROWS}: judged against the whole reference")
        elif rows is not None:
            try:
                built = await asyncio.to_thread(ModelMonitor, rows, monitored.config, seed=self.seed,
                                                quality=monitor.quality)
            except Exception as exc:  # noqa: BLE001 - pure computation: the whole reference still judges it
                monitored.limitations.append(f"segment {segment[:64]}: its reference rows make no monitor "
                                             f"({brief(str(exc), 200)}): judged against the whole reference")
        return monitored.segments.setdefault(segment, built)

    async def _baseline(self, monitored: Monitored, index: int, batch: Batch) -> ModelMonitor:
        """No reference: the first window closed is the baseline. Its rows (the first, bounded) are kept
        in Redis once a monitor is built from them, the first kept staying, so a restarted scorer, or
        another process adopting the version, builds the same baseline (it took the first window it
        closed, maybe one already drifted, and the drift was gone).

        Raises: Unscorable: the rows make no baseline (what the store raises propagates)."""
        try:
            monitor, data = await asyncio.to_thread(_bootstrap_monitor, batch, monitored.config)
        except Exception as exc:  # noqa: BLE001 - pure computation: it would fail again on a retry
            raise _unscorable(monitored.key, index, exc) from exc
        kept = await self.store.keep_baseline(monitored.key, data)
        return monitor if kept is None else await asyncio.to_thread(_kept_monitor, kept, monitored.config)

    async def _apply_rules(self, monitored: Monitored, score: WindowScore, segment: str = "") -> None:
        """Steps the rules of the version's (or its ``segment``'s) states: each segment counts its own
        ``for`` and ``clear_after`` windows."""
        key = window_key(monitored.key, segment)
        await self._refresh_rules(monitored)  # set through any scorer process
        saved = await self.store.rule_states(key)
        states: dict[str, dict] = {}
        for rule in monitored.rules:
            data = saved.get(rule.name, {})
            if data.get("last_window", -1) >= score.index:
                continue  # this window was applied before a crash
            state = RuleState(firing=data.get("firing", False), breach_run=data.get("breach_run", 0),
                              clear_run=data.get("clear_run", 0), raised_at_window=data.get("raised_at_window"))
            change = step(rule, state, observe(rule, score.signals(), score.drift_signals()), score.index)
            if change is not None:
                await self._announce(monitored, change, score, segment)
            states[rule.name] = {"firing": state.firing, "breach_run": state.breach_run,
                                 "clear_run": state.clear_run, "raised_at_window": state.raised_at_window,
                                 "last_window": score.index}
            self.metrics.firing.labels(monitored.model, monitored.version, segment, rule.name).set(
                1 if state.firing else 0)
        await self.store.save_rule_states(key, states)

    async def _announce(self, monitored: Monitored, change: Transition, score: WindowScore, segment: str) -> None:
        rule, obs = change.rule, change.observation
        bound = rule.under if rule.under is not None else (rule.over if rule.over is not None else 0.0)
        evidence = alert_events_pb2.AlertEvidence(window=score.index, signal=rule.signal, value=obs.value or 0.0,
                                                  bound=bound, features=obs.evidence, rows=score.rows,
                                                  score=score.score)
        evidence.window_end.FromNanoseconds(int(score.last_time * 1e9))
        raised_at = change.raised_at_window if change.raised_at_window is not None else score.index
        record = AlertRecord(monitored.model, monitored.version, rule.name, rule.signal, raised_at, obs.value,
                             dict(obs.evidence), None if change.raised else score.index, segment)
        await self.store.save_alert(record)
        kind = "raised" if change.raised else "resolved"
        wk = window_key(monitored.key, segment)
        event_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"opml-monitoring/{wk}/{rule.name}/{kind}/{score.index}"))
        subject = f"models/{monitored.model}/versions/{monitored.version}"
        if change.raised:
            message = alert_events_pb2.AlertRaised(model=monitored.model, version=monitored.version, rule=rule.name,
                                                   evidence=evidence, segment=segment)
        else:
            message = alert_events_pb2.AlertResolved(model=monitored.model, version=monitored.version,
                                                     rule=rule.name, raised_at_window=raised_at, evidence=evidence,
                                                     segment=segment)
        self.emitter.emit(message, subject=subject, id=event_id)
        self.metrics.alerts.labels(monitored.model, monitored.version, segment, rule.name, kind).inc()
        log.warning("alert %s %s on %s at window %d: %s=%s", rule.name, kind, wk, score.index,
                    rule.signal, obs.value)

    def _announce_window(self, monitored: Monitored, record: dict) -> None:
        """WindowScored for a window as saved (``record``: :func:`window_record`'s)."""
        task = monitored.monitor.task if monitored.monitor is not None else None
        estimator = "cbpe" if record.get("cbpe") is not None else "mpp" if record.get("mpp") is not None else ""
        segment = record.get("segment", "")
        message = quality_events_pb2.WindowScored(
            model=monitored.model, version=monitored.version, window=record["index"], rows=record["rows"],
            task=task.value if task is not None else "", estimator=estimator, labelled=record.get("labelled", 0),
            score=record["score"], segment=segment)
        message.first_time.FromNanoseconds(int(record["first_time"] * 1e9))
        message.last_time.FromNanoseconds(int(record["last_time"] * 1e9))
        if estimator:
            message.estimate = record[estimator]
        if record.get("true") is not None:
            message.true_value = record["true"]
        wk = window_key(monitored.key, segment)
        event_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"opml-monitoring/{wk}/window/{record['index']}/"
                                                      f"{message.labelled}"))
        self.emitter.emit(message, subject=f"models/{monitored.model}/versions/{monitored.version}", id=event_id)

    def _export(self, monitored: Monitored, score: WindowScore, segment: str) -> None:
        m, v, s = monitored.model, monitored.version, segment
        self.metrics.windows.labels(m, v, s).inc()
        self.metrics.score.labels(m, v, s).set(score.score)
        for name, value in (("mpp", score.mpp), ("cbpe", score.cbpe), ("true", score.true)):
            if value is not None:
                self.metrics.estimate.labels(m, v, s, name).set(value)
        for name, drift in score.drift.items():
            self.metrics.drift.labels(m, v, s, name).set(drift.distance)
        self.metrics.drifted.labels(m, v, s).set(sum(d.drifted for d in score.drift.values()))
        self.metrics.data_quality.labels(m, v, s).set(score.data_quality.bad_rows_share)

    # ------------------------------------------------------------------ labels
    async def on_label(self, raw: bytes, origin: LabelOrigin) -> str:
        """Joins a LabelObserved from ``origin`` to its prediction (:meth:`on_labels`); returns the
        outcome: joined, corrected, duplicate, other_producer (see :meth:`MonitorStore.join_truths`), or
        parked (before its prediction; not newer than its producer's parked one: duplicate).

        Raises:
            UntrustedSource: the producer is not one the prediction's model accepts (the platform's,
                or one its monitoring.yaml names); before its prediction: one that no model accepts.
            InvalidArgument: the label is malformed (no request id, no values, wrong count for the
                prediction's batch, a non-finite or non-class value): the stream dead-letters it.
        """
        outcome = (await self.on_labels([(raw, origin)]))[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def on_labels(self, items: Sequence[tuple[bytes, LabelOrigin]]) -> list[str | Exception]:
        """Joins LabelObserved events (bytes, origin) to their predictions, as a batch: their
        predictions looked up in one round trip, the joins applied in one script call in the labels'
        order, and each window they touched saved and announced once with its final truth (a window per
        label was several round trips, a decode and an event for every label). Returns each label's
        outcome (:meth:`on_label`'s) or what it raises: UntrustedSource, InvalidArgument, and what
        failed for that label alone (a FailedPrecondition, an error that may pass); an error of the
        whole batch (Redis unreachable) is raised, and the batch may be applied again (a label applied
        twice is a duplicate)."""
        results: list[str | Exception | None] = [None] * len(items)
        labels: dict[int, label_events_pb2.LabelObserved] = {}
        for i, (raw, _) in enumerate(items):
            try:
                labels[i] = _checked_label(raw)
            except Exception as exc:  # noqa: BLE001 - this label's outcome: dead-lettered with the reason
                results[i] = exc
        producers: dict[str, bool] = {}  # producer -> whether a label of it may be parked
        pending = list(labels)
        while pending:
            found = await self.store.find_predictions([labels[i].request_id for i in pending])
            joins, parking, again = [], [], []
            for i, record in zip(pending, found, strict=True):
                if record is not None:
                    joins.append((i, record))
                    continue
                try:
                    await self._check_parkable(items[i][1].producer, producers)
                except Exception as exc:  # noqa: BLE001 - this label's outcome
                    results[i] = exc
                    continue
                parking.append(i)
            for i, parked in zip(parking, await self._park(parking, labels, items), strict=True):
                if parked == "arrived":  # the prediction came since the look-up; look again
                    again.append(i)
                    continue
                if isinstance(parked, str):
                    self.metrics.labels.labels(parked).inc()
                results[i] = parked
            for (i, _), outcome in zip(joins, await self._join_many(
                    [(key, window, event, labels[i], items[i][1], segment, segment_window)
                     for i, (key, window, event, segment, segment_window) in joins]), strict=True):
                results[i] = outcome
            pending = again
        return results  # type: ignore[return-value]

    async def _check_parkable(self, producer: str, producers: dict[str, bool]) -> None:
        """Whether the model accepts a label is known once its prediction comes; one is parked only from
        a producer some model accepts, so nobody else can fill Redis with labels (``producers``: the
        answers so far).

        Raises: UntrustedSource: no model accepts ``producer``."""
        if producer not in producers:
            producers[producer] = producer in self.label_sources or await self.store.is_label_producer(producer)
        if not producers[producer]:
            raise UntrustedSource(f"label source {producer[:MAX_SOURCE_SHOWN]!r} is not a label producer "
                                  f"of any monitored model; accepted for every model: "
                                  f"{', '.join(sorted(self.label_sources)) or 'none'}, and the producers a "
                                  "model's monitoring.yaml names (labels.producers)")

    async def _park(self, indexes: list[int], labels: Mapping[int, label_events_pb2.LabelObserved],
                    items: Sequence[tuple[bytes, LabelOrigin]]) -> list[str | Exception]:
        """Parks these labels, which came before their predictions, in one round trip: each one's
        parked, duplicate or arrived (see :meth:`MonitorStore.park_labels`), or, for all, what the
        store raised (Redis unreachable: the stream tries them again)."""
        try:
            return list(await self.store.park_labels(
                [(labels[i].request_id, ParkedLabel(items[i][1], items[i][0])) for i in indexes]))
        except Exception as exc:  # noqa: BLE001 - the outcome of each of these labels
            return [exc] * len(indexes)

    async def submit_labels(self, model: str, version: str, labels: Sequence[SubmittedLabel]) -> int:
        """Publishes these labels (LabelObserved, under the platform's label source) for the stream to
        join like any producer's; returns how many. Each event's id is derived from the label (request
        id, values, time), so a call sent again publishes the same events and the join counts them once.

        Raises:
            InvalidArgument: every wrong field at once: no model, 0 or more than
                ``MAX_SUBMITTED_LABELS`` labels, a row's request id empty, too long or repeated, its
                values none, too many or not finite, or not class indexes for a classifier version.
            NotFound: ``version`` (when set) is not monitored, or no version of ``model`` is.
        """
        problems: list[tuple[str, str]] = []
        if not model:
            problems.append(("model", "must not be empty"))
        if not labels or len(labels) > MAX_SUBMITTED_LABELS:
            problems.append(("labels", f"must hold 1-{MAX_SUBMITTED_LABELS} labels, but holds {len(labels)}"))
        if problems:
            raise InvalidArgument.of(problems)
        monitored = await self.find(model_version(model, version)) if version else None
        if monitored is None and not any(saved["model"] == model for saved in
                                         (await self.store.registrations()).values()):
            raise NotFound(f"no version of model {model[:120]!r} is monitored")
        classifier = monitored is not None and monitored.monitor is not None and monitored.monitor.task is not \
            Task.REGRESSION
        seen: dict[str, int] = {}
        for i, label in enumerate(labels):
            problems.extend(_label_problems(f"labels[{i}]", label, classifier=classifier))
            if label.request_id in seen:
                problems.append((f"labels[{i}].request_id", f"repeats labels[{seen[label.request_id]}]'s"))
            seen.setdefault(label.request_id, i)
        if problems:
            raise InvalidArgument.of(problems)
        for label in labels:
            event = label_events_pb2.LabelObserved(request_id=label.request_id, values=label.values)
            event.time.FromNanoseconds(int((label.time if label.time is not None else time.time()) * 1e9))
            event_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"opml-monitoring/label/{label.request_id}/"
                                                         f"{event.time.ToNanoseconds()}/{list(label.values)}"))
            self.label_emitter.emit(event, subject=label.request_id, id=event_id)
        self.metrics.labels_submitted.inc(len(labels))
        return len(labels)

    async def on_prediction_joinable(self, key: str, window: int, raw_event: bytes, request_id: str) -> None:
        """Keeps a prediction for the label join; applies the labels that came before it."""
        await self.on_predictions_joinable([Joinable(key, window, raw_event, request_id)])

    async def on_predictions_joinable(self, items: Sequence[Joinable]) -> None:
        """Keeps predictions for the label join (one Redis round trip for all); applies the labels
        that came before them, each producer's in the order they came (the first applied is kept).
        A parked label leaves Redis only with its join (the same script call) or once it is dropped
        (untrusted, malformed, unjoinable: unparked, then counted): after a failure at any step the
        predictions replayed find the labels not yet applied, and only those."""
        parked = await self.store.remember_predictions(
            [(item.request_id, item.key, item.window, item.raw_event, item.segment, item.segment_window)
             for item in items])
        found = [(item, label) for item, labels in zip(items, parked, strict=True) for label in labels]
        if not found:
            return
        outcomes = await self._join_many([(item.key, item.window, item.raw_event,
                                           label_events_pb2.LabelObserved.FromString(label.data), label.origin,
                                           item.segment, item.segment_window) for item, label in found], parked=True)
        dropped: list[tuple[str, LabelOrigin, str, object]] = []  # request id, origin, outcome counted, why
        failed: Exception | None = None
        for (item, label), outcome in zip(found, outcomes, strict=True):
            if isinstance(outcome, UntrustedSource):  # a producer another model names: counted, not dead-lettered
                dropped.append((item.request_id, label.origin, "untrusted", outcome))
            elif isinstance(outcome, InvalidArgument):
                dropped.append((item.request_id, label.origin, "malformed", outcome))
            elif isinstance(outcome, FailedPrecondition):  # no monitor yet (no reference, first window open):
                # raised out of here it would stop the predictions agent; the label would never join
                dropped.append((item.request_id, label.origin, "unjoinable", outcome.message))
            elif isinstance(outcome, Exception) and failed is None:  # left parked: the replay applies it
                failed = outcome
        await self.store.unpark_labels([(request_id, origin) for request_id, origin, _, _ in dropped])
        for request_id, _, counted_as, why in dropped:
            self.metrics.labels.labels(counted_as).inc()
            log.warning("parked label of %s dropped: %s", request_id, why)
        if failed is not None:
            raise failed

    def _check_producer(self, monitored: Monitored, producer: str) -> None:
        """Raises: UntrustedSource: ``producer`` is neither the platform's nor one the model names."""
        accepted = self.label_sources | monitored.config.label_producers
        if producer not in accepted:
            raise UntrustedSource(f"label source {producer[:MAX_SOURCE_SHOWN]!r} is not a label producer of "
                                  f"{monitored.key}; accepted: {', '.join(sorted(accepted)) or 'none'}")

    async def _join_many(self, joins: Sequence[tuple[str, int, bytes, label_events_pb2.LabelObserved, LabelOrigin,
                                                   str, int]], *, parked: bool = False) -> list[str | Exception]:
        """Applies labels to their predictions (version, window, PredictionMade bytes, label, origin,
        segment and its window), in order: each version's predictions decoded together, the joins in
        one script call (``parked``: the labels were parked, and are unparked by it), each window
        touched saved and announced once, with its truth after the last label. Returns each one's
        outcome (joined, corrected, duplicate, other_producer) or its error: FailedPrecondition (its
        version has no monitor: nobody registered it, or no reference and its first window open), what
        :meth:`adopt` raises, UntrustedSource, InvalidArgument (see :meth:`on_label`)."""
        results: list[str | Exception | None] = [None] * len(joins)
        by_key: dict[str, list[int]] = {}
        for i, join in enumerate(joins):
            by_key.setdefault(join[0], []).append(i)
        monitors: dict[str, Monitored] = {}
        rows: dict[int, Batch] = {}
        for key, indexes in by_key.items():
            try:
                monitored = await self.adopt(key)  # a label's partition may be another process's than its version's
                if monitored is None or monitored.monitor is None:
                    raise FailedPrecondition(f"{key} has no monitor to join labels to")
            except Exception as exc:  # noqa: BLE001 - the outcome of each of its labels
                for i in indexes:
                    results[i] = exc
                continue
            monitors[key] = monitored
            trusted = []
            for i in indexes:
                try:
                    self._check_producer(monitored, joins[i][4].producer)
                    trusted.append(i)
                except UntrustedSource as exc:
                    results[i] = exc
            rows.update(self._decode_joined(monitored, trusted, joins, results))
        applied, truth_joins = [], []
        for i, (key, window, _, label, origin, segment, segment_window) in enumerate(joins):
            if i not in rows:
                continue
            batch, values = rows[i], np.asarray(label.values, dtype=np.float64)
            monitor = monitors[key].monitor
            if len(values) != len(batch):
                results[i] = InvalidArgument("values", f"holds {len(values)} values, but request {label.request_id} "
                                                       f"predicted {len(batch)} rows")
                continue
            if monitor.task is not Task.REGRESSION and not np.all(values == np.round(values)):
                results[i] = InvalidArgument("values", "must be class indexes for a classifier")
                continue
            if monitor.task is Task.REGRESSION:
                total = float(np.sum(np.abs(batch.outputs.predicted - values)))
            else:
                total = float(np.sum(batch.outputs.predicted == values))
            in_segment = bool(segment) and segment_window >= 0
            applied.append((i, values, in_segment))
            truth_joins.append(TruthJoin(label.request_id, key, window, len(values), total, origin,
                                         (window_key(key, segment), segment_window) if in_segment else None,
                                         values_digest(values), parked))
        touched: dict[tuple[str, str, int], list[Any]] = {}  # (version, segment, window) -> [truth, changed]
        outcomes = await self.store.join_truths(truth_joins)
        counted: dict[str, int] = {}
        for outcome in outcomes:
            counted[outcome[0]] = counted.get(outcome[0], 0) + 1
        # counted as the script applied them: a failure after it (a window's save) makes the stream
        # apply the batch again, when its labels are duplicates; counted later, they were never counted
        for outcome, count in counted.items():
            self.metrics.labels.labels(outcome).inc(count)
        learned: dict[str, MPP] = {}  # version (or segment) key -> its MPP that took labels
        for (i, values, in_segment), (outcome, truth, segment_truth) in zip(applied, outcomes, strict=True):
            key, window, _, _, _, segment, segment_window = joins[i]
            monitored, changed = monitors[key], outcome in ("joined", "corrected")
            windows = [(("", window), truth)] + ([((segment, segment_window), segment_truth)] if in_segment else [])
            for (part, index), after in windows:
                entry = touched.setdefault((key, part, index), [after, False])
                entry[0], entry[1] = after, entry[1] or changed
            results[i] = outcome
            if outcome != "joined":
                continue
            # the recalibration it makes due runs in the background (core/refits.py): the join does not
            # wait for it. A correction is not learned again: the MPP's live rows hold the request's
            # first label and cannot be taken back
            monitor, batch = monitored.monitor, rows[i]
            if monitor.mpp is not None:
                monitor.mpp.add_labels(batch.features, batch.outputs, values)
                learned[key] = monitor.mpp
            own = await self.segment_monitor(monitored, segment) if in_segment else monitor
            if own is not monitor and own.mpp is not None:  # the segment's own MPP learns too
                own.mpp.add_labels(batch.features, batch.outputs, values)
                learned[window_key(key, segment)] = own.mpp
        for wk, mpp in learned.items():
            self.refits.due(wk, mpp, self._recalibrated, self._recalibration_failed)
        for (key, segment, window), (truth, changed) in touched.items():
            await self._show_truth(monitors[key], segment, window, truth, stale_only=not changed)
        return results  # type: ignore[return-value]

    def _decode_joined(self, monitored: Monitored, indexes: list[int], joins: Sequence[tuple[Any, ...]],
                       results: list[Any]) -> dict[int, Batch]:
        """The rows of these labels' predictions (one version's), decoded together; if that fails, one
        by one, a prediction that does not decode failing its label (InvalidArgument)."""
        if not indexes:
            return {}
        events = [inference_events.PredictionMade.FromString(joins[i][2]) for i in indexes]
        try:
            batch, counts = self.decode_many(monitored, events)
        except Exception:  # noqa: BLE001 - a bad prediction or mixed layouts: one by one below
            out = {}
            for i, event in zip(indexes, events, strict=True):
                try:
                    out[i] = self.decode(monitored, event)
                except Exception as exc:  # noqa: BLE001 - its label's outcome
                    results[i] = exc
            return out
        out, start = {}, 0
        for i, count in zip(indexes, counts, strict=True):
            out[i] = batch.rows(start, start + count)
            start += count
        return out

    def _recalibrated(self, key: str, mpp: MPP, changed: bool) -> None:
        """A background recalibration of ``key``'s MPP was put in use (a segment's, ``{model}/{version}#{segment}``,
        is not counted in the version's metrics)."""
        monitored = self.models.get(key)
        if monitored is None:
            return
        if changed:
            self.metrics.recalibrations.labels(monitored.model, monitored.version).inc()
        self.metrics.recalibration_labels.labels(monitored.model, monitored.version).set(mpp.covered)

    def _recalibration_failed(self, key: str) -> None:
        """A background recalibration of ``key``'s MPP failed (it is tried again by itself, core/refits.py);
        counted under its version, a segment's too."""
        monitored = self.models.get(key.split(SEPARATOR, 1)[0])
        if monitored is not None:
            self.metrics.recalibration_failures.labels(monitored.model, monitored.version).inc()

    async def _show_truth(self, monitored: Monitored, segment: str, window: int, truth: tuple[int, float], *,
                          stale_only: bool = False) -> None:
        """The saved window (of the version, or of ``segment``) takes its truth so far, and is announced
        again; ``stale_only``: only if it was saved with fewer or more labels (its labels came again
        after a crash between their join and this)."""
        wk = window_key(monitored.key, segment)
        labelled, sum_total = truth
        if not labelled:
            return
        record = await self.store.get_window(wk, window)
        if record is None:  # still open: it reads its truth when it closes
            return
        if stale_only and record.get("labelled", 0) == labelled:
            return
        record["labelled"], record["true"] = labelled, sum_total / labelled
        await self.store.save_window(wk, record)
        self._announce_window(monitored, record)
        m, v = monitored.model, monitored.version
        self.metrics.estimate.labels(m, v, segment, "true").set(record["true"])
        for name in ("mpp", "cbpe"):
            if record.get(name) is not None:
                self.metrics.estimate_error.labels(m, v, segment, name).set(abs(record[name] - record["true"]))


def _checked_label(raw: bytes) -> label_events_pb2.LabelObserved:
    """Raises: InvalidArgument: no request id, no values, too many, or a non-finite one."""
    label = label_events_pb2.LabelObserved.FromString(raw)
    problems = []
    if not label.request_id or len(label.request_id) > MAX_REQUEST_ID_CHARS:
        problems.append(("request_id", f"must hold 1-{MAX_REQUEST_ID_CHARS} characters, but got "
                                       f"{brief(label.request_id)}"))
    if not label.values or len(label.values) > MAX_LABEL_VALUES:
        problems.append(("values", f"must hold 1-{MAX_LABEL_VALUES} values, but holds {len(label.values)}"))
    elif not np.all(np.isfinite(np.asarray(label.values))):
        problems.append(("values", "must all be finite numbers"))
    if problems:
        raise InvalidArgument.of(problems)
    return label


def _label_problems(field: str, label: SubmittedLabel, *, classifier: bool) -> list[tuple[str, str]]:
    """What is wrong with one submitted label (the rules :meth:`Scorer.on_label` applies to a LabelObserved)."""
    problems = []
    if not label.request_id or len(label.request_id) > MAX_REQUEST_ID_CHARS:
        problems.append((f"{field}.request_id", f"must hold 1-{MAX_REQUEST_ID_CHARS} characters, but got "
                                                f"{brief(label.request_id)}"))
    values = np.asarray(label.values, dtype=np.float64)
    if not len(values) or len(values) > MAX_LABEL_VALUES:
        problems.append((f"{field}.values", f"must hold 1-{MAX_LABEL_VALUES} values, but holds {len(values)}"))
    elif not np.all(np.isfinite(values)):
        problems.append((f"{field}.values", "must all be finite numbers"))
    elif classifier and not np.all((values == np.round(values)) & (values >= 0)):
        problems.append((f"{field}.values", "must be class indexes (0, 1, ...) for a classifier"))
    return problems


def _rules_of(text: str) -> tuple[Rule, ...]:
    from opml_common.yamlsafe import load_yaml

    data = load_yaml(text, what="rules", max_bytes=MAX_RULES_BYTES)
    if isinstance(data, Mapping):
        data = data.get("rules", [])
    return parse_rules(data or [], path="rules")


def _unscorable(key: str, index: int, exc: Exception) -> Unscorable:
    return Unscorable(f"window {index} of {key} cannot be scored: {brief(str(exc), 300)}")


def _bootstrap_monitor(batch: Batch, config: MonitoringConfig) -> tuple[ModelMonitor, bytes]:
    """No reference set: the first window is the baseline of drift and data quality (no labels). Its
    first rows, as many as fit ``MAX_BASELINE_ROWS`` and ``MAX_BASELINE_BYTES``: the monitor, and those
    rows as a reference.npz to keep."""
    scores = batch.outputs.scores
    task = config.task or (Task.REGRESSION if scores is None else
                           Task.MULTICLASS if batch.outputs.class_scores().shape[1] > 2 else Task.BINARY)
    rows = min(len(batch), MAX_BASELINE_ROWS)
    while True:
        baseline = batch.rows(0, rows)
        reference = ReferenceSet.build(task=task, features=baseline.features, predicted=baseline.outputs.predicted,
                                       scores=baseline.outputs.scores, min_rows=1)
        data = dump_reference(reference)
        if len(data) <= MAX_BASELINE_BYTES or rows == 1:
            return _monitor_of_baseline(reference, config), data
        rows = max(1, rows * MAX_BASELINE_BYTES // len(data))


def _kept_monitor(data: bytes, config: MonitoringConfig) -> ModelMonitor:
    """The monitor of a baseline kept by :func:`_bootstrap_monitor`."""
    return _monitor_of_baseline(load_reference(data, task=config.task, min_rows=1), config)


def _monitor_of_baseline(reference: ReferenceSet, config: MonitoringConfig) -> ModelMonitor:
    monitor = ModelMonitor(reference, config)
    monitor.limitations.append("no reference set: the first window is the baseline")
    return monitor
