"""Per-replica dynamic batching, as Triton's dynamic batcher does it.

Requests queue at their replica. A batch is dispatched when the queued rows reach the replica's
batch cap or the oldest request has waited ``max_queue_delay``; it takes requests from the head
whose non-batch shapes match while their rows fit. Each *instance* of the replica (its own
session, as Triton's ``instance_group`` count) runs one batch at a time on its own thread (the
event loop stays free to decode and queue), and a batch goes to a free instance, so ``k``
instances run ``k`` batches at once; requests that arrive while every instance runs form the next
batch: under load, batches fill without waiting. A request that finds the replica idle (nothing
queued, no instance running) does not wait the delay either: it runs at once, with whatever arrived
in the same turn of the event loop, and the requests that come while it runs form the next batch; the
delay is paid only to grow a batch behind other work, so a lone caller never pays it for nothing
(``dynamic_batching.wait_when_idle`` waits anyway, as Triton does). Without dynamic batching every
request runs alone. A cancelled request (its caller's deadline passed, or it was a hedged request that lost)
leaves the queue at once: it neither costs a run nor holds rows of the batch that is filling.

A batch that takes less than ``INLINE_BELOW_S`` (a running average of the CPU time of the replica's
runs; wall time on a GPU) runs on the event loop itself: handing it to the thread and back costs
~0.1-0.2 ms of wake-ups, far more than such a run, while blocking the loop that briefly costs other
requests less than the hop would. The average is of CPU time, not wall time: on a loaded machine a 50 µs run preempted mid-way
measured 0.3 ms of wall time, and the average crossed the bound back and forth, sending about half of
the runs through the thread. Requests that find such a replica idle need not queue at all:
:meth:`run_now` runs them as one batch in the caller's turn of the event loop (the worker's Unix socket
server does so for the calls of one read, with no task, future or dispatcher wake-up).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from opml_common.errors import FailedPrecondition, Unavailable
from opml_common.lifecycle import Component, cancel_and_wait
from opml_inference_router.runtime.metrics import BatchStats, ReplicaMetrics
from opml_inference_router.runtime.replica import Replica, Tensors

INLINE_BELOW_S = 0.0002


def _shapes_by_name(inputs: Tensors) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What must match for two requests to share a batch: each input's non-batch shape, by name.

    By name, not in the order the request listed its inputs: batches are joined by name, so two
    requests sending the same inputs in another order with their dynamic dims swapped must not meet."""
    return tuple(sorted((name, array.shape[1:]) for name, array in inputs.items()))


@dataclass(slots=True, eq=False)  # identity: the queue removes a cancelled one
class _Pending:
    inputs: Tensors
    rows: int
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    future: asyncio.Future
    enqueued: float
    idle: bool  # it found nothing queued and no instance running: it need not wait for a batch to fill
    taken: bool = False  # in a batch: a cancel no longer looks for it in the queue


