"""The control plane over REAL worker processes: deploy from a model directory, placement within
slots, a broken ONNX file, canary/promote/rollback through the DeploymentService RPCs."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_asyncio
import yaml
from opml.bundles.v1 import bundles_pb2
from opml.bundles.v1 import events_pb2 as bundle_events
from opml.inference.v1 import deployment_events_pb2 as events
from opml.inference.v1 import deployments_pb2 as pb
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2, service_pb2_grpc

from opml_common.bus import CloudEvent
from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from opml_common.events import RecordingEmitter
from opml_common.grpc.server import GrpcServer
from opml_common.metrics import ServiceMetrics
from opml_common.storage import redis_client
from opml_inference_router.control import DeploymentManager, DeploymentStore, Observer, PoolManager, Source
from opml_inference_router.control.autodeploy import AutoDeployer
from opml_inference_router.control.convert import placement
from opml_inference_router.placement import CostAwareSloPolicy, FleetConfig, ModelVersion, ResizeReplica
from opml_inference_router.routing import Router
from opml_inference_router.routing.grpc_replica import GrpcReplica
from opml_inference_router.routing.metrics import RouterMetrics
from opml_inference_router.servicer import DeploymentServicer
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router.testing.models import write_broken_onnx
from opml_inference_router_contract.client import DeploymentClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

FLEET = {
    "pool_kinds": [
        {"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
         "execution_provider": "CPUExecutionProvider"},
        {"name": "accel", "precisions": ["int8"], "memory_mib": 1024, "slots": 1, "cost_per_hour": 0.1,
         "execution_provider": "CPUExecutionProvider", "batch_sizes": [1, 8, 32]},
        {"name": "gpu", "precisions": ["fp32"], "memory_mib": 8192, "slots": 4, "cost_per_hour": 2.0,
         "execution_provider": "NoSuchExecutionProvider"},
    ],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 2}, {"name": "accel", "kind": "accel", "workers": 1},
              {"name": "gpu", "kind": "gpu", "workers": 1}],
    "min_replicas": 1,  # these tests count slots by the policy's own sizing; N+1 has its own tests
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pools(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PoolManager]:
    """Two cpu workers and one emulated accelerator (the gpu kind's provider does not exist)."""
    root = tmp_path_factory.mktemp("pools")
    fleet_path = root / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(FLEET))
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    manager = PoolManager(FleetConfig.from_dict(FLEET), fleet_path, work_dir=root, metrics=metrics,
                          token="worker-secret", threads_per_replica=1)
    async with manager:
        yield manager


@dataclass
class ControlPlane:
    manager: DeploymentManager
    emitted: list  # (subject, event) in the order the manager emitted them
    metrics: ServiceMetrics  # the router's metrics, which the observer reads
    clock: list[float]  # the observer's clock: clock[0] seconds


class SubjectRecorder(RecordingEmitter):
    """Also keeps ``(subject, message)`` per event, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.emitted: list = []

    def emit(self, message, *, subject: str):
        self.emitted.append((subject, message))
        return super().emit(message, subject=subject)


@contextlib.asynccontextmanager
async def control_plane(pools: PoolManager, *, policy=None, store: DeploymentStore | None = None,
                        undeploy: bool = True) -> AsyncIterator[ControlPlane]:
    """A control plane over the module's workers; with ``undeploy``, every model is undeployed after."""
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    router = Router(connect=lambda address: GrpcReplica(address, token="worker-secret"), metrics=metrics,
                    rng=random.Random(3))
    recorder = SubjectRecorder()
    clock = [0.0]
    manager = DeploymentManager(pools=pools, router=router, observer=Observer(metrics.registry, clock=lambda: clock[0]),
                                events=recorder, replan_interval_s=0, policy=policy, store=store)
    await manager.start()
    try:
        yield ControlPlane(manager, recorder.emitted, metrics, clock)
    finally:
        await manager.stop()
        for name in list(manager.models) if undeploy else []:
            await manager.undeploy(name)
        await router.close()


@pytest_asyncio.fixture(loop_scope="module")
async def deployments(pools: PoolManager) -> AsyncIterator[ControlPlane]:
    """A fresh control plane over the module's workers; every model is undeployed after the test."""
    async with control_plane(pools) as plane:
        yield plane


