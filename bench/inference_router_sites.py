"""Inference-router across sites: what a slow edge link costs, and what placement with sites costs.

1. **Deploy to an edge site.** A router (its own site: one worker), a cloud host next door (a plain
   veth) and an edge host behind 10 Mbit/s, 25 ms each way and 1% loss (network namespaces and the
   userspace wire of ``opml_devstack.testing.netem``), each host a real agent with a real worker. One
   model (``--mb`` MB of weights) is deployed with three replicas, one per site; the router's own
   metrics give the bytes each site received and the seconds they took. Baseline: the cloud host.
2. **p99 at the edge.** From inside the edge site, ``--requests`` one-row requests to the edge
   agent's own KServe front, then as many to the router across the link: as they come (the router
   answers from the nearest site, its own worker), then naming the edge as their site (the edge's
   replica answers, so each crosses the link twice). Then from the router's machine (the cloud
   side), as they come and naming the edge. The router's ``site_answers_total`` says where each
   row was answered. Baseline: a client at the edge through the router.
3. **Placement decisions per second** with ``--hosts`` simulated hosts in ``--sites`` sites (measured
   links from 0.2 to 80 ms, 1000 to 10 Mbit/s) and ``--models`` models, the real Planner with the site
   rule and nearest-first ranking; baseline: the same Planner and fleet without sites.

Needs root and iproute2 (parts 1-2), and the embedded infrastructure (``bench/_stack.py``).

    sudo .venv/bin/python bench/inference_router_sites.py
    .venv/bin/python bench/inference_router_sites.py --placement-only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from opml_inference_router.placement import (  # noqa: E402
    CostAwareSloPolicy,
    Fleet,
    FleetConfig,
    Link,
    ModelDemand,
    Planner,
    PoolConfig,
    PoolKind,
    Profile,
    ProfileBook,
    SiteRule,
    site_distance,
)
from opml_inference_router_contract.model_config import ModelConfig  # noqa: E402

KIND = {"name": "cpu", "precisions": ["fp32"], "memory_mib": 8192, "slots": 2, "cost_per_hour": 0.4,
        "execution_provider": "CPUExecutionProvider"}
FLEET = {"pool_kinds": [KIND], "pools": [
    {"name": "cpu", "kind": "cpu", "workers": 1},
    {"name": "cloud", "kind": "cpu", "workers": 1, "site": "cloud"},
    {"name": "edge", "kind": "cpu", "workers": 1, "site": "edge"}]}
EDGE_LINK = {"rate_mbit": 10, "delay_ms": 25, "loss": 0.01}
AGENT_PORT = 8500

LATENCY_PROGRAM = """
import json, sys, time
import numpy as np
import tritonclient.grpc as triton
target, count, token, site = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
seconds = []
with triton.InferenceServerClient(target) as client:
    deadline = time.monotonic() + 60  # the agent routes what its workers serve from its next heartbeat on
    while not client.is_model_ready("sites", headers={"authorization": f"Bearer {token}"}):
        if time.monotonic() > deadline:
            raise SystemExit(f"{target} does not serve the model")
        time.sleep(0.05)
    tensor = triton.InferInput("features", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
    for index in range(count + 20):
        began = time.perf_counter()
        client.infer("sites", [tensor], client_timeout=10.0, headers={"authorization": f"Bearer {token}"},
                     parameters={"site": site} if site else None)
        if index >= 20:
            seconds.append(time.perf_counter() - began)
seconds.sort()
print(json.dumps({"p50": seconds[len(seconds) // 2], "p99": seconds[int(len(seconds) * 0.99) - 1]}))
"""


def metric(port: int, name: str, **labels: str) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    wanted = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    for line in page.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def answers(port: int, site: str) -> float:
    """Requests of the bench's model the router answered from a replica at ``site``."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("opml_inference_router_site_answers_total{") and 'model="sites"' in line
               and f'site="{site}"' in line)


def wait(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def sites_part(args: argparse.Namespace) -> None:
    from _stack import bench_services

    from opml_devstack.testing.netem import emulated_hosts
    from opml_devstack.testing.relay import TcpRelay
    from opml_devstack.testing.services import TOKENS
    from opml_inference_router.testing import mlp_classifier, mlp_config, write_model_dir
    from opml_inference_router_contract.client import DeploymentClient

    with bench_services() as (starter, workdir), emulated_hosts([{}, EDGE_LINK]) as (cloud, edge):
        fleet = workdir / "fleet.yaml"
        fleet.write_text(yaml.safe_dump(FLEET))
        env = starter.env("inference-router", extra_env={
            "OPML_INFERENCE_ROUTER_FLEET": str(fleet), "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1",
            "OPML_INFERENCE_ROUTER_HOST_TOKENS": "bench-host", "OPML_INFERENCE_ROUTER_REPLAN_INTERVAL_S": "0",
            "OPML_INFERENCE_ROUTER_AUTODEPLOY": "false"})
        router = starter("inference-router", env=env)
        metrics_port = int(env["OPML_INFERENCE_ROUTER_METRICS_PORT"])
        agents = []
        with TcpRelay(("127.0.0.1", int(router.target.rsplit(":", 1)[1]))) as relay:
            try:
                for host, pool in ((cloud, "cloud"), (edge, "edge")):
                    agent_env = {**os.environ, "OPML_AUTH_TOKENS": ",".join(f"{t}={r}" for r, t in TOKENS.items()),
                                 "OPML_LOG_FORMAT": "text", "OPML_INFERENCE_HOST_NAME": pool,
                                 "OPML_INFERENCE_HOST_ROUTER_TARGET": f"{host.gateway}:{relay.listen(host.gateway)}",
                                 "OPML_INFERENCE_HOST_TOKEN": "bench-host", "OPML_INFERENCE_HOST_FLEET": str(fleet),
                                 "OPML_INFERENCE_HOST_POOLS": pool, "OPML_INFERENCE_HOST_HOST": "0.0.0.0",
                                 "OPML_INFERENCE_HOST_ADVERTISE": host.address,
                                 "OPML_INFERENCE_HOST_GRPC_PORT": str(AGENT_PORT),
                                 "OPML_INFERENCE_HOST_METRICS_PORT": "0",
                                 "OPML_INFERENCE_HOST_HOME": str(workdir / pool),
                                 "OPML_INFERENCE_HOST_WORKER_THREADS_PER_REPLICA": "1"}
                    agent = subprocess.Popen(host.exec(sys.executable, "-m", "opml_inference_router.host"),
                                             env=agent_env, stdout=subprocess.PIPE,
                                             stderr=(workdir / f"{pool}.log").open("w"), text=True)
                    agents.append(agent)
                    ready, _, _ = select.select([agent.stdout], [], [], 120)
                    if not ready or not agent.stdout.readline():
                        raise SystemExit(f"agent {pool} did not register: {(workdir / f'{pool}.log').read_text()}")
                with DeploymentClient(router.target, token=TOKENS["reader"]) as client:
                    wait(lambda: all(w.alive for w in client.placement().workers), "every host's worker serving")
                wait(lambda: all(metric(metrics_port, "opml_inference_router_site_rtt_ms", site=s) == metric(
                    metrics_port, "opml_inference_router_site_rtt_ms", site=s) for s in ("cloud", "edge")),
                    "both links measured")
                width = int((args.mb * 1e6 / 4) ** 0.5)  # a width x width layer dominates the weights
                config = {**mlp_config("sites", pool_kinds=("cpu",), precisions=("fp32",), p99_ms=200.0),
                          "min_replicas": 3}
                model = write_model_dir(workdir / "sites", config, mlp_classifier(width=width))
                size = sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
                began = time.monotonic()
                with DeploymentClient(router.target, token=TOKENS["writer"]) as client:
                    deployment = client.deploy(model_dir=str(model))
                deploy_s = time.monotonic() - began
                sites = sorted({r.worker.split("-")[0] for v in deployment.versions for r in v.replicas})
                moved = {s: (metric(metrics_port, "opml_inference_router_host_bundle_bytes_total", site=s),
                             metric(metrics_port, "opml_inference_router_host_bundle_seconds_sum", site=s))
                         for s in ("cloud", "edge")}
                print(f"\n## Deploy to an edge site ({size / 1e6:.1f} MB bundle, replicas on {', '.join(sites)}; "
                      f"the whole deploy {deploy_s:.1f} s)\n")
                print("| site | link | bytes moved | seconds | MB/s | x cloud |\n|---|---|---|---|---|---|")
                for site, link in (("cloud", "veth"), ("edge", "10 Mbit/s, 2 x 25 ms, 1% loss")):
                    sent, seconds = moved[site]
                    print(f"| {site} | {link} | {sent:.0f} | {seconds:.2f} | {sent / seconds / 1e6:.2f} "
                          f"| {seconds / moved['cloud'][1]:.1f} |")
                at_router = f"{edge.gateway}:{relay.listen(edge.gateway)}"
                rows = (("at the edge", "its site's agent", f"127.0.0.1:{AGENT_PORT}", "", edge),
                        ("at the edge", "through the router (nearest site)", at_router, "", edge),
                        ("at the edge", "through the router, naming site edge", at_router, "edge", edge),
                        ("at the router", "through the router (nearest site)", router.target, "", None),
                        ("at the router", "through the router, naming site edge", router.target, "edge", None))
                latency = {}
                for client_at, path, target, site, namespace in rows:
                    before = {s: answers(metrics_port, s) for s in ("local", "cloud", "edge")}
                    command = [sys.executable, "-c", LATENCY_PROGRAM, target, str(args.requests), TOKENS["writer"],
                               site]
                    out = subprocess.run(namespace.exec(*command) if namespace is not None else command,
                                         capture_output=True, text=True, timeout=600)
                    if out.returncode:
                        raise SystemExit(out.stderr)
                    where = {s: answers(metrics_port, s) - before[s] for s in before}
                    latency[(client_at, path)] = (json.loads(out.stdout), where)
                base = latency[("at the edge", "through the router (nearest site)")][0]["p99"]
                print(f"\n## p99 by where the client is and where it is answered ({args.requests} one-row requests "
                      f"each; load average {os.getloadavg()[0]:.1f})\n")
                print("| client | path | answered at (router's count) | p50 ms | p99 ms | p99 / edge through the router |"
                      "\n|---|---|---|---|---|---|")
                for (client_at, path), (seen, where) in latency.items():
                    answered = ", ".join(f"{s} {n:.0f}" for s, n in where.items() if n) or "the edge's agent"
                    print(f"| {client_at} | {path} | {answered} | {seen['p50'] * 1000:.1f} | {seen['p99'] * 1000:.1f} "
                          f"| {seen['p99'] / base:.2f} |")
            finally:
                for agent in agents:
                    agent.terminate()
                for agent in agents:
                    try:
                        agent.wait(20)
                    except subprocess.TimeoutExpired:
                        agent.kill()
                        agent.wait()


def placement_part(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    kind = PoolKind(name="cpu", precisions=("fp32",), memory_mib=65536, slots=16, cost_per_hour=1.6,
                    execution_provider="CPUExecutionProvider")
    per_site = args.hosts // args.sites
    pools = tuple(PoolConfig(name=f"site{s}", kind="cpu", workers=per_site, site=f"site{s}") for s in range(args.sites))
    fleet = Fleet(FleetConfig(pool_kinds=(kind,), pools=pools, min_replicas=2))
    links = {f"site{s}": Link(rtt_ms=0.2 + 80 * s / (args.sites - 1), bandwidth_mbps=1000 / (1 + 10 * s))
             for s in range(args.sites)}
    demands, profiles, sizes = [], [], {}
    for index in range(args.models):
        slo = rng.choice((25.0, 50.0, 100.0, 200.0))
        config = ModelConfig.from_dict({
            "name": f"m{index}", "max_batch_size": 16, "inputs": [{"name": "x", "data_type": "fp32", "dims": [16]}],
            "outputs": [{"name": "y", "data_type": "fp32", "dims": [4]}], "dynamic_batching": {"max_queue_delay_us": 1000},
            "slo": {"p99_ms": slo}, "expected_rate_rps": rng.uniform(10, 400), "pool_kinds": ["cpu"]})
        demand = ModelDemand(config, 1, config.expected_rate_rps)
        demands.append(demand)
        base = rng.uniform(0.5, 4.0)
        profiles.append(Profile(demand.model, "cpu", "fp32", {n: base + 0.3 * base * n for n in (1, 2, 4, 8, 16)},
                                rng.uniform(100, 2000)))
        sizes[demand.model] = int(rng.lognormvariate(17, 1.2))  # median ~24 MB
    book = ProfileBook(profiles)
    rule = SiteRule()
    with_sites = Planner(fleet=fleet, policy=CostAwareSloPolicy(site_rtt_ms=site_distance(links)),
                         usable=lambda want, worker: rule.refusal(want.config, sizes[want.model], worker.site,
                                                                  links.get(worker.site)))
    without = Planner(fleet=fleet, policy=CostAwareSloPolicy())
    results = {}
    for name, planner in (("without sites (baseline)", without), ("with sites", with_sites)):
        timings = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            plan = planner.plan(demands, book)
            timings.append(time.perf_counter() - began)
        best = min(timings)
        by_model = {demand.model: demand for demand in demands}
        refused = sum(1 for model, placed in plan.placements.items() for worker in placed.workers
                      if with_sites.usable(by_model[model], fleet.worker(worker)))
        far = refused
        results[name] = (best, len(plan.placements), len(plan.unplaced), far)
    base = results["without sites (baseline)"][0]
    print(f"\n## Placement decisions per second ({args.hosts} hosts in {args.sites} sites, {args.models} models, "
          f"best of {args.repeats}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores)\n")
    print("| planner | plan s | decisions/s | placed | unplaced | replicas the site rule refuses | time x baseline |\n"
          "|---|---|---|---|---|---|---|")
    for name, (seconds, placed, unplaced, far) in results.items():
        print(f"| {name} | {seconds:.3f} | {args.models / seconds:,.0f} | {placed} | {unplaced} | {far} "
              f"| {seconds / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=4.0, help="model weights, MB")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--hosts", type=int, default=50)
    parser.add_argument("--sites", type=int, default=10)
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--placement-only", action="store_true")
    args = parser.parse_args()
    if not args.placement_only:
        sites_part(args)
    placement_part(args)


if __name__ == "__main__":
    main()
