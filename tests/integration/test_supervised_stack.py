"""`make up`'s supervised stack: parts that die come back on their ports, and `opml status` tells.

One whole stack (SeaweedFS, tansu on its durable engine, the four services, Prometheus) runs for the
module as `make up` runs it (``python -m opml_devstack.stack up``), but hermetic: free ports, a topic
prefix, a Redis prefix and a state directory of its own, so it runs beside a real `make up`. Tests
SIGKILL its parts and wait, by polling the state file and live health, until they are back;
`opml status --json` (a subprocess) must then count each restart. Every process is stopped after.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from opml_devstack.stack import installed_services, probe
from opml_devstack.testing.bus import poll_until

pytestmark = pytest.mark.timeout(900)

SPECS = {spec.name: spec for spec in installed_services()}
SERVICES = list(SPECS)
OPML = str(Path(sys.executable).parent / "opml")
MAX_DEATHS = 3


@dataclass
class Stack:
    process: subprocess.Popen
    state_dir: Path
    log_path: Path
    topic_prefix: str

    def state(self) -> dict:
        """The state file as the stack last wrote it ({} before the first write)."""
        try:
            return json.loads((self.state_dir / "stack.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def part(self, name: str) -> dict:
        return next(part for part in self.state().get("parts", []) if part["name"] == name)

    def alive(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the stack exited with {self.process.returncode}:\n{self.log()}")
        return True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def status(self) -> tuple[int, dict]:
        """`opml status --json` as a script runs it: its exit code and document."""
        result = subprocess.run([OPML, "status", "--state-dir", str(self.state_dir), "--json"],
                                check=False, capture_output=True, text=True, timeout=120)
        return result.returncode, json.loads(result.stdout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("stack")
    prefix = f"t{uuid.uuid4().hex[:10]}-"
    log_path = root / "stack.log"
    command = [sys.executable, "-m", "opml_devstack.stack", "up", "--state-dir", str(root / "state"), "--free-ports",
               "--topic-prefix", prefix, "--redis-prefix", f"opml-test:{prefix}", "--homes", str(root / "homes"),
               "--max-deaths", str(MAX_DEATHS), "--death-window", "3600", "--backoff-base", "0.2",
               "--backoff-max", "2"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("OPML_")}
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
    stack = Stack(process, root / "state", log_path, prefix)
    pids: set[int] = set()
    try:
        poll_until(lambda: stack.alive() and "the platform is up" in stack.log(), timeout_s=400,
                   what="the stack to come up")
        yield stack
    finally:
        pids.update(part["pid"] for part in stack.state().get("parts", []) if part.get("pid"))
        process.send_signal(signal.SIGTERM)  # as `make down` does
        try:
            process.wait(timeout=180)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        left = [pid for pid in pids if _alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert process.returncode == 0, stack.log()
        assert not left, f"processes of the stack still running after it stopped: {left}"
        assert "stopped" in stack.log()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def wait_restarted(stack: Stack, name: str, *, restarts: int, old_pid: int) -> dict:
    """Block until ``name`` is RUNNING again after ``restarts`` restarts, with a new pid, and healthy."""
    def back() -> dict | None:
        stack.alive()
        part = stack.part(name)
        if part["state"] == "FAILED":
            raise AssertionError(f"{name} is FAILED:\n{stack.log()}")
        if part["state"] == "RUNNING" and part["restarts"] == restarts and part["pid"] not in (None, old_pid) \
                and probe(part["probe"]) in ("SERVING", "UP"):
            return part
        return None

    return poll_until(back, timeout_s=300, what=f"{name} restarted and healthy", every_s=0.2)


def test_every_part_runs_and_opml_status_shows_it(stack: Stack) -> None:
    code, document = stack.status()
    assert code == 0, document
    parts = {part["name"]: part for part in document["parts"]}
    assert set(SERVICES) | {"tansu", "seaweedfs", "prometheus"} <= parts.keys()
    for name in SERVICES:
        part = parts[name]
        assert (part["kind"], part["state"], part["health"], part["restarts"]) == ("service", "RUNNING", "SERVING", 0)
        assert part["pid"] and set(part["ports"]) == {"grpc", "metrics", *SPECS[name].extra_ports()}
        assert part["version"].startswith("opml-") and Path(part["log_path"]).exists()
    assert (parts["tansu"]["kind"], parts["tansu"]["health"]) == ("infra", "UP")
    assert parts["tansu"]["version"].startswith("tansu ")
    assert document["kafka_storage"] == "s3"

    table = subprocess.run([OPML, "status", "--state-dir", str(stack.state_dir)], check=False,
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stdout + table.stderr
    for name in parts:
        assert name in table.stdout


def test_prometheus_scrapes_every_service(stack: Stack) -> None:
    url = stack.part("prometheus")["probe"]["url"].removesuffix("/-/ready")
    metrics_targets = {f"127.0.0.1:{stack.part(name)['ports']['metrics']}" for name in SERVICES}

    def all_up() -> bool:
        query = urllib.parse.urlencode({"query": 'up{job="opml"} == 1'})
        with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=10) as response:
            result = json.loads(response.read())["data"]["result"]
        return {series["metric"]["instance"] for series in result} == metrics_targets

    poll_until(all_up, timeout_s=120, what="prometheus to scrape every service's metrics port")


@pytest.mark.parametrize("name", SERVICES)
def test_a_killed_service_comes_back_on_its_ports_and_is_counted(stack: Stack, name: str) -> None:
    before = stack.part(name)
    os.kill(before["pid"], signal.SIGKILL)
    wait_restarted(stack, name, restarts=before["restarts"] + 1, old_pid=before["pid"])

    code, document = stack.status()
    part = next(part for part in document["parts"] if part["name"] == name)
    assert (part["state"], part["health"], part["restarts"]) == ("RUNNING", "SERVING", before["restarts"] + 1)
    assert part["ports"] == before["ports"] and part["probe"] == before["probe"]
    assert part["last_exit_code"] == -signal.SIGKILL
    assert code == 0, document
    assert f"service {name} exited (exit code -9)" in stack.log()


@pytest.mark.parametrize("name", ["tansu", "prometheus", "seaweedfs"])
def test_a_killed_infrastructure_process_comes_back(stack: Stack, name: str) -> None:
    before = stack.part(name)
    os.kill(before["pid"], signal.SIGKILL)
    wait_restarted(stack, name, restarts=before["restarts"] + 1, old_pid=before["pid"])
    code, document = stack.status()
    part = next(part for part in document["parts"] if part["name"] == name)
    assert (part["state"], part["health"], part["restarts"]) == ("RUNNING", "UP", before["restarts"] + 1)
    assert part["ports"] == before["ports"]
    assert code == 0, document


def test_services_keep_their_topics_across_a_broker_restart(stack: Stack) -> None:
    """The broker restarted above kept its log on SeaweedFS: the topics the services created are there."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def topics() -> set[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=stack.state()["endpoints"]["kafka"])
        await admin.start()
        try:
            return set(await admin.list_topics())
        finally:
            await admin.close()

    assert stack.part("tansu")["restarts"] >= 1
    prefix = stack.topic_prefix
    assert {f"{prefix}opml.bundles.v1", f"{prefix}opml.predictions.v1"} <= asyncio.run(topics())


