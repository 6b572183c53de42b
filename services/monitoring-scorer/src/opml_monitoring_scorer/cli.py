"""``opml monitor``: what the monitoring-scorer sees of each model version, its alerts and rules,
and a plot of estimated against true quality."""

from __future__ import annotations

from pathlib import Path

import click
from opml.monitoring.v1 import monitoring_pb2 as pb
from rich.table import Table

from opml_common.cligroup import ClientSession, output_console, pass_session, service_group
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
@pass_session
def status(session: ClientSession, model: str, version: str) -> None:
    """One version: reference, limitations, last window, firing alerts."""
    with session.client() as client:
        s = client.status(model, version)
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
    return [f"{s.name}: {s.task or 'task unknown'}, {reference}",
            f"windows {s.windows}, predictions {s.predictions}, firing: {', '.join(s.firing) or 'none'}",
            *(f"note: {limitation}" for limitation in s.limitations)]


@monitor.command("windows")
@click.argument("model")
@click.argument("version")
@click.option("--limit", default=20, show_default=True, help="Newest windows to show.")
@pass_session
def windows(session: ClientSession, model: str, version: str, limit: int) -> None:
    """Window scores, newest first: score, estimates, truth, drifted features, data quality."""
    table = Table("window", "rows", "score", "mpp", "cbpe", "true", "labelled", "drifted", "bad rows")
    with session.client() as client:
        for n, w in enumerate(client.windows(model, version, page_size=min(limit, 1000))):
            if n >= limit:
                break
            drifted = ",".join(d.feature for d in w.drift if d.drifted) or "-"
            table.add_row(str(w.index), str(w.rows), f"{w.score:.3f}", _fmt(w, "mpp"), _fmt(w, "cbpe"),
                          _fmt(w, "true_value"), str(w.labelled), drifted, f"{w.data_quality_share:.1%}")
    console.print(table)


@monitor.command("alerts")
@click.argument("model", required=False, default="")
@click.argument("version", required=False, default="")
@pass_session
def alerts(session: ClientSession, model: str, version: str) -> None:
    """Alerts, newest first (of one version, or all)."""
    with session.client() as client:
        found = client.alerts(model, version)
    table = Table("version", "rule", "state", "raised at", "resolved at", "signal", "value", "features")
    for a in found:
        table.add_row(a.name, a.rule, "firing" if a.firing else "resolved", str(a.raised_at_window),
                      str(a.resolved_at_window) if not a.firing else "-", a.signal, f"{a.value:.3f}",
                      ", ".join(f"{k}={v:.2f}" for k, v in a.features.items()) or "-")
    console.print(table)


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
