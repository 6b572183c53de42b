"""Continuous pipelines: statistics computed once per span, against recomputing a rolling window's.

A backfill of ``--spans`` spans (CSV, ``--rows`` rows of ``--numeric`` numeric and ``--categorical``
categorical columns and a label, drifting slowly) is validated run after run over a rolling window of
``--window`` spans, by the validate step's own code (``stepjobs.run_validate`` over real folders, as the
step's job runs it), two ways:

- **once per span** (the platform): a run gets the statistics of the spans computed before as inputs
  and computes only its newest span's;
- **recompute** (the baseline: a cache keyed by the run, as TFX's MLMD cache is, misses on every new
  window): every run computes the statistics of every span of its window.

The two ways run interleaved, run by run, and one span's statistics (read + compute) is measured alone
after each pair, so the machine's load hits all three alike. Both ways must find the same anomalies in
every run (checked; exit 1 otherwise). Printed: statistics computed, total time, the tenth run (the
first with a full window) and the median full-window run of each way, the per-run ratios, and each
run's cost in units of one span's statistics: the platform's full-window run should cost about one
span's statistics, not ``--window``.

    .venv/bin/python bench/job_orchestrator_pipeline_stats.py                    # 100 spans x 5,000 rows
    .venv/bin/python bench/job_orchestrator_pipeline_stats.py --spans 30 --rows 2000   # quick
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics as stats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from opml_job_orchestrator.pipelines import statistics as span_statistics
from opml_job_orchestrator.pipelines.stepjobs import run_validate
from opml_job_orchestrator.pipelines.table import read_span

COLORS = ["red", "green", "blue", "grey", "black"]


def write_spans(root: Path, *, spans: int, rows: int, numeric: int, categorical: int, seed: int) -> list[str]:
    """``spans`` span folders of one CSV each; the numeric columns' means drift by 0.02 a span, and every
    25th span is bad (so the two ways' anomalies are compared on runs that have some)."""
    rng = np.random.default_rng(seed)
    names = []
    for index in range(spans):
        name = f"span-{index:04d}"
        folder = root / name
        folder.mkdir(parents=True)
        columns: dict[str, list[str]] = {}
        faulty = index % 25 == 24  # a bad span now and then: x0 a fifth NaN, x1 shifted by 3
        for column in range(numeric):
            values = rng.normal(loc=0.02 * index + (3.0 if faulty and column == 1 else 0.0),
                                scale=1.0 + 0.1 * column, size=rows)
            if faulty and column == 0:
                values[: rows // 5] = np.nan
            columns[f"x{column}"] = [f"{v:.5f}" for v in values]
        for column in range(categorical):
            columns[f"c{column}"] = list(rng.choice(COLORS, size=rows, p=[0.4, 0.3, 0.15, 0.1, 0.05]))
        columns["label"] = [str(int(v)) for v in rng.random(rows) < 0.3]
        header = ",".join(columns)
        body = "\n".join(",".join(row) for row in zip(*columns.values(), strict=True))
        (folder / "part-0.csv").write_text(f"{header}\n{body}\n")
        names.append(name)
    return names


class Backfill:
    """One way of running validate over every window ending at each span, a run at a time;
    ``once``: the statistics of spans computed by earlier runs are inputs, never recomputed."""

    def __init__(self, data: Path, work: Path, *, window: int, once: bool) -> None:
        self.data, self.work, self.window, self.once = data, work, window, once
        self.store = work / "store"
        self.schema_file: Path | None = None
        self.times: list[float] = []
        self.computed = 0
        self.results: list[tuple[bool, list[dict[str, Any]]]] = []

    def run(self, spans: list[str], end: int) -> None:
        names = spans[max(0, end - self.window):end]
        run = self.work / f"run-{end:04d}"
        inputs, outputs = run / "inputs", run / "outputs"
        started = time.perf_counter()
        for name in names:
            cached = self.store / name / "statistics.json"
            if self.once and cached.is_file():
                (inputs / "statistics" / name).mkdir(parents=True)
                shutil.copyfile(cached, inputs / "statistics" / name / "statistics.json")
            else:
                (inputs / "spans").mkdir(parents=True, exist_ok=True)
                os.symlink(self.data / name, inputs / "spans" / name)  # the span's files, as the engine stages them
        if self.schema_file is not None:
            (inputs / "schema").mkdir(parents=True)
            shutil.copyfile(self.schema_file, inputs / "schema" / "schema.json")
        result = run_validate({"spans": names, "label": "label"}, inputs, outputs)
        for name in result["computed"]:
            (self.store / name).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(outputs / "statistics" / name / "statistics.json", self.store / name / "statistics.json")
        if result["schema_inferred"]:
            self.schema_file = self.work / "schema.json"
            shutil.copyfile(outputs / "schema" / "schema.json", self.schema_file)
        self.times.append(time.perf_counter() - started)
        self.computed += len(result["computed"])
        self.results.append((result["ok"], result["anomalies"]))
        shutil.rmtree(run)


def one_span(data: Path, name: str) -> float:
    """Seconds to read one span and compute its statistics, alone."""
    started = time.perf_counter()
    span_statistics.compute(read_span(data / name))
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=100)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--numeric", type=int, default=8)
    parser.add_argument("--categorical", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.spans < args.window:
        parser.error(f"--spans ({args.spans}) must be at least --window ({args.window})")

    with tempfile.TemporaryDirectory(prefix="opml-bench-stats-") as temporary:
        root = Path(temporary)
        spans = write_spans(root / "data", spans=args.spans, rows=args.rows, numeric=args.numeric,
                            categorical=args.categorical, seed=args.seed)
        size = sum(p.stat().st_size for p in (root / "data").rglob("*.csv"))
        print(f"{args.spans} spans x {args.rows} rows x {args.numeric + args.categorical + 1} columns "
              f"({size / 2 ** 20:.1f} MiB of CSV), rolling window {args.window}; python {platform.python_version()}, "
              f"load average {os.getloadavg()[0]:.2f}")
        once = Backfill(root / "data", root / "once", window=args.window, once=True)
        again = Backfill(root / "data", root / "again", window=args.window, once=False)
        single: list[float] = []
        for end in range(1, args.spans + 1):  # interleaved, so a change of the machine's load hits both ways
            once.run(spans, end)
            again.run(spans, end)
            single.append(one_span(root / "data", spans[end - 1]))

    differing = sum(a != b for a, b in zip(once.results, again.results, strict=True))
    flagged = sum(not ok for ok, _ in once.results)
    tenth, full = args.window - 1, range(args.window - 1, args.spans)
    print()
    print(f"| way | statistics computed | backfill s | run {args.window} s | median full-window run s | "
          "median full-window run / one span's statistics |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, way in (("recompute (baseline)", again), ("once per span", once)):
        in_spans = stats.median(way.times[i] / single[i] for i in full)
        print(f"| {label} | {way.computed} | {sum(way.times):.2f} | {way.times[tenth]:.3f} | "
              f"{stats.median(way.times[i] for i in full):.3f} | {in_spans:.2f} |")
    ratio = stats.median(once.times[i] / again.times[i] for i in full)
    print()
    print(f"once per span vs recompute: statistics computed {once.computed / again.computed:.3f}x, backfill time "
          f"{sum(once.times) / sum(again.times):.3f}x, run {args.window} {once.times[tenth] / again.times[tenth]:.3f}x, "
          f"full-window runs {ratio:.3f}x (median of the per-run ratios)")
    print(f"one span's statistics alone (read + compute, measured after each run): median "
          f"{stats.median(single):.3f} s; run {args.window} once per span = "
          f"{once.times[tenth] / single[tenth]:.2f} of it, recomputing = {again.times[tenth] / single[tenth]:.2f}")
    print(f"runs whose anomalies differ between the two ways: {differing} of {args.spans} "
          f"(runs with anomalies: {flagged})")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
