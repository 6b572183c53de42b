"""The local executor's sandbox with real processes (the real executor, real jobs, no fakes).

The attack as filed: a writer's job read ``/proc/<pid>/environ`` of every service (tokens, the S3
secret), read the services' homes, wrote site-packages and the orchestrator's work dir, and ran in the
orchestrator's working directory. Here a job tries each of those, and more, and manages none, while the
test (root, as the services) shows every target exists and is readable to the services, so the test
cannot pass for lack of a target. A sandboxed job still does its work: its folders, its checkpoint
folder, its heartbeat and checkpoint reports, its exit codes. ``required`` refuses to start without
root; ``off`` runs jobs as before.

The sandbox needs root, as the service does to run jobs as users of their own (CI runs as root).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import sysconfig
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.private import private_dir, write_private_file
from opml_job_orchestrator.executor import CheckpointEvent, JobOutcome, JobProgram, LocalExecutor, TaskEvent, sandbox
from opml_job_orchestrator.scheduler import JobClass, JobSpec, Resources, RoleSpec

PROGRAMS = Path(__file__).parent / "programs"
CHECKOUT = Path(__file__).resolve().parents[3]
SECRETS = {"OPML_AUTH_TOKENS": "admin-token-of-the-service-5c2e=admin",
           "OPML_S3_SECRET_KEY": "s3-secret-of-the-service-91fa"}


def job(job_id: str, workers: int = 1) -> JobSpec:
    return JobSpec(job_id=job_id, job_class=JobClass.BE, roles={"worker": RoleSpec(workers, Resources(cpu_millis=100))})


def on_nodes(spec: JobSpec) -> dict[str, tuple[str, ...]]:
    return {"worker": ("local",) * spec.roles["worker"].replicas}


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.fixture
def home(job_dir: Path) -> Path:
    """The orchestrator's home, made as the service makes it, where a job could reach it but for its mode."""
    return private_dir(job_dir / "job-orchestrator")


@pytest.fixture
async def executor(home: Path) -> AsyncIterator[LocalExecutor]:
    async with LocalExecutor(work_dir=home / "work", cleanup_grace_s=1.0, shutdown_grace_s=0.5,
                             heartbeat_check_interval_s=0.1, sandbox="required", protected_dirs=[home]) as ex:
        yield ex


