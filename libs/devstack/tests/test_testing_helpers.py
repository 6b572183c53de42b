"""The bounded waits tests rely on: they return what they waited for, and fail when it never comes."""

import fcntl
import subprocess
import sys
import time

import pytest

from opml_devstack.testing.bus import poll_until

pytest_plugins = ["pytester"]


def test_poll_until_returns_the_first_truthy_value() -> None:
    answers = iter([None, [], ["ready"]])
    assert poll_until(lambda: next(answers), every_s=0.001) == ["ready"]


def test_poll_until_names_what_never_happened() -> None:
    with pytest.raises(AssertionError, match="timed out after 0.05s waiting for the impossible"):
        poll_until(lambda: None, timeout_s=0.05, every_s=0.01, what="the impossible")


def test_every_worker_answered_needs_each_known_worker_on_the_page() -> None:
    from opml_devstack.testing.metrics import every_worker_answered

    errors = ('opml_inference_router_worker_scrape_errors_total{worker="cpu-000"} 0\n'
              'opml_inference_router_worker_scrape_errors_total{worker="cpu-001"} 0\n')
    one = 'opml_inference_router_worker_batch_size_count{worker="cpu-000",pool_kind="cpu"} 3\n'
    two = 'opml_inference_router_worker_batch_size_count{worker="cpu-001",pool_kind="cpu"} 1\n'
    assert not every_worker_answered(errors)  # known, but none answered this scrape
    assert not every_worker_answered(errors + one)
    assert every_worker_answered(errors + one + two)
    assert not every_worker_answered(one)  # no known worker: a page without the router's collector


def test_a_test_that_wants_the_machine_to_itself_waits_for_those_beside_it_and_holds_back_new_ones(tmp_path) -> None:
    import fcntl
    import threading

    from opml_devstack.testing.bus import poll_until
    from opml_devstack.testing.plugin import machine_share

    def free(name: str, mode: int) -> bool:
        """Whether ``name`` could be locked in ``mode`` now (probed without waiting)."""
        with open(tmp_path / name, "a+") as probe:
            try:
                fcntl.flock(probe, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

    def hold(exclusive: bool, holding: threading.Event, release: threading.Event) -> threading.Thread:
        def run() -> None:
            with machine_share(tmp_path, exclusive=exclusive):
                holding.set()
                release.wait()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    beside, beside_done = threading.Event(), threading.Event()
    first = hold(False, beside, beside_done)
    assert beside.wait(10)
    second_beside, second_done = threading.Event(), threading.Event()
    second = hold(False, second_beside, second_done)
    assert second_beside.wait(10), "tests share the machine"
    second_done.set()
    second.join(10)
    alone, alone_done = threading.Event(), threading.Event()
    exclusive = hold(True, alone, alone_done)
    poll_until(lambda: not free("machine.gate", fcntl.LOCK_EX), what="the exclusive test at the gate")
    assert not alone.is_set(), "it waits for the test beside it"
    late, late_done = threading.Event(), threading.Event()
    newcomer = hold(False, late, late_done)
    beside_done.set()
    first.join(10)
    assert alone.wait(10), "it runs once the test beside it ended"
    assert not late.is_set() and not free("machine.lock", fcntl.LOCK_SH), "no new test started beside it"
    alone_done.set()
    exclusive.join(10)
    assert late.wait(10), "the next test starts after it"
    late_done.set()
    newcomer.join(10)


def test_the_wait_for_the_machine_is_not_counted_in_the_waiting_tests_timeout(pytester: pytest.Pytester,
                                                                              monkeypatch) -> None:
    """A test that wants the machine to itself may wait a whole long test beside it out; its timeout
    bounds its own work only (else it times out in a run where a long test happened to run beside it)."""
    pytester.makepyfile(test_alone="""
        import pytest

        @pytest.mark.machine_to_itself
        @pytest.mark.timeout(1)
        def test_alone():
            pass
    """)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")  # as a worker: the lock is in its base folder's parent
    lock_dir = pytester.path / "run"
    lock_dir.mkdir()
    with open(lock_dir / "machine.lock", "a+") as beside:
        fcntl.flock(beside, fcntl.LOCK_SH)  # a test running beside it on the other worker
        inner = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--basetemp",
                                  str(lock_dir / "base"), "test_alone.py"], cwd=pytester.path,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            def at_the_gate() -> bool:
                with open(lock_dir / "machine.gate", "a+") as probe:
                    try:
                        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        return True
                    return False
            poll_until(lambda: (lock_dir / "machine.gate").exists() and at_the_gate(), timeout_s=60,
                       what="the test waiting for the machine")
            time.sleep(2)  # the test beside it runs on past the waiting test's timeout: the case under test
        finally:
            fcntl.flock(beside, fcntl.LOCK_UN)
    output, _ = inner.communicate(timeout=60)
    assert inner.returncode == 0 and "1 passed" in output, output

