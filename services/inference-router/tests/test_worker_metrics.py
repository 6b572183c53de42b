"""The workers' metrics re-exported on the router's registry: merged per family with worker and pool_kind
labels, no name exported twice, a worker that does not answer skipped and counted; over real HTTP and
over a real PoolManager's worker process."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from opml_common.metrics import ServiceMetrics, serve_metrics
from opml_inference_router.control import PoolManager
from opml_inference_router.control.worker_metrics import (
    WorkerEndpoint,
    WorkerMetricsCollector,
    pool_endpoints,
    register_worker_metrics,
)
from opml_inference_router.placement import FleetConfig
from opml_inference_router.runtime import WorkerMetrics


def _router() -> ServiceMetrics:
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    metrics.counter("worker_restarts_total", "as the PoolManager registers it", ("worker",))  # the router's own
    metrics.counter("requests_total", "a router family", ("model",))
    return metrics


def _worker_page(model: str, batches: int, *, extra: str = "") -> str:
    """A worker's /metrics page, made by the worker's own metric definitions."""
    metrics = ServiceMetrics("inference-router-worker", registry=CollectorRegistry())
    worker = WorkerMetrics(metrics)
    replica = worker.for_replica(model, 1)
    for _ in range(batches):
        replica.batch_size.observe(4)
    metrics.gauge("no_samples_yet", "declared, not set", ("model",))
    return generate_latest(metrics.registry).decode() + extra


def _families(registry: CollectorRegistry) -> dict[str, object]:
    text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    names = [family.name for family in families]
    assert len(names) == len(set(names)), f"a family is exported twice: {sorted(names)}"
    return {family.name: family for family in families}


def _value(family, sample_name: str, **labels: str) -> float:
    [value] = [s.value for s in family.samples if s.name == sample_name and
               all(s.labels.get(k) == v for k, v in labels.items())]
    return value


def test_worker_families_are_merged_with_worker_and_pool_kind_labels() -> None:
    metrics = _router()
    endpoints = [WorkerEndpoint("cpu-000", "cpu", "http://a/metrics"), WorkerEndpoint("acc-000", "accel", "http://b/metrics")]
    pages = {"http://a/metrics": _worker_page("m", 2), "http://b/metrics": _worker_page("m", 3)}
    WorkerMetricsCollector(lambda: endpoints, metrics, fetch=lambda url, timeout: pages[url]).register()

    families = _families(metrics.registry)
    batch = families["opml_inference_router_worker_batch_size"]
    assert batch.type == "histogram"
    assert _value(batch, "opml_inference_router_worker_batch_size_count", worker="cpu-000", pool_kind="cpu") == 2
    assert _value(batch, "opml_inference_router_worker_batch_size_count", worker="acc-000", pool_kind="accel") == 3
    assert {s.labels["model"] for s in batch.samples} == {"m"}
    assert "opml_inference_router_worker_no_samples_yet" in families  # declared families stay visible
    assert "opml_inference_router_requests" in families  # the router's own are untouched


def test_only_the_worker_namespace_is_re_exported_and_never_a_name_the_router_owns() -> None:
    metrics = _router()
    clash = ("# HELP opml_inference_router_worker_restarts_total a worker's own idea of it\n"
             "# TYPE opml_inference_router_worker_restarts_total counter\n"
             'opml_inference_router_worker_restarts_total{worker="x"} 99.0\n')
    page = _worker_page("m", 1, extra=clash)
    assert "process_cpu_seconds_total" in generate_latest().decode()  # what a worker's default registry has
    page += generate_latest().decode()  # process_* and python_* of a real default registry
    WorkerMetricsCollector(lambda: [WorkerEndpoint("cpu-000", "cpu", "u")], metrics,
                           fetch=lambda url, timeout: page).register()

    families = _families(metrics.registry)
    reexported = {name for name, family in families.items()
                  if any(s.labels.get("worker") == "cpu-000" and "pool_kind" in s.labels for s in family.samples)}
    assert reexported and all(name.startswith("opml_inference_router_worker_") for name in reexported)
    assert not any(name.startswith(("process_", "python_")) for name in families)
    assert not any(name.endswith("_created") for name in reexported)
    restarts = families["opml_inference_router_worker_restarts"]
    assert restarts.samples == [] or all(s.value != 99.0 for s in restarts.samples)


def test_a_worker_that_does_not_answer_is_skipped_and_counted() -> None:
    metrics = _router()
    endpoints = [WorkerEndpoint("cpu-000", "cpu", "good"), WorkerEndpoint("cpu-001", "cpu", "bad"),
                 WorkerEndpoint("cpu-002", "cpu", "garbled")]

    def fetch(url: str, timeout: float) -> str:
        if url == "bad":
            raise TimeoutError("timed out")
        return "this is { not an exposition\n" if url == "garbled" else _worker_page("m", 1)

    WorkerMetricsCollector(lambda: endpoints, metrics, fetch=fetch,
                           known_workers=["cpu-000", "cpu-001", "cpu-002", "cpu-003"]).register()
    families = _families(metrics.registry)
    errors = families["opml_inference_router_worker_scrape_errors"]
    assert _value(errors, "opml_inference_router_worker_scrape_errors_total", worker="cpu-001") == 1
    assert _value(errors, "opml_inference_router_worker_scrape_errors_total", worker="cpu-002") == 1
    assert _value(errors, "opml_inference_router_worker_scrape_errors_total", worker="cpu-003") == 0  # from 0
    workers = {s.labels["worker"] for s in families["opml_inference_router_worker_batch_size"].samples}
    assert workers == {"cpu-000"}


def test_a_label_the_worker_already_has_is_kept_as_exported() -> None:
    metrics = _router()
    page = ("# HELP opml_inference_router_worker_thing a gauge\n# TYPE opml_inference_router_worker_thing gauge\n"
            'opml_inference_router_worker_thing{worker="inner",pool_kind="k"} 1.0\n')
    WorkerMetricsCollector(lambda: [WorkerEndpoint("cpu-000", "cpu", "u")], metrics,
                           fetch=lambda url, timeout: page).register()
    [sample] = _families(metrics.registry)["opml_inference_router_worker_thing"].samples
    assert sample.labels == {"worker": "cpu-000", "pool_kind": "cpu", "exported_worker": "inner",
                             "exported_pool_kind": "k"}


async def test_on_the_event_loop_it_reads_no_worker() -> None:
    """The router's Observer reads the registry on its loop: that must never block on a worker."""
    metrics = _router()
    calls = []
    WorkerMetricsCollector(lambda: [WorkerEndpoint("cpu-000", "cpu", "u")], metrics,
                           fetch=lambda url, timeout: calls.append(url) or _worker_page("m", 1)).register()
    assert "opml_inference_router_worker_batch_size" not in _families(metrics.registry) and calls == []
    assert "opml_inference_router_worker_batch_size" in await asyncio.to_thread(_families, metrics.registry)


