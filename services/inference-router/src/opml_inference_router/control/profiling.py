"""Profiling a new version before it is placed: one load with ``profile`` on the emptiest live worker
of each allowed pool kind, then the time batches take on the real request path, then unloaded.

The worker's own profile times the model's execution alone (``replica.run``), which for a small model
is a few percent of what a request costs: decoding and encoding the tensors, the protobuf copies, the
batcher, the hop from the router over the worker's socket. Planned on it, a model got a batch cap of 1
that served half of what the cap its measured latency later called for served. So at each batch size
the worker measured, the router sends that many one-row requests at once over the connection it
routes through, with the version's batch cap set to the size (so they form one batch), and plans on
the time the batch takes there: what a request really costs, measured before the first plan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np

from opml_common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OpmlError,
    ResourceExhausted,
    Unavailable,
)
from opml_common.kserve_codec import encode_request
from opml_inference_router.control.pools import PoolManager
from opml_inference_router.control.state import VersionRecord
from opml_inference_router.control.workers import WorkerClient
from opml_inference_router.placement import ModelVersion, Plan, Profile, ProfileBook
from opml_inference_router.placement.fleet_config import LOCAL_SITE
from opml_inference_router.routing import Replica, Router
from opml_inference_router.runtime.profiler import synthetic_inputs
from opml_inference_router_contract.model_config import ModelConfig

log = logging.getLogger(__name__)

# Load errors that say the bundle itself is bad: the deploy fails at once with the loader's reason.
BUNDLE_FAULTS = (InvalidArgument, NotFound)


PATH_REPEATS = 12  # timed batches per size on the request path (after 2 warm-up batches)
PATH_CALL_TIMEOUT_S = 30.0


async def profile_version(pools: PoolManager, plan: Plan, profiles: ProfileBook, entry: VersionRecord,
                          config: ModelConfig, router: Router) -> None:
    """Adds the version's profile on each allowed kind that has a live worker to ``profiles``: the
    request path's batch latencies (see the module), never below the worker's execution alone.

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
        # the router's own site first: a profile taken across a link would carry its round trip
        worker = min(workers, key=lambda w: (w.site != LOCAL_SITE, used[w.id], w.id))
        client = pools.client(worker.id)
        try:
            await client.load(config.name, path=Path(entry.directory), version=entry.version, profile=True)
        except BUNDLE_FAULTS:
            raise
        except (FailedPrecondition, ResourceExhausted, Unavailable, DeadlineExceeded) as error:
            skipped.append(f"{kind}: {error.message}")
            continue
        try:
            executed = await client.profile(config.name, entry.version)
            async with router.connection(pools.get(worker.id).address) as replica:
                profile = await request_path_profile(replica, client, config, entry, executed)
        finally:
            with contextlib.suppress(OpmlError):
                await client.unload(config.name, entry.version)
        profiles.add(profile, replace=True)
        log.info("profiled %s on %s (%s): request path %s ms, execution alone %s ms", model, kind,
                 profile.precision, {size: round(ms, 3) for size, ms in profile.batch_latency_ms.items()},
                 {size: round(ms, 3) for size, ms in executed.batch_latency_ms.items()})
    if not any(profiles.get(model, kind) for kind in config.pool_kinds):
        raise FailedPrecondition(f"{model} could not be profiled on any allowed pool kind "
                                 f"({'; '.join(skipped) or 'no worker of them runs'})")


async def _timed_batch(replica: Replica, requests: list[bytes]) -> float:
    """Milliseconds until every one of ``requests``, sent at once, is answered."""
    start = time.perf_counter()
    await asyncio.gather(*(replica.call("ModelInfer", request, timeout_s=PATH_CALL_TIMEOUT_S) for request in requests))
    return (time.perf_counter() - start) * 1000.0


async def request_path_profile(replica: Replica, client: WorkerClient, config: ModelConfig, entry: VersionRecord,
                               executed: Profile, *, repeats: int = PATH_REPEATS, warmup: int = 2) -> Profile:
    """``executed`` with each batch size's latency replaced by the mean time ``size`` one-row requests,
    sent at once through ``replica`` (the router's connection to the worker) with the version's batch
    cap set to ``size``, take to be answered; never below the execution alone, never falling with size.

    Raises: OpmlError from the worker (a call or the batch-cap change failed): the version is not placed.
    """
    rng = np.random.default_rng(entry.version)
    table: dict[int, float] = {}
    running = 0.0
    for size in sorted(executed.batch_latency_ms):
        await client.load(config.name, path=Path(entry.directory), version=entry.version, max_batch=size)
        requests = [encode_request(config.name, synthetic_inputs(config, 1, rng),
                                   version=str(entry.version)).SerializeToString() for _ in range(size)]
        for _ in range(warmup):
            await _timed_batch(replica, requests)
        path_ms = statistics.fmean([await _timed_batch(replica, requests) for _ in range(repeats)])
        running = max(running, path_ms, executed.batch_latency_ms[size])
        table[size] = running
    return Profile(executed.model, executed.pool_kind, executed.precision, table, executed.memory_mib)
