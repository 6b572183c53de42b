"""Flow 2's middle across services: a model bundle that carries a reference set is committed with the
tag serve=true; the inference-router deploys it and announces ModelDeployed; the monitoring-scorer
sets the version's monitoring up by itself from that bundle (read from the bundle-store, not from the
event) and scores the predictions the router publishes while tritonclient calls it. Every part is a
real process on the real broker, S3 and Redis."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as triton
from opml.inference.v1 import deployments_pb2 as pb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import NotFound
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS
from opml_inference_router_contract.client import DeploymentClient
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task
from opml_monitoring_scorer.core.scorer import dump_reference
from opml_monitoring_scorer_contract.client import MonitoringClient

WINDOW = 50
FEATURES = [f"f{i}" for i in range(16)]
CONFIG = f"""
task: multiclass
features: {{features: [{", ".join(FEATURES)}]}}
outputs: {{scores: scores}}
window: {{count: {WINDOW}}}
"""


def _reference(model: str, rows: int) -> bytes:
    """A reference set the MPP can learn from: the model's own scores, labels that agree with its
    prediction 80% of the time."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    scores = ort.InferenceSession(model).run(None, {"features": x})[0]
    predicted = scores.argmax(axis=1)
    labels = np.where(rng.random(rows) < 0.8, predicted, rng.integers(0, scores.shape[1], rows))
    reference = ReferenceSet(Task.MULTICLASS, {name: x[:, i] for i, name in enumerate(FEATURES)},
                             Outputs(predicted, scores), labels)
    return dump_reference(reference)


def _serving(deployments: DeploymentClient) -> bool:
    try:
        return any(v.version == 1 and v.state == pb.SERVING for v in deployments.get("mlp").versions)
    except NotFound:
        return False


def test_a_served_bundle_with_a_reference_set_is_monitored_from_the_router_s_predictions(
        serving_stack, start_service) -> None:
    store_process, router, files = serving_stack.store, serving_stack.router, serving_stack.files
    scorer = start_service("monitoring-scorer", extra_env={
        "OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": store_process.target,
        "OPML_MONITORING_SCORER_BUNDLE_STORE_TOKEN": TOKENS["reader"]})
    with BundleStoreClient(store_process.target, token=TOKENS["writer"]) as store, \
            DeploymentClient(router.target, token=TOKENS["reader"]) as deployments, \
            MonitoringClient(scorer.target, token=TOKENS["reader"]) as monitoring:
        store.create_context("served")
        bundle = store.add("served", "mlp", {**files, "reference.npz": _reference(str(files["model.onnx"]), 2000),
                                             "monitoring.yaml": CONFIG.encode()},
                           tags={"serve": "true"}, commit=True)
        poll_until(lambda: _serving(deployments), timeout_s=120, what="mlp v1 serving")

        def monitored():
            try:
                return monitoring.status("mlp", "1")
            except NotFound:
                return None
        status = poll_until(monitored, timeout_s=120, what="the scorer monitoring mlp v1 from its ModelDeployed")
        assert (status.task, status.reference_rows, list(status.limitations)) == ("multiclass", 2000, [])
        assert status.reference.context == "served" and status.reference.bundle in (bundle.uuid, "mlp")
        assert status.window_count == WINDOW

        data = np.random.default_rng(9).standard_normal((4 * WINDOW, 16)).astype(np.float32)
        with triton.InferenceServerClient(router.target) as client:
            for window in range(4):  # a window's worth, then until the scorer has it: the router's prediction
                # log lingers to put a burst in one record, and a window by count closes on record boundaries
                for start in range(window * WINDOW, (window + 1) * WINDOW, 10):
                    tensor = triton.InferInput("features", [10, 16], "FP32")
                    tensor.set_data_from_numpy(data[start:start + 10])
                    client.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"})
                poll_until(lambda window=window: monitoring.status("mlp", "1").predictions >= (window + 1) * WINDOW,
                           timeout_s=120, what=f"the scorer counting window {window}'s predictions")

        windows = poll_until(lambda: (found := list(monitoring.windows("mlp", "1"))) and len(found) >= 4 and found,
                             timeout_s=120, what="four windows scored from the router's predictions")
    windows = sorted(windows, key=lambda w: w.index)
    assert [w.index for w in windows[:4]] == [0, 1, 2, 3] and all(w.rows == WINDOW for w in windows[:4])
    for window in windows[:4]:
        assert 0.0 <= window.mpp <= 1.0 and 0.0 <= window.cbpe <= 1.0
        assert abs(window.mpp - 0.8) < 0.2  # what the reference's labels say the model gets right
        assert {d.feature for d in window.drift} == set(FEATURES)
        # The same distribution as the reference: at most a stray value beyond the reference's range.
        assert window.data_quality_share <= 0.05 and all(flag.startswith("out_of_range:") for flag in window.flags)
