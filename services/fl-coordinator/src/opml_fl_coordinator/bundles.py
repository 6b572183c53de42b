"""Publishing a federation's global model to bundle-store: a committed bundle ``fl-{federation}``
holding ``weights.npz`` with lineage (federation, round, clients, strategy, metrics as values and
parameters), and, when the model is a dense classifier, ``model.onnx`` (:mod:`onnx_export`), so
flow 3 (train across plants -> bundle -> served by the inference-router) continues from it."""

from __future__ import annotations

import asyncio
import logging

from opml.bundles.v1 import bundles_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import AlreadyExists, InvalidArgument
from opml_fl_coordinator.federation import Federation, RoundRecord
from opml_fl_coordinator.onnx_export import dense_classifier_onnx, serving_config
from opml_fl_coordinator.weights import to_bytes
from opml_fl_coordinator_contract.weights import Weights

log = logging.getLogger(__name__)


class BundlePublisher:
    """Commits models to bundle-store, through its contract's client."""

    def __init__(self, target: str, *, token: str | None, context: str, serve: bool = False) -> None:
        self.target, self._token, self.context = target, token or None, context
        self.serve = serve  # tag the ONNX bundles serve=true: the inference-router deploys them
        self._context_made = False

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
            try:  # a dense classifier also goes as ONNX, for the inference-router
                files["model.onnx"] = dense_classifier_onnx(weights)
                files["model.yaml"] = serving_config(f"fl-{federation.federation_id}", weights).encode()
            except (ValueError, InvalidArgument) as why:
                log.info("federation %s: model not exported to ONNX (%s)", federation.federation_id, why)
            tags = {"federation": federation.federation_id, "round": str(record.number)}
            if self.serve and "model.onnx" in files:
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