class DynamicBatcher(Component):
    """Queues requests for one replica and runs them in batches on its instances (``replica`` first;
    :meth:`add_instance` and :meth:`retire` change how many, :meth:`set_max_batch` the batch cap,
    all while it serves).

    ``start()`` starts the dispatch task and the instances' threads; ``stop()`` refuses new
    requests, lets the queued ones finish, then ends both. Both are idempotent; a stopped batcher is
    not started again (its threads are shut down).
    """

    def __init__(self, replica: Replica, metrics: ReplicaMetrics) -> None:
        super().__init__()
        self.replica = replica
        self.metrics = metrics
        config = replica.config
        self._batching = config.dynamic_batching is not None and replica.batches
        self._max_rows = replica.max_batch if self._batching else 1
        self._delay_s = config.queue_delay_ms / 1000.0 if self._batching else 0.0
        self._wait_when_idle = self._batching and config.dynamic_batching.wait_when_idle
        self._queue: deque[_Pending] = deque()
        self._queued_rows = 0
        self._wake = asyncio.Event()
        self._instances: list[Replica] = [replica]
        self._idle: deque[Replica] = deque([replica])
        self._threads: dict[Replica, ThreadPoolExecutor] = {}  # each instance's one thread
        self._runs: dict[Replica, asyncio.Task] = {}  # the batch an instance runs now
        self._task: asyncio.Task | None = None
        self._closed = False  # stopping: infer() refuses new requests
        self._mean_run_s = float("inf")  # how long a run holds its thread; unknown until the first run: use the thread
        # On the CPU that is the thread's CPU time (preemption and waits for the GIL left out); a GPU
        # run's thread may sleep while the device works, so there it is wall time.
        self._cpu_timed = replica.kind.execution_provider == "CPUExecutionProvider"

    @property
    def instances(self) -> tuple[Replica, ...]:
        return tuple(self._instances)

    @property
    def max_batch(self) -> int:
        """Rows per batch at most (1 without dynamic batching)."""
        return self._max_rows

    def set_max_batch(self, rows: int) -> None:
        """Caps batches at ``rows`` (at most the replica's own cap) from the next batch on; a request
        with more rows than the cap still runs, alone."""
        if self._batching:
            self._max_rows = max(1, min(rows, self.replica.max_batch))
            self._wake.set()

    def add_instance(self, instance: Replica) -> None:
        """Another session of the same replica: it takes batches from now on."""
        self._instances.append(instance)
        self._thread(instance)
        self._idle.append(instance)
        self._wake.set()

    async def retire(self, count: int) -> list[Replica]:
        """Takes the newest ``count`` instances (never the first) out of service; returns once each
        finished the batch it runs, with them."""
        retired = self._instances[max(1, len(self._instances) - count):]
        for instance in retired:
            self._instances.remove(instance)
            if instance in self._idle:
                self._idle.remove(instance)
        for instance in retired:
            run = self._runs.get(instance)
            if run is not None:
                await asyncio.gather(run, return_exceptions=True)
            self._threads.pop(instance).shutdown(wait=True)
        return retired

    def _thread(self, instance: Replica) -> ThreadPoolExecutor:
        if instance not in self._threads:
            self._threads[instance] = ThreadPoolExecutor(max_workers=1,
                                                         thread_name_prefix=f"replica-{instance.model.name}")
        return self._threads[instance]

    async def on_start(self) -> None:
        if self._closed:
            raise FailedPrecondition(f"the batcher of {self.replica.model} was stopped; make a new one")
        for instance in self._instances:
            self._thread(instance)
        self._task = asyncio.create_task(self._dispatch(), name=f"batcher {self.replica.model}")

    async def on_stop(self) -> None:
        """The dispatcher drains the queue and ends by itself once it is empty and its own batch ran:
        cancelling it mid-run would leave that batch's callers waiting for answers that never come (a
        version rolled back under load). A stop that is itself cancelled still answers them (Unavailable)."""
        self._closed = True
        self._wake.set()
        cancelled = False
        try:
            if self._task is not None:
                await self._task
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            await cancel_and_wait(self._task)
            if cancelled:  # the instances' runs fail their callers; their threads end when their runs do
                await cancel_and_wait(*self._runs.values())
            else:
                await asyncio.gather(*self._runs.values(), return_exceptions=True)  # a failed run failed its callers
            for thread in self._threads.values():
                thread.shutdown(wait=not cancelled)

    def can_run_now(self) -> bool:
        """Whether :meth:`run_now` would run a request at once: nothing queued, no instance running, runs
        short enough to run on the event loop, and no wait for a batch asked for when idle."""
        return (not self._closed and not self._queue and not self._wait_when_idle and not self._runs
                and len(self._idle) == len(self._instances) and self._mean_run_s < INLINE_BELOW_S)

    def fits_one_batch(self, requests: list[Tensors]) -> bool:
        """Whether ``requests`` make one batch: their rows within the cap (or one request, which runs alone
        whatever its rows), their non-batch shapes alike."""
        if len(requests) == 1:
            return True
        rows = sum(len(next(iter(inputs.values()))) for inputs in requests) if self.replica.batches else len(requests)
        shapes = _shapes_by_name(requests[0])
        return rows <= self._max_rows and all(_shapes_by_name(inputs) == shapes for inputs in requests[1:])

    def run_now(self, requests: list[Tensors]) -> list[dict[str, np.ndarray]]:
        """The outputs of ``requests`` (:meth:`fits_one_batch`) run at once as one batch on the event loop's
        thread, as the batch they would have made through :meth:`infer` (same metrics). Call only when
        :meth:`can_run_now` said so, in the same turn of the event loop: nothing else can start a run in
        between.

        Raises:
            FailedPrecondition: the replica is not idle, or the requests do not make one batch (a
                caller's mistake, not the requests').
            Exception: the run's own failure (counted, as a failed batch).
        """
        if not self.can_run_now() or not self.fits_one_batch(requests):
            raise FailedPrecondition(f"{self.replica.model} is not idle or these requests are no batch; "
                                     f"queue them with infer()")
        instance = self._idle.popleft()
        rows = sum(len(next(iter(inputs.values()))) for inputs in requests) if self.replica.batches else 1
        try:
            results, elapsed_ns, cpu_ns = self._timed_run(instance, requests)
        except Exception:
            self.metrics.failures += len(requests)
            raise
        finally:
            self._idle.appendleft(instance)
        self._record(rows, elapsed_ns, cpu_ns)
        for _ in requests:
            self.metrics.latency.observe(elapsed_ns / 1e9)
        return results

    async def infer(self, inputs: Tensors) -> dict[str, np.ndarray]:
        """The replica's outputs for one request (already validated: shapes fit, batch <= the cap).

        Raises:
            Unavailable: the replica is being unloaded.
        """
        if self._closed:
            raise Unavailable(f"{self.replica.model} is being unloaded; retry on another replica")
        loop = asyncio.get_running_loop()
        rows = len(next(iter(inputs.values()))) if self.replica.batches else 1
        idle = not self._wait_when_idle and not self._queue and len(self._idle) == len(self._instances)
        pending = _Pending(inputs, rows, _shapes_by_name(inputs), loop.create_future(), loop.time(), idle)
        self._queue.append(pending)
        self._queued_rows += rows
        self.metrics.queue_depth.inc()
        if len(self._queue) == 1 or self._queued_rows >= self._max_rows or not self._delay_s:
            self._wake.set()  # else a batch is forming and not full yet: its deadline's timer wakes the dispatcher
        try:
            result = await pending.future
        except asyncio.CancelledError:
            self._forget(pending)
            raise
        self.metrics.latency.observe(loop.time() - pending.enqueued)
        return result

    def _forget(self, pending: _Pending) -> None:
        """A caller that left frees its place in the forming batch now, not when it reaches the head."""
        if pending.taken:  # its run goes on, its result is dropped (deque.remove's miss would repr the arrays)
            return
        self._queue.remove(pending)
        self._queued_rows -= pending.rows
        self.metrics.queue_depth.dec()

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                if self._closed:
                    return  # drained: nothing queued, no batch of its own running
                self._wake.clear()
                await self._wake.wait()
            if (self._delay_s and self._queued_rows < self._max_rows and not self._queue[0].idle
                    and not self._closed):  # stopping: what is queued runs now, no batch grows
                await self._fill(loop, self._queue[0].enqueued + self._delay_s)
                if not self._queue:  # every caller left while it formed
                    continue
            while not self._idle:  # every instance runs a batch: the queue keeps filling meanwhile
                self._wake.clear()
                await self._wake.wait()
            batch = self._take()
            if not batch:
                continue
            instance = self._idle.popleft()
            if self._mean_run_s < INLINE_BELOW_S or len(self._instances) == 1:  # no task needed: nothing runs beside
                await self._run(instance, batch)
            else:
                self._runs[instance] = asyncio.create_task(self._run(instance, batch))

    async def _fill(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Waits until the forming batch is full or ``deadline`` passed: only these wake the dispatcher
        (:meth:`infer` does not for an arrival that leaves the batch short), so a batch of ``n``
        requests costs one timer, not ``n`` wake-ups."""
        if deadline <= loop.time():
            return
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            self._wake.set()

        timer = loop.call_at(deadline, expire)
        try:
            while self._queue and self._queued_rows < self._max_rows and not expired:
                self._wake.clear()
                await self._wake.wait()
        finally:
            timer.cancel()

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        rows = 0
        while self._queue:
            head = self._queue[0]
            if batch and (head.shapes != batch[0].shapes or rows + head.rows > self._max_rows):
                break
            self._queue.popleft()
            head.taken = True
            self._queued_rows -= head.rows
            self.metrics.queue_depth.dec()
            batch.append(head)
            rows += head.rows
        return batch

    @staticmethod
    def _timed_run(instance: Replica, inputs: list[Tensors]) -> tuple[list[dict[str, np.ndarray]], int, int]:
        """The instance's outputs, its run time and the running thread's CPU time, in ns (without the hop
        to its thread)."""
        start, cpu = time.perf_counter_ns(), time.thread_time_ns()
        results = instance.run_batch(inputs)
        return results, time.perf_counter_ns() - start, time.thread_time_ns() - cpu

    async def _run(self, instance: Replica, batch: list[_Pending]) -> None:
        """Runs ``batch`` on ``instance`` (inline when runs are tiny), then frees the instance."""
        try:
            await self._run_on(instance, batch)
        finally:
            self._runs.pop(instance, None)
            if instance in self._instances:  # not retired meanwhile
                self._idle.append(instance)
                self._wake.set()

    async def _run_on(self, instance: Replica, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        rows = sum(p.rows for p in batch)
        inputs = [p.inputs for p in batch]
        try:
            if self._mean_run_s < INLINE_BELOW_S:
                results, elapsed, cpu = self._timed_run(instance, inputs)
            else:
                results, elapsed, cpu = await loop.run_in_executor(self._threads[instance], self._timed_run,
                                                                   instance, inputs)
        except asyncio.CancelledError:  # torn down mid-run: its callers must not wait for an answer
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(Unavailable(f"{self.replica.model} was unloaded while "
                                                             f"running this request; retry on another replica"))
            raise
        except Exception as error:  # noqa: BLE001 - every waiting caller gets the failure
            self.metrics.failures += len(batch)
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
            return
        self._record(rows, elapsed, cpu)
        for pending, result in zip(batch, results):
            if not pending.future.done():
                pending.future.set_result(result)

    def _record(self, rows: int, elapsed_ns: int, cpu_ns: int) -> None:
        """A batch of ``rows`` ran: Triton's statistics, the batch-size histogram and the running average."""
        seconds = (cpu_ns if self._cpu_timed else elapsed_ns) / 1e9
        self._mean_run_s = seconds if self._mean_run_s == float("inf") else 0.9 * self._mean_run_s + 0.1 * seconds
        metrics = self.metrics
        metrics.batch_size.observe(rows)
        metrics.inference_count += rows
        metrics.execution_count += 1
        metrics.success_ns += elapsed_ns
        metrics.last_inference_ms = time.time_ns() // 1_000_000
        stats = metrics.batches.setdefault(rows, BatchStats())
        stats.count += 1
        stats.ns += elapsed_ns
