"""The monitoring-scorer's windows of a version read back from its API, for a rollout's quality checks:
the source of truth the events on ``opml.quality.v1`` are hints of (see :mod:`.quality`), and the only
place the labels of a window still open can be read."""

from __future__ import annotations

import math

import grpc
from opml.monitoring.v1 import monitoring_pb2, monitoring_pb2_grpc

from opml_common.grpc.client import domain_error, open_aio_channel
from opml_inference_router.control.quality import MAX_WINDOWS, Quality, Window, pooled
from opml_monitoring_scorer_contract.names import version_name


class ScorerWindows:
    """A version's windows read from the monitoring-scorer's API (``ListWindows``, newest first, and
    ``GetModelStatus`` for its task), pooled as :meth:`QualityBook.since` pools the events', with the
    open window's labels so far (``include_open``: its truth, no rows or estimate), which no
    WindowScored announces until it closes.

    On the router's event loop (grpc.aio, one channel kept): a synchronous client's calls from a thread
    beside the process's aio server are a mix gRPC crashed on (SIGSEGV in cygrpc) in a bench process.

    Raises (:meth:`since`): NotFound (the version is not monitored), Unavailable (no scorer)."""

    def __init__(self, target: str, *, token: str | None = None, timeout_s: float = 5.0) -> None:
        self._target = target
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: monitoring_pb2_grpc.MonitoringServiceStub | None = None

    async def since(self, model: str, version: str | int, start_time: float) -> Quality:
        if self._stub is None:
            self._channel = open_aio_channel(self._target)
            self._stub = monitoring_pb2_grpc.MonitoringServiceStub(self._channel)
        name = version_name(model, str(version))
        call = {"metadata": self._metadata, "timeout": self._timeout_s}
        windows: list[Window] = []
        try:
            status = await self._stub.GetModelStatus(monitoring_pb2.GetModelStatusRequest(name=name), **call)
            higher_is_better = status.task != "regression"
            token = ""
            while len(windows) < MAX_WINDOWS:
                reply = await self._stub.ListWindows(monitoring_pb2.ListWindowsRequest(
                    name=name, page_size=200, page_token=token, include_open=True), **call)
                older = False
                for window in reply.windows:
                    # the open window's labels so far (newest: it holds the latest predictions), so the
                    # accuracy check counts labels as they join, not once 1,000 predictions close it
                    last_time = math.inf if window.open else window.last_time.ToNanoseconds() / 1e9
                    if last_time < start_time or len(windows) >= MAX_WINDOWS:
                        older = True
                        break
                    estimate = (window.cbpe if window.HasField("cbpe") else
                                window.mpp if window.HasField("mpp") else None)
                    windows.append(Window(index=window.index, rows=window.rows, last_time=last_time,
                                          estimate=estimate, labelled=window.labelled,
                                          true_value=window.true_value if window.HasField("true_value") else None,
                                          higher_is_better=higher_is_better))
                token = reply.next_page_token
                if older or not token:
                    break
        except grpc.RpcError as error:
            raise domain_error(error) from None
        return pooled(windows)

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()
