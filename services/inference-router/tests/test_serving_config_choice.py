"""The serving configuration chosen per replica set (placement.serving): the one a fitted performance
model predicts best for the SLO at the expected load, within the slot's threads; ties, the
incumbent's margin, missing predictions; the planner sizing on it and the replanner re-loading a
replica in place when measurements change the choice."""

from __future__ import annotations

import pytest

from opml_common.perfmodel import PerformanceModel, Sample, ServingConfig
from opml_common.perfmodel.space import EXECUTION_MODES, OPT_LEVELS
from opml_inference_router.placement import (
    CostAwareSloPolicy,
    ModelVersion,
    Planner,
    Profile,
    ProfileBook,
    Replanner,
    ResizeReplica,
    ServingConfigChooser,
    ServingTable,
    SessionChoice,
)
from opml_inference_router.placement.predicted import kind_sizes
from opml_inference_router.testing.placement import CPU, LADDER, demand, fleet

LEVEL = {"disable": 2.0, "basic": 1.5, "extended": 1.0, "all": 1.25}  # a law where "all" is not the fastest
MODE = {"sequential": 1.0, "parallel": 1.4}
THREADS = {1: 1.0, 2: 0.6, 3: 0.45, 4: 0.4}
PRECISION = {"fp32": 1.0, "int8": 1.0}
MODEL = ModelVersion("m", 1)


def law(config: ServingConfig, precision_factor=PRECISION) -> float:
    return ((1.0 + 0.5 * config.batch) * LEVEL[config.opt_level] * MODE[config.execution_mode]
            * THREADS[config.threads] * precision_factor[config.precision])


def profile(precision: str = "fp32") -> Profile:
    return Profile(MODEL, "cpu", precision, {n: 2.0 + 1.0 * n for n in LADDER}, 300.0)


def space(threads=(1, 2, 3, 4), precisions=("fp32",)) -> list[ServingConfig]:
    return [ServingConfig(b, t, level, mode, p) for b in LADDER for t in threads for level in OPT_LEVELS
            for mode in EXECUTION_MODES for p in precisions]


def fitted_table(precisions=("fp32",), precision_factor=PRECISION) -> ServingTable:
    """A performance model fitted on the law's measurements, asked for every configuration."""
    measured = [Sample("m", 1.0, c, law(c, precision_factor)) for c in space(precisions=precisions)]
    model = PerformanceModel(environment="cpu").fit(measured)
    points = [Sample("m", 1.0, c) for c in space(precisions=precisions)]
    return ServingTable(dict(zip((p.config for p in points), map(float, model.predict_ms(points)), strict=True)),
                        "a test model")


def chooser(table: ServingTable | None, slot: int = 2, **settings) -> ServingConfigChooser:
    return ServingConfigChooser(fleet=fleet((CPU, 2)), policy=CostAwareSloPolicy(), slot_threads=lambda kind: slot,
                                tables=lambda model, kind: table, **settings)


WANTED = demand("m", rate=300, slo=40.0, precisions=("fp32", "int8"))


@pytest.mark.parametrize("slot", [1, 2, 4])
def test_the_predicted_best_within_the_slots_threads(slot):
    table = fitted_table()
    adjusted, chosen = chooser(table, slot=slot).choose(WANTED, CPU, profile())
    # the law's best at every slot is extended + sequential with all the slot's threads
    assert (chosen.threads, chosen.opt_level, chosen.execution_mode) == (slot, "extended", "sequential")
    assert "predicted best" in chosen.basis and "a test model" in chosen.basis
    # sized on the profile the performance model predicts for it: profile x predicted / predicted(defaults)
    default = ServingConfig(8, slot, "all", "sequential", "fp32")
    mine = ServingConfig(8, slot, "extended", "sequential", "fp32")
    ratio = table.latency_ms[mine] / table.latency_ms[default]
    assert adjusted.latency_ms(8) == pytest.approx(max(profile().latency_ms(8) * ratio, adjusted.latency_ms(4)))
    assert adjusted.precision == "fp32" and ratio < 0.9


