"""``opml trace``: the paper's offline tools over the trace-collector API and over portable files.

A SOURCE is a file (a session file ``*.jsonl[.gz]`` of step records, or a Chrome trace
``*.json[.gz]``) when the path exists, else a run of the service: ``JOB``, ``JOB/WORKER`` or
``JOB/WORKER/SESSION``. Breakdowns are shown as :class:`analysis.Breakdown` whichever the source
(the service's replies converted by :mod:`convert`).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
from google.protobuf.json_format import MessageToDict
from opml.traces.v1 import traces_pb2 as pb
from rich.table import Table

from opml_common.cligroup import ClientSession, output_console, pass_session, service_group
from opml_common.config import PlatformSettings
from opml_trace_collector import analysis, convert
from opml_trace_collector.plots import plot_step_times
from opml_trace_collector.session import is_session_file, read_session, write_session
from opml_trace_collector_contract.client import TraceCollectorClient

console = output_console()


@service_group("trace", service="trace-collector", client=TraceCollectorClient, default_target="127.0.0.1:50054")
def trace() -> None:
    """Trace TensorFlow jobs without changing them; summarize and compare runs (after tensorflow-tracing)."""


# -- sources ------------------------------------------------------------------------------------

@dataclass
class _Source:
    label: str
    breakdown: analysis.Breakdown
    step_times: list[float]
    top_ops: list[analysis.OpStat]
    op_level: bool  # from a trace (else from step metrics)


def _load_file(path: Path, top_k: int) -> _Source:
    op_level = not is_session_file(path)
    if not op_level:
        result = analysis.analyze_steps(read_session(path), source=path.name)
    else:
        try:
            result = analysis.analyze_trace(analysis.load_trace(path), source=path.name, top_k=top_k)
        except ValueError as exc:
            raise click.BadParameter(f"{path}: {exc}") from exc
    return _Source(path.name, result, list(result.step_times_s), list(result.top_ops_by_total), op_level)


def _load_run(session: ClientSession, ref: str) -> _Source:
    job, _, rest = ref.partition("/")
    worker, _, session_id = rest.partition("/")
    with session.client() as client:
        points = client.step_series(job, worker=worker, session_id=session_id)
    records = [convert.step_record_from_proto(p.record) for p in points]
    result = analysis.analyze_steps(records, source=ref)
    return _Source(ref, result, list(result.step_times_s), [], False)


def _load(session: ClientSession, ref: str, top_k: int = analysis.DEFAULT_TOP_K) -> _Source:
    path = Path(ref)
    return _load_file(path, top_k) if path.is_file() else _load_run(session, ref)


# -- tables -------------------------------------------------------------------------------------

def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def _bound(value: int) -> str:
    return analysis.Bound(value).name.lower()


def _breakdown_table(title: str, rows: list[tuple[str, analysis.Breakdown, bool]]) -> Table:
    """One row per (label, breakdown, op_level); step metrics alone know no computation or communication."""
    table = Table("source", "steps", "step ms", "p50 ms", "p95 ms", "compute ms", "comm ms", "input ms", "idle ms",
                  "examples/s", "bound", title=title)
    for label, b, op_level in rows:
        table.add_row(label, str(b.steps), _ms(b.step_time_s), _ms(b.step_time_p50_s), _ms(b.step_time_p95_s),
                      _ms(b.computation_s) if op_level else "-", _ms(b.communication_s) if op_level else "-",
                      _ms(b.input_s), _ms(b.idle_s) if op_level else "-",
                      f"{b.examples_per_second:.1f}" if b.examples_per_second else "-", _bound(b.bound))
    return table


def _ops_table(title: str, ops: list[analysis.OpStat]) -> Table:
    table = Table("op", "type", "category", "count", "total ms", "mean ms", title=title)
    for op in ops:
        table.add_row(op.op_name, op.op_type, op.category, str(op.count), _ms(op.total_s), _ms(op.mean_s))
    return table


# -- commands -----------------------------------------------------------------------------------

@trace.command("ls")
@click.argument("job", required=False)
@pass_session
def ls(session: ClientSession, job: str | None) -> None:
    """List jobs, or the runs and captures of JOB."""
    with session.client() as client:
        if job is None:
            table = Table("job", "runs", "running", "steps", "mean step ms", "examples/s now", "last seen")
            for item in client.list_jobs():  # the throughput is the running runs' ("-": none runs)
                table.add_row(item.job, str(item.run_count), str(item.running_runs), str(item.steps),
                              _ms(item.mean_step_s), f"{item.examples_per_second:.1f}" if item.running_runs else "-",
                              item.last_seen.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"))
            console.print(table)
            return
        runs, captures = client.list_runs(job), client.list_captures(job)
    table = Table("worker", "session", "state", "steps", "batches", "missing", "examples/s", "signatures",
                  title=f"runs of {job}")
    for run in runs:
        table.add_row(run.worker, run.session_id, pb.RunState.Name(run.state).removeprefix("RUN_STATE_").lower(),
                      str(run.steps), str(run.batches), str(run.missing_batches), f"{run.examples_per_second:.1f}",
                      ", ".join(f"{s.signature} x{s.count} ({_ms(s.mean_s)} ms)" for s in run.signatures))
    console.print(table)
    if captures:
        console.print(_captures_table(f"captures of {job}", captures))


def _state(value: int) -> str:
    return pb.CaptureState.Name(value).removeprefix("CAPTURE_STATE_").lower()


def _captures_table(title: str, captures: list[pb.Capture]) -> Table:
    table = Table("capture", "steps", "state", "workers", "created", title=title)
    for capture in captures:
        table.add_row(capture.capture_id, str(capture.steps), _state(capture.state),
                      ", ".join(f"{w.worker}: {_state(w.state)}" + (f" ({w.reason})" if w.reason else "")
                                for w in capture.workers),
                      capture.create_time.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"))
    return table


@trace.command("summary")
@click.argument("source")
@click.option("--capture", "capture_id", default="", help="Capture to analyze (default: the job's latest).")
@click.option("--top", "top_k", default=analysis.DEFAULT_TOP_K, show_default=True, help="Slowest ops to list.")
@pass_session
def summary(session: ClientSession, source: str, capture_id: str, top_k: int) -> None:
    """Where the step time of SOURCE goes: computation, communication, input, idle; the slowest ops."""
    path = Path(source)
    if path.is_file():
        loaded = _load_file(path, top_k)
        console.print(_breakdown_table(f"summary of {path.name}", [(loaded.label, loaded.breakdown, loaded.op_level)]))
        if loaded.top_ops:
            console.print(_ops_table("slowest ops (total time)", loaded.top_ops))
        return
    with session.client() as client:
        result = convert.summary_from_proto(client.summary(source, capture_id=capture_id, top_k=top_k))
    rows = [("step metrics", result.metrics, False)] + [(f"trace {b.worker}", b, True) for b in result.traces]
    console.print(_breakdown_table(f"summary of {source}" + (f" (capture {result.capture_id})"
                                                             if result.capture_id else ""), rows))
    for b in result.traces:
        console.print(_ops_table(f"slowest ops of {b.worker} (total time)", list(b.top_ops_by_total)))


@trace.command("compare")
@click.argument("a")
@click.argument("b")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also draw both runs' step times side by side to this PNG.")
@pass_session
def compare(session: ClientSession, a: str, b: str, png: Path | None) -> None:
    """Put two runs or files side by side (e.g. before and after a change of batch size)."""
    left, right = _load(session, a), _load(session, b)
    table = Table("", left.label, right.label, "change", title="comparison")
    rows = [("steps", "steps", str), ("step time (mean) ms", "step_time_s", _ms), ("p50 ms", "step_time_p50_s", _ms),
            ("p95 ms", "step_time_p95_s", _ms), ("input ms", "input_s", _ms), ("computation ms", "computation_s", _ms),
            ("communication ms", "communication_s", _ms), ("examples/s", "examples_per_second", lambda v: f"{v:.1f}")]
    for name, attr, show in rows:
        x, y = getattr(left.breakdown, attr), getattr(right.breakdown, attr)
        if attr in ("computation_s", "communication_s") and not (left.op_level and right.op_level):
            table.add_row(name, show(x) if left.op_level else "-", show(y) if right.op_level else "-", "-")
            continue
        change = f"{(y - x) / x * 100:+.1f}%" if x else "-"
        table.add_row(name, show(x), show(y), change)
    table.add_row("bound", _bound(left.breakdown.bound), _bound(right.breakdown.bound), "")
    console.print(table)
    if png is not None:
        plot_step_times([(left.label, left.step_times), (right.label, right.step_times)], png)
        console.print(f"step-time plots written to {png}")


@trace.command("export")
@click.argument("job")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write to (JOB/ is created in it).")
@pass_session
def export(session: ClientSession, job: str, out_dir: Path) -> None:
    """Write JOB's runs as session files and its captured traces as Chrome trace files (portable)."""
    root = out_dir / job
    with session.client() as client:
        runs = client.list_runs(job)
        captures = client.list_captures(job)
        root.mkdir(parents=True, exist_ok=True)
        (root / "runs.json").write_text(json.dumps([MessageToDict(r) for r in runs], indent=2))
        for run in runs:
            path = root / f"{run.worker}.{run.session_id}.jsonl"
            count = write_session(path, (p.record for p in client.step_series(job, session_id=run.session_id)))
            console.print(f"{path}  {count} steps")
        for capture in captures:
            for worker in capture.workers:
                if worker.state == pb.CAPTURE_STATE_COMPLETED:
                    path = client.download_trace(capture.capture_id, worker.worker,
                                                 root / "captures" / capture.capture_id
                                                 / f"{worker.worker}.trace.json.gz")
                    console.print(f"{path}  {path.stat().st_size} bytes")


