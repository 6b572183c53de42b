"""One trial, run to its end: :class:`TrialRunner`.

A trial is a TE job of the job-orchestrator (or, ServingConfigSurrogate, one prediction of the
inference-router). The runner submits the job (idempotently: a restarted controller re-attaches to
it), follows its log through the metrics collector (a Trace trial: the epochs the Trace collector's
consumer stores, woken by :meth:`TrialRunner.wake`), reports each objective value to the study (the
pruner may stop it: its job is cancelled at once), and tells the study how it ended, then saves and
announces the trial. Each trial's job gets a model folder of its own (:mod:`.trialmodel`): its
checkpoint folder, which the orchestrator makes for the job's user; a trial that succeeds having
named its model keeps it only if it lies there (else the reason is on the trial). Which way it
ended is read from the study: the pruner's and the controller's cancels mark the trial
(:data:`~opml_automl_controller.study.END_ATTR`) before they cancel its job, so a job cancelled by
either is told apart from one cancelled outside the controller.

The experiment's loop (:mod:`opml_automl_controller.controller`) runs one runner per running trial;
a runner whose task fails (Redis, the orchestrator) is replaced by a new one that re-attaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from optuna.trial import TrialState as OptunaState

from opml_automl_controller.collect import MetricsParser, Observation, epoch_observations, summarize
from opml_automl_controller.experiment import CollectorKind, ExperimentSpec
from opml_automl_controller.grants import GrantRevoker
from opml_automl_controller.jobs import JobView, TrialJobs
from opml_automl_controller.metrics import ControllerMetrics
from opml_automl_controller.models import ModelStore, TrialUpload
from opml_automl_controller.records import Records
from opml_automl_controller.state import TrialRecord, TrialState
from opml_automl_controller.study import END_ATTR, ERROR_ATTR
from opml_automl_controller.surrogate import ServingPredictor, build_surrogate_call
from opml_automl_controller.template import SURROGATE_KIND, TrialJob, build_trial_job
from opml_automl_controller.trialmodel import MODEL_DIR_VARIABLE, TrialFolders
from opml_common.errors import InvalidArgument, OpmlError

log = logging.getLogger(__name__)

EXPERIMENT_LABEL = "opml.dev/experiment"
TRIAL_LABEL = "opml.dev/trial"
"""Labels every trial's job carries (ListJobs filters on them)."""
TRACE_EXIT_TIMEOUT = "OPML_TRACE_EXIT_TIMEOUT_S"

SAVE_EVERY_S = 1.0
"""A running trial's series is saved (not announced) at most this often, so GetExperiment shows it."""


class TrialStudy(Protocol):
    """What a runner asks of the experiment's study (:class:`~opml_automl_controller.study.ExperimentStudy`;
    every call blocks, so the runner makes it on a thread)."""

    pruner_name: str

    def report(self, number: int, value: float, step: int) -> bool: ...
    def mark(self, number: int, key: str, value: str) -> bool: ...
    def tell(self, number: int, *, value: float | None = None, state: OptunaState = OptunaState.COMPLETE) -> None: ...
    def end_of(self, number: int) -> str | None: ...


def is_surrogate(spec: ExperimentSpec) -> bool:
    """A ServingConfigSurrogate experiment: its trials are predictions, no job runs."""
    return f"{spec.trial_template.api_version} {spec.trial_template.kind}" == SURROGATE_KIND


