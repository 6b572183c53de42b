"""One way to run a service: ``run_service(SPEC, build)`` is the whole of a ``__main__``.

``run_service`` owns the order every service starts in and the reverse order it stops in, on one
``AsyncExitStack``: settings and logging, the service's topics, then whatever ``build`` starts through
its :class:`ServiceContext` (Redis, the event publisher and outbox, the core, consumers), then the gRPC
server last, so on SIGINT/SIGTERM the server drains first and the parts it calls stop after it. A
``__main__`` only wires: it writes ``build``, never a teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
from minio import Minio
from pydantic import ValidationError

from opml_common.bus import EventPublisher, ensure_topics
from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.events import EventEmitter, OutboxEmitter
from opml_common.grpc.server import GrpcServer, ServiceRegistration, wait_for_signal
from opml_common.lifecycle import cancel_and_wait
from opml_common.logging import configure_logging
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.private import private_dir
from opml_common.process import ServiceSpec
from opml_common.storage import redis_client, s3_client

log = logging.getLogger(__name__)


class Startable(Protocol):
    async def start(self) -> Any: ...
    async def stop(self) -> Any: ...


P = TypeVar("P", bound=Startable)
T = TypeVar("T")
Build = Callable[["ServiceContext"], Awaitable[Sequence[ServiceRegistration]]]


class ServiceContext:
    """What ``build`` gets: the settings, the metrics, and one way to start each part so that it is
    stopped in reverse order at shutdown. Parts made here (Redis, publisher, emitter) are made once."""

    def __init__(self, spec: ServiceSpec, settings: ServiceSettings, platform: PlatformSettings,
                 metrics: ServiceMetrics, stack: contextlib.AsyncExitStack) -> None:
        self.spec, self.settings, self.platform, self.metrics = spec, settings, platform, metrics
        self._stack = stack
        self._redis: aioredis.Redis | None = None
        self._publisher: EventPublisher | None = None
        self._emitter: EventEmitter | None = None
        self._background: list[asyncio.Task] = []
        self._draining: list[Callable[[], object]] = []

    async def start(self, part: P) -> P:
        """Start ``part`` now and stop it at shutdown, before anything started earlier."""
        await part.start()
        self._stack.push_async_callback(part.stop)
        return part

    def on_stop(self, close: Callable[[], Awaitable[object]]) -> None:
        """Await ``close()`` at shutdown, before the parts started earlier stop (a part with no start)."""
        self._stack.push_async_callback(close)

    def redis(self) -> aioredis.Redis:
        """The service's Redis client (closed at shutdown, after every part that uses it)."""
        if self._redis is None:
            self._redis = redis_client(self.platform)
            self._stack.push_async_callback(self._redis.aclose)
        return self._redis

    def s3(self, *, max_connections: int = 64) -> Minio:
        return s3_client(self.platform, max_connections=max_connections)

    async def publisher(self) -> EventPublisher:
        """A started publisher for events that may be lost under pressure (predictions); domain
        events go through :meth:`emitter`."""
        if self._publisher is None:
            self._publisher = await self.start(
                EventPublisher(self.platform, source=self.spec.event_source, metrics=self.metrics))
        return self._publisher

    async def emitter(self) -> EventEmitter:
        """The emitter the core announces its changes through: every event is fsync'd to the outbox
        under ``settings.home`` before ``emit`` returns, and published in the background, at least once.

        Raises:
            ValueError: the service's settings have no ``home`` directory for the outbox.
        """
        if self._emitter is None:
            home = getattr(self.settings, "home", None)
            if not isinstance(home, Path):
                raise ValueError(f"{self.spec.name}: an emitter needs a `home` setting (the outbox lives there)")
            outbox = await self.start(Outbox(home / "outbox", await self.publisher(), self.metrics))
            self._emitter = OutboxEmitter(outbox, source=self.spec.event_source)
        return self._emitter

    def run_in_background(self, run: Callable[[], Awaitable[object]], *, name: str,
                          stop: Callable[[], Awaitable[object]] | None = None) -> asyncio.Task:
        """Run ``run()`` (a consumer loop, an expiry sweep) until shutdown. At shutdown ``stop()``
        asks it to finish what it has in hand (else it is cancelled), before the parts started earlier
        stop. If it ends on its own with an error, the service shuts down and exits with that error,
        so a supervisor restarts it instead of leaving a half-working process."""
        task = asyncio.create_task(run(), name=name)
        self._background.append(task)

        async def finish() -> None:
            try:
                if stop is not None:
                    await stop()
                    await asyncio.wait([task])  # it finishes what it has in hand, uncancelled
            finally:
                await cancel_and_wait(task)  # a failure is re-raised: the exit stack carries it out of run_service

        self._stack.push_async_callback(finish)
        return task

    def on_draining(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` when shutdown begins, before the server drains (stop taking new work)."""
        self._draining.append(callback)

    async def _wait_for_end(self, until: Awaitable[object]) -> None:
        """Until ``until`` is done, or a background task ends (its error is raised at teardown)."""
        waiters = {asyncio.ensure_future(until), *self._background}
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for task in waiters - set(self._background):
            task.cancel()
        for task in done & set(self._background):
            if task.cancelled() or task.exception() is None:
                log.warning("%s ended on its own; shutting the service down", task.get_name())
            else:
                log.error("%s stopped with an error; shutting the service down", task.get_name(),
                          exc_info=task.exception())
        for callback in self._draining:
            callback()


async def serve(spec: ServiceSpec, build: Build, *, settings: ServiceSettings, platform: PlatformSettings,
                metrics: ServiceMetrics | None = None, until: Awaitable[object] | None = None) -> None:
    """Start the service, serve until ``until`` is done (default: SIGINT or SIGTERM) or a background
    part ends, then stop everything in reverse. The service's ``home`` (when its settings have one) is
    made mode 0700 first: what a service keeps there is not for the jobs that run on its machine."""
    async with contextlib.AsyncExitStack() as stack:
        metrics = metrics or ServiceMetrics(spec.name)
        if isinstance(home := getattr(settings, "home", None), Path):
            private_dir(home)
        await ensure_topics(platform, spec.topics)
        context = ServiceContext(spec, settings, platform, metrics, stack)
        registrations = await build(context)
        await context.start(GrpcServer(settings=settings, platform=platform, metrics=metrics,
                                       registrations=registrations))
        await context._wait_for_end(until if until is not None else wait_for_signal())


def run_service(spec: ServiceSpec, build: Build) -> None:
    """A service's ``main()``: read and validate its settings (a bad value stops it with the variable
    named), configure logging, and :func:`serve`. A bad setting exits with status 1 and one line per
    problem naming the variable and the rule, never the value (secrets among them)."""
    platform = read_settings(spec.name, PlatformSettings)
    settings = read_settings(spec.name, spec.settings)
    configure_logging(spec.name, level=platform.log_level, fmt=platform.log_format)
    asyncio.run(serve(spec, build, settings=settings, platform=platform))


def read_settings(service: str, settings_class: type[T]) -> T:
    """``settings_class()`` from the environment; refused settings exit the process with
    :func:`settings_error_message` (status 1), never with pydantic's text, which may quote the values."""
    try:
        return settings_class()
    except ValidationError as error:
        raise SystemExit(settings_error_message(service, error,
                                                settings_class.model_config.get("env_prefix", ""))) from None


def settings_error_message(service: str, error: ValidationError, prefix: str) -> str:
    """Each variable that was refused and the rule it broke, built from ``error.errors()`` without its
    ``input_value``, so no value read from the environment (a token, a key, a Redis password) shows."""
    lines = [f"{service}: refusing to start, {error.error_count()} bad setting(s):"]
    for problem in error.errors(include_url=False, include_input=False, include_context=False):
        loc = ".".join(str(part) for part in problem["loc"])
        where = f"{prefix}{loc.upper()}" if loc else "settings"
        lines.append(f"  {where}: {problem['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)
