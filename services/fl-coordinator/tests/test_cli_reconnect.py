"""`opml fl watch` goes on across a restart of the coordinator (SIGTERM, then a new process on the
same port): it says it reconnects and prints each round once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.metrics import samples, scrape
from opml_devstack.testing.services import TOKENS
from opml_fl_coordinator_contract.client import FederationClient, run_client

CONFIG = "name: watched\nrounds: 2\nmin_clients: 1\nselection: {clients_per_round: 1}\n"


def _watching(metrics_port: str) -> bool:
    """Whether the coordinator is serving a WatchRounds stream (the watcher is subscribed)."""
    return any(s.name.endswith("grpc_requests_in_flight") and "WatchRounds" in s.labels.get("method", "")
               and s.value >= 1 for s in samples(scrape(metrics_port)))


def test_fl_watch_reconnects_across_a_restart_and_prints_each_round_once(start_service) -> None:
    from member import DigitsMember

    env = start_service.env("fl-coordinator")
    first = start_service("fl-coordinator", env=env)
    with FederationClient(first.target, token=TOKENS["writer"]) as writer:
        writer.create(CONFIG)
        token = writer.register_client("watched", "solo").token
    watch = subprocess.Popen(
        [str(Path(sys.executable).parent / "opml"), "fl", "watch", "watched"], text=True,
        env={**os.environ, "OPML_FL_COORDINATOR_TARGET": first.target, "OPML_TOKEN": TOKENS["reader"]},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        poll_until(lambda: _watching(env["OPML_FL_COORDINATOR_METRICS_PORT"]), what="the watcher's stream")
        first.stop()
        second = start_service("fl-coordinator", env=env)  # same ports, home and Redis
        run_client(second.target, "watched", token, DigitsMember(0, 2), token=TOKENS["reader"], wait_s=2.0)
        out, errors = watch.communicate()
    finally:
        watch.kill()
    assert watch.returncode == 0, errors
    assert [line.split(":")[0] for line in out.splitlines()] == ["round 1", "round 2"], out
    assert f"reconnecting to {first.target}" in errors
