"""The tracer's background thread: one asyncio loop that batches, publishes, spools and polls.

Every event goes to this run's spool folder, then the spool is flushed to the broker; the steps
also go to the session file (``<session_dir>/<job>/<worker>.<session_id>.jsonl``, one StepRecord
per line: the format of ``opml_trace_collector.session`` that ``opml trace summary`` reads). With the broker down the events wait in the spool and the next batch
retries; at exit one bounded delivery attempt (``finish``), and what is left stays for ``opml trace
flush`` or the next traced run. Nothing here may raise into the job: failures are logged once per kind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Iterable

from google.protobuf.message import Message
from opml.traces.v1.events_pb2 import StepRecord

from opml_common.bus.cloudevents import CloudEvent
from opml_common.bus.producer import EventPublisher
from opml_common.config import PlatformSettings
from opml_common.outbox import Outbox
from opml_trace_collector.inject import spool
from opml_trace_collector.inject.settings import TracerSettings
from opml_trace_collector.session import record_to_line
from opml_trace_collector.topics import TRACES, tracer_source

_CONNECT_TIMEOUT_S = 5.0


class Sender:
    """Owns the tracer's asyncio loop (run by ``run`` in the tracer's thread); other threads hand it
    work with ``submit``."""

    def __init__(self, settings: TracerSettings, platform: PlatformSettings, session_id: str,
                 warn: Callable[[str, str], None]) -> None:
        self.settings = settings
        self.platform = platform
        self.session_id = session_id
        self._warn = warn
        self._source = tracer_source(settings.job, settings.worker)
        self._loop = asyncio.new_event_loop()
        safe = lambda text: text.replace("/", "_")  # noqa: E731
        self.session_file = settings.session_dir / safe(settings.job) / f"{safe(settings.worker)}.{session_id}.jsonl"
        self.spool_folder = settings.spool_dir / session_id
        self._session = None
        self._lock_fd: int | None = None
        self._connected_once = False

    # --- loop ---------------------------------------------------------------------------------

    def run(self, on_ready: Callable[[], None]) -> None:
        """In the calling (tracer's) thread: set up, call ``on_ready`` on the loop, run it for good.

        The loop is never stopped: at exit the job waits only for ``finish`` (bounded by the tracer),
        and the daemon thread ends with the process.
        """
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._setup())
        except Exception as exc:  # noqa: BLE001
            self._warn("setup", f"the tracer's sender cannot start ({exc!r})")
        self._loop.call_soon(on_ready)
        self._loop.run_forever()

    async def _setup(self) -> None:
        # no metrics: nobody scrapes a job's tracer (and prometheus_client is not imported)
        self._publisher = EventPublisher(self.platform, source=self._source, metrics=None)
        self._lock_fd = spool.lock_folder(self.spool_folder, wait=True)
        self._outbox = Outbox(self.spool_folder, self._publisher, None)
        try:
            self.session_file.parent.mkdir(parents=True, exist_ok=True)
            self._session = open(self.session_file, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            self._warn("session", f"cannot write the session file {self.session_file} ({exc})")

    def submit(self, coro: Awaitable) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def spawn(self, coro: Awaitable, what: str) -> concurrent.futures.Future:
        """Run ``coro`` on the loop, logging (once) what it raises."""
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._warn(what, f"{what} failed ({exc!r})")
        return self.submit(guarded())

    async def finish(self) -> bool:
        """At exit, on the loop: deliver what is spooled, then close; True when all was delivered.

        The tracer bounds this (``exit_timeout_s``); cancelled there, what was not acknowledged stays
        in the spool folder (its lock goes with the process) for ``opml trace flush`` or the next run.
        """
        if self._session is not None:
            self._session.close()
            self._session = None
        delivered = await self.deliver()
        if delivered:
            if self._lock_fd is not None:
                spool.release_folder(self.spool_folder, self._lock_fd)
                self._lock_fd = None
            await self._publisher.stop()
        return delivered

    # --- events -------------------------------------------------------------------------------

    def write_steps(self, records: Iterable[StepRecord]) -> None:
        """Append steps to the session file (the loop's thread)."""
        if self._session is not None:
            self._session.writelines(record_to_line(record) + "\n" for record in records)

    def record(self, message: Message) -> None:
        """Record one event in the spool (durably); the next ``deliver`` sends it."""
        event = CloudEvent.from_proto(message, source=self._source, subject=self.settings.subject)
        self._outbox.record(TRACES, event)

    async def emit(self, message: Message) -> None:
        """Record one event in the spool (durably) and try to deliver it now."""
        event = CloudEvent.from_proto(message, source=self._source, subject=self.settings.subject)
        await self._outbox.publish(TRACES, event)  # False: it waits in the spool for deliver()

    async def deliver(self) -> bool:
        """Connect if needed and publish everything spooled; True when nothing is left."""
        if not self._publisher.started:
            try:
                await asyncio.wait_for(self._publisher.start(), _CONNECT_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - broker down: events wait in the spool
                self._warn("broker", f"the broker is unreachable ({exc}); metrics spool to {self.spool_folder}")
                return False
        delivered = await self._outbox.flush()
        if delivered and not self._connected_once:
            self._connected_once = True  # now also deliver what earlier runs left behind
            await spool.flush_folders(self.settings.spool_dir, self._publisher, skip=self.spool_folder)
        return delivered
