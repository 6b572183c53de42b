"""Bringing a model bundle onto this machine: from the bundle-store (by context and name or UUID), or
a local model directory as it is (development).

A bundle is downloaded once per UUID into ``<home>/bundles/<uuid>`` (committed bundles are
immutable), through a temporary directory renamed at the end, so a half-written download is
never mistaken for a bundle. Workers on this machine load it from there by path. A router killed
mid-download leaves its temporary directory; the next start removes it (:meth:`BundleFetcher.remove_leftovers`).

The bundle-store is called through its contract's asyncio client, on the router's event loop: a
blocking client on worker threads beside the router's grpc.aio server is a mix gRPC has crashed on
(SIGSEGV in cygrpc). Files are still written, renamed and removed in threads.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from pathlib import Path

from opml.bundles.v1 import bundles_pb2

from opml_bundle_store_contract.aioclient import AsyncBundleStoreClient
from opml_common.errors import InvalidArgument, NotFound
from opml_inference_router.control.state import Source

log = logging.getLogger(__name__)

PARTIAL_PREFIX = ".partial-"  # a download's temporary directory, renamed to the bundle's UUID when whole


def local_directory(source: Source) -> Path:
    """The model directory a dev deploy names. Raises: NotFound when it is not a directory here."""
    directory = Path(source.model_dir).expanduser().resolve()
    if not directory.is_dir():
        raise NotFound(f"model_dir {source.model_dir} is not a directory on the router's machine")
    return directory


class BundleFetcher:
    """One channel to the bundle-store at ``target`` with the router's ``token``, opened on the event loop
    of the first call; :meth:`close` at the router's stop, once deploys and autodeploy have stopped."""

    def __init__(self, target: str, home: Path, *, token: str | None = None) -> None:
        self._target = target
        self._token = token
        self._dir = home / "bundles"
        self._client: AsyncBundleStoreClient | None = None

    async def fetch(self, source: Source, *, bundle_uuid: str = "") -> tuple[Path, str]:
        """The local directory of ``source`` and the bundle's UUID ("" for a model directory).

        ``bundle_uuid`` pins the version to fetch (a restart re-fetches exactly what was deployed).

        Raises:
            NotFound: the directory, context or bundle does not exist.
            InvalidArgument: the source names neither a bundle nor a directory.
            Unavailable: the bundle-store cannot be reached.
            DataLoss: the store named a file path that would land outside the bundle's directory.
        """
        if source.model_dir:
            return local_directory(source), ""
        if not source.context or not source.bundle:
            raise InvalidArgument("bundle", "must name a context and a bundle (name or UUID), or give a model_dir")
        return await self._download(source.context, bundle_uuid or source.bundle)

    def remove_leftovers(self) -> None:
        """Remove the temporary directories of downloads a killed router left (at start, before any fetch of
        this router's: a home is one router's)."""
        leftovers = sorted(self._dir.glob(f"{PARTIAL_PREFIX}*")) if self._dir.is_dir() else []
        for leftover in leftovers:
            shutil.rmtree(leftover, ignore_errors=True)
        if leftovers:
            log.info("removed %d half-written bundle download(s) an earlier run left: %s", len(leftovers),
                     [leftover.name for leftover in leftovers])

    async def get_bundle(self, context: str, ref: str) -> bundles_pb2.Bundle:
        """What the bundle-store says of bundle ``ref`` (a name or UUID) of ``context``: its tags,
        committed flag and files. Autodeploy reads it before acting on an event, never the event's copy.

        Raises:
            NotFound: the context or bundle does not exist.
            Unavailable: the bundle-store cannot be reached.
        """
        return await self._store().get_bundle(context, ref)

    async def close(self) -> None:
        """Close the channel; a fetch still in flight fails with OpmlError and leaves no bundle directory."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def _store(self) -> AsyncBundleStoreClient:
        if self._client is None:
            self._client = AsyncBundleStoreClient(self._target, token=self._token)
        return self._client

    async def _download(self, context: str, ref: str) -> tuple[Path, str]:
        client = self._store()
        bundle = await client.get_bundle(context, ref)
        target = self._dir / bundle.uuid
        if await asyncio.to_thread(target.is_dir):
            return target, bundle.uuid
        partial = self._dir / f"{PARTIAL_PREFIX}{uuid.uuid4().hex}"
        try:
            await client.download(context, bundle.uuid, partial)
            await asyncio.to_thread(partial.rename, target)
        except OSError:
            if not await asyncio.to_thread(target.is_dir):  # not a concurrent fetch of the same bundle that won
                raise
        finally:
            await asyncio.to_thread(shutil.rmtree, partial, ignore_errors=True)
        return target, bundle.uuid
