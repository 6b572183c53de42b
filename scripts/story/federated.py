"""Step 7, federated: the four lines train one model together, their data never leaving them.

Shows the fl-coordinator with the rest: each line is a member process (``federated_member.py``, the
contract's client SDK) that reads only its own line's span files and its own archive, which differ in
size from line to line, so members differ in speed and TiFL's tiers group them by their profiled round
time. A few FedAvg rounds (each from one tier) make the global model, which the coordinator commits to
the bundle-store with its reference set from the operator's held-out rows (``holdout``). The story
ships it as the served model ``inspection-federated`` with the pipeline's rollout (``rollout.yaml``):
its first version takes all traffic, a later run's goes through the rollout, driven by held-out
requests. Then the federated model and the central one of step 3 (``inspection``) answer the same
held-out rows of each line over the router's KServe v2 front, and their accuracies are compared.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as triton
import yaml
from inspection_data import LINES, inspection_patches, span_features
from opml.bundles.v1 import bundles_pb2
from opml.fl.v1 import fl_pb2
from opml.inference.v1 import deployments_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import NotFound
from opml_fl_coordinator_contract.client import FederationClient
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.rollout_spec import ROLLOUT_FILE
from opml_monitoring_scorer_contract.reference import MONITORING_FILE, REFERENCE_FILE

from .context import Story, wait_for
from .data import CONTEXT
from .pipeline import MODEL as CENTRAL
from .summary import federated_plot

MEMBER = Path(__file__).resolve().parent / "federated_member.py"
MODEL = "inspection-federated"
HOLDOUT = "inspection-holdout"
HOLDOUT_SEED = 2000
"""Seed of the held-out rows: days no span or archive was made of."""
ARCHIVE = {1: 24, 2: 8, 3: 2, 4: 0}
"""Rows each line keeps on site and never committed, in spans' worth: the members' sizes differ, so their speeds do."""
BATCH = 32
"""Rows per inference request: within both models' max_batch_size."""
CLIENT_TIMEOUT_S = 10.0
"""The deadline the story's callers set (without one, a request gets the model's default: 4 x its p99 SLO)."""
ENDED = {fl_pb2.FEDERATION_STATE_COMPLETED, fl_pb2.FEDERATION_STATE_STOPPED}


@dataclass(frozen=True)
class Size:
    rounds: int
    holdout_rows: int  # per line


SIZES = {"quick": Size(rounds=4, holdout_rows=96), "full": Size(rounds=8, holdout_rows=256)}


def fl_target() -> str:
    return os.environ.get("OPML_FL_COORDINATOR_TARGET", "127.0.0.1:50057")


def holdout(rows: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Labelled rows of each line that no model trains on: the span features of fresh patches."""
    out = {}
    for line in LINES:
        images, labels = inspection_patches(rows, seed=HOLDOUT_SEED, line=line)
        out[line] = (span_features(images).astype(np.float32), labels.astype(np.int64))
    return out


def commit_holdout(story: Story, rows: dict[int, tuple[np.ndarray, np.ndarray]]) -> str:
    """The operator's held-out set as the coordinator reads it (``holdout.npz``: ``x``, ``y``)."""
    buffer = io.BytesIO()
    np.savez(buffer, x=np.concatenate([x for x, _ in rows.values()]), y=np.concatenate([y for _, y in rows.values()]))
    with BundleStoreClient(story.bundles_target) as client:
        bundle = client.add(CONTEXT, HOLDOUT, {"holdout.npz": buffer.getvalue()}, commit=True,
                            tags={"task": "vision-inspection"}, values={"rows_per_line": len(rows[1][1])})
    return bundle.uuid


def federation_yaml(name: str, size: Size) -> str:
    return yaml.safe_dump({
        "name": name, "rounds": size.rounds, "min_clients": len(LINES), "round_deadline_s": 60,
        "strategy": {"name": "fedavg"},
        "selection": {"policy": "tifl", "clients_per_round": 2, "tiers": 2, "tier_interval": 2},
        "local": {"epochs": 3, "batch_size": 32, "learning_rate": 0.003},
        "model": {"hidden_activation": "relu"},
        "serve": False,  # the story ships it, with a rollout
        "holdout": {"context": CONTEXT, "bundle": HOLDOUT}}, sort_keys=False)


def start_members(story: Story, fl: FederationClient, name: str) -> dict[int, tuple[subprocess.Popen, Path]]:
    """A process per line, with its own token and only its own line's files."""
    folder = story.workdir / "federated"
    folder.mkdir(exist_ok=True)
    members = {}
    for line in LINES:
        token = fl.register_client(name, f"line-{line}", {"line": str(line)}).token
        spans = sorted(story.spans_dir.glob(f"*/line-{line}.csv"))
        archive = ARCHIVE[line] * story.scale.span_rows
        log = folder / f"line-{line}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, str(MEMBER), fl_target(), name, "--line", str(line), "--archive-rows", str(archive),
                 *(arg for span in spans for arg in ("--span", str(span)))],
                env={**os.environ, "OPML_FL_CLIENT_TOKEN": token}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)
        members[line] = (process, log)
        print(f"   line-{line}: member pid {process.pid}, {len(spans)} span files + {archive} archived rows",
              flush=True)
    return members


