"""The scorer's durable state in Redis: registrations, window history, rule states, alerts, the label join.

Keys (under ``{redis_prefix}monitoring:``; ``{mv}`` is ``model/version``, ``{wk}`` is ``{mv}`` for the
version as a whole and ``{mv}#{segment}`` for one of its segments, core/segments.py):

| key | what |
|---|---|
| ``models`` (hash) | ``{mv}`` -> the registration (reference bundle, config YAML, how it was registered) |
| ``rules:{mv}`` | the rules YAML set through SetRules (overrides the bundle's) |
| ``baseline:{mv}`` | a version without a reference: its first window's rows (a reference.npz), the baseline |
| ``windows:{wk}`` (hash) + ``windex:{wk}`` (zset) | window index -> its score record; the index for paging |
| ``rows:{wk}`` | the rows of every window saved (a running total, so the status reads no window) |
| ``rulestate:{wk}`` (hash) | rule -> run counts, firing, the last window applied (replays are skipped) |
| ``alerts:{wk}`` (hash) + ``aindex:{wk}`` (zset) | ``{rule}@{window}`` -> the alert, newest first |
| ``pred:{request id}`` | the prediction a late label joins to (a JSON line of model version and window, and its segment's and window there, then the event's bytes), expires |
| ``labels:{request id}`` (hash) | producer -> its label that came before its prediction (the newest by event time), until its join applies it (or it is dropped), expires |
| ``joined:{request id}`` (hash) | the label applied: its producer, event time, event id, truth (correct count or error sum) and a digest of its values, expires |
| ``truth:{wk}:{window}`` (hash) | labelled rows and their correct count (or absolute error sum) |
| ``segments:{mv}`` (set) | the segments of the version that closed a window (bounded, core/segments.py) |
| ``labelproducers`` (set) | the label producers some model's monitoring.yaml names (a label may be parked only from one of them, or from the platform's) |

Everything is written idempotently (by window index, rule, request id and label event), so a replay
after a crash rewrites the same values instead of counting twice. Keys of the older forms:
``label:{request id}`` (a parked label whose producer was not recorded) is not read (it expires);
``joined:{request id}`` as a string (a label applied before producers were recorded) keeps its request
labelled (a later label is from another producer).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from opml_common.lifecycle import Component
from opml_monitoring_scorer.core.records import AlertRecord
from opml_monitoring_scorer.core.segments import window_key

_REMEMBER = """
local ttl, pred, parked = ARGV[1], ARGV[2], ARGV[3]
local found = {}
for i = 4, #ARGV, 2 do
  local id = ARGV[i]
  redis.call('SET', pred .. id, ARGV[i + 1], 'EX', ttl)
  for _, label in ipairs(redis.call('HVALS', parked .. id)) do
    found[#found + 1] = (i - 4) / 2
    found[#found + 1] = label
  end
end
return found
"""
"""Keeps predictions for the label join: ARGV retention, the pred: and labels: key prefixes, then per
prediction its request id and record; returns [index (from 0), parked label, ...] for the labels that
came first, each producer's. It leaves them parked: each is unparked by the script that applies it
(``_JOIN``), or by ``_UNPARK`` once it is dropped, so after a failure before then (Redis going away,
the process dying) the prediction replayed finds them again; it used to delete them here, and they
were lost."""

_UNPARK_LABEL = """
local function unpark(key, producer, time)
  local held = redis.call('HGET', key, producer)
  if held and string.match(held, '^%d+ (%d+)\\n') == time then
    redis.call('HDEL', key, producer)
  end
end
"""
"""Lua: deletes ``producer``'s label parked under ``key`` if it is the one of event time ``time`` (fixed
width), not one parked since."""

_UNPARK = _UNPARK_LABEL + """
for i = 2, #ARGV, 3 do
  unpark(ARGV[1] .. ARGV[i], ARGV[i + 1], ARGV[i + 2])
end
"""
"""Unparks labels dropped when their predictions came (untrusted, malformed, unjoinable): ARGV the
labels: key prefix, then per label its request id, producer and event time."""

_PARK = """
local ttl, parked, pred = ARGV[1], ARGV[2], ARGV[3]
local out = {}
for i = 4, #ARGV, 4 do
  local id, producer, time = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local key, result = parked .. id, 1
  if redis.call('EXISTS', pred .. id) == 1 then
    result = -1
  else
    local held = redis.call('HGET', key, producer)
    local seq = redis.call('HLEN', key)
    if held then
      local order, stamp = string.match(held, '^(%d+) (%d+)\\n')
      if time <= stamp then
        result = 0
      end
      seq = order
    end
    if result == 1 then
      redis.call('HSET', key, producer, seq .. ' ' .. time .. '\\n' .. ARGV[i + 3])
      redis.call('EXPIRE', key, ttl)
    end
  end
  out[#out + 1] = result
end
return out
"""
"""Parks labels that came before their predictions, in order, in one call: ARGV their expiry, the
labels: and pred: key prefixes, then per label its request id, producer, event time (fixed width,
compared as strings) and record. Each is kept as its producer's unless that producer's parked one is as
new; the record is kept after its arrival order among the producers and its time. Returns per label 1
when parked, 0 when not newer, -1 when its prediction is there: it came after the label looked for it,
and took the labels parked then, so one parked now would wait for it forever."""

_JOIN = _UNPARK_LABEL + """
local ttl, truth_ttl, joined, truth, parked = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local out = {}
for i = 6, #ARGV, 10 do
  local claimed, version, segment = joined .. ARGV[i], truth .. ARGV[i + 1], ARGV[i + 2]
  local rows, total, producer, time, id = ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7]
  local values = ARGV[i + 8]
  local delta, outcome = total, 'joined'
  if ARGV[i + 9] == '1' then
    unpark(parked .. ARGV[i], producer, time)
  end
  local kind = redis.call('TYPE', claimed)['ok']
  if kind == 'string' then
    outcome = 'other_producer'
  elseif kind == 'hash' then
    local claim = redis.call('HMGET', claimed, 'producer', 'time', 'id', 'total', 'values')
    if claim[1] ~= producer then
      outcome = 'other_producer'
    elseif claim[3] == id or time <= claim[2] then
      outcome = 'duplicate'
    elseif claim[5] == values then
      outcome = 'duplicate'
      redis.call('HSET', claimed, 'time', time, 'id', id)
    else
      rows, delta, outcome = 0, string.format('%.17g', tonumber(total) - tonumber(claim[4])), 'corrected'
    end
  end
  if segment ~= '' then
    segment = truth .. segment
  end
  if outcome == 'joined' or outcome == 'corrected' then
    redis.call('HSET', claimed, 'producer', producer, 'time', time, 'id', id, 'total', total, 'values', values)
    redis.call('EXPIRE', claimed, ttl)
    redis.call('HINCRBY', version, 'labelled', rows)
    redis.call('HINCRBYFLOAT', version, 'total', delta)
    redis.call('EXPIRE', version, truth_ttl)
    if segment ~= '' then
      redis.call('HINCRBY', segment, 'labelled', rows)
      redis.call('HINCRBYFLOAT', segment, 'total', delta)
      redis.call('EXPIRE', segment, truth_ttl)
    end
  end
  local now = redis.call('HMGET', version, 'labelled', 'total')
  local seg = {'0', '0'}
  if segment ~= '' then
    seg = redis.call('HMGET', segment, 'labelled', 'total')
  end
  out[#out + 1] = outcome
  out[#out + 1] = now[1] or '0'
  out[#out + 1] = now[2] or '0'
  out[#out + 1] = seg[1] or '0'
  out[#out + 1] = seg[2] or '0'
end
return out
"""
"""Applies labels to their requests' windows, in order, in one call: ARGV the claims' expiry, the
truths' expiry, the joined:, truth: and labels: key prefixes, then per label its request id, window
(``{wk}:{window}``), its segment's window (``{wk}#{segment}:{window}``, "" in none), rows, correct count
(or error sum), producer, event time (fixed width), event id, a digest of its values and "1" for a
label that was parked ("" otherwise). Each label claims its request id and adds its rows to its
window's truth (and its segment window's) in one step, a parked one unparked in that step too: once
applied (whatever its outcome) it is not found again, and until then it stays parked.
A request already claimed keeps its label unless this one is its producer's with a newer time and other
values (a correction: the truth takes the difference, its rows counted once); the same values again
under a newer time and another event id (the same labels sent again, e.g. a SubmitLabels call without
times retried) are a duplicate, which moves the claim's time and id on (a label of the producer older
than it is then not newer). Returns per label [outcome, the window's labelled rows and
total, the segment window's ("0" in none)] as they stand after it: joined, corrected, duplicate (that
event again, or not newer), other_producer; the truth is returned whatever the outcome, so a window
saved before its truth's last change (a crash between the two) is saved again when a label comes
again."""

_ROWS = """
if redis.call('EXISTS', KEYS[3]) == 0 and redis.call('ZCARD', KEYS[2]) > 0 then
  local rows = 0
  for _, record in ipairs(redis.call('HVALS', KEYS[1])) do
    rows = rows + cjson.decode(record)['rows']
  end
  redis.call('SET', KEYS[3], rows)
end
"""
"""Sums the rows of windows saved before the running total (KEYS[3]) was kept, once: KEYS[1] the
windows, KEYS[2] their index. Run first by the scripts below."""

_SAVE_WINDOW = _ROWS + """
if redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1]) == 1 then
  redis.call('INCRBY', KEYS[3], ARGV[3])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
"""
"""Saves window ARGV[1] (its record ARGV[2], of ARGV[3] rows) and adds its rows to the total the first
time it is saved: a window saved again (a replayed close, a label joined) is not counted twice."""

_TOTAL_ROWS = _ROWS + "return redis.call('GET', KEYS[3])"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _prediction_record(raw: bytes) -> tuple[str, int, bytes, str, int]:
    head, _, event = raw.partition(b"\n")
    data = json.loads(head)
    return (data["mv"], int(data["window"]), bytes.fromhex(data["event"]) if "event" in data else event,
            data.get("segment", ""), int(data.get("segment_window", -1)))


@dataclass(frozen=True)
class LabelOrigin:
    """Who sent a label and when: its event's source (the producer), time and id. A request's label is
    replaced only by its producer's with a newer time (a correction)."""

    producer: str
    time: datetime
    event_id: str

    @property
    def stamp(self) -> str:
        """The time as fixed-width microseconds since the epoch (0 before it): the scripts compare
        these as strings (a Lua number, a double, has no exact nanoseconds)."""
        return f"{max(0, (self.time - _EPOCH) // timedelta(microseconds=1)):020d}"


@dataclass(frozen=True)
class TruthJoin:
    """One label to apply to its request's window (:meth:`MonitorStore.join_truths`): its rows and
    correct count (or absolute error sum), and ``segment``: (``{mv}#{segment}``, its window) of a
    prediction in a segment, whose truth takes the label too."""

    request_id: str
    mv: str
    window: int
    labelled: int
    total: float
    origin: LabelOrigin
    segment: tuple[str, int] | None = None
    values: str = ""
    """A digest of the label's values (:func:`values_digest`): its producer's label again with a newer
    time and the same values changes nothing (a duplicate), with other values it is a correction."""
    parked: bool = False
    """The label was parked (it came before its prediction): the join unparks it."""


def values_digest(values: np.ndarray) -> str:
    """A short digest of a label's values (float64), kept in its request's claim."""
    return hashlib.blake2b(np.ascontiguousarray(values, dtype=np.float64).tobytes(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class ParkedLabel:
    """A label that came before its prediction, as parked: its origin and LabelObserved bytes."""

    origin: LabelOrigin
    data: bytes


class MonitorStore(Component):
    """Side effects: none until used; ``start()`` checks that Redis answers, ``stop()`` does nothing (the
    Redis client is the service's)."""

    def __init__(self, redis: aioredis.Redis, *, prefix: str, retention_s: int) -> None:
        super().__init__()
        self.redis = redis
        self.prefix = prefix + "monitoring:"
        self.retention_s = retention_s
        self._remember: Any = None
        self._join: Any = None
        self._park: Any = None
        self._unpark: Any = None
        self._save_window: Any = None
        self._total_rows: Any = None

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def on_start(self) -> None:
        await self.redis.ping()

    # registrations
    async def save_registration(self, mv: str, registration: dict[str, Any]) -> None:
        await self.redis.hset(self._k("models"), mv, json.dumps(registration))

    async def registrations(self) -> dict[str, dict[str, Any]]:
        raw = await self.redis.hgetall(self._k("models"))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def registration(self, mv: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(self._k("models"), mv)
        return None if raw is None else json.loads(raw)

    async def set_rules(self, mv: str, text: str) -> None:
        await self.redis.set(self._k("rules", mv), text)

    async def get_rules(self, mv: str) -> str | None:
        value = await self.redis.get(self._k("rules", mv))
        return None if value is None else value.decode()

    async def keep_baseline(self, mv: str, data: bytes) -> bytes | None:
        """Keeps ``data`` as the version's baseline unless one is kept: None, or the one kept first."""
        return await self.redis.set(self._k("baseline", mv), data, nx=True, get=True)

    async def baseline(self, mv: str) -> bytes | None:
        return await self.redis.get(self._k("baseline", mv))

    # windows
    async def save_window(self, mv: str, record: dict[str, Any]) -> None:
        if self._save_window is None:
            self._save_window = self.redis.register_script(_SAVE_WINDOW)
        await self._save_window(keys=self._window_keys(mv), args=[record["index"], json.dumps(record), record["rows"]])

    def _window_keys(self, mv: str) -> list[str]:
        return [self._k("windows", mv), self._k("windex", mv), self._k("rows", mv)]

    async def total_rows(self, mv: str) -> int:
        """The rows of every window saved, in O(1) (kept as windows are saved)."""
        if self._total_rows is None:
            self._total_rows = self.redis.register_script(_TOTAL_ROWS)
        return int(await self._total_rows(keys=self._window_keys(mv), args=[]) or 0)

    async def get_window(self, mv: str, index: int) -> dict[str, Any] | None:
        raw = await self.redis.hget(self._k("windows", mv), str(index))
        return None if raw is None else json.loads(raw)

    async def windows(self, mv: str, *, before: int | None, limit: int) -> list[dict[str, Any]]:
        """Newest first, indexes below ``before`` (None: from the newest)."""
        top = "+inf" if before is None else f"({before}"
        indexes = await self.redis.zrevrangebyscore(self._k("windex", mv), top, "-inf", start=0, num=limit)
        if not indexes:
            return []
        raws = await self.redis.hmget(self._k("windows", mv), indexes)
        return [json.loads(r) for r in raws if r is not None]

    async def window_count(self, mv: str) -> int:
        return int(await self.redis.zcard(self._k("windex", mv)))

    # rules and alerts
    async def rule_states(self, mv: str) -> dict[str, dict[str, Any]]:
        raw = await self.redis.hgetall(self._k("rulestate", mv))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def save_rule_states(self, mv: str, states: dict[str, dict[str, Any]]) -> None:
        if states:
            await self.redis.hset(self._k("rulestate", mv), mapping={k: json.dumps(v) for k, v in states.items()})

    async def save_alert(self, alert: AlertRecord) -> None:
        mv = window_key(f"{alert.model}/{alert.version}", alert.segment)
        key = f"{alert.rule}@{alert.raised_at_window}"
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._k("alerts", mv), key, json.dumps(alert.to_dict()))
            pipe.zadd(self._k("aindex", mv), {key: alert.raised_at_window})
            await pipe.execute()

    async def alerts(self, mv: str, *, below: int | None, limit: int) -> list[AlertRecord]:
        """The newest ``limit`` alerts raised at a window below ``below`` (None: from the newest), and
        every other alert raised at the oldest window of those: the API orders one window's alerts by
        rule, the index by its member, so a page cut inside a window would skip some."""
        top = "+inf" if below is None else f"({below}"
        found = await self.redis.zrevrangebyscore(self._k("aindex", mv), top, "-inf", start=0, num=limit,
                                                  withscores=True)
        keys = [key for key, _ in found]
        if len(found) == limit:
            keys += await self.redis.zrangebyscore(self._k("aindex", mv), found[-1][1], found[-1][1])
        return await self._alerts(mv, list(dict.fromkeys(keys)))

    async def alerts_at(self, mv: str, window: int) -> list[AlertRecord]:
        """The alerts raised at ``window`` (one per rule at most)."""
        return await self._alerts(mv, await self.redis.zrangebyscore(self._k("aindex", mv), window, window))

    async def _alerts(self, mv: str, keys: list[bytes]) -> list[AlertRecord]:
        if not keys:
            return []
        raws = await self.redis.hmget(self._k("alerts", mv), keys)
        return [AlertRecord.from_dict(json.loads(r)) for r in raws if r is not None]

    async def firing(self, mv: str) -> list[str]:
        states = await self.rule_states(mv)
        return sorted(rule for rule, state in states.items() if state.get("firing"))

    # label join
    async def remember_predictions(self, items: list[tuple[str, str, int, bytes, str, int]]
                                   ) -> list[list[ParkedLabel]]:
        """Keeps each (request id, model version, window, event, segment, the segment's window; "" and
        -1 for a prediction in no segment) for a late label, in one round trip:
        one script call (``_REMEMBER``) that SETs each prediction's record with its expiry and reads the
        labels that came first; returns them in order (each producer's, in the order they came; none
        where none did). They stay parked until :meth:`join_truths` applies them (``parked``) or
        :meth:`unpark_labels` drops them, so a prediction replayed after a failure in between finds them
        again. A script, not a pipeline of a SET per prediction and an MGET: redis-py's cost
        is per command and per reply (~25 µs of the scorer's CPU per prediction in a pipeline, ~2 µs as
        a script's arguments). The script builds its keys from the prefix it is given (one Redis, not a
        cluster: the platform's). Not a transaction in intent: each request's keys are its own, a
        replay after a crash writes the same values, and a label found twice is applied once
        (:meth:`join_truths`)."""
        if not items:
            return []
        headers: dict[tuple[str, int, str, int], bytes] = {}  # one per window: its events share it
        args: list[Any] = [self.retention_s, self._k("pred", ""), self._k("labels", "")]
        for request_id, mv, window, event, segment, segment_window in items:
            header = headers.get((mv, window, segment, segment_window))
            if header is None:
                head: dict[str, Any] = {"mv": mv, "window": window}
                if segment:
                    head.update(segment=segment, segment_window=segment_window)
                header = headers[mv, window, segment, segment_window] = json.dumps(head).encode() + b"\n"
            args += (request_id, header + event)
        if self._remember is None:
            self._remember = self.redis.register_script(_REMEMBER)
        found = await self._remember(keys=[], args=args)
        parked: list[list[tuple[int, ParkedLabel]]] = [[] for _ in items]
        for at in range(0, len(found), 2):
            order, _, rest = found[at + 1].partition(b" ")
            _, _, rest = rest.partition(b"\n")
            head, _, data = rest.partition(b"\n")
            origin = json.loads(head)
            parked[int(found[at])].append((int(order), ParkedLabel(LabelOrigin(
                origin["producer"], datetime.fromisoformat(origin["time"]), origin["id"]), data)))
        return [[label for _, label in sorted(labels, key=lambda item: item[0])] for labels in parked]

    async def find_predictions(self, request_ids: list[str]) -> list[tuple[str, int, bytes, str, int] | None]:
        """Each request's prediction kept for the join (:meth:`find_prediction`), in one round trip (MGET)."""
        if not request_ids:
            return []
        raws = await self.redis.mget([self._k("pred", request_id) for request_id in request_ids])
        return [None if raw is None else _prediction_record(raw) for raw in raws]

    async def find_prediction(self, request_id: str) -> tuple[str, int, bytes, str, int] | None:
        """(model version, window, event, segment, the segment's window: "" and -1 in none). The record
        is a JSON line (model version, window, segment and its window) then the event's bytes as they
        are (no hex in JSON: a prediction's record is written per event). A record of the older form
        (one JSON object, the event in hex), written before an upgrade, still reads."""
        return (await self.find_predictions([request_id]))[0]

    async def park_labels(self, labels: list[tuple[str, ParkedLabel]]) -> list[str]:
        """Parks labels that came before their predictions (request id, label), in order, in one round
        trip (one call of ``_PARK``; it was a call per label): each as its producer's (``parked``),
        unless that producer's parked one is as new (``duplicate``), or the prediction has come since
        the label looked for it (``arrived``: join it). Each producer's is kept apart, so whether a label
        is trusted for the request's model is decided when its prediction comes, and one producer's
        label never displaces another's. Labels of one request apply in their order, so a batch ends
        as the labels one by one would. The script builds its keys from the prefixes it is given (one
        Redis, not a cluster), as ``_REMEMBER`` does."""
        if not labels:
            return []
        if self._park is None:
            self._park = self.redis.register_script(_PARK)
        args: list[Any] = [self.retention_s, self._k("labels", ""), self._k("pred", "")]
        for request_id, label in labels:
            origin = label.origin
            head = json.dumps({"producer": origin.producer, "time": origin.time.isoformat(), "id": origin.event_id})
            args += (request_id, origin.producer, origin.stamp, head.encode() + b"\n" + label.data)
        out = await self._park(keys=[], args=args)
        return ["arrived" if parked < 0 else "parked" if parked else "duplicate" for parked in map(int, out)]

    async def unpark_labels(self, labels: list[tuple[str, LabelOrigin]]) -> None:
        """Deletes parked labels (request id, origin) that were dropped when their predictions came, in
        one round trip (``_UNPARK``); a producer's label parked since (a newer one) stays."""
        if not labels:
            return
        if self._unpark is None:
            self._unpark = self.redis.register_script(_UNPARK)
        args: list[Any] = [self._k("labels", "")]
        for request_id, origin in labels:
            args += (request_id, origin.producer, origin.stamp)
        await self._unpark(keys=[], args=args)

    async def join_truths(self, joins: list[TruthJoin]) -> list[tuple[str, tuple[int, float], tuple[int, float]]]:
        """Applies requests' labels to their windows' truth, in order, in one script call (``_JOIN``):
        per label (outcome, the window's labelled rows and total after it, the segment window's: (0, 0.0)
        in none). ``joined``: the request's first label; ``corrected``: its producer's again with a newer
        event time and other values, which replaces it (the truth takes the difference); ``duplicate``
        (that event again, or its producer's, not newer or with the same values) and ``other_producer`` (the request was labelled by another
        producer, whose label stays) change nothing. A label that was parked (``parked``) is unparked in the
        same step, whatever its outcome. The claim and the truth are made together: claimed
        first and then added, a failure between the two (a crash, Redis going away) left the label
        claimed and never counted, and its replay was taken for a duplicate. A script, not a pipeline
        of a call per label: redis-py's cost is per command and per reply. Labels of one request
        apply in their order, so a batch ends as the labels one by one would."""
        if not joins:
            return []
        if self._join is None:
            self._join = self.redis.register_script(_JOIN)
        args: list[Any] = [self.retention_s, max(self.retention_s * 4, 86_400), self._k("joined", ""),
                           self._k("truth", ""), self._k("labels", "")]
        for join in joins:
            origin = join.origin
            args += (join.request_id, f"{join.mv}:{join.window}",
                     "" if join.segment is None else f"{join.segment[0]}:{join.segment[1]}", join.labelled,
                     repr(float(join.total)), origin.producer, origin.stamp, origin.event_id, join.values,
                     "1" if join.parked else "")
        out = await self._join(keys=[], args=args)
        return [(out[at].decode(), (int(out[at + 1]), float(out[at + 2])), (int(out[at + 3]), float(out[at + 4])))
                for at in range(0, len(out), 5)]

    async def add_label_producers(self, producers: frozenset[str]) -> None:
        """Records producers a model names, so that any scorer process may park their labels."""
        if producers:
            await self.redis.sadd(self._k("labelproducers"), *sorted(producers))

    async def is_label_producer(self, producer: str) -> bool:
        """Whether some model's monitoring.yaml names ``producer`` (:meth:`add_label_producers`)."""
        return bool(await self.redis.sismember(self._k("labelproducers"), producer))

    async def add_segment(self, mv: str, segment: str) -> None:
        """Records a segment of the version that closed a window (the API lists them)."""
        await self.redis.sadd(self._k("segments", mv), segment)

    async def segments(self, mv: str) -> list[str]:
        return sorted(s.decode() for s in await self.redis.smembers(self._k("segments", mv)))

    async def truth(self, mv: str, window: int) -> tuple[int, float]:
        raw = await self.redis.hgetall(self._k("truth", mv, str(window)))
        return int(raw.get(b"labelled", 0)), float(raw.get(b"total", 0.0))
