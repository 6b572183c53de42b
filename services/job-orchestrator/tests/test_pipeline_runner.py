"""The pipelines' engine and runner over a fake bundle-store and fake step outcomes, with the run
store in the test's real Redis: every step's outputs and lineage, caching by content, warm starts
from blessed models only, blessing records, forced blessings, coalesced triggers and resumed runs."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from opml.bundles.v1 import bundles_pb2
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_bundle_store_contract.values import value_to_proto
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound
from opml_common.metrics import ServiceMetrics
from opml_common.storage import redis_client
from opml_job_orchestrator.orchestrator import JobState, JobStatus
from opml_job_orchestrator.pipelines import folders
from opml_job_orchestrator.pipelines.bundles import BundleIO
from opml_job_orchestrator.pipelines.engine import PipelineEngine
from opml_job_orchestrator.pipelines.metrics import PipelineMetrics
from opml_job_orchestrator.pipelines.runner import Runner
from opml_job_orchestrator.pipelines.steps import MODEL_DIR_VARIABLE, SPANS_VARIABLE, WARM_START_VARIABLE, StepJob
from opml_job_orchestrator.pipelines.store import RunStore
from opml_job_orchestrator.scheduler.model import Resources
from opml_job_orchestrator_contract.pipelinespec import load_pipeline


class FakeBundles(BundleIO):
    def __init__(self) -> None:
        self.bundles: dict[str, bundles_pb2.Bundle] = {}
        self.blobs: dict[tuple[str, str], bytes] = {}
        self.adds = 0

    def put(self, context: str, name: str, files: Mapping[str, bytes], *, tags: Mapping[str, str] | None = None,
            values: Mapping[str, object] | None = None, lineage: bundles_pb2.Lineage | None = None,
            commit: bool = True) -> bundles_pb2.Bundle:
        bundle = bundles_pb2.Bundle(context=context, bundle_name=name, uuid=uuid.uuid4().hex, tags=dict(tags or {}),
                                    committed=commit, lineage=lineage)
        digest = hashlib.sha256()
        for path in sorted(files):
            sha = hashlib.sha256(files[path]).hexdigest()
            bundle.files.add(path=path, sha256=sha, size_bytes=len(files[path]))
            digest.update(f"{path}\0{sha}\0".encode())
            self.blobs[(bundle.uuid, path)] = files[path]
        for key in sorted(values or {}):
            bundle.values[key].CopyFrom(value_to_proto(values[key]))
            digest.update(f"{key}={values[key]!r}\0".encode())
        bundle.content_hash = digest.hexdigest()
        bundle.name = f"contexts/{context}/bundles/{bundle.uuid}"
        bundle.create_time.GetCurrentTime()
        bundle.commit_time.FromNanoseconds(time.time_ns() + len(self.bundles))
        self.bundles[bundle.uuid] = bundle
        return bundle

    def of(self, **tags: str) -> list[bundles_pb2.Bundle]:
        return [b for b in self.bundles.values() if all(b.tags.get(k) == v for k, v in tags.items())]

    def read(self, bundle: bundles_pb2.Bundle, path: str) -> bytes:
        return self.blobs[(bundle.uuid, path)]

    async def list_committed(self, context: str, bundle_name: str = "") -> list[bundles_pb2.Bundle]:
        return [b for b in self.bundles.values() if b.context == context and b.committed
                and (not bundle_name or b.bundle_name == bundle_name)]

    async def get(self, context: str, uuid_: str) -> bundles_pb2.Bundle:
        bundle = self.bundles.get(uuid_)
        if bundle is None or bundle.context != context:
            raise NotFound(f"no bundle {uuid_} in {context}")
        return bundle

    async def download(self, context: str, uuid_: str, destination: Path) -> None:
        bundle = await self.get(context, uuid_)
        for entry in bundle.files:
            target = destination / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.blobs[(uuid_, entry.path)])

    async def find(self, context: str, tags: Mapping[str, str]) -> bundles_pb2.Bundle | None:
        found = [b for b in self.bundles.values() if b.context == context
                 and all(b.tags.get(k) == v for k, v in tags.items())]
        return found[-1] if found else None

    async def add(self, context, bundle_name, files, *, values=None, tags, lineage, commit=True):
        self.adds += 1
        read = {path: (source if isinstance(source, bytes) else Path(source).read_bytes())
                for path, source in files.items()}
        return self.put(context, bundle_name, read, tags=tags, values=values, lineage=lineage, commit=commit)


Outcome = Callable[[str, StepJob], Mapping[str, object] | None]


class FakeStepJobs:
    """Runs a step's job by writing, in its folder, what the real program would; ``verdicts`` set what
    validate and evaluate decide, ``gate`` (when set) holds every job until it is set."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: set[str] = set()
        self.validate_ok = True
        self.blessed = True
        self.gate: asyncio.Event | None = None
        self.plant_symlink = False
        self.running = asyncio.Event()
        self.going: list[str] = []
        self.most_at_once: list[str] = []

    def known(self, job_id: str) -> bool:
        return job_id in self.started

    async def run(self, job: StepJob, *, submitter: str) -> JobStatus:
        job_id = job.spec.job_id
        now = time.time()
        if job_id in self.finished:  # re-attached to a job that ended: its status; nothing runs again
            return JobStatus(job_id, JobState.SUCCEEDED, 0, 0, 0, None, now, now, now, now)
        if job_id not in self.started:
            self.started.append(job_id)
        self.going.append(job_id)
        if len(self.going) > len(self.most_at_once):
            self.most_at_once = list(self.going)
        self.running.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.going.remove(job_id)
        argv = list(job.program.commands["worker"])
        if "-m" in argv and argv[argv.index("-m") + 1] == "opml_job_orchestrator.pipelines.stepjobs":
            kind = argv[argv.index("-m") + 2]
            folder = Path(argv[argv.index("--outputs") + 1]).parent
            (self._validate if kind == "validate" else self._evaluate)(folder)
        else:
            self._train(job.program.env)
        self.finished.add(job_id)
        return JobStatus(job_id, JobState.SUCCEEDED, 0, 0, 0, None, now, now, now, now)

    async def wait_started(self, *job_ids: str) -> None:
        async with asyncio.timeout(60):  # jobs that never start together fail the test instead of hanging it
            while not set(job_ids) <= set(self.started):
                self.running.clear()
                await self.running.wait()

    def _validate(self, folder: Path) -> None:
        step = json.loads((folder / "step.json").read_text())
        computed = []
        for span in step["spans"]:
            source = folder / "inputs" / "spans" / span
            if source.is_dir():
                out = folder / "outputs" / "statistics" / span
                out.mkdir(parents=True)
                data = b"".join(p.read_bytes() for p in sorted(source.rglob("*")) if p.is_file())
                (out / "statistics.json").write_text(json.dumps({"sha": hashlib.sha256(data).hexdigest()}))
                computed.append(span)
        inferred = not (folder / "inputs" / "schema").is_dir()
        if inferred:
            (folder / "outputs" / "schema").mkdir()
            (folder / "outputs" / "schema" / "schema.json").write_text('{"features": []}')
        anomalies = [] if self.validate_ok else [{"feature": "x", "statistic": "jsd", "value": 0.9,
                                                  "threshold": 0.1, "message": "x drifted"}]
        (folder / "outputs" / "result.json").write_text(json.dumps(
            {"ok": self.validate_ok, "anomalies": anomalies, "computed": computed, "schema_inferred": inferred}))

    def _evaluate(self, folder: Path) -> None:
        baseline = (folder / "inputs" / "baseline").is_dir()
        reasons = [] if self.blessed else ["accuracy on slice all: 0.4 < lower bound 0.5"]
        (folder / "outputs" / "result.json").write_text(json.dumps(
            {"blessed": self.blessed, "baseline": baseline, "reasons": reasons, "metrics": {"accuracy": 0.9}}))
        (folder / "outputs" / "reference").mkdir()
        (folder / "outputs" / "reference" / "reference.npz").write_bytes(b"npz")
        (folder / "outputs" / "reference" / "monitoring.yaml").write_text("rules: []\n")
        if self.plant_symlink:  # a job that tries to make the service upload a file of its choosing
            (folder / "outputs" / "reference" / "secrets.txt").symlink_to("/etc/hostname")

    def _train(self, env: Mapping[str, str]) -> None:
        spans = Path(env[SPANS_VARIABLE])
        data = b"".join(p.read_bytes() for p in sorted(spans.rglob("*")) if p.is_file())
        warm = env.get(WARM_START_VARIABLE)
        if warm is not None:
            data += (Path(warm) / "model.onnx").read_bytes()
        model = Path(env[MODEL_DIR_VARIABLE])
        (model / "model.onnx").write_bytes(hashlib.sha256(data).digest())
        (model / "model.yaml").write_text("name: churn\n")


