"""The bundle-store's asyncio client (grpc.aio), for a service that calls it from its event loop.

The calls of :class:`~opml_bundle_store_contract.client.BundleStoreClient` that services make, with
the same requests, errors and checks (a download checks every path before it writes, and writes
through no symlink). Files are read, hashed and written in threads, so a large one never stalls the
loop; the gRPC calls stay on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from opml.bundles.v1 import bundles_pb2 as pb
from opml.bundles.v1 import bundles_pb2_grpc

from opml_bundle_store_contract.client import (
    CHUNK_BYTES,
    FileSource,
    add_header,
    download_targets,
    open_inside,
)
from opml_bundle_store_contract.values import Value
from opml_common.errors import OpmlError
from opml_common.grpc.client import AsyncServiceClient, async_pages


class AsyncBundleStoreClient(AsyncServiceClient):
    """``async with AsyncBundleStoreClient(target, token=...) as client:``; each method as the blocking
    client's of the same name."""

    stub_class = bundles_pb2_grpc.BundleStoreStub

    async def create_context(self, context_id: str, remote_url: str = "") -> pb.Context:
        return await self.stub.CreateContext(pb.CreateContextRequest(context_id=context_id, remote_url=remote_url))

    async def get_context(self, context_id: str) -> pb.Context:
        return await self.stub.GetContext(pb.GetContextRequest(name=f"contexts/{context_id}"))

    async def add(self, context_id: str, bundle_name: str, files: Mapping[str, FileSource], *,
                  values: Mapping[str, Value] | None = None, tags: Mapping[str, str] | None = None,
                  lineage: pb.Lineage | None = None, commit: bool = False,
                  media_types: Mapping[str, str] | None = None, idempotency_key: str = "") -> pb.Bundle:
        """Raises what the blocking client's ``add`` raises; OpmlError naming the file when one cannot be
        read while it is sent."""
        header = await asyncio.to_thread(add_header, context_id, bundle_name, files, values=values, tags=tags,
                                         lineage=lineage, commit=commit, media_types=media_types,
                                         idempotency_key=idempotency_key)
        unread: list[OpmlError] = []

        async def requests() -> AsyncIterator[pb.AddBundleRequest]:
            yield pb.AddBundleRequest(header=header)
            for index, (path, source) in enumerate(files.items()):
                try:
                    async for chunk in _chunks(source):
                        yield pb.AddBundleRequest(chunk=pb.FileChunk(file_index=index, data=chunk))
                except OSError as exc:  # grpc.aio only cancels the call: what the caller sees is said here
                    unread.append(OpmlError(f"could not read {path!r} of bundle {bundle_name!r} while "
                                            f"sending it: {exc}"))
                    raise

        try:
            return await self.stub.AddBundle(requests())
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if unread and (task is None or not task.cancelling()):
                raise unread[0] from None
            raise

    async def list_bundles(self, context_id: str, *, bundle_name: str = "", tags: Mapping[str, str] | None = None,
                           committed_only: bool = False, latest_only: bool = False) -> list[pb.Bundle]:
        def page(token: str):
            return self.stub.ListBundles(pb.ListBundlesRequest(
                parent=f"contexts/{context_id}", bundle_name=bundle_name, tags=dict(tags or {}),
                committed_only=committed_only, latest_only=latest_only, page_token=token))

        return [bundle async for bundle in async_pages(page, lambda reply: reply.bundles)]

    async def get_bundle(self, context_id: str, ref: str) -> pb.Bundle:
        return await self.stub.GetBundle(pb.GetBundleRequest(name=f"contexts/{context_id}/bundles/{ref}"))

    async def read_file(self, context_id: str, ref: str, path: str) -> AsyncIterator[bytes]:
        async for chunk in self.stub.ReadBundleFile(
                pb.ReadBundleFileRequest(name=f"contexts/{context_id}/bundles/{ref}", path=path)):
            yield chunk.data

    async def download(self, context_id: str, ref: str, destination: Path) -> list[Path]:
        """The blocking client's ``download``: every path the store names is checked before anything is
        written (DataLoss, nothing written, when one would land outside ``destination``), and each file
        is opened level by level with ``O_NOFOLLOW``."""
        destination = Path(destination)
        bundle = await self.get_bundle(context_id, ref)
        targets = await asyncio.to_thread(download_targets, bundle, destination, self.target)
        await asyncio.to_thread(destination.mkdir, parents=True, exist_ok=True)
        root = await asyncio.to_thread(destination.resolve)
        for path in targets:
            handle = await asyncio.to_thread(open_inside, root, path)
            try:
                async for data in self.read_file(context_id, ref, path):
                    await asyncio.to_thread(handle.write, data)
            finally:
                await asyncio.to_thread(handle.close)
        return list(targets.values())


async def _chunks(source: FileSource) -> AsyncIterator[bytes]:
    if isinstance(source, bytes):
        for start in range(0, len(source), CHUNK_BYTES):
            yield source[start:start + CHUNK_BYTES]
        return
    handle = await asyncio.to_thread(open, source, "rb")
    try:
        while chunk := await asyncio.to_thread(handle.read, CHUNK_BYTES):
            yield chunk
    finally:
        handle.close()