class ForcedPolicy(CostAwareSloPolicy):
    """The cost-aware policy with the batch cap and replica count a test sets (None: the policy's own)."""

    def __init__(self, *, cap: int | None = None, replicas: int | None = None) -> None:
        super().__init__()
        self.cap, self.replicas = cap, replicas

    def options(self, demand, profiles, fleet):
        return [replace(option, max_batch=self.cap or option.max_batch, replicas=self.replicas or option.replicas)
                for option in super().options(demand, profiles, fleet)]


def measured(plane: ControlPlane, name: str, rate_rps: float, *, seconds: float = 10.0) -> None:
    """What the router measures for version 1 of ``name`` over the next ``seconds``: ``rate_rps`` at ~1 ms."""
    served = RouterMetrics(plane.metrics).version(name, "1")
    served.ok.inc(rate_rps * seconds)
    for _ in range(100):
        served.duration.observe(0.001)
    plane.clock[0] += seconds


async def _served_as(manager: DeploymentManager, worker: str, name: str) -> tuple[int, int, int]:
    """(instances, batch cap, requests served) of ``name`` as the worker itself reports them."""
    async with grpc.aio.insecure_channel(manager.pools.get(worker).address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("authorization", "Bearer worker-secret"),)
        config = (await stub.ModelConfig(service_pb2.ModelConfigRequest(name=name), metadata=metadata)).config
        stats = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=name), metadata=metadata)
    return (config.instance_group[0].count, int(config.parameters["opml_batch_cap"].string_value),
            stats.model_stats[0].inference_count)


def _bundle(root: Path, name: str, *, kinds=("cpu", "accel"), seed: int = 0, rate_rps: float = 100.0) -> Path:
    config = {**mlp_config(name, pool_kinds=kinds, precisions=("fp32", "int8"), p99_ms=100.0),
              "expected_rate_rps": rate_rps}
    return write_model_dir(root / f"{name}-{seed}", config, mlp_classifier(seed=seed))


def _request(name: str, seed: int = 0, version: str = "") -> bytes:
    data = np.random.default_rng(seed).standard_normal((1, 16)).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name=name, model_version=version)
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(data.tobytes())
    return request.SerializeToString()


async def _infer(router: Router, name: str, seed: int = 0) -> tuple[str, np.ndarray]:
    routed = await router.infer(name, "", _request(name, seed), timeout_s=10)
    response = service_pb2.ModelInferResponse.FromString(routed.response)
    return routed.version, np.frombuffer(response.raw_output_contents[0], dtype=np.float32)


async def test_deploy_from_dir_serves_and_placement_respects_slots(deployments, tmp_path: Path) -> None:
    manager, emitted = deployments.manager, deployments.emitted
    record = await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "small"))))
    assert [e.state for e in record.versions.values()] == ["SERVING"]
    version, scores = await _infer(manager.router, "small")
    assert version == "1" and scores.shape == (4,) and abs(float(scores.sum()) - 1) < 1e-3
    # Profiled on both allowed kinds that run here; the cheap int8 accelerator wins at this rate.
    assert {p.pool_kind for p in manager.profiles} == {"cpu", "accel"}
    assert [s.option.pool_kind for s in manager.plan.placements.values()] == ["accel"]
    assert any(subject == "small" and isinstance(m, events.ModelDeployed) for subject, m in emitted)

    # cpu-only models take 3 of the 2 x 2 cpu slots; one needing more replicas than the free slot is
    # refused by the planner; the fourth takes the last slot; then no worker has room even to profile.
    for index in range(3):
        await manager.deploy(Source(model_dir=str(_bundle(tmp_path, f"cpu{index}", kinds=("cpu",)))))
    with pytest.raises(FailedPrecondition, match="cannot be placed"):  # the MLP runs ~1M rps per replica
        await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "hot", kinds=("cpu",), rate_rps=1e9))))
    await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "cpu3", kinds=("cpu",)))))
    with pytest.raises(FailedPrecondition, match="0 free of 2"):
        await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "cpu4", kinds=("cpu",)))))
    assert manager.models["hot"].versions[1].state == manager.models["cpu4"].versions[1].state == "FAILED"
    view = placement(manager)
    assert view.unavailable_pool_kinds == ["gpu"]
    for worker in view.workers:
        assert worker.used_slots <= worker.slots and worker.used_memory_mib <= worker.memory_mib
    assert Counter(w.pool_kind for w in view.workers for _ in w.replicas) == {"cpu": 4, "accel": 1}
    for name in ("small", "cpu0", "cpu1", "cpu2", "cpu3"):
        assert (await _infer(manager.router, name))[0] == "1"
    failed = [m for _, m in emitted if isinstance(m, events.DeployFailed)]
    assert [m.model for m in failed] == ["hot", "cpu4"] and failed[0].code == "FAILED_PRECONDITION"


