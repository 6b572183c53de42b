"""Predictions scored per second through the broker by one monitoring-scorer process, and the time from
a window's close to its score saved and its alerts emitted, against the same scoring in-process
(no broker, no faust, no Redis) measured in the same run.

Starts the embedded infrastructure (tansu, SeaweedFS, Redis), a bundle-store with a reference bundle
and one scorer; registers the model, stops the scorer, publishes N PredictionMade events (one row
each, KServe v2 bytes from the shared codec), starts the scorer again and times it through the
backlog, sampling its metrics and CPU time from the first prediction it counts to the last window
saved (wall time, and the scorer process's CPU time: predictions per core), so neither the
producer's rate nor the scorer's start-up is measured.

    .venv/bin/python bench/monitoring_scorer_stream.py                     # 20,000 predictions, windows of 1000
    .venv/bin/python bench/monitoring_scorer_stream.py --predictions 5000   # reduced
    .venv/bin/python bench/monitoring_scorer_stream.py --rows-per-event 10 # requests of 10 rows
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

from opml_bundle_store.client import BundleStoreClient  # noqa: E402
from opml_common.bus import EventPublisher  # noqa: E402
from opml_common.config import PlatformSettings  # noqa: E402
from opml_common.devinfra import DevInfra  # noqa: E402
from opml_common.kserve_codec import encode_outputs, encode_request  # noqa: E402
from opml_common.metrics import ServiceMetrics  # noqa: E402
from opml_common.testing.services import ServiceStarter  # noqa: E402
from opml_monitoring_scorer.__main__ import SPEC  # noqa: E402
from opml_monitoring_scorer.client import MonitoringClient  # noqa: E402
from opml_monitoring_scorer.core.reference import Task  # noqa: E402
from opml_monitoring_scorer.core.scorer import dump_reference  # noqa: E402
from opml_monitoring_scorer.synthetic import FEATURES, SyntheticWorld  # noqa: E402
from opml_monitoring_scorer.topics import PREDICTIONS  # noqa: E402


def events(world: SyntheticWorld, n: int, rows_per_event: int = 1) -> list[inference_events.PredictionMade]:
    """``n`` predictions in PredictionMade events of ``rows_per_event`` rows each (a request's batch)."""
    rows = world.rows(n)
    x = np.column_stack([rows.features[f] for f in FEATURES]).astype(np.float32)
    scores = rows.outputs.class_scores().astype(np.float32)
    out = []
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
    return out


async def publish(settings: PlatformSettings, messages: list) -> float:
    publisher = EventPublisher(settings, source="opml/bench", metrics=ServiceMetrics("bench", CollectorRegistry()))
    await publisher.start()
    started = time.perf_counter()
    try:
        for start in range(0, len(messages), 500):
            await asyncio.gather(*(publisher.publish_proto(PREDICTIONS, m, subject="bench/1")
                                   for m in messages[start:start + 500]))
    finally:
        await publisher.stop()
    return time.perf_counter() - started


def metric(port: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def watch(scorer: object, port: str, windows: int, seen: list) -> None:
    """Samples the scorer's counters and CPU time from its start until it has saved ``windows`` windows."""
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
                  counter(text, "opml_monitoring_scorer_windows_total"), cpu)
        seen.append(sample)
        if sample[2] >= windows:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{windows} windows not saved in 900 s")


def counter(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predictions", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--rows-per-event", type=int, default=1,
                        help="rows (predictions) per PredictionMade event: 1 = one request per prediction")
    args = parser.parse_args()
    if args.window % args.rows_per_event:
        parser.error("--window must be a multiple of --rows-per-event (windows close on whole events)")
    windows = args.predictions // args.window
    world = SyntheticWorld(Task.BINARY, seed=0)
    with tempfile.TemporaryDirectory() as tmp, DevInfra(Path(tmp) / "infra") as infra:
        env = {**infra.env(), "OPML_TOPIC_PREFIX": "bench-", "OPML_REDIS_PREFIX": f"opml-bench:{time.time_ns()}:",
               "OPML_KAFKA_SESSION_TIMEOUT_MS": "3000", "OPML_KAFKA_HEARTBEAT_INTERVAL_MS": "500"}
        starter = ServiceStarter(env, Path(tmp))
        try:
            store = starter("bundle-store", tokens=None)
            with BundleStoreClient(store.target) as client:
                client.create_context("bench")
                config = f"features: {{x: [{', '.join(FEATURES)}]}}\nwindow: {{count: {args.window}}}\n"
                client.add("bench", "reference", {"reference.npz": dump_reference(world.reference(3000)),
                                                  "monitoring.yaml": config.encode()}, commit=True)
            scorer = starter(SPEC, tokens=None, extra_env={"OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": store.target})
            scorer.startup_timeout_s = 300.0
            with MonitoringClient(scorer.target) as client:
                client.register("bench", "1", "bench", "reference")
            # the predictions wait on the topic while the scorer is down: what is measured is the
            # scorer consuming a backlog, not the producer (which is slower than the scorer)
            scorer.stop()
            messages = events(world, args.predictions, args.rows_per_event)
            os.environ.update(env)  # the publisher below reads the same platform settings
            publish_s = asyncio.run(publish(PlatformSettings(), messages))
            port = scorer.env["OPML_MONITORING_SCORER_METRICS_PORT"]
            seen: list[tuple[float, float, float, float]] = []  # (wall time, predictions, windows, scorer CPU s)
            watching = threading.Thread(target=watch, args=(scorer, port, windows, seen), daemon=True)
            watching.start()
            scorer.start()  # restores the registration from Redis, then consumes from the earliest offset
            watching.join()
            close_sum = metric(port, "opml_monitoring_scorer_window_close_seconds_sum")
            close_count = metric(port, "opml_monitoring_scorer_window_close_seconds_count")
        finally:
            starter.stop_all()
    first = next(s for s in seen if s[1] > 0)  # the first prediction counted
    last = next(s for s in seen if s[2] >= windows)  # the last window saved
    scored = args.predictions - first[1]
    wall_s, cpu_s = last[0] - first[0], last[3] - first[3]
    in_process = throughput(0, rows=args.predictions, window=args.window)
    stream_rate = scored / wall_s
    print(f"{args.predictions} predictions in {len(messages)} events of {args.rows_per_event} row(s), windows of "
          f"{args.window}, published before the scorer starts (producer {len(messages) / publish_s:,.0f} events/s)")
    print(f"scorer through the broker: {stream_rate:,.0f} predictions/s wall ({scored:.0f} predictions from the first "
          f"one counted to the last window saved, {wall_s:.2f} s); {scored / cpu_s:,.0f} predictions per CPU-second of the "
          f"scorer process ({cpu_s:.2f} s CPU: {cpu_s / wall_s:.2f} cores busy)")
    print(f"in-process scoring (decode + score, no broker, no faust, no Redis): {in_process:,.0f}/s; "
          f"ratio stream/in-process {stream_rate / in_process:.2f}")
    print(f"window close to score saved and alerts emitted: mean {1000 * close_sum / max(close_count, 1):.1f} ms "
          f"over {int(close_count)} windows")


if __name__ == "__main__":
    main()
