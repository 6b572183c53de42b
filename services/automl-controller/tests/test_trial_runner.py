"""One trial's runner against fakes of pure logic: an orchestrator whose jobs write a given log and end
as told, a study that records what it is told (and prunes at a given step), a store in memory. The
real controller, Optuna and Redis are test_controller.py's."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from opml.jobs.v1 import jobs_pb2
from optuna.trial import TrialState as OptunaState

from opml_automl_controller.collect import MODEL_MARKER
from opml_automl_controller.jobs import JobView, TrialJobs
from opml_automl_controller.katib import parse_experiment
from opml_automl_controller.metrics import ControllerMetrics
from opml_automl_controller.models import ModelStore, TrialUpload
from opml_automl_controller.modelspec import ModelPolicy
from opml_automl_controller.records import Records
from opml_automl_controller.state import TraceRecord, TrialRecord, TrialState
from opml_automl_controller.study import END_ATTR, ERROR_ATTR
from opml_automl_controller.surrogate import SurrogateCall
from opml_automl_controller.trialmodel import MODEL_DIR_VARIABLE, TrialFolders
from opml_automl_controller.trials import TrialRunner, TrialServices
from opml_automl_controller.uploadenv import (
    BUNDLE_VARIABLE,
    CONTEXT_VARIABLE,
    GRANT_VARIABLE,
    TARGET_VARIABLE,
)
from opml_common.errors import InvalidArgument, NotFound, Unavailable
from opml_common.events import RecordingEmitter

JOB = "exp-abc123-t0"
HOLD = object()
"""In a job's log: the job runs on here until it is cancelled or released (``FakeJobs.release``)."""
BREAK = object()
"""In a job's log: the stream ends here the first time it is read (the job still running)."""


def experiment(*, collector: str | None = None, kind: str = "Job", model: dict | None = None) -> str:
    template: dict = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {"containers": [
        {"name": "main", "image": "python:3.11", "command": ["python", "train.py", "--x=${trialParameters.x}"]}]}}}}
    parameters = [{"name": "x", "parameterType": "double", "feasibleSpace": {"min": "-2", "max": "2"}}]
    objective = {"type": "minimize", "objectiveMetricName": "loss"}
    if kind == "ServingConfigSurrogate":
        template = {"apiVersion": "jobs.opml.dev/v1", "kind": kind, "spec": {
            "model": "models/mlp/versions/1", "poolKind": "accel", "config": {"batch": "${trialParameters.x}"}}}
        parameters = [{"name": "x", "parameterType": "int", "feasibleSpace": {"min": "1", "max": "8"}}]
        objective = {"type": "maximize", "objectiveMetricName": "throughput_rps",
                     "additionalMetricNames": ["latency_ms"]}
    spec: dict = {
        "objective": objective, "algorithm": {"algorithmName": "random"}, "maxTrialCount": 4, "parallelTrialCount": 1,
        "parameters": parameters,
        "trialTemplate": {"primaryContainerName": "main", "trialParameters": [{"name": "x", "reference": "x"}],
                          "trialSpec": template}}
    if collector:
        spec["metricsCollectorSpec"] = {"collector": {"kind": collector}}
    if model is not None:
        spec["model"] = model
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": "exp"},
                           "spec": spec})


