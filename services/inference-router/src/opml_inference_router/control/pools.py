"""The pools of local worker processes: start one per worker the fleet declares, watch, restart.

Only pools whose kind this machine can run get workers: a kind's execution provider must be in
onnxruntime's available providers (a ``gpu`` pool only with ``CUDAExecutionProvider``, which the
router's ``gpu`` extra, onnxruntime-gpu, brings; an accelerator emulated with ``CPUExecutionProvider``
runs anywhere). :attr:`PoolManager.fleet` is the placement :class:`Fleet` of those pools, so the
planner never places on a worker that does not run; :attr:`PoolManager.unavailable_reasons` says
why each other kind gets no local worker.

A CUDA kind also needs devices (:func:`opml_common.gpus.discover`): each of its local workers is
pinned to one device of its own (``CUDA_VISIBLE_DEVICES=<index>`` in its environment, so its sessions
ask for device 0), none shared; no device found: the kind gets no worker; fewer devices than its
pools' workers: the manager refuses to start (FailedPrecondition naming the pools and the devices).

Workers are local processes, so each can also serve inference on a Unix domain socket
(``<work_dir>/workers/<id>.<start>.sock``, :mod:`opml_inference_router.worker.uds`; where that path is
longer than a socket address holds, in a private directory of the system's temporary folder, removed at
stop). With ``route_over_uds``,
:attr:`PoolWorker.address`, what the router calls, is that socket (``uds:<path>``; the router's
``connect`` must then be :func:`opml_inference_router.routing.uds_replica.connect`): a hop that
costs a fraction of a gRPC call (bench/inference_router_overhead.py). Health checks and the
control plane's admin calls use the worker's gRPC port on TCP.

A worker that dies (killed, crashed) is started again on new ports and a new socket (the dead one's
file is removed), and ``on_restart`` is awaited with its id and old and new addresses so the deployments re-load its
replicas and re-route. Before that, as soon as the death is seen, ``on_down`` is called with its id, its old
address and the seconds it is expected to take to come back (its last recovery, from death seen to replicas
re-loaded; before any, its first start), so the router stops sending there and can say when it expects it.

Pools at another site than ``local`` are served by host agents (:mod:`opml_inference_router.hosts`):
they are in :attr:`PoolManager.fleet` whatever this machine runs, no process is started for them, and
:meth:`PoolManager.get` hands out the host registry's :class:`~opml_inference_router.hosts.remote.HostedWorker`
for their workers once :meth:`PoolManager.attach_hosts` is called.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import onnxruntime as ort

from opml_common.errors import FailedPrecondition, NotFound, Unavailable
from opml_common.gpus import GpuDevice, discover, visible_devices_env
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_common.retry import Backoff
from opml_inference_router.control.workers import WorkerClient
from opml_inference_router.placement import Fleet, FleetConfig, Worker
from opml_inference_router.placement.fleet_config import LOCAL_SITE
from opml_inference_router.runtime.session import CUDA, thread_share
from opml_inference_router.worker.process import MAX_UDS_PATH, WorkerProcess

if TYPE_CHECKING:
    from opml_inference_router.hosts.registry import HostRegistry
    from opml_inference_router.hosts.remote import HostedWorker, HostedWorkerClient

_RESTART_BACKOFF = Backoff(base_s=1.0, max_s=30.0)  # after the n-th failed restart in a row: 1, 2, 4 .. 30 s

log = logging.getLogger(__name__)

RestartHook = Callable[[str, str, str], Awaitable[None]]
DownHook = Callable[[str, str, str, float], None]
"""``on_down(worker_id, address, reason, expected_back_in_s)``."""


def unavailable_reasons(config: FleetConfig, available: set[str], devices: Sequence[GpuDevice]) -> dict[str, str]:
    """Why each kind this machine cannot run gets no local worker, by kind name: its provider is not
    in this onnxruntime (for CUDA: the gpu extra is not installed), or it is CUDA and no device is found."""
    reasons = {}
    for kind in config.pool_kinds:
        if kind.execution_provider not in available:
            extra = "; install the router's gpu extra (onnxruntime-gpu)" if kind.execution_provider == CUDA else ""
            reasons[kind.name] = (f"{kind.execution_provider} is not in this onnxruntime (available: "
                                  f"{', '.join(sorted(available))}){extra}")
        elif kind.execution_provider == CUDA and not devices:
            reasons[kind.name] = ("no CUDA device found (nvidia-smi lists none or is not installed, or "
                                  "CUDA_VISIBLE_DEVICES hides them)")
    return reasons


def assign_devices(workers: Sequence[Worker], devices: Sequence[GpuDevice]) -> dict[str, GpuDevice]:
    """One device of its own per CUDA worker, in fleet order, by worker id.

    Raises:
        FailedPrecondition: more workers than devices (naming the pools and the devices).
    """
    if len(workers) > len(devices):
        pools: dict[str, int] = {}
        for worker in workers:
            pools[worker.pool] = pools.get(worker.pool, 0) + 1
        asked = ", ".join(f"{pool}: {count}" for pool, count in pools.items())
        have = ", ".join(device.describe() for device in devices) or "none"
        raise FailedPrecondition(f"the local CUDA pools ask for {len(workers)} workers ({asked}), one device each, "
                                 f"but this machine has {len(devices)} ({have}); lower their workers to at "
                                 f"most {len(devices)} in all")
    return {worker.id: device for worker, device in zip(workers, devices, strict=False)}


@dataclass
class PoolWorker:
    """One worker process of the fleet and the admin client of its TCP address."""

    worker: Worker
    process: WorkerProcess
    client: WorkerClient | None = None
    restarts: int = 0
    failures: int = field(default=0, repr=False)  # consecutive failed restarts
    recovery_s: float | None = field(default=None, repr=False)  # last start, or death seen -> replicas back
    died: tuple[str, float] | None = field(default=None, repr=False)  # (address, when seen) until it is back
    device: GpuDevice | None = None  # the CUDA device it is pinned to (a CUDA kind's worker)

    @property
    def expected_recovery_s(self) -> float:
        """How long it is expected to take to come back after a death (1 s before anything was measured)."""
        return self.recovery_s if self.recovery_s is not None else 1.0

    @property
    def address(self) -> str:
        """Where the router reaches it: gRPC ``host:port``, or its Unix socket when it serves one."""
        return self.process.local_target

    @property
    def alive(self) -> bool:
        return self.process.process is not None and self.process.process.poll() is None


class PoolManager(Component):
    """Starts, watches and restarts the worker processes of the fleet's runnable pools.

    Side effects:
        ``start()``: starts every worker (in parallel) and the watch task; a worker that fails to
        start stops the ones started and raises. Idempotent.
        ``stop()``: stops the watch task, then every worker gracefully (SIGTERM). Idempotent.
        Metrics ``opml_inference_router_worker_restarts_total{worker}``, ``_workers_alive{pool_kind}``.

    ``route_over_uds``: workers also serve on a Unix socket in ``<work_dir>/workers`` and
    :attr:`PoolWorker.address` is that socket (``uds:<path>``) for the router; off, it is gRPC ``host:port``.
    """

    def __init__(self, config: FleetConfig, fleet_path: Path, *, work_dir: Path, metrics: ServiceMetrics,
                 token: str | None = None, threads_per_replica: int = 0, startup_timeout_s: float = 60.0,
                 watch_interval_s: float = 0.5, providers: Sequence[str] | None = None,
                 devices: Sequence[GpuDevice] | None = None, route_over_uds: bool = False) -> None:
        """``providers``, ``devices``: what onnxruntime and the machine offer (default: asked).

        Raises: FailedPrecondition when no pool of the fleet can run on this machine, or its local
        CUDA pools ask for more workers than there are devices."""
        super().__init__()
        available = set(providers if providers is not None else ort.get_available_providers())
        kinds = {kind.name: kind for kind in config.pool_kinds}
        wants_cuda = CUDA in available and any(pool.site == LOCAL_SITE and pool.workers > 0
                                               and kinds[pool.kind].execution_provider == CUDA for pool in config.pools)
        found = list(devices) if devices is not None else (discover() if wants_cuda else [])
        self.unavailable_reasons = unavailable_reasons(config, available, found)
        self.unavailable_kinds = sorted(self.unavailable_reasons)
        for name, reason in self.unavailable_reasons.items():
            if any(pool.kind == name and pool.site == LOCAL_SITE and pool.workers > 0 for pool in config.pools):
                log.warning("pool kind %s gets no local worker: %s", name, reason)
        pools = tuple(pool for pool in config.pools
                      if (pool.kind not in self.unavailable_reasons or pool.site != LOCAL_SITE) and pool.workers > 0)
        if not pools:
            raise FailedPrecondition(f"no pool of {fleet_path} can run here: "
                                     + "; ".join(f"{name}: {why}" for name, why in self.unavailable_reasons.items()))
        self.fleet = Fleet(config.model_copy(update={"pools": pools}))
        pinned = assign_devices([worker for worker in self.fleet.workers
                                 if worker.site == LOCAL_SITE and worker.kind.execution_provider == CUDA], found)
        self.on_restart: RestartHook | None = None
        self.on_down: DownHook | None = None
        self._token = token
        self._threads_per_replica = threads_per_replica
        self._watch_interval_s = watch_interval_s
        self._sockets = work_dir / "workers" if route_over_uds else None
        self._short_sockets: Path | None = None  # made when a path under _sockets is too long (see _socket)
        env = {"OPML_AUTH_TOKENS": f"{token}=admin" if token else ""}
        extra = ("--threads-per-replica", str(threads_per_replica)) if threads_per_replica else ()
        self._workers = {
            worker.id: PoolWorker(worker, WorkerProcess(
                worker.kind.name, fleet_path, work_dir / "workers" / f"{worker.id}.log",
                env={**env, **visible_devices_env([pinned[worker.id]])} if worker.id in pinned else env,
                extra_args=extra, startup_timeout_s=startup_timeout_s, uds=self._socket(worker.id, 0)),
                device=pinned.get(worker.id))
            for worker in self.fleet.workers if worker.site == LOCAL_SITE}
        for worker_id, device in pinned.items():
            log.info("worker %s is pinned to %s", worker_id, device.describe())
        self.hosts: HostRegistry | None = None
        self._task: asyncio.Task | None = None
        self._restarts = metrics.counter("worker_restarts_total", "Worker processes restarted after they died.",
                                         ("worker",))
        alive = metrics.gauge("workers_alive", "Worker processes running, by pool kind.", ("pool_kind",))
        for kind in {worker.kind.name for worker in self.fleet.workers if worker.site == LOCAL_SITE}:
            alive.labels(kind).set_function(
                lambda kind=kind: sum(1 for w in self._workers.values() if w.worker.kind.name == kind and w.alive))

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self) -> None:
        results = await asyncio.gather(*(asyncio.to_thread(self._timed_start, w) for w in self._workers.values()),
                                       return_exceptions=True)
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            await self._stop_workers()
            raise errors[0]
        for pool_worker in self._workers.values():
            pool_worker.client = WorkerClient(pool_worker.process.target, token=self._token)
        log.info("workers started: %s", {w.worker.id: w.address for w in self._workers.values()})
        self._task = asyncio.create_task(self._watch(), name="pool-watch")

    async def on_stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self._stop_workers()
        if self._short_sockets is not None:
            shutil.rmtree(self._short_sockets, ignore_errors=True)

    # -- queries ---------------------------------------------------------------------------------

    def attach_hosts(self, hosts: HostRegistry) -> None:
        """Serves the workers of pools at other sites from ``hosts`` (see the module)."""
        self.hosts = hosts

    def get(self, worker_id: str) -> PoolWorker | HostedWorker:
        """Raises: NotFound for a worker the fleet does not run."""
        local = self._workers.get(worker_id)
        if local is not None:
            return local
        if self.hosts is not None and worker_id in self.hosts.workers:
            return self.hosts.workers[worker_id]
        raise NotFound(f"worker {worker_id!r} is not running in this router's pools")

    def slot_threads(self, kind: str) -> int:
        """Intra-op threads one slot of ``kind`` has on its workers (what a replica gets by default, and
        the most a serving configuration may give it): ``threads_per_replica``, else cores / slots."""
        return self._threads_per_replica or thread_share(self.fleet.kinds[kind])

    def client(self, worker_id: str) -> WorkerClient | HostedWorkerClient:
        """Raises: Unavailable for a worker whose host is lost or has not registered."""
        pool_worker = self.get(worker_id)
        if worker_id not in self._workers:  # a host's worker
            if pool_worker.client is None or not pool_worker.alive:
                raise Unavailable(f"worker {worker_id} has no live host (its host is lost or has not registered)")
            return pool_worker.client
        assert pool_worker.client is not None, "the pools are not started"
        return pool_worker.client

    def workers(self) -> list[PoolWorker | HostedWorker]:
        hosted = list(self.hosts.workers.values()) if self.hosts is not None else []
        return [*self._workers.values(), *hosted]

    # -- watching --------------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._watch_interval_s)
            for pool_worker in self._workers.values():
                if not pool_worker.alive:
                    await self._restart(pool_worker)

    @staticmethod
    def _timed_start(pool_worker: PoolWorker) -> None:
        began = time.monotonic()
        pool_worker.process.start()
        pool_worker.recovery_s = time.monotonic() - began

    def _down(self, pool_worker: PoolWorker, address: str, reason: str, back_in_s: float) -> None:
        if self.on_down is None:
            return
        try:
            self.on_down(pool_worker.worker.id, address, reason, back_in_s)
        except Exception:  # noqa: BLE001 - the watch goes on whatever the hook does
            log.exception("marking the replicas of dead worker %s down failed", pool_worker.worker.id)

    async def _restart(self, pool_worker: PoolWorker) -> None:
        """Starts a dead worker again and tells ``on_restart``; a failed start is retried on a later
        tick, backing off up to 30 s."""
        if pool_worker.died is None:  # first seen dead (not a retry after a failed start)
            pool_worker.died = (pool_worker.address, time.monotonic())
            self._down(pool_worker, pool_worker.address, f"worker {pool_worker.worker.id} restarting",
                       pool_worker.expected_recovery_s)
        old, seen = pool_worker.died  # what the router knows it by
        code = pool_worker.process.process.returncode if pool_worker.process.process is not None else None
        log.warning("worker %s at %s died (exit %s); restarting", pool_worker.worker.id, old, code)
        pool_worker.process.kill()  # reaps it and closes its pipe
        if pool_worker.process.uds is not None:  # a new socket: the router drops the old connection
            pool_worker.process.uds.unlink(missing_ok=True)
            pool_worker.process.uds = self._socket(pool_worker.worker.id, pool_worker.restarts + 1)
        try:
            await asyncio.to_thread(pool_worker.process.start)
        except Exception as error:  # noqa: BLE001 - keep watching; try again later
            pool_worker.failures += 1
            log.error("worker %s failed to restart (%s); retrying", pool_worker.worker.id, error)
            delay = _RESTART_BACKOFF.delay(pool_worker.failures - 1)
            self._down(pool_worker, old, f"worker {pool_worker.worker.id} failed to restart {pool_worker.failures} "
                       f"time{'s' if pool_worker.failures != 1 else ''} and is tried again",
                       delay + pool_worker.expected_recovery_s)
            await asyncio.sleep(delay)
            return
        pool_worker.failures = 0
        pool_worker.restarts += 1
        self._restarts.labels(pool_worker.worker.id).inc()
        if pool_worker.client is not None:
            await pool_worker.client.close()
        pool_worker.client = WorkerClient(pool_worker.process.target, token=self._token)
        log.info("worker %s restarted at %s", pool_worker.worker.id, pool_worker.address)
        if self.on_restart is not None:
            try:
                await self.on_restart(pool_worker.worker.id, old, pool_worker.address)
            except Exception:  # noqa: BLE001 - the hook logs its own failures; the watch goes on
                log.exception("re-loading the replicas of restarted worker %s failed", pool_worker.worker.id)
        pool_worker.recovery_s = time.monotonic() - seen
        pool_worker.died = None

    async def _stop_workers(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(w.process.stop) for w in self._workers.values()))
        for pool_worker in self._workers.values():
            if pool_worker.client is not None:
                await pool_worker.client.close()
                pool_worker.client = None

    def _socket(self, worker_id: str, start: int) -> Path | None:
        """The socket of a worker's ``start``-th process; ``None`` without ``route_over_uds``. A path under
        the work dir too long for a socket address (a deep work dir: a test's, a container volume's) moves
        to a private (0700) directory of the temporary folder; too long even there: TCP for that worker."""
        if self._sockets is None:
            return None
        name = f"{worker_id}.{start}.sock"
        path = (self._sockets / name).absolute()
        if len(os.fsencode(path)) <= MAX_UDS_PATH:
            return path
        if self._short_sockets is None:
            self._short_sockets = Path(tempfile.mkdtemp(prefix="opml-uds-"))
            log.info("worker sockets in %s: %s is longer than %d bytes", self._short_sockets, path, MAX_UDS_PATH)
        path = self._short_sockets / name
        if len(os.fsencode(path)) <= MAX_UDS_PATH:
            return path
        log.warning("worker socket path %s is longer than %d bytes; the router will use TCP", path, MAX_UDS_PATH)
        return None
