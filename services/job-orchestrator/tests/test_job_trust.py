"""Issue 16, item 2 and part of 6: what a job is given, and who may act on it, on a real service
process with the real broker and Redis.

The attack as filed: a writer submitted a job running ``env`` and a reader read its log, which held
``OPML_AUTH_TOKENS``, the S3 secret and the Redis URL. Here the service runs with known secret values;
the reader is refused, and the submitter's own log holds none of them, only what a job is given (the
job identity's S3 key, the allow-listed variables).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import stat
import sys
import sysconfig
from pathlib import Path

import pytest
from opml.jobs.v1 import events_pb2
from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.bus import CloudEvent
from opml_common.errors import InvalidArgument, PermissionDenied
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_job_orchestrator.convert import ENV_HIDDEN
from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import load_spec
from opml_job_orchestrator_contract.topics import JOBS

PLATFORM_SECRETS = {
    "OPML_S3_ACCESS_KEY": "platform-access-7f3a9c",
    "OPML_S3_SECRET_KEY": "platform-s3-secret-51d2e8b0",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-in-the-services-env-9e1f",  # an allow-list, not a deny-list
    "VAULT_TOKEN": "vault-token-of-the-service-44ab",
}
JOB_IDENTITY = {"OPML_JOB_ORCHESTRATOR_JOB_S3_ACCESS_KEY": "job-identity-key-0c7d",
                "OPML_JOB_ORCHESTRATOR_JOB_S3_SECRET_KEY": "job-identity-secret-88e2"}


@pytest.fixture
def secret_service(start_service: ServiceStarter, service_env: dict[str, str]):
    """A job-orchestrator whose environment holds known platform secrets and a job identity."""
    env = {**service_env, **PLATFORM_SECRETS, **JOB_IDENTITY}
    return start_service("job-orchestrator", env=env), env


def _client(service, role: str) -> JobClient:
    return JobClient(service.target, token=TOKENS[role])


def _log(client: JobClient, job_id: str) -> str:
    return b"".join(chunk.data for chunk in client.logs(job_id)).decode()


def test_a_writers_env_job_reads_no_platform_secret_and_a_reader_cannot_read_it(secret_service, wait_for) -> None:
    service, env = secret_service
    with _client(service, "writer") as writer, _client(service, "reader") as reader:
        writer.submit(load_spec({"name": "printenv", "class": "TE", "command": ["env"],
                                 "roles": {"worker": {"resources": {"cpu": 1, "memory": "64Mi"}}}}))
        wait_for(writer, "printenv", pb.JOB_STATE_SUCCEEDED)
        with pytest.raises(PermissionDenied, match="ReadJobLogs .* needs the admin role, or to be its submitter"):
            _log(reader, "printenv")
        log = _log(writer, "printenv")
    printed = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    secrets = {"the platform's tokens": list(TOKENS.values()), "its S3 keys and others": list(PLATFORM_SECRETS.values()),
               "its Redis URL": [env["OPML_REDIS_URL"]], "the token list": [env["OPML_AUTH_TOKENS"]]}
    for what, values in secrets.items():
        for value in values:
            assert value not in log, f"the job's log shows {what}: {value!r}"
    assert not {"OPML_AUTH_TOKENS", "OPML_REDIS_URL", "OPML_ENV", "AWS_SECRET_ACCESS_KEY", "VAULT_TOKEN"} & set(printed)
    # what a job is given: the job identity, the broker, its own variables, PATH, HOME and TMPDIR (its own)
    assert printed["OPML_S3_ACCESS_KEY"] == JOB_IDENTITY["OPML_JOB_ORCHESTRATOR_JOB_S3_ACCESS_KEY"]
    assert printed["OPML_S3_SECRET_KEY"] == JOB_IDENTITY["OPML_JOB_ORCHESTRATOR_JOB_S3_SECRET_KEY"]
    assert printed["OPML_KAFKA_BOOTSTRAP"] == env["OPML_KAFKA_BOOTSTRAP"] and printed["OPML_JOB_ID"] == "printenv"
    allowed = {"PATH", "HOME", "TMPDIR", "LANG", "TZ", "TF_CONFIG",
               "CUDA_VISIBLE_DEVICES"}  # empty: a job that asks for no GPU sees none
    assert {n for n in printed if not n.startswith(("OPML_", "LC_"))} <= allowed, sorted(printed)


def test_a_writers_job_runs_as_a_user_of_its_own_and_reads_no_services_environ(secret_service, wait_for) -> None:
    """The attack as filed, through the service: a job read the services' ``/proc/<pid>/environ`` and
    ran as their user, in the orchestrator's working directory. ``test_sandbox.py`` has every other
    read and write of it."""
    service, env = secret_service
    home = Path(env["OPML_JOB_ORCHESTRATOR_HOME"])
    targets = {"environ_pids": {"the job-orchestrator": service.process.pid}, "read": {},
               "list": {"its home": str(home)}, "write": {"site-packages": sysconfig.get_paths()["purelib"]}}
    attacker = str(Path(__file__).parent / "programs" / "attacker.py")
    with _client(service, "writer") as writer:
        writer.submit(load_spec({"name": "snoop", "class": "TE", "command": [sys.executable, attacker, json.dumps(targets)],
                                 "roles": {"worker": {"resources": {"cpu": 1, "memory": "64Mi"}}}}))
        wait_for(writer, "snoop", pb.JOB_STATE_SUCCEEDED)
        found = json.loads(_log(writer, "snoop").splitlines()[-1])
    assert found["managed"] == {}, found["managed"]
    assert found["uid"] != 0 and found["listed_uids"] == [found["uid"]]
    assert set(found["refused"]) >= {"environ of the job-orchestrator", "list its home", "write site-packages"}
    environ = Path(f"/proc/{service.process.pid}/environ").read_bytes()  # the control: the secrets are there
    assert all(value.encode() in environ for value in PLATFORM_SECRETS.values())
    assert stat.S_IMODE(home.stat().st_mode) == 0o700  # the service made its home its own


def test_the_spec_env_cannot_override_the_platforms_every_offender_named(job_service, writer: JobClient) -> None:
    spec = load_spec({"name": "override", "class": "BE", "command": ["true"],
                      "env": {"LD_PRELOAD": "/tmp/evil.so", "PYTHONPATH": "/tmp/evil", "OPML_TOPIC_PREFIX": "other-",
                              "TF_CONFIG": "{}", "LD_LIBRARY_PATH": "/tmp", "OPML_TRACE_JOB": "another-job",
                              "OPML_TRACE_FLUSH_INTERVAL_S": "1", "MY_SETTING": "fine"},
                      "roles": {"worker": {"resources": {"cpu": 1}}}})
    with pytest.raises(InvalidArgument) as caught:
        writer.submit(spec)
    fields = [field for field, _ in caught.value.violations]
    assert sorted(fields) == ["env.LD_LIBRARY_PATH", "env.LD_PRELOAD", "env.OPML_TOPIC_PREFIX", "env.OPML_TRACE_JOB",
                              "env.PYTHONPATH", "env.TF_CONFIG"], caught.value.message  # the tracer's tuning is fine
    assert all("set by the platform" in rule for _, rule in caught.value.violations)
    assert "env.LD_PRELOAD: is set by the platform" in caught.value.message
    assert writer.list() == []  # nothing was queued


def test_a_writer_cannot_cancel_an_admins_job_an_admin_can_cancel_a_writers(
        job_service, writer: JobClient, admin: JobClient, job_spec, wait_for) -> None:
    admin.submit(job_spec("admins", "import time; time.sleep(60)"))
    writer.submit(job_spec("writers", "import time; time.sleep(60)"))
    wait_for(admin, "admins", pb.JOB_STATE_RUNNING)
    with pytest.raises(PermissionDenied, match="CancelJob on job 'admins' needs the admin role, or to be its submitter"):
        writer.cancel("admins")
    assert admin.get("admins").status.state == pb.JOB_STATE_RUNNING  # untouched
    with pytest.raises(PermissionDenied):
        _log(writer, "admins")
    assert admin.cancel("writers").status.state == pb.JOB_STATE_CANCELLED
    assert admin.cancel("admins").status.state == pb.JOB_STATE_CANCELLED
    writer.submit(job_spec("own", "import time; time.sleep(60)"))
    assert writer.cancel("own").status.state == pb.JOB_STATE_CANCELLED  # a submitter cancels its own


def test_the_submitter_survives_a_restart(service_process, wait_for, job_spec) -> None:
    first = service_process().start()
    with _client(first, "writer") as writer:
        writer.submit(job_spec("kept", "import time; time.sleep(60)"))
        wait_for(writer, "kept", pb.JOB_STATE_RUNNING)
    first.stop()
    second = service_process().start()  # the submitter comes back from Redis with the job
    with _client(second, "writer") as writer, _client(second, "reader") as reader:
        with pytest.raises(PermissionDenied, match="ReadJobLogs on job 'kept'"):
            _log(reader, "kept")
        list(writer.logs("kept", attempt=0))  # its submitter may read them
        assert writer.cancel("kept").status.state == pb.JOB_STATE_CANCELLED


def test_job_events_on_the_broker_carry_no_env_values(writer: JobClient, job_spec, wait_for,
                                                      platform_settings) -> None:
    secret = "users-own-api-key-3b9f0e"
    writer.submit(job_spec("withenv", "import os; print(len(os.environ['MY_API_KEY']))",
                           job_class="TE", env={"MY_API_KEY": secret}))
    job = wait_for(writer, "withenv", pb.JOB_STATE_SUCCEEDED)
    assert job.spec.env["MY_API_KEY"] == secret  # the submitter's own Get still shows it
    assert _log(writer, "withenv") == f"{len(secret)}\n"  # and the job got it
    records = asyncio.run(read_records(platform_settings, JOBS.full_name(platform_settings.topic_prefix), 4))
    assert len(records) == 4
    for record in records:
        assert secret.encode() not in record.value and all(secret.encode() not in v for _, v in record.headers)
    events = {e.type: e for e in (CloudEvent.from_kafka(r.headers, r.value) for r in records)}
    submitted = events["opml.jobs.v1.JobSubmitted"].parse(events_pb2.JobSubmitted)
    assert dict(submitted.spec.env) == {"MY_API_KEY": ""}  # the name, not the value


def test_a_secret_env_reaches_every_run_and_no_reply_event_or_log(service_process, job_spec, wait_for,
                                                                   platform_settings) -> None:
    """A secret env value (a scoped credential the submitter hands its job) is in the task's environment,
    on its first run and on a retry after the service restarted, and nowhere else: not in any reply (the
    submitter's and an admin's included), not on the jobs topic, not in the service's log."""
    secret = "scoped-upload-grant-5e0c91"
    digest = hashlib.sha256(secret.encode()).hexdigest()  # what the job prints: the log shows no secret
    code = ("import hashlib, os, sys, time; print(hashlib.sha256(os.environ['GRANT'].encode()).hexdigest()); "
            "sys.stdout.flush(); os.environ['OPML_JOB_ATTEMPT'] == '0' and time.sleep(60)")
    spec = job_spec("secretive", code, job_class="TE", env={"MODE": "plain"}, secret_env={"GRANT": secret})
    first = service_process().start()
    with _client(first, "writer") as writer, _client(first, "admin") as admin:
        submitted = writer.submit(spec)
        running = wait_for(writer, "secretive", pb.JOB_STATE_RUNNING)
        replies = [submitted, running, admin.get("secretive"), *writer.list(), *admin.list()]
        watched = next(writer.watch("secretive"))
        assert all(dict(job.spec.secret_env) == {} for job in replies)
        assert all(dict(job.spec.env) == {"MODE": "plain"} for job in (submitted, running))
        assert secret not in str(watched) and all(secret not in str(job) for job in replies)
        while digest not in _log(writer, "secretive"):  # the first run got it
            pass
    first.stop()  # the running attempt is stopped; the restarted service runs it again from Redis
    second = service_process().start()
    with _client(second, "writer") as writer:
        done = wait_for(writer, "secretive", pb.JOB_STATE_SUCCEEDED)
        assert done.status.attempt >= 1 and dict(done.spec.secret_env) == {}
        assert b"".join(c.data for c in writer.logs("secretive", attempt=done.status.attempt)).decode() \
            == digest + "\n"  # the retry got it too, from what the store kept
    records = asyncio.run(read_records(platform_settings, JOBS.full_name(platform_settings.topic_prefix), 3))
    assert records and all(secret.encode() not in r.value and all(secret.encode() not in v for _, v in r.headers)
                           for r in records)
    submitted_event = next(CloudEvent.from_kafka(r.headers, r.value) for r in records
                           if CloudEvent.from_kafka(r.headers, r.value).type == "opml.jobs.v1.JobSubmitted")
    assert dict(submitted_event.parse(events_pb2.JobSubmitted).spec.secret_env) == {}
    for process in (first, second):
        assert secret not in process.log_path.read_text()


