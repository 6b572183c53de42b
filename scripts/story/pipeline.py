"""Step 3, train and bless: a continuous training pipeline over the spans, pushed with a rollout.

Shows the job-orchestrator's pipelines (after TFX): ``ingest`` resolves the committed spans,
``validate`` computes their statistics, infers the schema and checks the newest span for anomalies,
``train`` runs the user's program (``pipeline_train.py``, numpy) as a TE job, warm from the
pipeline's blessed model when there is one, ``evaluate`` judges the candidate overall and per line
(and against the blessed baseline), ``bless`` records the verdict, ``push`` commits a blessed model as
a serving bundle with its rollout, reference set and monitoring rules, monitored per line (the
request parameter ``line``; each line judged against its own reference rows). The inference-router deploys
it; the first version takes all traffic, a later one goes through the rollout.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from inspection_data import FEATURES
from opml.inference.v1 import deployments_pb2
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import NotFound
from opml_inference_router_contract.client import DeploymentClient
from opml_job_orchestrator_contract.pipelineclient import PipelineClient
from opml_job_orchestrator_contract.pipelinespec import load_pipeline

from .context import Story, wait_for
from .data import CONTEXT, SPANS

NAME = MODEL = "inspection"
TRAIN = Path(__file__).resolve().parent / "pipeline_train.py"
MIN_ACCURACY = 0.6
"""Every line's accuracy a candidate must reach to be blessed (chance is 0.25)."""
LINE_NOISE = 0.05
"""How much worse than the serving model on one line a candidate may be and still be blessed."""
JS_DIVERGENCE = 0.25
"""The most a grey level's distribution may move from one span to the next before validation stops a run."""


def pipeline_spec(story: Story) -> pb.PipelineSpec:
    return load_pipeline({
        "name": NAME,
        "triggers": {"on_span": False, "on_alert": True},  # the served model's alerts retrain it
        "steps": [
            {"name": "spans", "kind": "ingest",
             "ingest": {"context": CONTEXT, "bundle_name": SPANS, "rolling": story.scale.days}},
            {"name": "check", "kind": "validate", "inputs": ["spans"], "validate": {
                "label": "label",
                # One line's lamps dimming moves a grey level's distribution by up to 0.19 (Jensen-Shannon,
                # against the day before): retraining follows that; more (every line, a broken camera)
                # stops the run. A span is one day: its ``day`` column differs from the last by design.
                "thresholds": {"default": {"jensen_shannon_divergence": JS_DIVERGENCE},
                               "features": {"day": {"jensen_shannon_divergence": None}}}}},
            {"name": "fit", "kind": "train", "inputs": ["spans", "check"], "train": {
                "class": "TE", "command": [sys.executable, str(TRAIN)], "warm_start": True,
                "code_version": hashlib.sha256(TRAIN.read_bytes()).hexdigest()[:12],  # a changed program retrains
                "resources": {"cpu": 1, "memory": "1Gi"},
                "env": {"EPOCHS": str(story.scale.pipeline_epochs), "MODEL_NAME": MODEL}}},
            {"name": "judge", "kind": "evaluate", "inputs": ["fit", "spans"], "evaluate": {
                "label": "label", "features": list(FEATURES), "slices": ["line"], "metrics": ["accuracy"],
                # every line good enough, none worse than the serving model's by more than the noise of a
                # line's few hundred rows
                "thresholds": [{"metric": "accuracy", "lower": MIN_ACCURACY},
                               {"metric": "accuracy", "change": {"direction": "higher_is_better",
                                                                 "absolute": -0.02}, "slices": False},
                               {"metric": "accuracy", "change": {"direction": "higher_is_better",
                                                                 "absolute": -LINE_NOISE}}]}},
            {"name": "gate", "kind": "bless", "inputs": ["judge"]},
            # monitored per line too: the reference carries each row's line (the evaluate step's slice), so
            # the scorer judges each line against its own rows and line 3's drift raises line 3's alert
            {"name": "ship", "kind": "push", "inputs": ["gate"], "push": {
                "context": CONTEXT, "model": MODEL, "rollout": story.scale.rollout, "monitoring": {"segment": "line"}}},
        ],
    })