def stop_members(members: dict[int, tuple[subprocess.Popen, Path]]) -> None:
    """Members leave by themselves when the federation ends; any still running is stopped here."""
    for process, _ in members.values():
        if process.poll() is None:
            process.terminate()
    for process, _ in members.values():
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def follow_rounds(fl: FederationClient, name: str, members: dict[int, tuple[subprocess.Popen, Path]]
                  ) -> tuple[fl_pb2.Federation, list[fl_pb2.Round]]:
    """Print each round as the coordinator completes it until the federation ends; fails when a member
    exits before that."""
    rounds: list[fl_pb2.Round] = []

    def ended() -> fl_pb2.Federation | None:
        for record in fl.rounds(name)[len(rounds):]:
            rounds.append(record)
            accuracy = record.metrics.get("client_accuracy")
            dropped = f", dropped {dict(record.dropped)}" if record.dropped else ""
            tier = f"tier {record.tier}" if record.tier >= 0 else "profiling"
            print(f"   round {record.number}: {tier}, {', '.join(record.participants)}, "
                  f"{record.num_examples} examples in {record.duration_seconds:.2f} s; accuracy of the model it "
                  f"began with on their validation rows {accuracy:.3f}{dropped}" if accuracy is not None else
                  f"   round {record.number}: {', '.join(record.participants)}{dropped}", flush=True)
        federation = fl.get(name)
        if federation.state in ENDED:
            return federation
        for line, (process, log) in members.items():
            if process.poll() is not None:
                raise SystemExit(f"line-{line}'s member exited ({process.returncode}) before the federation "
                                 f"ended:\n{log.read_text(errors='replace')[-2000:]}")
        return None

    federation = wait_for(f"federation {name} ending", ended, timeout_s=300, every_s=0.5)
    ended()  # the rounds completed after the last look
    if federation.state == fl_pb2.FEDERATION_STATE_COMPLETED:  # its model is committed after it has ended

        def committed() -> fl_pb2.Federation | None:
            current = fl.get(name)
            return current if current.model_bundle else None
        federation = wait_for(f"federation {name}'s model committed", committed, timeout_s=60, every_s=0.2)
    return federation, rounds


def ship(story: Story, model_bundle: str) -> str:
    """Commit the coordinator's model as the served ``MODEL`` (its ``model.yaml`` renamed) with the
    pipeline's rollout, in the coordinator's context with its bundle as lineage input; returns the uuid."""
    context, _, rest = model_bundle.partition("/")
    uuid = rest.rpartition("@")[2]
    with BundleStoreClient(story.bundles_target) as client:
        names = {f.path for f in client.get_bundle(context, uuid).files}
        files = {name: b"".join(client.read_file(context, uuid, name))
                 for name in ("model.onnx", "model.yaml", MONITORING_FILE, REFERENCE_FILE) if name in names}
        config = yaml.safe_load(files["model.yaml"])
        files["model.yaml"] = yaml.safe_dump({**config, "name": MODEL}, sort_keys=False).encode()
        files[ROLLOUT_FILE] = yaml.safe_dump(story.scale.rollout, sort_keys=False).encode()
        bundle = client.add(context, MODEL, files, commit=True, tags={"task": "vision-inspection", "serve": "true"},
                            lineage=bundles_pb2.Lineage(creator="main-job", input_uuids=[uuid]))
    print(f"   shipped as {context}/{MODEL} {bundle.uuid[:8]} (tagged serve=true, with {ROLLOUT_FILE}: "
          f"{', '.join(next(iter(step)) for step in story.scale.rollout['steps'])})", flush=True)
    return bundle.uuid


