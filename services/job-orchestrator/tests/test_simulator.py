"""The simulator drives the real scheduler in virtual time: exact on small cases, reproducible per seed."""

from __future__ import annotations

import pytest

from opml_common.errors import InvalidArgument
from opml_job_orchestrator.scheduler import (
    JobClass,
    JobSpec,
    NodeSpec,
    Resources,
    RoleSpec,
    fifo_policy,
    te_be_plus_policy,
    te_be_policy,
)
from opml_job_orchestrator.simulator import (
    PAPER_CHANGES,
    RunSummary,
    SimJob,
    WorkloadConfig,
    compare,
    format_table,
    generate_workload,
    percentile,
    simulate,
    summarize,
)

NODE = NodeSpec("n0", Resources(cpu_millis=64_000, memory_mib=512 * 1024, gpu=8))
SMALL = WorkloadConfig(nodes=8, num_jobs=1500, load=0.85, warmup_fraction=0.1)


def sim_job(job_id: str, submit: float, duration: float, *, te: bool, checkpoint_s: float | None = None,
            overhead_s: float = 0.0) -> SimJob:
    spec = JobSpec(job_id=job_id, job_class=JobClass.TE if te else JobClass.BE,
                   roles={"chief": RoleSpec(1, Resources(cpu_millis=8_000, memory_mib=8_192, gpu=8))},
                   checkpoint_interval_s=checkpoint_s, restart_overhead_s=overhead_s)
    return SimJob(spec, submit, duration, measured=True)


def test_preempted_job_loses_the_work_since_its_checkpoint_and_resumes_after_its_overhead() -> None:
    jobs = [sim_job("be", 0, 1000, te=False, checkpoint_s=100, overhead_s=30), sim_job("te", 250, 50, te=True)]
    result = simulate(jobs, [NODE], te_be_policy())
    be, te = sorted(result.outcomes, key=lambda o: o.job_class.value)
    # BE: checkpoint at 200, stopped at 250 (50 s lost), resumes at 300, restores for 30 s, then
    # redoes 800 s of work from its checkpoint.
    assert (be.preemptions, be.lost_work_s, be.finish_time) == (1, 50.0, 1130.0)
    assert (te.first_start_time, te.finish_time, te.slowdown) == (250.0, 300.0, 1.0)
    assert result.decisions == 4  # start be, preempt be, start te, resume be


def test_a_job_without_checkpoints_restarts_from_zero() -> None:
    jobs = [sim_job("be", 0, 1000, te=False, checkpoint_s=None), sim_job("te", 400, 100, te=True)]
    be = next(o for o in simulate(jobs, [NODE], te_be_policy()).outcomes if o.job_id == "be")
    assert (be.lost_work_s, be.finish_time) == (400.0, 1500.0)


def test_fifo_makes_the_te_job_wait() -> None:
    jobs = [sim_job("be", 0, 1000, te=False, checkpoint_s=100), sim_job("te", 250, 50, te=True)]
    te = next(o for o in simulate(jobs, [NODE], fifo_policy()).outcomes if o.job_id == "te")
    assert (te.first_start_time, te.slowdown) == (1000.0, 16.0)


def test_workload_and_simulation_are_deterministic_per_seed() -> None:
    first, again, other = (generate_workload(SMALL, seed) for seed in (7, 7, 8))
    assert first == again and first != other
    runs = [simulate(first, SMALL.node_specs(), te_be_plus_policy()) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(runs[0].outcomes) == SMALL.num_jobs


def test_workload_offers_the_configured_load_and_mix() -> None:
    config = WorkloadConfig(num_jobs=20_000, load=0.8, te_load_share=0.25)
    jobs = generate_workload(config, 1)
    span = jobs[-1].submit_time - jobs[0].submit_time
    gpu_seconds = {c: sum(j.duration_s * j.spec.total.gpu for j in jobs if j.spec.job_class is c) for c in JobClass}
    offered = sum(gpu_seconds.values()) / (span * config.total_gpus)
    assert offered == pytest.approx(0.8, rel=0.15)
    assert gpu_seconds[JobClass.TE] / sum(gpu_seconds.values()) == pytest.approx(0.25, rel=0.15)
    te_jobs = [j for j in jobs if j.spec.job_class is JobClass.TE]
    assert len(te_jobs) > 10 * (len(jobs) - len(te_jobs))  # short and frequent
    assert all(not j.measured for j in jobs[:2000]) and all(j.measured for j in jobs[2000:])


def test_invalid_workload_config_names_the_field() -> None:
    with pytest.raises(InvalidArgument) as raised:
        WorkloadConfig(te_duration_s=(600.0, 60.0))
    assert raised.value.field == "te_duration_s"


def test_te_be_policies_cut_te_tail_slowdown_against_fifo_on_a_small_workload() -> None:
    jobs = generate_workload(SMALL, 3)
    summaries = [summarize(simulate(jobs, SMALL.node_specs(), policy), seed=3)
                 for policy in (fifo_policy(), te_be_policy(), te_be_plus_policy())]
    fifo, te_be, te_be_plus = summaries
    assert fifo.te_p95 > 5
    assert te_be.te_p95 < 0.2 * fifo.te_p95
    assert te_be_plus.te_p95 < 0.2 * fifo.te_p95
    assert te_be_plus.be_p50 < 1.18 * fifo.be_p50


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_compare_reports_per_seed_changes_against_the_baseline() -> None:
    def run(policy: str, seed: int, te_p95: float, be_p50: float) -> RunSummary:
        return RunSummary(policy, seed, 1.0, te_p95, be_p50, 2 * be_p50, preemptions=0, lost_gpu_hours=0.0)

    rows = compare([run("fifo", 0, 100, 1.0), run("fifo", 1, 50, 2.0),
                    run("te-be", 0, 2, 1.2), run("te-be", 1, 1, 2.2)])
    te_be = rows[1]
    assert te_be.change_pct["te_p95"].mean == pytest.approx(-98.0)
    assert te_be.change_pct["be_p50"].mean == pytest.approx(15.0)
    assert te_be.metrics["te_p95"].mean == pytest.approx(1.5)
    table = format_table(rows)
    assert "-98.0% ± 0.0" in table and f"{PAPER_CHANGES['te_p95']:+.1f}%" in table
    with pytest.raises(ValueError, match="seeds"):
        compare([run("fifo", 0, 1, 1), run("te-be", 1, 1, 1)])
