"""``opml experiment``: Katib experiments on the automl-controller (create, follow, compare trials)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import click
from google.protobuf.json_format import MessageToDict
from opml.automl.v1 import automl_pb2 as pb
from rich.live import Live
from rich.table import Table

from opml_automl_controller import report
from opml_automl_controller.katib import MAX_EXPERIMENT_BYTES, check_experiment, parse_experiment
from opml_automl_controller_contract.client import ExperimentClient
from opml_common.cligroup import ClientSession, output_console, pass_session, service_group

console = output_console()
_ENDED = (pb.EXPERIMENT_STATE_SUCCEEDED, pb.EXPERIMENT_STATE_FAILED, pb.EXPERIMENT_STATE_STOPPED)


def _state(value: int, enum=pb.ExperimentState) -> str:
    return enum.Name(value).split("_STATE_", 1)[1].lower()


def _read(path: Path) -> str:
    if path.stat().st_size > MAX_EXPERIMENT_BYTES:
        raise click.ClickException(f"{path}: must be at most {MAX_EXPERIMENT_BYTES} bytes, but has "
                                   f"{path.stat().st_size}")
    return path.read_text()


def _value(trial: pb.Trial) -> str:
    return f"{trial.objective_value:.6g}" if trial.HasField("objective_value") else "-"


def trials_table(experiment: pb.Experiment, trials: list[pb.Trial]) -> Table:
    names = sorted({name for t in trials for name in t.parameters})
    table = Table("trial", "state", *names, experiment.objective_metric, "job", "message",
                  title=f"{experiment.name}: {_state(experiment.status.state)} ({experiment.status.reason}) "
                        f"{experiment.status.trials}/{experiment.max_trial_count} trials")
    best = experiment.status.current_optimal_trial.number if experiment.status.HasField("current_optimal_trial") \
        else None
    for trial in trials:
        mark = " *" if trial.number == best else ""
        table.add_row(f"{trial.number}{mark}", _state(trial.state, pb.TrialState),
                      *[trial.parameters.get(n, "-") for n in names], _value(trial), trial.job_id,
                      trial.message[:60])
    return table


@service_group("experiment", service="automl-controller", client=ExperimentClient, default_target="127.0.0.1:50055")
def experiment() -> None:
    """Katib v1beta1 experiments on Optuna's samplers, each trial a TE job (after Katib)."""


def _watch(session: ClientSession, name: str, interval: float) -> pb.Experiment:
    """Refreshes the trials table until the experiment ends, reconnecting when the service restarts."""
    def read(client: ExperimentClient) -> Iterator[tuple[pb.Experiment, list[pb.Trial]]]:
        while True:
            shown = client.get(name)
            yield shown, client.trials(name)
            if shown.status.state in _ENDED:
                return
            time.sleep(interval)

    with Live(console=console, refresh_per_second=4) as live:
        for shown, trials in session.follow(read):
            live.update(trials_table(shown, trials))
    return shown


