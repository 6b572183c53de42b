"""Pytest fixtures for the real infrastructure (registered as the ``opml_infra`` plugin).

One broker, S3 server and Redis per test session: Docker images through testcontainers where a
Docker engine answers, else the embedded binaries of :mod:`opml_devstack.devinfra` on free ports.
Every session gets a unique topic, bucket and Redis-key prefix, so runs never see each other's
data (the machine's Redis is shared, and ``make up`` may be running beside the tests).
``start_service`` runs platform services as real processes on top (see :mod:`.services`).

A test marked ``machine_to_itself`` (one that measures latency against a bound, on two shared cores)
runs with no other test of the run beside it: the other pytest-xdist workers wait between tests.

A skipped test fails: a skip proves nothing on CI, and everything a test needs is installed by
``make install``, so a test that cannot run here says why as a failure.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from opml_common.config import PlatformSettings
from opml_devstack.devinfra import DevInfra, Endpoints
from opml_devstack.stack import delete_redis_keys
from opml_devstack.testing.containers import docker_available, start_containers
from opml_devstack.testing.services import TOKENS, ServiceStarter


@pytest.fixture(scope="session")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoints]:
    """Endpoints of a real Kafka-compatible broker, S3 server and Redis for this test session."""
    if docker_available():
        with start_containers() as endpoints:
            yield endpoints
        return
    with DevInfra(workdir=Path(tmp_path_factory.mktemp("infra"))) as endpoints:
        yield endpoints


@pytest.fixture(scope="session")
def run_id() -> str:
    """A short id unique to this test session, used in every name the session creates."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def run_redis_keys(infra: Endpoints, run_id: str) -> Iterator[str]:
    """The Redis-key prefix of every test of this session (``opml-test:t<run>-``); at the session's end its
    keys are deleted (SCAN and UNLINK): the machine's Redis outlives the run and is shared."""
    prefix = f"opml-test:t{run_id}-"
    yield prefix
    delete_redis_keys(infra.redis_url, prefix)


@pytest.fixture
def unique_prefix(run_id: str) -> str:
    """A prefix unique to one test: ``t<run>-<test>-``, valid in topic, bucket and key names."""
    return f"t{run_id}-{uuid.uuid4().hex[:6]}-"


@pytest.fixture
def settings_env(infra: Endpoints, unique_prefix: str, run_redis_keys: str) -> dict[str, str]:
    """OPML_* variables pointing a service or client at the test infrastructure, names isolated (the
    Redis keys under the session's prefix, deleted when it ends)."""
    assert f"opml-test:{unique_prefix}".startswith(run_redis_keys)
    return {
        **infra.env(),
        "OPML_TOPIC_PREFIX": unique_prefix,
        "OPML_REDIS_PREFIX": f"opml-test:{unique_prefix}",
        "OPML_KAFKA_SESSION_TIMEOUT_MS": "2000",
        "OPML_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
        "OPML_LOG_FORMAT": "text",
    }


@pytest.fixture
def platform_settings(settings_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> PlatformSettings:
    """PlatformSettings for the test infrastructure with this test's unique prefixes."""
    for key, value in settings_env.items():
        monkeypatch.setenv(key, value)
    return PlatformSettings()


@pytest.fixture
def tokens() -> dict[str, str]:
    """Bearer token of each role (admin, writer, reader) the ``start_service`` processes accept."""
    return dict(TOKENS)


@pytest.fixture
def job_dir() -> Iterator[Path]:
    """A folder any user may read and write (mode 0777), removed after the test: what a job reads (its
    program) or writes (its outputs; the folder its checkpoint folder is made in) goes here. A job the
    job-orchestrator runs sandboxed (its default where it runs as root) runs as a user of its own, and
    ``tmp_path`` is private to the test's user."""
    folder = Path(tempfile.mkdtemp(prefix="opml-job-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def start_service(settings_env: dict[str, str], tmp_path: Path) -> Iterator[ServiceStarter]:
    """``start_service("bundle-store", extra_env={...})``: a service running as a real process on free
    ports with auth on, its home and log under ``tmp_path``; every process made is stopped after the test."""
    starter = ServiceStarter(settings_env, tmp_path)
    yield starter
    starter.stop_all()


@pytest.fixture
def opml_cli(tokens: dict[str, str]):
    """``opml_cli(*args, token="writer", expect_exit=0)``: runs the ``opml`` command in-process with the
    role's bearer token and returns its output; the test fails on another exit code. Point it at a
    service with that service's ``OPML_<SERVICE>_TARGET`` (``monkeypatch.setenv``)."""
    from click.testing import CliRunner

    from opml_common.cli import main

    def run(*args: str, token: str = "writer", expect_exit: int = 0) -> str:
        result = CliRunner().invoke(main, list(args), env={"OPML_TOKEN": tokens[token], "COLUMNS": "200"},
                                    catch_exceptions=False)
        assert result.exit_code == expect_exit, result.output
        return result.output

    return run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Turns a skip (``pytest.skip``, a skip mark, ``importorskip``) into a failure with its reason."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"skipped ({reason}): a skipped test proves nothing; make it run here or remove it"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "machine_to_itself: no other test of the run runs beside this one "
                                       "(the other pytest-xdist workers wait between their tests)")


@contextlib.contextmanager
def machine_share(directory: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold the run's machine lock in ``directory``: shared by every test, exclusive for one marked
    ``machine_to_itself``. A gate lock gives the exclusive holder precedence: while it waits for the
    tests running beside it to end, no new test starts (else it could wait for a whole worker's files)."""
    with open(directory / "machine.gate", "a+") as gate, open(directory / "machine.lock", "a+") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield  # closing the files releases both locks


def _machine_lock_dir(config: pytest.Config) -> Path:
    """A folder every pytest-xdist worker of this run shares (the workers' base temporary folders are
    its children); the run's own base folder without xdist."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]  # what tmp_path_factory is
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Holds the machine lock around a test's whole protocol, outside pytest-timeout's (tryfirst: the
    outermost wrapper): the wait for the tests beside it is not the test's time, so a test's timeout
    bounds what it does, however long the test beside it runs."""
    with machine_share(_machine_lock_dir(item.config),
                       exclusive=item.get_closest_marker("machine_to_itself") is not None):
        yield
