"""`opml job watch` and `opml job logs -f` go on across a restart of the orchestrator (SIGTERM, then a
new process on the same port): they say they reconnect, print what happened after the restart, and
print nothing twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from opml.jobs.v1 import jobs_pb2 as pb

from opml_job_orchestrator_contract.client import JobClient

# Attempt 0 runs until the orchestrator is stopped (which preempts it); attempt 1, after the restart, ends.
RESUMABLE = """
import os, pathlib, time
attempt = os.environ["OPML_JOB_ATTEMPT"]
print(f"line-{attempt}", flush=True)
(pathlib.Path(os.environ["OPML_CHECKPOINT_DIR"]) / f"started-{attempt}").write_text(attempt)
time.sleep(60 if attempt == "0" else 0)
"""


def _opml(target: str, token: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OPML_JOB_ORCHESTRATOR_TARGET": target, "OPML_TOKEN": token, "OPML_RECONNECT_S": "120"}
    return subprocess.Popen([str(Path(sys.executable).parent / "opml"), "job", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _read_until(process: subprocess.Popen, text: str) -> list[str]:
    lines: list[str] = []
    while not lines or text not in lines[-1]:
        line = process.stdout.readline()
        assert line, f"the command ended before printing {text!r}: {lines}, {process.stderr.read()}"
        lines.append(line)
    return lines


def test_watch_and_follow_reconnect_across_a_restart(service_process, tokens, job_spec, wait_for, file_written,
                                                     job_dir: Path) -> None:
    ckpt = job_dir / "ckpt"
    first = service_process().start()
    with JobClient(first.target, token=tokens["writer"]) as client:
        client.submit(job_spec("resumable", RESUMABLE, checkpoint={"dir": str(ckpt)}))
    file_written(ckpt / "started-0")
    watch = _opml(first.target, tokens["reader"], "watch", "resumable")
    logs = _opml(first.target, tokens["writer"], "logs", "-f", "resumable")
    try:
        before = _read_until(watch, "running")
        assert _read_until(logs, "line-0") == ["line-0\n"]
        first.stop()  # SIGTERM: the run is stopped and queued to resume
        second = service_process().start()
        assert second.target == first.target
        with JobClient(second.target, token=tokens["writer"]) as client:
            wait_for(client, "resumable", pb.JOB_STATE_SUCCEEDED)
        watched, watch_errors = watch.communicate()
        logged, log_errors = logs.communicate()
    finally:
        watch.kill()
        logs.kill()
    assert watch.returncode == 0, watch_errors
    lines = before + watched.splitlines(keepends=True)
    assert "succeeded" in lines[-1] and "attempt 1" in lines[-1], lines
    assert len(set(lines)) == len(lines), lines  # a reconnect's current status is not printed again
    assert f"reconnecting to {first.target}" in watch_errors
    assert logs.returncode == 0, log_errors
    assert "line-0\n" + logged == "line-0\nline-1\n"  # attempt 0's line once, then attempt 1's
    assert f"reconnecting to {first.target}" in log_errors and "--- attempt 1 ---" in log_errors