def test_a_secret_env_breaks_the_env_rules_every_offender_named(job_service, writer: JobClient) -> None:
    spec = load_spec({"name": "bad-secrets", "class": "BE", "command": ["true"], "env": {"TOKEN": "a"},
                      "secret_env": {"TOKEN": "b", "OPML_AUTH_TOKENS": "c", "LD_PRELOAD": "d", "NUL": "x\0y"},
                      "roles": {"worker": {"resources": {"cpu": 1}}}})
    with pytest.raises(InvalidArgument) as caught:
        writer.submit(spec)
    assert sorted(field for field, _ in caught.value.violations) == [
        "secret_env.LD_PRELOAD", "secret_env.NUL", "secret_env.OPML_AUTH_TOKENS", "secret_env.TOKEN"]
    assert all(value not in caught.value.message for value in ('"b"', "'b'", "x\0y"))
    assert writer.list() == []


SECOND_WRITER_TOKEN = "second-writer-token"


@pytest.fixture
def shared_service(start_service: ServiceStarter, service_env: dict[str, str]):
    """A job-orchestrator with the usual reader, writer and admin, and a second writer (another principal)."""
    tokens = f"{service_env['OPML_AUTH_TOKENS']},other-team:{SECOND_WRITER_TOKEN}=writer"
    return start_service("job-orchestrator", env={**service_env, "OPML_AUTH_TOKENS": tokens})


