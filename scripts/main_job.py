"""The platform's main job, as far as the platform exists: run by `make up` against the live stack.

The vision-inspection story:
1-5. bundle-store: a plant's training output becomes a committed bundle, is pushed to S3, pulled
     into a second plant's context, verified byte for byte, and the bundle events are read back
     from Kafka with a plain consumer.
6.   job-orchestrator: a defect classifier is trained as a TE job, its TensorFlow traced with no
     change to its code (``main_job_train.py`` is plain Keras), and exported to ONNX.
7.   trace-collector: the job's always-on step metrics, as the service aggregated them.
8-9. The model is committed as a bundle tagged ``serve=true``, with a reference set and monitoring
     rules (so the monitoring-scorer estimates its accuracy and alerts from its first window); the
     inference-router deploys it from the bundles topic, serves it over KServe v2 (tritonclient),
     and publishes each prediction.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime
import tritonclient.grpc as triton
import yaml
from aiokafka import AIOKafkaConsumer
from inspection_data import CLASS_NAMES, inspection_patches
from opml.bundles.v1 import bundles_pb2 as pb
from opml.bundles.v1 import events_pb2 as bundle_events
from opml.inference.v1 import deployments_pb2
from opml.inference.v1 import events_pb2 as inference_events
from opml.jobs.v1 import jobs_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.errors import AlreadyExists, NotFound
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.topics import PREDICTIONS
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import load_spec
from opml_monitoring_scorer_contract.reference import MONITORING_FILE, REFERENCE_FILE, reference_npz
from opml_trace_collector_contract.client import TraceCollectorClient

TARGET = os.environ.get("OPML_BUNDLE_STORE_TARGET", "127.0.0.1:50051")
JOBS_TARGET = os.environ.get("OPML_JOB_ORCHESTRATOR_TARGET", "127.0.0.1:50052")
ROUTER_TARGET = os.environ.get("OPML_INFERENCE_ROUTER_TARGET", "127.0.0.1:50053")
# The router's inference port: its native KServe v2 front (the Python port above serves inference too)
INFERENCE_TARGET = os.environ.get("OPML_INFERENCE_ROUTER_INFERENCE_TARGET", "127.0.0.1:8001")
TRACES_TARGET = os.environ.get("OPML_TRACE_COLLECTOR_TARGET", "127.0.0.1:50054")
REMOTE = os.environ.get("OPML_MAIN_JOB_REMOTE", "s3://opml-bundles/vision-inspection")
TRAIN = Path(__file__).resolve().parent / "main_job_train.py"
TERMINAL = {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}
EVENTS_TIMEOUT_S = 60.0
"""How long in all a step waits for its events on a topic."""
Ours = Callable[[str, str, bytes], bool]
"""(ce_type, ce_subject, value) -> whether the event is this run's."""
REFERENCE_ROWS = 1000
ACCURACY_DROP = 0.10
"""Fall of the estimated accuracy below the reference's that raises the deployed model's alert."""


def ensure_context(client: BundleStoreClient, name: str) -> None:
    try:
        client.create_context(name, REMOTE)
    except AlreadyExists:
        client.set_remote(name, REMOTE)


def make_training_output(directory: Path) -> dict[str, Path]:
    """A stand-in training run's outputs: weights, a confusion matrix, and the training config."""
    weights = directory / "weights.bin"
    weights.write_bytes(random.Random(7).randbytes(4 * 64 * 64 * 3 * 8))
    confusion = directory / "confusion.json"
    confusion.write_text(json.dumps({"ok": {"ok": 912, "defect": 9}, "defect": {"ok": 14, "defect": 65}}))
    config = directory / "train-config.json"
    config.write_text(json.dumps({"epochs": 12, "batch_size": 64, "lr": 3e-4}))
    return {"model/weights.bin": weights, "eval/confusion.json": confusion, "train-config.json": config}


