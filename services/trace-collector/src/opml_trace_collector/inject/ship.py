"""The host's shipper: publishes what traced jobs write to the spool, so the jobs never talk to the broker.

``python -m opml_trace_collector.inject.ship`` (the job-orchestrator's local executor runs one as its
child; elsewhere the launcher starts one, detached, when none runs). One per spool folder and destination: it holds ``.shipper.lock`` in
its outlet (``config.outlet_dir``: the broker and topic prefix of its ``OPML_*`` settings) and
publishes only that outlet, so jobs of another platform sharing the spool folder are left to a
shipper of theirs. Woken by the jobs' writes (``spool.wake_address``; once a second otherwise, every
``poll_s`` where it cannot listen) it looks at each run folder and publishes its events oldest
first (``opml_common.outbox``: each file deleted after the broker's ack; the ids the job gave them,
so consumers deduplicate a re-send); a folder whose run ended (unlocked) is removed once empty.
Broker down: it retries, with a pause growing to 10 s, and says so once. Started with
``--idle-exit-s`` > 0 it exits after that long with no run folder and no launcher running a job
(launchers share-lock ``.launchers`` while their job runs); ``--once`` delivers what is there and
exits (``opml trace flush``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from opml_common.outbox import Outbox
from opml_trace_collector.inject import spool
from opml_trace_collector.inject.config import outlet_dir

if TYPE_CHECKING:
    from opml_common.bus.producer import EventPublisher
    from opml_common.config import PlatformSettings

log = logging.getLogger(__name__)
SHIPPER_LOCK = spool.SHIPPER_LOCK
SOURCE = "opml://trace-collector/shipper"
_CONNECT_TIMEOUT_S = 5.0
_MAX_BACKOFF_S = 10.0
_WOKEN_LOOK_S = 1.0  # with wake-ups: the look period when no job writes (finished runs, lost datagrams)
_LIVENESS_S = 1.0  # how often a run folder with nothing to send is checked for its run's end
_looked: dict[Path, float] = {}  # when each run folder's lock was last tried


class ShipperRunning(RuntimeError):
    """Another shipper holds the outlet's lock (its pid in the message)."""


def take_lock(outlet: Path) -> int:
    """Hold ``outlet``'s shipper lock (the descriptor returned), the pid written in it.

    Raises:
        ShipperRunning: another process holds it.
    """
    fd = spool.lock_folder(outlet, wait=False, name=SHIPPER_LOCK)
    if fd is None:
        raise ShipperRunning(f"a shipper already delivers {outlet} (pid {spool.shipper_pid(outlet)})")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


async def ship_once(outlet: Path, publisher: EventPublisher,
                    folders: list[Path] | None = None) -> tuple[int, int, int]:
    """One pass over the outlet's run folders (or ``folders``): (events sent, still pending, folders seen)."""
    sent = left = 0
    folders = spool.run_folders(outlet) if folders is None else folders
    now = time.monotonic()
    for folder in folders:
        before = len(spool.pending(folder))
        if not before and now - _looked.get(folder, 0.0) < _LIVENESS_S:
            continue  # a live run with nothing new: whether it ended is looked at once a second
        _looked[folder] = now
        fd = spool.lock_folder(folder, wait=False)  # None: its run is alive (and may add events)
        try:
            if before:
                await Outbox(folder, publisher, None).flush()
            remaining = len(spool.pending(folder))
            sent, left = sent + before - remaining, left + remaining
        finally:
            if fd is not None:
                spool.release_folder(folder, fd)
                _looked.pop(folder, None)
    for gone in set(_looked).difference(folders):  # removed by their own runs
        del _looked[gone]
    return sent, left, len(folders)


def _listen(outlet: Path, woken: asyncio.Event) -> Callable[[], None] | None:
    """Listen on the outlet's wake-up address (``spool.wake_address``), setting ``woken`` on each
    datagram; the function that stops it, or None where there is none or another process holds it
    (then the shipper looks every ``poll_s``)."""
    address = spool.wake_address(outlet)
    if address is None:
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        listener.bind(address)
    except OSError:
        listener.close()
        return None
    listener.setblocking(False)

    def readable() -> None:
        with contextlib.suppress(OSError):
            while listener.recv(64):
                pass
        woken.set()

    loop = asyncio.get_running_loop()
    loop.add_reader(listener.fileno(), readable)

    def close() -> None:
        loop.remove_reader(listener.fileno())
        listener.close()

    return close


def _publisher(platform: PlatformSettings) -> EventPublisher:
    from opml_common.bus.producer import EventPublisher
    return EventPublisher(platform, source=SOURCE, metrics=None)


