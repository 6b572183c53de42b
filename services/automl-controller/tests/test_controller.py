"""The controller core against a scripted orchestrator (a fake of pure logic: jobs whose logs are a
function of their parameters) and the machine's real Redis (the Optuna journal and the records)."""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
import yaml
from opml.jobs.v1 import jobs_pb2

from opml_automl_controller import controller as controller_module
from opml_automl_controller.controller import Controller
from opml_automl_controller.jobs import JobView, TrialJobs
from opml_automl_controller.metrics import ControllerMetrics
from opml_automl_controller.models import ModelStore, TrialUpload
from opml_automl_controller.state import ExperimentRecord, ExperimentState, ExperimentStore, TrialState
from opml_automl_controller.study import ExperimentStudy
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from opml_common.events import RecordingEmitter
from opml_devstack.testing.bus import wait_until

REDIS = "redis://127.0.0.1:6379/0"


def experiment(name: str, *, max_trials: int = 6, parallel: int = 3, goal: float | None = None,
               algorithm: str = "random", early: dict | None = None, max_failed: int = 3,
               resume: str = "Never", collector: dict | None = None, model: dict | None = None) -> str:
    doc = {
        "apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": name},
        "spec": {
            "objective": {"type": "minimize", "objectiveMetricName": "loss", **({"goal": goal} if goal else {})},
            "algorithm": {"algorithmName": algorithm, "algorithmSettings": [{"name": "random_state", "value": "7"}]},
            "parallelTrialCount": parallel, "maxTrialCount": max_trials, "maxFailedTrialCount": max_failed,
            "resumePolicy": resume,
            "parameters": [{"name": "x", "parameterType": "double", "feasibleSpace": {"min": "-2", "max": "2"}}],
            "trialTemplate": {
                "primaryContainerName": "main",
                "trialParameters": [{"name": "x", "reference": "x"}],
                "trialSpec": {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
                    "containers": [{"name": "main", "image": "python:3.11",
                                    "command": ["python", "train.py", "--x=${trialParameters.x}"]}]}}}},
            },
        },
    }
    if early:
        doc["spec"]["earlyStopping"] = early
    if collector:
        doc["spec"]["metricsCollectorSpec"] = collector
    if model is not None:
        doc["spec"]["model"] = model
    return yaml.safe_dump(doc)


class ScriptedJobs(TrialJobs):
    """Jobs whose log is ``script(x)`` (a list of lines); a job "runs" while its gate is closed
    (``hold``), and ends succeeded (or failed, when the script says ``FAIL``) once released."""

    def __init__(self, script: Callable[[float, int], list[str]], *, hold: bool = False) -> None:
        self.script = script
        self.submitted: list[str] = []
        self.cancelled: list[str] = []
        self.states: dict[str, str] = {}
        self.specs: dict[str, jobs_pb2.JobSpec] = {}
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self.lock = threading.Lock()
        self.running = threading.Semaphore(0)

    def ensure(self, spec: jobs_pb2.JobSpec) -> JobView:
        with self.lock:
            if spec.name not in self.states:
                self.submitted.append(spec.name)
                self.states[spec.name] = "running"
                self.specs[spec.name] = spec
                self.running.release()
            return JobView(spec.name, self.states[spec.name])

    def get(self, job_id: str) -> JobView:
        if job_id not in self.states:
            raise NotFound(job_id)
        return JobView(job_id, self.states[job_id], "exit code 1" if self.states[job_id] == "failed" else "")

    def cancel(self, job_id: str) -> JobView:
        with self.lock:
            if self.states[job_id] == "running":
                self.states[job_id] = "cancelled"
                self.cancelled.append(job_id)
        return self.get(job_id)

    def _x(self, job_id: str) -> float:
        argv = list(self.specs[job_id].roles["worker"].command)
        return float(next(a for a in argv if a.startswith("--x=")).split("=", 1)[1])

    def follow(self, job_id: str) -> Iterator[str]:
        lines = self.script(self._x(job_id), int(job_id.rsplit("-t", 1)[1]))
        for index, line in enumerate(lines):
            if line == "HOLD":  # until cancelled
                while self.states[job_id] == "running":
                    self.gate.wait(0.02)
                return
            if line == "FAIL":
                with self.lock:
                    self.states[job_id] = "failed"
                return
            if index == len(lines) - 1:
                while not self.gate.wait(0.02):
                    if self.states[job_id] == "cancelled":
                        return
            if self.states[job_id] == "cancelled":
                return
            yield line + "\n"  # a job that ended replays its whole log, as the orchestrator's does
        with self.lock:
            if self.states[job_id] == "running":
                self.states[job_id] = "succeeded"


class FedJobs(ScriptedJobs):
    """Jobs whose log is what the test puts in ``lines`` (None ends it); ``dropped`` is set once a
    follower lets go of a stream before its end."""

    def __init__(self) -> None:
        super().__init__(lambda x, n: [])
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.following = threading.Semaphore(0)
        self.dropped = threading.Event()

    def follow(self, job_id: str) -> Iterator[str]:
        self.following.release()
        try:
            while (line := self.lines.get()) is not None:
                yield line
        except GeneratorExit:
            self.dropped.set()
            raise


