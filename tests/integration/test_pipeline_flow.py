"""Continuous training pipelines across services: the job-orchestrator runs a pipeline over spans in a
real bundle-store (its steps as sandboxed jobs: the platform's step program for validate and
evaluate, a user's training program), on the real broker, S3 and Redis.

A committed span starts a run that ends with a serving bundle; a byte-identical span re-runs no job
and one changed byte re-runs what reads it; a run whose service is SIGKILLed during training resumes
and its training job completes once; spans committed during a run coalesce into one more run; forged
span and alert events start nothing (the bundle-store and the monitoring-scorer are asked first).
The closed loop (an alert retrains the served model, whose new version is rolled out) is test_loop.py."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from opml.bundles.v1 import events_pb2 as bundle_events
from opml.jobs.v1 import jobs_pb2 as jobs_pb
from opml.jobs.v1 import pipelines_pb2 as pb
from opml.monitoring.v1 import alert_events_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.names import EVENT_SOURCE as BUNDLE_STORE_SOURCE
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.bus import CloudEvent, EventPublisher
from opml_common.errors import NotFound
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import fresh_metrics, poll_until
from opml_devstack.testing.metrics import samples, scrape
from opml_devstack.testing.services import TOKENS
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.pipelineclient import PipelineClient
from opml_job_orchestrator_contract.pipelinespec import load_pipeline
from opml_monitoring_scorer_contract.names import EVENT_SOURCE as MONITORING_SOURCE
from opml_monitoring_scorer_contract.topics import ALERTS

TRAIN = Path(__file__).parent / "programs" / "pipeline_train.py"
NODE = {"name": "n0", "cpu_millis": 8000, "memory_mib": 8192, "gpu": 0}


def span_csv(seed: int, rows: int = 300) -> bytes:
    """A labelled span: label = x1 + x2 > 0, with a slicing column."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    out = io.StringIO()
    out.write("x1,x2,line,label\n")
    for (a, b), line in zip(x, rng.integers(0, 2, rows), strict=True):
        out.write(f"{a:.6f},{b:.6f},line-{line},{int(a + b > 0)}\n")
    return out.getvalue().encode()


def pipeline_spec(*, window: dict, on_span: bool = True, on_alert: bool = False,
                  env: dict | None = None) -> pb.PipelineSpec:
    return load_pipeline({
        "name": "quality",
        "triggers": {"on_span": on_span, "on_alert": on_alert},
        "steps": [
            {"name": "spans", "kind": "ingest", "ingest": {"context": "data", "bundle_name": "inspections", **window}},
            {"name": "check", "kind": "validate", "inputs": ["spans"], "validate": {
                "label": "label", "thresholds": {"default": {"jensen_shannon_divergence": 0.5}}}},
            {"name": "fit", "kind": "train", "inputs": ["spans", "check"], "train": {
                "class": "TE", "command": [sys.executable, str(TRAIN)], "warm_start": True,
                "resources": {"cpu": 1, "memory": "512Mi"}, "env": env or {}}},
            {"name": "judge", "kind": "evaluate", "inputs": ["fit", "spans"], "evaluate": {
                "label": "label", "features": ["x1", "x2"], "slices": ["line"], "metrics": ["accuracy"],
                "thresholds": [{"metric": "accuracy", "lower": 0.8}]}},
            {"name": "gate", "kind": "bless", "inputs": ["judge"]},
            {"name": "ship", "kind": "push", "inputs": ["gate"], "push": {
                "context": "serving", "model": "quality",
                "rollout": {"steps": [{"weight": 20}, {"pause": {"duration_s": 1}}]}}},
        ],
    })