class FakeEmitter:
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def emit(self, message, *, subject: str, id: str | None = None):
        copy = type(message)()
        copy.CopyFrom(message)
        self.events.append((type(message).__name__, copy))


SPEC = {
    "name": "churn",
    "steps": [
        {"name": "spans", "kind": "ingest", "ingest": {"context": "data", "bundle_name": "churn-span", "rolling": 2}},
        {"name": "check", "kind": "validate", "inputs": ["spans"], "validate": {"label": "y"}},
        {"name": "fit", "kind": "train", "inputs": ["spans", "check"],
         "train": {"class": "TE", "command": ["python", "train.py"], "warm_start": True}},
        {"name": "judge", "kind": "evaluate", "inputs": ["fit", "spans"],
         "evaluate": {"label": "y", "features": ["x"], "metrics": ["accuracy"],
                      "thresholds": [{"metric": "accuracy", "lower": 0.5}]}},
        {"name": "gate", "kind": "bless", "inputs": ["judge"]},
        {"name": "ship", "kind": "push", "inputs": ["gate"],
         "push": {"context": "serving", "model": "churn", "rollout": {"steps": [{"weight": 10}, {"pause": {"duration_s": 60}}]}}},
    ],
}


class Harness:
    def __init__(self, redis, prefix: str, tmp_path: Path) -> None:
        self.store = RunStore(redis, prefix=prefix)
        self.bundles = FakeBundles()
        self.jobs = FakeStepJobs()
        self.emitter = FakeEmitter()
        self.metrics = PipelineMetrics(ServiceMetrics(f"pipeline-test-{id(self)}"))
        self.tmp_path = tmp_path
        self.max_parallel_steps = 4
        self.engine = self.new_engine()

    def new_engine(self) -> PipelineEngine:
        runner = Runner(store=self.store, bundles=self.bundles, jobs=self.jobs, emitter=self.emitter,
                        metrics=self.metrics, work_dir=self.tmp_path / "work", staging_dir=self.tmp_path / "staging",
                        step_resources=Resources(1000, 256, 0), max_parallel_steps=self.max_parallel_steps)
        return PipelineEngine(store=self.store, runner=runner, emitter=self.emitter, metrics=self.metrics)

    def span(self, number: int, rows: bytes, *, header: bytes = b"x,y\n") -> None:
        self.bundles.put("data", "churn-span", {"part-0.csv": header + rows}, tags={"span": str(number)})

    async def run(self, source: str = "rpc") -> pb.PipelineRun:
        number, coalesced = await self.engine.trigger("churn", source)
        assert not coalesced
        return await self.ended(number)

    async def ended(self, number: int) -> pb.PipelineRun:
        async with asyncio.timeout(60):  # a run that never ends fails the test instead of hanging it
            return await self._ended(number)

    async def _ended(self, number: int) -> pb.PipelineRun:
        while True:  # the run is made (a coalesced one after the run before it), ended, and the pipeline freed
            run = await self.store.run("churn", number)
            if run is not None and run.state != pb.RUN_STATE_RUNNING and self.engine.get("churn").active_run != number:
                return run
            await asyncio.sleep(0.01)