def test_a_part_that_keeps_dying_is_failed(stack: Stack) -> None:
    """trace-collector is killed each time it is back, until its deaths reach the limit: FAILED, not
    restarted again, and `opml status` fails; the other parts keep running."""
    name = "trace-collector"
    killed: set[int] = set()

    def kill_until_failed() -> bool:
        stack.alive()
        part = stack.part(name)
        if part["state"] == "FAILED":
            return True
        if part["state"] == "RUNNING" and part["pid"] not in killed:
            killed.add(part["pid"])
            os.kill(part["pid"], signal.SIGKILL)
        return False

    poll_until(kill_until_failed, timeout_s=600, what=f"{name} FAILED", every_s=0.2)
    code, document = stack.status()
    parts = {part["name"]: part for part in document["parts"]}
    assert code == 1 and document["ok"] is False
    assert (parts[name]["state"], parts[name]["health"], parts[name]["pid"]) == ("FAILED", "UNREACHABLE", None)
    assert parts[name]["restarts"] == MAX_DEATHS - 1  # the last death is not followed by a restart
    for other in set(SERVICES) - {name}:
        assert (parts[other]["state"], parts[other]["health"]) == ("RUNNING", "SERVING")
    assert f"service {name} exited (exit code -9): it died {MAX_DEATHS} times" in stack.log()
    assert "FAILED" in stack.log()