def test_over_http_a_silent_worker_costs_one_timeout_and_the_rest_still_come() -> None:
    worker = ServiceMetrics("inference-router-worker", registry=CollectorRegistry())
    WorkerMetrics(worker).for_replica("m", 1).batch_size.observe(2)
    port = serve_metrics("127.0.0.1", 0, worker.registry)
    with socket.socket() as silent:  # accepts connections (backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoints = [WorkerEndpoint("cpu-000", "cpu", f"http://127.0.0.1:{port}/metrics"),
                     WorkerEndpoint("cpu-001", "cpu", f"http://127.0.0.1:{silent.getsockname()[1]}/metrics")]
        metrics = _router()
        WorkerMetricsCollector(lambda: endpoints, metrics, timeout_s=0.5).register()
        families = _families(metrics.registry)  # without the timeout this never returns (the suite's own timeout)
    assert {s.labels["worker"] for s in families["opml_inference_router_worker_batch_size"].samples} == {"cpu-000"}
    errors = families["opml_inference_router_worker_scrape_errors"]
    assert _value(errors, "opml_inference_router_worker_scrape_errors_total", worker="cpu-001") == 1


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        WorkerMetricsCollector(list, _router(), timeout_s=0)
    with pytest.raises(ValueError, match="max_parallel"):
        WorkerMetricsCollector(list, _router(), max_parallel=0)


FLEET = {"pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 1024, "slots": 1,
                         "cost_per_hour": 0.1, "execution_provider": "CPUExecutionProvider"}],
         "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}]}


async def test_a_real_pool_workers_metrics_come_through_the_routers_registry(tmp_path: Path) -> None:
    fleet_path = tmp_path / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(FLEET))
    metrics = ServiceMetrics("inference-router", registry=CollectorRegistry())
    pools = PoolManager(FleetConfig.from_dict(FLEET), fleet_path, work_dir=tmp_path, metrics=metrics,
                        token="worker-secret", threads_per_replica=1, providers=["CPUExecutionProvider"],
                        route_over_uds=True)
    register_worker_metrics(pools, metrics)
    assert pool_endpoints(pools)() == []  # not started: nothing to read, nothing counted as failed
    async with pools:
        [pool_worker] = pools.workers()
        [endpoint] = pool_endpoints(pools)()
        assert endpoint == WorkerEndpoint("cpu-000", "cpu", f"http://127.0.0.1:{pool_worker.process.metrics_port}/metrics")
        families = await asyncio.to_thread(_families, metrics.registry)
        grpc = families["opml_inference_router_worker_grpc_requests"]
        assert grpc.type == "counter" and {s.labels["worker"] for s in grpc.samples} == {"cpu-000"}
        assert "opml_inference_router_worker_uds_requests" in families
        assert "opml_inference_router_workers_alive" in families  # the router's own, unchanged
        errors = families["opml_inference_router_worker_scrape_errors"]
        assert _value(errors, "opml_inference_router_worker_scrape_errors_total", worker="cpu-000") == 0