@pytest.fixture
async def harness(platform_settings, tmp_path):
    redis = redis_client(platform_settings)
    made = Harness(redis, platform_settings.redis_prefix, tmp_path)
    await made.engine.start()
    await made.engine.apply(load_pipeline(SPEC), principal="writer")
    yield made
    await made.engine.stop()
    keys = [key async for key in redis.scan_iter(f"{platform_settings.redis_prefix}*")]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()


def states(run: pb.PipelineRun) -> dict[str, str]:
    return {s.step: pb.StepState.Name(s.state).removeprefix("STEP_STATE_").lower() for s in run.steps}


def step(run: pb.PipelineRun, name: str) -> pb.StepRun:
    return next(s for s in run.steps if s.step == name)


async def test_a_run_pushes_a_blessed_model_with_its_reference_set_rollout_and_lineage(harness: Harness) -> None:
    harness.span(1, b"1,0\n")
    harness.span(2, b"2,1\n")
    run = await harness.run()
    assert run.state == pb.RUN_STATE_SUCCEEDED, run
    assert states(run) == dict.fromkeys(["spans", "check", "fit", "judge", "gate", "ship"], "succeeded")
    assert harness.jobs.started == ["pl-churn-1-check", "pl-churn-1-fit", "pl-churn-1-judge"]
    [serving] = harness.bundles.of(**{"pipeline-output": "serving"})
    assert serving.context == "serving" and serving.committed and serving.tags["serve"] == "true"
    assert sorted(f.path for f in serving.files) == ["model.onnx", "model.yaml", "monitoring.yaml",
                                                     "reference.npz", "rollout.yaml"]
    assert b"weight: 10" in harness.bundles.read(serving, "rollout.yaml")
    [model] = harness.bundles.of(**{"pipeline-output": "model"})
    [blessing] = harness.bundles.of(**{"pipeline-output": "blessing"})
    assert model.uuid in serving.lineage.input_uuids and blessing.uuid in serving.lineage.input_uuids
    spans = [o.uuid for o in step(run, "spans").outputs]
    assert list(model.lineage.input_uuids) == spans
    record = json.loads(harness.bundles.read(blessing, "blessing.json"))
    assert record["blessed"] is True and record["model"] == model.uuid
    assert harness.engine.get("churn").blessed_model == model.uuid
    assert step(run, "fit").details["start"] == "cold"
    assert len(harness.bundles.of(**{"pipeline-output": "statistics-1"})) == 1
    kinds = [name for name, _ in harness.emitter.events]
    assert kinds[0] == "PipelineRunStarted" and kinds[-1] == "PipelineRunFinished"
    assert kinds.count("PipelineStepFinished") == 6
    assert not (harness.tmp_path / "work" / "churn" / "1").exists(), "a run's folders go when it ends"
    assert not (harness.tmp_path / "staging" / "churn" / "1").exists()


