"""The host agent: one process per machine that serves the router's fleet pools there.

It registers its pools with the router (``HostService.RegisterHost``, with a host token), runs one
worker process per pool (the router's own worker program, :mod:`opml_inference_router.worker`; a
pool of a CUDA kind's pinned to a device of the host's own, ``CUDA_VISIBLE_DEVICES``),
tells the router where they serve on every heartbeat, and restarts a worker that dies. The router
then places, loads and routes on those workers as on its own, over gRPC (TLS as ``OPML_GRPC_TLS_*``
says), sending each version's bundle to the agent first (``HostAgent.PutBundle``).

The agent also answers KServe v2 itself, for clients at its site: the router's own front
(:class:`~opml_inference_router.frontend.InferenceFrontend` over a :class:`~opml_inference_router.routing.Router`
of the local workers, reached on their Unix sockets), routing to whatever the router last placed
here. Its predictions go to a durable outbox and on to the router (:mod:`.forwarding`). So a site
cut off from the router keeps serving its clients with its last placed models, loses no
prediction, and sends the backlog once the link is back, at a bounded rate (KubeEdge's edge
autonomy). Heartbeats that fail are logged and retried; a router that forgot the host (restarted)
gets a new registration, and the workers restart when its worker token changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from opml.inference.v1 import hosts_pb2 as pb
from opml.inference.v1 import hosts_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from opml_common.config import PlatformSettings
from opml_common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OpmlError,
    PermissionDenied,
    Unauthenticated,
)
from opml_common.gpus import GpuDevice, discover, visible_devices_env
from opml_common.grpc.client import domain_error, open_aio_channel
from opml_common.grpc.interceptors import Principal, Scope
from opml_common.grpc.server import GrpcServer, ServiceRegistration
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.retry import Backoff
from opml_inference_router.frontend import InferenceFrontend
from opml_inference_router.hosts.forwarding import OutboxRecorder, RouterForwarder
from opml_inference_router.hosts.settings import HostAgentSettings
from opml_inference_router.placement import FleetConfig, load_fleet_config
from opml_inference_router.predictions import PredictionLog
from opml_inference_router.routing import ModelPolicy, Router
from opml_inference_router.routing.uds_replica import connect
from opml_inference_router.runtime import load_bundle
from opml_inference_router.runtime.session import CUDA
from opml_inference_router.worker.process import WorkerProcess

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
_REGISTER_BACKOFF = Backoff(base_s=0.5, max_s=15.0)


@dataclass
class HostWorker:
    """One worker process this host runs for a fleet worker."""

    pool: str
    kind: str
    process: WorkerProcess
    worker_id: str = ""
    routed: set[tuple[str, str]] = field(default_factory=set)  # (model, version) in the local router
    channel: tuple[str, grpc.aio.Channel] | None = field(default=None, repr=False)  # (target, its admin channel)
    serving: bool = False  # started and answering health: its address goes in the heartbeats


def pools_of(settings: HostAgentSettings, fleet: FleetConfig) -> list[pb.HostPool]:
    """The pools this host joins, with their kinds, slots and site from the fleet file.

    Raises: InvalidArgument naming every pool the fleet does not declare at a site, or sites that differ."""
    declared = {pool.name: pool for pool in fleet.pools}
    kinds = {kind.name: kind for kind in fleet.pool_kinds}
    problems, found = [], []
    names = settings.pool_names()
    if not names:
        problems.append(("pools", "must name at least one pool of the fleet file"))
    for index, name in enumerate(names):
        pool = declared.get(name)
        if pool is None or pool.site == "local":
            problems.append((f"pools[{index}]", f"must be a pool {settings.fleet} declares at a site other than "
                                                f"local, but got {name!r}"))
            continue
        found.append(pb.HostPool(pool=name, kind=pool.kind, slots=kinds[pool.kind].slots, site=pool.site))
    if len({pool.site for pool in found}) > 1:
        problems.append(("pools", f"must all be at one site, but name {', '.join(sorted({p.site for p in found}))}"))
    if problems:
        raise InvalidArgument.of(problems)
    return found


class AgentServicer(hosts_pb2_grpc.HostAgentServicer):
    """``HostAgent``: bundles from the router, link probes."""

    def __init__(self, bundles: Path, *, max_bundle_bytes: int) -> None:
        self.bundles = bundles
        self.max_bundle_bytes = max_bundle_bytes

    async def PutBundle(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PutBundleResponse:
        first = None
        self.bundles.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.bundles, prefix=".incoming-", suffix=".tar") as spool:
            received = 0
            async for chunk in request_iterator:
                if first is None:
                    first = chunk
                    problems = []
                    if not chunk.model or "/" in chunk.model or chunk.model.startswith("."):
                        problems.append(("model", f"must be a model name, but got {chunk.model!r}"))
                    if chunk.version < 1:
                        problems.append(("version", f"must be >= 1, but got {chunk.version}"))
                    if not 0 <= chunk.size <= self.max_bundle_bytes:
                        problems.append(("size", f"must be in [0, {self.max_bundle_bytes}] (the agent's "
                                                 f"OPML_INFERENCE_HOST_MAX_BUNDLE_BYTES), but got {chunk.size}"))
                    if problems:
                        raise InvalidArgument.of(problems)
                received += len(chunk.data)
                if received > first.size:
                    raise InvalidArgument("data", f"more bytes than the announced size {first.size}")
                spool.write(chunk.data)
            if first is None:
                raise InvalidArgument("chunks", "must hold at least one chunk")
            if received != first.size:
                raise InvalidArgument("data", f"{received} bytes arrived, but the first chunk announced {first.size}")
            spool.flush()
            target = self.bundles / first.model / str(first.version)
            await asyncio.to_thread(_unpack, Path(spool.name), target)
        log.info("bundle models/%s/versions/%d stored (%d bytes)", first.model, first.version, received)
        return pb.PutBundleResponse(path=str(target))

    async def Probe(self, request: pb.ProbeRequest, context: grpc.aio.ServicerContext) -> pb.ProbeResponse:
        return pb.ProbeResponse()

    def registration(self, verifier) -> ServiceRegistration:
        return ServiceRegistration(pb.DESCRIPTOR.services_by_name["HostAgent"],
                                   hosts_pb2_grpc.add_HostAgentServicer_to_server, self,
                                   {"PutBundle": "admin", "Probe": "admin"}, token_verifier=verifier)


def _unpack(archive: Path, target: Path) -> None:
    """Extracts the tar into ``target`` (replacing what was there) through a sibling folder, so a
    crash leaves the old bundle or the new one, never half of one. Regular files and folders only,
    inside the target (tarfile's ``data`` filter refuses links, devices and paths that leave it)."""
    staging = Path(tempfile.mkdtemp(dir=target.parent.parent if target.parent.exists() else archive.parent,
                                    prefix=".unpack-"))
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if not (member.isfile() or member.isdir()):
                    raise InvalidArgument("data", f"the bundle holds {member.name!r}, which is not a file or folder")
            tar.extractall(staging, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        old = target.with_name(f".old-{target.name}")
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    except tarfile.TarError as error:
        raise InvalidArgument("data", f"is not a readable tar: {error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class HostAgent(Component):
    """The agent (see the module). ``start()``: outbox, server, registration (retried until the router
    answers), workers, heartbeats. ``stop()``: the reverse; what the outbox holds stays on disk."""

    def __init__(self, settings: HostAgentSettings, platform: PlatformSettings,
                 metrics: ServiceMetrics | None = None, *, devices: Sequence[GpuDevice] | None = None) -> None:
        """``devices``: this machine's CUDA devices (default: :func:`opml_common.gpus.discover`'s, asked only
        when a pool is of a CUDA kind).

        Raises: InvalidArgument (see :func:`pools_of`); FailedPrecondition when a CUDA pool finds no device."""
        super().__init__()
        self.settings = settings
        self.platform = platform
        self.metrics = metrics or ServiceMetrics("inference-router-host")
        self.fleet = load_fleet_config(settings.fleet)
        self.pools = pools_of(settings, self.fleet)
        self.worker_token = ""
        self.heartbeat_interval_s = 1.0
        home = settings.home
        pinned = self._pin(devices)
        self.workers = [HostWorker(pool.pool, pool.kind, self._process(pool.pool, pool.kind, index,
                                                                         pinned.get(pool.pool)))
                        for index, pool in enumerate(self.pools)]
        self._channel = open_aio_channel(settings.router_target)
        self._stub = hosts_pb2_grpc.HostServiceStub(self._channel)
        token = settings.token.get_secret_value()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.outbox = Outbox(home / "outbox", RouterForwarder(self._channel, host=settings.name, token=token,
                                                              rate_eps=settings.forward_rate_eps),
                             self.metrics, retry_interval_s=1.0)
        self.predictions = PredictionLog(OutboxRecorder(self.outbox, source=f"opml://inference-router/hosts/"
                                                                            f"{settings.name}"), self.metrics)
        self.router = Router(connect=lambda address: connect(address, token=self.worker_token), metrics=self.metrics)
        self.front = InferenceFrontend(self.router, predictions=self.predictions)
        self.servicer = AgentServicer(home / "bundles", max_bundle_bytes=settings.max_bundle_bytes)
        self.server = GrpcServer(settings=settings, platform=platform, metrics=self.metrics,
                                 registrations=[self.servicer.registration(self._verify_router),
                                                self.front.registration()])
        self._task: asyncio.Task | None = None
        self.registered = asyncio.Event()
        self.link_up = True

    def _pin(self, devices: Sequence[GpuDevice] | None) -> dict[str, GpuDevice]:
        """A device of its own for the worker of each pool of a CUDA kind, by pool, in the order named.

        Raises: FailedPrecondition naming the pools left without one."""
        kinds = {kind.name: kind for kind in self.fleet.pool_kinds}
        cuda = [pool.pool for pool in self.pools if kinds[pool.kind].execution_provider == CUDA]
        if not cuda:
            return {}
        found = list(discover() if devices is None else devices)
        if len(cuda) > len(found):
            raise FailedPrecondition(f"pools {', '.join(cuda)} run on {CUDA}, one device each, but this host has "
                                     f"{len(found)} ({', '.join(d.describe() for d in found) or 'none found'})")
        pinned = dict(zip(cuda, found, strict=False))
        for pool, device in pinned.items():
            log.info("the worker of pool %s is pinned to %s", pool, device.describe())
        return pinned

    def _process(self, pool: str, kind: str, index: int, device: GpuDevice | None) -> WorkerProcess:
        sockets = Path(tempfile.mkdtemp(prefix="opml-host-"))  # short: a socket path holds 107 bytes
        extra = (("--threads-per-replica", str(self.settings.worker_threads_per_replica))
                 if self.settings.worker_threads_per_replica else ())
        return WorkerProcess(kind, self.settings.fleet, self.settings.home / "workers" / f"{pool}.log",
                             env=visible_devices_env([device]) if device is not None else {},
                             extra_args=extra, uds=sockets / f"{index}.sock",
                             startup_timeout_s=self.settings.worker_startup_timeout_s)

    def _verify_router(self, token: str) -> Principal | None:
        """The router's worker token may put bundles and probe, nothing else on the agent."""
        if self.worker_token and hmac.compare_digest(token.encode(), self.worker_token.encode()):
            return Principal("router", frozenset({"admin"}), Scope("the router's worker token",
                                                                  frozenset({"PutBundle", "Probe"}), None))
        return None

    @property
    def task(self) -> asyncio.Task:
        """The agent's loop: it ends only with an error the router's answer makes final (a refused registration)."""
        assert self._task is not None, "the agent is not started"
        return self._task

    @property
    def agent_address(self) -> str:
        return f"{self.settings.advertised_host}:{self.server.port}"

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self) -> None:
        await self.outbox.start()
        await self.predictions.start()
        await self.server.start()
        self._task = asyncio.create_task(self._run(), name="host-agent")

    async def on_stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.front.accepting = False
        await self.server.stop()
        await self.predictions.stop()
        await self.outbox.stop()
        await asyncio.gather(*(asyncio.to_thread(w.process.stop) for w in self.workers))
        for worker in self.workers:
            if worker.channel is not None:
                await worker.channel[1].close()
        await self.router.close()
        await self._channel.close()
        for worker in self.workers:
            if worker.process.uds is not None:
                shutil.rmtree(worker.process.uds.parent, ignore_errors=True)

    # -- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        """Registers, then heartbeats and tends the workers side by side: a worker that takes seconds to
        start never delays a heartbeat (the router would take the host for lost)."""
        await self._register()
        beats = asyncio.create_task(self._beat(), name="host-heartbeat")
        try:
            await self._tend()
        finally:
            await cancel_and_wait(beats)

    async def _tend(self) -> None:
        while True:
            for worker in self.workers:
                if worker.process.process is None or worker.process.process.poll() is not None:
                    await self._start_worker(worker)
            await self._sync_local()
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _beat(self) -> None:
        while True:
            try:
                await self._call(self._stub.Heartbeat, pb.HeartbeatRequest(host=self.settings.name, workers=[
                    pb.WorkerEndpoint(worker=w.worker_id, address=self._address(w)) for w in self.workers]))
                if not self.link_up:
                    log.warning("the router answers again")
                self.link_up = True
            except NotFound:
                log.warning("the router does not know this host (it restarted): registering again")
                await self._register()
            except OpmlError as error:
                if self.link_up:
                    log.warning("heartbeat failed (%s); serving local clients with what is loaded", error.message)
                self.link_up = False
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _register(self) -> None:
        request = pb.RegisterHostRequest(host=self.settings.name, pools=self.pools, agent_address=self.agent_address)
        attempt = 0
        while True:
            try:
                reply = await self._call(self._stub.RegisterHost, request)
                break
            except (InvalidArgument, PermissionDenied, Unauthenticated):
                raise  # a configuration or token the router refuses: fix it, retrying cannot help
            except OpmlError as error:
                delay = _REGISTER_BACKOFF.delay(attempt)
                attempt += 1
                log.warning("registering with %s failed (%s); retrying in %.1f s", self.settings.router_target,
                            error.message, delay)
                await asyncio.sleep(delay)
        restart = bool(self.worker_token) and self.worker_token != reply.worker_token
        self.worker_token = reply.worker_token
        self.heartbeat_interval_s = reply.heartbeat_interval_s or 1.0
        for worker, worker_id in zip(self.workers, reply.workers, strict=True):
            worker.worker_id = worker_id
            worker.process.env = {"OPML_AUTH_TOKENS": f"{self.worker_token}=admin",
                                  "OPML_INFERENCE_ROUTER_WORKER_HOST": self.settings.worker_host}
            if restart:  # started again with the new token by the next round
                worker.serving = False
                await asyncio.to_thread(worker.process.stop)
        self.registered.set()
        log.info("registered with %s as %s", self.settings.router_target, ", ".join(reply.workers))

    async def _start_worker(self, worker: HostWorker) -> None:
        worker.serving = False
        if worker.process.process is not None:
            log.warning("worker %s died (exit %s); restarting", worker.worker_id, worker.process.process.returncode)
            worker.process.kill()
            for model, version in list(worker.routed):
                with contextlib.suppress(NotFound):
                    await self.router.remove_replica(model, version, worker.process.local_target)
            worker.routed.clear()
        try:
            await asyncio.to_thread(worker.process.start)
        except Exception as error:  # noqa: BLE001 - reported as not serving; tried again next round
            log.error("worker %s failed to start: %s", worker.worker_id, error)
            return
        worker.serving = True

    def _address(self, worker: HostWorker) -> str:
        alive = worker.serving and worker.process.process is not None and worker.process.process.poll() is None
        return f"{self.settings.advertised_host}:{worker.process.grpc_port}" if alive else ""

    async def _sync_local(self) -> None:
        """The local front routes what each worker serves now (what the router last placed here)."""
        for worker in self.workers:
            if worker.process.grpc_port is None or worker.process.process is None:
                continue
            try:
                index = await self._index(worker)
            except OpmlError:
                continue
            address = worker.process.local_target
            for model, version in index - worker.routed:
                bundle = self.servicer.bundles / model / version
                try:
                    config = (await asyncio.to_thread(load_bundle, bundle)).config
                except OpmlError as error:
                    log.warning("models/%s/versions/%s serves here but its bundle is unreadable: %s",
                                model, version, error.message)
                    continue
                if model not in self.router.models():
                    self.router.set_model(model, ModelPolicy.for_model(config))
                self.router.add_replica(model, version, address)
                worker.routed.add((model, version))
            for model, version in worker.routed - index:
                with contextlib.suppress(NotFound):
                    await self.router.remove_replica(model, version, address)
                worker.routed.discard((model, version))

    async def _index(self, worker: HostWorker) -> set[tuple[str, str]]:
        """What the worker serves now (its repository index), on a channel kept while it runs."""
        if worker.channel is None or worker.channel[0] != worker.process.target:
            if worker.channel is not None:
                await worker.channel[1].close()
            worker.channel = (worker.process.target, open_aio_channel(worker.process.target))
        stub = service_pb2_grpc.GRPCInferenceServiceStub(worker.channel[1])
        reply = await self._call(stub.RepositoryIndex, service_pb2.RepositoryIndexRequest(ready=True),
                                 metadata=(("authorization", f"Bearer {self.worker_token}"),))
        return {(model.name, model.version) for model in reply.models}

    async def _call(self, method, request, metadata=None):
        try:
            return await method(request, timeout=CALL_TIMEOUT_S, metadata=metadata or self._metadata)
        except grpc.aio.AioRpcError as error:
            raise domain_error(error) from None

