"""The spool: where a traced job's events wait for the host's shipper (``ship``), standard library only.

``<spool_dir>/<outlet>/<session>/``: one folder per run (locked while its run lives) under one per
destination (``config.outlet_dir``: the broker and topic prefix the job's settings name). Each
event is one ``opml_common.outbox`` file, written and fsync'd before the job goes on; the shipper
publishes a folder's files oldest first and deletes each after the broker's ack, and removes a
finished run's folder once it is empty. Consumers deduplicate by event id.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import socket
import sys
import threading
from pathlib import Path

from google.protobuf.message import Message

from opml_common.bus.cloudevents import CloudEvent
from opml_common.outbox import write_event
from opml_common.topics import Topic

LOCK = ".lock"
SHIPPER_LOCK = ".shipper.lock"  # held by the outlet's shipper (``ship``), its pid written in it
LAUNCHERS = ".launchers"  # share-locked by each launcher while its job runs: the shipper is not idle then


def lock_folder(folder: Path, *, wait: bool, name: str = LOCK) -> int | None:
    """An exclusive lock on ``folder`` (held by the file descriptor returned), None if another holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def wake_address(outlet: Path) -> str | None:
    """The abstract unix socket the outlet's shipper listens on for "something was written" (Linux:
    abstract names have no path-length limit and vanish with the process); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    return "\0opml-trace-ship-" + hashlib.sha256(str(outlet.resolve()).encode()).hexdigest()[:24]


def hold_launcher(outlet: Path) -> int:
    """A shared lock on the outlet's launcher file, held by a launcher for its job's life (the
    descriptor): a shipper does not exit idle while one is held."""
    outlet.mkdir(parents=True, exist_ok=True)
    fd = os.open(outlet / LAUNCHERS, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def no_launcher(outlet: Path) -> int | None:
    """An exclusive lock on the launcher file when no launcher holds it (the descriptor), else None."""
    outlet.mkdir(parents=True, exist_ok=True)
    return lock_folder(outlet, wait=False, name=LAUNCHERS)


def shipper_pid(outlet: Path) -> int | None:
    """The pid of the shipper holding ``outlet``'s lock (0 if unreadable), None when none holds it."""
    if not (outlet / SHIPPER_LOCK).exists():
        return None
    fd = lock_folder(outlet, wait=False, name=SHIPPER_LOCK)
    if fd is not None:
        os.close(fd)
        return None
    try:
        return int((outlet / SHIPPER_LOCK).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def run_folders(outlet: Path) -> list[Path]:
    """The run folders of an outlet (not those still being made, whose names hold a dot)."""
    try:
        return sorted(p for p in outlet.iterdir() if "." not in p.name and p.is_dir())
    except FileNotFoundError:
        return []


def pending(folder: Path) -> list[Path]:
    """The events a folder holds, oldest first."""
    try:
        return sorted(p for p in folder.iterdir() if p.suffix == ".json")
    except FileNotFoundError:
        return []


def release_folder(folder: Path, fd: int) -> None:
    """Unlock ``folder`` and remove it when nothing is left to send."""
    try:
        if not pending(folder):
            (folder / LOCK).unlink(missing_ok=True)
            for leftover in folder.glob("*.tmp"):  # a write cut short: never renamed, never an event
                leftover.unlink(missing_ok=True)
            folder.rmdir()
    except OSError:
        pass  # a file arrived meanwhile or another process took it: the shipper removes it later
    finally:
        os.close(fd)


class RunSpool:
    """One run's folder, locked for the run's life; ``record`` writes an event into it from any thread."""

    def __init__(self, folder: Path, topic: Topic, source: str, subject: str) -> None:
        self.folder = folder
        self._topic, self._source, self._subject = topic, source, subject
        # locked under a name the shipper skips, then renamed: it never sees the folder unlocked
        making = folder.with_name(folder.name + ".new")
        self._fd = lock_folder(making, wait=True)
        os.replace(making, folder)
        self._seq = itertools.count()
        self._lock = threading.Lock()  # one writer at a time: file names then sort in the order written
        self._wake_to = wake_address(folder.parent)
        self._waker = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self._wake_to else None
        if self._waker is not None:
            self._waker.setblocking(False)

    def record(self, message: Message) -> str:
        """Write ``message`` as an event (durably); its id."""
        with self._lock:
            event = CloudEvent.from_proto(message, source=self._source, subject=self._subject)
            write_event(self.folder, self._topic, event, next(self._seq))
        self.wake()
        return event.id

    def wake(self) -> None:
        """Tell the shipper an event is waiting (a datagram; no shipper, or a full queue: it looks anyway)."""
        if self._waker is not None:
            try:
                self._waker.sendto(b"w", self._wake_to)
            except OSError:
                pass

    def drained(self) -> bool:
        return not pending(self.folder)

    def close(self) -> None:
        """At the run's end: unlock (the folder goes when empty; otherwise the shipper removes it)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            release_folder(self.folder, fd)
        if self._waker is not None:
            self._waker.close()