async def test_a_byte_identical_span_reruns_nothing_and_one_changed_byte_reruns_exactly_its_dependents(
        harness: Harness) -> None:
    harness.span(1, b"1,0\n")
    harness.span(2, b"2,1\n")
    first = await harness.run()
    jobs = list(harness.jobs.started)

    harness.span(2, b"2,1\n")  # span 2 committed again, byte for byte: a new bundle, the same content
    second = await harness.run()
    assert harness.jobs.started == jobs, "no job may start"
    assert states(second) == {"spans": "succeeded", "check": "cached", "fit": "cached", "judge": "cached",
                              "gate": "succeeded", "ship": "cached"}
    assert step(second, "fit").cached_from_run == first.number
    assert step(second, "spans").outputs[1].uuid != step(first, "spans").outputs[1].uuid
    assert len(harness.bundles.of(**{"pipeline-output": "serving"})) == 1
    assert len(harness.bundles.of(**{"pipeline-output": "blessing"})) == 2, "every run writes its blessing record"

    harness.span(2, b"2,2\n")  # one byte of span 2 changed
    third = await harness.run()
    assert states(third) == dict.fromkeys(["spans", "check", "fit", "judge", "gate", "ship"], "succeeded")
    assert harness.jobs.started == jobs + ["pl-churn-3-check", "pl-churn-3-fit", "pl-churn-3-judge"]
    # statistics are computed once per span: span 1 was reused, only the changed span 2 recomputed
    assert [b.tags["pipeline-run"] for b in harness.bundles.of(**{"pipeline-output": "statistics-1"})] == ["1"]
    assert [b.tags["pipeline-run"] for b in harness.bundles.of(**{"pipeline-output": "statistics-2"})] == ["1", "3"]
    assert len(harness.bundles.of(**{"pipeline-output": "serving"})) == 2


async def test_warm_start_comes_only_from_a_blessed_model_with_the_same_input_signature(harness: Harness) -> None:
    harness.jobs.blessed = False
    harness.span(1, b"1,0\n")
    first = await harness.run()
    assert states(first)["ship"] == "skipped" and not first.blessed
    assert step(first, "gate").decision.startswith("not blessed: accuracy on slice all")
    record = json.loads(harness.bundles.read(harness.bundles.of(**{"pipeline-output": "blessing"})[0],
                                             "blessing.json"))
    assert record["blessed"] is False and record["reasons"]

    harness.jobs.blessed = True
    harness.span(2, b"2,0\n")
    second = await harness.run()
    assert step(second, "fit").details["start"] == "cold", "the first model was never blessed"
    assert "no blessed model" in step(second, "fit").details["start_reason"]

    harness.span(3, b"3,0\n")
    third = await harness.run()
    assert step(third, "fit").details["start"] == "warm"
    assert f"run {second.number}" in step(third, "fit").details["start_reason"]

    harness.span(4, b"4,0,1\n", header=b"x,y,z\n")
    fourth = await harness.run()
    assert step(fourth, "fit").details["start"] == "cold"
    assert "input signature differs" in step(fourth, "fit").details["start_reason"]


