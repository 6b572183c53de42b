"""The service's control over a running tracer, through Redis, polled (no connection the job waits on).

``{prefix}traces:enabled`` = "0" turns tracing off everywhere (absent or "1": on);
``{prefix}traces:capture:{job}`` = ``{"capture_id", "steps", "workers"}`` arms a capture that each
named worker (all when ``workers`` is empty) runs once per ``capture_id``.

The keys are read with ``resp.RedisReader`` (standard library; redis-py only for URL options it
does not implement: importing redis-py cost more CPU than a short job's whole poll).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass

from opml_trace_collector.inject import resp

_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class CaptureRequest:
    """A capture asked of this worker (its key's value, checked): the tracer imports ``capture``, and
    TensorFlow's profiler with it, only when one arrives."""

    capture_id: str
    steps: int


def redis_client(url: str):  # noqa: ANN201 - a RedisReader or a redis.Redis: both have mget, close
    """The client the poll reads the keys with: the light one, unless the URL needs redis-py."""
    try:
        return resp.RedisReader(resp.parse_url(url), timeout_s=_TIMEOUT_S)
    except resp.Unsupported:
        import redis
        return redis.Redis.from_url(url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S)


def parse_capture(raw: bytes | str, worker: str) -> CaptureRequest | None:
    """The request for ``worker`` in a capture key's value, None when it names other workers.

    Raises:
        ValueError: the value is not the JSON object the service writes (says which field).
    """
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"capture request is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("capture request must be a JSON object")
    capture_id, steps, workers = value.get("capture_id"), value.get("steps"), value.get("workers") or []
    if not isinstance(capture_id, str) or not capture_id:
        raise ValueError("capture request `capture_id` must be a non-empty string")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"capture request `steps` must be an integer >= 1, but got {steps!r}")
    if not isinstance(workers, list):
        raise ValueError("capture request `workers` must be a list of worker names")
    if workers and worker not in workers:
        return None
    return CaptureRequest(capture_id, steps)


class ControlPoller:
    """Reads the two keys on each ``poll`` (the tracer's thread calls it every ``poll_s``); calls back on
    a change. Redis down: keeps trying quietly."""

    def __init__(self, redis_url: str, prefix: str, job: str, worker: str, *,
                 set_enabled: Callable[[bool], None], arm: Callable[[CaptureRequest], None],
                 bad_request: Callable[[str | None, str], None], warn: Callable[[str, str], None]) -> None:
        self._client = redis_client(redis_url)
        self._keys = [f"{prefix}traces:enabled", f"{prefix}traces:capture:{job}"]
        self._worker = worker
        self._set_enabled, self._arm, self._bad, self._warn = set_enabled, arm, bad_request, warn
        self._seen: set[str] = set()
        self.first_poll = threading.Event()  # set once the first answer (or failure) is in

    def poll(self) -> None:
        """One read of the keys and what follows from it; never raises."""
        try:
            enabled, capture = self._client.mget(self._keys)
        except Exception as exc:  # noqa: BLE001 - Redis unreachable: no captures, training unaffected
            self._warn("redis", f"Redis is unreachable ({exc}); captures and the global switch are unavailable")
        else:
            self._set_enabled(enabled != b"0")
            if capture is not None:
                self._on_capture(capture)
        self.first_poll.set()

    def _on_capture(self, raw: bytes) -> None:
        try:
            request = parse_capture(raw, self._worker)
        except ValueError as exc:
            capture_id = _capture_id_of(raw)
            if capture_id not in self._seen:
                self._seen.add(capture_id)
                self._bad(capture_id or None, str(exc))
            return
        if request is not None and request.capture_id not in self._seen:
            self._seen.add(request.capture_id)
            self._arm(request)

    def close(self) -> None:
        self._client.close()


def _capture_id_of(raw: bytes) -> str:
    try:
        value = json.loads(raw)
        return str(value.get("capture_id") or "") if isinstance(value, dict) else ""
    except ValueError:
        return ""
