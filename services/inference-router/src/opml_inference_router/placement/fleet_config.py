"""The router's fleet configuration: what a fleet offers (``FleetConfig``: pool kinds and pools), and
the identity of what placement puts on it (``ModelVersion``).

Pool kinds are declared by their capabilities (precisions, memory, model slots, cost, ONNX Runtime
execution provider, fixed batch shapes), so a new kind of worker is configuration, not code. What a
model needs (``ModelConfig``, a bundle's ``model.yaml``) is the router's contract
(:mod:`opml_inference_router_contract.model_config`), since model producers write it; the fleet file
is the router's alone, parsed with the same rules and limits. A proto version of these schemas will
mirror the field names and defaults documented here.

Every loader raises :class:`~opml_common.errors.InvalidArgument` whose field is the path of the
offending value (``pool_kinds[2].slots``) and whose message states the rule and shows the value;
unknown fields and unknown enum values are refused, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import Field, StrictFloat, StrictInt, StrictStr, field_validator, model_validator

from opml_common.errors import InvalidArgument, brief
from opml_inference_router_contract.model_config import (
    KindName,
    PositiveInt,
    Precision,
    RuleError,
    Schema,
    read_document,
    unique,
    validate,
)

LOCAL_SITE = "local"
"""The router's own site: its pools' workers are processes the router starts."""

_EXECUTION_PROVIDER = r"^[A-Z][A-Za-z0-9]*ExecutionProvider$"


# ----------------------------------------------------------------------------------------------
# Fleet configuration


class PoolKind(Schema):
    """A kind of worker, declared by what it can do. Every worker of a kind is alike."""

    name: KindName
    precisions: tuple[Precision, ...] = Field(min_length=1, description="Precisions the hardware runs. Required.")
    memory_mib: PositiveInt = Field(description="Memory of one worker for model replicas. Required.")
    slots: PositiveInt = Field(
        description="Model replicas one worker can host, each on its own isolated share "
        "(cores, a GPU partition, an accelerator context). Required."
    )
    cost_per_hour: StrictFloat = Field(gt=0, description="Cost of one worker per hour. Required.")
    execution_provider: Annotated[StrictStr, Field(pattern=_EXECUTION_PROVIDER)] = Field(
        description="ONNX Runtime execution provider, e.g. CPUExecutionProvider. Required."
    )
    batch_sizes: tuple[PositiveInt, ...] = Field(
        (), description="Fixed batch shapes the hardware runs (a batch is padded up to one); () : any size. Default ()."
    )

    @field_validator("precisions")
    @classmethod
    def _precisions_unique(cls, precisions: tuple[str, ...]) -> tuple[str, ...]:
        unique(precisions, "precisions")
        return precisions

    @field_validator("batch_sizes")
    @classmethod
    def _batch_sizes_ascending(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        for index in range(1, len(sizes)):
            if sizes[index] <= sizes[index - 1]:
                raise RuleError([index], f"must be strictly ascending, but {sizes[index]} follows {sizes[index - 1]}")
        return sizes

    @property
    def slot_cost_per_hour(self) -> float:
        """What one replica costs: its share of the worker."""
        return self.cost_per_hour / self.slots

    def padded_batch(self, size: int) -> int:
        """The batch shape a batch of ``size`` runs as (itself when the kind has no fixed shapes).

        Raises:
            InvalidArgument: ``size`` exceeds the kind's largest fixed shape.
        """
        if not self.batch_sizes:
            return size
        for shape in self.batch_sizes:
            if shape >= size:
                return shape
        raise InvalidArgument(
            "batch_size", f"{self.name} runs batches of at most {self.batch_sizes[-1]}, but got {size}"
        )


class PoolConfig(Schema):
    """A group of identical workers of one kind. A ``gpu`` pool exists only where GPUs do."""

    name: KindName
    kind: KindName
    workers: StrictInt = Field(ge=0, description="Number of workers. Required.")
    site: KindName = Field(LOCAL_SITE, description="Where the workers are: ``local`` (the router's machine, whose "
                           "processes the router starts), or a site whose host agents register into the pool "
                           "(:mod:`opml_inference_router.hosts`). Default local.")


class FleetConfig(Schema):
    """The pool kinds a deployment knows and the pools of workers it has."""

    pool_kinds: tuple[PoolKind, ...] = Field(min_length=1)
    pools: tuple[PoolConfig, ...] = Field(min_length=1)
    min_replicas: StrictInt = Field(
        2, ge=1, description="Fewest replicas of each model version whose config sets no min_replicas, on distinct "
        "workers while slots allow (DLIS's N+1). 1: as many as the load needs. Default 2.")

    @field_validator("pool_kinds")
    @classmethod
    def _kind_names_unique(cls, kinds: tuple[PoolKind, ...]) -> tuple[PoolKind, ...]:
        for index, kind in enumerate(kinds):
            if any(other.name == kind.name for other in kinds[:index]):
                raise RuleError([index, "name"],
                                f"pool kind names must be unique, but {brief(kind.name)} appears twice")
        return kinds

    @model_validator(mode="after")
    def _pools_valid(self) -> Self:
        known = [kind.name for kind in self.pool_kinds]
        for index, pool in enumerate(self.pools):
            if pool.kind not in known:
                raise RuleError(["pools", index, "kind"], f"must be a declared pool kind ({', '.join(known)}), "
                                                          f"but got {brief(pool.kind)}")
            if any(other.name == pool.name for other in self.pools[:index]):
                raise RuleError(["pools", index, "name"],
                                f"pool names must be unique, but {brief(pool.name)} appears twice")
        return self

    @classmethod
    def from_dict(cls, data: Any) -> FleetConfig:
        """Raises: InvalidArgument naming the path of the first bad field."""
        return validate(cls, data)


# ----------------------------------------------------------------------------------------------
# Identity of what is placed


@dataclass(frozen=True, order=True)
class ModelVersion:
    """One served version of a model: the unit placement sizes and places."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"models/{self.name}/versions/{self.version}"


# ----------------------------------------------------------------------------------------------
# Loading


def load_fleet_config(path: str | Path) -> FleetConfig:
    """Reads pool kinds and pools from a YAML or JSON file.

    Raises:
        NotFound: the file does not exist.
        InvalidArgument: the file is not YAML/JSON, or a field breaks a rule (field = its path).
    """
    return FleetConfig.from_dict(read_document(Path(path)))
