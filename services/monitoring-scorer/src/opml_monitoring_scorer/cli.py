"""``opml monitor``: what the monitoring-scorer sees of each model version, its alerts and rules,
and a plot of estimated against true quality."""

from __future__ import annotations

import csv
import json
import math
import re
from datetime import datetime
from pathlib import Path

import click
from opml.monitoring.v1 import monitoring_pb2 as pb
from rich.table import Table

from opml_common.cligroup import ClientSession, output_console, pass_session, service_group
from opml_common.errors import InvalidArgument
from opml_monitoring_scorer_contract.client import MonitoringClient

console = output_console()


def _fmt(window, field: str) -> str:
    return f"{getattr(window, field):.3f}" if window.HasField(field) else "-"


@service_group("monitor", service="monitoring-scorer", client=MonitoringClient, default_target="127.0.0.1:50056")
def monitor() -> None:
    """Label-free quality, drift and alerts of served models (after ParallelM's MPP)."""


@monitor.command("register")
@click.argument("model")
@click.argument("version")
@click.option("--context", required=True, help="Bundle-store context of the reference bundle.")
@click.option("--bundle", required=True, help="Reference bundle (name or UUID): reference.npz, monitoring.yaml.")
@pass_session
def register(session: ClientSession, model: str, version: str, context: str, bundle: str) -> None:
    """Monitor MODEL VERSION (served elsewhere) from a reference bundle."""
    with console.status("fetching the reference and training the MPP..."), session.client() as client:
        status = client.register(model, version, context, bundle)
    console.print(f"monitoring {status.name} ({status.task}, {status.reference_rows} reference rows)")
    for limitation in status.limitations:
        console.print(f"  note: {limitation}")


@monitor.command("ls")
@pass_session
def ls(session: ClientSession) -> None:
    """Every monitored version with its last window."""
    with session.client() as client:
        models = client.list_models()
    table = Table("version", "task", "windows", "score", "mpp", "cbpe", "true", "firing")
    for status in models:
        w = status.last_window
        table.add_row(status.name, status.task or "-", str(status.windows), f"{w.score:.3f}" if status.windows else "-",
                      _fmt(w, "mpp"), _fmt(w, "cbpe"), _fmt(w, "true_value"), ", ".join(status.firing) or "-")
    console.print(table)


@monitor.command("status")
@click.argument("model")
@click.argument("version")
@click.option("--segment", default="", help="One segment's (a value of monitoring.yaml's segment.parameter); "
                                            "default: the version as a whole.")
@pass_session
def status(session: ClientSession, model: str, version: str, segment: str) -> None:
    """One version (or one of its segments): reference, limitations, last window, firing alerts."""
    with session.client() as client:
        s = client.status(model, version, segment=segment)
    for line in status_lines(s):
        console.print(line)


def status_lines(s: pb.ModelStatus) -> list[str]:
    """``opml monitor status``'s lines for a ``ModelStatus``: a version monitored without reference
    rows (its bundle had no reference.npz) says so rather than show a blank task and a 0.000 performance."""
    reference = f"reference {s.reference.context}/{s.reference.bundle}"
    if s.reference_rows:
        reference += f" ({s.reference_rows} rows, performance {s.reference_performance:.3f})"
    else:
        reference += " (no reference rows)"
    segments = []
    if s.segment_parameter:
        segments.append(f"segments by request parameter {s.segment_parameter}: {', '.join(s.segments) or 'none yet'}")
    return [f"{s.name}{f' segment {s.segment}' if s.segment else ''}: {s.task or 'task unknown'}, {reference}",
            f"windows {s.windows}, predictions {s.predictions}, firing: {', '.join(s.firing) or 'none'}",
            *segments, *(f"note: {limitation}" for limitation in s.limitations)]


@monitor.command("windows")
@click.argument("model")
@click.argument("version")
@click.option("--limit", default=20, show_default=True, help="Newest windows to show.")
@click.option("--segment", default="", help="One segment's (a value of monitoring.yaml's segment.parameter); "
                                            "default: the version as a whole.")
