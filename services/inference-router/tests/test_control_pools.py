"""The pool manager over REAL worker processes: a SIGKILLed worker is restarted, its replicas are
loaded again and the router follows its new address (a new Unix socket with ``route_over_uds``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from opml.inference.v1 import deployment_events_pb2 as events
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2, service_pb2_grpc

from opml_common.errors import FailedPrecondition
from opml_common.events import RecordingEmitter
from opml_common.metrics import ServiceMetrics
from opml_devstack.testing.bus import sample
from opml_inference_router.control import DeploymentManager, Observer, PoolManager, Source
from opml_inference_router.placement import FleetConfig, ModelDemand, ModelVersion
from opml_inference_router.routing import Router
from opml_inference_router.routing.metrics import RouterMetrics
from opml_inference_router.routing.uds_replica import connect
from opml_inference_router.testing import mlp_config, write_model_dir

FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"},
                   {"name": "gpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 2.0,
                    "execution_provider": "CUDAExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}, {"name": "gpu", "kind": "gpu", "workers": 1}],
}


def _request(name: str) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=name)
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.ones((1, 16), dtype=np.float32).tobytes())
    return request.SerializeToString()


def _rate_needing(manager: DeploymentManager, model: ModelVersion, replicas: int) -> float:
    """A rate that the model's own profile says needs ``replicas`` cpu replicas."""
    config, profile = manager.models[model.name].versions[model.version].config, manager.profiles.get(model, "cpu")
    return next(r for r in (100 * 1.5 ** k for k in range(60))
                if manager.planner.policy.options(ModelDemand(config, model.version, r), {"cpu": profile},
                                                  manager.fleet)[0].replicas == replicas)


async def _instances(address: str, name: str) -> int:
    """How many instances of ``name`` the worker at ``address`` runs (its ModelConfig's instance_group)."""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelConfig(
            service_pb2.ModelConfigRequest(name=name), metadata=(("authorization", "Bearer worker-secret"),))
    return reply.config.instance_group[0].count


async def test_a_killed_worker_is_restarted_and_its_model_serves_again(tmp_path: Path) -> None:
    fleet_path = tmp_path / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(FLEET))
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    pools = PoolManager(FleetConfig.from_dict(FLEET), fleet_path, work_dir=tmp_path, metrics=metrics,
                        token="worker-secret", threads_per_replica=1, watch_interval_s=0.1,
                        providers=["CPUExecutionProvider"], route_over_uds=True)
    assert pools.unavailable_kinds == ["gpu"] and [w.id for w in pools.fleet.workers] == ["cpu-000"]
    router = Router(connect=lambda address: connect(address, token="worker-secret"), metrics=metrics,
                    rng=random.Random(0))
    recorder = RecordingEmitter()
    emitted = recorder.messages
    clock = [0.0]
    manager = DeploymentManager(pools=pools, router=router, observer=Observer(metrics.registry, clock=lambda: clock[0]),
                                events=recorder, replan_interval_s=0)
    model_dir = write_model_dir(tmp_path / "m", mlp_config("m", pool_kinds=("cpu",), precisions=("fp32",)))
    model = ModelVersion("m", 1)
    async with pools:
        try:
            await manager.deploy(Source(model_dir=str(model_dir)))
            # Serving measured a rate that needs two replicas: both on the one worker, as two instances.
            await manager.replan_once()  # opens the measuring window
            RouterMetrics(metrics).version("m", "1").ok.inc(_rate_needing(manager, model, 2) * 10)
            clock[0] += 10
            assert "above the planned" in (await manager.replan_once()).reasons[model]
            assert manager.plan.placements[model].workers == ("cpu-000", "cpu-000")
            await router.infer("m", "", _request("m"), timeout_s=5)
            worker = pools.get("cpu-000")
            assert worker.address == f"uds:{tmp_path / 'workers' / 'cpu-000.0.sock'}"
            assert await _instances(worker.process.target, "m") == 2
            old = worker.address
            worker.process.process.kill()  # SIGKILL: no goodbye
            deadline = time.monotonic() + 60
            while True:  # requests fail while the only worker is down, then serve from its successor
                try:
                    routed = await router.infer("m", "", _request("m"), timeout_s=2)
                    break
                except Exception:  # noqa: BLE001 - expected until the restart completes
                    assert time.monotonic() < deadline, "the model did not serve again within 60 s"
                    await asyncio.sleep(0.1)
            assert worker.restarts == 1 and worker.address != old and routed.replica == worker.address
            assert sample(metrics.registry, "opml_inference_router_worker_restarts_total", worker="cpu-000") == 1
            assert [s["replica"] for s in router.describe("m")["versions"]["1"]] == [worker.address]
            assert await _instances(worker.process.target, "m") == 2  # loaded again as the plan has it
            assert not (tmp_path / "workers" / "cpu-000.0.sock").exists()  # the dead worker's socket is gone
            changed = [m for m in emitted if isinstance(m, events.PlacementChanged)]
            assert "worker cpu-000 restarted" in changed[-1].reasons[0]
            assert changed[-1].placement.workers[0].restarts == 1
        finally:
            await router.close()


