"""Keep the local platform's processes alive: restart a part that dies, give up on one that keeps dying.

Two layers, so the decision can be tested without processes:

- the core, transport- and process-free: :class:`RestartPolicy` decides, from a part's recent deaths,
  whether to restart it and after how long (capped backoff from :class:`opml_common.retry.Backoff`),
  and :class:`PartStatus` is the state of one part (RUNNING / RESTARTING / FAILED, restarts, last exit
  code, pid) changed only through its ``started`` / ``died`` / ``stopped`` methods;
- :class:`Supervisor`, the process-watching loop: a thread polls every part's process; a part that
  died is restarted in a thread of its own, so a service that takes a minute to report SERVING
  never delays noticing (or restarting) the others.

A part is "keeps dying" when it died ``max_deaths`` times within ``window_s`` seconds (a failed start
counts as a death): it is marked FAILED, logged, and left alone, never restarted forever.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Self

from opml_common.errors import InvalidArgument
from opml_common.retry import Backoff

log = logging.getLogger(__name__)

DEFAULT_MAX_DEATHS = 5
DEFAULT_WINDOW_S = 300.0
DEFAULT_BACKOFF = Backoff(base_s=0.5, max_s=30.0)


class State(enum.StrEnum):
    STARTING = "STARTING"      # first start in progress
    RUNNING = "RUNNING"        # started and ready (SERVING, listening, /-/ready)
    RESTARTING = "RESTARTING"  # died; waiting out the backoff or starting again
    FAILED = "FAILED"          # kept dying: no more restarts
    STOPPED = "STOPPED"        # stopped on purpose


# -- core: no processes, no clock of its own ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When to restart a part that died, and when to give up.

    A part that died ``max_deaths`` times within the last ``window_s`` seconds is FAILED. Otherwise
    the k-th death within the window (k = 1, 2, ...) is followed by a restart after
    ``backoff.delay(k - 1)`` seconds: deaths long ago do not lengthen the wait.

    Raises:
        InvalidArgument: from the constructor, naming the field, when a value is out of range.
    """

    max_deaths: int = DEFAULT_MAX_DEATHS
    window_s: float = DEFAULT_WINDOW_S
    backoff: Backoff = DEFAULT_BACKOFF

    def __post_init__(self) -> None:
        if isinstance(self.max_deaths, bool) or not isinstance(self.max_deaths, int) or self.max_deaths < 1:
            raise InvalidArgument("max_deaths", f"`max_deaths` must be an integer >= 1, but got {self.max_deaths!r}.")
        if isinstance(self.window_s, bool) or not isinstance(self.window_s, int | float) \
                or not 0 < self.window_s < float("inf"):
            raise InvalidArgument("window_s", f"`window_s` must be a number of seconds > 0, but got {self.window_s!r}.")

    def recent(self, deaths: Sequence[float], now: float) -> list[float]:
        """The deaths (monotonic times) that lie within the window ending at ``now``."""
        return [t for t in deaths if now - t < self.window_s]

    def restart_delay(self, deaths: Sequence[float], now: float) -> float | None:
        """Seconds to wait before restarting a part with these deaths (the latest included), or
        None: it keeps dying, give up."""
        recent = self.recent(deaths, now)
        if len(recent) >= self.max_deaths:
            return None
        return self.backoff.delay(max(len(recent) - 1, 0))


@dataclass
class PartStatus:
    """The supervision state of one part, changed only by the supervisor's events.

    ``restarts`` counts the restarts begun (not the first start); ``deaths`` holds the monotonic
    times of the deaths within the policy's window.
    """

    name: str
    kind: str  # "service" or "infra"
    state: State = State.STARTING
    pid: int | None = None
    restarts: int = 0
    last_exit_code: int | None = None
    deaths: deque[float] = field(default_factory=deque)

    def started(self, pid: int | None) -> None:
        """The part is ready (its first start or a restart)."""
        if self.state is not State.FAILED:
            self.state = State.RUNNING
            self.pid = pid

    def restarting(self) -> None:
        """A restart begins now (after the backoff)."""
        self.restarts += 1
        self.state = State.RESTARTING

    def died(self, now: float, exit_code: int | None, policy: RestartPolicy) -> float | None:
        """The part's process exited (or failed to start): record it and return the restart delay,
        or None when the part keeps dying (its state becomes FAILED)."""
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] >= policy.window_s:  # older ones no longer count
            self.deaths.popleft()
        self.last_exit_code = exit_code
        self.pid = None
        delay = policy.restart_delay(self.deaths, now)
        self.state = State.FAILED if delay is None else State.RESTARTING
        return delay

    def stopped(self) -> None:
        if self.state is not State.FAILED:
            self.state = State.STOPPED
        self.pid = None

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "state": str(self.state), "pid": self.pid,
                "restarts": self.restarts, "last_exit_code": self.last_exit_code}


# -- the process-watching loop -------------------------------------------------------------------


class Process(Protocol):
    """What the supervisor needs of a process wrapper (ServiceProcess, InfraProcess, PrometheusServer)."""

    process: object  # a subprocess.Popen while it runs (None before the first start)

    def start(self) -> object:
        """Start (a no-op while running) and block until ready; raise if it died or timed out."""

    def stop(self) -> None:
        """Stop gracefully; idempotent."""


