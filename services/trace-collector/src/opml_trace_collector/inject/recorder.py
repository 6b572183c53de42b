"""The hot path: what a patched TensorFlow call does around each step. O(1), no lock, no I/O.

A step appends one tuple to a deque (thread-safe append/popleft) that the sender drains. Nested
calls (Keras's own tf.functions inside ``fit``'s step, Session.run inside MonitoredSession.run)
are not steps: only the outermost call counts. "Inside a step" is process-wide, not per thread,
because distribution strategies run the replica functions in threads of their own while the step
runs (so a call made by another thread during a step is not a step either). Time the job's thread
spends in a dataset iterator's ``next`` outside any step is input wait, charged to the next step.

The end of a Keras epoch (once per epoch, not per step) appends its ``logs`` to a second deque and
tells ``epoch_observer`` (the tracer wakes its sender, so epochs reach the bus without waiting for the
next interval: an early-stopping controller acts on them).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, Protocol

# StepKind numbers of protos/opml/traces/v1/events.proto (kept here so the hot path imports no proto).
TRAIN, EVALUATE, PREDICT, SESSION_RUN, FUNCTION = 1, 2, 3, 4, 5

_perf = time.perf_counter
_wall = time.time
_new_tuple = tuple.__new__


class Step(NamedTuple):
    step: int
    kind: int
    signature: str
    start_time: float     # seconds since the epoch
    duration_s: float
    input_wait_s: float
    examples: int


class Epoch(NamedTuple):
    epoch: int
    fit: int              # which fit call of the process, from 0
    time: float           # seconds since the epoch
    logs: dict            # a shallow copy of what Keras handed its callbacks (converted on the sender's thread)


class StepObserver(Protocol):
    """Told of every recorded step, in the job's thread (an armed capture)."""

    def after_step(self, step: Step) -> None: ...


class _Local(threading.local):
    in_next = False       # inside an iterator's __next__ (nested iterators count once)
    input_wait = 0.0      # iterator time since the last step, charged to the next one
    api = None            # the Keras API being run: (signature, examples per step)
    tape_start = None     # eager custom loop: (perf, wall) when the step's GradientTape opened


class Recorder:
    """Counts and times steps; ``enabled`` is the global on/off the control poller sets."""

    def __init__(self) -> None:
        self.enabled = True
        self.running = False      # a step is being timed (anywhere in the process)
        self.train_mark = False   # an optimizer applied gradients during the current step
        self.steps: deque[Step] = deque()
        self.observer: StepObserver | None = None
        self.local = _Local()
        self._next_step = [0] * 6  # per StepKind
        self.total = 0
        self.epochs: deque[Epoch] = deque()
        self.epoch_observer: Callable[[], None] | None = None
        self.fits = 0  # fit calls begun (the current one is fits - 1)

    def begin(self) -> float | None:
        """Start timing a step; None when tracing is off or a step already runs."""
        if self.running or not self.enabled:
            return None
        self.running = True
        self.train_mark = False
        return _perf()

    def abort(self) -> None:
        """The call raised: it was no step (e.g. StopIteration at the end of an epoch)."""
        self.running = False

    def end(self, started: float, kind: int, signature: str, examples: int = 0) -> None:
        duration = _perf() - started
        local = self.local
        self.running = False
        wait, local.input_wait = local.input_wait, 0.0
        counters = self._next_step
        number = counters[kind]
        counters[kind] = number + 1
        self.total += 1
        # tuple.__new__ is what Step(...) runs, minus a Python-level call (~0.3 µs of ~1 µs per step)
        step = _new_tuple(Step, (number, kind, signature, _wall() - duration, duration, wait, examples))
        self.steps.append(step)
        observer = self.observer
        if observer is not None:
            observer.after_step(step)

    def fit_began(self) -> None:
        """A Keras ``fit`` call starts: the epochs it ends carry its number."""
        self.fits += 1

    def epoch_end(self, epoch: int, logs: dict | None) -> None:
        """A Keras epoch ended with ``logs`` (job's thread, once per epoch)."""
        if not self.enabled:
            return
        self.epochs.append(Epoch(int(epoch), max(self.fits - 1, 0), _wall(), dict(logs) if logs else {}))
        observer = self.epoch_observer
        if observer is not None:
            observer()

    def drain_epochs(self) -> list[Epoch]:
        """Take the recorded epochs (the sender's thread)."""
        epochs = self.epochs
        return [epochs.popleft() for _ in range(len(epochs))]

    def drain(self) -> list[Step]:
        """Take the recorded steps (the sender's thread)."""
        steps = self.steps
        return [steps.popleft() for _ in range(len(steps))]