async def test_broken_onnx_fails_with_the_loaders_reason_and_other_models_serve(deployments, tmp_path: Path) -> None:
    manager, emitted = deployments.manager, deployments.emitted
    await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "good"))))
    broken = _bundle(tmp_path, "broken")
    write_broken_onnx(broken / "model.onnx")
    with pytest.raises(InvalidArgument) as caught:
        await manager.deploy(Source(model_dir=str(broken)))
    assert "NoSuchOperator" in caught.value.message  # onnxruntime's own words
    entry = manager.models["broken"].versions[1]
    assert entry.state == "FAILED" and "NoSuchOperator" in entry.reason
    assert "broken" not in manager.router.models()
    assert all(m.name == "good" for m in manager.plan.placements)
    assert (await _infer(manager.router, "good"))[0] == "1"
    failed = [m for _, m in emitted if isinstance(m, events.DeployFailed)]
    assert failed[-1].model == "broken" and failed[-1].code == "INVALID_ARGUMENT" and failed[-1].model_dir
    with pytest.raises(InvalidArgument, match="pool_kinds"):
        await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "tpu", kinds=("tpu",)))))


async def test_a_failed_deploy_gives_its_version_number_back(deployments, tmp_path: Path) -> None:
    """The FAILED version keeps its reason until the next deploy, which takes its number (no gap)."""
    manager = deployments.manager
    assert (await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "clf", seed=1))))).stable == 1
    broken = _bundle(tmp_path, "clf", seed=2)
    write_broken_onnx(broken / "model.onnx")
    with pytest.raises(InvalidArgument):
        await manager.deploy(Source(model_dir=str(broken)), canary_percent=10)
    assert manager.models["clf"].versions[2].state == "FAILED"
    record = await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "clf", seed=3))), canary_percent=10)
    assert {v: e.state for v, e in record.versions.items()} == {1: "SERVING", 2: "SERVING"}
    assert record.versions[2].source.model_dir.endswith("clf-3")
    assert (await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "clf", seed=4))))).stable == 3


async def test_canary_promote_and_rollback_through_the_rpcs(deployments, tmp_path: Path) -> None:
    manager, emitted = deployments.manager, deployments.emitted
    servicer = DeploymentServicer(manager)
    server = GrpcServer(settings=ServiceSettings(host="127.0.0.1", grpc_port=0, metrics_port=0),
                        platform=PlatformSettings(auth_tokens=""),
                        metrics=ServiceMetrics("inference-router", registry=CollectorRegistry()),
                        registrations=[servicer.registration()])
    async with server:
        client = DeploymentClient(f"127.0.0.1:{server.port}")
        try:
            call = asyncio.to_thread
            first = await call(client.deploy, model_dir=str(_bundle(tmp_path, "clf", seed=1)))
            assert first.stable_version == 1 and first.versions[0].traffic_percent == 100
            canary = await call(client.deploy, model_dir=str(_bundle(tmp_path, "clf", seed=2)), canary_percent=25)
            assert {v.version: v.traffic_percent for v in canary.versions} == {1: 75, 2: 25}
            assert all(v.state == pb.SERVING and v.replicas and v.profiles for v in canary.versions)
            seen = Counter([(await _infer(manager.router, "clf", seed))[0] for seed in range(80)])
            assert seen["1"] > seen["2"] > 5

            promoted = await call(client.promote, "clf")
            assert [(v.version, v.traffic_percent) for v in promoted.versions] == [(2, 100)]  # v1 retired
            assert {m.version for m in manager.plan.placements} == {2}

            await call(client.deploy, model_dir=str(_bundle(tmp_path, "clf", seed=3)), canary_percent=50)
            rolled = await call(client.rollback, "clf")
            assert rolled.stable_version == 2 and [v.version for v in rolled.versions] == [2]
            assert {(await _infer(manager.router, "clf", seed))[0] for seed in range(10)} == {"2"}
            split = await call(client.set_traffic, "clf", {"2": 1})
            assert split.versions[0].traffic_percent == 100
            with pytest.raises(Exception, match="does not serve"):
                await call(client.set_traffic, "clf", {"7": 1})
            with pytest.raises(InvalidArgument, match=r"weights\[²\]: keys must be version numbers"):
                await call(client.set_traffic, "clf", {"²": 1})
            assert [d.model for d in await call(client.list)] == ["clf"]
            plan = await call(client.placement)
            assert sum(len(w.replicas) for w in plan.workers) == 1 and plan.cost_per_hour > 0
            causes = [m.cause for _, m in emitted if isinstance(m, events.TrafficChanged)]
            assert causes == ["deploy", "canary", "promote", "canary", "rollback", "set_traffic"]
            await call(client.undeploy, "clf")
            assert "clf" not in manager.models and not manager.plan.placements
        finally:
            client.close()


