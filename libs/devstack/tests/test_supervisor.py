"""The supervisor's restart decision (pure), and its loop over small real child processes."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from opml_common.errors import InvalidArgument
from opml_common.retry import Backoff
from opml_devstack.supervisor import Part, PartStatus, RestartPolicy, State, Supervisor
from opml_devstack.testing.bus import poll_until

# -- the decision -------------------------------------------------------------------------------

POLICY = RestartPolicy(max_deaths=3, window_s=60.0, backoff=Backoff(base_s=1.0, max_s=4.0))


def test_first_death_restarts_after_the_base_delay() -> None:
    assert POLICY.restart_delay([100.0], now=100.0) == 1.0


def test_deaths_within_the_window_back_off_until_the_limit_fails_the_part() -> None:
    assert POLICY.restart_delay([100.0, 101.0], now=101.0) == 2.0
    assert POLICY.restart_delay([100.0, 101.0, 103.0], now=103.0) is None


def test_the_delay_is_capped() -> None:
    policy = RestartPolicy(max_deaths=10, window_s=60.0, backoff=Backoff(base_s=1.0, max_s=4.0))
    assert policy.restart_delay([float(t) for t in range(8)], now=7.0) == 4.0


def test_deaths_older_than_the_window_are_forgotten() -> None:
    # Two old deaths and one now: only the newest counts, so a part that ran for a while gets the
    # base delay again instead of being failed.
    assert POLICY.restart_delay([0.0, 1.0, 200.0], now=200.0) == 1.0
    assert POLICY.recent([0.0, 1.0, 200.0], now=200.0) == [200.0]


def test_a_death_exactly_window_seconds_ago_is_outside_it() -> None:
    assert POLICY.recent([40.0, 41.0, 100.0], now=100.0) == [41.0, 100.0]


@pytest.mark.parametrize(("field", "kwargs"), [
    ("max_deaths", {"max_deaths": 0}), ("max_deaths", {"max_deaths": True}), ("max_deaths", {"max_deaths": 1.5}),
    ("window_s", {"window_s": 0}), ("window_s", {"window_s": float("inf")}), ("window_s", {"window_s": "60"}),
])
def test_bad_policy_names_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(InvalidArgument, match=f"`{field}`"):
        RestartPolicy(**kwargs)


def test_part_status_follows_deaths_restarts_and_failure() -> None:
    status = PartStatus("bundle-store", "service")
    assert status.state is State.STARTING
    status.started(pid=10)
    assert (status.state, status.pid, status.restarts) == (State.RUNNING, 10, 0)

    assert status.died(now=1.0, exit_code=-9, policy=POLICY) == 1.0
    assert (status.state, status.pid, status.last_exit_code) == (State.RESTARTING, None, -9)
    status.restarting()
    status.started(pid=11)
    assert (status.state, status.pid, status.restarts) == (State.RUNNING, 11, 1)

    assert status.died(now=2.0, exit_code=1, policy=POLICY) == 2.0
    status.restarting()
    assert status.died(now=3.0, exit_code=1, policy=POLICY) is None  # third death within 60 s
    assert status.state is State.FAILED and status.restarts == 2
    status.started(pid=12)  # a late "started" never hides a failure
    status.stopped()
    assert status.state is State.FAILED
    assert status.as_dict() == {"name": "bundle-store", "kind": "service", "state": "FAILED", "pid": None,
                                "restarts": 2, "last_exit_code": 1}


def test_stopped_part_is_stopped() -> None:
    status = PartStatus("tansu", "infra")
    status.started(pid=5)
    status.stopped()
    assert (status.state, status.pid) == (State.STOPPED, None)


# -- the loop, over real child processes ----------------------------------------------------------


class Sleeper:
    """A child process that runs until killed; ``fail_starts`` makes the next starts fail (exit 3)."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.fail_starts = 0
        self.starts = 0
        self.lock = threading.Lock()

    def start(self) -> Sleeper:
        if self.process is not None and self.process.poll() is None:
            return self
        with self.lock:
            self.starts += 1
            failing = self.fail_starts > 0
            self.fail_starts -= failing
        code = "raise SystemExit(3)" if failing else "import time; time.sleep(600)"
        self.process = subprocess.Popen([sys.executable, "-c", code])
        if failing:
            self.process.wait()
            raise RuntimeError("exited with 3 before it was ready")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait()


@pytest.fixture
def sleepers(tmp_path: Path):
    made: list[Sleeper] = []

    def make() -> Sleeper:
        made.append(Sleeper(tmp_path / f"s{len(made)}.log"))
        return made[-1]

    yield make
    for sleeper in made:
        sleeper.stop()


def supervisor_of(*sleepers: Sleeper, policy: RestartPolicy, changes: list | None = None) -> Supervisor:
    parts = [Part(f"p{i}", "infra", s, s.log_path) for i, s in enumerate(sleepers)]
    on_change = (lambda snapshot: changes.append({p.name: st.state for p, st in snapshot})) if changes is not None else None
    return Supervisor(parts, policy=policy, on_change=on_change, poll_interval_s=0.02)


