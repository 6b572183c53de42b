"""One suite per scheduling-policy interface: each ABC's contract, run against every implementation.

The implementations are found as the ABC's subclasses, recursively (abstract ones and test doubles
left out), so a new policy in ``opml_job_orchestrator`` is tested here without being listed; one
whose constructor needs arguments gets its settings in ``SETTINGS`` (the suite says so). What each
suite asserts is what the ABC's docstrings in ``scheduler/policies.py`` promise; what one
implementation does beyond that (best-fit packs tightly, TE before BE, the cheapest victims) is
tested in test_scheduler.py.

The cases are random but seeded, so every run checks the same ones.
"""

from __future__ import annotations

import inspect
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import pytest

from opml_job_orchestrator.scheduler import (
    BestFitPlacement,
    ClassPriorityQueue,
    Cluster,
    FifoQueue,
    FirstFitPlacement,
    GpuSecondsPreemption,
    JobClass,
    JobRecord,
    JobSpec,
    JobState,
    LowestResumeCostPreemption,
    NodeSpec,
    NoPreemption,
    PlacementPolicy,
    PreemptionPolicy,
    PreemptJob,
    QueuePolicy,
    Replica,
    Resources,
    RoleSpec,
    Scheduler,
    SchedulingPolicy,
    StartJob,
)

INTERFACES = (PlacementPolicy, QueuePolicy, PreemptionPolicy)

SETTINGS: dict[type, list[dict[str, Any]]] = {
    FifoQueue: [{"backfill": False}, {"backfill": True}],
    ClassPriorityQueue: [{"aging_bound_s": None, "backfill": False}, {"aging_bound_s": 100.0, "backfill": True}],
    LowestResumeCostPreemption: [{"max_preemptions": None, "promoted_protection_s": 0.0},
                                 {"max_preemptions": 2, "promoted_protection_s": 500.0}],
    GpuSecondsPreemption: [{"max_preemptions": None, "promoted_protection_s": 0.0, "gang_patience_s": 0.0},
                           {"max_preemptions": 2, "promoted_protection_s": 500.0, "max_victim_nodes": 2,
                            "gang_patience_s": None}],
}
"""Constructor settings per implementation, each a separate case; an implementation not listed is built
with no arguments."""


def implementations(interface: type) -> list[type]:
    """Every concrete subclass of ``interface`` defined in the package, in name order."""
    found: set[type] = set()
    todo = [interface]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if not inspect.isabstract(sub) and sub.__module__.startswith("opml_job_orchestrator."):
                found.add(sub)
    return sorted(found, key=lambda cls: cls.__qualname__)


def cases(interface: type) -> list[Any]:
    return [pytest.param((cls, kwargs), id=cls.__name__ + "".join(f"-{k}={v}" for k, v in kwargs.items()))
            for cls in implementations(interface) for kwargs in SETTINGS.get(cls, [{}])]


def build(request: pytest.FixtureRequest) -> Any:
    cls, kwargs = request.param
    try:
        return cls(**kwargs)
    except TypeError as error:
        pytest.fail(f"cannot build {cls.__name__}({kwargs}): {error}; add its settings to SETTINGS in {__file__}.")


@pytest.fixture(params=cases(PlacementPolicy))
def placement(request: pytest.FixtureRequest) -> PlacementPolicy:
    return build(request)


@pytest.fixture(params=cases(QueuePolicy))
def queue(request: pytest.FixtureRequest) -> QueuePolicy:
    return build(request)


@pytest.fixture(params=cases(PreemptionPolicy))
def preemption(request: pytest.FixtureRequest) -> PreemptionPolicy:
    return build(request)


def test_every_interface_has_implementations_and_every_setting_an_implementation() -> None:
    found = {interface: implementations(interface) for interface in INTERFACES}
    assert all(found.values()), found
    assert {FirstFitPlacement, BestFitPlacement} <= set(found[PlacementPolicy])
    assert {FifoQueue, ClassPriorityQueue} <= set(found[QueuePolicy])
    assert {NoPreemption, LowestResumeCostPreemption, GpuSecondsPreemption} <= set(found[PreemptionPolicy])
    assert set(SETTINGS) <= {cls for classes in found.values() for cls in classes}, "a stale entry in SETTINGS"


# -- helpers -------------------------------------------------------------------------------------

NODE = Resources(cpu_millis=64_000, memory_mib=512 * 1024, gpu=8)


def gpus(n: int) -> Resources:
    return Resources(cpu_millis=1_000 * max(n, 1), memory_mib=1024 * max(n, 1), gpu=n)


