"""The bundle-store service SIGKILLed during a push (issue 12, item 6), on the real S3.

The service is killed as the first progress message that counts a blob on the remote arrives (blobs
are moving; the manifest goes last). The client's stream fails UNAVAILABLE (retriable), nothing of
the bundle is visible on the remote, the service restarted over the same home and the retried push
succeed, and another context pulls the whole bundle, every blob verified.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import Unavailable
from opml_devstack.testing.services import TOKENS


@pytest.mark.timeout(300)
def test_a_push_killed_mid_way_fails_retriable_leaves_nothing_half_visible_and_succeeds_when_retried(
        start_service, remote_url: str, tmp_path: Path) -> None:
    env = start_service.env("bundle-store")
    env["OPML_BUNDLE_STORE_TRANSFER_WORKERS"] = "1"  # one blob at a time: the push is still moving when killed
    service = start_service("bundle-store", env=env)
    rng = random.Random(5)
    files = {f"shard/{index:03d}.bin": rng.randbytes(64 * 1024) for index in range(120)}
    with BundleStoreClient(service.target, token=TOKENS["admin"]) as client:
        client.create_context("plant-a", remote_url)
        client.create_context("plant-b", remote_url)
        added = client.add("plant-a", "shards", files, commit=True)
        stream = client.push("plant-a", added.uuid)
        first = next(message for message in stream if message.files_done or message.done)
        assert not first.done and 0 < first.files_done < first.files_total == len(files)
        service.kill()  # SIGKILL, as its first progress message arrives
        with pytest.raises(Unavailable) as caught:
            list(stream)
        assert caught.value.retriable

    service = start_service("bundle-store", env=env)  # the same home and ports
    with BundleStoreClient(service.target, token=TOKENS["admin"]) as client:
        assert list(client.pull("plant-b", "shards"))[-1].bundles == []  # no manifest reached the remote
        assert client.get_bundle("plant-a", added.uuid).remote_url == ""  # not recorded as pushed
        done = list(client.push("plant-a", added.uuid))[-1]  # the retry
        assert done.done and [b.uuid for b in done.bundles] == [added.uuid]
        pulled = list(client.pull("plant-b", "shards", localize=True))[-1]  # every blob verified
        assert [b.uuid for b in pulled.bundles] == [added.uuid]
        written = client.download("plant-b", added.uuid, tmp_path / "out")
        assert {p.relative_to(tmp_path / "out").as_posix(): p.read_bytes() for p in written} == files
    assert not os.listdir(Path(env["OPML_BUNDLE_STORE_HOME"]) / "announcing")