def test_the_choice_is_the_best_the_policy_sizes_of_every_candidate():
    table = fitted_table()
    the_chooser = chooser(table, slot=2)
    _, chosen = the_chooser.choose(WANTED, CPU, profile())
    policy, the_fleet = CostAwareSloPolicy(), fleet((CPU, 2))
    scores = {}
    for threads in (1, 2):
        for level in OPT_LEVELS:
            for mode in EXECUTION_MODES:
                base = {n: table.latency_ms[ServingConfig(n, 2, "all", "sequential")] for n in LADDER}
                mine = {n: table.latency_ms[ServingConfig(n, threads, level, mode)] for n in LADDER}
                latencies, running = {}, 0.0
                for n in LADDER:
                    running = latencies[n] = max(running, profile().latency_ms(n) * mine[n] / base[n])
                option = policy.options(WANTED, {"cpu": Profile(MODEL, "cpu", "fp32", latencies, 300.0)},
                                        the_fleet)[0]
                scores[threads, level, mode] = (option.replicas, -option.replica_capacity_rps)
    best = min(scores.values())
    assert scores[chosen.threads, chosen.opt_level, chosen.execution_mode] == best


def test_ties_go_to_the_defaults_then_fewer_threads_more_optimization_sequential():
    flat = ServingTable({c: 1.0 + c.batch for c in space()}, "flat")  # every configuration alike
    _, chosen = chooser(flat, slot=2).choose(WANTED, CPU, profile())
    assert (chosen.threads, chosen.opt_level, chosen.execution_mode) == (2, "all", "sequential")
    assert chosen.basis.startswith("defaults predicted best")

    # the defaults are slow; basic alike with 1 or 2 threads, sequential or parallel: 1 thread, sequential
    def slow_defaults(c: ServingConfig) -> float:
        return (1.0 + c.batch) * (1.0 if c.opt_level == "basic" else 3.0)
    ties = ServingTable({c: slow_defaults(c) for c in space()}, "ties")
    _, chosen = chooser(ties, slot=2).choose(WANTED, CPU, profile())
    assert (chosen.threads, chosen.opt_level, chosen.execution_mode) == (1, "basic", "sequential")


def test_a_gain_within_the_margin_keeps_the_incumbent():
    def slightly(c: ServingConfig) -> float:
        return (1.0 + c.batch) * (0.97 if c.opt_level == "extended" else 1.0)  # 3% better: within 5%
    table = ServingTable({c: slightly(c) for c in space()}, "slight")
    _, chosen = chooser(table, slot=2).choose(WANTED, CPU, profile())
    assert (chosen.threads, chosen.opt_level) == (2, "all")
    assert chosen.basis.startswith("defaults kept within 5% of the predicted best of 12 for p99 <= 40 ms at 300 rps")
    _, chosen = chooser(table, slot=2, min_gain=0.0).choose(WANTED, CPU, profile())
    assert (chosen.threads, chosen.opt_level) == (1, "extended")  # threads do not matter here: fewer
    # what runs now stays when the best beats it by less than the margin
    placed = Planner(fleet=fleet((CPU, 2)), policy=CostAwareSloPolicy(), chooser=chooser(fitted_table())).plan(
        [WANTED], ProfileBook([profile()])).placements[MODEL].option
    assert placed.session.opt_level == "extended"
    # now basic is predicted 2% faster than extended, the incumbent: it stays
    near = ServingTable({c: law(c) * (0.98 * LEVEL["extended"] / LEVEL["basic"] if c.opt_level == "basic" else 1.0)
                         for c in space()}, "near")
    _, kept = chooser(near, slot=2).choose(WANTED, CPU, profile(), incumbent=placed)
    assert (kept.threads, kept.opt_level, kept.execution_mode) == (2, "extended", "sequential")
    assert kept.basis.startswith("kept within 5% of the predicted best")


