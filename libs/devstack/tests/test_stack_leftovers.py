"""A stack that was killed leaves its parts running; the next `make up` or `make down` stops them.

Real processes: a "part" in a session of its own with a child of its own (the whole group must go),
and a process whose pid the state file names but which runs another command (a pid the kernel gave
to someone else after the crash), which must be left alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from opml_devstack.stack import stop_leftovers
from opml_devstack.testing.bus import poll_until

PART = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '600']); "
        "print(child.pid, flush=True); time.sleep(600)")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def test_what_a_killed_stack_left_is_stopped_and_nothing_else(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    part = subprocess.Popen([sys.executable, "-c", PART], stdout=subprocess.PIPE, start_new_session=True, text=True)
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        grandchild = int(part.stdout.readline())
        (tmp_path / "stack.pid").write_text(str(dead.pid))
        (tmp_path / "stack.json").write_text(json.dumps({"parts": [
            {"name": "bundle-store", "pid": part.pid, "command": part.args},
            {"name": "tansu", "pid": stranger.pid, "command": ["/usr/bin/tansu", "broker"]},
        ]}))

        assert stop_leftovers(tmp_path) == ["bundle-store"]

        assert part.wait(timeout=60) == -signal.SIGTERM
        poll_until(lambda: _gone(grandchild), timeout_s=60, what="the part's own child to stop with its group")
        assert stranger.poll() is None, "a process that only shares a recorded pid was stopped"
    finally:
        for process in (part, stranger):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_nothing_is_stopped_while_the_stack_that_wrote_the_state_runs(tmp_path: Path) -> None:
    part = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        (tmp_path / "stack.pid").write_text(str(os.getpid()))  # this test's process stands for a live stack
        (tmp_path / "stack.json").write_text(json.dumps({"parts": [
            {"name": "bundle-store", "pid": part.pid, "command": part.args}]}))
        assert stop_leftovers(tmp_path) == []
        assert part.poll() is None
    finally:
        part.kill()
        part.wait()
