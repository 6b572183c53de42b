"""S3 stopped in the middle of a push (issue 12, item 8): the push fails retriable, nothing half visible.

A private SeaweedFS (and a broker on tansu's memory engine, so only S3 goes down) serves a
bundle-store. S3 is stopped as the first progress message that counts a blob on the remote arrives:
the push fails UNAVAILABLE (retriable) and the service stays up (it answers reads of its local store).
S3 started again on the same port and data directory, nothing restarted: the remote holds no
manifest of the bundle, the retried push succeeds, and another context pulls every blob, verified.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from opml_bundle_store.client import BundleStoreClient
from opml_common.devinfra import DevInfra
from opml_common.errors import Unavailable
from opml_common.testing.services import TOKENS

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
