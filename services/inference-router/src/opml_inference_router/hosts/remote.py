"""The router's side of a worker on another host: the agent's API (bundles, link probes) and the
worker's admin client, which sends a version's bundle to the host before the worker loads it.

A :class:`HostedWorker` stands where :class:`~opml_inference_router.control.pools.PoolWorker` stands
for a local process, so the deployments place, load, route and re-place on a host's workers as on
the router's own (:meth:`~opml_inference_router.control.pools.PoolManager.get`).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import tarfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from opml.inference.v1 import hosts_pb2 as pb
from opml.inference.v1 import hosts_pb2_grpc

from opml_common.grpc.client import domain_error, open_aio_channel
from opml_inference_router.control.workers import WorkerClient
from opml_inference_router.placement import Profile, SessionChoice, Worker

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
PUT_TIMEOUT_S = 600.0
PROBE_TIMEOUT_S = 10.0


def bundle_tar(directory: Path) -> bytes:
    """The bundle's folder as an uncompressed tar (ONNX weights barely compress): what crosses the link."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(directory.rglob("*")):
            if path.is_file() and not path.is_symlink():
                tar.add(path, arcname=str(path.relative_to(directory)), recursive=False)
    return buffer.getvalue()


@dataclass(frozen=True)
class Transfer:
    """One bundle sent to a host: what a deploy at a far site pays before the worker loads."""

    bytes: int
    seconds: float


class AgentClient:
    """Calls to one host's agent (``PutBundle``, ``Probe``) with the router's worker token."""

    def __init__(self, address: str, *, token: str) -> None:
        self.address = address
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._channel = open_aio_channel(address)  # TLS as OPML_GRPC_TLS_* says
        self._stub = hosts_pb2_grpc.HostAgentStub(self._channel)

    async def put_bundle(self, model: str, version: int, directory: Path) -> tuple[str, Transfer]:
        """Sends the bundle; returns its path on the host and what the transfer took.

        Raises: Unavailable (the host cannot be reached), or the agent's own refusal."""
        data = await asyncio.to_thread(bundle_tar, directory)

        async def chunks() -> AsyncIterator[pb.BundleChunk]:
            for offset in range(0, max(len(data), 1), CHUNK_BYTES):
                piece = data[offset:offset + CHUNK_BYTES]
                yield (pb.BundleChunk(model=model, version=version, size=len(data), data=piece) if offset == 0
                       else pb.BundleChunk(data=piece))

        began = time.monotonic()
        reply = await self._call(self._stub.PutBundle(chunks(), timeout=PUT_TIMEOUT_S, metadata=self._metadata))
        return reply.path, Transfer(len(data), time.monotonic() - began)

    async def probe(self, pad_bytes: int = 0) -> float:
        """Seconds one probe round trip took. Raises: Unavailable."""
        began = time.monotonic()
        await self._call(self._stub.Probe(pb.ProbeRequest(pad=os.urandom(pad_bytes)), timeout=PROBE_TIMEOUT_S,
                                          metadata=self._metadata))
        return time.monotonic() - began

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, call):
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise domain_error(error) from None


class HostedWorkerClient:
    """The admin client of a worker on a host: :class:`WorkerClient`'s calls, with each version's
    bundle sent to the host first (once per host and version; again after the host restarts)."""

    def __init__(self, worker: WorkerClient, agent: AgentClient, on_transfer=None) -> None:
        self.address = worker.address
        self._worker = worker
        self._agent = agent
        self._on_transfer = on_transfer
        self._sent: dict[tuple[str, int], str] = {}
        self._lock = asyncio.Lock()

    async def load(self, model: str, *, path: Path, version: int, precision: str | None = None,
                   profile: bool = False, instances: int | None = None, max_batch: int | None = None,
                   session: SessionChoice | None = None) -> None:
        """:meth:`WorkerClient.load` of the bundle at ``path`` on the router's disk, sent to the host."""
        remote = await self._bundle(model, version, path)
        await self._worker.load(model, path=Path(remote), version=version, precision=precision, profile=profile,
                                instances=instances, max_batch=max_batch, session=session)

    async def unload(self, model: str, version: int) -> None:
        await self._worker.unload(model, version)

    async def profile(self, model: str, version: int) -> Profile:
        return await self._worker.profile(model, version)

    async def loaded(self) -> set[tuple[str, int]]:
        return await self._worker.loaded()

    async def close(self) -> None:
        await self._worker.close()

    async def _bundle(self, model: str, version: int, path: Path) -> str:
        async with self._lock:  # two loads of one version on one host send it once
            remote = self._sent.get((model, version))
            if remote is None:
                remote, transfer = await self._agent.put_bundle(model, version, path)
                self._sent[model, version] = remote
                log.info("models/%s/versions/%d: %d bytes sent to the host of %s in %.2f s", model, version,
                         transfer.bytes, self.address, transfer.seconds)
                if self._on_transfer is not None:
                    self._on_transfer(transfer)
            return remote


@dataclass
class HostedWorker:
    """A fleet worker served by a host's agent: what the deployments need of a pool worker."""

    worker: Worker
    host: str = ""
    address: str = ""  # the worker's gRPC host:port while its host serves it
    alive: bool = False
    restarts: int = 0
    client: HostedWorkerClient | None = field(default=None, repr=False)
    process: None = None  # no local process: its metrics are its host's to expose
