"""Loading bundles onto a worker's repository: precisions, int8, slots, memory, failures (in process)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from prometheus_client import CollectorRegistry

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from opml_common.metrics import ServiceMetrics
from opml_inference_router.placement.fleet_config import PoolKind
from opml_inference_router.runtime import (
    ModelRepository,
    WorkerMetrics,
    build_session,
    check_signature,
    choose_precision,
    convert,
    load_bundle,
    require_provider,
)
from opml_inference_router.runtime.bundle import write_bundle
from opml_inference_router.testing import mlp_classifier, mlp_config, write_broken_onnx, write_model_dir
from opml_inference_router_contract.model_config import ModelConfig

CPU = PoolKind(name="cpu", precisions=("fp32",), memory_mib=4096, slots=3, cost_per_hour=1.0,
               execution_provider="CPUExecutionProvider")
ACCEL = PoolKind(name="accel", precisions=("int8",), memory_mib=512, slots=2, cost_per_hour=0.5,
                 execution_provider="CPUExecutionProvider", batch_sizes=(1, 4, 8))
GPU = PoolKind(name="gpu", precisions=("fp32", "fp16"), memory_mib=8192, slots=2, cost_per_hour=4.0,
               execution_provider="CUDAExecutionProvider")


def repository(kind: PoolKind, models: Path) -> ModelRepository:
    return ModelRepository(kind, metrics=WorkerMetrics(ServiceMetrics("test", CollectorRegistry())), threads=1,
                           models_dir=models, profile_repeats=3)


async def infer(repo: ModelRepository, name: str, data: np.ndarray) -> np.ndarray:
    return (await repo.get(name).batcher.infer({"features": data}))["scores"]


def test_precision_is_the_cheapest_both_sides_allow() -> None:
    config = ModelConfig.from_dict(mlp_config("m", precisions=("fp32", "int8")))
    assert choose_precision(config, ACCEL) == "int8"
    assert choose_precision(config, CPU) == "fp32"
    fp32_only = ModelConfig.from_dict(mlp_config("m", precisions=("fp32",)))
    with pytest.raises(FailedPrecondition, match="model m allows fp32, but pool kind accel runs int8"):
        choose_precision(fp32_only, ACCEL)
    with pytest.raises(FailedPrecondition, match="precision int8 is not one that pool kind cpu runs"):
        choose_precision(config, CPU, "int8")


def test_a_kind_whose_provider_is_missing_is_refused() -> None:
    # A provider no onnxruntime build has, so the refusal is tested on every machine (with CUDA too).
    fpga = GPU.model_copy(update={"name": "fpga", "execution_provider": "MadeUpExecutionProvider"})
    assert "MadeUpExecutionProvider" not in ort.get_available_providers()
    with pytest.raises(FailedPrecondition, match="pool kind fpga needs MadeUpExecutionProvider, which this "
                                                 "onnxruntime build lacks"):
        require_provider(fpga)


def test_a_graph_that_differs_from_its_config_is_refused(tmp_path: Path) -> None:
    session = build_session(mlp_classifier(features=8).SerializeToString(), CPU, threads=1, source="m",
                            folder=tmp_path)
    with pytest.raises(InvalidArgument, match=r"^inputs\[features\]: the config declares FP32 \[-1,16\], but the "
                                              r"ONNX graph has FP32 \[-1, 8\]"):
        check_signature(session, ModelConfig.from_dict(mlp_config("m", features=16)))
    with pytest.raises(InvalidArgument, match=r"^outputs\[probs\]: is not in the ONNX graph, whose outputs are scores"):
        check_signature(session, ModelConfig.from_dict(mlp_config("m", features=8, output_name="probs")))


def test_versioned_bundle_serves_what_its_policy_picks(tmp_path: Path) -> None:
    config = mlp_config("m") | {"version_policy": {"latest": {"num_versions": 2}}}
    directory = write_model_dir(tmp_path / "m", config, versions=(1, 2, 3))
    (directory / "²").mkdir()  # "²".isdigit(), but no version number: ignored like any other folder
    (directory / "²" / "model.onnx").write_bytes((directory / "3" / "model.onnx").read_bytes())
    bundle = load_bundle(directory)
    assert sorted(bundle.select()) == [2, 3]
    with pytest.raises(NotFound, match="version 9 of model m is not in"):
        bundle.select(9)


@pytest.mark.parametrize("version", ["²", "0", "-1", "1.0", "v1", "9" * 5000])
def test_a_model_version_that_is_no_version_number_is_refused_naming_the_field(tmp_path: Path, version: str) -> None:
    write_model_dir(tmp_path / "m", mlp_config("m"))

    async def scenario() -> None:
        repo = repository(CPU, tmp_path)
        try:
            await repo.load("m")
            assert repo.get("m", "01").replica.model.version == 1
            with pytest.raises(InvalidArgument) as caught:
                repo.get("m", version)
            assert caught.value.field == "model_version" and len(caught.value.message) < 200
        finally:
            await repo.close()

    asyncio.run(scenario())


def test_int8_on_fixed_shapes_agrees_with_fp32(tmp_path: Path) -> None:
    model = mlp_classifier(features=16, width=128, depth=3, classes=10, seed=3)
    write_model_dir(tmp_path / "m", mlp_config("m", classes=10), model)
    data = np.random.default_rng(7).standard_normal((200, 16)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString()).run(None, {"features": data})[0]

    async def scenario() -> np.ndarray:
        repo = repository(ACCEL, tmp_path)
        try:
            [served] = await repo.load("m")
            assert served.replica.precision == "int8"
            parts = await asyncio.gather(*[infer(repo, "m", data[i:i + 5]) for i in range(0, 200, 5)])
            return np.concatenate(parts)
        finally:
            await repo.close()

    quantized = asyncio.run(scenario())
    assert quantized.shape == reference.shape
    agreement = float(np.mean(quantized.argmax(1) == reference.argmax(1)))
    assert agreement >= 0.9, agreement
    assert np.max(np.abs(quantized - reference)) < 0.1
    assert not np.allclose(quantized, reference, atol=1e-6)  # it really ran in int8


def test_calibrated_static_int8_when_the_bundle_has_samples(tmp_path: Path) -> None:
    model = mlp_classifier(features=16, width=64, depth=2, classes=4, seed=5)
    write_model_dir(tmp_path / "m", mlp_config("m"), model)
    samples = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    np.savez(tmp_path / "m" / "calibration.npz", features=samples)
    data = np.random.default_rng(2).standard_normal((40, 16)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString()).run(None, {"features": data})[0]

    async def scenario() -> np.ndarray:
        repo = repository(ACCEL, tmp_path)
        try:
            [served] = await repo.load("m")
            assert served.replica.precision == "int8"
            return served.replica.run({"features": data[:8]})["scores"]
        finally:
            await repo.close()

    quantized = asyncio.run(scenario())
    assert float(np.mean(quantized.argmax(1) == reference[:8].argmax(1))) >= 0.75
    assert np.max(np.abs(quantized - reference[:8])) < 0.1


def test_slots_and_memory_bound_what_a_worker_hosts(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        write_model_dir(tmp_path / name, mlp_config(name))
    big = mlp_classifier(width=1024, depth=2)  # ~4 MiB of weights
    write_model_dir(tmp_path / "big", mlp_config("big"), big)

    async def scenario() -> None:
        repo = repository(ACCEL, tmp_path)
        try:
            await repo.load("a")
            await repo.load("b")
            with pytest.raises(ResourceExhausted, match=r"needs 1 slot\(s\), but this accel worker has 0 free of 2 "
                                                        r"\(in use by a v1, b v1\)"):
                await repo.load("c")
            await repo.load("a")  # a reload reuses its own slot
            await repo.unload("b")
            await repo.load("c")
            assert [(e.name, e.state) for e in repo.index()] == [("a", "READY"), ("c", "READY")]
        finally:
            await repo.close()
        small = PoolKind(name="cpu", precisions=("fp32",), memory_mib=2, slots=4, cost_per_hour=1.0,
                         execution_provider="CPUExecutionProvider")
        tight = repository(small, tmp_path)
        with pytest.raises(ResourceExhausted, match=r"big's ONNX files alone take 4\.\d MiB, but this cpu worker "
                                                    r"has 2\.0 MiB free of 2"):
            await tight.load("big")

    asyncio.run(scenario())


def test_a_broken_model_fails_with_the_loaders_reason_and_others_keep_serving(tmp_path: Path) -> None:
    write_model_dir(tmp_path / "good", mlp_config("good"))
    write_model_dir(tmp_path / "bad", mlp_config("bad"))
    write_broken_onnx(tmp_path / "bad" / "model.onnx")
    data = np.ones((2, 16), np.float32)

    async def scenario() -> None:
        repo = repository(CPU, tmp_path)
        try:
            await repo.load("good")
            before = await infer(repo, "good", data)
            with pytest.raises(InvalidArgument, match=r"bad/model\.onnx: onnxruntime cannot load it: .*NoSuchOperator"):
                await repo.load("bad")
            write_model_dir(tmp_path / "good", mlp_config("good"))
            write_broken_onnx(tmp_path / "good" / "model.onnx")
            with pytest.raises(InvalidArgument, match="onnxruntime cannot load it"):
                await repo.load("good")  # a failed reload keeps the loaded version serving
            np.testing.assert_array_equal(await infer(repo, "good", data), before)
            index = {(e.name, e.state): e.reason for e in repo.index()}
            assert ("good", "READY") in index
            assert "NoSuchOperator" in index[("bad", "UNAVAILABLE")]
            with pytest.raises(NotFound, match="model 'bad' is not loaded on this worker"):
                repo.get("bad")
            with pytest.raises(NotFound, match="version 2 of model 'good' is not loaded"):
                repo.get("good", "2")
        finally:
            await repo.close()

    asyncio.run(scenario())


def test_a_model_that_may_not_run_on_the_kind_is_refused(tmp_path: Path) -> None:
    write_model_dir(tmp_path / "m", mlp_config("m", pool_kinds=("gpu",)))
    with pytest.raises(FailedPrecondition, match="model m may run on pool kinds gpu, not on this worker's cpu"):
        asyncio.run(repository(CPU, tmp_path).load("m"))


def test_int8_conversion_is_dynamic_without_samples_and_static_with_them(tmp_path: Path) -> None:
    write_model_dir(tmp_path, mlp_config("m"))
    samples = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    np.savez(tmp_path / "calibration.npz", features=samples)
    config = ModelConfig.from_dict(mlp_config("m"))

    def ops(calibration: Path | None) -> set[str]:
        converted = onnx.load_from_string(convert(tmp_path / "model.onnx", "int8", config, calibration=calibration))
        return {node.op_type for node in converted.graph.node}

    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops(None)
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops(tmp_path / "calibration.npz")


def test_a_bundle_sent_over_the_wire_stays_inside_its_directory(tmp_path: Path) -> None:
    model = mlp_classifier().SerializeToString()
    with pytest.raises(InvalidArgument, match=r"^parameters\[file:\.\./evil\.onnx\]: must be a path inside"):
        write_bundle(tmp_path / "sent", config_json="{}", files={"../evil.onnx": model})
    with pytest.raises(InvalidArgument, match=r"^parameters: the files sent hold no model\.onnx"):
        write_bundle(tmp_path / "sent", config_json="{}", files={"weights.bin": b"x"})
    written = write_bundle(tmp_path / "sent", config_json=json.dumps(mlp_config("m")), files={"3/model.onnx": model})
    bundle = load_bundle(written)
    assert bundle.config.name == "m"
    assert bundle.files[3].read_bytes() == model


def test_instances_take_a_slot_each_and_change_in_place(tmp_path: Path) -> None:
    write_model_dir(tmp_path / "a", mlp_config("a"))
    write_model_dir(tmp_path / "b", mlp_config("b"))
    data = np.ones((2, 16), np.float32)

    async def scenario() -> None:
        repo = repository(CPU, tmp_path)  # 3 slots
        try:
            await repo.load("a", version=1, instances=2, max_batch=4)
            served = repo.get("a")
            first = served.batcher.instances
            assert (served.instances, repo.slots_used, served.batcher.max_batch) == (2, 2, 4)
            assert repo.memory_used_mib == pytest.approx(sum(i.memory_mib for i in first)) and len(set(first)) == 2
            with pytest.raises(ResourceExhausted, match=r"needs 2 slot\(s\), but this cpu worker has 1 free of 3 "
                                                        r"\(in use by a v1 x2\)"):
                await repo.load("b", version=1, instances=2)
            before = await infer(repo, "a", data)
            await repo.load("a", version=1, instances=2, max_batch=8)  # a re-size: same sessions, new cap
            assert repo.get("a") is served and served.batcher.instances == first and served.batcher.max_batch == 8
            await repo.load("a", version=1, instances=3)  # one more session beside the two serving
            assert served.batcher.instances[:2] == first and repo.slots_used == 3
            with pytest.raises(ResourceExhausted, match=r"models/a/versions/1 needs 1 more slot\(s\) for 4 instances, "
                                                        r"but this cpu worker has 0 free of 3"):
                await repo.load("a", version=1, instances=4)
            await repo.load("a", version=1, instances=1)
            assert served.batcher.instances == first[:1] and repo.slots_used == 1
            np.testing.assert_array_equal(await infer(repo, "a", data), before)
            await repo.load("b", version=1, instances=2)
            assert repo.slots_used == 3
            await repo.load("a", version=1)  # no instances or cap: a full reload, as before
            assert repo.get("a") is not served and repo.get("a").instances == 1
        finally:
            await repo.close()

    asyncio.run(scenario())
