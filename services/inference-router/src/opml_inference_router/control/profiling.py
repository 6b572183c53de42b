"""Profiling a new version before it is placed: one load with ``profile`` on the emptiest live worker
of each allowed pool kind, the measured batch latencies read back, then unloaded."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from pathlib import Path

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, OpmlError, ResourceExhausted, Unavailable
from opml_inference_router.control.pools import PoolManager
from opml_inference_router.control.state import VersionRecord
from opml_inference_router.placement import ModelConfig, ModelVersion, Plan, ProfileBook

log = logging.getLogger(__name__)

# Load errors that say the bundle itself is bad: the deploy fails at once with the loader's reason.
BUNDLE_FAULTS = (InvalidArgument, NotFound)


async def profile_version(pools: PoolManager, plan: Plan, profiles: ProfileBook, entry: VersionRecord,
                          config: ModelConfig) -> None:
    """Adds the version's profile on each allowed kind that has a live worker to ``profiles``.

    A kind that cannot host it (precision, room, a worker down) is skipped with its reason.

    Raises:
        InvalidArgument, NotFound: a load failed because of the bundle (the loader's reason).
        FailedPrecondition: no allowed kind could profile it.
    """
    model = ModelVersion(config.name, entry.version)
    skipped = []
    for kind in config.pool_kinds:
        workers = [w for w in pools.fleet.workers_of(kind) if pools.get(w.id).alive]
        if not workers:
            continue
        used = Counter(worker_id for _, worker_id in plan.replicas())
        worker = min(workers, key=lambda w: (used[w.id], w.id))
        client = pools.client(worker.id)
        try:
            await client.load(config.name, path=Path(entry.directory), version=entry.version, profile=True)
        except BUNDLE_FAULTS:
            raise
        except (FailedPrecondition, ResourceExhausted, Unavailable) as error:
            skipped.append(f"{kind}: {error.message}")
            continue
        try:
            profile = await client.profile(config.name, entry.version)
        finally:
            with contextlib.suppress(OpmlError):
                await client.unload(config.name, entry.version)
        profiles.add(profile, replace=True)
        log.info("profiled %s on %s (%s): %s", model, kind, profile.precision,
                 {size: round(ms, 3) for size, ms in profile.batch_latency_ms.items()})
    if not any(profiles.get(model, kind) for kind in config.pool_kinds):
        raise FailedPrecondition(f"{model} could not be profiled on any allowed pool kind "
                                 f"({'; '.join(skipped) or 'no worker of them runs'})")
