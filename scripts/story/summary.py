"""The end: what each step did and how long it took, as a table and PNG plots.

The table (step, service, duration, outcome) is what the run printed as it went, in one place; the
plots (``steps.png``: each step's duration; ``trials.png``: the tuning trials' objective by state;
``accuracy.png``: the scorer's estimated accuracy per window and each line's true accuracy, the
alert marked;
``rollout.png``: the loop's rollout, each version's traffic share over time) go to the run's output
folder, `.opml/main-job/` under `make up`.
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


def plots(results: list[StepResult], handed: dict, out: Path) -> list[Path]:
    """``steps.png`` always; ``trials.png`` when the tuning step ran; ``accuracy.png`` and
    ``rollout.png`` when the loop closed (step 6). Returns the files written."""
    trials: list[tuple[int, str, float | None]] = handed.get("trials", [])
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
    if handed.get("quality"):
        written.append(accuracy_plot(handed, out))
    if handed.get("traffic"):
        written.append(rollout_plot(handed, out))
    return written


def accuracy_plot(handed: dict, out: Path) -> Path:
    """``accuracy.png``: left, the scorer's label-free estimate per window (lines) and its truth from
    the late labels (dots), by model version, per line where it splits the model by line, else for
    all lines; right, each line's true accuracy over time (every answer, 5 s at a time). The lamps'
    change and the alert are marked on both."""
    start = handed["traffic_started"]
    figure, (scorer, truth) = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    latest: dict[tuple[str, str, int], tuple] = {}
    for at, version, segment, window, estimate, true, _ in handed["quality"]:  # a window's last event is its truth so far
        latest[(version, segment, window)] = (at - start, estimate, true)
    split = any(segment for _, segment, _ in latest)
    for version, segment in sorted({(v, s) for v, s, _ in latest if bool(s) == split}, key=lambda k: (int(k[0]), k[1])):
        points = sorted(p for (v, s, _), p in latest.items() if (v, s) == (version, segment))
        name = f"v{version}" + (f" line {segment}" if segment else "")
        drawn = scorer.plot([t for t, e, _ in points if e is not None], [e for _, e, _ in points if e is not None],
                            label=f"{name} estimated")
        scorer.scatter([t for t, _, y in points if y is not None], [y for _, _, y in points if y is not None],
                       color=drawn[0].get_color(), s=10, label=f"{name} from labels")
    scorer.set_title("the scorer: estimated accuracy per window" + ("" if split else " (all lines)"))
    buckets: dict[tuple[int, int], list[int]] = {}
    for at, _, line, right, rows in handed["answers"]:
        total = buckets.setdefault((line, int((at - start) // 5)), [0, 0])
        total[0] += right
        total[1] += rows
    for line in sorted({line for line, _ in buckets}):
        points = sorted((5 * b + 2.5, r / n) for (of, b), (r, n) in buckets.items() if of == line)
        truth.plot(*zip(*points), label=f"line {line}")
    truth.set_title("true accuracy of the answers, per line")
    for axes in (scorer, truth):
        axes.axvline(handed["drift_at"] - start, color="grey", ls=":", label="line 3's lamps change")
        axes.axvline(handed["alert_at"] - start, color="red", ls="--", label="alert")
        axes.set_xlabel("seconds since the traffic began")
        axes.legend(fontsize=7, loc="lower left")
    scorer.set_ylabel("accuracy")
    figure.tight_layout()
    figure.savefig(out / "accuracy.png", dpi=100)
    plt.close(figure)
    return out / "accuracy.png"


def rollout_plot(handed: dict, out: Path) -> Path:
    """``rollout.png``: each version's share of the model's traffic over time (the router's splits),
    the shadow step shaded, the alert marked."""
    start = handed["traffic_started"]
    splits = handed["traffic"] + [(max(at for at, *_ in handed["quality"]), handed["traffic"][-1][1])]
    versions = sorted({v for _, split in splits for v in split}, key=int)
    figure, axes = plt.subplots(figsize=(7, 3.4))
    for version in versions:
        axes.step([at - start for at, _ in splits], [split.get(version, 0.0) for _, split in splits], where="post",
                  label=f"version {version}")
    if handed.get("shadow"):
        begin, end, percent = handed["shadow"]
        axes.axvspan(begin - start, end - start, color="grey", alpha=0.2, label=f"shadow ({percent:g}% mirrored)")
    axes.axvline(handed["alert_at"] - start, color="red", ls="--", label="alert")
    axes.set_ylim(-5, 105)
    axes.set_xlabel("seconds since the traffic began")
    axes.set_ylabel("share of the traffic, %")
    axes.set_title("the loop's rollout: traffic by version")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "rollout.png", dpi=100)
    plt.close(figure)
    return out / "rollout.png"


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