def of_bundle(bundle_uuid: str) -> Ours:
    """This run's bundle events: of the bundle version it committed (the subject is the bundle name,
    the same in every run)."""
    messages = {"opml.bundles.v1.BundleCommitted": bundle_events.BundleCommitted,
                "opml.bundles.v1.BundlePushed": bundle_events.BundlePushed}

    def ours(kind: str, subject: str, value: bytes) -> bool:
        return (subject == "defect-classifier" and kind in messages
                and messages[kind].FromString(value).bundle.uuid == bundle_uuid)
    return ours


def of_request(version: int, request_id: str) -> Ours:
    """This run's prediction: its request, of the version this run deployed."""
    def ours(kind: str, subject: str, value: bytes) -> bool:
        return (subject == f"defect-classifier/{version}" and kind == "opml.inference.v1.PredictionMade"
                and inference_events.PredictionMade.FromString(value).request_id == request_id)
    return ours


async def show_events(bootstrap: str, topic: str, expect: set[str], ours: Ours, *,
                      timeout_s: float = EVENTS_TIMEOUT_S) -> None:
    """Print this run's events on ``topic`` until one of each type in ``expect`` came. The topic is read
    from its start, so it holds earlier runs' events too: only those ``ours`` accepts count.

    Raises: SystemExit: they did not all come within ``timeout_s`` in all (naming the missing)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None)
    seen: set[str] = set()
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
            while not expect <= seen:
                for records in (await consumer.getmany(timeout_ms=1000)).values():
                    for record in records:
                        headers = {k: v.decode(errors="replace") for k, v in record.headers or ()}
                        kind, subject = headers.get("ce_type", ""), headers.get("ce_subject", "")
                        if kind in expect and ours(kind, subject, record.value or b""):
                            seen.add(kind)
                            print(f"  event {kind:<34} id={headers.get('ce_id', '')[:8]} subject={subject} "
                                  f"partition={record.partition} offset={record.offset}")
    except TimeoutError:
        raise SystemExit(f"this run's {', '.join(sorted(expect - seen))} did not reach {topic} within "
                         f"{timeout_s:.0f} s") from None
    finally:
        await consumer.stop()


def wait_for(what: str, check, timeout_s: float = 180.0, every_s: float = 1.0):
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(every_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")


def train_traced(model_dir: Path) -> str:
    """Step 6: the training program as a traced TE job; returns the job id. ``model_dir`` (not made yet)
    is the job's checkpoint folder: the orchestrator makes it for the job's own user (a sandboxed job
    may write nothing else of ours), and this script reads the model from it."""
    job_id = f"defect-classifier-train-{int(time.time())}"
    spec = load_spec({"name": job_id, "class": "TE", "trace": True, "checkpoint": {"dir": str(model_dir)},
                      "command": [sys.executable, str(TRAIN), "--out", str(model_dir)],
                      "roles": {"worker": {"replicas": 1, "resources": {"cpu": "1000m", "memory": "2Gi"}}}})
    with JobClient(JOBS_TARGET) as jobs:
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


def show_trace(job_id: str) -> None:
    """Step 7: what the trace-collector aggregated of the job, with no line of it changed."""
    with TraceCollectorClient(TRACES_TARGET) as traces:
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


def serve_model(client: BundleStoreClient, model_dir: Path) -> Ours:
    """Steps 8-9: commit the model tagged for serving, with its reference set and monitoring rules; the
    router deploys it; predict over KServe v2. Returns what tells this prediction's event."""
    write_monitoring_files(model_dir)
    files = {name: model_dir / name
             for name in ("model.onnx", "model.yaml", "metrics.json", REFERENCE_FILE, MONITORING_FILE)}
    accuracy = json.loads(files["metrics.json"].read_text())["accuracy"]
    bundle = client.add("plant-a", "defect-classifier-onnx", files, commit=True, values={"accuracy": accuracy},
                        tags={"task": "vision-inspection", "serve": "true"})
    print(f"8. committed {bundle.bundle_name} {bundle.uuid} tagged serve=true; waiting for the router to deploy it")
    with DeploymentClient(ROUTER_TARGET) as router:
        version = wait_for(f"the router deploying bundle {bundle.uuid}", lambda: deployed(router, bundle.uuid),
                           timeout_s=180)
    where = ", ".join(f"{r.worker} ({r.pool_kind}, {r.precision})" for r in version.replicas)
    print(f"   version {version.version} SERVING {version.traffic_percent:.0f}% on {where}; "
          f"predicted p99 {version.predicted_p99_ms:.1f} ms")
    print("9. predict through the router's inference port with tritonclient (KServe v2 gRPC)")
    images, labels = inspection_patches(8, seed=3)
    request_id = f"main-job-{uuid.uuid4().hex}"
    with triton.InferenceServerClient(INFERENCE_TARGET) as kserve:
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


