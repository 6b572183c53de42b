"""Labels joined per second by one monitoring-scorer process through the broker, and the scorer's CPU
seconds per 1,000 labels joined.

Starts the embedded infrastructure (tansu, SeaweedFS, Redis), a bundle-store with a reference bundle
and one scorer; registers a model, publishes N one-row predictions (PredictionBatch records of
``--per-record``, as the router's prediction log publishes them) and waits until the scorer has closed
every window (so each prediction is kept for the join). Then it stops the scorer, publishes the true
label of every ``--label-every``th request (LabelObserved under the platform's label source, as
SubmitLabels publishes them), starts the scorer again and times it through that backlog: from the
first label it counts joined to the last (wall time, and the scorer process's CPU time from
/proc), so neither the producer's rate nor the scorer's start-up is measured. Every label joins a
closed window, so each one re-saves and re-announces its window's truth (what a rollout's accuracy
check waits for).

    .venv/bin/python bench/monitoring_scorer_labels.py                        # 20,000 predictions, 10,000 labels
    .venv/bin/python bench/monitoring_scorer_labels.py --predictions 40000 --label-every 1
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

from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services" / "monitoring-scorer" / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from monitoring_scorer_stream import counter, cpu_seconds, events, joined, records  # noqa: E402

from opml_bundle_store_contract.client import BundleStoreClient  # noqa: E402
from opml_common.bus import EventPublisher  # noqa: E402
from opml_common.config import PlatformSettings  # noqa: E402
from opml_common.metrics import ServiceMetrics  # noqa: E402
from opml_devstack.devinfra import DevInfra  # noqa: E402
from opml_devstack.stack import delete_redis_keys  # noqa: E402
from opml_devstack.testing.services import ServiceStarter  # noqa: E402
from opml_inference_router_contract.names import EVENT_SOURCE as ROUTER_SOURCE  # noqa: E402
from opml_monitoring_scorer.__main__ import SPEC  # noqa: E402
from opml_monitoring_scorer.core.reference import Task  # noqa: E402
from opml_monitoring_scorer.core.scorer import dump_reference  # noqa: E402
from opml_monitoring_scorer.synthetic import FEATURES, SyntheticWorld  # noqa: E402
from opml_monitoring_scorer.topics import LABELS, PREDICTIONS  # noqa: E402
from opml_monitoring_scorer_contract.client import MonitoringClient  # noqa: E402
from opml_monitoring_scorer_contract.names import LABEL_SOURCE  # noqa: E402


async def publish(settings: PlatformSettings, topic: object, messages: list, *, source: str,
                  subject: object) -> None:
    publisher = EventPublisher(settings, source=source, metrics=ServiceMetrics("bench", CollectorRegistry()))
    await publisher.start()
    try:
        for start in range(0, len(messages), 500):
            await asyncio.gather(*(publisher.publish_proto(topic, m, subject=subject(m))
                                   for m in messages[start:start + 500]))
    finally:
        await publisher.stop()


def scrape(port: str) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def wait_windows(port: str, windows: int) -> None:
    deadline = time.monotonic() + 900
    while counter(scrape(port), "opml_monitoring_scorer_windows_total") < windows:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{windows} windows not closed in 900 s")
        time.sleep(0.2)


def watch(scorer: object, port: str, labels: int, seen: list) -> None:
    """Samples the scorer's labels joined and CPU time from its start until ``labels`` are joined."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        process = scorer.process
        try:
            if process is None:
                raise OSError("not started")
            text, cpu = scrape(port), cpu_seconds(process.pid)
        except OSError:
            time.sleep(0.02)
            continue
        seen.append((time.perf_counter(), joined(text), cpu))
        if seen[-1][1] >= labels:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{labels} labels not joined in 900 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predictions", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--per-record", type=int, default=20)
    parser.add_argument("--label-every", type=int, default=2)
    args = parser.parse_args()
    world = SyntheticWorld(Task.BINARY, seed=0)
    messages, truth = events(world, args.predictions)
    labels = truth[::args.label_every]
    windows = args.predictions // args.window
    with tempfile.TemporaryDirectory() as tmp, DevInfra(Path(tmp) / "infra") as infra:
        tag = f"labels-{time.time_ns()}"
        env = {**infra.env(), "OPML_TOPIC_PREFIX": f"bench-{tag}-", "OPML_REDIS_PREFIX": f"opml-bench:{tag}:",
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
            port = scorer.env["OPML_MONITORING_SCORER_METRICS_PORT"]
            with MonitoringClient(scorer.target) as client:
                client.register("bench", "1", "bench", "reference")
            os.environ.update(env)  # the publishers below read the same platform settings
            settings = PlatformSettings()
            asyncio.run(publish(settings, PREDICTIONS, records(messages, args.per_record), source=ROUTER_SOURCE,
                                subject=lambda m: "bench/1"))
            wait_windows(port, windows)
            # the labels wait on the topic while the scorer is down: what is measured is the join
            # through a backlog, not the producer
            scorer.stop()
            asyncio.run(publish(settings, LABELS, labels, source=LABEL_SOURCE, subject=lambda m: m.request_id))
            seen: list[tuple[float, float, float]] = []  # (wall time, labels joined, scorer CPU s)
            watching = threading.Thread(target=watch, args=(scorer, port, len(labels), seen), daemon=True)
            watching.start()
            scorer.start()  # restores the registration from Redis, then consumes the labels
            watching.join()
        finally:
            starter.stop_all()
            delete_redis_keys(env["OPML_REDIS_URL"], env["OPML_REDIS_PREFIX"])  # the machine's Redis outlives the bench
    first = next(s for s in seen if s[1] > 0)
    last = seen[-1]
    count = last[1] - first[1]
    wall_s, cpu_s = last[0] - first[0], last[2] - first[2]
    if count <= 0 or wall_s <= 0:
        raise SystemExit("the labels were joined between two samples of the scorer's metrics; run with more labels")
    print(f"{len(labels)} labels (one in {args.label_every} of {args.predictions} one-row predictions, "
          f"{windows} closed windows of {args.window}), published before the scorer starts")
    print(f"labels joined/s: {count / wall_s:,.0f} ({count:.0f} in {wall_s:.2f} s); scorer CPU-s per 1,000 "
          f"labels: {1000 * cpu_s / count:.3f} ({cpu_s / wall_s:.2f} cores busy)")


if __name__ == "__main__":
    main()
