"""tansu's storage engines at the platform's own event sizes and batching: memory vs s3 (SeaweedFS).

`make up` can run the embedded broker with its log in memory (lost on every broker restart) or on
the embedded SeaweedFS (durable). This measures what durability costs, through the platform's own
``EventPublisher`` (acks=all, CloudEvents in binary mode), in the two ways the services publish:

- **one at a time**: each publish awaited before the next, as the outbox flushes (BundleCommitted
  events of a few hundred bytes, keyed by bundle name);
- **concurrent**: ``--senders`` tasks publishing at once, 8 as the inference-router's prediction log
  does and 64 to show how far batching goes (PredictionMade events of a few hundred bytes, keyed by
  model/version); aiokafka batches what is in flight to one partition into one request.

Both engines run side by side (one DevInfra each, its own SeaweedFS) and the workloads alternate
between them for ``--rounds`` rounds, so load on the machine falls on both alike. Prints msgs/s and
p50/p99 publish latency per engine and workload, and the ratios s3/memory of the same run.

    .venv/bin/python bench/broker_storage.py [--rounds 3] [--sequential 300] [--concurrent 3000] [--senders 8 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp
from opml.bundles.v1 import bundles_pb2
from opml.bundles.v1 import events_pb2 as bundle_events
from opml.inference.v1 import events_pb2 as inference_events
from prometheus_client import CollectorRegistry

from opml_common.bus import CloudEvent, EventPublisher, ensure_topics
from opml_common.config import PlatformSettings
from opml_common.metrics import ServiceMetrics
from opml_common.topics import Topic
from opml_devstack.devinfra import KAFKA_STORAGES, DevInfra

SOURCE = "opml/bench-broker-storage"
BUNDLES = Topic.of(bundle_events)
PREDICTIONS = Topic.of(inference_events)


def bundle_committed(i: int) -> bundle_events.BundleCommitted:
    """A committed bundle as bundle-store announces it: a few files, values, tags, lineage."""
    stamp = Timestamp()
    stamp.GetCurrentTime()
    bundle_id = str(uuid.uuid4())
    bundle = bundles_pb2.Bundle(
        name=f"contexts/plant-a/bundles/{bundle_id}", context="plant-a", bundle_name=f"defect-classifier-{i % 7}",
        uuid=bundle_id, tags={"stage": "candidate", "serve": "true"}, content_hash="ab" * 32, committed=True,
        create_time=stamp, commit_time=stamp)
    for path in ("model.onnx", "metrics.json"):
        bundle.files.add(path=path, sha256="cd" * 32, size_bytes=123_456)
    return bundle_events.BundleCommitted(bundle=bundle)


def prediction_made(i: int) -> inference_events.PredictionMade:
    """A prediction as the router logs it: a small KServe request and response recorded as bytes."""
    stamp = Timestamp()
    stamp.GetCurrentTime()
    return inference_events.PredictionMade(
        request_id=f"req-{i}-{uuid.uuid4().hex[:8]}", model_name="defect-classifier", model_version="3", time=stamp,
        latency_ms=1.7, replica="unix:///tmp/opml/worker-0.sock", infer_request=bytes(160),
        infer_response=bytes(48), attempts=1)


class Engine:
    """One engine's broker, a publisher on it, and the latencies measured per workload."""

    def __init__(self, name: str, endpoints, prefix: str) -> None:
        self.name = name
        self.settings = PlatformSettings(kafka_bootstrap=endpoints.kafka_bootstrap, topic_prefix=prefix)
        self.publisher = EventPublisher(self.settings, source=SOURCE,
                                        metrics=ServiceMetrics("bench", registry=CollectorRegistry()))
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.elapsed: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.sizes: dict[str, int] = {}

    async def start(self) -> None:
        await ensure_topics(self.settings, [BUNDLES, PREDICTIONS])
        await self.publisher.start()

    async def sequential(self, count: int, *, record: bool = True) -> None:
        events = [CloudEvent.from_proto(bundle_committed(i), source=SOURCE, subject=f"defect-classifier-{i % 7}")
                  for i in range(count)]
        self.sizes["one at a time"] = _record_size(events[0])
        latencies = []
        began = time.perf_counter()
        for event in events:
            start = time.perf_counter()
            await self.publisher.publish(BUNDLES, event)
            latencies.append(time.perf_counter() - start)
        if record:
            self._add("one at a time", latencies, time.perf_counter() - began)

    async def concurrent(self, count: int, senders: int, *, record: bool = True) -> None:
        events = [CloudEvent.from_proto(prediction_made(i), source=SOURCE, subject="defect-classifier/3")
                  for i in range(count)]
        workload = concurrent_name(senders)
        self.sizes[workload] = _record_size(events[0])
        queue = list(reversed(events))
        latencies: list[float] = []

        async def sender() -> None:
            while queue:
                event = queue.pop()
                start = time.perf_counter()
                await self.publisher.publish(PREDICTIONS, event, key="defect-classifier/3")
                latencies.append(time.perf_counter() - start)

        began = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(senders)))
        if record:
            self._add(workload, latencies, time.perf_counter() - began)

    def _add(self, workload: str, latencies: list[float], elapsed: float) -> None:
        self.latencies[workload].extend(latencies)
        self.elapsed[workload] += elapsed
        self.counts[workload] += len(latencies)

    def rate(self, workload: str) -> float:
        return self.counts[workload] / self.elapsed[workload]

    def percentile(self, workload: str, q: float) -> float:
        values = sorted(self.latencies[workload])
        return values[min(len(values) - 1, int(q * len(values)))] * 1000.0


