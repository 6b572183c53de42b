"""Predictions scored per second through the broker by one monitoring-scorer process, and the time from
a window's close to its score saved and its alerts emitted, against the same scoring in-process
(no broker, no faust, no Redis) measured in the same run.

Starts the embedded infrastructure (tansu, SeaweedFS, Redis), a bundle-store with a reference bundle
and one scorer; publishes N PredictionMade events (one row each, KServe v2 bytes from the shared
codec) as fast as the producer goes, and waits until the scorer has closed every window.

    .venv/bin/python bench/monitoring_scorer_stream.py                     # 20,000 predictions, windows of 1000
    .venv/bin/python bench/monitoring_scorer_stream.py --predictions 5000   # reduced
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
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


def events(world: SyntheticWorld, n: int) -> list[inference_events.PredictionMade]:
    rows = world.rows(n)
    x = np.column_stack([rows.features[f] for f in FEATURES]).astype(np.float32)
    scores = rows.outputs.class_scores().astype(np.float32)
    out = []
    for i in range(n):
        request = encode_request("bench", {"x": x[i:i + 1], "color": np.array([[rows.features["color"][i].encode()]],
                                                                                dtype=object)}, request_id=f"r{i}")
        response = encode_outputs(pb.ModelInferResponse(id=f"r{i}"), {"probabilities": scores[i:i + 1]})
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predictions", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    args = parser.parse_args()
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
            with MonitoringClient(scorer.target) as client:
                client.register("bench", "1", "bench", "reference")
                messages = events(world, args.predictions)
                os.environ.update(env)  # the publisher below reads the same platform settings
                started = time.perf_counter()
                publish_s = asyncio.run(publish(PlatformSettings(), messages))
                while len(list(client.windows("bench", "1", page_size=1000))) < windows:
                    time.sleep(0.05)
                total_s = time.perf_counter() - started
            port = scorer.env["OPML_MONITORING_SCORER_METRICS_PORT"]
            close_sum = metric(port, "opml_monitoring_scorer_window_close_seconds_sum")
            close_count = metric(port, "opml_monitoring_scorer_window_close_seconds_count")
        finally:
            starter.stop_all()
    in_process = throughput(0, rows=args.predictions, window=args.window)
    stream_rate = args.predictions / total_s
    print(f"{args.predictions} predictions, windows of {args.window}: producer {args.predictions / publish_s:,.0f}/s; "
          f"scorer through the broker {stream_rate:,.0f} predictions/s (first publish to last window saved, "
          f"{total_s:.1f} s); in-process scoring {in_process:,.0f}/s; ratio {stream_rate / in_process:.2f}")
    print(f"window close to score saved and alerts emitted: mean {1000 * close_sum / max(close_count, 1):.1f} ms "
          f"over {int(close_count)} windows")


if __name__ == "__main__":
    main()
