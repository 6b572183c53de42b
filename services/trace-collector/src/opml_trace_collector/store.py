"""The Redis model of jobs, runs, step series and the tracers' control keys.

Keys (``P`` = ``settings.redis_prefix + "traces:"``); each kind of key ends in its own suffix, so
no job or session name can make two keys collide:

* ``P enabled`` ("0"/"1") and ``P capture:{job}`` (JSON, with a TTL): the control keys the
  tracers poll (see :mod:`opml_trace_collector.captures`).
* ``P generation``: the id of this state, written when the state is first built (see
  :meth:`TraceStore.generation`; the consumer group is named after it).
* ``P jobs``: sorted set job -> last heard (epoch s); ``P job:{job}:info``: hash of first/last
  seen, step count and total step seconds; ``P job:{job}:runs``: sorted set session -> first heard.
* ``P run:{session}:info``: hash of the run (identity, TracerStarted/Stopped facts, counters,
  ``seq_low``/``seq_high``); ``P run:{session}:seqs``: batch sequences applied above ``seq_low``;
  ``P run:{session}:sigs``: per-signature aggregates (``stat\\tkind\\tsignature`` fields);
  ``P run:{session}:series``: sorted set of the last ``series_length`` step records (the bytes of
  their ``opml.traces.v1.StepRecord`` message, :mod:`convert`'s storage encoding) scored by start time
  in microseconds.

The store takes and returns the domain types of :mod:`opml_trace_collector.model`.

A batch is applied by one Lua script: the (session, sequence) check and every effect happen
atomically, so a batch delivered twice, late or out of order counts once, and a crash cannot
leave it half applied. ``seq_low`` is the first sequence not yet seen; sequences above it that
arrived early wait in ``:seqs`` until the gap closes, so the set stays as small as the gaps.

Every time kept ("first/last seen", "heard") is an event's time, never the time it was applied,
and is kept as a min or max: the state depends on which events came, not on when or in what order,
so replaying the topic into an empty Redis rebuilds it as it was.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from opml_common.errors import InvalidArgument, NotFound
from opml_trace_collector import model
from opml_trace_collector.convert import decode_step, encode_step

# Lua shared by the scripts: "seen" times are the events' times, kept as min (first) and max (last),
# so replaying the topic in any order rebuilds the same state.
_SEEN = """
local function seen(hash, when)
  local first = redis.call('HGET', hash, 'first_seen')
  if not first or tonumber(when) < tonumber(first) then redis.call('HSET', hash, 'first_seen', when) end
  local last = redis.call('HGET', hash, 'last_seen')
  if not last or tonumber(when) > tonumber(last) then redis.call('HSET', hash, 'last_seen', when) end
end
local function touch(info, jobs, jobinfo, jobruns, job, session, when)
  seen(info, when)
  seen(jobinfo, when)
  redis.call('ZADD', jobs, 'GT', when, job)
  redis.call('ZADD', jobruns, 'LT', when, session)
end
"""

# KEYS: run info, jobs, job info, job runs; ARGV: when, job, session, then field/value pairs of the run.
_RECORD_FACTS = _SEEN + """
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
touch(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[1])
return 1
"""

# Redis does not roll a script back: every number the writes take is checked before the first write
# (each signature's count, total, min, max, input wait and examples; then the steps and their time).
_APPLY_BATCH = _SEEN + """
local function invalid(value, integer)
  local x = tonumber(value)
  return not x or x ~= x or x < 0 or x >= 2^53 or (integer and x % 1 ~= 0)
end
local first = 9 + 2 * tonumber(ARGV[7])
local last = first + 7 * tonumber(ARGV[first - 1])
local bad = invalid(ARGV[last], true) or invalid(ARGV[last + 1], false)
for i = first, last - 1, 7 do
  for k = 1, 6 do bad = bad or invalid(ARGV[i + k], k == 1 or k == 6) end
