"""Monitoring set up by itself for what the inference-router deploys (opml.deployments.v1).

The handler of an ``EventConsumer`` on DEPLOYMENTS (group :data:`GROUP`, ``sources=SOURCES``): a
ModelDeployed names the version and, for a bundle deploy, the bundle's UUID; the scorer reads that
bundle's ``reference.npz`` and ``monitoring.yaml`` from the bundle-store itself (the event is a hint:
the files come from their owner), trains the version's MPP and starts scoring its predictions.
"""

from __future__ import annotations

import logging

from opml.inference.v1 import deployment_events_pb2

from opml_common.bus.cloudevents import CloudEvent
from opml_common.errors import OpmlError
from opml_inference_router_contract.names import EVENT_SOURCE as ROUTER_SOURCE
from opml_monitoring_scorer.core.scorer import Scorer

log = logging.getLogger(__name__)
GROUP = "monitoring-scorer-deployments"
SOURCES = frozenset({ROUTER_SOURCE})
_DEPLOYED = "opml.inference.v1.ModelDeployed"


class DeploymentWatcher:
    def __init__(self, scorer: Scorer) -> None:
        self._scorer = scorer

    async def __call__(self, event: CloudEvent) -> None:
        if event.type != _DEPLOYED:
            return
        deployed = event.parse(deployment_events_pb2.ModelDeployed)
        try:
            await self._scorer.on_deployed(deployed)
        except OpmlError as error:
            if error.retriable:
                raise
            log.warning("monitoring of %s version %s not set up: %s", deployed.deployment.model, deployed.version,
                        error.message)