async def test_a_specific_version_policy_keeps_the_versions_it_names_that_serve(deployments, tmp_path: Path) -> None:
    """``version_policy: specific`` may name versions not deployed yet: deploying version 1 of a model
    that names versions 1 and 2 serves it, and version 2's deploy keeps version 1 serving beside it."""
    manager = deployments.manager
    for seed in (1, 2):
        bundle = _bundle(tmp_path, "pinned", seed=seed)
        config = yaml.safe_load((bundle / "model.yaml").read_text())
        config["version_policy"] = {"specific": {"versions": [1, 2]}}
        (bundle / "model.yaml").write_text(yaml.safe_dump(config))
        record = await manager.deploy(Source(model_dir=str(bundle)))
    assert {number: entry.state for number, entry in record.versions.items()} == {1: "SERVING", 2: "SERVING"}
    assert record.stable == 2
    assert {(await _infer(manager.router, "pinned", seed))[0] for seed in range(10)} == {"2"}
    routed = await manager.router.infer("pinned", "1", _request("pinned", version="1"), timeout_s=10)
    assert routed.version == "1"


async def test_a_version_number_out_of_range_is_refused_and_reported(deployments, tmp_path: Path) -> None:
    """A version past int32 (an autodeploy tag, a typo) would be given once and leave no next number:
    refused naming ``version``, and DeployFailed still goes out (with no version: it was not valid)."""
    manager, emitted = deployments.manager, deployments.emitted
    for version in (2**31, 10**20):
        with pytest.raises(InvalidArgument) as caught:
            await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "huge"))), version=version)
        assert caught.value.field == "version" and str(2**31 - 1) in caught.value.message
    failed = [m for _, m in emitted if isinstance(m, events.DeployFailed)]
    assert [(m.code, m.version) for m in failed] == [("INVALID_ARGUMENT", 0)] * 2
    assert "huge" not in manager.models
    record = await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "huge"))), version=2**31 - 1)
    assert list(record.versions) == [2**31 - 1]
    with pytest.raises(FailedPrecondition, match="every version number"):
        await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "huge", seed=1))))
    last = [m for _, m in emitted if isinstance(m, events.DeployFailed)][-1]
    assert last.code == "FAILED_PRECONDITION"


