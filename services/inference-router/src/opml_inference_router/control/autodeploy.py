"""Automatic deploy: a committed bundle tagged for serving, announced on the bundles topic, is deployed.

Tags a bundle carries (set them on ``opml bundle add --tag``):

* ``serve=true`` (required): deploy this bundle when it is committed. Other bundles are ignored.
* ``version=<n>`` (optional): serve it as version ``n``; without it, one more than the newest
  deployed version of the model (the order in which its bundles were committed).
* ``canary=<percent>`` (optional): start it as a canary with that share of the traffic.

An event is a hint, never an authority. Anyone who can write to the bundles topic can publish a
``BundleCommitted`` with any source, tags, context and uuid, so:

* the consumer accepts bundle events only from the bundle-store (:data:`SOURCES`, the ``ce_source``
  of its ServiceSpec); others are dead-lettered by :class:`~opml_common.bus.EventConsumer`;
* before acting, :class:`AutoDeployer` re-reads the bundle from the bundle-store (GetBundle by the
  event's context and uuid) and deploys only when the store says that bundle exists with exactly
  that uuid in that context, is committed and is tagged ``serve=true``; the version and canary tags
  are the store's too. The event's own tags, context and uuid are never trusted.

The bundle must hold ``model.yaml`` and ``model.onnx`` (the model's name comes from model.yaml).
A bundle that cannot be deployed (bad config, an ONNX file onnxruntime refuses, no room) is
reported as a ``DeployFailed`` event by the deploy itself and the event counts as handled: a bad
bundle is not retried and never stops the consumer. A failure that may pass (the bundle-store or
a worker unreachable) is retried by the consumer, then dead-lettered.
"""

from __future__ import annotations

import logging
from typing import Protocol

from opml.bundles.v1 import bundles_pb2
from opml.bundles.v1 import events_pb2 as bundle_events

from opml_bundle_store_contract.names import EVENT_SOURCE as BUNDLE_STORE_SOURCE
from opml_common.bus import CloudEvent
from opml_common.errors import InvalidArgument, NotFound, OpmlError
from opml_inference_router.control.deployments import DeploymentManager
from opml_inference_router.control.state import Source

log = logging.getLogger(__name__)

GROUP = "inference-router-autodeploy"
SOURCES = frozenset({BUNDLE_STORE_SOURCE})  # the only ce_source autodeploy's consumer accepts
SERVE_TAG, VERSION_TAG, CANARY_TAG = "serve", "version", "canary"
_COMMITTED = bundle_events.BundleCommitted.DESCRIPTOR.full_name


class BundleReader(Protocol):
    """Reads a bundle from the bundle-store (:class:`~opml_inference_router.control.bundles.BundleFetcher`)."""

    async def get_bundle(self, context: str, ref: str) -> bundles_pb2.Bundle:
        """Raises: NotFound, Unavailable."""
        ...


class AutoDeployer:
    """The handler of an ``EventConsumer`` on BUNDLES (group :data:`GROUP`, ``sources=SOURCES``).

    ``bundles`` is where the bundle named by an event is re-read before anything is deployed.
    """

    def __init__(self, manager: DeploymentManager, *, bundles: BundleReader) -> None:
        self._manager = manager
        self._bundles = bundles

    async def __call__(self, event: CloudEvent) -> None:
        if event.type != _COMMITTED:
            return  # pushes and deletions do not deploy
        hint = event.parse(bundle_events.BundleCommitted).bundle
        if hint.tags.get(SERVE_TAG, "").lower() != "true":
            return  # a hint that it is not for serving: nothing to check (a refusal never deploys)
        if not hint.context or not hint.uuid:
            log.warning("autodeploy: event %s from %s names no context or uuid; ignored", event.id, event.source)
            return
        if self._manager.serves_bundle(hint.uuid):
            return  # the same commit delivered again
        bundle = await self._confirmed(event, hint)
        if bundle is None:
            return
        tags = dict(bundle.tags)
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

    async def _confirmed(self, event: CloudEvent, hint: bundles_pb2.Bundle) -> bundles_pb2.Bundle | None:
        """The store's bundle when it confirms the event (same context and uuid, committed, serve=true),
        else None (logged). Unavailable propagates: the consumer retries."""
        what = f"bundle {hint.uuid!r} of context {hint.context!r} (event {event.id!r} from {event.source!r})"
        try:
            bundle = await self._bundles.get_bundle(hint.context, hint.uuid)
        except (NotFound, InvalidArgument) as error:
            log.warning("autodeploy refused %s: the bundle-store does not have it (%s)", what, error.message)
            return None
        problem = None
        if bundle.uuid != hint.uuid or bundle.context != hint.context:
            # GetBundle also resolves names: an event whose "uuid" is a bundle's name must not deploy it.
            problem = f"the store resolves it to bundle {bundle.uuid!r} of context {bundle.context!r}"
        elif not bundle.committed:
            problem = "the store says it is not committed"
        elif bundle.tags.get(SERVE_TAG, "").lower() != "true":
            problem = f"the store says it is tagged {SERVE_TAG}={bundle.tags.get(SERVE_TAG, '')!r}, not serve=true"
        if problem is not None:
            log.warning("autodeploy refused %s: %s", what, problem)
            return None
        return bundle


def _number(tags: dict[str, str], key: str, kind: type) -> float:
    text = tags.get(key, "")
    if not text:
        return 0
    try:
        return kind(text)
    except ValueError:
        raise InvalidArgument(f"tags.{key}", f"must be a {kind.__name__}, but got {text!r}") from None
