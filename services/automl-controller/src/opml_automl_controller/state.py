"""Experiments and trials as the controller keeps them, and their durable store in Redis.

The Optuna study (a JournalStorage on Redis, :mod:`opml_automl_controller.study`) is the source
of truth for which trials exist, their parameters and how they ended; these records add what
Optuna does not keep (the job, every metric's series, the job's error) and what the API lists.
A record is written before the change it describes is acted on where that matters (a trial's job
id before its submission), so a restarted controller finds every trial again.

Several replicas share these keys. The leader's writes (every trial's, the experiment's loop's) are
fenced: they apply only while the ``automl-controller`` lease's fence holds the writer's tenure
(:class:`~opml_common.lease.Fence`), so a deposed leader's late write is refused, never applied over
its successor's. An experiment's record changes by compare-and-set (WATCH), so an API call on any
replica and the leader's loop never overwrite each other's change. A trial is written only while its
experiment exists, so a write that races a delete cannot bring its trials back.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from opml_common.errors import NotFound
from opml_common.lease import Fence, NotLeader
from opml_common.lifecycle import Component


class ExperimentState(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class TrialState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EARLY_STOPPED = "early_stopped"
    KILLED = "killed"


TERMINAL_TRIALS = frozenset({TrialState.SUCCEEDED, TrialState.FAILED, TrialState.EARLY_STOPPED, TrialState.KILLED})

# Writes a trial's record (KEYS[1] the trials' hash, ARGV[1] its number, ARGV[2] its JSON) while the
# fence KEYS[3] holds the token ARGV[3] ('' : unfenced) and the experiment KEYS[2] exists; with states
# in ARGV[4..], not over a stored record in one of them (that one is returned, 'kept').
_PUT_TRIAL = """
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[3] then return {'fenced'} end
if redis.call('EXISTS', KEYS[2]) == 0 then return {'gone'} end
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw then
  local state = cjson.decode(raw)['state']
  for i = 4, #ARGV do
    if state == ARGV[i] then return {'kept', raw} end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {'stored'}
"""


@dataclass(frozen=True, slots=True)
class TrialRecord:
    experiment: str
    number: int
    parameters: dict[str, str]
    job_id: str
    state: TrialState = TrialState.CREATED
    observations: dict[str, list[float]] = field(default_factory=dict)
    objective_value: float | None = None
    message: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    model_bundle: str | None = None
    """The uuid of the bundle the trial said it uploaded (its log's word: a hint the bundle-store is
    asked about before anything is committed), if it said so."""
    model_refused: str = ""
    """Why the trial's model was refused ('': it was not)."""
    upload_grants: list[str] = field(default_factory=list)
    """The ids of the upload grants issued to the trial's job and not revoked yet (saved before the job
    is submitted; one per runner that submitted or re-attached to it): each is revoked once the trial
    has ended (:mod:`opml_automl_controller.grants`), then removed here. The id names the grant in the
    bundle-store's logs and revokes it; it is no token."""

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "state": self.state.value})

    @classmethod
    def from_json(cls, text: str | bytes) -> TrialRecord:
        data = json.loads(text)
        data.pop("model_dir", None)  # a path in the trial's folder, kept before trials uploaded their models
        return cls(**{**data, "state": TrialState(data["state"])})


@dataclass(frozen=True, slots=True)
class ExperimentRecord:
    name: str
    uid: str
    """Unique per creation: job ids and the study's keys carry it, so a re-created experiment of the
    same name never meets the old one's jobs (the orchestrator never reuses a job id)."""
    katib_yaml: str
    max_trial_count: int
    state: ExperimentState = ExperimentState.RUNNING
    reason: str = "Created"
    message: str = ""
    created_at: float = field(default_factory=time.time)
    completed_at: float | None = None
    best_model_bundle: str = ""
    """The bundle the best trial's model was committed as (contexts/{context}/bundles/{uuid})."""

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "state": self.state.value})

    @classmethod
    def from_json(cls, text: str | bytes) -> ExperimentRecord:
        data = json.loads(text)
        return cls(**{**data, "state": ExperimentState(data["state"])})

    def changed(self, **changes: Any) -> ExperimentRecord:
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """What the tracer of a Trace trial's job sent: each Keras epoch's logs by (fit, epoch), and the
    tracer runs (sessions) that started and stopped."""

    epochs: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)
    started: frozenset[str] = frozenset()
    stopped: frozenset[str] = frozenset()

    @property
    def complete(self) -> bool:
        """Every tracer run that started has stopped (its last batch is in: it comes before)."""
        return bool(self.started) and self.started <= self.stopped


