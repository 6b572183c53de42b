"""Model and fleet configuration: valid documents load; each bad field is named by its path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from opml_common.errors import InvalidArgument, NotFound
from opml_inference_router.placement import Fleet, FleetConfig, demands_for, load_fleet_config
from opml_inference_router_contract.model_config import ModelConfig, load_model_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

MODEL = {
    "name": "ranker",
    "max_batch_size": 16,
    "inputs": [{"name": "features", "data_type": "fp32", "dims": [-1, 64]}],
    "outputs": [{"name": "scores", "data_type": "fp32", "dims": [8]}],
    "dynamic_batching": {"max_queue_delay_us": 1000},
    "slo": {"p99_ms": 20.0},
    "expected_rate_rps": 250,
    "pool_kinds": ["cpu", "accel"],
    "precisions": ["fp32", "int8"],
}

FLEET = {
    "pool_kinds": [
        {"name": "cpu", "precisions": ["fp32"], "memory_mib": 65536, "slots": 16, "cost_per_hour": 1.6,
         "execution_provider": "CPUExecutionProvider"},
        {"name": "accel", "precisions": ["int8"], "memory_mib": 16384, "slots": 4, "cost_per_hour": 1.0,
         "execution_provider": "VitisAIExecutionProvider", "batch_sizes": [1, 8, 32]},
    ],
    "pools": [{"name": "cpu-a", "kind": "cpu", "workers": 3}, {"name": "accel-a", "kind": "accel", "workers": 2}],
}


def changed(document: dict, path: list, value=None, *, delete: bool = False) -> dict:
    document = copy.deepcopy(document)
    target = document
    for part in path[:-1]:
        target = target[part]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return document


def test_the_readme_examples_load() -> None:
    model = load_model_config(EXAMPLES / "model.yaml")
    fleet = Fleet(load_fleet_config(EXAMPLES / "fleet.yaml"))
    assert model.batch_limit == 32 and model.queue_delay_ms == 2.0 and "int8" in model.precisions
    assert {kind for kind in fleet.kinds} == {"cpu", "gpu", "accel"}
    assert len(fleet.workers) == 18


def test_defaults_are_the_documented_ones() -> None:
    bare = changed(changed(MODEL, ["precisions"], delete=True), ["dynamic_batching"], delete=True)
    config = ModelConfig.from_dict(bare)
    assert config.precisions == ("fp32",)
    assert config.batch_limit == 1 and config.queue_delay_ms == 0.0  # no dynamic batching: one request per batch
    assert config.version_policy.select([1, 3, 2]) == (3,)
    assert config.default_timeout_ms is None  # the router's default: 4 x slo.p99_ms
    assert ModelConfig.from_dict(changed(MODEL, ["default_timeout_ms"], 2000)).default_timeout_ms == 2000.0


@pytest.mark.parametrize(
    ("path", "value", "field", "fragment"),
    [
        (["inputs", 0, "dims", 1], 0, "inputs[0].dims[1]", "-1 for a dynamic size, but got 0"),
        (["inputs", 0, "data_type"], "float32", "inputs[0].data_type", "but got 'float32'"),
        (["precisions", 1], "int4", "precisions[1]", "'fp32', 'fp16', 'bf16' or 'int8', but got 'int4'"),
        (["pool_kinds"], ["cpu", "cpu"], "pool_kinds[1]", "unique, but 'cpu' appears twice"),
        (["pool_kinds"], [], "pool_kinds", "at least 1 item"),
        (["pool_kinds", 0], "CPU!", "pool_kinds[0]", "must match pattern"),
        (["max_batch_size"], 0, "dynamic_batching", "needs max_batch_size >= 1"),
        (["max_batch_size"], -2, "max_batch_size", "greater than or equal to 0, but got -2"),
        (["slo", "p99_ms"], 0, "slo.p99_ms", "greater than 0, but got 0"),
        (["expected_rate_rps"], "fast", "expected_rate_rps", "valid number, but got 'fast'"),
        (["expected_rate_rps"], True, "expected_rate_rps", "but got True"),
        (["dynamic_batching", "max_queue_delay_us"], -1, "dynamic_batching.max_queue_delay_us", "but got -1"),
        (["outputs"], [{"name": "s", "data_type": "fp32"}, {"name": "s", "data_type": "fp32"}], "outputs[1].name",
         "'s' appears twice"),
        (["version_policy"], {"latest": {"num_versions": 1}, "all": {}}, "version_policy",
         "exactly one of latest, all, specific"),
        (["version_policy"], {"specific": {"versions": [2, 2]}}, "version_policy.specific.versions[1]",
         "appears twice"),
        (["default_timeout_ms"], 0, "default_timeout_ms", "greater than 0, but got 0"),
        (["default_timeout_ms"], -200, "default_timeout_ms", "greater than 0, but got -200"),
        (["default_timeout_ms"], "200ms", "default_timeout_ms", "valid number, but got '200ms'"),
        (["default_timeout_ms"], 600_001, "default_timeout_ms", "less than or equal to 600000"),
        (["shape"], [1], "shape", "is not a field"),
    ],
)
def test_a_bad_model_field_is_named_by_its_path(path, value, field, fragment) -> None:
    with pytest.raises(InvalidArgument) as caught:
        ModelConfig.from_dict(changed(MODEL, path, value))
    assert caught.value.field == field
    assert fragment in caught.value.message


def test_a_missing_required_field_is_named() -> None:
    with pytest.raises(InvalidArgument) as caught:
        ModelConfig.from_dict(changed(MODEL, ["slo"], delete=True))
    assert str(caught.value) == "slo: is required"


def test_every_error_is_counted_and_the_first_is_named() -> None:
    with pytest.raises(InvalidArgument) as caught:
        ModelConfig.from_dict(changed(changed(MODEL, ["max_batch_size"], -1), ["name"], ""))
    assert caught.value.field == "name"
    assert "(and 1 more: max_batch_size)" in caught.value.message


def test_a_document_that_is_missing_not_yaml_or_not_a_mapping_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="must be a mapping"):
        ModelConfig.from_dict(["name", "x"])
    bad = tmp_path / "model.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(InvalidArgument, match="not valid YAML") as caught:
        load_model_config(bad)
    assert caught.value.field == str(bad)
    with pytest.raises(NotFound, match="does not exist"):
        load_fleet_config(tmp_path / "missing.yaml")


def test_version_policy_selects_versions() -> None:
    latest_two = ModelConfig.from_dict(changed(MODEL, ["version_policy"], {"latest": {"num_versions": 2}}))
    every = ModelConfig.from_dict(changed(MODEL, ["version_policy"], {"all": {}}))
    pinned = ModelConfig.from_dict(changed(MODEL, ["version_policy"], {"specific": {"versions": [4, 1]}}))
    assert latest_two.version_policy.select([1, 2, 3]) == (2, 3)
    assert every.version_policy.select([3, 1]) == (1, 3)
    assert [d.version for d in demands_for(pinned, [1, 2, 4])] == [1, 4]
    assert all(d.rate_rps == 250 for d in demands_for(pinned, [1, 2, 4]))
    with pytest.raises(NotFound, match=r"versions \[4\] that do not exist"):
        pinned.version_policy.select([1, 2])


def test_pool_kinds_and_pools_come_from_config() -> None:
    fleet = Fleet(FleetConfig.from_dict(FLEET))
    assert [worker.id for worker in fleet.workers] == [
        "cpu-a-000", "cpu-a-001", "cpu-a-002", "accel-a-000", "accel-a-001"]
    accel = fleet.kinds["accel"]
    assert accel.slot_cost_per_hour == 0.25
    assert accel.padded_batch(5) == 8 and accel.padded_batch(32) == 32
    with pytest.raises(InvalidArgument, match="at most 32, but got 33"):
        accel.padded_batch(33)
    assert fleet.kinds["cpu"].padded_batch(5) == 5


@pytest.mark.parametrize(
    ("path", "value", "field", "fragment"),
    [
        (["pools", 1, "kind"], "tpu", "pools[1].kind", "declared pool kind (cpu, accel), but got 'tpu'"),
        (["pools", 1, "name"], "cpu-a", "pools[1].name", "'cpu-a' appears twice"),
        (["pool_kinds", 1, "name"], "cpu", "pool_kinds[1].name", "'cpu' appears twice"),
        (["pool_kinds", 1, "batch_sizes"], [1, 32, 8], "pool_kinds[1].batch_sizes[2]", "8 follows 32"),
        (["pool_kinds", 0, "slots"], 0, "pool_kinds[0].slots", "greater than or equal to 1, but got 0"),
        (["pool_kinds", 0, "execution_provider"], "cpu", "pool_kinds[0].execution_provider", "must match pattern"),
        (["pool_kinds", 0, "precisions"], ["fp64"], "pool_kinds[0].precisions[0]", "but got 'fp64'"),
        (["pools", 0, "workers"], -1, "pools[0].workers", "but got -1"),
    ],
)
def test_a_bad_fleet_field_is_named_by_its_path(path, value, field, fragment) -> None:
    with pytest.raises(InvalidArgument) as caught:
        FleetConfig.from_dict(changed(FLEET, path, value))
    assert caught.value.field == field
    assert fragment in caught.value.message
