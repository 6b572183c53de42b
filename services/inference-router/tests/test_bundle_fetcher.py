"""The router's bundle fetcher against the real bundle-store, on the test's event loop as on the router's:
a bundle lands whole under ``<home>/bundles/<uuid>``, once, with the router's token; a fetch the router's
stop cuts short leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from pathlib import Path

import pytest

from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.testing import BUNDLE_UUID, HostileStore, files_under, serving
from opml_common.errors import NotFound, OpmlError, Unauthenticated
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.control.bundles import BundleFetcher
from opml_inference_router.control.state import Source


@pytest.fixture
def bundle_store(start_service: ServiceStarter) -> ServiceProcess:
    return start_service("bundle-store")


async def test_a_bundle_is_fetched_whole_once_and_by_the_same_uuid_again(bundle_store: ServiceProcess,
                                                                         tmp_path: Path) -> None:
    context = f"fetch-{uuid.uuid4().hex[:8]}"
    weights = os.urandom(3 * 1024 * 1024 + 5)  # several chunks
    with BundleStoreClient(bundle_store.target, token=TOKENS["writer"]) as store:
        store.create_context(context)
        added = store.add(context, "model", {"model.onnx": weights, "conf/config.yaml": b"name: m\n"}, commit=True)
    home = tmp_path / "home"
    fetcher = BundleFetcher(bundle_store.target, home, token=TOKENS["reader"])
    try:
        # two deploys of the same bundle at once: one download wins the rename, both get its directory
        fetched = await asyncio.gather(fetcher.fetch(Source(context=context, bundle="model")),
                                       fetcher.fetch(Source(context=context, bundle=added.uuid)))
        directory = home / "bundles" / added.uuid
        assert fetched == [(directory, added.uuid)] * 2
        assert (directory / "model.onnx").read_bytes() == weights
        assert files_under(home) == {f"bundles/{added.uuid}/model.onnx", f"bundles/{added.uuid}/conf/config.yaml"}
        (directory / "conf" / "config.yaml").write_bytes(b"kept\n")
        assert await fetcher.fetch(Source(context=context, bundle="model")) == (directory, added.uuid)
        assert (directory / "conf" / "config.yaml").read_bytes() == b"kept\n"  # not downloaded again
        assert (await fetcher.get_bundle(context, "model")).uuid == added.uuid
        with pytest.raises(NotFound):
            await fetcher.fetch(Source(context=context, bundle="missing"))
    finally:
        await fetcher.close()
    anonymous = BundleFetcher(bundle_store.target, tmp_path / "anonymous")
    try:
        with pytest.raises(Unauthenticated):
            await anonymous.fetch(Source(context=context, bundle="model"))
    finally:
        await anonymous.close()
    assert not (tmp_path / "anonymous").exists()


async def test_a_fetch_in_flight_when_the_router_stops_fails_and_leaves_nothing(tmp_path: Path) -> None:
    """The router closes the fetcher at its stop: a download cut short raises OpmlError (what a failed
    deploy handles), and neither a bundle directory nor its half-written staging copy is left."""
    reading, release = threading.Event(), threading.Event()

    def stall(path: str) -> None:  # the store answers the file's read only once the fetcher is closed
        reading.set()
        release.wait(timeout=60)

    home = tmp_path / "home"
    with serving(HostileStore(["model.onnx"], on_read=stall)) as target:
        fetcher = BundleFetcher(target, home)
        fetch = asyncio.create_task(fetcher.fetch(Source(context="lab", bundle="model")))
        try:
            assert await asyncio.to_thread(reading.wait, 60)
            await fetcher.close()
            with pytest.raises(OpmlError, match="closed"):
                await fetch
        finally:
            release.set()
    assert files_under(tmp_path) == set()
    assert not (home / "bundles" / BUNDLE_UUID).exists()


def test_a_download_a_killed_router_left_half_written_is_removed_at_start(tmp_path: Path) -> None:
    """A router killed mid-download leaves its staging directory (no finally runs after SIGKILL); the
    next start removes it and keeps the whole bundles."""
    bundles = tmp_path / "home" / "bundles"
    (bundles / ".partial-0f3a" / "conf").mkdir(parents=True)
    (bundles / ".partial-0f3a" / "conf" / "config.yaml").write_bytes(b"half")
    (bundles / BUNDLE_UUID).mkdir()
    (bundles / BUNDLE_UUID / "model.onnx").write_bytes(b"whole")
    BundleFetcher("127.0.0.1:1", tmp_path / "home").remove_leftovers()
    assert files_under(tmp_path / "home") == {f"bundles/{BUNDLE_UUID}/model.onnx"}
    BundleFetcher("127.0.0.1:1", tmp_path / "elsewhere").remove_leftovers()  # a first start: no bundles yet
