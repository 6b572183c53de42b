"""Traffic across a model's versions in the router: the first route of a new version (all traffic,
or a canary share), explicit splits, promote, rollback, which versions retire, and the split a
restart restores. The router keeps the split; this module keeps the records in step with it."""

from __future__ import annotations

from collections.abc import Mapping

from opml_common.errors import NotFound
from opml_inference_router.control.state import SERVING, ModelRecord
from opml_inference_router.routing import Router


class Rollout:
    """The traffic decisions of the control plane, over the ``router``."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def percent(self, name: str) -> dict[str, float]:
        """Version -> share of ``name``'s traffic in percent (versions with none left out)."""
        if name not in self.router.models():
            return {}
        weights = self.router.describe(name)["traffic"]
        total = sum(weights.values())
        return {version: 100.0 * weight / total for version, weight in weights.items() if weight > 0} if total else {}

    def route_new(self, record: ModelRecord, number: int, canary_percent: float) -> str:
        """Routes a version that now serves: a canary beside the stable version, or all traffic.
        Returns the cause (``canary`` or ``deploy``)."""
        if canary_percent and record.stable is not None and record.stable != number:
            self.router.start_canary(record.name, str(number), canary_percent)
            return "canary"
        self.router.promote(record.name, str(number))
        return "deploy"

    def set(self, record: ModelRecord, weights: Mapping[str, float]) -> None:
        """Raises: NotFound (a weighted version that does not serve)."""
        serving = {str(entry.version) for entry in record.serving()}
        for version, weight in weights.items():
            if weight > 0 and version not in serving:
                raise NotFound(f"models/{record.name}/versions/{version} does not serve (serving: {sorted(serving)})")
        self.router.set_traffic(record.name, dict(weights))
        stable = self.router.describe(record.name)["stable"]
        record.stable = int(stable) if stable else record.stable

    def promote(self, record: ModelRecord, version: int = 0) -> None:
        """All traffic to ``version`` (0: the canary). Raises: NotFound, FailedPrecondition (no single canary)."""
        if version and (version not in record.versions or record.versions[version].state != SERVING):
            raise NotFound(f"models/{record.name}/versions/{version} does not serve")
        self.router.promote(record.name, str(version) if version else None)

    def rollback(self, record: ModelRecord) -> int:
        """All traffic back to the stable version, which it returns. Raises: FailedPrecondition (none)."""
        return int(self.router.rollback(record.name))

    def retiring(self, record: ModelRecord) -> list[int]:
        """The serving versions that neither the stable one's version policy keeps nor take traffic
        (``record.stable`` follows the router's)."""
        stable = self.router.describe(record.name)["stable"]
        record.stable = int(stable) if stable else None
        serving = [entry.version for entry in record.serving()]
        if record.stable is None or not serving:
            return []
        policy = record.versions[record.stable].config.version_policy  # type: ignore[union-attr]
        keep = policy.keeps(serving) | {record.stable} | {int(v) for v in self.percent(record.name)}
        return [number for number in serving if number not in keep]

    def record_split(self, record: ModelRecord) -> None:
        """Copies the router's split into the record (what the store keeps)."""
        if record.name in self.router.models():
            record.traffic = {v: float(w) for v, w in self.router.describe(record.name)["traffic"].items()}

    def restore(self, record: ModelRecord) -> None:
        """The stored split, with the stored stable version as the router's stable one (a rollback
        after a restart goes where it went before)."""
        name, weights = record.name, {v: w for v, w in record.traffic.items() if w > 0}
        if record.stable is not None:
            self.router.promote(name, str(record.stable))
        others = [v for v in weights if v != str(record.stable)]
        if len(others) == 1 and str(record.stable) in weights:
            self.router.start_canary(name, others[0], 100.0 * weights[others[0]] / sum(weights.values()))
        elif others:
            self.router.set_traffic(name, weights)