def deployed(router: DeploymentClient, model: str, bundle_uuid: str) -> deployments_pb2.ModelVersionStatus | None:
    """The router's version of ``bundle_uuid`` once it serves; None before."""
    try:
        versions = router.get(model).versions
    except NotFound:
        return None
    ours = [v for v in versions if v.bundle_uuid == bundle_uuid]
    if ours and ours[-1].state == deployments_pb2.FAILED:
        raise SystemExit(f"deploy of bundle {bundle_uuid} failed: {ours[-1].reason}")
    return ours[-1] if ours and ours[-1].state == deployments_pb2.SERVING else None


def drive_rollout(router: DeploymentClient, kserve: triton.InferenceServerClient, version: int,
                  rows: np.ndarray) -> deployments_pb2.Rollout:
    """Send the model's callers' requests (no version named: the router splits them) until the rollout of
    ``version`` ends; print each step as it is reached."""
    metadata = kserve.get_model_metadata(MODEL)
    shown: list[tuple[int, str]] = []
    sent, failed = [0], Counter()

    def ended() -> deployments_pb2.Rollout | None:
        for _ in range(20):
            start = (sent[0] * 8) % (len(rows) - 8)
            request = triton.InferInput(metadata.inputs[0].name, [8, rows.shape[1]], "FP32")
            request.set_data_from_numpy(rows[start:start + 8])
            sent[0] += 1
            try:  # a caller's deadline, as the lines' traffic sets one; an error is the rollout's evidence
                kserve.infer(MODEL, [request], client_timeout=CLIENT_TIMEOUT_S)
            except triton.InferenceServerException as error:
                failed[error.status() or "error"] += 1
        try:
            rollout = router.get_rollout(MODEL)
        except NotFound:  # the deploy has not begun it yet (and no rollout of the model came before)
            return None
        if rollout.version != version:
            return None
        if (rollout.step, rollout.phase) not in shown:
            shown.append((rollout.step, rollout.phase))
            print(f"   rollout of version {version}: step {rollout.step} {rollout.phase} {rollout.reason}".rstrip(),
                  flush=True)
        if rollout.phase == "PAUSED":
            router.resume_rollout(MODEL)  # paused on too little traffic: the requests keep coming
        return rollout if rollout.phase in ("PROMOTED", "ABORTED") else None

    rollout = wait_for(f"the rollout of {MODEL} version {version} ending", ended, timeout_s=240, every_s=0)
    print(f"   {sent[0]} requests sent during the rollout"
          + (f", failed: {dict(failed)}" if failed else ", none failed"), flush=True)
    return rollout


def accuracy_by_line(kserve: triton.InferenceServerClient, model: str, version: int,
                     rows: dict[int, tuple[np.ndarray, np.ndarray]]) -> dict[int, float]:
    """The model version's accuracy on each line's held-out rows, as the router's front answers."""
    metadata = kserve.get_model_metadata(model, str(version))
    inputs, output = metadata.inputs[0].name, metadata.outputs[0].name
    accuracy = {}
    for line, (x, y) in rows.items():
        predicted = []
        for start in range(0, len(x), BATCH):
            batch = x[start:start + BATCH]
            request = triton.InferInput(inputs, list(batch.shape), "FP32")
            request.set_data_from_numpy(batch)
            predicted.append(kserve.infer(model, [request], model_version=str(version),
                                          client_timeout=CLIENT_TIMEOUT_S).as_numpy(output).argmax(1))
        accuracy[line] = float((np.concatenate(predicted) == y).mean())
    return accuracy


def central_version(router: DeploymentClient, story: Story) -> int:
    """The central model's version the story last made serve (``serving_version``: step 3's, or the one the loop
    retrained), or the one serving most of its traffic if that one went."""
    serving = [v for v in router.get(CENTRAL).versions if v.state == deployments_pb2.SERVING]
    ours = [v.version for v in serving if str(v.version) == str(story.handed.get("serving_version"))]
    return ours[0] if ours else max(serving, key=lambda v: v.traffic_percent).version