async def test_a_measured_p99_above_the_slo_re_places_the_model(deployments, tmp_path: Path) -> None:
    manager, emitted = deployments.manager, deployments.emitted
    model = ModelVersion("drifty", 1)
    await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "drifty", kinds=("cpu",)))))
    before = manager.plan.placements[model]
    profiled = manager.profiles.get(model, "cpu")
    assert not (await manager.replan_once()).reasons  # the first look only opens the window
    # Serving measured half what the plan's replicas can take by their profile, at a p99 of 150 ms over
    # 10 s, above the 100 ms SLO. At half capacity the profile predicts a p99 far under the measured one,
    # and a profile twice as slow saturates the replicas, so the calibration scales it by about 2 however
    # fast the profile came out (it is measured on the request path, so it varies with the machine's
    # load). A fixed rate would not: CI's loaded run profiled 311 rps, where 300 rps already nearly
    # saturated the replica and the profile was scaled by only 1.1.
    rate = int(before.option.replica_capacity_rps * len(before.workers) / 2)
    served = RouterMetrics(deployments.metrics).version("drifty", "1")
    served.ok.inc(rate * 10)
    for _ in range(1000):
        served.duration.observe(0.15)
    deployments.clock[0] += 10
    replan = await manager.replan_once()
    assert "above the SLO" in replan.reasons[model] and replan.moves
    # The profile was scaled to what serving measured and the model re-sized on it (more replicas,
    # or a larger batch cap in place); the moves ran, each new replica ready before an old one went.
    after = manager.plan.placements[model]
    assert manager.profiles.get(model, "cpu").latency_ms(1) > 1.5 * profiled.latency_ms(1)
    assert (after.option.max_batch, len(after.workers)) != (before.option.max_batch, len(before.workers))
    assert (await _infer(manager.router, "drifty"))[0] == "1"
    routed = {r["replica"] for r in manager.router.describe("drifty")["versions"]["1"]}
    assert routed == {manager.pools.get(worker).address for worker in after.workers}
    changed = [m for _, m in emitted if isinstance(m, events.PlacementChanged)][-1]
    resized = [action for action in replan.moves if isinstance(action, ResizeReplica)]
    assert changed.replicas_added + len(resized) >= 1 and "above the SLO" in " ".join(changed.reasons)
    for action in resized:  # re-sized on the worker itself: the same loaded replica, the new cap
        assert (await _served_as(manager, action.new.worker, "drifty"))[1] == action.new.max_batch


async def test_autodeploy_acts_only_on_commits_tagged_serve_and_reports_bad_ones(deployments) -> None:
    manager, emitted = deployments.manager, deployments.emitted
    stored: dict[str, bundles_pb2.Bundle] = {}

    class Store:  # the bundle-store autodeploy re-reads: it agrees with each event here
        async def get_bundle(self, context: str, ref: str) -> bundles_pb2.Bundle:
            return stored[ref]

    handle = AutoDeployer(manager, bundles=Store())

    def committed(tags: dict[str, str]) -> CloudEvent:
        bundle = bundles_pb2.Bundle(context="lab", bundle_name="clf", uuid=f"u-{len(tags)}", tags=tags, committed=True)
        stored[bundle.uuid] = bundle
        return CloudEvent.from_proto(bundle_events.BundleCommitted(bundle=bundle), source="test", subject="clf")

    await handle(committed({"stage": "candidate"}))  # not for serving
    await handle(CloudEvent.from_proto(bundle_events.BundleDeleted(context="lab", uuid="u"), source="t", subject="c"))
    assert emitted == []
    await handle(committed({"serve": "true", "version": "two"}))  # a bad tag is reported, not retried
    await handle(committed({"serve": "true", "version": "2", "canary": "10"}))  # no bundle-store here
    failed = [m for _, m in emitted if isinstance(m, events.DeployFailed)]
    assert [(m.code, m.bundle.context, m.bundle.bundle) for m in failed] == [
        ("INVALID_ARGUMENT", "lab", "u-2"), ("FAILED_PRECONDITION", "lab", "u-3")]
    assert "tags.version" in failed[0].reason and not manager.models


async def test_a_new_batch_cap_on_the_full_single_slot_accelerator_is_applied_in_place(pools, tmp_path: Path) -> None:
    policy, model = ForcedPolicy(replicas=1), ModelVersion("tiny", 1)
    async with control_plane(pools, policy=policy) as plane:
        manager = plane.manager
        await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "tiny", kinds=("accel",)))))
        before = manager.plan.placements[model]
        assert before.workers == ("accel-000",)  # its one slot is now full
        for seed in range(5):
            await _infer(manager.router, "tiny", seed)
        assert await _served_as(manager, "accel-000", "tiny") == (1, before.option.max_batch, 5)
        assert not (await manager.replan_once()).reasons  # opens the measuring window
        policy.cap = 1 if before.option.max_batch > 1 else 8
        measured(plane, "tiny", 130.0)  # 30% above the plan: re-placed, now with the other cap
        replan = await manager.replan_once()
        assert "above the planned" in replan.reasons[model]
        assert [type(action) for action in replan.moves] == [ResizeReplica]  # no slot needed, nothing refused
        assert manager.plan.placements[model].option.max_batch == policy.cap
        # The same loaded replica (its counters kept: no reload), batching up to the new cap, and the
        # router's concurrency limit follows the planned caps.
        assert await _served_as(manager, "accel-000", "tiny") == (1, policy.cap, 5)
        assert manager.router.describe("tiny")["policy"].max_concurrency == max(8, 2 * policy.cap)
        assert (await _infer(manager.router, "tiny"))[0] == "1"