@pass_session
def windows(session: ClientSession, model: str, version: str, limit: int, segment: str) -> None:
    """Window scores, newest first: score, estimates, truth, drifted features, data quality."""
    table = Table("window", "rows", "score", "mpp", "cbpe", "true", "labelled", "drifted", "bad rows")
    with session.client() as client:
        for n, w in enumerate(client.windows(model, version, page_size=min(limit, 1000), segment=segment)):
            if n >= limit:
                break
            drifted = ",".join(d.feature for d in w.drift if d.drifted) or "-"
            table.add_row(str(w.index), str(w.rows), f"{w.score:.3f}", _fmt(w, "mpp"), _fmt(w, "cbpe"),
                          _fmt(w, "true_value"), str(w.labelled), drifted, f"{w.data_quality_share:.1%}")
    console.print(table)


@monitor.command("alerts")
@click.argument("model", required=False, default="")
@click.argument("version", required=False, default="")
@click.option("--segment", default="", help="One segment's (a value of monitoring.yaml's segment.parameter); "
                                            "default: the version as a whole.")
@pass_session
def alerts(session: ClientSession, model: str, version: str, segment: str) -> None:
    """Alerts, newest first (of one version, or all; of the version as a whole, or of one segment)."""
    with session.client() as client:
        found = client.alerts(model, version, segment=segment)
    table = Table("version", "rule", "state", "raised at", "resolved at", "signal", "value", "features")
    for a in found:
        table.add_row(a.name + (f" [{a.segment}]" if a.segment else ""), a.rule, "firing" if a.firing else "resolved", str(a.raised_at_window),
                      str(a.resolved_at_window) if not a.firing else "-", a.signal, f"{a.value:.3f}",
                      ", ".join(f"{k}={v:.2f}" for k, v in a.features.items()) or "-")
    console.print(table)


LABELS_PER_CALL = 1000
"""Labels sent per SubmitLabels call (the most the service takes)."""
MAX_PROBLEMS_SHOWN = 50
Label = tuple[str, list[float], float | None]


def _label_values(raw: object) -> list[float]:
    """A label cell: a number, a list of numbers (one per row of the request), or "1;0;1" in a CSV.

    Raises: ValueError: not numbers (a class name: the service takes class indexes)."""
    items = raw if isinstance(raw, list) else str(raw).split(";") if isinstance(raw, str) else [raw]
    values = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int | float | str):
            raise ValueError(f"{item!r} is not a number")
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"{item!r} is not a number (send the class index, not the class name)") from None
        if not math.isfinite(value):
            raise ValueError(f"{item!r} is not a finite number")
        values.append(value)
    if not values:
        raise ValueError("holds no value")
    return values


def _label_time(raw: object) -> float | None:
    """Epoch seconds, or an ISO 8601 time with its zone; empty: now. Raises: ValueError."""
    if raw in (None, ""):
        return None
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    text = str(raw)
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} names no time zone")
    return moment.timestamp()