class FakeJobs(TrialJobs):
    """One job, whose log is ``log`` (chunks, with HOLD and BREAK) and which ends ``ends`` ("succeeded"
    or "failed", with ``cause``) once its log is written."""

    def __init__(self, log: list, *, ends: str = "succeeded", cause: str = "", refuse: str = "",
                 unavailable: int = 0) -> None:
        self.log, self.ends, self.cause, self.refuse = log, ends, cause, refuse
        self.unavailable = unavailable
        self.state = "none"
        self.submitted: list[jobs_pb2.JobSpec] = []
        self.cancelled: list[str] = []
        self.follows = 0
        self.following = threading.Semaphore(0)
        self.released = threading.Event()
        self.lock = threading.Lock()

    def ensure(self, spec: jobs_pb2.JobSpec) -> JobView:
        if self.unavailable:
            self.unavailable -= 1
            raise Unavailable("job-orchestrator is restarting")
        if self.refuse:
            raise InvalidArgument("spec.roles.worker.env", self.refuse)
        with self.lock:
            if self.state == "none":
                self.submitted.append(spec)
                self.state = "running"
        return self.get(spec.name)

    def get(self, job_id: str) -> JobView:
        return JobView(job_id, self.state, self.cause if self.state in ("failed", "cancelled") else "")

    def cancel(self, job_id: str) -> JobView:
        with self.lock:
            if self.state == "running":
                self.state = "cancelled"
                self.cause = "cancelled by a user"
                self.cancelled.append(job_id)
        return self.get(job_id)

    def release(self) -> None:
        self.released.set()

    def follow(self, job_id: str) -> Iterator[str]:
        self.follows += 1
        self.following.release()
        for chunk in self.log:
            if chunk is BREAK:
                if self.follows == 1:
                    return
                continue
            if chunk is HOLD:
                while self.state == "running" and not self.released.wait(0.01):
                    pass
                continue
            if self.state != "running":
                return
            yield chunk
        with self.lock:
            if self.state == "running":
                self.state = self.ends


class BrokenStream(FakeJobs):
    def follow(self, job_id: str) -> Iterator[str]:
        raise NotFound(f"job {job_id!r} does not exist")


class FakeStudy:
    """What the runner tells the study; the pruner says stop from step ``prune_at`` on."""

    pruner_name = "MedianPruner"

    def __init__(self, *, prune_at: int | None = None) -> None:
        self.prune_at = prune_at
        self.reported: list[tuple[int, float]] = []
        self.attrs: dict[str, str] = {}
        self.told: tuple[OptunaState, float | None] | None = None

    def report(self, number: int, value: float, step: int) -> bool:
        self.reported.append((step, value))
        return self.prune_at is not None and step >= self.prune_at

    def mark(self, number: int, key: str, value: str) -> bool:
        if self.told is not None:
            return False
        self.attrs[key] = value
        return True

    def tell(self, number: int, *, value: float | None = None, state: OptunaState = OptunaState.COMPLETE) -> None:
        self.told = (state, value)

    def end_of(self, number: int) -> str | None:
        return self.attrs.get(END_ATTR)


class FakeStore:
    def __init__(self) -> None:
        self.trials: dict[int, TrialRecord] = {}
        self.traces: dict[int, TraceRecord] = {}

    async def put_trial(self, trial: TrialRecord) -> None:
        self.trials[trial.number] = trial

    async def trace(self, experiment: str, number: int) -> TraceRecord:
        return self.traces.get(number, TraceRecord())


class Metrics(ControllerMetrics):
    def __init__(self) -> None:
        self.ended: list[TrialState] = []
        self.models_refused = 0

    def trial_ended(self, state: TrialState, seconds: float | None) -> None:
        self.ended.append(state)

    def model_refused(self) -> None:
        self.models_refused += 1


class Predictor:
    def __init__(self, answer: dict[str, float] | Exception) -> None:
        self.answer = answer
        self.calls: list[SurrogateCall] = []

    def predict(self, call: SurrogateCall) -> dict[str, float]:
        self.calls.append(call)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class Grants(ModelStore):
    """Upload grants as the bundle-store makes them (a token per call), each call recorded."""

    def __init__(self) -> None:
        self.granted: list[tuple[str, int, int]] = []

    def grant_upload(self, trial: TrialRecord, policy: ModelPolicy, ttl_s: int) -> TrialUpload:
        self.granted.append((trial.job_id, policy.max_bytes, ttl_s))
        return TrialUpload(env={CONTEXT_VARIABLE: "automl", BUNDLE_VARIABLE: trial.job_id},
                           secret_env={TARGET_VARIABLE: "store:50051", GRANT_VARIABLE: f"grant-{len(self.granted)}"},
                           grant_id=f"{len(self.granted):016x}")

    def revoke_upload(self, grant_id: str) -> None:
        raise AssertionError("a runner revokes nothing itself: the controller's GrantRevoker does")

    def commit_best(self, *args, **kwargs) -> str:
        raise AssertionError("a runner commits nothing")


