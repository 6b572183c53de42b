"""The rollout spec (rollout.yaml) a bundle carries: what it accepts, and every mistake named at once."""

from __future__ import annotations

import pytest

from opml_common.errors import InvalidArgument, NotFound
from opml_inference_router.testing import mlp_config
from opml_inference_router_contract.model_config import ModelConfig
from opml_inference_router_contract.rollout_spec import (
    CLASSES,
    SCORES,
    VALUES,
    RolloutSpec,
    comparison_of,
    load_rollout_spec,
)

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
        {"analysis": {"interval_s": 0, "count": 0, "checks": {"latency": {}, "p99_latency": {"max_ratio": 0.5},
                                                              "error_rate": {"max_increase": 0.1, "extra": 1}}}},
        {"pause": {}},
        {"weight": 20, "pause": {}},
    ], "mode": "fast"}
    with pytest.raises(InvalidArgument) as caught:
        RolloutSpec.from_dict(bad)
    fields = [field for field, _ in caught.value.violations]
    assert fields == ["mode", "steps[1].weight", "steps[2].analysis.interval_s", "steps[2].analysis.count",
                      "steps[2].analysis.checks.latency", "steps[2].analysis.checks.p99_latency.max_ratio",
                      "steps[2].analysis.checks.error_rate.extra", "steps[4]", "steps[0].analysis", "steps[3].pause"]
    assert ("is not a check (checks: error_rate, p99_latency, disagreement, estimated_accuracy, accuracy)"
            in caught.value.message)
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
    ({"steps": [{"shadow": {"percent": 0}}]}, "steps[0].shadow.percent"),
    ({"steps": [{"shadow": {"percent": 101}}]}, "steps[0].shadow.percent"),
    ({"steps": [{"shadow": {"percent": 10, "mirror": True}}]}, "steps[0].shadow.mirror"),
    ({"steps": [{"shadow": {"percent": 10, "tolerance": -1}}]}, "steps[0].shadow.tolerance"),
    ({"steps": [{"weight": 10}, {"analysis": {"interval_s": 1, "checks": {"disagreement": {"max_share": 0.1}}}}]},
     "steps[1].analysis.checks.disagreement"),  # no shadow step in force
    ({"steps": [{"shadow": {"percent": 10}}, {"analysis": {"interval_s": 1, "checks": {
        "disagreement": {"max_share": 1.5}}}}]}, "steps[1].analysis.checks.disagreement.max_share"),
    ({"steps": [{"weight": 10}, {"analysis": {"interval_s": 1, "checks": {
        "accuracy": {"max_drop": 0.01, "min_requests": 5}}}}]}, "steps[1].analysis.checks.accuracy.min_requests"),
    ({"steps": [{"weight": 10}, {"analysis": {"interval_s": 1, "checks": {
        "estimated_accuracy": {"max_drop": -0.01}}}}]}, "steps[1].analysis.checks.estimated_accuracy.max_drop"),
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


CLASSIFIER = ModelConfig.model_validate(mlp_config("clf"))  # one output: 4 class scores per row


def config_with_outputs(*outputs: dict) -> ModelConfig:
    return ModelConfig.model_validate({**mlp_config("clf"), "outputs": list(outputs)})


def test_shadow_steps_and_the_new_checks_are_read_with_their_minima_and_round_trip():
    spec = RolloutSpec.from_dict({"steps": [
        {"shadow": {"percent": 25}},
        {"analysis": {"interval_s": 5, "checks": {"disagreement": {"max_share": 0.02, "min_requests": 200},
                                                  "error_rate": {"max_increase": 0.01}}}},
        {"weight": 20},
        {"analysis": {"interval_s": 60, "checks": {"estimated_accuracy": {"max_drop": 0.02, "min_predictions": 500},
                                                   "accuracy": {"max_drop": 0.03, "min_labels": 40}}}},
    ]}, model=CLASSIFIER)
    assert [step.kind for step in spec.steps] == ["shadow", "analysis", "weight", "analysis"]
    assert (spec.steps[0].shadow.percent, spec.steps[0].shadow.output) == (25.0, "scores")  # the first output
    assert [(c.name, c.bound, c.min_requests, c.minimum_name) for c in spec.steps[3].analysis.checks] == [
        ("estimated_accuracy", 0.02, 500, "min_predictions"), ("accuracy", 0.03, 40, "min_labels")]
    assert [spec.shadow_at(i) is not None for i in range(4)] == [True, True, False, False]  # a weight step ends it
    assert RolloutSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(("output", "max_batch", "kind"), [
    ({"name": "y", "data_type": "fp32", "dims": [4]}, 8, SCORES),
    ({"name": "y", "data_type": "fp32", "dims": [1]}, 8, VALUES),
    ({"name": "y", "data_type": "fp64", "dims": []}, 8, VALUES),
    ({"name": "y", "data_type": "int64", "dims": [1]}, 8, CLASSES),
    ({"name": "y", "data_type": "fp32", "dims": [-1, 3]}, 0, SCORES),      # no batch dim: dims[0] is the rows
    ({"name": "y", "data_type": "string", "dims": [1]}, 8, None),          # not a number
    ({"name": "y", "data_type": "fp32", "dims": [-1]}, 8, None),           # a dynamic size per row
    ({"name": "y", "data_type": "fp32", "dims": [8, 8]}, 8, None),         # an image per row
])
def test_what_a_shadow_step_can_compare_is_read_from_the_output_description(output, max_batch, kind):
    batching = mlp_config("clf", max_batch_size=max_batch, max_queue_delay_us=None if not max_batch else 2000)
    config = ModelConfig.model_validate({**batching, "outputs": [output]})
    assert comparison_of(config.outputs[0], config.max_batch_size) == kind


def test_a_shadow_step_on_outputs_that_cannot_be_compared_is_refused_with_every_other_mistake():
    text = config_with_outputs({"name": "caption", "data_type": "string", "dims": [1]},
                               {"name": "mask", "data_type": "fp32", "dims": [16, 16]})
    with pytest.raises(InvalidArgument) as caught:
        RolloutSpec.from_dict({"steps": [
            {"shadow": {"percent": 10}},                        # the first output: a string
            {"shadow": {"percent": 10, "output": "mask"}},      # many values per row
            {"shadow": {"percent": 10, "output": "nothing"}},   # no such output
            {"weight": 120},
            {"analysis": {"interval_s": 1, "checks": {"latency": {"max": 1}}}},
            {"pause": {}},
        ]}, model=text)
    violations = dict(caught.value.violations)
    assert list(violations) == ["steps[0].shadow", "steps[1].shadow.output", "steps[2].shadow.output",
                                "steps[3].weight", "steps[4].analysis.checks.latency", "steps[5].pause"]
    assert "cannot be compared: model clf's output caption is string" in violations["steps[0].shadow"]
    assert "output mask is fp32 with dims [16, 16]" in violations["steps[1].shadow.output"]
    assert "is not an output of model clf (outputs: caption, mask)" in violations["steps[2].shadow.output"]
    # the same spec without the model config: only what it says itself is checked
    with pytest.raises(InvalidArgument) as alone:
        RolloutSpec.from_dict({"steps": [{"shadow": {"percent": 10, "output": "nothing"}}, {"weight": 120}]})
    assert [f for f, _ in alone.value.violations] == ["steps[1].weight"]
