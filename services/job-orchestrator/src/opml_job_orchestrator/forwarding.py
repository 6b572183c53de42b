"""Requests a follower hands to the leader through Redis: what only the lease's holder may do.

Every replica serves the API, but a change that the scheduler or the pipelines' engine must make
(submit, cancel, preempt a job; apply, delete, trigger a pipeline; force a blessing) is made by the
replica holding the ``job-orchestrator`` lease. A follower pushes it as a record on the list
``{prefix}job-orchestrator:requests`` and waits for the leader's answer on a key of its own
(``...:reply:{id}``, BLPOP): one Redis round trip each way beyond the leader's own work, so a
submit through a follower answers as one through the leader does, a few milliseconds later.

The leader takes each request with BLMOVE onto ``...:requests:taken`` and removes it once
answered; a new leader first answers what its predecessor took and did not answer (it died
mid-request), so a request is never lost to a leader change. A request carries its deadline: one
still queued after it (no leader for that long; the caller was told UNAVAILABLE) is dropped, not
acted on behind the caller's back. A request taken again after a leader change may have been
carried out already; the handler makes each kind idempotent enough (a submit of a job the store
already has is answered as done).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from opml_common.errors import OpmlError, Unavailable, from_status
from opml_common.lifecycle import Component, cancel_and_wait

log = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any], bool], Awaitable[dict[str, Any]]]
"""``handler(kind, args, retaken)``: carries out one request on the leader; ``retaken``: a previous
leader took it and may have carried it out. Returns the answer's fields (JSON values)."""

_REPLY_TTL_S = 60
_TAKE_BLOCK_S = 1.0


def _keys(prefix: str) -> tuple[str, str, str]:
    base = f"{prefix}job-orchestrator:requests"
    return base, f"{base}:taken", f"{prefix}job-orchestrator:reply:"


class Forwarder:
    """A follower's side: :meth:`call` hands one request to the leader and returns its answer.

    ``timeout_s`` bounds the wait (no leader, or a slow one): the caller gets UNAVAILABLE and the
    request is dropped unanswered if still queued then."""

    def __init__(self, redis: aioredis.Redis, *, prefix: str, timeout_s: float = 10.0) -> None:
        self._redis = redis
        self._queue, _, self._reply = _keys(prefix)
        self._timeout_s = timeout_s

    async def call(self, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        """Raises: the leader's OpmlError (its code, message, violations); Unavailable: no answer in time."""
        request_id = uuid.uuid4().hex
        record = {"id": request_id, "kind": kind, "args": args, "deadline": time.time() + self._timeout_s}
        try:
            await self._redis.rpush(self._queue, json.dumps(record))
            answer = await self._redis.blpop([self._reply + request_id], timeout=self._timeout_s)
        except RedisError as exc:
            raise Unavailable(f"{kind}: Redis cannot be reached to hand it to the leading replica ({exc})") from exc
        if answer is None:
            raise Unavailable(f"{kind}: no job-orchestrator replica leads, or the leader did not answer within "
                              f"{self._timeout_s:g} s; nothing was done unless a get shows it (try again)")
        reply = json.loads(answer[1])
        if "error" in reply:
            error = reply["error"]
            raise from_status(error["code"], error["message"], [tuple(v) for v in error.get("violations", ())])
        return reply["ok"]


class RequestConsumer(Component):
    """The leader's side: takes requests in order and answers each with ``handler``'s result or error.

    Started when this replica takes the lease (after its orchestrator and engine are up), stopped
    when it loses it; a request it took and had not answered then is answered by the next leader."""

    def __init__(self, redis: aioredis.Redis, *, prefix: str, handler: Handler) -> None:
        super().__init__()
        self._redis = redis
        self._queue, self._taken, self._reply = _keys(prefix)
        self._handler = handler
        self._task: asyncio.Task[None] | None = None

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="job-orchestrator requests")

    async def on_stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        retaken = await self._redis.lrange(self._taken, 0, -1)
        for raw in retaken:  # a previous leader took these and may not have answered
            await self._answer(raw, retaken=True)
        while True:
            try:
                raw = await self._redis.blmove(self._queue, self._taken, _TAKE_BLOCK_S, "LEFT", "RIGHT")
            except RedisError as exc:
                log.warning("requests: Redis unreachable (%s); trying again", exc)
                await asyncio.sleep(_TAKE_BLOCK_S)
                continue
            if raw is not None:
                await self._answer(raw, retaken=False)

    async def _answer(self, raw: bytes, *, retaken: bool) -> None:
        try:
            record = json.loads(raw)
            request_id, kind, args = str(record["id"]), str(record["kind"]), dict(record["args"])
            deadline = float(record["deadline"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("requests: dropped a malformed request %r (%s)", raw[:200], exc)
            await self._redis.lrem(self._taken, 1, raw)
            return
        if time.time() > deadline:
            log.warning("requests: dropped %s request %s, queued past its deadline (its caller was told UNAVAILABLE)",
                        kind, request_id)
        else:
            try:
                reply: dict[str, Any] = {"ok": await self._handler(kind, args, retaken)}
            except OpmlError as exc:
                reply = {"error": {"code": exc.code, "message": exc.message,
                                   "violations": list(getattr(exc, "violations", ()))}}
            except Exception as exc:  # a bug: the caller hears INTERNAL, the leader goes on
                log.exception("requests: %s request %s failed", kind, request_id)
                reply = {"error": {"code": "INTERNAL", "message": f"the leading replica failed on it "
                                                                  f"({type(exc).__name__}; see its log)"}}
            key = self._reply + request_id
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.rpush(key, json.dumps(reply)).expire(key, _REPLY_TTL_S)
                await pipe.execute()
        await self._redis.lrem(self._taken, 1, raw)
