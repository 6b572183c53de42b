"""A process that dies (SIGKILL, no cleanup) in the middle of a bundle-store operation.

Used by the crash tests of the core:

    python core_child.py add HOME CONTEXT KILL_AFTER_CHUNKS
        starts adding a bundle and kills itself after that many 64 KiB chunks of one file;
    python core_child.py push HOME CONTEXT KILL_AFTER_UPLOADS
        pushes the context and kills itself once that many blob uploads have completed
        (S3 settings from the OPML_* environment).

It prints "READY" before the operation starts; reaching the end prints "SURVIVED" and exits 3.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from opml_bundle_store.core import remote as remote_module
from opml_bundle_store.core.store import BundleStore
from opml_common.config import PlatformSettings
from opml_common.storage import s3_client


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


def main() -> int:
    mode, home, context, count = sys.argv[1:5]
    {"add": add, "push": push}[mode](Path(home), context, int(count))
    print("SURVIVED", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
