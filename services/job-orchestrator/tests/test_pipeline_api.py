"""The Pipelines API and `opml pipeline` against a running job-orchestrator: every mistake of a spec in
one INVALID_ARGUMENT, the role each call needs (a forced blessing is an admin's), one run at a time
(a trigger during a run coalesces), and a run's start announced on opml.pipelines.v1.

No bundle-store answers here, so a run stays at its ingest step, waiting for it: what these tests
need of a run is only that it is going."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from opml.jobs.v1 import pipeline_events_pb2 as events

from opml_common.bus import CloudEvent
from opml_common.errors import InvalidArgument, NotFound, PermissionDenied
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.services import TOKENS
from opml_job_orchestrator_contract.pipelineclient import PipelineClient
from opml_job_orchestrator_contract.pipelinespec import load_pipeline
from opml_job_orchestrator_contract.topics import PIPELINES

SPEC = {
    "name": "quality",
    "steps": [
        {"name": "spans", "kind": "ingest", "ingest": {"context": "data"}},
        {"name": "fit", "kind": "train", "inputs": ["spans"], "train": {"command": ["python", "train.py"]}},
    ],
}


@pytest.fixture
def opml(job_service, opml_cli, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OPML_JOB_ORCHESTRATOR_TARGET", job_service.target)
    return opml_cli


def test_a_bad_spec_gets_every_mistake_at_once_and_each_call_its_role(job_service) -> None:
    bad = {**SPEC, "steps": [*SPEC["steps"], {"name": "judge", "kind": "evaluate", "inputs": ["fit", "ghost"]}]}
    with PipelineClient(job_service.target, token=TOKENS["writer"]) as writer, \
            PipelineClient(job_service.target, token=TOKENS["reader"]) as reader, \
            PipelineClient(job_service.target, token=TOKENS["admin"]) as admin:
        spec = load_pipeline(SPEC)
        spec.steps[1].inputs.append("fit")  # past the client's checks: the service checks again
        spec.steps.add().CopyFrom(load_pipeline(SPEC).steps[0])  # a second step named spans
        with pytest.raises(InvalidArgument) as raised:
            writer.apply(spec)
        assert {field for field, _ in raised.value.violations} == {"steps[1].inputs[1]", "steps[2].name"}
        with pytest.raises(InvalidArgument) as raised:
            load_pipeline(bad)
        assert {field for field, _ in raised.value.violations} == {"steps[2].inputs", "steps[2].inputs[1]",
                                                                    "steps[2].evaluate.label"}

        with pytest.raises(PermissionDenied):
            reader.apply(load_pipeline(SPEC))
        applied = writer.apply(load_pipeline(SPEC))
        assert applied.name == "pipelines/quality" and applied.applied_by.startswith("token:")
        assert [p.spec.name for p in reader.list()] == ["quality"]
        with pytest.raises(PermissionDenied):
            writer.force_bless("quality", 1, "because")
        with pytest.raises(NotFound):
            admin.force_bless("quality", 1, "because")
        with pytest.raises(InvalidArgument, match="reason"):
            admin.force_bless("quality", 1, " ")
        with pytest.raises(NotFound):
            reader.get("ghost")


def test_one_run_at_a_time_through_the_cli_and_its_start_is_announced(opml, job_service, platform_settings,
                                                                    tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({**SPEC, "triggers": {"schedule": "0 3 * * *"}}))
    assert "applied quality (2 steps)" in opml("pipeline", "apply", "-f", str(path))
    assert "quality" in opml("pipeline", "ls") and "cron 0 3 * * *" in opml("pipeline", "ls")
    assert "run 1 started" in opml("pipeline", "trigger", "quality", "--reason", "first")
    assert "a run is going; one more run follows it" in opml("pipeline", "trigger", "quality")
    assert "a run is going" in opml("pipeline", "trigger", "quality")
    shown = json.loads(opml("pipeline", "get", "quality"))
    assert shown["activeRun"] == "1" and shown["runPending"] is True
    runs = json.loads(opml("pipeline", "runs", "quality", "--json"))
    assert [r["number"] for r in runs] == ["1"] and runs[0]["triggers"][0].startswith("rpc: token:")
    assert runs[0]["triggers"][0].endswith(": first")
    assert "FAILED_PRECONDITION" in opml("pipeline", "rm", "quality", expect_exit=1)
    denied = opml("pipeline", "bless", "quality", "1", "--force", "--reason", "x", expect_exit=1)
    assert "PERMISSION_DENIED" in denied

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "Bad", "steps": [{"name": "x", "kind": "shuffle"}]}))
    said = opml("pipeline", "apply", "-f", str(bad), expect_exit=1)
    assert "name:" in said and "steps[0].kind:" in said

    records = asyncio.run(read_records(platform_settings, PIPELINES.full_name(platform_settings.topic_prefix), 1))
    event = CloudEvent.from_kafka(records[0].headers, records[0].value)
    started = event.parse(events.PipelineRunStarted)
    assert event.subject == "quality" and started.run.number == 1 and event.source == "opml/job-orchestrator"