async def test_a_forced_blessing_is_recorded_with_who_and_why_and_pushes_the_model(harness: Harness) -> None:
    harness.jobs.blessed = False
    harness.span(1, b"1,0\n")
    run = await harness.run()
    assert not harness.bundles.of(**{"pipeline-output": "serving"})
    with pytest.raises(InvalidArgument):
        await harness.engine.force_bless("churn", run.number, principal="ops", reason="  ")
    await harness.engine.force_bless("churn", run.number, principal="ops", reason="signature changed on purpose")
    forced = await harness.ended(run.number)
    assert forced.blessed and states(forced)["ship"] == "succeeded"
    [record] = harness.bundles.of(**{"pipeline-output": "blessing-forced"})
    written = json.loads(harness.bundles.read(record, "blessing.json"))
    assert written["forced"] == {"principal": "ops", "reason": "signature changed on purpose"}
    [event] = [e for name, e in harness.emitter.events if name == "PipelineBlessingForced"]
    assert event.principal == "ops" and event.record == record.uuid
    with pytest.raises(FailedPrecondition):
        await harness.engine.force_bless("churn", run.number, principal="ops", reason="again")


async def test_validation_anomalies_fail_the_run_and_nothing_downstream_runs(harness: Harness) -> None:
    harness.jobs.validate_ok = False
    harness.span(1, b"1,0\n")
    run = await harness.run()
    assert run.state == pb.RUN_STATE_FAILED and "x drifted" in run.message
    assert states(run) == {"spans": "succeeded", "check": "failed", "fit": "skipped", "judge": "skipped",
                           "gate": "skipped", "ship": "skipped"}
    assert harness.jobs.started == ["pl-churn-1-check"]


async def test_triggers_during_a_run_coalesce_into_one_more_run(harness: Harness) -> None:
    harness.span(1, b"1,0\n")
    harness.jobs.gate = asyncio.Event()
    first, _ = await harness.engine.trigger("churn", "rpc")
    await harness.jobs.running.wait()
    answers = [await harness.engine.trigger("churn", source) for source in ("span", "alert", "rpc", "schedule")]
    assert answers == [(0, True)] * 4
    assert harness.engine.get("churn").run_pending
    harness.jobs.gate.set()
    await harness.ended(first)
    second = await harness.ended(first + 1)
    assert [t.split(":")[0] for t in second.triggers] == ["span", "alert", "rpc", "schedule"]
    assert await harness.store.run("churn", first + 2) is None, "never a queue of runs"
    assert not harness.engine.get("churn").run_pending


async def test_a_run_interrupted_during_a_job_resumes_and_reattaches_to_it(harness: Harness) -> None:
    harness.span(1, b"1,0\n")
    harness.jobs.gate = asyncio.Event()
    number, _ = await harness.engine.trigger("churn", "rpc")
    await harness.jobs.running.wait()
    await harness.engine.stop()  # the service goes away while the validate job runs
    saved = await harness.store.run("churn", number)
    assert step(saved, "check").job_id == "pl-churn-1-check" and saved.state == pb.RUN_STATE_RUNNING

    harness.jobs.gate.set()
    harness.engine = harness.new_engine()
    await harness.engine.start()  # resumes the run: re-attaches to the job, submits nothing twice
    run = await harness.ended(number)
    assert run.state == pb.RUN_STATE_SUCCEEDED
    assert harness.jobs.started == ["pl-churn-1-check", "pl-churn-1-fit", "pl-churn-1-judge"]
    assert len(harness.bundles.of(**{"pipeline-output": "serving"})) == 1


# check and audit (validate) and fit (train, not gated by them) read only the spans: independent steps
PARALLEL_SPEC = copy.deepcopy(SPEC)
PARALLEL_SPEC["steps"][2]["inputs"] = ["spans"]
PARALLEL_SPEC["steps"].insert(2, {"name": "audit", "kind": "validate", "inputs": ["spans"], "validate": {
    "label": "y", "thresholds": {"default": {"jensen_shannon_divergence": 0.2}}}})


async def test_steps_whose_inputs_have_ended_run_side_by_side_validate_steps_one_at_a_time(harness: Harness) -> None:
    await harness.engine.apply(load_pipeline(PARALLEL_SPEC), principal="writer")
    harness.span(1, b"1,0\n")
    harness.jobs.gate = asyncio.Event()
    number, _ = await harness.engine.trigger("churn", "rpc")
    await harness.jobs.wait_started("pl-churn-1-check", "pl-churn-1-fit")  # both going before either ends
    harness.jobs.gate.set()
    run = await harness.ended(number)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run
    assert states(run) == dict.fromkeys(["spans", "check", "audit", "fit", "judge", "gate", "ship"], "succeeded")
    assert sorted(harness.jobs.most_at_once) == ["pl-churn-1-check", "pl-churn-1-fit"], \
        "two validate steps never go at once: they read and may set the pipeline's schema"
    assert sorted(harness.jobs.started) == ["pl-churn-1-audit", "pl-churn-1-check", "pl-churn-1-fit",
                                            "pl-churn-1-judge"]
    assert harness.engine.get("churn").schema and harness.engine.get("churn").blessed_model
    stored = await harness.store.pipeline("churn")
    assert (stored.schema, stored.blessed_model) == (harness.engine.get("churn").schema,
                                                     harness.engine.get("churn").blessed_model)
    finished = [e.step for name, e in harness.emitter.events if name == "PipelineStepFinished"]
    assert sorted(finished) == sorted(states(run)) and finished[-1] == "ship"