@pytest.fixture
def service_process():
    """A service-like process (root) with secrets in its environment, stopped after the test."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                               env={"PATH": os.defpath, **SECRETS})
    yield process
    process.kill()
    process.wait()


async def test_a_job_reads_no_service_secret_and_writes_nothing_of_the_platforms(
        executor: LocalExecutor, home: Path, job_dir: Path, service_process: subprocess.Popen,
        until_job_event, job_event) -> None:
    # what the services keep, made as they make it
    outbox = home / "outbox"
    outbox.mkdir()
    (outbox / "event.json").write_text('{"job": "someone else\'s"}')  # the process's umask: 0644
    bundle_store_home = private_dir(job_dir / "bundle-store")
    (bundle_store_home / "manifest.key").write_text("manifest-signing-key-of-the-store")
    infra = private_dir(private_dir(job_dir / ".opml") / "infra")  # `make up`'s state dir and its infra
    s3_json = write_private_file(infra / "s3.json", json.dumps({"identities": [{"credentials": [
        {"accessKey": "opml", "secretKey": SECRETS["OPML_S3_SECRET_KEY"]}]}]}).encode())
    site_packages = Path(sysconfig.get_paths()["purelib"])

    # another job, running: its working directory holds a secret of its own
    victim = job("victim")
    await executor.launch(victim, JobProgram(commands={"worker": py(
        "import pathlib, time; pathlib.Path('secret.txt').write_text('victims-own-secret'); "
        "print('ready', flush=True); time.sleep(60)")}), on_nodes(victim), attempt=0)
    while "ready" not in await executor.logs("victim", "worker", 0):
        await asyncio.sleep(0.02)
    victim_run = home / "work" / "victim" / "attempt-0"
    victim_pid = json.loads((victim_run / "run.json").read_text())["tasks"][0]["pid"]
    victim_cwd = victim_run / "sandbox" / "worker-0"

    targets = {
        "environ_pids": {"a service": service_process.pid, "the orchestrator": os.getpid(), "another job": victim_pid},
        "read": {"the orchestrator's outbox": str(outbox / "event.json"),
                 "another service's home": str(bundle_store_home / "manifest.key"),
                 "s3.json": str(s3_json),
                 "another job's file": str(victim_cwd / "secret.txt"),
                 "another job's log": str(victim_run / "worker-0.log"),
                 "another job's heartbeat": str(victim_run / "sandbox" / "worker-0.heartbeat")},
        "list": {"the orchestrator's home": str(home), "the orchestrator's work dir": str(home / "work"),
                 "another job's working dir": str(victim_cwd)},
        "write": {"site-packages": str(site_packages), "the checkout": str(CHECKOUT),
                  "the orchestrator's home": str(home), "the orchestrator's work dir": str(home / "work"),
                  "another job's working dir": str(victim_cwd)},
    }
    attacker = job("attacker")
    await executor.launch(attacker, JobProgram(commands={"worker": [
        sys.executable, str(PROGRAMS / "attacker.py"), json.dumps(targets)]}), on_nodes(attacker), attempt=0)
    events = await until_job_event(executor, "attacker")
    log = await executor.logs("attacker", "worker", 0)
    assert job_event(events).outcome is JobOutcome.SUCCEEDED, log
    found = json.loads(log.splitlines()[-1])

    assert found["managed"] == {}, found["managed"]
    assert found["uid"] != 0 and found["listed_uids"] == [found["uid"]]  # not one process of another user listed
    expected = ({f"{verb} {name}" for verb, names in (("read", targets["read"]), ("list", targets["list"]),
                                                      ("write", targets["write"])) for name in names}
                | {f"{what} of {name}" for what in ("environ", "cwd") for name in targets["environ_pids"]})
    assert set(found["refused"]) >= expected, sorted(expected - set(found["refused"]))

    # the control: every target is there, and the services' user (root, this test) reads and writes it
    environ = Path(f"/proc/{service_process.pid}/environ").read_bytes()
    assert all(value.encode() in environ for value in SECRETS.values())
    assert Path(f"/proc/{victim_pid}/environ").read_bytes() and Path(f"/proc/{os.getpid()}/environ").read_bytes()
    assert (victim_cwd / "secret.txt").read_text() == "victims-own-secret"
    for path in targets["read"].values():
        Path(path).read_bytes()  # raises if it is not there
    for path in targets["list"].values():
        assert os.listdir(path)
    for path in targets["write"].values():
        assert os.access(path, os.W_OK)
    # the platform's code: root's, and no other user may write it
    for code in (site_packages, CHECKOUT, Path(sys.executable).resolve().parent):
        mode = code.stat()
        assert mode.st_uid == 0 and not mode.st_mode & (stat.S_IWGRP | stat.S_IWOTH), code
    await executor.terminate("victim", 0)


async def test_a_sandboxed_job_does_its_work_in_folders_of_its_own_as_the_same_user_every_attempt(
        executor: LocalExecutor, home: Path, job_dir: Path, until_job_event, job_event) -> None:
    ckpt = job_dir / "checkpoints" / "train"  # neither exists yet: made for the job
    work = ("import json, os, pathlib, tempfile\n"
            "ckpt = pathlib.Path(os.environ['OPML_CHECKPOINT_DIR'])\n"
            "before = (ckpt / 'model.ckpt').read_text() if (ckpt / 'model.ckpt').exists() else None\n"
            "pathlib.Path('in-cwd.txt').write_text('x')\n"
            "pathlib.Path(os.environ['HOME'], '.keras').mkdir()\n"
            "tempfile.NamedTemporaryFile(delete=False).write(b'x')\n"
            "(ckpt / 'model.ckpt').write_text('attempt ' + os.environ['OPML_JOB_ATTEMPT'])\n"
            "pathlib.Path(os.environ['OPML_HEARTBEAT_FILE']).write_text(json.dumps({'checkpoint_step': 7}))\n"
            "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
            "print(json.dumps({'ids': [os.getuid(), os.geteuid(), os.getgid(), os.getegid()], 'groups': os.getgroups(),"
            " 'nnp': status['NoNewPrivs'].strip(), 'umask': status['Umask'].strip(), 'cwd': os.getcwd(),"
            " 'home': os.environ['HOME'], 'tmp': tempfile.gettempdir(), 'before': before}))\n")
    spec = job("train")
    program = JobProgram(commands={"worker": py(work)}, checkpoint_dir=str(ckpt))
    await executor.launch(spec, program, on_nodes(spec), attempt=0)
    events = await until_job_event(executor, "train")
    assert job_event(events).outcome is JobOutcome.SUCCEEDED, await executor.logs("train", "worker", 0)
    assert [e.step for e in events if isinstance(e, CheckpointEvent)] == [7]
    first = json.loads((await executor.logs("train", "worker", 0)).splitlines()[-1])
    uid = int((home / "work" / "train" / "sandbox-uid").read_text())
    assert first["ids"] == [uid] * 4 and uid >= sandbox.DEFAULT_UID_BASE and first["groups"] == []
    assert (first["nnp"], first["umask"]) == ("1", "0077")
    assert first["cwd"] == first["home"] == "/run/opml-job/worker-0" and first["tmp"] == "/run/opml-job/worker-0/tmp"
    assert first["before"] is None
    own = home / "work" / "train" / "attempt-0" / "sandbox" / "worker-0"
    assert (own / "in-cwd.txt").exists() and (own / ".keras").is_dir() and len(list((own / "tmp").iterdir())) == 1
    assert (own.stat().st_uid, stat.S_IMODE(own.stat().st_mode)) == (uid, 0o700)
    assert (ckpt.stat().st_uid, stat.S_IMODE(ckpt.stat().st_mode)) == (uid, 0o700)
    assert (ckpt.parent.stat().st_uid, stat.S_IMODE(ckpt.parent.stat().st_mode)) == (0, 0o755)

    await executor.launch(spec, program, on_nodes(spec), attempt=1)  # a resume: the same user reads its checkpoint
    assert job_event(await until_job_event(executor, "train")).outcome is JobOutcome.SUCCEEDED
    second = json.loads((await executor.logs("train", "worker", 0, attempt=1)).splitlines()[-1])
    assert second["ids"] == [uid] * 4 and second["before"] == "attempt 0"
    assert (ckpt / "model.ckpt").read_text() == "attempt 1"

    other = job("other")
    await executor.launch(other, JobProgram(commands={"worker": py("import os; print(os.getuid())")}),
                          on_nodes(other), attempt=0)
    assert job_event(await until_job_event(executor, "other")).outcome is JobOutcome.SUCCEEDED
    assert int(await executor.logs("other", "worker", 0)) not in (0, uid)  # every job a user of its own


async def test_exit_codes_and_signals_are_the_tasks_own(executor: LocalExecutor, until_job_event, job_event) -> None:
    """The sandbox is entered by the task's own process: its exit code, and the signal that killed it (a
    SIGTERM it has no handler for, which a PID 1 would ignore), are reported as they are."""
    for job_id, code, exit_code, message in (
            ("exits", "import sys; sys.exit(3)", 3, "worker 0 exited with code 3"),
            ("killed", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM,
             "worker 0 was killed by signal SIGTERM")):
        spec = job(job_id)
        await executor.launch(spec, JobProgram(commands={"worker": py(code)}), on_nodes(spec), attempt=0)
        events = await until_job_event(executor, job_id)
        (ended,) = [e for e in events if isinstance(e, TaskEvent) and e.exit_code is not None]
        assert (ended.exit_code, job_event(events).message) == (exit_code, message)


async def test_a_heartbeat_swapped_for_a_fifo_or_a_link_is_no_heartbeat(
        executor: LocalExecutor, job_dir: Path, until_job_event) -> None:
    """The task owns its heartbeat file's folder: a FIFO there must not block the executor's reads (it reads
    on its event loop), nor a link make it read a file of the services' (a checkpoint step from it)."""
    services_file = write_private_file(private_dir(job_dir / "service") / "state.json",
                                       json.dumps({"checkpoint_step": 42}).encode())
    code = ("import os, time; beat = os.environ['OPML_HEARTBEAT_FILE']\n"
            "os.remove(beat); os.mkfifo(beat); time.sleep(0.5)\n"
            f"os.remove(beat); os.symlink({str(services_file)!r}, beat); time.sleep(0.5)\n")
    spec = job("swapper")
    await executor.launch(spec, JobProgram(commands={"worker": py(code)}), on_nodes(spec), attempt=0)
    events = await until_job_event(executor, "swapper")
    assert not [e for e in events if isinstance(e, CheckpointEvent)]


