"""``spec.model`` as admission reads it (every mistake at once, the router's rollout rules), and the
trial's SDK side of an upload before any byte leaves it (pure logic; the uploads themselves, through a
real bundle-store, are test_service.py's)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from opml_automl_controller import sdk
from opml_automl_controller.controller import Controller
from opml_automl_controller.katib import parse_experiment
from opml_automl_controller.modelspec import DEFAULT_MAX_BYTES
from opml_automl_controller.uploadenv import (
    BUNDLE_VARIABLE,
    CONTEXT_VARIABLE,
    GRANT_VARIABLE,
    MAX_BYTES_VARIABLE,
    TARGET_VARIABLE,
)
from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.events import RecordingEmitter


def experiment(model: object, *, kind: str = "Job") -> str:
    template: dict = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {"containers": [
        {"name": "main", "image": "python:3.11", "command": ["python", "train.py", "--x=${trialParameters.x}"]}]}}}}
    parameters = [{"name": "x", "parameterType": "double", "feasibleSpace": {"min": "-2", "max": "2"}}]
    objective = {"type": "minimize", "objectiveMetricName": "loss"}
    if kind == "ServingConfigSurrogate":
        template = {"apiVersion": "jobs.opml.dev/v1", "kind": kind, "spec": {
            "model": "models/mlp/versions/1", "poolKind": "accel", "config": {"batch": "${trialParameters.x}"}}}
        parameters = [{"name": "x", "parameterType": "int", "feasibleSpace": {"min": "1", "max": "8"}}]
        objective = {"type": "maximize", "objectiveMetricName": "throughput_rps"}
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": "exp"},
                           "spec": {"objective": objective, "algorithm": {"algorithmName": "random"},
                                    "maxTrialCount": 4, "parallelTrialCount": 1, "parameters": parameters,
                                    "model": model,
                                    "trialTemplate": {"primaryContainerName": "main",
                                                      "trialParameters": [{"name": "x", "reference": "x"}],
                                                      "trialSpec": template}}})


def test_a_model_section_is_read_with_its_serving_files() -> None:
    rollout = {"steps": [{"weight": 10}, {"analysis": {"interval_s": 30, "checks": {"error_rate": {"max_increase": 0.01}}}}]}
    model = parse_experiment(experiment({"serve": True, "rollout": rollout, "maxBytes": "512Mi",
                                         "monitoring": {"window": {"count": 500}}})).model
    assert model is not None and model.commit and model.serve and model.max_bytes == 512 * 1024**2
    assert model.tags() == {"serve": "true"}
    assert yaml.safe_load(model.rollout_yaml)["steps"][0] == {"weight": 10}
    assert yaml.safe_load(model.monitoring_yaml) == {"window": {"count": 500}}
    canary = parse_experiment(experiment({"serve": True, "canary": 5})).model
    assert canary is not None and canary.tags() == {"serve": "true", "canary": "5"} and canary.rollout_yaml == ""
    plain = parse_experiment(experiment({})).model
    assert plain is not None and (plain.commit, plain.serve, plain.max_bytes) == (True, False, DEFAULT_MAX_BYTES)
    assert parse_experiment(experiment(None)).model is None


def test_every_mistake_of_a_model_section_is_named_at_once() -> None:
    bad = {"commit": "yes", "serve": False, "canary": 150, "maxBytes": "lots", "replicas": 2,
           "rollout": {"steps": [{"weight": 10}, {"analysis": {"interval_s": -1}}]},
           "monitoring": {"window": {"count": 10}, "alerts": []}}
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(experiment(bad))
    fields = [field for field, _ in caught.value.violations]
    assert {"spec.model.commit", "spec.model.canary", "spec.model.maxBytes", "spec.model.replicas",
            "spec.model.serve", "spec.model.monitoring.alerts"} <= set(fields), caught.value.message
    assert any(field.startswith("spec.model.rollout.steps[1].analysis") for field in fields), caught.value.message
    assert "cannot be combined with rollout" in caught.value.message  # canary and rollout both given
    with pytest.raises(InvalidArgument, match="spec.model: must not be set: a ServingConfigSurrogate trial"):
        parse_experiment(experiment({}, kind="ServingConfigSurrogate"))
    with pytest.raises(InvalidArgument, match=r"spec.model.commit: must be true to serve the model"):
        parse_experiment(experiment({"commit": False, "serve": True}))


@pytest.fixture
def granted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial's environment as the controller makes it (the store is never reached in these tests)."""
    for name, value in {TARGET_VARIABLE: "127.0.0.1:1", GRANT_VARIABLE: "opmlgrant1.x.y", CONTEXT_VARIABLE: "automl",
                        BUNDLE_VARIABLE: "exp-abc123-t0", MAX_BYTES_VARIABLE: "16"}.items():
        monkeypatch.setenv(name, value)


def test_save_model_outside_a_modelled_experiment_says_what_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    monkeypatch.delenv(GRANT_VARIABLE, raising=False)
    (tmp_path / "model.onnx").write_bytes(b"m")
    with pytest.raises(ValueError, match="needs the upload grant the automl-controller gives the trials of an "
                                         "experiment with spec.model"):
        sdk.save_model(tmp_path)


def test_save_model_refuses_symlinks_empty_folders_oversized_models_and_two_references(granted, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(ValueError, match="holds no file"):
        sdk.save_model(folder)
    (folder / "sub").mkdir()
    (folder / "sub" / "weights.bin").write_bytes(b"w" * 8)
    assert sdk._model_files(folder) == [("sub/weights.bin", folder / "sub" / "weights.bin")]  # at the root
    (tmp_path / "secret").write_text("not the model's")
    os.symlink(tmp_path / "secret", folder / "link")
    with pytest.raises(ValueError, match="which is not a file or a folder"):
        sdk.save_model(folder)
    (folder / "link").unlink()
    (folder / "big.bin").write_bytes(b"b" * 9)
    with pytest.raises(ValueError, match="holds 17 bytes, more than the 16 the experiment allows"):
        sdk.save_model(folder)
    (folder / "big.bin").unlink()
    (folder / "reference.npz").write_bytes(b"r")
    with pytest.raises(ValueError, match="holds a reference.npz too"):
        sdk.save_model(folder, reference={"features": {"x": [1.0]}, "predicted": [1]})


def test_an_experiment_asking_for_a_model_needs_a_bundle_store_to_upload_to() -> None:
    """Admission, before anything is stored: no store or job is touched (none is given)."""
    controller = Controller(store=None, jobs=None, emitter=RecordingEmitter(), redis_url="redis://unused")  # type: ignore[arg-type]
    with pytest.raises(FailedPrecondition, match="spec.model needs a bundle-store its trials upload their models to: "
                                                 "set OPML_AUTOML_CONTROLLER_BUNDLE_STORE_TARGET"):
        controller.validate(experiment({"serve": True}))
    assert controller.validate(experiment({"commit": False})).spec.model is not None  # asks for no upload