def ended_run(client: PipelineClient, number: int) -> pb.PipelineRun:
    """Wait for run ``number`` to end, printing each step as it finishes."""
    shown: set[str] = set()

    def ended() -> pb.PipelineRun | None:
        run = client.run(NAME, number)
        for step in run.steps:
            if step.state not in (pb.STEP_STATE_PENDING, pb.STEP_STATE_RUNNING) and step.step not in shown:
                shown.add(step.step)
                state = pb.StepState.Name(step.state).removeprefix("STEP_STATE_").lower()
                why = step.message or step.decision
                print(f"   {step.step:<6} {pb.StepKind.Name(step.kind).removeprefix('STEP_KIND_').lower():<9} "
                      f"{state:<9} {why[:150]}", flush=True)
        return run if run.state != pb.RUN_STATE_RUNNING else None
    return wait_for(f"run {number} of pipeline {NAME} ending", ended, timeout_s=600, every_s=0.5)


def line_accuracy(story: Story, run: pb.PipelineRun) -> dict[str, float]:
    """The candidate's accuracy per line, as the run's evaluate step wrote it (its result.json)."""
    [output] = [o for s in run.steps if s.step == "judge" for o in s.outputs if o.role == "evaluation"]
    with BundleStoreClient(story.bundles_target) as client:
        result = json.loads(b"".join(client.read_file(output.context, output.uuid, "result.json")))
    candidate = result["metrics"]["candidate"]
    return {key.removeprefix("line="): values["accuracy"] for key, values in sorted(candidate.items())
            if key.startswith("line=")}


def serving_bundle(run: pb.PipelineRun) -> str | None:
    return next((o.uuid for s in run.steps if s.step == "ship" for o in s.outputs if o.role == "serving"), None)


def version_of(router: DeploymentClient, bundle_uuid: str) -> deployments_pb2.ModelVersionStatus | None:
    """The router's version of ``bundle_uuid`` once it serves; None before."""
    try:
        versions = router.get(MODEL).versions
    except NotFound:
        return None
    ours = [v for v in versions if v.bundle_uuid == bundle_uuid]
    if ours and ours[-1].state == deployments_pb2.FAILED:
        raise SystemExit(f"deploy of bundle {bundle_uuid} failed: {ours[-1].reason}")
    return ours[-1] if ours and ours[-1].state == deployments_pb2.SERVING else None


def run_once(story: Story, reason: str) -> tuple[pb.PipelineRun, str | None]:
    """Trigger a run of the pipeline, follow it to its end; the run and its serving bundle (None when
    nothing was pushed)."""
    with PipelineClient(story.jobs_target) as client:
        started = client.trigger(NAME, reason=reason)
        number = started.run or max(r.number for r in client.runs(NAME))
        print(f"   run {number} ({reason})", flush=True)
        run = ended_run(client, number)
    if run.state != pb.RUN_STATE_SUCCEEDED:
        raise SystemExit(f"pipeline {NAME} run {number} ended {pb.RunState.Name(run.state)}: {run.message}")
    return run, serving_bundle(run)


def run(story: Story) -> str:
    with PipelineClient(story.jobs_target) as client:
        client.apply(pipeline_spec(story))
    print(f"   pipeline {NAME}: ingest -> validate -> train (warm start) -> evaluate per line -> bless -> push, "
          f"model {MODEL}", flush=True)
    pipeline_run, bundle = run_once(story, "the story's first training")
    accuracy = line_accuracy(story, pipeline_run)
    print(f"   blessed={pipeline_run.blessed}; accuracy by line on span {story.scale.days - 1}: "
          + ", ".join(f"line {line} {value:.3f}" for line, value in accuracy.items()))
    story.handed["line_accuracy"] = {"first training": accuracy}
    with DeploymentClient(story.router_target) as router:
        if not bundle:  # the same spans as an earlier run's: what they trained already serves
            print(f"   nothing new to push: {next(s.decision for s in pipeline_run.steps if s.step == 'ship')}")
            bundle = next(v.bundle_uuid for v in reversed(router.get(MODEL).versions)
                          if v.state == deployments_pb2.SERVING)
        version = wait_for(f"the router serving bundle {bundle}", lambda: version_of(router, bundle), timeout_s=180)
    print(f"   {MODEL} version {version.version} SERVING {version.traffic_percent:.0f}% (bundle {bundle[:8]})")
    story.handed["serving_version"] = str(version.version)
    return f"run {pipeline_run.number} blessed and pushed, version {version.version} serving"
