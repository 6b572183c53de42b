"""Every Katib v1beta1 example (katib_examples/: the 33 of the Katib repository) parses, and is
accepted or rejected exactly as written here, each expectation derived from ../shared/katib/RULES.md.

A rejection lists every (YAML path, rule keyword) the experiment breaks, no more and no less.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from opml_automl_controller.experiment import CollectorKind
from opml_automl_controller.katib import check_experiment, parse_experiment
from opml_automl_controller.template import build_trial_job
from opml_common.errors import InvalidArgument

EXAMPLES = Path(__file__).parent / "katib_examples"
KIND = "spec.trialTemplate.trialSpec.kind"
ALGO = "spec.algorithm.algorithmName"
COLLECTOR = "spec.metricsCollectorSpec.collector.kind"

# Accepted: file -> (algorithm, collector kind, roles of the trial's job).
ACCEPTED = {
    "bayesian-optimization.yaml": ("bayesianoptimization", "StdOut", {"worker": 1}),
    "cma-es.yaml": ("cmaes", "StdOut", {"worker": 1}),
    "file-metrics-collector-with-json-format.yaml": ("random", "File", {"worker": 1}),
    "file-metrics-collector.yaml": ("random", "File", {"worker": 1}),
    # FromVolume: our sampler state is always in Redis, so it resumes as LongRunning does.
    "from-volume-resume.yaml": ("random", "StdOut", {"worker": 1}),
    "grid.yaml": ("grid", "StdOut", {"worker": 1}),
    "hyperband.yaml": ("hyperband", "StdOut", {"worker": 1}),
    "long-running-resume.yaml": ("random", "StdOut", {"worker": 1}),
    "median-stop-with-json-format.yaml": ("random", "File", {"worker": 1}),
    "median-stop.yaml": ("random", "StdOut", {"worker": 1}),
    "metrics-collection-strategy.yaml": ("tpe", "StdOut", {"worker": 1}),
    "multivariate-tpe.yaml": ("multivariate-tpe", "StdOut", {"worker": 1}),
    "optuna-distribution.yaml": ("tpe", "StdOut", {"worker": 1}),
    "random.yaml": ("random", "StdOut", {"worker": 1}),
    "sobol.yaml": ("sobol", "StdOut", {"worker": 1}),
    "tpe.yaml": ("tpe", "StdOut", {"worker": 1}),
    "trial-metadata-substitution.yaml": ("random", "StdOut", {"worker": 1}),
    "xgboost-example.yaml": ("random", "StdOut", {"worker": 1}),
}

# Rejected: file -> every (path, keyword of the rule) expected.
REJECTED = {
    "argo-workflow.yaml": [(KIND, "argoproj.io/v1alpha1 Workflow is not supported")],
    "custom-metrics-collector.yaml": [(COLLECTOR, "Custom is not supported")],
    "darts-cpu.yaml": [(ALGO, "'darts' is not supported")],
    "darts-gpu.yaml": [(ALGO, "'darts' is not supported")],
    "enas-cpu.yaml": [(ALGO, "'enas' is not supported")],
    "enas-gpu.yaml": [(ALGO, "'enas' is not supported")],
    # Katib's Optuna service refuses normal/logNormal (#2666); so does this controller.
    "hyperopt-distribution.yaml": [("spec.parameters[0].feasibleSpace.distribution", "normal is not supported"),
                                   ("spec.parameters[3].feasibleSpace.distribution", "logNormal is not supported")],
    "mpijob-horovod.yaml": [(KIND, "MPIJob is not supported")],
    # The upstream example never uses ${trialParameters.learningRate} (rule 26), besides its kind.
    "pipeline-run.yaml": [(KIND, "PipelineRun is not supported"),
                          ("spec.trialTemplate.trialSpec", "parameter learningRate in spec.trialTemplate")],
    "pytorchjob-mnist.yaml": [(KIND, "PyTorchJob is not supported")],
    # Rule 5 (maxFailedTrialCount 3 > maxTrialCount 2): Katib's own webhook rejects its example too.
    "simple-pbt.yaml": [("spec.maxFailedTrialCount", "must not exceed spec.maxTrialCount (got 3 > 2)"),
                        (ALGO, "'pbt' is not supported")],
    "tfjob-mnist-with-summaries.yaml": [(COLLECTOR, "TensorFlowEvent is not supported")],
    "trainjob-pytorch.yaml": [(KIND, "TrainJob is not supported")],
    "trial-configmap-source.yaml": [("spec.trialTemplate.configMap", "unable to parse spec.trialTemplate")],
    "xgboostjob-lightgbm.yaml": [(KIND, "XGBoostJob is not supported")],
}


def test_the_expectations_cover_all_33_examples() -> None:
    files = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert len(files) == 33
    assert sorted([*ACCEPTED, *REJECTED]) == files


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_example_maps_to_a_te_job(name: str) -> None:
    spec = parse_experiment((EXAMPLES / name).read_text(), what=name)
    algorithm, collector, roles = ACCEPTED[name]
    assert spec.algorithm.name == algorithm
    assert spec.collector.kind is CollectorKind(collector)
    values = {p.name: str(p.low if p.low is not None else p.choices[0]) for p in spec.parameters}
    job = build_trial_job(spec.trial_template, values, trial_name=f"{spec.name}-t0", namespace=spec.namespace)
    assert {role: body.replicas for role, body in job.spec.roles.items()} == roles
    argv = " ".join(job.spec.roles["worker"].command)
    assert "${trialParameters" not in argv and "${trialParameters" not in str(dict(job.spec.env))
    assert any("image" in note for note in job.notes), "the image is reported as ignored locally"


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_rejected_example_names_every_broken_rule(name: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment((EXAMPLES / name).read_text(), what=name)
    got = list(caught.value.violations)
    expected = REJECTED[name]
    assert len(got) == len(expected), got
    for (path, keyword), (got_path, rule) in zip(expected, got, strict=True):
        assert got_path == path and keyword in rule, (got_path, rule)
    if any(path == ALGO for path, _ in expected):
        assert "supported: random, grid, tpe, multivariate-tpe, cmaes, sobol, bayesianoptimization, hyperband" in \
            caught.value.message
    if any(path == KIND for path, _ in expected):
        assert "supported kinds: batch/v1 Job, kubeflow.org/v1 TFJob, jobs.opml.dev/v1 OpmlJob" in caught.value.message


def _random() -> dict:
    return yaml.safe_load((EXAMPLES / "random.yaml").read_text())


def _changed(change) -> dict:
    doc = copy.deepcopy(_random())
    change(doc["spec"])
    return doc


def _set(path: list, value):
    def change(spec: dict) -> None:
        node = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


def _dup_trial_parameter(spec: dict) -> None:
    spec["trialTemplate"]["trialParameters"][1]["name"] = "learningRate"
    command = spec["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]["command"]
    command[-1] = "--momentum=${trialParameters.learningRate}"


def _undeclared(spec: dict) -> None:
    spec["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]["command"].append(
        "--batch-size=${trialParameters.batchSize}")


def _int_missing_max(spec: dict) -> None:
    spec["parameters"][0] = {"name": "lr", "parameterType": "int", "feasibleSpace": {"min": "1"}}


def _duplicate_cmaes(spec: dict) -> None:
    spec["algorithm"] = {"algorithmName": "cmaes"}
    spec["parameters"][1]["name"] = "lr"
    del spec["trialTemplate"]["trialParameters"][1]
    spec["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]["command"].pop()


# RULES.md's invalid/ table: random.yaml with one change, one violation each (the rule's path and keyword).
INVALID = {
    "01-unknown-algorithm": (_set(["algorithm", "algorithmName"], "simulated-annealing"),
                             ALGO, "unable to get Suggestion config data for algorithm 'simulated-annealing'"),
    "02-missing-objective-metric-name": (_set(["objective", "objectiveMetricName"], ""),
                                         "spec.objective.objectiveMetricName", "is required"),
    "03-parallel-gt-max-trials": (_set(["parallelTrialCount"], 20), "spec.parallelTrialCount",
                                  "must not exceed spec.maxTrialCount (got 20 > 12)"),
    "04-max-failed-gt-max-trials": (_set(["maxFailedTrialCount"], 13), "spec.maxFailedTrialCount",
                                    "must not exceed spec.maxTrialCount (got 13 > 12)"),
    "05-trialparameter-reference-not-in-parameters": (
        _set(["trialTemplate", "trialParameters", 0, "reference"], "learning_rate"),
        "spec.trialTemplate.trialParameters[0].reference", "'learning_rate' is not a parameter"),
    "06-duplicate-trialparameter-name": (_dup_trial_parameter, "spec.trialTemplate.trialParameters[1].name",
                                         "duplicate trialParameter name 'learningRate'"),
    "07-template-placeholder-undeclared": (_undeclared, "spec.trialTemplate.trialSpec.spec.template.spec."
                                                        "containers[0].command[6]",
                                           "undeclared placeholder ${trialParameters.batchSize}"),
    "08-unsupported-parameter-type": (_set(["parameters", 0, "parameterType"], "float"),
                                      "spec.parameters[0].parameterType", "parameterType 'float' is not supported"),
    "09-int-parameter-missing-max": (_int_missing_max, "spec.parameters[0].feasibleSpace.max",
                                     "is required for parameterType int"),
    "10-duplicate-parameter-name-cmaes": (_duplicate_cmaes, "spec.parameters[1].name",
                                          "Detect duplicated parameter name 'lr'"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_each_katib_rule_is_named_with_its_path(case: str) -> None:
    change, path, keyword = INVALID[case]
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(_changed(change))
    assert len(caught.value.violations) == 1, caught.value.violations
    ((got_path, rule),) = caught.value.violations
    assert got_path == path and keyword in rule, (got_path, rule)


def test_every_violation_at_once() -> None:
    def many(spec: dict) -> None:
        spec["parallelTrialCount"] = 5
        spec["maxTrialCount"] = 3
        spec["maxFailedTrialCount"] = -1
        spec["algorithm"]["algorithmSettings"] = [{"name": "gamma", "value": "0.5"}]
        spec["parameters"][1]["feasibleSpace"]["min"] = "2"
        spec["earlyStopping"] = {"algorithmName": "medianstop", "algorithmSettings": [{"name": "warmup", "value": "1"}]}
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(_changed(many))
    assert dict(caught.value.violations) == {
        "spec.maxFailedTrialCount": "must be >= 0 (got -1)",
        "spec.parallelTrialCount": "must not exceed spec.maxTrialCount (got 5 > 3)",
        "spec.algorithm.algorithmSettings[0].name": "unknown setting 'gamma' for algorithm random; known: "
                                                    "['random_state']",
        "spec.earlyStopping.algorithmSettings[0].name": "unknown setting 'warmup' for algorithm medianstop; known: "
                                                        "['min_trials_required', 'start_step']",
        "spec.parameters[1].feasibleSpace": "min must not exceed max (got 2 > 0.9)",
    }
    assert caught.value.message.startswith("spec.maxFailedTrialCount: must be >= 0 (got -1); ")


def test_an_invalid_objective_does_not_hide_the_other_mistakes() -> None:
    def three(spec: dict) -> None:
        spec["objective"]["type"] = "minimise"
        spec["parameters"][0]["feasibleSpace"] = {"min": "0.5", "max": "0.1"}
        spec["parallelTrialCount"] = 0
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(_changed(three))
    assert dict(caught.value.violations) == {
        "spec.objective.type": "must be minimize or maximize, but got 'minimise'",
        "spec.parameters[0].feasibleSpace": "min must not exceed max (got 0.5 > 0.1)",
        "spec.parallelTrialCount": "must be greater than 0 (got 0)",
    }


def test_an_unknown_field_is_a_warning_with_the_nearest_name() -> None:
    def misspelt(spec: dict) -> None:
        spec["paralelTrialCount"] = 5
        spec["parameters"][0]["feasibleSpace"]["maximum"] = "0.9"
    checked = check_experiment(_changed(misspelt))
    assert checked.warnings == (
        "spec.parameters[0].feasibleSpace.maximum: unknown field, ignored (did you mean max?)",
        "spec.paralelTrialCount: unknown field, ignored (did you mean parallelTrialCount?)",
    )
    assert checked.spec.parallel_trial_count == 3  # Katib's CRD keeps and ignores it: the default applies


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_the_upstream_examples_have_no_unknown_field(name: str) -> None:
    assert check_experiment((EXAMPLES / name).read_text()).warnings == ()


_COMMAND = "spec.trialTemplate.trialSpec.spec.template.spec.containers[0].command[6]"


@pytest.mark.parametrize(("placeholder", "rule"), [
    ("${trialParameters.batchSize}", "undeclared placeholder ${trialParameters.batchSize}"),
    ("${trialParameter.momentum}", "unresolved placeholder ${trialParameter.momentum}"),
    ("${momentum}", "unresolved placeholder ${momentum}"),
    ("${trialParameters.momentum", "unclosed placeholder '${trialParameters.momentum'"),
])
def test_a_placeholder_left_unresolved_is_refused_with_its_field(placeholder: str, rule: str) -> None:
    def add(spec: dict) -> None:
        spec["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]["command"].append(
            f"--x={placeholder}")
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(_changed(add))
    ((path, message),) = caught.value.violations
    assert path == _COMMAND and message.startswith(rule), (path, message)


def test_a_shell_variable_in_a_trial_command_is_left_alone() -> None:
    def add(spec: dict) -> None:
        spec["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]["command"].append(
            "--home=${HOME}")
    parse_experiment(_changed(add))


def test_katib_defaults_apply() -> None:
    def strip(spec: dict) -> None:
        del spec["parallelTrialCount"], spec["maxFailedTrialCount"]
    spec = parse_experiment(_changed(strip))
    assert spec.parallel_trial_count == 3
    assert spec.max_failed_trial_count is None
    assert spec.resume_policy.value == "Never"
    assert spec.collector.kind is CollectorKind.STDOUT and spec.collector.filters == ()
    assert all(p.distribution.value == "uniform" for p in spec.parameters)
    assert spec.objective.strategy("loss") == "min"


def test_a_yaml_syntax_error_names_the_file_line_and_column() -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment("spec:\n  objective: [unclosed\n", what="exp.yaml")
    assert caught.value.field == "exp.yaml" and "line" in caught.value.message


def test_an_oversized_document_is_refused_before_parsing() -> None:
    with pytest.raises(InvalidArgument, match="at most"):
        parse_experiment("a: " + "x" * 300_000)


def test_metadata_substitution_fills_trial_spec_references() -> None:
    spec = parse_experiment((EXAMPLES / "trial-metadata-substitution.yaml").read_text())
    job = build_trial_job(spec.trial_template, {"lr": "0.02", "momentum": "0.6"}, trial_name="exp-t3",
                          namespace="kubeflow")
    assert dict(job.spec.env) == {
        "TRIAL_NAME": "exp-t3", "TRIAL_NAMESPACE": "kubeflow", "TRIAL_KIND": "Job", "TRIAL_API_VERSION": "batch/v1",
        "TRIAL_LABEL_CUSTOM": "custom-label", "TRIAL_ANNOTATION_CUSTOM": "custom-annotation"}
    assert list(job.spec.roles["worker"].command)[-2:] == ["--lr=0.02", "--momentum=0.6"]


def test_tfjob_replicas_become_roles() -> None:
    doc = yaml.safe_load((EXAMPLES / "tfjob-mnist-with-summaries.yaml").read_text())
    del doc["spec"]["metricsCollectorSpec"]  # TensorFlowEvent is refused; the template itself maps
    replicas = doc["spec"]["trialTemplate"]["trialSpec"]["spec"]["tfReplicaSpecs"]
    replicas["PS"] = copy.deepcopy(replicas["Worker"]) | {"replicas": 1}
    replicas["Chief"] = copy.deepcopy(replicas["Worker"]) | {"replicas": 1}
    spec = parse_experiment(doc)
    job = build_trial_job(spec.trial_template, {"learning_rate": "0.03", "batch_size": "40"}, trial_name="t",
                          namespace="kubeflow")
    assert {r: b.replicas for r, b in job.spec.roles.items()} == {"worker": 2, "ps": 1, "chief": 1}
    assert "--learning-rate=0.03" in job.spec.roles["chief"].command


def test_the_platforms_own_job_spec_is_a_trial_template() -> None:
    doc = _random()
    doc["spec"]["trialTemplate"]["trialSpec"] = {
        "apiVersion": "jobs.opml.dev/v1", "kind": "OpmlJob",
        "spec": {"command": ["python", "train.py", "--lr=${trialParameters.learningRate}",
                             "--m=${trialParameters.momentum}"],
                 "roles": {"worker": {"replicas": 1, "resources": {"cpu": "500m", "memory": "256Mi"}}}}}
    spec = parse_experiment(doc)
    job = build_trial_job(spec.trial_template, {"lr": "0.01", "momentum": "0.5"}, trial_name="t", namespace="k")
    assert list(job.spec.command) == ["python", "train.py", "--lr=0.01", "--m=0.5"]
    assert job.spec.roles["worker"].resources.cpu_millis == 500 and job.notes == ()


def test_a_template_naming_the_trials_model_or_checkpoint_folder_is_refused_at_admission() -> None:
    """Both are the trial's own folder, which the controller names and the orchestrator makes for the
    trial's job, and AUTOML_* and secret_env say where and with what grant a trial uploads its model:
    every such field is named at once; a checkpoint interval stays the template's."""
    doc = _random()
    doc["spec"]["trialTemplate"]["trialSpec"] = {
        "apiVersion": "jobs.opml.dev/v1", "kind": "OpmlJob",
        "spec": {"command": ["python", "train.py", "--lr=${trialParameters.learningRate}",
                             "--m=${trialParameters.momentum}"],
                 "env": {"AUTOML_MODEL_DIR": "/tmp/mine", "AUTOML_MODEL_GRANT": "mine"},
                 "secret_env": {"TOKEN": "mine"},
                 "checkpoint": {"dir": "/tmp/ckpt", "interval_seconds": 30},
                 "roles": {"worker": {"replicas": 1}}}}
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(doc)
    assert [path for path, _ in caught.value.violations] == ["spec.trialTemplate.trialSpec.spec.checkpoint.dir",
                                                             "spec.trialTemplate.trialSpec.env.AUTOML_MODEL_DIR",
                                                             "spec.trialTemplate.trialSpec.env.AUTOML_MODEL_GRANT",
                                                             "spec.trialTemplate.trialSpec.spec.secret_env"]
    assert "each trial's own model folder ($AUTOML_MODEL_DIR)" in caught.value.violations[0][1]
    del doc["spec"]["trialTemplate"]["trialSpec"]["spec"]["checkpoint"]["dir"]
    del doc["spec"]["trialTemplate"]["trialSpec"]["spec"]["env"]
    del doc["spec"]["trialTemplate"]["trialSpec"]["spec"]["secret_env"]
    spec = parse_experiment(doc)
    job = build_trial_job(spec.trial_template, {"lr": "0.01", "momentum": "0.5"}, trial_name="t", namespace="k")
    assert job.spec.checkpoint.interval_seconds == 30 and job.spec.checkpoint.dir == ""


