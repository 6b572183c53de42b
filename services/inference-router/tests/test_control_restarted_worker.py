"""A restarted worker gets its planned replicas back, also when the plan still lists a version that
was retired (its record gone) because the re-plan after the retirement failed: unit test of the
placer with a fake pool manager and fake replica connections."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from opml_devstack.testing.bus import fresh_metrics
from opml_inference_router.control.replan import ReplicaPlacer
from opml_inference_router.control.state import SERVING, ModelRecord, Source, VersionRecord
from opml_inference_router.placement import CostAwareSloPolicy, ModelVersion, Replica
from opml_inference_router.routing import ModelPolicy, Router
from opml_inference_router.routing import Replica as Connection
from opml_inference_router.testing.placement import CPU, fleet


@dataclass
class FakeWorker:
    address: str
    alive: bool = True
    loads: list[tuple[str, int]] = field(default_factory=list)

    async def load(self, name: str, *, version: int, **_settings) -> None:
        self.loads.append((name, version))


class FakePools:
    """What the placer asks of the pool manager: the fleet, each worker's handle and its client."""

    def __init__(self) -> None:
        self.fleet = fleet((CPU, 1))
        self.slot_threads = 1
        self.worker = FakeWorker("w0:1")

    def get(self, _worker_id: str) -> FakeWorker:
        return self.worker

    def client(self, _worker_id: str) -> FakeWorker:
        return self.worker


class FakeConnection(Connection):
    def __init__(self, address: str) -> None:
        self.name = address

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        return b""

    async def close(self) -> None:
        pass


def replica(name: str, version: int) -> Replica:
    return Replica(ModelVersion(name, version), "cpu-0", 0, "cpu", "fp32", 8, memory_mib=10.0, capacity_rps=100.0)


async def test_a_restarted_worker_reloads_the_live_versions_and_skips_a_retired_one() -> None:
    pools = FakePools()
    metrics, _ = fresh_metrics("inference-router")
    router = Router(connect=FakeConnection, metrics=metrics, rng=random.Random(1))
    models = {"live": ModelRecord("live", {1: VersionRecord(1, Source(model_dir="/m"), "/m", state=SERVING)})}
    placer = ReplicaPlacer(pools=pools, router=router, policy=CostAwareSloPolicy(), models=models)  # type: ignore[arg-type]
    for name in ("gone", "live"):  # "gone": undeployed, its record dropped, its replica still planned
        router.set_model(name, ModelPolicy())
        router.add_replica(name, "1", "w0:1")
        placer._hosted["cpu-0", ModelVersion(name, 1)].append(replica(name, 1))

    await placer.worker_restarted("cpu-0", "w0:1", "w0:2")

    assert pools.worker.loads == [("live", 1)]
    assert [r["replica"] for r in router.describe("live")["versions"]["1"]] == ["w0:2"]
    assert router.describe("gone")["versions"]["1"] == []  # the dead address is forgotten
    await router.close()