end
if bad then return redis.error_reply('a step number is not finite, negative or too big; nothing applied') end
local info, seqs, sigs, series, jobs, jobinfo, jobruns = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local seq = tonumber(ARGV[1])
local low = tonumber(redis.call('HGET', info, 'seq_low') or '0')
if seq < low or redis.call('SISMEMBER', seqs, ARGV[1]) == 1 then return 0 end
redis.call('SADD', seqs, ARGV[1])
while redis.call('SISMEMBER', seqs, tostring(low)) == 1 do
  redis.call('SREM', seqs, tostring(low))
  low = low + 1
end
local high = tonumber(redis.call('HGET', info, 'seq_high') or '-1')
local newest = seq >= high
if newest then high = seq end
redis.call('HSET', info, 'seq_low', tostring(low), 'seq_high', tostring(high), 'job', ARGV[2], 'worker', ARGV[3],
           'session_id', ARGV[4])
redis.call('HINCRBY', info, 'batches', 1)
local i = 8
local points = tonumber(ARGV[7])
for k = 1, points do
  redis.call('ZADD', series, ARGV[i], ARGV[i + 1])
  i = i + 2
end
if points > 0 then redis.call('ZREMRANGEBYRANK', series, 0, -(tonumber(ARGV[6]) + 1)) end
local signatures = tonumber(ARGV[i])
i = i + 1
for k = 1, signatures do
  local f = ARGV[i]
  redis.call('HINCRBY', sigs, 'count\\t' .. f, ARGV[i + 1])
  redis.call('HINCRBYFLOAT', sigs, 'total\\t' .. f, ARGV[i + 2])
  local low_s = redis.call('HGET', sigs, 'min\\t' .. f)
  if not low_s or tonumber(ARGV[i + 3]) < tonumber(low_s) then redis.call('HSET', sigs, 'min\\t' .. f, ARGV[i + 3]) end
  local high_s = redis.call('HGET', sigs, 'max\\t' .. f)
  if not high_s or tonumber(ARGV[i + 4]) > tonumber(high_s) then redis.call('HSET', sigs, 'max\\t' .. f, ARGV[i + 4]) end
  redis.call('HINCRBYFLOAT', sigs, 'input\\t' .. f, ARGV[i + 5])
  redis.call('HINCRBY', sigs, 'examples\\t' .. f, ARGV[i + 6])
  i = i + 7
end
local steps, total = ARGV[i], ARGV[i + 1]
redis.call('HINCRBY', info, 'steps', steps)
if newest then
  if ARGV[i + 2] ~= '' then redis.call('HSET', info, 'eps', ARGV[i + 2]) end
  if ARGV[i + 3] ~= '' then redis.call('HSET', info, 'cpu', ARGV[i + 3], 'rss', ARGV[i + 4]) end
