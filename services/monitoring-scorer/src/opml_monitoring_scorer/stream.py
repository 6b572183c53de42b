"""The prediction and label streams, as a faust-streaming app (agents and tables, at least once).

``predictions`` agent, on opml.predictions.v1 (keyed ``<model>/<version>``, so one version's
predictions arrive in order on one partition): each event is decoded (a malformed one, or one of a
model nobody registered, goes to the topic's dead-letter topic with the reason, and the stream flows
on), appended to its version's open window, and the window is closed and scored when it holds
``window.count`` rows, or when an event's time is ``window.seconds`` past the window's first.
Window times are event times, so windows close the same way on a replay.

Two faust tables hold the open windows, with changelog topics so a restarted scorer recovers them:
``windows`` (version -> index, rows, times, the source offsets of its events and the last one
applied) and ``rows`` (``version|partition:offset`` -> the event's bytes). faust replays events after the last committed offset
(at least once); an event at or below the offset its window already applied is skipped, so a
restart neither loses a window nor counts an event twice. faust flushes the changelogs before it
commits source offsets.

``labels`` agent, on opml.labels.v1: each LabelObserved is joined to its prediction by request id in
Redis with expiry (the retention bound; see state.py), because labels are keyed by request id and
predictions by model version: a faust-table join would need both streams repartitioned by request
id first (two more internal topics); the Redis join is one lookup per label either way.

Every internal topic is created at start-up with the predictions topic's partition count (tansu
gives auto-created topics 4 partitions, and faust refuses a table whose changelog differs from its
source).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path
from typing import Any

import faust
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from opml.inference.v1 import events_pb2 as inference_events

from opml_common.bus import EventPublisher
from opml_common.bus.cloudevents import CloudEvent
from opml_common.bus.security import kafka_client_kwargs
from opml_common.config import PlatformSettings
from opml_common.errors import InvalidArgument
from opml_monitoring_scorer.core.scorer import Scorer, model_version
from opml_monitoring_scorer.metrics import ScorerMetrics
from opml_monitoring_scorer.topics import LABELS, PREDICTIONS

log = logging.getLogger(__name__)
PREDICTION_TYPE = "opml.inference.v1.PredictionMade"
LABEL_TYPE = "opml.monitoring.v1.LabelObserved"
MAX_EVENT_BYTES = 8 * 1024 * 1024


class UnknownModel(Exception):
    """A prediction of a model version nobody registered for monitoring."""


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


class ScoringStream:
    """Side effects:
        ``start()``: creates the internal topics, starts the faust app (joins the consumer group,
        recovers the tables from their changelogs, then consumes). Idempotent.
        ``stop()``: stops the app (commits what was processed). Idempotent.
    """

    def __init__(self, platform: PlatformSettings, scorer: Scorer, metrics: ScorerMetrics, *,
                 publisher: EventPublisher, datadir: Path, app_id: str = "monitoring-scorer") -> None:
        self.platform = platform
        self.scorer = scorer
        self.metrics = metrics
        self.publisher = publisher
        self.datadir = datadir
        self.app_id = platform.topic_prefix + app_id
        self.app: faust.App | None = None
        self.processed = 0

    def _internal_topics(self) -> dict[str, int]:
        partitions = PREDICTIONS.partitions
        return {f"{self.app_id}-windows-changelog": partitions, f"{self.app_id}-rows-changelog": partitions,
                f"{self.app_id}-__assignor-__leader": 1}

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

    async def start(self) -> None:
        if self.app is not None:
            return
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
            loop=asyncio.get_running_loop())
        predictions = app.topic(PREDICTIONS.full_name(platform.topic_prefix), key_type=bytes, value_type=bytes,
                                key_serializer="raw", value_serializer="raw", partitions=PREDICTIONS.partitions)
        labels = app.topic(LABELS.full_name(platform.topic_prefix), key_type=bytes, value_type=bytes,
                           key_serializer="raw", value_serializer="raw", partitions=LABELS.partitions)
        self.windows = app.Table("windows", default=None, partitions=PREDICTIONS.partitions)
        # values are base64 text: faust's table recovery decodes changelog values as JSON whatever the
        # table's declared serializer (a raw-bytes table recovered to 'utf-8' errors here)
        self.rows = app.Table("rows", default=None, partitions=PREDICTIONS.partitions)

        async def on_predictions(stream: Any) -> None:
            async for event in stream.events():
                await self._on_prediction(event)

        async def on_labels(stream: Any) -> None:
            async for event in stream.events():
                await self._on_label(event)

        app.agent(predictions, name="predictions")(on_predictions)
        app.agent(labels, name="labels")(on_labels)
        self.app = app
        await app.start()

    async def stop(self) -> None:
        if self.app is None:
            return
        app, self.app = self.app, None
        await app.stop()

    async def _dead_letter(self, topic_name: str, message: Any, error: Exception) -> None:
        headers = [*(message.headers or ()),
                   ("opml_error", str(error)[:1024].encode("utf-8", "replace")),
                   ("opml_error_type", type(error).__name__.encode()),
                   ("opml_source_topic", message.topic.encode()),
                   ("opml_source_partition", str(message.partition).encode()),
                   ("opml_source_offset", str(message.offset).encode()),
                   ("opml_consumer_group", self.app_id.encode())]
        await self.publisher.send_raw(topic_name, message.value, key=message.key, headers=headers)

    def _parse(self, message: Any, expected: str) -> bytes:
        if message.value is None or len(message.value) > MAX_EVENT_BYTES:
            raise InvalidArgument("value", f"must be a CloudEvent of at most {MAX_EVENT_BYTES} bytes")
        headers = [(k, v) for k, v in (message.headers or ())]
        event = CloudEvent.from_kafka(headers, message.value, timestamp_ms=message.timestamp
                                      and int(message.timestamp * 1000))
        if event.type != expected:
            raise InvalidArgument("ce_type", f"must be {expected}, but got {event.type[:80]!r}")
        return event.data

    async def _on_prediction(self, event: Any) -> None:
        message = event.message
        try:
            data = self._parse(message, PREDICTION_TYPE)
            prediction = inference_events.PredictionMade.FromString(data)
            key = model_version(prediction.model_name, prediction.model_version)
            monitored = self.scorer.models.get(key)
            if monitored is None:
                raise UnknownModel(f"model {prediction.model_name[:80]!r} version {prediction.model_version[:20]!r} "
                                   "is not monitored (register it, or deploy it through the inference-router)")
            batch = self.scorer.decode(monitored, prediction)
        except UnknownModel as exc:
            self.metrics.rejected.labels("unknown_model").inc()
            await self._dead_letter(PREDICTIONS.dead_letter(self.platform.topic_prefix), message, exc)
            return
        except Exception as exc:  # noqa: BLE001 - any undecodable event is dead-lettered, never blocks
            self.metrics.rejected.labels("malformed").inc()
            await self._dead_letter(PREDICTIONS.dead_letter(self.platform.topic_prefix), message, exc)
            return
        state = self.windows.get(key) or {"index": 0, "rows": 0, "offsets": [], "first": None, "last": None,
                                          "partition": message.partition, "offset": -1}
        spec = monitored.config.window
        row_key = f"{key}|{message.partition}:{message.offset}"
        if state["partition"] == message.partition and message.offset <= state["offset"]:
            # applied before a restart (faust replays from the last committed offset): skip it, but
            # restore its row if the rows changelog lost it while the windows changelog kept the state
            if message.offset in state["offsets"] and self.rows.get(row_key) is None:
                self.rows[row_key] = base64.b64encode(data).decode()
            return
        if spec.count is not None and state["rows"] >= spec.count:
            state = await self._close(key, state)  # full before a crash, not closed: close it now
        when = prediction.time.ToNanoseconds() / 1e9 if prediction.HasField("time") else message.timestamp
        if spec.seconds is not None and state["offsets"] and when >= state["first"] + spec.seconds:
            state = await self._close(key, state)
        self.rows[row_key] = base64.b64encode(data).decode()
        if state["first"] is None:
            state["first"] = when
        state["last"] = when
        state["offsets"] = [*state["offsets"], message.offset]
        state["rows"] += len(batch) or 1
        state["partition"], state["offset"] = message.partition, message.offset
        self.metrics.predictions.labels(monitored.model, monitored.version).inc(len(batch))
        if prediction.request_id and len(batch):
            await self.scorer.on_prediction_joinable(key, state["index"], data, prediction.request_id)
        if spec.count is not None and state["rows"] >= spec.count:
            state = await self._close(key, state)
        self.windows[key] = state
        self.processed += 1

    async def _close(self, key: str, state: dict) -> dict:
        """Scores the open window (its rows read back from the table), then empties it. A close
        replayed after a crash rewrites the same window (the scorer saves by index, steps rules once)."""
        index = state["index"]
        names = [f"{key}|{state['partition']}:{offset}" for offset in state["offsets"]]
        events = [self.rows.get(name) for name in names]
        missing = sum(e is None for e in events)
        if missing:
            log.error("window %d of %s: %d rows missing from the rows table", index, key, missing)
        await self.scorer.close_window(key, index, [base64.b64decode(e) for e in events if e is not None],
                                       state["first"], state["last"])
        for name in names:
            self.rows.pop(name, None)
        return {**state, "index": index + 1, "rows": 0, "offsets": [], "first": None, "last": None}

    async def _on_label(self, event: Any) -> None:
        message = event.message
        try:
            data = self._parse(message, LABEL_TYPE)
            await self.scorer.on_label(data)
        except Exception as exc:  # noqa: BLE001 - a malformed label is dead-lettered with the reason
            log.warning("label at %s@%d/%d dead-lettered: %s", message.topic, message.partition, message.offset, exc)
            self.metrics.labels.labels("malformed").inc()
            await self._dead_letter(LABELS.dead_letter(self.platform.topic_prefix), message, exc)
