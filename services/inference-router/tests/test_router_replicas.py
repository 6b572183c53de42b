"""Router replicas: two router processes share Redis and the broker (``OPML_INFERENCE_ROUTER_REPLICATED``).
The one holding the ``inference-router`` lease writes the deployments; the other mirrors them onto its
own worker, serves inference and forwards the deployment API. The leader is SIGKILLed under load: a
client that retries on the other replica loses no request, the other takes the lease over, and a
bundle committed after the failover is deployed once (by the new leader, from the bundles topic),
served by both once the killed replica is back as a follower. A rollout's analyses, run by the
leader, judge the follower's requests and its mirror's comparisons too.

Real processes on the real broker, S3 and Redis; a bundle-store for autodeploy.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as triton
import yaml
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from opml.inference.v1 import deployment_events_pb2 as events
from opml.inference.v1 import deployments_pb2 as pb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.bus import CloudEvent, kafka_client_kwargs
from opml_common.errors import NotFound
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.testing import mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient
from opml_inference_router_contract.rollout_spec import ROLLOUT_FILE
from opml_inference_router_contract.topics import DEPLOYMENTS

FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2,
                         "cost_per_hour": 0.4, "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}], "min_replicas": 1}
HEADERS = {"authorization": f"Bearer {TOKENS['writer']}"}


def leads(replica: tuple[ServiceProcess, int]) -> bool:
    """Whether the replica's ``leader`` gauge is 1 (False when it does not answer: killed)."""
    try:
        page = urllib.request.urlopen(f"http://127.0.0.1:{replica[1]}/metrics", timeout=30).read().decode()
    except OSError:
        return False
    return "opml_inference_router_leader 1.0" in page


def serving(target: str, model: str, version: int) -> pb.Deployment | None:
    """The deployment of ``model`` as the replica at ``target`` shows it, once ``version`` serves."""
    with DeploymentClient(target, token=TOKENS["reader"]) as client:
        try:
            deployment = client.get(model)
        except NotFound:
            return None
    return deployment if any(v.version == version and v.state == pb.SERVING for v in deployment.versions) else None


