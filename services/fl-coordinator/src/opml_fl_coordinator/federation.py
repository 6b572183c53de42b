"""One federation's rounds, transport-free and clock-free: the same code under the gRPC service
(wall time) and the simulator (virtual time).

Every method takes ``now`` (seconds on the caller's clock); nothing sleeps. The driver calls
:meth:`Federation.poll` after each event and at :meth:`Federation.next_deadline`, and poll moves
the federation on: starts the first round once ``min_clients`` have joined and the starting model
is known, closes a round when every selected client answered or its deadline passed, aggregates,
evaluates, and starts the next. Clients pull their task (:meth:`task_for`) and hand in an update
(:meth:`submit`) or a failure (:meth:`fail`).

Synchronous rounds (FedAvg's): select, configure, wait until all answered or the deadline, drop
the rest. Semi-asynchronous mode (after FedBuff, Nguyen et al., 2022): up to ``concurrency``
clients train at once, each on the newest model when it starts; updates are buffered as they
arrive and every ``buffer_size`` of them make a new version. A stale update (started ``s``
versions ago) is rebased on the current model with its change scaled by ``(1 + s) ** -a``, so late
work still counts, less; one older than ``max_staleness`` is refused.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from opml_fl_coordinator.config import FederationConfig
from opml_fl_coordinator.profiles import ProfileBook
from opml_fl_coordinator.selection import Selection
from opml_fl_coordinator.strategy import Failure, FitRes, Strategy
from opml_fl_coordinator.strategy.base import Config, Scalar
from opml_fl_coordinator.validation import UpdateValidator
from opml_fl_coordinator.weights import add, cast_like, subtract
from opml_fl_coordinator_contract.weights import Weights

MAX_CONSECUTIVE_DROPS = 3
"""A client that missed this many tasks in a row counts as gone until it joins again."""


class Phase(enum.Enum):
    WAITING = "waiting"      # for the starting model or for min_clients
    RUNNING = "running"
    COMPLETED = "completed"  # every round done, or the target accuracy reached
    STOPPED = "stopped"      # by a caller


@dataclass(frozen=True)
class Task:
    """What one client is asked to do: ``kind`` is ``fit``, or ``init`` (send your starting weights)."""

    task_id: int
    kind: str
    client_id: str
    round: int
    version: int
    weights: Weights | None
    config: Config
    issued_at: float
    deadline_at: float


@dataclass
class RoundRecord:
    """A completed round (an aggregation, in semi-async mode) as it is shown, saved and published."""

    number: int
    started_at: float
    ended_at: float
    participants: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    tier: int | None = None
    num_examples: int = 0
    aggregated: bool = False
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.ended_at - self.started_at


class FederationListener:
    """What a federation announces (the service publishes events and saves state; the simulator
    records). Each default does nothing."""

    def round_started(self, federation: Federation, number: int, clients: list[str], now: float) -> None: ...

    def round_completed(self, federation: Federation, record: RoundRecord) -> None: ...

    def client_dropped(self, federation: Federation, client_id: str, number: int, reason: str) -> None: ...

    def update_rejected(self, federation: Federation, client_id: str, number: int, reason: str) -> None: ...

    def finished(self, federation: Federation, reason: str) -> None: ...


@dataclass
class _Open:
    """The round being run (sync), or the buffer being filled (semi-async)."""

    number: int
    started_at: float
    tier: int | None = None
    selected: list[str] = field(default_factory=list)
    results: dict[str, FitRes] = field(default_factory=dict)
    norms: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


class Federation:
    """One federation: its model, clients, rounds and history (see the module's docstring)."""

    def __init__(self, federation_id: str, config: FederationConfig, *, strategy: Strategy, selection: Selection,
                 validator: UpdateValidator | None = None, listener: FederationListener | None = None,
                 weights: Weights | None = None, created_at: float = 0.0) -> None:
        self.federation_id = federation_id
        self.config = config
        self.strategy = strategy
        self.selection = selection
        self.validator = validator or UpdateValidator(
            max_update_norm=config.validation.max_update_norm,
            norm_outlier_factor=config.validation.norm_outlier_factor)
        self.listener = listener or FederationListener()
        self.created_at = created_at
        self.profiles = ProfileBook()
        self.phase = Phase.WAITING
        self.reason = ""
        self.version = 0
        self.history: list[RoundRecord] = []
        self.weights: Weights | None = None
        self._tasks: dict[str, Task] = {}
        self._task_ids = itertools.count(1)
        self._open: _Open | None = None
        self._drop_streak: dict[str, int] = {}
        self._init_asked: str | None = None
        self._restored = False
        self._resume_at: float | None = None
        if weights is not None:
            self._set_initial(weights)

    # --- clients -------------------------------------------------------------------------------

    def join(self, client_id: str, now: float, labels: dict[str, str] | None = None, *,
             num_examples: int | None = None) -> None:
        """A client is ready for tasks (again). Joining twice is harmless. ``num_examples`` is the
        example count it declares (its dataset's size; None keeps its earlier declaration): its
        updates may claim at most that times their task's epochs (:meth:`examples_problem`)."""
        self.profiles.join(client_id, now, labels, num_examples)
        self._drop_streak[client_id] = 0
        self.poll(now)

    def leave(self, client_id: str, now: float) -> None:
        """A client is gone: its task, if any, counts as dropped."""
        if client_id not in self.profiles.clients:
            return
        self.profiles.leave(client_id)
        if client_id in self._tasks:
            self._drop(client_id, "left the federation", now)
        self.poll(now)

    def task_for(self, client_id: str) -> Task | None:
        """The client's outstanding task (None: nothing for it now; ask again later)."""
        return self._tasks.get(client_id)

    def current_task(self, client_id: str, task_id: int) -> Task | None:
        """The client's task ``task_id`` while an update of it is awaited (None: late, or not its)."""
        task = self._tasks.get(client_id)
        return task if task is not None and task.task_id == task_id else None

    def examples_problem(self, client_id: str, task: Task, num_examples: int) -> str | None:
        """Why an update of ``task`` may not claim ``num_examples``, a rule about the field (None:
        it may). A count is of
        examples processed, each epoch passing once over the data, so a fit may claim from 1 to
        what the client declared when it joined (at most ``validation.max_examples``) times the
        task's epochs: a member cannot outweigh the others by saying it trained on more."""
        if task.kind != "fit":
            return None  # the starting weights are nobody's training
        declared = self.profiles.clients[client_id].num_examples
        if declared is None:
            return f"must be declared when the client joins, but {client_id!r} declared none"
        declared = min(declared, self.config.validation.max_examples)
        epochs = max(1, int(task.config.get("epochs", 1)))
        if not 1 <= num_examples <= declared * epochs:
            return (f"must be in [1, {declared * epochs}] ({declared} declared at join x {epochs} epochs), but "
                    f"got {num_examples}")
        return None

    def refuse(self, client_id: str, task_id: int, reason: str, now: float) -> None:
        """The update of the client's current task ``task_id`` is refused before it was read whole
        (too many examples claimed, arrays not the model's): the task ends, rejected with ``reason``."""
        if self.current_task(client_id, task_id) is not None:
            del self._tasks[client_id]
            self._reject(client_id, reason)
            self.poll(now)

    def submit(self, client_id: str, task_id: int, weights: Weights, num_examples: int,
               metrics: dict[str, Scalar], now: float) -> str | None:
        """Hand in the update of task ``task_id``. Returns None when accepted, else why not (the
        update is then left out; the client's profile counts the rejection)."""
        task = self.current_task(client_id, task_id)
        if task is None:
            return f"task {task_id} is not {client_id!r}'s current task (late, or the round closed)"
        examples_problem = self.examples_problem(client_id, task, num_examples)
        if examples_problem is not None:
            reason = f"num_examples {examples_problem}"
            self.refuse(client_id, task_id, reason, now)
            return reason
        del self._tasks[client_id]
        if task.kind == "init":
            reason = self._initial_problem(weights)
            if reason is None:
                self._set_initial(weights)
            else:
                self._reject(client_id, reason)
            self.poll(now)
            return reason
        assert task.weights is not None
        norm, reason = self.validator.check(weights, task.weights)
        staleness = self.version - task.version
        if reason is None and staleness > self.config.semi_async.max_staleness:
            reason = f"update is {staleness} versions stale (max_staleness {self.config.semi_async.max_staleness})"
        accuracy = metrics.get("eval_accuracy")
        self.profiles.completed(client_id, now - task.issued_at,
                                float(accuracy) if isinstance(accuracy, (int, float)) else None)
        self._drop_streak[client_id] = 0
        if reason is not None:
            self._reject(client_id, reason)
        else:
            update = cast_like(weights, task.weights)  # the model's dtypes, as the validator took it
            if staleness > 0:  # rebase a stale change on the current model, damped by its age
                damp = (1.0 + staleness) ** -self.config.semi_async.staleness_exponent
                update = cast_like(add(self.weights, subtract(update, task.weights), damp), update)
            assert self._open is not None
            self._open.results[client_id] = FitRes(client_id, update, int(num_examples), dict(metrics), staleness)
            self._open.norms[client_id] = norm
        self.poll(now)
        return reason

    def fail(self, client_id: str, task_id: int, reason: str, now: float) -> None:
        """The client says its task failed (``reason`` is its own words, shown as such)."""
        task = self._tasks.get(client_id)
        if task is not None and task.task_id == task_id:
            self._drop(client_id, f"client reported: {reason[:200]}", now)
            self.poll(now)

    def stop(self, now: float, reason: str = "stopped") -> None:
        if self.phase in (Phase.COMPLETED, Phase.STOPPED):
            return
        self._tasks.clear()
        self._open = None
        self._finish(Phase.STOPPED, reason)

    # --- driving -------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`poll` must next be called even if nothing happens (None: only on events)."""
        deadlines = [t.deadline_at for t in self._tasks.values()]
        if self._resume_at is not None and self.phase is Phase.WAITING:
            deadlines.append(self._resume_at)
        return min(deadlines) if deadlines else None

    def poll(self, now: float) -> None:
        """Move on: expire late tasks, close what is complete, start what can start."""
        if self.phase in (Phase.COMPLETED, Phase.STOPPED):
            return
        for client_id, task in list(self._tasks.items()):
            if now >= task.deadline_at:
                self._drop(client_id, f"missed the round deadline ({self.config.round_deadline_s:g} s)", now)
        if self.weights is None:
            self._ask_initial(now)
            return
        if self.phase is Phase.WAITING:
            present = len(self.profiles.present())
            if self._restored and self._resume_at is None:
                self._resume_at = now + self.config.round_deadline_s
            resume = self._resume_at is not None and now >= self._resume_at and present >= 1
            if present < self.config.min_clients and not resume:
                return
            self.phase = Phase.RUNNING
            self._resume_at = None
        if self.config.mode == "sync":
            self._poll_sync(now)
        else:
            self._poll_async(now)

    def _poll_sync(self, now: float) -> None:
        if self._open is not None and not any(t.kind == "fit" for t in self._tasks.values()):
            self._close(now)
        if self._open is None and self.phase is Phase.RUNNING:
            candidates = self.profiles.present()
            if not candidates:
                return
            number = self.version + 1
            chosen, tier = self.selection.select(number, candidates)
            self._open = _Open(number, now, tier, chosen)
            self._issue(number, chosen, now)
            self.listener.round_started(self, number, chosen, now)

    def _poll_async(self, now: float) -> None:
        if self._open is None:
            self._open = _Open(self.version + 1, now)
        if len(self._open.results) >= self.config.semi_async.buffer_size:
            self._close(now)
            if self.phase is not Phase.RUNNING:
                return
            self._open = _Open(self.version + 1, now)
        free = self.config.semi_async.concurrency - sum(t.kind == "fit" for t in self._tasks.values())
        idle = [p for p in self.profiles.present() if p.client_id not in self._tasks]
        if free > 0 and idle:
            chosen, _ = self.selection.select(self._open.number, idle, count=free)
            self._open.selected.extend(chosen)
            self._issue(self.version + 1, chosen, now)
            if chosen:
                self.listener.round_started(self, self._open.number, chosen, now)

    def _issue(self, number: int, clients: list[str], now: float) -> None:
        assert self.weights is not None
        instructions = self.strategy.configure_fit(number, self.weights, clients)
        budget = self.config.round_deadline_s
        for ins in instructions:
            config = dict(ins.config)
            if self.config.stragglers == "partial":
                config["time_budget_s"] = budget * 0.8  # leave the upload a fifth of the time
            self.profiles.selected(ins.client_id)
            self._tasks[ins.client_id] = Task(next(self._task_ids), "fit", ins.client_id, number, self.version,
                                              ins.weights, config, now, now + budget)

    def _close(self, now: float) -> None:
        """Aggregate the open round's accepted updates, evaluate, record, and finish if done."""
        assert self._open is not None and self.weights is not None
        round_ = self._open
        self._open = None
        for client_id, reason in self.validator.outliers(round_.norms).items():
            round_.results.pop(client_id, None)
            self._reject(client_id, reason, round_)
        results = list(round_.results.values())
        failures = [Failure(c, r) for c, r in {**round_.dropped, **round_.rejected}.items()]
        if self.config.mode == "semi_async":  # strategies that track the round's model (DP) see the current one
            self.strategy.configure_fit(round_.number, self.weights, [r.client_id for r in results] or ["-"])
        aggregated, metrics = self.strategy.aggregate_fit(round_.number, results, failures) if results else (None, {})
        record = RoundRecord(round_.number, round_.started_at, now, sorted(round_.results), dict(round_.dropped),
                             dict(round_.rejected), round_.tier, sum(r.num_examples for r in results),
                             aggregated is not None)
        record.metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if "eval_accuracy" in record.metrics:
            record.metrics["client_accuracy"] = record.metrics.pop("eval_accuracy")
        if results:
            record.metrics["max_staleness"] = float(max(r.staleness for r in results))
        if aggregated is not None:
            self.weights = aggregated
        self.version += 1
        evaluated = self.strategy.evaluate(self.version, self.weights)
        if evaluated is not None:
            loss, server = evaluated
            record.metrics["loss"] = float(loss)
            record.metrics.update({k: float(v) for k, v in server.items() if isinstance(v, (int, float))})
        self.history.append(record)
        self.listener.round_completed(self, record)
        accuracy = record.metrics.get("accuracy", record.metrics.get("client_accuracy"))
        if self.config.target_accuracy is not None and accuracy is not None and accuracy >= self.config.target_accuracy:
            self._finish(Phase.COMPLETED, f"reached target accuracy {self.config.target_accuracy:g} "
                                          f"in round {record.number}")
        elif self.version >= self.config.rounds:
            self._finish(Phase.COMPLETED, f"completed {self.config.rounds} rounds")

    def _finish(self, phase: Phase, reason: str) -> None:
        self.phase, self.reason = phase, reason
        self._tasks.clear()
        self.listener.finished(self, reason)

    def _drop(self, client_id: str, reason: str, now: float) -> None:
        task = self._tasks.pop(client_id)
        self.profiles.dropped(client_id, reason, now - task.issued_at)
        streak = self._drop_streak[client_id] = self._drop_streak.get(client_id, 0) + 1
        if streak >= MAX_CONSECUTIVE_DROPS:
            self.profiles.leave(client_id)
        if self._open is not None:
            self._open.dropped[client_id] = reason
        self.listener.client_dropped(self, client_id, task.round, reason)

    def _reject(self, client_id: str, reason: str, round_: _Open | None = None) -> None:
        round_ = round_ or self._open
        self.profiles.rejected(client_id, reason)
        if round_ is not None:
            round_.rejected[client_id] = reason
            self.listener.update_rejected(self, client_id, round_.number, reason)

    # --- the starting model --------------------------------------------------------------------

    def _ask_initial(self, now: float) -> None:
        """No starting model yet: ask one present client for its initial weights (as Flower asks a
        random client when the strategy has no initial parameters). Each ask goes to the next client
        in turn, so one that fails, misses the deadline or sends bad weights does not hold the start up."""
        if any(t.kind == "init" for t in self._tasks.values()):
            return
        present = sorted(p.client_id for p in self.profiles.present())
        if present:
            after = [c for c in present if self._init_asked is None or c > self._init_asked]
            client_id = self._init_asked = (after or present)[0]
            self._tasks[client_id] = Task(next(self._task_ids), "init", client_id, 0, 0, None, {}, now,
                                          now + self.config.round_deadline_s)

    @staticmethod
    def _initial_problem(weights: Weights) -> str | None:
        if not weights:
            return "initial weights must hold at least one array"
        for index, array in enumerate(weights):
            array = np.asarray(array)
            if not np.issubdtype(array.dtype, np.floating) or not np.all(np.isfinite(array)):
                return f"initial array {index} must be finite floating point"
        return None

    def _set_initial(self, weights: Weights) -> None:
        self.weights = self.strategy.initialize([np.asarray(w) for w in weights])

    # --- durability ----------------------------------------------------------------------------

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Weights]]:
        """What a restart needs, as of the last completed round: a JSON-able document and the
        arrays (``weights`` and the strategy's state)."""
        document = {"federation_id": self.federation_id, "config": self.config.model_dump(mode="json"),
                    "created_at": self.created_at, "phase": self.phase.value, "reason": self.reason,
                    "version": self.version, "history": [asdict(r) for r in self.history],
                    "profiles": self.profiles.to_dict(), "selection": self.selection.state()}
        arrays = {"weights": list(self.weights or []), **{f"strategy.{k}": v for k, v in self.strategy.state().items()}}
        return document, arrays

    def restore(self, document: dict[str, Any], arrays: dict[str, Weights]) -> None:
        """Continue from a :meth:`snapshot`: the next round is the one after the last completed.
        Clients are known but absent until they join again; rounds resume once ``min_clients``
        are back, or one round deadline after the first call following the restore with whoever
        is back (a client that died with the old coordinator must not stall the federation).

        Raises:
            ValueError: the snapshot is of another federation, or does not fit the strategy.
        """
        if document["federation_id"] != self.federation_id:
            raise ValueError(f"snapshot of {document['federation_id']!r}, not {self.federation_id!r}")
        self.created_at = float(document["created_at"])
        self.version = int(document["version"])
        self.history = [RoundRecord(**row) for row in document["history"]]
        self.profiles = ProfileBook.from_dict(document["profiles"])
        self.selection.load_state(document["selection"])
        self.weights = None
        if arrays.get("weights"):
            self._set_initial(arrays["weights"])
            self.strategy.load_state({k.removeprefix("strategy."): v for k, v in arrays.items()
                                      if k.startswith("strategy.")})
        phase = Phase(document["phase"])
        if phase not in (Phase.COMPLETED, Phase.STOPPED) and self.version >= self.config.rounds:
            phase = Phase.COMPLETED  # saved after its last round, before it was marked completed
        self.phase = phase if phase in (Phase.COMPLETED, Phase.STOPPED) else Phase.WAITING
        self._restored = self.version > 0
        self.reason = str(document.get("reason", ""))


def new_federation(federation_id: str, config: FederationConfig, *, now: float, weights: Weights | None = None,
                   evaluate_fn=None, listener: FederationListener | None = None) -> Federation:
    """A federation with the strategy and selection policy its config names."""
    from opml_fl_coordinator.config import build_selection, build_strategy

    return Federation(federation_id, config, strategy=build_strategy(config, evaluate_fn=evaluate_fn),
                      selection=build_selection(config), listener=listener, weights=weights, created_at=now)
