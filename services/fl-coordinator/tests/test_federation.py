"""The federation's rounds with hand-driven clients: deadlines, drops, rejections, tiers,
join/leave, semi-async staleness, and continuing from a snapshot."""

from __future__ import annotations

import numpy as np

from opml_fl_coordinator.config import parse_config
from opml_fl_coordinator.federation import FederationListener, Phase, new_federation
from opml_fl_coordinator.profiles import ClientProfile
from opml_fl_coordinator.selection import TiflSelection

W0 = [np.zeros((3, 2), np.float32), np.zeros(2, np.float32)]


class Log(FederationListener):
    def __init__(self):
        self.started, self.completed, self.dropped, self.rejected, self.ends = [], [], [], [], []
        self.snapshots = []

    def round_started(self, federation, number, clients, now):
        self.started.append((number, sorted(clients)))

    def round_completed(self, federation, record):
        self.completed.append(record)
        self.snapshots.append(federation.snapshot())  # as the service saves it: before the next round starts

    def client_dropped(self, federation, client_id, number, reason):
        self.dropped.append((client_id, number, reason))

    def update_rejected(self, federation, client_id, number, reason):
        self.rejected.append((client_id, number, reason))

    def finished(self, federation, reason):
        self.ends.append(reason)


def federation(log=None, weights=W0, **overrides):
    document = {"name": "t", "rounds": 3, "min_clients": 4, "round_deadline_s": 10,
                "selection": {"clients_per_round": 4}, **overrides}
    return new_federation("f1", parse_config(document), now=0.0, weights=weights, listener=log or Log())


def answer(fed, client_id, now, value=1.0, examples=10, weights=None):
    task = fed.task_for(client_id)
    assert task is not None and task.kind == "fit"
    update = weights if weights is not None else [np.full_like(w, value) for w in task.weights]
    return fed.submit(client_id, task.task_id, update, examples, {"eval_accuracy": 0.5}, now)


def test_a_round_waits_for_min_clients_then_aggregates_every_answer():
    log = Log()
    fed = federation(log)
    for i in range(3):
        fed.join(f"c{i}", 0.0, num_examples=100)
    assert fed.phase is Phase.WAITING and log.started == []
    fed.join("c3", 0.0, num_examples=100)
    assert log.started == [(1, ["c0", "c1", "c2", "c3"])]
    for i, value in enumerate([1.0, 2.0, 3.0, 4.0]):
        assert answer(fed, f"c{i}", 1.0 + i, value=value, examples=10 * (i + 1)) is None
    (record,) = log.completed
    assert record.participants == ["c0", "c1", "c2", "c3"] and record.aggregated
    np.testing.assert_allclose(fed.weights[0], np.full((3, 2), 3.0))  # (10+40+90+160)/100
    assert log.started[-1][0] == 2  # the next round started at once


def test_the_deadline_closes_a_round_without_the_crashed_client():
    log = Log()
    fed = federation(log)
    for i in range(4):
        fed.join(f"c{i}", 0.0, num_examples=100)
    for i in range(3):
        answer(fed, f"c{i}", 1.0)
    assert fed.next_deadline() == 10.0 and not log.completed
    fed.poll(10.0)
    (record,) = log.completed
    assert record.dropped == {"c3": "missed the round deadline (10 s)"} and record.participants == ["c0", "c1", "c2"]
    assert log.dropped == [("c3", 1, "missed the round deadline (10 s)")]
    assert fed.profiles.clients["c3"].availability == 0.0
    late = fed.task_for("c3")
    assert late is not None and late.round == 2  # selected again: still present