def main() -> int:
    with BundleStoreClient(TARGET) as client, tempfile.TemporaryDirectory() as tmp:
        for context in ("plant-a", "plant-b"):
            ensure_context(client, context)
        files = make_training_output(Path(tmp))
        print("1. plant-a: add and commit the defect classifier's training output")
        added = client.add("plant-a", "defect-classifier", files, commit=True,
                           values={"accuracy": 0.977, "epochs": 12, "line": "inspection-line-3"},
                           tags={"task": "vision-inspection", "stage": "candidate"},
                           lineage=pb.Lineage(code_version="main-job", parameters={"lr": "3e-4"}))
        print(f"   {added.bundle_name} {added.uuid} committed={added.committed} hash={added.content_hash[:16]}")
        print(f"2. push to {REMOTE}")
        pushed = [m for m in client.push("plant-a", added.uuid) if m.done][0]
        print(f"   {pushed.files_done}/{pushed.files_total} files, {pushed.bytes_done} bytes")
        print("3. plant-b: pull with --localize (every blob verified against its sha256)")
        pulled = [m for m in client.pull("plant-b", "defect-classifier", localize=True) if m.done][0]
        print(f"   {len(pulled.bundles)} bundle versions pulled")
        print("4. verify plant-b's copy byte for byte")
        copy = client.get_bundle("plant-b", added.uuid)
        download = Path(tmp) / "plant-b"
        client.download("plant-b", added.uuid, download)
        for path, source in files.items():
            ours = hashlib.sha256(source.read_bytes()).hexdigest()
            theirs = hashlib.sha256((download / path).read_bytes()).hexdigest()
            status = "ok" if ours == theirs else "MISMATCH"
            print(f"   {path:<24} {theirs[:16]} {status}")
            if ours != theirs:
                return 1
        assert copy.content_hash == added.content_hash, "content hash differs between contexts"
        print(f"   content hash equal in both contexts: {copy.content_hash[:16]}")
        bootstrap, prefix = os.environ["OPML_KAFKA_BOOTSTRAP"], os.environ.get("OPML_TOPIC_PREFIX", "")
        print(f"5. events on {BUNDLES.name}")
        asyncio.run(show_events(bootstrap, BUNDLES.full_name(prefix),
                                {"opml.bundles.v1.BundleCommitted", "opml.bundles.v1.BundlePushed"},
                                of_bundle(added.uuid)))
        print("6. train the defect classifier as a traced TE job (job-orchestrator)")
        os.chmod(tmp, 0o711)  # the job's user may pass through to its model folder, and list nothing here
        model_dir = Path(tmp) / "model"
        job_id = train_traced(model_dir)
        print("7. the job's step metrics (trace-collector)")
        show_trace(job_id)
        prediction = serve_model(client, model_dir)
        print(f"10. predictions on {PREDICTIONS.name}")
        asyncio.run(show_events(bootstrap, PREDICTIONS.full_name(prefix), {"opml.inference.v1.PredictionMade"},
                                prediction))
    return 0


if __name__ == "__main__":
    sys.exit(main())
