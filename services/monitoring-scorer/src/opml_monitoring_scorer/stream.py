"""The prediction and label streams, as a faust-streaming app (agents and tables, at least once).

``predictions`` agent, on opml.predictions.v1 (keyed ``<model>/<version>``, so one version's
predictions arrive in order on one partition), in batches (``Stream.noack_take``: up to
``BATCH_MAX`` records, or what came within ``BATCH_WITHIN_S``). A record is one PredictionMade (an
external producer's, or a quiet router's) or a PredictionBatch (the router's prediction log
publishes what is queued for a version as one record: faust's costs are per record, so this is what
lets one-row requests be scored at more than a few thousand per second). The predictions of one
version in a batch of records are decoded together (their tensors stacked, one numpy call per
tensor; if that fails, record by record, then prediction by prediction); a malformed record (one of
its predictions does not decode, is of another version than the first, or disagrees with the
version's reference), or one not keyed by its version, goes whole to the topic's dead-letter topic
with the reason, and the stream flows on; so do the records of a window the estimators cannot score
(``Unscorable``). A valid record of a version nobody registered (a model served outside the platform,
or one whose deployment the scorer has not seen yet) is counted as skipped (its predictions) and
settled, with a log line per version at most every ``UNKNOWN_LOG_INTERVAL_S``: it is not malformed,
and a dead-letter write per record buried the topic under one model's valid predictions. Each record's rows (ranges of its version's
decode) are appended, whole, to its version's open window: **a record belongs to the window open
when it comes**, and the window is closed and scored after the record that brings it to
``window.count`` rows (so a window holds ``count`` to ``count`` + the record's rows - 1), or when a
record's first prediction's time is ``window.seconds`` past the window's first (a batch's later
predictions may pass it by the time the router took to queue them). Windows close on record
boundaries because a record is the unit of the offsets the stream commits. Window times are event
times, so windows close the same way on a replay.

The source topic is the log of the open windows (as in Kafka Streams): an event (a record) is
settled once the window it belongs to is closed and saved (or it is dead-lettered, or skipped as
closed before), and acked (its offset may be committed) only once every record before it on its
partition is settled too (``Held``: faust commits past an unacked offset that acks out of order
leave behind), so the committed offset of a partition never passes the first event of a window still
open there, whichever version's; a record is in one window only, so its offset is acked once. The
open windows themselves live in memory only. A restarted scorer (or the new owner of a partition
after a rebalance) is fed again from the committed offset and rebuilds the open windows from the
same events, in the same order, with the same event times: the same windows (each partition's
records are applied in offset order with no gap from the offset it was fed from; a gap faust leaves
is sought back, ``_in_order``). What it must not count again is a window it closed already: the
``windows`` table (a faust table with a changelog topic) holds per version the next window index and
the offset of the last event of its last closed window, written once per closed window (not per
event); an event at or below it is settled and skipped. faust flushes the changelog before it commits
source offsets, and a window saved but not yet in the changelog when the process dies is closed
again under the same index (the scorer saves windows by index and steps rules once per index), so a
SIGKILL loses no window and counts none twice.

Per batch (in chunks of about ``DECODE_PREDICTIONS`` predictions): one Redis script call for the
label-join records of its predictions (state.py; one record per prediction, a batch's predictions
serialized one by one), no per-record table write. Memory: the open windows' events (their decoded
rows and the faust events, unacked), one window per monitored version.

**Segments** (monitoring.yaml ``segment: {parameter: P}``, core/segments.py): each applied record's
predictions are also split by their request's value of P (admitted in offset order, bounded), and
each segment's part of the record goes to that segment's own open window (keyed
``{model}/{version}#{segment}`` here, in the ``windows`` table and in Redis), besides the whole
record going to the version's window. Segment windows close by the same count and time rules, on the
same record boundaries, each with its own progress in the table; a record is settled once every
window it went to is closed (``Held`` counts its parts), and on a replay each part at or below its
window key's progress is skipped, so a record half in closed windows rebuilds only its open ones.
A version's segment windows cost about as much again as its own (every row is scored twice).

``labels`` agent, on opml.labels.v1: each LabelObserved is joined to its prediction by request id in
Redis with expiry (the retention bound; see state.py), because labels are keyed by request id and
predictions by model version: a faust-table join would need both streams repartitioned by request
id first (two more internal topics); the Redis join is one lookup per label either way. Labels are
taken in batches (``noack_take``: up to ``LABEL_BATCH_MAX``, or what came within
``LABEL_BATCH_WITHIN_S``) and joined together (:meth:`Scorer.on_labels`: their predictions in one
MGET, the joins in one script call, each window touched saved and announced once with its truth
after the batch); the batch's events are acked once each of them is applied or dead-lettered, so a
crash in between applies it again (its labels then duplicates). Label by label, the join was several
Redis round trips, a decode and a WindowScored per label (98-319 labels/s in
bench/monitoring_scorer_labels.py, against 1,245-4,761 batched). A label is applied only from a
producer (its event's source) the prediction's model accepts; any other is
dead-lettered as ``UntrustedSource``. Predictions are trusted the same way: a record whose event
source is not one of ``prediction_sources`` (by default the inference-router's alone) is
dead-lettered as ``UntrustedSource`` before it is read, so no other producer can feed a model's
windows, estimates and alerts.

Every internal topic is created at start-up with the predictions topic's partition count (tansu
gives auto-created topics 4 partitions, and faust refuses a table whose changelog differs from its
source).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from faust.types import TP
from opml.inference.v1 import events_pb2 as inference_events

from opml_common.bus import EventPublisher, UntrustedSource, is_retriable
from opml_common.bus.cloudevents import CloudEvent
from opml_common.bus.security import kafka_client_kwargs
from opml_common.config import PlatformSettings
from opml_common.errors import InvalidArgument, brief
from opml_common.lifecycle import Component
from opml_common.retry import Backoff
from opml_inference_router_contract.names import EVENT_SOURCE as ROUTER_SOURCE
from opml_monitoring_scorer.core.decode import Batch
from opml_monitoring_scorer.core.scorer import MAX_SOURCE_SHOWN, Joinable, Scorer, Unscorable, model_version
from opml_monitoring_scorer.core.segments import SEPARATOR, SegmentBook, parameter_value, window_key
from opml_monitoring_scorer.core.summary import PredictionSummary
from opml_monitoring_scorer.metrics import ScorerMetrics
from opml_monitoring_scorer.state import LabelOrigin
from opml_monitoring_scorer.topics import LABELS, PREDICTIONS

log = logging.getLogger(__name__)
PREDICTION_TYPE = "opml.inference.v1.PredictionMade"
BATCH_TYPE = "opml.inference.v1.PredictionBatch"
PREDICTION_TYPES = (PREDICTION_TYPE, BATCH_TYPE)
LABEL_TYPE = "opml.monitoring.v1.LabelObserved"
MAX_EVENT_BYTES = 8 * 1024 * 1024
BATCH_MAX = 2000
"""Most events the predictions agent takes at once (at most ``stream_buffer_maxsize``)."""
BATCH_WITHIN_S = 0.25
"""How long the agent waits to fill a batch before it processes what it has."""
LABEL_BATCH_MAX = 500
"""Most label events the labels agent takes at once."""
LABEL_BATCH_WITHIN_S = 0.05
"""How long the labels agent waits to fill a batch before it applies what it has."""
LABEL_RETRIES = Backoff(base_s=0.1, max_s=2.0)
"""Backoff of a label whose join failed for a reason that may pass (Redis unreachable)."""
PREDICTION_RETRIES = Backoff(base_s=0.1, max_s=2.0)
"""Backoff of the predictions agent after a batch stopped for a reason that may pass (Redis unreachable)."""
DECODE_PREDICTIONS = 4096
"""About the most predictions decoded together: a batch of records (up to ``BATCH_MAX`` records of up
to the router's ``prediction_batch_max`` predictions each) is decoded and applied in chunks of whole
records of about this many, so its transient decode stays bounded."""


UNKNOWN_LOG_INTERVAL_S = 300.0
"""How often the skipping of one unknown version's predictions is logged."""
UNKNOWN_LOGGED_MAX = 10_000
"""Most versions whose last log time is kept (the names come from producers: bounded)."""


class UnknownModel(Exception):
    """A valid prediction of a model version nobody registered for monitoring: skipped, not dead-lettered."""

    def __init__(self, key: str, predictions: int) -> None:
        super().__init__(f"{key[:120]!r} is not monitored")
        self.key = key
        self.predictions = predictions


@dataclass
class OpenWindow:
    """A version's open window, in memory: its rows, event times, and the events to ack once it closes."""

    index: int
    partition: int
    key: str = ""
    """Its version (model/version)."""
    segment: str = ""
    """"" for the version's own window; else its segment's."""
    parts: list[list[Any]] = field(default_factory=list)
    """[decoded batch, first row, end row]: the window's rows, ranges of its events' batch decodes."""
    events: list[Any] = field(default_factory=list)
    rows: int = 0
    summary_only: int = 0
    summaries: list[PredictionSummary] = field(default_factory=list)
    """What its summary-only predictions carry."""
    first: float | None = None
    last: float | None = None
    last_offset: int = -1


@dataclass
class DecodedRecord:
    """One source record's predictions (one PredictionMade, or a PredictionBatch's), decoded: what it
    adds, whole, to its version's open window."""

    key: str
    predictions: list[Any]
    data: bytes | None
    """The PredictionMade bytes of a one-prediction record (a batch's are serialized when joined)."""
    parts: list[tuple[Batch, int, int]]
    """Its rows: ranges of decoded batches."""
    counts: list[int]
    """Rows per prediction (0: summary only, or none)."""
    rows: int
    summary_only: int
    summaries: list[PredictionSummary]
    """What its summary-only predictions carry, in order."""
    weight: int
    """What it counts toward a window by count: its rows, and 1 for a prediction without rows."""
    first: float
    last: float
    """Event times of its first and latest prediction."""
    ranges: list[tuple[Batch, int, int]] = field(default_factory=list)
    """Each prediction's rows (a range of a decoded batch; empty for a summary-only one)."""
    times: list[float] = field(default_factory=list)
    """Each prediction's event time."""
    segment_of: list[str] = field(default_factory=list)
    """Each prediction's segment ("": in none; empty: the version has no segments)."""
    segments: dict[str, DecodedRecord] = field(default_factory=dict)
    """Its predictions of each segment, as a record (:meth:`split`)."""

    @classmethod
    def of(cls, key: str, predictions: list[Any], data: bytes | None, decodes: list[tuple[Batch, int, list[int]]],
           message: Any, summaries: list[PredictionSummary]) -> DecodedRecord:
        """From its predictions and their decodes: (decoded batch, first row, rows of each prediction in
        it), and what its summary-only predictions carry."""
        parts, counts, ranges = [], [], []
        for batch, start, rows in decodes:
            parts.append((batch, start, start + sum(rows)))
            counts.extend(rows)
            for n in rows:
                ranges.append((batch, start, start + n))
                start += n
        times = [p.time.ToNanoseconds() / 1e9 if p.HasField("time") else message.timestamp for p in predictions]
        return cls(key, predictions, data, parts, counts, sum(counts), len(summaries), summaries,
                   sum(n or 1 for n in counts), times[0], max(times), ranges, times)

    def split(self, segment_of: list[str]) -> None:
        """Sets each prediction's segment and :attr:`segments`: per segment, its predictions' rows,
        summaries, weight and times as a record of their own (joined through the version's record)."""
        self.segment_of = segment_of
        groups: dict[str, list[int]] = {}
        for i, segment in enumerate(segment_of):
            if segment:
                groups.setdefault(segment, []).append(i)
        if not groups:
            return
        summary_at, summarised = {}, 0
        for i, n in enumerate(self.counts):
            if not n and summarised < len(self.summaries):
                summary_at[i] = self.summaries[summarised]
                summarised += 1
        for segment, indexes in groups.items():
            parts: list[tuple[Batch, int, int]] = []
            for i in indexes:
                batch, start, stop = self.ranges[i]
                if stop == start:
                    continue
                if parts and parts[-1][0] is batch and parts[-1][2] == start:
                    parts[-1] = (batch, parts[-1][1], stop)
                else:
                    parts.append((batch, start, stop))
            counts = [self.counts[i] for i in indexes]
            summaries = [summary_at[i] for i in indexes if i in summary_at]
            times = [self.times[i] for i in indexes]
            self.segments[segment] = DecodedRecord(
                self.key, [self.predictions[i] for i in indexes], None, parts, counts, sum(counts), len(summaries),
                summaries, sum(n or 1 for n in counts), times[0], max(times))

    def joinable_at(self) -> list[tuple[int, bytes, str]]:
        """(index, PredictionMade bytes, request id) of each prediction a label may join (one with rows
        and an id)."""
        if self.data is not None:
            p = self.predictions[0]
            return [(0, self.data, p.request_id)] if p.request_id and self.counts[0] else []
        return [(i, p.SerializeToString(), p.request_id)
                for i, (p, n) in enumerate(zip(self.predictions, self.counts, strict=True)) if p.request_id and n]

    def joinable(self) -> list[tuple[bytes, str]]:
        """(PredictionMade bytes, request id) of each prediction a label may join (one with rows and an id)."""
        return [(raw, request_id) for _, raw, request_id in self.joinable_at()]


class Held:
    """A source partition's applied records that are not acked yet, in offset order: a record is acked
    once it and every record before it are settled, so the committed offset never passes a record an
    open window holds.

    Why not ack each record when its window closes: versions that share a partition interleave, and a
    closed window's records acked while an older record of another version's open window is not let
    faust-streaming 0.15.3 commit past that record (``Consumer._new_offset`` commits past a gap of one
    offset after the committed one, and past any gap while the partition has no commit yet); a restart
    or a rebalance then lost it."""

    def __init__(self) -> None:
        self._order: deque[list[Any]] = deque()  # [event, parts not settled yet]
        self._by_offset: dict[int, list[Any]] = {}

    def add(self, event: Any, parts: int = 1) -> None:
        """``parts``: how many windows the record goes to (the version's, and one per segment in it);
        it is settled when each of them settled it."""
        entry = [event, parts]
        self._order.append(entry)
        self._by_offset[event.message.offset] = entry

    def settle(self, event: Any) -> None:
        """Marks one part of the record settled and acks the settled records at the head."""
        entry = self._by_offset.get(event.message.offset)
        if entry is not None and entry[0] is event and entry[1] > 0:
            entry[1] -= 1
        order = self._order
        while order and not order[0][1]:
            head = order.popleft()[0]
            del self._by_offset[head.message.offset]
            head.ack()


def _rows(key: str, window: OpenWindow) -> Batch:
    """Raises: Unscorable: its records' tensors differ in layout (a version without a reference has
    none to check them against as they come)."""
    try:
        return Batch.concat([batch.rows(start, stop) for batch, start, stop in window.parts],
                            summary_only=window.summary_only, summaries=window.summaries)
    except ValueError as exc:
        raise Unscorable(f"window {window.index} of {key} cannot be scored: its records' tensors differ in "
                         f"layout: {brief(str(exc), 300)}") from exc


def _credentials(platform: PlatformSettings) -> Any:
    kwargs = kafka_client_kwargs(platform)
    protocol = platform.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return None
    if protocol == "SSL":
        return faust.SSLCredentials(kwargs["ssl_context"])
    return faust.SASLCredentials(username=platform.kafka_sasl_username,
                                 password=platform.kafka_sasl_password.get_secret_value(),
                                 mechanism=platform.kafka_sasl_mechanism, ssl_context=kwargs.get("ssl_context"))


def _seek_uncommitted_to_earliest(consumer: Any, topics: set[str],
                                  fed_from: Callable[[dict[Any, int]], None] | None = None) -> None:
    """Makes faust's "seek to the committed offsets" seek a source partition that has none to its
    earliest offset (what ``consumer_auto_offset_reset="earliest"`` means), instead of leaving it where
    it is; ``fed_from`` is told the offset each source partition is fed from after every such seek.

    The restart defect (a scorer SIGKILLed in its first seconds and started again closed no further
    window, or stopped short, in about half the runs): faust-streaming 0.15.3's ``Consumer.getmany``
    drops records it has already taken from aiokafka's fetcher (so the fetch position is past them)
    when the flow stops, the generation changes or the partition is paused at that moment, as it does
    while a restarted worker recovers its tables, and relies on ``perform_seek`` ->
    ``seek_to_committed`` to fetch them again. aiokafka's ``seek_to_committed`` seeks only where the
    committed offset is above 0: a partition its group never committed (the first scorer was killed
    before its first commit, every ``broker_commit_interval``) stays at the position past the dropped
    records, and they are never delivered. Seen in a stalled process: position 160 = the log end, no
    record buffered, none processed, nothing committed.
    """
    seek_to_committed = consumer.seek_to_committed

    async def seek_to_committed_or_earliest() -> Any:
        committed = await seek_to_committed()
        missing = [tp for tp, offset in committed.items() if not offset and tp.topic in topics]
        earliest = await consumer.earliest_offsets(*missing) if missing else {}
        if missing:
            await consumer.seek_wait({tp: earliest[tp] for tp in missing})
        if fed_from is not None:
            fed_from({tp: offset or earliest[tp] for tp, offset in committed.items() if tp.topic in topics})
        log.info("stream partitions fed again from their committed offsets: %s", ", ".join(
            f"{tp.topic}[{tp.partition}]@{offset if offset else 'earliest'}"
            for tp, offset in sorted(committed.items()) if tp.topic in topics))
        return committed

    consumer.seek_to_committed = seek_to_committed_or_earliest


class ScoringStream(Component):
    """Side effects:
        ``start()``: creates the internal topics, starts the faust app (joins the consumer group,
        recovers the table from its changelog, then consumes). Idempotent.
        ``stop()``: stops the app (commits what was processed: closed windows). Idempotent.
    """

    def __init__(self, platform: PlatformSettings, scorer: Scorer, metrics: ScorerMetrics, *,
                 publisher: EventPublisher, datadir: Path, app_id: str = "monitoring-scorer",
                 prediction_sources: frozenset[str] = frozenset({ROUTER_SOURCE})) -> None:
        super().__init__()
        self.platform = platform
        self.prediction_sources = frozenset(prediction_sources)
        self.scorer = scorer
        self.metrics = metrics
        self.publisher = publisher
        self.datadir = datadir
        self.app_id = platform.topic_prefix + app_id
        self.app: faust.App | None = None
        self.processed = 0
        self._open: dict[str, OpenWindow] = {}
        self._joinable: list[Joinable] = []
        self._resuming: set[int] = set()  # partitions revoked whose first record since is not seen yet
        self._next: dict[int, int] = {}  # source partition -> the offset the stream applies next
        self._rewound: dict[int, int] = {}  # source partition -> the record that showed a gap, while sought back
        self._held: dict[int, Held] = {}  # source partition -> its applied records not acked yet
        self._unknown_logged: dict[str, float] = {}  # unknown version -> when its skipping was last logged
        self._segments: dict[str, SegmentBook] = {}  # version -> its segments admitted

    def _internal_topics(self) -> dict[str, int]:
        return {f"{self.app_id}-windows-changelog": PREDICTIONS.partitions, f"{self.app_id}-__assignor-__leader": 1}

    async def _create_topics(self) -> None:
        admin = AIOKafkaAdminClient(**kafka_client_kwargs(self.platform))
        await admin.start()
        try:
            existing = set(await admin.list_topics())
            wanted = [NewTopic(name, count, self.platform.kafka_replication_factor)
                      for name, count in self._internal_topics().items() if name not in existing]
            if wanted:
                await admin.create_topics(wanted)
        finally:
            await admin.close()

    async def on_start(self) -> None:
        await self._create_topics()
        self.datadir.mkdir(parents=True, exist_ok=True)
        platform = self.platform
        app = faust.App(
            self.app_id, broker=[f"kafka://{host}" for host in platform.kafka_bootstrap.split(",")],
            broker_credentials=_credentials(platform), store="memory://", processing_guarantee="at_least_once",
            topic_partitions=PREDICTIONS.partitions, topic_allow_declare=False, topic_disable_leader=False,
            topic_replication_factor=platform.kafka_replication_factor, web_enabled=False,
            broker_session_timeout=platform.kafka_session_timeout_ms / 1000,
            broker_heartbeat_interval=platform.kafka_heartbeat_interval_ms / 1000,
            consumer_auto_offset_reset="earliest", datadir=str(self.datadir), producer_acks=-1,
            # the events of open windows stay unacked until their window closes: a rebalance or a
            # stop must not wait for them (they are fed again from the committed offset)
            stream_wait_empty=False, stream_buffer_maxsize=max(4096, 2 * BATCH_MAX),
            loop=asyncio.get_running_loop())
        predictions = app.topic(PREDICTIONS.full_name(platform.topic_prefix), key_type=bytes, value_type=bytes,
                                key_serializer="raw", value_serializer="raw", partitions=PREDICTIONS.partitions)
        labels = app.topic(LABELS.full_name(platform.topic_prefix), key_type=bytes, value_type=bytes,
                           key_serializer="raw", value_serializer="raw", partitions=LABELS.partitions)
        # version (or version#segment) -> {"index": next window, "partition", "through": offset of its last
        # closed window's last event}
        self.windows = app.Table("windows", default=None, partitions=PREDICTIONS.partitions)

        async def on_predictions(stream: Any) -> None:
            await self._take_predictions(stream.noack_take(BATCH_MAX, within=BATCH_WITHIN_S))

        async def on_labels(stream: Any) -> None:
            async for events in stream.noack_take(LABEL_BATCH_MAX, within=LABEL_BATCH_WITHIN_S):
                await self._on_labels(events)

        async def on_revoked(sender: Any, revoked: Any, **kwargs: Any) -> None:
            self._forget({tp.partition for tp in revoked if tp.topic == predictions.get_topic_name()})

        app.agent(predictions, name="predictions")(on_predictions)
        app.agent(labels, name="labels")(on_labels)
        app.on_partitions_revoked.connect(on_revoked)
        self._source = predictions.get_topic_name()
        _seek_uncommitted_to_earliest(app.consumer, {self._source, labels.get_topic_name()}, self._fed_from)
        self.app = app
        try:
            await app.start()
        except BaseException:  # not started: nobody calls stop(), so what it began is stopped here
            self.app = None
            await app.stop()
            raise

    async def on_stop(self) -> None:
        app, self.app = self.app, None
        if app is not None:
            await app.stop()

    def _fed_from(self, positions: dict[Any, int]) -> None:
        """faust sought the source partitions to their committed offsets (after an assignment, or when
        it stopped the flow): a partition assigned since its revoke applies from there; one this process
        kept goes on from its next offset (what came from the committed offset on is in its open
        windows or acked: it comes again and is skipped)."""
        for tp, offset in positions.items():
            if tp.topic == self._source:
                self._next.setdefault(tp.partition, offset)

    async def _in_order(self, message: Any) -> bool:
        """Whether to apply the record (then the partition's next offset is the one after it): the
        stream applies each partition's records in offset order, with no gap, from the offset it was
        fed from, so windows by count are the same on every replay.

        A record fed before (an open window holds it, or it was acked) is not applied again. A record
        past a gap makes the stream seek the partition back to the first missing offset, again at each
        such record (faust drops a fetched record below the highest offset it has handed over, so a
        seek made while it still hands over records fetched before it does not stick); the records
        until the missing one comes are not applied (not acked: they come again). faust loses records
        it took from the fetcher when the flow stops or the generation changes, and relies on its seek
        to the committed offsets to fetch them again. If the seek brings the first record past the gap
        again, the offsets before it are not in the log (deleted, or control records) and it is applied.
        """
        partition, offset = message.partition, message.offset
        expected = self._next.get(partition)
        if expected is None or offset == expected:
            if self._rewound.pop(partition, None) is not None:
                log.info("partition %d fed again from offset %d: the gap is closed", partition, offset)
            self._next[partition] = offset + 1
            return True
        if offset < expected:
            return False
        gap_at = self._rewound.get(partition)
        if gap_at == offset:
            del self._rewound[partition]
            log.warning("partition %d: offsets %d..%d are not in the log; applied from %d", partition, expected,
                        offset - 1, offset)
            self._next[partition] = offset + 1
            return True
        if gap_at is None:
            self._rewound[partition] = offset
            log.warning("partition %d: record %d came where %d was expected (%d..%d not delivered); seeking back "
                        "to %d", partition, offset, expected, expected, offset - 1, expected)
        await self.app.consumer.seek(TP(message.topic, partition), expected)
        return False

    def _forget(self, partitions: set[int]) -> None:
        """Partitions revoked: their open windows are dropped unacked; whoever gets them next (this
        process too) is fed their events again from the committed offset and rebuilds them."""
        dropped = {k: w for k, w in self._open.items() if w.partition in partitions}
        for key in dropped:
            del self._open[key]
        if dropped:
            log.info("partitions %s revoked; their open windows dropped (rebuilt from the committed offsets): %s",
                     sorted(partitions), ", ".join(
                         f"{k} #{w.index} ({w.rows} rows, offsets {w.events[0].message.offset if w.events else '-'}"
                         f"..{w.last_offset})" for k, w in dropped.items()))
        self._resuming |= partitions
        for partition in partitions:
            self._next.pop(partition, None)
            self._rewound.pop(partition, None)
            self._held.pop(partition, None)
        self._joinable = [j for j in self._joinable if j.partition not in partitions]

    async def _dead_letter(self, topic_name: str, message: Any, error: Exception) -> None:
        headers = [*(message.headers or ()),
                   ("opml_error", str(error)[:1024].encode("utf-8", "replace")),
                   ("opml_error_type", type(error).__name__.encode()),
                   ("opml_source_topic", message.topic.encode()),
                   ("opml_source_partition", str(message.partition).encode()),
                   ("opml_source_offset", str(message.offset).encode()),
                   ("opml_consumer_group", self.app_id.encode())]
        await self.publisher.send_raw(topic_name, message.value, key=message.key, headers=headers)

    def _parse(self, message: Any, expected: tuple[str, ...]) -> CloudEvent:
        if message.value is None or len(message.value) > MAX_EVENT_BYTES:
            raise InvalidArgument("value", f"must be a CloudEvent of at most {MAX_EVENT_BYTES} bytes")
        headers = [(k, v) for k, v in (message.headers or ())]
        event = CloudEvent.from_kafka(headers, message.value, timestamp_ms=message.timestamp
                                      and int(message.timestamp * 1000))
        if event.type not in expected:
            raise InvalidArgument("ce_type", f"must be {' or '.join(expected)}, but got {event.type[:80]!r}")
        return event

    async def _adopt_unknown(self, events: list[Any]) -> None:
        """Versions in these records (by their Kafka key) that another scorer process registered are
        adopted before the records are read, so they are scored here, not skipped as unknown."""
        models = self.scorer.models
        keys = {key.decode("utf-8", "replace") for e in events if (key := e.message.key)} - models.keys()
        for key in keys:
            try:
                await self.scorer.adopt(key)
            except Exception as exc:  # noqa: BLE001 - its records are skipped as unknown, the stream flows
                log.error("monitoring of %s registered elsewhere not adopted: %s", key[:200], exc)

    async def _take_predictions(self, batches: AsyncIterator[list[Any]]) -> None:
        """Applies each batch (:meth:`_on_batch`). An error that may pass (Redis unreachable) stops its batch
        where it happened and waits, backing off, before the next one: what it had not applied is fed
        again from the first missing offset (:meth:`_in_order`), the predictions kept for the label
        join stay pending. Raised out of the agent, faust restarted the agent on every batch for as long
        as Redis was away, and past 100 restarts a second it stops the app. Any other error still does."""
        failures = 0
        async for events in batches:
            try:
                await self._on_batch(events)
            except Exception as exc:
                if not is_retriable(exc):
                    raise
                delay = PREDICTION_RETRIES.delay(failures)
                failures += 1
                log.warning("a batch of %d prediction records stopped (failure %d in a row), its rest fed again; "
                            "next batch in %.1f s: %s", len(events), failures, delay, exc)
                await asyncio.sleep(delay)
            else:
                failures = 0

    async def _on_batch(self, events: list[Any]) -> None:
        app = self.app
        await self._adopt_unknown(events)
        parsed = [self._parsed(event) for event in events]
        begin = 0
        while begin < len(events):  # in chunks of about DECODE_PREDICTIONS, on record boundaries
            end, held = begin, 0
            while end < len(events) and (end == begin or held < DECODE_PREDICTIONS):
                held += len(parsed[end][1]) if isinstance(parsed[end], tuple) else 1
                end += 1
            chunk = events[begin:end]
            counted: dict[str, int] = {}
            for event, item in zip(chunk, self._decode_parsed(chunk, parsed[begin:end]), strict=True):
                if (app is None or not app.flow_control.is_active()
                        or event.message.generation_id != app.consumer_generation_id):
                    # a rebalance began (its revoke drops the open windows) or the event was fetched
                    # before one: not applied, not acked, fed again from the committed offset
                    continue
                if not await self._in_order(event.message):
                    continue
                if isinstance(item, Exception):
                    self._hold(event)
                    await self._reject(event, item)
                    continue
                self._segment(item)
                self._hold(event, 1 + len(item.segments))
                await self._on_record(event, item)
                counted[item.key] = counted.get(item.key, 0) + item.rows
            for key, rows in counted.items():
                monitored = self.scorer.models.get(key)
                if monitored is not None and rows:
                    self.metrics.predictions.labels(monitored.model, monitored.version).inc(rows)
            await self._flush_joins()
            begin = end

    def _parsed(self, event: Any) -> tuple[str, list[Any], bytes | None] | Exception:
        try:
            return self._predictions_of(event.message)
        except Exception as exc:  # noqa: BLE001 - any undecodable record is dead-lettered, never blocks
            return exc

    def _predictions_of(self, message: Any) -> tuple[str, list[Any], bytes | None]:
        """A record's version and predictions: one PredictionMade (and its bytes), or a PredictionBatch's,
        all of one monitored version. Raises what dead-letters the record."""
        event = self._parse(message, PREDICTION_TYPES)
        if event.source not in self.prediction_sources:
            raise UntrustedSource(f"prediction source {event.source[:MAX_SOURCE_SHOWN]!r} is not a prediction producer; "
                                  f"accepted: {', '.join(sorted(self.prediction_sources)) or 'none'}")
        if event.type == PREDICTION_TYPE:
            predictions, data = [inference_events.PredictionMade.FromString(event.data)], event.data
        else:
            predictions, data = list(inference_events.PredictionBatch.FromString(event.data).predictions), None
            if not predictions:
                raise InvalidArgument("predictions", "must hold at least one PredictionMade")
        first = predictions[0]
        key = model_version(first.model_name, first.model_version)
        for i, prediction in enumerate(predictions):
            if prediction.model_name != first.model_name or prediction.model_version != first.model_version:
                raise InvalidArgument(f"predictions[{i}]", f"is of {prediction.model_name[:80]!r} version "
                                      f"{prediction.model_version[:20]!r}, but the record's first is of {key!r}: "
                                      "a batch holds one version's predictions")
        if key not in self.scorer.models:
            raise UnknownModel(key, len(predictions))
        if message.key != key.encode():
            # a version's records on several partitions would each replace its open window (its rows
            # lost, and its records never acked: that partition's commits held back for good)
            raise InvalidArgument("key", f"must be the predictions' version {key[:120]!r}, so that one version's "
                                         f"records come in order on one partition, but got {brief(message.key)}")
        return key, predictions, data

    def _decode_parsed(self, events: list[Any], parsed: list[Any]) -> list[DecodedRecord | Exception]:
        """The predictions of one version in these records are decoded together (one numpy call per
        tensor); if that fails, record by record, then prediction by prediction, so only a record that
        holds a bad prediction is rejected (whole: it is one record)."""
        items: list[Any] = list(parsed)
        by_key: dict[str, list[int]] = {}
        for i, item in enumerate(parsed):
            if not isinstance(item, Exception):
                by_key.setdefault(item[0], []).append(i)
        models = self.scorer.models
        for key, indexes in by_key.items():
            monitored = models[key]
            together = [p for i in indexes for p in parsed[i][1]]
            try:
                batch, counts = self.scorer.decode_many(monitored, together)
            except Exception:  # noqa: BLE001 - a bad prediction or mixed layouts: record by record below
                for i in indexes:
                    items[i] = self._decode_alone(key, monitored, events[i].message, *parsed[i][1:])
                continue
            row = at = summarised = 0
            for i in indexes:
                _, predictions, data = parsed[i]
                rows = counts[at:at + len(predictions)]
                only = sum(not (p.infer_request and p.infer_response) for p in predictions)
                items[i] = DecodedRecord.of(key, predictions, data, [(batch, row, rows)], events[i].message,
                                            batch.summaries[summarised:summarised + only])
                row += sum(rows)
                at += len(rows)
                summarised += only
        return items

    def _decode_alone(self, key: str, monitored: Any, message: Any, predictions: list[Any],
                      data: bytes | None) -> DecodedRecord | Exception:
        try:
            batch, counts = self.scorer.decode_many(monitored, predictions)
            return DecodedRecord.of(key, predictions, data, [(batch, 0, counts)], message, batch.summaries)
        except Exception:  # noqa: BLE001 - mixed layouts in one record, or a bad prediction: one by one
            pass
        decodes, summaries = [], []
        for i, prediction in enumerate(predictions):
            try:
                one = self.scorer.decode(monitored, prediction)
            except Exception as exc:  # noqa: BLE001 - the record is dead-lettered with the reason
                if data is not None:
                    return exc
                field = f"predictions[{i}].{exc.field}" if isinstance(exc, InvalidArgument) else f"predictions[{i}]"
                return InvalidArgument(field, str(exc))
            decodes.append((one, 0, [len(one)]))
            summaries.extend(one.summaries)
        return DecodedRecord.of(key, predictions, data, decodes, message, summaries)

    def _segment(self, record: DecodedRecord) -> None:
        """Splits a record of a version monitored per segment by its predictions' segments, admitted in
        the order of the partition's offsets (the records are applied in that order: a replay admits the
        same), the bound's overflow to ``other`` (counted)."""
        monitored = self.scorer.models[record.key]
        parameter = monitored.config.segment_parameter
        if parameter is None:
            return
        book = self._segments.get(record.key)
        if book is None:  # the segments whose windows closed before (this process or another)
            prefix = record.key + SEPARATOR
            book = self._segments[record.key] = SegmentBook(
                k.removeprefix(prefix) for k in list(self.windows.data.keys())
                if isinstance(k, str) and k.startswith(prefix))
        segment_of, other = [], 0
        for prediction in record.predictions:
            segment, overflow = book.admit(parameter_value(prediction.infer_request, parameter))
            segment_of.append(segment)
            other += overflow
        if other:
            self.metrics.segment_other.labels(monitored.model, monitored.version).inc(other)
        record.split(segment_of)

    def _skip_unknown(self, event: Any, unknown: UnknownModel) -> None:
        """Counts and settles a valid record of a version nobody registered; logs it once a while per version."""
        self.metrics.skipped.labels("unknown_model").inc(unknown.predictions)
        now = time.monotonic()
        last = self._unknown_logged.get(unknown.key)
        if last is None or now - last >= UNKNOWN_LOG_INTERVAL_S:
            if len(self._unknown_logged) >= UNKNOWN_LOGGED_MAX:
                self._unknown_logged.clear()
            self._unknown_logged[unknown.key] = now
            log.warning("predictions of %r skipped: it is not monitored (register it with RegisterModel, or deploy "
                        "it through the inference-router); counted in opml_monitoring_scorer_predictions_skipped_total"
                        ", logged again in %.0f s at most", unknown.key[:120], UNKNOWN_LOG_INTERVAL_S)
        self._settle([event])

    async def _reject(self, event: Any, error: Exception) -> None:
        if isinstance(error, UnknownModel):
            self._skip_unknown(event, error)
            return
        reason = "untrusted" if isinstance(error, UntrustedSource) else "malformed"
        self.metrics.rejected.labels(reason).inc()
        message = event.message
        log.warning("record %s[%d]@%d dead-lettered (%s): %s", message.topic, message.partition,
                    message.offset, reason, str(error)[:300])
        await self._dead_letter(PREDICTIONS.dead_letter(self.platform.topic_prefix), event.message, error)
        self._settle([event])

    async def _on_record(self, event: Any, record: DecodedRecord) -> None:
        """Adds a record's predictions to its version's open window, whole, and each segment's part of
        them to that segment's open window: a record belongs to the windows open when it comes (by
        time: the ones its first prediction's time falls in), so windows close on record boundaries and
        a replay from any committed offset rebuilds them the same."""
        message = event.message
        partition, offset, key = message.partition, message.offset, record.key
        if partition in self._resuming:
            self._resuming.discard(partition)
            progress = self.windows.get(key)
            log.info("partition %d resumed at offset %d (%s: windows closed through offset %s)", partition, offset,
                     key, progress["through"] if progress is not None and progress["partition"] == partition else "-")
        spec = self.scorer.models[key].config.window
        placed: list[OpenWindow] = []
        for segment, part in (("", record), *record.segments.items()):
            window = await self._place(event, key, segment, part, spec)
            if window is not None:
                placed.append(window)
        if len(placed) == 1 + len(record.segments):
            # a record with a part in a window closed before had its joins kept before that close
            index = {window.segment: window.index for window in placed}
            for i, raw, request_id in record.joinable_at():
                segment = record.segment_of[i] if record.segment_of else ""
                self._joinable.append(Joinable(key, index[""], raw, request_id, partition, segment,
                                               index.get(segment, -1)))
        for window in placed:
            if spec.count is not None and window.rows >= spec.count:
                await self._close(window)
        self.processed += 1

    async def _place(self, event: Any, key: str, segment: str, record: DecodedRecord, spec: Any) -> OpenWindow | None:
        """Adds ``record`` (the version's record, or its part in ``segment``) to the open window of the
        version or the segment (first closing it by time); None: that window was closed before (a
        replay), the part is settled."""
        partition, offset = event.message.partition, event.message.offset
        wk = window_key(key, segment)
        progress = self.windows.get(wk)
        if progress is not None and progress["partition"] == partition and offset <= progress["through"]:
            self._settle([event])  # in a window closed before a restart or a rebalance
            return None
        window = self._open.get(wk)
        if window is None or window.partition != partition:
            index = progress["index"] if progress is not None else 0
            window = self._open[wk] = OpenWindow(index=index, partition=partition, key=key, segment=segment)
        if spec.seconds is not None and window.events and record.first >= window.first + spec.seconds:
            window = await self._close(window)
        parts = window.parts
        for batch, start, stop in record.parts:
            if parts and parts[-1][0] is batch and parts[-1][2] == start:
                parts[-1][2] = stop  # the next rows of the same decode: one range
            else:
                parts.append([batch, start, stop])
        window.summary_only += record.summary_only
        window.summaries.extend(record.summaries)
        window.events.append(event)
        window.rows += record.weight
        window.last_offset = offset
        if window.first is None:
            window.first = record.first
        window.last = record.last
        return window

    def _hold(self, event: Any, parts: int = 1) -> None:
        """An applied record (in offset order, ``_in_order``) is held until each window it went to settled it."""
        self._held.setdefault(event.message.partition, Held()).add(event, parts)

    def _settle(self, events: list[Any]) -> None:
        """These records are done with (their window saved, dead-lettered, or closed before); see :class:`Held`."""
        for event in events:
            held = self._held.get(event.message.partition)
            if held is not None:  # None: its partition was revoked since
                held.settle(event)

    async def _flush_joins(self) -> None:
        """Keeps the pending predictions for the label join and applies their parked labels. On a
        failure (Redis unreachable) they stay pending, and the next flush (the next batch's, or the
        close of their window) applies them again: their records are in open windows, not fed again,
        and dropped they were never kept for the join, their parked labels never applied."""
        if self._joinable:
            joinable, self._joinable = self._joinable, []
            try:
                await self.scorer.on_predictions_joinable(joinable)
            except BaseException:
                self._joinable[:0] = joinable
                raise

    async def _close(self, window: OpenWindow) -> OpenWindow:
        """Scores the open window, records it closed (the table, once per window), settles its events'
        parts, and opens the next. A close replayed after a crash rewrites the same window (the scorer
        saves by index, steps rules once)."""
        key = window_key(window.key, window.segment)
        await self._flush_joins()  # a label that came first is applied before the window reads its truth
        try:
            await self.scorer.score_window(window.key, window.index, _rows(key, window), window.first, window.last,
                                           segment=window.segment)
        except Unscorable as exc:
            await self._unscorable(window, exc)
        progress = {"index": window.index + 1, "partition": window.partition, "through": window.last_offset}
        # Sent to the changelog and awaited (the broker has it, acks=all) before the window's events
        # are acked: faust's commit flushes its producer buffer for at most 0.1 s, so a table write
        # through ``table[key] = ...`` (send_soon) may still be buffered when the source offsets
        # behind it are committed. Written to the window's own partition: the table is
        # co-partitioned with the predictions (a batch has no current event to take it from).
        table = self.windows
        sent = await table.changelog_topic.send(key=key, value=progress, partition=window.partition,
                                                key_serializer=table.key_serializer,
                                                value_serializer=table.value_serializer)
        await sent
        table.data[key] = progress
        self._settle(window.events)
        following = OpenWindow(index=window.index + 1, partition=window.partition, key=window.key,
                               segment=window.segment)
        if self._open.get(key) is window:
            self._open[key] = following
        return following

    async def _unscorable(self, window: OpenWindow, error: Unscorable) -> None:
        """A window its estimators cannot score goes to the dead-letter topic, record by record, with the
        reason, and is closed without a score: retried, it would fail on every close and replay, and
        its version would never be scored again. A segment's window is closed without a score and
        logged only: its records are in the version's window too, which dead-letters them if it fails."""
        if window.segment:
            log.error("%s; closed without a score", error)
            return
        log.error("%s; its %d records dead-lettered", error, len(window.events))
        self.metrics.rejected.labels("unscorable").inc(len(window.events))
        topic = PREDICTIONS.dead_letter(self.platform.topic_prefix)
        for event in window.events:
            await self._dead_letter(topic, event.message, error)

    async def _on_labels(self, events: list[Any]) -> None:
        """Applies a batch of labels (:meth:`Scorer.on_labels`), each as its event's source's (the
        producer) at its event time, in their order; a malformed one, or one from a producer its model
        does not accept (``UntrustedSource``), is dead-lettered with the reason. The events are acked
        once every one of them is applied or dead-lettered (at least once: a crash in between applies
        the batch again, and a label applied twice is a duplicate). An error that may pass (Redis
        unreachable) is retried here, from the first label it stopped, the partitions waiting, however
        long it lasts: it used to dead-letter a valid label as malformed, and raised out of the agent,
        faust would ack it. Any other error of the whole batch (not of one label) is met by applying
        its labels one at a time, so only the label that causes it is dead-lettered."""
        pending = events
        for attempt in itertools.count():
            outcomes = await self._apply_labels(pending)
            stopped = next((i for i, outcome in enumerate(outcomes) if is_retriable(outcome)), len(pending))
            for event, outcome in zip(pending[:stopped], outcomes[:stopped], strict=True):
                if isinstance(outcome, Exception):
                    await self._reject_label(event.message, outcome)
            if stopped == len(pending):
                break
            message, delay = pending[stopped].message, LABEL_RETRIES.delay(attempt)
            log.warning("label at %s@%d/%d not applied yet, retrying in %.1f s (with the %d after it): %s",
                        message.topic, message.partition, message.offset, delay, len(pending) - stopped - 1,
                        outcomes[stopped])
            await asyncio.sleep(delay)
            pending = pending[stopped:]
        for event in events:
            event.ack()

    async def _apply_labels(self, events: list[Any]) -> list[Any]:
        """Each event's outcome (a string) or error."""
        outcomes: list[Any] = [None] * len(events)
        items, at = [], []
        for i, event in enumerate(events):
            try:
                label = self._parse(event.message, (LABEL_TYPE,))
            except Exception as exc:  # noqa: BLE001 - dead-lettered with the reason
                outcomes[i] = exc
                continue
            items.append((label.data, LabelOrigin(label.source, label.time, label.id)))
            at.append(i)
        try:
            applied = await self.scorer.on_labels(items)
        except Exception as exc:  # noqa: BLE001 - retried, or the labels one by one
            if is_retriable(exc) or len(items) == 1:
                applied = [exc] * len(items)
            else:
                applied = [outcome for item in items for outcome in await self._apply_alone(item)]
        for i, outcome in zip(at, applied, strict=True):
            outcomes[i] = outcome
        return outcomes

    async def _apply_alone(self, item: tuple[bytes, LabelOrigin]) -> list[Any]:
        try:
            return await self.scorer.on_labels([item])
        except Exception as exc:  # noqa: BLE001 - retried, or this label dead-lettered
            return [exc]

    async def _reject_label(self, message: Any, error: Exception) -> None:
        log.warning("label at %s@%d/%d dead-lettered: %s", message.topic, message.partition, message.offset, error)
        self.metrics.labels.labels("untrusted" if isinstance(error, UntrustedSource) else "malformed").inc()
        await self._dead_letter(LABELS.dead_letter(self.platform.topic_prefix), message, error)
