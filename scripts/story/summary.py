"""Step 8, the end: what each step did and how long it took, as a table and PNG plots.

The table (step, service, duration, outcome) is what the run printed as it went, in one place; the
plots (``steps.png``: each step's duration; ``trials.png``: the tuning trials' objective by state)
go to the run's output folder, `.opml/main-job/` under `make up`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: the main job runs with no display
import matplotlib.pyplot as plt  # noqa: E402


@dataclass(frozen=True)
class StepResult:
    number: int
    name: str
    services: str
    seconds: float
    outcome: str


def table(results: list[StepResult]) -> str:
    rows = [("step", "services", "duration", "outcome")]
    rows += [(f"{r.number}. {r.name}", r.services, f"{r.seconds:.1f} s", r.outcome) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def plots(results: list[StepResult], trials: list[tuple[int, str, float | None]], out: Path) -> list[Path]:
    """``steps.png`` always; ``trials.png`` when the tuning step ran. Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    figure, axes = plt.subplots(figsize=(7, 0.5 + 0.45 * len(results)))
    axes.barh([f"{r.number}. {r.name}" for r in results][::-1], [r.seconds for r in results][::-1])
    axes.set_xlabel("seconds")
    axes.set_title("main job: duration of each step")
    figure.tight_layout()
    figure.savefig(out / "steps.png", dpi=100)
    plt.close(figure)
    written.append(out / "steps.png")
    scored = [(number, state, value) for number, state, value in trials if value is not None]
    if scored:
        figure, axes = plt.subplots(figsize=(6, 3.5))
        for state in sorted({state for _, state, _ in scored}):
            points = [(number, value) for number, s, value in scored if s == state]
            axes.scatter(*zip(*points), label=state.removeprefix("TRIAL_STATE_").lower())
        axes.set_xlabel("trial")
        axes.set_ylabel("val_accuracy")
        axes.set_title("tuning: each trial's objective")
        axes.legend()
        figure.tight_layout()
        figure.savefig(out / "trials.png", dpi=100)
        plt.close(figure)
        written.append(out / "trials.png")
    return written


def federated_plot(federated: dict, out: Path) -> Path:
    """``federated.png`` (step 7): the federation's accuracy by round (of the model each round began
    with, on its members' own validation rows, marked by TiFL tier) and each line's held-out accuracy
    of the central and the federated model, as the router answered."""
    out.mkdir(parents=True, exist_ok=True)
    figure, (by_round, by_line) = plt.subplots(1, 2, figsize=(11, 3.8))
    rounds = [(number, tier, accuracy) for number, tier, accuracy in federated["rounds"] if accuracy is not None]
    by_round.plot([number for number, _, _ in rounds], [accuracy for _, _, accuracy in rounds], color="grey", lw=1)
    for tier in sorted({tier for _, tier, _ in rounds}):
        points = [(number, accuracy) for number, t, accuracy in rounds if t == tier]
        by_round.scatter(*zip(*points), label=f"tier {tier}" if tier >= 0 else "profiling", zorder=3)
    by_round.set_xticks([number for number, _, _ in federated["rounds"]])
    by_round.set_xlabel("round")
    by_round.set_ylabel("accuracy (members' validation rows)")
    by_round.set_title("federated: accuracy by round")
    by_round.legend()
    lines = sorted(federated["lines"]["central"])
    for offset, model in ((-0.2, "central"), (0.2, "federated")):
        by_line.bar([line + offset for line in lines], [federated["lines"][model][line] for line in lines], 0.4,
                    label=model)
    by_line.set_xticks(lines, [f"line {line}" for line in lines])
    by_line.set_ylim(0, 1)
    by_line.set_ylabel("held-out accuracy")
    by_line.set_title("central vs federated, per line")
    by_line.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(out / "federated.png", dpi=100)
    plt.close(figure)
    return out / "federated.png"
