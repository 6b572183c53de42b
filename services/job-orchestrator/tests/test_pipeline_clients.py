"""The pipelines' calls to other services, against the real services: the bundle-store's
(:class:`BundleStoreIO`, what the runner and the span trigger read and write) and the
monitoring-scorer's (:class:`ScorerAlerts`, what the alert trigger asks), on the test's event loop
as on the service's, with the tokens the service is given."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from opml.bundles.v1 import bundles_pb2

from opml_common.errors import NotFound, PermissionDenied, Unauthenticated
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_job_orchestrator.pipelines.bundles import BundleStoreIO, output_tags
from opml_job_orchestrator.pipelines.triggers import ScorerAlerts


@pytest.fixture
def bundle_store(start_service: ServiceStarter) -> ServiceProcess:
    return start_service("bundle-store")


@pytest.fixture
def monitoring_scorer(start_service: ServiceStarter, bundle_store: ServiceProcess) -> ServiceProcess:
    return start_service("monitoring-scorer", extra_env={"OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": bundle_store.target})


async def test_bundles_are_added_found_read_and_downloaded(bundle_store: ServiceProcess, tmp_path: Path) -> None:
    context = f"pipelines-{uuid.uuid4().hex[:8]}"
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(3 * 1024 * 1024 + 5))  # several chunks each way
    tags = output_tags("quality", 1, "train", "model")
    bundles = BundleStoreIO(bundle_store.target, token=TOKENS["writer"])
    try:
        assert await bundles.list_committed(context) == []  # an unknown context has none
        assert await bundles.find(context, tags) is None
        first = await bundles.add(context, "model", {"weights.bin": weights, "conf/model.yaml": b"name: m\n"},
                                  values={"accuracy": 0.9}, tags=tags, lineage=bundles_pb2.Lineage())
        second = await bundles.add(context, "model", {"conf/model.yaml": b"name: m2\n"}, tags=tags,
                                   lineage=bundles_pb2.Lineage())  # the context is there now
        assert first.committed and second.committed
        assert (await bundles.find(context, tags)).uuid == second.uuid  # the newest
        assert {b.uuid for b in await bundles.list_committed(context, "model")} == {first.uuid, second.uuid}
        assert (await bundles.get(context, first.uuid)).content_hash == first.content_hash
        await bundles.download(context, first.uuid, tmp_path / "out")
        assert (tmp_path / "out" / "weights.bin").read_bytes() == weights.read_bytes()
        assert (tmp_path / "out" / "conf" / "model.yaml").read_bytes() == b"name: m\n"
        with pytest.raises(NotFound):
            await bundles.get(context, str(uuid.uuid4()))
    finally:
        await bundles.aclose()


@pytest.mark.parametrize(("token", "error"), [(TOKENS["reader"], PermissionDenied), (None, Unauthenticated)])
async def test_bundle_calls_carry_the_service_token(bundle_store: ServiceProcess, token: str | None,
                                                    error: type[Exception]) -> None:
    bundles = BundleStoreIO(bundle_store.target, token=token)
    try:
        with pytest.raises(error):
            await bundles.add(f"pipelines-{uuid.uuid4().hex[:8]}", "model", {"a": b"x"}, tags={"pipeline": "p"},
                              lineage=bundles_pb2.Lineage())
    finally:
        await bundles.aclose()


async def test_the_alerts_of_a_version_the_scorer_does_not_monitor_are_not_found(
        monitoring_scorer: ServiceProcess) -> None:
    """What the alert trigger takes for "nothing fires"; a call without the token is refused."""
    alerts, anonymous = (ScorerAlerts(monitoring_scorer.target, token=TOKENS["reader"]),
                         ScorerAlerts(monitoring_scorer.target))
    try:
        with pytest.raises(NotFound):
            await alerts.alerts("unmonitored", "1")
        with pytest.raises(Unauthenticated):
            await anonymous.alerts("unmonitored", "1")
    finally:
        await alerts.aclose()
        await anonymous.aclose()
