"""A restarted orchestrator takes its jobs back from Redis: a run that was going is never duplicated
(its processes are stopped, then it is retried), waiting jobs keep their turn, ended jobs stay listed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opml.jobs.v1 import jobs_pb2 as pb

from opml_job_orchestrator_contract.client import JobClient

# Each run records its pid and which runs of earlier attempts were still alive when it started.
SURVIVOR = """
import json, os, pathlib, time
d = pathlib.Path(os.environ["OPML_CHECKPOINT_DIR"])
attempt = os.environ["OPML_JOB_ATTEMPT"]
def alive(pid):
    try:
        os.kill(pid, 0)
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
earlier = [int(p.read_text()) for p in d.glob("pid-*")]
(d / f"alive-{attempt}").write_text(json.dumps([p for p in earlier if alive(p)]))
(d / f"pid-{attempt}").write_text(str(os.getpid()))
time.sleep(60 if attempt == "0" else 0.5)
"""


@pytest.fixture
def ckpt(job_dir: Path) -> Path:
    """The checkpoint directory where SURVIVOR's runs record themselves (made for the job's user)."""
    return job_dir / "ckpt"


def test_killed_orchestrator_recovers_without_duplicates(service_process, tokens, job_spec, wait_for, file_written,
                                                         alive, ckpt: Path) -> None:
    first = service_process().start()
    with JobClient(first.target, token=tokens["writer"]) as client:
        client.submit(job_spec("done-before", "print('finished early')", job_class="TE"))
        wait_for(client, "done-before", pb.JOB_STATE_SUCCEEDED)
        client.submit(job_spec("survivor", SURVIVOR, checkpoint={"dir": str(ckpt)}))
        pid = int(file_written(ckpt / "pid-0"))
        client.submit(job_spec("waiting", "pass", roles={"worker": {"resources": {"cpu": 4}}}))  # needs the node
        assert client.get("waiting").status.state == pb.JOB_STATE_PENDING
    first.kill()  # SIGKILL: no chance to stop its jobs or write anything more
    assert alive(pid), "the run outlives the orchestrator (its own session)"

    second = service_process().start()
    with JobClient(second.target, token=tokens["writer"]) as client:
        job = wait_for(client, "survivor", pb.JOB_STATE_SUCCEEDED)
        assert not alive(pid)
        assert json.loads((ckpt / "alive-1").read_text()) == []  # attempt 1 never ran beside attempt 0
        assert (job.status.attempt, job.status.retries) == (1, 1)
        assert wait_for(client, "waiting", pb.JOB_STATE_SUCCEEDED).status.attempt == 0  # its turn, once
        assert [j.status.job_id for j in client.list()] == ["done-before", "survivor", "waiting"]
        assert b"".join(c.data for c in client.logs("done-before")) == b"finished early\n"


def test_graceful_restart_preempts_and_resumes(service_process, tokens, job_spec, wait_for, file_written, alive,
                                               ckpt: Path) -> None:
    first = service_process().start()
    with JobClient(first.target, token=tokens["writer"]) as client:
        client.submit(job_spec("resumable", SURVIVOR, checkpoint={"dir": str(ckpt)}))
        pid = int(file_written(ckpt / "pid-0"))
    first.stop()  # SIGTERM: runs are stopped and queued to resume
    assert not alive(pid)
    second = service_process().start()
    with JobClient(second.target, token=tokens["writer"]) as client:
        job = wait_for(client, "resumable", pb.JOB_STATE_SUCCEEDED)
        assert (job.status.attempt, job.status.preemptions, job.status.retries) == (1, 1, 0)
