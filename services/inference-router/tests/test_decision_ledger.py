"""A rollout's decisions written into a real bundle-store by :class:`DecisionLedger`, on the test's event
loop as on the router's: once each, in the model bundle's lineage, with the router's token."""

from __future__ import annotations

import uuid

import pytest
from opml.bundles.v1 import bundles_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import PermissionDenied
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.control.decisions import DECISION_TAG, Decision, DecisionLedger


@pytest.fixture
def bundle_store(start_service: ServiceStarter) -> ServiceProcess:
    return start_service("bundle-store")


async def test_a_decision_is_written_once_into_the_lineage_and_only_with_the_writer_role(
        bundle_store: ServiceProcess) -> None:
    context = f"ledger-{uuid.uuid4().hex[:8]}"
    with BundleStoreClient(bundle_store.target, token=TOKENS["writer"]) as store:
        store.create_context(context)
        model = store.add(context, "m", {"model.onnx": b"onnx"}, commit=True)
    decision = Decision(model="m", version=2, stable=1, context=context, bundle_uuid=model.uuid, kind="promoted",
                        verdict="PROMOTED", step=2, sequence=1, reason="every step passed")
    ledger, reader = (DecisionLedger(bundle_store.target, token=TOKENS["writer"]),
                      DecisionLedger(bundle_store.target, token=TOKENS["reader"]))
    try:
        with pytest.raises(PermissionDenied):
            await reader.write(decision)
        assert await ledger.write(decision) is True
        assert await ledger.write(decision) is False  # a restart writing it again adds nothing
    finally:
        await ledger.close()
        await reader.close()
    with BundleStoreClient(bundle_store.target, token=TOKENS["reader"]) as store:
        (written,) = store.list_bundles(context, bundle_name=decision.bundle_name)
        graph = store.lineage(context, model.uuid, direction=bundles_pb2.GetLineageRequest.DOWNSTREAM)
    assert written.committed and written.tags["rollout.verdict"] == "PROMOTED" and DECISION_TAG in written.tags
    assert {(e.input_uuid, e.output_uuid) for e in graph.edges} == {(model.uuid, written.uuid)}