end
redis.call('HINCRBY', jobinfo, 'steps', steps)
redis.call('HINCRBYFLOAT', jobinfo, 'total_s', total)
touch(info, jobs, jobinfo, jobruns, ARGV[2], ARGV[4], ARGV[5])
if newest then return 2 end
return 1
"""


class Keys:
    """Every Redis key of the service (see the module docstring)."""

    def __init__(self, redis_prefix: str) -> None:
        self.base = redis_prefix + "traces:"
        self.enabled = self.base + "enabled"
        self.jobs = self.base + "jobs"
        self.pending_captures = self.base + "captures:pending"
        self.generation = self.base + "generation"

    def capture_control(self, job: str) -> str:
        return f"{self.base}capture:{job}"

    def job_info(self, job: str) -> str:
        return f"{self.base}job:{job}:info"

    def job_runs(self, job: str) -> str:
        return f"{self.base}job:{job}:runs"

    def job_captures(self, job: str) -> str:
        return f"{self.base}job:{job}:captures"

    def job_active_capture(self, job: str) -> str:
        return f"{self.base}job:{job}:active-capture"

    def run_info(self, session: str) -> str:
        return f"{self.base}run:{session}:info"

    def run_seqs(self, session: str) -> str:
        return f"{self.base}run:{session}:seqs"

    def run_sigs(self, session: str) -> str:
        return f"{self.base}run:{session}:sigs"

    def run_series(self, session: str) -> str:
        return f"{self.base}run:{session}:series"

    def capture(self, capture_id: str) -> str:
        return f"{self.base}capture-record:{capture_id}:info"

    def analysis(self, capture_id: str, worker: str) -> str:
        return f"{self.base}capture-record:{capture_id}:analysis:{worker}"

    def refused_analysis(self, capture_id: str, worker: str) -> str:
        return f"{self.base}capture-record:{capture_id}:refused-analysis:{worker}"


def _text(value: bytes | None, default: str = "") -> str:
    return value.decode() if value is not None else default


def _number(value: bytes | None, kind: type = float):
    return kind(value.decode()) if value else kind(0)


@dataclass(frozen=True)
class BatchEffect:
    """What applying one batch changed (for the metrics); ``applied`` False for a repeat.

    ``newest``: the batch has the run's highest sequence so far (its throughput is the run's current one);
    ``examples_per_second``: of the batch's steps whose batch size is known, 0 when none is.
    """

    applied: bool
    steps: int = 0
    newest: bool = False
    examples_per_second: float = 0.0


class TraceStore:
    """Jobs, runs and step series in Redis. Every write is idempotent (events come at least once)."""

    def __init__(self, redis, keys: Keys, *, series_length: int, run_lost_after_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.series_length = series_length
        self.run_lost_after_s = run_lost_after_s
        self._apply_batch = redis.register_script(_APPLY_BATCH)
        self._apply_facts = redis.register_script(_RECORD_FACTS)

    # ---------------------------------------------------------------- the state's generation

    async def generation(self) -> tuple[str, bool]:
        """The id of the state in Redis, and True when this call created it.

        The id is written once, when a service first finds no state; a missing id means the state
        was never built or is gone, and the caller must rebuild it from the beginning of the topic
        (the consumer group is named after the id, so a new id starts a group with no offsets).
        """
        while True:
            fresh = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]
            if await self.redis.set(self.keys.generation, fresh, nx=True):
                return fresh, True
            current = await self.redis.get(self.keys.generation)
            if current is not None:  # else deleted in between: try again
                return current.decode(), False

    async def current_generation(self) -> str | None:
        """The id of the state in Redis now; None when it is gone."""
        current = await self.redis.get(self.keys.generation)
        return current.decode() if current is not None else None

    # ---------------------------------------------------------------- writes (the aggregator)

    async def record_started(self, event: model.TracerStarted, when: float) -> None:
        """Record a run's TracerStarted, published at ``when`` (epoch s)."""
        await self._record_facts(event.job, event.session_id, when, {
            "worker": event.worker, "tf_version": event.tf_version, "patched": json.dumps(list(event.patched)),
            "pid": event.pid, "hostname": event.hostname, "argv": json.dumps(list(event.argv)),
            "started": repr(when)})

    async def record_stopped(self, event: model.TracerStopped, when: float) -> None:
        """Record a run's TracerStopped, published at ``when`` (epoch s)."""
        await self._record_facts(event.job, event.session_id, when, {
            "worker": event.worker, "stopped": repr(when), "exit_code": event.exit_code,
            "reported_steps": event.steps})

    async def _record_facts(self, job: str, session: str, when: float, facts: dict[str, object]) -> None:
        fields = [item for pair in {"job": job, "session_id": session, **facts}.items() for item in pair]
        await self._apply_facts(keys=[self.keys.run_info(session), self.keys.jobs, self.keys.job_info(job),
                                      self.keys.job_runs(job)],
                                args=[repr(when), job, session, *fields])

    async def apply_batch(self, batch: model.StepBatch, when: float) -> BatchEffect:
        """Apply a StepMetricsBatch, published at ``when`` (epoch s), once per (session, sequence).

        Check it with :func:`check_batch` first: the script refuses, whole, a batch whose numbers
        Redis cannot add up (``redis.ResponseError``, nothing applied, the sequence not taken).
        """
        points: list[object] = []
        signatures: dict[str, list[float]] = {}
        total = 0.0
        examples = 0
        counted_s = 0.0  # time of the steps whose batch size is known, for the throughput
        for record in batch.steps:
            points += [record.start_us, encode_step(record)]
            stats = signatures.setdefault(f"{record.kind}\t{record.signature}",
                                          [0, 0.0, record.duration_s, record.duration_s, 0.0, 0])
            stats[0] += 1
            stats[1] += record.duration_s
            stats[2] = min(stats[2], record.duration_s)
            stats[3] = max(stats[3], record.duration_s)
            stats[4] += record.input_wait_s
            stats[5] += record.examples
            total += record.duration_s
            examples += record.examples
            counted_s += record.duration_s if record.examples else 0.0
        args: list[object] = [batch.sequence, batch.job, batch.worker, batch.session_id, repr(when),
                              self.series_length, len(batch.steps), *points, len(signatures)]
        for field, (count, seconds, low, high, wait, seen) in signatures.items():
            args += [field, count, repr(seconds), repr(low), repr(high), repr(wait), seen]
        host = batch.host[-1] if batch.host else None
        throughput = examples / counted_s if counted_s > 0 else 0.0
        args += [len(batch.steps), repr(total), repr(throughput) if counted_s > 0 else "",
                 repr(host.cpu_percent) if host else "", host.rss_bytes if host else 0]
        keys = [self.keys.run_info(batch.session_id), self.keys.run_seqs(batch.session_id),
                self.keys.run_sigs(batch.session_id), self.keys.run_series(batch.session_id), self.keys.jobs,
                self.keys.job_info(batch.job), self.keys.job_runs(batch.job)]
        applied = await self._apply_batch(keys=keys, args=args)  # 0: a repeat, 2: the run's newest batch
        if not applied:
            return BatchEffect(applied=False)
        return BatchEffect(applied=True, steps=len(batch.steps), newest=applied == 2, examples_per_second=throughput)

    # ---------------------------------------------------------------- reads

    async def job_exists(self, job: str) -> bool:
        return await self.redis.zscore(self.keys.jobs, job) is not None

    async def known_job(self, job: str) -> str:
        """``job``, checked.

        Raises:
            InvalidArgument: ``job`` is not a valid name (the field ``job``).
            NotFound: no tracer ever reported ``job``.
        """
        check_name("job", job)
        if not await self.job_exists(job):
            raise NotFound(f"job {job!r} is unknown: no tracer has reported it")
        return job

    async def job_names(self) -> list[str]:
        """Jobs, most recently heard from first."""
        return [name.decode() for name in await self.redis.zrevrange(self.keys.jobs, 0, -1)]

    async def jobs(self, names: Sequence[str]) -> list[model.Job]:
        """The jobs named (a page of :meth:`job_names`), with their runs' counts."""
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.job_info(name))
        infos = await pipe.execute()
        every_run = await asyncio.gather(*(self.runs(name) for name in names))
        jobs = []
        for name, info, runs in zip(names, infos, every_run):
            steps, total = _number(info.get(b"steps"), int), _number(info.get(b"total_s"))
            running = [r for r in runs if r.state == model.RunState.RUNNING]
            jobs.append(model.Job(
                job=name, run_count=len(runs), running_runs=len(running), steps=steps,
                first_seen=_number(info.get(b"first_seen")), last_seen=_number(info.get(b"last_seen")),
                mean_step_s=total / steps if steps else 0.0,
                examples_per_second=sum(r.examples_per_second for r in running)))
        return jobs

    async def session_ids(self, job: str) -> list[str]:
        """The job's runs in the order they were first heard of."""
        return [s.decode() for s in await self.redis.zrange(self.keys.job_runs(job), 0, -1)]

    async def runs(self, job: str, sessions: Sequence[str] | None = None) -> list[model.Run]:
        """The job's runs (or those of ``sessions``), in one round trip after the session ids."""
        sessions = await self.session_ids(job) if sessions is None else sessions
        pipe = self.redis.pipeline(transaction=False)
        for session in sessions:
            pipe.hgetall(self.keys.run_info(session))
            pipe.hgetall(self.keys.run_sigs(session))
            pipe.scard(self.keys.run_seqs(session))
        replies = await pipe.execute()
        now = time.time()
        return [self._run(session, *replies[3 * i:3 * i + 3], now) for i, session in enumerate(sessions)]

    def _run(self, session: str, info: dict, sigs: dict, early: int, now: float) -> model.Run:
        last_seen = _number(info.get(b"last_seen"))
        if b"stopped" in info:
            state = model.RunState.STOPPED
        elif now - last_seen > self.run_lost_after_s:
            state = model.RunState.LOST
        else:
            state = model.RunState.RUNNING
        return model.Run(
            job=_text(info.get(b"job")), worker=_text(info.get(b"worker")), session_id=session, state=state,
            started=_number(info.get(b"started") or info.get(b"first_seen")), last_seen=last_seen,
            stopped=_number(info[b"stopped"]) if b"stopped" in info else None,
            tf_version=_text(info.get(b"tf_version")), patched=tuple(json.loads(info.get(b"patched", b"[]"))),
            pid=_number(info.get(b"pid"), int), hostname=_text(info.get(b"hostname")),
            argv=tuple(json.loads(info.get(b"argv", b"[]"))),
            exit_code=_number(info.get(b"exit_code"), int), steps=_number(info.get(b"steps"), int),
            batches=_number(info.get(b"batches"), int),
            missing_batches=max(_number(info.get(b"seq_high", b"-1"), int) + 1
                                - _number(info.get(b"seq_low"), int) - early, 0),
            examples_per_second=_number(info.get(b"eps")), cpu_percent=_number(info.get(b"cpu")),
            rss_bytes=_number(info.get(b"rss"), int),
            signatures=_signatures(sigs))

    async def series(self, job: str, *, worker: str = "", session: str = "", since_us: int = 0,
                     page_size: int = 1000, cursor: tuple[int, str] | None = None
                     ) -> tuple[list[model.StepPoint], tuple[int, str] | None]:
        """One page of the job's step records ordered by (start time, session), and the cursor of
        the next page (None on the last). ``cursor`` is the (start µs, session) of the last point
        of the previous page; start times are unique within a session (a worker runs one step at a time).
        """
        sessions = await self.session_ids(job)
        if session:
            if session not in sessions:
                raise NotFound(f"run {session!r} of job {job!r} is unknown")
            sessions = [session]
        pipe = self.redis.pipeline(transaction=False)
        for sid in sessions:  # only the workers' names: the runs' aggregates are not needed here
            pipe.hget(self.keys.run_info(sid), "worker")
        chosen = [(sid, _text(name)) for sid, name in zip(sessions, await pipe.execute())
                  if not worker or _text(name) == worker]
        pipe = self.redis.pipeline(transaction=False)
        for sid, _ in chosen:
            low = since_us
            exclusive = False
            if cursor is not None:
                if cursor[0] > low or (cursor[0] == low and sid <= cursor[1]):
                    low, exclusive = cursor[0], sid <= cursor[1]
            pipe.zrangebyscore(self.keys.run_series(sid), f"({low}" if exclusive else low, "+inf",
                               start=0, num=page_size + 1, withscores=True)
        merged: list[tuple[int, str, bytes, str]] = []
        for (sid, run_worker), rows in zip(chosen, await pipe.execute()):
            merged += [(int(score), sid, member, run_worker) for member, score in rows]
        merged.sort(key=lambda row: (row[0], row[1]))
        page = merged[:page_size]
        points = [model.StepPoint(worker=run_worker, session_id=sid, record=decode_step(member))
                  for _, sid, member, run_worker in page]
        following = (page[-1][0], page[-1][1]) if len(merged) > page_size else None
        return points, following

    async def newest_steps(self, sessions: Sequence[str], per_run: int) -> list[model.StepRecord]:
        """The newest ``per_run`` kept step records of each run (in no particular order)."""
        pipe = self.redis.pipeline(transaction=False)
        for session in sessions:
            pipe.zrevrange(self.keys.run_series(session), 0, per_run - 1)
        return [decode_step(member) for rows in await pipe.execute() for member in rows]

    async def tracing_enabled(self) -> bool:
        return await self.redis.get(self.keys.enabled) != b"0"

    async def set_tracing(self, enabled: bool) -> None:
        await self.redis.set(self.keys.enabled, b"1" if enabled else b"0")