def spec(job_id: str, gpu: int, *, te: bool = False, replicas: int = 1, priority: int = 0,
         overhead_s: float = 0.0) -> JobSpec:
    roles = {"chief": RoleSpec(1, gpus(gpu))}
    if replicas > 1:
        roles["worker"] = RoleSpec(replicas - 1, gpus(gpu))
    return JobSpec(job_id=job_id, job_class=JobClass.TE if te else JobClass.BE, roles=roles, priority=priority,
                   checkpoint_interval_s=None if te else 100.0, restart_overhead_s=overhead_s)


def state(record: JobRecord) -> tuple[Any, ...]:
    """Everything a policy could change on a record."""
    return tuple(getattr(record, name) for name in JobRecord.__slots__)


def random_resources(rng: random.Random, most: int) -> Resources:
    return Resources(cpu_millis=rng.randint(0, most) * 1000, memory_mib=rng.randint(0, most) * 1024,
                     gpu=rng.randint(0, most))


def placement_cases(seed: int, count: int = 400) -> list[tuple[tuple[Replica, ...], dict[str, Resources]]]:
    """Small random jobs against small random clusters, in three dimensions."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        free = {f"n{i}": random_resources(rng, 8) for i in range(rng.randint(1, 4))}
        replicas = []
        for i in range(rng.randint(1, 5)):
            resources = random_resources(rng, 4)
            replicas.append(Replica("worker", i, resources if not resources.is_zero() else Resources(gpu=1)))
        out.append((tuple(replicas), free))
    return out


def drive(policy: SchedulingPolicy, seed: int, *, steps: int = 60) -> tuple[list[Any], dict[str, JobClass]]:
    """Run a scheduler over a random TE/BE workload on three nodes; return every decision and the
    class of every job.

    The scheduler itself raises when a policy over-commits a node (the cluster refuses the
    allocation) or returns victims that are not candidates or do not make room.
    """
    rng = random.Random(seed)
    s = Scheduler(Cluster([NodeSpec(f"n{i}", NODE) for i in range(3)]), policy)
    decisions: list[Any] = []
    classes: dict[str, JobClass] = {}
    now, k = 0.0, 0
    for _ in range(steps):
        now += rng.choice([1.0, 10.0, 60.0])
        for _ in range(rng.randint(0, 3)):
            te = rng.random() < 0.4
            record = s.submit(spec(f"j{k}", rng.choice([1, 2, 4, 8]), te=te,
                                   replicas=1 if te else rng.choice([1, 1, 2, 3]), priority=rng.choice([0, 0, 1]),
                                   overhead_s=rng.choice([0.0, 30.0])), now=now)
            classes[record.job_id] = record.spec.job_class
            k += 1
        for job_id in list(s.running):
            roll = rng.random()
            if roll < 0.2:
                s.finish(job_id, now=now)
            elif roll < 0.5:
                s.record_checkpoint(job_id, now=now)
        decisions += s.schedule(now=now)
        assert all(min(free.gpu, free.cpu_millis, free.memory_mib) >= 0 for free in s.cluster.free.values())
    return decisions, classes


# -- PlacementPolicy -----------------------------------------------------------------------------


def overcommitted(replicas: Sequence[Replica], nodes: Sequence[str], free: Mapping[str, Resources]) -> list[str]:
    used: dict[str, Resources] = {}
    for replica, node in zip(replicas, nodes, strict=True):
        used[node] = used.get(node, Resources()) + replica.resources
    return [node for node, amount in used.items() if not amount.fits_in(free[node])]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_placement_names_a_node_of_free_per_replica_and_never_overcommits_one(placement: PlacementPolicy,
                                                                             seed: int) -> None:
    placed = 0
    for replicas, free in placement_cases(seed):
        nodes = placement.place(replicas, free)
        if nodes is None:
            continue
        placed += 1
        assert isinstance(nodes, list) and len(nodes) == len(replicas), (replicas, free, nodes)
        assert all(node in free for node in nodes), (free, nodes)
        assert overcommitted(replicas, nodes, free) == [], (replicas, free, nodes)
    assert placed > 50  # the cases do exercise placement, not only refusals


def test_placement_is_none_when_the_replicas_cannot_fit_and_raises_nothing(placement: PlacementPolicy) -> None:
    one = (Replica("chief", 0, gpus(4)),)
    two = (Replica("chief", 0, gpus(4)), Replica("worker", 0, gpus(4)))
    assert placement.place(one, {}) is None  # no node at all
    assert placement.place(one, {"n0": gpus(3), "n1": gpus(2)}) is None  # 5 GPUs free, none with 4
    assert placement.place(one, {"n0": Resources(cpu_millis=64_000, memory_mib=1 << 20, gpu=0)}) is None  # no GPU
    assert placement.place(one, {"n0": Resources(cpu_millis=3_999, memory_mib=1 << 20, gpu=8)}) is None  # CPU short
    assert placement.place(two, {"n0": gpus(7)}) is None  # replicas on one node add up
    assert placement.place(two, {"n0": gpus(4), "n1": gpus(3)}) is None  # all of them or none


@pytest.mark.parametrize("seed", [4, 5])
def test_placement_finds_room_whenever_all_replicas_fit_on_one_node(placement: PlacementPolicy, seed: int) -> None:
    checked = 0
    for replicas, free in placement_cases(seed):
        total = sum((r.resources for r in replicas), Resources())
        if any(total.fits_in(available) for available in free.values()):
            checked += 1
            assert placement.place(replicas, free) is not None, (replicas, free)
    assert checked > 20


def test_placement_is_deterministic_and_leaves_free_unchanged(placement: PlacementPolicy) -> None:
    for replicas, free in placement_cases(6):
        before = dict(free)
        first = placement.place(replicas, free)
        assert free == before and list(free) == list(before)
        assert placement.place(replicas, MappingProxyType(dict(free))) == first  # a read-only view will do
        assert placement.place(list(replicas), dict(before)) == first


@pytest.mark.parametrize("seed", [7, 8])
def test_a_scheduler_under_the_placement_never_overcommits_a_node(placement: PlacementPolicy, seed: int) -> None:
    policy = SchedulingPolicy(name="conformance", queue=ClassPriorityQueue(aging_bound_s=100.0, backfill=True),
                              preemption=GpuSecondsPreemption(max_preemptions=3, promoted_protection_s=50.0,
                                                              gang_patience_s=60.0),
                              placement=placement)
    assert any(isinstance(d, StartJob) for d in drive(policy, seed)[0])


# -- QueuePolicy ---------------------------------------------------------------------------------


def queued_jobs(seed: int, count: int = 40) -> list[JobRecord]:
    """Waiting jobs of both classes and several priorities, some submitted at the same time, some
    preempted, some promoted."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        record = JobRecord(spec(f"q{i}", rng.choice([1, 2, 8]), te=rng.random() < 0.5,
                                priority=rng.choice([-1, 0, 0, 5])), seq=i, now=float(rng.randint(0, 20)))
        if rng.random() < 0.3:
            record.preemptions = rng.randint(1, 3)
            record.enqueued_at = record.submitted_at + rng.randint(1, 100)
        record.promoted = rng.random() < 0.1
        jobs.append(record)
    return jobs


