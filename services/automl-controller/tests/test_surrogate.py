"""ServingConfigSurrogate experiments: trials evaluated by the inference-router's performance model.

Admission checks are pure (parse_experiment); the experiment runs on a real controller and a real
router process (its workers, a real ONNX model, real onnxruntime measurements, Redis, the broker).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml
from opml.automl.v1 import automl_pb2 as pb

from opml_automl_controller.katib import parse_experiment
from opml_automl_controller_contract.client import ExperimentClient
from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.perfmodel import ServingConfig, grid
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.testing import fleet_env, mlp_classifier, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

VERSION = "models/mlp/versions/1"
BATCHES, THREADS, LEVELS, MODES = (1, 2, 4, 8, 16, 32), (1, 2), ("disable", "basic", "extended", "all"), (
    "sequential", "parallel")
TRIALS = 40
MARGIN = 0.8
"""The best trial's predicted throughput must be at least this share of the grid's best prediction
(40 trials of multivariate TPE on the 96 configurations; the run prints how many reach it)."""


def surrogate_yaml(name: str, *, max_trials: int, parallel: int = 3, config: dict | None = None,
                   parameters: list | None = None, metric: str = "throughput_rps", kind: str = "accel") -> str:
    parameters = parameters if parameters is not None else [
        {"name": "batch", "parameterType": "discrete", "feasibleSpace": {"list": [str(b) for b in BATCHES]}},
        {"name": "threads", "parameterType": "int", "feasibleSpace": {"min": "1", "max": "2"}},
        {"name": "optLevel", "parameterType": "categorical", "feasibleSpace": {"list": list(LEVELS)}},
        {"name": "mode", "parameterType": "categorical", "feasibleSpace": {"list": list(MODES)}},
    ]
    config = config if config is not None else {
        "batch": "${trialParameters.batch}", "threads": "${trialParameters.threads}",
        "optLevel": "${trialParameters.optLevel}", "executionMode": "${trialParameters.mode}", "precision": "int8"}
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": name},
                           "spec": {
        "objective": {"type": "maximize" if metric == "throughput_rps" else "minimize",
                      "objectiveMetricName": metric,
                      "additionalMetricNames": ["latency_ms" if metric == "throughput_rps" else "throughput_rps"]},
        "algorithm": {"algorithmName": "multivariate-tpe", "algorithmSettings": [{"name": "random_state", "value": "7"}]},
        "parallelTrialCount": parallel, "maxTrialCount": max_trials, "parameters": parameters,
        "trialTemplate": {
            "trialParameters": [{"name": p["name"], "reference": p["name"]} for p in parameters],
            "trialSpec": {"apiVersion": "jobs.opml.dev/v1", "kind": "ServingConfigSurrogate",
                          "spec": {"model": VERSION, "poolKind": kind, "config": config}}}}})


def test_unknown_options_out_of_space_values_and_metrics_are_refused_with_their_paths() -> None:
    spec = parse_experiment(surrogate_yaml("ok", max_trials=4))
    assert spec.trial_template.kind == "ServingConfigSurrogate"
    base = "spec.trialTemplate.trialSpec.spec"
    bad = surrogate_yaml("bad", max_trials=4, metric="loss", config={
        "batch": "${trialParameters.batch}", "threads": "${trialParameters.threads}", "cores": 2,
        "optLevel": "${trialParameters.optLevel}", "executionMode": "${trialParameters.mode}", "precision": "fp16"},
        parameters=[
            {"name": "batch", "parameterType": "int", "feasibleSpace": {"min": "0", "max": "8"}},
            {"name": "threads", "parameterType": "double", "feasibleSpace": {"min": "1", "max": "2"}},
            {"name": "optLevel", "parameterType": "categorical", "feasibleSpace": {"list": ["all", "max"]}},
            {"name": "mode", "parameterType": "categorical", "feasibleSpace": {"list": ["sequential"]}}])
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(bad)
    violations = dict(caught.value.violations)
    assert violations[f"{base}.config.cores"] == ("is not a serving option; options: batch, threads, optLevel, "
                                                  "executionMode, precision")
    assert violations[f"{base}.config.precision"].startswith("must be one of fp32, int8, but got 'fp16'")
    assert violations[f"{base}.config.batch"] == "must be an integer >= 1, but got '0' (parameter batch = 0)"
    assert violations[f"{base}.config.threads"] == "must be an integer >= 1, but got '1.5' (parameter threads = 1.5)"
    assert violations[f"{base}.config.optLevel"] == ("must be one of disable, basic, extended, all, but got 'max' "
                                                     "(parameter optLevel = max)")
    assert "reports latency_ms, throughput_rps, not 'loss'" in violations["spec.objective.objectiveMetricName"]
    missing = yaml.safe_load(surrogate_yaml("bad", max_trials=4))
    body = missing["spec"]["trialTemplate"]["trialSpec"]["spec"]
    missing["spec"]["trialTemplate"]["trialSpec"]["spec"] = {"model": "mlp", "config": body["config"], "pool": "x"}
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(yaml.safe_dump(missing))
    assert [field for field, _ in caught.value.violations] == [f"{base}.pool", f"{base}.model", f"{base}.poolKind"]
    trailing = yaml.safe_load(surrogate_yaml("bad", max_trials=4))
    trailing["spec"]["trialTemplate"]["trialSpec"]["spec"]["model"] = VERSION + "\n"
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(trailing)
    assert [field for field, _ in caught.value.violations] == [f"{base}.model"]


@pytest.mark.parametrize("batch", ["9" * 400, 2**31])
def test_an_option_past_the_routers_int32_is_refused_with_its_path(batch) -> None:
    config = {"batch": batch, "threads": "${trialParameters.threads}", "optLevel": "${trialParameters.optLevel}",
              "executionMode": "${trialParameters.mode}"}
    parameters = [p for p in yaml.safe_load(surrogate_yaml("big", max_trials=4))["spec"]["parameters"]
                  if p["name"] != "batch"]
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(surrogate_yaml("big", max_trials=4, config=config, parameters=parameters))
    ((path, rule),) = caught.value.violations
    assert path == "spec.trialTemplate.trialSpec.spec.config.batch" and "must be at most 2147483647" in rule, rule


@pytest.fixture
def router(start_service: ServiceStarter, tmp_path: Path):
    """A router serving an MLP, its cpu configurations measured (a grid of 32) and 6 on accel."""
    process = start_service("inference-router", extra_env=fleet_env(tmp_path / "fleet.yaml"))
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", features=64),
                                mlp_classifier(features=64, width=256, depth=2))
    with DeploymentClient(process.target, token=TOKENS["writer"]) as client:
        client.deploy(model_dir=str(model_dir))
        client.measure_serving_configs(VERSION, "cpu", list(grid(batches=(1, 4, 16, 32), threads=(1, 2),
                                                                 opt_levels=("disable", "all"),
                                                                 modes=("sequential",))), runs=5, passes=1)
        client.measure_serving_configs(VERSION, "accel", [ServingConfig(b, t, "all", "sequential", "int8")
                                                          for b, t in ((1, 1), (8, 1), (32, 1), (4, 2), (16, 2),
                                                                       (2, 1))], runs=5, passes=1)
    return process


@pytest.fixture
def controller_env(start_service: ServiceStarter, router, trials_dir: Path) -> dict[str, str]:
    return start_service.env("automl-controller", extra_env={
        "OPML_AUTOML_CONTROLLER_INFERENCE_ROUTER_TARGET": router.target,
        "OPML_AUTOML_CONTROLLER_INFERENCE_ROUTER_TOKEN": TOKENS["reader"],
        "OPML_AUTOML_CONTROLLER_RETRY_S": "0.2", "OPML_AUTOML_CONTROLLER_TRIALS_DIR": str(trials_dir)})


def ended(client: ExperimentClient, name: str) -> pb.Experiment:
    poll_until(lambda: client.get(name).status.state != pb.EXPERIMENT_STATE_RUNNING, timeout_s=120,
               what=f"experiment {name} ends", every_s=0.1)
    return client.get(name)


def test_a_surrogate_experiment_finds_a_config_near_the_grids_best_and_survives_a_sigkill(
        start_service: ServiceStarter, router, controller_env: dict[str, str]) -> None:
    with DeploymentClient(router.target, token=TOKENS["reader"]) as client:
        space = list(grid(batches=BATCHES, threads=THREADS, opt_levels=LEVELS, modes=MODES, precisions=("int8",)))
        predicted = client.predict_serving_performance(VERSION, "accel", space)
    assert predicted.fit.method == "transferred" and predicted.fit.learned_on == "cpu"
    grid_best = max(p.throughput_rps for p in predicted.predictions)
    reaching = sum(p.throughput_rps >= MARGIN * grid_best for p in predicted.predictions)
    print(f"{reaching} of {len(space)} configurations predicted within {MARGIN} of the grid's best {grid_best:.0f} rps")

    first = start_service("automl-controller", env=controller_env)
    with ExperimentClient(first.target, token=TOKENS["writer"]) as client:
        created = client.create(surrogate_yaml("serving", max_trials=TRIALS))
        assert created.status.state == pb.EXPERIMENT_STATE_RUNNING
        poll_until(lambda: sum(t.state == pb.TRIAL_STATE_SUCCEEDED for t in client.trials("serving")) >= 3,
                   what="three trials evaluated", every_s=0.02)
        killed_at = client.get("serving").status
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    assert killed_at.state == pb.EXPERIMENT_STATE_RUNNING and killed_at.trials < TRIALS

    second = start_service("automl-controller", env=controller_env)
    with ExperimentClient(second.target, token=TOKENS["writer"]) as client:
        done = ended(client, "serving")
        trials = client.trials("serving")
        checked = client.validate(surrogate_yaml("other", max_trials=2, parallel=1))
    assert done.status.reason == "MaxTrialsReached" and done.status.trials == TRIALS
    assert sorted(t.number for t in trials) == list(range(TRIALS))  # none lost, none twice
    assert all(t.state == pb.TRIAL_STATE_SUCCEEDED for t in trials), [t.message for t in trials]
    best = done.status.current_optimal_trial
    assert best.objective_value >= MARGIN * grid_best, (best.parameters, best.objective_value, grid_best)
    # the trial's observation is the router's prediction of its configuration, both metrics
    with DeploymentClient(router.target, token=TOKENS["reader"]) as client:
        config = ServingConfig(int(float(best.parameters["batch"])), int(best.parameters["threads"]),
                               best.parameters["optLevel"], best.parameters["mode"], "int8")
        (again,) = client.predict_serving_performance(VERSION, "accel", [config]).predictions
    metrics = {m.name: m.latest for m in best.metrics}
    assert metrics["throughput_rps"] == pytest.approx(again.throughput_rps)
    assert metrics["latency_ms"] == pytest.approx(again.latency_ms)
    assert not checked.HasField("trial_job") and "PredictServingPerformance of models/mlp/versions/1" in checked.notes[0]


def test_trials_fail_with_the_routers_reason_and_no_router_refuses_the_kind(start_service: ServiceStarter,
                                                                            controller_env: dict[str, str]) -> None:
    controller = start_service("automl-controller", env=controller_env)
    with ExperimentClient(controller.target, token=TOKENS["writer"]) as client:
        client.create(surrogate_yaml("unmeasured", max_trials=2, parallel=1, kind="cpu", config={
            "batch": "${trialParameters.batch}", "threads": "${trialParameters.threads}",
            "optLevel": "${trialParameters.optLevel}", "executionMode": "${trialParameters.mode}",
            "precision": "fp32"}).replace(VERSION, "models/mlp/versions/9"))
        done = ended(client, "unmeasured")
        trials = client.trials("unmeasured")
    assert trials and all(t.state == pb.TRIAL_STATE_FAILED for t in trials)
    assert "inference-router: models/mlp/versions/9 is not deployed" in trials[0].message
    bare = start_service("automl-controller",  # no router configured
                         extra_env={"OPML_AUTOML_CONTROLLER_TRIALS_DIR": controller_env["OPML_AUTOML_CONTROLLER_TRIALS_DIR"]})
    with ExperimentClient(bare.target, token=TOKENS["writer"]) as client, \
            pytest.raises(FailedPrecondition, match="OPML_AUTOML_CONTROLLER_INFERENCE_ROUTER_TARGET"):
        client.create(surrogate_yaml("nowhere", max_trials=2, parallel=1))
    assert done.status.state in (pb.EXPERIMENT_STATE_SUCCEEDED, pb.EXPERIMENT_STATE_FAILED)
