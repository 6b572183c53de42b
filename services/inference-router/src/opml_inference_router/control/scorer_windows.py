"""The monitoring-scorer's windows of a version read back from its API, for a rollout's quality checks:
the source of truth the events on ``opml.quality.v1`` are hints of (see :mod:`.quality`), and the only
place the labels of a window still open can be read."""

from __future__ import annotations

import math
from contextlib import aclosing

from opml_inference_router.control.quality import MAX_WINDOWS, Quality, Window, pooled
from opml_monitoring_scorer_contract.aioclient import AsyncMonitoringClient


class ScorerWindows:
    """A version's windows read from the monitoring-scorer's API (``ListWindows``, newest first, and
    ``GetModelStatus`` for its task), pooled as :meth:`QualityBook.since` pools the events', with the
    open window's labels so far (``include_open``: its truth, no rows or estimate), which no
    WindowScored announces until it closes.

    On the router's event loop (the contract's asyncio client, one channel kept, opened on the first
    read): a synchronous client's calls from a thread beside the process's aio server are a mix gRPC
    crashed on (SIGSEGV in cygrpc) in a bench process. Each call may take ``timeout_s``.

    Raises (:meth:`since`): NotFound (the version is not monitored), Unavailable (no scorer)."""

    def __init__(self, target: str, *, token: str | None = None, timeout_s: float = 5.0) -> None:
        self._target = target
        self._token = token
        self._timeout_s = timeout_s
        self._client: AsyncMonitoringClient | None = None

    async def since(self, model: str, version: str | int, start_time: float) -> Quality:
        if self._client is None:
            self._client = AsyncMonitoringClient(self._target, token=self._token)
        client, version = self._client, str(version)
        status = await client.status(model, version, timeout=self._timeout_s)
        higher_is_better = status.task != "regression"
        windows: list[Window] = []
        async with aclosing(client.windows(model, version, page_size=200, include_open=True,
                                           timeout=self._timeout_s)) as newest_first:
            async for window in newest_first:
                # the open window's labels so far (newest: it holds the latest predictions), so the
                # accuracy check counts labels as they join, not once 1,000 predictions close it
                last_time = math.inf if window.open else window.last_time.ToNanoseconds() / 1e9
                if last_time < start_time:
                    break
                estimate = (window.cbpe if window.HasField("cbpe") else
                            window.mpp if window.HasField("mpp") else None)
                windows.append(Window(index=window.index, rows=window.rows, last_time=last_time,
                                      estimate=estimate, labelled=window.labelled,
                                      true_value=window.true_value if window.HasField("true_value") else None,
                                      higher_is_better=higher_is_better))
                if len(windows) >= MAX_WINDOWS:
                    break
        return pooled(windows)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()
