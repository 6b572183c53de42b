"""A hostile bundle-store for tests of the clients that trust one (this contract's own, the router's fetcher).

``HostileStore`` answers GetBundle with whatever paths a test chooses and ReadBundleFile with a fixed
payload; ``serving`` runs it on a real grpc.aio server. What must refuse is the real client code.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from opml.bundles.v1 import bundles_pb2 as pb
from opml.bundles.v1 import bundles_pb2_grpc

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
    """Every file and link below ``root``, relative: what a client wrote."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}
