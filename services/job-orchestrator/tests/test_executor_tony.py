"""TonY's rules as every executor applies them (RunTracker, awaited tasks, task env): pure logic."""

from __future__ import annotations

import json

from opml_job_orchestrator.executor import JobOutcome, JobProgram, TaskState
from opml_job_orchestrator.executor.tony import RunTracker, awaited_tasks, task_env


def test_awaited_tasks_are_the_chief_else_the_workers_else_all_but_ps() -> None:
    assert awaited_tasks([("chief", 0), ("worker", 0), ("ps", 0)]) == {("chief", 0)}
    assert awaited_tasks([("worker", 0), ("worker", 1), ("ps", 0)]) == {("worker", 0), ("worker", 1)}
    assert awaited_tasks([("evaluator", 0), ("ps", 0)]) == {("evaluator", 0)}


def test_the_run_succeeds_when_every_awaited_task_exited_0_and_later_ends_are_stopped() -> None:
    tracker = RunTracker("j", 2, [("worker", 0), ("worker", 1), ("ps", 0)],
                         awaited_tasks([("worker", 0), ("worker", 1), ("ps", 0)]))
    for key in tracker.states:
        assert tracker.started(key).state is TaskState.RUNNING
    event, verdict = tracker.exited(("worker", 0), 0, how="exited with code 0")
    assert event.state is TaskState.SUCCEEDED and verdict is None  # worker 1 still runs
    event, verdict = tracker.exited(("worker", 1), 0, how="exited with code 0")
    assert verdict is not None and verdict.outcome is JobOutcome.SUCCEEDED and not verdict.retriable
    assert verdict.message == "worker 0, worker 1 exited with code 0"
    assert tracker.decide(verdict) and not tracker.decide(verdict)  # decided once
    assert tracker.running() == [("ps", 0)]
    event, verdict = tracker.exited(("ps", 0), -15, how="was killed by signal SIGTERM")
    assert (event.state, event.exit_code, event.attempt, verdict) == (TaskState.STOPPED, -15, 2, None)


def test_a_failure_or_a_loss_fails_the_run_retriably_and_a_start_failure_does_not() -> None:
    tracker = RunTracker("j", 0, [("chief", 0), ("worker", 0)], [("chief", 0)])
    tracker.started(("chief", 0))
    event, verdict = tracker.exited(("worker", 0), 3, how="exited with code 3")
    assert event.state is TaskState.FAILED and verdict.message == "worker 0 exited with code 3" and verdict.retriable
    event, verdict = tracker.lost(("chief", 0), "chief 0 sent no heartbeat")
    assert event.state is TaskState.LOST and verdict.retriable
    assert tracker.exited(("chief", 0), -9, how="killed") == (None, None)  # its end was reported as LOST
    _, verdict = RunTracker("j", 0, [("worker", 0)], [("worker", 0)]).could_not_start(("worker", 0), "no such file")
    assert verdict.outcome is JobOutcome.FAILED and not verdict.retriable


def test_task_env_names_the_task_and_its_cluster() -> None:
    program = JobProgram(commands={"worker": ["x"]}, env={"A": "1", "OPML_JOB_ID": "overridden"}, checkpoint_dir="/c")
    env = task_env(program, job_id="j", attempt=1, role="worker", index=1, cluster={"worker": ["h:1", "h:2"]})
    assert json.loads(env.pop("TF_CONFIG")) == {"cluster": {"worker": ["h:1", "h:2"]},
                                                "task": {"type": "worker", "index": 1}}
    assert env == {"A": "1", "OPML_JOB_ID": "j", "OPML_JOB_ATTEMPT": "1", "OPML_TASK_TYPE": "worker",
                   "OPML_TASK_INDEX": "1", "OPML_CHECKPOINT_DIR": "/c"}