def answers(target: str, model: str, version: str = "") -> bool:
    tensor = triton.InferInput("features", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
    try:
        with triton.InferenceServerClient(target) as client:
            client.infer(model, [tensor], model_version=version, client_timeout=10, headers=HEADERS)
    except Exception:  # noqa: BLE001 - not yet
        return False
    return True


class RetryingTraffic:
    """Requests one after another, alternating between the replicas; a request that fails on one is
    sent again to the other (what a client with both addresses, or a front, does). Failures on both
    are kept. Each request served is kept with when it was sent: one sent after a replica was killed
    cannot have been served by it, whenever its answer was recorded."""

    def __init__(self, targets: list[str], model: str) -> None:
        self.targets, self.model = targets, model
        self.served: list[tuple[float, str]] = []  # (when it was sent, by which target)
        self.retried = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        tensor = triton.InferInput("features", [1, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
        clients = [triton.InferenceServerClient(target) for target in self.targets]
        index = 0
        try:
            while not self._stop.is_set():
                errors = []
                for attempt in range(2):
                    which = (index + attempt) % 2
                    sent = time.monotonic()
                    try:  # the timeout is a safety net: a slow answer is no lost request
                        clients[which].infer(self.model, [tensor], request_id=f"r-{index}", client_timeout=30.0,
                                             headers=HEADERS)
                        self.served.append((sent, self.targets[which]))
                        self.retried += attempt
                        break
                    except Exception as error:  # noqa: BLE001 - tried on the other replica, then counted
                        errors.append(str(error)[:300])
                else:
                    self.failures.append(" | ".join(errors))
                index += 1
        finally:
            for client in clients:
                client.close()

    def __enter__(self) -> RetryingTraffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)


async def read_to_the_end(platform_settings, topic_name: str) -> list[ConsumerRecord]:
    """Every record of the topic, in each of its partitions up to the end offset it has when asked."""
    consumer = AIOKafkaConsumer(**kafka_client_kwargs(platform_settings), group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer.topics()  # the cluster's metadata, which names the topic's partitions
        partitions = [TopicPartition(topic_name, p) for p in consumer.partitions_for_topic(topic_name) or ()]
        assert partitions, f"no partitions of {topic_name}"
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        records: list[ConsumerRecord] = []
        while [p for p in partitions if await consumer.position(p) < end[p]]:
            for part in (await asyncio.wait_for(consumer.getmany(timeout_ms=500), 60)).values():
                records.extend(part)
        return records
    finally:
        await consumer.stop()


def model_deployed(platform_settings, model: str, version: int) -> list[events.ModelDeployed]:
    """The topic's ModelDeployed events of ``model`` ``version``, read to its end (not up to a count)."""
    records = asyncio.run(read_to_the_end(platform_settings, DEPLOYMENTS.full_name(platform_settings.topic_prefix)))
    found = [CloudEvent.from_kafka(r.headers, r.value) for r in records]
    return [m for m in (e.parse(events.ModelDeployed) for e in found if e.type.endswith("ModelDeployed"))
            if m.deployment.model == model and m.version == version]


def start_replicas(start_service: ServiceStarter, tmp_path: Path, *, bundle_store: str = "",
                   autodeploy: bool = True) -> list[tuple[ServiceProcess, int]]:
    """Two replicas (their process, their metrics port), the first leading once the second starts."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    replicas: list[tuple[ServiceProcess, int]] = []
    for _ in range(2):
        env = start_service.env("inference-router")
        port = env["OPML_INFERENCE_ROUTER_GRPC_PORT"]
        env.update({"OPML_INFERENCE_ROUTER_FLEET": str(fleet), "OPML_INFERENCE_ROUTER_REPLICATED": "true",
                    "OPML_INFERENCE_ROUTER_LEASE_TTL_S": "5", "OPML_INFERENCE_ROUTER_ADVERTISE": f"127.0.0.1:{port}",
                    "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TARGET": bundle_store or "127.0.0.1:1",
                    "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TOKEN": TOKENS["reader"],
                    "OPML_INFERENCE_ROUTER_AUTODEPLOY": str(autodeploy).lower(),
                    "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1",
                    "OPML_INFERENCE_ROUTER_REPLAN_INTERVAL_S": "0", "OPML_INFERENCE_ROUTER_NATIVE_FRONT": "false"})
        replicas.append((start_service("inference-router", env=env), int(env["OPML_INFERENCE_ROUTER_METRICS_PORT"])))
        if len(replicas) == 1:  # the first takes the free lease
            poll_until(lambda: leads(replicas[0]), timeout_s=60, what="the first replica leading")
    return replicas


def test_the_leader_sigkilled_under_load_its_peer_serves_on_takes_over_and_autodeploys_once(
        start_service: ServiceStarter, platform_settings, tmp_path: Path) -> None:
    store = start_service("bundle-store")
    replicas = start_replicas(start_service, tmp_path, bundle_store=store.target)
    first, second = replicas
    assert not leads(second)

    # a deploy sent to the follower is carried out by the leader; the follower mirrors it onto its worker
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)))
    with DeploymentClient(second[0].target, token=TOKENS["writer"]) as client:
        client.deploy(model_dir=str(model_dir))
    for process, _ in replicas:
        poll_until(lambda process=process: answers(process.target, "mlp"), timeout_s=120,
                   what=f"mlp answering at {process.target}")

    with RetryingTraffic([first[0].target, second[0].target], "mlp") as traffic:
        poll_until(lambda: len({target for _, target in traffic.served}) == 2, timeout_s=60,
                   what="traffic served by both replicas")
        first[0].kill()  # SIGKILL, and reaped: its lease expires, it releases nothing, it answers no more
        killed_at = time.monotonic()  # what is sent from now on, only the second can serve
        poll_until(lambda: leads(second), timeout_s=120, what="the second replica leading")
        took_over_s = time.monotonic() - killed_at
        poll_until(lambda: len([t for t, _ in traffic.served if t > killed_at + took_over_s]) >= 20, timeout_s=120,
                   what="traffic after the take-over")
    assert traffic.failures == [], traffic.failures[:5]
    during = [target for when, target in traffic.served if when > killed_at]
    assert during and set(during) == {second[0].target}, set(during)

    # committed after the failover: the new leader's autodeploy deploys it, once; both replicas serve it
    files = {"model.onnx": model_dir / "model.onnx", "model.yaml": model_dir / "model.yaml"}
    with BundleStoreClient(store.target, token=TOKENS["writer"]) as bundles:
        bundles.create_context("serving")
        bundle = bundles.add("serving", "mlp", files, tags={"serve": "true", "version": "2"}, commit=True)
    deployment = poll_until(lambda: serving(second[0].target, "mlp", 2), timeout_s=120, what="mlp v2 serving")
    assert {v.version: v.bundle_uuid for v in deployment.versions}.get(2) == bundle.uuid
    first[0].start()  # back as a follower: the lease is the second's
    poll_until(lambda: answers(first[0].target, "mlp", "2"), timeout_s=120, what="mlp v2 at the restarted replica")
    assert leads(second) and not leads(first)
    deployed = poll_until(lambda: model_deployed(platform_settings, "mlp", 2), timeout_s=60,
                          what="mlp v2's ModelDeployed")
    assert len(deployed) == 1, deployed  # the topic read to its end: the same key, the same partition
    with DeploymentClient(first[0].target, token=TOKENS["reader"]) as client:  # forwarded: the leader's view
        assert [v.version for v in client.get("mlp").versions if v.state == pb.SERVING] == [2]
    print(f"\nleader SIGKILLed under load: {len(during)} requests after it, {traffic.retried} retried on the other "
          f"replica, none failed; the other led {took_over_s:.2f} s after the kill (lease TTL 5 s)")


def test_a_leader_stalled_past_its_lease_steps_down_and_follows_its_successor(
        start_service: ServiceStarter, tmp_path: Path) -> None:
    """SIGSTOP past the lease's TTL (a GC pause, a frozen VM): the other replica takes over meanwhile;
    resumed, the stalled one finds its lease gone, stops leading and follows; what is deployed through
    it then (forwarded) is the new leader's doing, and both serve it."""
    first, second = start_replicas(start_service, tmp_path, autodeploy=False)
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)))
    with DeploymentClient(first[0].target, token=TOKENS["writer"]) as client:
        client.deploy(model_dir=str(model_dir))
    first[0].process.send_signal(signal.SIGSTOP)
    try:
        poll_until(lambda: leads(second), timeout_s=120, what="the second replica leading while the first is stopped")
    finally:
        first[0].process.send_signal(signal.SIGCONT)
    poll_until(lambda: not leads(first), timeout_s=60, what="the resumed replica no longer leading")
    with DeploymentClient(first[0].target, token=TOKENS["writer"]) as client:  # forwarded to the new leader
        client.deploy(model_dir=str(model_dir), version=2)
    for process, _ in (first, second):
        poll_until(lambda process=process: answers(process.target, "mlp", "2"), timeout_s=120,
                   what=f"mlp v2 answering at {process.target}")
    assert leads(second) and not leads(first)


