"""Members on hosts of their own: each in a network namespace behind a link of 8 Mbit/s (``tc ... tbf``)
and DELAY_S each way (``opml_devstack.testing.netem``: this machine's kernel has no ``netem`` qdisc, so a
userspace wire in a namespace of its own holds every frame that long), so every model and update crosses a
real, slow, distant link. The coordinator listens on 127.0.0.1 only: a relay on each link's host side
forwards the members' connections to it. Needs root and ``ip`` and ``tc`` (iproute2; `make install`
installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opml.fl.v1 import fl_pb2 as pb

from opml_devstack.testing.netem import emulated_hosts
from opml_devstack.testing.relay import TcpRelay
from opml_devstack.testing.services import TOKENS
from opml_fl_coordinator_contract.client import FederationClient

PROGRAMS = Path(__file__).parent / "programs"
RATE_MBIT = 8
PAD = 500_000  # float32s: a 2 MB model, 2 s each way at 8 Mbit/s
MEMBERS = 3
DELAY_S = 0.2  # one way, each direction: a 400 ms round trip


@pytest.fixture
def hosts():
    """``MEMBERS`` namespaces, each behind its own link; yields [(namespace, host-side IP)]."""
    assert os.geteuid() == 0, "network namespaces need root"
    assert shutil.which("ip") and shutil.which("tc"), "iproute2 (ip, tc) is missing: `make install` installs it"
    with emulated_hosts([{"rate_mbit": RATE_MBIT, "delay_ms": DELAY_S * 1000}] * MEMBERS) as made:
        yield [(host.namespace, host.gateway) for host in made]


@pytest.fixture
def coordinator(start_service):
    return start_service("fl-coordinator")


@pytest.fixture
def relay(coordinator) -> Iterator[TcpRelay]:
    """The members' way to the coordinator (which listens on 127.0.0.1 only); the links add the delay."""
    host, _, port = coordinator.target.rpartition(":")
    with TcpRelay((host, int(port))) as relay:
        yield relay


def test_members_in_their_own_namespaces_train_across_slow_distant_links(coordinator, relay, hosts, tmp_path):
    with FederationClient(coordinator.target, token=TOKENS["writer"]) as writer:
        writer.create(f"name: remote\nrounds: 2\nmin_clients: {MEMBERS}\nround_deadline_s: 120\n"
                      f"selection: {{clients_per_round: {MEMBERS}}}\n")
        processes = []
        for index, (namespace, host_ip) in enumerate(hosts):
            token = writer.register_client("remote", f"site-{index}").token
            log = (tmp_path / f"site-{index}.log").open("w")
            processes.append(subprocess.Popen(
                ["ip", "netns", "exec", namespace, sys.executable, str(PROGRAMS / "member.py"),
                 f"{host_ip}:{relay.listen(host_ip)}",
                 "remote", str(index), "--shards", str(MEMBERS), "--pad", str(PAD)],
                env={**os.environ, "OPML_FL_CLIENT_TOKEN": token, "OPML_TOKEN": TOKENS["reader"]},
                stdout=log, stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=240) for p in processes]
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
        logs = [(tmp_path / f"site-{i}.log").read_text() for i in range(MEMBERS)]
        assert codes == [0] * MEMBERS, logs
        done = writer.get("remote")
        rounds = writer.rounds("remote")
    assert done.state == pb.FEDERATION_STATE_COMPLETED
    assert all(sorted(r.participants) == [f"site-{i}" for i in range(MEMBERS)] for r in rounds)
    # each round moved the 2 MB model down and the update up through an 8 Mbit/s link (at least
    # 2 x 2 MB x 8 / 8 Mbit/s = 4 s), each way DELAY_S away; over loopback it would take milliseconds
    link_s = 2 * (PAD * 4 + 64 * 10 * 4) * 8 / (RATE_MBIT * 1e6)
    assert all(r.duration_seconds >= 0.9 * link_s + 2 * DELAY_S for r in rounds), [r.duration_seconds for r in rounds]