def test_bad_updates_are_rejected_with_the_reason_and_left_out():
    log = Log()
    fed = federation(log, min_clients=5, selection={"clients_per_round": 5})
    for i in range(5):
        fed.join(f"c{i}", 0.0, num_examples=100)
    nan = [np.full((3, 2), np.nan, np.float32), np.zeros(2, np.float32)]
    assert "NaN" in answer(fed, "c0", 1.0, weights=nan)
    assert "shapes" in answer(fed, "c1", 1.0, weights=[np.zeros((2, 2), np.float32)])
    assert "num_examples" in answer(fed, "c2", 1.0, examples=0)
    assert answer(fed, "c3", 1.0, value=0.1) is None
    assert answer(fed, "c4", 1.0, value=0.1) is None
    (record,) = log.completed
    assert set(record.rejected) == {"c0", "c1", "c2"} and record.participants == ["c3", "c4"]
    np.testing.assert_allclose(fed.weights[0], 0.1, rtol=1e-6)
    assert fed.profiles.clients["c0"].rejected == 1


def test_an_update_claims_at_most_the_examples_its_member_declared_times_the_epochs():
    log = Log()
    fed = federation(log, min_clients=4, local={"epochs": 2}, validation={"max_examples": 1000})
    fed.join("c0", 0.0, num_examples=100)
    fed.join("c1", 0.0, num_examples=100)
    fed.join("c2", 0.0, num_examples=10**9)  # more than validation.max_examples: counts as 1000
    fed.join("silent", 0.0)  # declared nothing (the service refuses such a join; the core refuses its updates)
    assert answer(fed, "c0", 1.0, examples=200) is None
    assert answer(fed, "c1", 1.0, examples=10_000_000) == ("num_examples must be in [1, 200] (100 declared at join "
                                                           "x 2 epochs), but got 10000000")
    assert "[1, 2000] (1000 declared" in answer(fed, "c2", 1.0, examples=2001)
    assert answer(fed, "silent", 1.0) == "num_examples must be declared when the client joins, but 'silent' declared none"
    (record,) = log.completed
    assert record.participants == ["c0"] and set(record.rejected) == {"c1", "c2", "silent"}


def test_a_member_that_shifts_every_weight_and_claims_ten_million_examples_moves_the_model_a_bounded_step():
    """The review's attack through a federation's defaults (untrusted): 4 honest members and one that
    declared (and claims) 10,000,000 examples and shifts every weight by +0.03. Trusted, FedAvg takes
    the shift whole; untrusted, the step is at most 3/7 of twice the median change (test_strategies)."""
    rng = np.random.default_rng(3)
    big = [np.zeros(1000, np.float32)]
    moved = {}
    for trust in ("untrusted", "trusted"):
        fed = federation(weights=big, min_clients=5, selection={"clients_per_round": 5}, rounds=1, trust=trust)
        for i in range(4):
            fed.join(f"h{i}", 0.0, num_examples=100)
        fed.join("attacker", 0.0, num_examples=10_000_000)
        for i in range(4):
            noise = [rng.normal(0.0, 0.01, 1000).astype(np.float32)]
            assert answer(fed, f"h{i}", 1.0, examples=100, weights=noise) is None
        assert answer(fed, "attacker", 1.0, examples=10_000_000, weights=[np.full(1000, 0.03, np.float32)]) is None
        moved[trust] = float(np.mean(fed.weights[0]))
    assert moved["trusted"] > 0.0299 and moved["untrusted"] < 0.01


def test_an_update_in_another_dtype_is_taken_in_the_models():
    log = Log()  # trusted: the two accepted changes (1 and 3) are averaged as they are, not clipped
    fed = federation(log, min_clients=3, selection={"clients_per_round": 3}, trust="trusted")
    for i in range(3):
        fed.join(f"c{i}", 0.0, num_examples=100)
    half = [np.full((3, 2), 1.0, np.float16), np.full(2, 1.0, np.float16)]
    huge = [np.full((3, 2), 1e300), np.zeros(2)]  # float64 past float32's range
    assert answer(fed, "c0", 1.0, weights=half) is None
    assert "NaN or infinite values as float32, the model's dtype" in answer(fed, "c1", 1.0, weights=huge)
    assert answer(fed, "c2", 1.0, value=3.0) is None
    (record,) = log.completed
    assert record.participants == ["c0", "c2"] and [w.dtype for w in fed.weights] == [np.float32, np.float32]
    np.testing.assert_allclose(fed.weights[0], 2.0)


