"""Job specs: YAML -> JobSpec message -> the orchestrator's JobDefinition, and every error's field path."""

from __future__ import annotations

from pathlib import Path

import pytest
from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_job_orchestrator.convert import saved_job_from_proto, status_from_proto, status_to_proto
from opml_job_orchestrator.orchestrator import JobState, JobStatus
from opml_job_orchestrator.scheduler import JobClass, Resources
from opml_job_orchestrator.spec import definition_from_proto, definition_to_proto
from opml_job_orchestrator_contract.jobspec import load_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

FULL = """
name: mnist-be
class: be
priority: 3
max_retries: 1
command: [python, train.py]
roles:
  chief: {resources: {cpu: 2, memory: 1Gi}}
  worker: {replicas: 2, resources: {cpu: 500m, memory: 512, gpu: 1}}
  ps: {replicas: 1, resources: {cpu: 0.25, memory: 1G}, command: [python, ps.py]}
env: {EPOCHS: 3, MODE: fast}
checkpoint: {dir: /ckpt, interval_seconds: 60, restart_overhead_seconds: 5}
trace: true
heartbeat_timeout_seconds: 30
"""


def test_full_spec_becomes_the_scheduler_spec_and_program() -> None:
    definition = definition_from_proto(load_spec(FULL))
    spec, program = definition.spec, definition.program
    assert (spec.job_id, spec.job_class, spec.priority) == ("mnist-be", JobClass.BE, 3)
    assert spec.roles["chief"].replicas == 1 and spec.roles["chief"].resources == Resources(2000, 1024, 0)
    assert spec.roles["worker"].replicas == 2 and spec.roles["worker"].resources == Resources(500, 512, 1)
    assert spec.roles["ps"].resources == Resources(250, 954, 0)  # 1 GB rounded up to MiB
    assert (spec.checkpoint_interval_s, spec.restart_overhead_s) == (60.0, 5.0)
    assert program.commands == {"chief": ("python", "train.py"), "worker": ("python", "train.py"),
                                "ps": ("python", "ps.py")}
    assert dict(program.env) == {"EPOCHS": "3", "MODE": "fast"}
    assert (program.checkpoint_dir, program.heartbeat_timeout_s, program.trace) == ("/ckpt", 30.0, True)
    assert definition.max_retries == 1
    assert definition_from_proto(definition_to_proto(definition)) == definition  # lossless round trip


def test_defaults() -> None:
    definition = definition_from_proto(load_spec({"name": "a", "class": "TE", "command": ["true"],
                                                  "roles": {"worker": {"resources": {"cpu": 1}}}}))
    assert definition.max_retries is None and definition.spec.checkpoint_interval_s is None
    assert definition.program.checkpoint_dir is None and definition.program.heartbeat_timeout_s is None
    assert definition.spec.roles["worker"].replicas == 1


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(example: Path) -> None:
    assert definition_from_proto(load_spec(example.read_text())).spec.job_id == example.stem


@pytest.mark.parametrize("patch, field, rule", [
    ({"roles": {"worker": {"resources": {"gpu": -1}}}}, "roles.worker.resources.gpu", ">= 0"),
    ({"roles": {"worker": {"replicas": 0, "resources": {"cpu": 1}}}}, "roles.worker.replicas", ">= 1"),
    ({"roles": {"chief": {"replicas": 2, "resources": {"cpu": 1}}}}, "roles.chief.replicas", "must be 1"),
    ({"roles": {"learner": {"resources": {"cpu": 1}}}}, "roles.learner", "not one of"),
    ({"roles": {"worker": {}}}, "roles.worker.resources", "some CPU, memory or GPU"),
    ({"roles": {}}, "roles", "at least one"),
    ({"roles": {"worker": {"resources": {"cpu": "lots"}}}}, "roles.worker.resources.cpu", "millicores"),
    ({"roles": {"worker": {"resources": {"memory": "3 bananas"}}}}, "roles.worker.resources.memory", "unit"),
    ({"roles": {"worker": {"resources": {"cpu": 1}, "replica": 2}}}, "roles.worker.replica", "not a known key"),
    ({"command": "python train.py"}, "command", "list of strings"),
    ({"command": []}, "roles.worker.command", "set one of them"),
    ({"class": "urgent"}, "class", "TE or BE"),
    ({"class": None}, "job_class", "TE"),
    ({"name": "Bad Name"}, "name", "must match"),
    ({"max_retries": -1}, "max_retries", ">= 0"),
    ({"checkpoint": {"interval_seconds": -5}}, "checkpoint.interval_seconds", ">= 0"),
    ({"priority": 1.5}, "priority", "integer"),
    ({"trace": "yes"}, "trace", "true or false"),
    ({"colour": "red"}, "colour", "not a known key"),
])
def test_errors_name_the_field_path_and_rule(patch: dict, field: str, rule: str) -> None:
    doc = {"name": "job", "class": "TE", "command": ["true"], "roles": {"worker": {"resources": {"cpu": 1}}}}
    doc.update(patch)
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(InvalidArgument) as caught:
        definition_from_proto(load_spec(doc))
    assert caught.value.field == field, caught.value.message
    assert rule in caught.value.message


