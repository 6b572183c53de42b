"""Steps' jobs: what the orchestrator runs for a validate, evaluate or train step, and waiting on it.

validate and evaluate run the platform's step program as BE jobs, sandboxed like every local job,
reading only the step's folder (``python -m opml_job_orchestrator.pipelines.stepjobs KIND --step
F/step.json --inputs F/inputs --outputs F/outputs``). train runs the user's command as a job of the
class its spec says, traced when asked, with ``OPML_PIPELINE_SPANS`` (a folder per input span),
``OPML_PIPELINE_MODEL_DIR`` (where it writes ``model.onnx`` and ``model.yaml``) and, when warm,
``OPML_PIPELINE_WARM_START`` (the blessed model's files). No job gets bundle-store credentials.

:class:`StepJobs` is an orchestrator lifecycle listener: :meth:`StepJobs.run` submits a step's job,
or re-attaches to it when the orchestrator knows it already (a resumed run), and returns when it ends.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from opml.jobs.v1 import jobs_pb2
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_common.errors import NotFound
from opml_job_orchestrator.executor.base import JobProgram
from opml_job_orchestrator.orchestrator import TERMINAL_STATES, JobStatus, LifecycleEvent, Orchestrator
from opml_job_orchestrator.scheduler.model import JobClass, JobSpec, Resources, RoleSpec

STEP_PROGRAM = "opml_job_orchestrator.pipelines.stepjobs"
SPANS_VARIABLE, MODEL_DIR_VARIABLE, WARM_START_VARIABLE = (
    "OPML_PIPELINE_SPANS", "OPML_PIPELINE_MODEL_DIR", "OPML_PIPELINE_WARM_START")


@dataclass(frozen=True, slots=True)
class StepJob:
    """One step's job, ready to submit."""

    spec: JobSpec
    program: JobProgram
    max_retries: int | None = None
    labels: Mapping[str, str] | None = None


def job_id(pipeline: str, run: int, step: str) -> str:
    """The job of ``step`` in run ``run``: one per step and run, never reused (run numbers are not)."""
    return f"pl-{pipeline}-{run}-{step}"


def platform_step_job(job: str, kind: str, folder: Path, resources: Resources, labels: Mapping[str, str]) -> StepJob:
    """A validate or evaluate job over ``folder`` (``step.json``, ``inputs/``, ``outputs/``)."""
    command = [sys.executable, "-m", STEP_PROGRAM, kind, "--step", str(folder / "step.json"),
               "--inputs", str(folder / "inputs"), "--outputs", str(folder / "outputs")]
    return StepJob(JobSpec(job_id=job, job_class=JobClass.BE, roles={"worker": RoleSpec(1, resources)}),
                   JobProgram(commands={"worker": command}), labels=labels)


def train_job(job: str, train: pb.TrainConfig, *, spans: Path, model_dir: Path, warm_start: Path | None,
              labels: Mapping[str, str]) -> StepJob:
    """The user's training command as the spec's train section says, with the pipeline's variables."""
    env = dict(train.env)
    env[SPANS_VARIABLE] = str(spans)
    env[MODEL_DIR_VARIABLE] = str(model_dir)
    if warm_start is not None:
        env[WARM_START_VARIABLE] = str(warm_start)
    resources = Resources(cpu_millis=train.resources.cpu_millis, memory_mib=train.resources.memory_mib,
                          gpu=train.resources.gpu)
    job_class = JobClass.TE if train.job_class == jobs_pb2.JOB_CLASS_TE else JobClass.BE
    return StepJob(JobSpec(job_id=job, job_class=job_class, roles={"worker": RoleSpec(1, resources)}),
                   JobProgram(commands={"worker": list(train.command)}, env=env, trace=train.trace),
                   max_retries=train.max_retries if train.HasField("max_retries") else None, labels=labels)


class StepJobs:
    """Submits steps' jobs to the orchestrator and waits for them. Register :meth:`on_lifecycle` among
    the orchestrator's listeners, then :meth:`bind` the orchestrator. ``durable`` returns once the
    orchestrator's job store has written every change so far."""

    def __init__(self, *, durable: Callable[[], Awaitable[None]]) -> None:
        self._orchestrator: Orchestrator | None = None
        self._durable = durable
        self._changed: dict[str, asyncio.Event] = {}

    def bind(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator

    def on_lifecycle(self, event: LifecycleEvent) -> None:
        """The orchestrator's listener: wakes whoever waits on the job."""
        waiter = self._changed.get(event.job_id)
        if waiter is not None:
            waiter.set()

    def known(self, job: str) -> bool:
        try:
            self._get().get(job)
        except NotFound:
            return False
        return True

    async def run(self, job: StepJob, *, submitter: str) -> JobStatus:
        """Submit ``job`` unless the orchestrator knows its id (then re-attach), and return its final status."""
        orchestrator = self._get()
        job_id_ = job.spec.job_id
        if not self.known(job_id_):
            orchestrator.submit(job.spec, job.program, max_retries=job.max_retries, submitter=submitter,
                                labels=job.labels)
            await self._durable()
        waiter = self._changed.setdefault(job_id_, asyncio.Event())
        try:
            while True:
                status = orchestrator.get(job_id_)
                if status.state in TERMINAL_STATES:
                    return status
                waiter.clear()
                await waiter.wait()
        finally:
            self._changed.pop(job_id_, None)

    def _get(self) -> Orchestrator:
        if self._orchestrator is None:
            raise RuntimeError("StepJobs.bind(orchestrator) was not called")
        return self._orchestrator
