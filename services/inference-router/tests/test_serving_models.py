"""Measuring and predicting serving configurations through the router's API: a real router process
with its real workers, a real ONNX model, real onnxruntime timings, Redis keeping the measurements
across a restart; bad arguments answered with the field they break."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from opml.inference.v1 import deployments_pb2 as pb

from opml_common.cli import main as opml
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from opml_common.perfmodel import ServingConfig, grid
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.control.serving_models import MIN_MEASURED
from opml_inference_router.testing import fleet_env, mlp_classifier, mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

VERSION = "models/mlp/versions/1"
CPU_GRID = list(grid(batches=(1, 4, 16), threads=(1, 2), opt_levels=("disable", "all"), modes=("sequential",)))
ACCEL_FEW = [ServingConfig(1, 1, "all", "sequential", "int8"), ServingConfig(8, 1, "all", "sequential", "int8"),
             ServingConfig(16, 2, "disable", "sequential", "int8"), ServingConfig(4, 2, "all", "sequential", "int8"),
             ServingConfig(32, 1, "basic", "parallel", "int8")]


@pytest.fixture
def router_env(start_service: ServiceStarter, tmp_path: Path) -> dict[str, str]:
    return start_service.env("inference-router", extra_env=fleet_env(tmp_path / "fleet.yaml"))


def test_measure_then_predict_on_the_kind_and_transferred_to_another(start_service: ServiceStarter,
                                                                     router_env: dict[str, str],
                                                                     tmp_path: Path) -> None:
    assert len(CPU_GRID) >= MIN_MEASURED
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", features=64),
                                mlp_classifier(features=64, width=256, depth=2))
    router = start_service("inference-router", env=router_env)
    with DeploymentClient(router.target, token=TOKENS["writer"]) as writer, \
            DeploymentClient(router.target, token=TOKENS["reader"]) as reader:
        writer.deploy(model_dir=str(model_dir))
        with pytest.raises(FailedPrecondition, match="0 measurements on cpu"):
            reader.predict_serving_performance(VERSION, "cpu", [ServingConfig(1)])
        with pytest.raises(PermissionDenied):
            reader.measure_serving_configs(VERSION, "cpu", [ServingConfig(1)])

        measured = writer.measure_serving_configs(VERSION, "cpu", CPU_GRID, runs=5, passes=1)
        assert len(measured.samples) == len(CPU_GRID) and measured.pool_kind == "cpu"
        assert all(s.latency_ms > 0 and s.throughput_rps == pytest.approx(s.config.batch * 1000 / s.latency_ms)
                   for s in measured.samples)

        asked = [ServingConfig(16, 1, "all", "sequential", "fp32"), ServingConfig(2, 2, "basic", "parallel", "int8")]
        own = reader.predict_serving_performance(VERSION, "cpu", asked)
        assert (own.fit.method, own.fit.learned_on, own.fit.source_samples, own.fit.target_samples) == (
            "measured", "cpu", len(CPU_GRID), len(CPU_GRID))
        assert [(p.config.batch, p.config.precision, p.config.opt_level) for p in own.predictions] == [
            (16, "fp32", "all"), (2, "int8", "basic")]
        by_config = {(s.config.batch, s.config.threads, s.config.opt_level, s.config.precision): s.latency_ms
                     for s in measured.samples}
        # a measured configuration is predicted near its measurement (trees learnt on it; log scale)
        assert own.predictions[0].latency_ms == pytest.approx(by_config[16, 1, "all", "fp32"], rel=0.5)
        assert all(p.throughput_rps == pytest.approx(p.config.batch * 1000 / p.latency_ms) for p in own.predictions)

        with pytest.raises(FailedPrecondition, match="no measurement on accel"):
            reader.predict_serving_performance(VERSION, "accel", [ServingConfig(8, precision="int8")])
        with pytest.raises(FailedPrecondition, match="accel runs int8, not fp32"):
            writer.measure_serving_configs(VERSION, "accel", [ServingConfig(8)], runs=3, passes=1)
        few = writer.measure_serving_configs(VERSION, "accel", ACCEL_FEW, runs=5, passes=1)
        assert len(few.samples) == len(ACCEL_FEW)
        transferred = reader.predict_serving_performance(VERSION, "accel", [ServingConfig(8, precision="int8")])
        assert (transferred.fit.method, transferred.fit.learned_on, transferred.fit.source_samples,
                transferred.fit.target_samples) == ("transferred", "cpu", len(CPU_GRID), len(ACCEL_FEW))
        assert transferred.predictions[0].latency_ms > 0

    # The measurements are in Redis: a restarted router predicts the same without measuring again.
    router.stop()
    again = start_service("inference-router", env=router_env)
    with DeploymentClient(again.target, token=TOKENS["reader"]) as reader:
        after = reader.predict_serving_performance(VERSION, "accel", [ServingConfig(8, precision="int8")])
    assert after.fit == transferred.fit
    assert after.predictions[0].latency_ms == pytest.approx(transferred.predictions[0].latency_ms)

    # The CLI: measure one more accel configuration, then predict a grid from the model it moved.
    runner = CliRunner()
    base = ["model", "--target", again.target, "--token", TOKENS["writer"]]
    measured_cli = runner.invoke(opml, [*base, "measure", "mlp", "1", "--kind", "accel", "--batch", "2",
                                        "--precision", "int8", "--runs", "3", "--passes", "1"])
    assert measured_cli.exit_code == 0, measured_cli.output
    assert f"{len(ACCEL_FEW) + 1} measurements kept" in measured_cli.output
    predicted_cli = runner.invoke(opml, [*base, "predict", "mlp", "1", "--kind", "accel", "--batch", "1,8,32",
                                         "--threads", "1,2", "--precision", "int8"])
    assert predicted_cli.exit_code == 0, predicted_cli.output
    assert f"transferred from cpu ({len(CPU_GRID)} measurements) with {len(ACCEL_FEW) + 1}" in predicted_cli.output
    assert predicted_cli.output.count("int8") == 6


def test_bad_arguments_name_their_fields(start_service: ServiceStarter, router_env: dict[str, str],
                                         tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp"))
    router = start_service("inference-router", env=router_env)
    with DeploymentClient(router.target, token=TOKENS["writer"]) as client:
        client.deploy(model_dir=str(model_dir))
        predict = client.predict_serving_performance
        for call, field in ((lambda: predict("models/mlp", "cpu", [ServingConfig(1)]), "name"),
                            (lambda: predict("models/mlp/versions/0", "cpu", [ServingConfig(1)]), "name"),
                            (lambda: predict(VERSION, "", [ServingConfig(1)]), "pool_kind"),
                            (lambda: predict(VERSION, "tpu", [ServingConfig(1)]), "pool_kind"),
                            (lambda: predict(VERSION, "cpu", []), "configs"),
                            (lambda: predict(VERSION, "cpu", [ServingConfig(1)] * 1001), "configs"),
                            (lambda: client.measure_serving_configs(VERSION, "cpu", [ServingConfig(1)], runs=101),
                             "runs"),
                            (lambda: client.measure_serving_configs(VERSION, "cpu", [ServingConfig(1)], passes=6),
                             "passes")):
            with pytest.raises(InvalidArgument) as caught:
                call()
            assert caught.value.field == field, caught.value.message
        # every value outside the space at once, each with its index (sent as raw messages: the
        # client's ServingConfig refuses them before they could be sent)
        request = pb.PredictServingPerformanceRequest(name=VERSION, pool_kind="cpu", configs=[
            pb.ServingConfig(batch=0), pb.ServingConfig(batch=2, opt_level="max", precision="fp16"),
            pb.ServingConfig(batch=1, threads=-1, execution_mode="async")])
        with pytest.raises(InvalidArgument) as caught:
            client.stub.PredictServingPerformance(request, timeout=60)
        assert [field for field, _ in caught.value.violations] == [
            "configs[0].batch", "configs[1].opt_level", "configs[1].precision", "configs[2].execution_mode",
            "configs[2].threads"]
        assert "must be one of disable, basic, extended, all, but got 'max'" in caught.value.message
        with pytest.raises(NotFound, match="models/other/versions/1 is not deployed"):
            predict("models/other/versions/1", "cpu", [ServingConfig(1)])
        with pytest.raises(NotFound, match="it has versions"):
            predict("models/mlp/versions/7", "cpu", [ServingConfig(1)])
