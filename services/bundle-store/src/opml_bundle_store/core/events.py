"""The bundle store's domain events: built here from the core's dataclasses, announced once, by the
part of the core where the change happens (a commit, a push, a delete), through an EventEmitter.

The subject (the record key) is the bundle name, so the events of one bundle's versions stay in order.

No change goes unannounced, even when the process dies between the change and its event (a SIGKILL
right after a manifest is written). Each announcement is written ahead: before the change, its event
(message, subject and the id it will carry) is fsync'd to ``<home>/announcing/`` as an
:class:`Intent`; after the change, it is handed to the emitter (the service's durable outbox) under
that id and the intent file is removed. At the next start, :meth:`BundleEvents.recover` settles the
intents a crash left: when the store shows the change (the bundle committed, pushed to that remote,
gone), the event is announced under its first id, so a consumer that had it already (a crash between
the outbox's write and the intent's removal) drops it as a duplicate; when it does not, the change
never happened and the intent is dropped unannounced.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import Message
from opml.bundles.v1 import events_pb2

from opml_bundle_store.core.convert import bundle_to_proto
from opml_bundle_store.core.layout import TMP_SUFFIX, atomic_write
from opml_bundle_store.core.manifest import Bundle
from opml_common.events import EventEmitter

log = logging.getLogger(__name__)

COMMITTED, PUSHED, DELETED = "committed", "pushed", "deleted"


@dataclass(frozen=True)
class Intent:
    """An event written ahead of its change. ``kind``, ``context``, ``uuid`` and ``remote_url`` say what
    the store must show for the change to have happened (:data:`COMMITTED`: that bundle is committed;
    :data:`PUSHED`: it records that remote; :data:`DELETED`: it is gone)."""

    id: str
    kind: str
    context: str
    uuid: str
    subject: str
    message: Message
    remote_url: str = ""

    def to_json(self) -> bytes:
        return json.dumps({"id": self.id, "kind": self.kind, "context": self.context, "uuid": self.uuid,
                           "subject": self.subject, "remote_url": self.remote_url,
                           "type": self.message.DESCRIPTOR.name, "data": self.message.SerializeToString().hex()
                           }).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Intent:
        """Raises: ValueError, KeyError, AttributeError (not an intent this module wrote)."""
        fields = json.loads(data)
        message = getattr(events_pb2, fields.pop("type"))()
        message.ParseFromString(bytes.fromhex(fields.pop("data")))
        return cls(message=message, **fields)


ShowsChange = Callable[[Intent], "bool | None"]
"""Whether the store shows an intent's change: True (announce it), False (drop it), None (cannot tell
now, e.g. the remote is unreachable: keep it for the next start)."""


class BundleEvents:
    """Announces bundle changes through ``emitter``, each written ahead to ``journal`` (a directory);
    with no emitter, announces nothing and writes nothing (a store used by a tool or a benchmark).

    Use: ``intent = events.committing(bundle)`` before the change is made durable, then
    ``events.announce(intent)`` after it. Safe from any thread; ``announce`` is called outside the
    store's locks.

    Raises (each method): OSError: the intent or the event could not be recorded.
    """

    def __init__(self, emitter: EventEmitter | None, journal: Path | None = None) -> None:
        self._emitter = emitter
        self._journal = journal if emitter is not None else None
        if self._journal is not None:
            self._journal.mkdir(parents=True, exist_ok=True)

    # -- before each change ----------------------------------------------------------------------

    def committing(self, bundle: Bundle) -> Intent | None:
        return self._write(Intent(str(uuid.uuid4()), COMMITTED, bundle.context, bundle.uuid, bundle.name,
                                  events_pb2.BundleCommitted(bundle=bundle_to_proto(bundle))))

    def pushing(self, bundle: Bundle) -> Intent | None:
        """``bundle`` as it will be recorded, ``remote_url`` set."""
        assert bundle.remote_url
        return self._write(Intent(str(uuid.uuid4()), PUSHED, bundle.context, bundle.uuid, bundle.name,
                                  events_pb2.BundlePushed(bundle=bundle_to_proto(bundle), remote_url=bundle.remote_url),
                                  remote_url=bundle.remote_url))

    def deleting(self, context_id: str, uuid_: str, bundle_name: str, tags: Mapping[str, str], *,
                 remote: bool, only_remote: str = "") -> Intent | None:
        """``only_remote``: the remote's url when the bundle is only there (its listing tells the change)."""
        return self._write(Intent(str(uuid.uuid4()), DELETED, context_id, uuid_, bundle_name or uuid_,
                                  events_pb2.BundleDeleted(context=context_id, uuid=uuid_, bundle_name=bundle_name,
                                                           tags=dict(tags), remote=remote),
                                  remote_url=only_remote))

    # -- after it --------------------------------------------------------------------------------

    def announce(self, intent: Intent | None) -> None:
        """The change is durable: its event goes to the emitter under the intent's id, then the intent goes."""
        if intent is None or self._emitter is None:
            return
        self._emitter.emit(intent.message, subject=intent.subject, id=intent.id)
        self._remove(intent)

    def recover(self, shows_change: ShowsChange) -> tuple[int, int]:
        """Settles the intents an earlier process left (see the module's docstring). Returns (announced,
        dropped); an intent whose change cannot be told now stays."""
        announced = dropped = 0
        for leftover in self._journal.glob(f".*{TMP_SUFFIX}") if self._journal is not None else ():
            leftover.unlink(missing_ok=True)  # an intent never fully written: its change was not begun
        for path in self._paths():
            try:
                intent = Intent.from_json(path.read_bytes())
            except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
                log.error("dropping the unreadable announcement intent %s (%s)", path, exc)
                path.unlink(missing_ok=True)
                continue
            settled = self.settle(intent, shows_change)
            announced += settled is True
            dropped += settled is False
        if announced or dropped:
            log.warning("announcements left by an earlier process: %d announced (the change had happened), "
                        "%d dropped (it had not)", announced, dropped)
        return announced, dropped

    def settle(self, intent: Intent | None, shows_change: ShowsChange) -> bool | None:
        """Announces ``intent`` if the store shows its change, drops it if not, keeps it if that cannot be
        told now (returned: True, False, None). For an operation that failed part-way, and at start."""
        if intent is None:
            return None
        happened = shows_change(intent)
        if happened is None:
            log.warning("announcement %s (%s of bundle %s) kept: the store cannot tell yet whether it "
                        "happened", intent.id, intent.kind, intent.uuid)
        elif happened:
            self.announce(intent)
        else:
            self._remove(intent)
        return happened

    def pending(self) -> int:
        """Intents written and not yet announced or dropped."""
        return len(self._paths())

    # -- the journal -----------------------------------------------------------------------------

    def _write(self, intent: Intent) -> Intent | None:
        if self._journal is None:
            return None
        atomic_write(self._path(intent), intent.to_json())
        return intent

    def _remove(self, intent: Intent) -> None:
        # not fsync'd: a removal the disk loses is an intent settled again at the next start, same id
        if self._journal is not None:
            self._path(intent).unlink(missing_ok=True)

    def _path(self, intent: Intent) -> Path:
        assert self._journal is not None
        return self._journal / f"{intent.id}.json"

    def _paths(self) -> list[Path]:
        if self._journal is None:
            return []
        return sorted(self._journal.glob("*.json"), key=lambda path: os.stat(path).st_mtime_ns)