@experiment.command("create")
@click.option("-f", "--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="The Katib Experiment (YAML).")
@click.option("-w", "--watch", is_flag=True, help="Show its trials live until it ends.")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between refreshes with --watch.")
@pass_session
def create(session: ClientSession, path: Path, watch: bool, interval: float) -> None:
    """Create (and start) an experiment."""
    text = _read(path)
    # every mistake, with the file's line and column, before a request; unknown fields are ignored, and said
    for warning in check_experiment(text, what=str(path)).warnings:
        click.echo(f"warning: {warning}", err=True)
    with session.client() as client:
        created = client.create(text)
    console.print(f"created {created.name} ({created.algorithm}, {created.max_trial_count} trials, "
                  f"{created.parallel_trial_count} at once)")
    if watch:
        _watch(session, created.name.split("/", 1)[1], interval)


@experiment.command("validate")
@click.option("-f", "--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@pass_session
def validate(session: ClientSession, path: Path) -> None:
    """Dry run: every rule the experiment breaks, or the first trial's job and what it ignores."""
    with session.client() as client:
        checked = client.validate(_read(path))
    console.print(f"{path}: valid ({checked.experiment.algorithm}, {checked.experiment.max_trial_count} trials)")
    if checked.HasField("trial_job"):
        click.echo(json.dumps(MessageToDict(checked.trial_job), indent=2))
    for note in checked.notes:
        console.print(f"note: {note}", markup=False)
    for warning in checked.warnings:
        click.echo(f"warning: {warning}", err=True)


@experiment.command("get")
@click.argument("name")
@pass_session
def get(session: ClientSession, name: str) -> None:
    """Show an experiment and its status (JSON)."""
    with session.client() as client:
        shown = client.get(name)
    click.echo(json.dumps(MessageToDict(shown), indent=2))


@experiment.command("ls")
@pass_session
def ls(session: ClientSession) -> None:
    """List experiments in creation order."""
    with session.client() as client:
        items = client.list()
    table = Table("experiment", "state", "reason", "algorithm", "trials", "best", "objective")
    for item in items:
        status = item.status
        best = _value(status.current_optimal_trial) if status.HasField("current_optimal_trial") else "-"
        table.add_row(item.name.split("/", 1)[1], _state(status.state), status.reason, item.algorithm,
                      f"{status.trials}/{item.max_trial_count}", best,
                      f"{item.objective_type} {item.objective_metric}")
    console.print(table)


@experiment.command("trials")
@click.argument("name")
@click.option("-w", "--watch", is_flag=True, help="Refresh until the experiment ends.")
@click.option("--interval", default=1.0, show_default=True)
@pass_session
def trials(session: ClientSession, name: str, watch: bool, interval: float) -> None:
    """The experiment's trials: parameters, state, objective (* marks the best)."""
    if watch:
        _watch(session, name, interval)
        return
    with session.client() as client:
        console.print(trials_table(client.get(name), client.trials(name)))


@experiment.command("best")
@click.argument("name")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the optimization history and parameter importances as a PNG.")
@pass_session
def best(session: ClientSession, name: str, plot_path: Path | None) -> None:
    """The best trial, the optimization history and the parameter importances (Optuna's fANOVA)."""
    with session.client() as client:
        shown = client.get(name)
        all_trials = client.trials(name)
    spec = parse_experiment(shown.katib_yaml)
    if not shown.status.HasField("current_optimal_trial"):
        raise click.ClickException(f"experiment {name!r} has no succeeded trial yet")
    top = shown.status.current_optimal_trial
    console.print(f"best trial {top.number}: {shown.objective_metric} = {_value(top)}  "
                  + "  ".join(f"{k}={v}" for k, v in sorted(top.parameters.items())))
    table = Table("trial", shown.objective_metric, "best so far", title="optimization history")
    for number, value, so_far in report.history(spec, all_trials):
        table.add_row(str(number), f"{value:.6g}", f"{so_far:.6g}")
    console.print(table)
    try:
        shares = report.importances(spec, all_trials)
    except ValueError as error:
        console.print(f"importances: {error}")
    else:
        table = Table("parameter", "importance", title="parameter importances (fANOVA)")
        for parameter, share in shares.items():
            table.add_row(parameter, f"{share:.3f}")
        console.print(table)
    if plot_path is not None:
        report.plot(spec, all_trials, plot_path)
        console.print(f"wrote {plot_path}")


@experiment.command("stop")
@click.argument("name")
@pass_session
def stop(session: ClientSession, name: str) -> None:
    """Stop a running experiment (its running trials' jobs are cancelled)."""
    with session.client() as client:
        done = client.stop(name)
    console.print(f"{done.name} {_state(done.status.state)}")


@experiment.command("resume")
@click.argument("name")
@click.option("--max-trial-count", type=int, default=0, help="A larger trial budget (needed for a succeeded "
              "experiment with resumePolicy LongRunning).")
@pass_session
def resume(session: ClientSession, name: str, max_trial_count: int) -> None:
    """Run a stopped experiment again, or a finished LongRunning one to a larger budget."""
    with session.client() as client:
        done = client.resume(name, max_trial_count)
    console.print(f"{done.name} {_state(done.status.state)} to {done.max_trial_count} trials")


@experiment.command("delete")
@click.argument("name")
@pass_session
def delete(session: ClientSession, name: str) -> None:
    """Delete an experiment, its trials and its sampler history (admin role)."""
    with session.client() as client:
        client.delete(name)
    console.print(f"deleted experiments/{name}")