@pytest.mark.parametrize("route_over_uds", [False, True], ids=["grpc", "uds"])
async def test_a_worker_killed_under_load_loses_no_request_and_gets_its_replica_back(tmp_path: Path,
                                                                                     route_over_uds: bool) -> None:
    """N+1 by default: a model whose load needs one replica gets two on distinct workers, so killing
    one worker under load fails no request."""
    fleet = {**FLEET, "pools": [{"name": "cpu", "kind": "cpu", "workers": 2}]}
    fleet_path = tmp_path / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(fleet))
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    pools = PoolManager(FleetConfig.from_dict(fleet), fleet_path, work_dir=tmp_path, metrics=metrics,
                        token="worker-secret", threads_per_replica=1, watch_interval_s=0.1,
                        route_over_uds=route_over_uds)
    router = Router(connect=lambda address: connect(address, token="worker-secret"), metrics=metrics,
                    rng=random.Random(1))
    manager = DeploymentManager(pools=pools, router=router, replan_interval_s=0,
                                observer=Observer(metrics.registry, clock=lambda: 0.0))
    model = ModelVersion("m", 1)
    async with pools:
        try:
            await manager.deploy(Source(model_dir=str(write_model_dir(
                tmp_path / "m", mlp_config("m", pool_kinds=("cpu",), precisions=("fp32",))))))
            # the load needs one replica here, N+1 gives two (three when the profile was taken on a loaded
            # machine: then it needs two); what matters is more than one, on both workers
            assert manager.plan.placements[model].option.replicas >= 2
            assert set(manager.plan.placements[model].workers) == {"cpu-000", "cpu-001"}
            doomed = pools.get("cpu-001")
            old = doomed.address
            outcomes, stop = await _kill_under_load(router, doomed, old, callers=8, timeout_s=5)
            assert outcomes["ok"] > 0 and set(outcomes) == {"ok"}, outcomes
            assert _replicas(router) == {pools.get("cpu-000").address, doomed.address}
        finally:
            await router.close()


async def _kill_under_load(router: Router, doomed, old: str, *, callers: int,
                           timeout_s: float) -> tuple[Counter[str], asyncio.Event]:
    """SIGKILLs ``doomed`` while ``callers`` closed-loop callers (deadline ``timeout_s``) send requests,
    and counts the outcomes (by status code; 'late' for a failure whose deadline had time left) until the
    pool restarted it, the router routes to its new address and every caller got an answer after that."""
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()
    answered = [0] * callers
    restarted = asyncio.Event()

    async def call(index: int) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            start = loop.time()
            try:
                await router.infer("m", "", _request("m"), timeout_s=timeout_s)
                outcomes["ok"] += 1
            except Exception as error:  # noqa: BLE001 - counted by code
                outcomes[getattr(error, "code", type(error).__name__)] += 1
                if loop.time() - start < timeout_s * 0.9:
                    outcomes["failed_with_time_left"] += 1
            if restarted.is_set():
                answered[index] += 1

    clients = [asyncio.create_task(call(index)) for index in range(callers)]
    try:
        while outcomes["ok"] < 4 * callers:  # serving under load before the kill
            await asyncio.sleep(0.01)
        doomed.process.process.kill()  # SIGKILL with requests in flight
        while doomed.restarts == 0 or old in _replicas(router) or doomed.address not in _replicas(router):
            await asyncio.sleep(0.02)  # polls the pool's state: the restart is the event waited for
        restarted.set()
        while min(answered) < 2:  # every caller got answers after the restart
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    return outcomes, stop


