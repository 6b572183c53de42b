"""The router's registry of worker hosts: which host serves which fleet worker, whether it is alive,
and the measured link to each site.

A host's agent registers its pools; each becomes a place of a pool the fleet file declares at that
site (a host that registers again gets its places back). Heartbeats carry the workers' addresses.
A host silent for ``host_timeout_s`` is **lost**: its workers' replicas are marked down in the
router at once (``on_down``), then its workers are refused to placement (:meth:`refusal`) and
``on_change`` re-places what they hosted on other workers (deployments' ``replan_once``). When it
heartbeats again its workers are usable again, a worker whose address changed gets its planned
replicas back (``on_back``: deployments' ``worker_restarted``), and ``on_change`` runs again.

Links: every ``probe_interval_s`` the router times empty probes to each host's agent (the round
trip: the least of three) and one carrying ``probe_bytes`` (bandwidth: its bytes over the time past
the round trip). A site's link is its best host's. Placement reads them through :meth:`refusal`
(:class:`~opml_inference_router.placement.SiteRule`) and :meth:`site_rtt_ms`; the router's choice of
replicas gets each site's round trip after every measurement (``on_links``), to send each request to
the nearest site that serves it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, OpmlError
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_inference_router.control.workers import WorkerClient
from opml_inference_router.hosts.remote import AgentClient, HostedWorker, HostedWorkerClient, Transfer
from opml_inference_router.hosts.replicas import HostReplicas
from opml_inference_router.placement import (
    Fleet,
    Link,
    ModelDemand,
    ModelVersion,
    SiteRule,
    Worker,
    site_distance,
)
from opml_inference_router.placement.fleet_config import LOCAL_SITE

log = logging.getLogger(__name__)

HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_POOLS = 64

DownHook = Callable[[str, str, str, float], None]
BackHook = Callable[[str, str, str], Awaitable[None]]
UpHook = Callable[[str], object]
ChangeHook = Callable[[], Awaitable[object]]
LinksHook = Callable[[dict[str, float]], object]


@dataclass(frozen=True)
class RequestedPool:
    pool: str
    kind: str
    slots: int
    site: str


@dataclass
class Host:
    """One registered host: its agent, the workers it serves, when it was last heard of."""

    name: str
    site: str
    agent: AgentClient
    workers: list[str]
    last_seen: float
    lost: bool = False
    link: Link | None = None
    probed: float = field(default=-math.inf, repr=False)


class HostRegistry(Component):
    """Hosts, their workers and links (see the module).

    Side effects: ``start()`` starts the watch (liveness and link probes, every ``tick_s``);
    ``stop()`` ends it and closes the clients. Metrics ``opml_inference_router_hosts_alive{site}``,
    ``_hosts_lost_total{site}``, ``_host_bundle_bytes_total{site}``, ``_host_bundle_seconds{site}``,
    ``_site_rtt_ms{site}``, ``_site_bandwidth_mbps{site}``.
    """

    def __init__(self, fleet: Fleet, *, worker_token: str, metrics: ServiceMetrics,
                 bundle_bytes: Callable[[ModelVersion], int], rule: SiteRule | None = None,
                 heartbeat_interval_s: float = 1.0, host_timeout_s: float = 3.0, probe_interval_s: float = 30.0,
                 probe_bytes: int = 256 * 1024) -> None:
        if not 0 < heartbeat_interval_s < host_timeout_s:
            raise InvalidArgument("host_timeout_s", f"must be more than heartbeat_interval_s "
                                                    f"({heartbeat_interval_s}), but got {host_timeout_s}")
        super().__init__()
        self.fleet = fleet
        self.rule = rule or SiteRule()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.host_timeout_s = host_timeout_s
        self.on_down: DownHook | None = None
        self.on_up: UpHook | None = None
        self.on_back: BackHook | None = None
        self.on_change: ChangeHook | None = None
        self.on_links: LinksHook | None = None
        self.replicas = HostReplicas()
        self.worker_token = worker_token
        self._bundle_bytes = bundle_bytes
        self._probe_interval_s = probe_interval_s
        self._probe_bytes = probe_bytes
        self.hosts: dict[str, Host] = {}
        self.workers: dict[str, HostedWorker] = {
            worker.id: HostedWorker(worker) for worker in fleet.workers if worker.site != LOCAL_SITE}
        self._task: asyncio.Task | None = None
        self._probes: set[asyncio.Task] = set()
        self._changes: asyncio.Task | None = None
        self._pending_change = False
        sites = sorted({worker.worker.site for worker in self.workers.values()})
        alive = metrics.gauge("hosts_alive", "Registered worker hosts heard from within the host timeout, by site.",
                              ("site",))
        for site in sites:
            alive.labels(site).set_function(
                lambda site=site: sum(1 for h in self.hosts.values() if h.site == site and not h.lost))
        self._lost = metrics.counter("hosts_lost_total", "Hosts found silent past the host timeout, by site.",
                                     ("site",))
        self._sent_bytes = metrics.counter("host_bundle_bytes_total", "Bundle bytes sent to hosts, by site.",
                                           ("site",))
        self._sent_seconds = metrics.histogram("host_bundle_seconds", "Seconds a bundle took to reach a host.",
                                               ("site",), buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        rtt = metrics.gauge("site_rtt_ms", "Measured round trip from the router to a site.", ("site",))
        bandwidth = metrics.gauge("site_bandwidth_mbps", "Measured bandwidth from the router to a site.", ("site",))
        for site in sites:
            rtt.labels(site).set_function(lambda site=site: (self.links().get(site) or Link(math.nan, 0)).rtt_ms)
            bandwidth.labels(site).set_function(
                lambda site=site: (self.links().get(site) or Link(0, math.nan)).bandwidth_mbps)

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="host-watch")

    async def on_stop(self) -> None:
        task, self._task = self._task, None
        changes, self._changes = self._changes, None
        await cancel_and_wait(task, changes, *self._probes)
        for host in self.hosts.values():
            await host.agent.close()
        for hosted in self.workers.values():
            if hosted.client is not None:
                await hosted.client.close()
                hosted.client = None

    # -- what placement reads --------------------------------------------------------------------

    def links(self) -> dict[str, Link]:
        """Each site's link: its nearest live host's (sites with no measured live host are left out)."""
        found: dict[str, Link] = {}
        for host in self.hosts.values():
            if host.lost or host.link is None:
                continue
            best = found.get(host.site)
            if best is None or host.link.rtt_ms < best.rtt_ms:
                found[host.site] = host.link
        return found

    def site_rtt_ms(self, site: str) -> float:
        return site_distance(self.links())(site)

    def refusal(self, demand: ModelDemand, worker: Worker) -> str:
        """Why ``worker`` may not host ``demand`` now ('' when it may): a :data:`~.placement.WorkerCheck`."""
        if worker.site == LOCAL_SITE:
            return ""
        hosted = self.workers[worker.id]
        if not hosted.alive:
            return (f"host {hosted.host} is lost" if hosted.host and self.hosts[hosted.host].lost
                    else "no host serves it")
        site_link = self.links().get(worker.site)
        return self.rule.refusal(demand.config, self._bundle_bytes(demand.model), worker.site, site_link)

    def connector(self, connect):
        """The router's ``connect`` with the calls to a lost host's workers failed at once, and each host
        worker's replica at its site (:mod:`.replicas`)."""
        def site_of(address: str) -> str | None:
            return next((hosted.worker.site for hosted in self.workers.values() if hosted.address == address), None)
        return self.replicas.connector(connect, site_of)

    def worker(self, worker_id: str) -> HostedWorker:
        """Raises: NotFound for a worker no host pool declares."""
        hosted = self.workers.get(worker_id)
        if hosted is None:
            raise NotFound(f"worker {worker_id!r} is not in this router's fleet")
        return hosted

    # -- the agents' calls -----------------------------------------------------------------------

    def register(self, name: str, pools: Sequence[RequestedPool], agent_address: str) -> list[str]:
        """The fleet workers the host's pools become (see the module).

        Raises:
            InvalidArgument: naming every bad field: the host name, a pool the fleet does not
                declare, or declares with another kind, slots or site; the agent address.
            FailedPrecondition: a pool has no free place (every worker of it is held by a live host).
        """
        problems = []
        if not HOST_NAME.fullmatch(name):
            problems.append(("host", f"must match {HOST_NAME.pattern}, but got {name!r}"))
        if not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:\d{1,5}", agent_address):
            problems.append(("agent_address", f"must be host:port, but got {agent_address!r}"))
        if not 1 <= len(pools) <= MAX_POOLS:
            problems.append(("pools", f"must hold 1 to {MAX_POOLS} pools, but holds {len(pools)}"))
        declared = {pool.name: pool for pool in self.fleet.config.pools}
        for index, wanted in enumerate(pools[:MAX_POOLS]):
            pool = declared.get(wanted.pool)
            if pool is None or pool.site == LOCAL_SITE:
                remote = sorted(p.name for p in declared.values() if p.site != LOCAL_SITE)
                problems.append((f"pools[{index}].pool", f"must be a pool the fleet declares at a site other than "
                                                         f"local ({', '.join(remote) or 'none'}), but got {wanted.pool!r}"))
                continue
            kind = self.fleet.kinds[pool.kind]
            for attribute, expected, got in (("kind", pool.kind, wanted.kind), ("slots", kind.slots, wanted.slots),
                                             ("site", pool.site, wanted.site)):
                if expected != got:
                    problems.append((f"pools[{index}].{attribute}",
                                     f"must be the fleet's {attribute} of pool {pool.name} ({expected}), but got {got!r}"))
        if problems:
            raise InvalidArgument.of(problems)
        sites = {wanted.site for wanted in pools}
        if len(sites) > 1:
            raise InvalidArgument("pools", f"a host is at one site, but its pools name {', '.join(sorted(sites))}")
        existing = self.hosts.get(name)
        places = []
        for wanted in pools:
            place = self._place(name, wanted.pool, taken=places)
            places.append(place)
        if existing is not None:
            for worker_id in existing.workers:
                if worker_id not in places:
                    self._release(worker_id)
            agent_changed = existing.agent.address != agent_address
            host = existing
            host.workers, host.last_seen = places, time.monotonic()
            if agent_changed:
                old = host.agent
                host.agent = AgentClient(agent_address, token=self.worker_token)
                asyncio.get_running_loop().create_task(old.close())
            host.probed = -math.inf
        else:
            host = self.hosts[name] = Host(name, sites.pop(), AgentClient(agent_address, token=self.worker_token),
                                           places, time.monotonic())
        for worker_id in places:
            self.workers[worker_id].host = name
        log.info("host %s at site %s registered: %s (agent %s)", name, host.site, ", ".join(places), agent_address)
        return places

    async def heartbeat(self, name: str, endpoints: dict[str, str]) -> None:
        """Raises: NotFound (the host is not registered: register again); InvalidArgument (a worker
        that is not the host's)."""
        host = self.hosts.get(name)
        if host is None:
            raise NotFound(f"host {name!r} is not registered with this router; register again")
        strangers = sorted(set(endpoints) - set(host.workers))
        if strangers:
            raise InvalidArgument("workers", f"host {name} serves {', '.join(host.workers)}, but reported "
                                             f"{', '.join(strangers)}")
        host.last_seen = time.monotonic()
        changed = host.lost
        if host.lost:
            host.lost = False
            log.warning("host %s at site %s is back", name, host.site)
        for worker_id in host.workers:
            address = endpoints.get(worker_id, "")
            hosted = self.workers[worker_id]
            if address == hosted.address and hosted.alive == bool(address):
                continue
            old = hosted.address
            if not address:
                self._down(hosted, f"worker {worker_id} on host {name} is not serving")
                continue
            changed = True
            if old == address:  # the same process, back after a cut: its replicas take traffic again
                hosted.alive = True
                self.replicas.mend(address)
                if self.on_up is not None:
                    self.on_up(address)
                log.info("worker %s serves again at %s", worker_id, address)
                continue
            await self._connect(hosted, host, address)
            if old and self.on_back is not None:
                try:
                    await self.on_back(worker_id, old, address)
                except Exception:  # noqa: BLE001 - logged; the heartbeat is answered either way
                    log.exception("re-loading the replicas of worker %s failed", worker_id)
        if changed:
            self._changed()

    async def clear(self) -> None:
        """Lets every host go (this router replica stopped leading): their workers' replicas are marked
        down and their places freed; each agent's next call reaches the leading replica, which tells it
        to register."""
        for host in list(self.hosts.values()):
            for worker_id in host.workers:
                self._release(worker_id)
            await host.agent.close()
        self.hosts.clear()
        for hosted in self.workers.values():
            if hosted.client is not None:
                await hosted.client.close()
                hosted.client = None

    # -- internals -------------------------------------------------------------------------------

    def _place(self, host: str, pool: str, *, taken: list[str]) -> str:
        """The host's place in ``pool``: the one it holds, else a free one, else a lost host's."""
        workers = [w for w in self.fleet.workers if w.pool == pool and w.id not in taken]
        for worker in workers:
            if self.workers[worker.id].host == host:
                return worker.id
        for worker in workers:
            if not self.workers[worker.id].host:
                return worker.id
        for worker in workers:
            holder = self.hosts.get(self.workers[worker.id].host)
            if holder is None or holder.lost:
                if holder is not None:
                    holder.workers.remove(worker.id)
                self._release(worker.id)
                return worker.id
        raise FailedPrecondition(f"pool {pool} has no free place: its {len(workers)} workers are held by live hosts "
                                 f"({', '.join(sorted({self.workers[w.id].host for w in workers}))}); raise its "
                                 f"workers in the fleet file")

    def _release(self, worker_id: str) -> None:
        hosted = self.workers[worker_id]
        if hosted.alive:
            self._down(hosted, f"worker {worker_id} left by host {hosted.host}")
        hosted.host, hosted.address = "", ""

    async def _connect(self, hosted: HostedWorker, host: Host, address: str) -> None:
        if hosted.client is not None:
            await hosted.client.close()
        site = host.site

        def sent(transfer: Transfer) -> None:
            self._sent_bytes.labels(site).inc(transfer.bytes)
            self._sent_seconds.labels(site).observe(transfer.seconds)

        hosted.client = HostedWorkerClient(WorkerClient(address, token=self.worker_token), host.agent, on_transfer=sent)
        if hosted.address:
            hosted.restarts += 1
        hosted.address, hosted.alive = address, True
        log.info("worker %s serves at %s (host %s, site %s)", hosted.worker.id, address, host.name, site)

    def _down(self, hosted: HostedWorker, reason: str) -> None:
        if not hosted.alive:
            return
        hosted.alive = False
        severed = self.replicas.sever(hosted.address, reason) if hosted.address else 0
        log.warning("%s: its replicas are marked down (%d connections' calls failed over)", reason, severed)
        if self.on_down is not None and hosted.address:
            try:
                self.on_down(hosted.worker.id, hosted.address, reason, self.host_timeout_s)
            except Exception:  # noqa: BLE001 - the watch goes on whatever the hook does
                log.exception("marking the replicas of %s down failed", hosted.worker.id)

    def _changed(self) -> None:
        """Runs ``on_change`` (a re-placement) in the background, one at a time, once more if asked meanwhile."""
        if self.on_change is None:
            return
        self._pending_change = True
        if self._changes is None or self._changes.done():
            self._changes = asyncio.get_running_loop().create_task(self._run_changes(), name="host-replace")

    async def _run_changes(self) -> None:
        while self._pending_change:
            self._pending_change = False
            try:
                await self.on_change()  # type: ignore[misc]
            except OpmlError as error:
                log.warning("re-placement after a host change failed: %s", error.message)
            except Exception:  # noqa: BLE001 - the next change tries again
                log.exception("re-placement after a host change failed")

    async def _watch(self) -> None:
        tick_s = min(self.heartbeat_interval_s, self.host_timeout_s / 4)
        while True:
            self.check(time.monotonic())
            await asyncio.sleep(tick_s)

    def check(self, now: float) -> list[str]:
        """One watch round at ``now``: hosts silent past the timeout are lost (their replicas marked down
        and severed, a re-placement started), links due a measurement are probed. Returns the hosts lost."""
        lost = []
        for host in list(self.hosts.values()):
            if not host.lost and now - host.last_seen > self.host_timeout_s:
                host.lost = True
                lost.append(host.name)
                self._lost.labels(host.site).inc()
                log.warning("host %s at site %s lost: no heartbeat for %.1f s", host.name, host.site,
                            now - host.last_seen)
                for worker_id in host.workers:
                    self._down(self.workers[worker_id], f"host {host.name} (site {host.site}) lost")
                self._changed()
            elif not host.lost and now - host.probed >= self._probe_interval_s:
                host.probed = now
                self._probes.add(asyncio.get_running_loop().create_task(self._probe(host), name=f"probe-{host.name}"))
        return lost

    async def _probe(self, host: Host) -> None:
        """Measures the host's link; a measurement that changes what placement may do re-places."""
        try:
            rtt_s = min([await host.agent.probe() for _ in range(3)])
            padded_s = await host.agent.probe(self._probe_bytes)
        except OpmlError as error:
            log.info("probing host %s failed: %s", host.name, error.message)
            return
        finally:
            self._probes.discard(asyncio.current_task())  # type: ignore[arg-type]
        bandwidth = self._probe_bytes * 8 / max(padded_s - rtt_s, 1e-6) / 1e6
        first = host.link is None
        host.link = Link(rtt_ms=rtt_s * 1000, bandwidth_mbps=bandwidth)
        log.info("host %s at site %s: %s", host.name, host.site, host.link)
        if self.on_links is not None:
            self.on_links({site: link.rtt_ms for site, link in self.links().items()})
        if first:
            self._changed()


__all__ = ["Host", "HostRegistry", "RequestedPool"]
