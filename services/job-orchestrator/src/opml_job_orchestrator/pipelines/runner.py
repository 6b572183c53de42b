"""One pipeline run, step by step, durably: every decision is written to the run store before it
is acted on, so a run interrupted anywhere (the service SIGKILLed) resumes where it stood.

Every step whose inputs have all ended starts, in the plan's order, beside the others (at most
``max_parallel_steps`` at once; validate steps one at a time, since they read and may set the
pipeline's schema): a step already ended is passed over (a resumed run); a step one of whose inputs
failed or was skipped is skipped; otherwise its cache key is computed from the content hashes of
what it reads (:mod:`.cache`), and an earlier successful run's outputs for that key are reused
(CACHED, the decision recorded); else it runs. The run's record is one document: its writes are
serialized, each carrying every step's state as it stands, so steps ending side by side never
write over each other. A step that runs a job records the
job's id before submitting it, and on resume re-attaches to that job (the orchestrator keeps it),
so no step's job completes twice; outputs are found by their tags before they are added, so none
is added twice either.

Each step's output is a bundle with lineage to its inputs: the spans (ingest reads, writes nothing),
statistics per span and the schema (validate), the model (train), the evaluation with its
reference set (evaluate), the blessing record (bless, every run), the serving bundle (push, blessed
models only, committed in one call).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from google.protobuf.json_format import MessageToDict
from opml.bundles.v1 import bundles_pb2
from opml.jobs.v1 import pipeline_events_pb2 as events
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_common.errors import FailedPrecondition, OpmlError
from opml_common.events import EventEmitter
from opml_job_orchestrator.orchestrator import JobState
from opml_job_orchestrator.pipelines import folders, spans
from opml_job_orchestrator.pipelines.bundles import CREATOR, BundleIO, output_tags
from opml_job_orchestrator.pipelines.cache import cache_key, code_version
from opml_job_orchestrator.pipelines.dag import Plan
from opml_job_orchestrator.pipelines.metrics import PipelineMetrics
from opml_job_orchestrator.pipelines.stepjobs import monitoring_with_segment
from opml_job_orchestrator.pipelines.steps import StepJobs, job_id, platform_step_job, train_job
from opml_job_orchestrator.pipelines.store import RunStore
from opml_job_orchestrator.scheduler.model import Resources
from opml_job_orchestrator_contract.pipelinespec import KIND_NAMES

logger = logging.getLogger(__name__)

ENDED = frozenset({pb.STEP_STATE_SUCCEEDED, pb.STEP_STATE_CACHED, pb.STEP_STATE_FAILED, pb.STEP_STATE_SKIPPED})
PASSED = frozenset({pb.STEP_STATE_SUCCEEDED, pb.STEP_STATE_CACHED})
_OUTCOME = {pb.STEP_STATE_SUCCEEDED: "ran", pb.STEP_STATE_CACHED: "cached", pb.STEP_STATE_FAILED: "failed",
            pb.STEP_STATE_SKIPPED: "skipped"}
MAX_RESULT_DETAIL = 64 * 1024


class StepFailed(OpmlError):
    """The step could not produce its outputs (its job failed, its outputs were refused, validation
    found anomalies); the run fails with this message."""

    code = "FAILED_PRECONDITION"


def run_context(spec: pb.PipelineSpec) -> str:
    """The bundle-store context of a pipeline's outputs."""
    return spec.context or f"pipeline-{spec.name}"


def input_signature(span_folder: Path) -> str:
    """What a model trained on these spans takes: the header row of the first CSV file of the
    newest span (columns in order), as a sha256. Equal signatures: a warm start can load the model."""
    for path in sorted(span_folder.rglob("*.csv")):
        with path.open("rb") as handle:
            header = handle.readline(64 * 1024).strip()
        return hashlib.sha256(header).hexdigest()
    return ""


Update = Callable[[str, dict[str, Any]], Awaitable[None]]
"""``update(pipeline, {field: value})``: set fields of the pipeline's record (its blessed model, its schema)."""


