"""Step 4, a traced job: a defect classifier trained as a traced TE job, committed and served.

Shows the job-orchestrator, the trace-collector and the inference-router together: the training
program (``main_job_train.py``, plain Keras) runs as a TE job with its TensorFlow traced and no line
of it changed; the trace-collector's step metrics of it; the model committed tagged ``serve=true``
with a reference set and monitoring rules (so the monitoring-scorer estimates its accuracy and
alerts from its first window); the router deploys it from the bundles topic, serves it over KServe
v2 (tritonclient), and publishes each prediction.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import onnxruntime
import tritonclient.grpc as triton
import yaml
from inspection_data import CLASS_NAMES, inspection_patches
from opml.inference.v1 import deployments_pb2
from opml.inference.v1 import events_pb2 as inference_events
from opml.jobs.v1 import jobs_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import NotFound
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.topics import PREDICTIONS
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import load_spec
from opml_monitoring_scorer_contract.reference import MONITORING_FILE, REFERENCE_FILE, reference_npz
from opml_trace_collector_contract.client import TraceCollectorClient

from .context import Ours, Story, show_events, wait_for

TRAIN = Path(__file__).resolve().parents[1] / "main_job_train.py"
TERMINAL = {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}
REFERENCE_ROWS = 1000
ACCURACY_DROP = 0.10
"""Fall of the estimated accuracy below the reference's that raises the deployed model's alert."""


def of_request(version: int, request_id: str) -> Ours:
    """This run's prediction: its request, of the version this run deployed."""
    def ours(kind: str, subject: str, value: bytes) -> bool:
        return (subject == f"defect-classifier/{version}" and kind == "opml.inference.v1.PredictionMade"
                and inference_events.PredictionMade.FromString(value).request_id == request_id)
    return ours


def train_traced(story: Story, model_dir: Path) -> str:
    """The training program as a traced TE job; returns the job id. ``model_dir`` (not made yet)
    is the job's checkpoint folder: the orchestrator makes it for the job's own user (a sandboxed job
    may write nothing else of ours), and this script reads the model from it."""
    job_id = f"defect-classifier-train-{int(time.time())}"
    spec = load_spec({"name": job_id, "class": "TE", "trace": True, "checkpoint": {"dir": str(model_dir)},
                      "command": [sys.executable, str(TRAIN), "--out", str(model_dir)],
                      "roles": {"worker": {"replicas": 1, "resources": {"cpu": "1000m", "memory": "2Gi"}}}})
    with JobClient(story.jobs_target) as jobs:
        jobs.submit(spec)
        seen = []
        def ended():
            state = jobs.get(job_id).status.state
            if not seen or seen[-1] != state:
                seen.append(state)
                print(f"   {job_id}: {jobs_pb2.JobState.Name(state)}")
            return state in TERMINAL and state
        state = wait_for(f"job {job_id} ending", ended, timeout_s=240)
        logs = b"".join(chunk.data for chunk in jobs.logs(job_id, role="worker", index=0)).decode(errors="replace")
    accuracy = [line for line in logs.splitlines() if line.startswith("test accuracy")]
    print(f"   worker-0 log: {accuracy[-1] if accuracy else logs[-300:]}")
    if state != jobs_pb2.JOB_STATE_SUCCEEDED:
        raise SystemExit(f"training job {job_id} ended {jobs_pb2.JobState.Name(state)}")
    return job_id


def show_trace(story: Story, job_id: str) -> None:
    """What the trace-collector aggregated of the job, with no line of it changed."""
    with TraceCollectorClient(story.traces_target) as traces:
        runs = wait_for("the job's traced run reaching the trace-collector",
                        lambda: [r for r in traces.list_runs(job_id) if r.steps], timeout_s=60)
        for run in runs:
            print(f"   run {run.worker} session {run.session_id[:8]}: TensorFlow {run.tf_version}, "
                  f"{run.steps} steps, patched {', '.join(run.patched[:3])}...")
        metrics = traces.summary(job_id).metrics
    print(f"   step time mean {metrics.step_time_s * 1000:.1f} ms (p95 {metrics.step_time_p95_s * 1000:.1f} ms), "
          f"{metrics.examples_per_second:.0f} examples/s, input wait {metrics.input_s * 1000:.2f} ms/step")


def deployed(router: DeploymentClient, bundle_uuid: str) -> deployments_pb2.ModelVersionStatus | None:
    """The version the router deployed from ``bundle_uuid`` once it serves; None while it is not there
    or deploying. Fails on that version only: other versions of the model (an earlier run's, restored
    or not) are not this run's business, and their state is printed once as a note."""
    try:
        versions = router.get("defect-classifier").versions
    except NotFound:
        return None
    ours = [v for v in versions if v.bundle_uuid == bundle_uuid]
    if not ours:
        return None
    version = ours[-1]
    if version.state == deployments_pb2.FAILED:
        raise SystemExit(f"deploy of version {version.version} (bundle {bundle_uuid}) failed: {version.reason}")
    if version.state != deployments_pb2.SERVING:
        return None
    for other in versions:
        if other.version != version.version:
            print(f"   (version {other.version}, an earlier one: {deployments_pb2.VersionState.Name(other.state)}"
                  f"{': ' + other.reason if other.reason else ''})")
    return version


