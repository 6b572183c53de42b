"""Katib's algorithms on Optuna (each sampler and pruner really runs ask/tell on the examples' search
spaces), and the metrics collectors on the lines trials write."""

from __future__ import annotations

import importlib.abc
import inspect
import io
import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import yaml

from opml_automl_controller.algorithms import make_pruner, make_sampler, search_space
from opml_automl_controller.collect import (
    FILE_MARKER,
    PUSH_MARKER,
    MetricsParser,
    Observation,
    epoch_observations,
    summarize,
)
from opml_automl_controller.experiment import CollectorKind, MetricsCollector
from opml_automl_controller.katib import parse_experiment
from opml_automl_controller.sdk import report
from opml_common.errors import FailedPrecondition, InvalidArgument

EXAMPLES = Path(__file__).parent / "katib_examples"
SAMPLERS = {
    "random.yaml": optuna.samplers.RandomSampler, "grid.yaml": optuna.samplers.GridSampler,
    "tpe.yaml": optuna.samplers.TPESampler, "multivariate-tpe.yaml": optuna.samplers.TPESampler,
    "cma-es.yaml": optuna.samplers.CmaEsSampler, "sobol.yaml": optuna.samplers.QMCSampler,
    "bayesian-optimization.yaml": optuna.samplers.GPSampler, "hyperband.yaml": optuna.samplers.RandomSampler,
    "optuna-distribution.yaml": optuna.samplers.TPESampler,
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_each_algorithm_runs_ask_and_tell_in_its_space(name: str) -> None:
    spec = parse_experiment((EXAMPLES / name).read_text())
    sampler = make_sampler(spec)
    assert isinstance(sampler, SAMPLERS[name])
    study = optuna.create_study(sampler=sampler, pruner=make_pruner(spec))
    space = search_space(spec)
    for _ in range(4):
        trial = study.ask(fixed_distributions=space)
        for parameter in spec.parameters:
            if parameter.name in trial.params and parameter.low is not None and spec.algorithm.name != "grid":
                assert parameter.low <= trial.params[parameter.name] <= parameter.high
        study.tell(trial, sum(float(v) for v in trial.params.values()))
    assert len(study.trials) == 4 and all(t.state.is_finished() for t in study.trials)


def test_bayesianoptimization_fits_its_gaussian_process_on_pytorch() -> None:
    """The gp extra installed (the test extra includes it): past n_initial_points, GPSampler fits."""
    doc = yaml.safe_load((EXAMPLES / "bayesian-optimization.yaml").read_text())
    doc["spec"]["algorithm"]["algorithmSettings"].append({"name": "n_initial_points", "value": "2"})
    spec = parse_experiment(doc, runnable_here=True)
    study = optuna.create_study(sampler=make_sampler(spec))
    study.optimize(lambda trial: (trial.suggest_float("lr", 0.01, 0.05) - 0.03) ** 2
                   + trial.suggest_float("momentum", 0.5, 0.9), n_trials=4)
    assert len(study.trials) == 4 and "torch" in sys.modules


ALL_BUT_GP = sorted(set(SAMPLERS) - {"bayesian-optimization.yaml"})


class NoTorch(importlib.abc.MetaPathFinder):
    """`import torch` fails, as where the gp extra is not installed (not ``sys.modules["torch"] = None``:
    SciPy's array-API helpers take such an entry for the module)."""

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_bayesianoptimization_without_pytorch_is_refused_at_admission_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # imported by the tests before: forgotten here
    monkeypatch.setattr(sys, "meta_path", [NoTorch(), *sys.meta_path])
    with pytest.raises(ModuleNotFoundError):
        import torch  # noqa: F401
    doc = yaml.safe_load((EXAMPLES / "bayesian-optimization.yaml").read_text())
    doc["spec"]["parallelTrialCount"] = 20  # and another mistake: every one is reported at once
    with pytest.raises(InvalidArgument) as refused:
        parse_experiment(doc, runnable_here=True)
    assert dict(refused.value.violations) == {
        "spec.algorithm.algorithmName": "algorithm 'bayesianoptimization' needs PyTorch: install "
                                        "opml-automl-controller[gp]",
        "spec.parallelTrialCount": "must not exceed spec.maxTrialCount (got 20 > 12)"}
    doc["spec"]["parallelTrialCount"] = 3
    spec = parse_experiment(doc)  # a client's check of its file, or a stored experiment read back
    with pytest.raises(FailedPrecondition, match=r"needs PyTorch: install opml-automl-controller\[gp\]"):
        make_sampler(spec)  # its run fails, and is retried at the next start (the extra installed by then)
    for name in ALL_BUT_GP:
        assert make_sampler(parse_experiment((EXAMPLES / name).read_text(), runnable_here=True)) is not None


def test_the_controller_imports_and_validates_without_pytorch() -> None:
    """No module imports PyTorch (or Optuna's GP model) at import time: with `import torch` failing, every
    module imports, and the API's validation refuses bayesianoptimization alone, by its field."""
    program = "import importlib.abc, sys\n" + inspect.getsource(NoTorch) + textwrap.dedent("""
        sys.meta_path.insert(0, NoTorch())
        import importlib, json, pkgutil
        import opml_automl_controller
        for module in pkgutil.iter_modules(opml_automl_controller.__path__):
            importlib.import_module(f"opml_automl_controller.{module.name}")
        from opml_automl_controller.controller import Controller
        from opml_common.errors import InvalidArgument
        from opml_common.events import RecordingEmitter
        controller = Controller(store=None, jobs=None, emitter=RecordingEmitter(), redis_url="redis://unused")
        refused = {}
        for path in sys.argv[1:]:
            try:
                controller.validate(open(path).read())
                refused[path] = []
            except InvalidArgument as error:
                refused[path] = [list(violation) for violation in error.violations]
        print(json.dumps({"refused": refused, "gp": sorted(m for m in sys.modules if m.startswith(("optuna._gp", "torch")))}))
    """)
    paths = [str(EXAMPLES / name) for name in ("bayesian-optimization.yaml", *ALL_BUT_GP)]
    done = subprocess.run([sys.executable, "-c", program, *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["refused"] == {path: [] for path in paths[1:]} | {paths[0]: [[
        "spec.algorithm.algorithmName",
        "algorithm 'bayesianoptimization' needs PyTorch: install opml-automl-controller[gp]"]]}
    # optuna.samplers defines GPSampler without PyTorch; its model (optuna._gp) is what imports it
    assert result["gp"] == [], "neither PyTorch nor Optuna's GP model was imported"


def test_grid_visits_the_katib_grid() -> None:
    spec = parse_experiment((EXAMPLES / "grid.yaml").read_text())  # lr 0.01..0.05 by 0.005, momentum 0.5..0.9 by 0.1
    assert len(search_space(spec)["lr"].choices) == 9 and len(search_space(spec)["momentum"].choices) == 5
    study = optuna.create_study(sampler=make_sampler(spec))
    seen = set()
    for _ in range(12):
        trial = study.ask(fixed_distributions=search_space(spec))
        seen.add((trial.params["lr"], trial.params["momentum"]))
        study.tell(trial, 0.0)
    assert len(seen) == 12, "no combination twice"


def test_optuna_distribution_example_maps_log_spaces() -> None:
    space = search_space(parse_experiment((EXAMPLES / "optuna-distribution.yaml").read_text()))
    kinds = {name: (type(d).__name__, getattr(d, "log", None)) for name, d in space.items()}
    assert ("FloatDistribution", True) in kinds.values() and ("IntDistribution", True) in kinds.values()


def test_medianstop_settings_and_defaults() -> None:
    spec = parse_experiment((EXAMPLES / "median-stop.yaml").read_text())  # min_trials_required 1, start_step 2
    pruner = make_pruner(spec)
    assert isinstance(pruner, optuna.pruners.MedianPruner)
    assert (pruner._n_startup_trials, pruner._n_warmup_steps) == (1, 2)
    # start_step 2: the 2nd reported value (step 2) is the first the rule may act on
    study = optuna.create_study(pruner=pruner)
    good = study.ask()
    for step in (1, 2, 3):
        good.report(1.0, step)
    study.tell(good, 1.0)
    bad = study.ask()
    bad.report(5.0, 1)
    assert not bad.should_prune()
    bad.report(5.0, 2)
    assert bad.should_prune()
    import yaml
    doc = yaml.safe_load((EXAMPLES / "median-stop.yaml").read_text())
    doc["spec"]["earlyStopping"] = {"algorithmName": "medianstop"}
    defaults = make_pruner(parse_experiment(doc))
    assert (defaults._n_startup_trials, defaults._n_warmup_steps) == (3, 4)  # Katib's defaults


def test_hyperband_takes_its_resource_from_the_settings() -> None:
    spec = parse_experiment((EXAMPLES / "hyperband.yaml").read_text())  # resource num-epochs, eta 2, r_l 2
    pruner = make_pruner(spec)
    assert isinstance(pruner, optuna.pruners.HyperbandPruner)
    assert (pruner._min_resource, pruner._max_resource, pruner._reduction_factor) == (1, 2, 2)
    assert "num-epochs" not in search_space(spec)


def test_reseeding_after_a_restart_draws_new_values() -> None:
    spec = parse_experiment((EXAMPLES / "bayesian-optimization.yaml").read_text().replace(
        "bayesianoptimization", "random"))
    first = make_sampler(spec, trials_so_far=0)
    again = make_sampler(spec, trials_so_far=0)
    later = make_sampler(spec, trials_so_far=3)
    draw = [s._rng.rng.uniform() for s in (first, again, later)]
    assert draw[0] == draw[1] != draw[2]


def test_a_seed_stays_in_numpys_range_at_admission_and_after_a_restart() -> None:
    doc = yaml.safe_load((EXAMPLES / "random.yaml").read_text())
    doc["spec"]["algorithm"]["algorithmSettings"] = [{"name": "random_state", "value": str(2**32)}]
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(doc)
    assert list(caught.value.violations) == [("spec.algorithm.algorithmSettings[0].value",
                                              f"random_state must be at most {2**32 - 1} (numpy's 32-bit seeds), "
                                              f"but got '{2**32}'")]
    doc["spec"]["algorithm"]["algorithmSettings"][0]["value"] = str(2**32 - 1)
    spec = parse_experiment(doc)
    restarted = make_sampler(spec, trials_so_far=5)  # re-seeded past the trials so far: 2**32 + 4 wraps to 4
    assert restarted._rng.rng.uniform() == make_sampler(replace(spec, algorithm=replace(
        spec.algorithm, settings=(("random_state", "4"),))))._rng.rng.uniform()


def test_stdout_default_filter_keeps_the_experiments_metrics() -> None:
    parser = MetricsParser(MetricsCollector(), ["loss", "accuracy"])
    got = parser.feed("epoch 1: loss=0.5 accuracy = 0.8 lr=0.1\nnoise=3\nloss=1e-3")
    assert got == [Observation("loss", 0.5), Observation("accuracy", 0.8)]
    assert parser.feed("\nloss=nan\n") == [Observation("loss", 0.001)]  # completed by the next chunk; nan dropped
    parser.feed("accuracy=0.9")
    assert parser.close() == [Observation("accuracy", 0.9)]  # a last line without its newline


def test_file_collector_custom_filter_and_json() -> None:
    spec = parse_experiment((EXAMPLES / "file-metrics-collector.yaml").read_text())
    parser = MetricsParser(spec.collector, ["accuracy", "loss"])
    line = "{metricName: accuracy, metricValue: 0.9712}"
    assert parser.feed(f"{line}\n{FILE_MARKER}{line}\n") == [Observation("accuracy", 0.9712)]  # marked lines only
    json_spec = parse_experiment((EXAMPLES / "file-metrics-collector-with-json-format.yaml").read_text())
    parser = MetricsParser(json_spec.collector, ["accuracy", "loss"])
    assert parser.feed(f'{FILE_MARKER}{{"accuracy": "0.6", "loss": 0.3, "epoch": 1}}\n{FILE_MARKER}not json\n') == [
        Observation("accuracy", 0.6), Observation("loss", 0.3)]


def test_push_sdk_lines_are_the_only_push_metrics() -> None:
    out = io.StringIO()
    report(loss=0.25, accuracy=0.5, stream=out)
    parser = MetricsParser(MetricsCollector(kind=CollectorKind.PUSH), ["loss", "accuracy"])
    assert parser.feed("loss=9\n" + out.getvalue()) == [Observation("loss", 0.25), Observation("accuracy", 0.5)]
    with pytest.raises(ValueError, match="finite"):
        report(loss=float("inf"))
    stdout = MetricsParser(MetricsCollector(), ["loss"])
    assert stdout.feed(out.getvalue()) == [], "StdOut does not read the SDK's lines twice"


def test_a_json_integer_past_a_floats_range_is_a_bad_line_not_a_crash() -> None:
    parser = MetricsParser(MetricsCollector(kind=CollectorKind.PUSH), ["loss"])
    lines = f'{PUSH_MARKER}{{"metrics": {{"loss": {"9" * 400}}}}}\n{PUSH_MARKER}{{"metrics": {{"loss": 0.5}}}}\n'
    assert parser.feed(lines) == [Observation("loss", 0.5)]


def test_trace_kind_reads_epochs_in_order_not_log_lines() -> None:
    parser = MetricsParser(MetricsCollector(kind=CollectorKind.TRACE), ["loss"])
    assert parser.feed("epoch 1: loss=0.5\n") == [], "Trace reads no metric from the log"
    seen: set[tuple[int, int]] = set()
    epochs = {(1, 0): {"loss": 0.2}, (0, 1): {"loss": 0.4, "accuracy": 0.9}, (0, 0): {"loss": 0.5, "x": "nan"}}
    assert epoch_observations(epochs.items(), ["loss", "accuracy"], seen) == [
        Observation("loss", 0.5), Observation("loss", 0.4), Observation("accuracy", 0.9), Observation("loss", 0.2)]
    epochs[(1, 1)] = {"loss": float("nan")}
    assert epoch_observations(epochs.items(), ["loss"], seen) == [], "seen epochs count once; nan is dropped"
    doc = yaml.safe_load((EXAMPLES / "random.yaml").read_text())
    doc["spec"]["metricsCollectorSpec"] = {"collector": {"kind": "Trace"}}
    assert parse_experiment(yaml.safe_dump(doc)).collector.kind is CollectorKind.TRACE
    doc["spec"]["metricsCollectorSpec"]["source"] = {"filter": {"metricsFormat": ["(\\w+)=(\\d+)"]}}
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(yaml.safe_dump(doc))
    assert [f for f, _ in caught.value.violations] == ["spec.metricsCollectorSpec.source.filter"]


def test_metric_strategies() -> None:
    assert [summarize([3.0, 1.0, 2.0], s) for s in ("min", "max", "latest")] == [1.0, 3.0, 2.0]
    spec = parse_experiment((EXAMPLES / "metrics-collection-strategy.yaml").read_text())
    assert spec.objective.strategy("accuracy") == "max" and spec.objective.strategy("loss") == "min"


def test_filetail_copies_the_file_into_the_log_and_keeps_the_exit_status(tmp_path: Path) -> None:
    metrics = tmp_path / "m.log"
    metrics.write_text("accuracy=0.1\n")  # an earlier run's line: not this run's
    program = (f"import time\nf = open({str(metrics)!r}, 'a')\n"
               "for i in range(3):\n    f.write(f'accuracy=0.{i + 5}\\n'); f.flush(); time.sleep(0.05)\n"
               "f.write('loss=0.7'); f.close()\nraise SystemExit(4)\n")
    done = subprocess.run([sys.executable, "-m", "opml_automl_controller.filetail", str(metrics), "--",
                           sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 4
    assert done.stdout.splitlines() == [f"{FILE_MARKER}accuracy=0.5", f"{FILE_MARKER}accuracy=0.6",
                                        f"{FILE_MARKER}accuracy=0.7", f"{FILE_MARKER}loss=0.7"]


def test_discrete_choices_reach_the_trial_as_listed() -> None:
    """Katib passes a discrete value through as listed: "32" is 32 for an int flag, never "32.0"."""
    from opml_automl_controller.experiment import parameter_text

    text = (EXAMPLES / "random.yaml").read_text()
    document = yaml.safe_load(text)
    document["spec"]["parameters"].append({"name": "batch", "parameterType": "discrete",
                                           "feasibleSpace": {"list": ["32", "64", "0.5", "1.0", 128]}})
    spec = parse_experiment(yaml.safe_dump(document))
    assert [parameter_text(c) for c in spec.parameter("batch").choices] == ["32", "64", "0.5", "1.0", "128"]