def concurrent_name(senders: int) -> str:
    return f"concurrent, {senders} senders"


def workloads(args: argparse.Namespace) -> list[str]:
    return ["one at a time", *(concurrent_name(n) for n in args.senders)]


def _record_size(event: CloudEvent) -> int:
    """Bytes of one record: value plus ce_* headers (what the broker stores per event)."""
    return len(event.data) + sum(len(name) + len(value) for name, value in event.kafka_headers())


async def run(args: argparse.Namespace, engines: list[Engine]) -> None:
    for engine in engines:
        await engine.start()
        await engine.sequential(20, record=False)  # warm-up: metadata, connections, the first objects
        await engine.concurrent(200, max(args.senders), record=False)
    try:
        for round_ in range(args.rounds):
            order = engines if round_ % 2 == 0 else list(reversed(engines))  # ABBA: neither always goes first
            for engine in order:
                await engine.sequential(args.sequential)
            for senders in args.senders:
                for engine in order:
                    await engine.concurrent(args.concurrent, senders)
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for engine in engines:
            await engine.publisher.stop()


def report(args: argparse.Namespace, engines: list[Engine]) -> None:
    by_name = {engine.name: engine for engine in engines}
    print(f"\ntansu storage engines, EventPublisher acks=all, {args.rounds} rounds "
          f"(one at a time: {args.sequential} BundleCommitted per round; concurrent: {args.concurrent} "
          f"PredictionMade per round and sender count)\n")
    print("| workload | record bytes | engine | msgs/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|")
    for workload in workloads(args):
        for engine in engines:
            print(f"| {workload} | {engine.sizes[workload]} | {engine.name} | {engine.rate(workload):,.0f} | "
                  f"{engine.percentile(workload, 0.5):.2f} | {engine.percentile(workload, 0.99):.2f} |")
    if {"memory", "s3"} <= by_name.keys():
        memory, s3 = by_name["memory"], by_name["s3"]
        print("\n| workload | msgs/s s3/memory | p50 s3/memory | p99 s3/memory |")
        print("|---|---|---|---|")
        for workload in workloads(args):
            print(f"| {workload} | {s3.rate(workload) / memory.rate(workload):.2f}x | "
                  f"{s3.percentile(workload, 0.5) / memory.percentile(workload, 0.5):.2f}x | "
                  f"{s3.percentile(workload, 0.99) / memory.percentile(workload, 0.99):.2f}x |")
    for engine in engines:
        for workload in workloads(args):
            mean = statistics.fmean(engine.latencies[workload]) * 1000.0
            print(f"{engine.name:>6} {workload:<13} mean {mean:.2f} ms over {engine.counts[workload]} publishes",
                  file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential", type=int, default=300, help="one-at-a-time publishes per round")
    parser.add_argument("--concurrent", type=int, default=3000, help="concurrent publishes per round")
    parser.add_argument("--senders", type=int, nargs="+", default=[8, 64],
                        help="concurrent senders, one workload each (the prediction log has 8)")
    parser.add_argument("--engines", nargs="+", choices=KAFKA_STORAGES, default=list(KAFKA_STORAGES))
    args = parser.parse_args()
    prefix = f"bench-{uuid.uuid4().hex[:8]}-"
    with tempfile.TemporaryDirectory(prefix="opml-bench-broker-") as tmp, ExitStack() as stack:
        engines = []
        for name in args.engines:
            endpoints = stack.enter_context(DevInfra(workdir=Path(tmp) / name, kafka_storage=name))
            engines.append(Engine(name, endpoints, prefix))
        asyncio.run(run(args, engines))
    report(args, engines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
