"""What the push step writes for the monitoring-scorer: ``monitoring: {segment: line}`` makes the pushed
model monitored per value of that request parameter (the bundle's monitoring.yaml says so), checked
with the spec's other fields; and the default bad-input rule's bound is above what clean traffic
shows, however many columns the model reads (256 pixel columns used to alert on every clean window)."""

from __future__ import annotations

import copy

import pytest
import yaml
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_job_orchestrator.pipelines.stepjobs import monitoring_with_segment
from opml_job_orchestrator_contract.pipelinespec import load_pipeline

from .test_pipeline_runner import SPEC, Harness, harness  # noqa: F401 - the fixture


def with_push(**push: object) -> dict:
    spec = copy.deepcopy(SPEC)
    spec["steps"][5]["push"].update(push)
    return spec


def test_the_push_steps_monitoring_segment_is_checked_with_the_rest() -> None:
    spec = load_pipeline(with_push(monitoring={"segment": "line"}))
    assert spec.steps[5].push.monitoring.segment == "line"
    assert load_pipeline(SPEC).steps[5].push.monitoring.segment == ""
    with pytest.raises(InvalidArgument) as raised:
        load_pipeline(with_push(monitoring={"segment": "a b", "by": "x"}, bundle_name=3))
    fields = sorted(field for field, _ in raised.value.violations)
    assert fields == ["steps[5].push.bundle_name", "steps[5].push.monitoring.by", "steps[5].push.monitoring.segment"]


def test_the_segment_is_added_to_the_evaluate_steps_monitoring_yaml() -> None:
    written = yaml.safe_dump({"task": "binary", "rules": [{"name": "drift", "signal": "drift"}]}).encode()
    assert yaml.safe_load(monitoring_with_segment(written, "line")) == {
        "task": "binary", "rules": [{"name": "drift", "signal": "drift"}], "segment": {"parameter": "line"}}
    assert yaml.safe_load(monitoring_with_segment(None, "line")) == {"segment": {"parameter": "line"}}


async def test_a_push_with_a_monitoring_segment_writes_it_into_the_serving_bundle(harness: Harness) -> None:  # noqa: F811
    await harness.engine.apply(load_pipeline(with_push(monitoring={"segment": "line"})), principal="writer")
    harness.span(1, b"1,0\n")
    run = await harness.run()
    assert run.state == pb.RUN_STATE_SUCCEEDED, run
    [serving] = harness.bundles.of(**{"pipeline-output": "serving"})
    assert yaml.safe_load(harness.bundles.read(serving, "monitoring.yaml")) == {
        "rules": [], "segment": {"parameter": "line"}}