def _signatures(sigs: dict[bytes, bytes]) -> tuple[model.SignatureStats, ...]:
    stats: dict[tuple[int, str], dict[str, float]] = {}
    for raw, value in sigs.items():
        stat, kind, signature = raw.decode().split("\t", 2)
        stats.setdefault((int(kind), signature), {})[stat] = float(value)
    out = []
    for (kind, signature), values in sorted(stats.items(), key=lambda item: (item[0][1], item[0][0])):
        count = int(values.get("count", 0))
        out.append(model.SignatureStats(
            signature=signature, kind=kind, count=count, total_s=values.get("total", 0.0),
            mean_s=values.get("total", 0.0) / count if count else 0.0, min_s=values.get("min", 0.0),
            max_s=values.get("max", 0.0), input_wait_s=values.get("input", 0.0),
            examples=int(values.get("examples", 0))))
    return tuple(out)


def check_name(field: str, value: str) -> str:
    """Job and worker names: non-empty, at most 253 characters, no '/', whitespace or control characters."""
    if not value:
        raise InvalidArgument(field, "is required, but is empty")
    if len(value) > 253 or "/" in value or any(c.isspace() or not c.isprintable() for c in value):
        raise InvalidArgument(field, f"must be at most 253 printable characters without '/' or spaces, "
                                     f"but got {value!r}")
    return value


