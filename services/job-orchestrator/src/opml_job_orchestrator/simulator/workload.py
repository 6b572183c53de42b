"""Synthetic workloads like the TE/BE paper's: many short TE jobs, fewer long BE jobs, one GPU cluster.

The paper's full workload description was not available to us, so these are stated assumptions,
all of them fields of :class:`WorkloadConfig`:

* a homogeneous GPU cluster (default 16 nodes x 8 GPUs, 96 cores, 768 GiB);
* Poisson arrivals whose rate makes the offered GPU load ``load`` of the cluster's GPUs, of
  which ``te_load_share`` comes from TE jobs;
* TE jobs: one chief replica with 1, 2, 4 or 8 GPUs, log-uniform durations from 1 minute to 1 hour
  (short and frequent: about 30 TE jobs for each BE job at the defaults);
* BE jobs: 1 to 4 replicas (a chief and workers) of 1 to 8 GPUs each, sometimes with parameter
  servers and an evaluator (CPU only), log-uniform durations from 1 to 24 hours, checkpointing
  every 15, 30 or 60 minutes, and paying 1 to 5 minutes of restart overhead on every resume;
* every replica asks for 8 cores and 64 GiB per GPU.

Jobs are generated from one ``random.Random(seed)``: the same config and seed give the same jobs.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from opml_common.errors import InvalidArgument
from opml_job_orchestrator.scheduler.capacity import NodeSpec
from opml_job_orchestrator.scheduler.model import JobClass, JobSpec, Resources, RoleSpec

CPU_MILLIS_PER_GPU = 8_000
MEMORY_MIB_PER_GPU = 64 * 1024
PS_RESOURCES = Resources(cpu_millis=4_000, memory_mib=16 * 1024)
EVALUATOR_RESOURCES = Resources(cpu_millis=4_000, memory_mib=32 * 1024)


@dataclass(frozen=True)
class SimJob:
    """A job of the workload: what is submitted when, and how much work it is (in seconds)."""

    spec: JobSpec
    submit_time: float
    duration_s: float
    measured: bool
    """False for jobs submitted during the warm-up, which reports leave out."""


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """The cluster and the job mix. Keyword-only; checked when built (InvalidArgument names the field)."""

    nodes: int = 16
    gpus_per_node: int = 8
    cpu_millis_per_node: int = 96_000
    memory_mib_per_node: int = 768 * 1024
    num_jobs: int = 12_000
    load: float = 0.85
    """Offered GPU load: expected GPU-seconds asked per second over the cluster's GPUs."""
    te_load_share: float = 0.2
    """Fraction of the offered GPU load that comes from TE jobs."""
    te_duration_s: tuple[float, float] = (60.0, 3600.0)
    be_duration_s: tuple[float, float] = (3600.0, 24 * 3600.0)
    te_gpus: tuple[tuple[int, float], ...] = ((1, 0.5), (2, 0.25), (4, 0.15), (8, 0.1))
    """(GPUs of the chief, weight)."""
    be_shapes: tuple[tuple[int, int, float], ...] = (
        (1, 1, 0.2), (1, 2, 0.15), (1, 4, 0.15), (1, 8, 0.2), (2, 8, 0.15), (4, 8, 0.15))
    """(replicas: one chief plus workers, GPUs per replica, weight)."""
    be_ps_probability: float = 0.5
    """Chance that a multi-replica BE job also has two parameter servers."""
    be_evaluator_probability: float = 0.3
    be_checkpoint_interval_s: tuple[float, ...] = (900.0, 1800.0, 3600.0)
    be_restart_overhead_s: tuple[float, float] = (60.0, 300.0)
    warmup_fraction: float = 0.1
    """Leading fraction of the jobs left out of reports (the cluster starts empty)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "cpu_millis_per_node", "memory_mib_per_node", "num_jobs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(name, f"`{name}` must be an integer >= 1, but got {value!r}.")
        if not isinstance(self.load, int | float) or isinstance(self.load, bool) or not 0 < self.load <= 1.5:
            raise InvalidArgument("load", f"`load` must be a number in (0, 1.5], but got {self.load!r}.")
        for name in ("te_load_share", "be_ps_probability", "be_evaluator_probability", "warmup_fraction"):
            _check_fraction(getattr(self, name), name, upper=1.0)
        for name in ("te_duration_s", "be_duration_s", "be_restart_overhead_s"):
            low, high = getattr(self, name)
            if not 0 <= low <= high < math.inf or (name != "be_restart_overhead_s" and low <= 0):
                raise InvalidArgument(name, f"`{name}` must be (low, high) seconds with 0 < low <= high, "
                                            f"but got {(low, high)!r}.")
        if not self.te_gpus or any(g < 1 or g > self.gpus_per_node or w <= 0 for g, w in self.te_gpus):
            raise InvalidArgument("te_gpus", f"`te_gpus` must list (GPUs in 1..{self.gpus_per_node}, weight > 0), "
                                             f"but got {self.te_gpus!r}.")
        if not self.be_shapes or any(r < 1 or g < 1 or g > self.gpus_per_node or w <= 0
                                     for r, g, w in self.be_shapes):
            raise InvalidArgument("be_shapes", f"`be_shapes` must list (replicas >= 1, GPUs per replica in "
                                               f"1..{self.gpus_per_node}, weight > 0), but got {self.be_shapes!r}.")
        if not self.be_checkpoint_interval_s or any(i <= 0 for i in self.be_checkpoint_interval_s):
            raise InvalidArgument("be_checkpoint_interval_s", "`be_checkpoint_interval_s` must list intervals > 0 s, "
                                                              f"but got {self.be_checkpoint_interval_s!r}.")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_specs(self) -> list[NodeSpec]:
        capacity = Resources(self.cpu_millis_per_node, self.memory_mib_per_node, self.gpus_per_node)
        return [NodeSpec(f"node-{i:03d}", capacity) for i in range(self.nodes)]

    def arrival_rates(self) -> tuple[float, float]:
        """(TE, BE) jobs per second that offer ``load`` with ``te_load_share`` from TE jobs."""
        te_gpu_seconds = _weighted_mean(self.te_gpus) * _log_uniform_mean(*self.te_duration_s)
        be_gpus = sum(r * g * w for r, g, w in self.be_shapes) / sum(w for *_, w in self.be_shapes)
        be_gpu_seconds = be_gpus * _log_uniform_mean(*self.be_duration_s)
        offered = self.load * self.total_gpus
        return offered * self.te_load_share / te_gpu_seconds, offered * (1 - self.te_load_share) / be_gpu_seconds


def generate_workload(config: WorkloadConfig, seed: int) -> list[SimJob]:
    """``config.num_jobs`` jobs in submit order; the same config and seed give the same list."""
    rng = random.Random(seed)
    te_rate, be_rate = config.arrival_rates()
    te_probability = te_rate / (te_rate + be_rate)
    warmup = int(config.num_jobs * config.warmup_fraction)
    jobs: list[SimJob] = []
    now = 0.0
    for i in range(config.num_jobs):
        now += rng.expovariate(te_rate + be_rate)
        if rng.random() < te_probability:
            spec, duration = _te_job(config, rng, f"te-{i:06d}"), _log_uniform(rng, *config.te_duration_s)
        else:
            spec, duration = _be_job(config, rng, f"be-{i:06d}"), _log_uniform(rng, *config.be_duration_s)
        jobs.append(SimJob(spec, now, duration, measured=i >= warmup))
    return jobs


def _te_job(config: WorkloadConfig, rng: random.Random, job_id: str) -> JobSpec:
    gpus = _weighted_choice(rng, config.te_gpus)
    return JobSpec(job_id=job_id, job_class=JobClass.TE, roles={"chief": RoleSpec(1, _per_gpu(gpus))})


def _be_job(config: WorkloadConfig, rng: random.Random, job_id: str) -> JobSpec:
    replicas, gpus = _weighted_choice(rng, [((r, g), w) for r, g, w in config.be_shapes])
    roles = {"chief": RoleSpec(1, _per_gpu(gpus))}
    if replicas > 1:
        roles["worker"] = RoleSpec(replicas - 1, _per_gpu(gpus))
        if rng.random() < config.be_ps_probability:
            roles["ps"] = RoleSpec(2, PS_RESOURCES)
    if rng.random() < config.be_evaluator_probability:
        roles["evaluator"] = RoleSpec(1, EVALUATOR_RESOURCES)
    return JobSpec(job_id=job_id, job_class=JobClass.BE, roles=roles,
                   checkpoint_interval_s=rng.choice(config.be_checkpoint_interval_s),
                   restart_overhead_s=rng.uniform(*config.be_restart_overhead_s))


def _per_gpu(gpus: int) -> Resources:
    return Resources(cpu_millis=gpus * CPU_MILLIS_PER_GPU, memory_mib=gpus * MEMORY_MIB_PER_GPU, gpu=gpus)


def _weighted_choice(rng: random.Random, options: Any) -> Any:
    values, weights = zip(*options, strict=True)
    return rng.choices(values, weights=weights)[0]


def _weighted_mean(options: tuple[tuple[int, float], ...]) -> float:
    return sum(v * w for v, w in options) / sum(w for _, w in options)


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _log_uniform_mean(low: float, high: float) -> float:
    return low if high == low else (high - low) / math.log(high / low)


def _check_fraction(value: Any, name: str, *, upper: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= upper:
        raise InvalidArgument(name, f"`{name}` must be a number in [0, {upper}], but got {value!r}.")
