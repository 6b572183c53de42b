"""The bundle store's domain events: built here from the core's dataclasses, announced once, by the
part of the core where the change happens (a commit, a push, a delete), through an EventEmitter.

The subject (the record key) is the bundle name, so the events of one bundle's versions stay in order.
"""

from __future__ import annotations

from collections.abc import Mapping

from opml.bundles.v1 import events_pb2

from opml_bundle_store.core.convert import bundle_to_proto
from opml_bundle_store.core.model import Bundle
from opml_common.events import EventEmitter


class BundleEvents:
    """Announces bundle changes through ``emitter``; with None, announces nothing (a store used by a
    tool or a benchmark, outside the service).

    Each method is called right after the change is durable, outside the store's locks, and is safe
    from any thread.

    Raises (each method): OSError: the event could not be recorded; the change has happened.
    """

    def __init__(self, emitter: EventEmitter | None) -> None:
        self._emitter = emitter

    def committed(self, bundle: Bundle) -> None:
        if self._emitter is not None:
            self._emitter.emit(events_pb2.BundleCommitted(bundle=bundle_to_proto(bundle)), subject=bundle.name)

    def pushed(self, bundle: Bundle) -> None:
        if self._emitter is not None:
            self._emitter.emit(events_pb2.BundlePushed(bundle=bundle_to_proto(bundle), remote_url=bundle.remote_url),
                               subject=bundle.name)

    def deleted(self, context_id: str, uuid: str, bundle_name: str, tags: Mapping[str, str], *,
                remote: bool) -> None:
        if self._emitter is not None:
            self._emitter.emit(events_pb2.BundleDeleted(context=context_id, uuid=uuid, bundle_name=bundle_name,
                                                        tags=dict(tags), remote=remote),
                               subject=bundle_name or uuid)