MAX_STEP_S = 30 * 86400.0
"""The longest step or input wait a batch may report (a month): more is no measurement, and every
sum of them stays finite."""
MAX_STEP_EXAMPLES = 2 ** 32
"""The largest batch size a step may report: the per-signature sums stay far inside Redis' 64-bit integers."""


def check_batch(batch: model.StepBatch) -> model.StepBatch:
    """A batch's numbers: durations and input waits finite, in [0, MAX_STEP_S]; examples in
    [0, MAX_STEP_EXAMPLES]; CPU finite and >= 0; RSS >= 0.

    Raises:
        InvalidArgument: on the first number out of range (``steps[3].duration_s``).
    """
    for index, record in enumerate(batch.steps):
        for name in ("duration_s", "input_wait_s"):
            value = getattr(record, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_STEP_S):
                raise InvalidArgument(f"steps[{index}].{name}", f"must be a number of seconds in [0, {MAX_STEP_S:g}], "
                                                                f"but got {value!r}")
        if not 0 <= record.examples <= MAX_STEP_EXAMPLES:
            raise InvalidArgument(f"steps[{index}].examples", f"must be an integer in [0, {MAX_STEP_EXAMPLES}], "
                                                             f"but got {record.examples}")
    for index, sample in enumerate(batch.host):
        if not (math.isfinite(sample.cpu_percent) and sample.cpu_percent >= 0) or sample.rss_bytes < 0:
            raise InvalidArgument(f"host[{index}]", f"must have a finite cpu_percent >= 0 and rss_bytes >= 0, "
                                                    f"but got {sample.cpu_percent!r} and {sample.rss_bytes}")
    return batch