async def test_the_bound_on_steps_at_once_holds(harness: Harness) -> None:
    await harness.engine.stop()
    harness.max_parallel_steps = 1
    harness.engine = harness.new_engine()
    await harness.engine.start()
    await harness.engine.apply(load_pipeline(PARALLEL_SPEC), principal="writer")
    harness.span(1, b"1,0\n")
    run = await harness.run()
    assert run.state == pb.RUN_STATE_SUCCEEDED, run
    assert len(harness.jobs.most_at_once) == 1
    assert harness.jobs.started == ["pl-churn-1-check", "pl-churn-1-audit", "pl-churn-1-fit", "pl-churn-1-judge"], \
        "one at a time, in the plan's order"


async def test_a_run_stopped_with_steps_going_side_by_side_resumes_each_and_no_job_runs_twice(
        harness: Harness) -> None:
    await harness.engine.apply(load_pipeline(PARALLEL_SPEC), principal="writer")
    harness.span(1, b"1,0\n")
    harness.jobs.gate = asyncio.Event()
    number, _ = await harness.engine.trigger("churn", "rpc")
    await harness.jobs.wait_started("pl-churn-1-check", "pl-churn-1-fit")
    await harness.engine.stop()  # the service goes away while both jobs run
    saved = await harness.store.run("churn", number)
    assert {s.step: s.job_id for s in saved.steps if s.state == pb.STEP_STATE_RUNNING} == {
        "check": "pl-churn-1-check", "fit": "pl-churn-1-fit"}, "both jobs' ids were kept before their submits"

    harness.jobs.gate.set()
    harness.engine = harness.new_engine()
    await harness.engine.start()  # resumes both: re-attaches to their jobs, submits nothing twice
    run = await harness.ended(number)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run
    assert sorted(harness.jobs.started) == ["pl-churn-1-audit", "pl-churn-1-check", "pl-churn-1-fit",
                                            "pl-churn-1-judge"]
    assert len(harness.bundles.of(**{"pipeline-output": "model"})) == 1, "the model was added once"
    assert len(harness.bundles.of(**{"pipeline-output": "serving"})) == 1


class FakeAlerts:
    """The scorer's alerts firing: (model, version, rule), or (model, version, rule, segment)."""

    def __init__(self) -> None:
        self.firing: set[tuple[str, ...]] = set()

    async def alerts(self, model: str, version: str, segment: str = "") -> list:
        from opml.monitoring.v1 import monitoring_pb2

        return [monitoring_pb2.Alert(name=f"models/{m}/versions/{v}", rule=r, firing=True, segment=s)
                for m, v, r, s in ((*a, "")[:4] for a in self.firing) if (m, v, s) == (model, version, segment)]


async def with_triggers(harness: Harness) -> None:
    spec = load_pipeline({**SPEC, "triggers": {"on_span": True, "on_alert": True}})
    await harness.engine.apply(spec, principal="writer")


async def test_a_span_event_is_a_hint_the_store_confirms_before_a_run(harness: Harness) -> None:
    from opml.bundles.v1 import events_pb2 as bundle_events

    from opml_common.bus import CloudEvent
    from opml_job_orchestrator.pipelines.triggers import SpanTrigger

    await with_triggers(harness)
    trigger = SpanTrigger(harness.engine, harness.bundles, harness.metrics)
    harness.bundles.put("data", "churn-span", {"a.csv": b"x,y\n1,0\n"}, tags={"span": "1"}, commit=False)
    uncommitted = next(iter(harness.bundles.bundles.values()))
    forged = bundles_pb2.Bundle(context="data", bundle_name="churn-span", uuid=uncommitted.uuid,
                                tags={"span": "1"}, committed=True)  # the event claims committed: the store says not
    await trigger.handle(CloudEvent.from_proto(bundle_events.BundleCommitted(bundle=forged), source="opml/bundle-store"))
    unknown = bundles_pb2.Bundle(context="data", bundle_name="churn-span", uuid="f" * 32, tags={"span": "2"})
    await trigger.handle(CloudEvent.from_proto(bundle_events.BundleCommitted(bundle=unknown), source="opml/bundle-store"))
    other = harness.bundles.put("data", "other-name", {"a.csv": b"x,y\n"}, tags={"span": "3"})
    await trigger.handle(CloudEvent.from_proto(bundle_events.BundleCommitted(bundle=other), source="opml/bundle-store"))
    assert harness.engine.get("churn").last_run == 0, "no run from what the store does not confirm"

    harness.span(1, b"1,0\n")
    [real] = [b for b in harness.bundles.bundles.values() if b.committed and b.bundle_name == "churn-span"]
    await trigger.handle(CloudEvent.from_proto(bundle_events.BundleCommitted(bundle=real), source="opml/bundle-store"))
    run = await harness.ended(1)
    assert run.triggers == [f"span: data/churn-span span 1 ({real.uuid})"]


