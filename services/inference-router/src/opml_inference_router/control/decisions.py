"""A rollout's decisions in the deployed bundle's lineage: each analysis measurement that counted
(PASSED, FAILED) or stopped the rollout (INCONCLUSIVE past its limit), and the outcome (PROMOTED,
ABORTED), each a small committed bundle in the model bundle's context whose lineage input is the model
bundle, so ``opml bundle lineage MODEL_BUNDLE`` lists them downstream, named for what they say
(``{model}.v{version}.rollout.01.step1.passed``, ``{model}.v{version}.rollout.03.promoted``), and
``opml bundle cat`` shows the evidence: values (verdict, reason, each check's value, stable value,
bound and counts) and ``decision.json`` (the whole decision).

Written only through the bundle-store's contract client (its asyncio one, on the router's event loop: a
blocking client on worker threads beside the router's grpc.aio server is a mix gRPC has crashed on).
Idempotent: each decision has a stable id
(model, version and its number in the rollout) carried as the tag ``rollout.decision``; a decision the
store already holds is not added again, so a router that restarts and writes its pending decisions
again adds each once. A version deployed from a directory (no bundle) has no lineage to write to.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import asdict, dataclass, field

from opml.bundles.v1 import bundles_pb2

from opml_bundle_store_contract.aioclient import AsyncBundleStoreClient

log = logging.getLogger(__name__)

DECISION_TAG = "rollout.decision"
"""The tag holding a decision's id (what makes a second write of it a no-op)."""
DECISION_FILE = "decision.json"
MAX_NAME = 128


@dataclass(frozen=True)
class Decision:
    """One decision of a rollout, with its evidence (``checks``: each CheckResult as a dict)."""

    model: str
    version: int
    stable: int
    context: str
    bundle_uuid: str
    kind: str                 # analysis, promoted, aborted
    verdict: str              # PASSED, FAILED, INCONCLUSIVE for an analysis; PROMOTED, ABORTED
    step: int
    sequence: int             # the rollout's decisions so far, this one included (1, 2, ...)
    measurement: int = 0      # measurements the analysis took
    reason: str = ""
    checks: list[dict] = field(default_factory=list)
    time: float = 0.0

    @property
    def id(self) -> str:
        return f"models/{self.model}/versions/{self.version}/rollout/decisions/{self.sequence}"

    @property
    def bundle_name(self) -> str:
        what = f"step{self.step}.{self.verdict.lower()}" if self.kind == "analysis" else self.kind
        name = f"{self.model}.v{self.version}.rollout.{self.sequence:02d}.{what}"
        return name if len(name) <= MAX_NAME else f"rollout.{uuid.uuid5(uuid.NAMESPACE_URL, self.id).hex}"

    def to_dict(self) -> dict:
        return asdict(self)


class DecisionLedger:
    """Writes decisions to the bundle-store at ``target`` (``token``: needs the writer role), on one
    channel opened on the event loop of the first write; :meth:`close` once the writers have stopped."""

    def __init__(self, target: str, *, token: str | None = None) -> None:
        self._target = target
        self._token = token
        self._client: AsyncBundleStoreClient | None = None

    async def write(self, decision: Decision) -> bool:
        """Adds the decision's bundle unless the store holds it; whether it was added.

        Raises: what the client raises (Unavailable: retry later; PermissionDenied, NotFound...)."""
        if self._client is None:
            self._client = AsyncBundleStoreClient(self._target, token=self._token)
        client, decision_id = self._client, str(uuid.uuid5(uuid.NAMESPACE_URL, decision.id))
        if await client.list_bundles(decision.context, bundle_name=decision.bundle_name,
                                     tags={DECISION_TAG: decision_id}):
            return False
        await client.add(decision.context, decision.bundle_name,
                         {DECISION_FILE: json.dumps(decision.to_dict(), indent=2, sort_keys=True).encode()},
                         values=_values(decision), tags={DECISION_TAG: decision_id, "rollout.model": decision.model,
                                                         "rollout.verdict": decision.verdict},
                         lineage=bundles_pb2.Lineage(input_uuids=[decision.bundle_uuid], parameters={
                             "model": decision.model, "version": str(decision.version),
                             "stable_version": str(decision.stable), "step": str(decision.step),
                             "decision": decision.kind}),
                         media_types={DECISION_FILE: "application/json"}, commit=True)
        log.info("models/%s: rollout decision %s recorded in the lineage of bundle %s", decision.model,
                 decision.bundle_name, decision.bundle_uuid)
        return True

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()


def _values(decision: Decision) -> dict[str, object]:
    values: dict[str, object] = {"verdict": decision.verdict, "reason": decision.reason, "step": decision.step,
                                 "version": decision.version, "stable_version": decision.stable}
    if decision.kind == "analysis":
        values["measurement"] = decision.measurement
    for check in decision.checks:
        name = check["check"]
        values[f"{name}.verdict"] = check["verdict"]
        for key in ("new_value", "stable_value", "bound"):
            values[f"{name}.{key}"] = float(check[key])
        for key in ("new_requests", "stable_requests"):
            values[f"{name}.{key}"] = int(check[key])
    return values
