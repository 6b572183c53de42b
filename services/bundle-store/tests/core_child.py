"""A process that dies (SIGKILL, no cleanup) in the middle of a bundle-store operation.

Used by the crash tests of the core:

    python core_child.py add HOME CONTEXT KILL_AFTER_CHUNKS
        starts adding a bundle and kills itself after that many 64 KiB chunks of one file;
    python core_child.py push HOME CONTEXT KILL_AFTER_UPLOADS
        pushes the context and kills itself once that many blob uploads have completed
        (S3 settings from the OPML_* environment).

    python core_child.py announce HOME CONTEXT OP:WHERE
        runs OP (add: add and commit a bundle "crashing"; commit: commit the draft bundle "draft";
        delete: delete the bundle "doomed"; push: push the committed bundle "ready") and kills itself
        WHERE: "after-change" when the store hands the event to its emitter (the manifest is durable,
        the event not yet recorded), "before-change" when the store is about to write or remove the manifest.

It prints "READY" before the operation starts; reaching the end prints "SURVIVED" and exits 3.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from opml_bundle_store.core import layout as layout_module
from opml_bundle_store.core import remote as remote_module
from opml_bundle_store.core.store import BundleStore
from opml_common.config import PlatformSettings
from opml_common.events import EventEmitter
from opml_common.storage import s3_client


class DieOnEmit(EventEmitter):
    """The store's emitter, called once the change is durable: the process dies there, unannounced."""

    def emit(self, message, *, subject, id=None):
        die()


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def add(home: Path, context: str, kill_after: int) -> None:
    store = BundleStore(home, None)
    writer = store.new_bundle(context, "crashing")
    writer.add_file("done.bin", [b"complete file"])

    def chunks():
        for index in range(1_000_000):
            if index == kill_after:
                die()
            yield os.urandom(64 * 1024)

    print("READY", flush=True)
    writer.add_file("half.bin", chunks())
    writer.finish(commit=True)


def push(home: Path, context: str, kill_after: int) -> None:
    store = BundleStore(home, s3_client(PlatformSettings()), transfer_workers=4)
    original = remote_module.S3Remote.put_bytes
    lock = threading.Lock()
    uploads = 0

    def put_bytes(self, key, data, **kwargs):
        nonlocal uploads
        result = original(self, key, data, **kwargs)
        if "/objects/" in f"/{key}":
            with lock:
                uploads += 1
                if uploads >= kill_after:
                    die()
        return result

    remote_module.S3Remote.put_bytes = put_bytes
    print("READY", flush=True)
    store.push(context)


def announce(home: Path, context: str, what: str) -> None:
    op, where = what.split(":")
    s3 = s3_client(PlatformSettings()) if op == "push" else None
    store = BundleStore(home, s3, transfer_workers=2, events=DieOnEmit())
    if where == "before-change":  # the manifest's path is asked for right before it is written or removed
        layout_module.ContextDir.manifest_path = lambda self, uuid: die()
    print("READY", flush=True)
    if op == "add":
        with store.new_bundle(context, "crashing") as writer:
            writer.add_file("f", [b"content"])
            writer.finish(commit=True)
    elif op == "commit":
        store.commit(context, "draft")
    elif op == "delete":
        store.delete_bundle(context, "doomed")
    else:
        store.push(context, "ready")


def main() -> int:
    mode, home, context, arg = sys.argv[1:5]
    if mode == "announce":
        announce(Path(home), context, arg)
    else:
        {"add": add, "push": push}[mode](Path(home), context, int(arg))
    print("SURVIVED", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
