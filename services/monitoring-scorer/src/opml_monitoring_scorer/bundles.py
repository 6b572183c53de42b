"""Reading a reference bundle's two files from the bundle-store: ``reference.npz`` and ``monitoring.yaml``."""

from __future__ import annotations

import asyncio

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import InvalidArgument
from opml_monitoring_scorer.core.scorer import CONFIG_FILE, MAX_REFERENCE_BYTES, REFERENCE_FILE

WANTED = {REFERENCE_FILE: MAX_REFERENCE_BYTES, CONFIG_FILE: 256 * 1024}


class BundleReader:
    """``await reader(context, ref)`` -> (uuid, {file: bytes}) of the files the scorer reads (either
    may be absent). Each file's size is checked from the bundle's listing before it is read.

    Raises (from the call): NotFound (context or bundle), InvalidArgument (a file too large),
    Unavailable (the bundle-store cannot be reached)."""

    def __init__(self, target: str, *, token: str | None = None) -> None:
        self._target = target
        self._token = token

    def _read(self, context: str, ref: str) -> tuple[str, dict[str, bytes]]:
        with BundleStoreClient(self._target, token=self._token) as client:
            bundle = client.get_bundle(context, ref)
            files: dict[str, bytes] = {}
            for entry in bundle.files:
                limit = WANTED.get(entry.path)
                if limit is None:
                    continue
                if entry.size_bytes > limit:
                    raise InvalidArgument(f"reference.bundle.files[{entry.path}]",
                                          f"holds {entry.size_bytes} bytes, more than the {limit} allowed")
                files[entry.path] = b"".join(client.read_file(context, bundle.uuid, entry.path))
            return bundle.uuid, files

    async def __call__(self, context: str, ref: str) -> tuple[str, dict[str, bytes]]:
        return await asyncio.to_thread(self._read, context, ref)
