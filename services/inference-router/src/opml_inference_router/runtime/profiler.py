"""Profiling on deploy: how long one batch takes at each size on this worker's kind, and the memory.

The ladder is the kind's fixed shapes up to the replica's batch cap (an accelerator runs only
those), else powers of two up to the cap. Each size runs a few warm-up batches, then ``repeats``
timed ones (fewer when a size exceeds its time budget) on synthetic inputs of the declared form.
:func:`to_profile` turns the report into placement's :class:`Profile` (mean latency per size).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from opml_inference_router.kserve.datatypes import DATATYPES
from opml_inference_router.placement.fleet_config import ModelVersion
from opml_inference_router.placement.profile import Profile
from opml_inference_router.runtime.replica import Replica
from opml_inference_router_contract.model_config import ModelConfig


@dataclass(frozen=True)
class BatchTiming:
    """Latency of one batch of ``batch`` rows over ``runs`` timed runs, in milliseconds."""

    batch: int
    runs: int
    mean_ms: float
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class ProfileReport:
    """What profiling measured for one replica: a timing per batch size and its memory."""

    model: ModelVersion
    pool_kind: str
    precision: str
    timings: tuple[BatchTiming, ...]
    memory_mib: float

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.name, "version": self.model.version, "pool_kind": self.pool_kind,
                "precision": self.precision, "memory_mib": self.memory_mib,
                "timings": [vars(t) for t in self.timings]}


def to_profile(report: ProfileReport) -> Profile:
    """Placement's Profile of the report: the mean latency per batch size, made non-decreasing (a larger
    batch measured faster than a smaller one is timer noise, and Profile refuses falling latencies)."""
    table: dict[int, float] = {}
    running = 0.0
    for timing in sorted(report.timings, key=lambda t: t.batch):
        running = max(running, timing.mean_ms)
        table[timing.batch] = running
    return Profile(report.model, report.pool_kind, report.precision, table, report.memory_mib)  # type: ignore[arg-type]


def batch_ladder(replica: Replica) -> list[int]:
    """Batch sizes to measure: the kind's fixed shapes up to the cap, else 1, 2, 4, ... and the cap."""
    cap = replica.max_batch
    if replica.kind.batch_sizes and replica.batches:
        return [shape for shape in replica.kind.batch_sizes if shape <= cap] or [cap]
    sizes, size = [], 1
    while size < cap:
        sizes.append(size)
        size *= 2
    return [*sizes, cap]


def synthetic_inputs(config: ModelConfig, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random inputs of the declared form (dynamic non-batch dims as 1) with ``rows`` rows."""
    inputs: dict[str, np.ndarray] = {}
    for spec in config.inputs:
        shape = ([rows] if config.max_batch_size > 0 else []) + [d if d > 0 else 1 for d in spec.dims]
        dtype = DATATYPES[spec.data_type].numpy
        if spec.data_type == "string":
            array = np.full(shape, b"x", dtype=np.object_)
        elif spec.data_type == "bool":
            array = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            array = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            array = rng.standard_normal(shape).astype(dtype)
        inputs[spec.name] = array
    return inputs


def profile_replica(replica: Replica, *, repeats: int = 20, warmup: int = 2, budget_s: float = 1.0,
                    sizes: list[int] | None = None, seed: int = 0) -> ProfileReport:
    """Times ``replica.run`` at each batch size (blocking; call it off the event loop).

    At least 3 timed runs per size; more up to ``repeats`` while the size's ``budget_s`` lasts.
    """
    rng = np.random.default_rng(seed)
    timings = []
    for size in sizes or batch_ladder(replica):
        inputs = synthetic_inputs(replica.config, size, rng)
        for _ in range(warmup):
            replica.run(inputs)
        samples: list[float] = []
        deadline = time.perf_counter() + budget_s
        while len(samples) < repeats and (len(samples) < 3 or time.perf_counter() < deadline):
            start = time.perf_counter()
            replica.run(inputs)
            samples.append((time.perf_counter() - start) * 1000.0)
        ordered = sorted(samples)
        timings.append(BatchTiming(size, len(samples), statistics.fmean(samples), statistics.median(ordered),
                                   ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]))
    return ProfileReport(replica.model, replica.kind.name, replica.precision, tuple(timings), replica.memory_mib)
