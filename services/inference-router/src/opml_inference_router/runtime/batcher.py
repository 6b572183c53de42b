"""Per-replica dynamic batching, as Triton's dynamic batcher does it.

Requests queue at their replica. A batch is dispatched when the queued rows reach the replica's
batch cap or the oldest request has waited ``max_queue_delay``; it takes requests from the head
whose non-batch shapes match while their rows fit. The replica runs one batch at a time on its own
thread (the event loop stays free to decode and queue), so requests that arrive during a run form
the next batch: under load, batches fill without waiting. Without dynamic batching every request
runs alone. Cancelled requests (a caller's deadline passed) are dropped before they cost a run.

A batch that takes less than ``INLINE_BELOW_S`` (a running average of the replica's runs) runs on
the event loop itself: handing it to the thread and back costs ~0.1-0.2 ms of wake-ups, far more
than such a run, while blocking the loop that briefly costs other requests less than the hop would.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from opml_common.errors import Unavailable

from opml_inference_router.runtime.metrics import BatchStats, ReplicaMetrics
from opml_inference_router.runtime.replica import Replica, Tensors

INLINE_BELOW_S = 0.0002


@dataclass
class _Pending:
    inputs: Tensors
    rows: int
    shapes: tuple[tuple[int, ...], ...]
    future: asyncio.Future
    enqueued: float


class DynamicBatcher:
    """Queues requests for one replica and runs them in batches.

    ``start()`` starts the dispatch task and the replica's thread; ``stop()`` refuses new requests,
    lets the queued ones finish, then ends both. Both are idempotent.
    """

    def __init__(self, replica: Replica, metrics: ReplicaMetrics) -> None:
        self.replica = replica
        self.metrics = metrics
        config = replica.config
        self._batching = config.dynamic_batching is not None and replica.batches
        self._max_rows = replica.max_batch if self._batching else 1
        self._delay_s = config.queue_delay_ms / 1000.0
        self._queue: deque[_Pending] = deque()
        self._queued_rows = 0
        self._wake = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._mean_run_s = float("inf")  # unknown until the first run: use the thread

    async def start(self) -> None:
        if self._task is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replica-{self.replica.model.name}")
        self._task = asyncio.create_task(self._dispatch(), name=f"batcher {self.replica.model}")

    async def stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._queue and self._task is not None and not self._task.done():
            await asyncio.sleep(0.005)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def infer(self, inputs: Tensors) -> dict[str, np.ndarray]:
        """The replica's outputs for one request (already validated: shapes fit, batch <= the cap).

        Raises:
            Unavailable: the replica is being unloaded.
        """
        if self._closed:
            raise Unavailable(f"{self.replica.model} is being unloaded; retry on another replica")
        loop = asyncio.get_running_loop()
        rows = len(next(iter(inputs.values()))) if self.replica.batches else 1
        pending = _Pending(inputs, rows, tuple(array.shape[1:] for array in inputs.values()),
                           loop.create_future(), loop.time())
        self._queue.append(pending)
        self._queued_rows += rows
        self.metrics.queue_depth.inc()
        self._wake.set()
        start = time.perf_counter()
        result = await pending.future
        self.metrics.latency.observe(time.perf_counter() - start)
        return result

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            if self._batching and self._delay_s > 0:
                deadline = self._queue[0].enqueued + self._delay_s
                while self._queued_rows < self._max_rows and (remaining := deadline - loop.time()) > 0:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), remaining)
                    except TimeoutError:
                        break
            batch = self._take()
            if batch:
                await self._run(batch)

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        rows = 0
        while self._queue:
            head = self._queue[0]
            if batch and (head.shapes != batch[0].shapes or rows + head.rows > self._max_rows):
                break
            self._queue.popleft()
            self._queued_rows -= head.rows
            self.metrics.queue_depth.dec()
            if head.future.done():  # cancelled by its caller while queued
                continue
            batch.append(head)
            rows += head.rows
        return batch

    def _timed_run(self, inputs: list[Tensors]) -> tuple[list[dict[str, np.ndarray]], int]:
        """The replica's outputs and its run time in ns (without the hop to its thread)."""
        start = time.perf_counter_ns()
        results = self.replica.run_batch(inputs)
        return results, time.perf_counter_ns() - start

    async def _run(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        rows = sum(p.rows for p in batch)
        inputs = [p.inputs for p in batch]
        try:
            if self._mean_run_s < INLINE_BELOW_S:
                results, elapsed = self._timed_run(inputs)
            else:
                results, elapsed = await loop.run_in_executor(self._executor, self._timed_run, inputs)
        except Exception as error:  # noqa: BLE001 - every waiting caller gets the failure
            self.metrics.failures += len(batch)
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
            return
        seconds = elapsed / 1e9
        self._mean_run_s = seconds if self._mean_run_s == float("inf") else 0.9 * self._mean_run_s + 0.1 * seconds
        metrics = self.metrics
        metrics.batch_size.observe(rows)
        metrics.inference_count += rows
        metrics.execution_count += 1
        metrics.success_ns += elapsed
        metrics.last_inference_ms = time.time_ns() // 1_000_000
        stats = metrics.batches.setdefault(rows, BatchStats())
        stats.count += 1
        stats.ns += elapsed
        for pending, result in zip(batch, results):
            if not pending.future.done():
                pending.future.set_result(result)