def test_a_job_env_overriding_the_platform_is_refused_at_admission() -> None:
    def env(spec: dict) -> None:
        spec["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]["env"] = [
            {"name": "LD_PRELOAD", "value": "/evil.so"}]
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(_changed(env))
    assert caught.value.violations[0][0] == "spec.trialTemplate.trialSpec.env.LD_PRELOAD"


@pytest.mark.parametrize("name", ["a/b", "a.b_c:d*", "aB", "exp\n", "exp-"])
def test_an_experiment_name_must_match_katibs_pattern_whole(name: str) -> None:
    """A name the pattern matches only a prefix of could not be got, stopped or deleted, and a '*' in it
    would match other experiments' keys in the store's SCAN."""
    doc = _random()
    doc["metadata"]["name"] = name
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(doc)
    ((path, rule),) = caught.value.violations
    assert path == "metadata.name" and repr(name) in rule, rule


def _grid(*spaces: dict) -> dict:
    doc = yaml.safe_load((EXAMPLES / "grid.yaml").read_text())
    for parameter, space in zip(doc["spec"]["parameters"], spaces, strict=True):
        parameter["feasibleSpace"].update(space)
    return doc


# grid.yaml with its two parameters' feasibleSpaces changed: the one violation expected (path, keyword).
GRID_CASES = {
    # counted, not listed (1e9 values of one parameter were listed in the event loop until memory ran out)
    "one-parameter": (({"min": "0", "max": "1000000", "step": "1"}, {}), "spec.parameters[0].feasibleSpace",
                      "grid over lr (1e+06 values) makes more than 10000 combinations"),
    "product": (({"min": "0", "max": "1", "step": "0.005"}, {"min": "0", "max": "1", "step": "0.005"}),
                "spec.parameters[1].feasibleSpace",
                "grid over momentum (201 values) makes more than 10000 combinations"),
    "tiny-step": (({"step": "1e-320"}, {}), "spec.parameters[0].feasibleSpace", "grid over lr (inf values)"),
    "zero-step": (({"step": "0"}, {}), "spec.parameters[0].feasibleSpace.step", "must be > 0"),
}


