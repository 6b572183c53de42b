"""Pluggable scheduling policies: small ABCs whose docstrings say when the scheduler calls them.

A :class:`SchedulingPolicy` bundles three parts, each replaceable on its own:

* :class:`QueuePolicy`: the order in which pending jobs are tried, the aging rule that promotes a
  job that waited too long, and whether jobs may start past a job that cannot (backfilling);
* :class:`PreemptionPolicy`: which waiting jobs may stop running ones, which running jobs may be
  stopped, and which of them to stop;
* :class:`PlacementPolicy`: which node each replica of a starting job goes to.

The presets are :func:`fifo_policy` (the baseline), :func:`te_be_policy` (the TE/BE algorithm of
Yabuuchi et al., OpML '19) and :func:`te_be_plus_policy` (ours: TE/BE with backfilling, best-fit
packing, and victims chosen by GPU-seconds lost, gang jobs only as a last resort).

Policies read the scheduler's :class:`~opml_job_orchestrator.scheduler.scheduler.JobRecord` objects
and must never change them; they must be deterministic, or simulations stop being reproducible.
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opml_common.errors import InvalidArgument
from opml_job_orchestrator.scheduler.model import JobClass, Replica, Resources

if TYPE_CHECKING:
    from opml_job_orchestrator.scheduler.scheduler import JobRecord

VictimTest = Callable[[Sequence["JobRecord"]], bool]
"""``fits(victims)``: could the waiting job be placed if ``victims`` were stopped?"""


# ----------------------------------------------------------------------------------------------
# Placement


class PlacementPolicy(ABC):
    """Chooses a node for every replica of a job: all of them or none (gang placement)."""

    @abstractmethod
    def place(self, replicas: Sequence[Replica], free: Mapping[str, Resources]) -> list[str] | None:
        """Return a node name per replica (in the order of ``replicas``), or None if none was found.

        Called each time the scheduler tries to start a job; on the empty cluster when a job is
        submitted (a job that cannot be placed there is rejected); and once per victim set a
        preemption policy tests. ``free`` maps node names, in cluster order, to free resources and
        must not be changed. Replicas placed on one node add up on it.

        Every implementation guarantees (tests/test_policy_conformance.py checks each):

        * a list names, for each replica, a node of ``free``, and never over-commits one: the
          replicas it gives a node add up to at most that node's free resources, in every dimension;
        * None whenever the replicas cannot all fit; None is also allowed when they could, since
          packing is a heuristic (the presets are greedy, and more free room can, rarely, make them
          miss a fit), except that a placement is always found when all the replicas fit together
          on one node (so a one-replica job is placed whenever some node has room for it);
        * the same ``replicas`` and ``free`` (the same nodes in the same order) give the same answer:
          the scheduler tests a victim set with ``fits`` and then places the job again once the
          victims stopped, and must get a placement both times.

        Raises:
            Nothing: a job that does not fit is None, not an error.
        """


class FirstFitPlacement(PlacementPolicy):
    """Largest replica first, each on the first node (in cluster order) with room for it."""

    def place(self, replicas: Sequence[Replica], free: Mapping[str, Resources]) -> list[str] | None:
        taken: dict[str, Resources] = {}
        nodes: list[str] = [""] * len(replicas)
        for i in _largest_first(replicas):
            need = replicas[i].resources
            for name, available in free.items():
                available = taken.get(name, available)
                if need.fits_in(available):
                    nodes[i] = name
                    taken[name] = available - need
                    break
            else:
                return None
        return nodes


class BestFitPlacement(PlacementPolicy):
    """Largest replica first, each on the node it leaves with the fewest free GPUs (then CPU, memory).

    Packing jobs tightly keeps whole nodes free for the jobs that need them, so fewer TE jobs find
    the free GPUs scattered in pieces too small to use, and fewer preemptions are needed.
    """

    def place(self, replicas: Sequence[Replica], free: Mapping[str, Resources]) -> list[str] | None:
        taken: dict[str, Resources] = {}
        nodes: list[str] = [""] * len(replicas)
        for i in _largest_first(replicas):
            need = replicas[i].resources
            best_name, best_left, best_key = "", None, None
            for name, available in free.items():
                available = taken.get(name, available)
                if need.fits_in(available):
                    left = available - need
                    key = (left.gpu, left.cpu_millis, left.memory_mib)
                    if best_key is None or key < best_key:
                        best_name, best_left, best_key = name, left, key
            if best_left is None:
                return None
            nodes[i] = best_name
            taken[best_name] = best_left
        return nodes


def _largest_first(replicas: Sequence[Replica]) -> list[int]:
    return sorted(range(len(replicas)), key=lambda i: (-replicas[i].resources.gpu, -replicas[i].resources.cpu_millis,
                                                       -replicas[i].resources.memory_mib, i))


# ----------------------------------------------------------------------------------------------
# Queue order


class QueuePolicy(ABC):
    """Orders the pending queue, promotes jobs that waited too long, and allows backfilling or not.

    The aging rule, enforced by the scheduler for every policy: the first waiting job of each
    class (its highest-ranked one) runs a clock while it is first in line, from the scheduling
    pass that first sees it there, keeping what it has when another job moves ahead of it for a
    while. When the clock reaches :meth:`promotion_delay`, the job is *promoted*: it is tried
    before every other job, and the preemption policy may let it preempt (see
    :class:`CheckpointPreemption`). If it still cannot start, it holds the line: without
    backfilling nothing behind it starts; with backfilling it reserves the nodes it will run on
    (those that will drain soonest: most free, counting what TE jobs hold as free, since they are
    short) and nothing behind it starts there. Capacity drains to it as running jobs end. One job
    per class is promoted at a time.

    Waiting behind jobs of the same class does not run the clock, so ordinary queueing under load
    promotes nobody; waiting first in line does, whoever holds the capacity (TE jobs, smaller jobs
    backfilled past it, long runs). A job's wait is therefore bounded by the waits of the jobs
    ahead of it in its class, plus the delay, plus the longest remaining run on the nodes it
    drains.

    No method raises: every answer is taken as valid (ranks must compare with each other).
    """

    @abstractmethod
    def rank(self, job: JobRecord) -> tuple[Any, ...]:
        """The job's place in the queue: smaller ranks are tried first; ties go to the earlier submit.

        Called each time the job enters the queue (on submit and after each preemption); the rank
        holds until the job leaves the queue.

        Every implementation guarantees: a tuple that compares with every other job's rank; the same
        answer for the same job state (the job is only read); and, among jobs of one class and one
        ``priority``, an earlier submit never ranks behind a later one (FIFO within a class and
        priority: the aging bound relies on it, since waiting behind one's own class runs no clock).
        """

    @abstractmethod
    def promotion_delay(self, job: JobRecord) -> float | None:
        """Seconds ``job`` may stay first in line of its class before it is promoted (None: never).

        Called at a scheduling pass when ``job`` has just become the first waiting job of its class.
        The answer is None or a finite number of seconds >= 0, the same for the same job state.
        """

    @property
    @abstractmethod
    def backfill(self) -> bool:
        """Whether jobs ranked behind a job that cannot start may start meanwhile on free capacity.

        Read at each scheduling pass; a bool. A promoted job is never passed on the nodes it reserved.
        """


class FifoQueue(QueuePolicy):
    """Submission order, for every class and priority alike: the baseline of the paper."""

    def __init__(self, *, backfill: bool = False) -> None:
        self._backfill = _check_bool(backfill, "backfill")

    def rank(self, job: JobRecord) -> tuple[Any, ...]:
        return (job.submitted_at,)

    def promotion_delay(self, job: JobRecord) -> float | None:
        return None

    @property
    def backfill(self) -> bool:
        return self._backfill


class ClassPriorityQueue(QueuePolicy):
    """TE jobs before BE jobs; within a class, higher ``priority`` first, then submission order.

    A preempted job keeps its rank (it is ranked by its first submit), so it resumes ahead of BE
    jobs submitted after it. The first waiting BE job is promoted after ``aging_bound_s`` seconds
    first in line (see :class:`QueuePolicy`), which bounds how long TE traffic, or backfilled
    smaller BE jobs, can hold it back. None disables aging.
    """

    def __init__(self, *, aging_bound_s: float | None, backfill: bool) -> None:
        self._aging_bound_s = _check_seconds(aging_bound_s, "aging_bound_s", allow_none=True)
        self._backfill = _check_bool(backfill, "backfill")

    def rank(self, job: JobRecord) -> tuple[Any, ...]:
        return (0 if job.spec.job_class is JobClass.TE else 1, -job.spec.priority, job.submitted_at)

    def promotion_delay(self, job: JobRecord) -> float | None:
        return self._aging_bound_s if job.spec.job_class is JobClass.BE else None

    @property
    def backfill(self) -> bool:
        return self._backfill


# ----------------------------------------------------------------------------------------------
# Preemption


class PreemptionPolicy(ABC):
    """Decides who may stop whom, and which running jobs to stop so that a waiting job fits.

    No method raises; an impossible choice of victims is reported by the scheduler (see
    :meth:`select_victims`). Every method only reads the jobs it is given and answers the same for
    the same inputs (tests/test_policy_conformance.py checks each implementation).
    """

    @abstractmethod
    def may_preempt(self, job: JobRecord) -> bool:
        """Whether pending ``job`` may have running jobs stopped so it can start (a bool).

        Called when ``job`` is the next to try in a scheduling pass and the free capacity cannot
        hold it.
        """

    @abstractmethod
    def is_preemptible(self, job: JobRecord, now: float) -> bool:
        """Whether running ``job`` may be stopped at ``now`` (a bool).

        Called for every running job each time a job that :meth:`may_preempt` cannot start. Never
        True for a TE job (:attr:`JobClass.TE` jobs are never preempted), nor before the time
        :meth:`protection_ends_at` gives for ``job``.
        """

    @abstractmethod
    def select_victims(self, job: JobRecord, candidates: Sequence[JobRecord], fits: VictimTest,
                       now: float) -> Sequence[JobRecord]:
        """The running jobs to stop so that ``job`` starts, or an empty sequence to let it wait.

        Called right after :meth:`is_preemptible` chose ``candidates`` (in start order, never
        empty), when the free capacity cannot hold ``job`` (``fits(())`` is False).
        ``fits(victims)`` places ``job`` against the free capacity plus what ``victims`` hold; since
        placement is a heuristic (see :meth:`PlacementPolicy.place`), freeing more almost always,
        but not always, keeps a fit. Stopped jobs go back to the queue and resume from their last
        checkpoint.

        The answer is empty, or distinct jobs taken from ``candidates`` (the same objects) for
        which ``fits`` is True, checked on that exact set: so nothing is stopped for a job that no
        victims make room for, and never a job that :meth:`is_preemptible` refused.

        Raises:
            Nothing: the scheduler raises OpmlError (INTERNAL) itself when the returned jobs are not
            all candidates or do not make ``job`` fit.
        """

    def protection_ends_at(self, job: JobRecord) -> float | None:
        """When running ``job``, now not preemptible, becomes preemptible by time alone (None: never).

        Called when ``job`` starts. Before that time, :meth:`is_preemptible` is False for ``job``.
        The scheduler reports the time through ``next_deadline`` so a waiting job gets another
        chance to preempt then. Default: None.
        """
        return None

    def retry_at(self, job: JobRecord) -> float | None:
        """When waiting ``job``, for which no victims were chosen, may find some by time alone.

        Called right after :meth:`select_victims` returned nothing for ``job``. The scheduler
        reports the time through ``next_deadline``. Default: None (only new reports help it).
        """
        return None


class NoPreemption(PreemptionPolicy):
    """Nothing is ever stopped: the baseline."""

    def may_preempt(self, job: JobRecord) -> bool:
        return False

    def is_preemptible(self, job: JobRecord, now: float) -> bool:
        return False

    def select_victims(self, job: JobRecord, candidates: Sequence[JobRecord], fits: VictimTest,
                       now: float) -> Sequence[JobRecord]:
        return ()


class CheckpointPreemption(PreemptionPolicy):
    """TE jobs, and promoted BE jobs, may stop BE jobs; subclasses choose which. Protection rules:

    * a BE job stopped ``max_preemptions`` times is no longer preemptible (it runs to completion),
      which caps the work it can lose and the restarts it pays;
    * a BE job that started while promoted (see :class:`QueuePolicy`) is not preemptible for its
      first ``promoted_protection_s`` seconds, so it makes progress and checkpoints before a TE job
      may take its place again.

    Together with the aging rule, no BE job starves: each wait ends within a bound, and after
    ``max_preemptions`` stops a run is never interrupted again.
    """

    def __init__(self, *, max_preemptions: int | None, promoted_protection_s: float) -> None:
        if max_preemptions is not None and (not isinstance(max_preemptions, int) or isinstance(max_preemptions, bool)
                                            or max_preemptions < 0):
            raise InvalidArgument("max_preemptions", "`max_preemptions` must be an integer >= 0 or None (no "
                                                     f"limit), but got {max_preemptions!r}.")
        self._max_preemptions = max_preemptions
        self._promoted_protection_s = _check_seconds(promoted_protection_s, "promoted_protection_s")

    def may_preempt(self, job: JobRecord) -> bool:
        return job.spec.job_class is JobClass.TE or job.promoted

    def is_preemptible(self, job: JobRecord, now: float) -> bool:
        if job.spec.job_class is not JobClass.BE:
            return False
        if self._max_preemptions is not None and job.preemptions >= self._max_preemptions:
            return False
        protected_until = self.protection_ends_at(job)
        return protected_until is None or now >= protected_until

    def protection_ends_at(self, job: JobRecord) -> float | None:
        if job.run_promoted and job.run_started_at is not None:
            return job.run_started_at + self._promoted_protection_s
        return None


class LowestResumeCostPreemption(CheckpointPreemption):
    """The paper's rule: stop the BE jobs that resume most cheaply, only as many as needed.

    A victim's resume cost is the work it loses (progress since its last checkpoint) plus its
    restart overhead. Candidates are added cheapest first until the waiting job fits; then every
    victim the job fits without is dropped again, dearest first.
    """

    def select_victims(self, job: JobRecord, candidates: Sequence[JobRecord], fits: VictimTest,
                       now: float) -> Sequence[JobRecord]:
        ordered = sorted(candidates, key=lambda c: c.resume_cost_s(now))
        return _cheapest_prefix_that_fits(ordered, fits)


class GpuSecondsPreemption(CheckpointPreemption):
    """Our victim rule: lose the fewest GPU-seconds, break up gang jobs only as a last resort.

    A victim's cost is its resume cost times the GPUs it holds (at least 1): stopping an 8-GPU job
    to fit a 1-GPU TE job throws away eight times the work. Victim sets are tried per node (the
    candidates that run on it, cheapest first) and across the cluster; the cheapest set that
    fits wins, and victims it does not need are dropped.

    Jobs running on more than ``max_victim_nodes`` nodes (gang jobs) are candidates only once the
    waiting job has waited ``gang_patience_s`` seconds: stopping a gang job that spans k nodes
    frees k nodes for a TE job that needs one, and the gang job then waits for k nodes to come
    free at once while smaller jobs backfill them. In our simulations, breaking gangs at once
    doubled the BE p95 slowdown, never breaking them left 8-GPU TE jobs waiting for a whole node,
    and 30 minutes of patience kept most of both gains. ``gang_patience_s=None`` never breaks them.
    """

    def __init__(self, *, max_preemptions: int | None, promoted_protection_s: float,
                 max_victim_nodes: int = 1, gang_patience_s: float | None = 1800.0) -> None:
        super().__init__(max_preemptions=max_preemptions, promoted_protection_s=promoted_protection_s)
        if not isinstance(max_victim_nodes, int) or isinstance(max_victim_nodes, bool) or max_victim_nodes < 1:
            raise InvalidArgument("max_victim_nodes", "`max_victim_nodes` must be an integer >= 1, "
                                                      f"but got {max_victim_nodes!r}.")
        self._max_victim_nodes = max_victim_nodes
        self._gang_patience_s = _check_seconds(gang_patience_s, "gang_patience_s", allow_none=True)

    def select_victims(self, job: JobRecord, candidates: Sequence[JobRecord], fits: VictimTest,
                       now: float) -> Sequence[JobRecord]:
        compact = [c for c in candidates if len(c.nodes) <= self._max_victim_nodes]
        victims = self._cheapest_set(compact, fits, now)
        if not victims and len(compact) < len(candidates):
            patience_ends = self.retry_at(job)
            if patience_ends is not None and now >= patience_ends:
                victims = self._cheapest_set(candidates, fits, now)
        return victims

    def retry_at(self, job: JobRecord) -> float | None:
        return None if self._gang_patience_s is None else job.enqueued_at + self._gang_patience_s

    @staticmethod
    def _cheapest_set(candidates: Sequence[JobRecord], fits: VictimTest, now: float) -> Sequence[JobRecord]:
        cost = {c.spec.job_id: c.resume_cost_s(now) * max(1, c.spec.total.gpu) for c in candidates}
        ordered = sorted(candidates, key=lambda c: cost[c.spec.job_id])
        by_node: dict[str, list[JobRecord]] = {}
        for candidate in ordered:
            for node in candidate.nodes:
                by_node.setdefault(node, []).append(candidate)
        best: Sequence[JobRecord] = _cheapest_prefix_that_fits(ordered, fits)
        best_cost = sum(cost[v.spec.job_id] for v in best) if best else math.inf
        for node_candidates in by_node.values():
            victims = _cheapest_prefix_that_fits(node_candidates, fits)
            total = sum(cost[v.spec.job_id] for v in victims)
            if victims and total < best_cost:
                best, best_cost = victims, total
        return best


def _cheapest_prefix_that_fits(ordered: Sequence[JobRecord], fits: VictimTest) -> list[JobRecord]:
    """The shortest prefix of ``ordered`` that makes the job fit, minus the victims it can spare.

    Freeing more almost never hurts a fit, so the shortest prefix is found by bisection (log n
    placements instead of n); then victims are dropped dearest first while the job still fits
    without them. Where greedy placement does miss a fit that less room had (see
    :meth:`PlacementPolicy.place`), bisection may settle on a longer prefix, never on one that does
    not fit: it only stops at a length it checked, and every drop is checked too.
    """
    if not ordered or not fits(ordered):
        return []
    length = bisect.bisect_left(range(1, len(ordered) + 1), True, key=lambda n: fits(ordered[:n])) + 1
    victims = list(ordered[:length])
    for victim in reversed(ordered[:length - 1]):
        rest = [v for v in victims if v is not victim]
        if fits(rest):
            victims = rest
    return victims


# ----------------------------------------------------------------------------------------------
# Bundles


@dataclass(frozen=True, kw_only=True)
class SchedulingPolicy:
    """The three parts the scheduler consults, under one name for reports. Checked when built."""

    name: str
    queue: QueuePolicy
    preemption: PreemptionPolicy
    placement: PlacementPolicy

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument("name", f"`name` must be a non-empty string, but got {self.name!r}.")
        for field, kind in (("queue", QueuePolicy), ("preemption", PreemptionPolicy), ("placement", PlacementPolicy)):
            if not isinstance(getattr(self, field), kind):
                raise InvalidArgument(field, f"`{field}` must be a {kind.__name__}, but got {getattr(self, field)!r}.")


DEFAULT_AGING_BOUND_S = 24 * 3600.0
DEFAULT_MAX_PREEMPTIONS = 3
DEFAULT_PROMOTED_PROTECTION_S = 2 * 3600.0


def fifo_policy(*, backfill: bool = False) -> SchedulingPolicy:
    """Submission order, no preemption, first-fit placement; ``backfill`` lets smaller jobs pass."""
    return SchedulingPolicy(name="fifo+backfill" if backfill else "fifo", queue=FifoQueue(backfill=backfill),
                            preemption=NoPreemption(), placement=FirstFitPlacement())


def te_be_policy(*, backfill: bool = False, aging_bound_s: float | None = DEFAULT_AGING_BOUND_S,
                 max_preemptions: int | None = DEFAULT_MAX_PREEMPTIONS,
                 promoted_protection_s: float = DEFAULT_PROMOTED_PROTECTION_S) -> SchedulingPolicy:
    """The paper's algorithm: TE first, BE jobs with the lowest resume cost preempted for them.

    First-fit placement and, unless ``backfill``, strict order, like the FIFO baseline, so the
    comparison isolates the class order and preemption. Aging and protection as documented on
    :class:`QueuePolicy` and :class:`CheckpointPreemption`.
    """
    return SchedulingPolicy(
        name="te-be+backfill" if backfill else "te-be",
        queue=ClassPriorityQueue(aging_bound_s=aging_bound_s, backfill=backfill),
        preemption=LowestResumeCostPreemption(max_preemptions=max_preemptions,
                                              promoted_protection_s=promoted_protection_s),
        placement=FirstFitPlacement(),
    )


def te_be_plus_policy(*, aging_bound_s: float | None = DEFAULT_AGING_BOUND_S,
                      max_preemptions: int | None = DEFAULT_MAX_PREEMPTIONS,
                      promoted_protection_s: float = DEFAULT_PROMOTED_PROTECTION_S,
                      gang_patience_s: float | None = 1800.0) -> SchedulingPolicy:
    """Ours: TE/BE plus backfilling, best-fit packing, and victims chosen by GPU-seconds lost,
    breaking up gang jobs only for a job that waited ``gang_patience_s`` (:class:`GpuSecondsPreemption`)."""
    return SchedulingPolicy(
        name="te-be+",
        queue=ClassPriorityQueue(aging_bound_s=aging_bound_s, backfill=True),
        preemption=GpuSecondsPreemption(max_preemptions=max_preemptions, promoted_protection_s=promoted_protection_s,
                                        gang_patience_s=gang_patience_s),
        placement=BestFitPlacement(),
    )


POLICY_PRESETS: dict[str, Callable[[], SchedulingPolicy]] = {
    "fifo": fifo_policy,
    "fifo+backfill": lambda: fifo_policy(backfill=True),
    "te-be": te_be_policy,
    "te-be+backfill": lambda: te_be_policy(backfill=True),
    "te-be+": te_be_plus_policy,
}
"""Preset name to factory: what the simulator's bench compares."""


def _check_bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(field, f"`{field}` must be True or False, but got {value!r}.")
    return value


def _check_seconds(value: Any, field: str, *, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < math.inf:
        rule = " or None" if allow_none else ""
        raise InvalidArgument(field, f"`{field}` must be a finite number of seconds >= 0{rule}, but got {value!r}.")
    return float(value)
