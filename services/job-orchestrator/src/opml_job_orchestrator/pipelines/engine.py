"""Pipelines and their runs: apply, trigger, one run at a time per pipeline, resume after a restart.

:class:`PipelineEngine` imports no transport: the gRPC servicer and the triggers (bundle and alert
events, schedules) call it. A request for a run while one is going is kept (in Redis) and
coalesces with every other such request into one more run after it: triggers never queue up N
runs. At start, every run that was going is resumed where its record stood (:class:`~.runner.Runner`),
and a run asked for while the service was down is started.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

from opml.jobs.v1 import pipeline_events_pb2 as events
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_common.bus import is_retriable
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, OpmlError
from opml_common.events import EventEmitter
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.retry import Backoff
from opml_job_orchestrator.pipelines import anomalies, evaluation
from opml_job_orchestrator.pipelines.dag import Plan
from opml_job_orchestrator.pipelines.metrics import PipelineMetrics
from opml_job_orchestrator.pipelines.runner import ENDED, PASSED, Runner, plain
from opml_job_orchestrator.pipelines.store import RunStore
from opml_job_orchestrator_contract.names import pipeline_name, run_name
from opml_job_orchestrator_contract.pipelinespec import pipeline_violations

logger = logging.getLogger(__name__)

_BACKOFF = Backoff(base_s=0.5, max_s=30.0)
MAX_REASON = 500


def step_program_violations(spec: pb.PipelineSpec) -> list[tuple[str, str]]:
    """The validate steps' thresholds and the evaluate steps' configs checked with the step program's
    own rules, so a setting it would refuse is refused at apply, every one with its path."""
    problems: list[str] = []
    for index, step in enumerate(spec.steps):
        if step.kind == pb.STEP_KIND_VALIDATE and step.validate.thresholds.fields:
            problems += anomalies.threshold_errors(plain(step.validate.thresholds), f"steps[{index}].validate.thresholds")
        elif step.kind == pb.STEP_KIND_EVALUATE:
            problems += evaluation.config_errors(plain(step.evaluate.config), f"steps[{index}].evaluate")
    return [tuple(problem.split(": ", 1)) if ": " in problem else ("steps", problem) for problem in problems]


def rollout_violations(spec: pb.PipelineSpec) -> list[tuple[str, str]]:
    """A push step's rollout checked with the inference-router's own rules (its contract, in the
    ``pipelines`` extra), so a rollout the router would refuse is refused at apply, not after a run.

    Raises:
        FailedPrecondition: a push step has a rollout and the router's contract is not installed.
    """
    violations: list[tuple[str, str]] = []
    for index, step in enumerate(spec.steps):
        if step.kind != pb.STEP_KIND_PUSH or not step.push.rollout.fields:
            continue
        try:
            from opml_inference_router_contract.rollout_spec import RolloutSpec
        except ImportError:
            raise FailedPrecondition("a push step's rollout is checked with the inference-router's contract, "
                                     "which is not installed here: install opml-job-orchestrator[pipelines]") from None
        try:
            RolloutSpec.from_dict(plain(step.push.rollout))
        except InvalidArgument as error:
            violations += [(f"steps[{index}].push.rollout.{field}", rule) for field, rule in error.violations]
    return violations


def spec_hash(spec: pb.PipelineSpec) -> str:
    return hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()


class PipelineEngine(Component):
    """``runner`` executes runs; ``changed`` is called with a pipeline whenever its spec is applied or
    removed (the triggers re-read what to watch)."""

    def __init__(self, *, store: RunStore, runner: Runner, emitter: EventEmitter, metrics: PipelineMetrics,
                 changed: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._store, self._runner, self._emitter, self._metrics = store, runner, emitter, metrics
        self._changed = changed or (lambda: None)
        self._pipelines: dict[str, pb.Pipeline] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._saving: dict[str, asyncio.Lock] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    async def on_start(self) -> None:
        """Load every pipeline; resume the runs that were going; start the runs asked for meanwhile."""
        for pipeline in await self._store.pipelines():
            self._pipelines[pipeline.spec.name] = pipeline
        for name, pipeline in self._pipelines.items():
            if pipeline.active_run:
                logger.info("resuming run %d of pipeline %s", pipeline.active_run, name)
                self._spawn(name, pipeline.active_run)
            elif pipeline.run_pending:
                async with self._lock(name):
                    await self._start_next(name)
        self._changed()

    async def on_stop(self) -> None:
        """Stop driving runs (their jobs go on in the orchestrator; the runs resume at the next start)."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            await cancel_and_wait(task)

    def pipelines(self) -> list[pb.Pipeline]:
        return [self._pipelines[name] for name in sorted(self._pipelines)]

    # -- requests ------------------------------------------------------------------------------

    async def apply(self, spec: pb.PipelineSpec, *, principal: str) -> pb.Pipeline:
        """Create or replace a pipeline. A run going on keeps the spec it started with.

        Raises:
            InvalidArgument: every rule the spec breaks, at once.
        """
        violations = pipeline_violations(spec) + step_program_violations(spec) + rollout_violations(spec)
        if violations:
            raise InvalidArgument.of(violations)
        async with self._lock(spec.name):
            pipeline = self._pipelines.get(spec.name)
            if pipeline is None:  # a run going on works on its own copy: the live record is changed in place
                pipeline = pb.Pipeline(name=pipeline_name(spec.name))
                pipeline.create_time.GetCurrentTime()
            pipeline.spec.CopyFrom(spec)
            pipeline.update_time.GetCurrentTime()
            pipeline.applied_by = principal
            await self._save_pipeline(pipeline)
            self._pipelines[spec.name] = pipeline
        self._changed()
        return pipeline

    def get(self, name: str) -> pb.Pipeline:
        """Raises: NotFound."""
        pipeline = self._pipelines.get(name)
        if pipeline is None:
            raise NotFound(f"pipeline {name!r} does not exist; `opml pipeline ls` lists them")
        return pipeline

    async def delete(self, name: str) -> None:
        """Raises: NotFound; FailedPrecondition while a run is going."""
        async with self._lock(name):
            pipeline = self.get(name)
            if pipeline.active_run:
                raise FailedPrecondition(f"pipeline {name!r} has run {pipeline.active_run} going; "
                                         "delete it once the run ended")
            await self._store.delete_pipeline(name)
            del self._pipelines[name]
        self._changed()

    async def trigger(self, name: str, source: str, about: str = "") -> tuple[int, bool]:
        """Ask for a run of ``name`` because of ``source`` (rpc, span, alert, schedule) ``about`` something.

        Returns: (the run started, False), or (0, True) when a run is going and this request
        coalesced into the one run that follows it.

        Raises:
            NotFound: no such pipeline.
        """
        trigger = f"{source}: {about}" if about else source
        async with self._lock(name):
            pipeline = self.get(name)
            if pipeline.active_run:
                await self._store.add_pending(name, trigger)
                if not pipeline.run_pending:
                    pipeline.run_pending = True
                    await self._save_pipeline(pipeline)
                self._metrics.triggers.labels(source, "coalesced").inc()
                return 0, True
            await self._store.add_pending(name, trigger)
            number = await self._start_next(name)
            self._metrics.triggers.labels(source, "started").inc()
            return number, False

    async def runs(self, name: str) -> list[pb.PipelineRun]:
        self.get(name)
        return await self._store.runs(name)

    async def run(self, name: str, number: int) -> pb.PipelineRun:
        self.get(name)
        found = await self._store.run(name, number)
        if found is None:
            raise NotFound(f"pipeline {name!r} has no run {number}")
        return found

    async def force_bless(self, name: str, number: int, *, principal: str, reason: str) -> pb.PipelineRun:
        """Bless run ``number``'s model over its evaluation's verdict (an admin's decision, audited: a
        blessing record naming who, when and why, a PipelineBlessingForced event, a log line). A push
        step the verdict skipped runs then.

        Raises:
            InvalidArgument: no reason, or one too long.
            NotFound: no such pipeline or run.
            FailedPrecondition: the run is going, has no evaluated model, is blessed already, or
                another run is going (its push would race this one).
        """
        reason = reason.strip()
        if not reason or len(reason) > MAX_REASON:
            raise InvalidArgument("reason", f"must say why, in 1 to {MAX_REASON} characters, but has {len(reason)}")
        async with self._lock(name):
            pipeline = self.get(name)
            run = await self.run(name, number)
            if pipeline.active_run:
                raise FailedPrecondition(f"run {pipeline.active_run} of pipeline {name!r} is going; force the "
                                         "blessing once it ended")
            if run.blessed:
                raise FailedPrecondition(f"run {number} of pipeline {name!r} is blessed already")
            planned = _planned(pipeline, run)
            plan = Plan.of(planned.spec)
            bless = plan.step_of(pb.STEP_KIND_BLESS)
            steps = {s.step: s for s in run.steps}
            evaluate = plan.input_of(bless, pb.STEP_KIND_EVALUATE) if bless else None
            if bless is None or evaluate not in steps or steps[evaluate].state not in PASSED:
                raise FailedPrecondition(f"run {number} of pipeline {name!r} has no evaluated model to bless "
                                         f"(its evaluate step did not succeed)")
            record = await self._runner.write_blessing(
                planned, run, steps[bless], blessed=True, reasons=[f"forced by {principal}: {reason}"],
                metrics={}, update=self._update, forced={"principal": principal, "reason": reason})
            steps[bless].state = pb.STEP_STATE_SUCCEEDED
            steps[bless].decision = f"blessed by {principal} (forced): {reason}"
            reopened = [s for s in run.steps if s.step in plan.downstream(bless) and s.state == pb.STEP_STATE_SKIPPED]
            for step in reopened:
                step.state = pb.STEP_STATE_PENDING
                step.message = ""
            if reopened:
                run.state = pb.RUN_STATE_RUNNING
                pipeline.active_run = number
                await self._save_pipeline(pipeline)
            await self._store.save_run(run)
            logger.warning("blessing forced", extra={"pipeline": name, "run": number, "principal": principal,
                                                     "reason": reason, "record": record.uuid})
            self._metrics.forced.inc()
            self._emitter.emit(events.PipelineBlessingForced(run=run, principal=principal, reason=reason,
                                                             record=record.uuid), subject=name)
            if reopened:
                self._spawn(name, number)
            return run

    # -- driving runs --------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _save_pipeline(self, pipeline: pb.Pipeline) -> None:
        """Write the live record as it stands now, after any write of it under way: a run's steps going
        side by side (a schema, a blessed model) and a trigger change it concurrently."""
        async with self._saving.setdefault(pipeline.spec.name, asyncio.Lock()):
            await self._store.save_pipeline(pipeline)

    async def _start_next(self, name: str) -> int:
        """Start a run for what is pending (the caller holds the pipeline's lock)."""
        pipeline = self._pipelines[name]
        number = await self._store.next_run_number(name)
        run = pb.PipelineRun(name=run_name(name, number), pipeline=name, number=number, state=pb.RUN_STATE_RUNNING,
                             triggers=await self._store.pending(name), spec_hash=spec_hash(pipeline.spec),
                             spec=pipeline.spec)
        run.create_time.GetCurrentTime()
        plan = Plan.of(pipeline.spec)
        for step_name in plan.order:
            run.steps.add(step=step_name, kind=plan.steps[step_name].kind, state=pb.STEP_STATE_PENDING)
        await self._store.save_run(run)
        pipeline.active_run = number
        pipeline.last_run = number
        pipeline.run_pending = False
        await self._save_pipeline(pipeline)
        await self._store.clear_pending(name)
        self._emitter.emit(events.PipelineRunStarted(run=run), subject=name)
        self._spawn(name, number)
        return number

    def _spawn(self, name: str, number: int) -> None:
        self._metrics.active.inc()
        task = asyncio.create_task(self._drive(name, number), name=f"pipeline {name} run {number}")
        self._tasks[name] = task

    async def _drive(self, name: str, number: int) -> None:
        """Carry run ``number`` to its end (waiting and trying again, from where its record stands, while
        the bundle-store or Redis is away: a retriable error), then start the coalesced next run, if
        one was asked for. Anything else ends the run, failed, with its cause."""
        try:
            failures = 0
            while True:
                try:
                    run = await self._store.run(name, number)
                    if run is None or run.state != pb.RUN_STATE_RUNNING:
                        break
                    pipeline = _planned(self._pipelines[name], run)
                    await self._runner.execute(pipeline, run, update=self._update)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - what is not retriable ends the run, with its cause
                    if not is_retriable(exc):
                        logger.exception("run %d of pipeline %s cannot go on", number, name)
                        cause = str(exc) if isinstance(exc, OpmlError) else (
                            f"the engine failed ({type(exc).__name__}); see its log")
                        await self._fail(name, number, cause)
                        break
                    logger.warning("run %d of pipeline %s waits for the bundle-store or Redis: %s", number, name, exc)
                await asyncio.sleep(_BACKOFF.delay(failures))
                failures += 1
            async with self._lock(name):
                pipeline = self._pipelines.get(name)
                if pipeline is None:
                    return
                pipeline.active_run = 0
                await self._save_pipeline(pipeline)
                if pipeline.run_pending:
                    self._tasks.pop(name, None)
                    await self._start_next(name)
        finally:
            self._metrics.active.dec()

    async def _update(self, name: str, fields: dict) -> None:
        """Set fields of the live pipeline record (a run's blessed model, its schema) and keep them."""
        pipeline = self._pipelines.get(name)
        if pipeline is None:
            return
        for field, value in fields.items():
            setattr(pipeline, field, value)
        await self._save_pipeline(pipeline)

    async def _fail(self, name: str, number: int, message: str) -> None:
        run = await self._store.run(name, number)
        if run is None:
            return
        for step in run.steps:
            if step.state not in ENDED:
                step.state = pb.STEP_STATE_FAILED
                step.message = message
        run.state = pb.RUN_STATE_FAILED
        run.message = message
        run.end_time.GetCurrentTime()
        await self._store.save_run(run)
        self._metrics.runs.labels("failed").inc()
        self._emitter.emit(events.PipelineRunFinished(run=run), subject=name)


def _planned(pipeline: pb.Pipeline, run: pb.PipelineRun) -> pb.Pipeline:
    """A copy of ``pipeline`` for ``run`` to work on, with the spec the run was planned from."""
    copy = pb.Pipeline()
    copy.CopyFrom(pipeline)
    copy.spec.CopyFrom(run.spec)
    return copy
