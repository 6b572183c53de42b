"""The cluster's capacity: nodes with CPU, memory and GPUs, and what each running job holds on them.

Allocation is all-or-nothing per job (gang scheduling), and every allocation is released exactly as
it was made, so free capacity never drifts. The cluster also answers the question a submit must
answer before a job may wait: could this job ever run here, even on the empty cluster?
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from opml_job_orchestrator.scheduler.model import RESOURCE_DIMENSIONS, JobSpec, Resources, validate_resources

Assignment = tuple[tuple[str, Resources], ...]
"""(node name, resources) per replica of a job: what it holds while it runs."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node and everything it offers to jobs."""

    name: str
    capacity: Resources


class Cluster:
    """Free and total capacity per node, and the allocation of every running job.

    Not thread-safe: the scheduler that owns it serializes every call.
    """

    def __init__(self, nodes: Iterable[NodeSpec]) -> None:
        """Raises InvalidArgument when there is no node, a name repeats or a capacity is negative."""
        nodes = tuple(nodes)
        if not nodes:
            raise InvalidArgument("nodes", "`nodes` must list at least one node, but got none.")
        capacity: dict[str, Resources] = {}
        for i, node in enumerate(nodes):
            if not isinstance(node, NodeSpec) or not isinstance(node.name, str) or not node.name:
                raise InvalidArgument(f"nodes[{i}]", f"`nodes[{i}]` must be a NodeSpec with a non-empty name, "
                                                     f"but got {node!r}.")
            if node.name in capacity:
                raise InvalidArgument(f"nodes[{i}].name", f"node name {node.name!r} appears twice; names "
                                                          "must be unique.")
            capacity[node.name] = validate_resources(node.capacity, f"nodes[{i}].capacity")
        self._nodes = nodes
        self._capacity = capacity
        self._free = dict(capacity)
        self._free_view = MappingProxyType(self._free)
        self._total_capacity = sum(capacity.values(), Resources())
        self._total_free = self._total_capacity
        self._allocations: dict[str, Assignment] = {}

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        return self._nodes

    @property
    def capacity(self) -> Mapping[str, Resources]:
        """Node name to total capacity, in cluster order."""
        return MappingProxyType(self._capacity)

    @property
    def free(self) -> Mapping[str, Resources]:
        """Node name to free capacity, in cluster order: a live read-only view."""
        return self._free_view

    @property
    def total_capacity(self) -> Resources:
        return self._total_capacity

    @property
    def total_free(self) -> Resources:
        return self._total_free

    def allocation(self, job_id: str) -> Assignment | None:
        """What ``job_id`` holds, or None when it holds nothing."""
        return self._allocations.get(job_id)

    def allocate(self, job_id: str, assignment: Sequence[tuple[str, Resources]]) -> None:
        """Take ``assignment`` for ``job_id``, all of it or nothing.

        Raises:
            AlreadyExists: the job already holds an allocation.
            NotFound: a node of the assignment is not in the cluster.
            FailedPrecondition: the assignment does not fit the nodes' free capacity.
        """
        if job_id in self._allocations:
            raise AlreadyExists(f"job {job_id!r} already holds an allocation; release it first.")
        needed: dict[str, Resources] = {}
        for node, resources in assignment:
            if node not in self._free:
                raise NotFound(f"node {node!r} (in the assignment of job {job_id!r}) is not in the cluster.")
            needed[node] = needed.get(node, Resources()) + resources
        for node, resources in needed.items():
            if not resources.fits_in(self._free[node]):
                raise FailedPrecondition(f"job {job_id!r} needs {resources.describe()} on node {node!r}, "
                                         f"which has {self._free[node].describe()} free.")
        for node, resources in needed.items():
            self._free[node] -= resources
            self._total_free -= resources
        self._allocations[job_id] = tuple(assignment)

    def release(self, job_id: str) -> Assignment:
        """Give back everything ``job_id`` holds and return it.

        Raises:
            NotFound: the job holds no allocation.
        """
        assignment = self._allocations.pop(job_id, None)
        if assignment is None:
            raise NotFound(f"job {job_id!r} holds no allocation in the cluster.")
        for node, resources in assignment:
            self._free[node] += resources
            self._total_free += resources
        return assignment

    def check_admissible(self, spec: JobSpec) -> None:
        """Raise InvalidArgument, naming the field path, when ``spec`` asks for more than the cluster has.

        Checks, in order: a replica's amount of one resource against the largest node's
        (``roles.worker.resources.gpu``); a replica against every node with all resources together
        (``roles.worker.resources``); the job's total of one resource against the cluster's
        (``roles.worker.replicas``, naming the role that asks for most of it). Whether the replicas
        can be packed onto the empty cluster is left to the scheduler's placement policy.
        """
        largest = {d: max(getattr(c, d) for c in self._capacity.values()) for d in RESOURCE_DIMENSIONS}
        for role, role_spec in spec.roles.items():
            wanted = role_spec.resources
            for dimension in RESOURCE_DIMENSIONS:
                amount = getattr(wanted, dimension)
                if amount > largest[dimension]:
                    field = f"roles.{role}.resources.{dimension}"
                    raise InvalidArgument(field, f"`{field}` is {amount} per replica, but the largest node has "
                                                 f"{largest[dimension]}; a replica must fit on one node, so ask "
                                                 f"for at most {largest[dimension]} or split the work across "
                                                 "more replicas.")
            if not any(wanted.fits_in(capacity) for capacity in self._capacity.values()):
                field = f"roles.{role}.resources"
                raise InvalidArgument(field, f"`{field}` ({wanted.describe()} per replica) fits no single node: "
                                             "no node has all of it at once.")
        total = spec.total
        for dimension in RESOURCE_DIMENSIONS:
            asked, have = getattr(total, dimension), getattr(self._total_capacity, dimension)
            if asked > have:
                role = max(spec.roles,
                           key=lambda r: getattr(spec.roles[r].resources, dimension) * spec.roles[r].replicas)
                role_spec = spec.roles[role]
                field = f"roles.{role}.replicas"
                raise InvalidArgument(field, f"the job asks for {asked} {dimension} in total ({role_spec.replicas} "
                                             f"{role} replicas x {getattr(role_spec.resources, dimension)} and "
                                             f"the other roles), but the whole cluster has {have}; lower "
                                             f"`{field}` or the {dimension} per replica.")
