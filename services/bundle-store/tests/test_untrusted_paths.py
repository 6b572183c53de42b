"""Paths a client is handed by a store, and the local disk they must not escape (issue 16, item 4).

The store here is hostile: a real grpc.aio server in the test that answers GetBundle and
ReadBundleFile with whatever paths the test chooses. What refuses is the real client code:
``BundleStoreClient.download`` (behind ``opml bundle get -o DIR`` and the inference-router's
bundle fetcher).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from opml.bundles.v1 import bundles_pb2 as pb
from opml.bundles.v1 import bundles_pb2_grpc

from opml_bundle_store.client import BundleStoreClient
from opml_common.errors import DataLoss

BUNDLE_UUID = str(uuid.uuid4())
PAYLOAD = b"written by the store"


class HostileStore(bundles_pb2_grpc.BundleStoreServicer):
    """Answers GetBundle with ``paths`` and ReadBundleFile with PAYLOAD; ``on_read(path)`` runs first."""

    def __init__(self, paths: list[str], on_read: Callable[[str], None] | None = None) -> None:
        self.paths = paths
        self.on_read = on_read
        self.reads: list[str] = []

    async def GetBundle(self, request: pb.GetBundleRequest, context) -> pb.Bundle:
        return pb.Bundle(name=f"contexts/lab/bundles/{BUNDLE_UUID}", context="lab", bundle_name="model",
                         uuid=BUNDLE_UUID, committed=True, localized=True,
                         files=[pb.BundleFile(path=path, size_bytes=len(PAYLOAD)) for path in self.paths])

    async def ReadBundleFile(self, request: pb.ReadBundleFileRequest, context):
        self.reads.append(request.path)
        if self.on_read is not None:
            self.on_read(request.path)
        yield pb.FileChunk(data=PAYLOAD)


@contextmanager
def serving(servicer: HostileStore) -> Iterator[str]:
    """``servicer`` on a real grpc.aio server (its own event loop, in a thread); yields its target."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        bundles_pb2_grpc.add_BundleStoreServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


@pytest.fixture
def destination(tmp_path: Path) -> Path:
    """Three levels down, so ``../../../x`` would land at ``tmp_path/x``."""
    path = tmp_path / "deep" / "er" / "out"
    path.mkdir(parents=True)
    return path


def escaping_paths(tmp_path: Path) -> list[str]:
    # The absolute path is under tmp_path, so even a broken client would write nowhere else.
    return ["../../../x", str(tmp_path / "abs" / "x"), "ok/../../../../x", "..\\..\\..\\x", "ok/\n/../x"]


@pytest.mark.parametrize("index", range(5))
def test_download_refuses_a_path_that_leaves_the_destination(tmp_path: Path, destination: Path, index: int) -> None:
    evil = escaping_paths(tmp_path)[index]
    store = HostileStore(["good.bin", evil])
    with serving(store) as target, BundleStoreClient(target) as client, pytest.raises(DataLoss) as caught:
        client.download("lab", "model", destination)
    assert repr(evil) in caught.value.message and "files[1].path" in caught.value.message
    assert files_under(tmp_path) == set()  # nothing at all: the paths are checked before any write
    assert store.reads == []


def test_download_refuses_symlinks_out_of_the_destination(tmp_path: Path, destination: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"keep")
    (destination / "link").symlink_to(outside, target_is_directory=True)
    (destination / "f").symlink_to(victim)
    for path in ("link/x", "f"):
        store = HostileStore([path])
        with serving(store) as target, BundleStoreClient(target) as client, \
                pytest.raises(DataLoss, match=f"{path!r} resolves outside"):
            client.download("lab", "model", destination)
    assert files_under(outside) == {"victim"} and victim.read_bytes() == b"keep"


def test_download_refuses_a_symlink_planted_after_the_check(tmp_path: Path, destination: Path) -> None:
    """The store plants ``sub -> outside`` while the client reads the first file, then names ``sub/x``."""
    outside = tmp_path / "outside"
    outside.mkdir()

    def plant(path: str) -> None:
        if path == "a":
            (destination / "sub").symlink_to(outside, target_is_directory=True)

    store = HostileStore(["a", "sub/x"], on_read=plant)
    with serving(store) as target, BundleStoreClient(target) as client, \
            pytest.raises(DataLoss, match="'sub/x'.*'sub' is not a directory"):
        client.download("lab", "model", destination)
    assert store.reads == ["a"] and files_under(outside) == set()


def test_download_writes_a_well_formed_bundle(destination: Path) -> None:
    with serving(HostileStore(["a", "dir/b", "dir/sub/c"])) as target, BundleStoreClient(target) as client:
        written = client.download("lab", "model", destination)
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


def test_inference_router_bundle_fetcher_refuses(tmp_path: Path) -> None:
    fetcher_module = pytest.importorskip("opml_inference_router.control.bundles")
    state = pytest.importorskip("opml_inference_router.control.state")
    home = tmp_path / "router" / "home"
    home.mkdir(parents=True)
    with serving(HostileStore(["../../../../x"])) as target:
        fetcher = fetcher_module.BundleFetcher(target, home)
        with pytest.raises(DataLoss, match=r"'\.\./\.\./\.\./\.\./x'"):
            asyncio.run(fetcher.fetch(state.Source(context="lab", bundle="model")))
    assert files_under(tmp_path) == set()