def test_an_update_far_larger_than_the_others_is_an_outlier():
    log = Log()
    fed = federation(log, min_clients=5, selection={"clients_per_round": 5})
    for i in range(5):
        fed.join(f"c{i}", 0.0, num_examples=100)
    for i in range(4):
        answer(fed, f"c{i}", 1.0, value=0.1 + 0.01 * i)
    answer(fed, "c4", 1.0, value=50.0)
    (record,) = log.completed
    assert list(record.rejected) == ["c4"] and "median" in record.rejected["c4"]


def test_clients_join_and_leave_between_rounds():
    log = Log()
    fed = federation(log, min_clients=2, selection={"clients_per_round": 2})
    fed.join("a", 0.0, num_examples=100)
    fed.join("b", 0.0, num_examples=100)
    fed.leave("b", 1.0)  # mid-round: dropped, round continues with a
    answer(fed, "a", 2.0)
    assert log.completed[0].dropped == {"b": "left the federation"}
    fed.join("c", 3.0, num_examples=100)
    # round 2 started before c joined (only a present); c is selected from round 3 on
    answer(fed, "a", 4.0)
    assert log.started[-1] == (3, ["a", "c"])


def test_a_client_that_keeps_missing_deadlines_counts_as_gone():
    fed = federation(min_clients=2, selection={"clients_per_round": 2}, rounds=10)
    fed.join("a", 0.0, num_examples=100)
    fed.join("dead", 0.0, num_examples=100)
    for round_ in range(3):
        answer(fed, "a", 10.0 * round_ + 1)
        fed.poll(10.0 * (round_ + 1))
    assert not fed.profiles.clients["dead"].present
    assert fed.task_for("dead") is None


def test_the_first_client_supplies_the_starting_model_when_none_is_given():
    fed = federation(weights=None, min_clients=1, selection={"clients_per_round": 1})
    fed.join("a", 0.0, num_examples=100)
    task = fed.task_for("a")
    assert task.kind == "init"
    assert fed.submit("a", task.task_id, W0, 0, {}, 1.0) is None
    assert fed.task_for("a").kind == "fit" and fed.phase is Phase.RUNNING


def test_target_accuracy_and_round_count_end_the_federation():
    log = Log()
    fed = federation(log, rounds=2)
    for i in range(4):
        fed.join(f"c{i}", 0.0, num_examples=100)
    for round_ in range(2):
        for i in range(4):
            answer(fed, f"c{i}", round_ + 1.0)
    assert fed.phase is Phase.COMPLETED and log.ends == ["completed 2 rounds"]
    fed2 = federation(target_accuracy=0.5)
    for i in range(4):
        fed2.join(f"c{i}", 0.0, num_examples=100)
    for i in range(4):
        answer(fed2, f"c{i}", 1.0)  # clients report eval_accuracy 0.5
    assert fed2.phase is Phase.COMPLETED and "target accuracy" in fed2.reason


def test_semi_async_buffers_updates_and_damps_stale_ones():
    log = Log()
    fed = federation(log, mode="semi_async", rounds=5, min_clients=4,
                     semi_async={"buffer_size": 2, "concurrency": 3, "staleness_exponent": 1.0, "max_staleness": 1})
    for i in range(4):
        fed.join(f"c{i}", 0.0, num_examples=100)
    busy = sorted(c for c in ("c0", "c1", "c2", "c3") if fed.task_for(c))
    assert len(busy) == 3
    first, second, slow = busy
    answer(fed, first, 1.0, value=1.0)
    answer(fed, second, 1.0, value=1.0)  # buffer full: version 1 = 1.0
    assert fed.version == 1
    np.testing.assert_allclose(fed.weights[0], 1.0)
    # the slow client started from version 0: its change (+3) is halved (staleness 1, a = 1)
    answer(fed, slow, 2.0, value=3.0)
    assert fed._open.results[slow].staleness == 1
    np.testing.assert_allclose(fed._open.results[slow].weights[0], 1.0 + 3.0 / 2)


