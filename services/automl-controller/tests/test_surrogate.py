"""The surrogate objective: an experiment over serving options searched on a performance model's
predictions with the experiment's own sampler (a known latency law stands for measurements)."""

from __future__ import annotations

import pytest
import yaml

from opml_automl_controller.katib import parse_experiment
from opml_automl_controller.surrogate import SurrogateObjective, run_surrogate
from opml_common.errors import InvalidArgument
from opml_common.perfmodel import PerformanceModel, Sample, ServingConfig, grid

BATCHES, THREADS = (1, 2, 4, 8, 16, 32), (1, 2, 4)


def law(config: ServingConfig) -> float:
    """ms per batch: batching amortizes a fixed cost, threads help, int8 is cheaper, no optimization costs."""
    ms = (0.5 + 0.05 * config.batch) / config.threads ** 0.5 * (0.5 if config.precision == "int8" else 1.0)
    return ms * (1.4 if config.opt_level == "disable" else 1.0) * (1.1 if config.execution_mode == "parallel" else 1.0)


@pytest.fixture(scope="module")
def model() -> PerformanceModel:
    samples = [Sample("m", 2.0, c, law(c)) for c in grid(batches=BATCHES, threads=THREADS)]
    return PerformanceModel(environment="cpu").fit(samples)


def experiment(parameters: list[dict], *, trials: int = 40) -> str:
    template = {"primaryContainerName": "main", "trialParameters": [],
                "trialSpec": {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
                    "containers": [{"name": "main", "image": "python:3.11", "command": ["true"]}]}}}}}
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment",
                           "metadata": {"name": "serving", "namespace": "default"},
                           "spec": {"objective": {"type": "maximize", "objectiveMetricName": "throughput_rps"},
                                    "algorithm": {"algorithmName": "tpe", "algorithmSettings": [
                                        {"name": "random_state", "value": "3"}]},
                                    "maxTrialCount": trials, "parallelTrialCount": 1, "parameters": parameters,
                                    "trialTemplate": template}})


SERVING = [
    {"name": "batch", "parameterType": "discrete", "feasibleSpace": {"list": [str(b) for b in BATCHES]}},
    {"name": "threads", "parameterType": "int", "feasibleSpace": {"min": "1", "max": "4"}},
    {"name": "opt_level", "parameterType": "categorical", "feasibleSpace": {"list": ["disable", "basic", "all"]}},
    {"name": "execution_mode", "parameterType": "categorical", "feasibleSpace": {"list": ["sequential", "parallel"]}},
    {"name": "precision", "parameterType": "categorical", "feasibleSpace": {"list": ["fp32", "int8"]}},
]


def test_the_experiments_sampler_finds_a_configuration_near_the_best_on_predictions(model):
    objective = SurrogateObjective(model, mflop_per_row=2.0, metric="throughput_rps")
    study = run_surrogate(parse_experiment(experiment(SERVING)), objective)
    assert len(study.trials) == 40
    best_true = max(c.batch * 1000 / law(c) for c in grid(batches=BATCHES, threads=THREADS))
    found = objective.config(study.best_params)
    assert found.batch * 1000 / law(found) >= 0.8 * best_true
    assert found.precision == "int8" and found.opt_level != "disable"


def test_latency_is_the_prediction_and_unset_options_keep_the_defaults(model):
    objective = SurrogateObjective(model, mflop_per_row=2.0, defaults=ServingConfig(8, threads=2))
    assert objective.config({"precision": "int8"}) == ServingConfig(8, 2, precision="int8")
    predicted = objective({"precision": "int8"})
    assert predicted == pytest.approx(law(ServingConfig(8, 2, precision="int8")), rel=0.25)
    throughput = SurrogateObjective(model, mflop_per_row=2.0, metric="throughput_rps",
                                    defaults=ServingConfig(8, threads=2))({"precision": "int8"})
    assert throughput == pytest.approx(8 * 1000 / predicted)


def test_a_parameter_that_is_no_serving_option_is_refused_by_name(model):
    spec = parse_experiment(experiment([*SERVING, {"name": "lr", "parameterType": "double",
                                                   "feasibleSpace": {"min": "0.01", "max": "0.1"}}]))
    with pytest.raises(InvalidArgument, match=r"parameters\[lr\]"):
        run_surrogate(spec, SurrogateObjective(model, mflop_per_row=2.0), trials=2)
    with pytest.raises(InvalidArgument, match="metric"):
        SurrogateObjective(model, mflop_per_row=2.0, metric="accuracy")
    with pytest.raises(InvalidArgument, match="mflop_per_row"):
        SurrogateObjective(model, mflop_per_row=0.0)
