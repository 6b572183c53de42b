"""The serving configuration placement chooses per replica: the worker's defaults, the configuration
a performance model predicts best, and the one exhaustive measurement finds best, served by a real
worker under the same closed-loop load, in one run.

Two pool kinds, each a real worker process of one slot (so a replica may take the slot's share of
cores, ``os.cpu_count()`` threads): ``cpu`` (fp32, any batch) and ``accel`` (the router's emulated
int8 accelerator: int8 only, batches padded to 1, 8, 32). Both run on this machine's cores: the kinds
differ in what the router gives their workers (int8 emulation, fixed shapes), not in hardware, so
transfer between them has little to learn.

1. Every candidate configuration placement considers (batch sizes the kind profiles, threads 1 to the
   slot's, 4 graph optimization levels, 2 execution modes with 2+ threads) is measured with the
   router's own code (``runtime.perfsample``: the kind's session code, median of 15 batches, lowest
   of 3 passes). The request-path profile the router takes at deploy (its defaults) is what
   placement sizes on.
2. Per seed, the performance model the router would have: ``cpu``'s learnt on 20 of the measured
   configurations drawn at random (the router's minimum for a kind's own model); ``accel``'s
   transferred from that model with 5 accel measurements (ScaleShift, as the router does). The
   router's chooser (``placement.serving.ServingConfigChooser``, CostAwareSloPolicy) picks from its
   predictions: the *predicted* configuration. The same chooser given the measured table of step 1
   picks the *measured best*; the *default* is the worker's (slot's threads, all, sequential).
3. Each distinct configuration is loaded on the kind's worker with the batch cap placement gave it
   (the worker's reload, as the router's ResizeReplica does) and driven by ``--clients`` closed-loop
   clients (one-row ModelInfer over the worker's Unix socket, the router's local hop) for
   ``--seconds``, in ``--rounds`` rounds of alternating order; throughput and p99 are the medians
   over rounds.

    taskset -c 1 .venv/bin/python bench/inference_router_serving_config.py [--clients 8] [--seconds 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from opml_common.kserve_codec import encode_request
from opml_common.perfmodel import PerformanceModel, Sample, ScaleShift, ServingConfig
from opml_inference_router.control.profiling import request_path_profile
from opml_inference_router.control.state import Source, VersionRecord
from opml_inference_router.control.workers import WorkerClient
from opml_inference_router.placement import (
    Batching,
    BatchQueueModel,
    CostAwareSloPolicy,
    Fleet,
    FleetConfig,
    ModelDemand,
    Profile,
    ServiceCurve,
    ServingConfigChooser,
    ServingTable,
    SessionChoice,
)
from opml_inference_router.routing.uds_replica import UdsReplica
from opml_inference_router.runtime.perfsample import measure
from opml_inference_router.runtime.profiler import synthetic_inputs
from opml_inference_router.runtime.session import thread_share
from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
from opml_inference_router_contract.model_config import ModelConfig

FLEET = {"pool_kinds": [
    {"name": "cpu", "precisions": ["fp32"], "memory_mib": 4096, "slots": 1, "cost_per_hour": 0.4,
     "execution_provider": "CPUExecutionProvider"},
    {"name": "accel", "precisions": ["int8"], "memory_mib": 4096, "slots": 1, "cost_per_hour": 0.2,
     "execution_provider": "CPUExecutionProvider", "batch_sizes": [1, 8, 32]}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}, {"name": "accel", "kind": "accel", "workers": 1}],
    "min_replicas": 1}
OWN, TRANSFER = 20, 5  # the router's minimum for a kind's own model; a few target samples to transfer with


def chooser(fleet: Fleet, slot: int, table: ServingTable | None, min_gain: float = 0.05) -> ServingConfigChooser:
    return ServingConfigChooser(fleet=fleet, policy=CostAwareSloPolicy(), slot_threads=lambda kind: slot,
                                tables=lambda model, kind: table, min_gain=min_gain)


def table_of(samples: list[Sample], basis: str) -> ServingTable:
    return ServingTable({s.config: s.latency_ms for s in samples}, basis)


async def closed_loop(address: str, request: bytes, clients: int, seconds: float) -> tuple[float, float]:
    """Rows per second and p99 (ms) of ``clients`` callers each sending the next request on a reply."""
    replica = UdsReplica(address)
    try:
        async def run(until: float, out: list[float]) -> None:
            while time.perf_counter() < until:
                start = time.perf_counter()
                await replica.call("ModelInfer", request, timeout_s=30.0)
                out.append((time.perf_counter() - start) * 1000.0)

        warm: list[float] = []
        await asyncio.gather(*(run(time.perf_counter() + 1.0, warm) for _ in range(clients)))
        latencies: list[float] = []
        start = time.perf_counter()
        await asyncio.gather(*(run(start + seconds, latencies) for _ in range(clients)))
        elapsed = time.perf_counter() - start
    finally:
        await replica.close()
    return len(latencies) / elapsed, float(np.percentile(latencies, 99))


def label(session: SessionChoice, cap: int) -> str:
    return f"{session.threads}t/{session.opt_level}/{session.execution_mode}/b{cap}"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="8,32", help="closed-loop loads: clients, comma-separated")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()
    loads = [int(n) for n in args.clients.split(",")]
    from opml_inference_router.worker import WorkerProcess  # after argparse: --help stays fast

    fleet = Fleet(FleetConfig.model_validate(FLEET))
    slot = thread_share(fleet.kinds["cpu"])  # a slot's share of the cores, as the worker's default
    print(f"cores {os.cpu_count()}, affinity {sorted(os.sched_getaffinity(0))}, load {os.getloadavg()}, "
          f"slot threads {slot}; model MLP 64-{'-'.join([str(args.width)] * args.depth)}-4; {args.clients} "
          f"closed-loop clients of one row, {args.seconds:g} s x {args.rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="opml-serving-config-") as scratch:
        root = Path(scratch)
        (root / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
        document = mlp_config("mlp", features=64, pool_kinds=("cpu", "accel"), precisions=("fp32", "int8"))
        write_model_dir(root / "models" / "mlp", document, mlp_classifier(features=64, width=args.width, depth=args.depth))
        config = ModelConfig.from_dict(document)
        demand = ModelDemand(config, 1, config.expected_rate_rps)
        workers = {kind: WorkerProcess(kind, root / "fleet.yaml", root / f"{kind}.log", models_dir=root / "models",
                                       uds=root / f"{kind}.sock").start() for kind in ("cpu", "accel")}
        try:
            measured: dict[str, list[Sample]] = {}
            profiles: dict[str, Profile] = {}
            for kind, worker in workers.items():
                client = WorkerClient(worker.target)
                await client.load("mlp", path=root / "models" / "mlp", version=1, profile=True)
                executed = await client.profile("mlp", 1)
                replica = UdsReplica(worker.uds_target)
                entry = VersionRecord(1, Source(model_dir=str(root / "models" / "mlp")), str(root / "models" / "mlp"))
                # what the router plans on: the request path's batch times, at the worker's defaults
                profiles[kind] = await request_path_profile(replica, client, config, entry, executed)
                await replica.close()
                await client.close()
                candidates = chooser(fleet, slot, None).candidates(demand, fleet.kinds[kind])
                started = time.perf_counter()
                measured[kind] = await asyncio.to_thread(measure, root / "models" / "mlp" / "model.onnx", config,
                                                         fleet.kinds[kind], candidates)
                print(f"{kind}: measured {len(candidates)} configurations in {time.perf_counter() - started:.0f} s")

            chosen: dict[str, dict[str, tuple[SessionChoice, int]]] = {k: {} for k in workers}
            for kind in workers:
                chosen[kind]["default"] = _placed(fleet, slot, None, demand, kind, profiles[kind])
                chosen[kind]["measured best"] = _placed(fleet, slot, table_of(measured[kind], "all measured"), demand,
                                                        kind, profiles[kind], min_gain=0.0)
            for seed in range(args.seeds):
                rng = random.Random(seed)
                cpu_few = rng.sample(measured["cpu"], OWN)
                source = PerformanceModel(environment="cpu", seed=seed).fit(cpu_few)
                accel_few = rng.sample(measured["accel"], TRANSFER)
                models = {"cpu": source, "accel": ScaleShift(source).fit(accel_few)}
                for kind, model in models.items():
                    points = [Sample("mlp", s.mflop_per_row, s.config) for s in measured[kind]]
                    predicted = [Sample("mlp", p.mflop_per_row, p.config, float(ms))
                                 for p, ms in zip(points, model.predict_ms(points), strict=True)]
                    chosen[kind][f"predicted (seed {seed})"] = _placed(
                        fleet, slot, table_of(predicted, f"seed {seed}"), demand, kind, profiles[kind])

            results: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
            for kind, worker in workers.items():
                client = WorkerClient(worker.target)
                request = encode_request("mlp", synthetic_inputs(config, 1, np.random.default_rng(0)),
                                         version="1").SerializeToString()
                distinct = sorted({label(*c) for c in chosen[kind].values()})
                by_label = {label(*c): c for c in chosen[kind].values()}
                for round_ in range(args.rounds):
                    for name in distinct if round_ % 2 == 0 else reversed(distinct):
                        session, cap = by_label[name]
                        await client.load("mlp", path=root / "models" / "mlp", version=1, instances=1,
                                          max_batch=cap, session=session)
                        for clients in loads:
                            results.setdefault((kind, name, clients), []).append(
                                await closed_loop(worker.uds_target, request, clients, args.seconds))
                await client.close()
        finally:
            for worker in workers.values():
                worker.stop()

    print(f"\nload after: {os.getloadavg()}")
    for kind in ("cpu", "accel"):
        print(f"\n{kind} (profile at the defaults: "
              f"{ {n: round(ms, 3) for n, ms in profiles[kind].batch_latency_ms.items()} } ms)")
        by = {(c.config.threads, c.config.opt_level, c.config.execution_mode, c.config.batch): c.latency_ms
              for c in measured[kind]}
        sizes = sorted(profiles[kind].batch_latency_ms)
        mid = sizes[len(sizes) // 2]
        print(f"  measured ms per batch of {sizes[0]} / {mid} / {sizes[-1]} rows (perfsample): " + "; ".join(
            f"{t}t/{level}/{mode} {by[t, level, mode, sizes[0]]:.2f}/{by[t, level, mode, mid]:.2f}/"
            f"{by[t, level, mode, sizes[-1]]:.2f}"
            for t, level, mode in sorted({key[:3] for key in by})))
        capacities = {what: measured_capacity(fleet, kind, demand, profiles[kind], measured[kind], *c)
                      for what, c in chosen[kind].items()}
        print("  by the measured grid (placement's latency model, rate within 0.9 x SLO):")
        for what, (session, cap) in chosen[kind].items():
            print(f"    {what:19} {label(session, cap):28} {capacities[what]:7.0f} rows/s "
                  f"({capacities[what] / capacities['measured best']:6.1%})")
        for clients in loads:
            medians = {what: (statistics.median(r for r, _ in results[kind, label(*c), clients]),
                              statistics.median(p for _, p in results[kind, label(*c), clients]))
                       for what, c in chosen[kind].items()}
            best_rps, best_p99 = medians["measured best"]
            print(f"  {clients} clients:")
            for what, (session, cap) in chosen[kind].items():
                rps, p99 = medians[what]
                runs = results[kind, label(session, cap), clients]
                print(f"    {what:19} {label(session, cap):28} {rps:7.0f} rows/s ({rps / best_rps:6.1%})  "
                      f"p99 {p99:6.2f} ms ({p99 / best_p99:5.2f}x)  rounds {', '.join(f'{r:.0f}' for r, _ in runs)}")
    return 0


def _placed(fleet: Fleet, slot: int, table: ServingTable | None, demand: ModelDemand, kind: str,
            profile: Profile, min_gain: float = 0.05) -> tuple[SessionChoice, int]:
    """The session options and batch cap placement gives the model on ``kind`` with ``table``
    (the measured best: with no margin for the defaults)."""
    adjusted, session = chooser(fleet, slot, table, min_gain).choose(demand, fleet.kinds[kind], profile)
    option = CostAwareSloPolicy().options(demand, {kind: adjusted}, fleet)[0]
    return session, option.max_batch


def measured_capacity(fleet: Fleet, kind: str, demand: ModelDemand, profile: Profile, measured: list[Sample],
                      session: SessionChoice, cap: int) -> float:
    """The rate one replica of ``session`` and batch cap ``cap`` takes within 0.9 x the SLO by the
    placement's latency model on the profile the exhaustive measurements give it (profile x
    measured(session) / measured(defaults)): the chooser's own criterion, on measurements."""
    by = {s.config: s.latency_ms for s in measured}
    slot, latencies, running = fleet.kinds[kind], {}, 0.0
    precision = profile.precision
    for n in sorted(profile.batch_latency_ms):
        ratio = (by[ServingConfig(n, session.threads, session.opt_level, session.execution_mode, precision)]
                 / by[ServingConfig(n, thread_share(slot), "all", "sequential", precision)])
        running = latencies[n] = max(running, profile.batch_latency_ms[n] * ratio)
    service = ServiceCurve(Profile(profile.model, kind, precision, latencies, profile.memory_mib), slot)
    return BatchQueueModel().max_rate_rps(service, Batching(cap, demand.config.queue_delay_ms),
                                          0.9 * demand.config.slo.p99_ms)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
