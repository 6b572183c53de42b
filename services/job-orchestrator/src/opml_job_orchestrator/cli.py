"""``opml job``: submit, follow and control jobs on the job-orchestrator (after TonY's client)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import click
from google.protobuf.json_format import MessageToDict
from opml.jobs.v1 import jobs_pb2 as pb
from rich.table import Table

from opml_common.cligroup import ClientSession, output_console, pass_session, service_group
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import load_spec

console = output_console()
_STATES = [name.removeprefix("JOB_STATE_").lower() for name in pb.JobState.keys()[1:]]


def _state(value: int) -> str:
    return pb.JobState.Name(value).removeprefix("JOB_STATE_").lower()


def _time(status: pb.JobStatus, field: str) -> str:
    return getattr(status, field).ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if status.HasField(field) else "-"


@service_group("job", service="job-orchestrator", client=JobClient, default_target="127.0.0.1:50052")
def job() -> None:
    """Distributed TensorFlow jobs, TE before BE, with preemption and retries (after TonY)."""


@job.command("submit")
@click.option("-f", "--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="The job spec (YAML); see services/job-orchestrator/examples/.")
@click.option("--name", default=None, help="Job name instead of the spec's `name`.")
@pass_session
def submit(session: ClientSession, path: Path, name: str | None) -> None:
    """Submit the job of a YAML spec."""
    spec = load_spec(path.read_text(), what=str(path))  # a syntax error names the file, line, column
    if name:
        spec.name = name
    with session.client() as client:
        submitted = client.submit(spec)
    console.print(f"submitted {submitted.status.job_id} ({_state(submitted.status.state)})")


@job.command("get")
@click.argument("job_id")
@pass_session
def get(session: ClientSession, job_id: str) -> None:
    """Show a job's spec and status (JSON)."""
    with session.client() as client:
        shown = client.get(job_id)
    click.echo(json.dumps(MessageToDict(shown), indent=2))


@job.command("ls")
@click.option("--state", type=click.Choice(_STATES), default=None, help="Only jobs in this state.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@pass_session
def ls(session: ClientSession, state: str | None, as_json: bool) -> None:
    """List jobs in submission order."""
    with session.client() as client:
        jobs = client.list(state=pb.JobState.Value(f"JOB_STATE_{state.upper()}") if state else 0)
    if as_json:
        click.echo(json.dumps([MessageToDict(j) for j in jobs], indent=2))
        return
    table = Table("job", "class", "state", "attempt", "retries", "preemptions", "submitted", "cause")
    for item in jobs:
        status = item.status
        table.add_row(status.job_id, pb.JobClass.Name(item.spec.job_class).removeprefix("JOB_CLASS_"),
                      _state(status.state), str(status.attempt), str(status.retries), str(status.preemptions),
                      _time(status, "submit_time"), status.cause or "-")
    console.print(table)


@job.command("logs")
@click.argument("job_id")
@click.option("--role", default="", help="chief, worker, ps or evaluator (default: the chief, else worker).")
@click.option("--index", default=0, show_default=True, help="Replica index.")
@click.option("--attempt", type=int, default=None, help="Run number (default: the latest).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
@pass_session
def logs(session: ClientSession, job_id: str, role: str, index: int, attempt: int | None, follow: bool) -> None:
    """Print what a task of a job wrote to stdout and stderr (with -f, across restarts of the service)."""
    printed: dict[int, int] = {}  # bytes printed per attempt

    def read(client) -> Iterator[tuple[int, bytes]]:
        """The chunks not printed yet: each stream sends every attempt from its first byte."""
        received: dict[int, int] = {}
        for chunk in client.logs(job_id, role=role, index=index, attempt=attempt, follow=follow):
            start = received.get(chunk.attempt, 0)
            received[chunk.attempt] = end = start + len(chunk.data)
            new = chunk.data[max(printed.get(chunk.attempt, 0) - start, 0):]
            if new:
                printed[chunk.attempt] = end
                yield chunk.attempt, new

    shown = None
    with contextlib.ExitStack() as stack:  # without -f: one read, failing at once if the service is down
        chunks = session.follow(read) if follow else read(stack.enter_context(session.client()))
        for run, data in chunks:
            if follow and run != shown:
                click.echo(f"--- attempt {run} ---", err=True)
                shown = run
            sys.stdout.write(data.decode("utf-8", errors="replace"))
            sys.stdout.flush()


@job.command("cancel")
@click.argument("job_id")
@pass_session
def cancel(session: ClientSession, job_id: str) -> None:
    """Cancel a job: drop it from the queue or stop its run."""
    with session.client() as client:
        done = client.cancel(job_id)
    console.print(f"{done.status.job_id} {_state(done.status.state)}")


@job.command("preempt")
@click.argument("job_id")
@pass_session
def preempt(session: ClientSession, job_id: str) -> None:
    """Stop a running job and queue it to resume from its checkpoint (admin role)."""
    with session.client() as client:
        done = client.preempt(job_id)
    console.print(f"{done.status.job_id} {_state(done.status.state)}: {done.status.cause}")


@job.command("watch")
@click.argument("job_id", required=False, default="")
@pass_session
def watch(session: ClientSession, job_id: str) -> None:
    """Print state changes as they happen: of one job until it ends, or of every job until Ctrl-C.
    A restart of the service is reconnected to; a job's current status is not printed again."""
    shown: dict[str, bytes] = {}  # the last status printed per job

    def read(client) -> Iterator[pb.JobChange]:
        for change in client.watch(job_id):
            status = change.status.SerializeToString(deterministic=True)
            if change.kind == pb.CHANGE_KIND_UNSPECIFIED and shown.get(change.status.job_id) == status:
                continue  # a reconnect's current status, printed already
            shown[change.status.job_id] = status
            yield change

    for change in session.follow(read):
        status = change.status
        kind = pb.ChangeKind.Name(change.kind).removeprefix("CHANGE_KIND_").lower()
        kind = "now" if kind == "unspecified" else kind
        click.echo(f"{_time(status, 'update_time')}  {status.job_id}  {kind:<10} {_state(status.state):<10} "
                   f"attempt {status.attempt}  {change.message or status.cause}".rstrip())
