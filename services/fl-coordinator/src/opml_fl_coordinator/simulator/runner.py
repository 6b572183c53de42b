"""Virtual clients in virtual time around a real :class:`Federation`.

Resource heterogeneity: each client has a speed (examples per virtual second, like TiFL's CPU
shares), an upload delay, and a chance of dropping out of each task (it then never answers, and
the round's deadline drops it). Data heterogeneity comes from :func:`partition_digits`. Training
is real (softmax regression on the client's shard); only time is virtual, so a run is
deterministic per seed and fast, whatever the speeds.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from opml_fl_coordinator.config import FederationConfig
from opml_fl_coordinator.federation import Federation, FederationListener, Phase, RoundRecord, new_federation
from opml_fl_coordinator.simulator.data import Partition
from opml_fl_coordinator.simulator.model import SoftmaxModel

SPEED_SHARES = (4.0, 2.0, 1.0, 0.5, 0.1)
"""TiFL's CPU shares of its five client groups (Chai et al., HPDC '20, section 5)."""


@dataclass(frozen=True)
class ClientTraits:
    speed: float            # examples per virtual second
    delay_s: float          # upload latency, virtual seconds
    dropout: float          # chance of never answering a task


def heterogeneous_traits(num_clients: int, *, seed: int = 0, base_speed: float = 200.0,
                         dropout: float = 0.05) -> list[ClientTraits]:
    """Clients in TiFL's five speed groups (equal shares), log-normal delays, a drop-out rate."""
    rng = np.random.default_rng(seed + 7919)
    groups = rng.permutation(np.arange(num_clients) % len(SPEED_SHARES))
    return [ClientTraits(speed=base_speed * SPEED_SHARES[g], delay_s=float(rng.lognormal(-1.0, 0.5)),
                         dropout=dropout) for g in groups]


@dataclass
class SimulationResult:
    rounds: list[RoundRecord] = field(default_factory=list)
    times: list[float] = field(default_factory=list)        # virtual time at each round's end
    accuracy: list[float] = field(default_factory=list)     # server-side test accuracy after each round
    wall: list[float] = field(default_factory=list)         # wall seconds from the run's start to each round's end
    wall_s: float = 0.0
    reason: str = ""

    def time_to(self, target: float, *, wall: bool = False) -> tuple[float, int] | None:
        """(virtual seconds, or wall seconds with ``wall``, and rounds) until the test accuracy
        first reached ``target``."""
        for index, (at, accuracy) in enumerate(zip(self.wall if wall else self.times, self.accuracy)):
            if accuracy >= target:
                return at, index + 1
        return None


class _Recorder(FederationListener):
    def __init__(self, result: SimulationResult) -> None:
        self.result = result
        self.started = time.perf_counter()

    def round_completed(self, federation: Federation, record: RoundRecord) -> None:
        self.result.rounds.append(record)
        self.result.times.append(record.ended_at)
        self.result.accuracy.append(record.metrics.get("accuracy", float("nan")))
        self.result.wall.append(time.perf_counter() - self.started)


class Simulator:
    """Runs one federation of ``len(traits)`` virtual clients to its end."""

    def __init__(self, config: FederationConfig, partition: Partition, traits: list[ClientTraits], *,
                 seed: int = 0) -> None:
        if len(traits) != len(partition.clients):
            raise ValueError(f"{len(traits)} client traits for {len(partition.clients)} data shards")
        self.config, self.partition, self.traits = config, partition, traits
        features = partition.test[0].shape[1]
        self.model = SoftmaxModel(features, partition.classes)
        self.seed = seed

    def run(self, *, max_virtual_s: float = 1e7) -> SimulationResult:
        result = SimulationResult()
        started = time.perf_counter()
        x_test, y_test = self.partition.test

        def evaluate(server_round: int, weights):
            loss, accuracy = self.model.evaluate(weights, x_test, y_test)
            return loss, {"accuracy": accuracy}

        federation = new_federation("sim", self.config, now=0.0, weights=self.model.initial_weights(),
                                    evaluate_fn=evaluate, listener=_Recorder(result))
        client_ids = [f"client-{i:04d}" for i in range(len(self.traits))]
        rngs = [np.random.default_rng([self.seed, i]) for i in range(len(self.traits))]
        queue: list[tuple[float, int, str, object]] = []
        order = itertools.count()
        dispatched: set[int] = set()
        now = 0.0
        for client_id, (_, y) in zip(client_ids, self.partition.clients, strict=True):
            federation.join(client_id, now, num_examples=len(y))
        while federation.phase not in (Phase.COMPLETED, Phase.STOPPED) and now <= max_virtual_s:
            for index, client_id in enumerate(client_ids):
                task = federation.task_for(client_id)
                if task is None or task.task_id in dispatched:
                    continue
                dispatched.add(task.task_id)
                arrival = self._work(index, task, rngs[index], now)
                if arrival is not None:
                    heapq.heappush(queue, (arrival[0], next(order), client_id, arrival[1]))
            deadline = federation.next_deadline()
            if queue and (deadline is None or queue[0][0] <= deadline):
                now, _, client_id, payload = heapq.heappop(queue)
                task_id, weights, examples, metrics = payload  # type: ignore[misc]
                federation.submit(client_id, task_id, weights, examples, metrics, now)
            elif deadline is not None:
                now = deadline
                federation.poll(now)
            else:
                break  # nothing in flight and nothing to wait for: the federation is stuck
        result.wall_s = time.perf_counter() - started
        result.reason = federation.reason or f"stopped at virtual time {now:g} in phase {federation.phase.value}"
        return result

    def _work(self, index: int, task, rng: np.random.Generator, now: float):
        """What client ``index`` does with ``task``: None if it drops out, else when its update
        arrives and what it holds."""
        traits = self.traits[index]
        if rng.random() < traits.dropout:
            return None
        x, y = self.partition.clients[index]
        config = task.config
        epochs = int(config.get("epochs", 1))
        budget = config.get("time_budget_s")
        max_examples = None
        if budget is not None:  # partial work: what fits in the time budget
            max_examples = max(1, int((float(budget) - traits.delay_s) * traits.speed))
        _, accuracy = self.model.evaluate(task.weights, x, y)
        weights, done = self.model.fit(task.weights, x, y, epochs=epochs, batch_size=int(config.get("batch_size", 32)),
                                       learning_rate=float(config.get("learning_rate", 0.05)), rng=rng,
                                       proximal_mu=float(config.get("proximal_mu", 0.0)), max_examples=max_examples)
        arrival = now + done / traits.speed + traits.delay_s
        return arrival, (task.task_id, weights, max(done, 1), {"eval_accuracy": accuracy})
