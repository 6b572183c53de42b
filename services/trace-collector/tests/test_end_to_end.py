"""The whole loop: an unmodified Keras program run by `opml trace run`, its cheap metrics in the running
service, a capture armed through the gRPC API while it trains, and the op-level summary of that trace."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from opml.traces.v1 import traces_pb2 as pb

from opml_common.storage import s3_client

PROGRAMS = Path(__file__).parent / "programs"
pytestmark = pytest.mark.slow


def test_keras_job_traced_captured_and_summarized(collector, collector_env, admin, eventually, tmp_path) -> None:
    go = tmp_path / "go"
    env = {**os.environ, **collector_env, "OPML_TRACE_BUCKET": collector_env["OPML_TRACE_COLLECTOR_BUCKET"],
           "OPML_TRACE_SPOOL_DIR": str(tmp_path / "spool"), "OPML_TRACE_SESSION_DIR": str(tmp_path / "sessions"),
           "OPML_TRACE_FLUSH_INTERVAL_S": "0.5", "OPML_TRACE_POLL_S": "0.2", "TF_CPP_MIN_LOG_LEVEL": "2"}
    opml = Path(sys.executable).parent / "opml"
    with open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen([str(opml), "trace", "run", "--job", "e2e-cnn", "--worker", "worker-0", "--",
                                sys.executable, str(PROGRAMS / "keras_cnn.py"), "--steps", "4", "--wait-file", str(go)],
                               env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        def running() -> bool:
            jobs = {j.job for j in admin.list_jobs()}
            return "e2e-cnn" in jobs and any(r.state == pb.RUN_STATE_RUNNING and r.steps > 0
                                             for r in admin.list_runs("e2e-cnn"))

        eventually(running, "the traced job's first steps", timeout_s=120)
        capture = admin.capture("e2e-cnn", 3)
        done = eventually(lambda: (c := admin.get_capture(capture.capture_id)).state != pb.CAPTURE_STATE_PENDING
                          and c, "the capture to end", timeout_s=90)
        assert done.state == pb.CAPTURE_STATE_COMPLETED, done
        go.touch()
        assert job.wait(120) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()

    [run] = eventually(lambda: [r for r in admin.list_runs("e2e-cnn") if r.state == pb.RUN_STATE_STOPPED],
                       "the run to stop")
    assert run.worker == "worker-0" and "keras.fit" in {s.signature for s in run.signatures}
    summary = admin.summary("e2e-cnn")
    assert summary.capture_id == capture.capture_id and summary.metrics.steps > 0
    [breakdown] = summary.traces
    assert breakdown.worker == "worker-0" and breakdown.steps == 3
    assert breakdown.computation_s > 0 and breakdown.top_ops_by_total
    parts = breakdown.computation_s + breakdown.communication_s + breakdown.input_s + breakdown.idle_s
    assert parts == pytest.approx(breakdown.step_time_s, rel=1e-6)
    assert any("Conv2D" in op.op_type or "MatMul" in op.op_type for op in breakdown.top_ops_by_total)
    trace = json.loads(gzip.decompress(b"".join(admin.fetch_trace(capture.capture_id))))
    assert trace["metadata"]["capture_id"] == capture.capture_id and trace["metadata"]["job"] == "e2e-cnn"


def test_a_job_killed_mid_capture_announces_no_trace(collector, collector_env, admin, eventually, bucket,
                                                     platform_settings, tmp_path) -> None:
    env = {**os.environ, **collector_env, "OPML_TRACE_BUCKET": bucket,
           "OPML_TRACE_SPOOL_DIR": str(tmp_path / "spool"), "OPML_TRACE_SESSION_DIR": str(tmp_path / "sessions"),
           "OPML_TRACE_FLUSH_INTERVAL_S": "0.5", "OPML_TRACE_POLL_S": "0.2", "TF_CPP_MIN_LOG_LEVEL": "2"}
    opml = Path(sys.executable).parent / "opml"
    with open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen([str(opml), "trace", "run", "--job", "doomed", "--",
                                sys.executable, str(PROGRAMS / "keras_cnn.py"), "--steps", "4", "--wait-file",
                                str(tmp_path / "never")], env=env, cwd=tmp_path, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        eventually(lambda: any(r.state == pb.RUN_STATE_RUNNING and r.steps > 0 for r in admin.list_runs("doomed"))
                   if "doomed" in {j.job for j in admin.list_jobs()} else False, "the job's first steps", timeout_s=120)
        capture = admin.capture("doomed", 1000)  # far more steps than it lives for
        steps_then = sum(r.steps for r in admin.list_runs("doomed"))
        eventually(lambda: sum(r.steps for r in admin.list_runs("doomed")) > steps_then + 8,
                   "training to go on under the capture")
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the launcher and the job, mid-capture
        job.wait()
    expired = eventually(lambda: (c := admin.get_capture(capture.capture_id)).state != pb.CAPTURE_STATE_PENDING
                         and c, "the capture to end", timeout_s=30)
    assert expired.state == pb.CAPTURE_STATE_EXPIRED
    assert [w.state for w in expired.workers] == [pb.CAPTURE_STATE_EXPIRED]
    assert admin.summary("doomed").traces == []
    objects = s3_client(platform_settings).list_objects(bucket, prefix=f"traces/doomed/{capture.capture_id}/",
                                                        recursive=True)
    assert list(objects) == []