async def test_a_checkpoint_folder_is_refused_where_it_is_not_the_jobs_to_have(
        executor: LocalExecutor, home: Path, job_dir: Path, until_job_event, job_event) -> None:
    (job_dir / "taken").mkdir()  # root's: never handed to a job
    (job_dir / "to-etc").symlink_to("/etc")
    site_packages = Path(sysconfig.get_paths()["purelib"])
    refused = {
        "ckpt": "must be an absolute path",
        str(site_packages / "opml-job-ckpt"): "a folder of the platform's or the system's",
        str(home / "work" / "ckpt"): "a folder of the platform's or the system's",
        str(home / "ckpt"): "a folder of the platform's or the system's",
        "/etc/opml-job-ckpt": "a folder of the platform's or the system's",
        str(job_dir / "to-etc" / "opml-job-ckpt"): "a folder of the platform's or the system's",
        str(job_dir / "taken"): "exists and belongs to uid 0",
        str(private_dir(job_dir / "private") / "ckpt"): f"{str(job_dir / 'private')!r} is mode 0700 of uid 0",
    }
    for number, (path, why) in enumerate(refused.items()):
        spec = job(f"refused-{number}")
        await executor.launch(spec, JobProgram(commands={"worker": py("pass")}, checkpoint_dir=path),
                              on_nodes(spec), attempt=0)
        event = job_event(await until_job_event(executor, spec.job_id))
        assert event.outcome is JobOutcome.FAILED and not event.retriable, event
        assert f"checkpoint.dir {path!r}" in event.message or "checkpoint.dir must be" in event.message, event.message
        assert why in event.message, event.message
    assert not (site_packages / "opml-job-ckpt").exists() and not Path("/etc/opml-job-ckpt").exists()
    assert not (job_dir / "private" / "ckpt").exists() and (job_dir / "taken").stat().st_uid == 0