@pytest.fixture
async def store():
    client = aioredis.from_url(REDIS)
    prefix = f"opml-test:automl-{uuid.uuid4().hex[:8]}:"
    yield ExperimentStore(client, prefix=prefix)
    keys = [k async for k in client.scan_iter(match=prefix + "*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def controller(store: ExperimentStore, jobs: TrialJobs) -> Controller:
    return Controller(store=store, jobs=jobs, emitter=RecordingEmitter(), redis_url=REDIS, retry_s=0.05)


async def until_ended(ctl: Controller, name: str) -> None:
    while (await ctl.get(name)).record.state is ExperimentState.RUNNING:
        await asyncio.sleep(0.05)


def quadratic(x: float, number: int) -> list[str]:
    return [f"epoch {i}: loss={(x - 0.5) ** 2 + 1 / (i + 1):.6f}" for i in range(3)]


async def test_runs_exactly_max_trials_with_parallel_jobs(store: ExperimentStore) -> None:
    jobs = ScriptedJobs(quadratic)
    ctl = controller(store, jobs)
    await ctl.start()
    await ctl.create(experiment("quad", max_trials=7))
    await asyncio.wait_for(until_ended(ctl, "quad"), 60)
    view = await ctl.get("quad")
    assert view.record.state is ExperimentState.SUCCEEDED and view.record.reason == "MaxTrialsReached"
    assert len(view.trials) == 7 and len(set(jobs.submitted)) == len(jobs.submitted) == 7
    assert all(t.state is TrialState.SUCCEEDED for t in view.trials)
    best = view.best()
    assert best is not None
    # the objective of a trial is the min of its series (minimize): the last epoch's
    x = float(best.parameters["x"])
    assert best.objective_value == pytest.approx((x - 0.5) ** 2 + 1 / 3, abs=1e-5)
    assert best.objective_value == min(t.objective_value for t in view.trials)
    await ctl.stop()


async def test_goal_reached_ends_the_experiment_early(store: ExperimentStore) -> None:
    jobs = ScriptedJobs(lambda x, n: ["loss=0.001"])
    ctl = controller(store, jobs)
    await ctl.start()
    await ctl.create(experiment("goal", max_trials=12, parallel=1, goal=0.01))
    await asyncio.wait_for(until_ended(ctl, "goal"), 60)
    view = await ctl.get("goal")
    assert view.record.reason == "GoalReached" and view.record.state is ExperimentState.SUCCEEDED
    assert len(view.trials) == 1
    await ctl.stop()


async def test_failed_jobs_fail_the_experiment_past_max_failed(store: ExperimentStore) -> None:
    jobs = ScriptedJobs(lambda x, n: ["FAIL"])
    ctl = controller(store, jobs)
    await ctl.start()
    await ctl.create(experiment("fails", max_trials=8, parallel=1, max_failed=2))
    await asyncio.wait_for(until_ended(ctl, "fails"), 60)
    view = await ctl.get("fails")
    assert view.record.state is ExperimentState.FAILED and view.record.reason == "MaxFailedTrialsReached"
    assert len(view.trials) == 3  # Katib: failed > maxFailedTrialCount
    assert all(t.state is TrialState.FAILED and "job failed: exit code 1" in t.message for t in view.trials)
    assert "exit code 1" in view.record.message
    await ctl.stop()


async def test_metrics_unavailable_fails_the_trial(store: ExperimentStore) -> None:
    jobs = ScriptedJobs(lambda x, n: ["accuracy=0.9"])
    ctl = controller(store, jobs)
    await ctl.start()
    await ctl.create(experiment("nometric", max_trials=1, parallel=1, max_failed=1))
    await asyncio.wait_for(until_ended(ctl, "nometric"), 60)
    (trial,) = (await ctl.get("nometric")).trials
    assert trial.state is TrialState.FAILED and trial.message.startswith("MetricsUnavailable")
    await ctl.stop()


async def test_median_stop_cancels_bad_trials_jobs(store: ExperimentStore) -> None:
    # trials 0 and 1 are good; later ones with x > 0 are much worse and would run until cancelled:
    # with 2 completed trials the median rule stops them at step 2 (start_step), their jobs cancelled
    def script(x: float, number: int) -> list[str]:
        if number >= 2 and x > 0:
            return ["loss=10", "loss=11", "HOLD", "loss=12"]
        return [f"loss={1.0 / (i + 1)}" for i in range(6)]
    jobs = ScriptedJobs(script)
    ctl = controller(store, jobs)
    await ctl.start()
    early = {"algorithmName": "medianstop", "algorithmSettings": [{"name": "min_trials_required", "value": "2"},
                                                                   {"name": "start_step", "value": "2"}]}
    await ctl.create(experiment("median", max_trials=12, parallel=1, early=early))
    await asyncio.wait_for(until_ended(ctl, "median"), 60)
    trials = (await ctl.get("median")).trials
    stopped = [t for t in trials if t.state is TrialState.EARLY_STOPPED]
    good = [t for t in trials if t.state is TrialState.SUCCEEDED]
    assert len(good) >= 2 and stopped, [(t.parameters, t.state) for t in trials]
    assert all(float(t.parameters["x"]) > 0 for t in stopped)
    assert sorted(t.job_id for t in stopped) == sorted(jobs.cancelled)
    assert all(len(t.observations["loss"]) == 2 for t in stopped)
    await ctl.stop()


async def test_restart_finishes_with_no_trial_repeated_or_lost(store: ExperimentStore) -> None:
    jobs = ScriptedJobs(quadratic, hold=True)
    first = controller(store, jobs)
    await first.start()
    await first.create(experiment("restart", max_trials=6, parallel=3))
    for _ in range(3):
        await asyncio.to_thread(jobs.running.acquire)  # three jobs submitted and running
    await first.stop()  # as a kill: no trial is told; their jobs go on
    second = controller(store, jobs)
    await second.start()
    jobs.gate.set()
    await asyncio.wait_for(until_ended(second, "restart"), 60)
    view = await second.get("restart")
    assert view.record.reason == "MaxTrialsReached" and len(view.trials) == 6
    assert len(jobs.submitted) == len(set(jobs.submitted)) == 6
    assert sorted(t.number for t in view.trials) == list(range(6))
    assert all(t.state is TrialState.SUCCEEDED for t in view.trials)
    assert len({t.parameters["x"] for t in view.trials}) == 6, "the re-seeded sampler repeats no value"
    await second.stop()


async def test_a_leader_that_loses_its_lease_stops_its_loops_and_resumes_them_when_it_leads_again(
        store: ExperimentStore) -> None:
    from opml_common.lease import LeaderLease

    client, prefix = store._redis, store._prefix.removesuffix("automl:")
    changes: asyncio.Queue[bool] = asyncio.Queue()
    fenced = ExperimentStore(client, prefix=prefix, fence=lambda: lease.fence)
    jobs = ScriptedJobs(quadratic, hold=True)
    ctl = Controller(store=fenced, jobs=jobs, emitter=RecordingEmitter(), redis_url=REDIS, retry_s=0.05)

    def changed(leading: bool) -> None:
        ctl.leadership_changed(leading)
        changes.put_nowait(leading)

    lease = LeaderLease(client, "automl-controller", "a", prefix=prefix, ttl_s=0.6, on_change=changed)
    ctl._lease = lease
    async with lease, ctl:
        assert await changes.get() is True
        await ctl.create(experiment("handover", max_trials=6, parallel=3))
        for _ in range(3):
            await asyncio.to_thread(jobs.running.acquire)  # three trials' jobs running
        key = f"{prefix}lease:automl-controller"
        await client.set(key, "another-replica:0", px=60_000)  # taken by another (as after an expiry)
        assert await changes.get() is False
        await wait_until(lambda: not ctl._runs, what="every loop stopped once the lease is lost")
        assert jobs.cancelled == []  # the trials' jobs go on
        await client.delete(key)  # the other replica is gone
        assert await changes.get() is True  # taken again with a new tenure, and the loops run again
        jobs.gate.set()
        await asyncio.wait_for(until_ended(ctl, "handover"), 60)
    view = await store.experiment("handover"), await store.trials("handover")
    assert view[0].reason == "MaxTrialsReached" and [t.number for t in view[1]] == list(range(6))
    assert all(t.state is TrialState.SUCCEEDED for t in view[1]) and jobs.cancelled == []
    assert sorted(jobs.submitted) == sorted(t.job_id for t in view[1])  # the running ones re-attached, not resubmitted


class SaveOfAnEndFailsOnce(ExperimentStore):
    """The real store, but the first save of an ended trial fails, as when Redis drops the
    connection between Optuna's tell and the record's save."""

    failed = False

    async def put_trial(self, trial) -> None:
        if trial.state is TrialState.SUCCEEDED and not self.failed:
            self.failed = True
            raise ConnectionError("connection lost")
        await super().put_trial(trial)


async def test_a_trial_told_but_not_saved_keeps_its_objective_series(store: ExperimentStore) -> None:
    failing = SaveOfAnEndFailsOnce(store._redis, prefix=store._prefix.removesuffix("automl:"))
    jobs = ScriptedJobs(quadratic)
    ctl = controller(failing, jobs)
    await ctl.start()
    await ctl.create(experiment("untold", max_trials=1, parallel=1, max_failed=0))
    await asyncio.wait_for(until_ended(ctl, "untold"), 60)
    [trial] = (await ctl.get("untold")).trials
    x = float(trial.parameters["x"])
    assert failing.failed and trial.state is TrialState.SUCCEEDED
    assert trial.observations["loss"] == pytest.approx([(x - 0.5) ** 2 + 1 / (i + 1) for i in range(3)], abs=1e-5)
    assert trial.objective_value == pytest.approx(min(trial.observations["loss"]))
    await ctl.stop()


async def test_an_ended_trial_record_is_not_overwritten_by_a_stale_one(store: ExperimentStore) -> None:
    from opml_automl_controller.state import TrialRecord

    await store.put_experiment(ExperimentRecord(name="e", uid="abcdef", katib_yaml="", max_trial_count=2), new=True)
    running = TrialRecord(experiment="e", number=0, parameters={"x": "1"}, job_id="e-abcdef-t0",
                          state=TrialState.RUNNING)
    assert await store.put_trial_unless_ended(running) is running
    ended = TrialRecord(experiment="e", number=0, parameters={"x": "1"}, job_id="e-abcdef-t0",
                        state=TrialState.SUCCEEDED, observations={"loss": [2.0, 1.0]}, objective_value=1.0)
    await store.put_trial(ended)
    stale = TrialRecord(experiment="e", number=0, parameters={"x": "1"}, job_id="e-abcdef-t0",
                        state=TrialState.SUCCEEDED, objective_value=1.0)
    assert await store.put_trial_unless_ended(stale) == ended
    assert await store.trial("e", 0) == ended
    diverged = TrialRecord(experiment="e", number=1, parameters={"x": "9"}, job_id="e-abcdef-t1",
                           state=TrialState.FAILED, observations={"loss": [float("nan")]})
    await store.put_trial(diverged)  # a diverging Keras fit logs loss nan: the record's JSON holds NaN
    assert (await store.put_trial_unless_ended(replace(diverged, message="stale"))).message == ""


async def test_a_deposed_leaders_trial_and_loop_writes_are_refused_and_api_changes_never_lost(store) -> None:
    """Replicas share the store: the leader's writes are fenced (a deposed leader's are refused while
    it still believes it leads), a trial is never written for a deleted experiment, and an API change
    on another replica and the loop's change meet by compare-and-set, neither lost."""
    from opml_automl_controller.state import TrialRecord
    from opml_common.lease import LeaderLease, NotLeader

    client, prefix = store._redis, store._prefix.removesuffix("automl:")
    old = LeaderLease(client, "automl-controller", "old", prefix=prefix, ttl_s=30)
    new = LeaderLease(client, "automl-controller", "new", prefix=prefix, ttl_s=30)
    deposed = ExperimentStore(client, prefix=prefix, fence=lambda: old.fence)
    leader = ExperimentStore(client, prefix=prefix, fence=lambda: new.fence)
    follower = ExperimentStore(client, prefix=prefix, fence=lambda: new.fence)  # its API writes are not fenced
    await store.put_experiment(ExperimentRecord(name="e", uid="abcdef", katib_yaml="", max_trial_count=2), new=True)
    trial = TrialRecord(experiment="e", number=0, parameters={"x": "1"}, job_id="e-abcdef-t0")
    async with old:
        await old.wait_leading()
        await deposed.put_trial(trial)
        await client.delete(f"{prefix}lease:automl-controller")  # its lease expired while it stalled
        async with new:
            await new.wait_leading()
            assert old.leading  # by its own clock
            with pytest.raises(NotLeader):
                await deposed.put_trial(replace(trial, state=TrialState.RUNNING))
            with pytest.raises(NotLeader):
                await deposed.change_experiment("e", lambda r: r.changed(reason="Running"), fenced=True)
            await leader.put_trial(replace(trial, state=TrialState.SUCCEEDED))

            def loop_change(record: ExperimentRecord) -> ExperimentRecord | None:
                return record.changed(reason="Running") if record.state is ExperimentState.RUNNING else None

            await follower.change_experiment("e", lambda r: r.changed(state=ExperimentState.STOPPED))
            assert (await leader.change_experiment("e", loop_change, fenced=True))[1] is False  # it sees the stop
            assert (await store.experiment("e")).state is ExperimentState.STOPPED
            await store.delete(await store.experiment("e"))
            with pytest.raises(NotFound, match="deleted"):
                await leader.put_trial(replace(trial, number=1, job_id="e-abcdef-t1"))
    assert await store.trials("e") == []


async def test_a_change_that_races_another_writer_is_made_again_on_the_new_record(store) -> None:
    await store.put_experiment(ExperimentRecord(name="r", uid="abcdef", katib_yaml="", max_trial_count=2), new=True)
    seen: list[int] = []

    def bump(record: ExperimentRecord) -> ExperimentRecord:
        seen.append(record.max_trial_count)
        return record.changed(max_trial_count=record.max_trial_count + 1)

    async def racing(record: ExperimentRecord) -> None:
        await store.put_experiment(record.changed(max_trial_count=10))  # another replica, after our read

    original = store._redis.pipeline

    def pipeline(*args, **kwargs):
        pipe = original(*args, **kwargs)
        get = pipe.get

        async def get_then_race(key):
            raw = await get(key)
            if not seen and key.endswith(b"experiment:r" if isinstance(key, bytes) else "experiment:r"):
                await racing(ExperimentRecord.from_json(raw))
            return raw

        pipe.get = get_then_race
        return pipe

    store._redis.pipeline = pipeline
    try:
        record, changed = await store.change_experiment("r", bump)
    finally:
        store._redis.pipeline = original
    assert changed and seen == [2, 10] and record.max_trial_count == 11
    assert (await store.experiment("r")).max_trial_count == 11


async def test_stop_kills_running_trials_and_resume_continues(store: ExperimentStore) -> None:
    jobs = ScriptedJobs(quadratic, hold=True)
    ctl = controller(store, jobs)
    await ctl.start()
    await ctl.create(experiment("stopme", max_trials=4, parallel=2))
    for _ in range(2):
        await asyncio.to_thread(jobs.running.acquire)
    await ctl.stop_experiment("stopme")
    while any(t.state is TrialState.RUNNING for t in (await ctl.get("stopme")).trials):
        await asyncio.sleep(0.05)
    view = await ctl.get("stopme")
    assert view.record.state is ExperimentState.STOPPED
    assert [t.state for t in view.trials] == [TrialState.KILLED, TrialState.KILLED]
    assert sorted(jobs.cancelled) == sorted(t.job_id for t in view.trials)
    with pytest.raises(FailedPrecondition):
        await ctl.stop_experiment("stopme")
    jobs.gate.set()
    await ctl.resume("stopme")
    await asyncio.wait_for(until_ended(ctl, "stopme"), 60)
    view = await ctl.get("stopme")
    assert view.record.reason == "MaxTrialsReached" and len(view.trials) == 4
    await ctl.stop()


async def test_resume_policy(store: ExperimentStore) -> None:
    jobs = ScriptedJobs(quadratic)
    ctl = controller(store, jobs)
    await ctl.start()
    await ctl.create(experiment("never", max_trials=2, parallel=2, max_failed=1))
    await ctl.create(experiment("long", max_trials=2, parallel=2, max_failed=1, resume="LongRunning"))
    await asyncio.wait_for(until_ended(ctl, "never"), 60)
    await asyncio.wait_for(until_ended(ctl, "long"), 60)
    with pytest.raises(FailedPrecondition, match="resumePolicy Never"):
        await ctl.resume("never", 4)
    await ctl.resume("long", 4)
    await asyncio.wait_for(until_ended(ctl, "long"), 60)
    view = await ctl.get("long")
    assert len(view.trials) == 4 and view.record.max_trial_count == 4
    await ctl.delete("long")
    with pytest.raises(NotFound):
        await ctl.get("long")
    await ctl.stop()


async def test_file_collector_wraps_the_command(store: ExperimentStore) -> None:
    ctl = controller(store, ScriptedJobs(quadratic))
    spec = ctl.validate(experiment("file", collector={
        "collector": {"kind": "File"}, "source": {"fileSystemPath": {"path": "/tmp/m.log", "kind": "File"}}}))
    argv = list(spec.trial_job.spec.roles["worker"].command)
    assert argv[1:5] == ["-m", "opml_automl_controller.filetail", "/tmp/m.log", "--"]
    assert argv[5:] == ["python", "train.py", "--x=-2.0"]


async def test_validate_warns_of_a_field_katib_does_not_have(store: ExperimentStore) -> None:
    doc = yaml.safe_load(experiment("typo"))
    doc["spec"]["paralelTrialCount"] = 1
    checked = controller(store, ScriptedJobs(quadratic)).validate(yaml.safe_dump(doc))
    assert checked.warnings == ("spec.paralelTrialCount: unknown field, ignored (did you mean parallelTrialCount?)",)
    assert checked.spec.parallel_trial_count == 3


async def test_trace_collector_feeds_trials_from_tracer_events(store: ExperimentStore) -> None:
    """Trace kind: the job runs traced; only the tracer events of a running trial's primary task count
    (others are ignored, a forged source is refused); after the job succeeded the trial waits for its
    tracer's TracerStopped, so the last epoch (sent at exit) is in its value."""
    from opml.traces.v1 import events_pb2 as tpb

    from opml_automl_controller.controller import spec_of
    from opml_automl_controller.tracing import SourceMismatch, TraceCollector
    from opml_common.bus import CloudEvent
    from opml_trace_collector_contract.topics import tracer_source

    jobs = ScriptedJobs(lambda x, n: ["no metric in the log: loss=99"], hold=True)
    ctl = Controller(store=store, jobs=jobs, emitter=RecordingEmitter(), redis_url=REDIS, retry_s=0.05,
                     trace_wait_s=30)
    collector = TraceCollector(store, spec_of=spec_of, wake=ctl.wake_trace)
    await ctl.start()
    await ctl.create(experiment("traced", max_trials=2, parallel=2, max_failed=0, collector={"collector": {"kind": "Trace"}}))
    for _ in range(2):
        await asyncio.to_thread(jobs.running.acquire)

    def event(message, job: str, worker: str = "worker-0", source: str | None = None) -> CloudEvent:
        return CloudEvent.from_proto(message, source=source or tracer_source(job, worker), subject=f"{job}/{worker}")

    def batch(job: str, worker: str, *losses: tuple[int, float]) -> tpb.StepMetricsBatch:
        return tpb.StepMetricsBatch(job=job, worker=worker, session_id="s1", epochs=[
            tpb.EpochLog(epoch=e, logs={"loss": v, "accuracy": 0.5}) for e, v in losses])

    for job in jobs.submitted:
        spec = jobs.specs[job]
        assert spec.trace and spec.env["OPML_TRACE_EXIT_TIMEOUT_S"] == "30"
        await collector.handle(event(tpb.TracerStarted(job=job, worker="worker-0", session_id="s1"), job))
        await collector.handle(event(batch(job, "worker-0", (0, 3.0), (1, 2.0)), job))
        await collector.handle(event(batch(job, "worker-0", (1, 2.0)), job))  # redelivered: counted once
        await collector.handle(event(batch(job, "worker-1", (2, -5.0)), job, "worker-1"))  # not the primary task
        with pytest.raises(SourceMismatch):
            await collector.handle(event(batch(job, "worker-0", (2, -7.0)), job, source=tracer_source("x", "y")))
    await collector.handle(event(batch("other-abcdef-t0", "worker-0", (0, 1.0)), "other-abcdef-t0"))  # no trial
    jobs.gate.set()  # the jobs succeed; their last epoch and TracerStopped come after
    for job in jobs.submitted:
        await collector.handle(event(batch(job, "worker-0", (2, 1.5)), job))
        await collector.handle(event(tpb.TracerStopped(job=job, worker="worker-0", session_id="s1"), job))
    await asyncio.wait_for(until_ended(ctl, "traced"), 60)
    view = await ctl.get("traced")
    assert view.record.reason == "MaxTrialsReached", view.record
    for trial in view.trials:
        assert trial.state is TrialState.SUCCEEDED, trial
        assert trial.observations["loss"] == [3.0, 2.0, 1.5] and trial.objective_value == 1.5
    late = view.trials[0].job_id  # the trial has ended: its events change nothing
    await collector.handle(event(batch(late, "worker-0", (3, 0.1)), late))
    assert (await store.trace("traced", 0)).epochs.keys() == {(0, 0), (0, 1), (0, 2)}
    await ctl.stop()


async def test_trace_epochs_stored_before_a_restart_count_after_it(store: ExperimentStore) -> None:
    from opml.traces.v1 import events_pb2 as tpb

    from opml_automl_controller.controller import spec_of
    from opml_automl_controller.tracing import TraceCollector
    from opml_common.bus import CloudEvent
    from opml_trace_collector_contract.topics import tracer_source

    def event(message, job: str) -> CloudEvent:
        return CloudEvent.from_proto(message, source=tracer_source(job, "worker-0"), subject=f"{job}/worker-0")

    jobs = ScriptedJobs(lambda x, n: ["training"], hold=True)
    first = controller(store, jobs)
    await first.start()
    await first.create(experiment("retraced", max_trials=1, parallel=1, max_failed=0,
                                  collector={"collector": {"kind": "Trace"}}))
    await asyncio.to_thread(jobs.running.acquire)
    [job] = jobs.submitted
    before = TraceCollector(store, spec_of=spec_of, wake=first.wake_trace)
    await before.handle(event(tpb.TracerStarted(job=job, worker="worker-0", session_id="s"), job))
    await before.handle(event(tpb.StepMetricsBatch(job=job, worker="worker-0", session_id="s", epochs=[
        tpb.EpochLog(epoch=e, logs={"loss": 3.0 - e}) for e in (0, 1)]), job))
    await first.stop()  # as a kill: the trial's job goes on, its epochs so far are in Redis only
    second = controller(store, jobs)
    after = TraceCollector(store, spec_of=spec_of, wake=second.wake_trace)
    await second.start()
    jobs.gate.set()
    await after.handle(event(tpb.StepMetricsBatch(job=job, worker="worker-0", session_id="s", epochs=[
        tpb.EpochLog(epoch=2, logs={"loss": 1.0})]), job))
    await after.handle(event(tpb.TracerStopped(job=job, worker="worker-0", session_id="s"), job))
    await asyncio.wait_for(until_ended(second, "retraced"), 60)
    [trial] = (await second.get("retraced")).trials
    assert trial.state is TrialState.SUCCEEDED and trial.observations["loss"] == [3.0, 2.0, 1.0]
    assert len(jobs.submitted) == 1, "the job was re-attached, not run again"
    await second.stop()


async def test_a_trial_that_stops_reading_lets_go_of_its_log_stream(store: ExperimentStore) -> None:
    """A trial task that ends before its job (cancelled here; one that failed is re-attached with a
    new follower) must not leave its follower thread queueing the log for nobody."""
    jobs = FedJobs()
    ctl = controller(store, jobs)
    await ctl.start()
    await ctl.create(experiment("letgo", max_trials=1, parallel=1, max_failed=0))
    await asyncio.to_thread(jobs.following.acquire)
    await ctl.stop()  # the trial's task is cancelled; its job goes on writing
    jobs.lines.put("loss=1\n")
    assert await asyncio.to_thread(jobs.dropped.wait, 60)


async def test_an_experiment_stored_under_older_rules_fails_alone(store: ExperimentStore) -> None:
    # random_state 2^32 was admitted before numpy's seed bound became an admission rule
    stale = ExperimentRecord(name="stale", uid="aa", katib_yaml=experiment("stale").replace("'7'", "'4294967296'"),
                             max_trial_count=6)
    assert "4294967296" in stale.katib_yaml
    await store.put_experiment(stale, new=True)
    emitter = RecordingEmitter()
    ctl = Controller(store=store, jobs=ScriptedJobs(quadratic), emitter=emitter, redis_url=REDIS, retry_s=0.05)
    await ctl.start()
    await ctl.create(experiment("fresh", max_trials=1, parallel=1, max_failed=1))

    async def failed() -> bool:
        return (await store.experiment("stale")).state is ExperimentState.FAILED

    await wait_until(failed, what="the stale experiment's run to fail it")
    record = await store.experiment("stale")
    assert record.reason == "SpecInvalid" and "random_state" in record.message
    assert [v.record.name for v in await ctl.list()] == ["fresh"]
    with pytest.raises(FailedPrecondition, match="random_state"):
        await ctl.get("stale")
    await ctl.delete("stale")
    with pytest.raises(NotFound):
        await store.experiment("stale")
    deleted = [m.experiment.name for m in emitter.messages if getattr(m, "deleted", False)]
    assert deleted == ["experiments/stale"]
    await ctl.stop()


async def test_resuming_a_stopped_experiment_below_its_trials_is_refused(store: ExperimentStore) -> None:
    jobs = ScriptedJobs(quadratic, hold=True)
    ctl = controller(store, jobs)
    await ctl.start()
    await ctl.create(experiment("shrink", max_trials=4, parallel=2))
    for _ in range(2):
        await asyncio.to_thread(jobs.running.acquire)
    await ctl.stop_experiment("shrink")

    async def killed() -> bool:
        return [t.state for t in (await ctl.get("shrink")).trials] == [TrialState.KILLED] * 2

    await wait_until(killed, what="the stopped experiment's two trials killed")
    with pytest.raises(InvalidArgument, match="at least the experiment's 2 trials") as refused:
        await ctl.resume("shrink", 1)
    assert refused.value.field == "max_trial_count"
    assert (await ctl.get("shrink")).record.state is ExperimentState.STOPPED
    await ctl.resume("shrink", 2)  # as many as it ran: it ends at once, with them

    async def ended() -> bool:
        return (await ctl.get("shrink")).record.state is not ExperimentState.RUNNING

    await wait_until(ended, what="the resumed experiment's end")
    view = await ctl.get("shrink")
    assert view.record.reason == "MaxTrialsReached" and len(view.trials) == 2 == view.record.max_trial_count
    await ctl.stop()


async def test_an_experiments_run_and_its_entries_are_released_when_it_ends_or_is_deleted(
        store: ExperimentStore, monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []

    class Study(ExperimentStudy):
        def close(self) -> None:
            closed.append(self.spec.name)
            super().close()

    monkeypatch.setattr(controller_module, "ExperimentStudy", Study)
    jobs = ScriptedJobs(quadratic, hold=True)
    ctl = controller(store, jobs)
    await ctl.start()
    await ctl.create(experiment("gone", max_trials=2, parallel=2, max_failed=1))
    for _ in range(2):
        await asyncio.to_thread(jobs.running.acquire)
    await ctl.delete("gone")
    assert "gone" not in ctl._runs and "gone" not in ctl._wake
    assert closed == ["gone"]
    jobs.gate.set()
    await ctl.create(experiment("ends", max_trials=1, parallel=1, max_failed=1, resume="LongRunning"))
    await wait_until(lambda: "ends" not in ctl._runs, what="the run of the experiment that ended to be released")
    assert "ends" not in ctl._wake and closed == ["gone", "ends"]
    await ctl.resume("ends", 2)  # a run of its own, and a study (a Redis pool) of its own
    await wait_until(lambda: "ends" not in ctl._runs, what="the resumed run to be released")
    assert closed == ["gone", "ends", "ends"] and len((await ctl.get("ends")).trials) == 2
    await ctl.stop()


class Bundles(ModelStore):
    """The bundle-store as the controller uses it, in memory: grants issued (ids only) and revoked,
    revocations refused while ``down``; the best model's commit recorded."""

    def __init__(self) -> None:
        self.issued: list[str] = []
        self.revoked: list[str] = []
        self.committed: list[str] = []
        self.down = threading.Event()

    def grant_upload(self, trial, policy, ttl_s: int) -> TrialUpload:
        self.issued.append(f"{len(self.issued):016x}")
        return TrialUpload(env={}, secret_env={}, grant_id=self.issued[-1])

    def revoke_upload(self, grant_id: str) -> None:
        if self.down.is_set():
            raise Unavailable("bundle-store: connection refused")
        if grant_id not in self.revoked:
            self.revoked.append(grant_id)

    def commit_best(self, experiment, trial, policy, *, objective: str, algorithm: str) -> str:
        self.committed.append(trial.job_id)
        return f"contexts/automl/bundles/{experiment.uid}"


class Revocations(ControllerMetrics):
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def grant_revocation(self, outcome: str) -> None:
        self.outcomes.append(outcome)


async def test_ended_trials_grants_are_revoked_a_store_outage_blocks_nothing_and_a_restart_revokes_the_rest(
        store: ExperimentStore) -> None:
    """An experiment ends and commits its best model while the bundle-store refuses every revocation;
    its trials keep their grant ids; the controller started again revokes each one, and a deleted
    experiment's unrevoked grants too."""
    jobs, bundles, metrics = ScriptedJobs(quadratic), Bundles(), Revocations()
    bundles.down.set()
    first = Controller(store=store, jobs=jobs, emitter=RecordingEmitter(), redis_url=REDIS, retry_s=0.05,
                       models=bundles, resync_s=0.05, metrics=metrics)
    await first.start()
    await first.create(experiment("granted", max_trials=4, parallel=2, model={}))
    await asyncio.wait_for(until_ended(first, "granted"), 60)
    view = await first.get("granted")
    assert view.record.reason == "MaxTrialsReached" and bundles.committed == [view.best().job_id]
    assert sorted(g for t in view.trials for g in t.upload_grants) == bundles.issued and len(bundles.issued) == 4
    await wait_until(lambda: metrics.outcomes.count("failed") >= 6,
                     what="each trial's revocation, then resyncs' retries, refused")
    assert bundles.revoked == [] and {"revoked", "dropped"}.isdisjoint(metrics.outcomes)
    assert sorted(g for t in await store.trials("granted") for g in t.upload_grants) == bundles.issued
    await first.create(experiment("deleted", max_trials=2, parallel=1, max_failed=1, model={}))
    await asyncio.wait_for(until_ended(first, "deleted"), 60)
    await first.delete("deleted")
    await first.stop()
    bundles.down.clear()
    second = Controller(store=store, jobs=jobs, emitter=RecordingEmitter(), redis_url=REDIS, retry_s=0.05,
                        models=bundles, resync_s=0.05)
    await second.start()
    await wait_until(lambda: sorted(bundles.revoked) == bundles.issued,
                     what=lambda: f"every grant revoked: {bundles.revoked} of {bundles.issued}")

    async def nothing_left() -> bool:
        return await store.unrevoked_grants() == [] and all(
            t.upload_grants == [] for t in await store.trials("granted"))

    await wait_until(nothing_left, what="every revoked grant removed from the records")
    assert len(await store.trials("granted")) == 4
    await second.stop()


async def test_revoked_grants_leave_a_trials_record_only_through_the_leader_and_a_delete_keeps_the_rest(
        store: ExperimentStore) -> None:
    """Removing revoked grant ids is a fenced write of the trial's record, which keeps what a runner
    wrote meanwhile; a deleted experiment's unrevoked grants move to the set the leader revokes from."""
    from opml_automl_controller.state import TrialRecord
    from opml_common.lease import LeaderLease, NotLeader

    client, prefix = store._redis, store._prefix.removesuffix("automl:")
    old = LeaderLease(client, "automl-controller", "old", prefix=prefix, ttl_s=30)
    new = LeaderLease(client, "automl-controller", "new", prefix=prefix, ttl_s=30)
    deposed = ExperimentStore(client, prefix=prefix, fence=lambda: old.fence)
    leader = ExperimentStore(client, prefix=prefix, fence=lambda: new.fence)
    await store.put_experiment(ExperimentRecord(name="e", uid="abcdef", katib_yaml="", max_trial_count=2), new=True)
    trial = TrialRecord(experiment="e", number=0, parameters={"x": "1"}, job_id="e-abcdef-t0",
                        state=TrialState.SUCCEEDED, upload_grants=["a", "b", "c"], observations={"loss": [1.0]})
    await store.put_trial(trial)
    await store.put_trial(replace(trial, number=1, job_id="e-abcdef-t1", upload_grants=["d"]))
    async with old:
        await old.wait_leading()
        await client.delete(f"{prefix}lease:automl-controller")
        async with new:
            await new.wait_leading()
            with pytest.raises(NotLeader):
                await deposed.drop_grants("e", 0, ["a"])
            await leader.drop_grants("e", 0, ["a", "c"])
            await leader.drop_grants("e", 7, ["a"])  # no such trial: nothing
    assert await store.trial("e", 0) == replace(trial, upload_grants=["b"])
    await store.delete(await store.experiment("e"))
    assert await store.unrevoked_grants() == ["b", "d"] and await store.trials("e") == []
    await store.forget_unrevoked(["b"])
    assert await store.unrevoked_grants() == ["d"]
