"""Pipelines, their runs and their caches in Redis: the runs' durable state.

Keys under ``{redis_prefix}job-orchestrator:pipelines:``:

| key | holds |
|---|---|
| ``specs`` | hash: pipeline name -> ``opml.jobs.v1.Pipeline`` (spec, the active run, the blessed model, the schema) |
| ``runs:{pipeline}`` | hash: run number -> ``PipelineRun`` (its steps, their cache decisions, jobs and outputs) |
| ``seq:{pipeline}`` | the last run number given (kept when a pipeline is deleted: job ids are never reused) |
| ``pending:{pipeline}`` | list: what asked for a run while one was going (coalesced into one more run) |
| ``cache`` | hash: cache key -> the ``StepRun`` that computed it (its outputs) |
| ``statistics:{pipeline}`` | hash: span content hash -> ``StepOutput`` of its statistics bundle |

The runner writes a run before each action it takes (a job submitted, a bundle added), so a
service killed at any point finds where each run stood. Writes are awaited: a run never acts on
something Redis has not kept.
"""

from __future__ import annotations

from typing import Any

from opml.jobs.v1 import pipelines_pb2 as pb

from opml_common.errors import DataLoss

MAX_PENDING_TRIGGERS = 20
"""What a coalesced run remembers of the triggers that asked for it (it runs once however many did)."""


class RunStore:
    """``redis`` is an asyncio client; every method raises ``redis.exceptions.RedisError`` when Redis is away."""

    def __init__(self, redis: Any, *, prefix: str) -> None:
        self._redis = redis
        self._base = f"{prefix}job-orchestrator:pipelines:"

    # -- pipelines ------------------------------------------------------------------------------

    async def pipelines(self) -> list[pb.Pipeline]:
        """Every pipeline, by name."""
        found = await self._redis.hgetall(self._base + "specs")
        return sorted((_parse(pb.Pipeline, v, f"pipeline {k!r}") for k, v in found.items()), key=lambda p: p.name)

    async def pipeline(self, name: str) -> pb.Pipeline | None:
        data = await self._redis.hget(self._base + "specs", name)
        return None if data is None else _parse(pb.Pipeline, data, f"pipeline {name!r}")

    async def save_pipeline(self, pipeline: pb.Pipeline) -> None:
        await self._redis.hset(self._base + "specs", pipeline.spec.name, pipeline.SerializeToString())

    async def delete_pipeline(self, name: str) -> None:
        """Forget a pipeline, its runs, its pending triggers and its statistics index (not its run counter)."""
        await self._redis.delete(self._base + f"runs:{name}", self._base + f"pending:{name}",
                                 self._base + f"statistics:{name}")
        await self._redis.hdel(self._base + "specs", name)

    # -- runs -----------------------------------------------------------------------------------

    async def next_run_number(self, pipeline: str) -> int:
        return int(await self._redis.incr(self._base + f"seq:{pipeline}"))

    async def save_run(self, run: pb.PipelineRun) -> None:
        await self._redis.hset(self._base + f"runs:{run.pipeline}", str(run.number), run.SerializeToString())

    async def run(self, pipeline: str, number: int) -> pb.PipelineRun | None:
        data = await self._redis.hget(self._base + f"runs:{pipeline}", str(number))
        return None if data is None else _parse(pb.PipelineRun, data, f"run {number} of {pipeline!r}")

    async def runs(self, pipeline: str) -> list[pb.PipelineRun]:
        """Every run of ``pipeline``, newest first."""
        found = await self._redis.hgetall(self._base + f"runs:{pipeline}")
        runs = [_parse(pb.PipelineRun, v, f"run {k!r} of {pipeline!r}") for k, v in found.items()]
        return sorted(runs, key=lambda r: -r.number)

    # -- coalesced triggers ---------------------------------------------------------------------

    async def add_pending(self, pipeline: str, trigger: str) -> None:
        key = self._base + f"pending:{pipeline}"
        await self._redis.rpush(key, trigger)
        await self._redis.ltrim(key, -MAX_PENDING_TRIGGERS, -1)

    async def pending(self, pipeline: str) -> list[str]:
        return [_text(t) for t in await self._redis.lrange(self._base + f"pending:{pipeline}", 0, -1)]

    async def clear_pending(self, pipeline: str) -> None:
        await self._redis.delete(self._base + f"pending:{pipeline}")

    # -- caches ---------------------------------------------------------------------------------

    async def cached(self, key: str) -> pb.StepRun | None:
        data = await self._redis.hget(self._base + "cache", key)
        return None if data is None else _parse(pb.StepRun, data, f"cache entry {key}")

    async def save_cached(self, key: str, step: pb.StepRun, run: int) -> None:
        entry = pb.StepRun()
        entry.CopyFrom(step)
        entry.cached_from_run = run
        await self._redis.hset(self._base + "cache", key, entry.SerializeToString())

    async def statistics(self, pipeline: str, span_hashes: list[str]) -> dict[str, pb.StepOutput]:
        """Span content hash -> its statistics bundle, for the spans whose statistics exist."""
        if not span_hashes:
            return {}
        found = await self._redis.hmget(self._base + f"statistics:{pipeline}", span_hashes)
        return {h: _parse(pb.StepOutput, v, f"statistics of {h}") for h, v in zip(span_hashes, found, strict=True)
                if v is not None}

    async def save_statistics(self, pipeline: str, span_hash: str, output: pb.StepOutput) -> None:
        await self._redis.hset(self._base + f"statistics:{pipeline}", span_hash, output.SerializeToString())


def _parse(message_class: Any, data: bytes, what: str) -> Any:
    message = message_class()
    try:
        message.ParseFromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and others
        raise DataLoss(f"saved {what} does not parse: {exc}") from exc
    return message


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
