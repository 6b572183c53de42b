"""Publishing a federation's global model to bundle-store: a committed bundle ``fl-{federation}``
holding ``weights.npz`` with lineage (federation, round, clients, strategy, metrics as values and
parameters), and, when the model is a dense classifier, ``model.onnx`` (:mod:`onnx_export`) with its
``model.yaml``, default ``monitoring.yaml`` (:mod:`monitoring`) and, when the federation names a
holdout, ``reference.npz`` (:mod:`holdout`), so flow 3 (train across plants -> bundle -> served by the
inference-router -> monitored) continues from it. A federation's ``serve``
(else the service's SERVE_MODELS) tags the ONNX bundles serve=true: the router deploys them."""

from __future__ import annotations

import asyncio
import logging

from opml.bundles.v1 import bundles_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import AlreadyExists, InvalidArgument, OpmlError
from opml_fl_coordinator.config import HoldoutRef
from opml_fl_coordinator.federation import Federation, RoundRecord
from opml_fl_coordinator.holdout import HOLDOUT_FILE, MAX_HOLDOUT_BYTES, Holdout, evaluate
from opml_fl_coordinator.monitoring import monitoring_config
from opml_fl_coordinator.onnx_export import dense_classifier_onnx, serving_config
from opml_fl_coordinator.weights import to_bytes
from opml_fl_coordinator_contract.weights import Weights
from opml_monitoring_scorer_contract.reference import MONITORING_FILE, REFERENCE_FILE

log = logging.getLogger(__name__)


class BundlePublisher:
    """Commits models to bundle-store, through its contract's client."""

    def __init__(self, target: str, *, token: str | None, context: str, serve: bool = False) -> None:
        self.target, self._token, self.context = target, token or None, context
        self.serve = serve  # for federations whose config does not say
        self._context_made = False
        self._holdouts: dict[tuple[str, str], Holdout] = {}  # (context, bundle uuid) -> parsed

    def _holdout(self, client: BundleStoreClient, ref: HoldoutRef) -> Holdout:
        """The held-out set, re-resolved at each publish (a name moves to its newest version), parsed
        once per version and bounded while it is read.

        Raises: InvalidArgument (the file), NotFound (the bundle or its file), OpmlError (the store)."""
        bundle = client.get_bundle(ref.context, ref.bundle)
        key = (ref.context, bundle.uuid)
        if key not in self._holdouts:
            data = bytearray()
            for chunk in client.read_file(ref.context, bundle.uuid, HOLDOUT_FILE):
                data += chunk
                if len(data) > MAX_HOLDOUT_BYTES:
                    raise InvalidArgument(f"holdout.{HOLDOUT_FILE}", f"holds more than {MAX_HOLDOUT_BYTES} bytes")
            self._holdouts = {key: Holdout.parse(bytes(data))}  # the newest only: a federation names one
        return self._holdouts[key]

    def _publish(self, federation: Federation, record: RoundRecord, weights: Weights, parent: str) -> str:
        with BundleStoreClient(self.target, token=self._token) as client:
            if not self._context_made:
                try:
                    client.create_context(self.context)
                except AlreadyExists:
                    pass
                self._context_made = True
            strategy = federation.config.strategy
            lineage = bundles_pb2.Lineage(creator="fl-coordinator", input_uuids=[parent] if parent else [], parameters={
                "federation": federation.federation_id, "round": str(record.number),
                "strategy": strategy.name, "selection": federation.config.selection.policy,
                "mode": federation.config.mode, "clients": ",".join(record.participants)})
            values = {"round": record.number, "federation": federation.federation_id,
                      **{f"metrics.{k}": float(v) for k, v in record.metrics.items()}}
            files = {"weights.npz": to_bytes(weights)}
            serve = self.serve if federation.config.serve is None else federation.config.serve
            activation = federation.config.model.hidden_activation
            try:  # a dense classifier also goes as ONNX, for the inference-router
                exported = {  # all or none: a model.onnx without its model.yaml is not served
                    "model.onnx": dense_classifier_onnx(weights, hidden_activation=activation),
                    "model.yaml": serving_config(f"fl-{federation.federation_id}", weights).encode()}
            except (ValueError, InvalidArgument) as why:
                exported = {}
                log.log(logging.WARNING if serve else logging.INFO, "federation %s: model not exported to "
                        "ONNX, so not served (%s)", federation.federation_id, why)
            if exported:
                accuracy, reference_rows = None, None
                if federation.config.holdout is not None:
                    try:
                        holdout = self._holdout(client, federation.config.holdout)
                        result = evaluate(holdout, weights, hidden_activation=activation)
                    except OpmlError as why:  # the model still goes out, monitored against its first window
                        log.warning("federation %s: no reference set from the holdout (%s)",
                                    federation.federation_id, why)
                    else:
                        accuracy, reference_rows = result.accuracy, len(holdout.x)
                        exported[REFERENCE_FILE] = result.reference
                        values["holdout.accuracy"] = accuracy
                exported[MONITORING_FILE] = monitoring_config(
                    columns=weights[0].shape[0], reference_rows=reference_rows, holdout_accuracy=accuracy).encode()
                files.update(exported)
            tags = {"federation": federation.federation_id, "round": str(record.number)}
            if serve and "model.onnx" in files:
                tags["serve"] = "true"
            bundle = client.add(self.context, f"fl-{federation.federation_id}", files, values=values, tags=tags,
                                lineage=lineage, commit=True)
        return f"{self.context}/{bundle.bundle_name}@{bundle.uuid}"

    async def publish(self, federation: Federation, record: RoundRecord, weights: Weights, *, parent: str = "") -> str:
        """Commit ``weights`` (the model after ``record``), with ``parent`` (the uuid of the model
        it was trained from, when published) as its lineage input; returns ``context/name@uuid``.

        Raises:
            OpmlError: bundle-store refused or could not be reached.
        """
        return await asyncio.to_thread(self._publish, federation, record, weights, parent)
