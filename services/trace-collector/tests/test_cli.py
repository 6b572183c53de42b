"""`opml trace`: offline on portable files, and against a running service (click's CliRunner)."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

from click.testing import CliRunner
from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1 import events_pb2
from opml.traces.v1 import traces_pb2 as pb

from opml_common.cli import main
from opml_common.storage import s3_client
from opml_trace_collector.session import read_session, write_session

WIDE = {"COLUMNS": "250"}


def _session(path: Path, durations: list[float], batch: int) -> Path:
    records = []
    for step, duration in enumerate(durations):
        start = Timestamp()
        start.FromMicroseconds(1_700_000_000_000_000 + step * 1_000_000)
        records.append(events_pb2.StepRecord(step=step, kind=events_pb2.STEP_KIND_TRAIN, signature="keras.fit",
                                             start_time=start, duration_s=duration, input_wait_s=duration / 10,
                                             examples=batch))
    write_session(path, records)
    return path


def _trace_file(path: Path) -> Path:
    events = [{"ph": "X", "cat": "step", "name": "step 0", "ts": 0, "dur": 2000, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "op", "name": "IteratorGetNext", "ts": 0, "dur": 1000, "pid": 1, "tid": 2,
               "args": {"op_type": "IteratorGetNext", "op_name": "IteratorGetNext"}},
              {"ph": "X", "cat": "op", "name": "conv/Conv2D", "ts": 1000, "dur": 800, "pid": 1, "tid": 2,
               "args": {"op_type": "Conv2D", "op_name": "conv/Conv2D"}}]
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events, "metadata": {"worker": "w0"}}).encode()))
    return path


def test_summary_of_a_trace_file_prints_the_breakdown_and_slowest_ops(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["trace", "summary", str(_trace_file(tmp_path / "w0.trace.json.gz"))], env=WIDE)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "w0.trace.json.gz" in line and "input" in line)
    # 2 ms step: 0.8 ms compute, 1.0 ms input, 0.2 ms idle -> input bound.
    assert "2.00" in row and "0.80" in row and "1.00" in row and "0.20" in row
    assert "conv/Conv2D" in result.output and "IteratorGetNext" in result.output


def test_compare_two_session_files_draws_a_png(tmp_path: Path) -> None:
    small = _session(tmp_path / "batch32.jsonl", [0.10, 0.12, 0.11, 0.30], 32)
    large = _session(tmp_path / "batch64.jsonl.gz", [0.15, 0.16, 0.17], 64)
    png = tmp_path / "plots" / "compare.png"
    result = CliRunner().invoke(main, ["trace", "compare", str(small), str(large), "--png", str(png)], env=WIDE)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    mean_row = next(line for line in result.output.splitlines() if "step time (mean)" in line)
    assert "157.50" in mean_row and "160.00" in mean_row and "+1.6%" in mean_row
    throughput = next(line for line in result.output.splitlines() if "examples/s" in line)
    assert "203.2" in throughput and "400.0" in throughput


def test_cli_against_the_service(collector, publish, batch, eventually, admin, bucket, platform_settings,
                                 tmp_path: Path) -> None:
    env = {**WIDE, "OPML_TRACE_COLLECTOR_TARGET": collector.target, "OPML_TOKEN": "admin-token"}
    publish(events_pb2.TracerStarted(job="cnn", worker="worker-0", session_id="s1", tf_version="2.21.0"),
            batch("cnn", "worker-0", "s1", 0, [(0, 0.2, 0.1), (1, 0.2, 0.1)]),
            batch("cnn", "worker-0", "s1", 1, [(2, 0.4, 0.1)]))
    eventually(lambda: any(r.steps == 3 for r in admin.list_runs("cnn")) if admin.list_jobs() else False, "the run")
    runner = CliRunner()

    jobs = runner.invoke(main, ["trace", "ls"], env=env)
    assert jobs.exit_code == 0 and "cnn" in jobs.output, jobs.output
    runs = runner.invoke(main, ["trace", "ls", "cnn"], env=env)
    assert "worker-0" in runs.output and "keras.fit x3" in runs.output, runs.output
    summary = runner.invoke(main, ["trace", "summary", "cnn"], env=env)
    assert summary.exit_code == 0 and "step metrics" in summary.output and "input" in summary.output, summary.output

    armed = runner.invoke(main, ["trace", "capture", "cnn", "--steps", "1", "--no-wait"], env=env)
    assert armed.exit_code == 0 and "armed for worker-0" in armed.output, armed.output
    [capture] = admin.list_captures("cnn")
    data = _trace_file(tmp_path / "upload.json.gz").read_bytes()
    key = f"traces/cnn/{capture.capture_id}/worker-0.trace.json.gz"
    s3_client(platform_settings).put_object(bucket, key, io.BytesIO(data), len(data))
    publish(events_pb2.CaptureCompleted(job="cnn", worker="worker-0", capture_id=capture.capture_id, steps=1,
                                        trace_url=f"s3://{bucket}/{key}", size_bytes=len(data)))
    eventually(lambda: admin.get_capture(capture.capture_id).state == pb.CAPTURE_STATE_COMPLETED, "the capture")
    summary = runner.invoke(main, ["trace", "summary", "cnn"], env=env)
    assert "trace worker-0" in summary.output and "conv/Conv2D" in summary.output, summary.output

    exported = runner.invoke(main, ["trace", "export", "cnn", "--out", str(tmp_path / "out")], env=env)
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "out" / "cnn" / "captures" / capture.capture_id / "worker-0.trace.json.gz").read_bytes() == data
    session_file = tmp_path / "out" / "cnn" / "worker-0.s1.jsonl"
    assert [r.duration_s for r in read_session(session_file)] == [0.2, 0.2, 0.4]
    compared = runner.invoke(main, ["trace", "compare", "cnn/worker-0", str(session_file)], env=env)
    assert compared.exit_code == 0 and compared.output.count("266.67") == 2, compared.output

    missing = runner.invoke(main, ["trace", "capture", "no-such-job", "--steps", "3"], env=env)
    assert missing.exit_code == 1 and "NOT_FOUND" in missing.output
    off = runner.invoke(main, ["trace", "tracing", "off"], env=env)
    assert "tracing is off" in off.output and admin.tracing() is False


def test_flush_with_an_empty_spool_reports_nothing_pending(settings_env: dict[str, str], tmp_path: Path) -> None:
    env = {**settings_env, "OPML_TRACE_SPOOL_DIR": str(tmp_path / "spool")}
    result = CliRunner().invoke(main, ["trace", "flush"], env=env)
    assert result.exit_code == 0, result.output
    assert "0 events sent, 0 still pending" in result.output
