"""Progressive rollouts decided by the real monitoring-scorer: two bundles of a model that carry a
reference set are committed with serve=true; the router deploys the first, then rolls the second out
with rollout.yaml whose analysis checks the scorer's label-free estimate of each version
(estimated_accuracy). The scorer scores the predictions the router publishes and announces each
window (WindowScored on opml.quality.v1); the router judges with those numbers (read back from the
scorer before it aborts on them), promotes or rolls back, and writes its decisions into the new
bundle's lineage. Every part is a real process on the real broker, S3 and Redis."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
import yaml
from opml.bundles.v1 import bundles_pb2
from opml.inference.v1 import deployments_pb2 as pb
from tritonclient.utils import InferenceServerException

from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.values import value_from_proto
from opml_common.errors import NotFound
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing import mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task
from opml_monitoring_scorer.core.scorer import dump_reference

pytestmark = pytest.mark.timeout(900)  # the scorer trains each version's MPP from its reference first

FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}
WINDOW = 50
FEATURES = [f"f{i}" for i in range(16)]
MONITORING = f"""
task: multiclass
features: {{features: [{", ".join(FEATURES)}]}}
outputs: {{scores: scores}}
window: {{count: {WINDOW}}}
"""
ROLLOUT = {"steps": [{"weight": 50}, {"analysis": {
    "interval_s": 1.0, "count": 1, "inconclusive_limit": 10_000,
    "checks": {"estimated_accuracy": {"max_drop": 0.1, "min_predictions": 4 * WINDOW}}}}]}


def _reference(model: Path, rows: int, *, right: float = 0.8) -> bytes:
    """The model's own scores on reference rows, with labels that agree with its prediction a ``right``
    share of the time (and a class at random otherwise)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    scores = ort.InferenceSession(str(model)).run(None, {"features": x})[0]
    predicted = scores.argmax(axis=1)
    labels = np.where(rng.random(rows) < right, predicted, rng.integers(0, scores.shape[1], rows))
    return dump_reference(ReferenceSet(Task.MULTICLASS, {name: x[:, i] for i, name in enumerate(FEATURES)},
                                       Outputs(predicted, scores), labels))


@contextmanager
def traffic(target: str) -> Iterator[None]:
    """Requests of 10 rows from a thread, until the block ends."""
    stop = threading.Event()
    data = np.random.default_rng(9).standard_normal((10, 16)).astype(np.float32)

    def send() -> None:
        with triton.InferenceServerClient(target) as client:
            tensor = triton.InferInput("features", [10, 16], "FP32")
            tensor.set_data_from_numpy(data)
            while not stop.wait(0.01):  # ~100 requests a second: the scorer's windows fill, the machine is shared
                with contextlib.suppress(InferenceServerException):  # the rollout is judged, not each call
                    client.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"})

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _serving(deployments: DeploymentClient, version: int) -> bool:
    try:
        return any(v.version == version and v.state == pb.SERVING for v in deployments.get("mlp").versions)
    except NotFound:
        return False


