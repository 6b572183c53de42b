"""Pipeline specs (the contract's YAML -> PipelineSpec) and cron schedules: every mistake is reported at
once with its field path; a cycle, an unknown kind, an input naming no step and a kind reading what
it cannot are errors."""

from __future__ import annotations

import copy
import datetime as dt

import pytest
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_job_orchestrator.pipelines.dag import Plan
from opml_job_orchestrator_contract.pipelinespec import load_pipeline, pipeline_violations, step_order
from opml_job_orchestrator_contract.schedule import parse_schedule

GOOD = {
    "name": "churn",
    "triggers": {"on_span": True, "on_alert": True, "schedule": "0 3 * * *"},
    "steps": [
        {"name": "spans", "kind": "ingest", "ingest": {"context": "data", "rolling": 3}},
        {"name": "check", "kind": "validate", "inputs": ["spans"], "validate": {"label": "y"}},
        {"name": "fit", "kind": "train", "inputs": ["spans", "check"],
         "train": {"class": "TE", "command": ["python", "train.py"], "resources": {"cpu": "500m", "memory": "1Gi"},
                   "warm_start": True, "code_version": "abc123"}},
        {"name": "judge", "kind": "evaluate", "inputs": ["fit", "spans"],
         "evaluate": {"label": "y", "min_rows": 30, "thresholds": [{"metric": "accuracy", "lower": 0.8}]}},
        {"name": "gate", "kind": "bless", "inputs": ["judge"]},
        {"name": "ship", "kind": "push", "inputs": ["gate"], "push": {"context": "serving", "model": "churn"}},
    ],
}


def violations(doc: dict) -> dict[str, str]:
    with pytest.raises(InvalidArgument) as raised:
        load_pipeline(doc)
    return dict(raised.value.violations)


def test_a_good_spec_loads_in_order_with_its_settings() -> None:
    spec = load_pipeline(GOOD)
    assert step_order(spec) == ["spans", "check", "fit", "judge", "gate", "ship"]
    fit = spec.steps[2].train
    assert (fit.resources.cpu_millis, fit.resources.memory_mib, fit.warm_start) == (500, 1024, True)
    assert spec.steps[0].ingest.rolling == 3 and spec.steps[0].ingest.WhichOneof("window") == "rolling"
    assert spec.steps[3].evaluate.config["thresholds"][0]["metric"] == "accuracy"
    assert not pipeline_violations(spec)


def test_every_mistake_is_reported_at_once_with_its_path() -> None:
    doc = copy.deepcopy(GOOD)
    doc["name"] = "Churn!"
    doc["steps"][1]["kind"] = "transform"
    doc["steps"][2]["inputs"] = ["spans", "nowhere"]
    doc["steps"][2]["train"]["env"] = {"OPML_S3_SECRET_KEY": "x"}
    doc["steps"][2]["train"]["command"] = "python train.py"
    doc["steps"][3]["evaluate"].pop("label")
    doc["steps"][5]["push"]["context"] = ""
    doc["triggers"]["schedule"] = "61 * * * *"
    found = violations(doc)
    assert set(found) == {"name", "steps[1].kind", "steps[2].inputs[1]", "steps[2].train.env.OPML_S3_SECRET_KEY",
                          "steps[2].train.command", "steps[3].evaluate.label", "steps[5].push.context",
                          "triggers.schedule"}
    assert "transform" in found["steps[1].kind"] and "'nowhere'" in found["steps[2].inputs[1]"]
    assert "minute field '61'" in found["triggers.schedule"]


def test_a_cycle_is_named_step_by_step() -> None:
    doc = copy.deepcopy(GOOD)
    doc["steps"].append({"name": "again", "kind": "validate", "inputs": ["spans"]})
    doc["steps"][1]["inputs"] = ["spans", "check"]
    assert "a step cannot read itself" in violations(doc)["steps[1].inputs[1]"]
    spec = load_pipeline(GOOD)
    spec.steps[1].inputs.append("fit")  # check -> fit -> check: a cycle through the spec's own kinds
    found = dict(pipeline_violations(spec))
    assert any("the steps form a cycle: " in rule and "check" in rule and "fit" in rule for rule in found.values())
    with pytest.raises(InvalidArgument):
        Plan.of(spec)


def test_each_kind_reads_only_what_it_can() -> None:
    doc = copy.deepcopy(GOOD)
    doc["steps"][4]["inputs"] = ["fit"]  # bless reads an evaluate step
    doc["steps"][0]["inputs"] = ["check"]
    doc["steps"].append({"name": "ship2", "kind": "push", "inputs": ["gate"], "push": {"context": "serving"}})
    found = violations(doc)
    assert found["steps[4].inputs[0]"] == "a bless step reads ['evaluate'], but 'fit' is a train step"
    assert "an ingest step reads nothing" in found["steps[0].inputs[0]"]
    assert "at most one push step" in found["steps[6].kind"]


def test_triggers_need_what_they_watch() -> None:
    doc = copy.deepcopy(GOOD)
    doc["steps"][5]["push"].pop("model")
    assert "needs a push step with `model` set" in violations(doc)["triggers.on_alert"]


def test_a_wrong_shape_is_named_and_unknown_keys_are_refused() -> None:
    doc = copy.deepcopy(GOOD)
    doc["steps"][0]["ingest"] = {"context": "data", "rolling": 2, "range": {"start": 1, "end": 3}, "color": "red"}
    doc["steps"][2]["validate"] = {"label": "y"}
    found = violations(doc)
    assert "must set at most one of latest, rolling, range" in found["steps[0].ingest"]
    assert "is not a known key" in found["steps[0].ingest.color"]
    assert "this step is a train step" in found["steps[2].validate"]


@pytest.mark.parametrize(("text", "after", "expected"), [
    ("0 3 * * *", "2026-12-06T07:00", "2026-12-07T03:00"),
    ("*/15 * * * *", "2026-12-06T07:00", "2026-12-06T07:15"),
    ("30 9 * * 1-5", "2026-12-05T10:00", "2026-12-07T09:30"),  # Saturday -> Monday
    ("0 0 1 * 0", "2026-12-02T00:00", "2026-12-06T00:00"),  # day 1 or a Sunday: cron's either-or
    ("0 12 29 2 *", "2026-03-01T00:00", "2028-02-29T12:00"),
])
def test_schedules_fire_at_their_next_minute(text: str, after: str, expected: str) -> None:
    at = dt.datetime.fromisoformat(after).replace(tzinfo=dt.UTC)
    assert parse_schedule(text).next_after(at) == dt.datetime.fromisoformat(expected).replace(tzinfo=dt.UTC)


@pytest.mark.parametrize(("text", "said"), [
    ("* * * *", "must be 5 cron fields"), ("0 24 * * *", "hour field '24'"), ("x * * * *", "minute field 'x'"),
    ("0 0 31 2 *", "fires on no day"), ("*/0 * * * *", "steps >= 1"),
])
def test_bad_schedules_say_what_is_wrong(text: str, said: str) -> None:
    with pytest.raises(InvalidArgument, match=said):
        parse_schedule(text)


def test_a_plan_knows_what_each_step_reads_and_what_depends_on_it() -> None:
    plan = Plan.of(load_pipeline(GOOD))
    assert plan.input_of("judge", pb.STEP_KIND_TRAIN) == "fit"
    assert plan.downstream("fit") == {"judge", "gate", "ship"}
    assert plan.step_of(pb.STEP_KIND_BLESS) == "gate"