@trace.command("capture")
@click.argument("job")
@click.option("--steps", type=int, required=True, help="How many steps to trace op by op.")
@click.option("--worker", "workers", multiple=True, help="Worker to trace (repeatable; default: every running one).")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until the capture ends.")
@pass_session
def capture(session: ClientSession, job: str, steps: int, workers: tuple[str, ...], wait: bool) -> None:
    """Arm a full op-level trace of JOB's next N steps (admin)."""
    with session.client() as client:
        armed = client.capture(job, steps, workers)
    console.print(f"capture {armed.capture_id} armed for {', '.join(w.worker for w in armed.workers)}")

    def read(client) -> Iterator[pb.Capture]:
        """The capture, every half second while it is pending (across restarts of the service)."""
        while True:
            time.sleep(0.5)
            yield (polled := client.get_capture(armed.capture_id))
            if polled.state != pb.CAPTURE_STATE_PENDING:
                return

    current = armed
    if wait and current.state == pb.CAPTURE_STATE_PENDING:
        with console.status(f"waiting for {steps} steps to be traced..."):
            *_, current = session.follow(read)  # the last poll: the capture ended
    console.print(_captures_table(f"capture {armed.capture_id}", [current]))
    if current.state in (pb.CAPTURE_STATE_FAILED, pb.CAPTURE_STATE_EXPIRED):
        sys.exit(1)