def test_bad_yaml_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="not valid YAML"):
        load_spec("name: [unclosed")
    with pytest.raises(InvalidArgument, match="mapping"):
        load_spec("- a list")


FOUR_MISTAKES = """\
name: Bad Name
class: urgent
command: [python, train.py]
roles:
  worker: {replicas: 0, resources: {cpu: 1, memory: 3 bananas}}
"""


def test_every_mistake_is_reported_at_once() -> None:
    """Shapes (class, memory) and rules (name, replicas) together, in one InvalidArgument."""
    with pytest.raises(InvalidArgument) as caught:
        load_spec(FOUR_MISTAKES)
    assert [field for field, _ in caught.value.violations] == [
        "class", "roles.worker.resources.memory", "name", "roles.worker.replicas"], caught.value.message
    rules = dict(caught.value.violations)
    assert "must match" in rules["name"] and "TE or BE" in rules["class"] and "unit" in rules[
        "roles.worker.resources.memory"] and ">= 1" in rules["roles.worker.replicas"]
    assert "job_class" not in rules  # the bad class is reported once, under the key as written


def test_every_rule_of_a_message_is_reported_at_once() -> None:
    spec = load_spec({"name": "ok", "class": "TE", "command": ["true"],
                      "roles": {"worker": {"resources": {"cpu": 1}}, "chief": {"replicas": 1}}})
    spec.name, spec.max_retries = "", -1
    spec.roles["worker"].resources.gpu = -2
    spec.checkpoint.interval_seconds = float("nan")
    with pytest.raises(InvalidArgument) as caught:
        definition_from_proto(spec)
    assert [field for field, _ in caught.value.violations] == [
        "name", "roles.chief.resources", "roles.worker.resources.gpu", "max_retries", "checkpoint.interval_seconds"]


def test_unknown_keys_and_wrong_shapes_are_all_named() -> None:
    with pytest.raises(InvalidArgument) as caught:
        load_spec({"name": "job", "class": "TE", "command": "python train.py", "colour": "red", "size": 3,
                   "roles": {"worker": {"resources": {"cpu": "lots"}, "replica": 2}}})
    assert [field for field, _ in caught.value.violations] == [
        "colour", "size", "command", "roles.worker.replica", "roles.worker.resources.cpu"], caught.value.message


def test_yaml_syntax_error_names_the_file_line_and_column() -> None:
    with pytest.raises(InvalidArgument) as caught:
        load_spec("name: job\nclass: TE\nroles:\n  worker: {resources: {cpu: 1}\n", what="jobs/bad.yaml")
    assert caught.value.field == "jobs/bad.yaml"
    assert "not valid YAML" in caught.value.message and "line 5, column 1" in caught.value.message, caught.value.message


def test_status_and_saved_job_round_trip() -> None:
    status = JobStatus("job", JobState.RETRYING, 2, 1, 1, "worker 0 exited with code 3", 1700000000.25,
                       1700000001.5, 1700000002.75, None, 42)
    assert status_from_proto(status_to_proto(status)) == status
    definition = definition_from_proto(load_spec(FULL))
    saved = saved_job_from_proto(pb.Job(spec=definition_to_proto(definition), status=status_to_proto(status)))
    assert (saved.definition, saved.status) == (definition, status)


def test_labels_are_kept_checked_and_round_trip() -> None:
    spec = load_spec({"name": "j", "class": "TE", "command": ["true"], "roles": {"worker": {"resources": {"cpu": 1}}},
                      "labels": {"opml.dev/experiment": "exp", "opml.dev/trial": 3}})
    assert dict(spec.labels) == {"opml.dev/experiment": "exp", "opml.dev/trial": "3"}
    definition = definition_from_proto(spec)
    assert dict(definition.labels) == dict(spec.labels)
    assert dict(definition_to_proto(definition).labels) == dict(spec.labels)
    spec.labels["Bad Key"] = "x"
    spec.labels["long"] = "v" * 64
    with pytest.raises(InvalidArgument) as caught:
        definition_from_proto(spec)
    assert [field for field, _ in caught.value.violations] == ["labels.Bad Key", "labels.long"]


def test_a_nul_byte_in_what_a_process_is_given_is_refused_with_its_field() -> None:
    """No OS can start a process with a NUL in its argv or environment; the value (maybe a secret) is not echoed."""
    spec = load_spec({"name": "nul", "class": "TE", "command": ["python", "a\0b"],
                      "roles": {"worker": {"resources": {"cpu": 1}}, "ps": {"resources": {"cpu": 1},
                                                                             "command": ["x\0"]}},
                      "env": {"TOKEN": "s3cr3t\0"}, "checkpoint": {"dir": "/ck\0pt"}})
    with pytest.raises(InvalidArgument) as caught:
        definition_from_proto(spec)
    assert [field for field, _ in caught.value.violations] == [
        "env.TOKEN", "checkpoint.dir", "command", "roles.ps.command"]
    assert all("NUL" in rule for _, rule in caught.value.violations)
    assert "s3cr3t" not in caught.value.message
    with pytest.raises(InvalidArgument, match="command: must not contain a NUL"):  # said with the YAML's mistakes
        load_spec({"name": "nul", "class": "TE", "command": ["a\0"], "roles": {"worker": {"resources": {"cpu": 1}}},
                   "priority": "high"})