def _roll_out(start_service, tmp_path: Path, *, new_right: float) -> tuple[pb.Rollout, dict[str, dict]]:
    """Version 1 (its reference right 80% of the time) serving, version 2 (right ``new_right`` of the
    time) rolled out under traffic; where the rollout ended and its decisions, by bundle name, as values."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    store_process = start_service("bundle-store")
    scorer = start_service("monitoring-scorer", extra_env={
        "OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": store_process.target,
        "OPML_MONITORING_SCORER_BUNDLE_STORE_TOKEN": TOKENS["reader"]})
    router = start_service("inference-router", extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet),
        "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TARGET": store_process.target,
        "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TOKEN": TOKENS["writer"],  # the decisions are written
        "OPML_INFERENCE_ROUTER_MONITORING_SCORER_TARGET": scorer.target,
        "OPML_INFERENCE_ROUTER_MONITORING_SCORER_TOKEN": TOKENS["reader"],
        "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)))
    files = {"model.onnx": model_dir / "model.onnx", "model.yaml": model_dir / "model.yaml",
             "reference.npz": _reference(model_dir / "model.onnx", 1000), "monitoring.yaml": MONITORING.encode()}
    with BundleStoreClient(store_process.target, token=TOKENS["writer"]) as store, \
            DeploymentClient(router.target, token=TOKENS["reader"]) as deployments:
        store.create_context("served")
        store.add("served", "mlp", files, tags={"serve": "true"}, commit=True)
        poll_until(lambda: _serving(deployments, 1), timeout_s=120, what="mlp v1 serving")
        with traffic(router.target):
            new = store.add("served", "mlp", {
                **files, "reference.npz": _reference(model_dir / "model.onnx", 1000, right=new_right),
                "rollout.yaml": yaml.safe_dump(ROLLOUT).encode()}, tags={"serve": "true", "version": "2"}, commit=True)
            rollout = poll_until(lambda: (r := _rollout(deployments)) is not None and r.phase not in (
                "RUNNING", "PAUSED") and r, timeout_s=600, every_s=0.5, what="the rollout of mlp v2 to end")
        with BundleStoreClient(store_process.target, token=TOKENS["reader"]) as reader:

            def decisions() -> dict[str, dict]:
                graph = reader.lineage("served", new.uuid, direction=bundles_pb2.GetLineageRequest.DOWNSTREAM)
                return {b.bundle_name: {k: value_from_proto(v) for k, v in b.values.items()}
                        for b in graph.bundles if b.uuid != new.uuid}

            # written after the rollout ended, by a task of their own: the analysis's and the outcome
            return rollout, poll_until(lambda: len(found := decisions()) >= 2 and found, timeout_s=60,
                                       what="the rollout's decisions in the new bundle's lineage")


def test_a_rollout_is_judged_on_the_scorers_estimates_and_its_decisions_are_in_the_lineage(
        start_service, tmp_path: Path) -> None:
    rollout, decisions = _roll_out(start_service, tmp_path, new_right=0.8)
    assert rollout.phase == "PROMOTED", rollout
    assert sorted(decisions) == ["mlp.v2.rollout.01.step1.passed", "mlp.v2.rollout.02.promoted"]
    passed = decisions["mlp.v2.rollout.01.step1.passed"]
    assert passed["estimated_accuracy.verdict"] == "PASSED"
    # the scorer's numbers: each version's pooled estimate over at least min_predictions scored rows
    assert passed["estimated_accuracy.new_requests"] >= 4 * WINDOW
    assert passed["estimated_accuracy.stable_requests"] >= 4 * WINDOW
    assert 0.5 < passed["estimated_accuracy.new_value"] < 1.0 and 0.5 < passed["estimated_accuracy.stable_value"] < 1.0


def test_a_version_the_scorer_estimates_worse_is_rolled_back_on_its_confirmed_numbers(
        start_service, tmp_path: Path) -> None:
    """Version 2's reference says the model is right 30% of the time: the scorer's estimate of it is far
    below version 1's, read back from the scorer before the rollout aborts."""
    rollout, decisions = _roll_out(start_service, tmp_path, new_right=0.3)
    assert rollout.phase == "ABORTED", rollout
    estimated = {c.check: c for c in rollout.checks}["estimated_accuracy"]
    assert estimated.verdict == "FAILED" and estimated.stable_value - estimated.new_value > 0.1
    assert estimated.new_requests >= 4 * WINDOW and "not confirmed" not in estimated.reason
    assert sorted(decisions) == ["mlp.v2.rollout.01.step1.failed", "mlp.v2.rollout.02.aborted"]
    aborted = decisions["mlp.v2.rollout.02.aborted"]
    assert aborted["verdict"] == "ABORTED" and "estimated_accuracy" in aborted["reason"]
    assert aborted["estimated_accuracy.verdict"] == "FAILED"


def _rollout(deployments: DeploymentClient) -> pb.Rollout | None:
    try:
        return deployments.get_rollout("mlp")
    except NotFound:
        return None
