"""Revoking each trial's upload grant once the trial has ended: :class:`GrantRevoker`.

A trial's job uploads its model itself, with a grant of its own (:mod:`.models`), valid for
``upload_grant_ttl_s`` (a day by default) from its submit. Credentials a job is given must not outlive
it, so once the trial has ended (succeeded, failed, early-stopped, killed: its job has ended, and with
it any upload of its own) the leader revokes it in the bundle-store; a finished trial's job, or whoever
read its env, is refused (UNAUTHENTICATED) from then on. The uploaded bundle stays, and the best one is
committed with the controller's own token, as before.

Never lost: the grant's id is saved on the trial's record (``upload_grants``) before its job is
submitted, and removed only once the store has revoked it; a deleted experiment's unrevoked ids move to
a set of their own (:meth:`~.state.ExperimentStore.delete`). A revocation is tried as the trial ends
(in a task of its own: the experiment's loop never waits for the store) and, while one fails or after
a start or a take-over, again at each resync, from the records: a restarted controller or a new leader
revokes what its predecessor did not. Only the leader revokes, and its record writes are fenced.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from opml_automl_controller.metrics import ControllerMetrics
from opml_automl_controller.models import ModelStore
from opml_automl_controller.state import TERMINAL_TRIALS, ExperimentStore, TrialRecord
from opml_common.errors import InvalidArgument, NotFound, OpmlError
from opml_common.lease import NotLeader

log = logging.getLogger(__name__)


class GrantRevoker:
    """Args:
        store: the trials' records (their ``upload_grants``) and the deleted experiments' unrevoked grants.
        models: the bundle-store that issued the grants.
        metrics: ``grant_revocation(outcome)``: revoked, failed (retried), dropped (never revocable).
        leading: whether this replica leads (only the leader revokes).
        check_leading: raises NotLeader when this replica no longer leads.
    """

    def __init__(self, *, store: ExperimentStore, models: ModelStore, metrics: ControllerMetrics,
                 leading: Callable[[], bool], check_leading: Callable[[], None]) -> None:
        self._store, self._models, self._metrics = store, models, metrics
        self._leading, self._check_leading = leading, check_leading
        self._tasks: set[asyncio.Task] = set()
        self._revoking: set[str] = set()
        """The job ids of the trials whose grants a task revokes now (a resync leaves them to it)."""
        self._behind = True
        """A revocation failed, or this replica has just started or taken over: the next resync reads
        every experiment's trials (else only the deleted experiments' set)."""
        self._was_leading = False

    def ended(self, trial: TrialRecord) -> None:
        """``trial`` has ended (its record saved): revoke its grants now, in a task of its own."""
        if not trial.upload_grants or trial.state not in TERMINAL_TRIALS or trial.job_id in self._revoking:
            return
        self._revoking.add(trial.job_id)
        task = asyncio.create_task(self._revoke_trial(trial), name=f"revoke {trial.job_id}'s upload grants")
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._done, trial.job_id))

    def _done(self, job_id: str, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._revoking.discard(job_id)
        if not task.cancelled() and task.exception() is not None:  # Redis: the next resync tries again
            self._behind = True
            log.error("trial %s: its upload grants' revocation failed; retried at the next resync", job_id,
                      exc_info=task.exception())

    async def resync(self) -> None:
        """The leader's periodic pass: every ended trial's grants still unrevoked (after a failure, a
        start or a take-over) and the deleted experiments'. A follower does nothing."""
        leading = self._leading()
        if leading and not self._was_leading:
            self._behind = True
        self._was_leading = leading
        if not leading:
            return
        ok = await self._revoke_deleted()
        if self._behind and ok:
            self._behind = False
            for record in await self._store.experiments():
                for trial in await self._store.trials(record.name):
                    if trial.state in TERMINAL_TRIALS and trial.upload_grants and trial.job_id not in self._revoking \
                            and not await self._revoke_trial(trial):
                        return  # the store is failing: the next resync goes on

    async def stop(self) -> None:
        """Cancel the revocations in flight (their grants stay on the records, for the next leader)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _revoke_trial(self, trial: TrialRecord) -> bool:
        """Whether every grant of ``trial`` is revoked (and removed from its record)."""
        done = [grant for grant in trial.upload_grants if await self._revoke(grant, trial.job_id)]
        if done:
            try:
                await self._store.drop_grants(trial.experiment, trial.number, done)
            except Exception as error:  # noqa: BLE001 - revoked all the same; the next pass removes them
                self._behind = True
                log.warning("trial %s: upload grants revoked but not removed from its record (%s); removed at "
                            "the next resync", trial.job_id, error)
                return False
        return len(done) == len(trial.upload_grants)

    async def _revoke_deleted(self) -> bool:
        """Whether every deleted experiment's grant is revoked (the first failure ends the pass)."""
        grants = await self._store.unrevoked_grants()
        done = []
        for grant in grants:
            if not await self._revoke(grant, "of a deleted experiment"):
                break
            done.append(grant)
        await self._store.forget_unrevoked(done)
        return len(done) == len(grants)

    async def _revoke(self, grant_id: str, whose: str) -> bool:
        """Whether ``grant_id`` is revoked (or can never be: dropped). A failure is logged, counted and
        left for the next resync."""
        try:
            self._check_leading()
        except NotLeader:
            return False  # the next leader revokes it
        try:
            await asyncio.to_thread(self._models.revoke_upload, grant_id)
        except (InvalidArgument, NotFound) as error:
            self._metrics.grant_revocation("dropped")
            log.error("upload grant %s (trial %s) cannot be revoked: %s; dropped", grant_id, whose, error.message)
            return True
        except OpmlError as error:
            self._behind = True
            self._metrics.grant_revocation("failed")
            log.warning("upload grant %s (trial %s) not revoked: %s; retried at the next resync", grant_id, whose,
                        error.message)
            return False
        self._metrics.grant_revocation("revoked")
        log.info("upload grant %s (trial %s) revoked", grant_id, whose)
        return True