async def test_the_only_replica_killed_under_load_fails_no_request_whose_deadline_covers_the_restart(
        tmp_path: Path) -> None:
    """One replica (min_replicas 1): SIGKILL its worker under load. Requests wait for the restarted
    worker within their deadlines (long enough for it): none fails, none is INTERNAL."""
    fleet = {**FLEET, "pools": [{"name": "cpu", "kind": "cpu", "workers": 2}]}
    fleet_path = tmp_path / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(fleet))
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    pools = PoolManager(FleetConfig.from_dict(fleet), fleet_path, work_dir=tmp_path, metrics=metrics,
                        token="worker-secret", threads_per_replica=1, watch_interval_s=0.1, route_over_uds=True)
    router = Router(connect=lambda address: connect(address, token="worker-secret"), metrics=metrics,
                    rng=random.Random(2))
    manager = DeploymentManager(pools=pools, router=router, replan_interval_s=0,
                                observer=Observer(metrics.registry, clock=lambda: 0.0))
    model = ModelVersion("m", 1)
    config = {**mlp_config("m", pool_kinds=("cpu",), precisions=("fp32",)), "min_replicas": 1}
    async with pools:
        try:
            await manager.deploy(Source(model_dir=str(write_model_dir(tmp_path / "m", config))))
            (worker_id,) = manager.plan.placements[model].workers
            doomed = pools.get(worker_id)
            old = doomed.address
            outcomes, _ = await _kill_under_load(router, doomed, old, callers=4, timeout_s=60)
            assert outcomes["ok"] > 0 and set(outcomes) == {"ok"}, outcomes  # no INTERNAL, no failure at all
            assert sample(metrics.registry, "opml_inference_router_replica_waits_total", model="m", version="1") >= 1
        finally:
            await router.close()


def _replicas(router: Router) -> set[str]:
    return {replica["replica"] for replica in router.describe("m")["versions"]["1"]}


def test_a_fleet_with_no_runnable_pool_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="no pool"):
        PoolManager(FleetConfig.from_dict(FLEET), tmp_path / "fleet.yaml", work_dir=tmp_path,
                    metrics=ServiceMetrics("inference-router", registry=CollectorRegistry()), providers=[])


async def test_a_deep_work_dir_keeps_the_unix_socket_hop(tmp_path: Path) -> None:
    """A work dir too deep for a socket address (108 bytes on Linux: a test's or a volume's path) puts the
    workers' sockets in a private directory of the temporary folder, removed at stop, instead of
    falling back to TCP."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    fleet_path = deep / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(FLEET))
    pools = PoolManager(FleetConfig.from_dict(FLEET), fleet_path, work_dir=deep,
                        metrics=ServiceMetrics("inference-router", registry=CollectorRegistry()),
                        token="worker-secret", threads_per_replica=1, providers=["CPUExecutionProvider"],
                        route_over_uds=True)
    async with pools:
        address = pools.get("cpu-000").address
        assert address.startswith("uds:"), address
        socket_path = Path(address.removeprefix("uds:"))
        assert socket_path.is_socket() and socket_path.parent.name.startswith("opml-uds-")
        assert socket_path.parent.stat().st_mode & 0o777 == 0o700
    assert not socket_path.parent.exists()
