"""Slowdown percentiles per job class, compared across policies and seeds, as the paper reports them.

A job's slowdown is (finish - submit) / its work: 1.0 means it never waited. Per run we take the
median and 95th percentile for TE and for BE jobs (warm-up jobs left out); across seeds we show
mean ± sample standard deviation; changes against the baseline are computed per seed (both
policies saw the same jobs) and then averaged.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from opml_job_orchestrator.scheduler.model import JobClass
from opml_job_orchestrator.simulator.runner import SimulationResult

METRICS = ("te_p50", "te_p95", "be_p50", "be_p95")
PAPER_CHANGES = {"te_p95": -96.6, "be_p50": 18.0, "be_p95": 23.9}
"""Yabuuchi et al., OpML '19: their algorithm against FIFO on synthetic workloads, in %."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's default).

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], but got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class RunSummary:
    """One policy on one seed's workload."""

    policy: str
    seed: int
    te_p50: float
    te_p95: float
    be_p50: float
    be_p95: float
    preemptions: int
    lost_gpu_hours: float
    """GPU-hours of progress thrown away by preemptions."""


def summarize(result: SimulationResult, *, seed: int) -> RunSummary:
    """Percentiles of the measured jobs of ``result``, per class.

    Raises:
        ValueError: a class has no measured job.
    """
    slowdowns: dict[JobClass, list[float]] = {JobClass.TE: [], JobClass.BE: []}
    for outcome in result.outcomes:
        if outcome.measured:
            slowdowns[outcome.job_class].append(outcome.slowdown)
    for job_class, values in slowdowns.items():
        if not values:
            raise ValueError(f"no measured {job_class.name} job in the run of {result.policy!r}; use more jobs")
    te, be = slowdowns[JobClass.TE], slowdowns[JobClass.BE]
    return RunSummary(
        policy=result.policy, seed=seed,
        te_p50=percentile(te, 50), te_p95=percentile(te, 95), be_p50=percentile(be, 50), be_p95=percentile(be, 95),
        preemptions=sum(o.preemptions for o in result.outcomes),
        lost_gpu_hours=sum(o.lost_work_s * o.gpus for o in result.outcomes) / 3600,
    )


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation over seeds (0 with one seed)."""

    mean: float
    std: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


@dataclass(frozen=True)
class PolicyRow:
    policy: str
    seeds: int
    metrics: dict[str, Spread]
    """METRICS plus ``preemptions`` and ``lost_gpu_hours``."""
    change_pct: dict[str, Spread]
    """Per-seed change of each of METRICS against the baseline, in %."""


def compare(summaries: Sequence[RunSummary], *, baseline: str = "fifo") -> list[PolicyRow]:
    """One row per policy, in first-seen order, with changes against ``baseline`` on the same seeds.

    Raises:
        ValueError: the baseline is missing for a seed another policy ran.
    """
    base = {s.seed: s for s in summaries if s.policy == baseline}
    policies = list(dict.fromkeys(s.policy for s in summaries))
    rows = []
    for policy in policies:
        runs = [s for s in summaries if s.policy == policy]
        missing = sorted({s.seed for s in runs} - base.keys())
        if missing:
            raise ValueError(f"baseline {baseline!r} has no run for seeds {missing}")
        metrics = {name: Spread.of([getattr(s, name) for s in runs])
                   for name in (*METRICS, "preemptions", "lost_gpu_hours")}
        change = {name: Spread.of([100 * (getattr(s, name) / getattr(base[s.seed], name) - 1) for s in runs])
                  for name in METRICS}
        rows.append(PolicyRow(policy, len(runs), metrics, change))
    return rows


def format_table(rows: Sequence[PolicyRow], *, baseline: str = "fifo") -> str:
    """A Markdown table: slowdowns, changes against the baseline, and the paper's changes beside them."""
    header = ("| policy | TE p50 | TE p95 | BE p50 | BE p95 | TE p95 vs FIFO | BE p50 vs FIFO | BE p95 vs FIFO "
              "| preemptions | lost GPU-h |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        m, c = row.metrics, row.change_pct
        changes = (["—"] * 3 if row.policy == baseline
                   else [f"{c[k].mean:+.1f}% ± {c[k].std:.1f}" for k in ("te_p95", "be_p50", "be_p95")])
        lines.append("| " + " | ".join([
            row.policy, *(f"{m[k].mean:.2f} ± {m[k].std:.2f}" for k in METRICS), *changes,
            f"{m['preemptions'].mean:.0f}", f"{m['lost_gpu_hours'].mean:.0f}",
        ]) + " |")
    paper = [f"{PAPER_CHANGES[k]:+.1f}%" for k in ("te_p95", "be_p50", "be_p95")]
    lines.append("| paper (Yabuuchi et al.) | | | | | " + " | ".join(paper) + " | | |")
    return "\n".join(lines)
