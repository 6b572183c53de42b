"""Traffic split across the versions of a model: canary, promote, roll back.

Weights are relative (``{"1": 90, "2": 10}`` sends 10% to version 2). A request is assigned at
random, or, with ``sticky=True``, by a hash of its request id, so a client retrying the same
request id always lands on the same version (and A/B comparisons are reproducible).
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Mapping

from opml_common.errors import InvalidArgument

_HASH_SCALE = float(1 << 64)


class TrafficSplit:
    """An immutable assignment of requests to versions by weight."""

    __slots__ = ("weights", "sticky", "_versions", "_cumulative", "_rng")

    def __init__(self, weights: Mapping[str, float], *, sticky: bool = False,
                 rng: random.Random | None = None) -> None:
        """Raises: InvalidArgument (field ``weights``) when a weight is negative or all are zero."""
        if not weights:
            raise InvalidArgument("weights", "must name at least one version, but got none")
        for version, weight in weights.items():
            if not isinstance(weight, (int, float)) or weight < 0:
                raise InvalidArgument(f"weights[{version!r}]", f"must be a number >= 0, but got {weight!r}")
        total = float(sum(weights.values()))
        if total <= 0:
            raise InvalidArgument("weights", f"at least one weight must be > 0, but got {dict(weights)}")
        self.weights = {version: weight / total for version, weight in weights.items() if weight > 0}
        self.sticky = sticky
        self._versions = list(self.weights)
        running, self._cumulative = 0.0, []
        for version in self._versions:
            running += self.weights[version]
            self._cumulative.append(running)
        self._cumulative[-1] = 1.0
        self._rng = rng or random.Random()

    @property
    def only(self) -> str | None:
        """The version that takes all traffic, if one does."""
        return self._versions[0] if len(self._versions) == 1 else None

    def choose(self, request_id: str = "") -> str:
        if len(self._versions) == 1:
            return self._versions[0]
        if self.sticky and request_id:
            point = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") / _HASH_SCALE
        else:
            point = self._rng.random()
        return self._versions[bisect.bisect_right(self._cumulative, point)]