def test_env_values_are_shown_to_the_submitter_and_admins_only(shared_service, job_spec, wait_for) -> None:
    secret = "writers-database-password-6c1e"
    tokens = {**TOKENS, "second writer": SECOND_WRITER_TOKEN}
    clients = {who: JobClient(shared_service.target, token=token) for who, token in tokens.items()}
    try:
        submitted = clients["writer"].submit(job_spec("private", "import time; time.sleep(60)",
                                                      env={"DB_PASSWORD": secret, "BATCH_SIZE": "64"}))
        assert dict(submitted.spec.env) == {"DB_PASSWORD": secret, "BATCH_SIZE": "64"}  # the submitter's answer
        wait_for(clients["admin"], "private", pb.JOB_STATE_RUNNING)
        for who, client in clients.items():
            got, (listed,) = client.get("private"), client.list()
            one_job = client.watch("private")
            first_of_one, first_of_all = next(one_job), next(all_jobs := client.watch())
            one_job.close()
            all_jobs.close()
            if who in ("writer", "admin"):
                expected = {"DB_PASSWORD": secret, "BATCH_SIZE": "64"}
            else:  # the reader, and a writer who did not submit it
                expected = {"DB_PASSWORD": ENV_HIDDEN, "BATCH_SIZE": ENV_HIDDEN}
            assert dict(got.spec.env) == expected, who
            assert dict(listed.spec.env) == expected, who
            assert got.spec.command == listed.spec.command == submitted.spec.command  # the rest is everyone's
            # a watch change holds the job's status and a message, never its spec: nothing to hide
            assert "spec" not in pb.JobChange.DESCRIPTOR.fields_by_name
            for change in (first_of_one, first_of_all):
                assert change.status.job_id == "private" and secret.encode() not in change.SerializeToString(), who
        assert clients["admin"].cancel("private").spec.env["DB_PASSWORD"] == secret
    finally:
        for client in clients.values():
            client.close()
