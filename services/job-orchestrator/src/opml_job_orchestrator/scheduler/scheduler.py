"""The scheduler core: it decides, someone else executes.

:class:`Scheduler` keeps the pending queue and the running set, asks its
:class:`~opml_job_orchestrator.scheduler.policies.SchedulingPolicy` what to do, and returns
decisions (:class:`StartJob`, :class:`PreemptJob`) that a real orchestrator carries out on a
cluster and the simulator carries out in virtual time: both drive this same code. It imports no
transport, reads no clock (every call says what time it is) and is not thread-safe: one caller
serializes the calls (an asyncio service runs it in one task).

The caller's loop: ``submit`` jobs as they arrive; report ``finish`` and ``record_checkpoint`` as
jobs report them; after each batch of reports call ``schedule`` and execute the decisions in
order (a preemption comes before the start that needs its room); and call ``schedule`` again at
``next_deadline()`` even if nothing else happened.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OpmlError
from opml_job_orchestrator.scheduler.capacity import Cluster
from opml_job_orchestrator.scheduler.model import JobClass, JobSpec, Resources
from opml_job_orchestrator.scheduler.policies import SchedulingPolicy
from opml_job_orchestrator.scheduler.queue import GroupKey, PendingQueue


class JobState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class StartJob:
    """Start (or, with ``resume``, restart from its last checkpoint) ``job_id`` on these nodes.

    ``placement`` maps each role to the node of each replica, by replica index: what TF_CONFIG's
    cluster spec needs.
    """

    job_id: str
    placement: Mapping[str, tuple[str, ...]]
    resume: bool


@dataclass(frozen=True)
class PreemptJob:
    """Stop ``job_id`` to make room for ``for_job_id``; it is back in the queue already.

    ``lost_work_s`` is the scheduler's estimate of the progress the stop throws away: the time the
    job made progress since its last reported checkpoint (or since its run began).
    """

    job_id: str
    for_job_id: str
    lost_work_s: float


Decision = StartJob | PreemptJob


class JobRecord:
    """The scheduler's state of one job. Policies read it; only the scheduler changes it.

    Times are the caller's clock, in seconds. ``enqueued_at`` is when the job last entered the
    queue (its submit, or its last preemption); ``first_in_line_s`` is how long it has been the
    first waiting job of its class (the aging clock); ``promoted`` says the clock ran out. ``run_*``
    fields describe the current run and are reset at each start (``run_resumed``: it restarts from
    a checkpoint after a preemption; ``run_promoted``: it started while promoted); ``nodes`` and
    ``placement`` say where it runs. The others accumulate over the job's life.
    """

    __slots__ = ("spec", "seq", "submitted_at", "state", "enqueued_at", "promoted", "preemptions",
                 "lost_work_s", "first_in_line_s", "runs", "run_started_at", "run_resumed", "run_promoted",
                 "last_checkpoint_at", "first_started_at", "ended_at", "placement", "nodes")

    def __init__(self, spec: JobSpec, seq: int, now: float) -> None:
        self.spec = spec
        self.seq = seq
        self.submitted_at = now
        self.state = JobState.PENDING
        self.enqueued_at = now
        self.promoted = False
        self.preemptions = 0
        self.lost_work_s = 0.0
        self.first_in_line_s = 0.0
        self.runs = 0
        self.run_started_at: float | None = None
        self.run_resumed = False
        self.run_promoted = False
        self.last_checkpoint_at: float | None = None
        self.first_started_at: float | None = None
        self.ended_at: float | None = None
        self.placement: Mapping[str, tuple[str, ...]] | None = None
        self.nodes: frozenset[str] = frozenset()

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    def lost_work_if_stopped(self, now: float) -> float:
        """Progress the current run would lose if stopped at ``now``: since its last checkpoint,
        or since it began making progress (after the restart overhead of a resumed run)."""
        if self.run_started_at is None:
            return 0.0
        progress_from = self.run_started_at + (self.spec.restart_overhead_s if self.run_resumed else 0.0)
        if self.last_checkpoint_at is not None:
            progress_from = max(progress_from, self.last_checkpoint_at)
        return max(0.0, now - progress_from)

    def resume_cost_s(self, now: float) -> float:
        """What stopping the job at ``now`` costs it: lost work plus the restart overhead it will pay."""
        return self.lost_work_if_stopped(now) + self.spec.restart_overhead_s

    def __repr__(self) -> str:
        return f"JobRecord({self.job_id!r}, {self.spec.job_class.name}, {self.state.name})"


def check_placement(spec: JobSpec, placement: Mapping[str, Sequence[str]]) -> None:
    """Raise InvalidArgument unless ``placement`` names a node for every replica of every role of ``spec``.

    Shared by :meth:`Scheduler.adopt` and every executor's ``launch``, so both reject a placement alike.
    """
    if not isinstance(placement, Mapping) or set(placement) != set(spec.roles):
        got = sorted(placement) if isinstance(placement, Mapping) else placement
        raise InvalidArgument("placement", f"`placement` must have exactly the roles of job {spec.job_id!r}, "
                                           f"{list(spec.roles)}, but got {got!r}.")
    for role, role_spec in spec.roles.items():
        nodes = placement[role]
        if isinstance(nodes, str) or not isinstance(nodes, Sequence) or len(nodes) != role_spec.replicas:
            raise InvalidArgument(f"placement.{role}", f"`placement.{role}` must list one node per replica "
                                                       f"({role_spec.replicas}), but got {nodes!r}.")


class Scheduler:
    """Decides which jobs start where and which are preempted, under a pluggable policy."""

    def __init__(self, cluster: Cluster, policy: SchedulingPolicy) -> None:
        """``cluster`` must be empty (nothing allocated); the scheduler owns it from now on."""
        if not isinstance(cluster, Cluster):
            raise InvalidArgument("cluster", f"`cluster` must be a Cluster, but got {cluster!r}.")
        if not isinstance(policy, SchedulingPolicy):
            raise InvalidArgument("policy", f"`policy` must be a SchedulingPolicy, but got {policy!r}.")
        if cluster.total_free != cluster.total_capacity:
            raise InvalidArgument("cluster", "`cluster` must have nothing allocated when the scheduler takes it over.")
        self._cluster = cluster
        self._policy = policy
        self._queue = PendingQueue()
        self._jobs: dict[str, JobRecord] = {}
        self._running: dict[str, JobRecord] = {}
        self._seq = itertools.count()
        self._now = float("-inf")
        self._lane_heads: dict[JobClass, tuple[JobRecord, float, float]] = {}  # class -> (head, since, delay)
        self._protections: list[tuple[float, int, int, JobRecord]] = []  # (time, seq, run number, job)
        self._retries: dict[str, tuple[float, JobRecord]] = {}  # waiting job id -> (retry time, job)
        self._reservations: dict[str, frozenset[str]] = {}  # waiting job id -> nodes it drains

    # -- reads ---------------------------------------------------------------------------------

    @property
    def cluster(self) -> Cluster:
        return self._cluster

    @property
    def policy(self) -> SchedulingPolicy:
        return self._policy

    @property
    def pending_count(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> Mapping[str, JobRecord]:
        """Running jobs by id, in start order."""
        return MappingProxyType(self._running)

    def job(self, job_id: str) -> JobRecord:
        """The record of a pending or running job.

        Raises:
            NotFound: no such job is pending or running (finished and cancelled jobs are forgotten;
            their records were returned by ``finish`` / ``cancel``).
        """
        record = self._jobs.get(job_id)
        if record is None:
            raise NotFound(f"job {job_id!r} is not pending or running.")
        return record

    def next_deadline(self) -> float | None:
        """The next time the schedule may change without any report: a promotion, the end of a
        protection, or a waiting job's retry (see ``PreemptionPolicy.retry_at``). Call ``schedule``
        then. None when there is none."""
        while self._protections and not self._protection_is_live(self._protections[0]):
            heapq.heappop(self._protections)
        self._retries = {job_id: (at, job) for job_id, (at, job) in self._retries.items()
                         if at > self._now and job.state is JobState.PENDING}
        times = [since + delay for _, since, delay in self._lane_heads.values()]
        times.extend(at for at, _ in self._retries.values())
        if self._protections:
            times.append(self._protections[0][0])
        return min(times) if times else None

    # -- reports -------------------------------------------------------------------------------

    def submit(self, spec: JobSpec, *, now: float) -> JobRecord:
        """Queue a job. It starts at a later ``schedule`` call.

        Raises:
            InvalidArgument: ``spec`` is not a JobSpec; it asks for more than the whole cluster has
                (the field path names what, e.g. ``roles.worker.resources.gpu``); or ``now`` is
                earlier than a time already reported.
            AlreadyExists: a job with this id is pending or running.
        """
        self._check_new(spec, now, fix="pick another job_id.")
        self._check_packs(spec)
        record = JobRecord(spec, next(self._seq), now)
        self._jobs[spec.job_id] = record
        self._enqueue(record, now)
        return record

    def check_admissible(self, spec: JobSpec) -> None:
        """Raise InvalidArgument when :meth:`submit` would refuse ``spec`` as more than the cluster can
        ever hold (too big, or replicas that cannot be packed); queue nothing. For a job submitted
        later, a retry after a restart onto a reconfigured cluster for one.

        Raises:
            InvalidArgument: as :meth:`submit` says (the field path names what).
        """
        self._cluster.check_admissible(spec)
        self._check_packs(spec)

    def finish(self, job_id: str, *, now: float) -> JobRecord:
        """The job ended (done or failed for good): free what it holds and forget it.

        Raises:
            NotFound: the job is not pending or running.
            FailedPrecondition: the job is pending (it was preempted or never started).
            InvalidArgument: ``now`` is earlier than a time already reported.
        """
        self._advance(now)
        record = self._running_record(job_id, "finish")
        self._cluster.release(job_id)
        del self._running[job_id]
        del self._jobs[job_id]
        record.state = JobState.FINISHED
        record.ended_at = now
        return record

    def record_checkpoint(self, job_id: str, *, now: float) -> None:
        """The running job saved a checkpoint at ``now``: stopping it now loses nothing.

        Raises:
            NotFound: the job is not pending or running.
            FailedPrecondition: the job is not running.
            InvalidArgument: ``now`` is earlier than a time already reported.
        """
        self._advance(now)
        self._running_record(job_id, "checkpoint").last_checkpoint_at = now

    def cancel(self, job_id: str, *, now: float) -> JobRecord:
        """Drop a pending job, or stop a running one for good (the caller stops its processes).

        Raises:
            NotFound: the job is not pending or running.
            InvalidArgument: ``now`` is earlier than a time already reported.
        """
        self._advance(now)
        record = self.job(job_id)
        if record.state is JobState.RUNNING:
            self._cluster.release(job_id)
            del self._running[job_id]
        else:
            self._queue.remove(job_id)
            self._reservations.pop(job_id, None)
        del self._jobs[job_id]
        record.state = JobState.CANCELLED
        record.ended_at = now
        return record

    def preempt(self, job_id: str, *, now: float) -> JobRecord:
        """Stop a running job the scheduler did not choose (an administrator's preemption) and
        queue it to resume, exactly as a preemption ``schedule`` decides: its room is freed, the
        work since its last checkpoint is added to ``lost_work_s``, its ``preemptions`` count
        (which ``max_preemptions`` caps) goes up by one, and it re-enters the queue with the rank
        the queue policy gives it (its original submit time, so ahead of later submissions of its
        class). The caller stops its processes. The policy is not asked whether the job may be
        preempted.

        Raises:
            NotFound: the job is not pending or running.
            FailedPrecondition: the job is not running (the message says its state).
            InvalidArgument: ``now`` is earlier than a time already reported.
        """
        self._advance(now)
        record = self._running_record(job_id, "preempt")
        self._stop_and_requeue(record, now)
        return record

    def adopt(self, spec: JobSpec, placement: Mapping[str, Sequence[str]], *, now: float) -> JobRecord:
        """Take in a job that already runs on ``placement`` (role -> node of each replica): after a
        restart, for a run the executor re-adopted where its tasks really are. The job holds that
        room from now on, exactly as if ``schedule`` had started it there at ``now`` (a first run,
        not a resume: nothing is known of its checkpoints yet), and is never placed again.

        Raises:
            InvalidArgument: ``spec`` is not a JobSpec, it asks for more than the whole cluster has,
                ``placement`` does not name one node per replica of each role of ``spec`` or names a
                node the cluster does not have (``placement.<role>``), or ``now`` is earlier than
                a time already reported.
            AlreadyExists: a job with this id is pending or running.
            FailedPrecondition: the nodes do not have that much room free (the message says which).
        """
        self._check_new(spec, now, fix="it cannot be adopted.")
        check_placement(spec, placement)
        for role in spec.roles:
            unknown = [node for node in placement[role] if node not in self._cluster.capacity]
            if unknown:
                raise InvalidArgument(f"placement.{role}", f"`placement.{role}` names nodes the cluster does not "
                                                           f"have: {unknown}; it has {list(self._cluster.capacity)}.")
        nodes = [placement[r.role][r.index] for r in spec.replicas]
        record = JobRecord(spec, next(self._seq), now)
        self._cluster.allocate(spec.job_id, [(node, r.resources) for node, r in zip(nodes, spec.replicas, strict=True)])
        self._jobs[spec.job_id] = record
        self._mark_running(record, nodes, now)
        return record

    # -- decisions -----------------------------------------------------------------------------

    def schedule(self, *, now: float) -> list[Decision]:
        """One scheduling pass: promote a job that was first in line too long, then start and preempt.

        Jobs are tried in rank order (promoted jobs first). A job that fits the free capacity
        starts. One that does not may preempt running jobs if the policy allows it; otherwise it
        waits, and without backfilling so does every job behind it. With backfilling, jobs behind
        it may start, except on the nodes a waiting promoted job has reserved. Jobs of a shape
        that failed are not tried again in the same sweep (free capacity only shrinks during it);
        a sweep that preempted is followed by another, since stopped jobs may free more than the
        job that stopped them uses.

        The returned decisions are already applied to this scheduler's state.

        Raises:
            InvalidArgument: ``now`` is earlier than a time already reported.
            OpmlError: the preemption policy returned victims that are not candidates or that
                do not make room (a bug in the policy).
        """
        self._advance(now)
        self._age_lanes(now, promote=True)
        decisions: list[Decision] = []
        while self._sweep(now, decisions):
            pass
        self._age_lanes(now, promote=False)
        return decisions

    def _sweep(self, now: float, decisions: list[Decision]) -> bool:
        """Walk the queue's groups in rank order once; return whether anything was preempted."""
        preempted = False
        backfill = self._policy.queue.backfill
        reserved: set[str] = set()
        order = self._queue.heads()
        while order:
            key = heapq.heappop(order)[2]
            head = self._queue.head(key)  # a victim queued during this sweep may now lead the group
            if head is None:
                continue
            job = head[1]
            nodes = self._place(job, {}, reserved)
            if nodes is None and self._policy.preemption.may_preempt(job):
                victims = self._victims(job, reserved, now)
                if victims:
                    for victim in victims:
                        decisions.append(self._preempt(victim, job, now))
                    nodes = self._place(job, {}, reserved)
                    preempted = True
            if nodes is None:
                if not backfill:
                    break
                if job.promoted:
                    reserved |= self._reservation(job)
                continue
            decisions.append(self._start(job, nodes, now))
            following = self._queue.head(key)
            if following is not None:
                heapq.heappush(order, (following[0], following[1].seq, key, following[1]))
        return preempted

    def _place(self, job: JobRecord, freed: Mapping[str, Resources], reserved: set[str]) -> list[str] | None:
        """Nodes for ``job``'s replicas against the free capacity plus ``freed``, off ``reserved``
        nodes; None when they do not fit."""
        free: Mapping[str, Resources] = self._cluster.free
        if reserved:
            free = {name: available for name, available in free.items() if name not in reserved}
            total_free = sum(free.values(), Resources())
        else:
            total_free = self._cluster.total_free
        for name, resources in freed.items():
            if name not in reserved:
                total_free += resources
        if not job.spec.total.fits_in(total_free):
            return None
        if freed:
            free = {name: available + freed[name] if name in freed else available for name, available in free.items()}
        return self._policy.placement.place(job.spec.replicas, free)

    def _reservation(self, job: JobRecord) -> frozenset[str]:
        """The nodes ``job`` will start on once they drain, chosen when it first reserves and kept.

        The job is placed on the nodes' whole capacity, trying first the nodes that will drain
        soonest: most free, counting what TE jobs hold as free (they are short by definition). It
        always fits, since every admitted job fits the empty cluster.
        """
        nodes = self._reservations.get(job.job_id)
        if nodes is None:
            soon_free = dict(self._cluster.free)
            for running in self._running.values():
                if running.spec.job_class is JobClass.TE:
                    for node, resources in self._cluster.allocation(running.job_id) or ():
                        soon_free[node] += resources
            capacity = self._cluster.capacity
            by_drain = sorted(capacity, key=lambda n: (-soon_free[n].gpu, -soon_free[n].cpu_millis,
                                                       -soon_free[n].memory_mib))
            placement = (self._policy.placement.place(job.spec.replicas, {name: capacity[name] for name in by_drain})
                         or self._policy.placement.place(job.spec.replicas, capacity))  # fits: checked at submit
            nodes = frozenset(placement or ())
            self._reservations[job.job_id] = nodes
        return nodes

    def _victims(self, job: JobRecord, reserved: set[str], now: float) -> Sequence[JobRecord]:
        preemption = self._policy.preemption
        candidates = [r for r in self._running.values() if preemption.is_preemptible(r, now)]
        if not candidates:
            return ()

        def fits(victims: Sequence[JobRecord]) -> bool:
            return self._place(job, self._held_by(victims), reserved) is not None

        victims = list(preemption.select_victims(job, candidates, fits, now))
        if not victims:
            retry_at = preemption.retry_at(job)
            if retry_at is not None and retry_at > now:
                self._retries[job.job_id] = (retry_at, job)
        elif (any(v not in candidates for v in victims) or len({v.job_id for v in victims}) < len(victims)
              or not fits(victims)):
            raise OpmlError(f"preemption policy {type(preemption).__name__} chose victims "
                            f"{[v.job_id for v in victims]} for job {job.job_id!r}: they must be distinct "
                            "preemptible running jobs that free enough room for it.")
        return victims

    def _held_by(self, jobs: Sequence[JobRecord]) -> dict[str, Resources]:
        held: dict[str, Resources] = {}
        for job in jobs:
            for node, resources in self._cluster.allocation(job.job_id) or ():
                held[node] = held.get(node, Resources()) + resources
        return held

    # -- transitions ---------------------------------------------------------------------------

    def _start(self, job: JobRecord, nodes: list[str], now: float) -> StartJob:
        replicas = job.spec.replicas
        self._cluster.allocate(job.job_id, [(node, r.resources) for node, r in zip(nodes, replicas, strict=True)])
        self._queue.remove(job.job_id)
        self._reservations.pop(job.job_id, None)
        return StartJob(job.job_id, self._mark_running(job, nodes, now), resume=job.run_resumed)

    def _mark_running(self, job: JobRecord, nodes: Sequence[str], now: float) -> Mapping[str, tuple[str, ...]]:
        """Record that ``job`` (its room already allocated on ``nodes``) started a run at ``now``;
        return its placement."""
        placement: dict[str, list[str]] = {}
        for node, replica in zip(nodes, job.spec.replicas, strict=True):
            placement.setdefault(replica.role, []).append(node)
        job.state = JobState.RUNNING
        job.runs += 1
        job.run_started_at = now
        job.run_resumed = job.preemptions > 0
        job.run_promoted = job.promoted
        job.promoted = False
        job.last_checkpoint_at = None
        if job.first_started_at is None:
            job.first_started_at = now
        job.placement = frozen = MappingProxyType({role: tuple(held) for role, held in placement.items()})
        job.nodes = frozenset(nodes)
        self._running[job.job_id] = job
        protected_until = self._policy.preemption.protection_ends_at(job)
        if protected_until is not None and protected_until > now:
            heapq.heappush(self._protections, (protected_until, job.seq, job.runs, job))
        return frozen

    def _preempt(self, victim: JobRecord, for_job: JobRecord, now: float) -> PreemptJob:
        return PreemptJob(victim.job_id, for_job.job_id, self._stop_and_requeue(victim, now))

    def _stop_and_requeue(self, job: JobRecord, now: float) -> float:
        """Preempt running ``job``: free its room, count the stop, queue it to resume; return the
        work the stop throws away."""
        lost = job.lost_work_if_stopped(now)
        self._cluster.release(job.job_id)
        del self._running[job.job_id]
        job.state = JobState.PENDING
        job.preemptions += 1
        job.lost_work_s += lost
        job.run_started_at = None
        job.last_checkpoint_at = None
        job.placement = None
        job.nodes = frozenset()
        self._enqueue(job, now)
        return lost

    def _enqueue(self, job: JobRecord, now: float) -> None:
        job.enqueued_at = now
        self._queue.push(job, self._group_key(job), (1, *self._policy.queue.rank(job)))

    def _age_lanes(self, now: float, *, promote: bool) -> None:
        """Track how long the first waiting job of each class has been first; promote it when due.

        A class whose first job is already promoted has no clock: one promoted job per class waits
        at a time, and the next one's clock starts when it is first in line.
        """
        lane_heads: dict[JobClass, tuple[tuple, int, JobRecord]] = {}
        for rank, seq, _, job in self._queue.heads():
            job_class = job.spec.job_class
            if job_class not in lane_heads or (rank, seq) < lane_heads[job_class][:2]:
                lane_heads[job_class] = (rank, seq, job)
        clocks: dict[JobClass, tuple[JobRecord, float, float]] = {}
        for job_class, previous in self._lane_heads.items():
            if lane_heads.get(job_class, (None, None, None))[2] is not previous[0]:
                previous[0].first_in_line_s += now - previous[1]
        for job_class, (_, _, job) in lane_heads.items():
            previous = self._lane_heads.get(job_class)
            if previous is not None and previous[0] is job:
                clocks[job_class] = previous
                continue
            delay = None if job.promoted else self._policy.queue.promotion_delay(job)
            if delay is not None:
                clocks[job_class] = (job, now, max(0.0, delay - job.first_in_line_s))
        if promote:
            for job_class, (job, since, delay) in list(clocks.items()):
                if since + delay <= now:
                    del clocks[job_class]
                    self._queue.remove(job.job_id)
                    job.promoted = True
                    self._queue.push(job, self._group_key(job), (0, now))
        self._lane_heads = clocks

    def _group_key(self, job: JobRecord) -> GroupKey:
        return (job.spec.shape, job.spec.job_class, job.promoted)

    def _protection_is_live(self, entry: tuple[float, int, int, JobRecord]) -> bool:
        job = entry[3]
        return entry[0] > self._now and job.state is JobState.RUNNING and job.runs == entry[2]

    def _running_record(self, job_id: str, action: str) -> JobRecord:
        record = self.job(job_id)
        if record.state is not JobState.RUNNING:
            raise FailedPrecondition(f"cannot {action} job {job_id!r}: it is {record.state.value}, not running.")
        return record

    def _check_new(self, spec: JobSpec, now: float, *, fix: str) -> None:
        """The checks a job passes before the scheduler takes it (submitted or adopted); ``fix`` ends the
        AlreadyExists message."""
        if not isinstance(spec, JobSpec):
            raise InvalidArgument("spec", f"`spec` must be a JobSpec, but got {spec!r}.")
        self._advance(now)
        if spec.job_id in self._jobs:
            raise AlreadyExists(f"job {spec.job_id!r} is already {self._jobs[spec.job_id].state.value}; {fix}")
        self._cluster.check_admissible(spec)

    def _check_packs(self, spec: JobSpec) -> None:
        if self._policy.placement.place(spec.replicas, self._cluster.capacity) is None:
            raise InvalidArgument("roles", f"the replicas ({len(spec.replicas)}, {spec.total.describe()} in total) "
                                           "cannot be packed onto the nodes even when the cluster is empty; use "
                                           "fewer or smaller replicas.")

    def _advance(self, now: float) -> None:
        if not isinstance(now, int | float) or isinstance(now, bool) or now != now:
            raise InvalidArgument("now", f"`now` must be a number of seconds, but got {now!r}.")
        if now < self._now:
            raise InvalidArgument("now", f"`now` must not go back in time: got {now}, after {self._now}.")
        self._now = float(now)