class ExperimentStore(Component):
    """Redis keys (all under ``prefix``): ``automl:experiments`` (a sorted set: names by creation),
    ``automl:experiment:{name}`` (the record, JSON), ``automl:trials:{name}`` (a hash: number ->
    trial JSON), ``automl:trace:{name}:{number}`` (a hash: a Trace trial's epochs ``e:{fit}:{epoch}``
    -> logs JSON, ``started:{session}``, ``stopped:{session}``), ``automl:grants:unrevoked`` (a set:
    the upload grants of deleted experiments' trials not revoked yet). Trials and experiments are small
    (KiBs); an experiment's trials are read whole, a trial's trace too.

    A part the service starts (Redis answers before anything reads it) and stops; the client is the
    service's, closed by it after every part that uses it.

    Args:
        fence: the leader's current fence (raises NotLeader when it does not lead); every trial write
            and every fenced experiment change checks it in the same transaction. None: one writer
            by construction (tests, benchmarks), nothing checked.
    """

    def __init__(self, redis: aioredis.Redis, *, prefix: str, fence: Callable[[], Fence] | None = None) -> None:
        super().__init__()
        self._redis = redis
        self._prefix = f"{prefix}automl:"
        self._fence = fence
        self._put_trial = redis.register_script(_PUT_TRIAL)

    async def on_start(self) -> None:
        await self._redis.ping()

    async def on_stop(self) -> None:
        """Nothing to flush: every write is awaited where it is made."""

    def journal_prefix(self, record: ExperimentRecord) -> str:
        """Where the experiment's Optuna journal lives."""
        return f"{self._prefix}journal:{record.name}:{record.uid}"

    async def put_experiment(self, record: ExperimentRecord, *, new: bool = False) -> bool:
        """Save ``record``; with ``new``, only if no experiment of that name exists (False then)."""
        key = f"{self._prefix}experiment:{record.name}"
        if new:
            if not await self._redis.set(key, record.to_json(), nx=True):
                return False
            await self._redis.zadd(f"{self._prefix}experiments", {record.name: record.created_at})
            return True
        await self._redis.set(key, record.to_json())
        return True

    async def change_experiment(self, name: str, change: Callable[[ExperimentRecord], ExperimentRecord | None], *,
                                fenced: bool = False) -> tuple[ExperimentRecord, bool]:
        """Read, change and save the record by compare-and-set (``change`` is called again if another
        writer, on any replica, changed it meanwhile; it returns None for no change): the record as
        stored now, and whether this call changed it. ``fenced``: only while this replica leads.

        Raises: NotFound. NotLeader: ``fenced``, and the lease moved on. What ``change`` raises."""
        key = f"{self._prefix}experiment:{name}"
        fence = self._fence() if fenced and self._fence is not None else None
        async with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await _watch(pipe, key, fence, f"experiment {name!r} not changed")
                    raw = await pipe.get(key)
                    if raw is None:
                        raise NotFound(f"experiment {name!r} does not exist")
                    record = ExperimentRecord.from_json(raw)
                    changed = change(record)
                    if changed is None:
                        return record, False
                    pipe.multi()
                    pipe.set(key, changed.to_json())
                    await pipe.execute()
                    return changed, True
                except WatchError:
                    continue

    async def experiment(self, name: str) -> ExperimentRecord:
        """Raises: NotFound: no experiment of that name."""
        raw = await self._redis.get(f"{self._prefix}experiment:{name}")
        if raw is None:
            raise NotFound(f"experiment {name!r} does not exist")
        return ExperimentRecord.from_json(raw)

    async def experiments(self) -> list[ExperimentRecord]:
        names = await self._redis.zrange(f"{self._prefix}experiments", 0, -1)
        records = []
        for name in names:
            raw = await self._redis.get(f"{self._prefix}experiment:{name.decode()}")
            if raw is not None:
                records.append(ExperimentRecord.from_json(raw))
        return records

    async def put_trial(self, trial: TrialRecord) -> None:
        """Raises: NotFound: the experiment was deleted. NotLeader: fenced, and the lease moved on."""
        await self._write_trial(trial, ())

    async def put_trial_unless_ended(self, trial: TrialRecord) -> TrialRecord:
        """Save ``trial`` unless its stored record has ended already (its runner saved it, with every
        series, since the caller read it); returns the record stored now. Atomic (one Lua script).

        Raises: NotFound: the experiment was deleted. NotLeader: fenced, and the lease moved on."""
        stored = await self._write_trial(trial, tuple(s.value for s in TERMINAL_TRIALS))
        return trial if stored is None else TrialRecord.from_json(stored)

    async def _write_trial(self, trial: TrialRecord, unless: tuple[str, ...]) -> bytes | None:
        fence = self._fence() if self._fence is not None else None
        experiment_key = f"{self._prefix}experiment:{trial.experiment}"
        outcome, *stored = await self._put_trial(
            keys=[f"{self._prefix}trials:{trial.experiment}", experiment_key, fence.key if fence else experiment_key],
            args=[trial.number, trial.to_json(), str(fence.token) if fence else "", *unless])
        if outcome == b"fenced":
            raise NotLeader(f"the automl-controller lease moved on (tenure {fence.token if fence else 0}); "
                            f"trial {trial.job_id} not saved")
        if outcome == b"gone":
            raise NotFound(f"experiment {trial.experiment!r} was deleted; trial {trial.job_id} not saved")
        return stored[0] if stored else None

    async def drop_grants(self, experiment: str, number: int, grant_ids: list[str]) -> None:
        """Remove ``grant_ids`` (revoked) from the trial's ``upload_grants``, by compare-and-set (a
        runner's write meanwhile is read again), fenced as every trial write; nothing when the trial or
        its experiment is gone.

        Raises: NotLeader: the lease moved on."""
        key = f"{self._prefix}trials:{experiment}"
        fence = self._fence() if self._fence is not None else None
        async with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await _watch(pipe, key, fence, f"trial {number} of {experiment!r} not saved")
                    raw = await pipe.hget(key, str(number))
                    if raw is None:
                        return
                    trial = TrialRecord.from_json(raw)
                    kept = [grant for grant in trial.upload_grants if grant not in grant_ids]
                    if kept == trial.upload_grants:
                        return
                    pipe.multi()
                    pipe.hset(key, str(number), replace(trial, upload_grants=kept).to_json())
                    await pipe.execute()
                    return
                except WatchError:
                    continue

    async def unrevoked_grants(self) -> list[str]:
        """The upload grants of deleted experiments' trials that are not revoked yet."""
        return sorted(raw.decode() for raw in await self._redis.smembers(self._unrevoked_key))

    async def forget_unrevoked(self, grant_ids: list[str]) -> None:
        """``grant_ids`` (of deleted experiments' trials) are revoked."""
        if grant_ids:
            await self._redis.srem(self._unrevoked_key, *grant_ids)

    @property
    def _unrevoked_key(self) -> str:
        return f"{self._prefix}grants:unrevoked"

    async def trial(self, experiment: str, number: int) -> TrialRecord | None:
        raw = await self._redis.hget(f"{self._prefix}trials:{experiment}", str(number))
        return None if raw is None else TrialRecord.from_json(raw)

    async def trials(self, experiment: str) -> list[TrialRecord]:
        raw = await self._redis.hgetall(f"{self._prefix}trials:{experiment}")
        return sorted((TrialRecord.from_json(v) for v in raw.values()), key=lambda t: t.number)

    def _trace_key(self, experiment: str, number: int) -> str:
        return f"{self._prefix}trace:{experiment}:{number}"

    async def add_trace(self, experiment: str, number: int, *, epochs: dict[tuple[int, int], dict[str, float]],
                        started: str | None = None, stopped: str | None = None) -> None:
        """Record epochs (an epoch sent again overwrites itself: idempotent) and a tracer run's start or stop."""
        fields = {f"e:{fit}:{epoch}": json.dumps(logs) for (fit, epoch), logs in epochs.items()}
        if started:
            fields[f"started:{started}"] = "1"
        if stopped:
            fields[f"stopped:{stopped}"] = "1"
        if fields:
            await self._redis.hset(self._trace_key(experiment, number), mapping=fields)

    async def trace(self, experiment: str, number: int) -> TraceRecord:
        epochs: dict[tuple[int, int], dict[str, float]] = {}
        started, stopped = set(), set()
        for raw_key, raw in (await self._redis.hgetall(self._trace_key(experiment, number))).items():
            kind, _, rest = raw_key.decode().partition(":")
            if kind == "e":
                fit, _, epoch = rest.partition(":")
                epochs[(int(fit), int(epoch))] = json.loads(raw)
            elif kind == "started":
                started.add(rest)
            elif kind == "stopped":
                stopped.add(rest)
        return TraceRecord(epochs, frozenset(started), frozenset(stopped))

    async def delete(self, record: ExperimentRecord) -> None:
        """The experiment, its trials, their traces and its Optuna journal; the trials' upload grants not
        revoked yet move to ``automl:grants:unrevoked`` (in the same transaction as the trials' delete),
        where the leader revokes them."""
        journal = [key async for key in self._redis.scan_iter(match=self.journal_prefix(record) + ":*")]
        journal += [key async for key in self._redis.scan_iter(match=f"{self._prefix}trace:{record.name}:*")]
        trials_key = f"{self._prefix}trials:{record.name}"
        async with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(trials_key)
                    grants = [grant for raw in (await pipe.hgetall(trials_key)).values()
                              for grant in TrialRecord.from_json(raw).upload_grants]
                    pipe.multi()
                    if grants:
                        pipe.sadd(self._unrevoked_key, *grants)
                    pipe.delete(f"{self._prefix}experiment:{record.name}", trials_key, *journal)
                    pipe.zrem(f"{self._prefix}experiments", record.name)
                    await pipe.execute()
                    return
                except WatchError:
                    continue


async def _watch(pipe: Any, key: str, fence: Fence | None, what: str) -> None:
    """WATCH ``key`` (and the fence's key) for a compare-and-set.

    Raises: NotLeader: ``fence`` no longer holds (``what``: the write not made)."""
    await pipe.watch(key, *([fence.key] if fence else []))
    if fence is not None and await pipe.get(fence.key) != str(fence.token).encode():
        raise NotLeader(f"the automl-controller lease moved on (tenure {fence.token}); {what}")