async def serve(spool_dir: Path, platform: PlatformSettings, *, poll_s: float = 0.05, idle_exit_s: float = 0.0,
                stop: asyncio.Event | None = None) -> None:
    """Ship ``spool_dir``'s outlet for ``platform`` until ``stop`` is set (or idle for ``idle_exit_s``).

    Raises:
        ShipperRunning: another shipper delivers that outlet.
    """
    outlet = outlet_dir(spool_dir.expanduser(), platform.kafka_bootstrap, platform.topic_prefix)
    lock = take_lock(outlet)
    stop = stop or asyncio.Event()
    stopped = asyncio.ensure_future(stop.wait())  # one waiter for the whole run: the idle loop stays cheap
    woken = asyncio.Event()
    listener = _listen(outlet, woken)
    publisher = _publisher(platform)
    backoff, warned, idle_since = 0.0, False, time.monotonic()
    log.info("shipper started", extra={"outlet": str(outlet), "pid": os.getpid()})
    try:
        while not stop.is_set():
            pause = poll_s
            folders = spool.run_folders(outlet)
            if folders:
                idle_since = time.monotonic()
            if folders and not publisher.started:
                try:
                    await asyncio.wait_for(publisher.start(), _CONNECT_TIMEOUT_S)
                    backoff, warned = 0.0, False
                except Exception as exc:  # noqa: BLE001 - the broker is down: the events wait
                    if not warned:
                        log.warning("the broker is unreachable; the spool waits", extra={"error": str(exc)})
                        warned = True
                    backoff = min(_MAX_BACKOFF_S, max(0.5, backoff * 2))
                    pause = backoff
            if folders and publisher.started:
                _sent, left, _runs = await ship_once(outlet, publisher, folders)
                if left:  # a publish failed: the broker went away; reconnect after a pause
                    backoff = min(_MAX_BACKOFF_S, max(0.5, backoff * 2))
                    pause = backoff
                    await publisher.stop()
                    publisher = _publisher(platform)
            if idle_exit_s and time.monotonic() - idle_since >= idle_exit_s:
                quiet = spool.no_launcher(outlet)  # held while the lock goes: a launcher then starts another
                if quiet is not None:
                    try:
                        os.close(lock)
                        lock = None
                    finally:
                        os.close(quiet)
                    log.info("shipper idle, exiting", extra={"idle_s": idle_exit_s})
                    return
                idle_since = time.monotonic()  # a launcher's job is starting or running
            if listener is not None and pause == poll_s:
                pause = _WOKEN_LOOK_S  # the jobs wake it when they write; a look now and then all the same
            waiter = asyncio.ensure_future(woken.wait())
            await asyncio.wait({stopped, waiter}, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            woken.clear()
    finally:
        stopped.cancel()
        if listener is not None:
            listener()
        if publisher.started:
            await publisher.stop()
        if lock is not None:
            os.close(lock)


async def flush_spool(spool_dir: Path, platform: PlatformSettings, *, timeout_s: float = 30.0) -> tuple[int, int]:
    """Deliver every spooled event of ``platform``'s outlet once, now; (sent, still pending).

    Raises:
        ShipperRunning: a shipper delivers that outlet (it sends them).
        opml_common.errors.Unavailable: no broker answered.
    """
    outlet = outlet_dir(spool_dir.expanduser(), platform.kafka_bootstrap, platform.topic_prefix)
    lock = take_lock(outlet)
    try:
        async with _publisher(platform) as publisher:
            sent, left, _runs = await asyncio.wait_for(ship_once(outlet, publisher), timeout_s)
            return sent, left
    finally:
        os.close(lock)


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opml_trace_collector.inject.ship", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spool-dir", type=Path, default=None, help="default: OPML_TRACE_SPOOL_DIR")
    parser.add_argument("--poll-s", type=float, default=0.05, help="how often the run folders are looked at")
    parser.add_argument("--idle-exit-s", type=float, default=None,
                        help="exit after this long with no run folder (default: never; the launcher passes "
                        "OPML_TRACE_SHIPPER_IDLE_EXIT_S)")
    parser.add_argument("--once", action="store_true", help="deliver what is spooled now, then exit")
    ns = parser.parse_args(args)

    from opml_common.config import PlatformSettings
    from opml_common.logging import configure_logging
    from opml_trace_collector.inject.settings import TracerSettings
    platform = PlatformSettings()
    configure_logging("trace-shipper", level=platform.log_level, fmt=platform.log_format)
    spool_dir = ns.spool_dir or TracerSettings().spool_dir
    try:
        if ns.once:
            sent, left = asyncio.run(flush_spool(spool_dir, platform))
            print(f"{sent} events sent, {left} still pending")
            return 1 if left else 0
        asyncio.run(serve(spool_dir, platform, poll_s=ns.poll_s, idle_exit_s=ns.idle_exit_s or 0.0))
    except ShipperRunning as exc:
        print(str(exc), file=sys.stderr)
        return 0 if not ns.once else 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
