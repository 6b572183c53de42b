"""How many predictions the inference-router's prediction log puts in a record at a given rate of
one-row requests: the record sizes the monitoring-scorer is fed (its cost is per record; see
bench/monitoring_scorer_stream.py for what it scores per CPU-second at each size).

Starts the embedded infrastructure (tansu as ``make up`` runs it), then per rate queues one-row
requests on a ``PredictionLog`` with the router's default settings (senders, batch bounds, records in
flight per version; from ``RouterSettings``) publishing through the platform's ``EventPublisher``,
at that rate for ``--seconds``, as the request path does (``record``, no await), and counts the
records the broker acknowledged by type (the publisher's ``events_published_total``) and the
predictions in them.

    .venv/bin/python bench/monitoring_scorer_router_batches.py                 # 1,000 / 3,000 / 10,000 per second
    .venv/bin/python bench/monitoring_scorer_router_batches.py --rates 10000 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services" / "monitoring-scorer" / "src"))

from opml_common.bus import EventPublisher, ensure_topics  # noqa: E402
from opml_common.config import PlatformSettings  # noqa: E402
from opml_common.kserve_codec import encode_outputs, encode_request  # noqa: E402
from opml_common.metrics import ServiceMetrics  # noqa: E402
from opml_devstack.devinfra import DevInfra  # noqa: E402
from opml_inference_router.predictions import PredictionLog  # noqa: E402
from opml_inference_router.routing import Routed  # noqa: E402
from opml_inference_router.settings import RouterSettings  # noqa: E402
from opml_inference_router_contract.names import EVENT_SOURCE  # noqa: E402
from opml_inference_router_contract.topics import PREDICTIONS  # noqa: E402


def one_row_requests(n: int) -> list[tuple[bytes, bytes]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        request = encode_request("bench", {"x": rng.normal(size=(1, 4)).astype(np.float32),
                                           "color": np.array([[b"red"]], dtype=object)}, request_id=f"r{i}")
        p = rng.uniform()
        response = encode_outputs(pb.ModelInferResponse(id=f"r{i}"),
                                  {"probabilities": np.array([[1 - p, p]], dtype=np.float32)})
        out.append((request.SerializeToString(), response.SerializeToString()))
    return out


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def run_rate(settings: PlatformSettings, rate: int, seconds: float, messages: list[tuple[bytes, bytes]],
                   ) -> dict:
    router = RouterSettings.model_fields
    registry = CollectorRegistry()
    publisher = EventPublisher(settings, source=EVENT_SOURCE,
                               metrics=ServiceMetrics("bench-publisher", registry))
    log = PredictionLog(publisher, ServiceMetrics("inference-router", registry),
                        senders=router["prediction_senders"].default, batch_max=router["prediction_batch_max"].default,
                        batch_max_bytes=router["prediction_batch_max_bytes"].default,
                        in_flight_per_version=router["prediction_in_flight_per_version"].default)
    routed = Routed(b"", "1", "127.0.0.1:1", 1, False)
    await publisher.start()
    queued = 0
    try:
        async with log:
            loop = asyncio.get_running_loop()
            started = loop.time()
            while (elapsed := loop.time() - started) < seconds:
                due = int(rate * elapsed)
                while queued < due:
                    request, response = messages[queued % len(messages)]
                    log.record(request_id=f"req-{queued}", model="bench", routed=routed, request=request,
                               response=response, received=time.time(), latency_s=0.001)
                    queued += 1
                await asyncio.sleep(0.001)
            offered_s = loop.time() - started
            while log.pending:  # what is still queued is published (stop drains the rest)
                await asyncio.sleep(0.005)
    finally:
        await publisher.stop()
    records = {kind: sample(registry, "opml_bench_publisher_events_published_total", topic=PREDICTIONS.name,
                            type=f"opml.inference.v1.{kind}") for kind in ("PredictionMade", "PredictionBatch")}
    published = sample(registry, "opml_inference_router_predictions_published_total")
    dropped = sum(sample(registry, "opml_inference_router_predictions_dropped_total", reason=r)
                  for r in ("queue_full", "publish_failed", "shutdown"))
    return {"rate": rate, "offered": queued / offered_s, "published": published, "dropped": dropped,
            "records": sum(records.values()), "singles": records["PredictionMade"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1000,3000,10000", help="one-row requests per second, one run each")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    messages = one_row_requests(2000)
    results = []
    with tempfile.TemporaryDirectory() as tmp, DevInfra(Path(tmp) / "infra") as infra:
        for rate in (int(r) for r in args.rates.split(",")):
            os.environ.update({**infra.env(), "OPML_TOPIC_PREFIX": f"bench-{rate}-{time.time_ns()}-"})
            settings = PlatformSettings()
            asyncio.run(ensure_topics(settings, [PREDICTIONS]))
            results.append(asyncio.run(run_rate(settings, rate, args.seconds, messages)))
    defaults = RouterSettings.model_fields
    print(f"prediction log with the router's defaults: senders {defaults['prediction_senders'].default}, "
          f"batch max {defaults['prediction_batch_max'].default}, in flight per version "
          f"{defaults['prediction_in_flight_per_version'].default}; one version, one-row requests, {args.seconds:g} s")
    print("rate asked  offered/s  published  dropped  records  one-prediction records  predictions per record")
    for r in results:
        print(f"{r['rate']:>10,}  {r['offered']:>9,.0f}  {r['published']:>9,.0f}  {r['dropped']:>7,.0f}  "
              f"{r['records']:>7,.0f}  {r['singles']:>22,.0f}  {r['published'] / max(r['records'], 1):>22.1f}")


if __name__ == "__main__":
    main()
