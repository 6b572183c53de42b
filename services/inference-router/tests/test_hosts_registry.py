"""The router's host registry, the host token and the agent's bundle intake, without a network: what a
registration may claim, places kept across re-registrations, liveness, the placement refusals it gives,
severed calls to a lost host. (On real hosts: tests/test_hosts_netns.py.)"""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from pathlib import Path

import pytest
from opml.inference.v1 import hosts_pb2 as pb
from prometheus_client import CollectorRegistry

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound
from opml_common.metrics import ServiceMetrics
from opml_inference_router.hosts.agent import AgentServicer
from opml_inference_router.hosts.registry import HostRegistry, RequestedPool
from opml_inference_router.hosts.replicas import SeverableReplica
from opml_inference_router.hosts.service import HOST_METHODS, host_token_verifier
from opml_inference_router.placement import Fleet, FleetConfig, Link, PoolConfig
from opml_inference_router.routing import Replica
from opml_inference_router.routing.errors import ReplicaFailed
from opml_inference_router.testing.placement import CPU, demand

AGENT = "127.0.0.1:9"  # nothing listens: a probe fails at once


def registry(**options) -> HostRegistry:
    fleet = Fleet(FleetConfig(pool_kinds=(CPU,), pools=(
        PoolConfig(name="cpu", kind="cpu", workers=1),
        PoolConfig(name="edge", kind="cpu", workers=2, site="edge"))))
    return HostRegistry(fleet, worker_token="worker-token", metrics=ServiceMetrics("t", CollectorRegistry()),
                        bundle_bytes=lambda model: 50_000_000, **options)


def edge(pool: str = "edge", *, kind: str = "cpu", slots: int = 16, site: str = "edge") -> RequestedPool:
    return RequestedPool(pool, kind, slots, site)


async def test_a_registration_gets_a_place_per_pool_and_keeps_it_when_it_registers_again() -> None:
    hosts = registry()
    assert hosts.register("h1", [edge()], AGENT) == ["edge-000"]
    assert hosts.register("h2", [edge()], AGENT) == ["edge-001"]
    assert hosts.register("h2", [edge()], AGENT) == ["edge-001"]  # a restarted agent
    with pytest.raises(FailedPrecondition, match="pool edge has no free place"):
        hosts.register("h3", [edge()], AGENT)


async def test_a_registration_that_breaks_the_fleet_names_every_wrong_field() -> None:
    with pytest.raises(InvalidArgument) as refused:
        registry().register("bad name!", [edge("cpu"), edge(kind="gpu", slots=4, site="far")], "nowhere")
    assert [field for field, _ in refused.value.violations] == [
        "host", "agent_address", "pools[0].pool", "pools[1].kind", "pools[1].slots", "pools[1].site"]