class Ended:
    """The controller's GrantRevoker as a runner sees it: the trials it was told have ended."""

    def __init__(self) -> None:
        self.trials: list[TrialRecord] = []

    def ended(self, trial: TrialRecord) -> None:
        self.trials.append(trial)


class Harness:
    def __init__(self, jobs: TrialJobs, *, study: FakeStudy | None = None, collector: str | None = None,
                 kind: str = "Job", serving: Predictor | None = None, trace_wait_s: float = 5.0,
                 folders: TrialFolders | None = None, models: ModelStore | None = None,
                 model: dict | None = None) -> None:
        self.jobs, self.study = jobs, study or FakeStudy()
        self.store, self.emitter, self.metrics = FakeStore(), RecordingEmitter(), Metrics()
        self.ended = Ended()
        self.services = TrialServices(jobs=jobs, records=Records(self.store, self.emitter, self.metrics),  # type: ignore[arg-type]
                                      metrics=self.metrics, serving=serving, retry_s=0.01, trace_wait_s=trace_wait_s,
                                      folders=folders, models=models, upload_ttl_s=600,
                                      grants=self.ended)  # type: ignore[arg-type]
        self.spec = parse_experiment(experiment(collector=collector, kind=kind, model=model))
        self.runner = TrialRunner(self.services, self.spec, self.study,
                                  TrialRecord(experiment="exp", number=0, parameters={"x": "1"}, job_id=JOB))

    async def run(self) -> TrialRecord:
        await asyncio.wait_for(self.runner.run(), 10)
        return self.store.trials[0]

    def announced(self) -> list[str]:
        from opml.automl.v1 import automl_pb2 as pb
        return [pb.TrialState.Name(m.trial.state).removeprefix("TRIAL_STATE_") for m in self.emitter.messages]


