"""Durable federation state, written once per completed round, so a coordinator killed at any
moment restarts from its last completed round.

Each completed round's arrays (global model and server-optimizer state) go to S3 as one ``.npz``
object, then, in one Redis transaction, the rounds completed since the last save are appended to the
federation's history list and the round's document (config, profiles, selection state, the history's
length and the object's key) replaces the federation's entry in a Redis hash: Redis never points at
arrays that are not there, and a save writes what the round changed, not the whole history again.
Client credentials are kept as SHA-256 digests in another hash, never in clear.
"""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import numpy as np
from minio import Minio

from opml_common.lifecycle import Component
from opml_fl_coordinator_contract.weights import Weights


def _pack(arrays: dict[str, Weights]) -> bytes:
    flat = {f"{name}/{i}": np.asarray(a) for name, weights in arrays.items() for i, a in enumerate(weights)}
    buffer = io.BytesIO()
    np.savez(buffer, **flat)
    return buffer.getvalue()


def _unpack(data: bytes) -> dict[str, Weights]:
    grouped: dict[str, dict[int, np.ndarray]] = {}
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        for key in archive.files:
            name, _, index = key.rpartition("/")
            grouped.setdefault(name, {})[int(index)] = archive[key]
    return {name: [parts[i] for i in sorted(parts)] for name, parts in grouped.items()}


class FederationStore(Component):
    """Redis (documents, credentials) + S3 (arrays), under the platform's prefixes.

    ``start()`` creates the bucket if it is missing; ``stop()`` does nothing (the clients are the service's).
    """

    def __init__(self, redis: Any, s3: Minio, *, bucket: str, prefix: str) -> None:
        super().__init__()
        self._redis, self._s3, self._bucket = redis, s3, bucket
        self._federations = f"{prefix}fl:federations"
        self._history = f"{prefix}fl:history:"  # + federation id: one JSON round record per entry
        self._credentials = f"{prefix}fl:credentials"
        self._object_prefix = f"{prefix}federations"

    async def on_start(self) -> None:
        """Creates the bucket if it is missing."""
        def ensure() -> None:
            if not self._s3.bucket_exists(self._bucket):
                self._s3.make_bucket(self._bucket)
        await asyncio.to_thread(ensure)

    async def save(self, document: dict[str, Any], arrays: dict[str, Weights]) -> None:
        """Arrays to S3 first, then the new history records and the document (pointing at the arrays)
        to Redis in one transaction. ``document["history"]`` is the whole history; only the records
        past what is stored are written."""
        federation_id = document["federation_id"]
        key = f"{self._object_prefix}/{federation_id}/rounds/{int(document['version']):06d}.npz"
        data = _pack(arrays)
        await asyncio.to_thread(self._s3.put_object, self._bucket, key, io.BytesIO(data), len(data),
                                content_type="application/octet-stream")
        history = document["history"]
        rest = {name: value for name, value in document.items() if name != "history"}
        stored = await self._redis.llen(self._history + federation_id)
        async with self._redis.pipeline(transaction=True) as transaction:
            if len(history) > stored:
                transaction.rpush(self._history + federation_id, *(json.dumps(row) for row in history[stored:]))
            transaction.hset(self._federations, federation_id,
                             json.dumps({**rest, "history_length": len(history), "arrays_key": key}))
            await transaction.execute()

    async def load_all(self) -> list[tuple[dict[str, Any], dict[str, Weights]]]:
        """Every saved federation's last document and arrays, in creation order."""
        entries = await self._redis.hgetall(self._federations)
        loaded = []
        for federation_id, raw in entries.items():
            document = json.loads(raw)
            name = federation_id.decode() if isinstance(federation_id, bytes) else federation_id
            length = document.pop("history_length")
            rows = await self._redis.lrange(self._history + name, 0, length - 1) if length else []
            document["history"] = [json.loads(row) for row in rows]
            response = await asyncio.to_thread(self._s3.get_object, self._bucket, document["arrays_key"])
            try:
                data = response.read()
            finally:
                response.close()
                response.release_conn()
            loaded.append((document, _unpack(data)))
        return sorted(loaded, key=lambda item: item[0]["created_at"])

    async def save_credential(self, digest: str, federation_id: str, client_id: str) -> None:
        await self._redis.hset(self._credentials, digest, json.dumps([federation_id, client_id]))

    async def drop_credentials(self, federation_id: str, client_id: str, keep: str) -> None:
        """Remove the client's earlier credentials (registering again replaces the token)."""
        for digest, raw in (await self._redis.hgetall(self._credentials)).items():
            name = digest.decode() if isinstance(digest, bytes) else digest
            if name != keep and json.loads(raw) == [federation_id, client_id]:
                await self._redis.hdel(self._credentials, name)

    async def credentials(self) -> dict[str, tuple[str, str]]:
        rows = await self._redis.hgetall(self._credentials)
        return {(k.decode() if isinstance(k, bytes) else k): tuple(json.loads(v)) for k, v in rows.items()}