@dataclass
class _Run:
    pipeline: pb.Pipeline
    run: pb.PipelineRun
    plan: Plan
    update: Update
    saving: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while the run's record is written: steps going side by side save it one at a time."""

    async def set(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self.pipeline, name, value)
        await self.update(self.name, fields)

    @property
    def name(self) -> str:
        return self.pipeline.spec.name

    def step(self, name: str) -> pb.StepRun:
        return next(s for s in self.run.steps if s.step == name)

    def outputs(self, name: str, role: str) -> list[pb.StepOutput]:
        return [o for o in self.step(name).outputs if o.role == role]


class Runner:
    """Executes runs. ``work_dir`` is where steps' folders are made (readable by jobs), ``staging_dir``
    the service's own folder where what jobs wrote is copied before it is read; ``submitter`` the
    principal steps' jobs are submitted as; ``max_parallel_steps`` how many of a run's steps may go at once."""

    def __init__(self, *, store: RunStore, bundles: BundleIO, jobs: StepJobs, emitter: EventEmitter,
                 metrics: PipelineMetrics, work_dir: Path, staging_dir: Path, step_resources: Resources,
                 submitter: str = "job-orchestrator/pipelines", max_parallel_steps: int = 4) -> None:
        if max_parallel_steps < 1:
            raise ValueError(f"max_parallel_steps must be at least 1, but is {max_parallel_steps}")
        self._store, self._bundles, self._jobs, self._emitter = store, bundles, jobs, emitter
        self._metrics = metrics
        self._work_dir, self._staging_dir = work_dir, staging_dir
        self._step_resources = step_resources
        self._submitter = submitter
        self._max_parallel_steps = max_parallel_steps

    async def execute(self, pipeline: pb.Pipeline, run: pb.PipelineRun, *, update: Update) -> pb.PipelineRun:
        """Carry ``run`` (RUNNING, saved) to its end; return it ended (saved, announced). ``pipeline`` is
        the runner's own copy; what the run changes of the pipeline (its blessed model, its schema) goes
        to ``update`` too, which keeps it."""
        state = _Run(pipeline, run, Plan.of(pipeline.spec), update)
        waiting = [name for name in state.plan.order if state.step(name).state not in ENDED]
        going: dict[asyncio.Task[None], str] = {}
        try:
            while waiting or going:
                for name in list(waiting):
                    if len(going) >= self._max_parallel_steps:
                        break
                    if not self._ready(state, name, going.values()):
                        continue
                    waiting.remove(name)
                    blocked = [i for i in state.plan.steps[name].inputs if state.step(i).state not in PASSED]
                    if blocked:
                        await self._end_step(state, state.step(name), pb.STEP_STATE_SKIPPED, f"not run: input "
                                             f"{blocked[0]!r} {_state_word(state.step(blocked[0]).state)}")
                        continue
                    going[asyncio.create_task(self._step(state, state.step(name)),
                                              name=f"pipeline {state.name} run {run.number} step {name}")] = name
                if not going:
                    break  # every step left was skipped just now (the plan's order puts inputs first)
                done, _ = await asyncio.wait(going, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    del going[task]
                errors = [task.exception() for task in done if task.exception() is not None]
                if errors:  # the bundle-store or Redis away (the engine retries the run from its record), or a defect
                    raise errors[0]
        finally:  # stopped or retried: the steps still going stop as a restart stops them (their jobs go on)
            for task in going:
                task.cancel()
            await asyncio.gather(*going, return_exceptions=True)
        failed = [s.step for s in run.steps if s.state == pb.STEP_STATE_FAILED]
        run.state = pb.RUN_STATE_FAILED if failed else pb.RUN_STATE_SUCCEEDED
        run.message = f"step {failed[0]!r} failed: {state.step(failed[0]).message}" if failed else "done"
        run.end_time.GetCurrentTime()
        await self._save(state)
        for root in (self._work_dir, self._staging_dir):  # what the steps made is in bundles now
            shutil.rmtree(root / state.name / str(run.number), ignore_errors=True)
        self._metrics.runs.labels("failed" if failed else "succeeded").inc()
        self._emitter.emit(events.PipelineRunFinished(run=run), subject=state.name)
        return run

    @staticmethod
    def _ready(state: _Run, name: str, going: Any) -> bool:
        """Whether step ``name`` may start now: every input ended, and no other validate step going."""
        if any(state.step(i).state not in ENDED for i in state.plan.steps[name].inputs):
            return False
        return state.plan.steps[name].kind != pb.STEP_KIND_VALIDATE or all(
            state.plan.steps[other].kind != pb.STEP_KIND_VALIDATE for other in going)

    async def _step(self, state: _Run, step: pb.StepRun) -> None:
        """Carry one step to its end: ran, cached or failed (a retriable error is raised)."""
        started = time.monotonic()
        if not step.HasField("start_time"):
            step.start_time.GetCurrentTime()
        try:
            await self._STEPS[step.kind](self, state, step)
        except OpmlError as exc:
            if exc.retriable:
                raise
            await self._end_step(state, step, pb.STEP_STATE_FAILED, str(exc))
            return
        if step.state == pb.STEP_STATE_SUCCEEDED and step.kind != pb.STEP_KIND_INGEST:
            self._metrics.step_seconds.labels(KIND_NAMES[step.kind]).observe(time.monotonic() - started)
        await self._end_step(state, step, step.state, step.message)

    async def _save(self, state: _Run) -> None:
        """Write the run's record as it stands now, after any write already under way."""
        async with state.saving:
            await self._store.save_run(state.run)

    async def _end_step(self, state: _Run, step: pb.StepRun, to: int, message: str) -> None:
        step.state = to
        step.message = message
        step.end_time.GetCurrentTime()
        await self._save(state)
        self._metrics.steps.labels(KIND_NAMES[step.kind], _OUTCOME[to]).inc()
        self._emitter.emit(events.PipelineStepFinished(run=state.run, step=step.step), subject=state.name)

    async def _reuse(self, state: _Run, step: pb.StepRun, key: str) -> bool:
        """Take an earlier successful run's outputs for ``key``, if one has them."""
        step.cache_key = key
        entry = await self._store.cached(key)
        if entry is None:
            step.decision = "ran: no earlier run read the same content with the same spec and code"
            return False
        del step.outputs[:]
        step.outputs.extend(entry.outputs)
        step.details.update(entry.details)
        step.cached_from_run = entry.cached_from_run
        step.state = pb.STEP_STATE_CACHED
        step.decision = f"cached: run {entry.cached_from_run} read the same content with the same spec and code"
        return True

    async def _succeeded(self, state: _Run, step: pb.StepRun) -> None:
        step.state = pb.STEP_STATE_SUCCEEDED
        if step.cache_key:
            await self._store.save_cached(step.cache_key, step, state.run.number)

    # -- ingest -------------------------------------------------------------------------------

    async def _ingest(self, state: _Run, step: pb.StepRun) -> None:
        ingest = state.plan.steps[step.step].ingest
        try:
            found = spans.resolve(await self._bundles.list_committed(ingest.context, ingest.bundle_name), ingest)
        except FailedPrecondition as exc:
            raise StepFailed(str(exc)) from None
        del step.outputs[:]
        for bundle in found:
            step.outputs.add(role="span", context=bundle.context, uuid=bundle.uuid, content_hash=bundle.content_hash,
                             key=str(spans.span_number(bundle)))
        step.decision = "resolved spans " + ", ".join(o.key for o in step.outputs)
        step.state = pb.STEP_STATE_SUCCEEDED

    # -- validate -----------------------------------------------------------------------------

    async def _validate(self, state: _Run, step: pb.StepRun) -> None:
        spec = state.plan.steps[step.step]
        span_outputs = state.outputs(state.plan.input_of(step.step, pb.STEP_KIND_INGEST), "span")
        schema_hash = ""
        if state.pipeline.schema:
            schema_hash = (await self._bundles.get(run_context(state.pipeline.spec), state.pipeline.schema)).content_hash
        key = cache_key(spec, [("span", o.content_hash) for o in span_outputs] + [("schema", schema_hash)])
        if not step.job_id and await self._reuse(state, step, key):
            return
        step.cache_key = key
        known = await self._store.statistics(state.name, [o.content_hash for o in span_outputs])

        async def prepare(folder: Path) -> None:
            inputs = folder / "inputs"
            for output in span_outputs:
                if output.content_hash in known:
                    stats = known[output.content_hash]
                    await self._bundles.download(stats.context, stats.uuid, inputs / "statistics" / output.key)
                else:
                    await self._bundles.download(output.context, output.uuid, inputs / "spans" / output.key)
            if state.pipeline.schema:
                await self._bundles.download(run_context(state.pipeline.spec), state.pipeline.schema,
                                             inputs / "schema")
            label = spec.validate.label or None
            folders.write_json(folder / "step.json", {"spans": [o.key for o in span_outputs], "label": label,
                                                      "thresholds": plain(spec.validate.thresholds)})

        outputs, result = await self._platform_job(state, step, "validate", prepare)
        context = run_context(state.pipeline.spec)
        by_key = {o.key: o for o in span_outputs}
        del step.outputs[:]
        computed = [str(k) for k in result.get("computed", []) if str(k) in by_key]
        for span_key in [o.key for o in span_outputs]:
            span = by_key[span_key]
            if span_key in computed:
                files = _under(outputs, f"statistics/{span_key}/")
                bundle = await self._output(state, step, f"statistics-{span_key}", context,
                                            f"{state.name}-statistics", files, inputs=[span.uuid])
                stats = pb.StepOutput(role="statistics", context=context, uuid=bundle.uuid,
                                      content_hash=bundle.content_hash, key=span_key)
                await self._store.save_statistics(state.name, span.content_hash, stats)
            elif span.content_hash in known:
                stats = known[span.content_hash]
            else:
                continue
            step.outputs.add().CopyFrom(stats)
        also_key = None
        if result.get("schema_inferred") and (files := _under(outputs, "schema/")):
            bundle = await self._output(state, step, "schema", context, f"{state.name}-schema", files,
                                        inputs=[o.uuid for o in span_outputs])
            step.outputs.add(role="schema", context=context, uuid=bundle.uuid, content_hash=bundle.content_hash)
            await state.set(schema=bundle.uuid)
            # The same spans checked against the schema inferred from them pass the same way: the next
            # run, which has that schema, finds this result too.
            also_key = cache_key(spec, [("span", o.content_hash) for o in span_outputs]
                                 + [("schema", bundle.content_hash)])
        report = await self._output(state, step, "validation", context, f"{state.name}-validation",
                                    {"result.json": outputs["result.json"]},
                                    inputs=[o.uuid for o in step.outputs] + [o.uuid for o in span_outputs])
        step.outputs.add(role="validation", context=context, uuid=report.uuid, content_hash=report.content_hash)
        anomalies = result.get("anomalies") or []
        step.details["anomalies"] = str(len(anomalies))
        if not result.get("ok"):
            shown = "; ".join(str(a.get("message", a)) if isinstance(a, dict) else str(a) for a in anomalies[:5])
            raise StepFailed(f"validation found {len(anomalies)} anomalies: {shown}")
        await self._succeeded(state, step)
        if also_key is not None:
            await self._store.save_cached(also_key, step, state.run.number)

    # -- train --------------------------------------------------------------------------------

    async def _train(self, state: _Run, step: pb.StepRun) -> None:
        spec = state.plan.steps[step.step]
        span_outputs = state.outputs(state.plan.input_of(step.step, pb.STEP_KIND_INGEST), "span")
        folder = folders.step_folder(self._work_dir, state.name, state.run.number, step.step)
        fresh = not step.job_id or not self._jobs.known(step.job_id)
        if fresh:  # nothing submitted yet (or lost before the submit): prepare the folder from scratch
            folders.reset_folder(folder)
            for output in span_outputs:
                await self._bundles.download(output.context, output.uuid, folder / "spans" / output.key)
        signature = input_signature(folder / "spans" / span_outputs[-1].key)
        warm, why = await self._warm_start(state, spec.train, signature)
        trained_on = _digest([o.content_hash for o in span_outputs])
        if (not step.job_id and warm is not None and "trained_on" in warm.values
                and warm.values["trained_on"].string_value == trained_on):
            # The blessed model was trained on these very spans: training again from it adds nothing.
            del step.outputs[:]
            step.outputs.add(role="model", context=warm.context, uuid=warm.uuid, content_hash=warm.content_hash)
            step.cached_from_run = state.pipeline.blessed_run
            step.state = pb.STEP_STATE_CACHED
            step.decision = f"cached: the blessed model of run {state.pipeline.blessed_run} was trained on these spans"
            return
        key = cache_key(spec, [("span", o.content_hash) for o in span_outputs]
                        + [("warm_start", warm.content_hash if warm else "")])
        if not step.job_id and await self._reuse(state, step, key):
            step.details["start"], step.details["start_reason"] = ("warm" if warm else "cold"), why
            return
        step.cache_key = key
        step.details["start"], step.details["start_reason"] = ("warm" if warm else "cold"), why
        if fresh:
            if warm is not None:
                await self._bundles.download(warm.context, warm.uuid, folder / "warm_start")
                folders.open_to_jobs(folder / "warm_start")
            folders.open_to_jobs(folder / "spans")
            folders.make_folder(folder / "model", writable=True)
            _open_parents(folder, self._work_dir)
        if not step.job_id:
            step.job_id = job_id(state.name, state.run.number, step.step)
            step.state = pb.STEP_STATE_RUNNING
            await self._save(state)  # the job's id is kept before it is submitted
        job = train_job(step.job_id, spec.train, spans=folder / "spans", model_dir=folder / "model",
                        warm_start=(folder / "warm_start") if warm is not None else None,
                        labels=_labels(state, step))
        await self._await_job(step, job)
        outputs = self._copy_out(folder / "model", state, step)
        missing = [name for name in ("model.onnx", "model.yaml") if name not in outputs]
        if missing:
            raise StepFailed(f"the training job succeeded but wrote no {' nor '.join(missing)} in "
                             "OPML_PIPELINE_MODEL_DIR")
        bundle = await self._output(state, step, "model", run_context(state.pipeline.spec), f"{state.name}-model",
                                    outputs, inputs=[o.uuid for o in span_outputs] + ([warm.uuid] if warm else []),
                                    values={"input_signature": signature, "trained_on": trained_on})
        del step.outputs[:]
        step.outputs.add(role="model", context=bundle.context, uuid=bundle.uuid, content_hash=bundle.content_hash)
        await self._succeeded(state, step)

    async def _warm_start(self, state: _Run, train: pb.TrainConfig, signature: str
                          ) -> tuple[bundles_pb2.Bundle | None, str]:
        """The blessed model to start from, or None, and why (TFX warm-starts from the newest model,
        blessed or not; here only a blessed one whose input signature matches)."""
        if not train.warm_start:
            return None, "cold: warm_start is false"
        if not state.pipeline.blessed_model:
            return None, "cold: the pipeline has no blessed model yet"
        model = await self._bundles.get(run_context(state.pipeline.spec), state.pipeline.blessed_model)
        theirs = model.values["input_signature"].string_value if "input_signature" in model.values else ""
        if theirs != signature:
            return None, (f"cold: the blessed model of run {state.pipeline.blessed_run} was trained on other "
                          "columns (input signature differs)")
        return model, f"warm: from the blessed model of run {state.pipeline.blessed_run} ({model.uuid})"

    # -- evaluate -----------------------------------------------------------------------------

    async def _evaluate(self, state: _Run, step: pb.StepRun) -> None:
        spec = state.plan.steps[step.step]
        [candidate] = state.outputs(state.plan.input_of(step.step, pb.STEP_KIND_TRAIN), "model")
        span = state.outputs(state.plan.input_of(step.step, pb.STEP_KIND_INGEST), "span")[-1]
        context = run_context(state.pipeline.spec)
        if not step.job_id and candidate.uuid == state.pipeline.blessed_model:
            # The blessed model itself: its evaluation is the one that blessed it, never one against itself.
            blessing_run = await self._store.run(state.name, state.pipeline.blessed_run)
            evaluated = [s for s in (blessing_run.steps if blessing_run else []) if s.step == step.step
                         and s.state in PASSED and any(o.role == "evaluation" for o in s.outputs)]
            if evaluated:
                del step.outputs[:]
                step.outputs.extend(evaluated[0].outputs)
                step.details.update(evaluated[0].details)
                step.cached_from_run = state.pipeline.blessed_run
                step.state = pb.STEP_STATE_CACHED
                step.decision = (f"cached: the candidate is the blessed model; its evaluation is run "
                                 f"{state.pipeline.blessed_run}'s, which blessed it")
                return
        baseline = (await self._bundles.get(context, state.pipeline.blessed_model)
                    if state.pipeline.blessed_model else None)
        key = cache_key(spec, [("candidate", candidate.content_hash),
                               ("baseline", baseline.content_hash if baseline else ""), ("span", span.content_hash)])
        if not step.job_id and await self._reuse(state, step, key):
            return
        step.cache_key = key

        async def prepare(folder: Path) -> None:
            inputs = folder / "inputs"
            await self._bundles.download(candidate.context, candidate.uuid, inputs / "candidate")
            if baseline is not None:
                await self._bundles.download(baseline.context, baseline.uuid, inputs / "baseline")
            await self._bundles.download(span.context, span.uuid, inputs / "span")
            folders.write_json(folder / "step.json", plain(spec.evaluate.config))

        outputs, result = await self._platform_job(state, step, "evaluate", prepare)
        files = {"result.json": outputs["result.json"], **{p: f for p, f in outputs.items() if p.startswith("reference/")}}
        inputs = [candidate.uuid, span.uuid] + ([baseline.uuid] if baseline else [])
        bundle = await self._output(state, step, "evaluation", context, f"{state.name}-evaluation", files,
                                    inputs=inputs)
        del step.outputs[:]
        step.outputs.add(role="evaluation", context=context, uuid=bundle.uuid, content_hash=bundle.content_hash)
        step.details["blessed"] = "true" if result.get("blessed") else "false"
        step.details["result"] = json.dumps(result, sort_keys=True)[:MAX_RESULT_DETAIL]
        await self._succeeded(state, step)

    # -- bless --------------------------------------------------------------------------------

    async def _bless(self, state: _Run, step: pb.StepRun) -> None:
        evaluate = state.plan.input_of(step.step, pb.STEP_KIND_EVALUATE)
        result = json.loads(state.step(evaluate).details.get("result", "{}"))
        blessed = bool(result.get("blessed"))
        reasons = result.get("reasons") or []
        await self.write_blessing(state.pipeline, state.run, step, blessed=blessed, reasons=reasons,
                                  metrics=result.get("metrics") or {}, update=state.update, saving=state.saving)
        step.decision = "blessed" if blessed else "not blessed: " + "; ".join(map(str, reasons[:5]))
        step.state = pb.STEP_STATE_SUCCEEDED

    async def write_blessing(self, pipeline: pb.Pipeline, run: pb.PipelineRun, step: pb.StepRun, *, blessed: bool,
                             reasons: list[Any], metrics: dict[str, Any], update: Update,
                             forced: dict[str, str] | None = None, saving: asyncio.Lock | None = None
                             ) -> bundles_pb2.Bundle:
        """The run's blessing record (a bundle, blessed or not, with the reasons per threshold and slice);
        when blessed, the model becomes the pipeline's blessed model (warm starts, evaluation baseline).
        ``saving``: the lock of the run's record while the run goes (its other steps save it too)."""
        state = _Run(pipeline, run, Plan.of(pipeline.spec), update, saving or asyncio.Lock())
        evaluate = state.plan.input_of(step.step, pb.STEP_KIND_EVALUATE)
        [evaluation] = state.outputs(evaluate, "evaluation")
        [model] = state.outputs(state.plan.input_of(evaluate, pb.STEP_KIND_TRAIN), "model")
        record = {"pipeline": pipeline.spec.name, "run": run.number, "blessed": blessed, "reasons": reasons,
                  "metrics": metrics, "model": model.uuid, "evaluation": evaluation.uuid,
                  "forced": forced or None, "at": time.time()}
        role = "blessing-forced" if forced else "blessing"
        bundle = await self._output(state, step, role, run_context(pipeline.spec), f"{pipeline.spec.name}-blessing",
                                    {"blessing.json": json.dumps(record, indent=2, sort_keys=True).encode()},
                                    inputs=[model.uuid, evaluation.uuid],
                                    extra_tags={"blessed": "true" if blessed else "false"})
        step.outputs.add(role=role, context=bundle.context, uuid=bundle.uuid, content_hash=bundle.content_hash)
        step.details["blessed"] = "true" if blessed else "false"
        run.blessed = blessed
        if blessed:
            await state.set(blessed_model=model.uuid, blessed_run=run.number)
        await self._save(state)
        return bundle

    # -- push ---------------------------------------------------------------------------------

    async def _push(self, state: _Run, step: pb.StepRun) -> None:
        if not state.run.blessed:
            step.decision = "not pushed: the model is not blessed"
            step.state = pb.STEP_STATE_SKIPPED
            return
        push = state.plan.steps[step.step].push
        bless = state.plan.input_of(step.step, pb.STEP_KIND_BLESS)
        evaluate = state.plan.input_of(bless, pb.STEP_KIND_EVALUATE)
        [evaluation] = state.outputs(evaluate, "evaluation")
        [model] = state.outputs(state.plan.input_of(evaluate, pb.STEP_KIND_TRAIN), "model")
        key = cache_key(state.plan.steps[step.step], [("model", model.content_hash),
                                                      ("evaluation", evaluation.content_hash)])
        step.cache_key = key
        serving = await self._bundles.find(push.context, {"pipeline": state.name, "pipeline-output": "serving"})
        if serving is not None and serving.tags.get("pipeline-cache-key") == key:
            step.outputs.add(role="serving", context=serving.context, uuid=serving.uuid,
                             content_hash=serving.content_hash)
            step.cached_from_run = int(serving.tags.get("pipeline-run", "0"))
            step.decision = (f"cached: the serving bundle of run {step.cached_from_run} holds this model, "
                             "evaluation and rollout already")
            step.state = pb.STEP_STATE_CACHED
            return
        step.decision = "pushed: a new blessed model"
        staging = Path(tempfile.mkdtemp(prefix="push-", dir=self._staging_dir))
        try:
            await self._bundles.download(model.context, model.uuid, staging / "model")
            await self._bundles.download(evaluation.context, evaluation.uuid, staging / "evaluation")
            files: dict[str, Path | bytes] = {p.name: p for p in (staging / "model").iterdir() if p.is_file()}
            if push.model:
                _check_model_name(staging / "model" / "model.yaml", push.model)
            for name in ("reference.npz", "monitoring.yaml"):
                if (staging / "evaluation" / "reference" / name).is_file():
                    files[name] = staging / "evaluation" / "reference" / name
            if push.monitoring.segment:  # monitored per value of this request parameter too
                written = files.get("monitoring.yaml")
                files["monitoring.yaml"] = monitoring_with_segment(
                    written.read_bytes() if isinstance(written, Path) else None, push.monitoring.segment)
            if push.HasField("rollout") and push.rollout.fields:
                files["rollout.yaml"] = yaml.safe_dump(plain(push.rollout), sort_keys=False).encode()
            tags = dict(push.tags) or {"serve": "true"}
            tags["pipeline-cache-key"] = key
            blessing = state.outputs(bless, "blessing-forced") or state.outputs(bless, "blessing")
            bundle = await self._output(state, step, "serving", push.context, push.bundle_name or state.name, files,
                                        inputs=[model.uuid, evaluation.uuid] + [b.uuid for b in blessing[-1:]],
                                        extra_tags=tags)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        step.outputs.add(role="serving", context=bundle.context, uuid=bundle.uuid, content_hash=bundle.content_hash)
        step.state = pb.STEP_STATE_SUCCEEDED

    # -- shared -------------------------------------------------------------------------------

    async def _platform_job(self, state: _Run, step: pb.StepRun, kind: str, prepare: Callable
                            ) -> tuple[dict[str, Path], dict[str, Any]]:
        """Run the platform's step program for ``step`` over a folder ``prepare`` fills; return what it
        wrote (copied out) and its result.json."""
        folder = folders.step_folder(self._work_dir, state.name, state.run.number, step.step)
        if not step.job_id or not self._jobs.known(step.job_id):
            folders.reset_folder(folder)
            folders.make_folder(folder / "inputs")
            await prepare(folder)
            folders.open_to_jobs(folder)
            folders.make_folder(folder / "outputs", writable=True)
            _open_parents(folder, self._work_dir)
            if not step.job_id:
                step.job_id = job_id(state.name, state.run.number, step.step)
                step.state = pb.STEP_STATE_RUNNING
                await self._save(state)  # the job's id is kept before it is submitted
        await self._await_job(step, platform_step_job(step.job_id, kind, folder, self._step_resources,
                                                      _labels(state, step)))
        outputs = self._copy_out(folder / "outputs", state, step)
        return outputs, folders.read_result(self._staging_dir / state.name / str(state.run.number) / step.step)

    async def _await_job(self, step: pb.StepRun, job: Any) -> None:
        status = await self._jobs.run(job, submitter=self._submitter)
        if status.state is not JobState.SUCCEEDED:
            raise StepFailed(f"job {step.job_id} {status.state.value}: {status.cause or 'no cause given'}")

    def _copy_out(self, source: Path, state: _Run, step: pb.StepRun) -> dict[str, Path]:
        into = self._staging_dir / state.name / str(state.run.number) / step.step
        shutil.rmtree(into, ignore_errors=True)
        try:
            return folders.copy_out(source, into)
        except FileNotFoundError:
            raise StepFailed(f"the job of step {step.step!r} left no {source.name}/ folder") from None
        except folders.OutputRefused as exc:
            raise StepFailed(str(exc)) from None

    async def _output(self, state: _Run, step: pb.StepRun, role: str, context: str, bundle_name: str,
                      files: dict[str, Path | bytes], *, inputs: list[str], values: dict[str, str] | None = None,
                      extra_tags: dict[str, str] | None = None) -> bundles_pb2.Bundle:
        """Add (committed) the output ``role`` of ``step``, or find it when a resumed run added it already."""
        tags = output_tags(state.name, state.run.number, step.step, role)
        found = await self._bundles.find(context, tags)
        if found is not None and found.committed:
            return found
        lineage = bundles_pb2.Lineage(input_uuids=inputs, code_version=code_version(state.plan.steps[step.step]),
                                      creator=CREATOR, parameters={"pipeline": state.name,
                                                                   "run": str(state.run.number),
                                                                   "step": step.step, "cache_key": step.cache_key,
                                                                   "job": step.job_id})
        return await self._bundles.add(context, bundle_name, files, values=values, tags={**(extra_tags or {}), **tags},
                                       lineage=lineage, commit=True)

    _STEPS = {pb.STEP_KIND_INGEST: _ingest, pb.STEP_KIND_VALIDATE: _validate, pb.STEP_KIND_TRAIN: _train,
              pb.STEP_KIND_EVALUATE: _evaluate, pb.STEP_KIND_BLESS: _bless, pb.STEP_KIND_PUSH: _push}


def _check_model_name(config: Path, expected: str) -> None:
    """The model is served (and monitored, and alerted on) under model.yaml's ``name``: it must be the
    push step's ``model``, or the pipeline would never hear of its alerts.

    Raises:
        StepFailed: it is not, or model.yaml is not a YAML mapping (of at most 1 MiB).
    """
    if config.stat().st_size > 1024 * 1024:
        raise StepFailed("the model's model.yaml is larger than 1 MiB")
    try:
        document = yaml.safe_load(config.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise StepFailed(f"the model's model.yaml is not YAML: {exc}") from None
    name = document.get("name") if isinstance(document, dict) else None
    if name != expected:
        raise StepFailed(f"the model's model.yaml names it {name!r}, but the push step's `model` is {expected!r}: "
                         "it would be served under another name than the one whose alerts reach this pipeline")


def _open_parents(folder: Path, root: Path) -> None:
    """Let the step's job reach ``folder``: every folder below ``root`` down to it searchable (``root``
    itself was opened at start: :func:`folders.open_pipeline_dir`)."""
    for parent in [folder, *folder.parents]:
        if parent == root:
            return
        parent.chmod(0o755)


def plain(struct: Any) -> Any:
    """A spec's pass-through section as the YAML said it: a Struct holds every number as a double, so
    whole numbers (``min_rows: 30``) become ints again."""
    def whole(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, dict):
            return {k: whole(v) for k, v in value.items()}
        if isinstance(value, list):
            return [whole(v) for v in value]
        return value
    return whole(MessageToDict(struct))


def _digest(hashes: list[str]) -> str:
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def _under(files: dict[str, Path], prefix: str) -> dict[str, Path]:
    return {path[len(prefix):]: source for path, source in files.items() if path.startswith(prefix)}


def _labels(state: _Run, step: pb.StepRun) -> dict[str, str]:
    return {"pipeline": state.name, "pipeline-run": str(state.run.number), "pipeline-step": step.step}


def _state_word(state: int) -> str:
    return pb.StepState.Name(state).removeprefix("STEP_STATE_").lower()
