"""The federation store on the real Redis and S3: a coordinator restarted reads back every completed
round, and a save writes what the round changed, not the whole history again."""

from __future__ import annotations

import numpy as np

from opml_common.storage import redis_client, s3_client
from opml_fl_coordinator.store import FederationStore


def _document(rounds: int) -> dict:
    return {"federation_id": "f-1", "version": rounds, "created_at": 1.0, "config": "name: f",
            "history": [{"round": r, "accuracy": r / 10, "participants": [f"c{r}"]} for r in range(1, rounds + 1)]}


async def test_rounds_are_appended_once_and_read_back_whole(platform_settings, unique_prefix) -> None:
    redis = redis_client(platform_settings)
    store = FederationStore(redis, s3_client(platform_settings), bucket=f"{unique_prefix}fl".lower()[:60],
                            prefix=platform_settings.redis_prefix)
    await store.start()
    try:
        sizes = []
        for rounds in range(1, 31):
            await store.save(_document(rounds), {"weights": [np.full((3, 2), rounds, np.float32)]})
            sizes.append(len(await redis.hget(f"{platform_settings.redis_prefix}fl:federations", "f-1")))
        assert max(sizes) - min(sizes) <= 8  # the document stays the same size as rounds complete
        assert await redis.llen(f"{platform_settings.redis_prefix}fl:history:f-1") == 30  # each round once
        await store.save(_document(30), {"weights": [np.full((3, 2), 30, np.float32)]})  # saved again: no dup
        ((document, arrays),) = await store.load_all()
        assert document["history"] == _document(30)["history"] and "history_length" not in document
        np.testing.assert_array_equal(arrays["weights"][0], np.full((3, 2), 30, np.float32))
    finally:
        keys = [key async for key in redis.scan_iter(f"{platform_settings.redis_prefix}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
