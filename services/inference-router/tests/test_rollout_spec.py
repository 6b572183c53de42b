"""The rollout spec (rollout.yaml) a bundle carries: what it accepts, and every mistake named at once."""

from __future__ import annotations

import pytest

from opml_common.errors import InvalidArgument, NotFound
from opml_inference_router_contract.rollout_spec import RolloutSpec, load_rollout_spec

GOOD = {"steps": [
    {"weight": 10},
    {"analysis": {"interval_s": 30, "count": 4, "failure_limit": 1, "inconclusive_limit": 2,
                  "checks": {"error_rate": {"max_increase": 0.01, "min_requests": 100},
                             "p99_latency": {"max_ratio": 1.5}}}},
    {"pause": {"duration_s": 60}},
    {"weight": 50},
    {"pause": {}},
    {"analysis": {"interval_s": 5, "checks": {"error_rate": {"max_increase": 0}}}},
]}


def test_a_good_spec_is_read_with_its_defaults_and_round_trips():
    spec = RolloutSpec.from_dict(GOOD)
    assert [step.kind for step in spec.steps] == ["weight", "analysis", "pause", "weight", "pause", "analysis"]
    first = spec.steps[1].analysis
    assert (first.interval_s, first.count, first.failure_limit, first.inconclusive_limit) == (30, 4, 1, 2)
    assert [(c.name, c.bound, c.min_requests) for c in first.checks] == [("error_rate", 0.01, 100),
                                                                        ("p99_latency", 1.5, 50)]
    assert spec.steps[2].pause_s == 60 and spec.steps[4].pause_s is None
    last = spec.steps[5].analysis
    assert (last.count, last.failure_limit, last.inconclusive_limit) == (1, 0, 0)
    assert RolloutSpec.from_dict(spec.to_dict()) == spec


def test_every_mistake_is_named_at_once():
    bad = {"steps": [
        {"analysis": {"interval_s": 1, "checks": {"error_rate": {"max_increase": 0.1}}}},   # before any weight
        {"weight": 150},
        {"analysis": {"interval_s": 0, "count": 0, "checks": {"accuracy": {}, "p99_latency": {"max_ratio": 0.5},
                                                              "error_rate": {"max_increase": 0.1, "extra": 1}}}},
        {"pause": {}},
        {"weight": 20, "pause": {}},
    ], "mode": "fast"}
    with pytest.raises(InvalidArgument) as caught:
        RolloutSpec.from_dict(bad)
    fields = [field for field, _ in caught.value.violations]
    assert fields == ["mode", "steps[1].weight", "steps[2].analysis.interval_s", "steps[2].analysis.count",
                      "steps[2].analysis.checks.accuracy", "steps[2].analysis.checks.p99_latency.max_ratio",
                      "steps[2].analysis.checks.error_rate.extra", "steps[4]", "steps[0].analysis", "steps[3].pause"]
    assert "is not a check (checks: error_rate, p99_latency)" in caught.value.message
    assert "must be a percent in (0, 100) (all traffic is the promotion after the last step), but got 150" in caught.value.message


@pytest.mark.parametrize(("data", "field"), [
    ([], "rollout"),
    ({}, "steps"),
    ({"steps": []}, "steps"),
    ({"steps": [{"weight": True}]}, "steps[0].weight"),
    ({"steps": [{"weight": 0}]}, "steps[0].weight"),
    ({"steps": [{"weight": 100}]}, "steps[0].weight"),
    ({"steps": [{"weight": 10}, {"pause": {"duration_s": -1}}]}, "steps[1].pause.duration_s"),
    ({"steps": [{"weight": 10}, {"analysis": {"interval_s": 1, "checks": {}}}]}, "steps[1].analysis.checks"),
    ({"steps": [{"weight": 10}, {"analysis": {"interval_s": 1, "checks": {"error_rate": {"max_increase": 2}}}}]},
     "steps[1].analysis.checks.error_rate.max_increase"),
    ({"steps": [{"weight": 10}, {"analysis": {"interval_s": 1, "failure_limit": -1,
                                              "checks": {"error_rate": {"max_increase": 0.1}}}}]},
     "steps[1].analysis.failure_limit"),
    ({"steps": [{"weight": 10}, {"analysis": {"interval_s": 1, "checks": {
        "p99_latency": {"max_ratio": 2, "min_requests": 0}}}}]}, "steps[1].analysis.checks.p99_latency.min_requests"),
    ({"steps": [{"weight": 10}, {"pause": None}]}, "steps[1].pause"),
])
def test_one_mistake_is_named_by_its_path(data, field):
    with pytest.raises(InvalidArgument) as caught:
        RolloutSpec.from_dict(data)
    assert [f for f, _ in caught.value.violations] == [field]


def test_a_file_is_read_and_a_missing_one_is_not_found(tmp_path):
    path = tmp_path / "rollout.yaml"
    path.write_text("steps:\n  - weight: 25\n  - pause: {duration_s: 1}\n")
    assert [s.kind for s in load_rollout_spec(path).steps] == ["weight", "pause"]
    with pytest.raises(NotFound):
        load_rollout_spec(tmp_path / "none.yaml")
