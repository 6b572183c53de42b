"""Run a worker host agent: ``python -m opml_inference_router.host`` (or ``opml-inference-host``),
configured by ``OPML_INFERENCE_HOST_*`` (:mod:`opml_inference_router.hosts.settings`).

It joins the fleet pools it names at the router, runs their workers and serves KServe v2 to local
clients (:mod:`opml_inference_router.hosts.agent`). The first stdout line, once registered, is
``{"grpc_port": .., "metrics_port": .., "workers": [..]}``; logs go to stderr. SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import asyncio
import json

from opml_common.config import PlatformSettings
from opml_common.grpc.server import wait_for_signal
from opml_common.logging import configure_logging
from opml_inference_router.hosts.agent import HostAgent
from opml_inference_router.hosts.settings import HostAgentSettings


async def serve(settings: HostAgentSettings, platform: PlatformSettings) -> None:
    async with HostAgent(settings, platform) as agent:
        stop = asyncio.ensure_future(wait_for_signal())
        registered = asyncio.ensure_future(agent.registered.wait())
        await asyncio.wait({stop, registered, agent.task}, return_when=asyncio.FIRST_COMPLETED)
        if registered.done():
            print(json.dumps({"grpc_port": agent.server.port, "metrics_port": agent.server.metrics_port,
                              "workers": [worker.worker_id for worker in agent.workers]}), flush=True)
        else:
            registered.cancel()
        await asyncio.wait({stop, agent.task}, return_when=asyncio.FIRST_COMPLETED)
        if agent.task.done() and not agent.task.cancelled() and agent.task.exception() is not None:
            stop.cancel()
            raise agent.task.exception()  # a registration the router refused: its reason, and exit 1
        stop.cancel()


def main() -> None:
    platform = PlatformSettings()
    configure_logging("inference-router-host", level=platform.log_level, fmt=platform.log_format)
    asyncio.run(serve(HostAgentSettings(), platform))


if __name__ == "__main__":
    main()