def test_without_predictions_the_defaults_stay_and_say_so():
    adjusted, chosen = chooser(None, slot=2).choose(WANTED, CPU, profile())
    assert adjusted == profile()
    assert (chosen.threads, chosen.opt_level, chosen.execution_mode) == (2, "all", "sequential")
    assert chosen.basis == "defaults: no serving-configuration measurements of models/m/versions/1 to predict cpu from"
    # a table that lacks the profile's batch sizes predicts nothing for it
    partial = ServingTable({c: law(c) for c in space() if c.batch < 16}, "partial")
    adjusted, chosen = chooser(partial, slot=2).choose(WANTED, CPU, profile())
    assert adjusted == profile() and chosen.basis.startswith("defaults: partial does not cover")


def test_precision_only_where_the_model_and_the_kind_allow_it():
    cpu_int8 = CPU.model_copy(update={"precisions": ("fp32", "int8")})
    int8_fast = fitted_table(precisions=("fp32", "int8"), precision_factor={"fp32": 1.0, "int8": 0.4})
    the_chooser = ServingConfigChooser(fleet=fleet((cpu_int8, 2)), policy=CostAwareSloPolicy(),
                                       slot_threads=lambda kind: 2, tables=lambda model, kind: int8_fast)
    adjusted, chosen = the_chooser.choose(WANTED, cpu_int8, profile())
    assert adjusted.precision == "int8"
    fp32_only = demand("m", rate=300, slo=40.0, precisions=("fp32",))
    assert {c.precision for c in the_chooser.candidates(fp32_only, cpu_int8)} == {"fp32"}
    adjusted, _ = the_chooser.choose(fp32_only, cpu_int8, profile())
    assert adjusted.precision == "fp32"
    assert {c.batch for c in the_chooser.candidates(WANTED, cpu_int8)} == set(kind_sizes(cpu_int8, WANTED.config))
    assert max(c.threads for c in the_chooser.candidates(WANTED, cpu_int8)) == 2


def test_the_planner_sizes_on_the_choice_and_the_replanner_reloads_in_place_when_it_changes():
    the_fleet = fleet((CPU, 2))
    tables: dict = {}
    the_chooser = ServingConfigChooser(fleet=the_fleet, policy=CostAwareSloPolicy(), slot_threads=lambda kind: 2,
                                       tables=lambda model, kind: tables.get((model, kind)))
    planner = Planner(fleet=the_fleet, policy=CostAwareSloPolicy(), chooser=the_chooser)
    book = ProfileBook([profile()])
    first = Planner(fleet=the_fleet, policy=CostAwareSloPolicy(), chooser=the_chooser).plan([WANTED], book)
    option = first.placements[MODEL].option
    assert option.session == SessionChoice(2, "all", "sequential") and option.session.basis.startswith("defaults:")

    replanner = Replanner(planner=planner)
    assert not replanner.replan(first, [WANTED], book, {}).moves  # nothing measured: nothing moves

    # measurements that predict the defaults best: the same replicas, the reason renewed
    tables[MODEL, "cpu"] = ServingTable({c: 1.0 + c.batch for c in space()}, "a flat model")
    renewed = replanner.replan(first, [WANTED], book, {})
    assert not renewed.moves and not renewed.reasons
    session = renewed.plan.placements[MODEL].option.session
    assert session == option.session and session.basis.startswith("defaults predicted best")

    tables[MODEL, "cpu"] = fitted_table()
    replan = replanner.replan(first, [WANTED], book, {})
    placed = replan.plan.placements[MODEL].option
    assert placed.session == SessionChoice(2, "extended", "sequential")
    assert placed.replica_capacity_rps > option.replica_capacity_rps  # sized on the faster predicted profile
    assert "serving configuration 2 threads, opt extended, sequential, fp32 chosen" in replan.reasons[MODEL]
    assert "serves with 2 threads, opt extended, sequential, fp32 on cpu (predicted best" in replan.reasons[MODEL]
    resizes = [a for a in replan.moves if isinstance(a, ResizeReplica)]
    assert resizes and len(resizes) == len(replan.moves)  # the same replicas, re-loaded in place
    assert all(a.new.session == placed.session and a.old.session == option.session for a in resizes)
    assert not replanner.replan(replan.plan, [WANTED], book, {}).moves  # stable once chosen