async def test_a_silent_host_is_lost_its_workers_refused_and_its_calls_severed_until_it_heartbeats() -> None:
    hosts = registry(heartbeat_interval_s=0.5, host_timeout_s=2.0)
    down, changes = [], []
    hosts.on_down = lambda worker, address, reason, back_in_s: down.append((worker, address))
    hosts.on_up = lambda address: down.remove(next(d for d in down if d[1] == address))

    async def changed() -> None:
        changes.append(time.monotonic())

    hosts.on_change = changed
    hosts.register("h1", [edge()], AGENT)
    worker = hosts.fleet.worker("edge-000")
    want = demand("m", rate=10, slo=200.0)
    assert hosts.refusal(want, worker) == "no host serves it"
    await hosts.heartbeat("h1", {"edge-000": "10.1.1.2:7001"})
    await asyncio.wait_for(hosts._changes, 5)  # a worker to place on: a re-placement
    assert len(changes) == 1
    assert "not measured" in hosts.refusal(want, worker)
    hosts.hosts["h1"].link = Link(rtt_ms=50.0, bandwidth_mbps=100.0)
    assert hosts.refusal(want, worker) == ""
    assert hosts.refusal(want, hosts.fleet.worker("cpu-000")) == ""  # the router's own: always

    hanging = asyncio.Event()

    class Hanging(Replica):
        name = "10.1.1.2:7001"

        async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
            await hanging.wait()
            return b""

        async def close(self) -> None:
            pass

    replica = hosts.connector(lambda address: Hanging())("10.1.1.2:7001")
    assert isinstance(replica, SeverableReplica) and replica.site == "edge"  # the router ranks it by its site
    assert hosts.connector(lambda address: Hanging())("uds:/w.sock").site == "local"  # the router's own worker

    # each link measured gives the router every site's round trip, for its nearest-first choice
    links: list[dict[str, float]] = []
    hosts.on_links = links.append

    async def probe(nbytes: int = 0) -> float:
        return 0.04 if nbytes == 0 else 0.05

    hosts.hosts["h1"].agent.probe = probe  # type: ignore[method-assign]
    await hosts._probe(hosts.hosts["h1"])
    assert links == [{"edge": pytest.approx(40.0)}]
    call = asyncio.ensure_future(replica.call("ModelInfer", b"", timeout_s=60))
    await asyncio.sleep(0)  # the call is in flight

    assert hosts.check(time.monotonic()) == []
    assert hosts.check(time.monotonic() + 2.5) == ["h1"]
    assert down == [("edge-000", "10.1.1.2:7001")]
    assert hosts.refusal(want, worker) == "host h1 is lost"
    with pytest.raises(ReplicaFailed) as severed:
        await call
    assert severed.value.retriable and severed.value.code == "UNAVAILABLE"
    await asyncio.wait_for(hosts._changes, 5)  # the re-placement it started
    assert len(changes) == 2

    await hosts.heartbeat("h1", {"edge-000": "10.1.1.2:7001"})  # back after the cut, same worker
    assert down == [] and hosts.refusal(want, worker) == ""
    hanging.set()
    assert await replica.call("ModelInfer", b"", timeout_s=1) == b""
    await asyncio.wait_for(hosts._changes, 5)
    assert len(changes) == 3
    with pytest.raises(NotFound, match="register again"):
        await hosts.heartbeat("h9", {})
    await hosts.stop()


async def test_a_far_site_is_refused_a_model_whose_bytes_take_too_long() -> None:
    hosts = registry()
    hosts.register("h1", [edge()], AGENT)
    await hosts.heartbeat("h1", {"edge-000": "10.1.1.2:7001"})
    hosts.hosts["h1"].link = Link(rtt_ms=50.0, bandwidth_mbps=10.0)  # 50 MB: 40 s
    assert "take 40.0 s to arrive" in hosts.refusal(demand("m", rate=10, slo=50.0), hosts.fleet.worker("edge-000"))
    assert hosts.refusal(demand("m", rate=10, slo=200.0), hosts.fleet.worker("edge-000")) == ""
    await hosts.stop()


def test_a_host_token_may_call_the_host_methods_only() -> None:
    verify = host_token_verifier(["host-secret"])
    principal = verify("host-secret")
    assert principal is not None and principal.scope is not None and principal.scope.methods == HOST_METHODS
    assert {"RegisterHost", "Heartbeat", "ForwardPredictions"} == HOST_METHODS
    assert verify("another") is None and "host-secret" not in principal.name


def _tar(**members: bytes | str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


async def _put(servicer: AgentServicer, data: bytes, *, size: int | None = None) -> pb.PutBundleResponse:
    async def chunks():
        yield pb.BundleChunk(model="m", version=1, size=len(data) if size is None else size, data=data[:100])
        yield pb.BundleChunk(data=data[100:])
    return await servicer.PutBundle(chunks(), None)


async def test_the_agent_stores_a_bundle_whole_and_refuses_links_and_short_ones(tmp_path: Path) -> None:
    servicer = AgentServicer(tmp_path / "bundles", max_bundle_bytes=1 << 20)
    reply = await _put(servicer, _tar(**{"model.yaml": b"name: m\n", "model.onnx": b"x" * 500}))
    assert sorted(p.name for p in Path(reply.path).iterdir()) == ["model.onnx", "model.yaml"]
    with pytest.raises(InvalidArgument, match="not a file or folder"):
        await _put(servicer, _tar(**{"model.yaml": b"name: m\n", "model.onnx": "/etc/passwd"}))
    assert (Path(reply.path) / "model.onnx").read_bytes() == b"x" * 500  # the stored one is untouched
    with pytest.raises(InvalidArgument, match="announced"):
        await _put(servicer, _tar(**{"model.yaml": b"y"}), size=10_000)
    with pytest.raises(InvalidArgument) as refused:
        await _put(servicer, b"", size=2 << 20)
    assert refused.value.field == "size"