async def test_required_refuses_to_start_without_root_and_auto_runs_unsandboxed_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sandbox, "privileged", lambda: False)
    required = LocalExecutor(work_dir=tmp_path / "work", sandbox="required")
    with pytest.raises(FailedPrecondition, match=r"sandbox is required \(sandbox=required\), but the service "
                                                  r"does not run as root"):
        await required.start()
    with caplog.at_level(logging.WARNING):
        async with LocalExecutor(work_dir=tmp_path / "work") as auto:
            assert not auto.sandboxed
    assert "jobs run unsandboxed, as this service's user: the service does not run as root" in caplog.text
    with pytest.raises(InvalidArgument) as caught:
        LocalExecutor(work_dir="w", sandbox="on", sandbox_uid_base=0)
    assert [field for field, _ in caught.value.violations] == ["sandbox", "sandbox_uid_base"]
    with pytest.raises(InvalidArgument, match=r"^sandbox_uid_count: .* at most 4294967294"):
        LocalExecutor(work_dir="w", sandbox_uid_base=2**32 - 10, sandbox_uid_count=100)


async def test_off_runs_jobs_as_before(tmp_path: Path, until_job_event, job_event) -> None:
    code = "import json, os; print(json.dumps([os.getuid(), os.getcwd(), os.environ['HOME']]))"
    async with LocalExecutor(work_dir=tmp_path / "work", sandbox="off") as ex:
        assert not ex.sandboxed
        spec = job("plain")
        await ex.launch(spec, JobProgram(commands={"worker": py(code)}), on_nodes(spec), attempt=0)
        assert job_event(await until_job_event(ex, "plain")).outcome is JobOutcome.SUCCEEDED
        assert json.loads(await ex.logs("plain", "worker", 0)) == [os.getuid(), os.getcwd(), os.environ["HOME"]]


async def test_off_makes_a_missing_checkpoint_folder_too(tmp_path: Path, until_job_event, job_event) -> None:
    """A trial writes its model into its checkpoint folder whether or not the job runs sandboxed."""
    folder = tmp_path / "checkpoints" / "trial-1"
    code = f"open({str(folder / 'model.txt')!r}, 'w').write('ok')"
    async with LocalExecutor(work_dir=tmp_path / "work", sandbox="off") as ex:
        spec = job("ckpt")
        await ex.launch(spec, JobProgram(commands={"worker": py(code)}, checkpoint_dir=str(folder)), on_nodes(spec),
                        attempt=0)
        assert job_event(await until_job_event(ex, "ckpt")).outcome is JobOutcome.SUCCEEDED
    assert (folder / "model.txt").read_text() == "ok"
