"""Saving and announcing: every change is saved to Redis, then announced once (``opml.experiments.v1``).

Saved first, so a consumer that reads the controller back on an event finds the change in it. The
controller (experiments) and the trial runners (trials) write through one :class:`Records`.
"""

from __future__ import annotations

from opml_automl_controller import convert
from opml_automl_controller.experiment import ExperimentSpec
from opml_automl_controller.metrics import ControllerMetrics
from opml_automl_controller.state import ExperimentRecord, ExperimentState, ExperimentStore, TrialRecord
from opml_common.events import EventEmitter


class Records:
    """Args:
        store: experiments and trials in Redis.
        emitter: where each change is announced (the subject: the experiment's name).
        metrics: the experiments-by-state gauge, refreshed at each experiment's change.
    """

    def __init__(self, store: ExperimentStore, emitter: EventEmitter, metrics: ControllerMetrics) -> None:
        self.store = store
        self._emitter = emitter
        self._metrics = metrics

    async def announce_saved(self, record: ExperimentRecord, spec: ExperimentSpec | None) -> None:
        """The event of the experiment's record just saved (by compare-and-set, in the store), with its
        trials as stored (``spec`` None: a record that no longer parses; its event carries the record only)."""
        self.announce(record, spec, tuple(await self.store.trials(record.name)))
        await self.count()

    async def save_trial(self, trial: TrialRecord, *, announce: bool = True) -> None:
        """``announce`` False: a running trial's series saved as it grows (once a second), which is
        no change of state worth an event."""
        await self.store.put_trial(trial)
        if announce:
            self.announce_trial(trial)

    def announce_trial(self, trial: TrialRecord) -> None:
        self._emitter.emit(convert.trial_event(trial), subject=trial.experiment)

    def announce(self, record: ExperimentRecord, spec: ExperimentSpec | None, trials: tuple[TrialRecord, ...],
                 *, deleted: bool = False) -> None:
        self._emitter.emit(convert.experiment_event(record, spec, trials, deleted=deleted), subject=record.name)

    async def count(self) -> None:
        counts = dict.fromkeys(ExperimentState, 0)
        for record in await self.store.experiments():
            counts[record.state] += 1
        self._metrics.experiments(counts)
