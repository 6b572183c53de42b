"""deploy/compose/kafka-init.sh grants each service what its code reads and writes, and nothing more.

With ``allow.everyone.if.no.acl.found=false`` a missing grant is a service refused at run time (a
consumer that never gets its events), and an extra one a service that may write what it does not own.
The script runs here with stand-ins for the Kafka CLI that record each ACL it adds; the grants expected
come from the code: each service's ``SPEC.topics``, split into what it consumes (its own ``topics``
module) and what it publishes (the rest: its contract's), and the consumer group of each consumer.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
from collections import defaultdict
from pathlib import Path

from opml_common.topics import Topic
from opml_devstack.stack import installed_services

ROOT = Path(__file__).resolve().parents[2]
KAFKA_INIT = ROOT / "deploy" / "compose" / "kafka-init.sh"

Grants = dict[tuple[str, str, str, str], frozenset[str]]  # (principal, topic|group, name, pattern) -> operations


def _faust_app() -> str:
    """The monitoring-scorer's faust app id: its consumer group and the prefix of its changelog topics."""
    from opml_monitoring_scorer.stream import ScoringStream

    return inspect.signature(ScoringStream.__init__).parameters["app_id"].default


def _consumer_groups() -> dict[str, list[tuple[str, str]]]:
    """Each consuming service's consumer groups as (name, pattern), from the constants its consumers use."""
    from opml_automl_controller.tracing import GROUP as AUTOML_TRACES
    from opml_inference_router.control.autodeploy import GROUP as AUTODEPLOY
    from opml_inference_router.control.quality import GROUP as ROLLOUT_QUALITY
    from opml_job_orchestrator.pipelines.triggers import ALERTS_GROUP, SPANS_GROUP
    from opml_monitoring_scorer.deployments import GROUP as SCORER_DEPLOYMENTS
    from opml_trace_collector.settings import TraceCollectorSettings

    collector = TraceCollectorSettings.model_fields["consumer_group"].default
    return {"automl-controller": [(AUTOML_TRACES, "literal")],
            "inference-router": [(AUTODEPLOY, "literal"), (ROLLOUT_QUALITY, "literal")],
            "job-orchestrator": [(SPANS_GROUP, "literal"), (ALERTS_GROUP, "literal")],
            "monitoring-scorer": [(SCORER_DEPLOYMENTS, "literal"), (_faust_app(), "literal")],
            "trace-collector": [(f"{collector}.", "prefixed")]}  # {group}.{generation}


def _expected() -> Grants:
    from opml_monitoring_scorer_contract.topics import LABELS
    from opml_trace_collector_contract.topics import TRACES

    grants: Grants = {}

    def add(principal: str, kind: str, name: str, *operations: str, pattern: str = "literal") -> None:
        key = (principal, kind, name, pattern)
        grants[key] = grants.get(key, frozenset()) | frozenset(operations)

    groups = _consumer_groups()
    for spec in installed_services():
        try:
            module = importlib.import_module(f"{spec.module}.topics")
            consumed = {value for value in vars(module).values() if isinstance(value, Topic)}
        except ModuleNotFoundError:
            consumed = set()
        if spec.name == "trace-collector":  # its contract's topic is written by the tracers in jobs
            consumed.add(TRACES)
        for topic in spec.topics:
            if topic in consumed:
                add(spec.name, "topic", topic.name, "Read", "Describe", "Create")
                add(spec.name, "topic", topic.dead_letter(), "Write", "Describe", "Create")
            else:
                add(spec.name, "topic", topic.name, "Write", "Describe", "Create")
                add(spec.name, "topic", topic.dead_letter(), "Describe", "Create")
        for group, pattern in groups.get(spec.name, []):
            add(spec.name, "group", group, "Read", "Describe", pattern=pattern)
    add("tracer", "topic", TRACES.name, "Write", "Describe")
    add("monitoring-scorer", "topic", f"{_faust_app()}-", "All", pattern="prefixed")  # its changelog topics
    add("monitoring-scorer", "topic", LABELS.name, "Write")  # the labels users send through SubmitLabels
    return grants


def _granted(tmp_path: Path) -> Grants:
    """The ACLs kafka-init.sh adds, recorded by stand-ins for the Kafka CLI it calls."""
    log = tmp_path / "acls.log"
    for tool, body in {"kafka-broker-api-versions.sh": "exit 0",
                       "kafka-configs.sh": "exit 0",
                       "kafka-acls.sh": 'printf "%q " "$@" >> "$ACL_LOG"; echo >> "$ACL_LOG"'}.items():
        (tmp_path / tool).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (tmp_path / tool).chmod(0o755)
    passwords = set(re.findall(r"\b(KAFKA_\w+_PASSWORD)\b", KAFKA_INIT.read_text()))
    env = {**os.environ, "KAFKA_BIN": str(tmp_path), "ACL_LOG": str(log), **dict.fromkeys(passwords, "test")}
    subprocess.run(["bash", str(KAFKA_INIT)], env=env, check=True, capture_output=True, timeout=60)
    grants: dict[tuple[str, str, str, str], set[str]] = defaultdict(set)
    for line in log.read_text().splitlines():
        words = shlex.split(line)
        principal = words[words.index("--allow-principal") + 1].removeprefix("User:")
        kind = "topic" if "--topic" in words else "group"
        name = words[words.index(f"--{kind}") + 1]
        pattern = words[words.index("--resource-pattern-type") + 1] if "--resource-pattern-type" in words else "literal"
        grants[(principal, kind, name, pattern)] |= {words[i + 1] for i, w in enumerate(words) if w == "--operation"}
    return {key: frozenset(operations) for key, operations in grants.items()}


def _named(grants: Grants) -> list[str]:
    return [f"{principal} {'+'.join(sorted(ops))} on {kind} {name}{' (prefixed)' if pattern == 'prefixed' else ''}"
            for (principal, kind, name, pattern), ops in sorted(grants.items())]


def test_kafka_init_grants_each_service_exactly_what_its_code_reads_and_writes(tmp_path) -> None:
    expected, granted = _expected(), _granted(tmp_path)
    missing = {key: ops - granted.get(key, frozenset()) for key, ops in expected.items()}
    extra = {key: ops - expected.get(key, frozenset()) for key, ops in granted.items()}
    missing, extra = {k: v for k, v in missing.items() if v}, {k: v for k, v in extra.items() if v}
    assert not missing and not extra, f"kafka-init.sh lacks {_named(missing)} and grants beyond the code {_named(extra)}"


def test_every_consumer_group_of_the_code_is_checked() -> None:
    """A service that consumes (has a topics module) without a group here would be checked for no group."""
    consuming = {spec.name for spec in installed_services()
                 if importlib.util.find_spec(f"{spec.module}.topics") is not None} | {"trace-collector"}
    assert consuming == set(_consumer_groups())