@trace.command("tracing")
@click.argument("switch", required=False, type=click.Choice(["on", "off"]))
@pass_session
def tracing(session: ClientSession, switch: str | None) -> None:
    """Show or set global tracing (off: every tracer stops measuring; admin to set)."""
    with session.client() as client:
        enabled = client.tracing() if switch is None else client.set_tracing(switch == "on")
    console.print(f"tracing is {'on' if enabled else 'off'}")


@trace.command("flush")
def flush() -> None:
    """Deliver what traced runs spooled, now (when no shipper runs: `python -m opml_trace_collector.inject.ship`)."""
    from opml_trace_collector.inject.settings import TracerSettings
    from opml_trace_collector.inject.ship import ShipperRunning, flush_spool

    try:
        sent, pending = asyncio.run(flush_spool(TracerSettings().spool_dir, PlatformSettings()))
    except ShipperRunning as exc:
        console.print(f"{exc}: it sends them")
        return
    console.print(f"{sent} events sent, {pending} still pending")
    if pending:
        sys.exit(1)


@trace.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--job", required=True, help="Job name the events are reported under.")
@click.option("--worker", default=None, help="Worker name (default: from TF_CONFIG, else 'local').")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def run(job: str, worker: str | None, argv: tuple[str, ...]) -> None:
    """Run a command (e.g. `-- python train.py`) with its TensorFlow traced, unchanged."""
    from opml_trace_collector.inject.launcher import run_traced

    sys.exit(run_traced(list(argv), job=job, worker=worker))