async def test_replicas_that_share_a_worker_run_as_instances_that_take_a_slot_each(pools, tmp_path: Path) -> None:
    policy, model = ForcedPolicy(replicas=3, cap=8), ModelVersion("wide", 1)  # 3 replicas on 2 cpu workers
    async with control_plane(pools, policy=policy) as plane:
        manager = plane.manager
        await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "wide", kinds=("cpu",)))))
        per_worker = Counter(manager.plan.placements[model].workers)
        assert sorted(per_worker.values()) == [1, 2]
        for worker, count in per_worker.items():
            assert (await _served_as(manager, worker, "wide"))[0] == count
        full = next(worker for worker, count in per_worker.items() if count == 2)
        other = _bundle(tmp_path, "other", kinds=("cpu",))
        with pytest.raises(ResourceExhausted, match=r"0 free of 2 \(in use by wide v1 x2\)"):
            await manager.pools.client(full).load("other", path=other, version=1)  # the worker counts both slots
        assert {(await _infer(manager.router, "wide", seed))[0] for seed in range(6)} == {"1"}

        assert not (await manager.replan_once()).reasons
        policy.replicas = 1
        measured(plane, "wide", 50.0)  # half the plan: scaled in to one replica
        replan = await manager.replan_once()
        assert "below the planned" in replan.reasons[model]
        assert [type(action).__name__ for action in replan.moves] == ["RemoveReplica", "RemoveReplica"]
        (kept,) = manager.plan.placements[model].workers
        assert (await _served_as(manager, kept, "wide"))[0] == 1
        for worker in set(per_worker) - {kept}:
            with pytest.raises(grpc.aio.AioRpcError, match="not loaded"):
                await _served_as(manager, worker, "wide")
        assert (await _infer(manager.router, "wide"))[0] == "1"


async def test_undeploying_a_model_with_two_instances_on_one_worker_frees_every_slot(pools, tmp_path: Path) -> None:
    # Undeploy removed the first of two instances on a worker by re-loading the version with one
    # instance, from a record undeploy had already dropped: a KeyError, and the second instance kept
    # its slot (seen in CI after a drift re-placement put two replicas on one worker).
    policy, model = ForcedPolicy(replicas=3, cap=8), ModelVersion("twin", 1)  # 3 replicas on 2 cpu workers
    async with control_plane(pools, policy=policy, undeploy=False) as plane:
        manager = plane.manager
        await manager.deploy(Source(model_dir=str(_bundle(tmp_path, "twin", kinds=("cpu",)))))
        per_worker = Counter(manager.plan.placements[model].workers)
        assert sorted(per_worker.values()) == [1, 2]
        await manager.undeploy("twin")
        assert not manager.plan.placements and "twin" not in manager.models
        for worker in per_worker:
            with pytest.raises(grpc.aio.AioRpcError, match="not loaded"):
                await _served_as(manager, worker, "twin")
    async with control_plane(pools, policy=ForcedPolicy(replicas=4, cap=8)) as plane:  # every cpu slot is free
        await plane.manager.deploy(Source(model_dir=str(_bundle(tmp_path, "after", kinds=("cpu",)))))
        assert Counter(plane.manager.plan.placements[ModelVersion("after", 1)].workers).most_common(1)[0][1] == 2