def build_job(spec: ExperimentSpec, job_id: str, number: int, params: dict[str, str], *, trial_python: str,
              trace_wait_s: float, model_dir: Path | None = None, upload: TrialUpload | None = None) -> TrialJob:
    """The trial's job: the template's, named and labelled, wrapped for the File collector, traced for
    the Trace collector (its tracer's exit bound ``trace_wait_s`` unless the template sets one), told
    its own folder ``model_dir`` (:data:`~.trialmodel.MODEL_DIR_VARIABLE`) when there is one, which is
    also its checkpoint folder: the orchestrator makes it for the job's user (a sandboxed job runs as a
    user of its own; a folder the controller made would be root's), so the controller makes none; and,
    with ``upload``, where and with what grant it uploads its model (the grant in the job's secret env,
    which the orchestrator shows no one).

    Raises: InvalidArgument: the template does not make a job with these parameters.
    """
    job = build_trial_job(spec.trial_template, params, trial_name=job_id, namespace=spec.namespace)
    job.spec.name = job_id
    job.spec.labels.update({EXPERIMENT_LABEL: spec.name, TRIAL_LABEL: str(number)})
    if model_dir is not None:
        job.spec.env[MODEL_DIR_VARIABLE] = str(model_dir)
        job.spec.checkpoint.dir = str(model_dir)
    if upload is not None:
        job.spec.env.update(upload.env)
        job.spec.secret_env.update(upload.secret_env)
    if spec.collector.kind is CollectorKind.FILE:
        for role in job.spec.roles.values():
            argv = list(role.command or job.spec.command)
            del role.command[:]
            role.command.extend([trial_python, "-m", "opml_automl_controller.filetail",
                                 str(spec.collector.path), "--", *argv])
    if spec.collector.kind is CollectorKind.TRACE:
        job.spec.trace = True
        if TRACE_EXIT_TIMEOUT not in job.spec.env:
            job.spec.env[TRACE_EXIT_TIMEOUT] = f"{trace_wait_s:g}"
    return job


async def retrying(call: Callable[[], Any], what: str, *, retry_s: float) -> Any:
    """``call()`` on a thread, again after ``retry_s`` while it fails with a retriable error."""
    while True:
        try:
            return await asyncio.to_thread(call)
        except OpmlError as error:
            if not error.retriable:
                raise
            log.warning("%s: %s; retrying in %.1f s", what, error.message, retry_s)
            await asyncio.sleep(retry_s)


@dataclass(frozen=True, slots=True)
class TrialServices:
    """What every trial's runner uses; one per controller.

    Args:
        jobs: the orchestrator (blocking calls, run on threads).
        records: where the trial is saved and announced (its store holds Trace trials' epochs).
        metrics: trials by how they ended.
        serving: the inference-router's predictions (ServingConfigSurrogate trials).
        trial_python: the interpreter that runs the File collector's wrapper in a trial's job.
        retry_s: pause before retrying a call that failed with a retriable error.
        trace_wait_s: Trace collector: how long after a trial's job succeeded its runner waits for its
            tracer's last epochs.
        wakers: each running Trace trial's :meth:`TrialRunner.wake`, by job id (the controller's
            ``wake_trace`` looks it up).
        folders: where each trial's own folder is (None: trials get none).
        models: the bundle-store trials upload their models to (None: experiments with ``spec.model``
            are refused).
        upload_ttl_s: how long a trial's upload grant is valid (from its job's submit).
        grants: revokes an ended trial's upload grants (None: no bundle-store, no grants).
    """

    jobs: TrialJobs
    records: Records
    metrics: ControllerMetrics = field(default_factory=ControllerMetrics)
    serving: ServingPredictor | None = None
    trial_python: str = sys.executable
    retry_s: float = 1.0
    trace_wait_s: float = 10.0
    wakers: dict[str, Callable[[], None]] = field(default_factory=dict)
    folders: TrialFolders | None = None
    models: ModelStore | None = None
    upload_ttl_s: int = 24 * 3600
    grants: GrantRevoker | None = None

    async def retrying(self, call: Callable[[], Any], what: str) -> Any:
        return await retrying(call, what, retry_s=self.retry_s)


