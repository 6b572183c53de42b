"""``opml pipeline``: continuous training pipelines on the job-orchestrator (after TFX)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from google.protobuf.json_format import MessageToDict
from opml.jobs.v1 import pipelines_pb2 as pb
from rich.table import Table

from opml_common.cligroup import ClientSession, output_console, pass_session, service_group
from opml_job_orchestrator_contract.pipelineclient import PipelineClient
from opml_job_orchestrator_contract.pipelinespec import KIND_NAMES, load_pipeline

console = output_console()
_RUN_POLL_S = 0.5


def _run_state(value: int) -> str:
    return pb.RunState.Name(value).removeprefix("RUN_STATE_").lower()


def _step_state(value: int) -> str:
    return pb.StepState.Name(value).removeprefix("STEP_STATE_").lower()


def _time(message, field: str) -> str:
    return getattr(message, field).ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if message.HasField(field) else "-"


@service_group("pipeline", service="job-orchestrator", client=PipelineClient, default_target="127.0.0.1:50052")
def pipeline() -> None:
    """Continuous training pipelines: spans -> validate -> train -> evaluate -> bless -> push (after TFX)."""


@pipeline.command("apply")
@click.option("-f", "--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="The pipeline spec (YAML); see the job-orchestrator's README, Pipelines.")
@pass_session
def apply(session: ClientSession, path: Path) -> None:
    """Create or replace a pipeline from a YAML spec (every mistake is reported at once)."""
    spec = load_pipeline(path.read_text(), what=str(path))
    with session.client() as client:
        applied = client.apply(spec)
    console.print(f"applied {applied.spec.name} ({len(applied.spec.steps)} steps)")


@pipeline.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@pass_session
def ls(session: ClientSession, as_json: bool) -> None:
    """List pipelines."""
    with session.client() as client:
        found = client.list()
    if as_json:
        click.echo(json.dumps([MessageToDict(p) for p in found], indent=2))
        return
    table = Table("pipeline", "steps", "triggers", "active run", "last run", "blessed run", "updated")
    for item in found:
        triggers = [t for t, on in (("span", item.spec.triggers.on_span), ("alert", item.spec.triggers.on_alert))
                    if on] + ([f"cron {item.spec.triggers.schedule}"] if item.spec.triggers.schedule else [])
        table.add_row(item.spec.name, " -> ".join(s.name for s in item.spec.steps), ", ".join(triggers) or "rpc",
                      str(item.active_run or "-") + (" (+1 pending)" if item.run_pending else ""),
                      str(item.last_run or "-"), str(item.blessed_run or "-"), _time(item, "update_time"))
    console.print(table)


@pipeline.command("get")
@click.argument("name")
@pass_session
def get(session: ClientSession, name: str) -> None:
    """Show a pipeline (JSON)."""
    with session.client() as client:
        click.echo(json.dumps(MessageToDict(client.get(name)), indent=2))


@pipeline.command("runs")
@click.argument("name")
@click.option("--run", "number", type=int, default=None, help="Show this run's steps only.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@pass_session
def runs(session: ClientSession, name: str, number: int | None, as_json: bool) -> None:
    """A pipeline's runs, newest first, each with its steps: state, cache decision, job, outputs."""
    with session.client() as client:
        found = [client.run(name, number)] if number else client.runs(name)
    if as_json:
        click.echo(json.dumps([MessageToDict(r) for r in found], indent=2))
        return
    for run in found:
        _print_run(run)


def _print_run(run: pb.PipelineRun) -> None:
    console.print(f"[bold]run {run.number}[/bold] {_run_state(run.state)}  started {_time(run, 'create_time')}  "
                  f"ended {_time(run, 'end_time')}  blessed: {'yes' if run.blessed else 'no'}  "
                  f"triggers: {'; '.join(run.triggers) or '-'}")
    table = Table("step", "kind", "state", "decision", "job", "outputs", "message")
    for step in run.steps:
        outputs = ", ".join(f"{o.role}{'[' + o.key + ']' if o.key else ''}:{o.uuid[:8]}" for o in step.outputs)
        decision = step.decision + (f" ({step.details['start_reason']})" if "start_reason" in step.details else "")
        table.add_row(step.step, KIND_NAMES.get(step.kind, "?"), _step_state(step.state), decision or "-",
                      step.job_id or "-", outputs or "-", step.message or "-")
    console.print(table)


@pipeline.command("trigger")
@click.argument("name")
@click.option("--reason", default="", help="Said in the run's triggers.")
@pass_session
def trigger(session: ClientSession, name: str, reason: str) -> None:
    """Ask for a run; one going already takes this request as one more run after it."""
    with session.client() as client:
        answer = client.trigger(name, reason)
    if answer.coalesced:
        console.print(f"{name}: a run is going; one more run follows it")
    else:
        console.print(f"{name}: run {answer.run} started")


@pipeline.command("run")
@click.argument("name")
@click.option("--reason", default="", help="Said in the run's triggers.")
@pass_session
def run(session: ClientSession, name: str, reason: str) -> None:
    """Start a run and follow it step by step until it ends (exit 1 if it failed)."""
    with session.client() as client:
        answer = client.trigger(name, reason)
        if answer.coalesced:
            console.print(f"{name}: a run is going; one more run follows it (`opml pipeline runs {name}`)")
            return
        shown: dict[str, int] = {}
        while True:
            current = client.run(name, answer.run)
            for step in current.steps:
                if shown.get(step.step) != step.state and step.state != pb.STEP_STATE_PENDING:
                    shown[step.step] = step.state
                    click.echo(f"{step.step:<16} {_step_state(step.state):<10} "
                               f"{step.decision or step.message or ''}".rstrip())
            if current.state != pb.RUN_STATE_RUNNING:
                break
            time.sleep(_RUN_POLL_S)
    click.echo(f"run {current.number} {_run_state(current.state)}: {current.message}")
    if current.state == pb.RUN_STATE_FAILED:
        raise SystemExit(1)


@pipeline.command("bless")
@click.argument("name")
@click.argument("run_number", type=int)
@click.option("--force", is_flag=True, required=True, help="Required: override the evaluation's verdict.")
@click.option("--reason", required=True, help="Why (kept in the blessing record and the event).")
@pass_session
def bless(session: ClientSession, name: str, run_number: int, force: bool, reason: str) -> None:
    """Bless a run's model over its evaluation (admin role; audited)."""
    if not force:
        raise click.UsageError("--force is required: a blessing outside the thresholds is an explicit act")
    with session.client() as client:
        blessed = client.force_bless(name, run_number, reason)
    console.print(f"{name} run {blessed.number} blessed (forced); {_run_state(blessed.state)}")


@pipeline.command("rm")
@click.argument("name")
@pass_session
def rm(session: ClientSession, name: str) -> None:
    """Delete a pipeline and its runs' records (its bundles stay in the bundle-store)."""
    with session.client() as client:
        client.delete(name)
    console.print(f"deleted {name}")