def test_semi_async_refuses_updates_beyond_max_staleness():
    fed = federation(mode="semi_async", rounds=10, min_clients=3, selection={"clients_per_round": 3},
                     semi_async={"buffer_size": 1, "concurrency": 3, "max_staleness": 0})
    for i in range(3):
        fed.join(f"c{i}", 0.0, num_examples=100)
    busy = sorted(c for c in ("c0", "c1", "c2") if fed.task_for(c))
    answer(fed, busy[0], 1.0)
    assert "stale" in answer(fed, busy[1], 1.0)


def test_a_snapshot_continues_from_the_last_completed_round():
    log = Log()
    fed = federation(log, strategy={"name": "fedadam", "eta": 0.1}, rounds=4, selection={"policy": "tifl",
                     "clients_per_round": 2, "tiers": 2})
    for i in range(4):
        fed.join(f"c{i}", 0.0, num_examples=100)
    for t in range(2):
        for c in sorted(c for c in fed.profiles.clients if fed.task_for(c)):
            answer(fed, c, t + 1.0, value=float(t + 1))
    document, arrays = log.snapshots[1]
    restored = federation(strategy={"name": "fedadam", "eta": 0.1}, rounds=4, selection={"policy": "tifl",
                          "clients_per_round": 2, "tiers": 2})
    restored.restore(document, arrays)
    assert restored.version == 2 and restored.phase is Phase.WAITING and len(restored.history) == 2
    np.testing.assert_array_equal(restored.weights[0], fed.weights[0])
    for i in range(4):
        restored.join(f"c{i}", 10.0, num_examples=100)
    # both continue identically: same selection draw, same server-optimizer step
    chosen = sorted(c for c in restored.profiles.clients if restored.task_for(c))
    assert chosen == sorted(c for c in fed.profiles.clients if fed.task_for(c))
    assert restored.task_for(chosen[0]).round == 3
    for f in (fed, restored):
        for c in chosen:
            answer(f, c, 11.0, value=5.0)
    np.testing.assert_allclose(restored.weights[0], fed.weights[0], rtol=1e-6)


def profile(cid, seconds, accuracy=None):
    p = ClientProfile(cid, 0.0, round_time_s=seconds)
    p.accuracy = accuracy
    return p


def test_tifl_tiers_by_speed_and_favours_the_tier_the_model_fits_worst():
    clients = [profile(f"fast{i}", 1.0 + i * 0.01, 0.9) for i in range(3)] + \
              [profile(f"slow{i}", 10.0 + i, 0.3) for i in range(3)]
    selection = TiflSelection(clients_per_round=2, tiers=2, seed=0)
    selection.update_probabilities(clients)
    assert {c for c, t in selection.assignment.items() if t == 0} == {"fast0", "fast1", "fast2"}
    assert selection.probabilities[1] > selection.probabilities[0]  # slow tier: lower accuracy
    chosen, tier = selection.select(1, clients)
    assert all(c.startswith("fast" if tier == 0 else "slow") for c in chosen) and len(chosen) == 2


def test_tifl_credits_bound_how_often_a_tier_is_chosen():
    clients = [profile(f"fast{i}", 1.0, 0.9) for i in range(2)] + [profile(f"slow{i}", 10.0, 0.1) for i in range(2)]
    selection = TiflSelection(clients_per_round=1, tiers=2, credits_per_tier=2, tier_interval=1, seed=0)
    tiers = [selection.select(r, clients)[1] for r in range(1, 9)]
    assert sorted(tiers[:4]) == [0, 0, 1, 1]  # a tier without credits is not chosen while another has some
    assert selection.credits == [0, 0]


