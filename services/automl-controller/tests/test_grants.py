"""The revocation of ended trials' upload grants (:class:`~opml_automl_controller.grants.GrantRevoker`)
against fakes of pure logic: a store of records in memory and a bundle-store that can be down. The
records in the real Redis are test_controller.py's; the real bundle-store refusing a revoked grant is
test_service.py's."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from opml_automl_controller.grants import GrantRevoker
from opml_automl_controller.metrics import ControllerMetrics
from opml_automl_controller.models import ModelStore
from opml_automl_controller.state import ExperimentRecord, TrialRecord, TrialState
from opml_common.errors import NotFound, Unavailable
from opml_common.lease import NotLeader


class Records:
    """Experiments' trials and the deleted experiments' unrevoked grants, in memory."""

    def __init__(self, *trials: TrialRecord, unrevoked: tuple[str, ...] = ()) -> None:
        self.records = {(t.experiment, t.number): t for t in trials}
        self.unrevoked = set(unrevoked)

    async def experiments(self) -> list[ExperimentRecord]:
        return [ExperimentRecord(name=name, uid="abc123", katib_yaml="", max_trial_count=4)
                for name in sorted({experiment for experiment, _ in self.records})]

    async def trials(self, experiment: str) -> list[TrialRecord]:
        return [t for (e, _), t in sorted(self.records.items()) if e == experiment]

    async def drop_grants(self, experiment: str, number: int, grant_ids: list[str]) -> None:
        trial = self.records[(experiment, number)]
        self.records[(experiment, number)] = replace(trial, upload_grants=[g for g in trial.upload_grants
                                                                          if g not in grant_ids])

    async def unrevoked_grants(self) -> list[str]:
        return sorted(self.unrevoked)

    async def forget_unrevoked(self, grant_ids: list[str]) -> None:
        self.unrevoked -= set(grant_ids)


class Store(ModelStore):
    """A bundle-store's revocations: ``down`` answers UNAVAILABLE; ``gone`` ids answer NOT_FOUND."""

    def __init__(self) -> None:
        self.revoked: list[str] = []
        self.down = False
        self.gone: set[str] = set()

    def grant_upload(self, *args, **kwargs):
        raise AssertionError("the revoker grants nothing")

    def commit_best(self, *args, **kwargs) -> str:
        raise AssertionError("the revoker commits nothing")

    def revoke_upload(self, grant_id: str) -> None:
        if self.down:
            raise Unavailable("bundle-store: connection refused")
        if grant_id in self.gone:
            raise NotFound("context 'automl' does not exist")
        self.revoked.append(grant_id)


class Counted(ControllerMetrics):
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def grant_revocation(self, outcome: str) -> None:
        self.outcomes.append(outcome)


class Lead:
    def __init__(self) -> None:
        self.leading = True
        self.deposed = False  # it believes it leads, but its fence has moved on

    def check(self) -> None:
        if self.deposed or not self.leading:
            raise NotLeader("the automl-controller lease moved on")


def trial(number: int, state: TrialState, *grants: str, experiment: str = "exp") -> TrialRecord:
    return TrialRecord(experiment=experiment, number=number, parameters={}, job_id=f"{experiment}-abc123-t{number}",
                       state=state, upload_grants=list(grants))


def revoker(records: Records, store: Store, lead: Lead | None = None) -> tuple[GrantRevoker, Counted]:
    lead = lead or Lead()
    metrics = Counted()
    return GrantRevoker(store=records, models=store, metrics=metrics, leading=lambda: lead.leading,  # type: ignore[arg-type]
                        check_leading=lead.check), metrics


async def settled(grants: GrantRevoker) -> None:
    await asyncio.gather(*grants._tasks)


async def test_an_ended_trials_grants_are_revoked_at_once_and_removed_from_its_record() -> None:
    records = Records(trial(0, TrialState.SUCCEEDED, "a0", "a1"), trial(1, TrialState.RUNNING, "b0"))
    store = Store()
    grants, metrics = revoker(records, store)
    grants.ended(records.records[("exp", 0)])
    grants.ended(records.records[("exp", 1)])  # not ended: nothing to revoke yet
    await settled(grants)
    assert store.revoked == ["a0", "a1"] and metrics.outcomes == ["revoked", "revoked"]
    assert records.records[("exp", 0)].upload_grants == [] and records.records[("exp", 1)].upload_grants == ["b0"]


async def test_a_revocation_that_fails_never_blocks_and_is_retried_at_the_next_resync() -> None:
    records = Records(*(trial(n, state, f"g{n}") for n, state in enumerate(
        (TrialState.FAILED, TrialState.EARLY_STOPPED, TrialState.KILLED))))
    store = Store()
    grants, metrics = revoker(records, store)
    await grants.resync()  # a start: every ended trial looked at once; nothing failed
    assert sorted(store.revoked) == ["g0", "g1", "g2"]
    store.revoked.clear()
    records.records[("exp", 3)] = trial(3, TrialState.SUCCEEDED, "g3")
    store.down = True
    grants.ended(records.records[("exp", 3)])  # returns at once: the task alone meets the store
    await settled(grants)
    assert metrics.outcomes[-1] == "failed" and records.records[("exp", 3)].upload_grants == ["g3"]
    await grants.resync()
    assert store.revoked == [] and records.records[("exp", 3)].upload_grants == ["g3"], "kept while the store is down"
    store.down = False
    await grants.resync()
    assert store.revoked == ["g3"] and records.records[("exp", 3)].upload_grants == []
    await grants.resync()  # nothing failed since: the records are not read again
    assert store.revoked == ["g3"]


async def test_a_restarted_controller_or_new_leader_revokes_what_its_predecessor_left_and_only_the_leader() -> None:
    records = Records(trial(0, TrialState.SUCCEEDED, "a0"), trial(0, TrialState.KILLED, "b0", experiment="other"),
                      trial(1, TrialState.RUNNING, "a1"), unrevoked=("d0", "d1"))
    store = Store()
    lead = Lead()
    lead.leading = False
    grants, _ = revoker(records, store, lead)
    await grants.resync()  # a follower revokes nothing
    assert store.revoked == []
    lead.leading = True  # a take-over: its first pass reads every record
    await grants.resync()
    assert sorted(store.revoked) == ["a0", "b0", "d0", "d1"] and records.unrevoked == set()
    assert [t.upload_grants for t in records.records.values()] == [[], [], ["a1"]]
    records.records[("exp", 1)] = replace(records.records[("exp", 1)], state=TrialState.SUCCEEDED)
    lead.deposed = True  # believes it leads, its fence moved on: neither revokes nor writes
    grants.ended(records.records[("exp", 1)])
    await settled(grants)
    assert "a1" not in store.revoked and records.records[("exp", 1)].upload_grants == ["a1"]
    successor, _ = revoker(records, store)
    await successor.resync()
    assert store.revoked[-1] == "a1" and records.records[("exp", 1)].upload_grants == []


async def test_a_grant_the_store_can_never_revoke_is_dropped_and_counted() -> None:
    records = Records(trial(0, TrialState.SUCCEEDED, "gone", "kept"))
    store = Store()
    store.gone.add("gone")
    grants, metrics = revoker(records, store)
    await grants.resync()
    assert store.revoked == ["kept"] and records.records[("exp", 0)].upload_grants == []
    assert sorted(metrics.outcomes) == ["dropped", "revoked"]
