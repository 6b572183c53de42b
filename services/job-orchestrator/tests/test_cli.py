"""`opml job` against a running service: TonY's client verbs as a user types them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from opml_common.errors import NotFound
from opml_devstack.testing.bus import poll_until

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def opml(job_service, opml_cli, monkeypatch: pytest.MonkeyPatch):
    """Runs `opml ...` in-process against the test service; fails the test on an unexpected exit code."""
    monkeypatch.setenv("OPML_JOB_ORCHESTRATOR_TARGET", job_service.target)
    return opml_cli


def test_job_workflow(opml, writer, tmp_path: Path) -> None:
    hello = (EXAMPLES / "hello.yaml").read_text().replace("python3", sys.executable)
    (tmp_path / "hello.yaml").write_text(hello)
    assert "submitted hello (pending)" in opml("job", "submit", "-f", str(tmp_path / "hello.yaml"))
    watched = opml("job", "watch", "hello")  # until the job ends
    assert "succeeded" in watched.splitlines()[-1]
    assert opml("job", "logs", "hello") == "hello from worker 0\n"
    shown = json.loads(opml("job", "get", "hello"))
    assert shown["status"]["state"] == "JOB_STATE_SUCCEEDED" and shown["spec"]["jobClass"] == "JOB_CLASS_TE"
    assert "hello" in opml("job", "ls", "--state", "succeeded")
    assert json.loads(opml("job", "ls", "--state", "failed", "--json")) == []

    sleeper = tmp_path / "sleeper.yaml"
    sleeper.write_text(json.dumps({"name": "sleeper", "class": "BE", "command": [sys.executable, "-c",
                                   "import time; print('up', flush=True); time.sleep(60)"],
                                   "roles": {"worker": {"resources": {"cpu": 1}}}}))
    opml("job", "submit", "-f", str(sleeper))

    def printed_up() -> bool:
        try:
            return b"up" in b"".join(chunk.data for chunk in writer.logs("sleeper"))
        except NotFound:  # its run started, its task has not opened its log yet
            return False

    poll_until(printed_up, timeout_s=60, every_s=0.05, what="the sleeper's task to print 'up'")
    denied = opml("job", "preempt", "sleeper", expect_exit=1)
    assert "PERMISSION_DENIED" in denied and "admin" in denied
    assert "cancelled" in opml("job", "cancel", "sleeper")
    assert "up\n" in opml("job", "logs", "sleeper", "--follow")  # it ended: the stream ends too
    assert "NOT_FOUND" in opml("job", "get", "ghost", expect_exit=1)


def test_bad_spec_is_reported_with_its_field_path(opml, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nclass: TE\ncommand: [/bin/true]\nroles:\n  worker:\n    resources: {gpu: 4}\n")
    out = opml("job", "submit", "-f", str(bad), expect_exit=1)
    assert "INVALID_ARGUMENT: roles.worker.resources.gpu" in out and "largest node has 1" in out
    bad.write_text("name: bad\nclass: TE\ncommand: [/bin/true]\nroles:\n  worker:\n    resources: {cpu: lots}\n")
    assert "INVALID_ARGUMENT: roles.worker.resources.cpu" in opml("job", "submit", "-f", str(bad), expect_exit=1)


def test_four_mistakes_are_printed_one_per_line(opml, tmp_path: Path) -> None:
    bad = tmp_path / "four.yaml"
    bad.write_text("name: Bad Name\nclass: urgent\ncommand: [/bin/true]\nroles:\n"
                   "  worker: {replicas: 0, resources: {cpu: 1, memory: 3 bananas}}\n")
    lines = opml("job", "submit", "-f", str(bad), expect_exit=1).splitlines()
    assert [line.split(": ")[2] for line in lines] == [
        "class", "roles.worker.resources.memory", "name", "roles.worker.replicas"], lines
    assert all(line.startswith("error: INVALID_ARGUMENT: ") for line in lines)


def test_four_rules_broken_on_the_service_are_printed_one_per_line(opml, tmp_path: Path) -> None:
    """Rules the service checks (the CLI sends a well-shaped spec as it is), all in one answer."""
    bad = tmp_path / "rules.yaml"
    bad.write_text("name: rules\nclass: BE\ncommand: [/bin/true]\nenv: {LD_PRELOAD: /x.so, OPML_JOB: other}\n"
                   "roles:\n  chief: {replicas: 2, resources: {cpu: 1}}\n  worker: {resources: {}}\n")
    lines = opml("job", "submit", "-f", str(bad), expect_exit=1).splitlines()
    assert sorted(line.split(": ")[2] for line in lines) == [
        "env.LD_PRELOAD", "env.OPML_JOB", "roles.chief.replicas", "roles.worker.resources"], lines


def test_yaml_syntax_error_names_the_file_line_and_column(opml, tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: broken\nclass: TE\nroles:\n  worker:\n    resources: {cpu: 1\n")
    out = opml("job", "submit", "-f", str(bad), expect_exit=1)
    assert f"INVALID_ARGUMENT: {bad}: is not valid YAML" in out and "line 6, column 1" in out, out