def read_labels(path: Path) -> list[Label]:
    """The labels of a .csv (a header with ``request_id`` and ``label``, optional ``time``) or a .jsonl
    file (objects with the same keys); every bad line is named at once.

    Raises: click.ClickException: the file's problems, by line."""
    rows: list[tuple[int, dict]] = []
    problems: list[str] = []
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as file:
            reader = csv.DictReader(file)
            missing = {"request_id", "label"} - set(reader.fieldnames or ())
            if missing:
                raise click.ClickException(f"{path}: the header must name request_id and label (missing: "
                                           f"{', '.join(sorted(missing))})")
            rows = [(reader.line_num, row) for row in reader]
    elif path.suffix.lower() in (".jsonl", ".ndjson"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(f"line {number}: not JSON: {exc.msg}")
                continue
            if not isinstance(row, dict):
                problems.append(f"line {number}: must be an object with request_id and label")
                continue
            rows.append((number, row))
    else:
        raise click.ClickException(f"{path}: must be a .csv or a .jsonl file")
    labels: list[Label] = []
    for number, row in rows:
        request_id = row.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            problems.append(f"line {number}: request_id must be a non-empty string")
        try:
            values = _label_values(row.get("label"))
        except ValueError as exc:
            problems.append(f"line {number}: label {exc}")
        try:
            moment = _label_time(row.get("time"))
        except ValueError as exc:
            problems.append(f"line {number}: time {exc}")
        if not problems:
            labels.append((request_id, values, moment))
    if problems:
        shown = problems[:MAX_PROBLEMS_SHOWN]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise click.ClickException(f"{path}: nothing sent, {len(problems)} problems:\n  " + "\n  ".join(shown) + more)
    if not labels:
        raise click.ClickException(f"{path}: holds no label")
    return labels


def _in_file(field: str, offset: int) -> str:
    """A refused field of a call (labels[i]) as the file's label it came from (its 1-based position)."""
    return re.sub(r"^labels\[(\d+)\]", lambda found: f"label {offset + int(found[1]) + 1}", field)


@monitor.command("label")
@click.argument("model")
@click.option("-f", "--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="A .csv (request_id,label[,time]) or .jsonl ({request_id, label, time}) of true labels.")
@click.option("--version", default="", help="Check that this version of MODEL is monitored (and its label type).")
@pass_session
def label(session: ClientSession, model: str, path: Path, version: str) -> None:
    """Send the true labels of MODEL's served requests (the class index, or the value for regression;
    several values "1;0;1" for a request of several rows); the scorer joins each to its prediction."""
    labels = read_labels(path)
    sent = 0
    with session.client() as client, console.status(f"sending {len(labels)} labels...") as shown:
        for begin in range(0, len(labels), LABELS_PER_CALL):
            chunk = labels[begin:begin + LABELS_PER_CALL]
            try:
                sent += client.submit_labels(model, chunk, version=version)
            except InvalidArgument as error:
                raise click.ClickException(f"{sent} labels sent; the service refused the next {len(chunk)}:\n  "
                                           + "\n  ".join(f"{_in_file(field, begin)}: {rule}"
                                                          for field, rule in error.violations)) from None
            shown.update(f"sending labels: {sent} of {len(labels)}")
    console.print(f"sent {sent} labels of {model}; each is joined to its prediction when the scorer sees it "
                  f"(see `opml monitor windows {model} VERSION`, column true)")


@monitor.group("rules")
def rules() -> None:
    """Alert rules of a version (YAML)."""


@rules.command("get")
@click.argument("model")
@click.argument("version")
@pass_session
def rules_get(session: ClientSession, model: str, version: str) -> None:
    with session.client() as client:
        click.echo(client.get_rules(model, version).yaml, nl=False)


@rules.command("set")
@click.argument("model")
@click.argument("version")
@click.option("-f", "--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@pass_session
def rules_set(session: ClientSession, model: str, version: str, path: Path) -> None:
    """Replace the rules with a YAML file's (a list, or {rules: [...]})."""
    with session.client() as client:
        click.echo(client.set_rules(model, version, path.read_text()).yaml, nl=False)


@monitor.command("plot")
@click.argument("model")
@click.argument("version")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True, help="PNG file.")
@pass_session
def plot(session: ClientSession, model: str, version: str, output: Path) -> None:
    """A PNG of the estimated (MPP, CBPE) against the true quality per window, and the score."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with session.client() as client:
        found = sorted(client.windows(model, version, page_size=1000), key=lambda w: w.index)
    if not found:
        raise click.ClickException(f"models/{model}/versions/{version} has no window yet")
    figure, axis = plt.subplots(figsize=(9, 4))
    x = [w.index for w in found]
    for field, label in (("mpp", "MPP estimate"), ("cbpe", "CBPE estimate"), ("true_value", "true (labels)")):
        points = [(w.index, getattr(w, field)) for w in found if w.HasField(field)]
        if points:
            axis.plot(*zip(*points), marker=".", label=label)
    axis.plot(x, [w.score for w in found], linestyle="--", color="grey", label="quality score")
    axis.set_xlabel("window")
    axis.set_ylabel("accuracy (MAE for regression) / score")
    axis.set_title(f"models/{model}/versions/{version}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(output, format="png", dpi=100)
    console.print(f"wrote {output} ({len(found)} windows)")