def test_ranks_are_tuples_that_compare_with_each_other(queue: QueuePolicy) -> None:
    ranks = [queue.rank(job) for job in queued_jobs(1)]
    assert all(isinstance(rank, tuple) for rank in ranks)
    sorted(ranks)
    for a in ranks:
        for b in ranks:
            assert isinstance(a < b, bool)


def test_answers_are_the_same_for_the_same_job_and_change_nothing(queue: QueuePolicy) -> None:
    for job in queued_jobs(2):
        before = state(job)
        twin = JobRecord(job.spec, seq=job.seq + 1000, now=job.submitted_at)
        twin.preemptions, twin.enqueued_at, twin.promoted = job.preemptions, job.enqueued_at, job.promoted
        assert queue.rank(job) == queue.rank(job) == queue.rank(twin)
        assert queue.promotion_delay(job) == queue.promotion_delay(job) == queue.promotion_delay(twin)
        assert state(job) == before


def test_rank_keeps_submission_order_within_a_class_and_priority(queue: QueuePolicy) -> None:
    jobs = queued_jobs(3, count=80)
    pairs = 0
    for a in jobs:
        for b in jobs:
            if (a.spec.job_class, a.spec.priority) == (b.spec.job_class, b.spec.priority) and (
                    a.submitted_at < b.submitted_at):
                pairs += 1
                assert queue.rank(a) <= queue.rank(b), (a, a.submitted_at, b, b.submitted_at)
    assert pairs > 100


def test_promotion_delay_is_none_or_finite_seconds_and_backfill_a_bool(queue: QueuePolicy) -> None:
    for job in queued_jobs(4):
        delay = queue.promotion_delay(job)
        assert delay is None or (isinstance(delay, int | float) and not isinstance(delay, bool)
                                 and 0 <= delay < float("inf")), delay
    assert isinstance(queue.backfill, bool) and queue.backfill == queue.backfill