async def test_version_numbers_are_never_given_twice_even_after_a_restart(pools, platform_settings,
                                                                           tmp_path: Path) -> None:
    redis = redis_client(platform_settings)
    store = DeploymentStore(redis, prefix=platform_settings.redis_prefix)

    def bundle(seed: int) -> Source:
        return Source(model_dir=str(_bundle(tmp_path, "mono", kinds=("cpu",), seed=seed)))

    try:
        async with control_plane(pools, store=store, undeploy=False) as plane:
            manager = plane.manager
            await manager.deploy(bundle(1))
            await manager.deploy(bundle(2), canary_percent=50)
            await manager.rollback("mono")  # v2 is retired: its number stays given
            assert sorted((await manager.deploy(bundle(3), canary_percent=50)).versions) == [1, 3]
            with pytest.raises(InvalidArgument, match=r"version: must be > 3 \(0: the next\)"):
                await manager.deploy(bundle(4), version=2)
        async with control_plane(pools, store=store) as plane:  # a restarted router, from Redis
            manager = plane.manager
            assert sorted(manager.record("mono").versions) == [1, 3]
            await manager.rollback("mono")
            assert sorted((await manager.deploy(bundle(4), canary_percent=50)).versions) == [1, 4]
            await manager.undeploy("mono")  # even a model deployed afresh goes on counting
            assert sorted((await manager.deploy(bundle(5))).versions) == [5]
    finally:
        await redis.aclose()


async def test_a_restart_brings_back_what_can_come_back_and_says_why_the_rest_cannot(pools, platform_settings,
                                                                                    tmp_path: Path) -> None:
    """Stored state where some sources are gone (issue 12, item 7): each version comes back on its own.
    ``pair`` v1 (stable, 50%) lost its directory: v2 takes all traffic and v1, announced as DeployFailed
    with the reason, is retired (a newer version serves). ``lone`` v1 lost its directory and has no other
    version: it stays FAILED with the reason, and a new deploy of ``lone`` is not blocked (v1 then retires)."""
    import shutil

    redis = redis_client(platform_settings)
    store = DeploymentStore(redis, prefix=platform_settings.redis_prefix)
    pair_1, pair_2 = _bundle(tmp_path, "pair", kinds=("cpu",), seed=1), _bundle(tmp_path, "pair", kinds=("cpu",), seed=2)
    lone_1 = _bundle(tmp_path, "lone", kinds=("cpu",), seed=3)
    try:
        async with control_plane(pools, store=store, undeploy=False) as plane:
            await plane.manager.deploy(Source(model_dir=str(pair_1)))
            await plane.manager.deploy(Source(model_dir=str(pair_2)), canary_percent=50)
            await plane.manager.deploy(Source(model_dir=str(lone_1)))
        await _unload_everywhere(pools, [("pair", 1), ("pair", 2), ("lone", 1)])  # a restart's fresh workers
        shutil.rmtree(pair_1)
        shutil.rmtree(lone_1)
        async with control_plane(pools, store=store, undeploy=False) as plane:  # a restarted router
            manager = plane.manager
            pair, lone = manager.record("pair"), manager.record("lone")
            assert {v: e.state for v, e in pair.versions.items()} == {2: "SERVING"}
            assert manager.traffic_percent("pair") == {"2": 100.0} and pair.stable == 2
            assert (await _infer(manager.router, "pair"))[0] == "2"
            assert lone.versions[1].state == "FAILED"
            assert lone.versions[1].reason == (f"not restored after a restart: model_dir {lone_1} is not a "
                                               f"directory on the router's machine")
            assert "lone" not in manager.router.models()
            failed = {(m.model, m.version): m.reason for _, m in plane.emitted if isinstance(m, events.DeployFailed)}
            assert failed.keys() == {("pair", 1), ("lone", 1)} and str(pair_1) in failed["pair", 1]

            lone_2 = _bundle(tmp_path, "lone", kinds=("cpu",), seed=4)
            assert sorted((await manager.deploy(Source(model_dir=str(lone_2)))).versions) == [2]
            assert (await _infer(manager.router, "lone"))[0] == "2"
        async with control_plane(pools, store=store) as plane:  # what the last one stored comes back whole
            states = {name: {v: e.state for v, e in record.versions.items()}
                      for name, record in plane.manager.models.items()}
            assert states == {"pair": {2: "SERVING"}, "lone": {2: "SERVING"}}
            assert not [m for _, m in plane.emitted if isinstance(m, events.DeployFailed)]
    finally:
        await redis.aclose()


async def _unload_everywhere(pools: PoolManager, versions: list[tuple[str, int]]) -> None:
    """What a router's restart does to its workers (they start empty), on the module's shared workers."""
    for worker in pools.workers():
        for name, version in versions:
            with contextlib.suppress(NotFound):
                await pools.client(worker.worker.id).unload(name, version)
