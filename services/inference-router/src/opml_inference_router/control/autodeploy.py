"""Automatic deploy: a committed bundle tagged for serving, announced on the bundles topic, is deployed.

Tags a bundle carries (set them on ``opml bundle add --tag``):

* ``serve=true`` (required): deploy this bundle when it is committed. Other bundles are ignored.
* ``version=<n>`` (optional): serve it as version ``n``; without it, one more than the newest
  deployed version of the model (the order in which its bundles were committed).
* ``canary=<percent>`` (optional): start it as a canary with that share of the traffic.

The bundle must hold ``model.yaml`` and ``model.onnx`` (the model's name comes from model.yaml).
A bundle that cannot be deployed (bad config, an ONNX file onnxruntime refuses, no room) is
reported as a ``DeployFailed`` event by the deploy itself and the event counts as handled: a bad
bundle is not retried and never stops the consumer. A failure that may pass (the bundle-store or
a worker unreachable) is retried by the consumer, then dead-lettered.
"""

from __future__ import annotations

import logging

from opml.bundles.v1 import events_pb2 as bundle_events

from opml_common.bus import CloudEvent
from opml_common.errors import InvalidArgument, OpmlError
from opml_inference_router.control.deployments import DeploymentManager
from opml_inference_router.control.state import Source

log = logging.getLogger(__name__)

GROUP = "inference-router-autodeploy"
SERVE_TAG, VERSION_TAG, CANARY_TAG = "serve", "version", "canary"
_COMMITTED = bundle_events.BundleCommitted.DESCRIPTOR.full_name


class AutoDeployer:
    """The handler of an ``EventConsumer`` on BUNDLES (group :data:`GROUP`)."""

    def __init__(self, manager: DeploymentManager) -> None:
        self._manager = manager

    async def __call__(self, event: CloudEvent) -> None:
        if event.type != _COMMITTED:
            return  # pushes and deletions do not deploy
        bundle = event.parse(bundle_events.BundleCommitted).bundle
        tags = dict(bundle.tags)
        if tags.get(SERVE_TAG, "").lower() != "true":
            return
        if self._manager.serves_bundle(bundle.uuid):
            return  # the same commit delivered again
        source = Source(context=bundle.context, bundle=bundle.uuid)
        try:
            version, canary = _number(tags, VERSION_TAG, int), _number(tags, CANARY_TAG, float)
            await self._manager.deploy(source, version=int(version), canary_percent=float(canary))
        except OpmlError as error:
            if error.retriable:
                raise
            # DeployFailed was published (by deploy, or here for a bad tag): the bundle is handled.
            if isinstance(error, InvalidArgument) and error.field.startswith("tags"):
                self._manager.report_failure(source, error)
            log.warning("autodeploy of %s failed: %s", source, error.message)


def _number(tags: dict[str, str], key: str, kind: type) -> float:
    text = tags.get(key, "")
    if not text:
        return 0
    try:
        return kind(text)
    except ValueError:
        raise InvalidArgument(f"tags.{key}", f"must be a {kind.__name__}, but got {text!r}") from None
