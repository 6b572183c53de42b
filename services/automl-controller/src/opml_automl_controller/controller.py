"""The controller: runs each experiment to its end, trials as TE jobs, decisions by Optuna.

One asyncio task per running experiment (:meth:`Controller._run`) keeps ``parallelTrialCount``
trials going until ``maxTrialCount`` trials have been asked, and ends the experiment as Katib does
(in this order: the objective's goal reached -> SUCCEEDED GoalReached; more failed trials than
``maxFailedTrialCount`` -> FAILED MaxFailedTrialsReached; ``maxTrialCount`` trials ended ->
SUCCEEDED MaxTrialsReached; a grid with no combination left -> SUCCEEDED SuggestionEndReached).
One task per trial runs a :class:`~opml_automl_controller.trials.TrialRunner`: it submits the
trial's job, follows its log through the metrics collector, reports each objective value to the
study (so the pruner can stop it: its job is cancelled at once), and tells the study how it ended.

Restart safety: the Optuna journal decides which trials exist. A trial is asked (durably, with its
job id stored on it) before its job is submitted; submission re-reads the orchestrator first, so a
restart re-attaches to the job rather than running it again; a trial that ended in Optuna but not
in our record is finished from Optuna's state. So a controller killed at any point and started
again ends with exactly maxTrialCount trials, none run twice, none lost.

Every change is saved to Redis, then announced once through the emitter (``opml.experiments.v1``):
:class:`~opml_automl_controller.records.Records`.

Replicas: the loops, the trials' runners and the best model's commit run only in the replica that
holds the ``automl-controller`` lease (:class:`~opml_common.lease.LeaderLease`); its trial writes
and its loops' experiment changes are fenced (:mod:`~opml_automl_controller.state`). Every replica
serves the reads, and Create, Stop and Resume (they write the record; a nudge wakes the leader's
loop, and the leader's resync finds what a lost nudge did not say). Delete is served by the leader,
and by a follower only for an experiment with nothing running (ended, every trial ended), since
deleting a running one cancels its trials' jobs under its loop. A leader that loses the lease stops
every loop at once; the next one takes over through the restart path above.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState

from opml_automl_controller import convert
from opml_automl_controller.algorithms import fixed_parameters
from opml_automl_controller.experiment import ExperimentSpec, ResumePolicy, parameter_text
from opml_automl_controller.grants import GrantRevoker
from opml_automl_controller.jobs import TrialJobs
from opml_automl_controller.katib import check_experiment, parse_experiment
from opml_automl_controller.metrics import ControllerMetrics
from opml_automl_controller.models import ModelRefused, ModelStore
from opml_automl_controller.nudges import EXPERIMENT, TRACE, Nudges
from opml_automl_controller.records import Records
from opml_automl_controller.state import (
    TERMINAL_TRIALS,
    ExperimentRecord,
    ExperimentState,
    ExperimentStore,
    TrialRecord,
    TrialState,
)
from opml_automl_controller.study import END_ATTR, ERROR_ATTR, ExperimentStudy
from opml_automl_controller.surrogate import ServingPredictor, SurrogateCall, build_surrogate_call
from opml_automl_controller.template import TrialJob
from opml_automl_controller.trialmodel import TrialFolders
from opml_automl_controller.trials import TrialRunner, TrialServices, build_job, is_surrogate, retrying
from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OpmlError
from opml_common.events import EventEmitter
from opml_common.lease import LeaderLease, NotLeader
from opml_common.lifecycle import Component, cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExperimentView:
    """An experiment as the API shows it: its record, its checked spec, its trials."""

    record: ExperimentRecord
    spec: ExperimentSpec
    trials: tuple[TrialRecord, ...]
    warnings: tuple[str, ...] = ()  # unknown fields of the spec, ignored (set when it is created)

    def best(self) -> TrialRecord | None:
        return convert.best_trial(self.spec, self.trials)


@dataclass(frozen=True, slots=True)
class Validation:
    """The checked spec and its first trial: a job, or (ServingConfigSurrogate) a router call."""

    spec: ExperimentSpec
    trial_job: TrialJob | None
    surrogate: SurrogateCall | None = None
    warnings: tuple[str, ...] = ()

    @property
    def notes(self) -> tuple[str, ...]:
        if self.surrogate is not None:
            return (f"no job runs: each trial is the inference-router's PredictServingPerformance of "
                    f"{self.surrogate.model_version} on pool kind {self.surrogate.pool_kind} (the first: "
                    f"{self.surrogate.config})",)
        return self.trial_job.notes if self.trial_job is not None else ()


class SpecInvalid(FailedPrecondition):
    """A stored experiment whose katib_yaml breaks an admission rule made after it was created."""


@functools.lru_cache(maxsize=256)
def _parsed(katib_yaml: str) -> ExperimentSpec:
    """A stored experiment's spec (checked when it was created; parsed once per process, not per read)."""
    return parse_experiment(katib_yaml)


