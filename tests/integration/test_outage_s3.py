"""S3 gone in the middle of a push and of a capture upload (issue 12, item 8): nothing half visible,
and what was in flight gets through once S3 is back.

A private SeaweedFS (and a broker on tansu's memory engine, so only S3 goes down) serves a
bundle-store. S3 is stopped as the first progress message that counts a blob on the remote arrives:
the push fails UNAVAILABLE (retriable) and the service stays up (it answers reads of its local store).
S3 started again on the same port and data directory, nothing restarted: the remote holds no
manifest of the bundle, the retried push succeeds, and another context pulls every blob, verified.

A traced job's capture while S3 cannot be reached from the job: the job reaches S3 through a relay
(:class:`~opml_devstack.testing.relay.TcpRelay`) that is closed, so connections are refused as by a
stopped server, while the collector (which arms the capture and reads the trace) reaches S3 itself.
The tracer keeps the finished trace on disk and retries; once the job's log says an upload failed,
the relay opens on the same port, the next attempt stores the trace and the capture completes.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from opml.traces.v1 import traces_pb2

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import Unavailable
from opml_devstack.devinfra import DevInfra, free_port
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.relay import TcpRelay
from opml_devstack.testing.services import TOKENS
from opml_trace_collector_contract.client import TraceCollectorClient

KERAS_CNN = Path(__file__).resolve().parents[2] / "services" / "trace-collector" / "tests" / "programs" / "keras_cnn.py"

pytestmark = pytest.mark.timeout(300)


def test_s3_stopped_mid_push_fails_it_retriable_and_the_retry_after_s3_is_back_succeeds(
        start_service, unique_prefix: str, tmp_path: Path) -> None:
    infra = DevInfra(workdir=tmp_path / "infra", kafka_storage="memory")
    endpoints = infra.start()
    try:
        env = start_service.env("bundle-store", extra_env={**endpoints.env(),
                                                           "OPML_BUNDLE_STORE_TRANSFER_WORKERS": "1"})
        service = start_service("bundle-store", env=env)
        remote = f"s3://{unique_prefix.rstrip('-')}/outage"
        files = {f"shard/{n:03d}.bin": random.Random(n).randbytes(64 * 1024) for n in range(120)}
        with BundleStoreClient(service.target, token=TOKENS["admin"]) as client:
            client.create_context("plant-a", remote)
            client.create_context("plant-b", remote)
            added = client.add("plant-a", "shards", files, commit=True)
            stream = client.push("plant-a", added.uuid)
            first = next(message for message in stream if message.files_done or message.done)
            assert not first.done
            infra.process("seaweedfs").stop()  # S3 goes away mid-push
            with pytest.raises(Unavailable) as caught:
                list(stream)
            assert caught.value.retriable
            assert client.get_bundle("plant-a", added.uuid).remote_url == ""  # up, and not recorded as pushed

            infra.process("seaweedfs").start()  # back on its port and data; the service was not restarted
            assert list(client.pull("plant-b", "shards"))[-1].bundles == []  # no manifest reached the remote
            done = list(client.push("plant-a", added.uuid))[-1]
            assert done.done and [b.uuid for b in done.bundles] == [added.uuid]
            assert list(client.pull("plant-b", "shards", localize=True))[-1].bundles[0].uuid == added.uuid
            written = client.download("plant-b", added.uuid, tmp_path / "out")
            assert {p.relative_to(tmp_path / "out").as_posix(): p.read_bytes() for p in written} == files
    finally:
        infra.stop()


def test_s3_unreachable_during_a_capture_upload_is_retried_and_the_capture_completes(
        start_service, unique_prefix: str, tmp_path: Path) -> None:
    bucket, job_name = unique_prefix.rstrip("-"), f"{unique_prefix}outage-capture"
    env = start_service.env("trace-collector", extra_env={"OPML_TRACE_COLLECTOR_BUCKET": bucket})
    collector = start_service("trace-collector", env=env)
    s3 = urlsplit(env["OPML_S3_ENDPOINT"])
    go, log_path, relay_port = tmp_path / "go", tmp_path / "job.log", free_port()
    job_env = {**os.environ, **env, "OPML_S3_ENDPOINT": f"http://127.0.0.1:{relay_port}", "OPML_TRACE_BUCKET": bucket,
               "OPML_TRACE_SPOOL_DIR": str(tmp_path / "spool"), "OPML_TRACE_SESSION_DIR": str(tmp_path / "sessions"),
               "OPML_TRACE_FLUSH_INTERVAL_S": "0.5", "OPML_TRACE_POLL_S": "0.2", "TF_CPP_MIN_LOG_LEVEL": "2",
               "OPML_TRACE_SHIPPER_IDLE_EXIT_S": "5"}  # the shipper `opml trace run` starts ends soon after
    with TcpRelay((s3.hostname, s3.port)) as relay, \
            TraceCollectorClient(collector.target, token=TOKENS["admin"]) as admin, open(log_path, "w") as log:
        job = subprocess.Popen([str(Path(sys.executable).parent / "opml"), "trace", "run", "--job", job_name, "--",
                                sys.executable, str(KERAS_CNN), "--steps", "4", "--wait-file", str(go)],
                               env=job_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        try:
            poll_until(lambda: job_name in {j.job for j in admin.list_jobs()} and any(
                r.state == traces_pb2.RUN_STATE_RUNNING and r.steps > 0 for r in admin.list_runs(job_name)),
                timeout_s=180, every_s=0.2, what="the traced job's first steps")
            capture = admin.capture(job_name, 3)
            refused = f"uploading capture {capture.capture_id} failed (attempt 1"
            poll_until(lambda: refused in log_path.read_text(), timeout_s=120, every_s=0.2,
                       what="the job's first refused upload")
            assert admin.get_capture(capture.capture_id).state == traces_pb2.CAPTURE_STATE_PENDING

            relay.listen(port=relay_port)  # S3 reachable again at the endpoint the job was given
            done = poll_until(lambda: (c := admin.get_capture(capture.capture_id)).state
                              != traces_pb2.CAPTURE_STATE_PENDING and c, timeout_s=120, every_s=0.2,
                              what="the capture to end")
            assert done.state == traces_pb2.CAPTURE_STATE_COMPLETED, (done, log_path.read_text()[-3000:])
            trace = json.loads(gzip.decompress(b"".join(admin.fetch_trace(capture.capture_id))))
            assert trace["metadata"]["capture_id"] == capture.capture_id and trace["metadata"]["steps"] == 3
            go.touch()
            assert job.wait(120) == 0, log_path.read_text()[-3000:]
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