@pytest.fixture
def stack(start_service, job_dir: Path):
    """A bundle-store and a job-orchestrator that runs pipelines over it (their steps' folders in ``job_dir``)."""
    store = start_service("bundle-store")
    env = start_service.env("job-orchestrator", extra_env={
        "OPML_JOB_ORCHESTRATOR_NODES": json.dumps([NODE]),
        "OPML_JOB_ORCHESTRATOR_RETRY_BASE_DELAY_S": "0.1",
        "OPML_JOB_ORCHESTRATOR_RETRY_MAX_DELAY_S": "0.2",
        "OPML_JOB_ORCHESTRATOR_TERMINATE_GRACE_S": "2",
        "OPML_JOB_ORCHESTRATOR_SHUTDOWN_GRACE_S": "1",
        "OPML_JOB_ORCHESTRATOR_LEASE_TTL_S": "2",  # a killed service's next process leads within 2 s
        "OPML_JOB_ORCHESTRATOR_BUNDLE_STORE_TARGET": store.target,
        "OPML_JOB_ORCHESTRATOR_BUNDLE_STORE_TOKEN": TOKENS["writer"],
        "OPML_JOB_ORCHESTRATOR_PIPELINE_DIR": str(job_dir / "pipelines"),
    })
    return store, env, lambda: start_service("job-orchestrator", env=env, start=False)


def commit_span(store: BundleStoreClient, number: int, data: bytes, version: int = 0) -> str:
    return store.add("data", "inspections", {"part-0.csv": data},
                     tags={"span": str(number), "version": str(version)}, commit=True).uuid


def ended_run(client: PipelineClient, number: int, timeout_s: float = 180) -> pb.PipelineRun:
    def ended() -> pb.PipelineRun | None:
        runs = [r for r in client.runs("quality") if r.number == number]
        return runs[0] if runs and runs[0].state != pb.RUN_STATE_RUNNING else None
    return poll_until(ended, timeout_s=timeout_s, every_s=0.2, what=f"run {number} of pipeline quality to end")


def step_states(run: pb.PipelineRun) -> dict[str, str]:
    return {s.step: pb.StepState.Name(s.state).removeprefix("STEP_STATE_").lower() for s in run.steps}


def job_state(jobs: JobClient, job_id: str) -> int | None:
    try:
        return jobs.get(job_id).status.state
    except NotFound:
        return None


def pipeline_jobs(jobs: JobClient, run: int) -> list[str]:
    return [j.status.job_id for j in jobs.list(labels={"pipeline": "quality", "pipeline-run": str(run)})]