FAST = Backoff(base_s=0.0, max_s=0.0)


def test_a_killed_part_is_restarted_and_counted(sleepers) -> None:
    a, b = sleepers(), sleepers()
    changes: list[dict] = []
    with supervisor_of(a, b, policy=RestartPolicy(max_deaths=3, window_s=600, backoff=FAST),
                       changes=changes) as supervisor:
        first = a.process.pid
        a.process.kill()
        poll_until(lambda: supervisor.status("p0").state is State.RUNNING and supervisor.status("p0").restarts == 1,
                   what="p0 restarted")
        assert a.process.pid != first and a.process.poll() is None
        assert supervisor.status("p0").pid == a.process.pid
        assert supervisor.status("p0").last_exit_code == -9
        assert supervisor.status("p1").restarts == 0 and b.starts == 1
    assert {state for state in changes[-1].values()} == {State.STOPPED}
    assert a.process.poll() is not None and b.process.poll() is not None
    assert any(change["p0"] is State.RESTARTING for change in changes)


def test_a_part_that_keeps_failing_to_start_is_failed_and_left_alone(sleepers) -> None:
    a, b = sleepers(), sleepers()
    with supervisor_of(a, b, policy=RestartPolicy(max_deaths=3, window_s=600, backoff=FAST)) as supervisor:
        a.fail_starts = 100
        a.process.kill()
        poll_until(lambda: supervisor.status("p0").state is State.FAILED, what="p0 failed")
        status = supervisor.status("p0")
        assert status.restarts == 2 and status.last_exit_code == 3  # death 1 (kill), 2 and 3 (failed starts)
        assert a.starts == 3
        assert supervisor.status("p1").state is State.RUNNING  # the others keep running
        b.process.kill()
        poll_until(lambda: supervisor.status("p1").restarts == 1 and supervisor.status("p1").state is State.RUNNING,
                   what="p1 restarted while p0 is failed")
    assert a.starts == 3  # never restarted again


def test_a_slow_restart_does_not_hold_up_the_others(sleepers) -> None:
    slow, fast = sleepers(), sleepers()
    release = threading.Event()
    original = slow.start

    def blocked_start() -> Sleeper:
        started = original()
        release.wait(60)
        return started

    with supervisor_of(slow, fast, policy=RestartPolicy(max_deaths=5, window_s=600, backoff=FAST)) as supervisor:
        slow.start = blocked_start  # restarts of `slow` now hang until released
        slow.process.kill()
        poll_until(lambda: supervisor.status("p0").state is State.RESTARTING, what="p0 restarting")
        fast.process.kill()
        poll_until(lambda: supervisor.status("p1").restarts == 1 and supervisor.status("p1").state is State.RUNNING,
                   what="p1 restarted while p0's restart hangs")
        assert supervisor.status("p0").state is State.RESTARTING
        release.set()
        poll_until(lambda: supervisor.status("p0").state is State.RUNNING, what="p0 restarted once released")


def test_stop_during_a_backoff_stops_everything_without_restarting(sleepers) -> None:
    a = sleepers()
    supervisor = supervisor_of(a, policy=RestartPolicy(max_deaths=5, window_s=600,
                                                       backoff=Backoff(base_s=30.0, max_s=30.0)))
    supervisor.start()
    a.process.kill()
    poll_until(lambda: supervisor.status("p0").state is State.RESTARTING, what="p0 waiting out its backoff")
    supervisor.stop()  # returns at once: the backoff wait ends on stop
    supervisor.stop()  # idempotent
    assert a.starts == 1
    assert supervisor.status("p0").state is State.STOPPED


def test_a_part_failing_its_first_start_stops_those_started(sleepers) -> None:
    a, b = sleepers(), sleepers()
    b.fail_starts = 1
    supervisor = supervisor_of(a, b, policy=RestartPolicy())
    with pytest.raises(RuntimeError, match="before it was ready"):
        supervisor.start()
    assert a.process.poll() is not None


def test_part_names_must_be_unique(tmp_path: Path) -> None:
    s = Sleeper(tmp_path / "x.log")
    with pytest.raises(InvalidArgument, match="unique names"):
        Supervisor([Part("x", "infra", s, s.log_path), Part("x", "service", s, s.log_path)])


def test_part_status_keeps_only_the_deaths_within_the_window() -> None:
    status = PartStatus("tansu", "infra")
    policy = RestartPolicy(max_deaths=100, window_s=10.0, backoff=Backoff(base_s=0.0, max_s=0.0))
    for t in range(1000):
        assert status.died(now=float(t), exit_code=1, policy=policy) == 0.0
    assert list(status.deaths) == [float(t) for t in range(990, 1000)]