def _spec_of(record: ExperimentRecord) -> ExperimentSpec:
    """Raises: SpecInvalid: the rules were tightened since the experiment was created."""
    try:
        parsed = _parsed(record.katib_yaml)
    except InvalidArgument as error:
        raise SpecInvalid(f"experiment {record.name!r} breaks admission rules made after it was created "
                          f"({error.message}); delete it and create it again") from None
    return replace(parsed, max_trial_count=record.max_trial_count)


def _spec_or_none(record: ExperimentRecord) -> ExperimentSpec | None:
    """The spec, or None for a record that no longer parses (its events then carry the record only)."""
    with contextlib.suppress(SpecInvalid):
        return _spec_of(record)
    return None


spec_of = _spec_of
"""A stored experiment's checked spec (the Trace collector's consumer reads it too)."""


class Controller(Component):
    """A long-lived part: :meth:`start` runs again the experiments that had not ended, :meth:`stop`
    stops their tasks (the trials' jobs go on, re-attached at the next start).

    Args:
        store: experiments and trials in Redis.
        jobs: the orchestrator (blocking calls, run on threads).
        emitter: where experiment and trial changes are announced.
        redis_url: the Optuna journals' Redis.
        trial_python: the interpreter that runs the File collector's wrapper in a trial's job.
        retry_s: pause before retrying an orchestrator call that failed with a retriable error.
        models: the bundle-store trials upload their models to, with a grant each, and the best one is
            committed in (None: experiments with ``spec.model`` are refused).
        upload_ttl_s: how long a trial's upload grant is valid (revoked sooner: once its trial has ended,
            :mod:`~opml_automl_controller.grants`).
        trace_wait_s: Trace collector: how long after a trial's job succeeded the controller waits
            for its tracer's last epochs (every tracer run's TracerStopped); also the tracer's
            exit bound (``OPML_TRACE_EXIT_TIMEOUT_S``) in the job, unless its template sets one.
        serving: the inference-router's predictions, for ServingConfigSurrogate trials (None:
            such experiments are refused).
        folders: where each trial's own folder is (its job's checkpoint folder, made by the
            orchestrator; None: trials get none); an experiment's are removed with it.
        lease: the ``automl-controller`` lease; its ``on_change`` must call :meth:`leadership_changed`.
            None: this controller is the only one and leads from its start.
        nudges: how a follower wakes the leader (None: no followers).
        resync_s: how often the leader looks for experiments whose loop it does not run (a nudge lost),
            and retries the ended trials' upload grants' revocations that failed.
    """

    def __init__(self, *, store: ExperimentStore, jobs: TrialJobs, emitter: EventEmitter, redis_url: str,
                 metrics: ControllerMetrics | None = None, trial_python: str = sys.executable,
                 retry_s: float = 1.0, models: ModelStore | None = None, trace_wait_s: float = 10.0,
                 serving: ServingPredictor | None = None, folders: TrialFolders | None = None,
                 upload_ttl_s: int = 24 * 3600, lease: LeaderLease | None = None, nudges: Nudges | None = None,
                 resync_s: float = 5.0) -> None:
        super().__init__()
        if resync_s <= 0:
            raise ValueError(f"resync_s must be > 0, but got {resync_s}")
        self._lease, self._nudges, self._resync_s = lease, nudges, resync_s
        self._transitions: asyncio.Queue[bool] = asyncio.Queue()
        self._leadership: asyncio.Task | None = None
        self._store, self._jobs = store, jobs
        self._serving = serving
        self._models = models
        self._folders = folders
        self._redis_url = redis_url
        self._metrics = metrics or ControllerMetrics()
        self._records = Records(store, emitter, self._metrics)
        self._trial_python = trial_python
        self._retry_s = retry_s
        self._trace_wait_s = trace_wait_s
        self._grants = GrantRevoker(store=store, models=models, metrics=self._metrics, leading=lambda: self.leading,
                                    check_leading=self._check_leading) if models is not None else None
        self._revocations: asyncio.Task | None = None
        self._trial_services = TrialServices(jobs=jobs, records=self._records, metrics=self._metrics,
                                             serving=serving, trial_python=trial_python, retry_s=retry_s,
                                             trace_wait_s=trace_wait_s, folders=folders, models=models,
                                             upload_ttl_s=upload_ttl_s, grants=self._grants)
        self._runs: dict[str, asyncio.Task] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._pending_nudges: set[asyncio.Task] = set()
        self._failed: set[str] = set()
        """Experiments whose loop failed: a resync leaves them (a start, take-over or nudge runs them again)."""

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self) -> None:
        """With no lease: run again every experiment that had not ended (and drain stopped ones of
        running trials). With one: follow it (the same when it is taken, see :meth:`leadership_changed`)."""
        self._metrics.leader(self._lease is None)
        if self._lease is None:
            await self._launch_unfinished(only_missing=False)
        else:
            self._leadership = asyncio.create_task(self._follow_lease(), name="automl leadership")
        if self._grants is not None:
            self._revocations = asyncio.create_task(self._revoke_grants(self._grants), name="automl grants")
        await self._records.count()

    async def on_stop(self) -> None:
        """Stop the experiments' tasks; trials' jobs keep running and are re-attached at the next start."""
        await cancel_and_wait(self._leadership, self._revocations)
        self._leadership = self._revocations = None
        await _cancel(self._runs.values())
        if self._grants is not None:
            await self._grants.stop()

    async def _revoke_grants(self, grants: GrantRevoker) -> None:
        """Every ``resync_s``, while leading: the ended trials' upload grants whose revocation failed (or
        that a predecessor left: the first pass after a start or take-over reads every trial)."""
        while True:
            try:
                await grants.resync()
            except Exception:  # Redis unreachable: the next pass tries again
                log.exception("automl-controller: could not revoke the ended trials' upload grants; trying again "
                              "in %g s", self._resync_s)
            await asyncio.sleep(self._resync_s)

    @property
    def leading(self) -> bool:
        """Whether this replica runs the experiments' loops (holds the lease, or has none to hold)."""
        return self._lease is None or self._lease.leading

    def leadership_changed(self, leading: bool) -> None:
        """The lease's ``on_change``: taken -> run every unfinished experiment from its stored state;
        lost -> stop every loop at once (the jobs go on; the next leader re-attaches to them)."""
        self._transitions.put_nowait(leading)

    async def _follow_lease(self) -> None:
        """Applies the lease's changes in order; while leading, resyncs every ``resync_s``."""
        leading = False
        while True:
            try:
                leading = await asyncio.wait_for(self._transitions.get(), self._resync_s if leading else None)
            except TimeoutError:  # a resync: experiments whose nudge was lost
                await self._launch_safely(only_missing=True)
                continue
            self._metrics.leader(leading)
            if leading:
                log.info("automl-controller: this replica leads (lease %s); running every unfinished experiment",
                         self._lease.holder if self._lease is not None else "")
                await self._launch_safely(only_missing=False)
            else:
                log.warning("automl-controller: this replica no longer leads; stopping %d experiments' loops "
                            "(their trials' jobs go on for the next leader)", len(self._runs))
                await _cancel(self._runs.values())

    async def _launch_safely(self, *, only_missing: bool) -> None:
        try:
            await self._launch_unfinished(only_missing=only_missing)
        except Exception:  # Redis unreachable: the next resync tries again (a take-over: ``only_missing`` then)
            log.exception("automl-controller: could not read the experiments to run; trying again in %g s",
                          self._resync_s)

    async def _launch_unfinished(self, *, only_missing: bool) -> None:
        """Launch every unfinished experiment's loop (a take-over); ``only_missing`` (a resync): a
        running one's with no loop here, and wake a stopped one's that still runs (nudges lost)."""
        for record in await self._store.experiments():
            if not self.leading:
                return
            if not only_missing:
                if record.state in (ExperimentState.RUNNING, ExperimentState.STOPPED):
                    self._launch(record.name)
            elif (record.state is ExperimentState.RUNNING) != (record.name in self._runs) \
                    and record.name not in self._failed:
                self._launch(record.name)  # created or resumed with no loop here, or stopped under its loop

    async def _nudge(self, name: str) -> None:
        """Wake the experiment's loop: here when leading, else the leader's through a nudge."""
        if self.leading:
            self._launch(name)
        elif self._nudges is not None:
            await self._nudges.publish(EXPERIMENT, name)

    def on_nudge(self, kind: str, value: str) -> None:
        """A nudge from a replica (this one's own included): the leader wakes what it names."""
        if not self.leading:
            return
        if kind == EXPERIMENT:
            self._launch(value)
        elif kind == TRACE and (waker := self._trial_services.wakers.get(value)) is not None:
            waker()

    def _launch(self, name: str) -> None:
        self._failed.discard(name)
        if name in self._runs and not self._runs[name].done():
            self._wake[name].set()
            return
        self._wake[name] = asyncio.Event()
        self._runs[name] = asyncio.create_task(self._run(name), name=f"experiment {name}")

    def wake_trace(self, job_id: str) -> None:
        """New trace data of ``job_id`` is stored (the Trace collector's consumer, on the loop): the
        trial's task reads it. A job whose trial runs no task here is the leader's to read when this
        replica follows (nudged), else ignored (its task reads the stored data when it starts)."""
        waker = self._trial_services.wakers.get(job_id)
        if waker is not None:
            waker()
        elif not self.leading and self._nudges is not None:
            task = asyncio.ensure_future(self._nudges.publish(TRACE, job_id))
            self._pending_nudges.add(task)
            task.add_done_callback(self._pending_nudges.discard)

    # -- API -------------------------------------------------------------------------------------

    def validate(self, katib_yaml: str) -> Validation:
        """The dry run: the checks, and the first trial's job (parameters at their lowest).

        Raises:
            InvalidArgument: every rule the experiment breaks (an algorithm whose optional extra this
                install lacks among them).
            FailedPrecondition: a ServingConfigSurrogate experiment, and no inference-router configured;
                an experiment asking for a model, and no bundle-store configured.
        """
        checked = check_experiment(katib_yaml, what="katib_yaml", runnable_here=True)
        spec = checked.spec
        if spec.model is not None and spec.model.commit and self._models is None:
            raise FailedPrecondition("an experiment with spec.model needs a bundle-store its trials upload their "
                                     "models to: set OPML_AUTOML_CONTROLLER_BUNDLE_STORE_TARGET")
        values = {p.name: parameter_text(p.low if p.low is not None else p.choices[0]) for p in spec.parameters}
        if is_surrogate(spec):
            if self._serving is None:
                raise FailedPrecondition("a ServingConfigSurrogate experiment needs the inference-router's "
                                         "predictions: set OPML_AUTOML_CONTROLLER_INFERENCE_ROUTER_TARGET")
            return Validation(spec, None, build_surrogate_call(spec.trial_template, values, trial_name="validate",
                                                               namespace=spec.namespace), checked.warnings)
        return Validation(spec, build_job(spec, "validate", 0, values, trial_python=self._trial_python,
                                          trace_wait_s=self._trace_wait_s), warnings=checked.warnings)

    async def create(self, katib_yaml: str) -> ExperimentView:
        """Raises: InvalidArgument: a rule broken. AlreadyExists: the name is taken."""
        checked = self.validate(katib_yaml)
        spec = checked.spec
        record = ExperimentRecord(name=spec.name, uid=secrets.token_hex(3), katib_yaml=katib_yaml,
                                  max_trial_count=spec.max_trial_count, reason="Created",
                                  message="Experiment is created")
        if not await self._store.put_experiment(record, new=True):
            raise AlreadyExists(f"experiment {spec.name!r} exists already; delete it or choose another "
                                f"metadata.name")
        self._records.announce(record, spec, ())
        await self._nudge(spec.name)
        await self._records.count()
        return ExperimentView(record, spec, (), checked.warnings)

    async def get(self, name: str) -> ExperimentView:
        """Raises: NotFound. SpecInvalid: it no longer parses."""
        record = await self._store.experiment(name)
        return ExperimentView(record, _spec_of(record), tuple(await self._store.trials(name)))

    async def list(self) -> list[ExperimentView]:
        """Every experiment but those that no longer parse (logged and counted: one must not hide the rest)."""
        views = []
        for record in await self._store.experiments():
            try:
                spec = _spec_of(record)
            except SpecInvalid as error:
                log.warning("ListExperiments skips %s: %s", record.name, error.message)
                self._metrics.spec_invalid()
                continue
            views.append(ExperimentView(record, spec, tuple(await self._store.trials(record.name))))
        return views

    async def trials(self, name: str) -> list[TrialRecord]:
        await self._store.experiment(name)
        return await self._store.trials(name)

    async def stop_experiment(self, name: str) -> ExperimentView:
        """Raises: NotFound. FailedPrecondition: it has ended."""
        def stop(record: ExperimentRecord) -> ExperimentRecord:
            if record.state is not ExperimentState.RUNNING:
                raise FailedPrecondition(f"experiment {name!r} is {record.state.value}, not running; nothing to stop")
            return record.changed(state=ExperimentState.STOPPED, reason="Stopped", message="Stopped by a user",
                                  completed_at=time.time())

        await self._change(name, stop)
        await self._nudge(name)  # wakes the run, which kills the running trials
        return await self.get(name)

    async def resume(self, name: str, max_trial_count: int = 0) -> ExperimentView:
        """Raises: NotFound. InvalidArgument: a budget below the trials run (a STOPPED one), or not above
        them (a restarted one). FailedPrecondition: Katib's rule."""
        record = await self._store.experiment(name)
        spec = _spec_of(record)
        trials = await self._store.trials(name)
        if max_trial_count < 0:
            raise InvalidArgument("max_trial_count", f"must be >= 0, but got {max_trial_count}")
        new_max = max_trial_count or record.max_trial_count
        if record.state is ExperimentState.RUNNING:
            raise FailedPrecondition(f"experiment {name!r} is running already")
        if record.state is ExperimentState.STOPPED and new_max < len(trials):
            raise InvalidArgument("max_trial_count", f"must be at least the experiment's {len(trials)} trials "
                                                     f"already run, but got {new_max}")
        if record.state is not ExperimentState.STOPPED:
            restartable = (record.state is ExperimentState.SUCCEEDED and record.reason == "MaxTrialsReached"
                           and spec.resume_policy in (ResumePolicy.LONG_RUNNING, ResumePolicy.FROM_VOLUME))
            if not restartable:
                raise FailedPrecondition(
                    f"experiment {name!r} is {record.state.value} ({record.reason}) with resumePolicy "
                    f"{spec.resume_policy.value}: only an experiment that succeeded by reaching maxTrialCount with "
                    f"resumePolicy LongRunning or FromVolume can be restarted")
            if new_max <= len(trials):
                raise InvalidArgument("max_trial_count", f"must be greater than the experiment's {len(trials)} "
                                                         f"trials to restart it, but got {new_max}")
        def resumed(current: ExperimentRecord) -> ExperimentRecord:
            if current.state is not record.state:
                raise FailedPrecondition(f"experiment {name!r} changed to {current.state.value} meanwhile; try again")
            return current.changed(state=ExperimentState.RUNNING, reason="Resumed", max_trial_count=new_max,
                                   message=f"Resumed to maxTrialCount {new_max}", completed_at=None)

        await self._change(name, resumed)
        await self._nudge(name)
        return await self.get(name)

    async def delete(self, name: str) -> None:
        """Kill the running trials' jobs, then delete the experiment, its trials and its journal, then
        the trials' model folders.

        An experiment that no longer parses is deleted too (its trials' jobs cancelled as any others).

        Raises: NotFound. FailedPrecondition: this replica does not lead, and the experiment runs or
            has trials that have not ended (its loop is the leader's).
        """
        record = await self._store.experiment(name)
        spec = _spec_or_none(record)
        task = self._runs.get(name)
        if task is not None:
            await _cancel([task])  # its end releases its entries
        trials = await self._store.trials(name)
        if not self.leading:
            running = [t.job_id for t in trials if t.state not in TERMINAL_TRIALS]
            if record.state is ExperimentState.RUNNING or running:
                raise FailedPrecondition(
                    f"experiment {name!r} is {record.state.value} with {len(running)} trials not ended, and this "
                    f"replica does not lead the automl-controller: stop it (StopExperiment, on any replica), then "
                    f"delete it once its trials have ended, or retry: another replica may lead")
        for trial in trials:
            if trial.state not in TERMINAL_TRIALS and not (spec is not None and is_surrogate(spec)):
                await self._retrying(lambda t=trial: self._jobs.cancel(t.job_id), f"cancel {trial.job_id}")
        await self._store.delete(record)
        if self._folders is not None:
            await asyncio.to_thread(self._folders.remove, [trial.job_id for trial in trials])
        self._records.announce(record, spec, (), deleted=True)
        await self._records.count()
        if not self.leading and self._nudges is not None:
            await self._nudges.publish(EXPERIMENT, name)  # the leader's loop of it, if any, ends

    # -- the experiment's loop -------------------------------------------------------------------

    async def _run(self, name: str) -> None:
        try:
            await self._experiment(name)
        except asyncio.CancelledError:
            raise
        except NotFound:
            log.info("experiment %s: deleted; its loop ends", name)
        except NotLeader as error:
            log.info("experiment %s: its loop ends: %s", name, error.message)
        except Exception:
            self._failed.add(name)
            log.exception("experiment %s: its run failed; it is retried at the next start (or take-over, Stop, "
                          "Resume)", name)
        finally:  # a later launch (resume, restart) makes its own
            if self._runs.get(name) is asyncio.current_task():
                del self._runs[name], self._wake[name]

    async def _experiment(self, name: str) -> None:
        record = await self._store.experiment(name)
        try:
            spec = _spec_of(record)
        except SpecInvalid as error:
            log.error("experiment %s: %s", name, error.message)
            await self._change(name, functools.partial(_ended, state=ExperimentState.FAILED, reason="SpecInvalid",
                                                       message=error.message, bundle=""), fenced=True)
            return
        study = await asyncio.to_thread(ExperimentStudy, spec, redis_url=self._redis_url,
                                        journal_prefix=self._store.journal_prefix(record))
        runners: dict[int, asyncio.Task] = {}
        try:
            await self._loop(name, spec, study, runners)
        finally:  # the service stops: the trials' jobs go on, and are re-attached at the next start
            await _cancel(runners.values())
            study.close()

    async def _loop(self, name: str, spec: ExperimentSpec, study: ExperimentStudy,
                    runners: dict[int, asyncio.Task]) -> None:
        wake = self._wake[name]
        while True:
            wake.clear()
            for number in [n for n, task in runners.items() if task.done()]:
                error = runners.pop(number).exception()
                if error is not None:  # Redis or the orchestrator failed it; it is re-attached below
                    log.error("experiment %s trial %d: %s; re-attaching", name, number, error, exc_info=error)
                    await asyncio.sleep(self._retry_s)
            record = await self._store.experiment(name)
            spec = replace(spec, max_trial_count=record.max_trial_count)
            frozen = await asyncio.to_thread(study.trials)
            trials = {t.number: t for t in await self._store.trials(name)}
            for ft in frozen:
                if ft.number not in trials:  # asked as the controller died: maybe not every parameter stored
                    ft = await asyncio.to_thread(study.completed, ft)
                trial = trials.get(ft.number) or await self._adopt(record, spec, ft)
                if ft.state.is_finished() and trial.state not in TERMINAL_TRIALS and ft.number not in runners:
                    # told, but its record not saved (a restart in between); a live runner saves its own
                    trial = await self._finished_from_optuna(record, spec, trial, ft)
                trials[ft.number] = trial
                if ft.state is OptunaState.RUNNING and ft.number not in runners:
                    runners[ft.number] = self._run_trial(spec, study, trial)
            if record.state is ExperimentState.STOPPED:
                if not runners:
                    return
                await self._kill(study, trials, runners, surrogate=is_surrogate(spec))
            else:
                ended = self._outcome(spec, list(trials.values()), len(frozen))
                if ended is None and not runners and len(frozen) < spec.max_trial_count \
                        and await asyncio.to_thread(study.search_space_exhausted):
                    ended = (ExperimentState.SUCCEEDED, "SuggestionEndReached",
                             "Experiment has succeeded because the grid has no combination left")
                if ended is not None:
                    if runners:
                        await self._kill(study, trials, runners, surrogate=is_surrogate(spec))
                        continue
                    state, reason, message = ended
                    bundle, message = await self._commit_best(record, spec, list(trials.values()), message)
                    final = await self._change(name, functools.partial(
                        _ended, state=state, reason=reason, message=message, bundle=bundle), spec, fenced=True)
                    if final.state is not ExperimentState.RUNNING and final.reason == reason:
                        return
                    continue  # stopped or resumed to more trials meanwhile
                asked = len(frozen)
                while len(runners) < spec.parallel_trial_count and asked < spec.max_trial_count:
                    self._check_leading()  # the journal's appends are not fenced: never ask as a deposed leader
                    started = time.perf_counter()
                    number, params = await asyncio.to_thread(study.ask, lambda n, r=record: self._job_id(r, n))
                    self._metrics.asked(time.perf_counter() - started)
                    trial = await self._adopt(record, spec, None, number=number, params=params)
                    trials[number] = trial
                    runners[number] = self._run_trial(spec, study, trial)
                    asked += 1
                if record.reason != "Running" and runners:
                    record = await self._change(name, lambda r: r.changed(
                        reason="Running", message="Experiment is running") if r.state is ExperimentState.RUNNING
                        and r.reason != "Running" else None, spec, fenced=True)
            woken = asyncio.ensure_future(wake.wait())
            await asyncio.wait([woken, *runners.values()], return_when=asyncio.FIRST_COMPLETED)
            await cancel_and_wait(woken)

    async def _commit_best(self, record: ExperimentRecord, spec: ExperimentSpec, trials: list[TrialRecord],
                           message: str) -> tuple[str, str]:
        """Commit the model the best trial uploaded, when the experiment asks for one (``spec.model``):
        the bundle's name ('' when none) and the experiment's message saying so (or why it was not)."""
        best = convert.best_trial(spec, trials)
        policy = spec.model
        if self._models is None or policy is None or not policy.commit or best is None or record.best_model_bundle:
            return record.best_model_bundle, message
        self._check_leading()
        try:
            bundle = await self._retrying(lambda: self._models.commit_best(  # type: ignore[union-attr]
                record, best, policy, objective=spec.objective.metric, algorithm=spec.algorithm.name),
                "commit the model")
        except ModelRefused as error:
            self._metrics.model_refused()
            return "", f"{message}; the best trial's model was refused: {error.message}"
        except OpmlError as error:
            return "", f"{message}; the best trial's model was not committed: {error.message}"
        return bundle, f"{message}; best model committed as {bundle}"

    def _outcome(self, spec: ExperimentSpec, trials: list[TrialRecord],
                 asked: int) -> tuple[ExperimentState, str, str] | None:
        """Katib's UpdateExperimentStatusCondition, in its order."""
        succeeded = [t.objective_value for t in trials if t.state is TrialState.SUCCEEDED
                     and t.objective_value is not None]
        if succeeded and spec.objective.target is not None:
            best = min(succeeded) if spec.objective.goal.value == "minimize" else max(succeeded)
            if spec.objective.reached(best):
                return (ExperimentState.SUCCEEDED, "GoalReached",
                        f"Experiment has succeeded because Objective goal has reached ({spec.objective.metric} "
                        f"{best:g}, goal {spec.objective.target:g})")
        failed = [t for t in trials if t.state is TrialState.FAILED]
        if spec.max_failed_trial_count is not None and len(failed) > spec.max_failed_trial_count:
            return (ExperimentState.FAILED, "MaxFailedTrialsReached",
                    f"Experiment has failed because max failed count has reached ({len(failed)} failed trials > "
                    f"maxFailedTrialCount {spec.max_failed_trial_count}); last error: {failed[-1].message}")
        completed = [t for t in trials if t.state in TERMINAL_TRIALS]
        if len(completed) >= spec.max_trial_count:
            return (ExperimentState.SUCCEEDED, "MaxTrialsReached",
                    "Experiment has succeeded because max trial count has reached")
        return None

    async def _kill(self, study: ExperimentStudy, trials: dict[int, TrialRecord],
                    runners: dict[int, asyncio.Task], *, surrogate: bool = False) -> None:
        """Cancel the running trials' jobs (each trial then ends KILLED) and wait for their tasks
        (``surrogate``: no jobs; the trials' predictions end them)."""
        for number, task in list(runners.items()):
            if surrogate:  # no job to cancel: its prediction ends it in a moment
                continue
            if not task.done() and await asyncio.to_thread(study.mark, number, END_ATTR, "killed"):
                await self._retrying(lambda n=number: self._jobs.cancel(trials[n].job_id), "cancel")
        await asyncio.gather(*runners.values(), return_exceptions=True)
        runners.clear()

    # -- trials ----------------------------------------------------------------------------------

    @staticmethod
    def _job_id(record: ExperimentRecord, number: int) -> str:
        return f"{record.name}-{record.uid}-t{number}"

    async def _adopt(self, record: ExperimentRecord, spec: ExperimentSpec, ft: FrozenTrial | None, *,
                     number: int | None = None, params: dict[str, Any] | None = None) -> TrialRecord:
        """The record of a trial Optuna has (asked now, or before a restart that lost its record)."""
        if ft is not None:
            number, params = ft.number, {**ft.params, **fixed_parameters(spec)}
        assert number is not None and params is not None
        trial = TrialRecord(experiment=record.name, number=number, job_id=self._job_id(record, number),
                            parameters={k: parameter_text(v) for k, v in params.items()})
        await self._records.save_trial(trial)
        return trial

    async def _finished_from_optuna(self, record: ExperimentRecord, spec: ExperimentSpec, trial: TrialRecord,
                                    ft: FrozenTrial) -> TrialRecord:
        """A trial told to Optuna whose record did not follow (a restart in between, or its runner
        failed after the tell). The objective's series is rebuilt from the values reported to Optuna
        (the other metrics' series are not in Optuna); a record its runner saved meanwhile wins."""
        end = ft.user_attrs.get(END_ATTR)
        if ft.state is OptunaState.COMPLETE:
            trial = replace(trial, state=TrialState.SUCCEEDED, objective_value=ft.value)
        elif ft.state is OptunaState.PRUNED:
            trial = replace(trial, state=TrialState.EARLY_STOPPED)
        else:
            trial = replace(trial, state=TrialState.KILLED if end == "killed" else TrialState.FAILED,
                            message=str(ft.user_attrs.get(ERROR_ATTR, trial.message)))
        objective = spec.objective.metric
        reported = [value for _, value in sorted(ft.intermediate_values.items())]
        if len(reported) > len(trial.observations.get(objective, ())):
            trial = replace(trial, observations={**trial.observations, objective: reported})
        trial = replace(trial, ended_at=trial.ended_at or time.time())
        stored = await self._store.put_trial_unless_ended(trial)
        if stored is trial:
            self._records.announce_trial(trial)
            if self._grants is not None:
                self._grants.ended(trial)
        return stored

    def _run_trial(self, spec: ExperimentSpec, study: ExperimentStudy, trial: TrialRecord) -> asyncio.Task:
        runner = TrialRunner(self._trial_services, spec, study, trial)
        return asyncio.create_task(runner.run(), name=f"trial {trial.job_id}")

    async def _retrying(self, call: Callable[[], Any], what: str) -> Any:
        return await retrying(call, what, retry_s=self._retry_s)

    # -- saving ----------------------------------------------------------------------------------

    def _check_leading(self) -> None:
        """Raises: NotLeader: a step that only the leader may take, and this replica no longer leads."""
        if self._lease is not None:
            _ = self._lease.token

    async def _change(self, name: str, change: Callable[[ExperimentRecord], ExperimentRecord | None],
                      spec: ExperimentSpec | None = None, *, fenced: bool = False) -> ExperimentRecord:
        """Change the experiment's record by compare-and-set, then announce it (an API call on any
        replica and the leader's loop never overwrite each other's change); ``change`` returns None
        for no change. ``fenced``: the loop's changes, made only while this replica leads.

        Raises: NotFound. NotLeader: ``fenced``, and the lease moved on.
        """
        record, changed = await self._store.change_experiment(name, change, fenced=fenced)
        if changed:
            await self._records.announce_saved(record, spec or _spec_or_none(record))
        return record


def _ended(record: ExperimentRecord, *, state: ExperimentState, reason: str, message: str,
           bundle: str) -> ExperimentRecord | None:
    """The record of an experiment that ended, unless it was stopped or resumed meanwhile."""
    if record.state is not ExperimentState.RUNNING:
        return None
    return record.changed(state=state, reason=reason, message=message, completed_at=time.time(),
                          best_model_bundle=bundle or record.best_model_bundle)


async def _cancel(tasks: Iterable[asyncio.Task]) -> None:
    """:func:`~opml_common.lifecycle.cancel_and_wait`, again every 0.5 s while a task goes on: the
    Redis client's timeouts (``asyncio.timeout``) can swallow a cancel that lands inside them. A
    task's own error is logged (each one's), not raised: the others are stopped all the same."""
    tasks = list(tasks)
    while pending := [task for task in tasks if not task.done()]:
        try:
            await asyncio.wait_for(cancel_and_wait(*pending), 0.5)
        except TimeoutError:
            continue  # one goes on: its cancel was swallowed
        except Exception:  # a task's error: each one is logged below
            pass
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended with an error", task.get_name(), exc_info=task.exception())