@dataclass
class Part:
    """One supervised process and what ``opml status`` shows about it."""

    name: str
    kind: str  # "service" or "infra"
    process: Process
    log_path: Path
    ports: Mapping[str, int] = field(default_factory=dict)
    version: str = ""
    probe: Mapping[str, str] = field(default_factory=dict)  # how `opml status` checks health live

    def popen(self):
        return getattr(self.process, "process", None)


class Supervisor:
    """Starts parts in order, restarts the ones that die, stops them in reverse order.

    Side effects:
        ``start()``: starts each part (blocking until it is ready; a part that fails its first start
        stops those already started and raises), then the watcher thread. Idempotent.
        ``stop()``: no more restarts; every part stopped, the last added first; the threads joined.
        Idempotent.
        ``on_change(statuses)`` is called (under the supervisor's lock) after every state change.
    """

    def __init__(self, parts: Sequence[Part], *, policy: RestartPolicy = RestartPolicy(),
                 on_change: Callable[[list[tuple[Part, PartStatus]]], None] | None = None,
                 poll_interval_s: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
        names = [part.name for part in parts]
        if len(set(names)) != len(names):
            raise InvalidArgument("parts", f"`parts` must have unique names, but got {names}.")
        self.policy = policy
        self._parts = list(parts)
        self._status = {part.name: PartStatus(part.name, part.kind) for part in parts}
        self._on_change = on_change
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._restarters: dict[str, threading.Thread] = {}

    def status(self, name: str) -> PartStatus:
        return self._status[name]

    def snapshot(self) -> list[tuple[Part, PartStatus]]:
        with self._lock:
            return [(part, self._status[part.name]) for part in self._parts]

    def start(self) -> None:
        if self._watcher is not None:
            return
        started: list[Part] = []
        try:
            for part in self._parts:
                part.process.start()
                started.append(part)
                self._change(part, lambda status, part=part: status.started(_pid(part)))
        except BaseException:
            for part in reversed(started):
                part.process.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="supervisor-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        # A restart in flight ends when its process is stopped (its start then fails, quietly); one
        # that spawned after this stop stops its own process (it checks ``_stopping`` after starting).
        for part in reversed(self._parts):
            part.process.stop()
            self._change(part, PartStatus.stopped)
        with self._lock:
            threads, self._restarters = list(self._restarters.values()), {}
        for thread in threads:
            thread.join()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _change(self, part: Part, change: Callable[[PartStatus], object]) -> object:
        with self._lock:
            result = change(self._status[part.name])
            if self._on_change is not None:
                try:
                    self._on_change(self.snapshot())
                except Exception:  # a state file that cannot be written must not stop supervision
                    log.exception("writing the supervision state failed")
            return result

    def _watch(self) -> None:
        while not self._stopping.wait(self._poll_interval_s):
            for part in self._parts:
                status = self._status[part.name]
                if status.state is not State.RUNNING:
                    continue  # restarting (its thread watches it), failed or stopped
                popen = part.popen()
                code = popen.poll() if popen is not None else None
                if popen is None or code is None:
                    continue
                self._died(part, code, "exited")

    def _died(self, part: Part, code: int | None, how: str) -> None:
        """The watcher saw ``part`` exit: record it and hand the part to a restart thread of its own."""
        delay = self._record_death(part, code, how)
        if delay is None:
            return
        thread = threading.Thread(target=self._restart, args=(part, delay), name=f"restart-{part.name}", daemon=True)
        with self._lock:
            if self._stopping.is_set():
                return
            self._restarters[part.name] = thread
        thread.start()

    def _record_death(self, part: Part, code: int | None, how: str) -> float | None:
        """Record a death; the restart delay, or None (FAILED, or the supervisor is stopping)."""
        if self._stopping.is_set():
            return None
        delay = self._change(part, lambda status: status.died(self._clock(), code, self.policy))
        if delay is None:
            log.error("%s %s %s (exit code %s): it died %d times within %gs, so it is FAILED and not restarted "
                      "again; its log is %s", part.kind, part.name, how, code, self.policy.max_deaths,
                      self.policy.window_s, part.log_path)
            return None
        log.warning("%s %s %s (exit code %s); restart %d in %.1fs (log %s)", part.kind, part.name, how, code,
                    self._status[part.name].restarts + 1, delay, part.log_path)
        return delay

    def _restart(self, part: Part, delay: float | None) -> None:
        """Wait out the backoff, start the part again; repeat while it fails to start, until FAILED."""
        while delay is not None:
            if self._stopping.wait(delay):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self._change(part, PartStatus.restarting)
            try:
                part.process.start()
            except Exception as exc:  # noqa: BLE001 - any failed start is a death of the part
                if self._stopping.is_set():
                    return
                popen = part.popen()
                code = popen.poll() if popen is not None else None
                first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
                delay = self._record_death(part, code, f"failed to start ({first_line})")
                continue
            if self._stopping.is_set():
                part.process.stop()
                return
            pid = _pid(part)
            self._change(part, lambda status, pid=pid: status.started(pid))
            log.warning("%s %s restarted (pid %s, restart %d)", part.kind, part.name, pid,
                        self._status[part.name].restarts)
            return


def _pid(part: Part) -> int | None:
    popen = part.popen()
    return getattr(popen, "pid", None)