async def until(condition, what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_trial_that_succeeds_reports_its_objective() -> None:
    jobs = FakeJobs(["epoch 0: loss=3\n", "epoch 1: loss=2\nepoch 2: lo", "ss=2.5"])  # a line cut between chunks
    h = Harness(jobs)
    trial = await h.run()
    assert trial.state is TrialState.SUCCEEDED and trial.objective_value == 2.0  # minimize: the series' min
    assert trial.observations == {"loss": [3.0, 2.0, 2.5]} and trial.message == ""
    assert trial.started_at is not None and trial.ended_at is not None
    # the last line, with no newline, is read once the job has ended: counted, no step for the pruner
    assert h.study.reported == [(1, 3.0), (2, 2.0)] and h.study.told == (OptunaState.COMPLETE, 2.0)
    assert h.announced() == ["RUNNING", "SUCCEEDED"] and h.metrics.ended == [TrialState.SUCCEEDED]
    [spec] = jobs.submitted
    assert spec.name == JOB and dict(spec.labels) == {"opml.dev/experiment": "exp", "opml.dev/trial": "0"}
    assert jobs.cancelled == []


UPLOADED = "0b9e6f3c-5a4d-4c1e-9f7a-2d8b1c3e4f5a"


def model_line(**said: object) -> str:
    return MODEL_MARKER + json.dumps(said) + "\n"


async def test_a_trials_own_folder_is_its_jobs_checkpoint_folder_made_by_the_orchestrator(tmp_path: Path) -> None:
    """The orchestrator makes a job's checkpoint folder for the job's user (a sandboxed job runs as a
    user of its own): a folder the controller made first would be the controller's, and refused."""
    folders = TrialFolders.open(tmp_path / "trials")
    h = Harness(FakeJobs(["loss=1\n"]), folders=folders)
    await h.run()
    [spec] = h.jobs.submitted
    assert dict(spec.env) == {MODEL_DIR_VARIABLE: str(folders.of(JOB))} and spec.checkpoint.dir == str(folders.of(JOB))
    assert dict(spec.secret_env) == {}  # no spec.model: no grant
    assert not folders.of(JOB).exists()


async def test_a_trial_of_a_modelled_experiment_gets_a_grant_in_its_secret_env_and_its_upload_is_a_hint() -> None:
    grants = Grants()
    h = Harness(FakeJobs(["loss=1\n", model_line(bundle=JOB, uuid=UPLOADED)]), models=grants,
                model={"serve": True, "maxBytes": "2Mi"})
    trial = await h.run()
    [spec] = h.jobs.submitted
    assert grants.granted == [(JOB, 2 * 1024**2, 600)]
    assert dict(spec.secret_env) == {TARGET_VARIABLE: "store:50051", GRANT_VARIABLE: "grant-1"}
    assert dict(spec.env) == {CONTEXT_VARIABLE: "automl", BUNDLE_VARIABLE: JOB}  # the grant is in no plain env
    assert (trial.state, trial.model_bundle, trial.message) == (TrialState.SUCCEEDED, UPLOADED, "")
    for said in ({"uuid": "../../s3.json"}, {"path": "."}, {"uuid": 7}):  # not a bundle's uuid: no hint
        h = Harness(FakeJobs(["loss=1\n", model_line(**said)]), models=Grants(), model={})
        trial = await h.run()
        assert trial.state is TrialState.SUCCEEDED and trial.model_bundle is None


class RecordedAtSubmit(FakeJobs):
    """Jobs that note the trial's stored record as the job is submitted (what a restart would find)."""

    def __init__(self, log: list, store: FakeStore | None = None, **kwargs) -> None:
        super().__init__(log, **kwargs)
        self.store = store
        self.at_submit: list[TrialRecord] = []

    def ensure(self, spec: jobs_pb2.JobSpec) -> JobView:
        assert self.store is not None
        self.at_submit.append(self.store.trials[0])
        return super().ensure(spec)


async def test_a_trials_grant_id_is_saved_before_its_job_is_submitted_and_revoked_however_it_ends() -> None:
    """Succeeded, failed, refused by the orchestrator, early-stopped, killed: each trial that got a grant
    is handed to the revoker once its record is saved in its final state, its grant id on it; a
    re-attaching runner's new grant joins the first (either may be the job's)."""
    jobs = RecordedAtSubmit(["loss=1\n"])
    h = Harness(jobs, models=Grants(), model={})
    jobs.store = h.store
    trial = await h.run()
    assert [t.upload_grants for t in jobs.at_submit] == [[f"{1:016x}"]], "saved before the job may hold it"
    assert trial.upload_grants == [f"{1:016x}"] and h.ended.trials == [trial]
    ends = {"failed": FakeJobs(["loss=1\n"], ends="failed", cause="exit code 3"),
            "refused": FakeJobs(["loss=1\n"], refuse="must not override OPML_HOME"),
            "pruned": FakeJobs(["loss=10\n", "loss=11\n", HOLD]),
            "killed": FakeJobs(["loss=1\n", HOLD])}
    for how, jobs in ends.items():
        h = Harness(jobs, models=Grants(), model={}, study=FakeStudy(prune_at=2 if how == "pruned" else None))
        run = asyncio.create_task(h.run())
        if how == "killed":
            await asyncio.to_thread(jobs.following.acquire)
            h.study.mark(0, END_ATTR, "killed")
            jobs.cancel(JOB)
        trial = await run
        assert h.ended.trials == [trial] and trial.upload_grants == [f"{1:016x}"], how
        assert trial.state is {"failed": TrialState.FAILED, "refused": TrialState.FAILED, "pruned":
                               TrialState.EARLY_STOPPED, "killed": TrialState.KILLED}[how], how
    grants = Grants()
    grants.granted.append(("before a restart", 0, 0))
    h = Harness(FakeJobs(["loss=1\n"]), models=grants, model={})
    h.runner.trial = replace(h.runner.trial, state=TrialState.RUNNING, upload_grants=[f"{1:016x}"])
    trial = await h.run()
    assert trial.upload_grants == [f"{1:016x}", f"{2:016x}"] and h.ended.trials == [trial]
    h = Harness(FakeJobs(["loss=1\n"]))  # no model asked: no grant, nothing to revoke
    trial = await h.run()
    assert trial.upload_grants == [] and h.ended.trials == [trial]


async def test_a_trial_whose_job_fails_is_failed_with_the_reason() -> None:
    h = Harness(FakeJobs(["loss=1\n"], ends="failed", cause="exit code 3"))
    trial = await h.run()
    assert trial.state is TrialState.FAILED and trial.message == "job failed: exit code 3"
    assert trial.objective_value is None and trial.observations == {"loss": [1.0]}
    assert h.study.told == (OptunaState.FAIL, None) and h.study.attrs[ERROR_ATTR] == "job failed: exit code 3"
    assert h.announced() == ["RUNNING", "FAILED"] and h.metrics.ended == [TrialState.FAILED]


async def test_a_job_that_succeeds_without_the_objective_fails_its_trial() -> None:
    h = Harness(FakeJobs(["accuracy=0.9\n"]))
    trial = await h.run()
    assert trial.state is TrialState.FAILED
    assert trial.message == "MetricsUnavailable: the job succeeded but reported no 'loss' (StdOut collector)"


async def test_an_early_stopped_trial_has_its_job_cancelled_and_is_marked_so() -> None:
    jobs = FakeJobs(["loss=10\n", "loss=11\n", HOLD, "loss=12\n"])
    h = Harness(jobs, study=FakeStudy(prune_at=2))
    trial = await h.run()
    assert jobs.cancelled == [JOB], "the pruner's decision cancels the job at once"
    assert h.study.attrs[END_ATTR] == "pruned", "marked before its job was cancelled"
    assert trial.state is TrialState.EARLY_STOPPED and trial.observations == {"loss": [10.0, 11.0]}
    assert trial.message == "stopped by the pruner at step 2 (MedianPruner); its job was cancelled"
    assert h.study.reported == [(1, 10.0), (2, 11.0)] and h.study.told == (OptunaState.PRUNED, None)
    assert h.announced() == ["RUNNING", "EARLY_STOPPED"]


async def test_a_trial_the_controller_kills_is_killed_and_one_cancelled_elsewhere_failed() -> None:
    jobs = FakeJobs(["loss=1\n", HOLD])
    h = Harness(jobs)
    run = asyncio.create_task(h.run())
    await asyncio.to_thread(jobs.following.acquire)
    h.study.mark(0, END_ATTR, "killed")  # what the experiment's loop does before it cancels the job
    jobs.cancel(JOB)
    trial = await run
    assert trial.state is TrialState.KILLED and h.study.told == (OptunaState.FAIL, None)
    assert trial.message == "its job was cancelled because the experiment ended or was stopped"

    jobs = FakeJobs(["loss=1\n", HOLD])
    h = Harness(jobs)
    run = asyncio.create_task(h.run())
    await asyncio.to_thread(jobs.following.acquire)
    jobs.cancel(JOB)  # opml job cancel, not the controller: no mark
    trial = await run
    assert trial.state is TrialState.FAILED
    assert trial.message == "job was cancelled outside the controller: cancelled by a user"


async def test_a_job_the_orchestrator_refuses_fails_its_trial_and_an_unavailable_one_is_retried() -> None:
    jobs = FakeJobs(["loss=1\n"], refuse="must not override OPML_HOME")
    h = Harness(jobs)
    trial = await h.run()
    assert trial.state is TrialState.FAILED and jobs.follows == 0 and h.announced() == ["FAILED"]
    assert trial.message == "job-orchestrator refused the job: spec.roles.worker.env: must not override OPML_HOME"

    jobs = FakeJobs(["loss=1\n"], unavailable=2)
    trial = await Harness(jobs).run()
    assert trial.state is TrialState.SUCCEEDED and len(jobs.submitted) == 1


async def test_a_stream_that_breaks_before_the_job_ends_is_read_again_each_value_once() -> None:
    jobs = FakeJobs(["loss=5\n", BREAK, "loss=4\n"])
    h = Harness(jobs)
    trial = await h.run()
    assert jobs.follows == 2
    assert trial.state is TrialState.SUCCEEDED and trial.observations == {"loss": [5.0, 4.0]}
    assert trial.objective_value == 4.0


async def test_a_stream_that_fails_for_good_raises_and_leaves_the_trial_untold() -> None:
    """Not retriable: the runner's task fails; the experiment's loop starts a new runner, which re-attaches."""
    h = Harness(BrokenStream([]))
    with pytest.raises(NotFound):
        await h.run()
    assert h.study.told is None and h.store.trials[0].state is TrialState.RUNNING
    assert JOB not in h.services.wakers


async def test_trace_epochs_stored_before_the_runner_and_after_the_job_ended_count() -> None:
    jobs = FakeJobs([HOLD])
    h = Harness(jobs, collector="Trace")
    h.store.traces[0] = TraceRecord({(0, 0): {"loss": 3.0}}, frozenset({"s"}))  # before a restart
    run = asyncio.create_task(h.run())
    await until(lambda: h.study.reported == [(1, 3.0)], "the stored epoch")
    h.store.traces[0] = TraceRecord({(0, 0): {"loss": 3.0}, (0, 1): {"loss": 2.0}}, frozenset({"s"}))
    h.services.wakers[JOB]()  # the Trace collector's consumer stored an epoch
    h.services.wakers[JOB]()  # and another batch before the runner read: one read of the store
    await until(lambda: h.study.reported == [(1, 3.0), (2, 2.0)], "the woken epoch")
    jobs.release()  # the job succeeds; its tracer's last epoch and TracerStopped come after
    await until(lambda: jobs.state == "succeeded", "the job's end")
    await asyncio.sleep(0.05)
    assert not run.done(), "waits for the tracer's last epochs"
    h.store.traces[0] = TraceRecord({(0, 0): {"loss": 3.0}, (0, 1): {"loss": 2.0}, (0, 2): {"loss": 1.0}},
                                    frozenset({"s"}), frozenset({"s"}))
    h.services.wakers[JOB]()
    trial = await run
    assert trial.state is TrialState.SUCCEEDED and trial.observations == {"loss": [3.0, 2.0, 1.0]}
    assert trial.objective_value == 1.0 and JOB not in h.services.wakers
    [spec] = jobs.submitted
    assert spec.trace and spec.env["OPML_TRACE_EXIT_TIMEOUT_S"] == "5"


async def test_a_trace_trial_whose_tracer_sends_nothing_fails_after_its_wait() -> None:
    h = Harness(FakeJobs(["no metric here\n"]), collector="Trace", trace_wait_s=0.2)
    trial = await h.run()
    assert trial.state is TrialState.FAILED
    assert "no epoch logs with it arrived from the job's tracer within 0.2 s of its end" in trial.message


async def test_a_surrogate_trial_is_the_routers_prediction() -> None:
    serving = Predictor({"throughput_rps": 900.0, "latency_ms": 2.5})
    jobs = FakeJobs([])
    h = Harness(jobs, kind="ServingConfigSurrogate", serving=serving)
    trial = await h.run()
    assert trial.state is TrialState.SUCCEEDED and trial.objective_value == 900.0
    assert trial.observations == {"throughput_rps": [900.0], "latency_ms": [2.5]}
    assert serving.calls[0].config.batch == 1 and jobs.submitted == []

    h = Harness(jobs, kind="ServingConfigSurrogate", serving=Predictor(NotFound("version 1 is not deployed")))
    trial = await h.run()
    assert trial.state is TrialState.FAILED and trial.message == "inference-router: version 1 is not deployed"
