"""Flow 1 through real services: an experiment's trials upload their models with their own grants, the
best is committed servable, the inference-router deploys it under the experiment's rollout (an
analysis step) and promotes it; a later experiment's best model, broken, is rolled back. Every step is
read back from the bus: the experiment's end, the bundle's commit, the deploy, the rollout's steps.

The job-orchestrator (local executor), bundle-store, inference-router (one CPU worker) and
automl-controller run as real processes on the real broker, S3 and Redis. Each trial is a job that
writes an ONNX classifier and its model.yaml and calls ``sdk.save_model`` with a reference set."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
import yaml
from opml.automl.v1 import automl_pb2
from opml.automl.v1 import events_pb2 as automl_events
from opml.bundles.v1 import events_pb2 as bundle_events
from opml.inference.v1 import deployment_events_pb2 as deploy_events
from tritonclient.utils import InferenceServerException

from opml_automl_controller_contract.client import ExperimentClient
from opml_automl_controller_contract.topics import EXPERIMENTS
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.bus import CloudEvent
from opml_common.config import PlatformSettings
from opml_devstack.testing.bus import poll_until, read_records
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.testing.models import POISON
from opml_inference_router_contract.topics import DEPLOYMENTS

NODE = {"name": "n0", "cpu_millis": 8000, "memory_mib": 8192, "gpu": 0}
FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 4, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}
ROLLOUT = {"steps": [{"weight": 50}, {"analysis": {
    "interval_s": 0.3, "count": 3, "inconclusive_limit": 100,
    "checks": {"error_rate": {"max_increase": 0.05, "min_requests": 20}}}}]}

# A trial: its loss is (x - 0.25)^2; its model an MLP classifier (seeded by the trial's number), or,
# with --broken, one that fails in onnxruntime on a request holding POISON.
TRIAL = textwrap.dedent("""
    import argparse
    import numpy as np
    from opml_automl_controller.sdk import model_dir, save_model
    from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
    from opml_inference_router.testing.models import poisoned_mlp
    p = argparse.ArgumentParser()
    p.add_argument("--x", type=float)
    p.add_argument("--name")
    p.add_argument("--broken", action="store_true")
    a = p.parse_args()
    seed = int(a.name.rsplit("-t", 1)[1])
    config = mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",), max_queue_delay_us=None)
    write_model_dir(model_dir(), config, poisoned_mlp(seed=seed) if a.broken else mlp_classifier(seed=seed))
    x = np.random.default_rng(seed).standard_normal((200, 16)).astype(np.float32)
    predicted = x[:, :4].argmax(axis=1)
    save_model(model_dir(), reference={"features": {f"x{i}": x[:, i] for i in range(16)},
                                       "predicted": predicted, "labels": predicted})
    print(f"loss={(a.x - 0.25) ** 2:.6f}", flush=True)
