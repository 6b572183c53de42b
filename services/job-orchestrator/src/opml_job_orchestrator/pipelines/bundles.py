"""What the engine asks of the bundle-store: spans to read, outputs to write, each idempotently.

:class:`BundleIO` is the port (a test's fake implements it); :class:`BundleStoreIO` calls the
bundle-store's gRPC API through its contract's asyncio client, on the service's event loop (a
blocking client on worker threads beside the service's grpc.aio server is a mix gRPC has crashed on).
Step jobs never get bundle-store credentials: the engine moves every bundle in and out, with the
service's own token.

An output is added with tags that name its pipeline, run, step and role (:func:`output_tags`), so
a runner that resumes after a crash between the add and its record finds it (:meth:`BundleIO.find`)
instead of adding it twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

from opml.bundles.v1 import bundles_pb2

from opml_bundle_store_contract.aioclient import AsyncBundleStoreClient
from opml_common.errors import AlreadyExists, NotFound

CREATOR = "job-orchestrator/pipelines"


def output_tags(pipeline: str, run: int, step: str, role: str) -> dict[str, str]:
    return {"pipeline": pipeline, "pipeline-run": str(run), "pipeline-step": step, "pipeline-output": role}


class BundleIO(ABC):
    """Every method raises the bundle-store's domain errors (``NotFound``, ``Unavailable``...)."""

    @abstractmethod
    async def list_committed(self, context: str, bundle_name: str = "") -> list[bundles_pb2.Bundle]:
        """Committed bundles of ``context`` (of ``bundle_name`` if set); an unknown context has none."""

    @abstractmethod
    async def get(self, context: str, uuid: str) -> bundles_pb2.Bundle:
        """Raises: NotFound."""

    @abstractmethod
    async def download(self, context: str, uuid: str, destination: Path) -> None:
        """Write the bundle's files under ``destination``, keeping its layout."""

    @abstractmethod
    async def find(self, context: str, tags: Mapping[str, str]) -> bundles_pb2.Bundle | None:
        """The newest bundle of ``context`` carrying ``tags``, or None."""

    @abstractmethod
    async def add(self, context: str, bundle_name: str, files: Mapping[str, Path | bytes], *,
                  values: Mapping[str, str | float] | None = None, tags: Mapping[str, str],
                  lineage: bundles_pb2.Lineage, commit: bool = True) -> bundles_pb2.Bundle:
        """Add (and commit, in the same call: a bundle is never seen half-written) a bundle; the
        context is made when missing."""


class BundleStoreIO(BundleIO):
    """Made on the service's event loop; :meth:`aclose` at shutdown, once the engine has stopped."""

    def __init__(self, target: str, *, token: str | None = None) -> None:
        self._client = AsyncBundleStoreClient(target, token=token)
        self._contexts: set[str] = set()

    async def aclose(self) -> None:
        await self._client.close()

    async def list_committed(self, context: str, bundle_name: str = "") -> list[bundles_pb2.Bundle]:
        try:
            return await self._client.list_bundles(context, bundle_name=bundle_name, committed_only=True)
        except NotFound:
            return []

    async def get(self, context: str, uuid: str) -> bundles_pb2.Bundle:
        return await self._client.get_bundle(context, uuid)

    async def download(self, context: str, uuid: str, destination: Path) -> None:
        await self._client.download(context, uuid, destination)

    async def find(self, context: str, tags: Mapping[str, str]) -> bundles_pb2.Bundle | None:
        try:
            found = await self._client.list_bundles(context, tags=dict(tags))
        except NotFound:
            return None
        return max(found, key=lambda b: b.create_time.ToNanoseconds()) if found else None

    async def add(self, context: str, bundle_name: str, files: Mapping[str, Path | bytes], *,
                  values: Mapping[str, str | float] | None = None, tags: Mapping[str, str],
                  lineage: bundles_pb2.Lineage, commit: bool = True) -> bundles_pb2.Bundle:
        await self._ensure_context(context)
        return await self._client.add(context, bundle_name, dict(files), values=values, tags=dict(tags),
                                      lineage=lineage, commit=commit)

    async def _ensure_context(self, context: str) -> None:
        if context in self._contexts:
            return
        try:
            await self._client.get_context(context)
        except NotFound:
            try:
                await self._client.create_context(context)
            except AlreadyExists:
                pass
        self._contexts.add(context)
