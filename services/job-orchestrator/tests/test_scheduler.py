"""The scheduler core: order, preemption, resume, aging, protection, errors and cost per pass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OpmlError
from opml_job_orchestrator.scheduler import (
    BestFitPlacement,
    ClassPriorityQueue,
    Cluster,
    JobClass,
    JobRecord,
    JobSpec,
    JobState,
    LowestResumeCostPreemption,
    NodeSpec,
    PlacementPolicy,
    PreemptJob,
    Replica,
    Resources,
    RoleSpec,
    Scheduler,
    SchedulingPolicy,
    StartJob,
    fifo_policy,
    te_be_plus_policy,
    te_be_policy,
)

NODE = Resources(cpu_millis=64_000, memory_mib=512 * 1024, gpu=8)


def gpus(n: int) -> Resources:
    return Resources(cpu_millis=1_000 * max(n, 1), memory_mib=1024 * max(n, 1), gpu=n)


def job(job_id: str, gpu: int, *, te: bool = False, replicas: int = 1, checkpoint_s: float | None = 100.0,
        overhead_s: float = 0.0, priority: int = 0) -> JobSpec:
    roles = {"chief": RoleSpec(1, gpus(gpu))}
    if replicas > 1:
        roles["worker"] = RoleSpec(replicas - 1, gpus(gpu))
    return JobSpec(job_id=job_id, job_class=JobClass.TE if te else JobClass.BE, roles=roles, priority=priority,
                   checkpoint_interval_s=None if te else checkpoint_s, restart_overhead_s=overhead_s)


def scheduler(policy: SchedulingPolicy, nodes: int = 1) -> Scheduler:
    return Scheduler(Cluster([NodeSpec(f"n{i}", NODE) for i in range(nodes)]), policy)


def a_running_b_pending() -> Scheduler:
    """One node, FIFO: job "a" takes all of it at time 0, "b" waits behind it."""
    s = scheduler(fifo_policy())
    s.submit(job("a", 8), now=0)
    s.submit(job("b", 8), now=0)
    s.schedule(now=0)
    return s


def started(decisions: Sequence) -> list[str]:
    return [d.job_id for d in decisions if isinstance(d, StartJob)]


def preempted(decisions: Sequence) -> list[str]:
    return [d.job_id for d in decisions if isinstance(d, PreemptJob)]


# -- order ---------------------------------------------------------------------------------------


def test_fifo_starts_jobs_in_submission_order() -> None:
    s = scheduler(fifo_policy())
    for t, (name, gpu) in enumerate([("a", 8), ("b", 4), ("c", 4)]):
        s.submit(job(name, gpu), now=t)
    assert started(s.schedule(now=3)) == ["a"]
    s.finish("a", now=4)
    decisions = s.schedule(now=4)
    assert started(decisions) == ["b", "c"]
    assert decisions[0] == StartJob("b", {"chief": ("n0",)}, resume=False)


def test_fifo_head_of_line_blocks_unless_it_backfills() -> None:
    for policy, expected in ((fifo_policy(), ["a"]), (fifo_policy(backfill=True), ["a", "c"])):
        s = scheduler(policy)
        for t, (name, gpu) in enumerate([("a", 6), ("b", 4), ("c", 2)]):
            s.submit(job(name, gpu), now=t)
        assert started(s.schedule(now=3)) == expected, policy.name
        assert s.job("b").state is JobState.PENDING


def test_te_jobs_go_first_then_priority_then_submission_order() -> None:
    s = scheduler(te_be_policy())
    s.submit(job("be-old", 2), now=0)
    s.submit(job("be-urgent", 2, priority=5), now=1)
    s.submit(job("te-early", 2, te=True), now=1.5)
    s.submit(job("te-late", 2, te=True), now=2)
    assert started(s.schedule(now=3)) == ["te-early", "te-late", "be-urgent", "be-old"]


def test_fifo_ignores_class_and_never_preempts() -> None:
    s = scheduler(fifo_policy())
    s.submit(job("be", 8), now=0)
    s.schedule(now=0)
    s.submit(job("te", 1, te=True), now=1)
    assert s.schedule(now=1) == []
    assert s.job("be").state is JobState.RUNNING


# -- preemption ----------------------------------------------------------------------------------


def running_be_jobs(s: Scheduler, checkpoints: Mapping[str, tuple[int, float]], *, overhead_s: float = 60.0) -> None:
    """Start BE jobs (name -> (GPUs, checkpoint time)) at t=0 and report their checkpoints."""
    for name, (gpu, _) in checkpoints.items():
        s.submit(job(name, gpu, overhead_s=overhead_s), now=0)
    assert set(checkpoints) <= set(started(s.schedule(now=0)))
    for name, (_, at) in sorted(checkpoints.items(), key=lambda item: item[1][1]):
        s.record_checkpoint(name, now=at)


@pytest.mark.parametrize(("te_gpus", "victims"), [(2, ["d"]), (3, ["d", "b"]), (4, ["d", "b"]), (6, ["d", "b", "c"])])
def test_te_preempts_the_lowest_resume_cost_be_jobs_and_only_as_many_as_needed(te_gpus: int,
                                                                              victims: list[str]) -> None:
    s = scheduler(te_be_policy())
    # Lost work at t=1000: a 900 s, b 100 s, c 500 s, d 10 s; each pays 60 s to restart.
    running_be_jobs(s, {"a": (2, 100), "b": (2, 900), "c": (2, 500), "d": (2, 990)})
    s.submit(job("te", te_gpus, te=True), now=1000)
    decisions = s.schedule(now=1000)
    assert preempted(decisions) == victims
    assert started(decisions) == ["te"]
    assert decisions.index(next(d for d in decisions if isinstance(d, StartJob))) == len(victims)
    lost = {"a": 900.0, "b": 100.0, "c": 500.0, "d": 10.0}
    assert [d.lost_work_s for d in decisions if isinstance(d, PreemptJob)] == [lost[v] for v in victims]
    assert all(d.for_job_id == "te" for d in decisions if isinstance(d, PreemptJob))


def test_victims_the_job_fits_without_are_dropped() -> None:
    s = scheduler(te_be_policy())
    s.submit(job("te-running", 3, te=True), now=0)
    s.submit(job("small", 1), now=0)
    s.submit(job("large", 4), now=0)
    s.schedule(now=0)
    s.record_checkpoint("small", now=90)  # cheapest, but 1 GPU does not make room for 4
    s.submit(job("te", 4, te=True), now=100)
    assert preempted(s.schedule(now=100)) == ["large"]
    assert s.job("small").state is JobState.RUNNING


def test_preempted_job_resumes_from_its_checkpoint_and_its_lost_work_is_counted() -> None:
    s = scheduler(te_be_policy())
    s.submit(job("be", 8, overhead_s=30), now=0)
    s.schedule(now=0)
    s.record_checkpoint("be", now=200)
    s.submit(job("te", 8, te=True), now=250)
    decisions = s.schedule(now=250)
    assert decisions[0] == PreemptJob("be", "te", lost_work_s=50.0)
    record = s.job("be")
    assert (record.state, record.preemptions, record.lost_work_s) == (JobState.PENDING, 1, 50.0)
    s.finish("te", now=300)
    assert s.schedule(now=300) == [StartJob("be", {"chief": ("n0",)}, resume=True)]
    assert record.run_resumed and record.runs == 2
    # The resumed run makes progress only after its restart overhead, and counts from there.
    assert record.lost_work_if_stopped(320) == 0.0
    assert record.lost_work_if_stopped(400) == 70.0
    assert record.resume_cost_s(400) == 100.0
    assert s.finish("be", now=1130).state is JobState.FINISHED


def test_paper_victims_minimize_seconds_ours_minimize_gpu_seconds() -> None:
    outcomes = {}
    for policy in (te_be_policy(), te_be_plus_policy()):
        s = scheduler(policy)
        s.submit(job("te-running", 3, te=True), now=0)
        running_be_jobs(s, {"big": (4, 700), "small": (1, 400)}, overhead_s=0)  # lost at t=1000: 300 s, 600 s
        s.submit(job("te", 1, te=True), now=1000)
        outcomes[policy.name] = preempted(s.schedule(now=1000))
    assert outcomes == {"te-be": ["big"], "te-be+": ["small"]}


def test_te_be_plus_breaks_up_a_gang_job_only_after_its_patience() -> None:
    s = scheduler(te_be_policy(), nodes=2)
    s.submit(job("gang", 8, replicas=2), now=0)
    s.schedule(now=0)
    s.submit(job("te", 8, te=True), now=10)
    assert preempted(s.schedule(now=10)) == ["gang"]

    s = scheduler(te_be_plus_policy(gang_patience_s=600), nodes=3)
    s.submit(job("gang", 8, replicas=2), now=0)
    s.submit(job("single", 4), now=0)
    s.submit(job("te-running", 4, te=True), now=0)
    s.schedule(now=0)
    s.submit(job("te", 8, te=True), now=10)
    assert s.schedule(now=10) == []  # "single" shares its node with a TE job: only the gang could make room
    assert s.next_deadline() == 610.0
    assert s.schedule(now=300) == []
    decisions = s.schedule(now=610)
    assert preempted(decisions) == ["gang"] and started(decisions) == ["te"]


def test_a_be_job_is_not_preempted_more_than_max_preemptions_times() -> None:
    s = scheduler(te_be_policy(max_preemptions=2))
    s.submit(job("be", 8), now=0)
    s.schedule(now=0)
    for round_ in range(3):
        t = 100.0 * (round_ + 1)
        s.submit(job(f"te-{round_}", 8, te=True), now=t)
        decisions = s.schedule(now=t)
        if round_ < 2:
            assert preempted(decisions) == ["be"] and started(decisions) == [f"te-{round_}"]
            s.finish(f"te-{round_}", now=t + 10)
            assert started(s.schedule(now=t + 10)) == ["be"]
        else:
            assert decisions == []
    assert s.job("be").preemptions == 2 and s.job("te-2").state is JobState.PENDING


def test_preempt_frees_the_job_counts_its_lost_work_and_requeues_it_to_resume() -> None:
    s = scheduler(te_be_policy())
    s.submit(job("be", 8), now=0)
    s.schedule(now=0)
    s.record_checkpoint("be", now=200)
    record = s.preempt("be", now=250)
    assert record is s.job("be")
    assert (record.state, record.preemptions, record.lost_work_s) == (JobState.PENDING, 1, 50.0)
    assert "be" not in s.running and record.nodes == frozenset() and s.pending_count == 1
    s.submit(job("other", 8), now=260)  # the room is free again, but "be" keeps its earlier place
    assert s.schedule(now=260) == [StartJob("be", {"chief": ("n0",)}, resume=True)]
    assert s.job("other").state is JobState.PENDING


def test_preempt_keeps_the_queue_position_of_the_internal_path() -> None:
    outcomes = {}
    for admin in (False, True):
        s = scheduler(te_be_policy())
        s.submit(job("be", 8), now=0)
        s.schedule(now=0)
        s.submit(job("later", 8), now=10)
        if admin:
            s.preempt("be", now=20)
            s.submit(job("te", 8, te=True), now=20)
            assert started(s.schedule(now=20)) == ["te"]
        else:
            s.submit(job("te", 8, te=True), now=20)
            assert preempted(s.schedule(now=20)) == ["be"]
        s.finish("te", now=30)
        outcomes[admin] = s.schedule(now=30)
    assert outcomes[True] == outcomes[False] == [StartJob("be", {"chief": ("n0",)}, resume=True)]


def test_preempt_counts_toward_the_max_preemptions_cap() -> None:
    s = scheduler(te_be_policy(max_preemptions=2))
    s.submit(job("be", 8), now=0)
    s.schedule(now=0)
    s.preempt("be", now=10)
    assert started(s.schedule(now=10)) == ["be"]
    s.submit(job("te-0", 8, te=True), now=20)
    assert preempted(s.schedule(now=20)) == ["be"]
    s.finish("te-0", now=30)
    assert started(s.schedule(now=30)) == ["be"]
    assert s.job("be").preemptions == 2
    s.submit(job("te-1", 8, te=True), now=40)
    assert s.schedule(now=40) == []  # the cap counts the administrator's preemption
    assert s.job("be").state is JobState.RUNNING


def test_preempt_of_an_unknown_or_waiting_job_fails_clearly() -> None:
    s = a_running_b_pending()
    with pytest.raises(NotFound, match="'nope'"):
        s.preempt("nope", now=1)
    with pytest.raises(FailedPrecondition, match="'b'.*pending"):
        s.preempt("b", now=1)
    s.preempt("a", now=1)
    with pytest.raises(FailedPrecondition, match="pending, not running"):
        s.preempt("a", now=2)
    with pytest.raises(InvalidArgument):
        s.preempt("a", now=0.5)


def test_policy_that_returns_victims_without_room_is_a_bug_reported_as_internal() -> None:
    class UselessVictims(LowestResumeCostPreemption):
        def select_victims(self, job: JobRecord, candidates: Sequence[JobRecord], fits, now: float):
            return candidates[:1]

    policy = SchedulingPolicy(name="bug", queue=ClassPriorityQueue(aging_bound_s=None, backfill=False),
                              preemption=UselessVictims(max_preemptions=None, promoted_protection_s=0),
                              placement=BestFitPlacement())
    s = scheduler(policy)
    running_be_jobs(s, {"a": (4, 10), "b": (4, 10)})
    s.submit(job("te", 8, te=True), now=20)
    with pytest.raises(OpmlError, match="UselessVictims") as raised:
        s.schedule(now=20)
    assert raised.value.code == "INTERNAL"


# -- aging ---------------------------------------------------------------------------------------


def starve_big_job(policy: SchedulingPolicy, until: float) -> Scheduler:
    """One 8-GPU node: a big BE job waits while 4-GPU BE jobs keep overlapping so it is never free."""
    s = scheduler(policy)
    s.submit(job("small-0", 4), now=0)
    s.schedule(now=0)
    s.submit(job("big", 8), now=1)
    s.schedule(now=1)
    t, k = 10.0, 1
    while t < until and s.job("big").state is JobState.PENDING:
        s.submit(job(f"small-{k}", 4), now=t)
        s.schedule(now=t)
        s.finish(f"small-{k - 1}", now=t + 5)
        s.schedule(now=t + 5)
        t, k = t + 10, k + 1
    return s


def test_backfilling_starves_a_big_job_without_the_aging_bound() -> None:
    s = starve_big_job(te_be_plus_policy(aging_bound_s=None), until=2000)
    assert s.job("big").state is JobState.PENDING


def test_aging_bound_promotes_the_job_first_in_line_and_drains_nodes_to_it() -> None:
    s = scheduler(te_be_plus_policy(aging_bound_s=100))
    s.submit(job("small-0", 4), now=0)
    s.schedule(now=0)
    s.submit(job("big", 8), now=1)
    s.schedule(now=1)
    assert s.next_deadline() == 101.0  # first in line since the pass at t=1
    s = starve_big_job(te_be_plus_policy(aging_bound_s=100), until=2000)
    big = s.job("big")
    assert big.state is JobState.RUNNING and big.run_promoted
    # Promoted at the first pass after t=101; nothing else started on its node, so it drained.
    assert big.run_started_at <= 1 + 100 + 10 + 5


def test_a_promoted_job_is_protected_for_a_while_after_it_starts() -> None:
    s = scheduler(te_be_plus_policy(aging_bound_s=100, promoted_protection_s=500))
    s.submit(job("te-running", 8, te=True), now=0)
    s.schedule(now=0)
    s.submit(job("big", 8), now=1)
    s.schedule(now=1)
    assert s.schedule(now=101) == []
    assert s.job("big").promoted
    s.finish("te-running", now=150)
    assert started(s.schedule(now=150)) == ["big"]
    s.submit(job("te", 8, te=True), now=160)
    assert s.schedule(now=160) == []
    assert s.next_deadline() == 650.0
    decisions = s.schedule(now=650)
    assert preempted(decisions) == ["big"] and started(decisions) == ["te"]


def test_waiting_behind_jobs_of_the_same_class_does_not_age_a_job() -> None:
    s = scheduler(te_be_plus_policy(aging_bound_s=100))
    s.submit(job("te-running", 8, te=True), now=0)
    s.schedule(now=0)
    s.submit(job("first", 8), now=1)
    s.submit(job("second", 8), now=2)
    s.schedule(now=2)
    assert s.next_deadline() == 102.0
    assert s.schedule(now=500) == []
    assert s.job("first").promoted and not s.job("second").promoted
    assert s.next_deadline() is None  # one promoted job per class at a time


# -- reports and errors --------------------------------------------------------------------------


def test_reports_about_unknown_or_pending_jobs_fail_clearly() -> None:
    s = a_running_b_pending()
    with pytest.raises(NotFound, match="'nope'"):
        s.finish("nope", now=1)
    with pytest.raises(FailedPrecondition, match="pending"):
        s.record_checkpoint("b", now=1)
    with pytest.raises(InvalidArgument) as raised:
        s.schedule(now=0.5)
    assert raised.value.field == "now"


def test_cancel_drops_a_pending_job_and_frees_a_running_one() -> None:
    s = scheduler(fifo_policy())
    for name in ("a", "b", "c"):
        s.submit(job(name, 8), now=0)
    s.schedule(now=0)
    assert s.cancel("b", now=1).state is JobState.CANCELLED
    assert s.cancel("a", now=2).state is JobState.CANCELLED
    assert s.schedule(now=2) == [StartJob("c", {"chief": ("n0",)}, resume=False)]
    with pytest.raises(NotFound):
        s.job("a")


class CountingPlacement(PlacementPolicy):
    def __init__(self) -> None:
        self.calls = 0
        self._inner = BestFitPlacement()

    def place(self, replicas: Sequence[Replica], free: Mapping[str, Resources]) -> list[str] | None:
        self.calls += 1
        return self._inner.place(replicas, free)


def test_a_pass_over_10000_queued_jobs_tries_each_shape_once() -> None:
    placement = CountingPlacement()
    policy = SchedulingPolicy(name="count", queue=ClassPriorityQueue(aging_bound_s=None, backfill=True),
                              preemption=LowestResumeCostPreemption(max_preemptions=0, promoted_protection_s=0),
                              placement=placement)
    s = scheduler(policy, nodes=4)
    for i in range(10_000):
        s.submit(job(f"j{i}", (3, 5, 6, 7)[i % 4], te=i % 2 == 0), now=0)
    s.schedule(now=0)
    s.finish(next(iter(s.running)), now=1)
    placement.calls = 0
    s.schedule(now=1)
    assert s.pending_count > 9_900
    assert placement.calls <= 8 + 2  # 4 GPU sizes x 2 classes, plus the jobs that started


@pytest.mark.parametrize(("build", "field"), [
    (lambda: te_be_policy(aging_bound_s=-1), "aging_bound_s"),
    (lambda: te_be_policy(max_preemptions=-1), "max_preemptions"),
    (lambda: te_be_plus_policy(gang_patience_s=float("inf")), "gang_patience_s"),
    (lambda: fifo_policy(backfill="yes"), "backfill"),
    (lambda: SchedulingPolicy(name="x", queue=ClassPriorityQueue(aging_bound_s=None, backfill=False),
                              preemption="none", placement=BestFitPlacement()), "preemption"),
])
def test_policy_settings_are_checked_when_built(build, field: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        build()
    assert raised.value.field == field


# -- adopting a run that already goes (after a restart) -------------------------------------------

def test_adopt_counts_a_running_job_where_it_runs_and_it_can_be_preempted_and_finish() -> None:
    s = scheduler(te_be_policy(), nodes=2)
    record = s.adopt(job("be", 8, replicas=2), {"chief": ["n1"], "worker": ["n0"]}, now=10.0)
    assert record.state is JobState.RUNNING and dict(record.placement) == {"chief": ("n1",), "worker": ("n0",)}
    assert s.cluster.total_free.gpu == 0 and list(s.running) == ["be"]
    s.submit(job("waits", 1), now=11.0)
    assert s.schedule(now=11.0) == []  # no room: the adopted job holds both nodes
    s.submit(job("te", 8, te=True), now=12.0)
    decisions = s.schedule(now=12.0)
    assert preempted(decisions) == ["be"] and started(decisions) == ["te", "waits"]
    assert decisions[0].lost_work_s == 2.0  # progress since it was adopted: nothing older is known
    s.finish("te", now=13.0)
    s.finish("waits", now=13.0)
    (resumed,) = s.schedule(now=13.0)
    assert (resumed.job_id, resumed.resume) == ("be", True)


def test_adopt_errors() -> None:
    s = scheduler(te_be_policy(), nodes=1)
    with pytest.raises(InvalidArgument, match=r"^placement: "):
        s.adopt(job("a", 1, replicas=2), {"chief": ["n0"]}, now=0)
    with pytest.raises(InvalidArgument, match=r"^placement.worker: .*one node per replica"):
        s.adopt(job("a", 1, replicas=3), {"chief": ["n0"], "worker": ["n0"]}, now=0)
    with pytest.raises(InvalidArgument, match=r"^placement.chief: .*'gone'"):
        s.adopt(job("a", 1), {"chief": ["gone"]}, now=0)
    with pytest.raises(InvalidArgument, match=r"^roles.chief.resources.gpu: "):
        s.adopt(job("a", 16), {"chief": ["n0"]}, now=0)
    s.adopt(job("a", 6), {"chief": ["n0"]}, now=0)
    with pytest.raises(AlreadyExists):
        s.adopt(job("a", 1), {"chief": ["n0"]}, now=0)
    with pytest.raises(FailedPrecondition, match="n0"):
        s.adopt(job("b", 4), {"chief": ["n0"]}, now=0)
    assert list(s.running) == ["a"] and s.cluster.free["n0"].gpu == 2  # a failed adopt holds nothing
