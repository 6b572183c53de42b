"""Profiles: what one replica of a model version does on one pool kind, measured when it is deployed.

On deploy the model is run on each allowed pool kind at a ladder of batch sizes; the mean latency
of one batch per size and the replica's memory become a :class:`Profile`. Profiles are stored (as
JSON, :meth:`ProfileBook.to_dict`) and drive placement; the latency model turns them into p99 at a
rate. When a replica's measured latency departs from its profile, re-placement scales the profile
(:meth:`Profile.scaled`) instead of trusting the stale numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from opml_common.errors import AlreadyExists, InvalidArgument
from opml_inference_router.placement.fleet_config import ModelVersion
from opml_inference_router_contract.model_config import PRECISIONS, Precision


@dataclass(frozen=True)
class Profile:
    """Measured cost of one replica of ``model`` on ``pool_kind`` in ``precision``.

    ``batch_latency_ms`` maps a batch size to the mean time one replica takes to run one batch of
    that size (sizes between measured ones are interpolated linearly; larger ones are refused).
    ``memory_mib`` is the replica's resident memory at its largest batch.

    Raises (on construction):
        InvalidArgument: no batch sizes, a size < 1, a latency that is not positive and finite or
            that falls as the batch grows, or memory that is not positive.
    """

    model: ModelVersion
    pool_kind: str
    precision: Precision
    batch_latency_ms: Mapping[int, float]
    memory_mib: float
    _sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InvalidArgument("precision", f"must be one of {', '.join(PRECISIONS)}, but got {self.precision!r}")
        if not self.batch_latency_ms:
            raise InvalidArgument("batch_latency_ms", "must hold at least one measured batch size, but is empty")
        sizes = tuple(sorted(self.batch_latency_ms))
        previous = 0.0
        for size in sizes:
            latency = self.batch_latency_ms[size]
            if not isinstance(size, int) or size < 1:
                raise InvalidArgument(f"batch_latency_ms[{size!r}]",
                                      f"batch size must be an int >= 1, but got {size!r}")
            if not (isinstance(latency, int | float) and math.isfinite(latency) and latency > 0):
                raise InvalidArgument(f"batch_latency_ms[{size}]",
                                      f"must be a positive number of ms, but got {latency!r}")
            if latency < previous:
                raise InvalidArgument(
                    f"batch_latency_ms[{size}]",
                    f"must not be below the latency of a smaller batch ({previous} ms), but got {latency}",
                )
            previous = latency
        if not (math.isfinite(self.memory_mib) and self.memory_mib > 0):
            raise InvalidArgument("memory_mib", f"must be a positive number of MiB, but got {self.memory_mib!r}")
        table = {size: float(self.batch_latency_ms[size]) for size in sizes}
        object.__setattr__(self, "batch_latency_ms", MappingProxyType(table))
        object.__setattr__(self, "_sizes", sizes)

    @property
    def max_batch(self) -> int:
        """The largest measured batch size."""
        return self._sizes[-1]

    def latency_ms(self, batch: int | float) -> float:
        """Mean time of one batch of ``batch`` requests (interpolated between measured sizes).

        Raises:
            InvalidArgument: ``batch`` is below 1 or above the largest measured size.
        """
        sizes, table = self._sizes, self.batch_latency_ms
        if batch < 1 or batch > sizes[-1]:
            raise InvalidArgument("batch", f"must be within 1..{sizes[-1]} (the measured sizes), but got {batch}")
        if batch <= sizes[0]:
            return table[sizes[0]]
        for low, high in zip(sizes, sizes[1:]):
            if batch <= high:
                return table[low] + (table[high] - table[low]) * (batch - low) / (high - low)
        return table[sizes[-1]]

    def scaled(self, factor: float) -> Profile:
        """This profile with every latency multiplied by ``factor`` (a calibration from measurements).

        Raises:
            InvalidArgument: ``factor`` is not positive and finite.
        """
        if not (math.isfinite(factor) and factor > 0):
            raise InvalidArgument("factor", f"must be a positive finite number, but got {factor!r}")
        return Profile(self.model, self.pool_kind, self.precision,
                       {size: ms * factor for size, ms in self.batch_latency_ms.items()}, self.memory_mib)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "version": self.model.version,
            "pool_kind": self.pool_kind,
            "precision": self.precision,
            "batch_latency_ms": {str(size): ms for size, ms in self.batch_latency_ms.items()},
            "memory_mib": self.memory_mib,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """Raises: InvalidArgument for a missing or malformed field."""
        try:
            latencies = {int(size): float(ms) for size, ms in data["batch_latency_ms"].items()}
            return cls(ModelVersion(str(data["model"]), int(data["version"])), str(data["pool_kind"]),
                       data["precision"], latencies, float(data["memory_mib"]))
        except KeyError as missing:
            raise InvalidArgument(str(missing.args[0]), "is required") from None
        except (TypeError, ValueError, AttributeError) as error:
            raise InvalidArgument("profile", f"is malformed: {error}") from None


class ProfileBook:
    """The stored profiles, one per (model version, pool kind)."""

    def __init__(self, profiles: Iterable[Profile] = ()) -> None:
        self._profiles: dict[tuple[ModelVersion, str], Profile] = {}
        for profile in profiles:
            self.add(profile)

    def add(self, profile: Profile, *, replace: bool = False) -> None:
        """Stores ``profile``; ``replace=True`` overwrites one already stored (a re-profile or a calibration).

        Raises:
            AlreadyExists: a profile for the same model version and pool kind is stored and not ``replace``.
        """
        key = (profile.model, profile.pool_kind)
        if key in self._profiles and not replace:
            raise AlreadyExists(f"a profile of {profile.model} on pool kind {profile.pool_kind!r} is already stored")
        self._profiles[key] = profile

    def get(self, model: ModelVersion, pool_kind: str) -> Profile | None:
        return self._profiles.get((model, pool_kind))

    def __iter__(self) -> Iterator[Profile]:
        return iter(self._profiles.values())

    def __len__(self) -> int:
        return len(self._profiles)

    def to_dict(self) -> dict[str, Any]:
        return {"profiles": [profile.to_dict() for profile in self]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProfileBook:
        """Raises: InvalidArgument for a malformed profile; AlreadyExists for a duplicate."""
        return cls(Profile.from_dict(item) for item in data.get("profiles", ()))