@pytest.mark.parametrize("case", sorted(GRID_CASES))
def test_a_grid_is_counted_and_refused_past_its_cap_before_it_is_listed(case: str) -> None:
    spaces, path, keyword = GRID_CASES[case]
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(_grid(*spaces))
    ((got_path, rule),) = caught.value.violations
    assert got_path == path and keyword in rule, (got_path, rule)


def _example(name: str, change) -> dict:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    change(doc["spec"])
    return doc


def _tfjob(change) -> dict:
    def both(spec: dict) -> None:
        del spec["metricsCollectorSpec"]  # TensorFlowEvent is refused; the template is what is checked
        change(spec["trialTemplate"]["trialSpec"]["spec"]["tfReplicaSpecs"]["Worker"])
    return _example("tfjob-mnist-with-summaries.yaml", both)


WORKER = "spec.trialTemplate.trialSpec.spec.tfReplicaSpecs.Worker"
# Values past what a field can hold: one violation each (path, keyword), never an INTERNAL error.
OUT_OF_RANGE = {
    "hyperband-r_l": (lambda: _example("hyperband.yaml", _set(["algorithm", "algorithmSettings", 2, "value"],
                                                              "9" * 400)),
                      "spec.algorithm.algorithmSettings[2].value", "r_l must fit in 64 bits"),
    "tpe-prior_weight": (lambda: _example("tpe.yaml", lambda spec: spec["algorithm"].update(
        algorithmSettings=[{"name": "prior_weight", "value": "1e400"}])),
                         "spec.algorithm.algorithmSettings[0].value", "prior_weight must be finite"),
    "tfjob-replicas": (lambda: _tfjob(lambda worker: worker.update(replicas=10_000_000_000)),
                       f"{WORKER}.replicas", "must be an integer from 1 to 2147483647"),
    "tfjob-resources": (lambda: _tfjob(lambda worker: worker["template"]["spec"]["containers"][0].update(
        resources={"limits": [1]})), f"{WORKER}.template.spec.containers[0].resources.limits", "must be a mapping"),
    "tfjob-gpu": (lambda: _tfjob(lambda worker: worker["template"]["spec"]["containers"][0].update(
        resources={"limits": {"nvidia.com/gpu": float("inf")}})),
                  f"{WORKER}.template.spec.containers[0].resources.nvidia.com/gpu", "must be a Kubernetes quantity"),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_a_value_past_its_fields_range_is_a_violation_with_its_path(case: str) -> None:
    make, path, keyword = OUT_OF_RANGE[case]
    with pytest.raises(InvalidArgument) as caught:
        parse_experiment(make())
    ((got_path, rule),) = caught.value.violations
    assert got_path == path and keyword in rule, (got_path, rule)
