"""The monitoring-scorer's asyncio client (grpc.aio), for a service that calls it from its event loop:
the calls of :class:`~opml_monitoring_scorer_contract.client.MonitoringClient` that services make,
with the same requests and errors."""

from __future__ import annotations

from opml.monitoring.v1 import monitoring_pb2 as pb
from opml.monitoring.v1 import monitoring_pb2_grpc

from opml_common.grpc.client import AsyncServiceClient, async_pages
from opml_monitoring_scorer_contract.names import version_name


class AsyncMonitoringClient(AsyncServiceClient):
    stub_class = monitoring_pb2_grpc.MonitoringServiceStub

    async def alerts(self, model: str = "", version: str = "", *, segment: str = "") -> list[pb.Alert]:
        """The alerts of the version (every version's when ``model`` is empty), or of its ``segment``'s rules."""
        name = version_name(model, version) if model else ""
        return [alert async for alert in async_pages(
            lambda token: self.stub.ListAlerts(pb.ListAlertsRequest(name=name, page_token=token, segment=segment)),
            lambda reply: reply.alerts)]
