"""A model's external data must be a regular file in the model's own folder: a bundle naming the
worker's ``s3.json``, an absolute path, a ``..`` path or a symlink out is refused before any session
reads it, naming the tensor and the location; data inside the folder loads and serves (in process:
the worker's repository, whose working directory holds the secret, as a worker's may)."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from prometheus_client import CollectorRegistry

from opml_common.errors import InvalidArgument, NotFound
from opml_common.metrics import ServiceMetrics
from opml_inference_router.placement.fleet_config import PoolKind
from opml_inference_router.runtime import ModelRepository, WorkerMetrics, load_bundle
from opml_inference_router.runtime.external_data import MAX_LISTED, check_external_data
from opml_inference_router.testing import external_weights_model, mlp_config, write_model_dir

CPU = PoolKind(name="cpu", precisions=("fp32",), memory_mib=4096, slots=3, cost_per_hour=1.0,
               execution_provider="CPUExecutionProvider")
ACCEL = PoolKind(name="accel", precisions=("int8",), memory_mib=4096, slots=3, cost_per_hour=0.5,
                 execution_provider="CPUExecutionProvider")
SECRET = (b'{"identities": [{"name": "admin", "credentials": [{"accessKey": "opml", "secretKey": "'
          + b"s3cr3t-" * 40 + b'"}]}]}')
"""What the worker's working directory holds as s3.json: 256 bytes of it would fill W1."""
WEIGHTS = np.arange(64, dtype=np.float32).reshape(16, 4)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The worker's working directory, holding the platform's S3 identities (s3.json), and a secret
    beside the models (``sec/ext_secret.txt``)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "s3.json").write_bytes(SECRET)
    (tmp_path / "sec").mkdir()
    (tmp_path / "sec" / "ext_secret.txt").write_bytes(SECRET)
    monkeypatch.chdir(work)
    return work


def repository(kind: PoolKind, models: Path) -> ModelRepository:
    return ModelRepository(kind, metrics=WorkerMetrics(ServiceMetrics("test", CollectorRegistry())), threads=1,
                           models_dir=models, profile_repeats=3)


def bundle(models: Path, name: str, location: str, **config) -> Path:
    return write_model_dir(models / name, mlp_config(name, **config), external_weights_model(location))


def attacks(tmp_path: Path) -> dict[str, str]:
    """Each location an attacker's bundle names, and how the refusal words it."""
    secret = str(tmp_path / "sec" / "ext_secret.txt")
    return {"s3.json": ", which is not a file in the model's folder",
            secret: " by an absolute path; it must lie inside the model's folder",
            "../../sec/ext_secret.txt": " outside the model's folder",
            "link.bin": " through a symlink ('link.bin'); it must be a regular file inside the model's folder"}


def test_external_data_outside_the_models_folder_is_refused_naming_the_tensor_and_the_path(
        tmp_path: Path, workdir: Path) -> None:
    models = tmp_path / "models"
    names = {}
    for index, location in enumerate(attacks(tmp_path)):
        names[location] = f"m{index}"
        bundle(models, f"m{index}", location)
    os.symlink(tmp_path / "sec" / "ext_secret.txt", models / names["link.bin"] / "link.bin")

    async def scenario() -> None:
        repo = repository(CPU, models)
        try:
            for location, why in attacks(tmp_path).items():
                name = names[location]
                with pytest.raises(InvalidArgument) as caught:
                    await repo.load(name)
                assert caught.value.message == f"model.onnx: tensor 'W1' names external data {location!r}{why}"
                assert caught.value.field == "model.onnx"
                with pytest.raises(NotFound):
                    repo.get(name)  # nothing serves, so no inference can answer the file's bytes
                assert {e.name: e.state for e in repo.index()}[name] == "UNAVAILABLE"
            assert repo.slots_used == 0
        finally:
            await repo.close()

    asyncio.run(scenario())


