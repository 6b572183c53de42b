"""Jobs as the scheduler sees them: resources, roles with replicas, class, priority, checkpointing.

A job (after LinkedIn's TonY) is a distributed TensorFlow program: each role (chief, worker, ps,
evaluator) runs ``replicas`` copies, each copy needs ``resources`` on one node, and all copies start
together (gang scheduling). The class says who waits on the job (Yabuuchi et al., OpML '19):
trial-and-error (TE) jobs are small experiments a person watches; best-effort (BE) jobs are long
runs that may be preempted and resumed from their last checkpoint.

Specs check themselves when built and raise :class:`~opml_common.errors.InvalidArgument` naming the
field path (``roles.worker.replicas``), showing the value and stating the rule, so the gRPC layer
can pass the message on as it is.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from types import MappingProxyType
from typing import Any, NamedTuple

from opml_common.errors import InvalidArgument
from opml_job_orchestrator_contract.jobspec import ROLE_NAMES, SINGLE_REPLICA_ROLES

_JOB_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")


class JobClass(enum.Enum):
    """Who waits on a job, which decides how the TE/BE policies treat it."""

    TE = "te"
    """Trial-and-error: short, a person watches it; scheduled first and never preempted."""
    BE = "be"
    """Best-effort: long, checkpoints; may be preempted for TE jobs and resumed later."""


@dataclass(frozen=True, slots=True)
class Resources:
    """An amount of every schedulable resource: CPU in millicores, memory in MiB, whole GPUs.

    Integers, so capacity accounting adds and subtracts exactly.
    """

    cpu_millis: int = 0
    memory_mib: int = 0
    gpu: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.cpu_millis + other.cpu_millis, self.memory_mib + other.memory_mib,
                         self.gpu + other.gpu)

    def __sub__(self, other: Resources) -> Resources:
        return Resources(self.cpu_millis - other.cpu_millis, self.memory_mib - other.memory_mib,
                         self.gpu - other.gpu)

    def __mul__(self, factor: int) -> Resources:
        return Resources(self.cpu_millis * factor, self.memory_mib * factor, self.gpu * factor)

    def fits_in(self, available: Resources) -> bool:
        """True when every amount is at most the one in ``available``."""
        return (self.gpu <= available.gpu and self.cpu_millis <= available.cpu_millis
                and self.memory_mib <= available.memory_mib)

    def is_zero(self) -> bool:
        return self.cpu_millis == 0 and self.memory_mib == 0 and self.gpu == 0

    def describe(self) -> str:
        """``8 gpu, 32000 cpu_millis, 262144 memory_mib``: for messages."""
        return f"{self.gpu} gpu, {self.cpu_millis} cpu_millis, {self.memory_mib} memory_mib"


RESOURCE_DIMENSIONS = tuple(f.name for f in fields(Resources))


def validate_resources(value: Any, field: str) -> Resources:
    """Raise InvalidArgument unless ``value`` is Resources of non-negative integers."""
    if not isinstance(value, Resources):
        raise InvalidArgument(field, f"`{field}` must be Resources, but got {_short(value)}.")
    for dimension in RESOURCE_DIMENSIONS:
        amount = getattr(value, dimension)
        if not isinstance(amount, int) or isinstance(amount, bool) or amount < 0:
            raise InvalidArgument(f"{field}.{dimension}",
                                  f"`{field}.{dimension}` must be an integer >= 0, but got {_short(amount)}.")
    return value


@dataclass(frozen=True, slots=True)
class RoleSpec:
    """``replicas`` copies of one role, each needing ``resources`` on a single node."""

    replicas: int
    resources: Resources


class Replica(NamedTuple):
    """One copy of a role: what a placement assigns to a node."""

    role: str
    index: int
    resources: Resources


@dataclass(frozen=True)
class JobSpec:
    """What a user submits. Immutable; checked when built.

    ``checkpoint_interval_s`` is how often the job saves a checkpoint while it makes progress (None:
    it never does, so stopping it loses the whole run). ``restart_overhead_s`` is what a resumed run
    spends before it makes progress again (placement, image pull, restoring the checkpoint); the
    scheduler counts it in a victim's resume cost. ``priority`` orders jobs within a class (higher
    first) under the TE/BE policies.
    """

    job_id: str
    job_class: JobClass
    roles: Mapping[str, RoleSpec]
    priority: int = 0
    checkpoint_interval_s: float | None = None
    restart_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not _JOB_ID.fullmatch(self.job_id):
            raise InvalidArgument("job_id", "`job_id` must match [a-z0-9][a-z0-9._-]{0,127}, "
                                            f"but got {_short(self.job_id)}.")
        if not isinstance(self.job_class, JobClass):
            raise InvalidArgument("job_class", f"`job_class` must be one of {[c.name for c in JobClass]}, "
                                               f"but got {_short(self.job_class)}.")
        object.__setattr__(self, "roles", MappingProxyType(_validated_roles(self.roles)))
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidArgument("priority", f"`priority` must be an integer, but got {_short(self.priority)}.")
        interval = self.checkpoint_interval_s
        if interval is not None and not (_is_number(interval) and 0 < interval < math.inf):
            raise InvalidArgument("checkpoint_interval_s", "`checkpoint_interval_s` must be a finite number of "
                                  f"seconds > 0, or None when the job never checkpoints, but got {_short(interval)}.")
        overhead = self.restart_overhead_s
        if not (_is_number(overhead) and 0 <= overhead < math.inf):
            raise InvalidArgument("restart_overhead_s", "`restart_overhead_s` must be a finite number of seconds "
                                  f">= 0, but got {_short(overhead)}.")

    @cached_property
    def replicas(self) -> tuple[Replica, ...]:
        """Every replica of every role, roles in ROLE_NAMES order."""
        return tuple(Replica(role, index, spec.resources)
                     for role, spec in self.roles.items() for index in range(spec.replicas))

    @cached_property
    def total(self) -> Resources:
        """What the whole job holds while it runs."""
        total = Resources()
        for spec in self.roles.values():
            total += spec.resources * spec.replicas
        return total

    @cached_property
    def shape(self) -> tuple[tuple[int, int, int], ...]:
        """The replicas' resources as a sorted tuple: jobs of equal shape fit or fail alike."""
        return tuple(sorted((r.resources.gpu, r.resources.cpu_millis, r.resources.memory_mib)
                            for r in self.replicas))


