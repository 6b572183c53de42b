"""The monitoring-scorer's asyncio client (grpc.aio), for a service that calls it from its event loop:
the calls of :class:`~opml_monitoring_scorer_contract.client.MonitoringClient` that services make,
with the same requests and errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

from opml.monitoring.v1 import monitoring_pb2 as pb
from opml.monitoring.v1 import monitoring_pb2_grpc

from opml_common.grpc.client import AsyncServiceClient, async_pages
from opml_monitoring_scorer_contract.names import version_name


class AsyncMonitoringClient(AsyncServiceClient):
    stub_class = monitoring_pb2_grpc.MonitoringServiceStub

    async def status(self, model: str, version: str, *, segment: str = "",
                     timeout: float | None = None) -> pb.ModelStatus:
        """The version's status, or one ``segment``'s of a version monitored per segment; ``timeout``: of
        the call, in seconds (None: none)."""
        return await self.stub.GetModelStatus(pb.GetModelStatusRequest(name=version_name(model, version),
                                                                       segment=segment), timeout=timeout)

    async def windows(self, model: str, version: str, *, page_size: int = 0, segment: str = "",
                      include_open: bool = False, timeout: float | None = None) -> AsyncIterator[pb.Window]:
        """Every window of the version (or of its ``segment``), newest first, page by page (a reader that
        stops early asks for no more); ``include_open``: first the open window's truth so far
        (``Window.open``), when labels joined it; ``timeout``: of each page's call, in seconds."""
        name = version_name(model, version)
        async for window in async_pages(lambda token: self.stub.ListWindows(pb.ListWindowsRequest(
                name=name, page_size=page_size, page_token=token, segment=segment, include_open=include_open),
                timeout=timeout), lambda reply: reply.windows):
            yield window

    async def alerts(self, model: str = "", version: str = "", *, segment: str = "") -> list[pb.Alert]:
        """The alerts of the version (every version's when ``model`` is empty), or of its ``segment``'s rules."""
        name = version_name(model, version) if model else ""
        return [alert async for alert in async_pages(
            lambda token: self.stub.ListAlerts(pb.ListAlertsRequest(name=name, page_token=token, segment=segment)),
            lambda reply: reply.alerts)]