class TrialRunner:
    """Runs one trial (:meth:`run`) to its end: SUCCEEDED with its objective value, FAILED with the
    reason, EARLY_STOPPED (the pruner), or KILLED (the controller cancelled its job: the experiment
    ended or was stopped). A runner is used once.

    Args:
        services: the controller's (:class:`TrialServices`).
        spec: the experiment's checked spec.
        study: the experiment's study.
        trial: the trial's record as stored (CREATED, or RUNNING when a restart re-attaches to it).
    """

    def __init__(self, services: TrialServices, spec: ExperimentSpec, study: TrialStudy, trial: TrialRecord) -> None:
        self._services = services
        self._spec = spec
        self._study = study
        self.trial = trial
        """The trial's record as last saved by this runner."""
        self._objective = spec.objective.metric
        self._metrics = (self._objective, *spec.objective.additional_metrics)
        self._traced = spec.collector.kind is CollectorKind.TRACE
        self._pruned_at: int | None = None
        """The step at which the pruner stopped the trial (its job cancelled by this runner)."""
        self._observations: dict[str, list[float]] = {m: [] for m in self._metrics}
        self._parser = MetricsParser(spec.collector, self._metrics)
        self._seen: set[tuple[int, int]] = set()
        """The Trace epochs counted already, as (fit, epoch)."""
        self._inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        """The queue being read: a Trace wake-up goes there."""
        self._wake_queued = False
        """A wake-up is in the inbox: more before it is read are the same one read of the store."""
        self._let_go = threading.Event()
        """Set as the runner ends: its log follower thread stops at the next chunk."""

    async def run(self) -> None:
        """Raises: an error of Redis or the orchestrator that is not retriable (the trial is not told:
        the experiment's loop starts a new runner, which re-attaches to its job)."""
        if is_surrogate(self._spec):
            await self._predict()
            return
        folders, models, policy = self._services.folders, self._services.models, self._spec.model
        model_dir = folders.of(self.trial.job_id) if folders is not None else None
        upload = None
        if policy is not None and policy.commit and models is not None:
            # A grant per submit: one made for a job that turns out to exist already (a restart
            # re-attaching) is never handed to anyone, and is revoked with the job's own.
            upload = await self._services.retrying(
                lambda: models.grant_upload(self.trial, policy, self._services.upload_ttl_s),
                f"upload grant for {self.trial.job_id}")
            # Its id saved before the job may hold it, so that it is revoked once the trial has ended,
            # by whichever controller leads then.
            self.trial = replace(self.trial, upload_grants=[*self.trial.upload_grants, upload.grant_id])
            await self._services.records.save_trial(self.trial, announce=False)
        try:
            job = build_job(self._spec, self.trial.job_id, self.trial.number, self.trial.parameters,
                            trial_python=self._services.trial_python, trace_wait_s=self._services.trace_wait_s,
                            model_dir=model_dir, upload=upload)
        except InvalidArgument as error:
            await self._end(TrialState.FAILED, message=f"trial template: {error.message}")
            return
        try:
            await self._services.retrying(lambda: self._services.jobs.ensure(job.spec), f"submit {self.trial.job_id}")
        except InvalidArgument as error:
            await self._end(TrialState.FAILED, message=f"job-orchestrator refused the job: {error.message}")
            return
        self.trial = replace(self.trial, state=TrialState.RUNNING, started_at=self.trial.started_at or time.time())
        await self._services.records.save_trial(self.trial)
        wakers = self._services.wakers
        if self._traced:
            wakers[self.trial.job_id] = self.wake
        try:
            view = await self._follow_to_the_end()
            end = await asyncio.to_thread(self._study.end_of, self.trial.number)
            if self._traced and end is None and view.state == "succeeded":
                await self._observe(await self._trace_tail(), may_prune=False)
        finally:
            self._let_go.set()
            if wakers.get(self.trial.job_id) == self.wake:
                del wakers[self.trial.job_id]
        self.trial = replace(self.trial, observations=self._observations)
        await self._finish(end, view)

    def wake(self) -> None:
        """New epochs of this Trace trial are stored (the Trace collector's consumer, on the loop)."""
        if not self._wake_queued:
            self._wake_queued = True
            self._inbox.put_nowait(("trace", None))

    # -- following the job -----------------------------------------------------------------------

    async def _follow_to_the_end(self) -> JobView:
        """Read the job's log (and trace) until the job has ended: its view then. The log is read
        from its start each time the stream breaks early, so each value counts once."""
        while True:
            self._parser = MetricsParser(self._spec.collector, self._metrics)
            self._observations = {m: [] for m in self._metrics}
            self._seen = set()
            self._inbox = stream = self._follow()
            if self._traced:
                self._wake_queued = False
                self.wake()  # what was stored before this runner (a restart) or this re-read
            try:
                await self._read(stream)
            except OpmlError as error:
                if not error.retriable:
                    raise
                await asyncio.sleep(self._services.retry_s)
                continue
            view: JobView = await self._services.retrying(
                lambda j=self.trial.job_id: self._services.jobs.get(j), "get")
            if view.ended:
                return view
            await asyncio.sleep(self._services.retry_s)  # the stream broke before the job ended

    async def _read(self, stream: asyncio.Queue[tuple[str, Any]]) -> None:
        saved_at = time.monotonic()
        while True:
            kind, payload = await stream.get()
            if kind == "error":
                raise payload
            if kind == "end":
                break
            if kind == "trace":
                self._wake_queued = False
                trace = await self._services.records.store.trace(self.trial.experiment, self.trial.number)
                await self._observe(epoch_observations(trace.epochs.items(), self._metrics, self._seen))
            else:
                await self._observe(self._parser.feed(payload))
            if time.monotonic() - saved_at > SAVE_EVERY_S:
                self.trial = replace(self.trial, observations=self._observations)
                await self._services.records.save_trial(self.trial, announce=False)
                saved_at = time.monotonic()
        for observation in self._parser.close():
            self._observations[observation.metric].append(observation.value)

    async def _observe(self, found: list[Observation], *, may_prune: bool = True) -> None:
        """Add to the series; report each objective value as the next step (the pruner may stop it)."""
        number, job_id = self.trial.number, self.trial.job_id
        for observation in found:
            self._observations[observation.metric].append(observation.value)
            if observation.metric != self._objective or self._pruned_at is not None:
                continue
            step = len(self._observations[self._objective])
            if await asyncio.to_thread(self._study.report, number, observation.value, step) and may_prune:
                self._pruned_at = step
                if await asyncio.to_thread(self._study.mark, number, END_ATTR, "pruned"):
                    await self._services.retrying(lambda: self._services.jobs.cancel(job_id), "cancel")

    async def _trace_tail(self) -> list[Observation]:
        """After a Trace trial's job succeeded: its epochs not seen yet, once every tracer run of the
        job has stopped (their last batches come before), or at most ``trace_wait_s`` later."""
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._inbox = queue
        deadline = time.monotonic() + self._services.trace_wait_s
        found: list[Observation] = []
        while True:
            self._wake_queued = False
            trace = await self._services.records.store.trace(self.trial.experiment, self.trial.number)
            found += epoch_observations(trace.epochs.items(), self._metrics, self._seen)
            remaining = deadline - time.monotonic()
            if trace.complete or remaining <= 0:
                return found
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(queue.get(), remaining)

    def _follow(self) -> asyncio.Queue[tuple[str, Any]]:
        """The job's log as it is written: ("data", text)... then ("end", None) or ("error", exc),
        read on a thread of its own (not the loop's executor: a stream blocks for the job's whole
        run, and parallel trials would otherwise take every worker the Optuna calls need). Once
        ``_let_go`` is set (the reader has gone: a runner that failed and is replaced, or cancelled),
        the thread drops the stream at its next chunk instead of queueing the log for nobody."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        jobs, job_id, let_go = self._services.jobs, self.trial.job_id, self._let_go

        def pump() -> None:
            try:
                for text in jobs.follow(job_id):
                    if let_go.is_set():
                        return
                    loop.call_soon_threadsafe(queue.put_nowait, ("data", text))
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except BaseException as error:  # noqa: BLE001 - carried to the reader
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    loop.call_soon_threadsafe(queue.put_nowait, ("error", error))

        threading.Thread(target=pump, name=f"follow {job_id}", daemon=True).start()
        return queue

    # -- its end ---------------------------------------------------------------------------------

    async def _finish(self, end: str | None, view: JobView) -> None:
        """The trial's end, from why its job was cancelled (``end``: the study's mark) and how the job ended."""
        if end == "pruned":
            step = self._pruned_at or len(self._observations[self._objective])
            await self._end(TrialState.EARLY_STOPPED, message=f"stopped by the pruner at step {step} "
                                                              f"({self._study.pruner_name}); its job was cancelled")
        elif end == "killed":
            await self._end(TrialState.KILLED, message="its job was cancelled because the experiment ended or was stopped")
        elif view.state == "succeeded":
            value = summarize(self._observations[self._objective], self._spec.objective.strategy(self._objective))
            if value is None:
                where = (f"no epoch logs with it arrived from the job's tracer within "
                         f"{self._services.trace_wait_s:g} s of its end: does the trial fit a Keras model?"
                         if self._traced else "")
                await self._end(TrialState.FAILED,
                                message=f"MetricsUnavailable: the job succeeded but reported no {self._objective!r} "
                                        f"({self._spec.collector.kind.value} collector{'; ' + where if where else ''})")
            else:
                if self._parser.model_bundle is not None:
                    self.trial = replace(self.trial, model_bundle=self._parser.model_bundle)
                await self._end(TrialState.SUCCEEDED, value=value)
        elif view.state == "failed":
            await self._end(TrialState.FAILED, message=f"job failed: {view.cause}")
        else:
            await self._end(TrialState.FAILED, message=f"job was cancelled outside the controller: {view.cause}")

    async def _predict(self) -> None:
        """A ServingConfigSurrogate trial: the router's prediction of its configuration is its one
        observation of each metric (retried while the router is unavailable)."""
        try:
            call = build_surrogate_call(self._spec.trial_template, self.trial.parameters, trial_name=self.trial.job_id,
                                        namespace=self._spec.namespace)
        except InvalidArgument as error:
            await self._end(TrialState.FAILED, message=f"trial template: {error.message}")
            return
        self.trial = replace(self.trial, state=TrialState.RUNNING, started_at=self.trial.started_at or time.time())
        await self._services.records.save_trial(self.trial)
        serving = self._services.serving
        assert serving is not None  # the controller's validate() refused the experiment otherwise
        try:
            predicted = await self._services.retrying(lambda: serving.predict(call), f"predict {self.trial.job_id}")
        except OpmlError as error:
            await self._end(TrialState.FAILED, message=f"inference-router: {error.message}")
            return
        self.trial = replace(self.trial, observations={m: [predicted[m]] for m in self._metrics})
        await self._end(TrialState.SUCCEEDED, value=predicted[self._objective])

    async def _end(self, state: TrialState, *, value: float | None = None, message: str = "") -> None:
        """Tell Optuna (the durable decision), then save and announce the trial."""
        number = self.trial.number
        if message and state is not TrialState.SUCCEEDED:
            await asyncio.to_thread(self._study.mark, number, ERROR_ATTR, message[:1000])
        optuna_state = {TrialState.SUCCEEDED: OptunaState.COMPLETE, TrialState.EARLY_STOPPED: OptunaState.PRUNED}.get(
            state, OptunaState.FAIL)
        await asyncio.to_thread(self._study.tell, number, value=value, state=optuna_state)
        self.trial = replace(self.trial, state=state, objective_value=value, message=message, ended_at=time.time())
        await self._services.records.save_trial(self.trial)
        if self._services.grants is not None:
            self._services.grants.ended(self.trial)  # its job has ended: its upload is done or never will be
        started = self.trial.started_at
        self._services.metrics.trial_ended(state, self.trial.ended_at - started if started else None)
