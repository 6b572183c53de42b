"""The contract's asyncio client against a real bundle-store process: where grpc.aio differs from the
blocking client, the caller still sees the domain errors it would see from the blocking one."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from opml.bundles.v1 import bundles_pb2 as pb

from opml_bundle_store_contract import aioclient
from opml_bundle_store_contract.aioclient import AsyncBundleStoreClient
from opml_common.errors import OpmlError
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS


async def test_a_file_that_vanishes_while_it_is_sent_fails_the_add_and_adds_nothing(
        bundle_store: ServiceProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """grpc.aio only cancels a call whose requests fail: the add raises OpmlError naming the file (the
    blocking client's failed call raises OpmlError too), not a cancellation of the caller's task."""
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 1000)
    hashed = aioclient.add_header

    def hashed_then_gone(*args, **kwargs) -> pb.AddBundleHeader:
        header = hashed(*args, **kwargs)
        weights.unlink()  # after it was hashed, before it is sent
        return header

    monkeypatch.setattr(aioclient, "add_header", hashed_then_gone)
    context = f"async-{uuid.uuid4().hex[:8]}"
    async with AsyncBundleStoreClient(bundle_store.target, token=TOKENS["writer"]) as client:
        await client.create_context(context)
        with pytest.raises(OpmlError, match="could not read 'weights.bin' of bundle 'model' while sending it"):
            await client.add(context, "model", {"config.yaml": b"a: 1\n", "weights.bin": weights}, commit=True)
        assert await client.list_bundles(context) == []
