"""How the router's deployments and its host registry are joined (the few lines ``__main__`` calls), and
the replicas a lost site's workers gave up, moved back when the site returns."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from pathlib import Path

from opml_common.errors import OpmlError
from opml_inference_router.control.deployments import DeploymentManager
from opml_inference_router.control.state import ModelRecord
from opml_inference_router.hosts.registry import HostRegistry
from opml_inference_router.placement import ModelVersion

log = logging.getLogger(__name__)


class SiteFailover:
    """Re-places on every host change (:meth:`DeploymentManager.replan_once`: off a lost host's workers,
    onto new ones) and remembers, per lost worker, where each of its replicas went; once the worker is
    usable again, each goes back there (:meth:`DeploymentManager.move_replica`), so a site that returns
    serves what it served before its cut, and the substitute's slot is free again. Then what a returned
    worker still holds that the plan does not put there is unloaded
    (:meth:`DeploymentManager.reconcile_worker`), so its slots hold what the plan counts. The same
    check is made of each worker the first time it serves for this router: a host that registers
    again after the router restarted still holds what the router placed there in its previous life.

    Each round re-places with ``regrow``: a version short of replicas since a worker was lost, or
    below its replica floor (placed while the hosts had not registered yet), grows where room is now."""

    def __init__(self, hosts: HostRegistry, manager: DeploymentManager) -> None:
        self.hosts = hosts
        self.manager = manager
        self.displaced: dict[str, dict[ModelVersion, str]] = {}  # lost worker -> version -> its substitute
        # workers whose holdings are checked against the plan once alive: seen lost, or not seen serving yet
        self.returned: set[str] = set(hosts.workers)

    async def changed(self) -> None:
        if not self.manager.leading:  # a router replica that follows places on no host
            return
        # the workers lost when this round began: those it re-places off (one may be back by its end)
        lost = {worker_id for worker_id, hosted in self.hosts.workers.items() if not hosted.alive}
        self.returned |= lost  # checked against the plan once alive again, after what moves back has
        await self.manager.place_waiting()  # restored versions that waited for their hosts
        before = self.manager.plan
        # a worker lost, back or new: placement only (the measurements of a window with a failover in it are no
        # measure of the replicas' speed: the re-placement tick judges drift); the versions short of replicas grow
        await self.manager.replan_once(regrow=True, measured=False)
        after = self.manager.plan
        for model, placed in before.placements.items():
            now = after.placements.get(model)
            for worker_id in set(placed.workers) & lost:
                if now is None or worker_id in now.workers:
                    continue
                substitutes = sorted(set(now.workers) - set(placed.workers))
                if substitutes:
                    self.displaced.setdefault(worker_id, {})[model] = substitutes[0]
        for worker_id in [w for w in self.displaced if self.hosts.workers[w].alive]:
            for model, substitute in self.displaced.pop(worker_id).items():
                try:
                    moved = await self.manager.move_replica(
                        model, substitute, worker_id, f"{worker_id} is back: its replica returns from {substitute}")
                except OpmlError as error:
                    log.warning("%s stays on %s: moving it back to %s failed: %s", model, substitute, worker_id,
                                error.message)
                    continue
                if moved is not None:
                    log.info("%s moved back from %s to %s", model, substitute, worker_id)
        for worker_id in sorted(self.returned & {w for w, h in self.hosts.workers.items() if h.alive}):
            self.returned.discard(worker_id)
            try:
                stale = await self.manager.reconcile_worker(worker_id)
            except OpmlError as error:
                log.warning("what %s serves beside the plan stays until its next load: %s", worker_id, error.message)
                continue
            if stale:
                log.info("%s back: unloaded %s, placed elsewhere while it was away", worker_id,
                         ", ".join(map(str, stale)))


def connect_hosts(hosts: HostRegistry, manager: DeploymentManager) -> SiteFailover:
    """A lost host's replicas are marked down at once (and up when it heartbeats again); its workers'
    changes re-place (:class:`SiteFailover`); a worker back at a new address gets its planned replicas;
    each link measured ranks its site for the router's nearest-first choice of replicas."""
    failover = SiteFailover(hosts, manager)
    hosts.on_links = manager.router.set_site_rtts
    hosts.on_down = manager.worker_down
    hosts.on_up = manager.router.replica_up
    hosts.on_back = manager.worker_restarted
    hosts.on_change = failover.changed
    return failover


def bundle_bytes(models: Mapping[str, ModelRecord], model: ModelVersion) -> int:
    """The bytes a version's bundle moves to a host (0 while it is not deployed here)."""
    record = models.get(model.name)
    entry = record.versions.get(model.version) if record is not None else None
    return _folder_bytes(entry.directory) if entry is not None and entry.directory else 0


@functools.lru_cache(maxsize=1024)
def _folder_bytes(directory: str) -> int:
    """A bundle's folder is never changed once fetched (a new version is a new folder), so its size is kept."""
    return sum(path.stat().st_size for path in Path(directory).rglob("*") if path.is_file())