def write_monitoring_files(model_dir: Path) -> None:
    """The deployed model's ``reference.npz`` (held-out patches, not trained or tested on: the model's
    scores on them, run from its ONNX file as it is served, and their labels) and ``monitoring.yaml``
    (window, drift, data-quality and estimated-accuracy rules), in the scorer's format. The image
    tensor is wider than the scorer monitors column by column, so its features are the per-row
    statistics the scorer takes of it: ``image.mean``, ``.std``, ``.min``, ``.max``."""
    images, labels = inspection_patches(REFERENCE_ROWS, seed=4)
    session = onnxruntime.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    scores = session.run(["defect_scores"], {"image": images.astype(np.float32)})[0]
    predicted = scores.argmax(axis=1)
    flat = images.reshape(len(images), -1).astype(np.float64)
    features = {f"image.{name}": getattr(flat, name)(axis=1) for name in ("mean", "std", "min", "max")}
    (model_dir / REFERENCE_FILE).write_bytes(reference_npz(features, predicted=predicted, scores=scores,
                                                           labels=labels))
    accuracy = float((predicted == labels).mean())
    rules = [{"name": "input-drift", "signal": "drift", "over": 0.3, "for": 2},
             {"name": "bad-input", "signal": "data_quality", "over": 0.05},
             {"name": "accuracy-low", "signal": "mpp", "under": round(max(0.0, accuracy - ACCURACY_DROP), 4),
              "for": 3, "clear_after": 3}]
    (model_dir / MONITORING_FILE).write_text(yaml.safe_dump(
        {"task": "multiclass", "outputs": {"scores": "defect_scores"}, "window": {"count": 200}, "rules": rules},
        sort_keys=False))
    print(f"   reference set: {REFERENCE_ROWS} held-out patches, accuracy {accuracy:.3f}; alert under "
          f"{rules[-1]['under']:.3f} estimated")


def serve_model(story: Story, client: BundleStoreClient, model_dir: Path) -> Ours:
    """Commit the model tagged for serving, with its reference set and monitoring rules; the
    router deploys it; predict over KServe v2. Returns what tells this prediction's event."""
    write_monitoring_files(model_dir)
    files = {name: model_dir / name
             for name in ("model.onnx", "model.yaml", "metrics.json", REFERENCE_FILE, MONITORING_FILE)}
    accuracy = json.loads(files["metrics.json"].read_text())["accuracy"]
    bundle = client.add("plant-a", "defect-classifier-onnx", files, commit=True, values={"accuracy": accuracy},
                        tags={"task": "vision-inspection", "serve": "true"})
    print(f"   committed {bundle.bundle_name} {bundle.uuid} tagged serve=true; waiting for the router to deploy it")
    with DeploymentClient(story.router_target) as router:
        version = wait_for(f"the router deploying bundle {bundle.uuid}", lambda: deployed(router, bundle.uuid),
                           timeout_s=180)
    where = ", ".join(f"{r.worker} ({r.pool_kind}, {r.precision})" for r in version.replicas)
    print(f"   version {version.version} SERVING {version.traffic_percent:.0f}% on {where}; "
          f"predicted p99 {version.predicted_p99_ms:.1f} ms")
    print("   predict through the router's inference port with tritonclient (KServe v2 gRPC)")
    images, labels = inspection_patches(8, seed=3)
    request_id = f"main-job-{uuid.uuid4().hex}"
    with triton.InferenceServerClient(story.inference_target) as kserve:
        request = triton.InferInput("image", list(images.shape), "FP32")
        request.set_data_from_numpy(images)
        scores = kserve.infer("defect-classifier", [request], model_version=str(version.version),
                              request_id=request_id).as_numpy("defect_scores")
    predicted = scores.argmax(axis=1)
    for truth, guess in zip(labels, predicted):
        print(f"   truth {CLASS_NAMES[truth]:<15} predicted {CLASS_NAMES[guess]:<15} "
              f"{'ok' if truth == guess else 'wrong'}")
    print(f"   {int((predicted == labels).sum())}/{len(labels)} right")
    return of_request(version.version, request_id)


def run(story: Story) -> str:
    print("   train the defect classifier as a traced TE job (job-orchestrator)")
    model_dir = story.workdir / "model"
    job_id = train_traced(story, model_dir)
    print("   the job's step metrics (trace-collector)")
    show_trace(story, job_id)
    with BundleStoreClient(story.bundles_target) as client:
        prediction = serve_model(story, client, model_dir)
    print(f"   predictions on {PREDICTIONS.name}")
    show_events(story, PREDICTIONS.full_name(story.topic_prefix), {"opml.inference.v1.PredictionMade"}, prediction)
    accuracy = json.loads((model_dir / "metrics.json").read_text())["accuracy"]
    return f"test accuracy {accuracy:.3f}, served, prediction published"