def test_the_router_reads_the_same_refusal_from_the_bundle(tmp_path: Path, workdir: Path) -> None:
    """load_bundle is what the router's deploy reads before anything is placed: it refuses too."""
    directory = bundle(tmp_path / "models", "m", "s3.json")
    with pytest.raises(InvalidArgument, match=re.escape("model.onnx: tensor 'W1' names external data 's3.json', "
                                                        "which is not a file in the model's folder")):
        load_bundle(directory)
    versioned = write_model_dir(tmp_path / "models" / "v", mlp_config("v"), external_weights_model("../w.bin"),
                                versions=(3,))
    (versioned / "w.bin").write_bytes(WEIGHTS.tobytes())  # the bundle's folder, but not version 3's
    with pytest.raises(InvalidArgument, match=re.escape("3/model.onnx: tensor 'W1' names external data '../w.bin' "
                                                        "outside the model's folder")):
        load_bundle(versioned)


@pytest.mark.parametrize("kind", [CPU, ACCEL], ids=["fp32", "int8"])
@pytest.mark.parametrize("location", ["weights.bin", "data/weights.bin", "data/../weights.bin"])
def test_external_data_inside_the_models_folder_loads_and_serves(tmp_path: Path, workdir: Path, kind: PoolKind,
                                                                 location: str) -> None:
    models = tmp_path / "models"
    directory = bundle(models, "m", location, pool_kinds=(kind.name,))
    (directory / "data").mkdir()
    (directory / location).write_bytes(WEIGHTS.tobytes())

    async def scenario() -> np.ndarray:
        repo = repository(kind, models)
        try:
            await repo.load("m")
            return (await repo.get("m").batcher.infer({"features": np.eye(16, dtype=np.float32)}))["scores"]
        finally:
            await repo.close()

    scores = asyncio.run(scenario())
    if kind is CPU:
        np.testing.assert_array_equal(scores, WEIGHTS)
    else:  # dynamic int8 quantization of 0..63: within a quantization step
        np.testing.assert_allclose(scores, WEIGHTS, atol=0.5)


def _external(name: str, location: str) -> TensorProto:
    tensor = numpy_helper.from_array(np.zeros(4, np.float32), name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    return tensor


def test_tensors_in_attributes_subgraphs_and_functions_are_checked_too(tmp_path: Path) -> None:
    branch = helper.make_graph([helper.make_node("Identity", ["inner"], ["out"])], "branch", [],
                               [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])],
                               [_external("inner", "../inner.bin")])
    nodes = [helper.make_node("Constant", [], ["c"], value=_external("constant", "/etc/passwd")),
             helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])],
                              [_external("init", "ok.bin")])
    function = helper.make_function("local", "f", [], ["y"], [helper.make_node("Constant", [], ["y"],
                                    value=_external("in_function", "link"))], [helper.make_opsetid("", 17)])
    model = helper.make_model(graph, functions=[function], opset_imports=[helper.make_opsetid("", 17)])
    (tmp_path / "ok.bin").write_bytes(b"\0" * 16)
    os.symlink(tmp_path / "ok.bin", tmp_path / "link")
    onnx.save(model, tmp_path / "model.onnx")
    with pytest.raises(InvalidArgument) as caught:
        check_external_data(tmp_path / "model.onnx", name="model.onnx")
    assert [rule.split(" names ")[0] for _, rule in caught.value.violations] == [
        "tensor 'constant'", "tensor 'inner'", "tensor 'inner'", "tensor 'in_function'"]


def test_a_model_naming_many_files_lists_a_few_and_counts_the_rest(tmp_path: Path) -> None:
    graph = helper.make_graph([], "g", [], [], [_external(f"t{i}", f"/x/{i}") for i in range(MAX_LISTED + 7)])
    onnx.save(helper.make_model(graph), tmp_path / "model.onnx")
    with pytest.raises(InvalidArgument) as caught:
        check_external_data(tmp_path / "model.onnx", name="model.onnx")
    assert len(caught.value.violations) == MAX_LISTED + 1
    assert caught.value.violations[-1][1] == "and 7 more tensors name external data outside the model's folder"
    (tmp_path / "model.onnx").write_bytes(b"\xff\xff not protobuf")
    with pytest.raises(InvalidArgument, match=r"^model\.onnx: cannot be read as an ONNX model"):
        check_external_data(tmp_path / "model.onnx", name="model.onnx")