async def test_an_alert_starts_a_run_only_while_the_scorer_says_it_fires(harness: Harness) -> None:
    from opml.monitoring.v1 import alert_events_pb2

    from opml_common.bus import CloudEvent
    from opml_job_orchestrator.pipelines.triggers import AlertTrigger

    await with_triggers(harness)
    harness.span(1, b"1,0\n")
    alerts = FakeAlerts()
    trigger = AlertTrigger(harness.engine, alerts, harness.metrics)
    raised = alert_events_pb2.AlertRaised(model="churn", version="3", rule="quality")
    await trigger.handle(CloudEvent.from_proto(raised, source="opml/monitoring-scorer"))
    assert harness.engine.get("churn").last_run == 0, "resolved meanwhile: no run"
    other = alert_events_pb2.AlertRaised(model="fraud", version="1", rule="quality")
    alerts.firing = {("fraud", "1", "quality"), ("churn", "3", "quality")}
    await trigger.handle(CloudEvent.from_proto(other, source="opml/monitoring-scorer"))
    assert harness.engine.get("churn").last_run == 0, "another model's alert"
    await trigger.handle(CloudEvent.from_proto(raised, source="opml/monitoring-scorer"))
    run = await harness.ended(1)
    assert run.triggers == ["alert: churn version 3 rule quality"] and run.state == pb.RUN_STATE_SUCCEEDED


async def test_a_segment_alert_starts_a_run_only_while_that_segment_fires(harness: Harness) -> None:
    from opml.monitoring.v1 import alert_events_pb2

    from opml_common.bus import CloudEvent
    from opml_job_orchestrator.pipelines.triggers import AlertTrigger

    await with_triggers(harness)
    harness.span(1, b"1,0\n")
    alerts = FakeAlerts()
    trigger = AlertTrigger(harness.engine, alerts, harness.metrics)
    raised = alert_events_pb2.AlertRaised(model="churn", version="3", rule="quality", segment="2")
    alerts.firing = {("churn", "3", "quality"), ("churn", "3", "quality", "1")}
    await trigger.handle(CloudEvent.from_proto(raised, source="opml/monitoring-scorer"))
    assert harness.engine.get("churn").last_run == 0, "the rule fires for the version and line 1, not for line 2"
    alerts.firing = {("churn", "3", "quality", "2")}
    await trigger.handle(CloudEvent.from_proto(raised, source="opml/monitoring-scorer"))
    run = await harness.ended(1)
    assert run.triggers == ["alert: churn version 3 segment 2 rule quality"]


async def test_a_schedule_fires_at_its_next_minute(harness: Harness) -> None:
    import datetime as dt

    from opml_job_orchestrator.pipelines.triggers import ScheduleTrigger

    await harness.engine.apply(load_pipeline({**SPEC, "triggers": {"schedule": "30 4 * * *"}}), principal="writer")
    harness.span(1, b"1,0\n")
    slept: list[float] = []
    fired = asyncio.Event()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) > 1:  # the second wait: the first minute fired already
            fired.set()
            await asyncio.Event().wait()

    now = dt.datetime(2026, 12, 6, 4, 0, 15, tzinfo=dt.UTC)
    async with ScheduleTrigger(harness.engine, now=lambda: now, sleep=sleep):
        await fired.wait()
    assert slept[0] == 29 * 60 + 45
    run = await harness.ended(1)
    assert run.triggers == ["schedule: 2026-12-06T04:30Z"]


async def test_a_rollout_the_router_would_refuse_is_refused_at_apply(harness: Harness) -> None:
    bad = copy.deepcopy(SPEC)
    bad["steps"][5]["push"]["rollout"] = {"steps": [{"weight": 150}, {"analysis": {"interval_s": -1}}]}
    with pytest.raises(InvalidArgument) as raised:
        await harness.engine.apply(load_pipeline(bad), principal="writer")
    assert all(field.startswith("steps[5].push.rollout.steps[") for field, _ in raised.value.violations)
    assert len(raised.value.violations) >= 2


