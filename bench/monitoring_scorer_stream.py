"""Predictions scored per second through the broker by one monitoring-scorer process, and the time from
a window's close to its score saved and its alerts emitted, against the same scoring in-process
(no broker, no faust, no Redis) measured in the same run.

Starts the embedded infrastructure (tansu, SeaweedFS, Redis) and a bundle-store with a reference
bundle; then per case (a number of predictions per record), with its own topic and Redis prefixes, one
scorer: registers the model, stops the scorer, publishes N predictions (requests of one row each by
default, KServe v2 bytes from the shared codec) as records of that many predictions (1: one
PredictionMade a record, as an external producer or a quiet router publishes them; more: a
PredictionBatch, as the router's prediction log publishes what is queued for a version, each prediction
built by the router's contract), starts the scorer again and times it through the backlog, sampling
its metrics and CPU time from the first prediction it counts to the last window saved (wall time, and
the scorer process's CPU time: predictions per core), so neither the producer's rate nor the
scorer's start-up is measured. The cases run one after the other in one run, on the same
infrastructure, so the one-prediction-a-record case is the same run's baseline.

    .venv/bin/python bench/monitoring_scorer_stream.py                       # 20,000 one-row requests, records of 1, 5, 20, 100
    .venv/bin/python bench/monitoring_scorer_stream.py --per-record 1,100    # two cases
    .venv/bin/python bench/monitoring_scorer_stream.py --rows-per-event 10 --per-record 1  # requests of 10 rows
    .venv/bin/python bench/monitoring_scorer_stream.py --per-record 20 --label-every 2  # a label every other request

``--label-every N`` also publishes, before the scorer starts, the true label of every Nth request (under
the platform's label source), so the two agents go through both backlogs at once: labels that come
before their prediction are parked and joined by the predictions agent, and the MPP recalibrates every
200 labels. It reports labels joined per second (from the first prediction counted to the last label
joined) besides the predictions scored per second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services" / "monitoring-scorer" / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from monitoring_scorer_cbpe import throughput  # noqa: E402
from opml.inference.v1 import events_pb2 as inference_events  # noqa: E402
from opml.monitoring.v1 import label_events_pb2  # noqa: E402

from opml_bundle_store_contract.client import BundleStoreClient  # noqa: E402
from opml_common.bus import EventPublisher  # noqa: E402
from opml_common.config import PlatformSettings  # noqa: E402
from opml_common.kserve_codec import encode_outputs, encode_request  # noqa: E402
from opml_common.metrics import ServiceMetrics  # noqa: E402
from opml_devstack.devinfra import DevInfra  # noqa: E402
from opml_devstack.stack import delete_redis_keys  # noqa: E402
from opml_devstack.testing.services import ServiceStarter  # noqa: E402
from opml_inference_router_contract.names import EVENT_SOURCE as ROUTER_SOURCE  # noqa: E402
from opml_inference_router_contract.predictions import prediction_made  # noqa: E402
from opml_monitoring_scorer.__main__ import SPEC  # noqa: E402
from opml_monitoring_scorer.core.reference import Task  # noqa: E402
from opml_monitoring_scorer.core.scorer import dump_reference  # noqa: E402
from opml_monitoring_scorer.synthetic import FEATURES, SyntheticWorld  # noqa: E402
from opml_monitoring_scorer.topics import LABELS, PREDICTIONS  # noqa: E402
from opml_monitoring_scorer_contract.client import MonitoringClient  # noqa: E402
from opml_monitoring_scorer_contract.names import LABEL_SOURCE  # noqa: E402


def events(world: SyntheticWorld, n: int, rows_per_event: int = 1,
           ) -> tuple[list[inference_events.PredictionMade], list[label_events_pb2.LabelObserved]]:
    """``n`` predictions in PredictionMade events of ``rows_per_event`` rows each (a request's batch), and
    each request's true label."""
    rows = world.rows(n)
    x = np.column_stack([rows.features[f] for f in FEATURES]).astype(np.float32)
    scores = rows.outputs.class_scores().astype(np.float32)
    out, truth = [], []
    for i in range(0, n, rows_per_event):
        j = min(i + rows_per_event, n)
        colors = np.array([[c.encode()] for c in rows.features["color"][i:j]], dtype=object)
        request = encode_request("bench", {"x": x[i:j], "color": colors}, request_id=f"r{i}")
        response = encode_outputs(pb.ModelInferResponse(id=f"r{i}"), {"probabilities": scores[i:j]})
        event = inference_events.PredictionMade(request_id=f"r{i}", model_name="bench", model_version="1",
                                                infer_request=request.SerializeToString(),
                                                infer_response=response.SerializeToString())
        event.time.GetCurrentTime()
        out.append(event)
        truth.append(label_events_pb2.LabelObserved(request_id=f"r{i}", values=rows.labels[i:j].tolist()))
    return out, truth


def records(messages: list[inference_events.PredictionMade], per_record: int) -> list:
    """The predictions as the router publishes them ``per_record`` at a time: one PredictionMade, or a
    PredictionBatch of them, each prediction built by the router's contract (``prediction_made``)."""
    if per_record == 1:
        return messages
    out = []
    for i in range(0, len(messages), per_record):
        batch = inference_events.PredictionBatch()
        for m in messages[i:i + per_record]:
            prediction_made(request_id=m.request_id, model=m.model_name, version=m.model_version,
                            request=m.infer_request, response=m.infer_response,
                            received=m.time.ToNanoseconds() / 1e9, latency_s=0.001, replica="127.0.0.1:1",
                            into=batch.predictions.add())
        out.append(batch)
    return out


async def publish(settings: PlatformSettings, messages: list, labels: list[label_events_pb2.LabelObserved]) -> float:
    """Publishes the predictions (under the router's source: the scorer scores no other producer's), then
    the labels (under the platform's label source); returns the predictions' seconds."""
    publisher = EventPublisher(settings, source=ROUTER_SOURCE, metrics=ServiceMetrics("bench", CollectorRegistry()))
    labeller = EventPublisher(settings, source=LABEL_SOURCE, metrics=ServiceMetrics("bench", CollectorRegistry()))
    await publisher.start()
    await labeller.start()
    started = time.perf_counter()
    try:
        for start in range(0, len(messages), 500):
            await asyncio.gather(*(publisher.publish_proto(PREDICTIONS, m, subject="bench/1")
                                   for m in messages[start:start + 500]))
        elapsed = time.perf_counter() - started
        for start in range(0, len(labels), 500):
            await asyncio.gather(*(labeller.publish_proto(LABELS, m, subject=m.request_id)
                                   for m in labels[start:start + 500]))
    finally:
        await publisher.stop()
        await labeller.stop()
    return elapsed


def metric(port: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def watch(scorer: object, port: str, windows: int, labels: int, seen: list) -> None:
    """Samples the scorer's counters and CPU time from its start until it has saved ``windows`` windows
    and joined ``labels`` labels."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        process = scorer.process
        try:
            if process is None:
                raise OSError("not started")
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            cpu = cpu_seconds(process.pid)
        except OSError:
            time.sleep(0.02)
            continue
        sample = (time.perf_counter(), counter(text, "opml_monitoring_scorer_predictions_total"),
                  counter(text, "opml_monitoring_scorer_windows_total"), cpu,
                  joined(text), counter(text, "opml_monitoring_scorer_mpp_recalibrations_total"))
        seen.append(sample)
        if sample[2] >= windows and sample[4] >= labels:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{windows} windows and {labels} labels not done in 900 s")


def joined(text: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('opml_monitoring_scorer_labels_total{outcome="joined"}'))


def counter(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def run_case(infra_env: dict[str, str], tmp: Path, store_target: str, world: SyntheticWorld,
             messages: list, labels: list, per_record: int, args: argparse.Namespace) -> dict:
    """One scorer through a backlog of ``messages`` published ``per_record`` predictions a record."""
    tag = f"{per_record}-{time.time_ns()}"
    env = {**infra_env, "OPML_TOPIC_PREFIX": f"bench-{tag}-", "OPML_REDIS_PREFIX": f"opml-bench:{tag}:",
           "OPML_KAFKA_SESSION_TIMEOUT_MS": "3000", "OPML_KAFKA_HEARTBEAT_INTERVAL_MS": "500"}
    starter = ServiceStarter(env, tmp)
    windows = args.predictions // args.window
    try:
        scorer = starter(SPEC, tokens=None, extra_env={"OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": store_target})
        scorer.startup_timeout_s = 300.0
        with MonitoringClient(scorer.target) as client:
            client.register("bench", "1", "bench", "reference")
        # the predictions wait on the topic while the scorer is down: what is measured is the
        # scorer consuming a backlog, not the producer (which is slower than the scorer)
        scorer.stop()
        published = records(messages, per_record)
        os.environ.update(env)  # the publisher below reads the same platform settings
        publish_s = asyncio.run(publish(PlatformSettings(), published, labels))
        port = scorer.env["OPML_MONITORING_SCORER_METRICS_PORT"]
        # (wall time, predictions, windows, scorer CPU s, labels joined, recalibrations that changed the MPP)
        seen: list[tuple[float, ...]] = []
        watching = threading.Thread(target=watch, args=(scorer, port, windows, len(labels), seen), daemon=True)
        watching.start()
        scorer.start()  # restores the registration from Redis, then consumes from the earliest offset
        watching.join()
        close_sum = metric(port, "opml_monitoring_scorer_window_close_seconds_sum")
        close_count = metric(port, "opml_monitoring_scorer_window_close_seconds_count")
    finally:
        starter.stop_all()
        delete_redis_keys(env["OPML_REDIS_URL"], env["OPML_REDIS_PREFIX"])  # the machine's Redis outlives the bench
    first = next(s for s in seen if s[1] > 0)  # the first prediction counted
    last = next(s for s in seen if s[2] >= windows)  # the last window saved
    labelled = next(s for s in seen if s[4] >= len(labels))  # the last label joined
    scored = args.predictions - first[1]
    wall_s, cpu_s = last[0] - first[0], last[3] - first[3]
    if scored <= 0 or wall_s <= 0 or cpu_s <= 0:
        raise SystemExit(f"records of {per_record}: the backlog was scored between two samples of the scorer's "
                         "metrics; run with more --predictions")
    return {"per_record": per_record, "records": len(published), "producer": len(published) / publish_s,
            "scored": scored, "wall_s": wall_s, "cpu_s": cpu_s, "close_ms": 1000 * close_sum / max(close_count, 1),
            "closes": int(close_count), "labels": len(labels), "labels_s": labelled[0] - first[0],
            "recalibrations": int(seen[-1][5])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predictions", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--rows-per-event", type=int, default=1,
                        help="rows (predictions) per request: 1 = one-row requests")
    parser.add_argument("--per-record", default="1,5,20,100",
                        help="requests per Kafka record, one case each (1: PredictionMade records; more: "
                             "PredictionBatch records, as the router batches what is queued)")
    parser.add_argument("--label-every", type=int, default=0,
                        help="also publish the true label of every Nth request (0: none)")
    args = parser.parse_args()
    cases = [int(n) for n in args.per_record.split(",")]
    for n in cases:
        if args.window % (args.rows_per_event * n):
            parser.error(f"--window must be a multiple of --rows-per-event x {n} (windows close on whole records)")
    world = SyntheticWorld(Task.BINARY, seed=0)
    messages, truth = events(world, args.predictions, args.rows_per_event)
    labels = truth[::args.label_every] if args.label_every else []
    results = []
    with tempfile.TemporaryDirectory() as tmp, DevInfra(Path(tmp) / "infra") as infra:
        starter = ServiceStarter({**infra.env(), "OPML_TOPIC_PREFIX": "bench-store-"}, Path(tmp))
        try:
            store = starter("bundle-store", tokens=None)
            with BundleStoreClient(store.target) as client:
                client.create_context("bench")
                config = f"features: {{x: [{', '.join(FEATURES)}]}}\nwindow: {{count: {args.window}}}\n"
                client.add("bench", "reference", {"reference.npz": dump_reference(world.reference(3000)),
                                                  "monitoring.yaml": config.encode()}, commit=True)
            for n in cases:
                results.append(run_case(infra.env(), Path(tmp), store.target, world, messages, labels, n, args))
                r = results[-1]
                print(f"  case {n} per record done: {r['scored'] / r['wall_s']:,.0f}/s wall, "
                      f"{r['scored'] / r['cpu_s']:,.0f} per CPU-second", flush=True)
        finally:
            starter.stop_all()
    in_process = throughput(0, rows=args.predictions, window=args.window)
    print(f"{args.predictions} predictions in requests of {args.rows_per_event} row(s), windows of {args.window}, "
          f"published before the scorer starts; in-process scoring (decode + score, no broker, no faust, no "
          f"Redis, one PredictionMade each): {in_process:,.0f}/s")
    print("requests/record  records  producer rec/s  predictions/s wall  per CPU-second  CPU us/prediction  "
          "cores busy  window close")
    for r in results:
        print(f"{r['per_record']:>15}  {r['records']:>7}  {r['producer']:>14,.0f}  {r['scored'] / r['wall_s']:>12,.0f} "
              f"({r['wall_s']:5.2f} s)  {r['scored'] / r['cpu_s']:>14,.0f}  {1e6 * r['cpu_s'] / r['scored']:>17.1f}  "
              f"{r['cpu_s'] / r['wall_s']:>10.2f}  {r['close_ms']:6.1f} ms ({r['closes']})")
        if r["labels"]:
            print(f"{'':>15}  labels: {r['labels']} (every {args.label_every}th request) joined in "
                  f"{r['labels_s']:.2f} s from the first prediction counted: {r['labels'] / r['labels_s']:,.0f}/s; "
                  f"{r['recalibrations']} recalibrations changed the MPP")


if __name__ == "__main__":
    main()