def test_after_a_restore_rounds_resume_without_a_client_that_never_returns():
    log = Log()
    fed = federation(log, rounds=5)
    for i in range(4):
        fed.join(f"c{i}", 0.0, num_examples=100)
    for i in range(4):
        answer(fed, f"c{i}", 1.0)
    document, arrays = log.snapshots[0]
    restored = federation(rounds=5)
    restored.restore(document, arrays)
    for i in range(3):  # c3 died with the old coordinator
        restored.join(f"c{i}", 100.0, num_examples=100)
    assert restored.phase is Phase.WAITING and restored.next_deadline() == 110.0
    restored.poll(110.0)
    assert restored.phase is Phase.RUNNING
    assert sorted(c for c in restored.profiles.clients if restored.task_for(c)) == ["c0", "c1", "c2"]


def test_tifl_profiles_new_clients_in_a_round_of_their_own_before_tiering_them():
    clients = [ClientProfile(f"new{i}", 0.0) for i in range(6)] + [profile("old", 1.0, 0.5)]
    selection = TiflSelection(clients_per_round=2, tiers=2, seed=0, profile_batch=4)
    chosen, tier = selection.select(1, clients)
    assert tier is None and len(chosen) == 4 and all(c.startswith("new") for c in chosen)
    for p in clients:
        if p.client_id in chosen:
            p.selected, p.round_time_s = 1, 5.0
    rest, _ = selection.select(2, clients)
    assert sorted(rest) == sorted(c.client_id for c in clients[:6] if c.client_id not in chosen)
    for p in clients:
        p.selected, p.round_time_s = max(p.selected, 1), p.round_time_s or 5.0
    chosen, tier = selection.select(3, clients)
    assert tier in (0, 1) and len(chosen) == 2


def test_tifl_profiling_hands_out_no_more_tasks_than_semi_async_has_free():
    clients = [ClientProfile(f"new{i}", 0.0) for i in range(6)]
    chosen, tier = TiflSelection(clients_per_round=2, tiers=2, seed=0, profile_batch=4).select(1, clients, count=1)
    assert tier is None and len(chosen) == 1


def test_a_client_that_fails_to_give_the_starting_model_is_not_asked_again_and_again():
    log = Log()
    fed = federation(log, weights=None, min_clients=1, selection={"clients_per_round": 1})
    fed.join("a", 0.0, num_examples=100)
    fed.join("b", 0.0, num_examples=100)
    first = fed.task_for("a")
    assert first.kind == "init" and fed.task_for("b") is None
    fed.fail("a", first.task_id, "no model here", 1.0)
    assert log.dropped == [("a", 0, "client reported: no model here")]
    bad = fed.task_for("b")
    assert bad.kind == "init" and fed.task_for("a") is None
    assert "finite floating point" in fed.submit("b", bad.task_id, [np.array([np.nan])], 0, {}, 2.0)
    late = fed.task_for("a")
    assert late.kind == "init"
    fed.poll(late.deadline_at)
    assert log.dropped[-1][:2] == ("a", 0) and "deadline" in log.dropped[-1][2]
    good = fed.task_for("b")
    assert fed.submit("b", good.task_id, W0, 0, {}, 20.0) is None
    assert fed.phase is Phase.RUNNING and fed.task_for("b").kind == "fit"


def test_a_lone_client_that_keeps_failing_the_starting_model_counts_as_gone():
    fed = federation(weights=None, min_clients=1, selection={"clients_per_round": 1})
    fed.join("solo", 0.0, num_examples=100)
    for attempt in range(3):
        task = fed.task_for("solo")
        assert task.kind == "init"
        fed.fail("solo", task.task_id, "no model here", float(attempt))
    assert not fed.profiles.clients["solo"].present and fed.task_for("solo") is None
    assert fed.phase is Phase.WAITING
