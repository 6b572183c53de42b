"""The spool: one Outbox folder per traced run under ``OPML_TRACE_SPOOL_DIR``, locked while its run lives.

Events are written there before they are published and deleted after the broker's ack. A run that
could not deliver (broker down, killed) leaves its folder; the next traced run on the machine, or
``flush_spool`` (``opml trace flush``), publishes it later. Consumers deduplicate by event id.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path
from typing import TYPE_CHECKING

from opml_common.outbox import Outbox

if TYPE_CHECKING:
    from opml_common.bus.producer import EventPublisher
    from opml_common.config import PlatformSettings

LOCK = ".lock"


def lock_folder(folder: Path, *, wait: bool) -> int | None:
    """An exclusive lock on ``folder`` (held by the file descriptor returned), None if another holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def release_folder(folder: Path, fd: int) -> None:
    """Unlock ``folder`` and remove it when nothing is left to send."""
    try:
        if not any(folder.glob("*.json")):
            (folder / LOCK).unlink(missing_ok=True)
            folder.rmdir()
    except OSError:
        pass  # a file arrived meanwhile or another process took it: it stays for a later flush
    finally:
        os.close(fd)


async def flush_folders(spool_dir: Path, publisher: EventPublisher, *, skip: Path | None = None) -> tuple[int, int]:
    """Publish what unlocked run folders hold; (events sent, events still pending)."""
    sent = pending = 0
    if not spool_dir.is_dir():
        return 0, 0
    for folder in sorted(p for p in spool_dir.iterdir() if p.is_dir() and p != skip):
        fd = lock_folder(folder, wait=False)
        if fd is None:
            continue  # a live run owns it
        try:
            before = len(list(folder.glob("*.json")))
            await Outbox(folder, publisher, None).flush()
            left = len(list(folder.glob("*.json")))
            sent, pending = sent + before - left, pending + left
        finally:
            release_folder(folder, fd)
    return sent, pending


async def flush_spool(spool_dir: Path, settings: PlatformSettings, *, timeout_s: float = 30.0) -> tuple[int, int]:
    """Deliver every spooled event of finished runs to the broker; (sent, still pending).

    Raises:
        opml_common.errors.Unavailable: no broker answered.
    """
    from opml_common.bus.producer import EventPublisher
    async with EventPublisher(settings, source="opml://trace-collector/spool", metrics=None) as publisher:
        return await asyncio.wait_for(flush_folders(spool_dir.expanduser(), publisher), timeout_s)