def test_a_committed_span_is_trained_evaluated_blessed_and_pushed_and_the_cache_follows_content(
        stack, opml_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    store_process, _, make = stack
    orchestrator = make().start()
    monkeypatch.setenv("OPML_JOB_ORCHESTRATOR_TARGET", orchestrator.target)
    with BundleStoreClient(store_process.target, token=TOKENS["writer"]) as store, \
            PipelineClient(orchestrator.target, token=TOKENS["writer"]) as pipelines, \
            JobClient(orchestrator.target, token=TOKENS["reader"]) as jobs:
        store.create_context("data")
        pipelines.apply(pipeline_spec(window={"rolling": 2}))
        commit_span(store, 1, span_csv(1))
        first = ended_run(pipelines, 1)
        assert first.state == pb.RUN_STATE_SUCCEEDED, first
        assert first.blessed and step_states(first) == dict.fromkeys(
            ["spans", "check", "fit", "judge", "gate", "ship"], "succeeded")
        assert first.triggers[0].startswith("span: data/inspections span 1")
        [serving] = store.list_bundles("serving", tags={"pipeline": "quality", "pipeline-output": "serving"})
        assert serving.committed and serving.tags["serve"] == "true"
        assert {f.path for f in serving.files} >= {"model.onnx", "model.yaml", "rollout.yaml", "reference.npz",
                                                  "monitoring.yaml"}
        rollout = yaml.safe_load(b"".join(store.read_file("serving", serving.uuid, "rollout.yaml")))
        assert rollout == {"steps": [{"weight": 20}, {"pause": {"duration_s": 1}}]}
        assert sorted(pipeline_jobs(jobs, 1)) == ["pl-quality-1-check", "pl-quality-1-fit", "pl-quality-1-judge"]

        commit_span(store, 2, span_csv(2))
        second = ended_run(pipelines, 2)
        assert second.state == pb.RUN_STATE_SUCCEEDED, second
        fit = next(s for s in second.steps if s.step == "fit")
        assert fit.details["start"] == "warm", fit

        commit_span(store, 2, span_csv(2), version=1)  # span 2 again, byte for byte
        third = ended_run(pipelines, 3)
        assert step_states(third) == {"spans": "succeeded", "check": "cached", "fit": "cached", "judge": "cached",
                                      "gate": "succeeded", "ship": "cached"}
        assert pipeline_jobs(jobs, 3) == [], "a byte-identical span starts no job"

        changed = bytearray(span_csv(2))
        digit = changed.rindex(b".") + 1  # one byte: a decimal of the last row's x2
        changed[digit] = ord("1") if changed[digit] != ord("1") else ord("2")
        commit_span(store, 2, bytes(changed), version=2)
        fourth = ended_run(pipelines, 4)
        assert fourth.state == pb.RUN_STATE_SUCCEEDED, fourth.message
        assert step_states(fourth)["check"] == step_states(fourth)["fit"] == "succeeded"
        assert sorted(pipeline_jobs(jobs, 4)) == ["pl-quality-4-check", "pl-quality-4-fit", "pl-quality-4-judge"]
        statistics = store.list_bundles("pipeline-quality", tags={"pipeline": "quality", "pipeline-step": "check"})
        computed = sorted((b.tags["pipeline-output"], b.tags["pipeline-run"]) for b in statistics
                          if b.tags["pipeline-output"].startswith("statistics-"))
        assert computed == [("statistics-1", "1"), ("statistics-2", "2"), ("statistics-2", "4")], \
            "statistics are computed once per span content"

    # `opml pipeline run` follows a run to its end; the same content again: every job step is cached
    followed = opml_cli("pipeline", "run", "quality", "--reason", "by hand")
    assert "fit              cached" in followed and followed.rstrip().endswith("run 5 succeeded: done")
    shown = opml_cli("pipeline", "runs", "quality", "--run", "5")
    assert "run 5" in shown and "pl-quality-4-fit" not in shown and "cached: run 4" in shown


def test_a_run_whose_service_is_killed_during_training_resumes_and_the_job_completes_once(stack, job_dir) -> None:
    store_process, _, make = stack
    hold, completions = job_dir / "release", job_dir / "completions"
    first = make().start()
    with BundleStoreClient(store_process.target, token=TOKENS["writer"]) as store, \
            PipelineClient(first.target, token=TOKENS["writer"]) as pipelines, \
            JobClient(first.target, token=TOKENS["reader"]) as jobs:
        store.create_context("data")
        pipelines.apply(pipeline_spec(window={"latest": True}, on_span=False,
                                      env={"HOLD_FILE": str(hold), "COMPLETIONS_FILE": str(completions)}))
        commit_span(store, 1, span_csv(1))
        assert pipelines.trigger("quality").run == 1
        poll_until(lambda: job_state(jobs, "pl-quality-1-fit") == jobs_pb.JOB_STATE_RUNNING, timeout_s=120,
                   what="the training job running")
    first.kill()  # SIGKILL while the training job waits

    second: ServiceProcess = make().start()
    # It serves at once and takes the jobs over once the dead one's lease has expired: the training job
    # is released only then, so what completes is the retry its restore starts, not the orphaned run.
    poll_until(lambda: any(s.name == "opml_job_orchestrator_leader" and s.value == 1 for s in
                           samples(scrape(second.env["OPML_JOB_ORCHESTRATOR_METRICS_PORT"]))),
               timeout_s=30, what="the new process leading")
    hold.write_text("go")
    with PipelineClient(second.target, token=TOKENS["reader"]) as pipelines, \
            JobClient(second.target, token=TOKENS["reader"]) as jobs:
        run = ended_run(pipelines, 1)
        assert run.state == pb.RUN_STATE_SUCCEEDED, run
        assert next(s for s in run.steps if s.step == "fit").job_id == "pl-quality-1-fit"
        assert completions.read_text().splitlines() == ["1"], "the training job completed once (its retry)"
        assert sorted(pipeline_jobs(jobs, 1)) == ["pl-quality-1-check", "pl-quality-1-fit", "pl-quality-1-judge"]


def test_spans_committed_during_a_run_coalesce_into_one_more_run(stack, job_dir) -> None:
    store_process, _, make = stack
    hold = job_dir / "release"
    orchestrator = make().start()
    with BundleStoreClient(store_process.target, token=TOKENS["writer"]) as store, \
            PipelineClient(orchestrator.target, token=TOKENS["writer"]) as pipelines, \
            JobClient(orchestrator.target, token=TOKENS["reader"]) as jobs:
        store.create_context("data")
        pipelines.apply(pipeline_spec(window={"latest": True}, env={"HOLD_FILE": str(hold)}))
        commit_span(store, 1, span_csv(1))
        poll_until(lambda: jobs.list(labels={"pipeline-step": "fit"}), timeout_s=120, what="run 1 training")
        for number in (2, 3, 4):
            commit_span(store, number, span_csv(number))

        def coalesced() -> float:
            return sum(s.value for s in samples(scrape(orchestrator.env["OPML_JOB_ORCHESTRATOR_METRICS_PORT"]))
                       if s.name == "opml_job_orchestrator_pipeline_triggers_total"
                       and s.labels == {"source": "span", "outcome": "coalesced"})
        poll_until(lambda: coalesced() == 3, timeout_s=60, what="three spans coalesced")
        assert pipelines.get("quality").run_pending
        hold.write_text("go")
        ended_run(pipelines, 1)
        second = ended_run(pipelines, 2)
        assert [t.split(" (")[0] for t in second.triggers] == [
            "span: data/inspections span 2", "span: data/inspections span 3", "span: data/inspections span 4"]
        assert next(s for s in second.steps if s.step == "spans").outputs[0].key == "4"
        assert [r.number for r in pipelines.runs("quality")] == [2, 1], "never a queue of runs"


def triggers_counted(orchestrator: ServiceProcess, source: str, outcome: str) -> float:
    return sum(s.value for s in samples(scrape(orchestrator.env["OPML_JOB_ORCHESTRATOR_METRICS_PORT"]))
               if s.name == "opml_job_orchestrator_pipeline_triggers_total"
               and s.labels == {"source": source, "outcome": outcome})


async def publish(settings, topic, message, *, source: str, subject: str) -> None:
    """Straight to the broker, as anyone who can write to it could."""
    metrics, _ = fresh_metrics("forger")
    async with EventPublisher(settings, source=source, metrics=metrics) as publisher:
        await publisher.publish(topic, CloudEvent.from_proto(message, source=source, subject=subject), key=subject)


def test_forged_span_and_alert_events_start_nothing(stack, start_service, platform_settings) -> None:
    store_process, env, make = stack
    scorer = start_service("monitoring-scorer", extra_env={
        "OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": store_process.target,
        "OPML_MONITORING_SCORER_BUNDLE_STORE_TOKEN": TOKENS["reader"]})
    env["OPML_JOB_ORCHESTRATOR_MONITORING_SCORER_TARGET"] = scorer.target
    env["OPML_JOB_ORCHESTRATOR_MONITORING_SCORER_TOKEN"] = TOKENS["reader"]
    orchestrator = make().start()
    with BundleStoreClient(store_process.target, token=TOKENS["writer"]) as store, \
            PipelineClient(orchestrator.target, token=TOKENS["writer"]) as pipelines:
        store.create_context("data")
        pipelines.apply(pipeline_spec(window={"latest": True}, on_alert=True))
        draft = store.add("data", "inspections", {"part-0.csv": span_csv(1)}, tags={"span": "1"})  # not committed
        claimed = type(draft)()
        claimed.CopyFrom(draft)
        claimed.committed = True
        for source in ("evil/anyone", BUNDLE_STORE_SOURCE):  # the wrong source; the right one, and a lie
            asyncio.run(publish(platform_settings, BUNDLES, bundle_events.BundleCommitted(bundle=claimed),
                                source=source, subject="inspections"))
        # no alert of model `quality` fires at the monitoring-scorer
        asyncio.run(publish(platform_settings, ALERTS, alert_events_pb2.AlertRaised(
            model="quality", version="1", rule="accuracy-low"), source=MONITORING_SOURCE, subject="quality"))
        poll_until(lambda: triggers_counted(orchestrator, "alert", "ignored") == 1, timeout_s=60,
                   what="the alert re-read and ignored")

        genuine = commit_span(store, 2, span_csv(2))  # same subject, same partition: after the forged ones
        run = ended_run(pipelines, 1)
        assert run.triggers == [f"span: data/inspections span 2 ({genuine})"], run.triggers
        assert [r.number for r in pipelines.runs("quality")] == [1]
        assert triggers_counted(orchestrator, "span", "started") == 1