""")


def experiment_yaml(name: str, program: Path, *, broken: bool = False, rollout: dict | None = None) -> str:
    argv = [sys.executable, str(program), "--x=${trialParameters.x}", "--name=${trialParameters.trialName}",
            *(["--broken"] if broken else [])]
    model: dict = {"serve": True, "monitoring": {"window": {"count": 100}}}
    if rollout is not None:
        model["rollout"] = rollout
    return yaml.safe_dump({"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": {"name": name},
                           "spec": {
        "objective": {"type": "minimize", "objectiveMetricName": "loss"},
        "algorithm": {"algorithmName": "random", "algorithmSettings": [{"name": "random_state", "value": "5"}]},
        "parallelTrialCount": 4, "maxTrialCount": 4, "maxFailedTrialCount": 0, "model": model,
        "parameters": [{"name": "x", "parameterType": "double", "feasibleSpace": {"min": "-1", "max": "1"}}],
        "trialTemplate": {
            "primaryContainerName": "main",
            "trialParameters": [{"name": "x", "reference": "x"}, {"name": "trialName", "reference": "${trialSpec.Name}"}],
            "trialSpec": {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {"containers": [{
                "name": "main", "image": "python:3.11", "command": argv,
                "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}}}]}}}}}}})


@pytest.fixture
def trials_dir() -> Iterator[Path]:
    """The controller's trials' folder, in the system's sticky temporary folder every job's user reaches."""
    folder = Path(tempfile.mkdtemp(prefix="opml-automl-trials-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class Bus:
    """The events of one topic read back from its start; ``until`` reads one more record at a time
    until a wanted event is there (synced on the event, never on the clock)."""

    def __init__(self, settings: PlatformSettings, topic: str) -> None:
        self.settings, self.topic = settings, topic

    def until(self, wanted: Callable[[CloudEvent], bool]) -> tuple[CloudEvent, list[CloudEvent]]:
        count = 1
        while True:
            read = [CloudEvent.from_kafka(r.headers, r.value)
                    for r in asyncio.run(read_records(self.settings, self.topic, count, timeout_s=180))]
            found = [event for event in read if wanted(event)]
            if found:
                return found[0], read
            count = len(read) + 1


def of_type(message: type, **fields: object) -> Callable[[CloudEvent], bool]:
    def wanted(event: CloudEvent) -> bool:
        if event.type != message.DESCRIPTOR.full_name:
            return False
        parsed = event.parse(message)
        return all(_field(parsed, name) == value for name, value in fields.items())
    return wanted


def _field(message: object, dotted: str) -> object:
    for name in dotted.split("."):
        message = getattr(message, name)
    return message


@contextlib.contextmanager
def traffic(target: str, value: float = 0.5) -> Iterator[dict[str, int]]:
    """Requests to mlp, one after another from a thread, until the block ends (``value`` in feature 0:
    POISON makes the broken model fail)."""
    counts = {"ok": 0, "failed": 0}
    stop = threading.Event()
    data = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    data[0, 0] = value

    def send() -> None:
        with triton.InferenceServerClient(target) as client:
            tensor = triton.InferInput("features", [1, 16], "FP32")
            tensor.set_data_from_numpy(data)
            while not stop.is_set():
                try:
                    client.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"})
                    counts["ok"] += 1
                except InferenceServerException:
                    counts["failed"] += 1

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        stop.set()
        thread.join()


def test_the_best_trials_model_is_deployed_rolled_out_promoted_and_a_broken_one_rolled_back(
        start_service: ServiceStarter, platform_settings: PlatformSettings, job_dir: Path, trials_dir: Path,
        tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    orchestrator = start_service("job-orchestrator", extra_env={
        "OPML_JOB_ORCHESTRATOR_NODES": json.dumps([NODE]), "OPML_JOB_ORCHESTRATOR_MAX_RETRIES": "0",
        "OPML_JOB_ORCHESTRATOR_LOG_POLL_S": "0.05"})
    store = start_service("bundle-store")
    router = start_service("inference-router", extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet), "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1",
        "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TARGET": store.target,
        "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TOKEN": TOKENS["writer"]})
    controller = start_service("automl-controller", extra_env={
        "OPML_AUTOML_CONTROLLER_JOB_ORCHESTRATOR_TARGET": orchestrator.target,
        "OPML_AUTOML_CONTROLLER_JOB_ORCHESTRATOR_TOKEN": TOKENS["writer"],
        "OPML_AUTOML_CONTROLLER_BUNDLE_STORE_TARGET": store.target,
        "OPML_AUTOML_CONTROLLER_BUNDLE_STORE_TOKEN": TOKENS["writer"],
        "OPML_AUTOML_CONTROLLER_TRIALS_DIR": str(trials_dir)})
    program = job_dir / "trial.py"
    program.write_text(TRIAL)
    experiments = Bus(platform_settings, EXPERIMENTS.full_name(platform_settings.topic_prefix))
    bundles = Bus(platform_settings, BUNDLES.full_name(platform_settings.topic_prefix))
    deployments = Bus(platform_settings, DEPLOYMENTS.full_name(platform_settings.topic_prefix))

    def run(name: str, **kwargs: object) -> tuple[automl_pb2.Experiment, bundle_events.BundleCommitted]:
        """Run one experiment to its end; its ExperimentChanged and its best bundle's BundleCommitted."""
        with ExperimentClient(controller.target, token=TOKENS["writer"]) as client:
            client.create(experiment_yaml(name, program, **kwargs))
        ended, _ = experiments.until(lambda e: e.subject == name and of_type(
            automl_events.ExperimentChanged, **{"experiment.status.state": automl_pb2.EXPERIMENT_STATE_SUCCEEDED})(e))
        experiment = ended.parse(automl_events.ExperimentChanged).experiment
        assert experiment.best_model_bundle, experiment.status.message
        committed, _ = bundles.until(of_type(bundle_events.BundleCommitted, **{"bundle.bundle_name": f"{name}-best"}))
        return experiment, committed.parse(bundle_events.BundleCommitted)

    # 1. The first model: nothing serves yet, so it is deployed as version 1 and takes all traffic.
    first, committed = run("first")
    assert dict(committed.bundle.tags)["serve"] == "true"
    assert {f.path for f in committed.bundle.files} == {"model.onnx", "model.yaml", "reference.npz", "monitoring.yaml"}
    deployed, _ = deployments.until(of_type(deploy_events.ModelDeployed, version=1))
    assert deployed.parse(deploy_events.ModelDeployed).deployment.versions[0].bundle_uuid == committed.bundle.uuid

    # 2. A better experiment's model, rolled out under its rollout: half the traffic, then an analysis
    # of its error rate against version 1's, on clean requests; it passes and version 2 is promoted.
    with traffic(router.target) as clean:
        better, committed = run("better", rollout=ROLLOUT)
        assert "rollout.yaml" in {f.path for f in committed.bundle.files}
        promoted, read = deployments.until(of_type(deploy_events.RolloutPromoted, version=2))
    assert clean["ok"] > 0 and clean["failed"] == 0
    steps = [e.type.rsplit(".", 1)[1] for e in read if ".Rollout" in e.type]
    assert steps[0] == "RolloutStepStarted" and "RolloutAnalysisCompleted" in steps and steps[-1] == "RolloutPromoted"
    assert promoted.subject == "mlp"

    # 3. A broken best model (it fails on POISON): its rollout's analysis fails and it is rolled back;
    # version 2 keeps every request.
    with traffic(router.target, POISON) as poisoned:
        run("broken", broken=True, rollout=ROLLOUT)
        aborted, read = deployments.until(of_type(deploy_events.RolloutAborted, version=3))
    message = aborted.parse(deploy_events.RolloutAborted)
    assert (message.stable_version, message.checks[0].check, message.checks[0].verdict) == (2, "error_rate", "FAILED")
    assert poisoned["ok"] > 0 and poisoned["failed"] > 0
    with triton.InferenceServerClient(router.target) as client:
        data = np.full((1, 16), POISON, dtype=np.float32)
        tensor = triton.InferInput("features", [1, 16], "FP32")
        tensor.set_data_from_numpy(data)
        poll_until(lambda: _answers(client, tensor), timeout_s=30, what="version 2 serves every request")
    assert [e.type.rsplit(".", 1)[1] for e in read if ".Rollout" in e.type][-1] == "RolloutAborted"
    assert first.best_model_bundle != better.best_model_bundle


def _answers(client: triton.InferenceServerClient, tensor: triton.InferInput) -> bool:
    try:
        client.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"})
    except InferenceServerException:
        return False
    return True
