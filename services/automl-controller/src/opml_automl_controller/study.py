"""One experiment's Optuna study: a JournalStorage on Redis, its sampler and pruner, ask and tell.

Every Optuna call blocks (Redis round trips, the samplers' fitting), so the controller makes them
on a thread; this class only gathers them. The journal is the history a restarted controller's
sampler continues from.
"""

from __future__ import annotations

import json
import time
from collections.abc import Generator
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages.journal import JournalRedisBackend, JournalStorage
from optuna.trial import FrozenTrial, TrialState

from opml_automl_controller.algorithms import direction, fixed_parameters, make_pruner, make_sampler, search_space
from opml_automl_controller.experiment import ExperimentSpec
from opml_common.errors import NotFound

optuna.logging.set_verbosity(optuna.logging.WARNING)

END_ATTR = "opml_end"
"""User attribute a trial gets before its job is cancelled: ``pruned`` or ``killed`` (so a restart
between the cancel and the tell still knows why the job was cancelled)."""
ERROR_ATTR = "opml_error"
JOB_ATTR = "opml_job"


class DeletableJournal(JournalRedisBackend):
    """Optuna's Redis journal, whose reads end when the journal is deleted under them.

    Optuna reads the journal's length, then each entry, and waits for an entry it does not find (up
    to 10 s at a time, forever). An experiment's delete removes its journal in one transaction, so a
    read that began before it (a trial's report, on a thread) waited forever for entries that were gone,
    and the thread never ended (a stop then hung joining it). Entries and length are written together
    (Optuna's append is one Lua call), so an entry missing while the length is gone means the journal
    was deleted: the read raises NotFound.
    """

    def read_logs(self, log_number_from: int) -> Generator[dict[str, Any], None, None]:
        length_key = f"{self._prefix}:log_number"
        last = self._redis.get(length_key)
        if last is None:
            return
        for log_number in range(log_number_from, int(last) + 1):
            wait_s = 0.1
            while (log := self._redis.get(self._key_log_id(log_number))) is None:
                if not self._redis.exists(length_key):
                    raise NotFound(f"journal {self._prefix!r} was deleted while it was read (its experiment was)")
                time.sleep(wait_s)  # as Optuna's: an entry not written yet (a cluster's non-atomic append)
                wait_s = min(wait_s * 2, 10)
            try:
                yield json.loads(log)
            except json.JSONDecodeError:
                if log_number != int(last):  # a torn last entry is Optuna's to skip
                    raise


class ExperimentStudy:
    def __init__(self, spec: ExperimentSpec, *, redis_url: str, journal_prefix: str) -> None:
        self.spec = spec
        self._backend = DeletableJournal(redis_url, prefix=journal_prefix)
        self.study = optuna.create_study(storage=JournalStorage(self._backend), study_name=spec.name, direction=direction(spec),
                                         load_if_exists=True)
        self.study.sampler = make_sampler(spec, trials_so_far=len(self.trials()))
        self.study.pruner = make_pruner(spec)
        self._space = search_space(spec)
        self._fixed = fixed_parameters(spec)

    def close(self) -> None:
        """Disconnect the journal's Redis connections (each run of an experiment opens its own pool)."""
        self._backend._redis.close()  # the backend has no close of its own

    def trials(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False)

    def end_of(self, number: int) -> str | None:
        """Why the trial's job was cancelled (:data:`END_ATTR`), if it was."""
        return self.trials()[number].user_attrs.get(END_ATTR)

    @property
    def pruner_name(self) -> str:
        return type(self.study.pruner).__name__

    def ask(self, job_id_of: Any) -> tuple[int, dict[str, Any]]:
        """A new trial: its number and parameters (sampled, plus the fixed ones); the job id it will
        have (``job_id_of(number)``) is stored on it before this returns."""
        trial = self.study.ask(fixed_distributions=self._space)
        trial.set_user_attr(JOB_ATTR, job_id_of(trial.number))
        return trial.number, {**trial.params, **self._fixed}

    def completed(self, frozen: FrozenTrial) -> FrozenTrial:
        """A running trial with every parameter of the space: Optuna's ask stores a new trial, then
        each sampled parameter in a journal entry of its own, so a controller killed in between
        leaves a trial with some; the rest are sampled now, as the ask would have."""
        missing = {name: d for name, d in self._space.items() if name not in frozen.params}
        if not missing or frozen.state is not TrialState.RUNNING:
            return frozen
        trial = self._trial(frozen.number)
        for name, distribution in missing.items():
            trial._suggest(name, distribution)  # what study.ask(fixed_distributions=...) does per parameter
        return self.study._storage.get_trial(trial._trial_id)

    def _trial(self, number: int) -> optuna.Trial:
        storage = self.study._storage
        return optuna.Trial(self.study, storage.get_trial_id_from_study_id_trial_number(self.study._study_id, number))

    def report(self, number: int, value: float, step: int) -> bool:
        """Report the ``step``-th objective value; whether the pruner says to stop the trial."""
        trial = self._trial(number)
        trial.report(value, step)
        return trial.should_prune()

    def mark(self, number: int, key: str, value: str) -> bool:
        """Set a user attribute of a running trial; False when the trial has finished already."""
        try:
            self._trial(number).set_user_attr(key, value)
        except UpdateFinishedTrialError:
            return False
        return True

    def tell(self, number: int, *, value: float | None = None, state: TrialState = TrialState.COMPLETE) -> None:
        self.study.tell(number, value if state is TrialState.COMPLETE else None, state=state,
                        skip_if_finished=True)

    def search_space_exhausted(self) -> bool:
        """Grid only: every combination has been asked."""
        sampler = self.study.sampler
        return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(self.study)