def serve_and_compare(story: Story, bundle_uuid: str, rows: dict[int, tuple[np.ndarray, np.ndarray]]
                      ) -> tuple[int, dict[str, dict[int, float]]]:
    """Wait for the router to serve the shipped model (through its rollout when a version served before),
    then both models' accuracy per line; returns the federated version compared and the accuracies."""
    with DeploymentClient(story.router_target) as router, triton.InferenceServerClient(story.inference_target) as kserve:
        version = wait_for(f"the router serving bundle {bundle_uuid}", lambda: deployed(router, MODEL, bundle_uuid),
                           timeout_s=180)
        print(f"   {MODEL} version {version.version} SERVING {version.traffic_percent:.0f}%", flush=True)
        if version.traffic_percent < 100:  # an earlier version serves: this one goes through the rollout
            rollout = drive_rollout(router, kserve, version.version, rows[1][0])
            print(f"   rollout {rollout.phase}: {rollout.reason or 'every step passed'}", flush=True)
        stable = max((v for v in router.get(MODEL).versions if v.state == deployments_pb2.SERVING),
                     key=lambda v: v.traffic_percent).version
        central = central_version(router, story)
        print(f"   held-out rows of each line through the router's KServe v2 front: {CENTRAL} version {central} "
              f"(central) and {MODEL} version {stable} (federated)", flush=True)
        compared = {"central": accuracy_by_line(kserve, CENTRAL, central, rows),
                    "federated": accuracy_by_line(kserve, MODEL, stable, rows)}
    return stable, compared


def run(story: Story) -> str:
    size = SIZES[story.scale.name]
    name = f"inspection-lines-{int(time.time())}"
    rows = holdout(size.holdout_rows)
    holdout_uuid = commit_holdout(story, rows)
    print(f"   held-out rows: {size.holdout_rows} a line, committed as {CONTEXT}/{HOLDOUT} {holdout_uuid[:8]}",
          flush=True)
    with FederationClient(fl_target()) as fl:
        created = fl.create(federation_yaml(name, size))
        print(f"   federation {name}: {created.total_rounds} rounds of FedAvg, TiFL 2 tiers, 2 members a round",
              flush=True)
        members: dict[int, tuple[subprocess.Popen, Path]] = {}
        try:
            members = start_members(story, fl, name)
            federation, rounds = follow_rounds(fl, name, members)
        finally:
            if fl.get(name).state not in ENDED:
                fl.stop(name)
            stop_members(members)
    for line, (_, log) in members.items():
        lines = log.read_text(errors="replace").splitlines()
        times = [float(text.split(" in ")[1].split(" s")[0]) for text in lines if text.startswith("round ")]
        print(f"   line-{line}: {len(times)} rounds trained, {np.mean(times) if times else 0:.2f} s each; "
              f"{lines[-1] if lines else ''}")
    if federation.state != fl_pb2.FEDERATION_STATE_COMPLETED or not federation.model_bundle:
        raise SystemExit(f"federation {name} ended {fl_pb2.FederationState.Name(federation.state)} "
                         f"({federation.reason}) with model {federation.model_bundle or 'none'}")
    print(f"   {federation.reason}; committed {federation.model_bundle}", flush=True)
    bundle_uuid = ship(story, federation.model_bundle)
    version, compared = serve_and_compare(story, bundle_uuid, rows)
    print("   (the central model trained on the committed spans; the members on those and on their archives, "
          "which never left them)")
    print(f"   {'line':<8} {'central':>8} {'federated':>10}")
    for line in LINES:
        print(f"   line-{line:<3} {compared['central'][line]:>8.3f} {compared['federated'][line]:>10.3f}")
    mean = {model: float(np.mean(list(values.values()))) for model, values in compared.items()}
    story.handed["federated"] = {
        "rounds": [(r.number, r.tier, r.metrics.get("client_accuracy")) for r in rounds],
        "lines": compared, "version": version}
    plot = federated_plot(story.handed["federated"], story.out)
    print(f"   plot: {plot}")
    return (f"{len(rounds)} rounds over {len(LINES)} lines; held-out accuracy federated {mean['federated']:.3f}, "
            f"central {mean['central']:.3f}")