@pytest.mark.parametrize("seed", [5, 6])
def test_the_scheduler_starts_every_queued_job_once_in_rank_order(queue: QueuePolicy, seed: int) -> None:
    """Jobs that each need the whole one-node cluster start one at a time: in (rank, submit) order,
    every one of them exactly once. The clock stands still, so nobody is promoted past the others."""
    policy = SchedulingPolicy(name="conformance", queue=queue, preemption=NoPreemption(),
                              placement=FirstFitPlacement())
    s = Scheduler(Cluster([NodeSpec("n0", NODE)]), policy)
    rng = random.Random(seed)
    submitted = [s.submit(spec(f"q{i}", 8, te=rng.random() < 0.5, priority=rng.choice([-1, 0, 5])), now=i // 3)
                 for i in range(30)]
    order: list[JobRecord] = []
    while s.pending_count or s.running:
        for decision in s.schedule(now=10.0):
            assert isinstance(decision, StartJob)
            order.append(s.job(decision.job_id))
            s.finish(decision.job_id, now=10.0)
    assert Counter(job.job_id for job in order) == Counter(job.job_id for job in submitted)
    assert not any(job.run_promoted for job in order)
    assert order == sorted(submitted, key=lambda job: (queue.rank(job), job.seq))


# -- PreemptionPolicy ----------------------------------------------------------------------------


class World:
    """Three 8-GPU nodes with running jobs placed on them, a waiting job that does not fit, and a
    ``fits`` that places it with best-fit against the free room plus what the victims hold."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.now = 1000.0
        self.capacity = {f"n{i}": NODE for i in range(3)}
        self.free = dict(self.capacity)
        self.held: dict[str, list[tuple[str, Resources]]] = {}
        self.running: list[JobRecord] = []
        packer = FirstFitPlacement()
        for i in range(12):
            te = rng.random() < 0.3
            job = spec(f"r{i}", rng.choice([1, 2, 3, 4]), te=te, replicas=1 if te else rng.choice([1, 1, 2]),
                       overhead_s=rng.choice([0.0, 60.0]))
            nodes = packer.place(job.replicas, self.free)
            if nodes is None:
                continue
            record = JobRecord(job, seq=i, now=rng.uniform(0, 500))
            record.state = JobState.RUNNING
            record.runs = 1 + rng.randint(0, 3)
            record.preemptions = record.runs - 1
            record.run_resumed = record.preemptions > 0
            record.run_started_at = rng.uniform(record.submitted_at, self.now)
            record.run_promoted = not te and rng.random() < 0.3
            record.first_started_at = record.run_started_at
            if rng.random() < 0.6:
                record.last_checkpoint_at = rng.uniform(record.run_started_at, self.now)
            record.nodes = frozenset(nodes)
            placement: dict[str, list[str]] = {}
            for node, replica in zip(nodes, job.replicas, strict=True):
                placement.setdefault(replica.role, []).append(node)
                self.free[node] -= replica.resources
            record.placement = MappingProxyType({role: tuple(held) for role, held in placement.items()})
            self.held[job.job_id] = [(node, r.resources) for node, r in zip(nodes, job.replicas, strict=True)]
            self.running.append(record)
        free_gpus = sum(r.gpu for r in self.free.values())
        te = rng.random() < 0.6
        self.waiting = JobRecord(spec("waiting", 8 if free_gpus < 8 or rng.random() < 0.5 else 4, te=te,
                                      replicas=rng.choice([1, 2])),
                                 seq=99, now=self.now - rng.uniform(0, 3600))
        self.waiting.promoted = not te and rng.random() < 0.5

    def fits(self, victims: Sequence[JobRecord]) -> bool:
        free = dict(self.free)
        for victim in victims:
            for node, resources in self.held[victim.job_id]:
                free[node] += resources
        return BestFitPlacement().place(self.waiting.spec.replicas, free) is not None


def worlds(count: int = 60) -> list[World]:
    """Worlds where the waiting job does not fit as things are: the only ones the scheduler asks about."""
    built = [World(seed) for seed in range(count)]
    return [world for world in built if not world.fits(())]


def test_may_preempt_and_is_preemptible_answer_bools_the_same_way_and_change_nothing(
        preemption: PreemptionPolicy) -> None:
    for world in worlds(20):
        for job in (world.waiting, *world.running):
            before = state(job)
            assert preemption.may_preempt(job) in (True, False)
            assert preemption.may_preempt(job) == preemption.may_preempt(job)
            for now in (world.now, world.now + 10_000):
                assert preemption.is_preemptible(job, now) in (True, False)
                assert preemption.is_preemptible(job, now) == preemption.is_preemptible(job, now)
            assert preemption.protection_ends_at(job) == preemption.protection_ends_at(job)
            assert preemption.retry_at(job) == preemption.retry_at(job)
            assert state(job) == before


def test_te_jobs_are_never_preemptible(preemption: PreemptionPolicy) -> None:
    te_jobs = [job for world in worlds() for job in world.running if job.spec.job_class is JobClass.TE]
    assert te_jobs
    for job in te_jobs:
        for now in (job.run_started_at, 1000.0, 1e9):
            assert not preemption.is_preemptible(job, now), job


def test_a_job_is_not_preemptible_before_its_protection_ends(preemption: PreemptionPolicy) -> None:
    for world in worlds():
        for job in world.running:
            ends = preemption.protection_ends_at(job)
            assert ends is None or isinstance(ends, float | int)
            if ends is not None:
                for now in (job.run_started_at, ends - 1.0, ends - 1e-6):
                    if now < ends:
                        assert not preemption.is_preemptible(job, now), (job, now, ends)


def check_victims(preemption: PreemptionPolicy, job: JobRecord, candidates: list[JobRecord],
                  fits: Callable[[Sequence[JobRecord]], bool], now: float) -> Sequence[JobRecord]:
    """Call ``select_victims`` as the scheduler does and check the answer against the contract."""
    given = list(candidates)
    before = [state(c) for c in candidates] + [state(job)]
    victims = preemption.select_victims(job, candidates, fits, now)
    assert isinstance(victims, Sequence), victims
    assert candidates == given and [state(c) for c in candidates] + [state(job)] == before
    assert all(any(v is c for c in candidates) for v in victims), (victims, candidates)
    assert len({id(v) for v in victims}) == len(victims), victims
    assert not victims or fits(victims), (victims, candidates)
    again = preemption.select_victims(job, list(candidates), fits, now)
    assert [v.job_id for v in again] == [v.job_id for v in victims]
    return victims


def test_victims_are_distinct_preemptible_candidates_that_make_the_job_fit(preemption: PreemptionPolicy) -> None:
    for world in worlds():
        candidates = [r for r in world.running if preemption.is_preemptible(r, world.now)]
        if candidates and preemption.may_preempt(world.waiting):
            victims = check_victims(preemption, world.waiting, candidates, world.fits, world.now)
            assert all(v.spec.job_class is JobClass.BE for v in victims)


def test_victims_fit_even_where_more_room_does_not_keep_a_fit(preemption: PreemptionPolicy) -> None:
    """A greedy placement can, rarely, miss a fit that less room had: ``fits`` here is arbitrary."""
    for world in worlds():
        candidates = [r for r in world.running if preemption.is_preemptible(r, world.now)]
        if not candidates:
            continue
        for salt in range(8):
            def fits(victims: Sequence[JobRecord], salt: int = salt) -> bool:
                ids = frozenset(v.job_id for v in victims)
                return bool(ids) and random.Random(f"{salt}:{sorted(ids)}").random() < 0.4

            check_victims(preemption, world.waiting, candidates, fits, world.now)


def test_nothing_is_stopped_for_a_job_no_victims_make_room_for(preemption: PreemptionPolicy) -> None:
    def never(victims: Sequence[JobRecord]) -> bool:
        return False

    for world in worlds():
        candidates = [r for r in world.running if preemption.is_preemptible(r, world.now)]
        if candidates:
            assert list(check_victims(preemption, world.waiting, candidates, never, world.now)) == []


@pytest.mark.parametrize("seed", [9, 10, 11])
def test_a_scheduler_under_the_policy_stops_only_be_jobs_and_reports_no_policy_bug(
        preemption: PreemptionPolicy, seed: int) -> None:
    te = JobRecord(spec("te", 1, te=True), seq=0, now=0.0)
    te.state, te.run_started_at = JobState.RUNNING, 0.0
    # A policy that lets TE jobs stop each other livelocks schedule(): fail here instead of hanging.
    assert not preemption.is_preemptible(te, 1e9)
    policy = SchedulingPolicy(name="conformance", queue=ClassPriorityQueue(aging_bound_s=100.0, backfill=True),
                              preemption=preemption, placement=BestFitPlacement())
    decisions, classes = drive(policy, seed)
    stopped = [d.job_id for d in decisions if isinstance(d, PreemptJob)]
    assert all(classes[job_id] is JobClass.BE for job_id in stopped), stopped
    assert any(isinstance(d, StartJob) for d in decisions)
