"""How the router's deployments and its host registry are joined (the few lines ``__main__`` calls)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

from opml_inference_router.control.deployments import DeploymentManager
from opml_inference_router.control.state import ModelRecord
from opml_inference_router.hosts.registry import HostRegistry
from opml_inference_router.placement import ModelVersion


def connect_hosts(hosts: HostRegistry, manager: DeploymentManager) -> None:
    """A lost host's replicas are marked down at once; its workers' changes re-place (off a lost host,
    onto a new or returning one); a worker back at a new address gets its planned replicas again."""
    hosts.on_down = manager.worker_down
    hosts.on_up = manager.router.replica_up
    hosts.on_back = manager.worker_restarted
    hosts.on_change = manager.replan_once


def bundle_bytes(models: Mapping[str, ModelRecord], model: ModelVersion) -> int:
    """The bytes a version's bundle moves to a host (0 while it is not deployed here)."""
    record = models.get(model.name)
    entry = record.versions.get(model.version) if record is not None else None
    return _folder_bytes(entry.directory) if entry is not None and entry.directory else 0


@functools.lru_cache(maxsize=1024)
def _folder_bytes(directory: str) -> int:
    """A bundle's folder is never changed once fetched (a new version is a new folder), so its size is kept."""
    return sum(path.stat().st_size for path in Path(directory).rglob("*") if path.is_file())
