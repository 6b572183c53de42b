"""``opml fl``: start federations from YAML, list them, watch rounds live, stop, register clients,
and plot accuracy against time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click
from google.protobuf.json_format import MessageToDict
from opml.fl.v1 import fl_pb2 as pb
from rich.table import Table

from opml_common.cligroup import ClientSession, output_console, pass_session, service_group
from opml_fl_coordinator.config import parse_config
from opml_fl_coordinator_contract.client import FederationClient

console = output_console()


def _state(value: int) -> str:
    return pb.FederationState.Name(value).removeprefix("FEDERATION_STATE_").lower()


def _accuracy(metrics) -> str:
    value = metrics.get("accuracy", metrics.get("client_accuracy"))
    return "-" if value is None else f"{value:.4f}"


def _round_line(r: pb.Round) -> str:
    dropped = ", ".join(f"{c} ({why})" for c, why in sorted(r.dropped.items())) or "-"
    rejected = ", ".join(f"{c} ({why})" for c, why in sorted(r.rejected.items())) or "-"
    tier = "" if r.tier < 0 else f" tier {r.tier}"
    return (f"round {r.number}{tier}: {r.duration_seconds:.2f} s, accuracy {_accuracy(r.metrics)}, "
            f"clients {', '.join(r.participants) or '-'}; dropped {dropped}; rejected {rejected}")


@service_group("fl", service="fl-coordinator", client=FederationClient, default_target="127.0.0.1:50057")
def fl() -> None:
    """Federated training across clients that keep their data (TiFL tiers, deadlines, semi-async rounds)."""


@fl.command("create")
@click.option("-f", "--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="The federation's config (YAML); see services/fl-coordinator/examples/.")
@pass_session
def create(session: ClientSession, path: Path) -> None:
    """Start a federation (the config is checked here first: every wrong field at once)."""
    text = path.read_text()
    parse_config(text, what=str(path))
    with session.client() as client:
        made = client.create(text)
    console.print(f"created {made.name} ({_state(made.state)}), {made.total_rounds} rounds")


@fl.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@pass_session
def ls(session: ClientSession, as_json: bool) -> None:
    """List federations."""
    with session.client() as client:
        federations = client.list()
    if as_json:
        click.echo(json.dumps([MessageToDict(f) for f in federations], indent=2))
        return
    table = Table("federation", "state", "rounds", "clients", "accuracy", "model", "reason")
    for f in federations:
        table.add_row(f.name.removeprefix("federations/"), _state(f.state), f"{f.completed_rounds}/{f.total_rounds}",
                      f"{f.present_clients}/{f.known_clients}", _accuracy(f.metrics), f.model_bundle or "-",
                      f.reason or "-")
    console.print(table)


@fl.command("get")
@click.argument("federation")
@pass_session
def get(session: ClientSession, federation: str) -> None:
    """Show a federation (JSON)."""
    with session.client() as client:
        click.echo(json.dumps(MessageToDict(client.get(federation)), indent=2))


@fl.command("rounds")
@click.argument("federation")
@pass_session
def rounds(session: ClientSession, federation: str) -> None:
    """Completed rounds: time, accuracy, who took part, who was dropped or rejected and why."""
    with session.client() as client:
        for r in client.rounds(federation):
            click.echo(_round_line(r))


@fl.command("watch")
@click.argument("federation")
@pass_session
def watch(session: ClientSession, federation: str) -> None:
    """Print each round as it completes, until the federation ends (across restarts of the service:
    a reconnect's rounds so far are not printed again)."""
    last = 0

    def read(client) -> Iterator[pb.Round]:
        return (r for r in client.watch(federation) if r.number > last)

    for r in session.follow(read):
        last = r.number
        click.echo(_round_line(r))


@fl.command("stop")
@click.argument("federation")
@pass_session
def stop(session: ClientSession, federation: str) -> None:
    """End a federation now (its last completed round's model stays)."""
    with session.client() as client:
        done = client.stop(federation)
    console.print(f"{done.name} {_state(done.state)}: {done.reason}")


@fl.command("register")
@click.argument("federation")
@click.argument("client_id")
@click.option("--label", "labels", multiple=True, help="key=value kept in the client's profile (repeatable).")
@pass_session
def register(session: ClientSession, federation: str, client_id: str, labels: tuple[str, ...]) -> None:
    """Register a client and print its token (shown once; give it to the client as OPML_FL_CLIENT_TOKEN)."""
    pairs = dict(label.partition("=")[::2] for label in labels)
    with session.client() as client:
        credential = client.register_client(federation, client_id, pairs)
    click.echo(credential.token)


@fl.command("plot")
@click.argument("federation")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True, help="PNG file.")
@pass_session
def plot(session: ClientSession, federation: str, output: Path) -> None:
    """Accuracy against time since the first round started, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with session.client() as client:
        history = client.rounds(federation)
    if not history:
        raise click.ClickException(f"federation {federation!r} has no completed rounds yet")
    start = history[0].start_time.ToNanoseconds() / 1e9
    points = [(r.end_time.ToNanoseconds() / 1e9 - start, r.metrics.get("accuracy", r.metrics.get("client_accuracy")))
              for r in history]
    points = [(t, a) for t, a in points if a is not None]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot([t for t, _ in points], [a for _, a in points], marker="o")
    axes.set_xlabel("seconds since round 1 started")
    axes.set_ylabel("accuracy")
    axes.set_title(f"federation {federation}")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)
    console.print(f"wrote {output} ({len(points)} rounds)")