async def test_a_run_waits_while_the_bundle_store_is_away_and_goes_on_from_where_it_stood(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from opml_common.errors import Unavailable
    from opml_job_orchestrator.pipelines import engine

    monkeypatch.setattr(engine, "_BACKOFF", engine.Backoff(base_s=0.01, max_s=0.01))
    harness.span(1, b"1,0\n")
    away = asyncio.Event()
    adds = harness.bundles.add

    async def add_while_away(*args, **kwargs):
        if not away.is_set():
            away.set()
            raise Unavailable("the bundle-store is restarting")
        return await adds(*args, **kwargs)

    monkeypatch.setattr(harness.bundles, "add", add_while_away)
    run = await harness.run()
    assert away.is_set() and run.state == pb.RUN_STATE_SUCCEEDED
    assert harness.jobs.started == ["pl-churn-1-check", "pl-churn-1-fit", "pl-churn-1-judge"], "no job ran twice"


async def test_a_run_keeps_the_spec_it_started_with_when_another_is_applied_meanwhile(harness: Harness) -> None:
    harness.span(1, b"1,0\n")
    harness.jobs.gate = asyncio.Event()
    number, _ = await harness.engine.trigger("churn", "rpc")
    await harness.jobs.running.wait()
    shorter = copy.deepcopy(SPEC)
    shorter["steps"] = shorter["steps"][:3]  # ingest, validate, train only
    await harness.engine.apply(load_pipeline(shorter), principal="writer")
    await harness.engine.stop()  # and the service restarts: the resumed run still has its own spec
    harness.jobs.gate.set()
    harness.engine = harness.new_engine()
    await harness.engine.start()
    run = await harness.ended(number)
    assert list(states(run)) == ["spans", "check", "fit", "judge", "gate", "ship"]
    assert run.state == pb.RUN_STATE_SUCCEEDED and len(run.spec.steps) == 6
    assert [s.name for s in harness.engine.get("churn").spec.steps] == ["spans", "check", "fit"]


async def test_settings_the_step_program_would_refuse_are_refused_at_apply(harness: Harness) -> None:
    bad = copy.deepcopy(SPEC)
    bad["steps"][1]["validate"]["thresholds"] = {"default": {"jensen_shannon_divergence": -1}, "colour": 1}
    bad["steps"][3]["evaluate"] = {"label": "y", "metrics": ["accuracy", "speed"]}
    with pytest.raises(InvalidArgument) as raised:
        await harness.engine.apply(load_pipeline(bad), principal="writer")
    fields = {field for field, _ in raised.value.violations}
    assert {"steps[1].validate.thresholds.colour", "steps[3].evaluate.features",
            "steps[3].evaluate.metrics[1]"} <= fields
    assert any(f.startswith("steps[1].validate.thresholds.default") for f in fields)


@pytest.mark.parametrize(("mode", "usable"), [(0o2775, True), (0o2770, False)])
def test_a_pipeline_dir_whose_mode_the_service_may_not_change_is_used_when_others_may_enter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, usable: bool) -> None:
    """A Kubernetes claim's root is owned by root, group the pod's fsGroup: its chmod is refused."""
    root = tmp_path / "claim"
    root.mkdir()
    root.chmod(mode)
    real_chmod = Path.chmod

    def refused(path: Path, *args, **kwargs) -> None:
        if path == root:
            raise PermissionError(1, "Operation not permitted", str(path))
        real_chmod(path, *args, **kwargs)
    monkeypatch.setattr(Path, "chmod", refused)
    if usable:
        folders.open_pipeline_dir(root)
    else:
        with pytest.raises(PermissionError, match="not searchable by other users"):
            folders.open_pipeline_dir(root)


async def test_what_a_job_wrote_is_read_as_plain_files_only(harness: Harness) -> None:
    harness.jobs.plant_symlink = True
    harness.span(1, b"1,0\n")
    run = await harness.run()
    judge = step(run, "judge")
    assert judge.state == pb.STEP_STATE_FAILED and "'reference/secrets.txt' is not a regular file" in judge.message
    assert not harness.bundles.of(**{"pipeline-output": "evaluation"}), "nothing of that step was uploaded"


async def test_a_model_served_under_another_name_than_the_push_step_says_is_not_pushed(harness: Harness) -> None:
    other = copy.deepcopy(SPEC)
    other["steps"][5]["push"]["model"] = "fraud"
    await harness.engine.apply(load_pipeline(other), principal="writer")
    harness.span(1, b"1,0\n")
    run = await harness.run()
    assert step(run, "ship").state == pb.STEP_STATE_FAILED and "names it 'churn'" in step(run, "ship").message
    assert not harness.bundles.of(**{"pipeline-output": "serving"})