def _validated_roles(roles: Any) -> dict[str, RoleSpec]:
    if not isinstance(roles, Mapping) or not roles:
        raise InvalidArgument("roles", f"`roles` must map at least one of {list(ROLE_NAMES)} to a RoleSpec, "
                                       f"but got {_short(roles)}.")
    for name in roles:
        if name not in ROLE_NAMES:
            raise InvalidArgument(f"roles.{name}", f"role {_short(name)} is not one of {list(ROLE_NAMES)}.")
    for name, spec in roles.items():
        field = f"roles.{name}"
        if not isinstance(spec, RoleSpec):
            raise InvalidArgument(field, f"`{field}` must be a RoleSpec, but got {_short(spec)}.")
        limit = 1 if name in SINGLE_REPLICA_ROLES else None
        replicas = spec.replicas
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1 or (
                limit is not None and replicas > limit):
            rule = "must be 1 (TensorFlow runs one per job)" if limit else "must be an integer >= 1"
            raise InvalidArgument(f"{field}.replicas", f"`{field}.replicas` {rule}, but got {_short(replicas)}.")
        resources = validate_resources(spec.resources, f"{field}.resources")
        if resources.is_zero():
            raise InvalidArgument(f"{field}.resources", f"`{field}.resources` must request some CPU, memory or "
                                                        "GPU, but every amount is 0.")
    return {name: roles[name] for name in ROLE_NAMES if name in roles}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