class FollowerTraffic:
    """Requests of one row, one after another, to one replica only, until the block ends."""

    def __init__(self, target: str, model: str) -> None:
        self.target, self.model, self.sent, self.failed = target, model, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        tensor = triton.InferInput("features", [1, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
        with triton.InferenceServerClient(self.target) as client:
            while not self._stop.wait(0.005):
                self.sent += 1
                try:
                    client.infer(self.model, [tensor], client_timeout=10, headers=HEADERS)
                except Exception:  # noqa: BLE001 - counted; the rollout judges them
                    self.failed += 1

    def __enter__(self) -> FollowerTraffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)


def test_the_leaders_analysis_judges_the_requests_and_mirror_of_a_follower(
        start_service: ServiceStarter, tmp_path: Path) -> None:
    """Every request goes to the follower: a shadow step's comparisons and a weight step's requests
    are all the follower's, and the leader's analyses (which need 20 of each) pass on them."""
    leader, follower = start_replicas(start_service, tmp_path, autodeploy=False)
    assert leads(leader) and not leads(follower)
    config = mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",), max_queue_delay_us=None, p99_ms=2000.0)
    first = write_model_dir(tmp_path / "v1", config)
    second = write_model_dir(tmp_path / "v2", config)
    spec = {"steps": [
        {"shadow": {"percent": 100}},
        {"analysis": {"interval_s": 1.0, "count": 2, "inconclusive_limit": 10,
                      "checks": {"disagreement": {"max_share": 0.0, "min_requests": 20}}}},
        {"weight": 50},
        {"analysis": {"interval_s": 1.0, "count": 2, "inconclusive_limit": 10,
                      "checks": {"error_rate": {"max_increase": 0.5, "min_requests": 20}}}}]}
    (second / ROLLOUT_FILE).write_text(yaml.safe_dump(spec))
    with DeploymentClient(leader[0].target, token=TOKENS["admin"]) as client:
        client.deploy(model_dir=str(first))
        poll_until(lambda: answers(follower[0].target, "mlp", "1"), timeout_s=120, what="mlp v1 at the follower")
        with FollowerTraffic(follower[0].target, "mlp") as traffic:
            poll_until(lambda: traffic.sent > 20, timeout_s=60, what="traffic at the follower")
            client.deploy(model_dir=str(second))

            def ended():
                try:
                    rollout = client.get_rollout("mlp")
                except NotFound:
                    return None
                return rollout if rollout.phase != "RUNNING" else None

            rollout = poll_until(ended, timeout_s=300, every_s=0.5, what="the rollout of mlp v2 to end")
    assert rollout.phase == "PROMOTED", rollout
    (error_rate,) = rollout.checks  # the last analysis' last measurement: the follower's requests of each
    assert error_rate.verdict == "PASSED" and min(error_rate.new_requests, error_rate.stable_requests) >= 20
    assert leads(leader) and not leads(follower)
