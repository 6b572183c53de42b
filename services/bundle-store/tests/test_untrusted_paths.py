"""Paths a client is handed by a store, and the local disk they must not escape (issue 16, item 4).

The store here is hostile: a real grpc.aio server in the test that answers GetBundle and
ReadBundleFile with whatever paths the test chooses. What refuses is the real client code:
``BundleStoreClient.download`` (behind ``opml bundle get -o DIR``; the inference-router's bundle
fetcher, which uses it too, is tested in its own suite) and ``AsyncBundleStoreClient.download`` (the
job-orchestrator's pipelines), each test run with both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from opml_bundle_store_contract.aioclient import AsyncBundleStoreClient
from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.testing import PAYLOAD, HostileStore, files_under, serving
from opml_common.errors import DataLoss


@pytest.fixture
def destination(tmp_path: Path) -> Path:
    """Three levels down, so ``../../../x`` would land at ``tmp_path/x``."""
    path = tmp_path / "deep" / "er" / "out"
    path.mkdir(parents=True)
    return path


Download = Callable[[str, Path], list[Path]]


@pytest.fixture(params=["blocking", "asyncio"])
def download(request: pytest.FixtureRequest) -> Download:
    """``download(target, destination)``: bundle ``model`` of context ``lab`` by one client or the other."""
    def blocking(target: str, destination: Path) -> list[Path]:
        with BundleStoreClient(target) as client:
            return client.download("lab", "model", destination)

    async def on_a_loop(target: str, destination: Path) -> list[Path]:
        async with AsyncBundleStoreClient(target) as client:
            return await client.download("lab", "model", destination)

    return blocking if request.param == "blocking" else lambda *args: asyncio.run(on_a_loop(*args))


def escaping_paths(tmp_path: Path) -> list[str]:
    # The absolute path is under tmp_path, so even a broken client would write nowhere else.
    return ["../../../x", str(tmp_path / "abs" / "x"), "ok/../../../../x", "..\\..\\..\\x", "ok/\n/../x"]


@pytest.mark.parametrize("index", range(5))
def test_download_refuses_a_path_that_leaves_the_destination(tmp_path: Path, destination: Path, index: int,
                                                             download: Download) -> None:
    evil = escaping_paths(tmp_path)[index]
    store = HostileStore(["good.bin", evil])
    with serving(store) as target, pytest.raises(DataLoss) as caught:
        download(target, destination)
    assert repr(evil) in caught.value.message and "files[1].path" in caught.value.message
    assert files_under(tmp_path) == set()  # nothing at all: the paths are checked before any write
    assert store.reads == []


def test_download_refuses_symlinks_out_of_the_destination(tmp_path: Path, destination: Path,
                                                          download: Download) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"keep")
    (destination / "link").symlink_to(outside, target_is_directory=True)
    (destination / "f").symlink_to(victim)
    for path in ("link/x", "f"):
        store = HostileStore([path])
        with serving(store) as target, pytest.raises(DataLoss, match=f"{path!r} resolves outside"):
            download(target, destination)
    assert files_under(outside) == {"victim"} and victim.read_bytes() == b"keep"


def test_download_refuses_a_symlink_planted_after_the_check(tmp_path: Path, destination: Path,
                                                            download: Download) -> None:
    """The store plants ``sub -> outside`` while the client reads the first file, then names ``sub/x``."""
    outside = tmp_path / "outside"
    outside.mkdir()

    def plant(path: str) -> None:
        if path == "a":
            (destination / "sub").symlink_to(outside, target_is_directory=True)

    store = HostileStore(["a", "sub/x"], on_read=plant)
    with serving(store) as target, pytest.raises(DataLoss, match="'sub/x'.*'sub' is not a directory"):
        download(target, destination)
    assert store.reads == ["a"] and files_under(outside) == set()


def test_download_writes_a_well_formed_bundle(destination: Path, download: Download) -> None:
    with serving(HostileStore(["a", "dir/b", "dir/sub/c"])) as target:
        written = download(target, destination)
    assert sorted(p.relative_to(destination).as_posix() for p in written) == ["a", "dir/b", "dir/sub/c"]
    assert files_under(destination) == {"a", "dir/b", "dir/sub/c"}
    assert all(p.read_bytes() == PAYLOAD for p in written)


def test_opml_bundle_get_refuses_and_names_the_path(tmp_path: Path, destination: Path, opml_cli,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPML_CLI_HOME", str(tmp_path / "cli"))
    for evil in ("../../../x", str(tmp_path / "abs" / "x")):
        with serving(HostileStore([evil])) as target:
            monkeypatch.setenv("OPML_BUNDLE_STORE_TARGET", target)
            out = opml_cli("bundle", "-c", "lab", "get", "model", "-o", str(destination), expect_exit=1)
        assert "DATA_LOSS" in out and "refusing to write" in out and evil in out
    assert files_under(tmp_path) == set()
